"""The softmax input (attention scores) of W8A8 with row codes: per-tensor grid vs relative to the row max.

On the reference LM, W8A8 with 8-bit `row` softmax codes and the softmax input relative to the row max
(``QuantConfig.softmax_input="row"``, the default before 2026-12-04 and what the integer-only export form
takes) is compared with:

* the same model with the softmax input left float (what ``softmax_input="auto"`` means for `row` codes now:
  ``"float"``);
* the softmax input on one calibrated grid per tensor (``softmax_input="tensor"``, asymmetric 8-bit,
  min-max over the scores a row can see);
* W8A8 with a float softmax (`softmax_bits=None`: neither scores nor probabilities quantized).

Also the one-part-at-a-time sensitivity of that row-relative W8A8 model (``softq.quant.
sensitivity``, grouped by tensor kind, held-out loss) and, per layer, the per-tensor grid's calibrated
step next to the row-relative one, and the range of the valid scores on the first held-out window.

    python benchmarks/probe_softmax_input.py --steps 800,2400 --threads 1

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
from softq.quant.sensitivity import sensitivity
from workloads.tasks import Task, reference_task

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_quant import command_line, write_atomic  # noqa: E402
from benchutil import int_list  # noqa: E402


def causal_valid(scores: torch.Tensor) -> torch.Tensor:
    q_len, k_len = scores.shape[-2], scores.shape[-1]
    return torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)


def rel(value: float, ref: float) -> str:
    return f"{(value / ref - 1) * 100:+.2f}%"


def probe(task: Task, steps: int, bits_list: list[int]) -> list[str]:
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
    default = per_tensor = None
    for bits in bits_list:
        qmodel = softq.quantize(task.model, task.calib, softq.QuantConfig(softmax_bits=bits, softmax_input="row"))
        record(f"W8A8, {bits}-bit row codes, input relative to the row max (softmax_input='row')", qmodel)
        quantizers = [p.scores for _, p in attention_points(qmodel)]
        for q in quantizers:
            q.mode = "float"
        record("&nbsp;&nbsp;softmax input float (softmax_input='float', the default)", qmodel)
        for q in quantizers:
            q.mode = "quant"
        tensor = softq.quantize(task.model, task.calib, softq.QuantConfig(softmax_bits=bits, softmax_input="tensor"))
        record("&nbsp;&nbsp;softmax input on one grid per tensor (softmax_input='tensor')", tensor)
        if bits == 8:
            default, per_tensor = qmodel, tensor
    lines = [f"## {task.name}, trained {steps} steps ({len(task.eval_inputs)} held-out windows)", "",
             "| setting | perplexity | vs FP32 | held-out loss |", "|---|---|---|---|"]
    lines += [f"| {label} | {ppl:.4f} | {rel(ppl, fp_ppl)} | {loss:.5f} |" for label, ppl, loss in rows]
    if default is not None:
        ranking = sensitivity(default, lambda m: task.measure(m)[1])
        ref = ranking[0][1]
        lines += ["", "One part of the row-relative-input W8A8 model quantized at a time (held-out loss, nats; the softmax "
                  "input alone drops the keys T or more below their row max, which the 8-bit row codes drop too):",
                  "", "| quantized part | held-out loss | change |", "|---|---|---|"]
        lines += [f"| {name} | {loss:.5f} | {loss - ref:+.5f} |" for name, loss in ranking
                  if not name.startswith("layer")]
        stats: list[torch.Tensor] = []
        hooks = [p.scores.register_forward_hook(lambda _m, i, _o: stats.append(i[0].detach()))
                 for _, p in attention_points(per_tensor)]
        with torch.no_grad():
            per_tensor(**task.eval_inputs[0])
        for hook in hooks:
            hook.remove()
        lines += ["", "Per layer: the step of the per-tensor grid (calibrated) and of the row-relative one (fixed), "
                  "and the valid (causal) scores of the first held-out window.", "",
                  "| layer | per-tensor step | row-relative step | valid min | valid max | row max, min over rows |",
                  "|---|---|---|---|---|---|"]
        relative = [p.scores for _, p in attention_points(default)]
        for index, ((_, p), s, r) in enumerate(zip(attention_points(per_tensor), stats, relative)):
            valid = causal_valid(s)
            values = s[..., valid]
            rowmax = s.masked_fill(~valid, float("-inf")).amax(-1)
            lines.append(f"| {index} | {p.scores.scale.item():.3f} | {r.scale.item():.4f} | {values.min().item():.1f} | "
                         f"{values.max().item():.1f} | {rowmax.min().item():.1f} |")
    return lines + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int_list, default="800", help="comma list of training budgets of the reference LM")
    parser.add_argument("--bits", type=int_list, default="8,4", help="comma list of softmax output bits (row codes)")
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
    for steps in args.steps:
        task = reference_task("lm", eval_limit=args.eval_limit, steps=steps, size=args.size)
        body += probe(task, steps, args.bits)
    lines = ["# The softmax input of W8A8 with row codes: per tensor vs relative to the row max (generated)", "",
             f"Command: `{command_line()}`  ",
             f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
             f"took {(time.time() - start) / 60:.1f} min. Reference LM at its full context; W8A8 = `QuantConfig` "
             "defaults: the softmax input as 8-bit codes of s - rowmax on [-T, 0], T = 6.34 for 8-bit and 3.51 "
             "for 4-bit row codes (where the output code reaches 0), step T/255.", ""]
    write_atomic(args.output, "\n".join(lines + body))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
