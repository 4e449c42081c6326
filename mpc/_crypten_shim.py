"""Import CrypTen 0.4.1 on current torch.

CrypTen 0.4.1 (the last release) imports ``torch.onnx._internal.registration``
at import time, a module that torch >= 2.9 moved to
``torch.onnx._internal.torchscript_exporter.registration``.  softq never uses
CrypTen's ONNX converter (it has its own, :mod:`softq.mpc.graph`), so the shim
only has to make that one import succeed: it aliases the moved module, or a
stub when even that is gone.  Everything else in CrypTen works unchanged.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

INSTALL_HINT = (
    "CrypTen is not installed. softq.mpc needs CrypTen 0.4.1, whose metadata pins dead "
    "dependencies, so install it without them:\n"
    "    pip install 'softq[mpc]' && pip install --no-deps crypten==0.4.1\n"
    "(or run `make setup`, which does exactly that)."
)

_OLD = "torch.onnx._internal.registration"
_NEW = "torch.onnx._internal.torchscript_exporter.registration"


class CrypTenMissingError(ImportError):
    """CrypTen is not importable; the message carries the install command."""


def _install_alias() -> None:
    if _OLD in sys.modules:
        return
    try:
        importlib.import_module(_OLD)
        return
    except ImportError:
        pass
    try:
        module: Any = importlib.import_module(_NEW)
    except ImportError:
        module = types.ModuleType(_OLD)
        module.registry = None  # only looked up by CrypTen's (unused) ONNX converter
    sys.modules[_OLD] = module


def load_crypten() -> Any:
    """Return the ``crypten`` module, shimmed for current torch; clear error if it is missing."""
    loaded = sys.modules.get("crypten")
    if loaded is not None:
        return loaded
    _install_alias()
    try:
        import crypten  # noqa: PLC0415
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] == "crypten":
            raise CrypTenMissingError(INSTALL_HINT) from None
        raise
    _fix_decode(crypten)
    return crypten


def _fix_decode(crypten: Any) -> None:
    """Correct CrypTen 0.4.1's fixed-point decoding of negative numbers.

    ``FixedPointEncoder.decode`` floor-divides negative values by ``scale - 1``, so a
    value ``-k - f`` (``k`` integer, fractional part ``f`` within ``k / 2^16`` of 1)
    decodes exactly 1.0 too low: revealed logits of magnitude ~20 had a few entries
    off by 1.0.  Decoding as ``int / scale`` in float64 is exact for |x| < 2^37.
    """
    encoder_cls = crypten.encoder.FixedPointEncoder
    if getattr(encoder_cls.decode, "_softq_fixed", False):
        return
    original = encoder_cls.decode

    def decode(self: Any, tensor: Any) -> Any:
        if tensor is None or self._scale <= 1:
            return original(self, tensor)
        return (tensor.double() / self._scale).float()

    decode._softq_fixed = True  # type: ignore[attr-defined]
    encoder_cls.decode = decode
