"""Passes that fold constant scales into a neighbour instead of a Mul over the activations: input smoothing's Mul
into a LayerNorm or the row core's final division, the attention's ``1/sqrt(d)`` into the query's
DequantizeLinear, a scalar before a quantizer into its scale, and the row core's scalar factor into the
scale of the QuantizeLinear that reads the attention output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import onnx

from softq.export.fuse_graph import Graph, dq_params, perm_of, requantizer
from softq.export.fuse_shapes import inferred_shapes


def fold_layernorm_scales(model: onnx.ModelProto) -> int:
    """Fold per-channel Muls of a LayerNorm output into its weight and bias; returns LayerNorms changed."""
    g = Graph(model, "ln")
    replaced: dict[int, list[onnx.NodeProto]] = {}
    folded = 0

    @functools.cache
    def shapes() -> dict[str, list]:
        return inferred_shapes(model, keep_value_info=True) or {}
    for ln in list(g.graph.node):
        if ln.op_type != "LayerNormalization" or len(ln.output) != 1 or len(ln.input) < 2:
            continue
        y = ln.output[0]
        axis = next((a.i for a in ln.attribute if a.name == "axis"), -1)
        gamma = g.const(ln.input[1])
        beta = g.const(ln.input[2]) if len(ln.input) > 2 and ln.input[2] else None
        if axis != -1 or y in g.outputs or gamma is None or gamma.ndim != 1 or gamma.dtype != np.float32:
            continue
        muls, c = [], None  # (Mul, the tensor it multiplies: y or a Reshape of y)
        readers = [(r, y) for r in g.readers.get(y, [])]
        while readers:
            reader, x = readers.pop()
            if reader.op_type == "Shape":
                continue
            if reader.op_type == "Reshape" and x == y and reader.output[0] not in g.outputs:
                # a Reshape that keeps the channels last (GPT-2's ln_f -> view -> lm_head): look past it
                if _last_dim(g, reader, shapes) == gamma.size:
                    readers += [(r, reader.output[0]) for r in g.readers.get(reader.output[0], [])]
                    continue
            other = None
            if reader.op_type == "Mul" and reader.input[0] != reader.input[1]:
                other = g.const(reader.input[1] if reader.input[0] == x else reader.input[0])
            ok = (other is not None and other.dtype == np.float32 and other.size == gamma.size
                  and other.shape[-1] == gamma.size and (c is None or np.array_equal(other.reshape(-1), c))
                  and reader.output[0] not in g.outputs)
            if not ok:
                muls = []
                break
            c = other.reshape(-1)
            muls.append((reader, x))
        if not muls:
            continue
        ln.input[1] = g.add_const("gamma", (gamma * c).astype(np.float32))
        if beta is not None:
            ln.input[2] = g.add_const("beta", (beta * c).astype(np.float32))
        for mul, x in muls:
            g.rename_uses(mul.output[0], x)
            replaced[id(mul)] = []
        folded += 1
    g.replace(replaced)
    return folded


def _last_dim(g: Graph, reshape: onnx.NodeProto, shapes: Callable[[], dict[str, list]]) -> int | None:
    """The last dimension of a Reshape's output where it is known: the last entry of a constant target, else
    by shape inference (``shapes``, called only then: GPT-2 builds ``[batch, tokens, hidden]`` at run time).
    A Reshape whose output keeps its input's last dimension maps rows to rows: channels stay last."""
    target = g.const(reshape.input[1])
    if target is not None and target.size and int(target.reshape(-1)[-1]) > 0:
        return int(target.reshape(-1)[-1])
    dims = shapes().get(reshape.output[0])
    return dims[-1] if dims and isinstance(dims[-1], int) else None


def fold_attention_output_scales(model: onnx.ModelProto) -> int:
    """Fold the per-channel Mul on a merged attention output into the core's final division; returns how many.

    ``Mul(Reshape(Transpose(Div(N, Mul(X, k)), perm=[0, 2, 1, 3])), c)``, ``c`` of ``heads * head_dim``
    channels and ``k`` a scalar constant, becomes ``Div(N, Mul(X, k / c[heads, head_dim]))``: the same
    number of nodes in the core, one Mul over the activations fewer (input smoothing of the output
    projection).  Heads and head size come from ONNX shape inference of the division's output.
    """
    g = Graph(model, "attn_out")
    inferred = inferred_shapes(model, keep_value_info=True)  # (the tracer's shapes carry the head count)
    if inferred is None:  # shapes unknown: nothing to fold
        return 0
    shapes = {k: [d if isinstance(d, int) else None for d in dims] for k, dims in inferred.items()}
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for mul in list(g.graph.node):
        if mul.op_type != "Mul" or len(mul.input) != 2:
            continue
        k_side = 1 if g.const(mul.input[1]) is not None else 0
        c, reshape = g.const(mul.input[k_side]), g.made_by(mul.input[1 - k_side], "Reshape")
        if c is None or c.dtype != np.float32 or reshape is None or g.only_reader(reshape.output[0]) is not mul:
            continue
        transpose = g.made_by(reshape.input[0], "Transpose")
        perm = perm_of(transpose)
        if perm != [0, 2, 1, 3] or g.only_reader(transpose.output[0], but_shape=True) is not reshape:
            continue
        div = g.made_by(transpose.input[0], "Div")
        den = g.made_by(div.input[1], "Mul") if div is not None else None
        # Shape readers see the same shape after the fold
        if (den is None or g.only_reader(div.output[0], but_shape=True) is not transpose
                or g.only_reader(den.output[0]) is not div):
            continue
        shape = shapes.get(div.output[0], [])
        k_index = next((j for j, i in enumerate(den.input) if g.const(i) is not None and g.const(i).size == 1), None)
        k = None if k_index is None else g.const(den.input[k_index])
        if len(shape) != 4 or None in shape[1:2] + shape[3:] or k is None or c.size != shape[1] * shape[3]:
            continue
        if c.shape[-1] != c.size or k.dtype != np.float32:
            continue
        heads, size = shape[1], shape[3]
        scale = (np.float32(k.reshape(())) / c.reshape(1, heads, 1, size)).astype(np.float32)
        den.input[k_index] = g.add_const("scale", scale)
        reshape.output[0] = mul.output[0]
        replaced[id(mul)] = []
    g.replace(replaced)
    return len(replaced)


def fold_matmul_scales(model: onnx.ModelProto) -> int:
    """Fold ``Mul(MatMul(DQ(codes, s), B), c)`` (scalar ``c > 0``) into the DQ's scale; returns how many."""
    g = Graph(model, "matmul")
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for mul in list(g.graph.node):
        if mul.op_type != "Mul" or len(mul.input) != 2:
            continue
        for k in (0, 1):
            c = g.const(mul.input[1 - k])
            mm = g.made_by(mul.input[k], "MatMul")
            if c is None or c.size != 1 or c.dtype != np.float32 or not float(c.reshape(())) > 0 or mm is None:
                continue
            if g.only_reader(mm.output[0]) is not mul:
                continue
            dq = next((d for d in (g.made_by(i, "DequantizeLinear") for i in mm.input)
                       if d is not None and g.only_reader(d.output[0]) is mm), None)
            params = dq_params(g, dq)
            if params is None or params[0].size != 1:
                continue
            dq.input[1] = g.add_const("scale", (params[0] * c.reshape(())).astype(np.float32))
            mm.output[0] = mul.output[0]
            replaced[id(mul)] = []
            break
    g.replace(replaced)
    return len(replaced)


def fold_quantizer_input_scales(model: onnx.ModelProto) -> int:
    """Fold ``QuantizeLinear(Mul(x, c), s)`` (scalar ``c > 0``, directly or through Reshape/Transpose) into
    ``QuantizeLinear(x, s / c)``; returns how many.

    Only where ``x`` is a Linear's output (``MatMul``, or its bias ``Add``): OPT multiplies the query
    projection's output by ``1/sqrt(d)`` before the query's quantizer; without the Mul the Q/K/V GEMM's
    parts are each only quantized, so :func:`fold_split_quantizers` and :func:`merge_head_splits` apply.
    A scalar Mul elsewhere stays (GELU's final ``* 0.5`` before fc2's quantizer is part of onnxruntime's
    Gelu fusion).  The same codes up to float rounding at ties (``x c / s`` and ``x / (s / c)`` round
    apart only there), as :func:`fold_split_quantizers`.
    """
    g = Graph(model, "qscale")
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for mul in list(g.graph.node):
        if mul.op_type != "Mul" or len(mul.input) != 2 or mul.domain not in ("", "ai.onnx"):
            continue
        k = next((j for j in (1, 0) if g.const(mul.input[j]) is not None), None)
        c = g.const(mul.input[k]) if k is not None else None
        if (c is None or c.size != 1 or c.dtype != np.float32 or not 0 < float(c.reshape(())) < np.inf
                or g.const(mul.input[1 - k]) is not None or mul.output[0] in g.outputs):
            continue
        x = mul.input[1 - k]
        add = g.made_by(x, "Add")  # only a Linear's output (MatMul [+ bias]), not a Mul inside an activation
        if not (g.made_by(x, "MatMul") or add is not None and any(g.made_by(i, "MatMul") for i in add.input)):
            continue
        quant = requantizer(g, mul.output[0])
        if quant is None:
            continue
        ql, scale = quant[0], quant[1]
        ql.input[1] = g.add_const("scale", np.float32(scale / float(c.reshape(()))))
        g.rename_uses(mul.output[0], x)
        replaced[id(mul)] = []
    g.replace(replaced)
    return len(replaced)


def fold_row_scales(model: onnx.ModelProto) -> int:
    """Fold the row core's scalar factor into the quantizer of the attention output; returns how many.

    ``QuantizeLinear(Div(N, Mul(D, c)), s)`` (directly or through Reshape/Transpose; ``c > 0`` a scalar)
    becomes ``QuantizeLinear(Div(N, D), s * c)``: the same codes up to float rounding at ties, one Mul
    fewer per layer.  A per-channel ``c`` (the output projection's input smoothing, folded there by
    :func:`fold_attention_output_scales`) stays.
    """
    g = Graph(model, "rowscale")
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for div in g.graph.node:
        if div.op_type != "Div" or len(div.input) != 2:
            continue
        mul = g.made_by(div.input[1], "Mul")
        if mul is None or len(mul.input) != 2 or g.only_reader(mul.output[0]) is not div:
            continue
        k = next((j for j, i in enumerate(mul.input) if g.const(i) is not None), None)
        c = g.const(mul.input[k]) if k is not None else None
        if c is None or c.size != 1 or c.dtype != np.float32 or not float(c.reshape(())) > 0:
            continue
        quant = requantizer(g, div.output[0])
        if quant is None:
            continue
        ql, s = quant[0], quant[1]
        ql.input[1] = g.add_const("scale", np.float32(s * float(c.reshape(()))))
        div.input[1] = mul.input[1 - k]
        replaced[id(mul)] = []
    g.replace(replaced)
    return len(replaced)
