"""ONNX plumbing shared by softq's exporters: atomic save, checks, op allow-lists, sessions.

Why atomic: a deployment pipeline that picks up ``model.onnx`` must never see a
half-written or unchecked file, so the model is written to a temporary file in
the target directory, checked there with ``full_check=True``, and only then
moved into place with ``os.replace``.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx

OPT_LEVELS = ("disable", "basic", "extended", "all")

# Ops whose *outputs* are float: none of them may sit inside the integer softmax.
FLOAT_OUTPUT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                      onnx.TensorProto.BFLOAT16}


def check_writable(path: str | os.PathLike, overwrite: bool) -> Path:
    """Validate an output path before any work is done; returns it resolved."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"output path {path} is a directory; give a file name such as {path / 'model.onnx'}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise FileNotFoundError(f"output directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"output directory {parent} is not writable")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; pass overwrite=True (CLI: --overwrite) to replace it")
    return path


def save_atomic(model: onnx.ModelProto, path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write ``model`` to ``path`` via a checked temporary file in the same directory.

    Raises ``FileExistsError`` if ``path`` exists and ``overwrite`` is false, and
    ``onnx.checker.ValidationError`` (nothing written) if the model fails the full check.
    """
    path = check_writable(path, overwrite)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise PermissionError(f"cannot write to output directory {path.parent}: {err.strerror}") from err
    os.close(fd)
    try:
        onnx.save_model(model, tmp)
        onnx.checker.check_model(tmp, full_check=True)
        if path.exists() and not overwrite:  # appeared while we were writing
            raise FileExistsError(f"{path} appeared during export; pass overwrite=True to replace it")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def check(model: onnx.ModelProto) -> None:
    """``onnx.checker.check_model(full_check=True)`` (runs shape inference strictly)."""
    onnx.checker.check_model(model, full_check=True)


def op_counts(model: onnx.ModelProto) -> Counter[tuple[str, str]]:
    """``(domain, op_type) -> count`` over the main graph ('' is the default domain)."""
    return Counter((n.domain or "", n.op_type) for n in model.graph.node)


def contrib_ops(model: onnx.ModelProto) -> list[str]:
    """Names of nodes outside the standard ONNX domain (e.g. com.microsoft)."""
    return [f"{n.domain}::{n.op_type} ({n.name})" for n in model.graph.node if n.domain not in ("", "ai.onnx")]


def check_allowed_ops(nodes: Iterable[onnx.NodeProto], allowed: set[tuple[str, str]]) -> None:
    """Raise naming every node whose ``(domain, op_type)`` is not in ``allowed``."""
    bad = [f"{n.domain or 'ai.onnx'}::{n.op_type} ({n.name})" for n in nodes if (n.domain or "", n.op_type) not in allowed]
    if bad:
        raise ValueError(f"ops outside the allow-list: {', '.join(bad)}")


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor name, after ONNX shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types: dict[str, int] = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        types[vi.name] = vi.type.tensor_type.elem_type
    for init in inferred.graph.initializer:
        types[init.name] = init.data_type
    return types


def float_valued_nodes(model: onnx.ModelProto, nodes: Iterable[onnx.NodeProto] | None = None) -> list[str]:
    """Nodes (of ``nodes``, default all) that produce a floating-point tensor."""
    types = value_types(model)
    chosen = model.graph.node if nodes is None else nodes
    return [f"{n.op_type} ({n.name})" for n in chosen if any(types.get(o) in FLOAT_OUTPUT_TYPES for o in n.output)]


def session(model: onnx.ModelProto | str | os.PathLike, optimization: str = "all", threads: int = 1,
            optimized_path: str | None = None):
    """A CPU onnxruntime session at a named graph optimisation level."""
    import onnxruntime as ort

    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    if optimization not in levels:
        raise ValueError(f"optimization must be one of {OPT_LEVELS}, got {optimization!r}")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = levels[optimization]
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    if optimized_path:
        opts.optimized_model_filepath = str(optimized_path)
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def run(model: onnx.ModelProto | str | os.PathLike, feeds: dict[str, np.ndarray], optimization: str = "all",
        threads: int = 1) -> list[np.ndarray]:
    """Run once on the CPU and return all outputs."""
    return session(model, optimization, threads).run(None, feeds)


def optimized_op_types(model: onnx.ModelProto, optimization: str, workdir: str | os.PathLike) -> list[str]:
    """Op types of the graph onnxruntime actually runs at ``optimization`` (to see fusions)."""
    out = Path(workdir) / f"optimized_{optimization}.onnx"
    session(model, optimization, optimized_path=str(out))
    return [n.op_type for n in onnx.load(str(out)).graph.node]
