"""What is left of the W8A8 gap with row codes: the softmax *input* (attention scores), measured.

On the reference LM, W8A8 with softq's default (8-bit `row` softmax codes) is compared with:

* the same model with the softmax input (the scores quantizer, per-tensor asymmetric 8-bit,
  min-max) left float;
* a prototype that is *not* in softq: the softmax input quantized relative to its row max,
  ``d = clamp(s - rowmax, -T, 0)`` on 8 bits with the fixed scale ``T / 255`` (causal rows,
  no padding: the reference LM's evaluation windows).  An integer runtime could do this on
  the int32 score accumulator (the row max is exact there); softmax is shift-invariant, so
  only ``d`` matters, and entries below ``-T`` give row codes of 0 anyway when
  ``exp(-T) (2^b - 1) < 1/2``;
* W8A8 with a float softmax (`softmax_bits=None`: neither scores nor probabilities quantized).

Also the one-part-at-a-time sensitivity of the default W8A8 model (``softq.calib.diagnostics.
sensitivity``, grouped by tensor kind, held-out loss) and, per layer, the scores quantizer's
calibrated step and the range of the valid scores on the first held-out window.

    python examples/probe_softmax_input.py --steps 800,2400 --threads 1

A budget that is not cached is trained first (the 2400-step LM: about half an hour on one core).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import softq
from softq.attention import attention_points
from softq.calib.diagnostics import sensitivity
from softq.quant.tasks import Task, reference_task

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from bench_quant import command_line, write_atomic  # noqa: E402


def causal_valid(scores: torch.Tensor) -> torch.Tensor:
    q_len, k_len = scores.shape[-2], scores.shape[-1]
    return torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)


class RowRelativeScores(nn.Module):
    """Prototype softmax-input quantizer: 8-bit codes of clamp(s - rowmax, -T, 0) at scale T/255 (causal rows)."""

    def __init__(self, span: float, bits: int = 8) -> None:
        super().__init__()
        self.span, self.levels = span, 2**bits - 1

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        rowmax = scores.masked_fill(~causal_valid(scores), float("-inf")).amax(-1, keepdim=True)
        step = self.span / self.levels
        d = (scores - rowmax).clamp(min=-self.span)
        return (d / step).round() * step + rowmax


def rel(value: float, ref: float) -> str:
    return f"{(value / ref - 1) * 100:+.2f}%"


def probe(task: Task, steps: int, bits_list: list[int], spans: list[float]) -> list[str]:
    fp_ppl, fp_loss = task.measure()
    rows: list[tuple[str, float, float]] = [("FP32", fp_ppl, fp_loss)]

    def record(label: str, model: nn.Module) -> None:
        start = time.time()
        ppl, loss = task.measure(model)
        rows.append((label, ppl, loss))
        print(f"[{task.name}, {steps} steps] {label:<64} perplexity {ppl:.4f} ({rel(ppl, fp_ppl)}) "
              f"({time.time() - start:.0f}s)", flush=True)

    record("W8A8, float softmax (softmax_bits=None)", softq.quantize(task.model, task.calib,
                                                                      softq.QuantConfig(softmax_bits=None)))
    default = None
    for bits in bits_list:
        qmodel = softq.quantize(task.model, task.calib, softq.QuantConfig(softmax_bits=bits))
        points = [p for _, p in attention_points(qmodel)]
        quantizers = [p.scores for p in points]
        record(f"W8A8, {bits}-bit row codes{' (default)' if bits == 8 else ''}", qmodel)
        for q in quantizers:
            q.mode = "float"
        record("&nbsp;&nbsp;softmax input float", qmodel)
        for span in spans:
            for p in points:
                p.scores = RowRelativeScores(span)
            record(f"&nbsp;&nbsp;softmax input relative to the row max, 8-bit, T = {span:g} (prototype)", qmodel)
        for p, q in zip(points, quantizers):
            p.scores = q
            q.mode = "quant"
        if bits == 8:
            default = qmodel
    lines = [f"## {task.name}, trained {steps} steps ({len(task.eval_inputs)} held-out windows)", "",
             "| setting | perplexity | vs FP32 | held-out loss |", "|---|---|---|---|"]
    lines += [f"| {label} | {ppl:.4f} | {rel(ppl, fp_ppl)} | {loss:.5f} |" for label, ppl, loss in rows]
    if default is not None:
        ranking = sensitivity(default, lambda m: task.measure(m)[1])
        ref = ranking[0][1]
        lines += ["", "One part of the default W8A8 model quantized at a time (held-out loss, nats):", "",
                  "| quantized part | held-out loss | change |", "|---|---|---|"]
        lines += [f"| {name} | {loss:.5f} | {loss - ref:+.5f} |" for name, loss in ranking
                  if not name.startswith("layer")]
        stats: list[torch.Tensor] = []
        hooks = [p.scores.register_forward_hook(lambda _m, i, _o: stats.append(i[0].detach()))
                 for _, p in attention_points(default)]
        with torch.no_grad():
            default(**task.eval_inputs[0])
        for hook in hooks:
            hook.remove()
        lines += ["", "Per layer: the default softmax-input quantizer's calibrated step (per tensor) and the valid "
                  "(causal) scores of the first held-out window.", "",
                  "| layer | step | valid min | valid max | row max, min over rows |", "|---|---|---|---|---|"]
        for index, ((_, p), s) in enumerate(zip(attention_points(default), stats)):
            valid = causal_valid(s)
            values = s[..., valid]
            rowmax = s.masked_fill(~valid, float("-inf")).amax(-1)
            lines.append(f"| {index} | {p.scores.scale.item():.3f} | {values.min().item():.1f} | "
                         f"{values.max().item():.1f} | {rowmax.min().item():.1f} |")
    return lines + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="800", help="comma list of training budgets of the reference LM")
    parser.add_argument("--bits", default="8,4", help="comma list of softmax output bits (row codes)")
    parser.add_argument("--spans", default="8,12", help="comma list of T for the row-relative prototype")
    parser.add_argument("--eval-limit", type=int, default=12, help="held-out windows")
    parser.add_argument("--size", default="reference", help="LM size (tiny: a smoke run)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "softmax_input.md")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    start = time.time()
    body = []
    for steps in (int(s) for s in args.steps.split(",")):
        task = reference_task("lm", eval_limit=args.eval_limit, steps=steps, size=args.size)
        body += probe(task, steps, [int(b) for b in args.bits.split(",")], [float(t) for t in args.spans.split(",")])
    lines = ["# What is left of the W8A8 gap with row codes: the softmax input (generated)", "",
             f"Command: `{command_line()}`  ",
             f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
             f"took {(time.time() - start) / 60:.1f} min. Reference LM at its full context; W8A8 = `QuantConfig` "
             "defaults (per-tensor asymmetric 8-bit softmax input, min-max).", "",
             "The *prototype* rows are not a softq option: the softmax input quantized as clamp(s - rowmax, -T, 0) "
             "with the fixed 8-bit scale T/255 (rows of a causal window without padding), to see what a "
             "row-relative softmax input would buy.", ""]
    write_atomic(args.output, "\n".join(lines + body))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
