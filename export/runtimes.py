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


def runner(path: str | os.PathLike, runtime: str = "onnxruntime", threads: int = 1) -> Runner:
    """A function running the ONNX file at ``path`` in ``runtime`` on the CPU with ``threads`` threads."""
    if not available(runtime):
        raise ImportError(f"runtime {runtime!r} is not installed (pip install {runtime})")
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    return {"onnxruntime": _onnxruntime, "tract": _tract, "openvino": _openvino}[runtime](str(path), threads)
