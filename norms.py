"""Normalisation layers, recognised by what they compute rather than by class name.

A norm here is a module with a 1-D ``weight`` (and optionally a ``bias``) of size n that maps
``x`` (last dimension n) to ``normalise(x) * (offset + weight) + bias``, where ``normalise`` is
the layer norm (centred, ``nn.LayerNorm``, ModernBERT's bias-free one) or the RMS norm
(Llama, Qwen, Mistral, Phi-3 and T5: ``offset`` 0; Gemma: ``offset`` 1, a gain of ``1 + w``).
:func:`classify` tells the form by running the module once on a synthetic input with random
gain and bias put in for the call (so a freshly initialised Gemma norm, ``w = 0``, is told
from a Llama one), then restoring them.  :func:`fold_scale` divides a norm's output channels
by a positive vector exactly for each form (SmoothQuant), and :func:`post_ln` tells a
post-LN model (a norm's output is what its block returns, so it also feeds the residual)
from a pre-LN one on one forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_POST_LN = "_softq_post_ln"  # post_ln's answer, cached on the model instance


@dataclass(frozen=True)
class NormForm:
    """What a norm computes: ``normalise(x) * (offset + weight) + bias``."""

    centred: bool  # layer norm (x - mean); else RMS norm
    offset: float  # 0, or 1 for Gemma's (1 + w) gain
    bias: bool

    @property
    def kind(self) -> str:
        return ("LayerNorm" if self.centred else "RMSNorm") + (" (1 + w)" if self.offset else "")


def classify(module: nn.Module) -> NormForm | None:
    """The form of ``module`` if it is a norm (see the module docstring), else None.  ``nn.LayerNorm`` is known by
    its type; any other module is a candidate if its only parameters are a 1-D ``weight`` and an optional ``bias``
    of the same size and it has no children, and is run once to tell its form."""
    if isinstance(module, nn.LayerNorm):
        if not module.elementwise_affine or len(module.normalized_shape) != 1:
            return None
        return NormForm(True, 0.0, module.bias is not None)
    if next(module.children(), None) is not None:
        return None
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    if (weight is None or set(params) - {"weight", "bias"} or weight.dim() != 1 or weight.numel() < 2
            or weight.is_meta or not weight.is_floating_point() or (bias is not None and bias.shape != weight.shape)):
        return None
    n = weight.numel()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, n, generator=g) * 3 + 1  # a mean of its own: layer and RMS norms differ on it
    gain, shift = torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
    saved = [(p, p.detach().clone()) for p in (weight, bias) if p is not None]
    try:
        with torch.no_grad():
            weight.copy_(gain)
            if bias is not None:
                bias.copy_(shift)
            y = module(x.to(weight.device, weight.dtype))
    except Exception:  # noqa: BLE001 -- a module that cannot run on a plain tensor is not a norm
        return None
    finally:
        with torch.no_grad():
            for p, value in saved:
                p.copy_(value)
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    y = y.detach().float().cpu()
    tol = 1e-4 if weight.dtype == torch.float32 or weight.dtype == torch.float64 else 3e-2
    centred = x - x.mean(-1, keepdim=True)
    for is_centred, z in ((False, x), (True, centred)):
        normalised = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True))
        for offset in (0.0, 1.0):
            expected = normalised * (offset + gain) + (shift if bias is not None else 0.0)
            if torch.allclose(y, expected, rtol=tol, atol=tol * float(expected.abs().max())):
                return NormForm(is_centred, offset, bias is not None)
    return None


def find_norms(model: nn.Module) -> dict[str, tuple[nn.Module, NormForm]]:
    """name -> (module, form) of every norm in ``model``, in module order."""
    found = {}
    for name, module in model.named_modules():
        form = classify(module)
        if form is not None:
            found[name] = (module, form)
    return found


def residual_norms(model: nn.Module) -> dict[str, tuple[nn.Module, NormForm]]:
    """The norms outside the attention modules: those that read the residual stream (or, as Gemma's post-norms,
    a sublayer's output on its way into it).  Norms inside attention (Qwen3's per-head ``q_norm`` and ``k_norm``)
    are not: they normalise query and key heads."""
    from softq.models import attention_modules

    inside = tuple(name + "." for name, _ in attention_modules(model))
    return {name: v for name, v in find_norms(model).items() if not name.startswith(inside)}


def gain(module: nn.Module, form: NormForm) -> torch.Tensor:
    """The per-channel factor the norm multiplies its normalised input by (``offset + weight``)."""
    return module.weight.detach() + form.offset


def fold_scale(module: nn.Module, form: NormForm, s: torch.Tensor) -> None:
    """Divide the norm's output channels by ``s`` (positive, one per channel) in place: gain and bias over s
    (Gemma's ``1 + w``: ``w = (1 + w) / s - 1``)."""
    with torch.no_grad():
        s = s.to(module.weight.device, module.weight.dtype)
        if form.offset:
            module.weight.copy_((module.weight + form.offset) / s - form.offset)
        else:
            module.weight.div_(s)
        if form.bias:
            module.bias.div_(s)


def post_ln(model: nn.Module, batch: dict[str, torch.Tensor] | None = None) -> bool:
    """True where some transformer block returns a norm's output itself (BERT, RoBERTa, OPT-350m: post-LN):
    that output is also the residual stream the next block adds to, so no scale can fold into the norm.
    Told on one forward pass (``batch``, else :func:`softq.models.probe_inputs`) of a float model; cached on
    the model."""
    cached = model.__dict__.get(_POST_LN)
    if cached is not None:
        return cached
    from softq.models import _no_cache, probe_inputs, transformer_blocks

    blocks = transformer_blocks(model)
    norm_outputs: list[torch.Tensor] = []  # kept alive: no other tensor can take their storage meanwhile
    block_outputs: list[torch.Tensor] = []
    handles = []

    def on_norm(_m, _inp, out):
        if isinstance(out, torch.Tensor):
            norm_outputs.append(out)

    def on_block(_m, _inp, out):
        hidden = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)
        if isinstance(hidden, torch.Tensor):
            block_outputs.append(hidden)

    for _, block in blocks:
        handles.append(block.register_forward_hook(on_block))
        handles += [m.register_forward_hook(on_norm) for m, _ in find_norms(block).values()]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(**dict(batch if batch is not None else probe_inputs(model)), **_no_cache(model))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    seen = {(t.data_ptr(), t.shape, t.stride()) for t in norm_outputs}
    answer = any((t.data_ptr(), t.shape, t.stride()) in seen for t in block_outputs)
    model.__dict__[_POST_LN] = answer
    return answer
