"""The ``torch.autograd.Function``s whose ONNX ``symbolic`` writes each quantization point of the export copy.

In torch each computes what the quantized model computes (so the trace runs the model's numbers); in the graph
each becomes the standard ONNX ops of that point (QuantizeLinear/DequantizeLinear pairs, integer weights,
gathered int8 embedding rows) or a ``softq`` marker node that :func:`softq.export.cores.replace_markers`
rewrites after the trace (the attention core, weight-only parameters).  Constants a symbolic cannot take as
traced inputs are looked up by a small integer key in :data:`STATE`, which the export layers
(:mod:`softq.export.modules`) fill and :func:`softq.export.model_export.build_onnx` clears after each export.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from onnx import TensorProto
from torch import nn

# the opset the trace targets; the marker ops (domain softq) that cores.replace_markers rewrites after it
TORCH_OPSET = 18
MARKER_DOMAIN = "softq"
MARKER_OP = "QAttention"
WEIGHT_MARKER_OP = "WeightOnly"


# ---------------------------------------------------------------------------
# Registry of constants the symbolic functions need (keyed by small ints)
# ---------------------------------------------------------------------------


@dataclass
class ExportState:
    weights: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, int]] = field(default_factory=dict)
    acts: dict[int, tuple[np.ndarray, np.ndarray, bool]] = field(default_factory=dict)
    softmax: dict[int, dict[str, Any]] = field(default_factory=dict)

    def clear(self) -> None:
        """Drop one export's tensors (they held a copy of the model's codes until the next export)."""
        for table in (self.weights, self.acts, self.softmax):
            table.clear()


STATE = ExportState()


def _zp_tensor(zp: int, signed: bool) -> torch.Tensor:
    return torch.tensor(int(zp), dtype=torch.int8 if signed else torch.uint8)


class QDQFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float, zp: int, qmin: int, qmax: int, signed: bool):  # noqa: ANN001
        # No "+ 0": the TorchScript peephole pass would rewrite it inside this op's block and crash.
        s = torch.tensor(scale, dtype=x.dtype)
        codes = torch.round(x / s + zp) if zp else torch.round(x / s)
        codes = torch.clamp(codes, qmin, qmax)
        return ((codes - zp) if zp else codes) * s

    @staticmethod
    def symbolic(g, x, scale: float, zp: int, qmin: int, qmax: int, signed: bool):  # noqa: ANN001
        s = g.op("Constant", value_t=torch.tensor(scale, dtype=torch.float32))
        z = g.op("Constant", value_t=_zp_tensor(zp, signed))
        if (qmin, qmax) == (-127, 127) and not zp:
            # symmetric codes stop at -127, QuantizeLinear at -128: clip the float input first (a float Clip
            # keeps the QuantizeLinear -> DequantizeLinear pair that onnxruntime fuses into integer kernels)
            bound = float(np.float32(127 * np.float32(scale)))
            x = g.op("Clip", x, g.op("Constant", value_t=torch.tensor(-bound, dtype=torch.float32)),
                     g.op("Constant", value_t=torch.tensor(bound, dtype=torch.float32)))
        q = g.op("QuantizeLinear", x, s, z)
        if (qmin, qmax) != ((-128, 127) if signed else (0, 255)) and (qmin, qmax) != (-127, 127):
            # fewer than 8 bits: saturate to the narrower integer range
            q = g.op("Clip", q, g.op("Constant", value_t=_zp_tensor(qmin, signed)),
                     g.op("Constant", value_t=_zp_tensor(qmax, signed)))
        return g.op("DequantizeLinear", q, s, z)


class GroupQDQFn(torch.autograd.Function):
    """Per-embedding-group activation QDQ over the last dimension (one scale and zero point per channel).

    Written as ``Div(x, s) -> Add(zp) -> QuantizeLinear(1, 0) -> DequantizeLinear(1, 0) -> Sub(zp) -> Mul(s)``
    rather than a per-axis QuantizeLinear/DequantizeLinear pair: the same codes (torch's own
    ``round(x / s + zp)``, bit for bit, where onnxruntime's per-axis kernel rounds ``x / s`` before
    adding the zero point), still a uint8 tensor in the graph, and fast: onnxruntime's per-axis
    QuantizeLinear is a scalar loop, profiled ad hoc at 1.7 ms for one [1, 128, 384] tensor (50x its
    per-tensor kernel on 4x the elements), which alone made MiniLM's INT8 file slower than FP32.
    """

    @staticmethod
    def forward(ctx, x, scale, zp, key: int, qmin: int, qmax: int):  # noqa: ANN001
        return (torch.clamp(torch.round(x / scale + zp), qmin, qmax) - zp) * scale

    @staticmethod
    def symbolic(g, x, scale, zp, key: int, qmin: int, qmax: int):  # noqa: ANN001
        scale_np, zp_np, signed = STATE.acts[key]
        s = g.op("Constant", value_t=torch.from_numpy(scale_np))
        z = g.op("Constant", value_t=torch.from_numpy(zp_np.astype(np.float32)))
        one = g.op("Constant", value_t=torch.tensor(1.0, dtype=torch.float32))
        zero = g.op("Constant", value_t=_zp_tensor(0, signed))
        y = g.op("Add", g.op("Div", x, s), z)
        if signed:  # symmetric signed codes stop at -127, QuantizeLinear would saturate at -128
            y = g.op("Clip", y, g.op("Constant", value_t=torch.tensor(float(qmin))),
                     g.op("Constant", value_t=torch.tensor(float(qmax))))
        codes = g.op("DequantizeLinear", g.op("QuantizeLinear", y, one, zero), one, zero)
        return g.op("Mul", g.op("Sub", codes, z), s)


class WeightDQFn(torch.autograd.Function):
    """A Linear's weight ``[in, out]`` from its stored codes, scales and zero points (module buffers: the graph's
    initializers): in torch ``(codes - zero point) * scale`` made per call (a float copy of every weight held
    through the export was most of its memory), in ONNX their DequantizeLinear.  Not constants made in the
    symbolic: Constant nodes carried the weights through every graph pass, each of which copied its node list."""

    @staticmethod
    def forward(ctx, codes, scale, zp):  # noqa: ANN001
        return (codes.to(torch.int32) - zp.to(torch.int32)).float() * scale

    @staticmethod
    def symbolic(g, codes, scale, zp):  # noqa: ANN001
        # the zero points as constants of each node: the exporter merges equal initializers, and onnxruntime's u8u8
        # conversion (session.x64quantprecision) rewrites each weight zero point per node and fails on a shared one
        sizes = scale.type().sizes()
        unsigned = codes.type().scalarType() == "Byte"
        zp = g.op("Constant", value_t=torch.full(sizes, 128 if unsigned else 0,
                                                  dtype=torch.uint8 if unsigned else torch.int8))
        if not sizes:  # one scale for the tensor
            return g.op("DequantizeLinear", codes, scale, zp)
        return g.op("DequantizeLinear", codes, scale, zp, axis_i=1)


class WeightOnlyFn(torch.autograd.Function):
    """A weight-only parameter (:class:`softq.quant.layers.WeightOnly`): ``Mul(Cast(int8 codes), scales)``.

    All of it constant, so runtimes fold it to a float tensor when they load the file (no cost per
    run); not a DequantizeLinear, which onnxruntime keeps in the graph and runs every time."""

    @staticmethod
    def forward(ctx, w, key: int):  # noqa: ANN001
        return w

    @staticmethod
    def symbolic(g, w, key: int):  # noqa: ANN001
        # a marker (replace_markers writes the Cast -> Mul): the exporter would fold Cast -> Mul of constants
        marker = g.op(f"{MARKER_DOMAIN}::{WEIGHT_MARKER_OP}", key_i=key)
        marker.setType(w.type())
        return marker


class AttentionMarkerFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, v, valid, out, key: int):  # noqa: ANN001
        return out.clone()

    @staticmethod
    def symbolic(g, scores, v, valid, out, key: int):  # noqa: ANN001
        inputs = [scores, v] if valid is None or valid.node().mustBeNone() else [scores, v, valid]
        marker = g.op(f"{MARKER_DOMAIN}::{MARKER_OP}", *inputs, key_i=key)
        marker.setType(out.type())
        return marker


class EmbeddingLookupFn(torch.autograd.Function):
    """Rows of an int8 table: ``Gather(codes, ids) * Gather(scales, ids)`` -- the looked-up rows only.

    Not ``Gather(DequantizeLinear(codes, scales, axis=0), ids)``: onnxruntime keeps a
    DequantizeLinear of an initializer in the graph (it does not fold Q/DQ), so that form
    dequantized MiniLM's whole 30522 x 384 token table on every run (profiled ad hoc: 4 ms of a 17 ms forward).
    The same numbers: one float multiplication per element, ``code * scale``.
    """

    @staticmethod
    def forward(ctx, ids, codes, scale):  # noqa: ANN001 - scale: [rows, 1]
        return nn.functional.embedding(ids, codes).float() * nn.functional.embedding(ids, scale)

    @staticmethod
    def symbolic(g, ids, codes, scale):  # noqa: ANN001
        rows = g.op("Gather", codes, ids, axis_i=0)
        return g.op("Mul", g.op("Cast", rows, to_i=TensorProto.FLOAT), g.op("Gather", scale, ids, axis_i=0))


def stored_grid(zp: int, qmin: int, qmax: int, signed: bool) -> tuple[int, int, int]:
    """(zero point, qmin, qmax) of a per-tensor point's codes as the int8 KV cache stores them: asymmetric 0..255
    codes shifted by -128 (:data:`softq.quant.kv_cache.UNSIGNED_SHIFT`), signed ones as they are."""
    shift = 0 if signed else 128
    return zp - shift, qmin - shift, qmax - shift


class CacheStoreFn(torch.autograd.Function):
    """New keys or values as the int8 codes the cache stores (``QuantizeLinear`` with the stored int8 zero point)."""

    @staticmethod
    def forward(ctx, x, scale: float, zp: int, qmin: int, qmax: int):  # noqa: ANN001 (stored grid)
        # no "+ 0" / "- 0" (a zero point of 0): the TorchScript peephole pass crashes on it inside this op's block
        codes = torch.round(x / torch.tensor(scale, dtype=x.dtype))
        return torch.clamp(codes + zp if zp else codes, qmin, qmax).to(torch.int8)

    @staticmethod
    def symbolic(g, x, scale: float, zp: int, qmin: int, qmax: int):  # noqa: ANN001
        s = g.op("Constant", value_t=torch.tensor(scale, dtype=torch.float32))
        z = g.op("Constant", value_t=_zp_tensor(zp, True))
        if qmin > -128:  # symmetric codes stop at -127: clip the float input first, as QDQFn
            bound = float(np.float32(qmax * np.float32(scale)))
            x = g.op("Clip", x, g.op("Constant", value_t=torch.tensor(-bound, dtype=torch.float32)),
                     g.op("Constant", value_t=torch.tensor(bound, dtype=torch.float32)))
        return g.op("QuantizeLinear", x, s, z)


class CacheLoadFn(torch.autograd.Function):
    """The cache's int8 codes as the float values the K or V point outputs (``DequantizeLinear``)."""

    @staticmethod
    def forward(ctx, codes, scale: float, zp: int):  # noqa: ANN001
        return ((codes.float() - zp) if zp else codes.float()) * scale

    @staticmethod
    def symbolic(g, codes, scale: float, zp: int):  # noqa: ANN001
        s = g.op("Constant", value_t=torch.tensor(scale, dtype=torch.float32))
        return g.op("DequantizeLinear", codes, s, g.op("Constant", value_t=_zp_tensor(zp, True)))
