"""Benchmark: outlier-free attention variants (the Quantizable Transformers Table 2, at small scale).

For each reference model and each attention variant (vanilla, clipped softmax, gated attention,
softpick), trained from scratch with the same budget and seeds: float metric, max inf-norm of the
block outputs, average kurtosis, attention-sink rate, and the metric after ``softq.quantize``
(W8A8 with 8-bit softmax; also W6A8 and W4A8 weights).  Mean and spread over seeds.

Writes the markdown (atomically; default docs/results/variants.md) with the command that produced it.
The committed tables are docs/results/variants_lm.md and docs/results/variants_vit.md.

    python benchmarks/bench_variants.py                       # reference budgets, 2 seeds (hours on 2 cores)
    python benchmarks/bench_variants.py --lm-steps 300 --vit-steps 600 --seeds 0,1   # smaller budget

Also writes, per model, a PNG of per-layer inf-norm and kurtosis (and per-head sink rate) of every
variant, seed 0, next to the markdown (same name; ``_<model>`` appended when several models run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import softq
from softq.calib import diagnostics
from workloads.tasks import Task, reference_task

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_quant import command_line, write_atomic  # noqa: E402
from benchutil import seed_list  # noqa: E402

VARIANTS: dict[str, dict[str, Any] | None] = {
    "vanilla": None,
    "clipped": {"softmax": "clipped", "alpha": 4.0},
    # alpha < 1 keeps a uniform row (every fresh model's attention) above zero: with alpha > T/(T-1)
    # the clip zeroes whole uniform rows at initialisation and no gradient reaches attention.
    "clipped-a0.5": {"softmax": "clipped", "alpha": 0.5},
    "gated": {"gated": True, "gate_pi_init": 0.25},
    "softpick": {"softmax": "softpick"},
}
WEIGHT_BITS = (8, 6, 4)


def measure(task: Task) -> tuple[dict[str, float], diagnostics.Diagnostics]:
    diag = diagnostics.collect(task.model, task.calib)
    out = {"fp": task.evaluate(), "inf_norm": diag.max_inf_norm, "kurtosis": diag.mean_kurtosis,
           "sink": diag.mean_sink_rate}
    for bits in WEIGHT_BITS:
        qmodel = softq.quantize(task.model, task.calib, softq.QuantConfig(weight_bits=bits))
        out[f"w{bits}a8"] = task.evaluate(qmodel)
    out["w8a8_gap"] = out["w8a8"] - out["fp"]
    return out, diag


def fmt(values: list[float], digits: int = 2) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="lm,vit")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--lm-variants", default=None, help="LM variants (default: --variants)")
    parser.add_argument("--vit-variants", default=None, help="ViT variants (default: --variants)")
    parser.add_argument("--seeds", type=seed_list, default="0,1")
    parser.add_argument("--lm-steps", type=int, default=None, help="training steps (default: reference budget)")
    parser.add_argument("--vit-steps", type=int, default=None)
    parser.add_argument("--eval-limit", type=int, default=None, help="held-out LM windows (default all)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "variants.md")
    args = parser.parse_args()
    seeds = args.seeds
    variants_of = {"lm": args.lm_variants or args.variants, "vit": args.vit_variants or args.variants}
    for model_name in args.models.split(","):
        if model_name not in variants_of:
            parser.error(f"unknown model '{model_name}'; choose lm or vit")
        unknown = set(variants_of[model_name].split(",")) - set(VARIANTS)
        if unknown:
            parser.error(f"unknown variant(s) {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    start = time.time()
    lines = ["# Attention variants vs outliers (generated)", "",
             f"Command: `{command_line()}`  ",
             f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}.", "",
             "Inf-norm: max |x| of any transformer block output; kurtosis: mean over blocks of the Pearson kurtosis",
             "of the block output (3 = Gaussian); sink: mean attention mass on the first key. W*A8: `softq.quantize`",
             "with 8-bit activations and 8-bit softmax output, min-max ranges, no bias correction. Mean ± std over seeds "
             f"{seeds}.", ""]
    for model_name in args.models.split(","):
        steps = args.lm_steps if model_name == "lm" else args.vit_steps
        header = None
        curves: dict[str, diagnostics.Diagnostics] = {}
        for variant in variants_of[model_name].split(","):
            attention = VARIANTS[variant]
            per_seed = []
            for seed in seeds:
                task = reference_task(model_name, seed=seed, attention=attention, eval_limit=args.eval_limit,
                                      steps=steps)
                result, diag = measure(task)
                curves.setdefault(variant, diag)
                print(f"[{model_name} {variant} seed {seed}] " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()),
                      flush=True)
                per_seed.append(result)
            if header is None:
                metric = task.metric_name
                header = [f"## {model_name} ({metric}; {steps or 'reference'} training steps)", "",
                          f"| variant | FP {metric} | max inf-norm | avg kurtosis | sink rate | "
                          + " | ".join(f"W{b}A8 {metric}" for b in WEIGHT_BITS) + " | W8A8 − FP |",
                          "|---|---|---|---|---|" + "---|" * (len(WEIGHT_BITS) + 1)]
                lines += header
            col = lambda key, d=2: fmt([r[key] for r in per_seed], d)  # noqa: E731
            lines.append(f"| {variant} | {col('fp', 3)} | {col('inf_norm', 1)} | {col('kurtosis', 1)} | "
                         f"{col('sink', 3)} | " + " | ".join(col(f'w{b}a8', 3) for b in WEIGHT_BITS)
                         + f" | {col('w8a8_gap', 3)} |")
        single = len(args.models.split(",")) == 1
        png = diagnostics.plot(curves, args.output.with_suffix(".png") if single
                               else args.output.with_name(f"{args.output.stem}_{model_name}.png"))
        shown = png.relative_to(ROOT) if png.is_relative_to(ROOT) else png
        lines += ["", f"Per-layer inf-norm and kurtosis, per-head sink rate (seed {seeds[0]}): `{shown}`.", ""]
    lines.append(f"Took {(time.time() - start) / 60:.1f} min.")
    write_atomic(args.output, "\n".join(lines) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
