"""``input_smoothing="auto"``: the candidate alphas tried on copies of the observed model, and the rule that picks one.

Min-max ranges of a smoothed input follow exactly from the unsmoothed input's
per-channel ranges (:func:`_smooth_observed`), so every candidate is finished from the
one observation pass ``quantize`` ran, judged on the held-out batches (``held_out.py``)
at every input and at the LayerNorm-folded inputs alone, and :func:`pick_smoothing`
keeps one.
"""

from __future__ import annotations

import torch
from torch import nn

from softq.calib.data import Batch
from softq.calib.observers import MinMaxObserver
from softq.calib.smoothquant import InputGroup, InputRecorder, skipped, smoothing_scales
from softq.quant.config import AUTO_SMOOTHING_MIN_GAIN, AUTO_SMOOTHING_TIE
from softq.quant.copies import _collect, independent_copy
from softq.quant.held_out import output_error
from softq.quant.layers import QLinear
from softq.quant.points import _finish


def _scope(groups: list[InputGroup], folded_only: bool) -> list[InputGroup]:
    """The groups a smoothing applies to: all, or those whose input is a LayerNorm output (``folded_only``)."""
    return [g for g in groups if g.after_norm] if folded_only else groups


def _search_smoothing(observed: nn.Module, recorder: InputRecorder, alphas: tuple[float | None, ...],
                      skip: tuple[str, ...], held: list[Batch], reference: list[torch.Tensor], foldable: bool,
                      ) -> tuple[float | None, bool, dict[float | None, float], dict[float, float]]:
    """``input_smoothing="auto"``: each candidate alpha (``None``: no smoothing) applied to a copy of the model
    observed so far, finished and run on the held-out batches, at every input and, in a pre-LN model with
    other inputs too, at the LayerNorm outputs alone (their scales fold into the LayerNorm: free at run time).
    Returns (alpha, folded only, every-input errors, folded-only errors) by :func:`pick_smoothing`.  Min-max
    ranges of smoothed inputs follow from the recorded per-channel ones, so the candidates share one
    observation pass."""
    errors: dict[float | None, float] = {}
    folded: dict[float, float] = {}
    # large per-channel weights are shared with the candidates, not copied: a candidate's smoothing factors stay
    # beside them (QLinear.weight_factor) and each weight piece is scaled as its product is computed
    large = [m.weight for m in observed.modules() if isinstance(m, QLinear) and m.pieces_when_calibrating()]
    for scope in (False, True):
        if scope and not foldable:
            break
        for alpha in alphas if not scope else [a for a in alphas if a is not None]:
            trial = independent_copy(observed, tuple(large))
            for m in trial.modules():  # the trial's factors are kept beside the weights it shares
                if isinstance(m, QLinear) and any(m.weight is p for p in large):
                    m.weight_factor = torch.ones(0)
            groups = recorder.groups(dict(trial.named_modules()))
            if alpha is not None:
                done = _smooth_observed(_scope(groups, scope), alpha, 0.0, skip)
                everything = len([g for g in groups if not skipped(g, skip)])
                if not done or scope and done == everything:  # nothing smoothed, or the every-input candidate
                    break
            _finish(trial)
            (folded if scope else errors)[alpha] = output_error(trial, held, reference)
            trial = groups = None  # the groups hold the copy's layers: dropped too, or two copies live at once
            _collect(observed)
    trial = groups = None  # a candidate left by a break
    _collect(observed)
    alpha, folded_only = pick_smoothing(errors, folded)
    return alpha, folded_only, errors, folded


def pick_smoothing(errors: dict[float | None, float], folded: dict[float, float] | None = None,
                   ) -> tuple[float | None, bool]:
    """"auto"'s rule, as (alpha, folded only); "the lowest error" of a set of candidates means the smallest alpha
    within ``AUTO_SMOOTHING_TIE`` of the lowest.  The every-input alpha with the lowest error if it is at least
    ``AUTO_SMOOTHING_MIN_GAIN`` below no smoothing's (``errors[None]``: at run time it costs a Mul at each input
    that does not follow a LayerNorm, a GELU output or the attention output, whose scale takes the place of the
    row core's factor that export/fuse.py otherwise folds away) and below every LayerNorm-folded candidate's;
    else the LayerNorm-folded candidate (``folded``) with the lowest error if below no smoothing's (it costs
    nothing at run time); else no smoothing."""
    if None not in errors:
        return None, False
    best_folded = _smallest_near_best(folded) if folded else None
    smoothed = {a: e for a, e in errors.items() if a is not None}
    if smoothed:
        best = _smallest_near_best(smoothed)
        if (smoothed[best] <= (1.0 - AUTO_SMOOTHING_MIN_GAIN) * errors[None]
                and (best_folded is None or smoothed[best] < folded[best_folded])):
            return best, False
    if best_folded is not None and folded[best_folded] < errors[None]:
        return best_folded, True
    return None, False


def _smallest_near_best(errors: dict[float, float]) -> float:
    """The smallest alpha whose error is within ``AUTO_SMOOTHING_TIE`` of the lowest (ties go to the milder scales)."""
    low = min(errors.values())
    # |low|: a distance of a near-float model can round to a tiny negative number
    return min(a for a, e in errors.items() if e <= low + AUTO_SMOOTHING_TIE * abs(low))


def _smooth_observed(groups: list[InputGroup], alpha: float, min_ratio: float, skip: tuple[str, ...]) -> int:
    """Input smoothing decided from the observation pass just run (``smooth_inputs`` without a pass of its
    own): weight columns x s, ``input_scale`` = 1/s, and each input quantizer's min-max range set to what it
    would have seen on the smoothed input, min/max over channels of the channel's min/max times 1/s (exact:
    scaling by a positive factor and rounding are both monotonic).  Returns how many groups it smoothed."""
    done = 0
    with torch.no_grad():
        for group, s in smoothing_scales(groups, alpha, min_ratio, skip):
            done += 1
            inv = 1.0 / s
            lo, hi = float((group.lo * inv).min()), float((group.hi * inv).max())
            for _, lin in group.linears:
                if isinstance(getattr(lin, "weight_factor", None), torch.Tensor):  # a candidate's shared weight
                    lin.weight_factor = s.to(lin.weight.dtype)
                else:
                    lin.weight.mul_(s.to(lin.weight.dtype))
                lin.input_scale = inv.to(lin.weight.dtype).clone()
                observer = lin.input_act.observer
                if not isinstance(observer, MinMaxObserver) or lin.input_act.channels is not None:
                    raise RuntimeError("one-pass input smoothing needs per-tensor min-max input observers")
                observer.lo, observer.hi = lo, hi
    return done
