"""Graph rewrites that leave onnxruntime fewer nodes around softq's integer linear layers.

Each pass rewrites a pattern of the traced graph into standard ONNX ops that compute the same
function up to float rounding (tract and OpenVINO run the file as before) and that
onnxruntime's CPU fusions absorb:

* :func:`fuse_linears`: ``MatMul(DQ(x codes), DQ(W codes, axis=1)) + bias`` becomes
  ``MatMulInteger -> Cast -> Mul(Mul(one, x_scale * w_scale)) -> Add(bias)``, the pattern of
  onnxruntime's ``MatMulIntegerToFloatFusion``, which takes the bias into the fused node.  From
  the DQ form, its QDQ selector builds ``MatMulIntegerToFloat`` *without* the bias and leaves a
  separate ``Add`` per linear.  The fusion needs the scale product to be a ``Mul`` node, and its
  constant folding would fold a ``Mul`` of two constants first; ``one`` is ``Abs(DequantizeLinear(1))``,
  which onnxruntime does not fold while QDQ optimisations are on: two scalar nodes per graph (other
  runtimes fold them).  Not the DQ alone: onnxruntime gives each reader of a DequantizeLinear its
  own copy (EnsureUniqueDQForNodeUnit), one more node per linear.
* :func:`fold_layernorm_scales`: ``Mul(LayerNorm(x), c)`` (input smoothing's per-channel
  ``QLinear.input_scale``) becomes ``LayerNorm`` with ``gamma * c`` and ``beta * c`` where every
  reader of the LayerNorm output multiplies it by the same ``c`` (``Shape`` readers aside), also past a
  ``Reshape`` that keeps the channels last (GPT-2's ``ln_f`` -> ``lm_head``).
* :func:`fold_attention_output_scales`: input smoothing's Mul on the attention output (after the
  heads' Transpose and Reshape) becomes a per-(head, channel) constant in the row core's final
  division's denominator (``Div(N, Mul(rowsum, k / c))``).
* :func:`fold_matmul_scales`: ``Mul(MatMul(DQ(q codes, s), k), c)`` (the attention's
  ``1/sqrt(d)``) becomes ``MatMul(DQ(q codes, s * c), k)``; the ``QuantizeLinear`` keeps ``s``.
* :func:`fold_quantizer_input_scales`: ``QuantizeLinear(Mul(x, c), s)`` with a scalar ``c`` (OPT's query
  scaling before the query's quantizer) becomes ``QuantizeLinear(x, s / c)``.
* :func:`fuse_shared_linears`: integer Linear layers that read the same codes (an attention's Q, K
  and V projections) become one ``MatMulInteger`` over the concatenated weights and a ``Split``:
  one GEMM call instead of three.
* :func:`fold_split_quantizers`: where a Linear's output is only split into parts that are each
  quantized again per tensor (that GEMM's Q, K and V, or GPT-2's ``c_attn``), the parts' scales and
  zero points fold into the GEMM's column scales and bias, and one ``QuantizeLinear`` (scale 1, zero
  point 0) before the ``Split`` replaces one per part; the heads' Reshape/Transpose then move codes.
* :func:`fold_sum_columns`: the ``row`` core's Pad of V with a column of ``z + 1`` (its row sums) becomes
  one more column per head in that GEMM (zero weights, the code as bias): a copy of V fewer per layer.
* :func:`fold_row_scales`: the core's scalar factor in ``Div(N, Mul(D, c))`` moves into the scale of the
  ``QuantizeLinear`` that reads the attention output: one Mul fewer per layer.
* :func:`merge_head_splits`: the Q/K/V codes' per-part ``Reshape -> Transpose`` into heads becomes one
  ``Reshape -> Transpose -> Reshape -> Split`` for all parts (Q and K padded to V's width with zero-point
  columns that add exact zeros to the scores): 3 nodes fewer per layer, the same outputs.
* :func:`quantize_before_layout`: a per-tensor ``QuantizeLinear`` after Reshape/Transpose nodes (the
  attention output merged from its heads) moves before them: the same codes, a quarter of the bytes moved.
* :func:`static_reshapes`: ``Reshape`` targets the exporter builds at run time
  (``Shape -> Gather -> Unsqueeze -> Concat``, e.g. ``[batch, seq, heads, head_dim]``) become
  constants, with 0 ("copy this dimension") where ONNX shape inference shows that the gathered
  dimension is the Reshape input's own dimension at that position (the same symbol, or the same size
  at three probe shapes where a mask's broadcast loses the symbols): about 7 nodes per attention
  layer fewer, which at batch 1 on a small model is several percent of the run time.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from softq.export import onnx_utils

ONE = "softq/fuse/one"


class _Graph:
    """Constant values, producers and readers of the tensors of one graph."""

    def __init__(self, model: onnx.ModelProto, prefix: str) -> None:
        self.graph = model.graph
        self.prefix = prefix
        # constants as tensors, converted to arrays when a pass reads them: converting every weight for each of
        # the passes took about as much memory as the file per pass (never returned to the system: each held the
        # process's peak higher on large models)
        self._tensors: dict[str, onnx.TensorProto] = {i.name: i for i in self.graph.initializer}
        self.consts: dict[str, np.ndarray] = {}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.graph.node:
            if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
                self._tensors[node.output[0]] = node.attribute[0].t
            for o in node.output:
                self.producer[o] = node
            for i in node.input:
                if i:
                    self.readers[i].append(node)
        self.outputs = {o.name for o in self.graph.output}
        self.count = 0

    def const(self, name: str) -> np.ndarray | None:
        if name not in self.consts and name in self._tensors:
            self.consts[name] = numpy_helper.to_array(self._tensors[name])
        return self.consts.get(name)

    def made_by(self, name: str, op: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op and node.domain in ("", "ai.onnx") else None

    def only_reader(self, name: str, but_shape: bool = False) -> onnx.NodeProto | None:
        """The one node reading ``name`` (``Shape`` readers aside with ``but_shape``), if it is not a graph output."""
        readers = [r for r in self.readers.get(name, []) if not (but_shape and r.op_type == "Shape")]
        return readers[0] if len(readers) == 1 and name not in self.outputs else None

    def add_const(self, tag: str, value: np.ndarray) -> str:
        self.count += 1
        name = f"softq/fuse/{self.prefix}{self.count}/{tag}"
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        self.consts[name] = np.asarray(value)
        return name

    def rename_uses(self, old: str, new: str) -> None:
        for node in self.graph.node:
            for j, name in enumerate(node.input):
                if name == old:
                    node.input[j] = new

    def replace(self, replaced: dict[int, list[onnx.NodeProto]]) -> None:
        """Swap nodes (by id) for lists of nodes in place; an empty list deletes the node."""
        nodes = [n for node in self.graph.node for n in replaced.get(id(node), [node])]
        del self.graph.node[:]
        self.graph.node.extend(nodes)


def _perm(node: onnx.NodeProto | None) -> list[int] | None:
    """A Transpose's ``perm`` (None: no node, or no perm attribute)."""
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None) if node is not None else None


def _dq_params(g: _Graph, dq: onnx.NodeProto | None) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(scale, zero point, axis) of a DequantizeLinear with constant parameters, else None."""
    if dq is None or len(dq.input) < 3 or any(a.name == "block_size" for a in dq.attribute):
        return None
    scale, zp = g.const(dq.input[1]), g.const(dq.input[2])
    if scale is None or zp is None or scale.dtype != np.float32:
        return None
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    return scale, zp, axis


def fuse_linears(model: onnx.ModelProto, dynamic: bool = False) -> int:
    """Rewrite every integer Linear into onnxruntime's bias-fusing form; returns how many.

    ``dynamic``: each Linear input is quantized by ``DynamicQuantizeLinear`` (uint8, the scale and
    zero point of the tensor's own range, per call) instead of its static grid, and the scale product
    is ``Mul(x_scale, w_scale)``: the pattern onnxruntime fuses into ``DynamicQuantizeMatMul``, as
    ``quantize_dynamic`` writes it.  Other inputs (Q, K, V, the softmax) keep their static grids.
    """
    g = _Graph(model, "linear")
    replaced: dict[int, list[onnx.NodeProto]] = {}
    dynamic_of: dict[str, tuple[str, str, str]] = {}  # float input -> (codes, scale, zero point)
    for mm in list(g.graph.node):
        if mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx"):
            continue
        a_dq, b_dq = g.made_by(mm.input[0], "DequantizeLinear"), g.made_by(mm.input[1], "DequantizeLinear")
        a, b = _dq_params(g, a_dq), _dq_params(g, b_dq)
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
            clip = g.made_by(x, "Clip")  # the static grid's bound of symmetric codes (model_export._QDQFn)
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


def fold_layernorm_scales(model: onnx.ModelProto) -> int:
    """Fold per-channel Muls of a LayerNorm output into its weight and bias; returns LayerNorms changed."""
    g = _Graph(model, "ln")
    replaced: dict[int, list[onnx.NodeProto]] = {}
    folded = 0

    @functools.cache
    def shapes() -> dict[str, list]:
        return _inferred_shapes(model, keep_value_info=True) or {}
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


def _last_dim(g: _Graph, reshape: onnx.NodeProto, shapes: Callable[[], dict[str, list]]) -> int | None:
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
    g = _Graph(model, "attn_out")
    inferred = _inferred_shapes(model, keep_value_info=True)  # (the tracer's shapes carry the head count)
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
        perm = _perm(transpose)
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
    g = _Graph(model, "matmul")
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
            params = _dq_params(g, dq)
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
    g = _Graph(model, "qscale")
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
        quant = _requantizer(g, mul.output[0])
        if quant is None:
            continue
        ql, scale = quant[0], quant[1]
        ql.input[1] = g.add_const("scale", np.float32(scale / float(c.reshape(()))))
        g.rename_uses(mul.output[0], x)
        replaced[id(mul)] = []
    g.replace(replaced)
    return len(replaced)


def fuse(model: onnx.ModelProto, linears: bool = True, dynamic: bool = False) -> dict[str, int]:
    """All passes, in order (``linears=False``: the Linear layers keep their DequantizeLinear -> MatMul
    form, which OpenVINO's int8 path needs; ``dynamic``: see :func:`fuse_linears`); returns what each changed."""
    done = {"layernorm_scales": fold_layernorm_scales(model), "matmul_scales": fold_matmul_scales(model),
            "attention_output_scales": fold_attention_output_scales(model),
            "quantizer_input_scales": fold_quantizer_input_scales(model),
            "linears": fuse_linears(model, dynamic) if linears else 0}
    done["static_reshapes"] = static_reshapes(model)
    onnx_utils.prune(model)  # the shape nodes the constants replaced read the projections' outputs
    done["shared_linears"] = fuse_shared_linears(model) if linears else 0
    done["split_quantizers"] = fold_split_quantizers(model) if linears else 0
    done["sum_columns"] = fold_sum_columns(model) if linears else 0
    done["row_scales"] = fold_row_scales(model)
    done["head_splits"] = merge_head_splits(model) if linears else 0
    done["layout_quantizers"] = quantize_before_layout(model) if linears else 0
    return done


def _integer_linear(g: _Graph, mm: onnx.NodeProto) -> dict | None:
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


LAYOUT_OPS = ("Reshape", "Transpose")  # commute with a per-tensor QuantizeLinear


def _requantizer(g: _Graph, name: str) -> tuple[onnx.NodeProto, float, np.ndarray, list[onnx.NodeProto]] | None:
    """(QuantizeLinear, scale, zero point, layout ops before it) if ``name`` is only read by a per-tensor
    QuantizeLinear with constant scale and zero point, directly or through Reshape/Transpose nodes
    (whose outputs only ``Shape`` nodes read besides)."""
    chain: list[onnx.NodeProto] = []
    reader = g.only_reader(name)
    while reader is not None and reader.op_type in LAYOUT_OPS and reader.input[0] == name:
        chain.append(reader)
        name = reader.output[0]
        reader = g.only_reader(name, but_shape=True)
    if reader is None or reader.op_type != "QuantizeLinear" or len(reader.input) != 3 or reader.attribute:
        return None
    s, z = g.const(reader.input[1]), g.const(reader.input[2])
    if s is None or z is None or s.size != 1 or z.size != 1 or s.dtype != np.float32 or not float(s.reshape(())) > 0:
        return None
    return reader, float(s.reshape(())), z.reshape(()), chain


def fuse_shared_linears(model: onnx.ModelProto) -> int:
    """Fuse integer Linear layers reading the same codes into one GEMM and a Split; returns the groups fused.

    ``y_i = Cast(A W_i) * (a_scale * S_i) + b_i`` for the members ``i`` becomes one
    ``MatMulInteger`` on ``[W_1 .. W_n]`` with column scales ``[S_1 .. S_n]`` and bias ``[b_1 .. b_n]``
    (the :func:`fuse_linears` form, which onnxruntime fuses into one ``MatMulIntegerToFloat``),
    then ``Split`` on the last axis (:func:`fold_split_quantizers` then folds Q, K and V's quantizers).
    """
    g = _Graph(model, "shared")
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for node in g.graph.node:
        part = _integer_linear(g, node)
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


def _split_sizes(g: _Graph, split: onnx.NodeProto, columns: int, rank: int | None) -> list[int] | None:
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
    g = _Graph(model, "split")
    shapes = _inferred_shapes(model) or {}
    found = []
    for node in g.graph.node:
        part = _integer_linear(g, node)
        split = g.only_reader(part["out"]) if part is not None else None
        if split is None or split.op_type != "Split" or split.input[0] != part["out"]:
            continue
        rank = len(shapes[part["out"]]) if part["out"] in shapes else None
        sizes = _split_sizes(g, split, part["w"].shape[1], rank)
        quants = [_requantizer(g, o) for o in split.output] if sizes is not None else [None]
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


def _const_input(g: _Graph, node: onnx.NodeProto, index: int) -> np.ndarray | None:
    return g.const(node.input[index]) if len(node.input) > index and node.input[index] else None


def _linear_of_codes(g: _Graph, codes: str) -> dict | None:
    """The :func:`fold_split_quantizers` GEMM (with its bias Add) whose ``QuantizeLinear(1, 0)`` gives ``codes``."""
    ql = g.made_by(codes, "QuantizeLinear")
    if ql is None or len(ql.input) != 3 or ql.attribute:
        return None
    one, zero = _const_input(g, ql, 1), _const_input(g, ql, 2)
    if one is None or zero is None or one.size != 1 or float(one.reshape(())) != 1.0 or zero.size != 1 or zero.any():
        return None
    add = g.made_by(ql.input[0], "Add")
    mul = g.made_by(add.input[0], "Mul") if add is not None else None
    cast = g.made_by(mul.input[0], "Cast") if mul is not None else None
    mm = g.made_by(cast.input[0], "MatMulInteger") if cast is not None else None
    part = _integer_linear(g, mm) if mm is not None else None
    if part is None or part["out"] != ql.input[0] or len(part["nodes"]) != 5 or g.only_reader(ql.input[0]) is not ql:
        return None
    return {**part, "zero": zero.reshape(())}


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
    g = _Graph(model, "sumcol")
    reshaped: set[str] = set()
    removed: dict[int, list[onnx.NodeProto]] = {}
    for pad in g.graph.node:
        if pad.op_type != "Pad" or len(pad.input) != 3 or any(a.name == "mode" and a.s != b"constant"
                                                               for a in pad.attribute):
            continue
        pads, value, x = _const_input(g, pad, 1), _const_input(g, pad, 2), pad.input[0]
        rank = pads.size // 2 if pads is not None else 0
        if rank < 2 or value is None or value.size != 1 or pads.tolist() != [0] * (2 * rank - 1) + [1]:
            continue
        codes, dq = x, None
        ql = g.made_by(x, "QuantizeLinear")
        if ql is not None:  # an identity requantization (same scale and zero point): the column passes through
            dq = g.made_by(ql.input[0], "DequantizeLinear")
            a = _dq_params(g, dq)
            b = (_const_input(g, ql, 1), _const_input(g, ql, 2)) if len(ql.input) == 3 and not ql.attribute else None
            if (a is None or b is None or b[0] is None or b[1] is None or a[0].size != 1 or b[0].size != 1
                    or a[0].reshape(()) != b[0].reshape(()) or a[1].tobytes() != b[1].tobytes()
                    or a[1].dtype != b[1].dtype or g.only_reader(dq.output[0]) is not ql):
                continue
            codes = dq.input[0]
        transpose = g.made_by(codes, "Transpose")
        perm = _perm(transpose)
        reshape = g.made_by(transpose.input[0], "Reshape") if perm is not None else None
        target = _const_input(g, reshape, 1) if reshape is not None else None
        if (target is None or len(perm) != rank or perm[-1] != rank - 1 or target.shape != (rank,)
                or g.only_reader(x) is not pad or g.only_reader(codes) is not (dq or pad)
                or g.only_reader(reshape.output[0]) is not transpose):
            continue
        heads, size = (int(v) for v in target[-2:])  # heads may be -1 (inferred), which it stays
        split = g.made_by(reshape.input[0], "Split")
        if split is None or heads == 0 or heads < -1 or size <= 0 or g.only_reader(reshape.input[0]) is not reshape:
            continue
        part = _linear_of_codes(g, split.input[0])
        sizes = _const_input(g, split, 1)
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


def fold_row_scales(model: onnx.ModelProto) -> int:
    """Fold the row core's scalar factor into the quantizer of the attention output; returns how many.

    ``QuantizeLinear(Div(N, Mul(D, c)), s)`` (directly or through Reshape/Transpose; ``c > 0`` a scalar)
    becomes ``QuantizeLinear(Div(N, D), s * c)``: the same codes up to float rounding at ties, one Mul
    fewer per layer.  A per-channel ``c`` (the output projection's input smoothing, folded there by
    :func:`fold_attention_output_scales`) stays.
    """
    g = _Graph(model, "rowscale")
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
        quant = _requantizer(g, div.output[0])
        if quant is None:
            continue
        ql, s = quant[0], quant[1]
        ql.input[1] = g.add_const("scale", np.float32(s * float(c.reshape(()))))
        div.input[1] = mul.input[1 - k]
        replaced[id(mul)] = []
    g.replace(replaced)
    return len(replaced)


def _dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) or None
            for d in value.type.tensor_type.shape.dim]


PROBE_SIZES = ((11, 13, 17), (19, 23, 29), (31, 37, 41))  # per probe, a prime for each symbolic input dimension
SKELETON_MAX_CONST = 4096  # initializers up to this many elements keep their values for shape inference


def _inferred_shapes(model: onnx.ModelProto, sizes: tuple[int, ...] | None = None,
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
    g = _Graph(model, "reshape")
    symbolic = _inferred_shapes(model)
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
                    probes = [p for p in (_inferred_shapes(model, sizes) for sizes in PROBE_SIZES) if p is not None]
                if len(probes) < len(PROBE_SIZES) or not all(same(p, reshape.input[0], j, part) for p in probes):
                    target = None
                    break
            target.append(0)
        if target is None or target.count(-1) > 1:
            continue
        reshape.input[1] = g.add_const("shape", np.array(target, np.int64))
        changed += 1
    return changed



def _contracted_pads(g: _Graph, codes: str) -> tuple[np.ndarray, list[tuple[onnx.NodeProto, int]]] | None:
    """Where a part's head codes ``codes`` ([batch, heads, tokens, size]) may take extra columns: each reader is a
    per-tensor ``DequantizeLinear`` (one zero point z for all) whose output a ``MatMul`` contracts over its last
    axis (as input A, or as input B through a Transpose swapping the last two axes).  A column of code z then
    dequantizes to exactly 0 and adds exactly 0 to every product.  Returns (z, [(MatMul, input index)])."""
    zps, uses = [], []
    for dq in g.readers.get(codes, []):
        params = _dq_params(g, dq) if dq.op_type == "DequantizeLinear" and dq.input[0] == codes else None
        if params is None or params[0].size != 1 or params[1].size != 1:
            return None
        zps.append(params[1].reshape(()))
        for reader in g.readers.get(dq.output[0], []):
            if reader.op_type == "Transpose" and _perm(reader) == [0, 1, 3, 2]:
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
    g = _Graph(model, "heads")
    replaced: dict[int, list[onnx.NodeProto]] = {}
    stale: set[str] = set()
    merged = 0
    shapes = functools.cache(lambda: _inferred_shapes(model) or {})  # only for a Split on a positive axis
    for split in list(g.graph.node):
        if split.op_type != "Split" or len(split.output) < 2:
            continue
        part = _linear_of_codes(g, split.input[0])
        if part is None or g.only_reader(split.input[0]) is not split:
            continue
        axis = next((a.i for a in split.attribute if a.name == "axis"), 0)
        rank = len(shapes().get(split.input[0], [])) or None if axis >= 0 else None
        sizes = _split_sizes(g, split, part["w"].shape[1], rank)
        if sizes is None:
            continue
        chains = []
        for out in split.output:
            reshape = g.only_reader(out)
            target = _const_input(g, reshape, 1) if reshape is not None and reshape.op_type == "Reshape" else None
            transpose = g.only_reader(reshape.output[0]) if target is not None else None
            if (target is None or target.shape != (4,) or transpose is None or transpose.op_type != "Transpose"
                    or _perm(transpose) != [0, 2, 1, 3] or reshape.input[0] != out):
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


def quantize_before_layout(model: onnx.ModelProto) -> int:
    """Move a per-tensor ``QuantizeLinear`` ahead of the Reshape/Transpose nodes before it; returns how many.

    ``QuantizeLinear(Reshape(Transpose(x)))`` (the attention output merged from its heads, read by the output
    projection's quantizer) becomes ``Reshape(Transpose(QuantizeLinear(x)))``: an elementwise per-tensor
    quantization commutes with moving elements, so the codes are the same, and the layout ops move a quarter
    of the bytes.  Only where each layout op's output has no other reader.
    """
    g = _Graph(model, "layoutq")
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
            if (op is None or op.op_type not in LAYOUT_OPS or op.domain not in ("", "ai.onnx") or id(op) in replaced
                    or g.only_reader(name) is not (chain[-1] if chain else ql)):
                break
            chain.append(op)
            name = op.input[0]
        if not chain:
            continue
        first, last = chain[-1], chain[0]  # first reads the float x; last fed the QuantizeLinear
        codes = ql.output[0]
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
    return sum(1 for nodes in replaced.values() if nodes)
