"""softq.quant: W8A8 post-training quantization of whole models, softmax included (Brevitas)."""

from softq.quant.config import QuantConfig
from softq.quant.quantize import is_quantized, quantize

__all__ = ["QuantConfig", "quantize", "is_quantized"]
