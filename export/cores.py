"""The attention cores written in place of the trace's ``softq::QAttention`` markers, by softmax form.

After the trace each marker (scores, V[, valid] -> P.V) becomes the softmax input stage (float ``s - rowmax``,
row-relative codes, or per-tensor score codes), then the core of the form chosen for the layer's
softmax-output representation: the row-code cores of :mod:`softq.export.row_attention`, the edge-code softmax
of :mod:`softq.export.int_softmax` with its bias correction, or a float ``Softmax`` for a model quantized with
``softmax_bits=None``.  Weight-only markers become ``Cast -> Mul`` of their int8 codes.  Also here: which forms
export which representation, and the check that the final graph holds standard ops only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from softq.export.errors import ExportError
from softq.export.functions import MARKER_DOMAIN, STATE, WEIGHT_MARKER_OP
from softq.export.int_softmax import FORMS as EDGE_FORMS
from softq.export.int_softmax import (OUT_SCALE, SoftmaxQuant, _Builder, build_relative_codes, build_relative_scores,
                                      build_softmax)
from softq.export.row_attention import ROW_FORMS, RowQuant, build_row_attention

# Softmax forms by softmax-output representation; the first is the default.  "float": a model quantized with
# softmax_bits=None (integer linears and Q/K/V codes, float softmax and P.V: onnxruntime's Softmax kernel)
FORMS_FOR = {"row": ROW_FORMS, "row_exact": ROW_FORMS, "row_log": ROW_FORMS, "edge": EDGE_FORMS, "float": ("float",)}
ALL_FORMS = tuple(dict.fromkeys(f for forms in FORMS_FOR.values() for f in forms))


def _init(name: str, value: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _rows_for_length(prefix: str, info: dict[str, Any], table: np.ndarray, head: np.ndarray, scores: str,
                     name: str, valid_b: str | None, opset: int) -> tuple[list, list, str]:
    """Nodes picking each row's per-row value (``table``: [1, h, positions, 1], rows past the calibrated ones hold
    the per-head value ``head``) as ``SoftmaxOutputQuantizer.beta_for`` does, into ``{prefix}{name}`` [B, h, q, 1]:
    by :meth:`~softq.quant.quantizers.SoftmaxOutputQuantizer.row_slots`, the slot of a causal row is its number of
    valid keys minus one, a bidirectional row's its position among its sequence's valid keys if the sequence has the
    calibrated length; rows without a slot (or past the table) take ``head``."""
    from softq.export.int_softmax import _Builder

    b = _Builder(f"{prefix}{name}_rows/", opset)
    positions = table.shape[2]
    table_t = np.concatenate([table, head], axis=2)[0, :, :, 0].T  # [positions + 1, h]: the last row is per-head
    none = b.const("head_slot", positions, np.int64)
    shape = b.op("Shape", [scores])
    qlen = b.op("Gather", [shape, b.const("i2", [2], np.int64)], axis=0)
    klen = b.op("Gather", [shape, b.const("i3", [3], np.int64)], axis=0)
    count = None
    if valid_b is not None:  # valid keys per row: [B', q'] (masks do not differ per head)
        count = b.reduce("ReduceSum", b.op("Cast", [valid_b], to=TensorProto.INT64), -1)
        count = b.op("Squeeze", [b.reduce("ReduceMax", count, 1), b.const("axes13", [1, 3], np.int64)])
    if info["causal_rows"]:
        if count is None:  # the causal triangle: row i is position klen - qlen + i
            start = b.op("Sub", [klen, qlen])
            count = b.op("Unsqueeze", [b.op("Add", [b.op("Range", [b.op("Squeeze", [start]), b.op("Squeeze", [klen]),
                                                                      b.const("one", 1, np.int64)]),
                                                     b.const("one1", 1, np.int64)]), b.const("axes0", [0], np.int64)])
        slot = b.op("Sub", [count, b.const("one2", 1, np.int64)])
        outside = b.op("Or", [b.op("Less", [slot, b.const("zero", 0, np.int64)]), b.op("Greater", [slot, b.const(
            "last", positions - 1, np.int64)])])
        slot = b.op("Where", [outside, none, slot])
    elif valid_b is None:
        rows = b.op("Unsqueeze", [b.op("Range", [b.const("zero", 0, np.int64), b.op("Squeeze", [qlen]),
                                                 b.const("one", 1, np.int64)]), b.const("axes0", [0], np.int64)])
        fits = b.op("And", [b.op("Equal", [qlen, b.const("calibrated_rows", [info["beta_rows"]], np.int64)]),
                            b.op("Equal", [qlen, klen])])
        slot = b.op("Where", [fits, rows, none])
    else:  # a bidirectional row: its position among its sequence's valid keys, if it has the calibrated length
        keys = b.reduce("ReduceMax", b.reduce("ReduceMax", b.op("Cast", [valid_b], to=TensorProto.INT64), 1), 2)
        keys = b.op("Squeeze", [keys, b.const("axes12", [1, 2], np.int64)])  # [B', k]
        position = b.op("Sub", [b.op("CumSum", [keys, b.const("last_axis", -1, np.int64)]),
                                b.const("one", 1, np.int64)])
        length = b.reduce("ReduceSum", keys, -1)  # [B', 1]
        fits = b.op("And", [b.op("Equal", [length, b.const("calibrated_rows", [info["beta_rows"]], np.int64)]),
                            b.op("Equal", [keys, b.const("one2", 1, np.int64)])])
        fits = b.op("And", [fits, b.op("Equal", [qlen, klen])])
        slot = b.op("Where", [fits, position, none])
    picked = b.op("Gather", [b.const("table", table_t, table_t.dtype), slot], axis=0)  # [B, q, h]
    b.op("Unsqueeze", [b.op("Transpose", [picked], perm=[0, 2, 1]), b.const("axes3", [3], np.int64)],
         out=f"{prefix}{name}")
    return b.nodes, b.inits, f"{prefix}{name}"


def _beta_nodes(prefix: str, info: dict[str, Any], scores: str, form: str, valid_b: str | None,
                opset: int) -> tuple[list, list, str | None, np.ndarray | None]:
    """Nodes giving beta for the current query length, or a static beta for the int form.

    Returns (nodes, inits, beta tensor name or None, static beta array or None).
    """
    beta = info["beta"]
    if beta is None:
        return [], [], None, None
    static = beta if beta.shape[2] == 1 else None
    if form == "int":
        return [], [], None, (static if static is not None else beta).astype(np.float64)
    if static is not None:
        return [], [_init(f"{prefix}beta", static.astype(np.float32))], f"{prefix}beta", None
    nodes, inits, name = _rows_for_length(prefix, info, beta.astype(np.float32),
                                          info["beta_head"].astype(np.float32), scores, "beta", valid_b, opset)
    return nodes, inits, name, None


def _int_beta_rows(prefix: str, info: dict[str, Any], scores: str, valid_b: str | None,
                   opset: int) -> tuple[list, list, str]:
    """Per-row rounding constants of the int form for the current query length (see :func:`_rows_for_length`)."""
    from softq.export.int_softmax import rounding_constants

    return _rows_for_length(prefix, info, rounding_constants(info["beta"]), rounding_constants(info["beta_head"]),
                            scores, "round_point", valid_b, opset)


def _edge_core(p: str, info: dict[str, Any], form: str, scores: str, valid_b: str | None, probs: str,
               opset: int) -> tuple[list, list, dict[str, int]]:
    """Nodes from the score codes ``{p}codes`` to the dequantized (bias-corrected) probabilities ``probs``."""
    q: SoftmaxQuant = info["q"]
    if form == "ort" and q.signed:  # QLinearSoftmax: int8 in, int8 out (zero point -128)
        q = dataclasses.replace(q, out_signed=True)
    nodes: list[onnx.NodeProto] = []
    inits = [_init(f"{p}p_scale", OUT_SCALE), _init(f"{p}p_zp", np.array(q.out_zero_point, q.out_dtype))]
    bnodes, binits, beta_name, beta_static = _beta_nodes(p, info, scores, form, valid_b, opset)
    nodes += bnodes
    inits += binits
    sm_beta = None
    if form == "int" and beta_static is not None:
        if beta_static.shape[2] > 1:  # per-row: the constants for the query length, picked at run time
            rnodes, rinits, _ = _int_beta_rows(p, info, scores, valid_b, opset)
            nodes += rnodes
            inits += rinits
            sm_beta = np.zeros((1, 1, 1, 1))  # placeholder, replaced below
        else:
            sm_beta = beta_static
    g = build_softmax(form, f"{p}codes", f"{p}pcodes", q, axis=-1, valid=valid_b, beta=sm_beta,
                      prefix=f"{p}sm/", opset=opset)
    if form == "int":
        from softq.export.int_softmax import uses_int32

        info["int64_core"] = not uses_int32(q, sm_beta)  # recorded in the file: OpenVINO computes int64 in int32
    if form == "int" and beta_static is not None and beta_static.shape[2] > 1:
        # point the softmax's rounding constant at the sliced per-row constants
        placeholder = next(i.name for i in g.initializers if "round_point" in i.name)
        g.initializers = [i for i in g.initializers if i.name != placeholder]
        for n in g.nodes:
            for j, name in enumerate(n.input):
                if name == placeholder:
                    n.input[j] = f"{p}round_point"
    nodes += g.nodes
    inits += g.initializers
    deq = f"{p}probs_deq" if beta_name else probs
    nodes.append(helper.make_node("DequantizeLinear", [f"{p}pcodes", f"{p}p_scale", f"{p}p_zp"], [deq],
                                  name=f"{p}DequantizeLinear"))
    if beta_name:
        corr = beta_name
        if valid_b is not None:
            corr = f"{p}beta_valid"
            nodes += [
                helper.make_node("Cast", [valid_b], [f"{p}valid_f"], name=f"{p}CastValidF", to=TensorProto.FLOAT),
                helper.make_node("Mul", [beta_name, f"{p}valid_f"], [corr], name=f"{p}BetaMask"),
            ]
        nodes.append(helper.make_node("Add", [deq, corr], [probs], name=f"{p}BetaAdd"))
    return nodes, inits, g.opset_imports


def default_form(config: Any) -> str:
    """The softmax form ``to_onnx`` uses when given none, for a model quantized with ``config``."""
    return FORMS_FOR["float" if config.softmax_bits is None else config.softmax_output][0]


def check_form_for(representation: str, form: str) -> None:
    """Refuse a softmax form that does not implement the model's softmax-output representation."""
    if form not in ALL_FORMS:
        raise ValueError(f"unknown softmax form {form!r}; choose one of {', '.join(ALL_FORMS)}")
    if form not in FORMS_FOR[representation]:
        other = next(r for r, fs in FORMS_FOR.items() if form in fs)
        raise ExportError(
            f"softmax form {form!r} does not export "
            f"{'a float softmax (softmax_bits=None)' if representation == 'float' else f'softmax_output={representation!r}'}; use "
            f"{' or '.join(repr(f) for f in FORMS_FOR[representation])} (or quantize with "
            f"{'softmax_bits=None' if other == 'float' else f'softmax_output={other!r}'})")


def _float_core(p: str, scores: str, v: str, out: str, probs: str, valid_b: str | None,
                valid: str | None) -> tuple[list[onnx.NodeProto], list[TensorProto]]:
    """Float softmax core (softmax_bits=None): ``Softmax`` over the valid keys, exact zeros at masked ones
    (``Where`` to the lowest float, ``* valid`` for a row with no valid key, as torch computes it), then
    ``MatMul`` with the dequantized V."""
    if valid_b is None:
        return [helper.make_node("Softmax", [scores], [probs], name=f"{p}Softmax", axis=-1),
                helper.make_node("MatMul", [probs, v], [out], name=f"{p}MatMulPV")], []
    low = _init(f"{p}lowest", np.array(np.finfo(np.float32).min, np.float32))
    return [helper.make_node("Where", [valid_b, scores, low.name], [f"{p}masked"], name=f"{p}Where"),
            helper.make_node("Softmax", [f"{p}masked"], [f"{p}softmax"], name=f"{p}Softmax", axis=-1),
            helper.make_node("Mul", [f"{p}softmax", valid], [probs], name=f"{p}MulValid"),
            helper.make_node("MatMul", [probs, v], [out], name=f"{p}MatMulPV")], [low]


def _quantized_core(p: str, info: dict[str, Any], form: str, scores: str, v: str, out: str, probs: str,
                    valid_b: str | None, valid: str | None, probs_outputs: bool,
                    opset: int) -> tuple[list[onnx.NodeProto], list[TensorProto], dict[str, int]]:
    """Score codes, then the edge or row-code core of ``form`` up to P.V."""
    q: SoftmaxQuant | None = info["q"]
    if q is None:  # float scores (softmax_input="float"): s - rowmax, masked keys <= -5e29 (exp gives 0)
        b = _Builder(f"{p}input/", opset)
        codes = build_relative_scores(b, scores, valid_float=valid)
        nodes, inits = list(b.nodes), list(b.inits)
    elif q.relative:  # codes of s - rowmax; masked keys get code 0, which every row core maps to E = 0
        b = _Builder(f"{p}input/", opset)
        codes = build_relative_codes(b, scores, q, out=f"{p}codes", valid_float=valid)
        nodes, inits = list(b.nodes), list(b.inits)
    else:
        inits = [_init(f"{p}s_scale", np.float32(q.scale)), _init(f"{p}s_zp", np.array(q.zero_point, q.in_dtype))]
        codes = f"{p}codes"
        # torch's score codes: signed ones narrow (-(2**(b-1) - 1) up), fewer than 8 bits below the type's range;
        # QuantizeLinear saturates at the type's limits, so clip the codes where the two differ
        lo, hi = (-q.qmax, q.qmax) if q.signed else (q.qmin, q.qmax)
        info8 = np.iinfo(q.in_dtype)
        clip = (lo, hi) != (info8.min, info8.max)
        nodes = [helper.make_node("QuantizeLinear", [scores, f"{p}s_scale", f"{p}s_zp"],
                                  [f"{p}codes_saturated" if clip else codes], name=f"{p}QuantizeLinear")]
        if clip:
            inits += [_init(f"{p}s_lo", np.array(lo, q.in_dtype)), _init(f"{p}s_hi", np.array(hi, q.in_dtype))]
            nodes.append(helper.make_node("Clip", [f"{p}codes_saturated", f"{p}s_lo", f"{p}s_hi"], [codes],
                                          name=f"{p}ClipCodes"))
    if info["representation"] == "edge":
        core, core_inits, domains = _edge_core(p, info, form, scores, valid_b, probs, opset)
        core.append(helper.make_node("MatMul", [probs, v], [out], name=f"{p}MatMulPV"))
        return nodes + core, inits + core_inits, domains
    rq: RowQuant = info["rq"]
    # V arrives dequantized (its QDQ pair): QuantizeLinear gives back its codes, stored as uint8
    nodes.append(helper.make_node("QuantizeLinear", [v, f"{p}v_scale", f"{p}v_zp"], [f"{p}vcodes"], name=f"{p}QuantizeV"))
    inits += [_init(f"{p}v_scale", np.float32(rq.v_scale)), _init(f"{p}v_zp", np.array(rq.v_zero_point, np.uint8))]
    # relative codes need no mask in the core, except row_exact's float sum of exp (fast form); float scores none
    core_valid = None if q is None or q.relative and (rq.sums_codes or form == "int") else valid_b
    core, core_inits = build_row_attention(form, codes, f"{p}vcodes", out, rq, core_valid,
                                           probs if probs_outputs else None, prefix=f"{p}core/", opset=opset,
                                           empty_rows=valid_b is not None, v_affine=info.get("v_affine"))
    return nodes + core, inits + core_inits, {}


def replace_markers(model: onnx.ModelProto, layers: dict[int, dict[str, Any]], form: str,
                    probs_outputs: bool = False) -> onnx.ModelProto:
    """Swap every ``softq::QAttention`` marker for the quantized attention core of ``form``."""
    graph = model.graph
    new_nodes: list[onnx.NodeProto] = []
    extra_inits: list[TensorProto] = []
    extra_outputs: list[onnx.ValueInfoProto] = []
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    found = 0
    weights: dict[int, str] = {}  # weight-only key -> the tensor its first marker became
    for node in graph.node:
        if node.domain != MARKER_DOMAIN:
            new_nodes.append(node)
            continue
        key = next(a.i for a in node.attribute if a.name == "key")
        if node.op_type == WEIGHT_MARKER_OP:  # int8 codes -> Cast -> Mul(scales): a constant runtimes fold
            p = f"softq/W{key}/"
            if key in weights:  # the parameter read again (DINOv2's position table, per slice): the same tensor
                new_nodes.append(helper.make_node("Identity", [weights[key]], [node.output[0]],
                                                  name=f"{p}Again{len(new_nodes)}"))
                continue
            codes, scale, _, _ = STATE.weights[key]
            weights[key] = node.output[0]
            extra_inits += [_init(f"{p}codes", codes), _init(f"{p}scale", scale)]
            new_nodes += [helper.make_node("Cast", [f"{p}codes"], [f"{p}float"], name=f"{p}Cast", to=TensorProto.FLOAT),
                          helper.make_node("Mul", [f"{p}float", f"{p}scale"], [node.output[0]], name=f"{p}Mul")]
            continue
        info = layers[key]
        p = f"softq/L{key}/"
        scores, v, out = node.input[0], node.input[1], node.output[0]
        probs = f"{p}probs"
        valid_b = None
        if len(node.input) > 2 and node.input[2]:
            valid_b = f"{p}valid"
            new_nodes.append(helper.make_node("Cast", [node.input[2]], [valid_b], name=f"{p}CastValid",
                                              to=TensorProto.BOOL))
        valid = node.input[2] if valid_b else None
        if info["representation"] == "float":
            nodes, inits = _float_core(p, scores, v, out, probs, valid_b, valid)
            domains: dict[str, int] = {}
        else:
            nodes, inits, domains = _quantized_core(p, info, form, scores, v, out, probs, valid_b, valid,
                                                    probs_outputs, opset)
        new_nodes += nodes
        extra_inits += inits
        if probs_outputs:
            extra_outputs.append(helper.make_tensor_value_info(probs, TensorProto.FLOAT, [None] * 4))
        for d, ver in domains.items():
            if d and not any(o.domain == d for o in model.opset_import):
                model.opset_import.append(helper.make_opsetid(d, ver))
        found += 1
    if found != len(layers):
        raise ExportError(f"found {found} attention markers for {len(layers)} attention layers; the trace lost some")
    # the markers' declared outputs keep their type and rank, not their dims' names: the trace names the batch
    # axis after the input's ("batch"), which tract then takes for a second, unbound dimension it cannot unify
    # with the batch it is fed
    replaced = {o for n in graph.node if n.domain == MARKER_DOMAIN for o in n.output}
    for info in graph.value_info:
        if info.name in replaced:
            for dim in info.type.tensor_type.shape.dim:
                if dim.HasField("dim_param"):
                    dim.ClearField("dim_param")
    del graph.node[:]
    graph.node.extend(new_nodes)
    graph.initializer.extend(extra_inits)
    graph.output.extend(extra_outputs)
    keep = [o for o in model.opset_import if o.domain != MARKER_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    return model


def check_exportable_ops(model: onnx.ModelProto, form: str) -> None:
    """Every node is a standard ONNX op, or QLinearSoftmax for the 'ort' form; else name op and node."""
    allowed_contrib = {("com.microsoft", "QLinearSoftmax")} if form == "ort" else set()
    bad = [f"{n.domain}::{n.op_type} (node '{n.name}')" for n in model.graph.node
           if n.domain not in ("", "ai.onnx") and (n.domain, n.op_type) not in allowed_contrib]
    if bad:
        raise ExportError(f"softq cannot export op(s) {', '.join(bad)}")
