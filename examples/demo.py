"""softq demo: quantize the reference models to INT8 (softmax included) and evaluate them.

The first run trains the two reference models (a character LM on Python's own
documentation, a ViT on scikit-learn's digits; a few minutes each on 2 cores) and
caches them in $SOFTQ_CACHE (default ~/.cache/softq); later runs reuse them.

    python examples/demo.py            # what `make demo` runs
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import softq
from softq.quant.tasks import reference_task


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def quantize_and_compare(name: str, eval_limit: int | None) -> tuple[object, torch.nn.Module]:
    task = reference_task(name, eval_limit=eval_limit)
    config = softq.QuantConfig(bias_correction="head_row")
    start = time.time()
    qmodel = softq.quantize(task.model, task.calib, config)
    fp, q = task.evaluate(), task.evaluate(qmodel)
    unit = "%" if task.higher_is_better else ""
    print(f"{task.name}: float {task.metric_name} {fp:.3f}{unit}  ->  {config.describe()} {q:.3f}{unit}"
          f"  (quantized in {time.time() - start:.0f}s)")
    return task, qmodel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval-limit", type=int, default=12, help="held-out LM windows to evaluate (default 12)")
    args = parser.parse_args()
    torch.manual_seed(0)

    step("1. INT8 language model: W8A8 with 8-bit softmax and softmax bias correction")
    quantize_and_compare("lm", args.eval_limit)

    step("2. INT8 vision transformer (digits)")
    quantize_and_compare("vit", None)

    step("3. Encrypted inference (CrypTen, 2 party processes on loopback): reference ViT")
    from softq.mpc.demo import encrypted_demo

    encrypted_demo(samples=16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
