"""Benchmark: seconds per training step of the reference LM per attention variant, eager vs fast path.

The fast path (``softq.attention.fast_training``, used by every softq training loop) computes the
same function as the eager softq attention: SDPA for exact softmax, ``torch.compile``'d variants
otherwise.  Vanilla without softq attention trains through SDPA as well.

    python benchmarks/bench_train_speed.py                 # reference LM, batch 4 x 1024, 2 warm-up + 5 timed steps
    python benchmarks/bench_train_speed.py --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import workloads as W
from softq.attention import fast_training

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_quant import command_line, write_atomic  # noqa: E402

VARIANTS: dict[str, dict[str, Any] | None] = {
    "vanilla": None,
    "clipped": {"softmax": "clipped", "alpha": 0.5},
    "gated": {"gated": True, "gate_pi_init": 0.25},
    "softpick": {"softmax": "softpick"},
}


def seconds_per_step(attention: dict[str, Any] | None, fast: bool, steps: int, warmup: int) -> float:
    torch.manual_seed(0)
    tokenizer = W.CharTokenizer()
    model = W.build_model(W.lm_config("reference", vocab_size=tokenizer.vocab_size))
    if attention is not None:
        from softq.attention import configure_attention

        configure_attention(model, **attention)
    elif not fast:
        model.set_attn_implementation("eager")
    else:
        model.set_attn_implementation("sdpa")
    batches = W.lm_batches("train", model.config.n_positions, int(W.LM_BUDGETS["reference"]["batch_size"]), 0,
                           tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()

    def step() -> None:
        loss = model(**next(batches)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    context = fast_training(model) if (fast and attention is not None) else contextlib.nullcontext()
    with context:
        for _ in range(warmup):  # includes torch.compile's first call
            step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
    return (time.perf_counter() - start) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "train_speed.md")
    args = parser.parse_args()
    lines = ["# Training step time per attention variant (generated)", "",
             f"Command: `{command_line()}`  ",
             f"Machine: {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}.",
             "", "Reference character LM (4 layers, d=128, context 1024, batch 4), AdamW step included; "
             f"{args.warmup} warm-up steps, then the mean of {args.steps}.", "",
             "| variant | eager softq attention (s/step) | fast path (s/step) | speed-up |", "|---|---|---|---|"]
    for name, attention in VARIANTS.items():
        eager = seconds_per_step(attention, False, args.steps, args.warmup)
        fast = seconds_per_step(attention, True, args.steps, args.warmup)
        print(f"{name}: eager {eager:.2f} s/step, fast {fast:.2f} s/step", flush=True)
        lines.append(f"| {name} | {eager:.2f} | {fast:.2f} | {eager / fast:.1f}x |")
    lines += ["", "vanilla 'eager' is Hugging Face's eager attention, its fast path is SDPA."]
    write_atomic(args.output, "\n".join(lines) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
