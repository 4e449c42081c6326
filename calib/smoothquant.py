"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the weights.

For a LayerNorm whose output feeds only Linear layers, each input channel j gets

    s_j = max|X_j|^alpha / max|W_{:, j}|^(1 - alpha)

and the LayerNorm's affine parameters are divided by s while the Linear weight
columns are multiplied by s.  The float function is unchanged; the activation the
Linear sees has flatter channels and quantizes with less error.  The division is
folded into the LayerNorm, so inference runs no extra op.

Which Linear reads which LayerNorm is discovered on a real forward pass (the
Linear's input *is* the LayerNorm's output tensor), not from a per-model table.
Post-LN models (BERT, RoBERTa) also add the LayerNorm output to the residual,
so scaling it would change the function: they have no foldable pair and the pass
says so instead of silently doing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from softq.calib.data import Batch, run_batches

# LayerNorms whose output also reaches a residual add (post-LN families).
POST_LN_FAMILIES = ("bert", "roberta")


@dataclass
class SmoothGroup:
    """One LayerNorm and the Linear layers that read its output."""

    norm_name: str
    norm: nn.LayerNorm
    linears: list[tuple[str, nn.Linear]] = field(default_factory=list)
    act_absmax: torch.Tensor | None = None


def find_norm_linear_groups(model: nn.Module, batch: Batch) -> list[SmoothGroup]:
    """LayerNorm -> Linear pairs, found by tensor identity on one forward pass."""
    # The tensors are kept alive so their ids cannot be reused during the pass.
    outputs: dict[int, tuple[str, torch.Tensor]] = {}
    readers: dict[str, list[tuple[str, nn.Linear]]] = {}
    norms = {name: m for name, m in model.named_modules() if isinstance(m, nn.LayerNorm)}
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    handles = []

    def on_norm(name: str):
        def hook(_m, _inp, out):
            outputs[id(out)] = (name, out)
        return hook

    def on_linear(name: str, module: nn.Linear):
        def hook(_m, inp):
            owner = outputs.get(id(inp[0]))
            if owner is not None and owner[1] is inp[0]:
                readers.setdefault(owner[0], []).append((name, module))
        return hook

    for name, m in norms.items():
        handles.append(m.register_forward_hook(on_norm(name)))
    for name, m in linears.items():
        handles.append(m.register_forward_pre_hook(on_linear(name, m)))
    try:
        run_batches(model, [batch])
    finally:
        for h in handles:
            h.remove()
    return [SmoothGroup(n, norms[n], readers[n]) for n in norms if n in readers]


def _tied(model: nn.Module, weight: torch.Tensor) -> bool:
    """True if ``weight`` is shared with another module (e.g. GPT-2's lm_head and embeddings)."""
    count = sum(1 for m in model.modules() for p in m.parameters(recurse=False) if p is weight)
    return count > 1


def smooth(model: nn.Module, batches: list[Batch], alpha: float = 0.5) -> list[str]:
    """Apply SmoothQuant in place; returns the names of the LayerNorms that were smoothed."""
    family = getattr(getattr(model, "config", None), "model_type", "")
    if family in POST_LN_FAMILIES:
        raise ValueError(
            f"SmoothQuant folds its scales into the LayerNorm before each Linear, but {family} is post-LN "
            "(the LayerNorm output also feeds the residual), so no scale can be folded; "
            "use smoothquant_alpha=None for this model"
        )
    groups = [g for g in find_norm_linear_groups(model, batches[0])
              if g.norm.weight is not None and not any(_tied(model, lin.weight) for _, lin in g.linears)]
    if not groups:
        raise ValueError("SmoothQuant found no LayerNorm that feeds only untied Linear layers in this model")
    handles = []

    def observe(group: SmoothGroup):
        def hook(_m, _inp, out):
            amax = out.detach().abs().reshape(-1, out.shape[-1]).amax(0).float()
            group.act_absmax = amax if group.act_absmax is None else torch.maximum(group.act_absmax, amax)
        return hook

    for g in groups:
        handles.append(g.norm.register_forward_hook(observe(g)))
    try:
        run_batches(model, batches, desc="smoothquant stats")
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        for g in groups:
            w_absmax = torch.stack([lin.weight.abs().amax(0) for _, lin in g.linears]).amax(0).float()
            s = (g.act_absmax.clamp_min(1e-5).pow(alpha) / w_absmax.clamp_min(1e-5).pow(1 - alpha)).clamp_min(1e-5)
            s = s.to(g.norm.weight.dtype)
            g.norm.weight.div_(s)
            if g.norm.bias is not None:
                g.norm.bias.div_(s)
            for _, lin in g.linears:
                lin.weight.mul_(s)
    return [g.norm_name for g in groups]
