"""Training helpers for the attention fixes: convert a trained model to gated attention, and write or read an
atomic training checkpoint (what :mod:`softq.calib.outlier_finetune` resumes from).

Converting to gated attention
-----------------------------
A fresh gate is ``sigmoid(0 . x + logit(pi)) = pi`` for every token, which
would scale every head's output by ``pi`` and break a trained model.  We keep
the gate in its responsive range (bias ``logit(pi)``, not a saturated large
bias whose sigmoid has almost no gradient) and instead divide the columns of
the following output projection that read head ``h`` by ``pi`` (the Linear that reads the heads' output, found
on a probe forward: :func:`output_projections`).  At conversion
``o_proj(pi * head / pi)`` equals the original exactly (up to float rounding);
fine-tuning then lets each gate move away from ``pi`` -- e.g. close on no-op
heads, the behaviour that removes outliers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from softq._files import atomic_file, error_line
from softq.models import attention_modules

def _projection_layer(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # GPT-2's transposed Linear


@torch.no_grad()
def output_projections(model: nn.Module) -> list[nn.Module]:
    """The layer that consumes the concatenated head outputs of each attention module, in order, found on one probe
    forward (``softq.models.probe_inputs``): the Linear whose input shares its memory with what softq's attention
    function returned for that module (every family flattens the [b, s, heads, head_dim] output by a view), inside
    the module (Llama's ``o_proj``) or after it (BERT's ``output.dense``)."""
    from softq import attention as A
    from softq.models import _no_cache, probe_inputs

    modules = [m for _, m in attention_modules(model)]
    outputs: dict[int, int] = {}  # storage address of an attention output -> index of its module
    alive: list[torch.Tensor] = []  # (kept so that no later tensor reuses an address)
    found: dict[int, nn.Module] = {}
    index = {id(m): i for i, m in enumerate(modules)}
    function = A.softq_attention

    def recording(module: nn.Module, *args, **kwargs):
        out = function(module, *args, **kwargs)
        if id(module) in index:
            outputs[out[0].untyped_storage().data_ptr()] = index[id(module)]
            alive.append(out[0])
        return out

    def reader(layer: nn.Module, inputs: tuple) -> None:
        if inputs and isinstance(inputs[0], torch.Tensor):
            i = outputs.get(inputs[0].untyped_storage().data_ptr())
            if i is not None:
                found.setdefault(i, layer)

    from transformers import AttentionInterface

    handles = [m.register_forward_pre_hook(reader) for m in model.modules() if _projection_layer(m)]
    was = model.training
    model.eval()
    AttentionInterface.register(A.ATTN_IMPLEMENTATION, recording)
    try:
        model(**probe_inputs(model), **_no_cache(model))
    finally:
        AttentionInterface.register(A.ATTN_IMPLEMENTATION, function)
        model.train(was)
        for h in handles:
            h.remove()
    missing = [i for i in range(len(modules)) if i not in found]
    if missing:
        names = [n for n, _ in attention_modules(model)]
        raise ValueError(f"cannot find the output projection of attention module '{names[missing[0]]}': no Linear "
                         "reads its heads' output")
    return [found[i] for i in range(len(modules))]


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
    configure_attention(model)
    projections = output_projections(model)
    points = configure_attention(model, gated=True, gate_pi_init=pi_init)
    for projection, p in zip(projections, points):
        gate_open = torch.sigmoid(p.gate.bias.detach())  # = pi_init per head
        _scale_head_inputs(projection, p.num_heads, 1.0 / gate_open)
    return model


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
    with atomic_file(path, "wb") as fh:
        torch.save(payload, fh)
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
