"""Train (or load from the cache) softq's reference digits ViT and print its held-out top-1.

    python examples/train_vit.py                      # vanilla, reference size
    python examples/train_vit.py --softmax clipped
    python examples/train_vit.py --gated --pi 0.25

Digits come from scikit-learn (bundled, no download).  The first run trains and
caches the model under $SOFTQ_CACHE (default ~/.cache/softq); --force retrains.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from softq import workloads as W


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the size's budget)")
    parser.add_argument("--size", choices=sorted(W.VIT_SIZES), default="reference")
    parser.add_argument("--softmax", default=None, help="softq softmax variant to train with (e.g. clipped)")
    parser.add_argument("--alpha", type=float, default=4.0, help="clipped softmax: gamma = -alpha / T")
    parser.add_argument("--gated", action="store_true", help="train with gated attention")
    parser.add_argument("--pi", type=float, default=0.5, help="gated attention: initial gate opening")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--force", action="store_true", help="retrain even if the model is cached")
    args = parser.parse_args(argv)
    try:
        W.attention_options(args.softmax, args.alpha, args.gated, args.pi)
    except ValueError as err:
        parser.error(str(err))
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.time()
    model = W.reference_vit(args.seed, W.attention_options(args.softmax, args.alpha, args.gated, args.pi), size=args.size, steps=args.steps, force=args.force)
    elapsed = time.time() - start
    image_size = W.VIT_SIZES[args.size]["image_size"]
    acc = W.top1(model, W.vit_eval_inputs(image_size), W.digits_data("heldout", image_size)[1])
    print(f"vit {args.size} {W.variant_name(W.attention_options(args.softmax, args.alpha, args.gated, args.pi))} seed {args.seed}: "
          f"heldout top-1 {acc:.2f}% ({elapsed:.0f} s to train or load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
