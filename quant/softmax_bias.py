"""Softmax bias correction (``QuantConfig.bias_correction``): each softmax output point's ``beta`` measured.

Rounding pushes small probabilities to 0, so rows of Q(p) sum to less than 1; one
pass over the calibration batches on the quantized model measures E[p - Q(p)]
(:class:`~softq.quant.quantizers.SoftmaxOutputQuantizer` does the bookkeeping).
"""

from __future__ import annotations

from torch import nn

from softq.calib.data import Batch, run_batches
from softq.quant.quantizers import SoftmaxOutputQuantizer


def correct_softmax_bias(qmodel: nn.Module, batches: list[Batch], granularity: str) -> None:
    """Measure E[p - Q(p)] on the quantized model and store it as each layer's ``beta``."""
    outputs = [m for m in qmodel.modules() if isinstance(m, SoftmaxOutputQuantizer)]
    if not outputs:
        raise ValueError("softmax bias correction needs a quantized softmax output (softmax_bits)")
    for q in outputs:
        q.start_bias_measurement(granularity)
    run_batches(qmodel, batches, desc="softmax bias correction")
    for q in outputs:
        q.finish_bias_measurement()
