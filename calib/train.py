"""Training paths for the attention fixes (issue 3): convert a trained model to gated attention, and
resumable checkpointed training runs.

Both reuse ``softq.workloads``' single training loop so a variant trained here is
trained exactly like the reference baseline.

Converting to gated attention
-----------------------------
A fresh gate is ``sigmoid(0 . x + logit(pi)) = pi`` for every token, which
would scale every head's output by ``pi`` and break a trained model.  We keep
the gate in its responsive range (bias ``logit(pi)``, not a saturated large
bias whose sigmoid has almost no gradient) and instead divide the columns of
the following output projection that read head ``h`` by ``pi``.  At conversion
``o_proj(pi * head / pi)`` equals the original exactly (up to float rounding);
fine-tuning then lets each gate move away from ``pi`` -- e.g. close on no-op
heads, the behaviour that removes outliers.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from softq import workloads as W
from softq._files import default_mode, error_line
from softq.models import attention_modules

# Attributes holding the projection right after the attention heads, per family
# (GPT-2 c_proj, OPT out_proj, ViT 5.x o_proj, DistilBERT out_lin).  BERT-like models keep it in the
# sibling ``output.dense``.
_OUT_PROJ_NAMES = ("o_proj", "out_proj", "c_proj", "out_lin")


def output_projection(model: nn.Module, attn_name: str, attn: nn.Module) -> nn.Module:
    """The layer that consumes the concatenated head outputs of attention module ``attn``."""
    for name in _OUT_PROJ_NAMES:
        layer = getattr(attn, name, None)
        if layer is not None:
            return layer
    parent_name = attn_name.rsplit(".", 1)[0] if "." in attn_name else ""
    parent = model.get_submodule(parent_name)
    dense = getattr(getattr(parent, "output", None), "dense", None)
    if dense is None:
        raise ValueError(f"cannot find the output projection of attention module '{attn_name}'")
    return dense


def _scale_head_inputs(layer: nn.Module, num_heads: int, factors: torch.Tensor) -> None:
    """Multiply the input features of ``layer`` that read head ``h`` by ``factors[h]``."""
    weight = layer.weight
    if type(layer).__name__ == "Conv1D":  # GPT-2: weight is [in, out]
        heads, factor_shape = (num_heads, -1, weight.shape[1]), (-1, 1, 1)
    elif isinstance(layer, nn.Linear):  # weight is [out, in]
        heads, factor_shape = (weight.shape[0], num_heads, -1), (1, -1, 1)
    else:
        raise ValueError(f"cannot rescale a {type(layer).__name__} output projection")
    with torch.no_grad():  # in place on the parameter (not .data): its version counter moves with it
        weight.view(heads).mul_(factors.view(factor_shape).to(weight.dtype))


@torch.no_grad()
def convert_to_gated(model: nn.Module, pi_init: float = 0.5) -> nn.Module:
    """Add gated attention to a trained model without changing its function (see module doc).

    The model's softmax variant is kept.  Raises if the model is already gated,
    because its output projection must not be rescaled twice.
    """
    from softq.attention import configure_attention

    if getattr(model, "softq_quant_config", None) is not None:  # softq.quantize's (calib does not import quant)
        raise ValueError("convert_to_gated rescales the output projections of a float model; this one is quantized "
                         "(its weight codes would change): convert the float model, then quantize it")
    if getattr(model.config, "softq_gated", False):
        raise ValueError("the model already has gated attention; convert_to_gated applies to ungated models")
    if not 0.0 < pi_init < 1.0:
        raise ValueError(f"pi_init must be in (0, 1), got {pi_init}")
    points = configure_attention(model, gated=True, gate_pi_init=pi_init)
    for (name, attn), p in zip(attention_modules(model), points):
        gate_open = torch.sigmoid(p.gate.bias.detach())  # = pi_init per head
        _scale_head_inputs(output_projection(model, name, attn), p.num_heads, 1.0 / gate_open)
    return model


def _batches_for(model: nn.Module, seed: int, batch_size: int | None, tokenizer: W.CharTokenizer | None) -> Iterator[dict]:
    family = model.config.model_type
    if family == "vit":
        size = model.config.image_size
        return W.vit_batches("train", size, batch_size or 64, seed)
    if family in ("gpt2", "opt"):
        tokenizer = tokenizer or W.CharTokenizer()
        context = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
        return W.lm_batches("train", context, batch_size or 4, seed, tokenizer)
    raise ValueError(f"finetune_to_gated trains softq's gpt2/opt/vit workloads, not '{family}'")


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


# ---------------------------------------------------------------------------
# Checkpointed, resumable training
# ---------------------------------------------------------------------------


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    losses: list[float], run: dict[str, Any]) -> Path:
    """One file holding everything needed to resume: config, weights, optimizer, step, run settings.

    Written to a temporary file in the same directory and moved into place, so a
    crash leaves the previous checkpoint intact.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": "softq-train-checkpoint-1",
        "config": model.config.to_dict(),
        "state_dict": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "losses": list(losses),
        "run": dict(run),
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(payload, fh)
        default_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - truncated, empty or not a torch file: all one answer
        raise ValueError(f"{path} cannot be read (truncated or not a softq training checkpoint: {error_line(err)})") from None
    if not isinstance(payload, dict) or payload.get("format") != "softq-train-checkpoint-1":
        raise ValueError(f"{path} is not a softq training checkpoint")
    return payload


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
        ctx = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
        batches = W.lm_batches("train", ctx, run["batch_size"], seed, W.CharTokenizer())
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
