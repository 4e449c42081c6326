"""Run an exported ONNX file in onnxruntime, tract or OpenVINO through one small interface.

softq's ONNX files use standard ops only (plus ``com.microsoft.QLinearSoftmax``
in the ``ort`` form), so runtimes other than onnxruntime run them too.  The
export tests check every form in each runtime installed here, and
``examples/bench_export_speed.py`` times them against their own FP32 file.

* ``onnxruntime``: :func:`softq.export.onnx_utils.session` (ORT_ENABLE_ALL; the
  u8u8 option on x86 CPUs without VNNI).
* ``tract`` (Sonos, PyPI ``tract``): input shapes are fixed per session, so a
  runner is built (and cached) per input shape, except along a cached decoder's
  past and total sequence axes (``past_sequence``, ``total_sequence``), which stay
  symbolic: one runner serves every decode step.  Its integer cores equal the
  numpy reference; whole models equal onnxruntime's outputs up to float-order
  rounding ties (tests/test_export_runtimes.py, docs/results/export_speed.md);
  cached decoder files (int8 cache included) give onnxruntime's logits and
  cache codes (tests/test_export_cache.py; the reference Llama LM's after 512
  tokens: docs/results/cache_runtimes.md).
* ``openvino`` (PyPI ``openvino``): compiled with ``INFERENCE_PRECISION_HINT=f32``.
  Its CPU plugin otherwise runs the float parts in bf16 on CPUs with AVX512-BF16
  or AMX, which does not match onnxruntime on softq's files; with the hint it does
  (tests/test_export_runtimes.py).  It runs cached decoder files too (the same
  greedy tokens), its float rounding moving a few int8 cache codes that sit on a
  rounding tie on long prompts (docs/results/cache_runtimes.md).

``runner(path, runtime, threads)`` returns ``run(feeds) -> list of outputs``
(numpy arrays, in the file's output order).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.util import find_spec

import numpy as np

from softq.export.cache_layout import PAST_LEN, TOTAL

RUNTIMES = ("onnxruntime", "tract", "openvino")
MAX_LENGTH_KEY = "softq.max_length"  # metadata of softq's text files: the longest sequence the model takes
# metadata of files whose first positions are special ([CLS] residual scales, a constant attention sink): the number
# of those positions and why; left-padded batches are refused (the graph applies them to positions 0.., pad or not)
RIGHT_PADDING_KEY = "softq.right_padding_rows"
RIGHT_PADDING_WHY_KEY = "softq.right_padding_why"
# metadata of files whose integer softmax computes in int64 (the int form with bias correction or wider inputs):
# OpenVINO's CPU plugin runs int64 arithmetic in int32, which overflows there (logits far off, no error)
INT64_CORE_KEY = "softq.int64_softmax"

# a cached decoder's axes that grow by one each decode step (cache_layout's names)
SYMBOLIC_AXES = (PAST_LEN, TOTAL)

Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


def available(runtime: str) -> bool:
    """Whether ``runtime``'s Python package is installed."""
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; softq runs {', '.join(RUNTIMES)}")
    return find_spec(runtime) is not None


def installed() -> list[str]:
    return [r for r in RUNTIMES if available(r)]


def _onnxruntime(path: str, threads: int) -> Runner:
    from softq.export.onnx_utils import session

    sess = session(path, "all", threads)
    names = [i.name for i in sess.get_inputs()]
    return lambda feeds: sess.run(None, {n: feeds[n] for n in names})


def _tract(path: str, threads: int, names: list[str], dims: dict[str, list[int | str | None]]) -> Runner:
    import tract

    cache: dict[tuple, object] = {}

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        arrays = [np.ascontiguousarray(feeds[n]) for n in names]
        # the cache's growing axes by their symbols, the other dims as given
        shapes = [tuple(d if d in SYMBOLIC_AXES else n for n, d in zip(a.shape, dims.get(name) or [None] * a.ndim))
                  for name, a in zip(names, arrays)]
        key = tuple((shape, a.dtype.str) for shape, a in zip(shapes, arrays))
        if key not in cache:
            model = tract.onnx().load(path)
            for i, (shape, a) in enumerate(zip(shapes, arrays)):
                dtype = {"i8": "i64", "i4": "i32", "f4": "f32", "u1": "u8", "i1": "i8", "b1": "bool"}[a.dtype.str[1:]]
                model.set_input_fact(i, ",".join(map(str, shape)) + f",{dtype}")
            try:
                cache[key] = model.into_model().into_runnable()
            except tract.bindings.TractError as err:  # its own optimiser's failure, with a Rust backtrace
                causes = [line.strip() for line in str(err).splitlines() if line.strip()][:6]
                what = "; ".join(c for c in causes if not c.startswith("Stack backtrace"))
                raise RuntimeError(f"tract cannot run {path}: {what}") from None
        return [t.to_numpy() for t in cache[key].run(arrays)]

    return run


def _openvino(path: str, threads: int, declared: list[str]) -> Runner:
    import openvino as ov

    compiled = ov.Core().compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                      "INFERENCE_NUM_THREADS": int(threads)})
    request = compiled.create_infer_request()
    # a port can carry several names (OpenVINO merges a node into an input and names the port after both):
    # the file's own input name
    names = [next((n for n in sorted(port.get_names()) if n in declared), port.get_any_name()) for port in compiled.inputs]
    outputs = list(compiled.outputs)

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        result = request.infer({n: feeds[n] for n in names})
        return [np.asarray(result[o]) for o in outputs]

    return run


@dataclass
class _Spec:
    """What a file's inputs accept: names, the declared dims (an int where fixed, the symbol's name where dynamic),
    for each input that indexes a table directly the rows it may index, and the longest sequence (metadata)."""

    names: list[str]
    dims: dict[str, list[int | str | None]]
    bounds: dict[str, int]
    max_length: int | None
    dtypes: dict[str, np.dtype] = field(default_factory=dict)
    prefix_rows: int = 0  # first positions that must hold real tokens (right padding only)
    prefix_why: str = ""
    int64_core: bool = False
    ort_ops: tuple[str, ...] = ()  # onnxruntime's own (com.microsoft) operators in the graph


def _spec(path: str) -> _Spec:
    """The file's inputs, and for each input that indexes a table directly (``Gather`` of an initializer:
    token ids) the number of rows it may index."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    graph = model.graph
    tables = {t.name: tuple(t.dims) for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in tables]
    names = [i.name for i in inputs]
    dims = {i.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in i.type.tensor_type.shape.dim] for i in inputs if i.type.tensor_type.HasField("shape")}
    for node in graph.node:  # tables held by Constant nodes
        value = next((a.t for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR), None)
        if node.op_type == "Constant" and value is not None:
            tables[node.output[0]] = tuple(value.dims)
    bounds: dict[str, int] = {}
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] in names and node.input[0] in tables:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            table = tables[node.input[0]]
            if -len(table) <= axis < len(table):
                bounds[node.input[1]] = min(bounds.get(node.input[1], table[axis]), table[axis])
    meta = {p.key: p.value for p in model.metadata_props}
    length = meta.get(MAX_LENGTH_KEY)
    dtypes = {i.name: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)) for i in inputs
              if i.type.tensor_type.elem_type}
    rows = meta.get(RIGHT_PADDING_KEY, "")
    return _Spec(names, dims, bounds, int(length) if length and length.isdigit() else None, dtypes,
                 int(rows) if rows.isdigit() else 0, meta.get(RIGHT_PADDING_WHY_KEY, ""),
                 meta.get(INT64_CORE_KEY) == "true",
                 tuple(sorted({n.op_type for n in graph.node if n.domain == "com.microsoft"})))


def _check_feeds(spec: _Spec, feeds: object) -> dict[str, np.ndarray]:
    """The feeds the file takes, checked (one ``ValueError`` naming the input and the problem)."""
    if not isinstance(feeds, Mapping):
        raise ValueError(f"feeds must be a dict of arrays by input name, got {type(feeds).__name__}")
    missing = [n for n in spec.names if n not in feeds]
    if missing:
        raise ValueError(f"missing input {', '.join(map(repr, missing))} (the file takes {', '.join(spec.names)})")
    extra = [n for n in feeds if n not in spec.names]
    types = feeds.get("token_type_ids") if "token_type_ids" in extra else None
    if types is not None:
        if np.asarray(types).any():
            raise ValueError("token_type_ids has nonzero values, but this file takes one segment (it was exported "
                             "with token type 0 for every token): a sentence pair would be read as one segment")
        extra.remove("token_type_ids")  # all 0: what the file computes
    if extra:
        raise ValueError(f"unexpected input {', '.join(map(repr, extra))} (the file takes {', '.join(spec.names)})")
    arrays = {n: _as_type(n, np.asarray(feeds[n]), spec.dtypes.get(n)) for n in spec.names}
    symbols: dict[str, tuple[str, int]] = {}
    for name, declared in spec.dims.items():
        shape = arrays[name].shape
        if len(shape) != len(declared):
            raise ValueError(f"{name} must have {len(declared)} dimensions {_dims_text(declared)}, got shape {shape}")
        for axis, (want, got) in enumerate(zip(declared, shape)):
            if isinstance(want, int) and want > 0 and got != want:
                raise ValueError(f"{name} must have shape {_dims_text(declared)}, got {shape}: dimension {axis} "
                                 f"is fixed to {want} in this file")
            # runtimes fail deep inside on empty tensors (a Reshape of 0 elements); a cached decoder's empty past
            # (its prefill) runs in each
            if got == 0 and want != PAST_LEN:
                raise ValueError(f"{name} has shape {shape}: dimension {axis} is empty; give at least one "
                                 f"{'example' if axis == 0 else 'element'} along it")
            if isinstance(want, str):
                seen = symbols.setdefault(want, (name, got))
                if seen[1] != got:
                    raise ValueError(f"{name} has {got} along '{want}' where {seen[0]} has {seen[1]}: the two must agree")
    if spec.max_length is not None:
        for name in ("input_ids", "attention_mask"):
            if name in arrays and arrays[name].ndim == 2 and arrays[name].shape[1] > spec.max_length:
                raise ValueError(f"{name} has {arrays[name].shape[1]} tokens; this model takes at most "
                                 f"{spec.max_length} (its position table)")
    mask = arrays.get("attention_mask")
    if spec.prefix_rows and mask is not None and mask.ndim == 2:
        keys = mask != 0
        if ((~keys[:, :spec.prefix_rows]).any(-1) & keys[:, spec.prefix_rows:].any(-1)).any():
            why = spec.prefix_why or "treats its first positions specially"
            raise ValueError(f"attention_mask: a sequence of this batch is left-padded; the model {why}, so pad on "
                             "the right (tokenizer.padding_side='right')")
    if "QLinearSoftmax" in spec.ort_ops and mask is not None and not mask.all():
        raise ValueError("attention_mask has padding, and this file's softmax (the ort form's QLinearSoftmax) has no "
                         "mask input: the pad keys would keep weight in every row; run sequences of one length "
                         "unpadded (one per call), or export the qdq or int form, which mask exactly")
    for name, rows in spec.bounds.items():
        ids = arrays[name]
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            raise ValueError(f"{name} must be in [0, {rows}) (the table it indexes has {rows} rows), "
                             f"got values from {ids.min()} to {ids.max()}")
    return arrays


def _as_type(name: str, array: np.ndarray, dtype: np.dtype | None) -> np.ndarray:
    """``array`` as the file's input type: integers converted where every value fits (a tokenizer's int32 ids for an
    int64 input), floats to the file's float type (float64 images for a float32 input), anything else refused."""
    if dtype is None or array.dtype == dtype:
        return array
    if array.dtype.kind in "iub" and dtype.kind in "iu":
        info = np.iinfo(dtype)
        if not array.size or (array.min() >= info.min and array.max() <= info.max):
            return array.astype(dtype)
        raise ValueError(f"{name} has values from {array.min()} to {array.max()}, outside the file's {dtype} input")
    if array.dtype.kind == "f" and dtype.kind == "f":
        return array.astype(dtype)
    raise ValueError(f"{name} must be {dtype}, got {array.dtype}")


def _dims_text(dims: list) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in dims) + "]"


def runner(path: str | os.PathLike, runtime: str = "onnxruntime", threads: int = 1) -> Runner:
    """A function running the ONNX file at ``path`` in ``runtime`` on the CPU with ``threads`` threads.

    Feeds are checked first (one ``ValueError`` naming the input): every input of the file present and no other
    (``token_type_ids`` of all zeros aside: what the file computes), shapes of the declared rank with the fixed
    dimensions (a ViT's image size) and the dynamic ones agreeing between inputs, sequences no longer than the
    model's position table (``softq.max_length`` in the file's metadata), ids that index a table (token
    ids) inside it, and right padding where the model treats its first positions specially (``[CLS]``
    residual scales, a constant attention sink: ``softq.right_padding_rows``; the torch model refuses left
    padding there too, the graph would apply them to the pad tokens).  Runtimes differ there: onnxruntime
    raises, OpenVINO reads out of bounds or reshapes and returns numbers, tract aborts the process, ONNX's
    Gather takes negative ids as counted from the end, where the torch model raises, and an input the file does
    not take (a sentence pair's token types) would be ignored.  OpenVINO is refused for files whose integer
    softmax computes in int64 (``softq.int64_softmax``): its CPU plugin runs int64 in int32.  Files with
    onnxruntime's own operators (the ``ort`` form's ``com.microsoft.QLinearSoftmax``) run in onnxruntime only:
    tract does not implement them and OpenVINO's outputs differ from onnxruntime's; their batches must
    be unpadded (``QLinearSoftmax`` has no mask input: pad keys keep weight)."""
    if not available(runtime):
        raise ImportError(f"runtime {runtime!r} is not installed (pip install {runtime})")
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    spec = _spec(str(path))
    if runtime == "openvino" and spec.int64_core:
        raise ValueError(f"{path}: its integer softmax computes in int64 (the int form with bias correction or inputs "
                         "wider than 8 bits), which OpenVINO's CPU plugin runs in int32 and overflows; run it in "
                         "onnxruntime or tract, or export the qdq form")
    if runtime != "onnxruntime" and spec.ort_ops:
        raise ValueError(f"{path}: it uses onnxruntime's own {', '.join(spec.ort_ops)} (com.microsoft; softq's 'ort' "
                         f"form), which {'tract does not implement' if runtime == 'tract' else 'OpenVINO computes otherwise (other outputs than onnxruntime)'}; "
                         "run it in onnxruntime, or export the standard-op qdq form")
    if runtime == "onnxruntime":
        run = _onnxruntime(str(path), threads)
    else:  # the file's input names (tract: in their order; OpenVINO: to find them among a port's names)
        run = (_tract(str(path), threads, spec.names, spec.dims) if runtime == "tract" else
               _openvino(str(path), threads, spec.names))
    return lambda feeds: run(_check_feeds(spec, feeds))
