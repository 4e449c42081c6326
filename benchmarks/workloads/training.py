"""The one training loop and the reference LM / ViT training recipes (budgets, CLI flags)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from softq.calib.schedule import lr_at, progress_bar
from softq.softmax import CLIPPED_ALPHA_FROM_SCRATCH
from workloads.data import CharTokenizer, check_choice, lm_batches, vit_batches
from workloads.models import (LM_SIZES, VIT_SIZES, _configure, attention_options, build_model, lm_config, lm_context,
                              vit_config)


# Training budgets (steps, batch size, peak learning rate) per size.  The reference LM
# budget is set by wall-clock on a shared 2-core machine, not by convergence: at 800
# steps of 4 x 1024 characters the model is just leaving the bigram plateau (its loss
# is still near the corpus bigram entropy), so more steps lower its perplexity a lot.
# Changing a budget changes the cache key (it contains the step count), so cached
# models never go stale silently.
LM_BUDGETS: dict[str, dict[str, float]] = {
    "reference": {"steps": 800, "batch_size": 4, "lr": 3e-3},
    "tiny": {"steps": 30, "batch_size": 8, "lr": 3e-3},
}
VIT_BUDGETS: dict[str, dict[str, float]] = {
    "reference": {"steps": 600, "batch_size": 64, "lr": 2e-3},
    "tiny": {"steps": 300, "batch_size": 32, "lr": 3e-3},
}


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on biases, norms or attention gates)."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2 and "gate" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and (p.ndim < 2 or "gate" in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )


@contextmanager
def _fast_attention(model: nn.Module) -> Iterator[None]:
    """Train with the fastest path that computes the same function, then switch back.

    A model without softq attention trains with PyTorch SDPA (about 3x faster than
    eager attention on CPU at context 1024); a model with a softq variant or gates
    trains through :func:`softq.attention.fast_training` (SDPA for exact softmax,
    ``torch.compile``'d variants otherwise).
    """
    if getattr(model.config, "softq_softmax", None) is not None:
        from softq.attention import fast_training

        with fast_training(model):
            yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation("eager")


def run_training(
    model: nn.Module,
    batches: Iterator[dict[str, torch.Tensor]],
    steps: int,
    lr: float,
    *,
    start_step: int = 0,
    end_step: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    warmup: int | None = None,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    progress: bool = True,
    desc: str = "train",
    on_step: Any = None,
) -> list[float]:
    """The one training loop: AdamW, warmup + cosine, gradient clipping; returns per-step losses.

    ``on_step(step, model, optimizer, losses)`` runs after every step (checkpointing).
    ``start_step``/``optimizer`` let a resumed run continue the same schedule;
    ``end_step`` stops early (the schedule still spans ``steps``).
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    optimizer = optimizer or make_optimizer(model, lr, weight_decay)
    warmup = max(1, min(100, steps // 10)) if warmup is None else max(1, warmup)
    losses: list[float] = []
    model.train()
    end_step = steps if end_step is None else min(steps, end_step)
    bar = progress_bar(range(start_step, end_step), progress, desc=desc, initial=start_step, total=steps)
    with _fast_attention(model):
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, steps, lr, warmup)
            batch = next(batches)
            loss = model(**batch).loss
            if not torch.isfinite(loss):
                raise RuntimeError(f"training diverged at step {step} (loss {float(loss)})")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip:
                nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            losses.append(loss.item())
            if progress and step % 10 == 0:
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if on_step is not None:
                on_step(step + 1, model, optimizer, losses)
    model.eval()
    return losses


def train_lm(
    size: str = "reference",
    seed: int = 0,
    steps: int | None = None,
    *,
    family: str = "gpt2",
    batch_size: int | None = None,
    lr: float | None = None,
    context: int | None = None,
    attention: dict[str, Any] | None = None,
    tokenizer: CharTokenizer | None = None,
    progress: bool = True,
    on_step: Any = None,
) -> nn.Module:
    """Train a character LM from scratch, deterministically by ``seed``; returns it in eval mode.

    ``attention`` (e.g. ``{"softmax": "clipped", "alpha": 4.0}`` or
    ``{"gated": True, "gate_pi_init": 0.25}``) configures softq attention before
    the first step, so the variant is what gets trained.  ``on_step`` is passed
    to :func:`run_training` (checkpoints, measurements during training).
    """
    check_choice("LM size", size, LM_SIZES)
    budget = LM_BUDGETS[size]
    tokenizer = tokenizer or CharTokenizer()
    torch.manual_seed(seed)
    config = lm_config(size, family, context, tokenizer.vocab_size)
    model = build_model(config)
    _configure(model, attention)
    batches = lm_batches("train", lm_context(config), int(batch_size or budget["batch_size"]), seed, tokenizer)
    run_training(model, batches, int(steps or budget["steps"]), float(lr or budget["lr"]),
                 progress=progress, desc=f"train {family} {size}", on_step=on_step)
    return model


def train_vit(
    size: str = "reference",
    seed: int = 0,
    steps: int | None = None,
    *,
    batch_size: int | None = None,
    lr: float | None = None,
    attention: dict[str, Any] | None = None,
    augment: bool = True,
    progress: bool = True,
    on_step: Any = None,
) -> nn.Module:
    """Train a digits ViT from scratch, deterministically by ``seed``; returns it in eval mode.

    ``on_step(step, model, optimizer, losses)`` runs after every step (see :func:`run_training`).
    """
    check_choice("ViT size", size, VIT_SIZES)
    budget = VIT_BUDGETS[size]
    torch.manual_seed(seed)
    config = vit_config(size)
    model = build_model(config)
    _configure(model, attention)
    batches = vit_batches("train", config.image_size, int(batch_size or budget["batch_size"]), seed, augment)
    run_training(model, batches, int(steps or budget["steps"]), float(lr or budget["lr"]),
                 weight_decay=0.05, progress=progress, desc=f"train vit {size}", on_step=on_step)
    return model


def add_training_args(parser: Any, sizes: Iterable[str]) -> None:
    """The command-line flags shared by ``benchmarks/train_lm.py`` and ``benchmarks/train_vit.py``."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the size's budget)")
    parser.add_argument("--size", choices=sorted(sizes), default="reference")
    parser.add_argument("--softmax", default=None, help="softq softmax variant to train with (e.g. clipped)")
    parser.add_argument("--alpha", type=float, default=CLIPPED_ALPHA_FROM_SCRATCH,
                        help=f"clipped softmax: gamma = -alpha / T (default {CLIPPED_ALPHA_FROM_SCRATCH:g}: from scratch, "
                             "alpha < 1 keeps a fresh model's rows alive)")
    parser.add_argument("--gated", action="store_true", help="train with gated attention")
    parser.add_argument("--pi", type=float, default=0.5, help="gated attention: initial gate opening")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--force", action="store_true", help="retrain even if the model is cached")


def attention_from_args(parser: Any, args: Any) -> dict[str, Any] | None:
    """Validate the flags of :func:`add_training_args` (a parser error on bad ones) and apply --threads."""
    try:
        attention = attention_options(args.softmax, args.alpha, args.gated, args.pi)
    except ValueError as err:
        parser.error(str(err))
    if args.threads:
        torch.set_num_threads(args.threads)
    return attention
