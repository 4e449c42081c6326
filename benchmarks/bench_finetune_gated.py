"""Benchmark: turn a trained vanilla reference model into gated attention by a short fine-tune.

Rows, all from the cached reference model (same data, seed and step count for both fine-tunes):

* ``vanilla``: the reference model as trained;
* ``vanilla + fine-tune``: the same number of extra steps without gates (the control);
* ``gated fine-tune``: ``workloads.resumable.finetune_to_gated`` (function-preserving conversion,
  then the extra steps).

Columns: float metric and held-out loss, max inf-norm and mean kurtosis of block outputs,
attention-sink rate, and the metric after ``softq.quantize`` (W8A8, 8-bit softmax).
Compare with the from-scratch variants in docs/results/variants_lm.md and variants_vit.md.  Writes
docs/results/finetune_gated.md (atomically) with the command.

    python benchmarks/bench_finetune_gated.py --models vit --steps 100
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

import softq
import workloads
from softq.calib import diagnostics
from workloads.resumable import _batches_for, finetune_to_gated
from workloads.tasks import Task, reference_task

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_quant import command_line, write_atomic  # noqa: E402


def measure(task: Task, model: torch.nn.Module) -> dict[str, float]:
    metric, loss = task.measure(model)
    diag = diagnostics.collect(model, task.calib)
    qmodel = softq.quantize(model, task.calib, softq.QuantConfig())
    return {"metric": metric, "loss": loss, "inf_norm": diag.max_inf_norm, "kurtosis": diag.mean_kurtosis,
            "sink": diag.mean_sink_rate, "w8a8": task.measure(qmodel)[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="vit", help="comma list of vit, lm")
    parser.add_argument("--steps", type=int, default=100, help="fine-tuning steps (both fine-tunes)")
    parser.add_argument("--pi", type=float, default=0.5, help="gate opening at conversion")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--eval-limit", type=int, default=12, help="held-out LM windows (ViT: all images)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "finetune_gated.md")
    args = parser.parse_args()
    start = time.time()
    lines = ["# Vanilla -> gated attention by fine-tuning (generated)", "", f"Command: `{command_line()}`  ",
             f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}. {args.steps} fine-tuning steps at "
             f"lr {args.lr}, gate opening pi={args.pi} at conversion; W8A8 = `softq.quantize` defaults "
             "(8-bit softmax, no bias correction).", ""]
    for name in args.models.split(","):
        task = reference_task(name, eval_limit=None if name == "vit" else args.eval_limit)
        rows = {"vanilla": measure(task, task.model)}
        control = copy.deepcopy(task.model)
        torch.manual_seed(0)
        workloads.run_training(control, _batches_for(control, 0, None, None), args.steps, args.lr,
                               warmup=max(1, args.steps // 10), desc="finetune vanilla (control)")
        rows["vanilla + fine-tune"] = measure(task, control)
        gated, _ = finetune_to_gated(copy.deepcopy(task.model), args.steps, args.pi, lr=args.lr, seed=0)
        rows["gated fine-tune"] = measure(task, gated)
        metric = task.metric_name
        lines += [f"## {task.name} ({metric})", "",
                  f"| model | FP {metric} | held-out loss | max inf-norm | avg kurtosis | sink rate | W8A8 {metric} |",
                  "|---|---|---|---|---|---|---|"]
        for label, r in rows.items():
            print(f"[{task.name}] {label}: " + ", ".join(f"{k} {v:.4f}" for k, v in r.items()), flush=True)
            lines.append(f"| {label} | {r['metric']:.3f} | {r['loss']:.4f} | {r['inf_norm']:.1f} | "
                         f"{r['kurtosis']:.2f} | {r['sink']:.3f} | {r['w8a8']:.3f} |")
        lines.append("")
    lines.append(f"Took {(time.time() - start) / 60:.1f} min.")
    write_atomic(args.output, "\n".join(lines) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
