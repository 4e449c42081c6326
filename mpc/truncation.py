"""Truncation after secret multiplications: exact (dealer-assisted) or CrypTen's probabilistic one.

Every fixed-point product ``a * b`` (and every matmul entry, and every division by
a public integer) is computed at scale ``2^32`` and must be divided by ``2^16``.
CrypTen 0.4.1 does this in two ways, and **both fail now and then**:

* 2 parties: each party divides its own share locally.  When the two shares wrap
  around the ring (probability about ``|value| / 2^32`` for a value encoded at scale
  ``2^32``) the result is off by about ``2^48 / 2^16 = 4.3e9``.
* more than 2 parties: ``beaver.truncate`` computes the shares' wrap count with the
  provider's help but leaves out the term ``eta_xr`` (``# TODO: Incorporate eta_xr``
  in ``crypten/mpc/primitives/beaver.py``), which is wrong with the same probability,
  with the same ``4.3e9`` error.

``mode="exact"`` (softq's default) replaces both by a dealer-assisted truncation
that never fails for ``|x| < 2^62`` (encoded), i.e. for any value below ``2^30`` at
scale ``2^32``; the range pass (:mod:`softq.mpc.ranges`) checks that bound.  The
dealer (party 0 with CrypTen's TFP provider, the separate dealer process with TTP)
hands out shares of a uniformly random ring element ``r``, of ``floor(r / d)`` and of
``r``'s top bit ``r_63`` (``r`` read as an unsigned 64-bit integer).  Then, with
``x' = x + 2^62`` (so ``0 <= x' < 2^63``):

1. the parties open ``c = x' + r mod 2^64`` (one round; ``c`` is uniform, so it
   reveals nothing about ``x``);
2. the sum ``x' + r`` wrapped past ``2^64`` exactly when ``r_63 = 1`` and
   ``c_63 = 0``, so ``w = r_63 (1 - c_63)`` is a *linear* function of the shared bit;
3. ``x' = c - r + w 2^64`` over the integers, hence
   ``floor(x' / d) = floor(c / d) - floor(r / d) + w floor(2^64 / d) - {0 or 1}``,
   every term a public value or a share; subtracting ``floor(2^62 / d)`` gives
   ``x / d`` within one unit of the last place (2^-16).

It costs one extra round and ``2 x 8`` bytes per truncated element per party (the
opening of ``c``); the 2-party local truncation costs nothing and is kept as the
opt-in ``mode="probabilistic"``.

:data:`STATS` counts the truncated elements (one per secret product, matmul entry
or division by a public integer): the number of multiplications whose truncation
could have failed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from softq.mpc._crypten_shim import load_crypten

TRUNCATION_MODES = ("exact", "probabilistic")
OFFSET = 2**62  # x + OFFSET must lie in [0, 2^63): |x| < 2^62 in the ring
# Largest value (at the product scale 2^32) that exact truncation accepts: 2^62 / 2^32.
EXACT_TRUNCATION_LIMIT = 2.0**30
_MASK63 = 2**63 - 1


@dataclass
class TruncationStats:
    """How many elements were truncated, in which mode, since the last reset."""

    elements: int = 0
    calls: int = 0
    exact_elements: int = 0

    def reset(self) -> None:
        self.elements = self.calls = self.exact_elements = 0


STATS = TruncationStats()
_STATE: dict[str, Any] = {"mode": "probabilistic", "original": None}


def floor_div_unsigned(v: torch.Tensor, d: int) -> torch.Tensor:
    """``floor(v / d)`` with the int64 tensor ``v`` read as unsigned 64-bit (exact, ``2 <= d < 2^62``)."""
    msb = (v < 0).long()
    low = v & _MASK63
    a, b = divmod(2**63, d)
    q = torch.div(low, d, rounding_mode="floor")
    rem = low - q * d
    return q + msb * a + (msb * b + rem >= d).long()


def _signed(value: int) -> int:
    """A Python integer reduced mod 2^64 into int64's range."""
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


def _dealer_tfp(size: torch.Size, d: int, device: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TFP: party 0 draws ``r`` and shares ``r``, ``floor(r/d)``, ``r_63`` (pseudo-random zero shares, no traffic)."""
    crypten = load_crypten()
    from crypten.common.rng import generate_random_ring_element

    ast = crypten.mpc.primitives.ArithmeticSharedTensor
    if crypten.communicator.get().get_rank() == 0:
        r = generate_random_ring_element(size, device=device)
        stacked = torch.stack([r, floor_div_unsigned(r, d), (r < 0).long()])
        shared = ast(stacked, precision=0, src=0)
    else:
        shared = ast(None, size=(3, *size), precision=0, src=0, device=device)
    return shared.share[0], shared.share[1], shared.share[2]


def _dealer_ttp(size: torch.Size, d: int, device: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TTP: every party draws its share of ``r`` from the generator it shares with the dealer."""
    crypten = load_crypten()
    from crypten.common.rng import generate_random_ring_element
    from crypten.mpc.provider.ttp_provider import TTPClient

    gen = TTPClient.get().get_generator(device=device)
    r = generate_random_ring_element(size, generator=gen, device=device)
    if crypten.communicator.get().get_rank() == 0:
        q_m = TTPClient.get().ttp_request("softq_truncation", device, tuple(size), d)
        return r, q_m[0], q_m[1]
    q = generate_random_ring_element(size, generator=gen, device=device)
    m = generate_random_ring_element(size, generator=gen, device=device)
    return r, q, m


def _server_truncation(self: Any, size: tuple[int, ...], d: int) -> torch.Tensor:
    """TTPServer method: party 0's shares of ``floor(r/d)`` and ``r_63`` (the others' come from their generators)."""
    r = self._get_additive_PRSS(size)
    q = floor_div_unsigned(r, d) - self._get_additive_PRSS(size, remove_rank=True)
    m = (r < 0).long() - self._get_additive_PRSS(size, remove_rank=True)
    return torch.stack([q, m])


def install_ttp_server() -> None:
    """Teach CrypTen's TTPServer (the dealer process) to hand out truncation pairs."""
    crypten = load_crypten()
    crypten.mpc.provider.ttp_provider.TTPServer.softq_truncation = _server_truncation


def exact_truncate(x: Any, d: int) -> Any:
    """Divide the ArithmeticSharedTensor ``x`` by the public integer ``d >= 2`` in place, exactly."""
    crypten = load_crypten()
    comm = crypten.communicator.get()
    size, device = x.share.size(), x.share.device
    dealer = _dealer_ttp if crypten.cfg.mpc.provider == "TTP" else _dealer_tfp
    r, q, m = dealer(size, d, device)
    masked = x.share + r
    if comm.get_rank() == 0:
        masked = masked + OFFSET
    c = comm.all_reduce(masked)  # x + 2^62 + r mod 2^64: uniform
    wrap_term = m * (c >= 0).long() * _signed(2**64 // d)
    share = wrap_term - q
    if comm.get_rank() == 0:
        share = share + floor_div_unsigned(c, d) - OFFSET // d
    x.share = share
    return x


def _div_(self: Any, y: Any) -> Any:
    """``ArithmeticSharedTensor.div_`` with exact truncation for public integer divisors."""
    from crypten.common.tensor_types import is_float_tensor, is_int_tensor

    if isinstance(y, float) and int(y) == y:
        y = int(y)
    if is_float_tensor(y) and y.frac().eq(0).all():
        y = y.long()
    if isinstance(y, int) or is_int_tensor(y):
        n = self.share.nelement()
        STATS.elements += n
        STATS.calls += 1
        world = load_crypten().communicator.get().get_world_size()
        if _STATE["mode"] == "exact" and isinstance(y, int) and y >= 2 and world >= 2:
            STATS.exact_elements += n
            return exact_truncate(self, y)
    return _STATE["original"](self, y)


def set_truncation(mode: str) -> None:
    """Select ``"exact"`` (dealer-assisted, never fails) or ``"probabilistic"`` (CrypTen's own) truncation."""
    if mode not in TRUNCATION_MODES:
        raise ValueError(f"unknown truncation mode {mode!r}; choose one of {TRUNCATION_MODES}")
    crypten = load_crypten()
    ast = crypten.mpc.primitives.ArithmeticSharedTensor
    if _STATE["original"] is None:
        _STATE["original"] = ast.div_
        ast.div_ = _div_
    _STATE["mode"] = mode


def truncation_mode() -> str:
    return str(_STATE["mode"])


@contextlib.contextmanager
def truncation(mode: str) -> Iterator[None]:
    """Within the block, use truncation ``mode``."""
    previous = _STATE["mode"]
    set_truncation(mode)
    try:
        yield
    finally:
        set_truncation(previous)
