"""The graph view the :mod:`softq.export.fuse` passes share, and the patterns more than one of them matches.

:class:`Graph` indexes one ONNX graph (constant values, each tensor's producer and readers) and applies a pass's
node replacements in place; the helpers read a Transpose's permutation, a DequantizeLinear's constant
parameters, a constant node input, and the per-tensor QuantizeLinear that requantizes a tensor (through
Reshape/Transpose nodes, which commute with it).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import numpy_helper


class Graph:
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


def perm_of(node: onnx.NodeProto | None) -> list[int] | None:
    """A Transpose's ``perm`` (None: no node, or no perm attribute)."""
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None) if node is not None else None


def dq_params(g: Graph, dq: onnx.NodeProto | None) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(scale, zero point, axis) of a DequantizeLinear with constant parameters, else None."""
    if dq is None or len(dq.input) < 3 or any(a.name == "block_size" for a in dq.attribute):
        return None
    scale, zp = g.const(dq.input[1]), g.const(dq.input[2])
    if scale is None or zp is None or scale.dtype != np.float32:
        return None
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    return scale, zp, axis


def const_input(g: Graph, node: onnx.NodeProto, index: int) -> np.ndarray | None:
    return g.const(node.input[index]) if len(node.input) > index and node.input[index] else None


LAYOUT_OPS = ("Reshape", "Transpose")  # commute with a per-tensor QuantizeLinear


def requantizer(g: Graph, name: str) -> tuple[onnx.NodeProto, float, np.ndarray, list[onnx.NodeProto]] | None:
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


def sort_nodes(graph: onnx.GraphProto) -> None:
    """Put the nodes in an order where each comes after the producers of its inputs, in place, keeping the
    present order wherever it already is one (a depth-first walk over producers, in node order)."""
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    placed = [False] * len(graph.node)
    order: list[int] = []
    for start in range(len(graph.node)):
        stack = [(start, False)]
        while stack:
            i, ready = stack.pop()
            if placed[i]:
                continue
            if ready:
                placed[i] = True
                order.append(i)
                continue
            stack.append((i, True))
            stack.extend((producer[x], False) for x in reversed(graph.node[i].input)
                         if x in producer and not placed[producer[x]])
    if order != list(range(len(graph.node))):
        nodes = [graph.node[i] for i in order]
        del graph.node[:]
        graph.node.extend(nodes)
