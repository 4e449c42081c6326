"""Train (or load from the cache) softq's reference character LM and print its held-out perplexity.

    python examples/train_lm.py                       # vanilla GPT-2 style, reference size
    python examples/train_lm.py --softmax clipped     # clipped softmax (alpha 4)
    python examples/train_lm.py --gated --pi 0.25     # gated attention
    python examples/train_lm.py --size tiny --steps 50

The first run trains (about 10 minutes on 2 CPU cores for the vanilla reference
model) and caches the model under $SOFTQ_CACHE (default ~/.cache/softq); later
runs load it.  --force retrains.
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
    parser.add_argument("--size", choices=sorted(W.LM_SIZES), default="reference")
    parser.add_argument("--family", choices=("gpt2", "opt"), default="gpt2")
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
    model, tokenizer = W.reference_lm(args.seed, W.attention_options(args.softmax, args.alpha, args.gated, args.pi), args.family,
                                      size=args.size, steps=args.steps, force=args.force)
    elapsed = time.time() - start
    context = W.LM_SIZES[args.size]["context"]
    ppl = W.perplexity(model, W.lm_eval_inputs(context, None, tokenizer))
    print(f"{args.family} {args.size} {W.variant_name(W.attention_options(args.softmax, args.alpha, args.gated, args.pi))} seed {args.seed}: "
          f"heldout perplexity {ppl:.3f} (context {context}; {elapsed:.0f} s to train or load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
