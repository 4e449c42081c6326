"""Per-family adapters: the few families whose attention softq's discovery cannot see by itself.

Most Hugging Face families compute attention through ``ALL_ATTENTION_FUNCTIONS``, which
softq plugs into (``softq.models.discover``).  A family that computes its attention in
its own forward gets an adapter here that routes that computation through the same
interface call, so everything downstream (quantization points, export, MPC) sees one
form.  Adapters change no weight and keep the function the model computes.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

# model_type -> adapter(model) installing the interface call on that family's attention modules
ADAPTERS: dict[str, Callable[[nn.Module], None]] = {}


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
