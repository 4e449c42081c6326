"""Graph passes of a decoder file with an int8 KV cache: attention reads the cache's codes per K/V head.

A grouped-query layer's trace repeats each cached K/V head to its query heads (``Unsqueeze -> Tile -> Reshape``,
Hugging Face's ``repeat_kv``) before the score and P.V matmuls, over the whole cache at every decode step.
:func:`group_query_heads` computes both matmuls with the queries grouped per K/V head instead: the query codes
``[b, heads, q, d]`` read as ``[b, kv_heads, rep * q, d]`` (query head ``h`` reads K/V head ``h // rep``, so each
group's heads are adjacent), one matmul per K/V head, the result read back as ``[b, heads, q, keys]`` (a model
with as many K/V heads as query heads gets the same integer score GEMM on its cache's codes).  The scores
become one ``MatMulInteger`` of the query codes and the cache's transposed K codes (onnxruntime fuses it with the
``Cast -> Mul`` of the scales into ``MatMulIntegerToFloat``): no repeated, dequantized or re-quantized copy of the
cache.  Float queries (a K point with per-channel scales folds them into the queries) get one float MatMul per
K/V head with the cache's dequantized K codes instead.  :func:`read_signed_values` has the P.V GEMM read V's int8
codes as stored (the core's uint8 grid moved onto them rather than the codes onto it), and
:func:`row_sums_from_codes` sums the row codes instead of padding V with a row-sum column: nothing but the GEMM
reads the V cache.  Exact: the same products, summed in the same integer or float order per row; the export's
check compares the file with torch.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from softq.export.fuse_graph import Graph, dq_params, perm_of, sort_nodes


# per-element conversions of V's codes to the core's grid (a requantization, or the sign flip of drop_requantize)
ELEMENTWISE = ("DequantizeLinear", "QuantizeLinear", "Cast", "BitwiseXor")


def _repeated(g: Graph, name: str) -> str | None:
    """The K/V codes ``[b, kv_heads, t, d]`` that ``name`` repeats to the query heads (``Unsqueeze(axis 2) -> Tile
    -> Reshape``), else None."""
    reshape = g.made_by(name, "Reshape")
    tile = g.made_by(reshape.input[0], "Tile") if reshape is not None else None
    unsqueeze = g.made_by(tile.input[0], "Unsqueeze") if tile is not None else None
    if unsqueeze is None or len(unsqueeze.input) != 2:
        return None
    axes = g.const(unsqueeze.input[1])
    return unsqueeze.input[0] if axes is not None and axes.reshape(-1).tolist() == [2] else None


class _Nodes:
    """New nodes and constants with unique names."""

    def __init__(self, g: Graph, tag: str) -> None:
        self.g, self.tag, self.nodes = g, tag, []

    def op(self, op: str, inputs: list[str], **attrs) -> str:  # noqa: ANN003
        out = f"softq/fuse/gqa/{self.tag}/{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def dims(self, name: str, start: int, end: int) -> str:
        return self.op("Shape", [name], start=start, end=end)

    def grouped(self, codes: str, kv: str) -> str:
        """``codes`` [b, heads, q, x] as [b, kv_heads, rep * q, x] (``kv`` the K/V codes)."""
        minus = self.g.add_const("minus_one", np.array([-1], np.int64))
        shape = self.op("Concat", [self.dims(kv, 0, 2), minus, self.dims(codes, 3, 4)], axis=0)
        return self.op("Reshape", [codes, shape])

    def ungrouped(self, out: str, codes: str, name: str) -> None:
        """``out`` [b, kv_heads, rep * q, y] back to [b, heads, q, y], written to ``name``."""
        minus = self.g.add_const("minus_one", np.array([-1], np.int64))
        shape = self.op("Concat", [self.dims(codes, 0, 3), minus], axis=0)
        self.nodes.append(helper.make_node("Reshape", [out, shape], [name]))


def _float_scores(g: Graph, mm: onnx.NodeProto, transpose: onnx.NodeProto | None, tag: str,
                  added: list[onnx.NodeProto], stale: set[str]) -> bool:
    """``MatMul(queries, Transpose(DQ(repeated K codes)))`` with float queries as one float MatMul per K/V head
    of the grouped queries and the cache's dequantized codes (no repeated copy); whether it was rewritten."""
    k_dq = g.made_by(transpose.input[0], "DequantizeLinear") if perm_of(transpose) == [0, 1, 3, 2] else None
    k = dq_params(g, k_dq)
    codes = _repeated(g, k_dq.input[0]) if k is not None and k[0].size == 1 and k[1].size == 1 else None
    if codes is None:
        return False
    n = _Nodes(g, tag)
    keys = n.op("DequantizeLinear", [n.op("Transpose", [codes], perm=[0, 1, 3, 2]), *k_dq.input[1:]])
    n.ungrouped(n.op("MatMul", [n.grouped(mm.input[0], codes), keys]), mm.input[0], mm.output[0])
    added.extend(n.nodes)
    mm.output[0] = f"{mm.output[0]}/replaced"  # dead: pruned
    return True


def group_query_heads(model: onnx.ModelProto) -> int:
    """Scores and P.V of grouped-query layers per K/V head (see the module docstring); returns the matmuls
    rewritten."""
    g = Graph(model, "gqa")
    added: list[onnx.NodeProto] = []
    stale: set[str] = set()  # tensors whose recorded shapes no longer hold (per K/V head now)
    done = 0
    for mm in list(g.graph.node):
        if mm.op_type != "MatMul":
            continue
        a_dq, b_in = g.made_by(mm.input[0], "DequantizeLinear"), mm.input[1]
        a = dq_params(g, a_dq)
        transpose = g.made_by(b_in, "Transpose")
        if a is None:  # float queries (K per channel: its scales on the queries) . the cache's K codes^T
            if _float_scores(g, mm, transpose, f"scores{done}", added, stale):
                done += 1
            continue
        if a[0].size != 1 or a[1].size != 1:
            continue
        if transpose is not None and perm_of(transpose) == [0, 1, 3, 2]:  # scores: Q codes . K codes^T
            k_dq = g.made_by(transpose.input[0], "DequantizeLinear")
            k = dq_params(g, k_dq)
            if k is None or k[0].size != 1 or k[1].size != 1:
                continue
            # one query head per K/V head: the codes as they are (the same integer GEMM, no grouping needed)
            codes = _repeated(g, k_dq.input[0]) or k_dq.input[0]
            n = _Nodes(g, f"scores{done}")
            kt = n.op("Transpose", [codes], perm=[0, 1, 3, 2])
            product = n.op("MatMulInteger", [n.grouped(a_dq.input[0], codes), kt, a_dq.input[2], k_dq.input[2]])
            scale = g.add_const("scale", np.array(a[0].item() * k[0].item(), np.float32))
            scores = n.op("Mul", [n.op("Cast", [product], to=TensorProto.FLOAT), scale])
            n.ungrouped(scores, a_dq.input[0], mm.output[0])
        else:  # P.V: row codes . V on the core's grid (with its row-sum column)
            v_dq = g.made_by(b_in, "DequantizeLinear")
            pad = g.made_by(v_dq.input[0], "Pad") if v_dq is not None else None
            chain = [pad, v_dq] if pad is not None else []
            while chain and chain[0].input[0] in g.producer and g.producer[chain[0].input[0]].op_type in ELEMENTWISE:
                chain.insert(0, g.producer[chain[0].input[0]])
            codes = _repeated(g, chain[0].input[0]) if len(chain) > 2 else None
            if codes is None or any(g.only_reader(op.output[0]) is None for op in chain):
                continue
            chain[0].input[0] = codes  # the conversion to the core's grid and the row-sum column on the cache's heads
            stale.update(op.output[0] for op in chain)
            n = _Nodes(g, f"pv{done}")
            rows = n.op("DequantizeLinear", [n.grouped(a_dq.input[0], codes), *a_dq.input[1:]])
            n.ungrouped(n.op("MatMul", [rows, b_in]), a_dq.input[0], mm.output[0])
        added.extend(n.nodes)
        mm.output[0] = f"{mm.output[0]}/replaced"  # dead: pruned
        done += 1
    if done:
        _insert(g, added, stale)
    return done


def _insert(g: Graph, added: list[onnx.NodeProto], stale: set[str]) -> None:
    """Put a pass's new nodes in the graph, in order, and drop the shapes recorded for the tensors it replaced."""
    g.graph.node.extend(added)
    sort_nodes(g.graph)
    kept = [v for v in g.graph.value_info if v.name not in stale]
    del g.graph.value_info[:]
    g.graph.value_info.extend(kept)


# nodes that move or pad int8 / uint8 codes without reading their values (a Pad's constant aside)
_LAYOUT = ("Pad", "Reshape", "Transpose", "Unsqueeze", "Squeeze")


def read_signed_values(model: onnx.ModelProto) -> int:
    """V's int8 cache codes read as they are by the P.V GEMM: ``BitwiseXor(sign bit) -> Cast(uint8)`` (the codes on
    the row core's uint8 grid 128 higher, :func:`softq.export.fuse_layout.drop_requantize`) dropped, and the grid
    moved instead: each ``Pad`` value on the way and the ``DequantizeLinear``'s zero point 128 lower, as int8.  Exact
    (``v - z`` unchanged for every code and pad value); a pass over the whole V cache fewer per decode step (the
    integer GEMM takes uint8 row codes times int8 V as it takes uint8 times uint8).  Returns the chains rewritten."""
    g = Graph(model, "signed_v")
    replaced: dict[int, list[onnx.NodeProto]] = {}
    stale: set[str] = set()  # the chains' outputs, recorded as uint8
    for xor in list(g.graph.node):
        mask = g.const(xor.input[1]) if xor.op_type == "BitwiseXor" and len(xor.input) == 2 else None
        if mask is None or mask.dtype != np.int8 or mask.size != 1 or int(mask.item()) != -128:
            continue
        cast = g.only_reader(xor.output[0])
        if cast is None or cast.op_type != "Cast" or cast.attribute[0].i != TensorProto.UINT8:
            continue
        chain, node = [], g.only_reader(cast.output[0])
        while node is not None and node.op_type in _LAYOUT:
            chain.append(node)
            node = g.only_reader(node.output[0])
        dq = node if node is not None and node.op_type == "DequantizeLinear" else None
        params = dq_params(g, dq)
        pads = [p for p in chain if p.op_type == "Pad"]
        if params is None or params[1].dtype != np.uint8 or params[1].size != 1 or any(
                len(p.input) < 3 or g.const(p.input[2]) is None or g.const(p.input[2]).dtype != np.uint8 for p in pads):
            continue
        for p in pads:
            p.input[2] = g.add_const("pad", (g.const(p.input[2]).astype(np.int16) - 128).astype(np.int8))
        dq.input[2] = g.add_const("zero_point", (params[1].astype(np.int16) - 128).astype(np.int8))
        (chain[0] if chain else dq).input[0] = xor.input[0]
        replaced[id(xor)], replaced[id(cast)] = [], []
        stale.update(n.output[0] for n in chain)
    if replaced:
        g.replace(replaced)
        kept = [v for v in g.graph.value_info if v.name not in stale]
        del g.graph.value_info[:]
        g.graph.value_info.extend(kept)
    return len(replaced) // 2


def _slice_bounds(g: Graph, node: onnx.NodeProto) -> tuple[int, int] | None:
    """(start, end) of a Slice along the last axis with constant bounds and step 1, else None."""
    if node.op_type != "Slice" or len(node.input) < 4 or (len(node.input) > 4 and node.input[4]):
        return None
    start, end, axes = (g.const(n) for n in node.input[1:4])
    if any(x is None or x.size != 1 for x in (start, end, axes)) or int(axes.item()) != -1:
        return None
    return int(start.item()), int(end.item())


def row_sums_from_codes(model: onnx.ModelProto) -> int:
    """The row core's ``sum(E)`` as a ``ReduceSum`` of the row codes instead of the GEMM's extra column: V's cache
    codes go to the GEMM unpadded (``Pad`` of a column of ``(sum code)`` copied the whole V cache every decode step,
    for a sum over one query row's codes).  Exact: ``sum(E * (c - z))`` with ``c - z = +-1``, and both sums are
    integers below 2**24 in float32 (codes below 256, fewer than 65536 keys).  Returns the GEMMs rewritten."""
    g = Graph(model, "row_sums")
    done = 0
    added: list[onnx.NodeProto] = []
    stale: set[str] = set()  # the GEMM's outputs, one column narrower now
    for pad in list(g.graph.node):
        pads = g.const(pad.input[1]) if pad.op_type == "Pad" and len(pad.input) >= 3 else None
        if pads is None or pads.tolist() != [0, 0, 0, 0, 0, 0, 0, 1] or any(
                a.name == "mode" and a.s not in (b"constant", "constant") for a in pad.attribute):
            continue
        dq = g.only_reader(pad.output[0])
        params = dq_params(g, dq) if dq is not None and dq.op_type == "DequantizeLinear" else None
        mm = g.only_reader(dq.output[0]) if params is not None else None
        if mm is None or mm.op_type != "MatMul" or mm.input[1] != dq.output[0] or params[0].size != 1 or \
                params[0].item() != 1.0 or params[1].size != 1:
            continue
        factor = int(g.const(pad.input[2]).item()) - int(params[1].item())
        reshape = g.only_reader(mm.output[0])
        acc = reshape.output[0] if reshape is not None and reshape.op_type == "Reshape" else mm.output[0]
        slices = g.readers.get(acc, [])
        bounds = {id(s): _slice_bounds(g, s) for s in slices}
        num = next((s for s in slices if bounds[id(s)] == (0, -1)), None)
        col = next((s for s in slices if bounds[id(s)] is not None and bounds[id(s)][0] == -1
                    and bounds[id(s)][1] >= 1), None)
        if factor not in (1, -1) or len(slices) != 2 or num is None or col is None or acc in g.outputs:
            continue
        n = _Nodes(g, f"rowsum{done}")
        total = n.op("ReduceSum", [mm.input[0], g.add_const("last", np.array([-1], np.int64))], keepdims=1)
        if factor == -1:
            total = n.op("Neg", [total])
        if reshape is not None and acc == reshape.output[0]:  # the same ungrouping as the GEMM's output
            total = n.op("Reshape", [total, reshape.input[1]])
        dq.input[0] = pad.input[0]
        g.rename_uses(num.output[0], acc)
        g.rename_uses(col.output[0], total)
        stale.update((dq.output[0], mm.output[0], acc))
        added.extend(n.nodes)
        done += 1
    if done:  # the Pads and Slices left without readers go with the export's prune
        _insert(g, added, stale)
    return done
