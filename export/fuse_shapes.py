"""Shapes in the graph: ONNX shape inference on a skeleton of it (its large weights left out), and the pass
that makes run-time Reshape targets constant where that inference proves them (:func:`static_reshapes`).

:func:`inferred_shapes` is also what the other passes ask when a rewrite needs a tensor's rank, head count or
last dimension.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from softq.export.fuse_graph import Graph


def _dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) or None
            for d in value.type.tensor_type.shape.dim]


PROBE_SIZES = ((11, 13, 17), (19, 23, 29), (31, 37, 41))  # per probe, a prime for each symbolic input dimension
SKELETON_MAX_CONST = 4096  # initializers up to this many elements keep their values for shape inference


def inferred_shapes(model: onnx.ModelProto, sizes: tuple[int, ...] | None = None,
                    keep_value_info: bool = False) -> dict[str, list] | None:
    """Tensor name -> dims by ONNX shape inference (``data_prop``), with the graph inputs' symbolic
    dimensions as they are or, with ``sizes``, set to those sizes (one per distinct symbol).
    ``keep_value_info`` starts from the shapes the graph already records (the tracer's)."""
    # a skeleton: the nodes, small constants, and large initializers as inputs of their shape (not copying
    # the weights keeps this cheap on large models); by default no value_info: the tracer's names would hide
    # that two dimensions are one
    small = [i for i in model.graph.initializer if np.prod(i.dims, dtype=np.int64) <= SKELETON_MAX_CONST]
    inputs = {i.name for i in model.graph.input}  # (older files list initializers as inputs too)
    large = [helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in model.graph.initializer
             if np.prod(i.dims, dtype=np.int64) > SKELETON_MAX_CONST and i.name not in inputs]
    graph = helper.make_graph(model.graph.node, model.graph.name, [*model.graph.input, *large], model.graph.output,
                              small)
    if keep_value_info:
        graph.value_info.extend(model.graph.value_info)
    bare = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    if sizes is not None:
        symbols = list(dict.fromkeys(d.dim_param for i in bare.graph.input
                                     for d in i.type.tensor_type.shape.dim if d.dim_param))
        if len(symbols) > len(sizes):
            return None
        for i in bare.graph.input:
            for d in i.type.tensor_type.shape.dim:
                if d.dim_param:
                    d.dim_value = sizes[symbols.index(d.dim_param)]  # (clears dim_param: one of)
    try:
        inferred = onnx.shape_inference.infer_shapes(bare, data_prop=True)
    except Exception:  # noqa: BLE001 - shapes unknown: nothing to prove
        return None
    return {v.name: _dims(v) for v in (*inferred.graph.value_info, *inferred.graph.input)}


def static_reshapes(model: onnx.ModelProto) -> int:
    """Make run-time Reshape targets constant where shape inference shows it; returns Reshapes changed.

    A target ``Concat`` of 1-element constants and dimensions ``Gather(Shape(t), i)`` (through an
    ``Unsqueeze`` for a scalar index) becomes a constant: a constant stays, and a gathered dimension at
    position ``j`` becomes 0 (copy the input's dimension ``j``) when ONNX shape inference
    (``data_prop``) gives the Reshape input's dimension ``j`` and ``t``'s dimension ``i`` the same
    symbol, or, where broadcasting with a mask loses the symbols, the same size at each of three
    probe shapes (the graph inputs' symbolic dimensions set to distinct primes).  Anything else
    leaves the Reshape as it is.  The Shape/Gather/Concat nodes left without readers go in
    :func:`softq.export.onnx_utils.prune`.
    """
    g = Graph(model, "reshape")
    symbolic = inferred_shapes(model)
    if symbolic is None:
        return 0
    probes: list[dict[str, list]] | None = None

    def gathered(name: str, shapes: dict[str, list]) -> object | None:
        """The symbol or size of the dimension ``name`` holds (``Gather(Shape(t), i)``), else None."""
        node, index = g.producer.get(name), None
        if node is not None and node.op_type == "Unsqueeze":
            node = g.made_by(node.input[0], "Gather")
            index = g.const(node.input[1]) if node is not None else None
            index = index if index is not None and index.ndim == 0 else None
        elif node is not None and node.op_type == "Gather":
            index = g.const(node.input[1])
            index = index if index is not None and index.shape == (1,) else None
        if index is None or any(a.name == "axis" and a.i != 0 for a in node.attribute):
            return None
        shape_node = g.made_by(node.input[0], "Shape")
        dims = shapes.get(shape_node.input[0]) if shape_node is not None and not shape_node.attribute else None
        i = int(index.reshape(()))
        return dims[i] if dims is not None and -len(dims) <= i < len(dims) else None

    def same(shapes: dict[str, list], data: str, j: int, part: str) -> bool:
        dims, dim = shapes.get(data), gathered(part, shapes)
        return dims is not None and dim is not None and j < len(dims) and dims[j] == dim

    changed = 0
    for reshape in g.graph.node:
        if reshape.op_type != "Reshape" or any(a.name == "allowzero" and a.i for a in reshape.attribute):
            continue
        concat = g.made_by(reshape.input[1], "Concat")
        if concat is None:
            continue
        target: list[int] | None = []
        for j, part in enumerate(concat.input):
            value = g.const(part)
            if value is not None and value.size == 1 and value.dtype == np.int64:
                target.append(int(value.reshape(-1)[0]))
                continue
            if not same(symbolic, reshape.input[0], j, part):
                if probes is None:
                    probes = [p for p in (inferred_shapes(model, sizes) for sizes in PROBE_SIZES) if p is not None]
                if len(probes) < len(PROBE_SIZES) or not all(same(p, reshape.input[0], j, part) for p in probes):
                    target = None
                    break
            target.append(0)
        if target is None or target.count(-1) > 1:
            continue
        reshape.input[1] = g.add_const("shape", np.array(target, np.int64))
        changed += 1
    return changed
