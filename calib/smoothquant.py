"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the weights.

For a norm (LayerNorm or RMSNorm, ``softq.norms``) whose output feeds only Linear layers,
each input channel j gets

    s_j = max|X_j|^alpha / max|W_{:, j}|^(1 - alpha)

and the norm's gain and bias are divided by s (``softq.norms.fold_scale``, Gemma's ``1 + w``
gain included) while the Linear weight columns are multiplied by s.  The float function is
unchanged; the activation the Linear sees has flatter channels and quantizes with less error.
The division is folded into the norm, so inference runs no extra op.

Which Linear reads which norm is discovered on a real forward pass (the Linear's input *is*
the norm's output tensor), not from a per-model table.  Post-LN models (BERT, RoBERTa) also
add the norm's output to the residual (``softq.norms.post_ln`` sees a block return it), so
scaling it would change the function: they have no foldable pair and the pass says so instead
of silently doing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from softq.calib.data import Batch, run_batches
from softq.calib.observers import token_mask, token_rows
from softq.models import transformer_blocks
from softq.norms import NormForm, find_norms, fold_scale, post_ln


@dataclass
class SmoothGroup:
    """One norm and the Linear layers that read its output."""

    norm_name: str
    norm: nn.Module
    form: NormForm
    linears: list[tuple[str, nn.Linear]] = field(default_factory=list)
    act_absmax: torch.Tensor | None = None


def find_norm_linear_groups(model: nn.Module, batch: Batch) -> list[SmoothGroup]:
    """Norm -> Linear pairs, found by tensor identity on one forward pass.  A norm whose output also enters or
    leaves a transformer block is left out: that output is the residual stream too (ModernBERT's embedding norm
    feeds layer 0's attention, whose own norm is an identity, and the residual), so a scale cannot fold into it."""
    # The tensors are kept alive so their ids cannot be reused during the pass.
    outputs: dict[int, tuple[str, torch.Tensor]] = {}
    readers: dict[str, list[tuple[str, nn.Linear]]] = {}
    residual: list[torch.Tensor] = []  # block inputs and outputs
    forms = find_norms(model)
    norms = {name: m for name, (m, _) in forms.items()}
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

    def on_block_input(_m, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor):
            residual.append(hidden)

    def on_block_output(_m, _inp, out):
        hidden = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(hidden, torch.Tensor):
            residual.append(hidden)

    for name, m in norms.items():
        handles.append(m.register_forward_hook(on_norm(name)))
    for name, m in linears.items():
        handles.append(m.register_forward_pre_hook(on_linear(name, m)))
    for _, block in transformer_blocks(model):
        handles.append(block.register_forward_pre_hook(on_block_input, with_kwargs=True))
        handles.append(block.register_forward_hook(on_block_output))
    try:
        run_batches(model, [batch])
    finally:
        for h in handles:
            h.remove()
    on_residual = {outputs[id(t)][0] for t in residual if id(t) in outputs and outputs[id(t)][1] is t}
    return [SmoothGroup(n, norms[n], forms[n][1], readers[n]) for n in norms if n in readers and n not in on_residual]


def _tied(model: nn.Module, weight: torch.Tensor) -> bool:
    """True if ``weight`` is shared with another module (e.g. GPT-2's lm_head and embeddings)."""
    count = sum(1 for m in model.modules() for p in m.parameters(recurse=False) if p is weight)
    return count > 1


def _conv1d_hint(model: nn.Module) -> str:
    """What to do first where the model's Linear layers are GPT-2's Conv1D (smoothing finds nn.Linear only)."""
    if any(type(m).__name__ == "Conv1D" for m in model.modules()):
        return ("; its projections are GPT-2 Conv1D layers: call softq.models.conv1d_to_linear(model) first "
                "(softq.quantize does)")
    return ""


def smooth(model: nn.Module, batches: list[Batch], alpha: float = 0.5) -> list[str]:
    """Apply SmoothQuant in place; returns the names of the norms that were smoothed."""
    family = getattr(getattr(model, "config", None), "model_type", "")
    if post_ln(model, batches[0]):
        raise ValueError(
            f"SmoothQuant folds its scales into the norm before each Linear, but {family} is post-LN "
            "(a norm's output is what its block returns, so it also feeds the residual), so no scale can be "
            "folded; use smoothquant_alpha=None for this model"
        )
    groups = [g for g in find_norm_linear_groups(model, batches[0])
              if not any(_tied(model, lin.weight) for _, lin in g.linears)]
    if not groups:
        raise ValueError("SmoothQuant found no norm (LayerNorm or RMSNorm) that feeds only untied Linear layers in "
                         "this model" + _conv1d_hint(model))
    handles = []

    def observe(group: SmoothGroup):
        def hook(_m, _inp, out):
            rows = token_rows(out.detach(), token_mask(out)).reshape(-1, out.shape[-1])  # real tokens only
            if rows.shape[0] == 0:
                return
            amax = rows.abs().amax(0).float()
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
            fold_scale(g.norm, g.form, s)
            s = s.to(g.norm.weight.dtype)
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
    lo: torch.Tensor  # per-channel min of the input over the data seen
    hi: torch.Tensor  # per-channel max
    after_norm: bool = False  # the input is a norm's output (the tensor or a view of all of it, not a copy)

    @property
    def act_absmax(self) -> torch.Tensor:
        return self.lo.abs().maximum(self.hi.abs())

    def channel_ratio(self) -> float:
        """Widest channel's max |x| over the median channel's: how outlier-dominated this input is."""
        absmax = self.act_absmax
        return float(absmax.max() / absmax.median().clamp_min(1e-12))


class InputRecorder:
    """Records, while ``model`` runs, which of ``linears`` read the same input tensor and each input's
    per-channel min and max, with forward pre-hooks (the Linear input before anything the layer does).

    Sharing is told by tensor identity on the first model call; later calls only update the ranges, so
    the recording rides along any pass over the calibration set (softq.quantize's observation pass).
    """

    def __init__(self, model: nn.Module, linears: dict[str, nn.Linear]) -> None:
        self.linears = linears
        self.members: dict[str, str] = {}  # linear -> first linear that read the same tensor
        self.after_norm: set[str] = set()  # first linears whose input is a norm's output (softq.norms)
        self._norm_out: dict[int, torch.Tensor] = {}
        self.lo: dict[str, torch.Tensor] = {}
        self.hi: dict[str, torch.Tensor] = {}
        self.calls = 0
        self._live: dict[int, tuple[str, torch.Tensor]] = {}
        self._model = model
        self._handles: list = []
        self._norms: list[nn.Module] | None = None
        self.resume()

    def resume(self) -> None:
        """Record again after :meth:`remove` (e.g. around a copy of the model), keeping what was recorded."""
        self.remove()
        self._handles = [self._model.register_forward_pre_hook(self._next_call)]
        self._handles += [m.register_forward_pre_hook(self._hook(name)) for name, m in self.linears.items()]
        if self._norms is None:  # found once: a norm is told by running it (softq.norms.classify)
            self._norms = [m for m, _ in find_norms(self._model).values()]
        self._handles += [m.register_forward_hook(self._norm_hook) for m in self._norms]

    def _norm_hook(self, _m: nn.Module, _inp: tuple, out: torch.Tensor) -> None:
        if self.calls <= 1:
            self._norm_out[out.data_ptr()] = out  # held here: no other tensor can take this address meanwhile

    def _next_call(self, _m: nn.Module, _args: tuple) -> None:
        self.calls += 1
        self._live.clear()
        self._norm_out.clear()

    def _hook(self, name: str):  # noqa: ANN202
        def hook(_m: nn.Module, inp: tuple[torch.Tensor, ...]) -> None:
            x = inp[0]
            if self.calls <= 1 and name not in self.members:
                owner = self._live.get(id(x))
                if owner is not None and owner[1] is x:
                    self.members[name] = owner[0]
                else:
                    self._live[id(x)] = (name, x)
                    self.members[name] = name
                    if _same_values(self._norm_out.get(x.data_ptr()), x):
                        self.after_norm.add(name)
            if self.members.get(name) == name:  # real tokens' rows only (observers.valid_tokens)
                seen = token_rows(x.detach(), token_mask(x))
                flat = seen.reshape(-1, x.shape[-1]).float()
                if flat.shape[0] == 0:
                    return
                lo, hi = flat.amin(0), flat.amax(0)  # 4x faster than aminmax(dim=0) on CPU (timed ad hoc)
                if name in self.lo:
                    lo, hi = torch.minimum(self.lo[name], lo), torch.maximum(self.hi[name], hi)
                self.lo[name], self.hi[name] = lo, hi
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._live.clear()
        self._norm_out.clear()

    def groups(self, modules: dict[str, nn.Module] | None = None) -> list[InputGroup]:
        """The input groups with their ranges so far; ``modules`` (a copy's ``dict(named_modules())``) gives
        the copy's Linear layers of the same names instead of the recorded model's."""
        grouped: dict[str, list[tuple[str, nn.Linear]]] = {}
        for name, lead in self.members.items():
            grouped.setdefault(lead, []).append((name, self.linears[name] if modules is None else modules[name]))
        return [InputGroup(lins, self.lo[lead].clone(), self.hi[lead].clone(), lead in self.after_norm)
                for lead, lins in grouped.items() if lead in self.lo]


def _same_values(norm_out: torch.Tensor | None, x: torch.Tensor) -> bool:
    """``x`` is ``norm_out`` or a view of it with the same elements (GPT-2's ``view`` and ``[:, -0:]`` slice
    between ``ln_f`` and ``lm_head``): same storage address, shape and strides."""
    return (norm_out is not None and norm_out.data_ptr() == x.data_ptr() and norm_out.shape == x.shape
            and norm_out.stride() == x.stride())


def _shared_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters held by more than one module (e.g. GPT-2's lm_head and embeddings)."""
    seen: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def smoothable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Linear layers (softq's quantized ones included) whose weights are not shared with another module."""
    shared = _shared_parameters(model)
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m.weight) not in shared}


def find_input_groups(model: nn.Module, batches: list[Batch]) -> list[InputGroup]:
    """Every group of untied Linear layers sharing one input tensor, with per-channel ranges over ``batches``."""
    recorder = InputRecorder(model, smoothable_linears(model))
    try:
        run_batches(model, batches, desc="input smoothing stats")
    finally:
        recorder.remove()
    return recorder.groups()


def skipped(group: InputGroup, skip: tuple[str, ...]) -> bool:
    """True if one of the group's Linear layers has a name containing one of ``skip``."""
    return any(pattern in name for name, _ in group.linears for pattern in skip)


def smoothing_scales(groups: list[InputGroup], alpha: float, min_ratio: float = 0.0,
                     skip: tuple[str, ...] = ()) -> list[tuple[InputGroup, torch.Tensor]]:
    """(group, s) for every group to smooth: ``s_j = max|X_j|^alpha / max|W_{:,j}|^(1-alpha)``.

    All groups or none: if no group's channel ratio exceeds ``min_ratio``, nothing (a model without
    outlier channels keeps its weights); on all-MiniLM-L6-v2 (ad hoc, before [CLS] had its own residual
    scales) smoothing only the groups past 16x gave
    embedding cosine 0.9931, smoothing every group 0.9962.  Groups with a Linear whose name contains one
    of ``skip`` are left alone.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"input smoothing alpha must be in [0, 1], got {alpha}")
    groups = [g for g in groups if not skipped(g, skip)]
    if not groups or max(g.channel_ratio() for g in groups) <= min_ratio:
        return []
    out = []
    with torch.no_grad():
        for group in groups:
            w_absmax = torch.stack([lin.weight.abs().amax(0) for _, lin in group.linears]).amax(0).float()
            s = (group.act_absmax.clamp_min(1e-5).pow(alpha) / w_absmax.clamp_min(1e-5).pow(1 - alpha)).clamp_min(1e-5)
            out.append((group, s))
    return out


def smooth_inputs(model: nn.Module, batches: list[Batch], alpha: float, min_ratio: float = 0.0,
                  exclude: tuple[str, ...] = ()) -> list[str]:
    """SmoothQuant without a LayerNorm to fold into, on a float model (:func:`smoothing_scales` decides).

    The weight columns are multiplied by ``s`` and ``1/s`` is stored on each Linear
    (``softq_input_scale``) and applied by a pre-hook; softq's quantized Linear takes it over and applies
    it to its input before quantizing it (one elementwise Mul; shared by Q, K and V, so the export keeps
    one Mul and one QuantizeLinear for them).  The float function is unchanged.  Returns the names of the
    smoothed Linear layers.  Groups with a Linear layer matching ``exclude`` (the layers
    ``QuantConfig.exclude`` keeps float) are left alone: a float Linear would need the input scale as a
    hook, which a saved model does not keep.  ``softq.quantize`` does the same without a pass of its own
    (it records the inputs during its observation pass)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"input smoothing alpha must be in [0, 1], got {alpha}")
    hint = _conv1d_hint(model)
    if hint:  # it would find no Linear to smooth and return [] (nothing done) without a word
        raise ValueError("input smoothing works on nn.Linear layers" + hint)
    done: list[str] = []
    with torch.no_grad():
        for group, s in smoothing_scales(find_input_groups(model, batches), alpha, min_ratio, exclude):
            for name, lin in group.linears:
                lin.weight.mul_(s.to(lin.weight.dtype))
                previous = getattr(lin, INPUT_SCALE_ATTR, None)
                inv = (1.0 / s).to(lin.weight.dtype)
                setattr(lin, INPUT_SCALE_ATTR, inv if previous is None else previous * inv)
                if previous is None:  # the float Linear applies it too (softq's QLinear takes it over)
                    lin.register_forward_pre_hook(_scale_input)
                done.append(name)
    if done:  # save_pretrained would write the scaled weights without the hooks' 1/s: another function
        from softq.hf import refuse_save_pretrained

        refuse_save_pretrained(model, smoothed=True)
    return done


def _scale_input(module: nn.Linear, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (inputs[0] * getattr(module, INPUT_SCALE_ATTR),) + tuple(inputs[1:])
