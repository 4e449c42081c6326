"""Passes on the layout of the attention heads' codes after the Q/K/V GEMM (:mod:`softq.export.fuse_linear`):
V's row-sum column written by that GEMM instead of a Pad (:func:`fold_sum_columns`), one Reshape/Transpose
for all of its parts (:func:`merge_head_splits`), and the attention output's QuantizeLinear ahead of the
heads' Transpose/Reshape (:func:`quantize_before_layout`).  Each leaves the outputs bit for bit the same.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import helper

from softq.export.fuse_graph import LAYOUT_OPS, Graph, const_input, dq_params, perm_of, sort_nodes
from softq.export.fuse_linear import linear_of_codes, split_sizes
from softq.export.fuse_shapes import inferred_shapes


def fold_sum_columns(model: onnx.ModelProto) -> int:
    """Let the Q/K/V GEMM write the row core's V sum column; returns the Pads removed.

    The ``row`` attention core pads V (``[batch, heads, keys, head_dim]`` uint8 codes) with a constant
    column (``z + 1``, so that ``E.(v - z)`` also gives the row sum ``sum E``).  Where V comes from a
    :func:`fold_split_quantizers` GEMM (its codes ``Split``, ``Reshape`` to ``[.., heads, head_dim]``,
    ``Transpose`` keeping the last axis, then possibly a ``DequantizeLinear -> QuantizeLinear`` pair with
    equal parameters), the GEMM gets one more column per head instead: zero weights with weight zero point
    0 (an accumulator of exactly 0) and the pad code as bias, which ``QuantizeLinear(1, 0)`` returns
    exactly.  The same codes; one Pad (a copy of V) fewer per layer for a GEMM ``heads`` columns wider.
    """
    g = Graph(model, "sumcol")
    reshaped: set[str] = set()
    removed: dict[int, list[onnx.NodeProto]] = {}
    for pad in g.graph.node:
        if pad.op_type != "Pad" or len(pad.input) != 3 or any(a.name == "mode" and a.s != b"constant"
                                                               for a in pad.attribute):
            continue
        pads, value, x = const_input(g, pad, 1), const_input(g, pad, 2), pad.input[0]
        rank = pads.size // 2 if pads is not None else 0
        if rank < 2 or value is None or value.size != 1 or pads.tolist() != [0] * (2 * rank - 1) + [1]:
            continue
        codes, dq = x, None
        ql = g.made_by(x, "QuantizeLinear")
        if ql is not None:  # an identity requantization (same scale and zero point): the column passes through
            dq = g.made_by(ql.input[0], "DequantizeLinear")
            a = dq_params(g, dq)
            b = (const_input(g, ql, 1), const_input(g, ql, 2)) if len(ql.input) == 3 and not ql.attribute else None
            if (a is None or b is None or b[0] is None or b[1] is None or a[0].size != 1 or b[0].size != 1
                    or a[0].reshape(()) != b[0].reshape(()) or a[1].tobytes() != b[1].tobytes()
                    or a[1].dtype != b[1].dtype or g.only_reader(dq.output[0]) is not ql):
                continue
            codes = dq.input[0]
        transpose = g.made_by(codes, "Transpose")
        perm = perm_of(transpose)
        reshape = g.made_by(transpose.input[0], "Reshape") if perm is not None else None
        target = const_input(g, reshape, 1) if reshape is not None else None
        if (target is None or len(perm) != rank or perm[-1] != rank - 1 or target.shape != (rank,)
                or g.only_reader(x) is not pad or g.only_reader(codes) is not (dq or pad)
                or g.only_reader(reshape.output[0]) is not transpose):
            continue
        heads, size = (int(v) for v in target[-2:])  # heads may be -1 (inferred), which it stays
        split = g.made_by(reshape.input[0], "Split")
        if split is None or heads == 0 or heads < -1 or size <= 0 or g.only_reader(reshape.input[0]) is not reshape:
            continue
        part = linear_of_codes(g, split.input[0])
        sizes = const_input(g, split, 1)
        if (part is None or sizes is None or sizes.ndim != 1 or len(sizes) != len(split.output)
                or int(sizes.sum()) != part["w"].shape[1] or g.only_reader(split.input[0]) is not split
                or value.dtype != part["zero"].dtype or list(split.output).count(reshape.input[0]) != 1):
            continue
        j = list(split.output).index(reshape.input[0])
        start, count = int(sizes[:j].sum()), int(sizes[j])
        heads = count // size if heads == -1 else heads
        if count != heads * size:
            continue
        where = start + size * np.arange(1, heads + 1)  # after each head's columns of part j
        w, w_zp = part["w"], part["w_zp"]
        mm, smul, add = part["nodes"][0], part["nodes"][3], part["nodes"][4]
        column = np.zeros((w.shape[0], heads), w.dtype)  # with weight zero point 0: accumulators exactly 0
        mm.input[1] = g.add_const("w", np.insert(w, where, column, axis=1))
        mm.input[3] = g.add_const("w_zp", np.insert(w_zp, where, np.zeros(heads, w_zp.dtype)))
        smul.input[1] = g.add_const("scale", np.insert(part["scale"], where, np.float32(1.0)))
        add.input[1] = g.add_const("bias", np.insert(part["bias"], where, np.float32(value.reshape(()))))
        sizes = sizes.astype(np.int64)
        sizes[j] += heads
        split.input[1] = g.add_const("sizes", sizes)
        target = target.astype(np.int64)
        target[-1] = size + 1
        reshape.input[1] = g.add_const("shape", target)
        g.rename_uses(pad.output[0], x)
        removed[id(pad)] = []
        reshaped.update([*(n.output[0] for n in part["nodes"]), split.input[0], reshape.input[0], reshape.output[0],
                         codes, x] + ([dq.output[0]] if dq is not None else []))
    kept = [v for v in g.graph.value_info if v.name not in reshaped]  # recorded shapes lack the new columns
    del g.graph.value_info[:]
    g.graph.value_info.extend(kept)
    g.replace(removed)
    return len(removed)


def _contracted_pads(g: Graph, codes: str) -> tuple[np.ndarray, list[tuple[onnx.NodeProto, int]]] | None:
    """Where a part's head codes ``codes`` ([batch, heads, tokens, size]) may take extra columns: each reader is a
    per-tensor ``DequantizeLinear`` (one zero point z for all) whose output a ``MatMul`` contracts over its last
    axis (as input A, or as input B through a Transpose swapping the last two axes).  A column of code z then
    dequantizes to exactly 0 and adds exactly 0 to every product.  Returns (z, [(MatMul, input index)])."""
    zps, uses = [], []
    for dq in g.readers.get(codes, []):
        params = dq_params(g, dq) if dq.op_type == "DequantizeLinear" and dq.input[0] == codes else None
        if params is None or params[0].size != 1 or params[1].size != 1:
            return None
        zps.append(params[1].reshape(()))
        for reader in g.readers.get(dq.output[0], []):
            if reader.op_type == "Transpose" and perm_of(reader) == [0, 1, 3, 2]:
                mm = g.only_reader(reader.output[0])
                if mm is None or mm.op_type != "MatMul" or list(mm.input).index(reader.output[0]) != 1:
                    return None
                uses.append((mm, 1))
            elif reader.op_type == "MatMul" and list(reader.input).count(dq.output[0]) == 1 and reader.input[0] == dq.output[0]:
                uses.append((reader, 0))
            else:
                return None
    if not zps or len({(z.dtype.str, z.tobytes()) for z in zps}) != 1 or g.outputs & {codes}:
        return None
    return zps[0], uses


def merge_head_splits(model: onnx.ModelProto) -> int:
    """One Reshape/Transpose for all heads of a split Q/K/V GEMM instead of one per part; returns how many.

    After :func:`fold_split_quantizers` (and :func:`fold_sum_columns`), a GEMM's codes ``[batch, tokens, n * heads
    * size_j]`` are split into n parts, each ``Reshape``-d to ``[batch, tokens, heads, size_j]`` and
    ``Transpose``-d to ``[batch, heads, tokens, size_j]``: 2n + 1 nodes with the Split.  Where every part has the same heads and
    the narrower parts only feed MatMuls that contract over their last axis (Q and K, one column narrower than
    V with the row core's sum column), those parts get extra columns of their dequantization's zero point
    (zero weights, the code as bias, as :func:`fold_sum_columns`), which add exactly 0 to Q.K, and the
    codes go ``Reshape [batch, tokens, n, heads, size] -> Transpose [batch, n, heads, tokens, size] ->
    Reshape [batch, n * heads, tokens, size] -> Split`` into the same parts: 4 nodes instead of 2n + 1, the
    same products.
    """
    g = Graph(model, "heads")
    replaced: dict[int, list[onnx.NodeProto]] = {}
    stale: set[str] = set()
    merged = 0
    shapes = functools.cache(lambda: inferred_shapes(model) or {})  # only for a Split on a positive axis
    for split in list(g.graph.node):
        if split.op_type != "Split" or len(split.output) < 2:
            continue
        part = linear_of_codes(g, split.input[0])
        if part is None or g.only_reader(split.input[0]) is not split:
            continue
        axis = next((a.i for a in split.attribute if a.name == "axis"), 0)
        rank = len(shapes().get(split.input[0], [])) or None if axis >= 0 else None
        sizes = split_sizes(g, split, part["w"].shape[1], rank)
        if sizes is None:
            continue
        chains = []
        for out in split.output:
            reshape = g.only_reader(out)
            target = const_input(g, reshape, 1) if reshape is not None and reshape.op_type == "Reshape" else None
            transpose = g.only_reader(reshape.output[0]) if target is not None else None
            if (target is None or target.shape != (4,) or transpose is None or transpose.op_type != "Transpose"
                    or perm_of(transpose) != [0, 2, 1, 3] or reshape.input[0] != out):
                break
            chains.append((reshape, [int(v) for v in target], transpose))
        if len(chains) != len(split.output):
            continue
        widths = [t[3] for _, t, _ in chains]
        if min(widths) <= 0:
            continue
        heads = {t[2] if t[2] != -1 else s // t[3] for s, (_, t, _) in zip(sizes, chains)}  # -1: inferred
        lead = {tuple(t[:2]) for _, t, _ in chains}
        width = max(widths)
        if (len(heads) != 1 or len(lead) != 1 or min(heads) <= 0
                or any(s != min(heads) * w for s, w in zip(sizes, widths))):
            continue
        h, n = min(heads), len(chains)
        pads, ok = {}, True
        for j, (_, _, transpose) in enumerate(chains):
            if widths[j] < width:
                found = _contracted_pads(g, transpose.output[0])
                if found is None:
                    ok = False
                    break
                pads[j] = found
        # a MatMul that contracts a padded part must get the padding on both of its inputs
        padded = {id(mm): set() for j in pads for mm, _ in pads[j][1]}
        for j in pads:
            for mm, k in pads[j][1]:
                padded[id(mm)].add(k)
        if not ok or any(roles != {0, 1} for roles in padded.values()):
            continue
        if any(pads[j][0].dtype != part["zero"].dtype for j in pads):
            continue
        w, w_zp, scale, bias = part["w"], part["w_zp"], part["scale"], part["bias"]
        for j in sorted(pads, reverse=True):  # later parts first: earlier column indices stay valid
            extra = width - widths[j]
            start = sum(sizes[:j])
            where = np.repeat(start + widths[j] * np.arange(1, h + 1), extra)
            w = np.insert(w, where, np.zeros((w.shape[0], 1), w.dtype), axis=1)
            w_zp = np.insert(w_zp, where, np.zeros((), w_zp.dtype))
            scale = np.insert(scale, where, np.float32(1.0))
            bias = np.insert(bias, where, np.float32(pads[j][0]))
        mm, smul, add = part["nodes"][0], part["nodes"][3], part["nodes"][4]
        mm.input[1] = g.add_const("w", w)
        mm.input[3] = g.add_const("w_zp", w_zp)
        smul.input[1] = g.add_const("scale", scale.astype(np.float32))
        add.input[1] = g.add_const("bias", bias.astype(np.float32))
        p = f"{split.name or split.output[0]}/heads/"
        codes = split.input[0]
        new = [helper.make_node("Reshape", [codes, g.add_const("shape", np.array([*chains[0][1][:2], n, h, width], np.int64))],
                                [f"{p}r"], name=f"{p}Reshape"),
               helper.make_node("Transpose", [f"{p}r"], [f"{p}t"], name=f"{p}Transpose", perm=[0, 2, 3, 1, 4]),
               helper.make_node("Reshape", [f"{p}t", g.add_const("shape", np.array([0, n * h, -1, width], np.int64))],
                                [f"{p}m"], name=f"{p}Reshape2"),
               helper.make_node("Split", [f"{p}m", g.add_const("sizes", np.full(n, h, np.int64))],
                                [t.output[0] for _, _, t in chains], name=f"{p}Split", axis=1)]
        replaced[id(split)] = new
        merged += 1
        for reshape, _, transpose in chains:
            replaced[id(reshape)] = []
            replaced[id(transpose)] = []
        stale.update([*(n.output[0] for n in part["nodes"]), codes, *split.output,
                      *(r.output[0] for r, _, _ in chains)])  # wider now, or gone
        for j in pads:
            t = chains[j][2].output[0]
            stale.add(t)
            for dq in g.readers.get(t, []):
                stale.add(dq.output[0])
                stale.update(r.output[0] for r in g.readers.get(dq.output[0], []) if r.op_type == "Transpose")
    kept = [v for v in g.graph.value_info if v.name not in stale]  # recorded shapes lack the new columns
    del g.graph.value_info[:]
    g.graph.value_info.extend(kept)
    g.replace(replaced)
    return merged


# ops that only move or repeat their first input's elements: a per-tensor QuantizeLinear commutes with them
MOVING_OPS = (*LAYOUT_OPS, "Tile", "Expand", "Unsqueeze", "Squeeze")


def quantize_before_layout(model: onnx.ModelProto) -> int:
    """Move a per-tensor ``QuantizeLinear`` ahead of the nodes before it that only move elements; returns how many.

    ``QuantizeLinear(Reshape(Transpose(x)))`` (the attention output merged from its heads, read by the output
    projection's quantizer) becomes ``Reshape(Transpose(QuantizeLinear(x)))``, and the K and V of a grouped-query
    layer repeated to the query heads (``Unsqueeze -> Tile -> Reshape``, over the whole cache at each decode step)
    are quantized before they are repeated: an elementwise per-tensor quantization commutes with moving and
    repeating elements (:data:`MOVING_OPS`), so the codes are the same, the moves take a quarter of the bytes and
    the quantization runs once per K/V head instead of once per query head.  Only where each moved op's output has
    no other reader than ``Shape`` nodes (which see the same shape in codes).
    """
    g = Graph(model, "layoutq")
    replaced: dict[int, list[onnx.NodeProto]] = {}
    retyped: set[str] = set()
    for ql in list(g.graph.node):
        if ql.op_type != "QuantizeLinear" or len(ql.input) != 3 or ql.attribute:
            continue
        s, z = g.const(ql.input[1]), g.const(ql.input[2])
        if s is None or z is None or s.size != 1 or z.size != 1:
            continue
        chain, name = [], ql.input[0]
        while True:
            op = g.producer.get(name)
            if (op is None or op.op_type not in MOVING_OPS or op.domain not in ("", "ai.onnx") or id(op) in replaced
                    or g.only_reader(name, but_shape=True) is not (chain[-1] if chain else ql)):
                break
            chain.append(op)
            name = op.input[0]
        if not chain:
            continue
        first, last = chain[-1], chain[0]  # first reads the float x; last fed the QuantizeLinear
        codes = ql.output[0]
        for reader in g.readers.get(last.output[0], []):  # its Shape readers: the same shape, under the new name
            if reader is not ql:
                reader.input[:] = [codes if i == last.output[0] else i for i in reader.input]
        retyped.update(op.output[0] for op in chain)
        ql.input[0] = first.input[0]
        ql.output[0] = f"{codes}/before_layout"
        first.input[0] = ql.output[0]
        last.output[0] = codes
        replaced[id(ql)] = [ql, *reversed(chain)]  # where the QuantizeLinear was: its inputs are all before
        replaced.update((id(op), []) for op in chain)
    kept = [v for v in g.graph.value_info if v.name not in retyped]  # float before, codes now
    del g.graph.value_info[:]
    g.graph.value_info.extend(kept)
    g.replace(replaced)
    sort_nodes(g.graph)  # Shape nodes that read a moved output may sit before its new place
    return sum(1 for nodes in replaced.values() if nodes)


def drop_requantize(model: onnx.ModelProto, flip_sign: bool = False) -> int:
    """``QuantizeLinear(DequantizeLinear(c, s, z), s, z)`` with equal constant per-tensor parameters is ``c``; returns
    how many were dropped.

    The int8 KV cache (:mod:`softq.export.decoder_export`) hands attention the values of its codes, which the K and V
    points quantize again on the same grid (with ``flip_sign``, the cached file's, also the row core's V on the uint8
    grid 128 higher: a ``BitwiseXor`` of the sign bit, which :func:`softq.export.fuse_cache.read_signed_values`
    then drops where the GEMM can read the int8 codes): after :func:`quantize_before_layout` the point's
    ``QuantizeLinear`` reads
    the cache's ``DequantizeLinear``, and the cores read the cache's codes directly (no float pass over the cache per
    step).  Exact: ``round(((c - z) * s) / s) + z`` is ``c`` for every int8 ``c`` at float32 scales.
    """
    g = Graph(model, "requant")
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for ql in list(g.graph.node):
        if ql.op_type != "QuantizeLinear" or len(ql.input) != 3 or ql.attribute:
            continue
        dq = g.made_by(ql.input[0], "DequantizeLinear")
        if dq is None or len(dq.input) != 3 or dq.attribute:
            continue
        params = [g.const(n) for n in (*ql.input[1:], *dq.input[1:])]
        if any(p is None or p.size != 1 for p in params):
            continue
        s1, z1, s2, z2 = params
        if s1.dtype != s2.dtype or s1.item() != s2.item() or ql.output[0] in g.outputs:
            continue
        if z1.dtype == z2.dtype and z1.item() == z2.item():
            g.rename_uses(ql.output[0], dq.input[0])
            replaced[id(ql)] = []
        elif flip_sign and z2.dtype == np.int8 and z1.dtype == np.uint8 and int(z1.item()) == int(z2.item()) + 128:
            # int8 codes onto the unsigned grid 128 higher (the int8 cache's V read by a core on uint8 codes): the
            # same bits with the sign bit flipped, read as uint8
            flipped = f"{ql.output[0]}/sign_flipped"
            mask = g.add_const("sign_bit", np.array(-128, np.int8))
            replaced[id(ql)] = [helper.make_node("BitwiseXor", [dq.input[0], mask], [flipped]),
                                helper.make_node("Cast", [flipped], [ql.output[0]], to=onnx.TensorProto.UINT8)]
    g.replace(replaced)
    dropped = len(replaced)
    if dropped:  # a DequantizeLinear left with Shape readers only: they read the codes' shape (the same)
        g = Graph(model, "requant_shape")
        for dq in g.graph.node:
            readers = g.readers.get(dq.output[0], []) if dq.op_type == "DequantizeLinear" else []
            if readers and dq.output[0] not in g.outputs and all(r.op_type == "Shape" for r in readers):
                for r in readers:
                    r.input[0] = dq.input[0]
    return dropped
