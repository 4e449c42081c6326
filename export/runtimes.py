"""Run an exported ONNX file in onnxruntime, tract or OpenVINO through one small interface.

softq's ONNX files use standard ops only (plus ``com.microsoft.QLinearSoftmax``
in the ``ort`` form), so runtimes other than onnxruntime run them too.  The
export tests check every form in each runtime installed here, and
``examples/bench_export_speed.py`` times them against their own FP32 file.

* ``onnxruntime``: :func:`softq.export.onnx_utils.session` (ORT_ENABLE_ALL; the
  u8u8 option on x86 CPUs without VNNI).
* ``tract`` (Sonos, PyPI ``tract``): input shapes are fixed per session, so a
  runner is built (and cached) per input shape.  Its integer cores equal the
  numpy reference; whole models equal onnxruntime's outputs up to float-order
  rounding ties (tests/test_export_runtimes.py, docs/results/export_speed.md).
* ``openvino`` (PyPI ``openvino``): compiled with ``INFERENCE_PRECISION_HINT=f32``.
  Its CPU plugin otherwise runs the float parts in bf16 on CPUs with AVX512-BF16
  or AMX, which does not match onnxruntime on softq's files; with the hint it does
  (tests/test_export_runtimes.py).

``runner(path, runtime, threads)`` returns ``run(feeds) -> list of outputs``
(numpy arrays, in the file's output order).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib.util import find_spec

import numpy as np

RUNTIMES = ("onnxruntime", "tract", "openvino")

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


def _tract(path: str, threads: int) -> Runner:
    import onnx
    import tract

    names = [i.name for i in onnx.load(path, load_external_data=False).graph.input]
    cache: dict[tuple, object] = {}

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        arrays = [np.ascontiguousarray(feeds[n]) for n in names]
        key = tuple((a.shape, a.dtype.str) for a in arrays)
        if key not in cache:
            model = tract.onnx().load(path)
            for i, a in enumerate(arrays):
                dtype = {"i8": "i64", "i4": "i32", "f4": "f32", "u1": "u8", "i1": "i8", "b1": "bool"}[a.dtype.str[1:]]
                model.set_input_fact(i, ",".join(map(str, a.shape)) + f",{dtype}")
            cache[key] = model.into_model().into_runnable()
        return [t.to_numpy() for t in cache[key].run(arrays)]

    return run


def _openvino(path: str, threads: int) -> Runner:
    import openvino as ov

    compiled = ov.Core().compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                      "INFERENCE_NUM_THREADS": int(threads)})
    request = compiled.create_infer_request()
    names = [i.get_any_name() for i in compiled.inputs]
    outputs = list(compiled.outputs)

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        result = request.infer({n: feeds[n] for n in names})
        return [np.asarray(result[o]) for o in outputs]

    return run


def _inputs_and_bounds(path: str) -> tuple[list[str], dict[str, int]]:
    """The file's input names, and for each input that indexes a table directly (``Gather`` of an initializer:
    token ids, positions) the number of rows it may index."""
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    tables = {t.name: tuple(t.dims) for t in graph.initializer}
    names = [i.name for i in graph.input if i.name not in tables]
    for node in graph.node:  # tables held by Constant nodes
        value = next((a.t for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR), None)
        if node.op_type == "Constant" and value is not None:
            tables[node.output[0]] = tuple(value.dims)
    bounds: dict[str, int] = {}
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] in names and node.input[0] in tables:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            dims = tables[node.input[0]]
            if -len(dims) <= axis < len(dims):
                bounds[node.input[1]] = min(bounds.get(node.input[1], dims[axis]), dims[axis])
    return names, bounds


def runner(path: str | os.PathLike, runtime: str = "onnxruntime", threads: int = 1) -> Runner:
    """A function running the ONNX file at ``path`` in ``runtime`` on the CPU with ``threads`` threads.

    Feeds are checked first (one ``ValueError`` naming the input): every input of the file present, and ids
    that index a table (token ids) inside it.  Runtimes differ there: onnxruntime raises, OpenVINO reads out of
    bounds and returns numbers, tract aborts the process, and ONNX's Gather takes negative ids as counted from
    the end, where the torch model raises."""
    if not available(runtime):
        raise ImportError(f"runtime {runtime!r} is not installed (pip install {runtime})")
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    run = {"onnxruntime": _onnxruntime, "tract": _tract, "openvino": _openvino}[runtime](str(path), threads)
    names, bounds = _inputs_and_bounds(str(path))

    def checked(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        missing = [n for n in names if n not in feeds]
        if missing:
            raise ValueError(f"missing input {', '.join(map(repr, missing))} (the file takes {', '.join(names)})")
        for name, rows in bounds.items():
            ids = np.asarray(feeds[name])
            if ids.size and (ids.min() < 0 or ids.max() >= rows):
                raise ValueError(f"{name} must be in [0, {rows}) (the table it indexes has {rows} rows), "
                                 f"got values from {ids.min()} to {ids.max()}")
        return run(feeds)

    return checked
