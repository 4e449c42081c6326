"""What softmax bias correction does under each softmax-output representation: an oracle study.

Quantizes *only* the softmax output of a reference model (everything else float), with
softq's own quantizer (``SoftmaxOutputQuantizer``) in each representation of
``QuantConfig.softmax_output`` (``edge``: uniform codes at 2^-bits; ``row``: codes relative
to the row max, normalised by their sum; ``row_exact``: the same codes over the exact sum of
exp), and compares perplexity / loss for:

* plain rounding, Q(p);
* ``bias correction (head, row)``: what ``QuantConfig(bias_correction="head_row")`` does, beta
  = E[p - Q(p)] per head and query row measured on the calibration windows (not for ``row``:
  its rows sum to 1, so the mean error over a row is 0 by construction and softq refuses it);
* ``oracle beta (head, row)``: Q(p) + beta with beta = mean_valid(p - Q(p)) computed on the
  very input being evaluated (the best any per-(head, row) constant can do);
* ``oracle, truncated entries only``: the row's lost mass given back exactly to the entries
  that rounded to zero (the best a "restore the truncated tail" correction can do).

If even the oracles do not close a gap, the gap is rounding *noise*, not bias, and no offline
correction removes it.  Also writes, per layer on the first held-out input, the mean row-sum
deficit, the mass of entries that round to 0 and the relative error of the attention output
P.V (without and with the oracle beta).  Writes docs/results/bias_correction.md.

    python benchmarks/probe_bias_correction.py --bits 8,6,4 --steps 800,2400 --threads 1

A budget that is not cached is trained first (the 2400-step LM: about half an hour on one core).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from softq.attention import ProbsQuantizer, attention_points
from softq.calib.data import run_batches
from softq.quant.quantizers import SoftmaxOutputQuantizer
from workloads.tasks import Task, reference_task
from workloads import LM_BUDGETS, VIT_BUDGETS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_quant import command_line, write_atomic  # noqa: E402
from benchutil import int_list  # noqa: E402

REPRESENTATIONS = ("edge", "row", "row_exact")
MODES = {  # mode -> row label
    "none": "plain rounding",
    "calibrated": "+ bias correction (head, row), calibrated",
    "oracle_row": "+ oracle beta (head, row)",
    "oracle_trunc": "+ oracle, truncated entries only",
}


class ProbeProbs(SoftmaxOutputQuantizer):
    """softq's softmax-output quantizer, plus oracle corrections (analysis only, not for deployment)."""

    def __init__(self, bits: int, num_heads: int, representation: str, oracle: str | None = None) -> None:
        super().__init__(bits, num_heads, representation=representation)
        self.mode = "quant"
        self.oracle = oracle

    def forward(self, probs: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        if self.oracle is None or self.measuring:
            return super().forward(probs, valid)
        q = self.quantize(probs)
        valid = torch.ones_like(probs) if valid is None else torch.broadcast_to(valid, probs.shape).to(probs.dtype)
        lost = ((probs - q) * valid).sum(-1, keepdim=True)
        if self.oracle == "oracle_row":
            return q + lost / valid.sum(-1, keepdim=True).clamp_min(1) * valid
        zeros = (self.int_repr(probs) == 0).to(probs.dtype) * valid
        return q + zeros * lost / zeros.sum(-1, keepdim=True).clamp_min(1)


def install(task: Task, bits: int | None, representation: str = "edge", mode: str = "none") -> list[ProbsQuantizer]:
    """Put a fresh softmax-output point in every attention layer (``bits=None``: float softmax)."""
    installed = []
    for _, points in attention_points(task.model):
        if bits is None:
            points.probs = ProbsQuantizer()
        else:
            points.probs = ProbeProbs(bits, points.num_heads, representation, mode if mode.startswith("oracle") else None)
        installed.append(points.probs)
    if mode == "calibrated":
        for q in installed:
            q.start_bias_measurement("head_row")
        run_batches(task.model, task.calib)
        for q in installed:
            q.finish_bias_measurement()
    return installed


def anatomy(task: Task, bits: int, representation: str) -> list[tuple[int, float, float, float, float]]:
    """Per layer on the first held-out input: row-sum deficit, truncated mass, P.V error, P.V error + oracle beta."""
    seen: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]] = []
    values: list[torch.Tensor] = []
    quantizers = install(task, bits, representation)
    hooks = []
    for (_, points), quantizer in zip(attention_points(task.model), quantizers):
        quantizer.mode = "float"  # the model runs in float; the hook quantizes on the side
        hooks.append(quantizer.register_forward_hook(
            lambda m, i, o: seen.append((i[0].detach(), i[1], m.quantize(i[0].detach()), m.int_repr(i[0].detach())))))
        hooks.append(points.v.register_forward_hook(lambda _m, _i, o: values.append(o.detach())))
    with torch.no_grad():
        task.model(**task.eval_inputs[0])
    for hook in hooks:
        hook.remove()
    out = []
    for index, ((p, valid, q, codes), v) in enumerate(zip(seen, values)):
        valid = torch.ones_like(p) if valid is None else torch.broadcast_to(valid, p.shape).to(p.dtype)
        ref = p @ v
        deficit = ((p - q) * valid).sum(-1).mean().item()
        truncated = (p * (codes == 0) * valid).sum(-1).mean().item()
        err = ((q @ v - ref).norm() / ref.norm()).item()
        beta = ((p - q) * valid).sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp_min(1)
        err_beta = (((q + beta * valid) @ v - ref).norm() / ref.norm()).item()
        out.append((index, deficit, truncated, err, err_beta))
    return out


def probe(task: Task, bits_list: list[int]) -> tuple[tuple[float, float], dict, dict]:
    install(task, None)
    fp = task.measure()
    results: dict[tuple[int, str, str], tuple[float, float]] = {}
    layers: dict[tuple[int, str], list] = {}
    for bits in bits_list:
        for representation in REPRESENTATIONS:
            for mode in MODES:
                if representation == "row" and mode != "none":
                    continue  # zero by construction: rows of E / sum(E) sum to exactly 1
                start = time.time()
                install(task, bits, representation, mode)
                results[bits, representation, mode] = task.measure()
                metric, loss = results[bits, representation, mode]
                print(f"[{task.name}] {bits}-bit {representation:<9} {MODES[mode]:<44} {task.metric_name} {metric:.4f} "
                      f"loss {loss:.5f} ({time.time() - start:.0f}s)", flush=True)
            layers[bits, representation] = anatomy(task, bits, representation)
    install(task, None)
    return fp, results, layers


def section(task: Task, steps: int, bits_list: list[int], fp: tuple[float, float], results: dict, layers: dict) -> list[str]:
    fp_metric, fp_loss = fp
    higher = task.higher_is_better
    lines = [f"## {task.name}, trained {steps} steps ({task.metric_name}, {len(task.eval_inputs)} held-out batches)", "",
             f"Float softmax: {task.metric_name} {fp_metric:.4f}, held-out loss {fp_loss:.5f}.", ""]
    for bits in bits_list:
        lines += [f"### {bits}-bit softmax output", "",
                  f"| representation | correction | {task.metric_name} | vs float | held-out loss | gap closed |",
                  "|---|---|---|---|---|---|"]
        for representation in REPRESENTATIONS:
            for mode, label in MODES.items():
                if (bits, representation, mode) not in results:
                    continue
                metric, loss = results[bits, representation, mode]
                rel = metric - fp_metric if higher else (metric - fp_metric) / fp_metric * 100
                delta = f"{rel:+.2f} pt" if higher else f"{rel:+.2f}%"
                note = ""
                if mode != "none":
                    gap = results[bits, representation, "none"][1] - fp_loss
                    base = results[bits, representation, "none"][1]
                    note = f"{(base - loss) / gap * 100:.0f}%" if gap > 1e-4 else "no gap"
                name = f"`{representation}`" + (" (default)" if representation == "row" else "")
                lines.append(f"| {name if mode == 'none' else ''} | {label.lstrip('+ ') if mode != 'none' else 'none'} | "
                             f"{metric:.4f} | {delta} | {loss:.5f} | {note} |")
        lines += ["", f"Per layer ({bits}-bit), first held-out input: mean row-sum deficit sum(p - Q(p)) (mass lost by "
                  "rounding; negative = gained), mean mass of entries whose code is 0, and the relative error of the "
                  "attention output P.V without and with the oracle per-(head, row) beta.", "",
                  "| layer | representation | row-sum deficit | truncated mass | P.V error | P.V error + oracle beta |",
                  "|---|---|---|---|---|---|"]
        for representation in REPRESENTATIONS:
            lines += [f"| {i} | `{representation}` | {d:+.4f} | {t:.4f} | {e:.4f} | {eb:.4f} |"
                      for i, d, t, e, eb in layers[bits, representation]]
        lines.append("")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["lm", "vit"], default="lm")
    parser.add_argument("--size", default="reference", help="model size (tiny: a smoke run)")
    parser.add_argument("--bits", type=int_list, default="8", help="comma list of softmax output bits")
    parser.add_argument("--steps", type=int_list, default=None,
                        help="comma list of training budgets (default: the reference budget); one section each")
    parser.add_argument("--eval-limit", type=int, default=12, help="held-out windows (LM) / images (ViT)")
    parser.add_argument("--calib-size", type=int, default=16, help="calibration windows/images for the calibrated beta")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "bias_correction.md")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bits_list = args.bits
    budget = (LM_BUDGETS if args.model == "lm" else VIT_BUDGETS)[args.size]["steps"]
    steps_list = args.steps or [budget]
    start = time.time()
    body = []
    for steps in steps_list:
        task = reference_task(args.model, eval_limit=args.eval_limit, calib_size=args.calib_size,
                              size=args.size, steps=steps)
        body += section(task, steps, bits_list, *probe(task, bits_list))
    lines = ["# Softmax bias correction under each softmax-output representation: oracle study (generated)", "",
             f"Command: `{command_line()}`  ",
             f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
             f"took {(time.time() - start) / 60:.1f} min. Model: the {args.size} {args.model}; "
             f"only the softmax output is quantized (softq's `SoftmaxOutputQuantizer`), everything else float.", "",
             "Representations (`QuantConfig.softmax_output`): `edge` = uniform codes at 2^-bits; `row` (the default) = "
             "codes E = round((2^b-1) exp(s - rowmax)), output E/sum(E); `row_exact` = the same codes over (2^b-1) times "
             "the exact sum of exp. Corrections: *calibrated* = `bias_correction=\"head_row\"`, beta = E[p - Q(p)] per "
             "head and query row on the calibration windows, added to valid entries (refused for `row`: its rows sum to "
             "1, so the mean error over a row is 0 by construction); *oracle beta* = the same constant computed on the "
             "evaluated input itself; *oracle, truncated entries only* = the row's lost mass given back to the entries "
             "whose code is 0. 'gap closed' = share of the held-out loss increase (float softmax -> plain rounding of "
             "the same representation) that the correction wins back; negative = worse; 'no gap' = plain rounding is within "
             "1e-4 nats of float.", ""]
    write_atomic(args.output, "\n".join(lines + body) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
