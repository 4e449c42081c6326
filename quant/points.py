"""The quantization points of a model: inserting them, switching their mode, fixing their ranges.

:func:`prepare` swaps Linear, norm and embedding layers for the quantized ones
(``layers.py``) and gives every attention layer its Q, K, V, score and softmax-output
quantizers; ``quantize`` calls it before calibrating and ``softq.quant.load`` to
rebuild a saved model's structure.  :func:`set_mode` switches every activation point
between ``float``, ``observe`` and ``quant``; :func:`_finish` ends range calibration.
Shared by ``quantize`` and the calibration passes that finish trial copies.
"""

from __future__ import annotations

from torch import nn

from softq.attention import AttentionPoints, attention_points
from softq.calib.data import CalibrationDataError
from softq.calib.observers import NoCalibrationData
from softq.hf import refuse_save_pretrained
from softq.models import conv1d_to_linear, is_causal, model_family
from softq.quant.config import PREFIX_TOKENS, QuantConfig, softmax_input_span
from softq.norms import residual_norms
from softq.quant.layers import QEmbedding, QLayerNorm, QLinear, QNorm, quantize_weight_only
from softq.quant.quantizers import ActQuantizer, RowScoresQuantizer, SoftmaxOutputQuantizer


def _act(config: QuantConfig, groups: int | str = 1, prefix: int = 0) -> ActQuantizer:
    return ActQuantizer(config.act_bits, config.act_symmetric, config.observer, config.percentile, groups, prefix)


def residual_prefix(model: nn.Module, config: QuantConfig) -> int:
    """How many leading positions get residual-stream scales of their own (``QuantConfig.residual_prefix``)."""
    family = model_family(model)
    causal = is_causal(model)
    if config.residual_prefix == "auto":
        return 0 if causal else PREFIX_TOKENS.get(family, 0)
    if config.residual_prefix and (causal or family not in PREFIX_TOKENS):
        what = f"a {family} decoder (is_decoder=True)" if family in PREFIX_TOKENS else f"a {family} model"
        raise ValueError(f"residual_prefix applies to encoders ({', '.join(PREFIX_TOKENS)}); {what} "
                         "decodes with a KV cache, where a step's first row is not position 0; use residual_prefix=0 "
                         "(what 'auto' picks for it)")
    return int(config.residual_prefix)


def _replace_modules(model: nn.Module, config: QuantConfig) -> None:
    """Swap Linear -> QLinear, LayerNorm -> QLayerNorm, any other residual-stream norm (RMSNorm, found by what it
    computes: ``softq.norms``) -> QNorm and Embedding -> QEmbedding in place; Conv2d weights and a vision encoder's
    position table get weight-only codes (:func:`quantize_weight_only`)."""
    prefix = residual_prefix(model, config)
    other_norms = ({id(m) for m, _ in residual_norms(model).values() if not isinstance(m, nn.LayerNorm)}
                   if config.residual_quantized else set())
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if any(pattern in full for pattern in config.exclude):
                continue
            if type(child) is nn.Linear:
                setattr(parent, child_name, QLinear(child, config.weight_bits, config.weight_per_channel, _act(config)))
            elif type(child) is nn.LayerNorm and config.residual_quantized:
                setattr(parent, child_name, QLayerNorm(child, _act(config, config.residual_groups, prefix)))
            elif id(child) in other_norms:
                setattr(parent, child_name, QNorm(child, _act(config, config.residual_groups, prefix)))
            elif (type(child) is nn.Embedding and config.embedding_bits is not None
                  and child.num_embeddings >= config.embedding_min_rows):
                setattr(parent, child_name, QEmbedding(child, config.embedding_bits))
    quantize_weight_only(model, config.weight_bits, config.embedding_bits, config.exclude)


def _attach_attention_quantizers(points: AttentionPoints, config: QuantConfig, causal: bool) -> None:
    points.q = _act(config)
    points.k = _act(config)
    points.v = _act(config)
    if config.softmax_bits is not None:
        if config.row_relative_input:
            points.scores = RowScoresQuantizer(config.act_bits, softmax_input_span(config.softmax_output,
                                                                                   config.softmax_bits, config.act_bits))
        elif not config.float_scores:  # softmax_input="float": the scores stay float (nn.Identity)
            points.scores = _act(config)
        points.probs = SoftmaxOutputQuantizer(config.softmax_bits, points.num_heads, config.softmax_scale,
                                              config.softmax_output)
        points.probs.causal_rows = causal  # per-row bias correction by position (SoftmaxOutputQuantizer.beta_for)
        points.set_softmax(points.softmax_name, **points.softmax_params)  # the quantizer learns if rows sum to 1


def act_quantizers(model: nn.Module) -> list[nn.Module]:
    """Every activation and softmax-output quantizer in ``model``."""
    return [m for m in model.modules() if isinstance(m, (ActQuantizer, SoftmaxOutputQuantizer))]


def set_mode(model: nn.Module, mode: str) -> None:
    for q in act_quantizers(model):
        q.mode = mode


def _finish(qmodel: nn.Module) -> None:
    prefix = max((getattr(points, "prefix_rows", 0) for _, points in attention_points(qmodel)), default=0)
    for name, q in qmodel.named_modules():
        if not isinstance(q, (ActQuantizer, SoftmaxOutputQuantizer)):
            continue
        try:
            q.finish_calibration()
        except NoCalibrationData:
            why = (f"; the model gives its first {prefix} position(s) scales of their own (QuantConfig.residual_"
                   f"prefix): calibration sequences of {prefix} token(s) reach only those" if prefix else "")
            raise CalibrationDataError(f"no calibration value reached {name}{why}") from None
    set_mode(qmodel, "quant")


def prepare(model: nn.Module, config: QuantConfig) -> nn.Module:
    """Insert every quantization point into ``model`` in place (no calibration yet).

    Used by :func:`quantize` before calibrating and by ``softq.quant.load`` to
    rebuild the structure a saved quantized model's state dict fits.
    """
    conv1d_to_linear(model)
    layers = attention_points(model)
    _replace_modules(model, config)
    prefix = residual_prefix(model, config) if config.residual_quantized else 0
    causal = is_causal(model)
    for _, points in layers:
        _attach_attention_quantizers(points, config, causal)
        points.prefix_rows = prefix
    model.softq_quant_config = config
    refuse_save_pretrained(model)
    model.train(model.training)  # the inserted modules in the model's mode (new modules are in training mode)
    return model
