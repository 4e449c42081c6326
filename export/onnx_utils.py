"""ONNX plumbing shared by softq's exporters: atomic save, checks, op allow-lists, sessions.

Why atomic: a deployment pipeline that picks up ``model.onnx`` must never see a
half-written or unchecked file, so the model is written to a temporary file in
the target directory, checked there with ``full_check=True``, and only then
moved into place with ``os.replace``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from softq._files import default_mode

OPT_LEVELS = ("disable", "basic", "extended", "all")

# Ops whose *outputs* are float: none of them may sit inside the integer softmax.
FLOAT_OUTPUT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                      onnx.TensorProto.BFLOAT16}


def check_writable(path: str | os.PathLike, overwrite: bool) -> Path:
    """Validate an output path before any work is done; returns it resolved."""
    if str(path).endswith(("/", os.sep)):  # Path() drops the slash: "exports/" would be written as a file
        raise ValueError(f"output path {path} names a directory; give a file name such as {Path(path) / 'model.onnx'}")
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


def save_atomic(model: onnx.ModelProto, path: str | os.PathLike, overwrite: bool = False,
                verify: Callable[[str], None] | None = None) -> Path:
    """Write ``model`` to ``path`` via a checked temporary file in the same directory.

    Raises ``FileExistsError`` if ``path`` exists and ``overwrite`` is false, and
    ``onnx.checker.ValidationError`` (nothing written) if the model fails the full check.  ``verify``, given the
    temporary file's path, may raise too (the export's self-check); nothing is written then either.

    A model whose tensors take more than :data:`PROTOBUF_LIMIT` bytes (one protobuf message holds at most 2 GiB) is
    written with its tensors as ONNX external data, in one file beside it named ``{path.name}.{token}.data``
    (``model``'s tensors then point at it).  The data file has a name of its own each time, so that the ``.onnx``
    is the one file replaced: a reader sees the old file with its old data or the new file with its new data,
    never one with the other's; the data files the old ``.onnx`` referenced are removed after the replace.
    """
    import shutil
    import uuid

    path = check_writable(path, overwrite)
    try:
        folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as err:
        raise PermissionError(f"cannot write to output directory {path.parent}: {err.strerror}") from err
    tmp = folder / path.name
    data = f"{path.name}.{uuid.uuid4().hex[:12]}.data" if tensor_bytes(model) > PROTOBUF_LIMIT else None
    try:
        if data is None:
            onnx.save_model(model, str(tmp))
        else:
            onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                            size_threshold=1024)
        onnx.checker.check_model(str(tmp), full_check=True)
        if verify is not None:
            verify(str(tmp))
        if path.exists() and not overwrite:  # appeared while we were writing
            raise FileExistsError(f"{path} appeared during export; pass overwrite=True to replace it")
        old = external_files(path) if path.is_file() else set()
        default_mode(tmp)
        if data is not None:
            default_mode(folder / data)
            os.replace(folder / data, path.parent / data)
        os.replace(tmp, path)
        for name in old - {data}:
            with contextlib.suppress(OSError):
                (path.parent / name).unlink()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return path


def external_files(path: str | os.PathLike) -> set[str]:
    """The external data files an ONNX file references (names relative to its folder; none for a plain file)."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - not an ONNX file: it references nothing softq would remove
        return set()
    return {e.value for t in onnx.external_data_helper._get_all_tensors(model)
            if t.data_location == onnx.TensorProto.EXTERNAL for e in t.external_data if e.key == "location"}


def check(model: onnx.ModelProto) -> None:
    """``onnx.checker.check_model(full_check=True)`` (runs shape inference strictly).  A model past
    :data:`PROTOBUF_LIMIT` cannot be checked in memory (the checker serializes it): :func:`save_atomic` checks its
    file, with the external data, instead."""
    if tensor_bytes(model) <= PROTOBUF_LIMIT:
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


VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def needs_u8u8(cpuinfo: str | None = None, machine: str | None = None) -> bool:
    """Whether onnxruntime must run int8-weight MatMuls as u8u8 on this CPU to be exact.

    x86 CPUs without VNNI (AVX2 / AVX-512 without VNNI) add pairs of u8*s8
    products in int16 (``vpmaddubsw``), which saturates; onnxruntime's session
    option ``session.x64quantprecision=1`` converts int8 weights to u8u8 at load
    time.  It is no free safety net: onnxruntime also applies it on VNNI CPUs
    (1.62x the time on MiniLM, docs/results/weight_storage.md),
    so it is set only where needed: x86 without any of ``VNNI_FLAGS`` (Linux
    ``/proc/cpuinfo``; when the flags cannot be read, it is set, the safe side).
    ARM and other CPUs have exact int8 dot products.
    """
    import platform

    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return False
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return True
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return not any(f in flags for f in VNNI_FLAGS)


def session_options(threads: int = 1):
    """onnxruntime ``SessionOptions`` for softq's INT8 files on this CPU (threads; the u8u8 option where needed)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    if needs_u8u8():
        opts.add_session_config_entry("session.x64quantprecision", "1")
    return opts


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
    opts = session_options(threads)
    opts.graph_optimization_level = levels[optimization]
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


def unshare_int_initializers(model: onnx.ModelProto) -> int:
    """Give each node reading an int8 / uint8 initializer that another node reads too its own copy, in place;
    returns the copies made.  torch's exporter merges initializers of equal values (two layers with the same
    weight codes, one Linear run twice), and onnxruntime's u8u8 conversion (``session.x64quantprecision``),
    which rewrites each integer weight and zero point for its node, fails to load a file that shares one."""
    graph = model.graph
    ints = {i.name: i for i in graph.initializer if i.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)}
    seen: set[str] = set()
    copies: list[onnx.TensorProto] = []
    for node in graph.node:
        for j, name in enumerate(node.input):
            if name not in ints:
                continue
            if name in seen:
                twin = onnx.TensorProto()
                twin.CopyFrom(ints[name])
                twin.name = f"{name}/{len(copies)}"
                copies.append(twin)
                node.input[j] = twin.name
            seen.add(name)
    graph.initializer.extend(copies)
    return len(copies)


# bytes: one ONNX file (a protobuf message) is at most 2 GiB; past it save_atomic writes external data
PROTOBUF_LIMIT = 2**31


def tensor_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the graph's initializers and Constant tensors, from their shapes (the bulk of a file's size)."""
    tensors = [*model.graph.initializer, *(a.t for n in model.graph.node if n.op_type == "Constant"
                                           for a in n.attribute if a.HasField("t"))]
    return sum(int(np.prod(t.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
               for t in tensors if t.data_type != onnx.TensorProto.STRING)


def prune(model: onnx.ModelProto) -> onnx.ModelProto:
    """Remove nodes and initializers nothing downstream of the graph outputs uses."""
    graph = model.graph
    needed = {o.name for o in graph.output}
    kept: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
    kept.reverse()
    del graph.node[:]
    graph.node.extend(kept)
    _drop_initializers(graph, {i.name for i in graph.initializer if i.name not in needed})
    return model


def _drop_initializers(graph: onnx.GraphProto, names: set[str]) -> None:
    """Delete the initializers named ``names`` in place (not by rebuilding the list: protobuf copies each tensor
    it extends a list with, and a model's weights are most of its memory)."""
    if names:
        for index in reversed(range(len(graph.initializer))):
            if graph.initializer[index].name in names:
                del graph.initializer[index]


def drop_identity_casts(model: onnx.ModelProto) -> onnx.ModelProto:
    """Remove Casts to the type their input already has (OPT's ``attention_mask.long()`` of an int64 mask; types
    known without shape inference: inputs, initializers, Casts' outputs).  tract evaluates a CumSum of such a
    Cast as a symbolic dimension and fails; OpenVINO merges it into the input and names the port after it."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    types = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    types.update((i.name, i.data_type) for i in graph.initializer)
    rename: dict[str, str] = {}
    kept: list[onnx.NodeProto] = []
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
        cast_to = next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None
        if cast_to is not None and node.output[0] not in outputs:
            if types.get(node.input[0]) == cast_to:
                rename[node.output[0]] = node.input[0]
                continue
            types[node.output[0]] = cast_to
        kept.append(node)
    _keep_nodes(graph, kept, rename)
    return model


def _keep_nodes(graph: onnx.GraphProto, kept: list[onnx.NodeProto], renamed: dict[str, str]) -> None:
    """The graph's nodes become ``kept``; the shapes recorded for tensors renamed away are dropped."""
    del graph.node[:]
    graph.node.extend(kept)
    infos = [vi for vi in graph.value_info if vi.name not in renamed]
    del graph.value_info[:]
    graph.value_info.extend(infos)


def dedupe(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Merge nodes that compute the same thing (common subexpressions); returns (model, nodes removed).

    Two initializers or ``Constant`` nodes are the same when their tensors are equal;
    any other two nodes when op, domain, attributes and (already merged) inputs are equal.
    Nodes producing graph outputs are kept.  softq's export gives the Q, K and V
    projections one ``QuantizeLinear`` of the same input each (one activation
    quantizer per Linear, with the same calibrated grid); onnxruntime does not
    merge them (its own common-subexpression pass compares the scale tensors by
    name), so each layer quantized its input three times.
    """
    drop_identity_casts(model)
    graph = model.graph
    outputs = {o.name for o in graph.output}
    rename: dict[str, str] = {}
    inputs = {i.name for i in graph.input}
    first: dict[bytes, str] = {}
    for init in graph.initializer:  # equal initializers (each layer's copy of the same constant) -> one
        # int8 tensors stay apart: onnxruntime's u8u8 conversion (session.x64quantprecision) rewrites
        # each weight zero point per node and fails on a shared one
        if init.name in inputs or init.data_location == onnx.TensorProto.EXTERNAL or init.data_type == onnx.TensorProto.INT8:
            continue
        key_init = onnx.TensorProto()
        key_init.CopyFrom(init)
        key_init.ClearField("name")
        key_init.ClearField("doc_string")
        key = hashlib.sha256(key_init.SerializeToString(deterministic=True)).digest()  # not a copy of each tensor
        if key in first:
            rename[init.name] = first[key]
        else:
            first[key] = init.name
    _drop_initializers(graph, set(rename))
    seen: dict[bytes, onnx.NodeProto] = {}
    kept: list[onnx.NodeProto] = []
    removed = 0
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
        if node.op_type in ("If", "Loop", "Scan") or any(o in outputs for o in node.output):
            kept.append(node)
            continue
        if node.op_type == "Identity":  # the exporter's way of sharing equal parameters: a plain rename
            rename[node.output[0]] = node.input[0]
            removed += 1
            continue
        if node.op_type == "Constant" and node.attribute and node.attribute[0].t.data_type == onnx.TensorProto.INT8:
            kept.append(node)
            continue
        key_node = onnx.NodeProto()
        key_node.CopyFrom(node)
        key_node.ClearField("name")
        del key_node.output[:]
        key_node.ClearField("doc_string")
        key = key_node.SerializeToString(deterministic=True)
        twin = seen.get(key)
        if twin is not None and len(twin.output) == len(node.output):
            rename.update(zip(node.output, twin.output))
            removed += 1
            continue
        seen[key] = node
        kept.append(node)
    _keep_nodes(graph, kept, rename)
    return model, removed


def compact_names(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Give every internal tensor a short name and drop node names; returns (model, bytes saved).

    The graph's inputs and outputs keep their names; nothing else changes (ops, order,
    attributes, values).  The exporter's names (``/model/vit/layers.0/attention/q_proj/
    input_act/Constant_output_0``...) appear once per producer and once per consumer
    and take several percent of an INT8 file.  Node names are optional in ONNX;
    runtimes name unnamed nodes themselves.
    """
    before = model.ByteSize()
    graph = model.graph
    keep = {v.name for v in graph.input} | {v.name for v in graph.output}
    rename: dict[str, str] = {}
    taken: set[str] = set()

    def short(name: str) -> str:
        if not name or name in keep:
            return name
        while name not in rename:
            n, s = len(rename) + len(taken), ""
            while True:  # base 36
                n, r = divmod(n, 36)
                s = "0123456789abcdefghijklmnopqrstuvwxyz"[r] + s
                if n == 0:
                    break
            if f"_{s}" in keep:  # an input or output already has this name
                taken.add(f"_{s}")
            else:
                rename[name] = f"_{s}"
        return rename[name]

    for node in graph.node:
        if node.op_type in ("If", "Loop", "Scan"):  # subgraphs see outer names: leave such graphs alone
            return model, 0
    for init in graph.initializer:
        init.name = short(init.name)
    for node in graph.node:
        node.name = ""
        node.doc_string = ""
        for i, name in enumerate(node.input):
            node.input[i] = short(name)
        for i, name in enumerate(node.output):
            node.output[i] = short(name)
    for vi in graph.value_info:
        vi.name = short(vi.name)
    return model, before - model.ByteSize()
