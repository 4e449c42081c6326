"""softq: make softmax-sensitive transformers quantizable, exportable and private-inference-ready.

The one-verb API::

    import softq
    qmodel = softq.quantize(model, calib_data, config=softq.QuantConfig())

Heavy dependencies (torch, transformers, Brevitas) load on first use, so
``softq --help`` stays instant.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["QuantConfig", "quantize", "configure_attention", "__version__"]

_LAZY = {
    "QuantConfig": "softq.quant.config",
    "quantize": "softq.quant.quantize",
    "configure_attention": "softq.attention",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'softq' has no attribute {name!r}")
