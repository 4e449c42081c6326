"""The quantization points of a model: inserting them, switching their mode, fixing their ranges.

:func:`prepare` swaps Linear, norm and embedding layers for the quantized ones
(``layers.py``) and gives every attention layer its Q, K, V, score and softmax-output
quantizers; ``quantize`` calls it before calibrating and ``softq.quant.load`` to
rebuild a saved model's structure.  :func:`set_mode` switches every activation point
between ``float``, ``observe`` and ``quant``; :func:`_finish` ends range calibration.
Shared by ``quantize`` and the calibration passes that finish trial copies.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from softq.attention import AttentionPoints, attention_points
from softq.calib.data import CalibrationDataError
from softq.calib.observers import NoCalibrationData
from softq.hf import refuse_save_pretrained
from softq.models import attention_modules, conv1d_to_linear, is_causal, model_family
from softq.norms import residual_norms
from softq.quant.config import MAX_PREFIX, PREFIX_TOKENS, QuantConfig, softmax_input_span
from softq.quant.kv_cache import kv_point, use_int8_cache
from softq.quant.layers import QEmbedding, QLayerNorm, QLinear, QNorm, quantize_weight_only
from softq.quant.quantizers import ActQuantizer, RowScoresQuantizer, SoftmaxOutputQuantizer


def _act(config: QuantConfig, groups: int | str = 1, prefix: int = 0) -> ActQuantizer:
    return ActQuantizer(config.act_bits, config.act_symmetric, config.observer, config.percentile, groups, prefix)


class _Stop(Exception):
    """Ends a forward pass at the first transformer block (:func:`constant_prefix`)."""


_CONSTANT_PREFIX = "_softq_constant_prefix"  # constant_prefix's answer, cached on the model instance


def constant_prefix(model: nn.Module) -> int:
    """How many leading positions enter the first transformer block with the same values whatever the input: the
    learned tokens a vision encoder puts before its patches ([CLS], a DeiT's distillation token, DINOv2's
    registers, CLIP's class embedding).  Told by running two random inputs of the model's main kind up to that
    block; 0 for text models, whose first token is whatever the tokenizer puts there.  Cached on the model."""
    cached = model.__dict__.get(_CONSTANT_PREFIX)
    if cached is not None:
        return cached
    import torch

    from softq.models import _no_cache, probe_inputs, transformer_blocks

    probe = probe_inputs(model)
    main = getattr(model, "main_input_name", "input_ids")
    count = 0
    if main != "input_ids" and probe.get(main) is not None and probe[main].is_floating_point():
        seen: list[torch.Tensor] = []

        def capture(_m, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            seen.append(hidden.detach())
            raise _Stop

        handle = transformer_blocks(model)[0][1].register_forward_pre_hook(capture, with_kwargs=True)
        was_training = model.training
        try:
            model.eval()
            for seed in (0, 1):
                g = torch.Generator().manual_seed(seed)
                x = torch.randn(probe[main].shape, generator=g).to(probe[main])
                try:
                    with torch.no_grad():
                        model(**{**probe, main: x}, **_no_cache(model))
                except _Stop:
                    pass
        finally:
            handle.remove()
            model.train(was_training)
        if len(seen) == 2 and seen[0].shape == seen[1].shape and seen[0].dim() == 3:
            same = (seen[0] == seen[1]).all(-1)[0]
            while not bool(same.all()) and count < min(same.numel() - 1, MAX_PREFIX) and bool(same[count]):
                count += 1
    model.__dict__[_CONSTANT_PREFIX] = count
    return count


def _prefix_tokens(model: nn.Module) -> int:
    """The special tokens every input of a bidirectional ``model`` starts with: the tokenizer's [CLS] of the
    text families in ``PREFIX_TOKENS`` (a text model's weights do not say what its tokenizer prepends), else
    the learned tokens :func:`constant_prefix` finds."""
    family = model_family(model)
    return PREFIX_TOKENS[family] if family in PREFIX_TOKENS else constant_prefix(model)


def residual_prefix(model: nn.Module, config: QuantConfig) -> int:
    """How many leading positions get residual-stream scales of their own (``QuantConfig.residual_prefix``).

    ``"auto"``: none in a causal model; the special tokens of :func:`_prefix_tokens` else.  An explicit count is
    refused on an encoder whose input is not text and that puts no learned tokens first (audio frames, a vision
    encoder without [CLS]); on a text encoder it is the user's to give (ModernBERT's tokenizer puts [CLS] first;
    'auto' leaves it 0, since nothing in the model says so), and on a decoder too: its first token's massive
    activations (Sun et al. 2024) then get scales of their own, and a cached step past the prefix uses the
    shared ones (:func:`cache_offset_hook`)."""
    family = model_family(model)
    if is_causal(model):
        return 0 if config.residual_prefix == "auto" else int(config.residual_prefix)
    if config.residual_prefix == "auto":
        return _prefix_tokens(model)
    text = getattr(model, "main_input_name", "input_ids") == "input_ids"
    if config.residual_prefix and not text and not _prefix_tokens(model):
        raise ValueError(f"residual_prefix={config.residual_prefix} gives leading special tokens residual scales of "
                         f"their own, but this {family} model puts no learned token before its "
                         f"{getattr(model, 'main_input_name', 'input')} positions; use residual_prefix=0")
    return int(config.residual_prefix)


def cache_offset_hook(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a causal model with prefix rows: tells each prefix quantizer where this call's first row
    sits, the length of the KV cache it is given (``cache``, or the older ``past_key_values``)."""
    past = kwargs.get("cache", kwargs.get("past_key_values"))
    offset = 0
    if past is not None and hasattr(past, "get_seq_length"):
        offset = int(past.get_seq_length())
    elif isinstance(past, (tuple, list)) and past and isinstance(past[0], (tuple, list)) and past[0]:
        offset = int(past[0][0].shape[-2])  # legacy tuples: (key, value) per layer, key [b, h, n, d]
    for module in model.modules():
        if isinstance(module, ActQuantizer) and len(module.prefix):
            module.row_offset = offset


def _replace_modules(model: nn.Module, config: QuantConfig) -> None:
    """Swap Linear -> QLinear, LayerNorm -> QLayerNorm, any other residual-stream norm (RMSNorm, found by what it
    computes: ``softq.norms``) -> QNorm and Embedding -> QEmbedding in place; Conv2d weights and a vision encoder's
    position table get weight-only codes (:func:`quantize_weight_only`)."""
    prefix = residual_prefix(model, config)
    other_norms = ({id(m) for m, _ in residual_norms(model).values() if not isinstance(m, nn.LayerNorm)}
                   if config.residual_quantized else set())
    # the parents only: a list holding the replaced layers too would keep every float weight alive until the end
    # (the whole model twice at once)
    parents = [(name, m) for name, m in model.named_modules() if next(m.children(), None) is not None]
    # a parameter two modules share (a tied lm_head and token table) is copied: each quantized layer gets its own
    # (smoothing scales one's weight columns); any other is adopted, not copied (layers._take_parameters)
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))

    def own(layer: nn.Module) -> bool:
        return all(uses[id(p)] == 1 for p in layer.parameters(recurse=False))

    for parent_name, parent in parents:
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if any(pattern in full for pattern in config.exclude):
                continue
            if type(child) is nn.Linear:
                setattr(parent, child_name, QLinear(child, config.weight_bits, config.weight_per_channel,
                                                           _act(config), adopt=own(child)))
            elif type(child) is nn.LayerNorm and config.residual_quantized:
                setattr(parent, child_name, QLayerNorm(child, _act(config, config.residual_groups, prefix)))
            elif id(child) in other_norms:
                setattr(parent, child_name, QNorm(child, _act(config, config.residual_groups, prefix)))
            elif (type(child) is nn.Embedding and config.embedding_bits is not None
                  and child.num_embeddings >= config.embedding_min_rows):
                setattr(parent, child_name, QEmbedding(child, config.embedding_bits, adopt=own(child)))
    quantize_weight_only(model, config.weight_bits, config.embedding_bits, config.exclude)


def _attach_attention_quantizers(points: AttentionPoints, config: QuantConfig, causal: bool,
                                 kv_heads: int | None = None) -> None:
    points.q = _act(config)
    points.k = kv_point(config, kv_heads)  # per tensor, head or channel (QuantConfig.kv_scales)
    points.v = kv_point(config, kv_heads)
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
    # the key/value heads each layer's K and V carry before grouped-query attention repeats them (seen on the
    # discovery probe), for per-head scales
    kv_heads = {id(m.softq): getattr(m, "softq_kv_heads", None) for _, m in attention_modules(model)}
    for _, points in layers:
        _attach_attention_quantizers(points, config, causal, kv_heads.get(id(points)))
        points.prefix_rows = prefix
    if prefix and causal:
        model.register_forward_pre_hook(cache_offset_hook, with_kwargs=True)
    if causal and config.int8_kv_cache:  # a call that asks for a cache gets the int8 one (kv_cache.py)
        model.register_forward_pre_hook(use_int8_cache, with_kwargs=True)
    model.softq_quant_config = config
    refuse_save_pretrained(model)
    model.train(model.training)  # the inserted modules in the model's mode (new modules are in training mode)
    return model
