"""Benchmark: the ONNX attention core (scores -> P.V) of each softmax-output form vs the float core.

Writes docs/results/attention_core.md (atomically) with the command that produced it.
Every form runs on the same uint8 score codes and V codes, one onnxruntime thread,
ORT_ENABLE_ALL; runs are interleaved (form A, B, C, ... then again) and each
form's time is the median of its runs, so a noisy shared machine slows all forms alike.

    python examples/bench_attention_core.py                       # [1,12,128,128] and [1,4,1024,1024]
    python examples/bench_attention_core.py --shapes 1,4,64,64 --repeats 5   # smoke run
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
from softq.export.int_softmax import SoftmaxQuant, softmax_model  # noqa: E402
from softq.export.row_attention import RowQuant, reference, row_attention_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
S_SCALE, S_ZP, V_SCALE, V_ZP = 0.06, 128, 0.02, 128


def float_core() -> "onnx.ModelProto":  # noqa: F821
    """DequantizeLinear(scores) -> Softmax -> MatMul(P, DequantizeLinear(V)): the float core."""
    nodes = [
        helper.make_node("DequantizeLinear", ["x", "s_scale", "s_zp"], ["xf"]),
        helper.make_node("Softmax", ["xf"], ["p"], axis=-1),
        helper.make_node("DequantizeLinear", ["v", "v_scale", "v_zp"], ["vf"]),
        helper.make_node("MatMul", ["p", "vf"], ["y"]),
    ]
    inits = [helper.make_tensor("s_scale", TensorProto.FLOAT, [], [S_SCALE]),
             helper.make_tensor("s_zp", TensorProto.UINT8, [], [S_ZP]),
             helper.make_tensor("v_scale", TensorProto.FLOAT, [], [V_SCALE]),
             helper.make_tensor("v_zp", TensorProto.UINT8, [], [V_ZP])]
    return _model(nodes, inits, "float_core")


def edge_core(form: str) -> "onnx.ModelProto":  # noqa: F821
    """Today's edge export: softmax form -> DequantizeLinear(2^-8) -> MatMul with the dequantized V."""
    sm = softmax_model(form, SoftmaxQuant(scale=S_SCALE, zero_point=S_ZP))
    nodes = list(sm.graph.node) + [
        helper.make_node("DequantizeLinear", ["y", "p_scale", "p_zp"], ["pf"]),
        helper.make_node("DequantizeLinear", ["v", "v_scale", "v_zp"], ["vf"]),
        helper.make_node("MatMul", ["pf", "vf"], ["out"]),
    ]
    for n in nodes:
        n.output[:] = ["probs_codes" if o == "y" else ("y" if o == "out" else o) for o in n.output]
        n.input[:] = ["probs_codes" if i == "y" else i for i in n.input]
    inits = list(sm.graph.initializer) + [
        helper.make_tensor("p_scale", TensorProto.FLOAT, [], [2.0**-8]),
        helper.make_tensor("p_zp", TensorProto.UINT8, [], [0]),
        helper.make_tensor("v_scale", TensorProto.FLOAT, [], [V_SCALE]),
        helper.make_tensor("v_zp", TensorProto.UINT8, [], [V_ZP])]
    opsets = {o.domain: o.version for o in sm.opset_import}
    return _model(nodes, inits, f"edge_{form}", opsets)


def _model(nodes, inits, name, opsets=None):  # noqa: ANN001, ANN202
    dims = ["b", "h", "q", "k"]
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.UINT8, dims),
                                            helper.make_tensor_value_info("v", TensorProto.UINT8, ["b", "h", "k", "d"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "h", "q", "d"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in (opsets or {"": 21}).items()])
    model.ir_version = 10
    return model


def forms() -> list[tuple[str, object]]:
    q = SoftmaxQuant(scale=S_SCALE, zero_point=S_ZP)
    out = [("float core: DQ -> Softmax -> MatMul", float_core())]
    for rep in ("row", "row_exact"):
        rq = RowQuant(q, V_SCALE, V_ZP, 8, rep)
        out += [(f"{rep}, fast (Exp in Q/DQ, MatMulInteger)", row_attention_model("fast", rq)),
                (f"{rep}, int (exp table, MatMulInteger)", row_attention_model("int", rq))]
    out += [("edge, qdq (today's default export)", edge_core("qdq")),
            ("edge, ort (QLinearSoftmax)", edge_core("ort")),
            ("edge, int (table softmax)", edge_core("int"))]
    return out


def bench_shape(shape: tuple[int, int, int, int], repeats: int, d_head: int) -> list[dict[str, object]]:
    b, h, n, k = shape
    rng = np.random.default_rng(0)
    x = np.clip(np.round(rng.normal(0, 2.5, shape) / S_SCALE) + S_ZP, 0, 255).astype(np.uint8)
    v = rng.integers(0, 256, (b, h, k, d_head)).astype(np.uint8)
    feeds = {"x": x, "v": v}
    exact = _exact(x, v)
    sessions = [(label, U.session(model, "all", threads=1)) for label, model in forms()]
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
    rq = RowQuant(SoftmaxQuant(scale=S_SCALE, zero_point=S_ZP), V_SCALE, V_ZP)
    ref_err = float(np.abs(reference("int", x, v, rq) - exact).max() / np.abs(exact).max())
    rows = []
    for label, _ in sessions:
        med = statistics.median(times[label])
        rows.append({"shape": shape, "form": label, "ms": 1e3 * med, "ratio": med / base, "err": errors[label]})
        print(f"{shape} {label:<45} {1e3 * med:9.2f} ms  x{med / base:5.2f}  err {errors[label]:.2e}", flush=True)
    rows[0]["ref_err"] = ref_err
    return rows


def _exact(x: np.ndarray, v: np.ndarray) -> np.ndarray:
    xf = (x.astype(np.float64) - S_ZP) * np.float32(S_SCALE)
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
        f"Inputs: uint8 score codes (scale {S_SCALE}, zero point {S_ZP}, N(0, 2.5) logits) and uint8 V codes "
        f"(scale {V_SCALE}, zero point {V_ZP}), head size {args.d_head}. Each form's time is the median of "
        f"{args.repeats} runs interleaved with the other forms' runs; 'x float' is that median over the float "
        "core's median in the same run. 'rel. error' = max |y - exact P.V| / max |exact P.V| (exact: float64 softmax "
        "of the dequantized scores times the dequantized V).",
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
        "- `int` forms are integer from the score codes to the int32 accumulators (exp table by Gather); their "
        "cost is onnxruntime's Gather, a scalar kernel.",
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
