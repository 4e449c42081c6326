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


# ---------------------------------------------------------------------------
# Explicit input smoothing: any Linear, post-LN models included
# ---------------------------------------------------------------------------

INPUT_SCALE_ATTR = "softq_input_scale"


@dataclass
class InputGroup:
    """Linear layers that read the same input tensor (Q, K and V read one), and that input's channel ranges."""

    linears: list[tuple[str, nn.Linear]]
    act_absmax: torch.Tensor

    def channel_ratio(self) -> float:
        """Widest channel's max |x| over the median channel's: how outlier-dominated this input is."""
        return float(self.act_absmax.max() / self.act_absmax.median().clamp_min(1e-12))


def find_input_groups(model: nn.Module, batches: list[Batch]) -> list[InputGroup]:
    """Every group of untied Linear layers sharing one input tensor, with per-channel max |x| over ``batches``."""
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear and not _tied(model, m.weight)}
    members: dict[str, str] = {}  # linear -> first linear that read the same tensor
    absmax: dict[str, torch.Tensor] = {}
    first_pass = {"on": True}
    live: dict[int, tuple[str, torch.Tensor]] = {}
    handles = []

    def on_linear(name: str):
        def hook(_m, inp):
            x = inp[0]
            if first_pass["on"]:
                owner = live.get(id(x))
                if owner is not None and owner[1] is x:
                    members[name] = owner[0]
                else:
                    live[id(x)] = (name, x)
                    members[name] = name
            if members.get(name) == name:
                amax = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()
                absmax[name] = amax if name not in absmax else torch.maximum(absmax[name], amax)
        return hook

    for name, m in linears.items():
        handles.append(m.register_forward_pre_hook(on_linear(name)))
    try:
        run_batches(model, batches[:1])
        first_pass["on"] = False
        live.clear()
        if len(batches) > 1:
            run_batches(model, batches[1:], desc="input smoothing stats")
    finally:
        for h in handles:
            h.remove()
    groups: dict[str, list[tuple[str, nn.Linear]]] = {}
    for name, lead in members.items():
        groups.setdefault(lead, []).append((name, linears[name]))
    return [InputGroup(lins, absmax[lead]) for lead, lins in groups.items()]


def smooth_inputs(model: nn.Module, batches: list[Batch], alpha: float, min_ratio: float = 0.0,
                  exclude: tuple[str, ...] = ()) -> list[str]:
    """SmoothQuant without a LayerNorm to fold into.  If any input group's channel ratio exceeds
    ``min_ratio`` (else nothing is done: a model without outlier channels keeps its weights), then for
    every input group ``s_j = max|X_j|^alpha / max|W_{:,j}|^(1-alpha)``; the weight columns are multiplied by
    ``s`` and ``1/s`` is stored on each Linear (``softq_input_scale``), which softq's quantized Linear
    applies to its input before quantizing it (one elementwise Mul; shared by Q, K and V, so the export
    keeps one Mul and one QuantizeLinear for them).  The float function is unchanged.  Returns the
    names of the smoothed Linear layers.  Groups with a Linear layer matching ``exclude`` (the layers
    ``QuantConfig.exclude`` keeps float) are left alone: a float Linear would need the input scale as a
    hook, which a saved model does not keep."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"input smoothing alpha must be in [0, 1], got {alpha}")
    done: list[str] = []
    groups = [g for g in find_input_groups(model, batches)
              if not any(pattern in name for name, _ in g.linears for pattern in exclude)]
    # all groups or none: on all-MiniLM-L6-v2 smoothing only the groups past 16x gives embedding
    # cosine 0.9931, smoothing every group 0.9962
    if not groups or max(g.channel_ratio() for g in groups) <= min_ratio:
        return done
    with torch.no_grad():
        for group in groups:
            w_absmax = torch.stack([lin.weight.abs().amax(0) for _, lin in group.linears]).amax(0).float()
            s = (group.act_absmax.clamp_min(1e-5).pow(alpha) / w_absmax.clamp_min(1e-5).pow(1 - alpha)).clamp_min(1e-5)
            for name, lin in group.linears:
                lin.weight.mul_(s.to(lin.weight.dtype))
                previous = getattr(lin, INPUT_SCALE_ATTR, None)
                inv = (1.0 / s).to(lin.weight.dtype)
                setattr(lin, INPUT_SCALE_ATTR, inv if previous is None else previous * inv)
                if previous is None:  # the float Linear applies it too (softq's QLinear takes it over)
                    lin.register_forward_pre_hook(_scale_input)
                done.append(name)
    return done


def _scale_input(module: nn.Linear, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (inputs[0] * getattr(module, INPUT_SCALE_ATTR),) + tuple(inputs[1:])
