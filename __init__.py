"""softq: make softmax-sensitive transformers quantizable, exportable and private-inference-ready."""

__version__ = "0.1.0"
