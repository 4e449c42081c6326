"""Activation observers: turn calibration activations into a quantization range.

Three rules, chosen per model with ``QuantConfig.observer``:

* ``minmax``: the extreme values seen.  Never clips, so one outlier stretches the
  scale for every other value.
* ``percentile``: the ``q``-th / ``(100-q)``-th percentile of all calibration values,
  however they are batched.  Clips rare outliers (activation clipping).
* ``mse``: the clipping range whose quantize-dequantize error on a reservoir of
  calibration values is smallest.  Costs a small grid search once.

Observers see raw float activations; they do not quantize.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

# Values kept per observer for the MSE rule and a long percentile tail: every value while they fit, then a uniform
# random subsample of them.
RESERVOIR = 1 << 18


_VALID_TOKENS: ContextVar[torch.Tensor | None] = ContextVar("softq_valid_tokens", default=None)


@contextmanager
def valid_tokens(mask: object) -> Iterator[None]:
    """While a calibration batch runs: its ``attention_mask`` ([batch, seq], nonzero at real tokens), so that what
    is observed meanwhile counts the rows of real tokens only (:func:`token_mask`).  A padding row holds what the
    model computes for a pad token, which no output reads; counted, pad rows widened ranges (all-MiniLM-L6-v2's
    layer-0 Q/K/V input among them) and the ranges depended on how the texts were batched."""
    m = mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    token = _VALID_TOKENS.set(None if m is None or bool(m.all()) else m)  # no padding: nothing to leave out
    try:
        yield
    finally:
        _VALID_TOKENS.reset(token)


def token_mask(x: torch.Tensor) -> torch.Tensor | None:
    """The running calibration batch's token mask, shaped for ``x``'s rows, if the batch has padding and ``x``
    holds one row per token: ``[batch, seq]`` for ``[batch, .., seq, channels]`` (Linear inputs, per-head Q/K/V,
    attention score rows), ``[batch * seq]`` for ``[batch * seq, channels]`` (OPT flattens its tokens before
    the feed-forward layers); else None."""
    m = _VALID_TOKENS.get()
    if m is None or x.dim() < 2:
        return None
    if x.dim() == 2:
        return m.reshape(-1).to(x.device) if x.shape[0] == m.numel() else None
    if x.shape[0] != m.shape[0] or x.shape[-2] != m.shape[1]:
        return None
    return m.to(x.device)


def token_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``x`` at the tokens ``mask`` (:func:`token_mask`) keeps: ``[tokens, .., channels]``."""
    if mask is None:
        return x
    return x[mask] if mask.dim() == 1 else x.movedim(-2, 1)[mask]


class NonFiniteActivation(ValueError):
    """A NaN or Inf reached an observer; ``source``: the module observing it (``run_batches`` names it)."""

    source: object = None


class NoCalibrationData(RuntimeError):
    """An observer asked for a range before any calibration value reached it (softq.quantize names the point)."""


@dataclass(frozen=True)
class QuantRange:
    """A calibrated [lo, hi] interval, lo <= 0 <= hi (zero must be representable)."""

    lo: float
    hi: float


class Observer:
    """Base class: ``update`` with every calibration activation, then read ``range``."""

    def __init__(self) -> None:
        self.batches = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float()
        if x.numel() == 0:
            return
        # One pass gives the extremes and the finiteness check (NaN and Inf propagate into them).
        lo, hi = (v.item() for v in torch.aminmax(x))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise NonFiniteActivation("non-finite activation (NaN or Inf) reached an observer")
        self.batches += 1
        self._update(x, lo, hi)

    def _update(self, x: torch.Tensor, lo: float, hi: float) -> None:
        raise NotImplementedError

    def range(self, bits: int, signed: bool) -> QuantRange:
        if self.batches == 0:
            raise NoCalibrationData("observer saw no data: the calibration set never reached this layer")
        lo, hi = self._range(bits, signed)
        return QuantRange(min(lo, 0.0), max(hi, 0.0))

    def _range(self, bits: int, signed: bool) -> tuple[float, float]:
        raise NotImplementedError


class MinMaxObserver(Observer):
    def __init__(self) -> None:
        super().__init__()
        self.lo = float("inf")
        self.hi = float("-inf")

    def _update(self, x: torch.Tensor, lo: float, hi: float) -> None:
        self.lo = min(self.lo, lo)
        self.hi = max(self.hi, hi)

    def _range(self, bits: int, signed: bool) -> tuple[float, float]:
        return self.lo, self.hi


def _subsample(x: torch.Tensor, limit: int) -> torch.Tensor:
    flat = x.reshape(-1)
    if flat.numel() <= limit:
        return flat
    idx = torch.randint(0, flat.numel(), (limit,), generator=torch.Generator().manual_seed(flat.numel()))
    return flat[idx]


class PercentileObserver(Observer):
    """The ``q``-th and ``(100-q)``-th percentiles of every value seen (``torch.quantile``'s linear
    interpolation), the same whether the values came in one batch or many.

    Exact while the tail beyond the percentile is at most ``TAIL`` values (each side keeps the ``TAIL`` most
    extreme values seen: for ``q = 99.99``, up to 655 million values per point); past that (a lower ``q`` on
    much data) it reads the percentile off a uniform sample of up to ``RESERVOIR`` values, which then holds
    thousands of values beyond it.  Until 2026-12-05 it averaged each batch's percentiles, which moved with
    the batch size (a batch of one sentence has few values beyond its 99.99th percentile: it is nearly its max).
    """

    TAIL = 1 << 16

    def __init__(self, percentile: float = 99.99) -> None:
        super().__init__()
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {percentile}")
        self.q = percentile / 100.0
        self.count = 0
        self.top = torch.empty(0)  # the TAIL largest values seen, and the TAIL smallest
        self.bottom = torch.empty(0)
        self.samples: list[torch.Tensor] = []  # for a tail longer than TAIL
        self.counts: list[int] = []

    def _update(self, x: torch.Tensor, lo: float, hi: float) -> None:
        flat = x.reshape(-1)
        self.count += flat.numel()
        top = torch.cat([self.top.to(flat.device), flat])  # kept on the data's device (a CUDA model's)
        bottom = torch.cat([self.bottom.to(flat.device), flat])
        k = min(self.TAIL, top.numel())
        self.top = top if top.numel() == k else torch.topk(top, k).values
        self.bottom = bottom if bottom.numel() == k else torch.topk(bottom, k, largest=False).values
        self.samples.append(_subsample(x, RESERVOIR))
        self.counts.append(flat.numel())
        if sum(s.numel() for s in self.samples) > RESERVOIR:
            self.samples, self.counts = [_uniform_sample(self.samples, self.counts)], [sum(self.counts)]

    def _quantile(self, q: float) -> float:
        """``torch.quantile`` of every value seen at ``q`` (position ``q (n - 1)`` in ascending order)."""
        n = self.count
        pos = q * (n - 1)
        i0, i1 = math.floor(pos), math.ceil(pos)
        if q >= 0.5 and n - i0 <= self.top.numel():  # both neighbours among the largest kept
            ranked = torch.sort(self.top, descending=True).values
            a, b = ranked[n - 1 - i0].item(), ranked[n - 1 - i1].item()
        elif q < 0.5 and i1 < self.bottom.numel():
            ranked = torch.sort(self.bottom).values
            a, b = ranked[i0].item(), ranked[i1].item()
        else:
            return torch.quantile(_uniform_sample(self.samples, self.counts), q).item()
        return a + (b - a) * (pos - i0)

    def _range(self, bits: int, signed: bool) -> tuple[float, float]:
        return self._quantile(1.0 - self.q), self._quantile(self.q)


def _uniform_sample(samples: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """At most ``RESERVOIR`` of the values seen, each batch's value as likely as any other's: every sample is
    thinned to the density of the sparsest (a merged reservoir stands for all the batches it holds; weighted
    like one batch, later batches would fill most of it)."""
    total = sum(counts)
    density = min([RESERVOIR / total] + [s.numel() / n for s, n in zip(samples, counts)])
    generator = torch.Generator().manual_seed(total % (1 << 31))
    kept = []
    for sample, n in zip(samples, counts):
        k = min(sample.numel(), round(density * n))
        kept.append(sample if k == sample.numel() else
                    sample[torch.randperm(sample.numel(), generator=generator)[:k]])
    return torch.cat(kept)


class MSEObserver(MinMaxObserver):
    """Grid search over shrink factors of the min-max range for the lowest quantization MSE.

    The grid is log-spaced down to 1% of the min-max range: with a handful of
    100x outliers the best range is far inside it.
    """

    GRID = torch.logspace(-2, 0, 48)

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[torch.Tensor] = []
        self.counts: list[int] = []  # how many values each sample stands for

    def _update(self, x: torch.Tensor, lo: float, hi: float) -> None:
        super()._update(x, lo, hi)
        self.samples.append(_subsample(x, RESERVOIR))
        self.counts.append(x.numel())
        if sum(s.numel() for s in self.samples) > RESERVOIR:
            self.samples, self.counts = [self.uniform_sample()], [sum(self.counts)]

    def uniform_sample(self) -> torch.Tensor:
        """At most ``RESERVOIR`` of the values seen, each batch's value as likely as any other's."""
        return _uniform_sample(self.samples, self.counts)

    def _range(self, bits: int, signed: bool) -> tuple[float, float]:
        values = self.uniform_sample()
        lo, hi = min(self.lo, 0.0), max(self.hi, 0.0)
        best, best_err = (lo, hi), float("inf")
        for factor in self.GRID.tolist():
            cand_lo, cand_hi = lo * factor, hi * factor
            err = (fake_quant_range(values, QuantRange(cand_lo, cand_hi), bits, signed) - values).pow(2).mean().item()
            if err < best_err:
                best, best_err = (cand_lo, cand_hi), err
        return best


def scale_and_zero_point(r: QuantRange, bits: int, signed: bool) -> tuple[float, float]:
    """Affine parameters for a range.

    ``signed=True``: symmetric, zero point 0, ``scale = max|r| / (2^(b-1) - 1)``.
    ``signed=False``: asymmetric unsigned, ``scale = (hi - lo) / (2^b - 1)`` and an
    integer zero point so that 0.0 is exactly representable (padding, masks).
    """
    if signed:
        scale = max(abs(r.lo), abs(r.hi)) / (2 ** (bits - 1) - 1)
        return max(scale, 1e-12), 0.0
    scale = max((r.hi - r.lo) / (2**bits - 1), 1e-12)
    zero_point = float(min(max(round(-r.lo / scale), 0), 2**bits - 1))
    return scale, zero_point


def fake_quant_range(x: torch.Tensor, r: QuantRange, bits: int, signed: bool) -> torch.Tensor:
    """Quantize-dequantize ``x`` with the affine parameters of ``r`` (used to score candidates)."""
    scale, zp = scale_and_zero_point(r, bits, signed)
    qmin, qmax = (-(2 ** (bits - 1)) + 1, 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    return (torch.clamp(torch.round(x / scale + zp), qmin, qmax) - zp) * scale


class ChannelRange(Observer):
    """Per-channel min/max over the last dimension, turned into per-embedding-group parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lo: torch.Tensor | None = None
        self.hi: torch.Tensor | None = None

    def _update(self, x: torch.Tensor, lo: float, hi: float) -> None:
        flat = x.reshape(-1, x.shape[-1])
        lo, hi = flat.amin(0), flat.amax(0)
        if self.lo is not None and self.lo.shape != lo.shape:
            raise ValueError(f"channel count changed during calibration ({self.lo.numel()} -> {lo.numel()})")
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)

    def _range(self, bits: int, signed: bool) -> tuple[float, float]:
        return float(self.lo.min()), float(self.hi.max())

    @staticmethod
    def merged(ranges: list["ChannelRange"]) -> "ChannelRange":
        """One range over the channels of several (observers of parts of one tensor)."""
        out = ChannelRange()
        for r in ranges:
            if r.lo is None:
                continue
            out.lo = r.lo if out.lo is None else torch.minimum(out.lo, r.lo)
            out.hi = r.hi if out.hi is None else torch.maximum(out.hi, r.hi)
            out.batches += r.batches
        return out

    def widths(self, signed: bool) -> torch.Tensor:
        if self.batches == 0 or self.lo is None or self.hi is None:
            raise NoCalibrationData("observer saw no data: the calibration set never reached this layer")
        lo, hi = self.lo.clamp_max(0.0), self.hi.clamp_min(0.0)
        return hi.abs().maximum(lo.abs()) if signed else hi - lo

    def outlier_ratio(self, signed: bool) -> float:
        """Widest channel range over the median channel range (about 2-4 without outlier dimensions)."""
        width = self.widths(signed)
        return float(width.max() / width.median().clamp_min(1e-12))

    def group_params(self, groups: int, bits: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero point) vectors over the channels, ``groups`` distinct values.

        Channels are sorted by range width and cut into contiguous groups by
        :func:`range_groups`, which minimises the summed relative rounding noise:
        the few outlier dimensions of a real model (one at |x| = 223 against a median
        of 2.3 in all-MiniLM-L6-v2) end up in groups of their own.
        """
        width = self.widths(signed)
        lo, hi = self.lo.clamp_max(0.0), self.hi.clamp_min(0.0)
        order = torch.argsort(width)
        scale = torch.empty(lo.numel())
        zero_point = torch.empty(lo.numel())
        for members in range_groups(width[order], groups):
            idx = order[members]
            s, z = scale_and_zero_point(QuantRange(float(lo[idx].min()), float(hi[idx].max())), bits, signed)
            scale[idx], zero_point[idx] = s, z
        return scale, zero_point


def range_groups(widths: torch.Tensor, groups: int) -> list[slice]:
    """Cut ascending ``widths`` into at most ``groups`` contiguous groups minimising sum_c (w_group / w_c)^2.

    A channel's rounding noise relative to its own range is (group step / its width)^2,
    and the group's step is set by its widest member, so the cost of a group i..j is
    w_j^2 * sum_{c=i..j} 1 / w_c^2.  Exact dynamic programming over the cut points
    (O(groups * n^2) tensor ops, milliseconds for n = 384).
    """
    w = widths.double().clamp_min(float(widths.max()) * 1e-6 + 1e-12)
    n = w.numel()
    groups = max(1, min(groups, n))
    prefix = torch.cat([torch.zeros(1, dtype=w.dtype), torch.cumsum(w.pow(-2), 0)])
    # seg[i, j]: cost of one group holding channels i..j (inf where i > j)
    seg = w.pow(2)[None, :] * (prefix[1:][None, :] - prefix[:-1][:, None])
    seg = torch.where(torch.arange(n)[:, None] <= torch.arange(n)[None, :], seg, torch.full_like(seg, float("inf")))
    cost = seg[0]  # cost[j]: best cost of channels 0..j in k + 1 groups
    starts: list[torch.Tensor] = []  # starts[k - 1][j]: first channel of the last group in that solution
    for _ in range(groups - 1):
        before = torch.cat([torch.full((1,), float("inf"), dtype=w.dtype), cost[:-1]])  # groups ending at i - 1
        cost, start = (before[:, None] + seg).min(dim=0)
        starts.append(start)
    bounds, end = [], n - 1
    for start in reversed(starts):
        first = int(start[end])
        bounds.append(slice(first, end + 1))
        end = first - 1
    bounds.append(slice(0, end + 1))
    return bounds[::-1]


OBSERVERS = {"minmax": MinMaxObserver, "percentile": PercentileObserver, "mse": MSEObserver}


def make_observer(kind: str, percentile: float = 99.99) -> Observer:
    if kind not in OBSERVERS:
        raise ValueError(f"unknown observer '{kind}'; choose one of {sorted(OBSERVERS)}")
    return PercentileObserver(percentile) if kind == "percentile" else OBSERVERS[kind]()
