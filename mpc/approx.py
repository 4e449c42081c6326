"""Accurate, range-safe approximations of GELU and exp on CrypTensors.

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
    raise ValueError(f"no accurate MPC GELU for {name!r}; use erf or tanh")


_COEFFS: dict[str, list[float]] = {}


def gelu_coefficients(name: str) -> list[float]:
    """Chebyshev coefficients of ``GELU(x) - x/2`` in ``v = 2 x^2 / B^2 - 1`` (least squares on 4000 nodes)."""
    if name not in _COEFFS:
        k = np.arange(4000)
        v = np.cos(np.pi * (k + 0.5) / 4000)
        x = np.sqrt((v + 1.0) / 2.0 * GELU_BOUND_SQ)
        f = _gelu_target(name)
        _COEFFS[name] = [float(c) for c in np.polynomial.chebyshev.chebfit(v, f(x) - x / 2.0, GELU_DEGREE)]
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


def gelu(x: Any, name: str = "erf") -> Any:
    """GELU of the MPCTensor ``x`` (``erf``: exact GELU, ``tanh``: its tanh form); error <= ~4e-5."""
    coeffs = gelu_coefficients(name)
    s = 2**INNER_BITS
    xs = x._tensor.share
    bound = math.sqrt(GELU_BOUND_SQ)
    # 1. which branch: one batched secret comparison of (x - B, -x - B) with 0
    crypten = load_crypten()
    stacked = crypten.stack([x - bound, -x - bound])
    bits = stacked.gt(0.0)._tensor.share  # scale 1: 0/1 shares
    hi, lo = bits[0], bits[1]
    # 2. v = 2 x^2 / B^2 - 1 at 24 bits: x^2 has scale 2^32, 2 / 32 = 2^-4, so divide by 2^12
    v = _plus_public(_trunc(_square(xs), 2 ** (2 * BITS + 4 - INNER_BITS)), -s)
    t: dict[int, torch.Tensor] = {1: v}
    for level in _chebyshev_levels(GELU_DEGREE):
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
    for k in range(1, GELU_DEGREE + 1):
        raw = raw + t[k] * int(round(coeffs[k] * s))
    raw = _plus_public(raw, int(round(coeffs[0] * s)) * s)
    middle = _trunc(raw, 2 ** (2 * INNER_BITS - BITS))
    # 4. select: hi * x + (1 - hi - lo) * middle; the bits have scale 1, so no truncation
    inside = _plus_public(-hi - lo, 1)
    out = _mul(torch.stack([hi, inside]), torch.stack([xs, middle]))
    return _wrap(out[0] + out[1])


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
