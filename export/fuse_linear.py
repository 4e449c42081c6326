"""Passes on the integer Linear layers: onnxruntime's bias-fusing form of each Linear (:func:`fuse_linears`),
one GEMM for Linears reading the same codes (:func:`fuse_shared_linears`), and one QuantizeLinear before the
Split of such a GEMM instead of one per part (:func:`fold_split_quantizers`).

Also the matchers of that fused form that the attention-layout passes (:mod:`softq.export.fuse_layout`) build on.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from softq.export.fuse_graph import Graph, const_input, dq_params, requantizer
from softq.export.fuse_shapes import inferred_shapes

ONE = "softq/fuse/one"


def fuse_linears(model: onnx.ModelProto, dynamic: bool = False) -> int:
    """Rewrite every integer Linear into onnxruntime's bias-fusing form; returns how many.

    ``dynamic``: each Linear input is quantized by ``DynamicQuantizeLinear`` (uint8, the scale and
    zero point of the tensor's own range, per call) instead of its static grid, and the scale product
    is ``Mul(x_scale, w_scale)``: the pattern onnxruntime fuses into ``DynamicQuantizeMatMul``, as
    ``quantize_dynamic`` writes it.  Other inputs (Q, K, V, the softmax) keep their static grids.
    """
    g = Graph(model, "linear")
    replaced: dict[int, list[onnx.NodeProto]] = {}
    dynamic_of: dict[str, tuple[str, str, str]] = {}  # float input -> (codes, scale, zero point)
    for mm in list(g.graph.node):
        if mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx"):
            continue
        a_dq, b_dq = g.made_by(mm.input[0], "DequantizeLinear"), g.made_by(mm.input[1], "DequantizeLinear")
        a, b = dq_params(g, a_dq), dq_params(g, b_dq)
        if a is None or b is None or a[0].size != 1 or a[1].size != 1:
            continue
        codes = g.const(b_dq.input[0])
        w_scale, w_zp, axis = b
        if codes is None or codes.ndim != 2 or codes.dtype not in (np.int8, np.uint8):
            continue
        n_out = codes.shape[1]
        if w_scale.size != 1 and (w_scale.shape != (n_out,) or axis not in (1, -1)):
            continue
        p = f"{mm.name or mm.output[0]}/"
        a_codes, a_scale, a_zp, nodes = a_dq.input[0], ONE, a_dq.input[2], []
        quant = g.made_by(a_dq.input[0], "QuantizeLinear")
        if dynamic and quant is not None:
            x = quant.input[0]
            clip = g.made_by(x, "Clip")  # the static grid's bound of symmetric codes (functions.QDQFn)
            if clip is not None:  # the dynamic grid takes the tensor's own range
                x = clip.input[0]
            if x not in dynamic_of:
                dynamic_of[x] = (f"{x}/dyn_codes", f"{x}/dyn_scale", f"{x}/dyn_zp")
                nodes.append(helper.make_node("DynamicQuantizeLinear", [x], list(dynamic_of[x]), name=f"{x}/DynamicQuantize"))
            a_codes, a_scale, a_zp = dynamic_of[x]
            scale = g.add_const("w_scale", w_scale.astype(np.float32))
        else:
            scale = g.add_const("scale", (np.float32(a[0].reshape(())) * w_scale.astype(np.float32)).astype(np.float32))
        nodes += [
            helper.make_node("MatMulInteger", [a_codes, b_dq.input[0], a_zp, b_dq.input[2]],
                             [f"{p}acc"], name=f"{p}MatMulInteger"),
            helper.make_node("Cast", [f"{p}acc"], [f"{p}acc_f"], name=f"{p}Cast", to=TensorProto.FLOAT),
            helper.make_node("Mul", [a_scale, scale], [f"{p}scale"], name=f"{p}Scale"),
            helper.make_node("Mul", [f"{p}acc_f", f"{p}scale"], [mm.output[0]], name=f"{p}Mul"),
        ]
        replaced[id(mm)] = nodes
        add = g.only_reader(mm.output[0])
        if add is not None and add.op_type == "Add" and add.input[0] != add.input[1]:
            other = add.input[1] if add.input[0] == mm.output[0] else add.input[0]
            bias = g.const(other)
            if bias is not None and bias.shape == (n_out,):  # the fusion takes the bias as Add's second input
                add.input[0], add.input[1] = mm.output[0], other
    if replaced:
        one = [helper.make_node("DequantizeLinear", [f"{ONE}_code", f"{ONE}_scale"], [f"{ONE}_dq"], name=f"{ONE}_dq"),
               helper.make_node("Abs", [f"{ONE}_dq"], [ONE], name=ONE)]
        g.graph.initializer.extend([numpy_helper.from_array(np.array(1, np.uint8), f"{ONE}_code"),
                                    numpy_helper.from_array(np.array(1.0, np.float32), f"{ONE}_scale")])
        g.replace(replaced)
        nodes = one + list(g.graph.node)
        del g.graph.node[:]
        g.graph.node.extend(nodes)
    return len(replaced)


def integer_linear(g: Graph, mm: onnx.NodeProto) -> dict | None:
    """The parts of one :func:`fuse_linears` chain ``MatMulInteger -> Cast -> Mul(acc, Mul(a_scale, S)) [-> Add(b)]``
    with constant 2-D weights and weight zero points, constant column scales ``S`` and bias; else None."""
    if mm.op_type != "MatMulInteger" or len(mm.input) != 4 or not all(mm.input):
        return None
    w, wz = g.const(mm.input[1]), g.const(mm.input[3])
    if w is None or w.ndim != 2 or wz is None or wz.dtype != w.dtype or wz.size not in (1, w.shape[1]):
        return None
    cast = g.only_reader(mm.output[0])
    mul = g.only_reader(cast.output[0]) if cast is not None and cast.op_type == "Cast" else None
    if mul is None or mul.op_type != "Mul" or mul.input[0] != cast.output[0]:
        return None
    smul = g.made_by(mul.input[1], "Mul")
    scale = g.const(smul.input[1]) if smul is not None and g.only_reader(smul.output[0]) is mul else None
    n = w.shape[1]
    if scale is None or scale.dtype != np.float32 or scale.size not in (1, n):
        return None
    out, bias, add = mul.output[0], np.zeros(n, np.float32), g.only_reader(mul.output[0])
    if add is not None and add.op_type == "Add" and add.input[0] == out:
        b = g.const(add.input[1])
        if b is not None and b.dtype == np.float32 and b.shape == (n,):
            out, bias = add.output[0], b
        else:
            add = None
    else:
        add = None
    if out in g.outputs:
        return None
    return {"mm": mm, "nodes": [mm, cast, mul, smul] + ([add] if add is not None else []), "w": w,
            "w_zp": np.broadcast_to(wz.reshape(-1), (n,)),
            "scale": np.broadcast_to(scale.reshape(-1), (n,)).astype(np.float32), "bias": bias, "out": out,
            "key": (mm.input[0], mm.input[2], smul.input[0], str(w.dtype), w.shape[0])}


def fuse_shared_linears(model: onnx.ModelProto) -> int:
    """Fuse integer Linear layers reading the same codes into one GEMM and a Split; returns the groups fused.

    ``y_i = Cast(A W_i) * (a_scale * S_i) + b_i`` for the members ``i`` becomes one
    ``MatMulInteger`` on ``[W_1 .. W_n]`` with column scales ``[S_1 .. S_n]`` and bias ``[b_1 .. b_n]``
    (the :func:`fuse_linears` form, which onnxruntime fuses into one ``MatMulIntegerToFloat``),
    then ``Split`` on the last axis (:func:`fold_split_quantizers` then folds Q, K and V's quantizers).
    """
    g = Graph(model, "shared")
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for node in g.graph.node:
        part = integer_linear(g, node)
        if part is not None:
            groups[part["key"]].append(part)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    fused = 0
    for (codes, zp, a_scale, _, _), parts in groups.items():
        if len(parts) < 2:
            continue
        fused += 1
        first = parts[0]["mm"]  # named after the first member (a profile lists it with its layer)
        p = f"{first.name or first.output[0]}/shared{fused}/"
        w = np.concatenate([part["w"] for part in parts], axis=1)
        scale = np.concatenate([part["scale"] for part in parts])
        bias = np.concatenate([part["bias"] for part in parts])
        w_zp = np.concatenate([part["w_zp"] for part in parts])
        sizes = g.add_const("sizes", np.array([part["w"].shape[1] for part in parts], np.int64))
        replaced[id(parts[0]["mm"])] = [
            helper.make_node("MatMulInteger", [codes, g.add_const("w", w), zp, g.add_const("w_zp", w_zp)], [f"{p}acc"],
                             name=f"{p}MatMulInteger"),
            helper.make_node("Cast", [f"{p}acc"], [f"{p}acc_f"], name=f"{p}Cast", to=TensorProto.FLOAT),
            helper.make_node("Mul", [a_scale, g.add_const("scale", scale)], [f"{p}scale"], name=f"{p}Scale"),
            helper.make_node("Mul", [f"{p}acc_f", f"{p}scale"], [f"{p}y0"], name=f"{p}Mul"),
            helper.make_node("Add", [f"{p}y0", g.add_const("bias", bias)], [f"{p}y"], name=f"{p}Add"),
            helper.make_node("Split", [f"{p}y", sizes], [part["out"] for part in parts], name=f"{p}Split", axis=-1),
        ]
        for part in parts:
            for node in part["nodes"]:
                replaced.setdefault(id(node), [])
    g.replace(replaced)
    return fused


def split_sizes(g: Graph, split: onnx.NodeProto, columns: int, rank: int | None) -> list[int] | None:
    """Column counts of a Split of a Linear's ``columns`` outputs along their last axis, else None."""
    axis = next((a.i for a in split.attribute if a.name == "axis"), 0)
    if not (axis == -1 or rank is not None and axis == rank - 1):
        return None
    sizes = g.const(split.input[1]) if len(split.input) > 1 and split.input[1] else None
    if sizes is None:
        sizes = next((np.array(a.ints) for a in split.attribute if a.name == "split"), None)
    if sizes is None:  # equal parts
        n = len(split.output)
        sizes = np.full(n, columns // n) if columns % n == 0 else None
    if sizes is None or sizes.ndim != 1 or len(sizes) != len(split.output) or int(sizes.sum()) != columns:
        return None
    return [int(v) for v in sizes]


def fold_split_quantizers(model: onnx.ModelProto) -> int:
    """Quantize a split Linear output once, before the Split; returns the Linears changed.

    A Linear (the :func:`fuse_linears` form) whose output only a ``Split`` along the last axis reads
    (a GPT-2 ``c_attn``, or :func:`fuse_shared_linears`' Q/K/V GEMM), each part then read by a
    per-tensor ``QuantizeLinear(s_i, z_i)`` of one type (directly or through Reshape/Transpose):
    ``round(y / s_i) + z_i`` is computed as ``round(y')`` with the part's columns' scales ``S / s_i``
    and bias ``b / s_i + z_i`` in the GEMM, one ``QuantizeLinear(1, 0)`` before the Split, and the
    Reshape/Transpose nodes move codes instead of floats.  The same codes up to float rounding at
    ties, as :func:`fuse_linears`: one ``QuantizeLinear`` instead of one per part.
    """
    g = Graph(model, "split")
    shapes = inferred_shapes(model) or {}
    found = []
    for node in g.graph.node:
        part = integer_linear(g, node)
        split = g.only_reader(part["out"]) if part is not None else None
        if split is None or split.op_type != "Split" or split.input[0] != part["out"]:
            continue
        rank = len(shapes[part["out"]]) if part["out"] in shapes else None
        sizes = split_sizes(g, split, part["w"].shape[1], rank)
        quants = [requantizer(g, o) for o in split.output] if sizes is not None else [None]
        if all(q is not None for q in quants) and len({q[2].dtype.str for q in quants}) == 1:
            found.append((part, split, sizes, quants))
    replaced: dict[int, list[onnx.NodeProto]] = {}
    retyped: set[str] = set()
    for part, split, sizes, quants in found:
        s_col = np.repeat([q[1] for q in quants], sizes)
        z_col = np.repeat([float(q[2]) for q in quants], sizes)
        mul, smul = part["nodes"][2], part["nodes"][3]
        smul.input[1] = g.add_const("scale", (part["scale"].astype(np.float64) / s_col).astype(np.float32))
        bias = g.add_const("bias", (part["bias"].astype(np.float64) / s_col + z_col).astype(np.float32))
        new = []
        if len(part["nodes"]) == 5:  # the Linear's bias Add takes the new bias
            part["nodes"][4].input[1] = bias
            y = part["out"]
        else:
            y = f"{mul.output[0]}/biased"
            new.append(helper.make_node("Add", [mul.output[0], bias], [y], name=f"{y}/Add"))
        codes = f"{y}/codes"
        new.append(helper.make_node("QuantizeLinear", [y, g.add_const("one", np.float32(1.0)),
                                                       g.add_const("zero", np.zeros((), quants[0][2].dtype))],
                                    [codes], name=f"{codes}/Quantize"))
        split.input[0] = codes
        replaced[id(split)] = new + [split]
        for j, (ql, _, _, chain) in enumerate(quants):
            # each part's last tensor (codes now) takes its quantizer's output name; Shape readers follow it
            last = chain[-1].output[0] if chain else split.output[j]
            retyped.update([split.output[j], *(n.output[0] for n in chain)])
            g.rename_uses(last, ql.output[0])
            if chain:
                chain[-1].output[0] = ql.output[0]
            else:
                split.output[j] = ql.output[0]
            replaced[id(ql)] = []
    kept = [v for v in g.graph.value_info if v.name not in retyped]
    del g.graph.value_info[:]
    g.graph.value_info.extend(kept)
    g.replace(replaced)
    return len(found)


def linear_of_codes(g: Graph, codes: str) -> dict | None:
    """The :func:`fold_split_quantizers` GEMM (with its bias Add) whose ``QuantizeLinear(1, 0)`` gives ``codes``."""
    ql = g.made_by(codes, "QuantizeLinear")
    if ql is None or len(ql.input) != 3 or ql.attribute:
        return None
    one, zero = const_input(g, ql, 1), const_input(g, ql, 2)
    if one is None or zero is None or one.size != 1 or float(one.reshape(())) != 1.0 or zero.size != 1 or zero.any():
        return None
    add = g.made_by(ql.input[0], "Add")
    mul = g.made_by(add.input[0], "Mul") if add is not None else None
    cast = g.made_by(mul.input[0], "Cast") if mul is not None else None
    mm = g.made_by(cast.input[0], "MatMulInteger") if cast is not None else None
    part = integer_linear(g, mm) if mm is not None else None
    if part is None or part["out"] != ql.input[0] or len(part["nodes"]) != 5 or g.only_reader(ql.input[0]) is not ql:
        return None
    return {**part, "zero": zero.reshape(())}
