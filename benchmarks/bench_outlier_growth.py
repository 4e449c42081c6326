"""Benchmark: do activation outliers grow with training?  (Quantizable Transformers, at small scale.)

Trains one reference model from scratch for ``--steps`` steps (the usual recipe, its cosine
schedule stretched over the longer run) and, every ``--every`` steps, measures a frozen copy:
the float metric, max inf-norm and average kurtosis of the block outputs, the attention-sink
rate, and the metric after ``softq.quantize`` (W8A8, 8-bit softmax).  Bondarenko et al. find
outliers are learned: heads that must "do nothing" push their softmax inputs ever further as
training goes on.  This shows whether that is under way in softq's small models.

Writes a markdown table (atomically) and a PNG of inf-norm and kurtosis per layer over training.

    python benchmarks/bench_outlier_growth.py --model lm --steps 3200 --every 400
    python benchmarks/bench_outlier_growth.py --model vit --steps 2400 --every 300
    python benchmarks/bench_outlier_growth.py --model lm --steps 3200 --every 400 --softmax clipped --alpha 0.5
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import softq
import workloads as W
from softq.calib import diagnostics
from workloads.tasks import Task, lm_task, vit_task

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_quant import command_line, write_atomic  # noqa: E402


def measure(task: Task) -> dict[str, Any]:
    diag = diagnostics.collect(task.model, task.calib)
    qmodel = softq.quantize(task.model, task.calib, softq.QuantConfig())
    return {"fp": task.evaluate(), "w8a8": task.evaluate(qmodel), "inf_norm": diag.max_inf_norm,
            "kurtosis": diag.mean_kurtosis, "sink": diag.mean_sink_rate,
            "layer_inf_norm": [s.inf_norm for s in diag.layers], "layer_kurtosis": [s.kurtosis for s in diag.layers]}


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    for layer in range(len(rows[0]["layer_inf_norm"])):
        axes[0].plot(steps, [r["layer_inf_norm"][layer] for r in rows], marker="o", label=f"layer {layer}")
        axes[1].plot(steps, [r["layer_kurtosis"][layer] for r in rows], marker="o", label=f"layer {layer}")
    axes[0].set(title=f"{title}: max |x| of block output", xlabel="training step", yscale="log")
    axes[1].set(title=f"{title}: kurtosis of block output", xlabel="training step", yscale="log")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return diagnostics.save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("lm", "vit"), default="lm")
    parser.add_argument("--every", type=int, default=400, help="measure every this many steps")
    parser.add_argument("--eval-limit", type=int, default=12, help="held-out LM windows / ViT images (default 12 "
                        "windows, as docs/results/quant.md; ViT: all images if 0)")
    parser.add_argument("--output", type=Path, default=None,
                        help="markdown to write (default docs/results/outlier_growth_<model>[_<variant>].md)")
    parser.add_argument("--save", type=Path, default=None,
                        help="also save the final model here (workloads.load_model reads it back)")
    W.add_training_args(parser, W.LM_SIZES)
    args = parser.parse_args()
    attention = W.attention_from_args(parser, args)
    if args.every < 1:
        parser.error("--every must be at least 1")
    budgets = W.LM_BUDGETS if args.model == "lm" else W.VIT_BUDGETS
    steps = int(args.steps or budgets[args.size]["steps"])
    variant = W.variant_name(attention)
    suffix = "" if attention is None else f"_{variant.replace(',', '_').replace('=', '')}"
    output = args.output or ROOT / "docs" / "results" / f"outlier_growth_{args.model}{suffix}.md"
    tokenizer = W.CharTokenizer()
    eval_limit = args.eval_limit or None
    rows: list[dict[str, Any]] = []
    start = time.time()

    def checkpoint(step: int, model: torch.nn.Module, _optimizer: Any, losses: list[float]) -> None:
        if step % args.every and step != steps:
            return
        frozen = copy.deepcopy(model).eval()  # measuring must not touch the model being trained
        task = (lm_task(frozen, tokenizer, eval_limit=eval_limit, seed=args.seed) if args.model == "lm"
                else vit_task(frozen, eval_limit=eval_limit, seed=args.seed))
        row = {"step": step, "train_loss": sum(losses[-20:]) / len(losses[-20:]), **measure(task)}
        rows.append(row)
        print(f"\n[step {step}] fp {row['fp']:.3f} w8a8 {row['w8a8']:.3f} inf-norm {row['inf_norm']:.1f} "
              f"kurtosis {row['kurtosis']:.2f} sink {row['sink']:.3f}", flush=True)

    if args.model == "lm":
        model = W.train_lm(args.size, args.seed, steps, attention=attention, tokenizer=tokenizer, on_step=checkpoint)
        metric = f"perplexity (first {eval_limit} held-out windows)" if eval_limit else "perplexity"
    else:
        model = W.train_vit(args.size, args.seed, steps, attention=attention, on_step=checkpoint)
        metric = "top-1 %"
    if args.save is not None:
        meta = {"kind": args.model, "size": args.size, "attention": attention, "seed": args.seed, "steps": steps}
        print(f"saved the final model to {W.save_model(model, args.save, tokenizer if args.model == 'lm' else None, meta)}")
    png = plot(rows, f"{args.model} {variant}", output.with_suffix(".png"))
    lines = [f"# Outlier growth over training: {args.model}, {variant}, seed {args.seed} (generated)", "",
             f"Command: `{command_line()}`  ",
             f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}.", "",
             f"One run of {steps} steps ({args.size} recipe, cosine schedule over the whole run). At each step shown, "
             "a frozen copy is measured: inf-norm = max |x| of any transformer block output, kurtosis = mean over "
             "blocks of the Pearson kurtosis of the block output (3 = Gaussian), sink = mean attention mass on the "
             "first key, W8A8 = `softq.quantize` defaults (8-bit weights, activations and softmax output, min-max).",
             "", f"| step | train loss | FP {metric} | W8A8 | max inf-norm | avg kurtosis | sink rate |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['train_loss']:.3f} | {r['fp']:.3f} | {r['w8a8']:.3f} | {r['inf_norm']:.1f} | "
              f"{r['kurtosis']:.2f} | {r['sink']:.3f} |" for r in rows]
    lines += ["", f"Per-layer curves: `{png.relative_to(ROOT) if png.is_relative_to(ROOT) else png}`.", "",
              f"Took {(time.time() - start) / 60:.1f} min."]
    write_atomic(output, "\n".join(lines) + "\n")
    print(f"wrote {output} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
