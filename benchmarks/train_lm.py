"""Train (or load from the cache) softq's reference character LM and print its held-out perplexity.

    python benchmarks/train_lm.py                       # vanilla GPT-2 style, reference size
    python benchmarks/train_lm.py --softmax clipped     # clipped softmax (alpha 0.5)
    python benchmarks/train_lm.py --gated --pi 0.25     # gated attention
    python benchmarks/train_lm.py --family llama        # Llama architecture (RoPE, GQA, RMSNorm, SwiGLU)
    python benchmarks/train_lm.py --size tiny --steps 50

The first run trains (about 10 minutes on 2 CPU cores for the vanilla reference
model) and caches the model under $SOFTQ_CACHE (default ~/.cache/softq); later
runs load it.  --force retrains.
"""

from __future__ import annotations

import argparse
import sys
import time

import workloads as W


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    W.add_training_args(parser, W.LM_SIZES)
    parser.add_argument("--family", choices=W.LM_FAMILIES, default="gpt2")
    args = parser.parse_args(argv)
    attention = W.attention_from_args(parser, args)
    start = time.time()
    model, tokenizer = W.reference_lm(args.seed, attention, args.family,
                                      size=args.size, steps=args.steps, force=args.force)
    elapsed = time.time() - start
    context = W.LM_SIZES[args.size]["context"]
    ppl = W.perplexity(model, W.lm_eval_inputs(context, None, tokenizer))
    print(f"{args.family} {args.size} {W.variant_name(attention)} seed {args.seed}: "
          f"heldout perplexity {ppl:.3f} (context {context}; {elapsed:.0f} s to train or load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
