"""The KV cache of an exported decoder: names, shapes and element type of its past and present tensors, in one place.

A decoder file with a cache (:mod:`softq.export.decoder_export`) takes ``input_ids``, ``attention_mask`` (the 2-D
mask over past and new tokens), ``position_ids`` and, per attention layer ``i``, ``past_key_values.{i}.key`` and
``past_key_values.{i}.value``; it outputs ``logits`` and ``present.{i}.key`` / ``present.{i}.value``: the names
optimum's ``text-generation-with-past`` export and onnxruntime-genai's configs use.  Each cache tensor is
``[batch, kv_heads, tokens, head_dim]`` (Hugging Face's layout; grouped-query models keep their K/V heads).

Everything that depends on the cache's element type reads :attr:`CacheLayout.dtype`: the inputs' declared type, the
empty past of a prefill, the generation loop's buffers.  ``int8``: the codes of a quantized model's int8 KV cache
(:mod:`softq.quant.kv_cache`: codes minus 128 for asymmetric points), whose scales and zero points are constants of
the graph; the layout is read from the cache the model itself computes (its element type included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

INPUTS = ("input_ids", "attention_mask", "position_ids")
LOGITS = "logits"
PAST = "past_key_values.{layer}.{part}"
PRESENT = "present.{layer}.{part}"
PARTS = ("key", "value")
# the symbolic axes of the file's inputs and outputs
BATCH, NEW, TOTAL, PAST_LEN = "batch", "sequence", "total_sequence", "past_sequence"


@dataclass(frozen=True)
class CacheLayout:
    """One decoder's cache: ``layers`` attention layers, each a key of ``[batch, kv_heads, tokens, key_dim]`` and a
    value of ``[batch, kv_heads, tokens, value_dim]`` of ``dtype``."""

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: str = "float32"

    @classmethod
    def of_tensors(cls, pairs: Sequence[tuple[object, object]]) -> CacheLayout:
        """The layout of a cache computed by the model itself (its (key, value) per layer, torch or numpy)."""
        if not pairs:
            raise ValueError("the model left no KV cache: it is not a decoder that caches keys and values")
        key, value = pairs[0]
        shapes = {(tuple(k.shape[1:2]), k.shape[-1], v.shape[-1]) for k, v in pairs}
        if len(shapes) != 1 or key.ndim != 4 or value.ndim != 4:
            raise ValueError(f"the model's cache layers differ in shape ({sorted(shapes)}): softq exports caches of "
                             "one [batch, kv_heads, tokens, head_dim] shape for every layer")
        dtype = "int8" if str(key.dtype) in ("torch.int8", "int8") else "float32"
        return cls(len(pairs), int(key.shape[1]), int(key.shape[-1]), int(value.shape[-1]), dtype)

    @classmethod
    def of_inputs(cls, inputs: Sequence[object]) -> CacheLayout:
        """The layout a file declares (its onnxruntime session's ``get_inputs()``); one line if it has no cache."""
        by_name = {i.name: i for i in inputs}
        layers = 0
        while PAST.format(layer=layers, part="key") in by_name:
            layers += 1
        missing = [n for n in INPUTS if n not in by_name]
        if not layers or missing:
            raise ValueError("this ONNX file has no KV cache inputs (past_key_values.0.key ...)" if not layers else
                             f"this ONNX file's cache inputs come without {', '.join(missing)}")
        key, value = by_name[PAST.format(layer=0, part="key")], by_name[PAST.format(layer=0, part="value")]
        dtype = {"tensor(float)": "float32", "tensor(int8)": "int8"}.get(key.type)
        if dtype is None or not isinstance(key.shape[1], int) or not isinstance(key.shape[3], int):
            raise ValueError(f"this ONNX file's cache input {key.name} is {key.type} {key.shape}; softq reads "
                             "float32 or int8 caches of [batch, kv_heads, tokens, head_dim] with fixed heads")
        return cls(layers, key.shape[1], key.shape[3], value.shape[3], dtype)

    @classmethod
    def of_file(cls, path: str) -> CacheLayout:
        """The layout the ONNX file at ``path`` declares (read without its weights), as :meth:`of_inputs`; one line
        unless its outputs begin with ``logits`` and the presents, in that order (a runner's outputs are read by
        position)."""
        import onnx

        graph = onnx.load(path, load_external_data=False).graph
        weights = {t.name for t in graph.initializer}
        layout = cls.of_inputs([_Declared.of(i) for i in graph.input if i.name not in weights])
        outputs, want = [o.name for o in graph.output], layout.output_names()
        if outputs[:len(want)] != want:
            wrong = next(i for i, (o, w) in enumerate(zip([*outputs, None], want)) if o != w)
            raise ValueError(f"this ONNX file's output {wrong} is {outputs[wrong] if wrong < len(outputs) else 'missing'}"
                             f", where a cached decoder's outputs are logits, then the presents in order ({want[wrong]})")
        return layout

    def past_names(self) -> list[str]:
        return [PAST.format(layer=i, part=p) for i in range(self.layers) for p in PARTS]

    def present_names(self) -> list[str]:
        return [PRESENT.format(layer=i, part=p) for i in range(self.layers) for p in PARTS]

    def input_names(self) -> list[str]:
        return [*INPUTS, *self.past_names()]

    def output_names(self) -> list[str]:
        return [LOGITS, *self.present_names()]

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """The exporter's dynamic axes: batch everywhere, new tokens, past tokens, and past + new."""
        axes = {"input_ids": {0: BATCH, 1: NEW}, "attention_mask": {0: BATCH, 1: TOTAL},
                "position_ids": {0: BATCH, 1: NEW}, LOGITS: {0: BATCH, 1: NEW}}
        axes.update({n: {0: BATCH, 2: PAST_LEN} for n in self.past_names()})
        axes.update({n: {0: BATCH, 2: TOTAL} for n in self.present_names()})
        return axes

    def empty(self, batch: int) -> dict[str, np.ndarray]:
        """The past of a prefill: every cache input with 0 tokens."""
        dims = {"key": self.key_dim, "value": self.value_dim}
        return {PAST.format(layer=i, part=p): np.zeros((batch, self.kv_heads, 0, dims[p]), self.dtype)
                for i in range(self.layers) for p in PARTS}

    def next_past(self, outputs: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """The next step's past from a step's outputs (``logits`` first, then the presents in order)."""
        return dict(zip(self.past_names(), outputs[1:]))


@dataclass(frozen=True)
class _Declared:
    """A graph input as onnxruntime's ``NodeArg`` describes it: name, ``tensor(...)`` type, dims (symbols as
    strings)."""

    name: str
    type: str
    shape: list[int | str | None]

    @classmethod
    def of(cls, value: object) -> _Declared:
        from onnx import helper

        tensor = value.type.tensor_type
        kind = {np.dtype(np.float32): "float", np.dtype(np.int8): "int8", np.dtype(np.int64): "int64"}.get(
            np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type)) if tensor.elem_type else None, "other")
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]
        return cls(value.name, f"tensor({kind})", dims)
