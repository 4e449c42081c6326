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
  reader of the LayerNorm output multiplies it by the same ``c`` (``Shape`` readers aside).
* :func:`fold_attention_output_scales`: input smoothing's Mul on the attention output (after the
  heads' Transpose and Reshape) becomes a per-(head, channel) constant in the row core's final
  division's denominator (``Div(N, Mul(rowsum, k / c))``).
* :func:`fold_matmul_scales`: ``Mul(MatMul(DQ(q codes, s), k), c)`` (the attention's
  ``1/sqrt(d)``) becomes ``MatMul(DQ(q codes, s * c), k)``; the ``QuantizeLinear`` keeps ``s``.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ONE = "softq/fuse/one"


class _Graph:
    """Constant values, producers and readers of the tensors of one graph."""

    def __init__(self, model: onnx.ModelProto, prefix: str) -> None:
        self.graph = model.graph
        self.prefix = prefix
        self.consts: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in self.graph.initializer}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.graph.node:
            if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
                self.consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
            for o in node.output:
                self.producer[o] = node
            for i in node.input:
                if i:
                    self.readers[i].append(node)
        self.outputs = {o.name for o in self.graph.output}
        self.count = 0

    def const(self, name: str) -> np.ndarray | None:
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
    for ln in list(g.graph.node):
        if ln.op_type != "LayerNormalization" or len(ln.output) != 1 or len(ln.input) < 2:
            continue
        y = ln.output[0]
        axis = next((a.i for a in ln.attribute if a.name == "axis"), -1)
        gamma = g.const(ln.input[1])
        beta = g.const(ln.input[2]) if len(ln.input) > 2 and ln.input[2] else None
        if axis != -1 or y in g.outputs or gamma is None or gamma.ndim != 1 or gamma.dtype != np.float32:
            continue
        muls, c = [], None
        for reader in g.readers.get(y, []):
            if reader.op_type == "Shape":
                continue
            other = None
            if reader.op_type == "Mul" and reader.input[0] != reader.input[1]:
                other = g.const(reader.input[1] if reader.input[0] == y else reader.input[0])
            ok = (other is not None and other.dtype == np.float32 and other.size == gamma.size
                  and other.shape[-1] == gamma.size and (c is None or np.array_equal(other.reshape(-1), c))
                  and reader.output[0] not in g.outputs)
            if not ok:
                muls = []
                break
            c = other.reshape(-1)
            muls.append(reader)
        if not muls:
            continue
        ln.input[1] = g.add_const("gamma", (gamma * c).astype(np.float32))
        if beta is not None:
            ln.input[2] = g.add_const("beta", (beta * c).astype(np.float32))
        for mul in muls:
            g.rename_uses(mul.output[0], y)
            replaced[id(mul)] = []
        folded += 1
    g.replace(replaced)
    return folded


def fold_attention_output_scales(model: onnx.ModelProto) -> int:
    """Fold the per-channel Mul on a merged attention output into the core's final division; returns how many.

    ``Mul(Reshape(Transpose(Div(N, Mul(X, k)), perm=[0, 2, 1, 3])), c)``, ``c`` of ``heads * head_dim``
    channels and ``k`` a scalar constant, becomes ``Div(N, Mul(X, k / c[heads, head_dim]))``: the same
    number of nodes in the core, one Mul over the activations fewer (input smoothing of the output
    projection).  Heads and head size come from ONNX shape inference of the division's output.
    """
    g = _Graph(model, "attn_out")
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 - shapes unknown: nothing to fold
        return 0
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
              for v in inferred.graph.value_info}
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for mul in list(g.graph.node):
        if mul.op_type != "Mul" or len(mul.input) != 2:
            continue
        k_side = 1 if g.const(mul.input[1]) is not None else 0
        c, reshape = g.const(mul.input[k_side]), g.made_by(mul.input[1 - k_side], "Reshape")
        if c is None or c.dtype != np.float32 or reshape is None or g.only_reader(reshape.output[0]) is not mul:
            continue
        transpose = g.made_by(reshape.input[0], "Transpose")
        perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None) if transpose else None
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


def fuse(model: onnx.ModelProto, linears: bool = True, dynamic: bool = False) -> dict[str, int]:
    """All passes, in order (``linears=False``: the Linear layers keep their DequantizeLinear -> MatMul
    form, which OpenVINO's int8 path needs; ``dynamic``: see :func:`fuse_linears`); returns what each changed."""
    return {"layernorm_scales": fold_layernorm_scales(model), "matmul_scales": fold_matmul_scales(model),
            "attention_output_scales": fold_attention_output_scales(model),
            "linears": fuse_linears(model, dynamic) if linears else 0}
