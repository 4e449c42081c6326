"""The one definition of every softmax variant softq knows.

Training (calib/ attention fixes), quantization (quant/), ONNX export (export/) and
encrypted inference (mpc/) all call the functions registered here, so a variant
behaves the same everywhere.

Every variant has the signature ``fn(scores, valid, **params) -> probs`` where

* ``scores`` are the raw attention scores ``Q K^T * scaling`` **without** the
  additive mask, shape ``[..., q, k]``;
* ``valid`` is a public 0/1 float tensor broadcastable to ``scores`` (1 = the key
  may be attended) or ``None`` (no mask);
* the result is zero, exactly, wherever ``valid`` is 0.

The bodies only use tensor *methods* that both ``torch.Tensor`` and CrypTen's
``CrypTensor`` provide (``exp``, ``relu``, ``square``, ``sum``, ``max``,
``sigmoid``, arithmetic with public tensors).  The only operations that differ
between plaintext and secret-shared tensors (division by a secret value and the
row max) go through :func:`reciprocal` and :func:`row_max`, which dispatch on the
tensor type.  That is what lets ``softq.mpc`` run the very same surrogates.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

# Scores of masked keys are pushed this far below the row's valid scores before a
# max is taken.  Big enough to never win a max, small enough for CrypTen's
# 16-bit fixed point (values must stay well below 2**47).
MASK_PUSH = 1.0e4
# Denominators of plaintext surrogates are clamped here so a fully masked row
# yields zeros instead of NaN.
TINY = 1.0e-12
HALF_DTYPES = (torch.float16, torch.bfloat16)  # computed in float32 wherever their range or rounding breaks a formula
# Largest |parameter| a variant takes (clipped softmax's alpha and zeta, 2Quad's c): far past any useful value;
# beyond it float32 rows overflow to inf / NaN (2Quad's (x + c)^2) or every score is lost in c's rounding.
PARAM_LIMIT = 1.0e6


def check_param(variant: str, name: str, value: Any, low: float, *, low_open: bool = False) -> float:
    """``value`` as a float if it is a real number in [low, PARAM_LIMIT] ((low, ...] with ``low_open``); else
    one line naming the variant and the parameter (a string, a bool, a tensor, NaN or an overflow included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars are Real, tensors are not
        raise TypeError(f"{variant}'s {name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not ((low < value if low_open else low <= value) and abs(value) <= PARAM_LIMIT):  # NaN fails too
        bracket = "(" if low_open else "["
        raise ValueError(f"{variant}'s {name} must be in {bracket}{low:g}, {PARAM_LIMIT:g}], got {value!r}")
    return value


class SoftmaxFn(Protocol):
    def __call__(self, scores: Any, valid: torch.Tensor | None, **params: Any) -> Any: ...


def _is_plain(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def reciprocal(x: Any) -> Any:
    """1/x for a tensor known to be positive.

    Plaintext: a clamped division.  CrypTen: ``CrypTensor.reciprocal`` (softq.mpc
    turns on ``functions.reciprocal_all_pos`` because every caller here passes a
    positive denominator, which saves a secure sign computation).
    """
    if _is_plain(x):  # TINY, or float16's smallest normal number (TINY itself rounds to 0 there)
        return 1.0 / x.clamp_min(max(TINY, torch.finfo(x.dtype).tiny))
    return x.reciprocal()


def normalize(num: Any, dim: int = -1) -> Any:
    """``num / num.sum(dim)`` for non-negative rows with a positive sum.

    CrypTen: ``CrypTensor.softq_normalize_rows(dim)`` where softq.mpc installs one (its
    fused row division for the 2Quad denominator), else ``num * reciprocal(row sum)``.
    """
    fused = None if _is_plain(num) else getattr(num, "softq_normalize_rows", None)
    if fused is not None:
        return fused(dim)
    return num * reciprocal(num.sum(dim=dim, keepdim=True))


def row_max(x: Any, dim: int = -1) -> Any:
    """Row maximum, keepdim.  CrypTen's ``max`` is the expensive part of exact softmax."""
    if _is_plain(x):
        return x.amax(dim=dim, keepdim=True)
    result = x.max(dim=dim, keepdim=True)  # CrypTen returns (max, one-hot argmax)
    return result[0] if isinstance(result, tuple) else result


def _mask(x: Any, valid: torch.Tensor | None) -> Any:
    if valid is None:
        return x
    # plaintext: exact zeros even where x is inf or NaN at a masked key (inf * 0 is NaN); CrypTen: a product
    return x.masked_fill(valid == 0, 0.0) if _is_plain(x) else x * valid


def _valid_count(scores: Any, valid: torch.Tensor | None, dim: int = -1) -> torch.Tensor | float:
    """Number of valid keys per row (public): the row length T of the papers."""
    if valid is None:
        return max(float(scores.shape[dim]), 1.0)  # no keys at all: nothing to scale
    if valid.shape[dim] != scores.shape[dim]:  # mask broadcast along keys: count the full row
        valid = valid.expand(*valid.shape[:dim % valid.dim()], scores.shape[dim], *valid.shape[dim % valid.dim() + 1:])
    # Summing the (small) mask before broadcasting to the heads keeps this O(b * q * k).
    return valid.sum(dim=dim, keepdim=True).clamp_min(1.0)


def _as_scores_dtype(x: Any, scores: Any) -> Any:
    """A public per-row quantity (a count, its log) in the plaintext scores' dtype: a float32 mask's count must not
    turn float16 / bfloat16 attention into float32 (the same variant without a mask keeps the dtype)."""
    return x.to(scores.dtype) if isinstance(x, torch.Tensor) and _is_plain(scores) else x


def _masked_for_max(scores: Any, valid: torch.Tensor | None) -> Any:
    if valid is None:
        return scores
    if _is_plain(scores):  # the same values, and a NaN or inf at a masked key stays out of the row max
        return scores.masked_fill(valid == 0, -MASK_PUSH)
    return scores * valid + (valid - 1.0) * MASK_PUSH


# ---------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------


def softmax(scores: Any, valid: torch.Tensor | None = None, dim: int = -1) -> Any:
    """Exact softmax over valid keys; masked keys get exactly 0."""
    if _is_plain(scores):
        if valid is None:
            return torch.softmax(scores, dim=dim)
        masked = scores.masked_fill(valid == 0, torch.finfo(scores.dtype).min)
        return _mask(torch.softmax(masked, dim=dim), valid)  # a fully masked row: 0, not uniform
    shifted = _masked_for_max(scores, valid)
    e = _mask((shifted - row_max(shifted, dim)).exp(), valid)
    return e * reciprocal(e.sum(dim=dim, keepdim=True))


CLIPPED_ALPHA = 4.0  # the clipped softmax's default stretch: gamma = -alpha / T
# from scratch: a fresh model's rows are uniform (p = 1/T) and survive the clip only if alpha < T / (T - 1); at 4
# every row of a fresh ViT is 0 and no gradient reaches Q and K (docs/outliers.md section 3)
CLIPPED_ALPHA_FROM_SCRATCH = 0.5


def clipped_softmax(
    scores: Any, valid: torch.Tensor | None = None, zeta: float = 1.0, alpha: float = CLIPPED_ALPHA, dim: int = -1
) -> Any:
    """Bondarenko et al.: ``clip((zeta - gamma) * softmax(x) + gamma, 0, 1)``, ``gamma = -alpha / T``.

    T is the number of valid keys of the row, so the stretch stays the same for
    any sequence length (the paper's length-robust choice).  Lets a head output
    exact zeros (and ones) with finite logits, which removes the pressure that
    grows outliers.

    Training from scratch: an entry survives only if ``p > alpha / (T + alpha)``
    (zeta = 1), so with ``alpha >= T / (T - 1)`` (any alpha > 1 on long rows) a
    uniform row, what a fresh model computes, is clipped to exactly zero and no
    gradient reaches Q and K.  A class-token ViT then never learns (docs/outliers.md);
    alpha < 1 keeps every row alive at initialisation.
    """
    alpha = check_param("clipped softmax", "alpha", alpha, 0.0)
    zeta = check_param("clipped softmax", "zeta", zeta, 1.0)
    if scores.shape[dim] == 0:
        return scores * 1.0
    gamma = -alpha / _valid_count(scores, valid, dim)
    gamma = _as_scores_dtype(gamma, scores)
    p = softmax(scores, valid, dim=dim)
    stretched = p * (zeta - gamma) + gamma
    if not _is_plain(stretched):
        # clip(y, 0, 1) = relu(y) - relu(y - 1), which CrypTen can evaluate.
        return _mask(stretched.relu() - (stretched - 1.0).relu(), valid)
    return _mask(stretched.clamp(0.0, 1.0), valid)


def _half_in_float32(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` in float32 on float16 / bfloat16 scores (the result cast back): their row sums of squares or
    exponentials overflow (2Quad's sum of ``(x + c)^2`` over 1024 keys near 4 is inf in float16: a row of zeros)
    and ``e^x - 1`` cancels (bfloat16 softpick of scores near 0)."""
    @functools.wraps(fn)
    def run(scores: Any, valid: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        if _is_plain(scores) and scores.dtype in HALF_DTYPES:
            return fn(scores.float(), valid, *args, **kwargs).to(scores.dtype)
        return fn(scores, valid, *args, **kwargs)

    return run


@_half_in_float32
def softpick(scores: Any, valid: torch.Tensor | None = None, dim: int = -1, eps: float = 1e-9) -> Any:
    """``ReLU(e^x - 1) / sum |e^x - 1|``: rectified, not sum-to-one.

    Computed stably by factoring ``e^m`` (``m = max(row max, 0)``) out of numerator
    and denominator: ``e^x - 1 = e^m (e^(x-m) - e^(-m))``.  Non-positive logits give
    exactly 0, so heads can attend to nothing without pushing logits to extremes.
    """
    if not _is_plain(scores):
        raise NotImplementedError("softpick is not offered under MPC (it needs |.|, a secure comparison per entry)")
    if scores.shape[dim] == 0:
        return scores * 1.0
    m = _masked_for_max(scores, valid).amax(dim=dim, keepdim=True).clamp_min(0.0)
    shifted = (scores - m).masked_fill(valid == 0, -math.inf) if valid is not None else scores - m
    d = shifted.exp() - torch.exp(-m)
    d = _mask(d, valid)
    den = d.abs().sum(dim=dim, keepdim=True)
    return d.relu() / (den + eps * torch.exp(-m))


@_half_in_float32
def quad2(scores: Any, valid: torch.Tensor | None = None, c: float = 5.0, dim: int = -1) -> Any:
    """MPCFormer's 2Quad: ``(x + c)^2 / sum (x + c)^2``; one multiplication and one reciprocal."""
    c = check_param("2quad", "shift c", c, -PARAM_LIMIT)
    return normalize(_mask((scores + c).square(), valid), dim)


RELU2_EPS = 1e-3  # 2ReLU's row sum offset: CrypTen's reciprocal needs a positive input (a row with no positive score)


@_half_in_float32
def relu2(scores: Any, valid: torch.Tensor | None = None, dim: int = -1) -> Any:
    """2ReLU: ``ReLU(x) / (sum ReLU(x) + 1e-3)`` (rows with no positive score give 0).  The offset keeps the
    encrypted reciprocal's input positive; plaintext adds it too, so both compute one function (rows sum to
    ``s / (s + 1e-3)`` for a row sum ``s``: a row whose one positive score is 0.01 gives 0.909, not 1)."""
    num = _mask(scores.relu(), valid)
    return num * reciprocal(num.sum(dim=dim, keepdim=True) + RELU2_EPS)


def relu_len(scores: Any, valid: torch.Tensor | None = None, dim: int = -1) -> Any:
    """``ReLU(x) / L`` with L the (public) number of valid keys: no secret division at all."""
    return _mask(scores.relu(), valid) * _as_scores_dtype(1.0 / _valid_count(scores, valid, dim), scores)


def sigmoid_len(scores: Any, valid: torch.Tensor | None = None, dim: int = -1) -> Any:
    """``sigmoid(x - ln L)``: per-entry, no row reduction (sigmoid attention)."""
    count = _valid_count(scores, valid, dim)
    log_len = math.log(count) if isinstance(count, float) else _as_scores_dtype(torch.log(count), scores)
    return _mask((scores - log_len).sigmoid(), valid)


@dataclass(frozen=True)
class SoftmaxVariant:
    """A registered variant: its function, default parameters and a one-line why."""

    name: str
    fn: Callable[..., Any]
    defaults: dict[str, float] = field(default_factory=dict)
    sums_to_one: bool = True
    mpc_ok: bool = True
    summary: str = ""

    def __call__(self, scores: Any, valid: torch.Tensor | None = None, **params: float) -> Any:
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise TypeError(
                f"softmax variant '{self.name}' has no parameter(s) {sorted(unknown)}; "
                f"it takes {sorted(self.defaults) or 'none'}"
            )
        return self.fn(scores, valid, **{**self.defaults, **params})


SOFTMAX_VARIANTS: dict[str, SoftmaxVariant] = {}


def register_softmax(variant: SoftmaxVariant) -> SoftmaxVariant:
    """Add a variant to the registry shared by training, quant, export and MPC."""
    SOFTMAX_VARIANTS[variant.name] = variant
    return variant


def get_softmax(name: str) -> SoftmaxVariant:
    try:
        return SOFTMAX_VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown softmax variant '{name}'; choose one of {sorted(SOFTMAX_VARIANTS)}") from None


_COMPILED: dict[str, Callable[..., Any]] = {}


def compiled_softmax(name: str) -> Callable[..., Any]:
    """The variant ``name`` fused by ``torch.compile`` for plaintext training (same maths).

    Eager variants run one memory pass per elementwise op over the
    ``[b, h, q, k]`` scores; fused, clipped softmax and softpick train about twice
    as fast on CPU (docs/results/train_speed.md).  A second input shape switches
    the compiled code to dynamic shapes instead of recompiling per length.  If this
    machine cannot compile (no C++ compiler, unsupported platform) the eager
    variant is used from then on, with a warning.
    """
    if name not in _COMPILED:
        variant = get_softmax(name)
        fused = torch.compile(variant.fn)

        def run(scores: Any, valid: torch.Tensor | None = None, **params: float) -> Any:
            if _COMPILED[name] is not run:  # compilation failed earlier
                return variant(scores, valid, **params)
            try:
                return fused(scores, valid, **{**variant.defaults, **params})
            except Exception as error:  # noqa: BLE001 - any compiler failure falls back to eager
                warnings.warn(f"torch.compile of softmax variant '{name}' failed ({type(error).__name__}: "
                              f"{error}); training with the eager variant", RuntimeWarning, stacklevel=2)
                _COMPILED[name] = variant
                return variant(scores, valid, **params)

        variant(torch.zeros(1, 2), None)  # unknown names fail here, not inside the compiler
        _COMPILED[name] = run
    return _COMPILED[name]


for _v in (
    SoftmaxVariant("softmax", softmax, {}, True, True, "exact softmax (the baseline)"),
    SoftmaxVariant("clipped", clipped_softmax, {"zeta": 1.0, "alpha": CLIPPED_ALPHA}, False, True,
                   "clipped softmax, Bondarenko et al. 2023 (exact 0/1 without outliers)"),
    SoftmaxVariant("softpick", softpick, {}, False, False, "rectified softpick, not sum-to-one"),
    SoftmaxVariant("2quad", quad2, {"c": 5.0}, True, True, "MPCFormer (x+c)^2 normalised"),
    SoftmaxVariant("2relu", relu2, {}, False, True, "ReLU(x) / (sum ReLU(x) + 1e-3)"),
    SoftmaxVariant("relu_len", relu_len, {}, False, True, "ReLU(x) / L, no secret division"),
    SoftmaxVariant("sigmoid_len", sigmoid_len, {}, False, True, "sigmoid(x - ln L)"),
):
    register_softmax(_v)
