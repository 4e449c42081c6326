"""softq: make softmax-sensitive transformers quantizable, exportable and private-inference-ready.

The API is a verb and a config::

    import softq
    qmodel = softq.quantize(model, calib_data, softq.QuantConfig())
    softq.save(qmodel, "qdir")                      # softq.load("qdir") rebuilds it
    softq.to_onnx(qmodel, "model.onnx", calib_data[0])

Its parts are attributes too, imported on first use: ``softq.calib``, ``softq.quant``, ``softq.export``,
``softq.mpc`` (``softq.mpc.run``), and the shared modules ``softq.softmax``, ``softq.attention``, ``softq.hf``,
``softq.models``, ``softq.evaluation``.
Heavy dependencies (torch, transformers, Brevitas) load on first use, so
``softq --help`` stays instant.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
PARTS = ("calib", "quant", "export", "mpc", "softmax", "attention", "hf", "models", "evaluation")
__all__ = ["QuantConfig", "quantize", "save", "load", "to_onnx", "configure_attention", "kv_cache", "__version__",
           "calib", "quant", "export", "mpc"]

_LAZY = {
    "QuantConfig": "softq.quant.config",
    "quantize": "softq.quant.quantize",
    "save": "softq.quant.io",
    "load": "softq.quant.io",
    "kv_cache": "softq.quant.kv_cache",
    "to_onnx": "softq.export.model_export",
    "configure_attention": "softq.attention",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY or name in PARTS:
        import importlib

        if name in PARTS:
            return importlib.import_module(f"softq.{name}")
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'softq' has no attribute {name!r}")
