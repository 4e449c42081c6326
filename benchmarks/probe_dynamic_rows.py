"""Probe: per-row dynamic activation quantization at the Linear inputs, against softq's static grid (the
default) and per-tensor dynamic quantization; writes docs/results/dynamic_rows.md.

Issue 10 asks for static activation scales (softq's calibrated ranges) and, if it measures better for some
models, dynamic per-row activation quantization.  softq's ``to_onnx(linears="dynamic")`` quantizes each Linear
input per call on the whole tensor's range (``DynamicQuantizeLinear``, what onnxruntime's ``quantize_dynamic``
writes).  Per row (each token's own scale) there is no standard ONNX operator and no onnxruntime fusion, so
this probe times the two ways it can be written:

* ``per-row dynamic, standard ops``: softq's ``linears="dynamic"`` file with every ``DynamicQuantizeLinear``
  replaced by symmetric per-row codes (``Abs -> ReduceMax`` over the channels, ``/127``, ``Div``, then
  ``QuantizeLinear`` at scale 1 and zero point 128) and the row scale multiplied into the output
  (``MatMulInteger -> Cast -> Mul(row scale x weight scale) -> Add``; onnxruntime fuses none of it);
* ``ORT MatMulNBits int8``: onnxruntime's own 8-bit block-quantized Linear (``MatMulNBitsQuantizer``: 8-bit
  weights in blocks of 128 along the input, ``accuracy_level=4``: each row's activations quantized per call
  in blocks of 128, int8 kernels), the only dynamic row-wise int8 kernel onnxruntime has.  Its weights are
  onnxruntime's own block-wise ones (finer than per channel), so its accuracy is not the activations' alone,
  and its embedding table stays float (size).

All files run in onnxruntime (ORT_ENABLE_ALL, one thread), interleaved run by run with FP32 and
``quantize_dynamic``.  Accuracy and distance as in export_speed.md.

    python benchmarks/probe_dynamic_rows.py   # writes docs/results/dynamic_rows.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_export_speed import Bench  # noqa: E402
from benchutil import (command_line, cpu_description, latency_cells, mean_cosine_distance,  # noqa: E402
                       one_thread_latency, write_atomic)

import softq  # noqa: E402
from softq.export import onnx_utils as U  # noqa: E402
from softq.export.model_export import to_onnx, to_onnx_float  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STATIC = "softq INT8 (static calibrated grid: the default)"
TENSOR = "softq INT8, linears='dynamic' (per tensor, per call)"
ROWS = "softq INT8, per-row dynamic, standard ops"
NBITS = "ORT MatMulNBits int8 (blocks of 128, accuracy_level=4)"
QD = "ORT quantize_dynamic"


def per_row(model: onnx.ModelProto) -> int:
    """Replace each ``DynamicQuantizeLinear(x) -> (codes, scale, zero point)`` by symmetric per-row codes
    (scale ``max |x| / 127`` over the last axis, zero point 128) and multiply each reading Linear's output by
    the row scale before its bias: ``MatMulInteger -> Cast -> Mul(weight scale) -> Mul(row scale) -> Add``.
    (The row scale cannot stay in the ``Mul(scale, weight scale)`` product: onnxruntime then fuses the chain
    into ``MatMulIntegerToFloat``, whose activation scale is per tensor, and the outputs are wrong.)"""
    g = model.graph
    consts = {"rows/axes": np.array([-1], np.int64), "rows/inv127": np.array(1 / 127, np.float32),
              "rows/tiny": np.array(1e-12, np.float32), "rows/one": np.array(1.0, np.float32),
              "rows/zp": np.array(128, np.uint8)}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def only(name: str, op: str) -> onnx.NodeProto:
        found = [r for r in readers.get(name, []) if r.op_type == op]
        if len(found) != 1:
            raise SystemExit(f"per_row: expected one {op} reading {name}, found {len(found)}")
        return found[0]

    after: dict[int, list[onnx.NodeProto]] = {}  # id(node) -> nodes inserted after it
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for count, n in enumerate([n for n in g.node if n.op_type == "DynamicQuantizeLinear"]):
        x, (codes, scale, zp), p = n.input[0], n.output, f"rows{count}/"
        row = p + "scale"
        replaced[id(n)] = [helper.make_node("Abs", [x], [p + "abs"]),
                           helper.make_node("ReduceMax", [p + "abs", "rows/axes"], [p + "max"], keepdims=1),
                           helper.make_node("Mul", [p + "max", "rows/inv127"], [p + "s"]),
                           helper.make_node("Max", [p + "s", "rows/tiny"], [row]),
                           helper.make_node("Div", [x, row], [p + "x"]),
                           helper.make_node("QuantizeLinear", [p + "x", "rows/one", "rows/zp"], [codes]),
                           helper.make_node("Identity", ["rows/zp"], [zp]),
                           helper.make_node("Identity", ["rows/one"], [scale])]
        for j, mm in enumerate(r for r in readers.get(codes, []) if r.op_type == "MatMulInteger"):
            mul = only(only(mm.output[0], "Cast").output[0], "Mul")
            out = mul.output[0]
            mul.output[0] = f"{p}{j}/unscaled"
            after[id(mul)] = [helper.make_node("Mul", [mul.output[0], row], [out])]
    nodes = []
    for n in g.node:
        nodes += replaced.get(id(n), [n]) + after.get(id(n), [])
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    del g.value_info[:]
    return len(replaced)


def probe(name: str, rounds: int, rounds_large: int, min_seconds: float, work: Path) -> list[str]:
    bench = Bench(name, argparse.Namespace(calib_batches=4))
    qmodel = softq.quantize(bench.model, bench.calib, softq.QuantConfig())
    pool = {} if bench.pooling is None else {"pooling": bench.pooling[0], "normalize": bench.pooling[1]}
    paths = {"FP32": Path(to_onnx_float(bench.model, work / f"{name}_fp32.onnx", bench.example(), **pool))}
    paths[STATIC] = Path(to_onnx(qmodel, work / f"{name}_static.onnx", bench.example(), **pool))
    paths[TENSOR] = Path(to_onnx(qmodel, work / f"{name}_tensor.onnx", bench.example(), linears="dynamic", **pool))
    rows = onnx.load(str(paths[TENSOR]))
    replaced = per_row(rows)
    onnx.checker.check_model(rows)
    paths[ROWS] = U.save_atomic(rows, work / f"{name}_rows.onnx", overwrite=True)
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    paths[NBITS] = work / f"{name}_nbits.onnx"
    nbits = MatMulNBitsQuantizer(onnx.load(str(paths["FP32"])), bits=8, block_size=128, is_symmetric=True,
                                 accuracy_level=4)
    nbits.process()
    nbits.model.save_model_to_file(str(paths[NBITS]), False)
    paths[QD] = work / f"{name}_dynamic.onnx"
    quantize_dynamic(str(paths["FP32"]), str(paths[QD]), per_channel=True, weight_type=QuantType.QInt8)
    ref = None if name in ("lm", "vit") else bench.reference(bench.model)
    fp32 = bench.output_rows(paths["FP32"])
    lat = one_thread_latency(paths, bench.latency_feeds, rounds, rounds_large, min_seconds)
    lines = [f"## {name} ({replaced} Linear inputs quantized per row)", "",
             "| file | accuracy (ONNX) | distance to FP32 | size / FP32 | 1 thr, batch 1 | 1 thr, batch 32 |",
             "|---|---|---|---|---|---|"]
    size_fp32 = paths["FP32"].stat().st_size
    for k, p in paths.items():
        lines.append(f"| {k} | {bench.accuracy(p, ref):.4f} | {mean_cosine_distance(bench.output_rows(p), fp32):.2e} | "
                     f"{p.stat().st_size / size_fp32:.2f} | {' | '.join(latency_cells(lat, k))} |")
    return lines + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="minilm,vit,lm", help="comma list of minilm, vit, lm, bert-base")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds at batch 1")
    parser.add_argument("--rounds-large", type=int, default=5, help="timed rounds at batch 32")
    parser.add_argument("--min-seconds", type=float, default=20.0, help="time each cell for at least this long")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "dynamic_rows.md")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - {"vit", "lm", "minilm", "bert-base"}
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}; choose from minilm, vit, lm, bert-base")
    torch.set_num_threads(1)
    start = time.time()
    body: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            body += probe(name, args.rounds, args.rounds_large, args.min_seconds, Path(tmp))
    head = ["# Per-row dynamic activation quantization at the Linear inputs (probe)", "",
            "Generated by `benchmarks/probe_dynamic_rows.py`; do not edit by hand. Command:", "",
            f"    {command_line()}", "",
            f"Machine: {cpu_description()}. onnxruntime, ORT_ENABLE_ALL, one thread; latency: the files of a model "
            f"interleaved run by run, medians ({args.rounds} rounds at batch 1, {args.rounds_large} at 32, more "
            f"until a cell has been timed for {args.min_seconds:g} s), ratio to the FP32 file in the same run. "
            "Distance: mean cosine distance of the output vectors (logits per image / per token, MiniLM's sentence "
            "embeddings) to FP32's on the held-out data, as export_speed.md. The softq files are one quantized model "
            "(default `QuantConfig()`); only the Linear inputs' quantization differs (Q, K, V and the softmax keep "
            "their static grids). What each row is: the script's docstring. "
            f"Took {(time.time() - start) / 60:.1f} min.", ""]
    write_atomic(args.output, "\n".join(head + body))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
