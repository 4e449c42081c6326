"""Per-family adapters: the few families whose attention softq's discovery cannot see by itself.

Most Hugging Face families compute attention through ``ALL_ATTENTION_FUNCTIONS``, which
softq plugs into (``softq.models.discover``).  A family that computes its attention in
its own forward gets an adapter here that routes that computation through the same
interface call, so everything downstream (quantization points, export, MPC) sees one
form.  Adapters change no weight and keep the function the model computes.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

PROJECTIONS = ("q", "k", "v", "o")  # MPNet's self-attention Linears


def _projection_modules(model: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """The modules whose children ``names`` are all Linears: a family's self-attention, found by structure."""
    return [m for m in model.modules()
            if all(isinstance(getattr(m, n, None), nn.Linear) and n in m._modules for n in names)]


def eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                    **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's eager attention ([b, s, h, d] out, probabilities): what "eager" selects for an adapted
    family (``ALL_ATTENTION_FUNCTIONS`` has no entry for it; each family's module keeps its own)."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = nn.functional.softmax(scores, dim=-1)
    out = torch.matmul(nn.functional.dropout(probs, p=dropout, training=module.training), value)
    return out.transpose(1, 2).contiguous(), probs


def _attention_function(config: Any) -> Callable[..., tuple[torch.Tensor, Any]]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = config._attn_implementation
    return eager_attention if name in (None, "eager") else ALL_ATTENTION_FUNCTIONS[name]


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: attend) as the additive float mask a position bias can be added to."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros((), dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


def _mpnet_forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_bias: torch.Tensor | None = None, output_attentions: bool = False,
                   **_: Any) -> tuple[torch.Tensor, ...]:
    """``MPNetSelfAttention.forward`` through the attention interface: the relative position bias is added to the
    additive mask (T5 passes its own bias the same way), ``scaling`` is 1/sqrt(head size).  A function marked
    ``takes_position_bias`` gets the bias as its own argument instead: under MPC the bias is secret (a lookup in
    the secret bias table at public buckets) and the mask public, and a sum of the two could no longer say which
    keys are masked without a secret comparison."""
    shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
    q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q, self.k, self.v))
    function = _attention_function(self.config)
    mask, extra = _additive(attention_mask, q.dtype), {}
    if position_bias is not None and getattr(function, "takes_position_bias", False):
        extra["position_bias"] = position_bias.to(q.dtype)  # kept apart from the public mask (softq.mpc)
    elif position_bias is not None:
        bias = position_bias.to(q.dtype)
        mask = bias if mask is None else mask + bias
    out, probs = function(self, q, k, v, mask, scaling=self.attention_head_size ** -0.5,
                          dropout=self.dropout.p if self.training else 0.0, **extra)
    o = self.o(out.reshape(*hidden_states.shape[:-1], -1))
    return (o, probs) if output_attentions else (o,)


def adapt_mpnet(model: nn.Module) -> None:
    """Route each MPNet self-attention (the modules with Linear children q, k, v, o) through the interface call."""
    for module in _projection_modules(model, PROJECTIONS):
        if getattr(module.forward, "__func__", None) is not _mpnet_forward:
            module.forward = types.MethodType(_mpnet_forward, module)
        module.config = model.config
        module.is_causal = False  # (SDPA reads a module without it as causal when no mask arrives)
        module.softq_mask_bias = True  # its mask always carries the bias (softq.attention.mask_bias: a model
        # exported before any eager forward, e.g. right after softq.quant.load, must not trace it away)


# model_type -> adapter(model) installing the interface call on that family's attention modules
ADAPTERS: dict[str, Callable[[nn.Module], None]] = {"mpnet": adapt_mpnet}


def adapt(model: nn.Module) -> bool:
    """Install the adapter of ``model``'s family, if it has one (idempotent); returns whether one applied."""
    adapter = ADAPTERS.get(getattr(getattr(model, "config", None), "model_type", None))
    if adapter is None:
        return False
    adapter(model)
    return True


def is_adapted(model: nn.Module) -> bool:
    """Whether ``model``'s family computes attention through an adapter of this module."""
    return getattr(getattr(model, "config", None), "model_type", None) in ADAPTERS


def set_implementation(model: nn.Module, name: str) -> None:
    """Select the attention function ``name`` of ``ALL_ATTENTION_FUNCTIONS`` for ``model``.  An adapted family's
    modules read the config's choice themselves (transformers refuses to switch a family it sees no interface call
    in), so it is written there directly."""
    if is_adapted(model):
        model.config._attn_implementation_internal = name
    else:
        model.set_attn_implementation(name)
