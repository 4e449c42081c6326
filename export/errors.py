"""The error the ONNX export raises for a model or inputs it cannot export.

A module of its own so that every export module raises the same class without importing the others.
"""


class ExportError(ValueError):
    """The model or its inputs cannot be exported; the message says what and where."""
