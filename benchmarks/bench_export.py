"""Benchmark softq's ONNX export on the reference workloads; writes docs/results/export.md.

Measures, on the reference LM (perplexity) and ViT (top-1):

* FP32 ONNX vs INT8 ONNX (each softmax form): latency, file size, metric in
  onnxruntime next to the torch float and torch fake-quant metric;
* onnxruntime's own ``quantize_static`` (QDQ, per-channel) on softq's float export
  with the same calibration data: metric and size;
* each integer softmax alone vs the float ``Softmax`` op: time ratio and max error.

Usage (the command used for the committed table is written into the table)::

    python benchmarks/bench_export.py --context 256 --eval-limit 16
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

import softq
import workloads
from softq.export import onnx_utils as U
from softq.export.int_softmax import FORMS, SoftmaxQuant, reference_qdq, softmax_model
from softq.export.row_attention import ROW_FORMS
from softq.export.model_export import to_onnx, to_onnx_float
from softq.quant.quantize import smoothing_report
from workloads.tasks import reference_task

ROOT = Path(__file__).resolve().parents[1]


def onnx_logits(sess: ort.InferenceSession, batch: dict[str, torch.Tensor]) -> np.ndarray:
    names = [i.name for i in sess.get_inputs()]
    feeds = {}
    for n in names:
        if n == "attention_mask" and n not in batch:
            feeds[n] = np.ones(tuple(batch["input_ids"].shape), dtype=np.int64)
        else:
            feeds[n] = batch[n].numpy()
    return sess.run(["logits"], feeds)[0]


@torch.no_grad()
def torch_logits(model: torch.nn.Module, task) -> list[np.ndarray]:  # noqa: ANN001
    return [model(**batch).logits.numpy() for batch in task.eval_inputs]


def parity(outs: list[np.ndarray], refs: list[np.ndarray]) -> tuple[float, float]:
    """(argmax agreement %, max |logit diff| / max |logit|) of ONNX vs torch over the eval set."""
    agree = np.concatenate([(o.argmax(-1) == r.argmax(-1)).ravel() for o, r in zip(outs, refs)])
    diff = max(float(np.abs(o - r).max()) for o, r in zip(outs, refs))
    scale = max(float(np.abs(r).max()) for r in refs)
    return 100.0 * float(agree.mean()), diff / scale


def onnx_metric(task_name: str, sess: ort.InferenceSession, task) -> tuple[float, list[np.ndarray]]:  # noqa: ANN001
    outs = [onnx_logits(sess, batch) for batch in task.eval_inputs]
    if task_name == "lm":
        nll, count = 0.0, 0
        for batch, out in zip(task.eval_inputs, outs):
            logits = out[:, :-1].astype(np.float64)
            target = batch["input_ids"][:, 1:].numpy()
            logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            picked = np.take_along_axis(logits, target[..., None], -1)[..., 0]
            nll += float((logz - picked).sum())
            count += target.size
        return math.exp(nll / count), outs
    preds = np.concatenate([o.argmax(-1) for o in outs])
    images, labels = workloads.digits_data("heldout", task.model.config.image_size)
    return 100.0 * float((preds == labels[: len(preds)].numpy()).mean()), outs


class CalibReader:
    """onnxruntime.quantization CalibrationDataReader over softq's calibration batches."""

    def __init__(self, batches: list[dict[str, torch.Tensor]], names: list[str]) -> None:
        self.items = []
        for b in batches:
            feed = {}
            for n in names:
                if n == "attention_mask" and n not in b:
                    feed[n] = np.ones(tuple(b["input_ids"].shape), dtype=np.int64)
                else:
                    feed[n] = b[n].numpy()
            self.items.append(feed)
        self.it = iter(self.items)

    def get_next(self):  # noqa: ANN201
        return next(self.it, None)

    def rewind(self) -> None:
        self.it = iter(self.items)


def ort_quantize_static(float_path: Path, out_path: Path, calib: list[dict[str, torch.Tensor]], names: list[str],
                        reduce_range: bool, method: str = "MinMax") -> None:
    """onnxruntime's ``quantize_static`` (QDQ, per-channel int8 weights, uint8 activations) calibrated on ``calib``
    with its ``CalibrationMethod`` ``method`` (MinMax, Percentile, Entropy, Distribution), its own defaults else."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    quantize_static(str(float_path), str(out_path), CalibReader(calib, names), quant_format=QuantFormat.QDQ,
                    per_channel=True, reduce_range=reduce_range, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod[method])


def bench_task(name: str, args: argparse.Namespace, workdir: Path) -> list[dict[str, object]]:
    task = reference_task(name, context=args.context if name == "lm" else None, calib_size=args.calib_size,
                          eval_limit=args.eval_limit if name == "lm" else None, size=args.size, progress=True)
    q_row = softq.quantize(task.model, task.calib, softq.QuantConfig())
    q_edge = softq.quantize(task.model, task.calib,
                            softq.QuantConfig(softmax_output="edge", bias_correction=args.bias_correction))
    example = task.eval_inputs[0]
    lat_batch = {k: v[:1] for k, v in example.items()} if name == "lm" else {
        "pixel_values": example["pixel_values"][: args.vit_batch]}
    names = ["input_ids", "attention_mask"] if name == "lm" else ["pixel_values"]
    rows: list[dict[str, object]] = []
    sessions: list[tuple[dict[str, object], ort.InferenceSession]] = []
    ref_float = torch_logits(task.model, task)

    def add(label: str, path: Path, torch_metric: float | None, ref: list[np.ndarray]) -> None:
        row: dict[str, object] = {"task": task.name, "model": label, "torch": torch_metric}
        sess = U.session(path, "all", threads=args.threads)
        row["onnx"], outs = onnx_metric(name, sess, task)
        row["agree"], row["rel"] = parity(outs, ref)
        row["mb"] = path.stat().st_size / 1e6
        rows.append(row)
        sessions.append((row, sess))
        print(row, file=sys.stderr, flush=True)

    fp_path = Path(to_onnx_float(task.model, workdir / f"{name}_fp32.onnx", example, overwrite=True))
    add("FP32 ONNX", fp_path, task.evaluate(), ref_float)
    q_codes = softq.quantize(task.model, task.calib, softq.QuantConfig(softmax_input="row"))
    for qmodel, kind, forms in ((q_row, "row codes (default)", ("fast",)),
                                (q_codes, "row codes on score codes", ROW_FORMS), (q_edge, "edge codes", FORMS)):
        q_torch, ref_q = task.evaluate(qmodel), torch_logits(qmodel, task)
        for form in forms:
            path = Path(to_onnx(qmodel, workdir / f"{name}_{kind.replace(' ', '_')[:12]}_{form}.onnx", example, softmax=form,
                                overwrite=True))
            add(f"softq INT8, {kind}, {form}", path, q_torch, ref_q)
    for reduce_range in (False, True):
        out = workdir / f"{name}_ortq_{int(reduce_range)}.onnx"
        ort_quantize_static(fp_path, out, task.calib, names, reduce_range)
        add(f"ORT quantize_static (QDQ, per-channel{', reduce_range' if reduce_range else ''})", out, None, ref_float)
    # latency: every model of the task interleaved, run by run, then the median per model
    times: list[list[float]] = [[] for _ in sessions]
    for _, sess in sessions:
        onnx_logits(sess, lat_batch)  # warm-up
    for _ in range(args.repeats):
        for i, (_, sess) in enumerate(sessions):
            t = time.perf_counter()
            onnx_logits(sess, lat_batch)
            times[i].append(time.perf_counter() - t)
    for (row, _), ts in zip(sessions, times):
        row["ms"] = 1e3 * statistics.median(ts)
    rows[0]["smoothing"] = smoothing_report(q_row)  # what the default config chose for this task
    return rows


def bench_softmax(args: argparse.Namespace) -> list[dict[str, object]]:
    """Each integer softmax alone vs float Softmax on [1, 4, n, n] scores."""
    rng = np.random.default_rng(0)
    n = args.softmax_len
    q = SoftmaxQuant(scale=0.06, zero_point=128)
    x = rng.normal(0, 2.5, (1, 4, n, n))
    codes = np.clip(np.round(x / q.scale) + q.zero_point, 0, 255).astype(np.uint8)
    xf = ((codes.astype(np.float32) - q.zero_point) * np.float32(q.scale)).astype(np.float32)
    from onnx import TensorProto, helper

    fmodel = helper.make_model(
        helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "float_softmax",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", "b", "c", "d"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b", "c", "d"])]),
        opset_imports=[helper.make_opsetid("", 21)])
    fmodel.ir_version = 10
    exact = np.exp(xf.astype(np.float64) - xf.max(-1, keepdims=True))
    exact = exact / exact.sum(-1, keepdims=True)

    def time_it(model, feed) -> float:  # noqa: ANN001
        sess = U.session(model, "all", threads=args.threads)
        sess.run(None, feed)
        ts = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = sess.run(None, feed)[0]
            ts.append(time.perf_counter() - t)
        return statistics.median(ts), out

    t_float, y = time_it(fmodel, {"x": xf})
    rows = [{"form": "float Softmax (fp32 in/out)", "ratio": 1.0, "ms": 1e3 * t_float,
             "err": float(np.abs(y - exact).max())}]
    for form in FORMS:
        t, yq = time_it(softmax_model(form, q), {"x": codes})
        err = float(np.abs(yq.astype(np.float64) / 256 - exact).max())
        ref_err = float(np.abs(reference_qdq(codes, q).astype(np.float64) / 256 - exact).max())
        rows.append({"form": form, "ratio": t / t_float, "ms": 1e3 * t, "err": err, "ideal": ref_err})
    return rows


def fmt(v: object, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def write_report(path: Path, command: str, model_rows: list[dict[str, object]], sm_rows: list[dict[str, object]],
                 args: argparse.Namespace) -> None:
    lines = [
        "# ONNX export: latency, size and accuracy",
        "",
        "Generated by `benchmarks/bench_export.py`; do not edit by hand. Command:",
        "",
        f"    {command}",
        "",
        f"onnxruntime {ort.__version__}, CPU `{platform.processor() or platform.machine()}`, "
        f"{args.threads} intra-op thread(s), graph optimisation ORT_ENABLE_ALL, median of {args.repeats} runs "
        "interleaved across the task's models. Default quantization (softmax codes relative to the row max, "
        "rounded from the float scores; 'on score codes': `softmax_input='row'`, the scores on a row-relative "
        "8-bit grid first, which the integer-only `int` form takes) "
        f"and the edge codes (uniform 2^-8) with softmax bias correction: {args.bias_correction}. LM latency: batch 1 x {args.context} tokens; "
        f"ViT latency: batch {args.vit_batch}. Metric: perplexity (LM, lower is better) or top-1 % (ViT) on "
        f"the held-out split (LM: {f'first {args.eval_limit} windows' if args.eval_limit else 'all windows'}; "
        "ViT: all images).",
        "",
        "| task | model | torch metric | ONNX metric | argmax = torch % | max rel logit diff | latency ms "
        "| latency / FP32 | size MB | size / FP32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    fp = {r["task"]: r for r in model_rows if r["model"] == "FP32 ONNX"}
    for r in model_rows:
        base = fp[r["task"]]
        lines.append(
            f"| {r['task']} | {r['model']} | {fmt(r['torch'], '.3f')} | {fmt(r.get('onnx'), '.3f')} | "
            f"{fmt(r.get('agree'), '.2f')} | {fmt(r.get('rel'), '.2e')} | "
            f"{fmt(r.get('ms'), '.2f')} | {fmt(r['ms'] / base['ms'], '.2f')} | {fmt(r.get('mb'), '.2f')} | "
            f"{fmt(r['mb'] / base['mb'], '.2f')} |")
    lines += [
        "",
        "torch metric of the INT8 rows is softq's fake-quant torch model; the ONNX metric is the exported file "
        "run in onnxruntime. Parity columns compare each ONNX model's logits on the whole eval set with torch: "
        "softq rows with softq's fake-quant model, the FP32 and quantize_static rows with the float model. "
        "quantize_static rows use the same calibration batches on softq's float export (its softmax output "
        "scale is 1/255 and it runs the float softmax between Q/DQ).",
        "",
        *[f"Default row codes, {r['task']}: {r['smoothing']}." for r in model_rows if "smoothing" in r],
        "",
        f"## Integer softmax alone (uint8 scores [1, 4, {args.softmax_len}, {args.softmax_len}], scale 0.06)",
        "",
        "| softmax | ms | time / float Softmax | max abs error vs exact | error of exact rounding |",
        "|---|---|---|---|---|",
    ]
    for r in sm_rows:
        lines.append(f"| {r['form']} | {r['ms']:.3f} | {r['ratio']:.2f} | {r['err']:.2e} | {fmt(r.get('ideal'), '.2e')} |")
    lines += [
        "",
        "Errors are in probability units; 8-bit outputs (scale 2^-8) cannot do better than half a step "
        "(1.95e-3), shown as the error of exact rounding.",
        "",
        "## Notes",
        "",
        "- Row codes (the default): `fast` = E = QuantizeLinear(Exp(DQ(s) - DQ(rowmax)), 1/255), "
        "MatMulInteger(E, [V | zp+1]) gives P.V's numerator and the row sum, one Div per output element; "
        "`int` = the same with an exp table (Gather) instead of Exp, integer up to the int32 accumulators. "
        "Core alone: docs/results/attention_core.md.",
        "- Edge softmax forms: `qdq` = DequantizeLinear -> Softmax -> QuantizeLinear (scale 2^-8, zero point 0); "
        "`ort` = com.microsoft.QLinearSoftmax (opset=13, axis=-1 written); `int` = standard ops, integer "
        "arithmetic only (256-entry exp table + rounded integer division; int32, or int64 with bias correction). Parity with numpy references is "
        "tested bit for bit in `tests/test_export_softmax.py`.",
        "- Softmax bias correction: in the `int` form beta moves the rounding point of the final integer "
        "division, `(e*256*K + sum*c) / (sum*K)` with `c = round(K (1/2 + beta/2^-8))`, K = 256: one "
        "extra integer Mul, no float op, masked keys stay 0. In `qdq`/`ort` it is an "
        "`Add(DQ(P), beta*valid)` after the output DequantizeLinear: a DQ zero point is an integer and "
        "beta is a fraction of a step.",
        "- Weights: symmetric per-channel 8-bit codes stored as int8 (onnxruntime's u8s8 kernels); on x86 "
        "CPUs without VNNI softq's sessions set `session.x64quantprecision=1` (exact u8u8 kernels there). "
        "Embedding tables: int8 codes with one scale per row (`QuantConfig.embedding_bits=8`). Speed next to "
        "onnxruntime's quantizers: docs/results/export_speed.md; storage options: docs/results/weight_storage.md.",
        "- `ort` on causal/padded models: QLinearSoftmax has no mask input, so masked keys enter as the "
        "lowest score code and keep a small weight (the LM `ort` row). `int` and `qdq` mask exactly.",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=["lm", "vit"], choices=["lm", "vit"])
    p.add_argument("--context", type=int, default=256, help="LM window length (eval and latency)")
    p.add_argument("--eval-limit", type=int, default=16, help="held-out LM windows (0: all); ViT uses all images")
    p.add_argument("--calib-size", type=int, default=16)
    p.add_argument("--bias-correction", choices=["tensor", "head", "head_row"], default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--vit-batch", type=int, default=32)
    p.add_argument("--softmax-len", type=int, default=256)
    p.add_argument("--size", default="reference", choices=["reference", "tiny"], help="tiny: smoke test only")
    p.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "export.md")
    args = p.parse_args(argv)
    args.eval_limit = args.eval_limit or None
    torch.set_num_threads(args.threads)
    command = "python benchmarks/bench_export.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        model_rows = [row for t in args.tasks for row in bench_task(t, args, Path(tmp))]
    sm_rows = bench_softmax(args)
    write_report(args.output, command.strip(), model_rows, sm_rows, args)
    print(args.output.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
