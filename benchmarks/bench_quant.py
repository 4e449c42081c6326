"""Benchmark: W8A8 quantization of the reference models, softmax-output representation, bits, bias correction.

Writes docs/results/quant.md (atomically) with the command that produced it.

    python benchmarks/bench_quant.py              # full held-out sets (a few minutes on one core, after training)
    python benchmarks/bench_quant.py --quick      # a few windows/images, for a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import command_line, int_list, write_atomic  # noqa: E402,F401  (other benchmarks import them from here)

import softq  # noqa: E402
from softq.quant.quantize import smoothing_report  # noqa: E402
from workloads.tasks import Task, reference_task  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SMOOTHING: dict[str, str] = {}  # task -> smoothing_report of its default-config row


@dataclass
class Row:
    label: str
    config: softq.QuantConfig | None  # None = float model
    baseline: str | None = None  # label of the uncorrected row whose gap this row closes


def rows(bits_list: tuple[int, ...] = (8, 6, 4), correction: bool = True) -> list[Row]:
    """FP32, float softmax, then each softmax-output representation at 8/6/4 bits (row = the default; row_log at 4).

    Bias correction is measured on top of ``edge`` and of ``row_exact`` (on ``row`` it is zero by
    construction: rows of E/sum(E) sum to 1); its 'gap closed' is relative to the same
    representation without it.  Every row keeps the residual stream float (the default of ``row``;
    ``edge`` rows too, so rows differ only in the softmax).  After the 8-bit rows: the default without
    input smoothing, and with the residual stream quantized (``edge``'s default), also without the prefix
    tokens' own residual scales and with grouped residual scales everywhere (and input smoothing at 0.5).
    """
    Q = softq.QuantConfig
    out = [
        Row("FP32", None),
        Row("W8A8, float softmax", Q(softmax_bits=None)),
    ]
    for bits in bits_list:
        edge, exact = f"W8A8, {bits}-bit softmax, edge (uniform 2^-{bits})", f"W8A8, {bits}-bit softmax, row_exact"
        edge_q = dict(softmax_bits=bits, softmax_output="edge", quantize_residual=False)  # float residual, as row
        edge_bc = Row("  + bias correction (head, row)", Q(bias_correction="head_row", **edge_q), edge)
        exact_bc = Row("  + bias correction (head, row)", Q(softmax_bits=bits, softmax_output="row_exact",
                                                             bias_correction="head_row"), exact)
        out += [Row(edge, Q(**edge_q)), *([edge_bc] if correction else []),
                Row(f"W8A8, {bits}-bit softmax, row (default)", Q(softmax_bits=bits)),
                Row("  softmax input on the row-relative grid (softmax_input='row', what the int form takes)",
                    Q(softmax_bits=bits, softmax_input="row")),
                Row("  softmax input on one calibrated grid per tensor (softmax_input='tensor')",
                    Q(softmax_bits=bits, softmax_input="tensor")),
                Row(exact, Q(softmax_bits=bits, softmax_output="row_exact")), *([exact_bc] if correction else [])]
        if bits == 4:  # log codes are defined at 4 bits
            out.append(Row("W8A8, 4-bit softmax, row_log (log codes: powers of sqrt(2))",
                           Q(softmax_bits=4, softmax_output="row_log")))
        if bits == 8:  # what the default's passes contribute on these models, and what a quantized residual costs
            R = dict(quantize_residual=True)
            out += [Row("  default without input smoothing (input_smoothing=None)", Q(input_smoothing=None)),
                    Row("  residual stream quantized too (quantize_residual=True, `edge`'s default)", Q(**R)),
                    Row("    [CLS] shares the residual scales (residual_prefix=0; the LM's default)",
                        Q(residual_prefix=0, **R)),
                    Row("    4 scale groups at every residual point (residual_groups=4)", Q(residual_groups=4, **R)),
                    Row("    residual_groups=4 and input smoothing 0.5 everywhere (input_smoothing=0.5)",
                        Q(residual_groups=4, input_smoothing=0.5, **R))]
    return out


def run_task(task: Task, table_rows: list[Row]) -> list[tuple[str, float, float, str, str]]:
    """(label, metric, loss, gap-closed note, input smoothing) for every row on one task.

    The gap a correction closes is measured on the held-out loss, which is
    continuous (top-1 on a few hundred images moves in whole images).
    """
    losses: dict[str, float] = {}
    table = []
    fp_metric, fp_loss = task.measure()
    for row in table_rows:
        start = time.time()
        smoothing = ""
        if row.config is None:
            value, loss = fp_metric, fp_loss
        else:
            qmodel = softq.quantize(task.model, task.calib, row.config)
            value, loss = task.measure(qmodel)
            alpha = qmodel.softq_input_smoothing
            smoothing = "none" if alpha is None else f"{alpha:g}" + (
                " (LN-folded inputs)" if getattr(qmodel, "softq_smoothing_folded_only", False) else "")
            if row.config == softq.QuantConfig():
                SMOOTHING[task.name] = smoothing_report(qmodel)
        losses[row.label.strip()] = loss
        note = ""
        if row.baseline is not None:
            gap = losses[row.baseline] - fp_loss
            note = f"{(losses[row.baseline] - loss) / gap * 100:.0f}%" if gap > 1e-4 else "no gap"
        table.append((row.label, value, loss, note, smoothing))
        print(f"[{task.name}] {row.label.strip():<52} {task.metric_name} {value:.4f} loss {loss:.5f} {note} "
              f"({time.time() - start:.0f}s)", flush=True)
    return table


def markdown(sections: list[tuple[Task, list[tuple[str, float, float, str, str]]]], command: str, seconds: float) -> str:
    lines = [
        "# Quantization results (generated)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
        f"took {seconds / 60:.1f} min.",
        "",
        "W8A8 everywhere (`QuantConfig` defaults otherwise): per-channel int8 weights, int8 embedding tables (one scale",
        "per row), asymmetric int8 activations (Linear inputs, Q, K, V; the residual stream and LayerNorm float",
        "unless a row says otherwise, `edge` rows included, so rows differ only in the softmax) with min-max",
        "ranges on 16 calibration windows/images from the training split; softmax input (`softmax_input='auto'`):",
        "float scores for `row` and `row_exact` (the codes rounded once from exp(s - rowmax)), 8-bit codes of s - rowmax",
        "on steps of ln(2)/2 for `row_log`, one calibrated asymmetric grid per tensor for `edge`; the",
        "'softmax_input=row' rows: 8-bit codes of s - rowmax on [-T, 0] (T = 6.34 for 8-bit `row` output; what the",
        "integer-only export form takes), the 'softmax_input=tensor' rows: one grid per tensor;",
        "softmax output unsigned: `edge` = uniform codes at scale 2^-bits; `row` (the default) = codes",
        "E = round((2^b-1) exp(s - rowmax)), P.V = (E.V)/sum(E); `row_exact` = the same codes divided by (2^b-1) times the",
        "exact sum of exp; `row_log` (4 bits) = the scores' distance to the row max on steps of ln(2)/2 (k steps),",
        "E = round(86.875 * 2^(-k/2)) (87, 61, 43, ... 1, then 0 from k = 15), P.V = (E.V)/sum(E).",
        "'gap closed' = share of the held-out loss increase (cross-entropy in nats, FP -> uncorrected",
        "row of the same representation) that the correction wins back; 100% = as good as float, negative = worse;",
        "'no gap' = the uncorrected row is within 1e-4 nats of FP (nothing to win back).",
        "'smoothing' = the input smoothing alpha the row's model got (`input_smoothing='auto'` unless the row says",
        "otherwise: no smoothing or alpha 0.6 / 0.8 / 1.0, whichever is closest to the float model on the calibration",
        "batches held out from range observation (the ViT's single batch of 16 images: 4 of them; the LM's logits, the",
        "ViT's last hidden state), each applied to every Linear input and, in these pre-LN models, only to the inputs",
        "that are LayerNorm outputs ('LN-folded inputs': free at run time, kept if closer than none); smoothing every",
        "input costs a Mul at run time and is kept only if at least 20% closer than none and closer than those).",
        "",
    ]
    for task, table in sections:
        fp = table[0][1]
        lines += [f"## {task.name} ({task.metric_name}, {len(task.eval_inputs)} held-out batches)", "",
                  f"| setting | {task.metric_name} | vs FP | held-out loss | gap closed | smoothing |",
                  "|---|---|---|---|---|---|"]
        for label, value, loss, note, smoothing in table:
            rel = (value - fp) / fp * 100 if task.higher_is_better is False else value - fp
            delta = f"{rel:+.2f}%" if not task.higher_is_better else f"{rel:+.2f} pt"
            lines.append(f"| {label.replace('  + ', '&nbsp;&nbsp;+ ')} | {value:.4f} | {delta} | {loss:.5f} | {note} "
                         f"| {smoothing} |")
        lines.append("")
        if task.name in SMOOTHING:
            lines += [f"Default row, {SMOOTHING[task.name]}.", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few eval windows/images (smoke run, numbers are noisy)")
    parser.add_argument("--tasks", default="lm,vit", help="comma list of lm256, lm (full context), vit")
    parser.add_argument("--steps", type=int, default=None,
                        help="use the reference models trained this many steps (default: the reference budget)")
    parser.add_argument("--bits", type=int_list, default="8,6,4", help="comma list of softmax output bits (default 8,6,4)")
    parser.add_argument("--no-correction", action="store_true", help="skip the bias-correction rows")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "quant.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.time()
    # Held-out windows: 48 x 256 and 12 x 1024 characters (paired: every row sees the same text).
    limit = {"lm256": 4, "lm": 2, "vit": 128} if args.quick else {"lm256": 48, "lm": 12, "vit": None}
    sections = []
    for name in args.tasks.split(","):
        if name == "lm256":
            task = reference_task("lm", context=256, eval_limit=limit["lm256"], steps=args.steps)
        elif name in ("lm", "vit"):
            task = reference_task(name, eval_limit=limit[name], steps=args.steps)
        else:
            parser.error(f"unknown task {name}")
        bits = tuple(args.bits)
        sections.append((task, run_task(task, rows(bits, not args.no_correction))))
    write_atomic(args.output, markdown(sections, command_line(), time.time() - start))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
