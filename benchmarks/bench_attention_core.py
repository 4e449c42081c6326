"""Benchmark: the ONNX attention core (scores -> P.V) of each softmax-output form vs the float core.

Writes docs/results/attention_core.md (atomically) with the command that produced it.
Every form runs on the same uint8 score codes and V codes, one onnxruntime thread,
ORT_ENABLE_ALL; runs are interleaved (form A, B, C, ... then again) and each
form's time is the median of its runs, so a noisy shared machine slows all forms alike.

    python benchmarks/bench_attention_core.py                       # [1,12,128,128] and [1,4,1024,1024]
    python benchmarks/bench_attention_core.py --shapes 1,4,64,64 --repeats 5   # smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant import command_line, write_atomic  # noqa: E402

from softq.export import onnx_utils as U  # noqa: E402
from softq.export.int_softmax import (  # noqa: E402
    SoftmaxQuant,
    _Builder,
    build_relative_codes,
    build_relative_scores,
    softmax_model,
)
from softq.export.row_attention import RowQuant, row_attention_model  # noqa: E402
from softq.quant.config import softmax_input_span  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
V_SCALE, V_ZP = 0.02, 128


def float_core() -> "onnx.ModelProto":  # noqa: F821
    """Softmax(scores) -> MatMul(P, DequantizeLinear(V)): the float core."""
    nodes = [
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("DequantizeLinear", ["v", "v_scale", "v_zp"], ["vf"]),
        helper.make_node("MatMul", ["p", "vf"], ["y"]),
    ]
    return _model(nodes, _v_inits(), "float_core")


def float_core_from_codes(q: SoftmaxQuant) -> "onnx.ModelProto":  # noqa: F821
    """The per-tensor score codes' QuantizeLinear, then DequantizeLinear -> Softmax -> MatMul: the float core of
    an export that keeps the scores quantized per tensor (issue 9's reference)."""
    nodes, inits = _codes(q)
    nodes += [
        helper.make_node("DequantizeLinear", ["x", "s_scale", "s_zp"], ["xf"]),
        helper.make_node("Softmax", ["xf"], ["p"], axis=-1),
        helper.make_node("DequantizeLinear", ["v", "v_scale", "v_zp"], ["vf"]),
        helper.make_node("MatMul", ["p", "vf"], ["y"]),
    ]
    return _model(nodes, inits + _v_inits(), "float_core_codes")


def _v_inits() -> list:
    return [helper.make_tensor("v_scale", TensorProto.FLOAT, [], [V_SCALE]),
            helper.make_tensor("v_zp", TensorProto.UINT8, [], [V_ZP])]


def _codes(q: SoftmaxQuant | None) -> tuple[list, list]:
    """Nodes from the float scores ``s`` to the score codes ``x``: per-tensor QuantizeLinear, or the
    row-relative codes (Min/ReduceMax/Max/Sub/QuantizeLinear without a mask: ReduceMax/Sub/QuantizeLinear),
    or with ``q`` None the float ``s - rowmax`` (ReduceMax/Sub; the default float softmax input)."""
    if q is None:
        b = _Builder("input/", 21)
        b.op("Identity", [build_relative_scores(b, "s")], out="x")
        return b.nodes, b.inits
    if q.relative:
        b = _Builder("input/", 21)
        build_relative_codes(b, "s", q, out="x")
        return b.nodes, b.inits
    return ([helper.make_node("QuantizeLinear", ["s", "s_scale", "s_zp"], ["x"])],
            [helper.make_tensor("s_scale", TensorProto.FLOAT, [], [q.scale]),
             helper.make_tensor("s_zp", TensorProto.UINT8, [], [q.zero_point])])


def row_core(form: str, rq: RowQuant) -> "onnx.ModelProto":  # noqa: F821
    nodes, inits = _codes(rq.scores)
    core = row_attention_model(form, rq)
    return _model(nodes + list(core.graph.node), inits + list(core.graph.initializer), f"row_{form}")


def edge_core(form: str, q: SoftmaxQuant) -> "onnx.ModelProto":  # noqa: F821
    """The edge export: score codes -> softmax form -> DequantizeLinear(2^-8) -> MatMul with the dequantized V."""
    nodes, inits = _codes(q)
    sm = softmax_model(form, q)
    nodes += list(sm.graph.node) + [
        helper.make_node("DequantizeLinear", ["y", "p_scale", "p_zp"], ["pf"]),
        helper.make_node("DequantizeLinear", ["v", "v_scale", "v_zp"], ["vf"]),
        helper.make_node("MatMul", ["pf", "vf"], ["out"]),
    ]
    for n in nodes:
        n.output[:] = ["probs_codes" if o == "y" else ("y" if o == "out" else o) for o in n.output]
        n.input[:] = ["probs_codes" if i == "y" else i for i in n.input]
    inits += list(sm.graph.initializer) + _v_inits() + [
        helper.make_tensor("p_scale", TensorProto.FLOAT, [], [2.0**-8]),
        helper.make_tensor("p_zp", TensorProto.UINT8, [], [0])]
    opsets = {o.domain: o.version for o in sm.opset_import}
    return _model(nodes, inits, f"edge_{form}", opsets)


def _model(nodes, inits, name, opsets=None):  # noqa: ANN001, ANN202
    dims = ["b", "h", "q", "k"]
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("s", TensorProto.FLOAT, dims),
                                            helper.make_tensor_value_info("v", TensorProto.UINT8, ["b", "h", "k", "d"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "h", "q", "d"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in (opsets or {"": 21}).items()])
    model.ir_version = 10
    return model


def grids(s: np.ndarray) -> dict[str, SoftmaxQuant]:
    """The score grids: row-relative (span of 8-bit row codes / of row_exact; row_log's log
    step) and per tensor (min-max over these scores, as softq's default observer would calibrate it)."""
    relative = {rep: SoftmaxQuant(scale=softmax_input_span(rep, 4 if rep == "row_log" else 8) / 255, zero_point=255,
                                  relative=True) for rep in ("row", "row_exact", "row_log")}
    scale = float(s.max() - s.min()) / 255
    return {**relative, "tensor": SoftmaxQuant(scale=scale, zero_point=int(np.clip(round(-s.min() / scale), 0, 255)))}


def forms(s: np.ndarray) -> list[tuple[str, object]]:
    g = grids(s)
    out = [("float core: Softmax -> MatMul", float_core()),
           ("float core on per-tensor codes: Q -> DQ -> Softmax -> MatMul", float_core_from_codes(g["tensor"]))]
    for rep in ("row", "row_exact"):
        out.append((f"{rep}, fast, float input{' (default)' if rep == 'row' else ''}",
                    row_core("fast", RowQuant(None, V_SCALE, V_ZP, 8, rep))))
        for grid, label in ((g[rep], "row-relative input"), (g["tensor"], "per-tensor input")):
            rq = RowQuant(grid, V_SCALE, V_ZP, 8, rep)
            out += [(f"{rep}, fast, {label}", row_core("fast", rq)),
                    (f"{rep}, int, {label}", row_core("int", rq))]
    log = RowQuant(g["row_log"], V_SCALE, V_ZP, 4, "row_log")  # 4-bit log codes on their row-relative grid
    out += [("row_log (4-bit), fast, row-relative input", row_core("fast", log)),
            ("row_log (4-bit), int, row-relative input", row_core("int", log))]
    for form in ("qdq", "ort", "int"):
        out.append((f"edge, {form}, per-tensor input", edge_core(form, g["tensor"])))
    return out


def bench_shape(shape: tuple[int, int, int, int], repeats: int, d_head: int) -> list[dict[str, object]]:
    b, h, n, k = shape
    rng = np.random.default_rng(0)
    s = rng.normal(0, 2.5, shape).astype(np.float32)
    v = rng.integers(0, 256, (b, h, k, d_head)).astype(np.uint8)
    feeds = {"s": s, "v": v}
    exact = _exact(s, v)
    sessions = [(label, U.session(model, "all", threads=1)) for label, model in forms(s)]
    times: dict[str, list[float]] = {label: [] for label, _ in sessions}
    errors = {}
    for label, sess in sessions:  # warm-up and accuracy
        y = sess.run(None, feeds)[0]
        errors[label] = float(np.abs(y - exact).max() / np.abs(exact).max())
    for _ in range(repeats):
        for label, sess in sessions:
            t = time.perf_counter()
            sess.run(None, feeds)
            times[label].append(time.perf_counter() - t)
    base = statistics.median(times[sessions[0][0]])
    rows = []
    for label, _ in sessions:
        med = statistics.median(times[label])
        rows.append({"shape": shape, "form": label, "ms": 1e3 * med, "ratio": med / base, "err": errors[label]})
        print(f"{shape} {label:<45} {1e3 * med:9.2f} ms  x{med / base:5.2f}  err {errors[label]:.2e}", flush=True)
    return rows


def _exact(s: np.ndarray, v: np.ndarray) -> np.ndarray:
    xf = s.astype(np.float64)
    p = np.exp(xf - xf.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p @ ((v.astype(np.float64) - V_ZP) * np.float32(V_SCALE))


def markdown(rows: list[dict[str, object]], args: argparse.Namespace, seconds: float) -> str:
    lines = [
        "# ONNX attention core: row codes vs the float core (generated)",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {os.cpu_count()} CPU cores (shared), `{platform.processor() or platform.machine()}`, onnxruntime "
        f"{ort.__version__}; 1 intra-op thread, ORT_ENABLE_ALL; took {seconds / 60:.1f} min.",
        "",
        f"Inputs: float32 scores (N(0, 2.5) logits, what the Q.K^T MatMul gives) and uint8 V codes "
        f"(scale {V_SCALE}, zero point {V_ZP}), head size {args.d_head}; every quantized core starts with its "
        f"softmax input: float (`QuantConfig.softmax_input='float'`, the default for row codes: ReduceMax, Sub, "
        f"then the float s - rowmax into the core's Exp), score codes row-relative (`softmax_input='row'`: "
        f"ReduceMax, Sub, QuantizeLinear at step T/255) or per tensor (QuantizeLinear on the min-max grid of the "
        f"scores). "
        f"Each form's time is the median of "
        f"{args.repeats} runs interleaved with the other forms' runs; 'x float' is that median over the float "
        "core's median in the same run. 'rel. error' = max |y - exact P.V| / max |exact P.V| (exact: float64 softmax "
        "of the float scores times the dequantized V).",
        "",
        "| shape [b,h,q,k] | attention core | ms | x float | rel. error |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        shape = ",".join(map(str, r["shape"]))
        lines.append(f"| [{shape}] | {r['form']} | {r['ms']:.2f} | {r['ratio']:.2f} | {r['err']:.1e} |")
    lines += [
        "",
        "- Row forms: `E = round(255 exp(s - rowmax))` (uint8), `MatMulInteger(E, [V | zp+1])` into int32 gives "
        "P.V's numerator and the row sum from one GEMM (`row`); `row_exact` divides by 255 times the exact sum of "
        "exp instead (float ReduceSum in `fast`, a second 2^16 table in `int`). One division per output element.",
        "- `row_log` (4 bits): the same core as `row` with the gain 86.875 for 255 and score codes on steps of "
        "ln(2)/2 (`E = round(86.875 * 2^(-k/2))`, 0 from k = 15); its error is that of a 4-bit softmax.",
        "- `int` forms are integer from the score codes to the int32 accumulators (exp table by Gather); their "
        "cost is onnxruntime's Gather, a scalar kernel.",
        "- Row-relative codes are `qmax - d` already, so the core takes no row max: `fast` dequantizes them into "
        "the Exp, `int` indexes its tables by the code.",
        "- Edge rows: today's export of the uniform 2^-8 codes (softmax form, DequantizeLinear, float MatMul).",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1,12,128,128;1,4,1024,1024", help="';'-separated b,h,q,k")
    parser.add_argument("--d-head", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "attention_core.md")
    args = parser.parse_args()
    start = time.time()
    rows = []
    for spec in args.shapes.split(";"):
        shape = tuple(int(s) for s in spec.split(","))
        if len(shape) != 4 or shape[2] != shape[3]:
            parser.error(f"shape {spec!r} must be b,h,n,n")
        rows += bench_shape(shape, args.repeats, args.d_head)
    write_atomic(args.output, markdown(rows, args, time.time() - start))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
