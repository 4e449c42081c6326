"""Reference-model training runs: a trained reference model converted to gated attention and fine-tuned, and
resumable checkpointed training from scratch (``benchmarks/reference.py train``).

Both reuse the workloads' single training loop, so a variant trained here is trained exactly like the baseline.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import workloads as W
from softq.calib.train import convert_to_gated, load_checkpoint, save_checkpoint


def _batches_for(model: nn.Module, seed: int, batch_size: int | None, tokenizer: W.CharTokenizer | None) -> Iterator[dict]:
    family = model.config.model_type
    if family == "vit":
        size = model.config.image_size
        return W.vit_batches("train", size, batch_size or 64, seed)
    if family in W.LM_FAMILIES:
        tokenizer = tokenizer or W.CharTokenizer()
        return W.lm_batches("train", W.lm_context(model.config), batch_size or 4, seed, tokenizer)
    raise ValueError(f"finetune_to_gated trains softq's {'/'.join(W.LM_FAMILIES)}/vit workloads, not '{family}'")


def finetune_to_gated(
    model: nn.Module,
    steps: int,
    pi_init: float = 0.5,
    *,
    lr: float = 3e-4,
    seed: int = 0,
    batch_size: int | None = None,
    batches: Iterator[dict[str, torch.Tensor]] | None = None,
    tokenizer: W.CharTokenizer | None = None,
    progress: bool = True,
) -> tuple[nn.Module, list[float]]:
    """Convert a trained softq workload model to gated attention, then fine-tune it briefly.

    ``batches`` defaults to the workload's training data (character windows for
    GPT-2/OPT, augmented digits for ViT).  Returns the model (in place) and the
    per-step losses.  ``steps=0`` only converts.
    """
    convert_to_gated(model, pi_init)
    if steps == 0:
        return model, []
    torch.manual_seed(seed)
    batches = batches or _batches_for(model, seed, batch_size, tokenizer)
    losses = W.run_training(model, batches, steps, lr, warmup=max(1, steps // 10), progress=progress,
                            desc="finetune gated")
    return model, losses


def _model_from_checkpoint(payload: dict[str, Any]) -> nn.Module:
    from transformers import AutoConfig

    from softq.attention import configure_from_config

    config_dict = dict(payload["config"])
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    model = W.build_model(config)
    configure_from_config(model)
    model.load_state_dict(payload["state_dict"], strict=True)
    return model


def train_resumable(
    kind: str,
    *,
    size: str = "reference",
    seed: int = 0,
    steps: int | None = None,
    attention: dict[str, Any] | None = None,
    family: str = "gpt2",
    checkpoint: str | Path,
    checkpoint_every: int = 100,
    resume: bool = False,
    stop_after: int | None = None,
    progress: bool = True,
) -> tuple[nn.Module, int]:
    """Train a workload ``kind`` ("lm" or "vit") with atomic checkpoints every ``checkpoint_every`` steps.

    With ``resume`` the run continues from the checkpoint's step with the saved
    weights, optimizer state and settings; the data stream is fast-forwarded, so
    an interrupted and resumed run ends bit-identical to an uninterrupted one.
    ``stop_after`` ends this invocation after that many steps (train in chunks).
    Returns the model and the step reached.
    """
    W.data.check_choice("model kind", kind, ("lm", "vit"))
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be at least 1, got {checkpoint_every}")
    sizes, budgets = (W.LM_SIZES, W.LM_BUDGETS) if kind == "lm" else (W.VIT_SIZES, W.VIT_BUDGETS)
    W.data.check_choice(f"{kind} size", size, sizes)
    run = {"kind": kind, "size": size, "seed": seed, "family": family if kind == "lm" else "vit",
           "attention": attention, "steps": int(steps or budgets[size]["steps"]),
           "batch_size": int(budgets[size]["batch_size"]), "lr": float(budgets[size]["lr"])}
    checkpoint = Path(checkpoint)
    if resume:
        payload = load_checkpoint(checkpoint)
        saved = payload["run"]
        for key in ("kind", "size", "seed", "family", "attention"):
            if saved[key] != run[key] and not (key == "attention" and attention is None):
                raise ValueError(f"--resume: checkpoint was trained with {key}={saved[key]!r}, not {run[key]!r}")
        if steps is not None and int(steps) != saved["steps"]:
            raise ValueError(f"--resume: checkpoint schedule has {saved['steps']} steps, not {steps}")
        run = saved
        model = _model_from_checkpoint(payload)
        start, losses = int(payload["step"]), list(payload["losses"])
    else:
        if checkpoint.exists():
            raise FileExistsError(f"checkpoint {checkpoint} exists; pass --resume to continue it or remove it")
        torch.manual_seed(seed)
        if kind == "lm":
            model = W.build_model(W.lm_config(size, run["family"]))
        else:
            model = W.build_model(W.vit_config(size))
        if attention:
            from softq.attention import configure_attention

            configure_attention(model, **attention)
        start, losses = 0, []
    total = run["steps"]
    optimizer = W.training.make_optimizer(model, run["lr"], 0.1 if kind == "lm" else 0.05)
    if resume:
        optimizer.load_state_dict(payload["optimizer"])
    if kind == "lm":
        batches = W.lm_batches("train", W.lm_context(model.config), run["batch_size"], seed, W.CharTokenizer())
    else:
        batches = W.vit_batches("train", model.config.image_size, run["batch_size"], seed)
    for _ in range(start):  # fast-forward the data stream to where the checkpoint stopped
        next(batches)
    end = total if stop_after is None else min(total, start + int(stop_after))
    if start >= end:
        return model.eval(), start

    def on_step(step: int, model: nn.Module, optimizer: torch.optim.Optimizer, step_losses: list[float]) -> None:
        if step % checkpoint_every == 0 or step == end:
            save_checkpoint(checkpoint, model, optimizer, step, losses + step_losses, run)

    W.run_training(model, batches, total, run["lr"], start_step=start, end_step=end, optimizer=optimizer,
                   progress=progress, desc=f"train {kind} {size}", on_step=on_step)
    return model.eval(), end
