"""A decoder's ONNX file with a KV cache: one file for the prefill (a past of 0 tokens) and for each decode step.

``to_onnx(qmodel, path, example, kv_cache=True)`` traces :class:`CachedDecoder` instead of the full-sequence
wrapper: inputs ``input_ids [batch, new]``, ``attention_mask [batch, past + new]``, ``position_ids [batch, new]``
and the past keys and values of every attention layer; outputs ``logits`` and the present keys and values (past and
new tokens), named as :mod:`softq.export.cache_layout` says.  Inside, the past goes into a Hugging Face
``DynamicCache`` and the model runs as it does in ``generate()``: its own mask code builds each layer's mask from
the 2-D mask and the cache length, each layer's ``update`` becomes a ``Concat`` of past and new, and softq's
attention cores read the concatenated K and V, so the integer softmax and P.V are the full-sequence file's.  Every
layer keeps all past tokens (a plain ``DynamicLayer``): a sliding-window layer's mask hides the tokens its window
has passed, which is what the model computes, at the cost of a cache longer than the window.

The trace runs on the example split in two (the first half as a past the model computed itself), so that both the
past and the new tokens are dynamic; :class:`CachedCheck` then runs the written file as a generation runs it, a
prefill of the whole example from an empty past and one decode step on its own present, and compares the logits
and the present with the quantized torch model's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from softq.export.cache_layout import CacheLayout
from softq.export.errors import ExportError
from softq.export.verify import EXPORT_TOLERANCE



def cache_argument(model: nn.Module) -> str:
    """The name the model's forward takes its cache by (``cache``, or ``past_key_values`` in older releases)."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise ExportError(f"{type(model).__name__}.forward takes no KV cache (cache / past_key_values): export it "
                      "without kv_cache")


def _cache_pairs(out: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "layers"):
        return []
    return [(layer.keys, layer.values) for layer in cache.layers]


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position from a (left-padded) 2-D mask, as ``generate()`` computes it (padding at 1)."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


class FloatCache(DynamicCache):
    """A float ``DynamicCache`` a quantized decoder keeps (its int8-cache hook replaces plain ones only): the
    reference of a file exported with ``kv_cache="float"``, whose logits equal the int8 cache's."""


def run_cached(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, past: Any = None,
               float_cache: bool = False) -> tuple[torch.Tensor, list]:
    """(logits, cache pairs) of the model on ``ids`` after ``past`` (a cache object or None: a new cache, the
    model's own kind unless ``float_cache``), its mask over both."""
    from softq.quant.kv_cache import Int8KVCache, kv_cache_ready

    pos = positions(mask)[:, -ids.shape[1]:]
    if past is None:  # every layer keeps every token, as the file's cache (a sliding window is the mask's)
        past = Int8KVCache(model, full=True) if not float_cache and kv_cache_ready(model) else FloatCache()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                    **{cache_argument(model): past})
    return out.logits, _cache_pairs(out)


def _int8_layer(points: nn.Module, keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    """A cache layer of the export copy holding int8 codes: each update stores only the new tokens' codes
    (``QuantizeLinear``), concatenates them to the past codes, and hands attention their values
    (``DequantizeLinear``), which its K and V points round back to the same codes: a pass of the fuse step
    (:func:`softq.export.fuse_layout.drop_requantize`) then lets the cores read the cache's codes directly."""
    from softq.export.functions import CacheLoadFn, CacheStoreFn

    k, v = points.k, points.v
    # per-head or per-channel points (ExportKV) round to the stored codes themselves, whose grid is scale 1
    k_grid, v_grid = (getattr(p, "to_grid", lambda x: x) for p in (k, v))

    class Layer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):  # noqa: ANN001, ANN202
            keys, values = super().update(CacheStoreFn.apply(k_grid(key_states), k.scale, k.zp, k.qmin, k.qmax),
                                          CacheStoreFn.apply(v_grid(value_states), v.scale, v.zp, v.qmin, v.qmax),
                                          *args, **kwargs)
            return CacheLoadFn.apply(keys, k.scale, k.zp), CacheLoadFn.apply(values, v.scale, v.zp)

    layer = Layer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer


class CachedDecoder(nn.Module):
    """input_ids, attention_mask, position_ids, past keys and values -> logits, present keys and values."""

    def __init__(self, model: nn.Module, layout: CacheLayout) -> None:
        super().__init__()
        self.model = model
        self.layout = layout
        self.cache_argument = cache_argument(model)
        self.points = None
        if layout.dtype == "int8":
            from softq.models import attention_modules

            self.points = [m.softq for _, m in attention_modules(model)]
            if len(self.points) != layout.layers:
                raise ExportError(f"the model has {len(self.points)} softq attention layers for {layout.layers} "
                                  "cache layers: an int8 cache is exported for decoders whose every layer caches")
            for p in self.points:
                if not (hasattr(p.k, "store_in_cache") and hasattr(p.v, "store_in_cache")):
                    raise ExportError("an int8 KV cache exports from a quantized model's K and V points")
                p.k.store_in_cache()
                p.v.store_in_cache()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # no config: every layer a full DynamicLayer (a sliding window is the mask's, see the module's docstring)
        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.layout.layers)])
        if self.points is not None:
            cache.layers = [_int8_layer(p, past[2 * i], past[2 * i + 1]) for i, p in enumerate(self.points)]
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{self.cache_argument: cache})
        present = [t for pair in _cache_pairs(out) for t in pair]
        if len(present) != 2 * self.layout.layers:
            raise ExportError(f"the model returned {len(present) // 2} cache layers for {self.layout.layers} past ones")
        return (out.logits, *present)


def example_ids(example_inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of a decoder export's example: a tensor of ids or a dict with ``input_ids``
    (and an optional ``attention_mask``), at least 2 tokens."""
    if isinstance(example_inputs, np.ndarray):
        example_inputs = torch.from_numpy(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = {"input_ids": example_inputs}
    if not isinstance(example_inputs, dict) or "input_ids" not in example_inputs:
        raise ExportError("a decoder export with kv_cache takes example input_ids: a tensor [batch, tokens] or a dict "
                          "with 'input_ids' (and 'attention_mask')")
    extra = set(example_inputs) - {"input_ids", "attention_mask"}
    if extra:
        raise ExportError(f"example_inputs has unexpected key(s) {sorted(extra)}; a decoder with kv_cache takes "
                          "input_ids and attention_mask")
    ids = torch.as_tensor(np.asarray(example_inputs["input_ids"]))
    if ids.ndim != 2 or ids.is_floating_point() or ids.shape[1] < 2:
        raise ExportError(f"example input_ids of a decoder with kv_cache must be integer [batch, tokens] with at "
                          f"least 2 tokens (the trace splits them into a past and new tokens), got {ids.dtype} "
                          f"{tuple(ids.shape)}")
    mask = example_inputs.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else torch.as_tensor(np.asarray(mask))
    if tuple(mask.shape) != tuple(ids.shape):
        raise ExportError(f"example attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}")
    return ids.long(), mask.long()


def cache_kind(kv_cache: bool | str) -> bool:
    """Whether a ``kv_cache`` export argument keeps the cache float (``"float"``) rather than the model's own
    (``True``: the int8 codes of a model whose ``QuantConfig.kv_cache`` resolves to int8); one line otherwise."""
    if kv_cache is True or kv_cache == "float":
        return kv_cache == "float"
    raise ExportError(f"kv_cache must be False, True (the model's own cache: int8 codes where it stores them) or "
                      f"'float' (a float cache, e.g. for onnxruntime-genai), got {kv_cache!r}")


def trace_inputs(model: nn.Module, export_model: nn.Module, example_inputs: Any, float_cache: bool = False
                 ) -> tuple[CachedDecoder, list[str], list[str], dict[str, torch.Tensor], dict[str, dict[int, str]]]:
    """The traced module, its input and output names, the feeds it is traced on (the example's second half after
    a past of its first half, computed by ``model``) and the dynamic axes."""
    from softq.models import is_causal

    if not is_causal(model) or not hasattr(model, "generate"):
        raise ExportError(f"kv_cache exports causal language models (a generate() method and causal attention); "
                          f"{type(model).__name__} is not one")
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ExportError(f"{type(model).__name__}.forward takes no position_ids, which the cached file feeds")
    ids, mask = example_ids(example_inputs)
    from softq.calib.data import CalibrationDataError, check_batch

    try:
        check_batch(model, {"input_ids": ids}, 0, "example input")
    except CalibrationDataError as err:
        raise ExportError(str(err)) from err
    split = ids.shape[1] // 2
    try:
        _, pairs = run_cached(model, ids[:, :split], mask[:, :split], float_cache=float_cache)
    except (RuntimeError, IndexError, ValueError) as err:
        raise ExportError(f"example input_ids {tuple(ids.shape)} do not run through the model with a cache: {err}") from err
    try:
        layout = CacheLayout.of_tensors(pairs)
    except ValueError as err:
        raise ExportError(str(err)) from err
    wrapper = CachedDecoder(export_model, layout).eval()
    feeds = {"input_ids": ids[:, split:], "attention_mask": mask, "position_ids": positions(mask)[:, split:]}
    feeds.update(zip(layout.past_names(), (t.detach() if t.dtype == torch.int8 else t.detach().float()
                                           for pair in pairs for t in pair)))
    return wrapper, layout.input_names(), layout.output_names(), feeds, layout.dynamic_axes()


@dataclass
class CachedCheck:
    """What a cached file must reproduce: the torch model's logits and cache after a prefill of the example and
    after one decode step (the greedy next token)."""

    ids: np.ndarray
    mask: np.ndarray
    next_ids: np.ndarray
    layout: CacheLayout
    prefill: list[np.ndarray]  # logits, then the cache pairs flattened
    decode: list[np.ndarray]
    # "{layer}.key" / "{layer}.value": (scale, stored zero point) of int8 codes, [] or [kv_heads, 1, 1 | head_dim]
    grids: dict[str, tuple[np.ndarray, np.ndarray]]

    @classmethod
    def of(cls, model: nn.Module, example_inputs: Any, layout: CacheLayout) -> CachedCheck:
        ids, mask = example_ids(example_inputs)
        float_cache = layout.dtype != "int8"
        logits, pairs = run_cached(model, ids, mask, float_cache=float_cache)
        nxt = logits[:, -1:].argmax(-1)
        full = torch.cat([ids, nxt], 1)
        full_mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        step_logits, step_pairs = run_cached(model, full, full_mask, float_cache=float_cache)  # the full pass: what a decode step equals
        flat = lambda ls, ps: [ls.float().numpy(), *(t.numpy() if t.dtype == torch.int8 else t.float().numpy()  # noqa: E731
                                                     for p in ps for t in p)]
        grids = {}
        if not float_cache:
            from softq.quant.kv_cache import layer_points, stored_zero_point

            for i, points in layer_points(model).items():
                grids.update({f"{i}.{part}": (p.scale.detach().float().numpy(),
                                              stored_zero_point(p).detach().float().numpy())
                              for part, p in (("key", points.k), ("value", points.v))})
        return cls(ids.numpy(), mask.numpy(), nxt.numpy(), layout, flat(logits, pairs),
                   flat(step_logits[:, -1:], step_pairs), grids)

    def errors(self, path: str | Path) -> dict[str, float]:
        """Relative L2 errors of the file's prefill and decode-step logits and caches (valid tokens only; int8
        caches as the values of their codes: equal codes on the tiny and reference Llamas, a few codes apart past the
        first layer where the layers before differ by float rounding, as the logits do)."""
        from softq.export import onnx_utils

        session = onnx_utils.session(str(path))
        feeds = {"input_ids": self.ids, "attention_mask": self.mask,
                 "position_ids": positions(torch.from_numpy(self.mask)).numpy(), **self.layout.empty(len(self.ids))}
        first = session.run(self.layout.output_names(), feeds)
        mask = np.concatenate([self.mask, np.ones_like(self.next_ids)], 1)
        feeds = {"input_ids": self.next_ids, "attention_mask": mask,
                 "position_ids": positions(torch.from_numpy(mask)).numpy()[:, -1:], **self.layout.next_past(first)}
        second = session.run(self.layout.output_names(), feeds)
        valid = self.mask.astype(bool)
        errors = {}
        for step, got, want, rows in (("prefill", first, self.prefill, valid), ("decode", second, self.decode, None)):
            for name, a, b in zip(self.layout.output_names(), got, want):
                if a.shape != b.shape:
                    raise ExportError(f"the exported file's {step} {name!r} has shape {a.shape}, the torch model's "
                                      f"{b.shape}: the export does not compute this model, and nothing was written")
                if name == "logits" and rows is not None:
                    a, b = a[rows], b[rows]
                if a.dtype == np.int8:  # int8 codes: judged by the values they stand for
                    scale, zero = self.grids[name.split(".", 1)[1]]
                    a, b = (a.astype(np.float32) - zero) * scale, (b.astype(np.float32) - zero) * scale
                errors[f"{step} {name}"] = float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))
        return errors

    def verify(self, path: str | Path) -> None:
        """Raise :class:`ExportError` if the file's prefill or decode step is off the torch model's."""
        for name, error in self.errors(path).items():
            if not error <= EXPORT_TOLERANCE:
                raise ExportError(f"the exported file's {name} is {error:.1%} off the quantized torch model on the "
                                  f"example inputs (relative L2 error, at most {EXPORT_TOLERANCE:.0%} allowed): the "
                                  "export does not compute this model, and nothing was written")
