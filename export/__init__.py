"""softq.export: ONNX export of softq-quantized models with an integer softmax.

``int_softmax`` holds the three softmax forms (``qdq``, ``ort``, ``int``) with a
numpy reference each; ``onnx_utils`` the atomic save, checks and sessions.
"""

from softq.export.int_softmax import FORMS, OUT_SCALE, SoftmaxQuant, build_softmax, reference, softmax_model

__all__ = ["FORMS", "OUT_SCALE", "SoftmaxQuant", "build_softmax", "reference", "softmax_model"]
