"""softq.quant: W8A8 post-training quantization of whole models, softmax included (Brevitas).

Public API: ``QuantConfig``, ``quantize``, ``is_quantized``, ``save``, ``load``
(loaded on first use so that ``softq --help`` does not import torch).
"""

from __future__ import annotations

from typing import Any

__all__ = ["QuantConfig", "quantize", "is_quantized", "save", "load", "kv_cache"]

_LAZY = {
    "QuantConfig": "softq.quant.config",
    "quantize": "softq.quant.quantize",
    "is_quantized": "softq.quant.quantize",
    "save": "softq.quant.io",
    "load": "softq.quant.io",
    "kv_cache": "softq.quant.kv_cache",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'softq.quant' has no attribute {name!r}")
