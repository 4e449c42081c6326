"""``reference.py train``: train a reference workload (optionally with an attention fix), checkpointed and resumable.

    python benchmarks/reference.py train --model lm --softmax clipped --steps 1000 --out runs/lm-clipped
    python benchmarks/reference.py train --model lm --softmax clipped --steps 1000 --out runs/lm-clipped --resume
    python benchmarks/reference.py train --model lm --finetune-gated ~/.cache/softq/lm-gpt2-reference-vanilla-seed0-steps800-v1 \
        --pi 0.5 --steps 100 --out runs/lm-to-gated

The run writes ``<out>/checkpoint.pt`` every ``--checkpoint-every`` steps
(atomically) and, when finished, the model directory ``<out>/model`` (loadable
with ``workloads.load_model``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from softq._files import check_writable_parent
from softq.cli import positive_int

# --alpha: clipped softmax's gamma = -alpha / T; train trains from scratch: alpha < 1 (CLIPPED_ALPHA, 4,
# kills every row of a fresh model)
from softq.softmax import CLIPPED_ALPHA_FROM_SCRATCH as DEFAULT_ALPHA
from workloads.models import LM_FAMILIES

DEFAULT_PI = 0.5  # --pi: gated attention's initial gate opening
DEFAULT_LR = 3e-4  # --lr of --finetune-gated


def attention_from_args(args: argparse.Namespace) -> dict | None:
    """The ``configure_attention`` keywords the flags ask for (None = vanilla)."""
    from workloads import attention_options

    if args.alpha is not None and args.softmax != "clipped":
        raise ValueError(f"--alpha sets the clipped softmax's gamma = -alpha / T; it does nothing with "
                         f"--softmax {args.softmax or 'softmax'}: add --softmax clipped or drop --alpha")
    if args.pi is not None and not args.gated:
        raise ValueError("--pi sets the gates' initial opening; it does nothing without --gated (or --finetune-gated)")
    if args.lr is not None:
        raise ValueError("--lr is the learning rate of --finetune-gated; training from scratch follows the "
                         "workload's own schedule: drop --lr")
    return attention_options(args.softmax, DEFAULT_ALPHA if args.alpha is None else args.alpha, args.gated,
                             DEFAULT_PI if args.pi is None else args.pi)


def _finetune_gated(args: argparse.Namespace) -> int:
    """Convert a saved model to gated attention (function-preserving) and fine-tune it briefly."""
    import workloads as W
    from workloads.resumable import finetune_to_gated

    if args.resume or args.stop_after:
        raise ValueError("--finetune-gated runs are short and not checkpointed; drop --resume/--stop-after")
    if args.softmax is not None or args.alpha is not None:
        raise ValueError("--finetune-gated converts the saved model's attention to gates and keeps its softmax; "
                         "drop --softmax/--alpha (train a variant from scratch with them)")
    model_dir = Path(args.out) / "model"
    if Path(args.out).is_file() or model_dir.exists():  # before the fine-tune, not after it
        raise FileExistsError(f"--out {args.out} is a file or already holds model/; give another --out")
    check_writable_parent(model_dir)  # a file further up (--out a_file/run)
    model = W.load_model(args.finetune_gated)
    if model.config.model_type != ("vit" if args.model == "vit" else args.family):
        wanted = "--model vit" if args.model == "vit" else f"--model lm --family {args.family}"
        raise ValueError(f"{args.finetune_gated} holds a {model.config.model_type} model, not {wanted}")
    steps = 100 if args.steps is None else args.steps
    pi = DEFAULT_PI if args.pi is None else args.pi
    model, losses = finetune_to_gated(model, steps, pi, lr=DEFAULT_LR if args.lr is None else args.lr, seed=args.seed,
                                      progress=not args.quiet)
    return _finish(args, model, steps, f"gated (pi_init {pi}) fine-tuned {steps} steps from {args.finetune_gated}")


def _finish(args: argparse.Namespace, model: object, step: int, what: str) -> int:
    """Evaluate on held-out data and save ``<out>/model`` (loadable with ``workloads.load_model``)."""
    import workloads as W

    out = Path(args.out)
    if args.model == "lm":
        tokenizer = W.CharTokenizer()
        ctx = W.lm_context(model.config)
        metric = f"heldout perplexity {W.perplexity(model, W.lm_eval_inputs(ctx, None, tokenizer)):.3f}"
        W.save_model(model, out / "model", tokenizer, {"steps": step})
    else:
        size = model.config.image_size
        metric = f"heldout top-1 {W.top1(model, W.vit_eval_inputs(size), W.digits_data('heldout', size)[1]):.2f}%"
        W.save_model(model, out / "model", None, {"steps": step})
    print(f"{what}: {metric}; model saved to {out / 'model'}")
    return 0


def _train(args: argparse.Namespace) -> int:
    import torch

    import workloads as W
    from workloads.resumable import train_resumable
    from softq.calib.train import load_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.finetune_gated:
        return _finetune_gated(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():  # before any step: the first checkpoint would fail after training
        raise NotADirectoryError(f"--out {out} is a file; give a directory for the checkpoint and the model")
    check_writable_parent(out / "checkpoint.pt")  # a file further up (--out a_file/run): also before any step
    if (out / "model").exists() and not (out / "checkpoint.pt").is_file():  # the finished run would replace it
        raise FileExistsError(f"--out {out} already holds model/ and no checkpoint.pt to resume; give another --out")
    if args.resume and args.softmax == "softmax" and (out / "checkpoint.pt").is_file():
        saved = load_checkpoint(out / "checkpoint.pt")["run"]["attention"]
        if saved and saved.get("softmax"):  # an explicit exact softmax is a mismatch, not "as saved"
            raise ValueError(f"--resume: checkpoint was trained with softmax={saved['softmax']!r}, not 'softmax'")
    model, step = train_resumable(
        args.model, size=args.size, seed=args.seed, steps=args.steps, attention=attention_from_args(args),
        family=args.family, checkpoint=out / "checkpoint.pt", checkpoint_every=args.checkpoint_every,
        resume=args.resume, stop_after=args.stop_after, progress=not args.quiet,
    )
    run = load_checkpoint(out / "checkpoint.pt")["run"]  # what was trained (a resumed run: the saved settings)
    total = run["steps"]
    if step < total:
        print(f"stopped at step {step}/{total}; continue with --resume (checkpoint {out / 'checkpoint.pt'})")
        return 0
    return _finish(args, model, step, f"trained {args.model} {args.size} "
                   f"{W.variant_name(run['attention'])} to step {step}")


def register(subparsers: argparse._SubParsersAction) -> dict[str, argparse.ArgumentParser]:
    p = subparsers.add_parser(
        "train", help="train a reference LM or ViT (optionally clipped softmax / gated attention), resumable",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", choices=("lm", "vit"), required=True, help="character LM or digits ViT")
    p.add_argument("--family", choices=LM_FAMILIES, default="gpt2", help="LM family")
    p.add_argument("--size", choices=("reference", "tiny"), default="reference")
    p.add_argument("--softmax", default=None, help="softq softmax variant (e.g. clipped); default exact softmax")
    p.add_argument("--alpha", type=float, default=None, help=f"clipped softmax: gamma = -alpha / T (default {DEFAULT_ALPHA:g})")
    p.add_argument("--gated", action="store_true", help="gated attention")
    p.add_argument("--pi", type=float, default=None, help=f"gated attention: initial gate opening pi_init (default {DEFAULT_PI:g})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=positive_int, default=None, help="total steps of the schedule (default: size's budget)")
    p.add_argument("--out", required=True, help="run directory (checkpoint.pt and, when done, model/)")
    p.add_argument("--checkpoint-every", type=positive_int, default=100, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    p.add_argument("--stop-after", type=positive_int, default=None, help="stop this invocation after N steps (resume later)")
    p.add_argument("--finetune-gated", metavar="MODEL_DIR", default=None,
                   help="instead of training from scratch: convert this saved model to gated attention "
                        "(function-preserving) and fine-tune it for --steps (default 100) steps at --lr")
    p.add_argument("--lr", type=float, default=None, help=f"learning rate of --finetune-gated (default {DEFAULT_LR:g})")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_train)
    return {"train": p}
