"""``softq.quantize``: W8A8 post-training quantization of a whole Hugging Face model.

What is quantized (each point is a Brevitas quantizer, see ``quantizers.py``):

* every ``nn.Linear`` weight (symmetric, per output channel) and its input;
* the Q and K inputs of the score matmul and the softmax input (scores);
* the softmax output (unsigned codes relative to the row max by default, see
  ``QuantConfig.softmax_output``) and the V input of P.V;
* LayerNorm inputs, i.e. the residual stream (``quantize_residual``; by default only
  with the ``edge`` softmax output).

Embedding tables, the ViT patch-embedding convolution and LayerNorm arithmetic
stay float, as in the usual W8A8 deployments.  Attention is hooked through
``transformers.AttentionInterface`` (``softq.attention``); Hugging Face code is
never edited.

The passes run in this order, each on the calibration set:
SmoothQuant (optional) -> range observation -> softmax bias correction (optional).
Input smoothing (``QuantConfig.input_smoothing``) needs no pass of its own with the
min-max observer: the observation pass also records each Linear input's per-channel
ranges, smoothing is decided from them afterwards, and the smoothed inputs' ranges
follow exactly (a positive per-channel factor maps each channel's min and max to the
scaled input's).  Other observers get a statistics pass first.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from softq.attention import AttentionPoints, attention_points
from softq.calib.data import Batch, as_batches, run_batches
from softq.calib.observers import MinMaxObserver
from softq.calib.smoothquant import InputRecorder, smooth, smooth_inputs, smoothable_linears, smoothing_scales, tied_linears
from softq.models import conv1d_to_linear, model_family
from softq.quant.config import AUTO_SMOOTHING_ALPHA, AUTO_SMOOTHING_RATIO, PREFIX_TOKENS, QuantConfig, softmax_input_span
from softq.quant.quantizers import (ActQuantizer, QEmbedding, QLinear, RowScoresQuantizer, SoftmaxOutputQuantizer,
                                    quantize_weight_only)


class QLayerNorm(nn.LayerNorm):
    """LayerNorm whose input (the residual stream) is quantized first."""

    def __init__(self, norm: nn.LayerNorm, act: ActQuantizer) -> None:
        super().__init__(norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.elementwise_affine,
                         bias=norm.bias is not None, device=norm.weight.device if norm.weight is not None else None)
        self.load_state_dict(norm.state_dict())
        self.input_act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.input_act(x))


def _act(config: QuantConfig, groups: int | str = 1, prefix: int = 0) -> ActQuantizer:
    return ActQuantizer(config.act_bits, config.act_symmetric, config.observer, config.percentile, groups, prefix)


def residual_prefix(model: nn.Module, config: QuantConfig) -> int:
    """How many leading positions get residual-stream scales of their own (``QuantConfig.residual_prefix``)."""
    family = model_family(model)
    if config.residual_prefix == "auto":
        return PREFIX_TOKENS.get(family, 0)
    if config.residual_prefix and family not in PREFIX_TOKENS:
        raise ValueError(f"residual_prefix applies to encoders ({', '.join(PREFIX_TOKENS)}); a {family} model "
                         "decodes with a KV cache, where a step's first row is not position 0; use residual_prefix=0 "
                         "(what 'auto' picks for it)")
    return int(config.residual_prefix)


def _replace_modules(model: nn.Module, config: QuantConfig) -> None:
    """Swap Linear -> QLinear, LayerNorm -> QLayerNorm and Embedding -> QEmbedding in place; Conv2d weights
    and a vision encoder's position table get weight-only codes (:func:`quantize_weight_only`)."""
    prefix = residual_prefix(model, config)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if any(pattern in full for pattern in config.exclude):
                continue
            if type(child) is nn.Linear:
                setattr(parent, child_name, QLinear(child, config.weight_bits, config.weight_per_channel, _act(config)))
            elif type(child) is nn.LayerNorm and config.residual_quantized:
                setattr(parent, child_name, QLayerNorm(child, _act(config, config.residual_groups, prefix)))
            elif type(child) is nn.Embedding and config.embedding_bits is not None:
                setattr(parent, child_name, QEmbedding(child, config.embedding_bits))
    quantize_weight_only(model, config.weight_bits, config.embedding_bits, config.exclude)


def _attach_attention_quantizers(points: AttentionPoints, config: QuantConfig) -> None:
    points.q = _act(config)
    points.k = _act(config)
    points.v = _act(config)
    if config.softmax_bits is not None:
        points.scores = (RowScoresQuantizer(config.act_bits, softmax_input_span(config.softmax_output, config.softmax_bits,
                                                                               config.act_bits))
                         if config.row_relative_input else _act(config))
        points.probs = SoftmaxOutputQuantizer(config.softmax_bits, points.num_heads, config.softmax_scale,
                                              config.softmax_output)


def act_quantizers(model: nn.Module) -> list[nn.Module]:
    """Every activation and softmax-output quantizer in ``model``."""
    return [m for m in model.modules() if isinstance(m, (ActQuantizer, SoftmaxOutputQuantizer))]


def set_mode(model: nn.Module, mode: str) -> None:
    for q in act_quantizers(model):
        q.mode = mode


def quantize(
    model: nn.Module,
    calib_data: Iterable[torch.Tensor | Mapping[str, torch.Tensor]],
    config: QuantConfig | None = None,
    inplace: bool = False,
) -> nn.Module:
    """Quantize ``model`` with ``config`` using ``calib_data``; returns the fake-quantized model.

    ``calib_data`` is an iterable of model inputs (tensors taken as the main
    input, or dicts of keyword inputs).  The result is called and evaluated
    exactly like the original model.  The original is left untouched unless
    ``inplace=True``.
    """
    config = config or QuantConfig()
    model_family(model)  # clear error for unsupported families before any work
    residual_prefix(model, config)  # and for a prefix a causal LM cannot have
    batches = as_batches(model, calib_data)
    _try_forward(model, batches[0])
    qmodel = model if inplace else copy.deepcopy(model)
    qmodel.eval()
    conv1d_to_linear(qmodel)
    attention_points(qmodel)  # switches to softq attention, keeps an already chosen variant
    if config.smoothquant_alpha is not None:
        smooth(qmodel, batches, config.smoothquant_alpha)
    smoothing = None
    if config.input_smoothing is not None:
        auto = config.input_smoothing == "auto"
        smoothing = (AUTO_SMOOTHING_ALPHA if auto else float(config.input_smoothing),
                     AUTO_SMOOTHING_RATIO if auto else 0.0)
    # Min-max ranges of a smoothed input follow from its per-channel ranges, so smoothing is decided
    # after the one observation pass; other observers need the smoothed values themselves: a stats pass first.
    one_pass = smoothing is not None and config.observer == "minmax"
    if smoothing is not None and not one_pass:
        smooth_inputs(qmodel, batches, *smoothing, exclude=config.exclude)
    tied = tied_linears(qmodel)  # before prepare copies the weights: a tied Linear is left alone, as in smooth_inputs
    prepare(qmodel, config)

    set_mode(qmodel, "observe")
    recorder = InputRecorder(qmodel, smoothable_linears(qmodel)) if one_pass else None
    try:
        run_batches(qmodel, batches, desc="calibrating ranges")
    finally:
        if recorder is not None:
            recorder.remove()
    if recorder is not None:
        floats = tuple(name for name, m in qmodel.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, QLinear))
        _smooth_observed(recorder, *smoothing, config.exclude + tied + floats)
    for q in act_quantizers(qmodel):
        q.finish_calibration()
    set_mode(qmodel, "quant")

    if config.bias_correction is not None:
        correct_softmax_bias(qmodel, batches, config.bias_correction)
    return qmodel


def _smooth_observed(recorder: InputRecorder, alpha: float, min_ratio: float, skip: tuple[str, ...]) -> None:
    """Input smoothing decided from the observation pass just run (``smooth_inputs`` without a pass of its
    own): weight columns x s, ``input_scale`` = 1/s, and each input quantizer's min-max range set to what it
    would have seen on the smoothed input, min/max over channels of the channel's min/max times 1/s (exact:
    scaling by a positive factor and rounding are both monotonic)."""
    with torch.no_grad():
        for group, s in smoothing_scales(recorder.groups(), alpha, min_ratio, skip):
            inv = 1.0 / s
            lo, hi = float((group.lo * inv).min()), float((group.hi * inv).max())
            for _, lin in group.linears:
                lin.weight.mul_(s.to(lin.weight.dtype))
                lin.input_scale = inv.to(lin.weight.dtype).clone()
                observer = lin.input_act.observer
                if not isinstance(observer, MinMaxObserver) or lin.input_act.channels is not None:
                    raise RuntimeError("one-pass input smoothing needs per-tensor min-max input observers")
                observer.lo, observer.hi = lo, hi


def prepare(model: nn.Module, config: QuantConfig) -> nn.Module:
    """Insert every quantization point into ``model`` in place (no calibration yet).

    Used by :func:`quantize` before calibrating and by ``softq.quant.load`` to
    rebuild the structure a saved quantized model's state dict fits.
    """
    conv1d_to_linear(model)
    layers = attention_points(model)
    _replace_modules(model, config)
    prefix = residual_prefix(model, config) if config.residual_quantized else 0
    for _, points in layers:
        _attach_attention_quantizers(points, config)
        points.prefix_rows = prefix
    model.softq_quant_config = config
    return model


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


def _try_forward(model: nn.Module, batch: Batch) -> None:
    """Run one example of the first batch through the float model, so a mismatch fails here, named,
    not deep inside a pass (one example: a fraction of a calibration pass)."""
    try:
        run_batches(model, [{k: v[:1] for k, v in batch.items()}])
    except (RuntimeError, IndexError, ValueError) as err:
        shapes = {k: tuple(v.shape) for k, v in batch.items()}
        raise ValueError(f"calibration batch 0 with shapes {shapes} does not fit {type(model).__name__}: {err}") from err


def is_quantized(model: nn.Module) -> bool:
    """True for a model returned by :func:`quantize`."""
    return isinstance(getattr(model, "softq_quant_config", None), QuantConfig)
