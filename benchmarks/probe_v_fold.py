"""Probe: ``QuantConfig(smoothing_into_v=True)`` against ``False``, on the reference ViT and LM and MiniLM, and
which of the two the default (``"auto"``) picks.

With ``input_smoothing`` at every input (what ``"auto"`` keeps for the reference ViT and LM), the output
projection's input (the attention output P.V) is multiplied by a per-channel ``1/s``; the ONNX export folds
it into the row core's final division as a per-(head, channel) constant, one full-size Mul per layer.  P.V is
linear in V channel by channel, so the same ``1/s`` can scale V instead: the rows (and bias) of the Linear
that produces V (v_proj; GPT-2's c_attn: its V third), whose per-output-channel weight codes do not change,
and V's quantizer then sees V/s (``softq.quant.v_fold.fold_smoothing_into_v``; V's range observed again
over the calibration batches).  This probe quantizes with and without it, exports both with ``to_onnx``
and compares, for
bench_export_speed.py's reference ViT and LM and all-MiniLM-L6-v2: the distance of the ONNX outputs to
FP32's, the task metric (MiniLM: the sentence embeddings' mean cosine to FP32's),
and the latency ratio to FP32 (one thread, batches 1 and 32, runs interleaved with onnxruntime's
``quantize_dynamic`` file).  The default, ``"auto"``, keeps the fold where the quantized model's outputs on
held-out calibration batches are no further from the float model's with it than without (both after the
weight bias correction); each section says what it picked and the two errors it compared.

    python benchmarks/probe_v_fold.py   # writes docs/results/v_fold_probe.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_export_speed import Bench  # noqa: E402
from benchutil import (command_line, cpu_description, latency_cells, mean_cosine_distance,  # noqa: E402
                       one_thread_latency, write_atomic)

import softq  # noqa: E402
from softq.export.model_export import to_onnx, to_onnx_float  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def probe(name: str, rounds: int, rounds_large: int, work: Path) -> list[str]:
    bench = Bench(name, argparse.Namespace(calib_batches=4))
    default = softq.quantize(bench.model, bench.calib, softq.QuantConfig())  # smoothing_into_v="auto"
    qmodel = softq.quantize(bench.model, bench.calib, softq.QuantConfig(smoothing_into_v=False))
    folded = softq.quantize(bench.model, bench.calib, softq.QuantConfig(smoothing_into_v=True))
    count = folded.softq_smoothing_into_v
    chose = "True" if default.softq_smoothing_into_v else "False"
    errors = default.softq_v_fold_errors
    pool = {} if bench.pooling is None else {"pooling": bench.pooling[0], "normalize": bench.pooling[1]}
    paths = {"FP32": Path(to_onnx_float(bench.model, work / f"{name}_fp32.onnx", bench.example(), **pool))}
    keys = {v: f"softq INT8, smoothing_into_v={v}" + (" (auto's choice: the default)" if v == chose else "")
            for v in ("False", "True")}
    paths[keys["False"]] = Path(to_onnx(qmodel, work / f"{name}_plain.onnx", bench.example(), **pool))
    paths[keys["True"]] = Path(to_onnx(folded, work / f"{name}_vfold.onnx", bench.example(), **pool))
    ref = None if name in ("lm", "vit") else bench.reference(bench.model)
    from onnxruntime.quantization import QuantType, quantize_dynamic

    paths["ORT quantize_dynamic"] = work / f"{name}_dynamic.onnx"
    quantize_dynamic(str(paths["FP32"]), str(paths["ORT quantize_dynamic"]), per_channel=True,
                     weight_type=QuantType.QInt8)
    fp32 = bench.output_rows(paths["FP32"])
    lat = one_thread_latency(paths, bench.latency_feeds, rounds, rounds_large)
    judged = ("" if errors is None else f"; auto: held-out calibration error {errors[1]:.3g} folded against "
              f"{errors[0]:.3g} unfolded")
    lines = [f"## {name} (smoothing_into_v=True folds {count} attention layers; input smoothing: alpha "
             f"{qmodel.softq_input_smoothing}, "
             f"{'LayerNorm-folded inputs only' if qmodel.softq_smoothing_folded_only else 'every input'}{judged})", "",
             "| file | accuracy (ONNX) | distance to FP32 | 1 thr, batch 1 | 1 thr, batch 32 |", "|---|---|---|---|---|"]
    for k, p in paths.items():
        lines.append(f"| {k} | {bench.accuracy(p, ref):.4f} | {mean_cosine_distance(bench.output_rows(p), fp32):.2e} | "
                     f"{' | '.join(latency_cells(lat, k))} |")
    return lines + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="vit,lm,minilm", help="comma list of vit, lm, minilm")
    parser.add_argument("--rounds", type=int, default=31, help="timed rounds at batch 1")
    parser.add_argument("--rounds-large", type=int, default=9, help="timed rounds at batch 32")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "v_fold_probe.md")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - {"vit", "lm", "minilm"}
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}; choose from vit, lm, minilm")
    torch.set_num_threads(1)
    start = time.time()
    body: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            body += probe(name, args.rounds, args.rounds_large, Path(tmp))
    head = ["# `QuantConfig(smoothing_into_v=...)`: the attention output's smoothing folded into V or not (probe)", "",
            "Generated by `benchmarks/probe_v_fold.py`; do not edit by hand. Command:", "", f"    {command_line()}", "",
            f"Machine: {cpu_description()}. onnxruntime, ORT_ENABLE_ALL; latency: the four files interleaved run by run, "
            f"medians ({args.rounds} rounds at batch 1, {args.rounds_large} at 32), ratio to the FP32 file in the same "
            f"run. Distance: mean cosine distance of the output vectors (logits per image / per token, MiniLM's sentence "
            f"embeddings) to FP32's on "
            f"the held-out data, as export_speed.md. Took {(time.time() - start) / 60:.1f} min.", ""]
    write_atomic(args.output, "\n".join(head + body))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
