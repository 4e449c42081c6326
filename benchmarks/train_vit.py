"""Train (or load from the cache) softq's reference digits ViT and print its held-out top-1.

    python benchmarks/train_vit.py                      # vanilla, reference size
    python benchmarks/train_vit.py --softmax clipped
    python benchmarks/train_vit.py --gated --pi 0.25

Digits come from scikit-learn (bundled, no download).  The first run trains and
caches the model under $SOFTQ_CACHE (default ~/.cache/softq); --force retrains.
"""

from __future__ import annotations

import argparse
import sys
import time

import workloads as W


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    W.add_training_args(parser, W.VIT_SIZES)
    args = parser.parse_args(argv)
    attention = W.attention_from_args(parser, args)
    start = time.time()
    model = W.reference_vit(args.seed, attention, size=args.size, steps=args.steps, force=args.force)
    elapsed = time.time() - start
    image_size = W.VIT_SIZES[args.size]["image_size"]
    acc = W.top1(model, W.vit_eval_inputs(image_size), W.digits_data("heldout", image_size)[1])
    print(f"vit {args.size} {W.variant_name(attention)} seed {args.seed}: "
          f"heldout top-1 {acc:.2f}% ({elapsed:.0f} s to train or load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
