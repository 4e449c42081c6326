"""softq.export: ONNX export of softq-quantized models with an integer softmax.

``to_onnx(qmodel, path, example_inputs, softmax=...)`` writes the whole model:
``"fast"`` (default) or ``"int"`` for softmax codes relative to the row max
(``row_attention``: the attention core scores -> P.V with a numpy reference),
``"qdq"``, ``"ort"`` or ``"int"`` for the uniform edge codes (``int_softmax``:
three softmax forms with a numpy reference each); ``onnx_utils`` the atomic
save, checks and sessions; ``runtimes`` one runner for onnxruntime, tract and
OpenVINO.  torch is
imported only when a model export is asked for, so ``softq --help`` stays fast.
"""

from __future__ import annotations

from typing import Any

from softq.export import runtimes
from softq.export.int_softmax import FORMS, OUT_SCALE, SoftmaxQuant, build_softmax, reference, softmax_model

__all__ = ["FORMS", "OUT_SCALE", "SoftmaxQuant", "build_softmax", "reference", "softmax_model",
           "to_onnx", "to_onnx_float", "build_onnx", "ExportError", "runtimes"]

# name -> the module that holds it (imported on first use: model_export imports torch)
_LAZY = {"to_onnx": "model_export", "to_onnx_float": "model_export", "build_onnx": "model_export",
         "build_onnx_float": "model_export", "ExportError": "errors"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"softq.export.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'softq.export' has no attribute {name!r}")
