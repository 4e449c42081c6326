"""INT8 KV cache: a decoder's cached keys and values stored as the int8 codes of its K and V points.

softq quantizes K and V where the attention function reads them (``AttentionPoints.k`` / ``.v``, after RoPE), with
static scales fixed by the calibration pass (``QuantConfig.kv_scales``: one per tensor, per key/value head, or per
head and channel: :class:`KVQuantizer`).  Hugging Face writes the float K and V of each step into its cache before
calling the attention function, so a float cache holds values every read rounds again to the same codes.  The
int8 cache stores those codes instead:

* layout: ``int8 [batch, kv_heads, seq, head_dim]`` per layer, for keys and values, in the cache layer's
  ``keys`` / ``values`` (Hugging Face's own layer logic grows, crops, slides and reorders them);
* scale: float32, shape ``[]`` (``tensor``), ``[kv_heads, 1, 1]`` (``head``) or ``[kv_heads, 1, head_dim]``
  (``channel``), broadcast over the codes; the point's ``scale`` buffer;
* zero point: integer-valued float32 of the scale's shape, ``stored_zero_point``: the point's zero point minus
  128 for asymmetric (unsigned 0..255) points, whose codes are stored minus 128; 0 for symmetric ones;
* value: ``(codes - stored_zero_point) * scale``.

A read hands the attention function those dequantized values, which its K and V points round back to the same
codes (``x / s`` lands within float32 rounding of an integer), so a model with the int8 cache computes, bit for
bit, what it computes with a float cache, and a cached decode equals the full forward to float rounding (the
tests check both).  The integer reference of a cache read, P.V as the integer GEMM of the row softmax codes and
the V codes, is :func:`softq.export.kv_reference.cache_attention`.

How it is used: a quantized decoder (``QuantConfig.kv_cache`` resolving to ``int8``) carries a forward pre-hook
(:func:`use_int8_cache`) that gives any call asking for a cache an :class:`Int8KVCache`: a forward with
``use_cache=True`` and no cache, and ``generate()``'s fresh ``DynamicCache`` (replaced before its first step, so
no generation argument is needed).  A cache the caller made otherwise (a static cache, one already filled) is
left alone.  :func:`kv_cache` builds one for passing explicitly.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from softq.calib.observers import NoCalibrationData, NonFiniteActivation, token_rows
from softq.quant.quantizers import ActQuantizer
from softq.softmax import HALF_DTYPES

UNSIGNED_SHIFT = 128  # asymmetric codes 0..255 are stored as int8 code - 128


class KVQuantizer(ActQuantizer):
    """A K or V point with one scale and zero point per key/value head (``granularity="head"``) or per head and
    channel (``"channel"``), from the min-max of what calibration shows it.

    The point sees ``[batch, heads, seq, head_dim]`` after grouped-query attention repeated the key/value heads;
    its parameters are per key/value head (``kv_heads``), repeated to the query heads where it quantizes, and
    its observer reads one copy of each head.  Codes round as ONNX's per-axis ``QuantizeLinear`` (round, then add
    the zero point)."""

    def __init__(self, bits: int, signed: bool, granularity: str, kv_heads: int | None):
        super().__init__(bits, signed)
        if granularity not in ("head", "channel"):
            raise ValueError(f"KV scale granularity must be 'head' or 'channel', got {granularity!r}")
        self.granularity = granularity
        self.kv_heads = kv_heads
        self.observer = None
        self._lo: torch.Tensor | None = None
        self._hi: torch.Tensor | None = None

    def _expand(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        """``t`` ([kv_heads, 1, 1 | head_dim]) repeated to ``heads`` query heads."""
        if t.dim() == 0 or t.shape[0] == heads:
            return t
        if heads % t.shape[0]:
            raise ValueError(f"a K/V point calibrated for {t.shape[0]} key/value heads got {heads} heads")
        return t.repeat_interleave(heads // t.shape[0], dim=0)

    def _forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        if self.mode == "observe":
            self._observe(x, valid)
            return x
        if self.mode != "quant":
            return x
        if x.dtype in HALF_DTYPES:  # rounded in float32, as every activation point
            return self._forward(x.float()).to(x.dtype)
        if torch.is_grad_enabled():
            s, z = self._expand(self.scale, x.shape[1]), self._expand(self.zero_point, x.shape[1])
            return self.quant(s, z, self.bit_width, x)
        return self.fake_quant_inference(x)

    def _observe(self, x: torch.Tensor, valid: torch.Tensor | None) -> None:
        if x.dim() != 4:
            raise ValueError(f"a per-head K/V point takes [batch, heads, seq, head_dim], got shape {tuple(x.shape)}")
        heads = x.shape[1]
        kv = self.kv_heads or heads
        if heads % kv:
            raise ValueError(f"{heads} attention heads are not a multiple of the {kv} key/value heads")
        rows = token_rows(x, valid) if valid is not None else x.transpose(1, 2).reshape(-1, heads, x.shape[-1])
        rows = rows[:, ::heads // kv].detach().float()  # [tokens, kv_heads, head_dim]: one copy of each head
        if rows.shape[0] == 0:
            return
        lo, hi = rows.amin(0), rows.amax(0)
        if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
            raise NonFiniteActivation("non-finite keys or values")
        self._lo = lo if self._lo is None else torch.minimum(self._lo, lo)
        self._hi = hi if self._hi is None else torch.maximum(self._hi, hi)

    def restart_observation(self, observer: str, percentile: float) -> None:
        """Observe afresh (min-max per head or channel whatever the rule: ``v_fold`` re-observes V)."""
        self._lo = self._hi = None
        self.mode = "observe"

    def finish_calibration(self, groups: int | None = None) -> None:
        if self._lo is None:
            if self.mode == "observe":
                raise NoCalibrationData("no keys or values reached this point")
            return
        lo, hi = self._lo.clamp(max=0.0), self._hi.clamp(min=0.0)  # 0 exactly representable
        if self.granularity == "head":
            lo, hi = lo.amin(-1, keepdim=True), hi.amax(-1, keepdim=True)
        lo, hi = lo.unsqueeze(1), hi.unsqueeze(1)  # [kv_heads, 1, 1 | head_dim]
        if self.signed:
            scale = (torch.maximum(-lo, hi) / (2 ** (self.bits - 1) - 1)).clamp(min=1e-12)
            zero_point = torch.zeros_like(scale)
        else:
            scale = ((hi - lo) / (2**self.bits - 1)).clamp(min=1e-12)
            zero_point = torch.round(-lo / scale).clamp(0, 2**self.bits - 1)
        self.scale = scale.to(self.scale.dtype)
        self.zero_point = zero_point.to(self.zero_point.dtype)
        self._lo = self._hi = None

    def _codes_(self, y: torch.Tensor) -> torch.Tensor:
        return y.round_().add_(self._expand(self.zero_point, y.shape[1]) if y.dim() == 4 else self.zero_point)

    def fake_quant_inference(self, x: torch.Tensor) -> torch.Tensor:
        qmin, qmax = float(self.quant.min_int(self.bit_width)), float(self.quant.max_int(self.bit_width))
        s, z = self._expand(self.scale, x.shape[1]), self._expand(self.zero_point, x.shape[1])
        y = (x / s).round_().add_(z)
        return y.clamp_(qmin, qmax).sub_(z).mul_(s)

    def int_repr(self, x: torch.Tensor) -> torch.Tensor:
        qmin, qmax = float(self.quant.min_int(self.bit_width)), float(self.quant.max_int(self.bit_width))
        x = x.float()
        return (x / self._expand(self.scale, x.shape[1])).round_().add_(
            self._expand(self.zero_point, x.shape[1])).clamp_(qmin, qmax)

    def extra_repr(self) -> str:
        return (f"bits={self.bits}, signed={self.signed}, mode={self.mode}, per {self.granularity}, "
                f"scales {tuple(self.scale.shape)}")


def kv_point(config, kv_heads: int | None) -> ActQuantizer:  # noqa: ANN001 (QuantConfig: no import cycle)
    """The K or V point ``config`` asks for: per tensor as every activation point, or a :class:`KVQuantizer`."""
    if config.kv_scales == "tensor":
        return ActQuantizer(config.act_bits, config.act_symmetric, config.observer, config.percentile)
    return KVQuantizer(config.act_bits, config.act_symmetric, config.kv_scales, kv_heads)


def stored_zero_point(point: ActQuantizer) -> torch.Tensor:
    """The zero point of the stored int8 codes (see the module docstring)."""
    return point.zero_point if point.signed else point.zero_point - UNSIGNED_SHIFT


def encode(point: ActQuantizer, x: torch.Tensor) -> torch.Tensor:
    """``x`` ([batch, kv_heads, seq, head_dim]) as the int8 codes the point rounds it to."""
    codes = point.int_repr(x)
    return (codes if point.signed else codes - UNSIGNED_SHIFT).to(torch.int8)


def decode(point: ActQuantizer, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(codes - stored_zero_point) * scale`` in ``dtype``: what the point outputs for the values it coded."""
    return codes.float().sub_(stored_zero_point(point)).mul_(point.scale).to(dtype)


class _Int8Layer:
    """A Hugging Face cache layer whose ``keys`` / ``values`` hold int8 codes: new states are coded by the layer's
    K and V points, the layer's own ``update`` stores them (appending, sliding), and the whole is handed back
    dequantized."""

    key_point: ActQuantizer
    value_point: ActQuantizer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):  # noqa: ANN201
        keys, values = super().update(encode(self.key_point, key_states), encode(self.value_point, value_states),
                                      *args, **kwargs)
        return decode(self.key_point, keys, key_states.dtype), decode(self.value_point, values, value_states.dtype)


class Int8DynamicLayer(_Int8Layer, DynamicLayer):
    """:class:`DynamicLayer` storing int8 codes."""


class Int8SlidingWindowLayer(_Int8Layer, DynamicSlidingWindowLayer):
    """:class:`DynamicSlidingWindowLayer` storing int8 codes."""


_INT8_LAYERS = {DynamicLayer: Int8DynamicLayer, DynamicSlidingWindowLayer: Int8SlidingWindowLayer}


def layer_points(model: nn.Module) -> dict[int, nn.Module]:
    """The ``AttentionPoints`` of each cache layer index (the attention module's ``layer_idx``, else its order)."""
    from softq.models import attention_modules

    return {getattr(module, "layer_idx", i): module.softq
            for i, (_, module) in enumerate(attention_modules(model)) if getattr(module, "softq", None) is not None}


class Int8KVCache(DynamicCache):
    """A ``DynamicCache`` of ``model`` whose full-attention and sliding-window layers store int8 codes (other layer
    kinds, such as linear attention states, stay as Hugging Face makes them).  ``full``: sliding-window layers keep
    every token too (the window is the mask's), as an exported decoder file's cache does."""

    def __init__(self, model: nn.Module, full: bool = False) -> None:
        super().__init__(config=model.config.get_text_config(decoder=True))
        points = layer_points(model)
        for idx, layer in enumerate(self.layers):
            if full and type(layer) is DynamicSlidingWindowLayer:
                layer = DynamicLayer()
            int8 = _INT8_LAYERS.get(type(layer))
            if int8 is not None and idx in points:
                new = int8.__new__(int8)
                new.__dict__.update(layer.__dict__)  # the layer as Hugging Face set it up (its sliding window)
                new.key_point, new.value_point = points[idx].k, points[idx].v
                self.layers[idx] = new


def kv_cache(model: nn.Module) -> Int8KVCache:
    """An empty int8 KV cache for ``model`` (from :func:`softq.quantize`), to pass as its ``cache``."""
    from softq.quant.quantize import is_quantized

    if not is_quantized(model):
        raise ValueError("softq.kv_cache stores the codes of a quantized model's K and V points; pass a model "
                         "returned by softq.quantize (or softq.quant.load)")
    if not _ready(model):
        raise ValueError("softq.kv_cache: the model's K and V points are still calibrating (not in 'quant' mode); "
                         "make the cache once softq.quantize has returned")
    return Int8KVCache(model)


def kv_cache_ready(model: nn.Module) -> bool:
    """Whether ``model``'s cached calls store int8 codes (its config asks for them and its K/V points are ready)."""
    config = getattr(model, "softq_quant_config", None)
    return bool(getattr(config, "int8_kv_cache", False)) and _ready(model)


_CALIBRATING = [0]  # depth of softq.quantize calls running: their passes read K and V as the points see them


@contextlib.contextmanager
def calibrating() -> Iterator[None]:
    """No int8 cache inside ``softq.quantize``: a pass after the ranges are fixed (the fold into V, the bias
    corrections) must see the float K and V that reach the points, not codes a cache already rounded."""
    _CALIBRATING[0] += 1
    try:
        yield
    finally:
        _CALIBRATING[0] -= 1


def _ready(model: nn.Module) -> bool:
    if _CALIBRATING[0]:
        return False
    points = layer_points(model)
    return bool(points) and all(getattr(p.k, "mode", None) == "quant" and getattr(p.v, "mode", None) == "quant"
                                for p in points.values())


def _cache_argument(model: nn.Module) -> str | None:
    """The name the model's forward takes its cache under (``cache``; ``past_key_values`` in older families)."""
    name = model.__dict__.get("_softq_cache_argument", "")
    if name == "":
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        name = next((n for n in ("cache", "past_key_values") if n in params), None)
        model.__dict__["_softq_cache_argument"] = name
    return name


def use_int8_cache(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of a quantized decoder: an :class:`Int8KVCache` where the call would get a fresh float
    cache (see the module docstring).  Not while tracing or exporting (the exported files take no cache), nor
    while the points calibrate."""
    if torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export():
        return None
    name = _cache_argument(model)
    if name is None:
        return None
    key = "past_key_values" if "past_key_values" in kwargs and "cache" not in kwargs else name
    given = kwargs.get(key)
    if given is None:
        use = kwargs.get("use_cache")
        if use is None:
            use = bool(getattr(model.config, "use_cache", False)) and not model.training
        if not use:
            return None
    elif type(given) is not DynamicCache or given.get_seq_length() != 0:
        return None
    if not _ready(model):
        return None
    kwargs[key] = Int8KVCache(model)
    return args, kwargs


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes a cache holds: its stored keys and values, and for int8 layers each point's scale and zero point."""
    total, points = 0, {}
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
        if isinstance(layer, _Int8Layer):
            for p in (layer.key_point, layer.value_point):
                points[id(p)] = p
    for p in points.values():
        total += p.scale.numel() * 4 + p.zero_point.numel() * 1  # float32 scales, int8 zero points
    return total
