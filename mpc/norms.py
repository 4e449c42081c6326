"""RMSNorm under MPC: found by what a module computes, run as one ``softq_mpc::rms_norm`` node.

Llama, Qwen, Mistral, Phi-3, Gemma and T5 normalise with ``x / sqrt(mean(x^2) + eps)`` times a
gain (``w``, or ``1 + w`` in Gemma), each family in a module of its own.  Traced as it is, the
normaliser is an ``rsqrt`` of a secret mean square multiplied into ``x``: two roundings of a
small number.  :func:`rms_norms` finds these modules from their behaviour (one parameter, a 1-D
``weight``, and an output equal to the formula on a probe, for one of the module's float
attributes as ``eps``), and inside :func:`swapped` each is replaced by :class:`MPCRMSNorm`,
which computes the same function and traces to one custom op; under MPC that op is
:func:`softq.mpc.approx.layer_norm` with ``center=False`` (a comparison-selected normaliser
and a polynomial, range-safe for massive activations).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_FOUND = "_softq_mpc_rms_norms"  # {path: (eps, offset)}, cached on the model instance


def _plain(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def rms_norm(x: Any, weight: Any, eps: float, offset: float) -> Any:
    """``x / sqrt(mean(x^2) + eps) * (offset + weight)`` over the last dim (plaintext or MPCTensor)."""
    if _plain(x):
        xf = x.float()
        out = xf * (xf.square().mean(-1, keepdim=True) + eps).rsqrt()
        return (out * (weight.float() + offset)).to(x.dtype)
    from softq.mpc.approx import layer_norm

    return layer_norm(x, weight + offset if offset else weight, eps, center=False)


@torch.library.custom_op("softq_mpc::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return rms_norm(x, weight, eps, offset).clone()


@_rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return torch.empty_like(x)


class MPCRMSNorm(nn.Module):
    """Stands in for a model's RMSNorm while it is exported for MPC (same weight, same function)."""

    def __init__(self, weight: nn.Parameter, eps: float, offset: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.softq_mpc.rms_norm(x, self.weight, self.eps, self.offset)


def _eps_candidates(module: nn.Module) -> list[float]:
    values = [v for v in vars(module).values() if isinstance(v, float) and 0.0 < v < 0.1]
    return values or [torch.finfo(torch.float32).eps]


def rms_form(module: nn.Module) -> tuple[float, float] | None:
    """``(eps, offset)`` when ``module`` computes RMSNorm with gain ``offset + weight``; None otherwise.

    The probe is off-centre (a LayerNorm without bias differs there) and spans four decades of scale
    (so ``eps`` is told apart from its neighbours)."""
    params = dict(module.named_parameters())
    weight = params.get("weight")
    if len(params) != 1 or weight is None or weight.dim() != 1 or any(True for _ in module.children()):
        return None
    n = weight.shape[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, n, generator=g) * torch.tensor([1e-3, 0.1, 1.0, 30.0]).view(4, 1, 1) + 0.3
    try:
        with torch.no_grad():
            out = module(x.to(weight.dtype))
    except Exception:  # a module with another signature is not a norm
        return None
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None
    out, w = out.double(), weight.detach().double()
    for eps in _eps_candidates(module):
        xd = x.double()
        normed = xd * (xd.square().mean(-1, keepdim=True) + eps).rsqrt()
        for offset in (0.0, 1.0):
            ref = normed * (w + offset)
            if (out - ref).abs().max() <= 1e-3 * max(float(ref.abs().max()), 1e-6):
                return float(eps), offset
    return None


def rms_norms(model: nn.Module) -> dict[str, tuple[float, float]]:
    """``{path: (eps, offset)}`` of every RMSNorm module of ``model`` (cached on the model)."""
    found = model.__dict__.get(_FOUND)
    modules = dict(model.named_modules())
    if found is not None and all(p in modules for p in found):
        return found
    found = {}
    for path, module in modules.items():
        if isinstance(module, MPCRMSNorm):
            found[path] = (module.eps, module.offset)
            continue
        form = rms_form(module)
        if form is not None:
            found[path] = form
    model.__dict__[_FOUND] = found
    return found


@contextlib.contextmanager
def swapped(model: nn.Module) -> Iterator[None]:
    """Within the block, every RMSNorm of ``model`` is an :class:`MPCRMSNorm` (put back after)."""
    saved: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for path, (eps, offset) in rms_norms(model).items():
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            original = getattr(parent, name)
            if isinstance(original, MPCRMSNorm):
                continue
            setattr(parent, name, MPCRMSNorm(original.weight, eps, offset))
            saved.append((parent, name, original))
        yield
    finally:
        for parent, name, original in reversed(saved):
            setattr(parent, name, original)
