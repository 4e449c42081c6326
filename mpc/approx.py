"""Accurate, range-safe approximations of GELU, SiLU, exp, LayerNorm, RMSNorm and row division on CrypTensors.

CrypTen's own functions are accurate on a narrow range only and wrap around the
ring outside it with no warning (MiniLM's GELU inputs reach -17 / +25, the tanh
argument 546, and CrypTen's tanh/erf GELU then returns errors of ~2^32).  softq
evaluates them on the raw shares instead, with more fractional bits where the
approximation needs them:

* **GELU** (``gelu``): comparison-selected branches, ``GELU(x) = x`` for
  ``x > B``, ``0`` for ``x < -B`` and ``x / 2 + Q(2 x^2 / B^2 - 1)`` in between,
  ``B = 4 sqrt 2`` (``B^2 = 32``, so the argument is an exact shift) and ``Q`` a
  degree-14 Chebyshev series of ``GELU(x) - x/2`` (which is even) evaluated with
  24 fractional bits.  Outside ``[-B, B]`` the polynomial branch may hold
  anything: it is multiplied by a secret 0 bit, which is exact in the ring.  Max
  error about 3.3e-5 over the whole line, for inputs up to the fixed-point limit.
* **exp** (``exp``): ``(1 + y + y^2/2)^256`` with ``y = x / 256`` read at 24
  fractional bits (the same shares: no rounding of ``y``) and the squarings at 24
  bits; CrypTen's ``(1 + x/256)^256`` at 16 bits leaves relative errors up to
  ~0.4 % (rounding of ``x / 256``) and ~x^2/512.  Accurate for ``x`` in
  :data:`EXP_RANGE`.

* **SiLU** (``silu``): the same piecewise form with ``B = 8 sqrt 2`` and degree 16 (SiLU's tail
  ``x e^-x`` decays slowly); max error about 2.4e-4 over the whole line.  SwiGLU / GeGLU (``glu``)
  multiply the activation by the up projection.
* **LayerNorm** and **RMSNorm** (``layer_norm``, ``center=False``) and **2Quad's row division** (``normalize_rows``):
  one batched comparison with public powers selects a normaliser, then a polynomial
  (see the section "Comparison-selected brackets" below): 21 and 20 rounds where
  Newton-Raphson from a fixed start took 49 and ~60.

All products go through CrypTen's Beaver protocol and softq's truncation
(:mod:`softq.mpc.truncation`), so they are exact in the default mode.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from softq.mpc._crypten_shim import load_crypten

BITS = 16  # CrypTen's fixed-point precision
INNER_BITS = 24  # precision of the inner polynomial evaluations
GELU_BOUND_SQ = 32  # B^2: the polynomial branch covers |x| <= B = 4 sqrt 2
GELU_DEGREE = 14
# SiLU's tail x sigmoid(-x) decays like x e^-x, not like GELU's e^(-x^2/2): the polynomial branch must reach
# B = 8 sqrt 2 (tail 1.4e-4 at B); degree 16 keeps GELU's multiplicative depth 4 (polynomial error 2.3e-4).
SILU_BOUND_SQ = 128
SILU_DEGREE = 16
EXP_SQUARINGS = 8
# exp input range where ``exp`` is accurate (absolute error < 1e-4) and every
# intermediate stays inside the 24-bit fixed point: below -1.5 * 256 the base
# polynomial is no longer below e^-1.5; above ~9 the squarings overflow.
EXP_RANGE = (-1.5 * 2**EXP_SQUARINGS, 9.0)
RECIPROCAL_ITERS = 10
# Positive inputs for which ``reciprocal`` is within 0.1 % or two 16-bit units of 1/x
# (below 0.05 the 16-bit input itself is that coarse; above ~190 the start's exp
# leaves EXP_RANGE).
RECIPROCAL_RANGE = (0.05, 150.0)


def _gelu_target(name: str) -> Any:
    from scipy.special import erf

    if name == "erf":
        return lambda x: 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))
    if name == "tanh":
        return lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if name == "silu":
        return lambda x: x / (1.0 + np.exp(-x))
    raise ValueError(f"no accurate MPC GELU for {name!r}; use erf or tanh")


# name -> (B^2, degree) of the piecewise form: x for x > B, 0 for x < -B, x/2 + Q(2 x^2 / B^2 - 1) between
PIECEWISE: dict[str, tuple[int, int]] = {"erf": (GELU_BOUND_SQ, GELU_DEGREE), "tanh": (GELU_BOUND_SQ, GELU_DEGREE),
                                         "silu": (SILU_BOUND_SQ, SILU_DEGREE)}
_COEFFS: dict[str, list[float]] = {}


def gelu_coefficients(name: str) -> list[float]:
    """Chebyshev coefficients of ``f(x) - x/2`` in ``v = 2 x^2 / B^2 - 1`` (least squares on 4000 nodes).

    ``f`` is GELU (``erf``, ``tanh``) or SiLU (``silu``); ``f(x) - x/2`` is even for all three
    (``x (sigmoid(x) - 1/2) = x/2 tanh(x/2)``), so a series in ``x^2`` has half the degree."""
    if name not in _COEFFS:
        bound_sq, degree = PIECEWISE[name]
        k = np.arange(4000)
        v = np.cos(np.pi * (k + 0.5) / 4000)
        x = np.sqrt((v + 1.0) / 2.0 * bound_sq)
        f = _gelu_target(name)
        _COEFFS[name] = [float(c) for c in np.polynomial.chebyshev.chebfit(v, f(x) - x / 2.0, degree)]
    return _COEFFS[name]


# ---------------------------------------------------------------------------
# Share-level helpers (an ArithmeticSharedTensor's int64 shares, any scale)
# ---------------------------------------------------------------------------


def _rank() -> int:
    return int(load_crypten().communicator.get().get_rank())


def _ast(share: torch.Tensor) -> Any:
    return load_crypten().mpc.primitives.ArithmeticSharedTensor.from_shares(share, precision=0)


def _plus_public(share: torch.Tensor, value: int) -> torch.Tensor:
    """Shares of ``x + value`` (party 0 adds the public integer)."""
    return share + value if _rank() == 0 else share


def _trunc(share: torch.Tensor, divisor: int) -> torch.Tensor:
    """Shares of ``x / divisor`` (through softq's truncation: exact by default)."""
    return _ast(share).div_(divisor).share


def _mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Shares of the ring product ``a b`` (Beaver; no truncation)."""
    from crypten.mpc.primitives import beaver

    return beaver.mul(_ast(a), _ast(b)).share


def _square(a: torch.Tensor) -> torch.Tensor:
    from crypten.mpc.primitives import beaver

    return beaver.square(_ast(a)).share


def _wrap(share: torch.Tensor) -> Any:
    return load_crypten().mpc.MPCTensor.from_shares(share, precision=BITS)


# ---------------------------------------------------------------------------
# GELU
# ---------------------------------------------------------------------------


def _chebyshev_levels(degree: int) -> list[list[int]]:
    """Group T_2..T_degree by multiplicative depth (T_k = 2 T_i T_j - T_{j-i}, i = k // 2)."""
    depth = {0: 0, 1: 0}
    for k in range(2, degree + 1):
        i, j = k // 2, k - k // 2
        depth[k] = max(depth[i], depth[j]) + 1
    levels: dict[int, list[int]] = {}
    for k in range(2, degree + 1):
        levels.setdefault(depth[k], []).append(k)
    return [levels[d] for d in sorted(levels)]


def _piecewise(x: Any, name: str) -> Any:
    """``x`` above ``B``, ``0`` below ``-B``, ``x/2 + Q(2 x^2 / B^2 - 1)`` between (see :data:`PIECEWISE`)."""
    coeffs = gelu_coefficients(name)
    bound_sq, degree = PIECEWISE[name]
    s = 2**INNER_BITS
    xs = x._tensor.share
    bound = math.sqrt(bound_sq)
    # 1. which branch: one batched secret comparison of (x - B, -x - B) with 0
    crypten = load_crypten()
    stacked = crypten.stack([x - bound, -x - bound])
    bits = stacked.gt(0.0)._tensor.share  # scale 1: 0/1 shares
    hi, lo = bits[0], bits[1]
    # 2. v = 2 x^2 / B^2 - 1 at 24 bits: x^2 has scale 2^32 and B^2 is a power of 2, so this is one exact shift
    shift = 2 * BITS - INNER_BITS + int(math.log2(bound_sq)) - 1
    v = _plus_public(_trunc(_square(xs), 2**shift), -s)
    t: dict[int, torch.Tensor] = {1: v}
    for level in _chebyshev_levels(degree):
        pairs = [(k // 2, k - k // 2) for k in level]
        prod = _mul(torch.stack([t[i] for i, _ in pairs]), torch.stack([t[j] for _, j in pairs]))
        for n, (k, (i, j)) in enumerate(zip(level, pairs)):
            low = t[j - i] * s if j - i > 0 else None  # T_0 = 1
            raw = 2 * prod[n] - low if low is not None else _plus_public(2 * prod[n], -s * s)
            t[k] = raw
        stacked_raw = torch.stack([t[k] for k in level])
        truncated = _trunc(stacked_raw, s)
        for n, k in enumerate(level):
            t[k] = truncated[n]
    # 3. the middle branch at scale 2^(2*24), then one truncation to 16 bits:
    #    x / 2 + sum_k a_k T_k
    raw = xs * 2 ** (2 * INNER_BITS - BITS - 1)
    for k in range(1, degree + 1):
        raw = raw + t[k] * int(round(coeffs[k] * s))
    raw = _plus_public(raw, int(round(coeffs[0] * s)) * s)
    middle = _trunc(raw, 2 ** (2 * INNER_BITS - BITS))
    # 4. select: hi * x + (1 - hi - lo) * middle; the bits have scale 1, so no truncation
    inside = _plus_public(-hi - lo, 1)
    out = _mul(torch.stack([hi, inside]), torch.stack([xs, middle]))
    return _wrap(out[0] + out[1])


def gelu(x: Any, name: str = "erf") -> Any:
    """GELU of the MPCTensor ``x`` (``erf``: exact GELU, ``tanh``: its tanh form); error <= ~4e-5."""
    if name not in ("erf", "tanh"):
        raise ValueError(f"no accurate MPC GELU for {name!r}; use erf or tanh")
    return _piecewise(x, name)


def silu(x: Any) -> Any:
    """SiLU ``x sigmoid(x)`` of the MPCTensor ``x``: max error ~2.4e-4 over the whole line.

    The piecewise form of :func:`gelu` with ``B = 8 sqrt 2`` and a degree-16 series: ``x`` above
    ``B`` (error ``B e^-B`` = 1.4e-4 at the join, less beyond), ``0`` below ``-B`` (the same),
    ``x/2 + (x/2) tanh(x/2)`` between (series error 2.3e-4), for inputs up to the fixed-point
    limit; 12 rounds, as GELU.  CrypTen's ``x * x.sigmoid()`` costs an exp and a reciprocal.
    """
    return _piecewise(x, "silu")


def glu(gate: Any, up: Any, act: str) -> Any:
    """``act(gate) * up`` (SwiGLU: ``act="silu"``; GeGLU: ``"erf"`` or ``"tanh"``): one more Beaver round.

    Error ``<= e_act |up| + 2^-16 (|act(gate)| + |up|)``, ``e_act`` the activation's bound
    (2.4e-4 for SiLU, 4e-5 for GELU); the product must stay below the fixed-point limit
    (2^30 before truncation, checked by the range pass as every secret value is).
    """
    return _piecewise(gate, act) * up


# ---------------------------------------------------------------------------
# exp
# ---------------------------------------------------------------------------


def exp(x: Any) -> Any:
    """``e^x`` for the MPCTensor ``x`` (accurate in :data:`EXP_RANGE`)."""
    s = 2**INNER_BITS
    # y = x / 256: the 16-bit shares of x are the 24-bit shares of y (exactly)
    y = x._tensor.share
    assert INNER_BITS - BITS == EXP_SQUARINGS
    # p = 1 + y + y^2 / 2 at 24 bits: (y^2 + 2 s y + 2 s^2) / 2s
    p = _trunc(_plus_public(_square(y) + 2 * s * y, 2 * s * s), 2 * s)
    for i in range(EXP_SQUARINGS):
        last = i == EXP_SQUARINGS - 1
        p = _trunc(_square(p), s * 2 ** (INNER_BITS - BITS) if last else s)
    return _wrap(p)


# ---------------------------------------------------------------------------
# reciprocal of a positive value
# ---------------------------------------------------------------------------


def reciprocal(x: Any, iters: int = RECIPROCAL_ITERS, initial: Any = None) -> Any:
    """``1 / x`` for a positive MPCTensor ``x`` in :data:`RECIPROCAL_RANGE`.

    CrypTen's Newton step ``2y - (y y) x`` rounds ``y y`` to 16 bits first, which
    leaves 4 % relative error at x = 50; ``y (2 - x y)`` keeps ``x y`` near 1.
    Start ``3 exp(1 - 2x) + 0.003`` (CrypTen's), ``iters`` steps (CrypTen's
    ``functions.reciprocal_nr_iters`` under :func:`accurate_functions`: 10 by default,
    3 inside CrypTen's sigmoid, whose input is in [1, 2] and which starts from
    ``initial = 0.75``).
    """
    y = exp(1.0 - 2.0 * x) * 3.0 + 0.003 if initial is None else initial
    for _ in range(iters):
        y = y * (2.0 - x * y)
    return y


@contextlib.contextmanager
def accurate_functions() -> Iterator[None]:
    """Within the block, ``MPCTensor.exp`` is :func:`exp` and positive ``reciprocal`` is :func:`reciprocal`."""
    crypten = load_crypten()
    cls = crypten.mpc.MPCTensor
    saved = {name: cls.__dict__.get(name) for name in ("exp", "reciprocal")}
    original_exp, original_reciprocal = cls.exp, cls.reciprocal

    def patched_exp(self: Any, *args: Any, **kwargs: Any) -> Any:
        return exp(self) if self.ptype.name == "arithmetic" else original_exp(self, *args, **kwargs)

    def patched_reciprocal(self: Any, *args: Any, **kwargs: Any) -> Any:
        f = crypten.cfg.functions
        if self.ptype.name != "arithmetic" or args or kwargs or f.reciprocal_method != "NR":
            return original_reciprocal(self, *args, **kwargs)
        if not f.reciprocal_all_pos:  # a generic division: sign, then the positive reciprocal
            sign = self.sign()
            return sign * reciprocal(sign * self, int(f.reciprocal_nr_iters), f.reciprocal_initial)
        return reciprocal(self, int(f.reciprocal_nr_iters), f.reciprocal_initial)

    cls.exp, cls.reciprocal = patched_exp, patched_reciprocal
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is None:
                delattr(cls, name)
            else:
                setattr(cls, name, previous)


# ---------------------------------------------------------------------------
# Comparison-selected brackets: LayerNorm's inverse square root, 2Quad's row division
# ---------------------------------------------------------------------------
#
# A positive row quantity v (a variance, a row sum) is compared, in one batched
# secret comparison (8 rounds, 432 bytes per threshold and row), with public
# thresholds T_0 < ... < T_K spaced by a ratio r.  The comparison bits select a
# public normaliser s_i per bracket (0 rounds: the bits are 0/1 integer shares,
# multiplied by integer encodings and summed), so z = v s_i lies in
# [1/sqrt(r), sqrt(r)]; a minimax polynomial in t = z - m then gives f(z) in 4
# rounds.  Products are truncated lazily where the bound allows (two products, then
# one truncation by 2^32): every lazy product is bounded in the comments below and
# the bounds are checked by the range pass (softq.mpc.ranges).

LN_RATIO = 2.0  # LayerNorm variance thresholds 2^k ...
LN_EXPONENTS = (-14, 24)  # ... for k = -14 .. 24: variances (+ eps) in [2^-14, 2^24] = [6.1e-5, 1.7e7]
LN_VAR_RANGE = (LN_RATIO ** LN_EXPONENTS[0], LN_RATIO ** LN_EXPONENTS[1])
ROW_RATIO = 4.0  # 2Quad row-sum thresholds (after the public row scale K = L c^2) 4^k ...
ROW_EXPONENTS = (-3, 4)  # ... for k = -3 .. 4: scaled row sums in [1/64, 256]
ROW_RANGE = (ROW_RATIO ** ROW_EXPONENTS[0], ROW_RATIO ** ROW_EXPONENTS[1])
POLY_DEGREE = 4
# |LayerNorm output - bias| must stay below this: the last product u w y is truncated
# lazily at scale 2^48 (< 2^62 for exact truncation): |out| < 2^14, with a factor 2 spare.
LN_OUTPUT_LIMIT = 2.0**13
# 2Quad's fused row division keeps num * (s y) at scale 2^48: needs L c^2 < 2^13 (p <= 1).
ROW_SCALE_LIMIT = 2.0**13


def _encode(value: Any, bits: int = BITS) -> torch.Tensor:
    return torch.round(torch.as_tensor(value, dtype=torch.float64) * 2**bits).long()


def _thresholds(ratio: float, exponents: tuple[int, int]) -> torch.Tensor:
    return torch.tensor([ratio**k for k in range(exponents[0], exponents[1] + 1)], dtype=torch.float64)


def bracket_select(value: Any, thresholds: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Shares of ``table[i]`` (int64 rows, any fixed-point scale) where ``i`` = number of thresholds below ``value``.

    ``value``: MPCTensor ``[..., 1]``; ``thresholds``: ``[K]`` increasing; ``table``: ``[K + 1, m]``.
    One batched secret comparison; the selection itself is local (telescoping sum of
    the monotone 0/1 bits times public integer differences).
    """
    bits = value.gt(thresholds.float())._tensor.share  # [..., K], 0/1 at scale 1
    out = bits @ (table[1:] - table[:-1])  # [..., m], exact in the ring
    return _plus_public(out, table[0])


def _bracket_table(ratio: float, exponents: tuple[int, int], power: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Thresholds and per-bracket normalisers ``G_i^-power`` (G_i = the geometric middle of bracket i)."""
    t = _thresholds(ratio, exponents)
    mids = torch.cat([t[:1] / math.sqrt(ratio), torch.sqrt(t[:-1] * t[1:]), t[-1:] * math.sqrt(ratio)])
    return t, mids ** (-power)


_POLY: dict[tuple[str, float], tuple[float, list[float]]] = {}


def bracket_polynomial(kind: str, ratio: float) -> tuple[float, list[float]]:
    """``(m, a)``: ``f(z) ~ sum_k a_k (z - m)^k`` on ``[1/sqrt(r), sqrt(r)]``, minimax in relative error.

    ``kind``: ``"rsqrt"`` (z^-1/2) or ``"reciprocal"`` (1/z); degree :data:`POLY_DEGREE`.
    """
    key = (kind, ratio)
    if key not in _POLY:
        f = {"rsqrt": lambda z: z**-0.5, "reciprocal": lambda z: 1.0 / z}[kind]
        lo, hi = 1.0 / math.sqrt(ratio), math.sqrt(ratio)
        m = (lo + hi) / 2
        z = np.linspace(lo, hi, 4001)
        basis = np.vander(z - m, POLY_DEGREE + 1, increasing=True) / f(z)[:, None]
        w = np.ones_like(z)
        for _ in range(200):  # iteratively reweighted least squares -> near-minimax relative error
            a, *_ = np.linalg.lstsq(basis * w[:, None], w, rcond=None)
            r = np.abs(basis @ a - 1.0)
            w = w * (1.0 + r / r.max()) ** 2
            w /= w.mean()
        _POLY[key] = (m, [float(c) for c in a])
    return _POLY[key]


def _polynomial(z: torch.Tensor, kind: str, ratio: float, out_bits: int) -> torch.Tensor:
    """Shares of ``f(z)`` at scale ``2^out_bits`` (16 or 32) for 16-bit shares ``z``: 4 rounds, 2 truncations.

    ``t = z - m`` (|t| <= 0.75), ``t^2`` truncated, then ``t^3 = t t^2`` and ``t^4 = t^2 t^2``
    in one Beaver round left at scale 2^32; the sum ``sum a_k t^k`` at scale 2^48
    (|f| < 2^14) is truncated once.
    """
    m, a = bracket_polynomial(kind, ratio)
    t = _plus_public(z, -int(_encode(m)))
    t2 = _trunc(_square(t), 2**BITS)
    t34 = _mul(torch.stack([t, t2]), torch.stack([t2, t2]))  # scale 2^32
    coeff = [int(_encode(c)) for c in a]
    acc = (t * coeff[1] + t2 * coeff[2]) * 2**BITS + t34[0] * coeff[3] + t34[1] * coeff[4]
    acc = _plus_public(acc, coeff[0] * 2 ** (2 * BITS))
    return _trunc(acc, 2 ** (3 * BITS - out_bits))


def layer_norm(x: Any, weight: Any = None, eps: float = 1e-5, center: bool = True) -> Any:
    """``(x - mean) / sqrt(var + eps) * weight`` over the last dim of the MPCTensor ``x`` (no bias): 21 rounds.

    ``center=False`` is RMSNorm, ``x / sqrt(mean(x^2) + eps) * weight``: the same steps without the
    mean (one truncation fewer).  For ``var + eps`` in :data:`LN_VAR_RANGE` the normaliser's relative
    error is 7e-5 (the polynomial) and the output's error stays below 5e-4 of the row's largest
    |output| (3.1e-4 measured, rows of scale 0.02 to 300 with a massive activation of 3000: the 16-bit
    resolution of ``u = x s`` sets it), whatever the scale of ``x``: ``u`` is normalised before any
    further product.

    1. mean (1 truncation), ``c = x - mean`` (``c = x`` for RMSNorm); variance = sum c^2 / n (Beaver + 1 truncation);
    2. one batched comparison of var + eps with 2^k (k in :data:`LN_EXPONENTS`) selects
       ``s ~ 1/std`` (within 2^1/4) and ``e = eps s^2``;
    3. ``u = c s`` (truncated: the exact rounding of s cancels, z below is computed from u);
       ``u^2`` and ``u w`` in one Beaver round; ``z = mean(u^2) + e`` in [2^-1/2, 2^1/2] and
       ``u w`` truncated together (``n u w`` at 2^32: |u w| < 2^30 / n);
    4. ``y = z^-1/2`` by a degree-4 polynomial (relative error 7e-5), kept at scale 2^32;
    5. ``u w y`` at scale 2^48, truncated once (|out| < :data:`LN_OUTPUT_LIMIT`).
    """
    crypten = load_crypten()
    n = int(x.shape[-1])
    c = x - x.mean(dim=-1, keepdim=True) if center else x
    cs = c._tensor.share
    var = _trunc(_square(cs).sum(dim=-1, keepdim=True), 2**BITS * n)
    thresholds, norms = _bracket_table(LN_RATIO, LN_EXPONENTS, 0.5)
    table = torch.stack([_encode(norms), _encode(eps * norms**2)], dim=-1)
    se = bracket_select(_wrap(_plus_public(var, int(_encode(eps)))), thresholds, table)
    s, e = se[..., :1], se[..., 1:]
    u = _trunc(_mul(cs, s), 2**BITS)
    if weight is None:
        sq, uw_raw = _square(u), u * 2**BITS
    elif isinstance(weight, crypten.CrypTensor):
        w = weight._tensor.share.expand_as(u)
        prods = _mul(torch.stack([u, u]), torch.stack([u, w]))
        sq, uw_raw = prods[0], prods[1]
    else:
        sq, uw_raw = _square(u), u * _encode(weight)
    both = _trunc(torch.cat([sq.sum(dim=-1, keepdim=True), uw_raw * n], dim=-1), 2**BITS * n)
    z, uw = both[..., :1] + e, both[..., 1:]
    y = _polynomial(z, "rsqrt", LN_RATIO, 2 * BITS)
    return _wrap(_trunc(_mul(uw, y), 2 ** (2 * BITS)))


def normalize_rows(num: Any, scale: float, dim: int = -1) -> Any:
    """``num / num.sum(dim)`` for a non-negative MPCTensor with row sums ``D`` in ``scale *`` :data:`ROW_RANGE`.

    20 rounds (CrypTen's reciprocal with the exp start and 10 Newton steps: ~60):
    one batched comparison of D with ``scale 4^k`` selects ``S = 1 / G_i`` (G_i the middle of
    D's bracket, an exact integer at scale 2^32); ``z = D S / scale`` (in [1/2, 2]); ``y ~ 1/z`` by a degree-4
    polynomial (relative error 8e-3) and one Newton step ``y (2 - z y)`` (7e-5) fused with
    the ``S`` factor at scale 2^32; the output ``num (S y') / scale`` is truncated once
    from scale 2^48 (needs ``scale <`` :data:`ROW_SCALE_LIMIT`, since p <= 1).
    """
    if dim not in (-1, num.dim() - 1):
        num = num.transpose(dim, -1)
        return normalize_rows(num, scale, -1).transpose(dim, -1)
    if not 0 < scale < ROW_SCALE_LIMIT:
        raise ValueError(f"normalize_rows needs a row scale in (0, {ROW_SCALE_LIMIT:g}), got {scale}")
    ns = num._tensor.share
    den = num.sum(dim=-1, keepdim=True)
    thresholds, norms = _bracket_table(ROW_RATIO, ROW_EXPONENTS, 1.0)
    big_s = bracket_select(den, thresholds * scale, _encode(norms, 2 * BITS)[:, None])  # 1 / G_i at scale 2^32
    divisor = int(round(scale * 2 ** (2 * BITS)))
    z = _trunc(_mul(den._tensor.share, big_s), divisor)  # D / (scale G_i) at 16 bits (scale 2^48 before: z scale < 2^14)
    y = _polynomial(z, "reciprocal", ROW_RATIO, BITS)
    zy_sy = _trunc(_mul(torch.stack([z, y]), torch.stack([y, big_s])), 2**BITS)  # z y at 2^16, S y at 2^32
    sy = _trunc(_mul(zy_sy[1], _plus_public(-zy_sy[0], 2 * 2**BITS)), 2**BITS)  # S y (2 - z y) at 2^32
    return _wrap(_trunc(_mul(ns, sy), divisor))


def quadratic(x: Any, a2: float, a1: float, a0: float) -> Any:
    """``a2 x^2 + a1 x + a0`` for dyadic ``a2 = 2^-p`` and ``a1 / a2`` an integer: one Beaver round, one truncation.

    ``(x^2 + (a1 / a2) x) 2^32`` is formed exactly and truncated once by ``2^(16 + p)``
    (CrypTen: square, truncate, then one more truncation per public float factor).
    """
    p = -math.log2(a2)
    ratio = a1 / a2
    if p != int(p) or p < 0 or ratio != int(ratio):
        raise ValueError(f"quadratic needs a2 = 2^-p and an integer a1 / a2, got a2={a2}, a1={a1}")
    xs = x._tensor.share
    raw = _square(xs) + xs * (int(ratio) * 2**BITS)
    return _wrap(_plus_public(_trunc(raw, 2 ** (BITS + int(p))), int(_encode(a0))))
