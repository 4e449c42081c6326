"""``QuantConfig.smoothing_into_v``: the attention output's input smoothing moved onto V, and its "auto" check.

:func:`fold_smoothing_into_v` finds which Linear reads each attention output and
which Linear's output is V by comparing values, then scales V's rows by the output
projection's ``1/s`` (the same function in float, a Mul less at run time);
``"auto"`` keeps the fold only where the held-out error (``held_out.py``) is no higher.
"""

from __future__ import annotations

import torch
from torch import nn

from softq.attention import attention_points
from softq.calib.data import Batch, run_batches
from softq.quant.config import QuantConfig
from softq.quant.copies import independent_copy
from softq.quant.held_out import output_error
from softq.quant.layers import QLinear
from softq.quant.weight_bias import correct_weight_bias


def _first_example(batch: Batch) -> Batch:
    """``batch`` cut to its first example (every tensor with a batch dimension, when they share one)."""
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(sizes) != 1:
        return batch
    return {k: v[:1] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}


@torch.no_grad()
def fold_smoothing_into_v(qmodel: nn.Module, batches: list[Batch], config: QuantConfig, explicit: bool = False) -> int:
    """``QuantConfig.smoothing_into_v``: each attention output's input-smoothing scale ``1/s`` (the output
    projection's ``input_scale``) moved onto V, i.e. onto the rows (and bias) of the Linear whose output V is;
    returns how many attention layers were folded.

    P.V is linear in V channel by channel, so ``(P.V) / s = P.(V / s)``: the same function in float.  Which
    Linear reads the attention output and which Linear's output (or which ``H d``-wide slice of it: GPT-2's
    c_attn) is V is found by comparing values on the first calibration batch, not by module names.  Only
    with per-channel weight codes (a row's scale then leaves its codes as they are).  V's quantizer, now
    seeing V / s, observes its range again over ``batches``; runs after the other ranges are fixed and
    before the weight bias correction, which then sees the scaled rows.  ``explicit`` (``smoothing_into_v=True``):
    a model where no layer folds because V has fewer heads than the queries (grouped-query attention: one V
    channel serves several output channels with scales of their own) is refused in one line.
    """
    if not config.weight_per_channel:
        return 0
    layers = attention_points(qmodel)
    linears = {n: m for n, m in qmodel.named_modules() if isinstance(m, QLinear)}
    values: dict[int, torch.Tensor] = {}
    pvs: dict[int, torch.Tensor] = {}
    seen_in: dict[str, torch.Tensor] = {}
    seen_out: dict[str, torch.Tensor] = {}
    hooks = []
    for i, (_, points) in enumerate(layers):
        hooks.append(points.v.register_forward_pre_hook(lambda _m, args, i=i: values.__setitem__(i, args[0])))
        hooks.append(points.pv.register_forward_hook(lambda _m, _args, out, i=i: pvs.__setitem__(i, out)))

    def record(name: str):  # noqa: ANN202 - a forward hook returning None keeps the layer's output
        def hook(_m: nn.Module, args: tuple, out: torch.Tensor) -> None:
            seen_in[name], seen_out[name] = args[0], out
        return hook

    for name, lin in linears.items():
        hooks.append(lin.register_forward_hook(record(name)))
    try:
        run_batches(qmodel, [_first_example(batches[0])])  # which tensor is which: one example tells
    finally:
        for hook in hooks:
            hook.remove()
    folded = []
    grouped = 0
    for i, (_, points) in enumerate(layers):
        v, pv = values.get(i), pvs.get(i)
        if v is not None and v.dim() == 4 and v.shape[1] > 1 and torch.equal(v[:, 0], v[:, 1]):
            grouped += 1  # V repeated for grouped-query attention (softq.attention): no Linear outputs it whole
        if v is None or pv is None or v.dim() != 4 or pv.dim() != 4 or pv.shape[:2] != v.shape[:2] \
                or pv.shape[3] != v.shape[3]:
            continue
        b, h, n, d = v.shape
        width = h * d
        flat_pv = pv.transpose(1, 2).reshape(b, pv.shape[2], width)
        readers = [k for k, x in seen_in.items() if x.shape == flat_pv.shape and torch.equal(x, flat_pv)]
        flat_v = v.transpose(1, 2).reshape(b, n, width)
        sources = [(k, j) for k, y in seen_out.items() if y.dim() == 3 and tuple(y.shape[:2]) == (b, n)
                   and y.shape[-1] % width == 0 for j in range(0, y.shape[-1], width)
                   if torch.equal(y[..., j:j + width], flat_v)]
        if len(readers) != 1 or len(sources) != 1:
            continue
        out, (src, j) = linears[readers[0]], sources[0]
        if out.input_scale.numel() != width:
            continue
        inv = out.input_scale.to(linears[src].weight.dtype)
        rows = slice(j, j + width)
        linears[src].weight[rows] *= inv[:, None]
        if linears[src].bias is not None:
            linears[src].bias[rows] *= inv
        out.input_scale = torch.ones(0, dtype=out.input_scale.dtype, device=out.input_scale.device)
        points.v.restart_observation(config.observer, config.percentile)
        folded.append(points.v)
    if explicit and not folded and grouped:
        raise ValueError(f"smoothing_into_v=True: V has fewer heads than the queries in {grouped} of {len(layers)} "
                         "attention layers (grouped-query attention), so the attention output's per-channel smoothing "
                         "cannot move onto V; use smoothing_into_v='auto' or False")
    if folded:
        run_batches(qmodel, batches, desc="calibrating V")
        for quantizer in folded:
            quantizer.finish_calibration()
            quantizer.mode = "quant"
    return len(folded)


@torch.no_grad()
def _fold_into_v_if_better(qmodel: nn.Module, batches: list[Batch], config: QuantConfig, held: list[Batch],
                           reference: list[torch.Tensor]) -> tuple[int, tuple[float, float] | None, bool]:
    """``smoothing_into_v="auto"``: :func:`fold_smoothing_into_v` on a copy, kept (copied into ``qmodel``) if
    its outputs on the held-out batches are no further from the float model's (:func:`output_error`) than the
    unfolded model's, both judged as they will be returned (after the weight bias correction, which the fold
    changes): it saves a Mul per layer at run time, so a tie goes to the fold.  Returns (layers folded,
    (unfolded error, folded error), whether the weight bias correction has run); (0, None, False) where there
    was nothing to fold."""
    trial = independent_copy(qmodel)  # the conv bias correction below adds a parametrization to the copy
    count = fold_smoothing_into_v(trial, batches, config)
    if not count:
        return 0, None, False
    if config.weight_bias_correction:
        correct_weight_bias(trial, batches)
        correct_weight_bias(qmodel, batches)
    errors = (output_error(qmodel, held, reference), output_error(trial, held, reference))
    if errors[1] > errors[0]:
        return 0, errors, config.weight_bias_correction
    mine, theirs = dict(qmodel.named_modules()), dict(trial.named_modules())
    for name, module in mine.items():  # the folded output projections' empty input_scale, the bias shifts
        if isinstance(module, QLinear):
            module.input_scale = torch.zeros_like(theirs[name].input_scale)
            module.bias_shift = torch.zeros_like(theirs[name].bias_shift)
    qmodel.load_state_dict(trial.state_dict())  # V's scale and zero point are buffers: its new range comes along
    return count, errors, config.weight_bias_correction
