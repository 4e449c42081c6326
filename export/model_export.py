"""Whole-model ONNX export of a softq-quantized Hugging Face model.

How (and why this way): tracing Brevitas' fake-quant modules gives an
unreadable graph, so export works on a copy of the model in which every
quantization point is swapped for a tiny module whose ``torch.autograd.Function``
has an ONNX ``symbolic``:

* activation quantizers -> ``QuantizeLinear -> DequantizeLinear`` with the
  calibrated scale and zero point;
* quantized Linear layers -> ``MatMul(x, DequantizeLinear(W_int8^T, scale, axis=1))``
  (+ float bias), per-channel int8 weights stored as int8 initializers (rewritten after the
  trace, see below);
* each attention core (the scores tap, the softmax, the probs quantizer and the
  P.V matmul) -> one marker node ``softq::QAttention(scores, v[, valid])`` whose
  output is P.V.

The TorchScript exporter (``dynamo=False``) traces that copy; afterwards each
marker is replaced, after the softmax input stage (the default float input: ``s - rowmax``,
:func:`softq.export.int_softmax.build_relative_scores`; score codes: ``QuantizeLinear`` of ``s - rowmax``
for the row-relative grid, :func:`softq.export.int_softmax.build_relative_codes`, of ``s`` for a
per-tensor grid), by the form chosen for the layer's softmax-output representation:

* ``row`` / ``row_exact`` (:mod:`softq.export.row_attention`): ``fast`` or
  ``int``, integer codes relative to the row max, ``MatMulInteger`` with the
  uint8 V codes, one division per output element;
* ``edge`` (:mod:`softq.export.int_softmax`): ``qdq``, ``ort`` or ``int``
  softmax, ``DequantizeLinear`` of the probabilities (scale ``2**-8``), then
  ``MatMul`` with the dequantized V;

then :func:`softq.export.fuse.fuse` rewrites the linears into the form onnxruntime fuses with
their bias (``MatMulInteger -> Cast -> Mul -> Add``) and folds
input smoothing's Mul into LayerNorms and the attention core's division, and the attention's
``1/sqrt(d)`` into the query's DequantizeLinear, and dead nodes are removed.  Language models get a 4-D boolean mask built in the graph from
``attention_mask`` (causal AND padding), which makes Hugging Face skip its own
mask code (not traceable with dynamic shapes).

Softmax bias correction ``beta`` (``softq.quant`` adds it to valid entries
after dequantization; exported for ``edge`` only):

* ``int`` form: folded into the rounding point of the integer division
  (:func:`softq.export.int_softmax.rounding_constants`): one extra integer Mul,
  no float op;
* ``qdq``/``ort``: an explicit ``Add(DQ(P), beta * valid)`` after the output
  DequantizeLinear (one Mul and one Add; a DQ zero point must be an integer and
  beta is a fraction of a step, so it cannot be absorbed there).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from softq.export import fuse, onnx_utils
from softq.export.int_softmax import FORMS as EDGE_FORMS
from softq.export.int_softmax import (OUT_SCALE, SoftmaxQuant, _Builder, build_relative_codes, build_relative_scores,
                                      build_softmax)
from softq.export.row_attention import ROW_FORMS, RowQuant, build_row_attention
from softq.models import has_cross_attention, image_size, is_causal, is_headless, max_tokens, output_fields
from softq.quant.config import FLOAT_INPUT_OUTPUTS
from softq.quant.quantizers import weight_codes

TORCH_OPSET = 18
MARKER_DOMAIN = "softq"
MARKER_OP = "QAttention"
WEIGHT_MARKER_OP = "WeightOnly"
EXPORTABLE_SOFTMAX = ("softmax",)
# Softmax forms by softmax-output representation; the first is the default.  "float": a model quantized with
# softmax_bits=None (integer linears and Q/K/V codes, float softmax and P.V: onnxruntime's Softmax kernel)
FORMS_FOR = {"row": ROW_FORMS, "row_exact": ROW_FORMS, "row_log": ROW_FORMS, "edge": EDGE_FORMS, "float": ("float",)}
ALL_FORMS = tuple(dict.fromkeys(f for forms in FORMS_FOR.values() for f in forms))


class ExportError(ValueError):
    """The model or its inputs cannot be exported; the message says what and where."""


# ---------------------------------------------------------------------------
# Registry of constants the symbolic functions need (keyed by small ints)
# ---------------------------------------------------------------------------


@dataclass
class _ExportState:
    weights: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, int]] = field(default_factory=dict)
    acts: dict[int, tuple[np.ndarray, np.ndarray, bool]] = field(default_factory=dict)
    softmax: dict[int, dict[str, Any]] = field(default_factory=dict)

    def clear(self) -> None:
        """Drop one export's tensors (they held a copy of the model's codes until the next export)."""
        for table in (self.weights, self.acts, self.softmax):
            table.clear()


_STATE = _ExportState()
WEIGHT_STORAGE = ("uint8", "int8")
# Linear layers in the graph: "integer" (MatMulInteger, Cast, Mul, Add: onnxruntime fuses it bias included,
# tract runs int8 kernels on it), "qdq" (DequantizeLinear -> MatMul: OpenVINO's int8 path) or "dynamic" (the
# integer form on DynamicQuantizeLinear codes: inputs quantized per call); export/fuse.py
LINEAR_FORMS = ("integer", "qdq", "dynamic")


def _zp_tensor(zp: int, signed: bool) -> torch.Tensor:
    return torch.tensor(int(zp), dtype=torch.int8 if signed else torch.uint8)


class _QDQFn(torch.autograd.Function):
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


class _GroupQDQFn(torch.autograd.Function):
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
        scale_np, zp_np, signed = _STATE.acts[key]
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


class _WeightDQFn(torch.autograd.Function):
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


class _WeightOnlyFn(torch.autograd.Function):
    """A weight-only parameter (:class:`softq.quant.quantizers.WeightOnly`): ``Mul(Cast(int8 codes), scales)``.

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


class _ExportWeightOnly(nn.Module):
    """Stands in for a :class:`WeightOnly` parametrization in the export copy (its input, the float
    original, is then unused and leaves the graph)."""

    def __init__(self, quant: nn.Module, original: torch.Tensor, key: int) -> None:
        super().__init__()
        codes, scale = quant.codes_and_scale(original)
        if codes.abs().max() > 127:
            raise ExportError(f"weight-only codes of {quant.bits} bits do not fit int8")
        _STATE.weights[key] = (codes.to(torch.int8).numpy(), scale.to(torch.float32).numpy(), None, None)
        self.register_buffer("w_deq", codes * scale)
        self.key = key

    def forward(self, _original: torch.Tensor) -> torch.Tensor:
        return _WeightOnlyFn.apply(self.w_deq, self.key)


class _AttentionMarkerFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, v, valid, out, key: int):  # noqa: ANN001
        return out.clone()

    @staticmethod
    def symbolic(g, scores, v, valid, out, key: int):  # noqa: ANN001
        inputs = [scores, v] if valid is None or valid.node().mustBeNone() else [scores, v, valid]
        marker = g.op(f"{MARKER_DOMAIN}::{MARKER_OP}", *inputs, key_i=key)
        marker.setType(out.type())
        return marker


class _ExportAct(nn.Module):
    def __init__(self, quantizer: nn.Module, key: int) -> None:
        super().__init__()
        self.signed = bool(quantizer.signed)
        bits = int(quantizer.bits)
        if bits > 8:
            raise ExportError(f"softq exports activations of at most 8 bits (ONNX opset {TORCH_OPSET}); got {bits}")
        self.qmin, self.qmax = ((-(2 ** (bits - 1)) + 1, 2 ** (bits - 1) - 1) if self.signed else (0, 2**bits - 1))
        self.key = key
        self.grouped = quantizer.scale.numel() > 1
        if self.grouped:  # per-embedding-group: one (scale, zero point) per hidden channel
            if (self.qmin, self.qmax) not in ((0, 255), (-127, 127)):
                raise ExportError(f"per-group activations export at 8 bits only; got {bits}")
            scale = quantizer.scale.detach().float().reshape(-1)
            zp = quantizer.zero_point.detach().round().reshape(-1)
            _STATE.acts[key] = (scale.numpy().astype(np.float32),
                                zp.numpy().astype(np.int8 if self.signed else np.uint8), self.signed)
            self.register_buffer("scale_v", scale)
            self.register_buffer("zp_v", zp.float())
        else:
            self.scale = float(quantizer.scale)
            self.zp = int(round(float(quantizer.zero_point)))
        # prefix-token rows (QuantConfig.residual_prefix): Slice -> their own Q/DQ -> Concat, as in torch
        self.prefix = nn.ModuleList(_ExportAct(row, -(key * 16 + i + 1))
                                    for i, row in enumerate(getattr(quantizer, "prefix", ())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.prefix) and x.dim() >= 3:
            rows = [q(x[..., i:i + 1, :]) for i, q in enumerate(self.prefix)]  # empty past a short input's end
            return torch.cat([*rows, self._forward(x[..., len(self.prefix):, :])], dim=-2)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            return _GroupQDQFn.apply(x, self.scale_v, self.zp_v, self.key, self.qmin, self.qmax)
        return _QDQFn.apply(x, self.scale, self.zp, self.qmin, self.qmax, self.signed)


class _ExportLinear(nn.Module):
    def __init__(self, layer: nn.Module, storage: str) -> None:
        super().__init__()
        # the codes inference computes with (QLinear.dequantized_weight; Brevitas' int_weight() bit for bit, with
        # a few weight-sized temporaries fewer)
        codes, scale = weight_codes(layer.weight, layer.weight_bits, 0 if layer.per_channel else None)
        if codes.abs().max() > 127:
            raise ExportError(f"weights of {type(layer).__name__} do not fit int8 (weight_bits > 8 is not exportable)")
        codes = codes.t().to(torch.int8).contiguous()  # [in, out]: MatMul(x, W^T), axis=1
        scale = scale.reshape(-1 if scale.numel() > 1 else ()).to(torch.float32)
        zp = torch.zeros(scale.shape, dtype=torch.int8)
        if storage == "uint8":  # same symmetric grid, stored shifted by 128 (see to_onnx)
            codes = (codes.to(torch.int16) + 128).to(torch.uint8)
            zp = torch.full(scale.shape, 128, dtype=torch.uint8)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("zp", zp)
        bias = layer.effective_bias()  # with the weight bias correction
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.input_act = layer.input_act
        self.register_buffer("input_scale", layer.input_scale.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale.numel():  # input smoothing: one Mul, merged for Linear layers sharing the input
            x = x * self.input_scale
        y = torch.matmul(self.input_act(x), _WeightDQFn.apply(self.codes, self.scale, self.zp))
        return y if self.bias is None else y + self.bias


class _ExportEmbedding(nn.Module):
    """Weight-only int8 embedding table (symmetric, one scale per row): int8 codes and float scales, both gathered.

    From a :class:`softq.quant.quantizers.QEmbedding` (``QuantConfig.embedding_bits``, the
    default): its own codes and scales, so ONNX computes what the torch model does.  From a
    float ``nn.Embedding`` (``embeddings="int8"`` on a model quantized with
    ``embedding_bits=None``): 8-bit codes made here, which the torch model does not use.
    """

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        if hasattr(emb, "int_weight"):  # a QEmbedding: the codes its inference computes with
            codes, scale = weight_codes(emb.weight, emb.bits, 0)
            if codes.abs().max() > 127:
                raise ExportError(f"embedding codes of {emb.bits} bits do not fit int8")
            codes, scale = codes.to(torch.int8), scale.reshape(-1).to(torch.float32)
        else:
            w = emb.weight.detach().to(torch.float32)
            scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
            codes = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        self.padding_idx = emb.padding_idx
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale.reshape(-1, 1).to(torch.float32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _EmbeddingLookupFn.apply(ids, self.codes, self.scale)


class _EmbeddingLookupFn(torch.autograd.Function):
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


class _FloatEmbedding(nn.Module):
    """A QEmbedding exported as a float table of its dequantized codes (``embeddings="float"``)."""

    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.padding_idx = emb.padding_idx
        self.weight = nn.Parameter(emb.dequantized().detach().clone(), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight, self.padding_idx)


class _ScoresTap(nn.Module):
    """Passes the float scores through and remembers them (and the mask) for the attention marker."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x
        return x


class _ValidTap(nn.Module):
    """Stands in for the softmax-output quantizer: remembers the mask, passes the probabilities on."""

    def __init__(self, tap: _ScoresTap) -> None:
        super().__init__()
        self.tap = [tap]  # a list: not a submodule

    def forward(self, probs: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        self.tap[0].valid = valid
        return probs


class _AttentionMarker(nn.Module):
    """Replaces the P.V matmul: one marker from (scores, V, valid) to P.V."""

    def __init__(self, tap: _ScoresTap, key: int) -> None:
        super().__init__()
        self.tap = [tap]
        self.key = key

    def forward(self, probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        tap = self.tap[0]
        return _AttentionMarkerFn.apply(tap.seen, value, tap.valid, torch.matmul(probs, value), self.key)


# ---------------------------------------------------------------------------
# Preparing the export copy
# ---------------------------------------------------------------------------


def _is_act_quantizer(m: nn.Module) -> bool:
    from softq.quant.quantizers import ActQuantizer

    return isinstance(m, ActQuantizer)


def _is_row_scores(m: nn.Module) -> bool:
    from softq.quant.quantizers import RowScoresQuantizer

    return isinstance(m, RowScoresQuantizer)


def _replace_children(model: nn.Module, match, make) -> None:  # noqa: ANN001
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if match(child):
                setattr(parent, name, make(child))


def _extend_rows(beta: np.ndarray | None, beta_head: np.ndarray | None, rows: int) -> np.ndarray | None:
    """Per-row beta padded to ``rows`` query rows with the per-head beta (torch's fallback)."""
    if beta is None or beta.shape[2] == 1 or beta_head is None or beta.shape[2] >= rows:
        return beta
    pad = np.broadcast_to(beta_head, (1, beta.shape[1], rows - beta.shape[2], 1))
    return np.concatenate([beta, pad], axis=2)


def _softmax_params(name: str, points: nn.Module, key: int) -> dict[str, Any]:
    from softq.quant.quantizers import SoftmaxOutputQuantizer

    if points.softmax_name not in EXPORTABLE_SOFTMAX:
        raise ExportError(
            f"softq cannot export softmax variant '{points.softmax_name}' (attention layer '{name}'); "
            f"the integer softmax forms implement: {', '.join(EXPORTABLE_SOFTMAX)}"
        )
    scores, probs = points.scores, points.probs
    if not _is_act_quantizer(scores) and not isinstance(probs, SoftmaxOutputQuantizer):
        if not all(_is_act_quantizer(m) for m in (points.q, points.k, points.v)):
            raise ExportError(f"attention layer '{name}' has float Q, K or V; the float-softmax core needs them "
                              "quantized (softq.quantize does)")
        return {"name": name, "representation": "float"}  # quantized with softmax_bits=None
    if (not _is_act_quantizer(scores) and isinstance(probs, SoftmaxOutputQuantizer)
            and probs.representation in FLOAT_INPUT_OUTPUTS):  # softmax_input="float": row codes from float scores
        return {"name": name, "q": None, "representation": probs.representation,
                "rq": _row_quant(name, points, None)}
    if not _is_act_quantizer(scores) or not isinstance(probs, SoftmaxOutputQuantizer):
        raise ExportError(
            f"attention layer '{name}' has a float softmax {'input' if not _is_act_quantizer(scores) else 'output'} "
            "and a quantized softmax "
            f"{'output' if not _is_act_quantizer(scores) else 'input'}; the ONNX export takes both quantized "
            "(softmax_bits=8) or both float (softmax_bits=None)"
        )
    if int(scores.bits) > 8:
        raise ExportError(f"attention layer '{name}': {scores.bits}-bit softmax inputs are not exportable (max 8)")
    q = SoftmaxQuant(scale=float(scores.scale), zero_point=int(round(float(scores.zero_point))),
                     bits=int(scores.bits), signed=bool(scores.signed), out_signed=False,
                     relative=_is_row_scores(scores))
    if probs.representation != "edge":
        return {"name": name, "q": q, "representation": probs.representation, "rq": _row_quant(name, points, q)}
    if abs(float(probs.scale) - float(OUT_SCALE)) > 0 or int(probs.bits) != 8 or float(probs.zero_point) != 0:
        raise ExportError(
            f"attention layer '{name}': softmax output quantizer has scale {float(probs.scale):.6g}, "
            f"{int(probs.bits)} bits; the export emits the edge convention 2**-8, 8 bits, zero point 0 "
            "(quantize with softmax_bits=8, softmax_scale='fixed')"
        )
    beta = None if probs.beta.numel() == 0 else probs.beta.detach().cpu().numpy().astype(np.float64)
    beta_head = None if probs.beta_head.numel() == 0 else probs.beta_head.detach().cpu().numpy().astype(np.float64)
    return {"name": name, "q": q, "representation": "edge", "beta": beta, "beta_head": beta_head,
            "causal_rows": bool(probs.causal_rows)}


def _row_quant(name: str, points: nn.Module, q: SoftmaxQuant | None) -> RowQuant:
    """The grids of a row-code attention core (``q`` None: float scores); V codes stored as uint8 (signed ones
    shifted by 128)."""
    probs, v = points.probs, points.v
    if probs.beta.numel():
        raise ExportError(f"attention layer '{name}': softmax bias correction is exported for "
                          f"softmax_output='edge' only, this layer uses '{probs.representation}'")
    if not _is_act_quantizer(v) or int(v.bits) > 8:
        raise ExportError(f"attention layer '{name}': the row-code attention needs V quantized to at most 8 bits")
    shift = 128 if v.signed else 0
    lo, hi = ((-(2 ** (v.bits - 1)) + 1, 2 ** (v.bits - 1) - 1) if v.signed else (0, 2**v.bits - 1))
    try:
        return RowQuant(q, float(v.scale), int(round(float(v.zero_point))) + shift, int(probs.bits),
                        probs.representation, lo + shift, hi + shift)
    except ValueError as err:
        raise ExportError(f"attention layer '{name}': {err}") from err


def _max_positions(model: nn.Module) -> int:
    """The longest sequence the model takes (:func:`softq.models.max_tokens`), 4096 where its config sets none."""
    return max_tokens(getattr(model, "config", None)) or 4096


def _float32(model: nn.Module) -> nn.Module:
    """A float16 / bfloat16 model (a copy) as float32, exactly (its weights and scales are float32 values): the file
    computes in float32, as runtimes run such graphs, so its outputs are the float32 model's (the half model's
    within its own rounding)."""
    from softq.softmax import HALF_DTYPES

    if any(t.dtype in HALF_DTYPES for t in (*model.parameters(), *model.buffers())):
        model.float()
    return model


def _export_copy(qmodel: nn.Module, weight_storage: str = "int8",
                 embeddings: str | None = None) -> tuple[nn.Module, dict[int, dict[str, Any]]]:
    from softq.attention import attention_points
    from softq.quant.layers import QEmbedding, QLinear
    from softq.softmax import HALF_DTYPES

    # the copy shares the quantized weights, which it only reads (into int8 codes) before replacing their layers: a
    # copy of each was a float copy of the model more; not in a float16 / bfloat16 model, whose copy is made float32
    shared = {} if any(t.dtype in HALF_DTYPES for t in (*qmodel.parameters(), *qmodel.buffers())) else {
        id(m.weight): m.weight for m in qmodel.modules() if isinstance(m, (QLinear, QEmbedding))}
    model = _float32(copy.deepcopy(qmodel, shared).eval())
    layers: dict[int, dict[str, Any]] = {}
    for key, (name, points) in enumerate(attention_points(model)):
        layers[key] = info = _softmax_params(name, points, key)
        if info["representation"] == "edge":
            # rows past the calibrated ones take the per-head beta (SoftmaxOutputQuantizer.beta_for)
            info["beta_rows"] = 0 if info["beta"] is None else info["beta"].shape[2]
            info["beta"] = _extend_rows(info["beta"], info["beta_head"], _max_positions(model))
        elif info["representation"] != "float":
            try:
                info["rq"].check_keys(_max_positions(model))
            except ValueError as err:
                raise ExportError(f"attention layer '{name}': {err}; the model takes "
                                  f"{_max_positions(model)} positions") from err
        points.prefix_rows = 0  # the left-padding check is torch's; ONNX graphs cannot refuse an input
        tap = _ScoresTap()
        points.scores = tap
        points.probs = _ValidTap(tap)
        points.pv = _AttentionMarker(tap, key)
    counter = iter(range(10**9))
    _replace_children(model, lambda m: isinstance(m, QLinear), lambda m: _ExportLinear(m, weight_storage))
    _replace_children(model, _is_act_quantizer, lambda m: _ExportAct(m, next(counter)))
    from softq.quant.layers import WeightOnly

    if embeddings == "float":
        _replace_children(model, lambda m: isinstance(m, QEmbedding), _FloatEmbedding)
    else:
        _replace_children(model, lambda m: isinstance(m, QEmbedding), _ExportEmbedding)
    for module in list(model.modules()):  # Conv2d weights, a vision encoder's position table
        for plist in getattr(module, "parametrizations", {}).values():
            if len(plist) == 1 and isinstance(plist[0], WeightOnly):
                plist[0] = _ExportWeightOnly(plist[0], plist.original, next(counter))
    if embeddings == "int8":
        # exact nn.Embedding only: subclasses (OPT's learned positions) have their own forward
        min_rows = qmodel.softq_quant_config.embedding_min_rows
        _replace_children(model, lambda m: type(m) is nn.Embedding and m.num_embeddings >= min_rows,
                          _ExportEmbedding)
    return model, layers


TEXT_OUTPUTS = ("logits", "last_hidden_state", "sentence_embedding")


class _TextWrapper(nn.Module):
    """input_ids, attention_mask -> logits (models with a head) or last_hidden_state (headless encoders),
    plus the pooled sentence embedding when asked; the 4-D mask is built from traceable ops."""

    def __init__(self, model: nn.Module, causal: bool, outputs: tuple[str, ...], pooling: str | None,
                 normalize: bool) -> None:
        super().__init__()
        self.model = model
        self.causal = causal
        self.outputs = outputs
        self.pooling = pooling
        self.normalize = normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        from softq.hf import pool

        pad = attention_mask.to(torch.bool)[:, None, None, :]
        if self.causal:
            pos = torch.arange(input_ids.shape[1], device=input_ids.device)
            pad = pad & (pos[None, :] <= pos[:, None])[None, None]
        extra = {}
        if self.model.config.model_type == "opt":  # OPT derives positions from the 2-D mask, as here
            mask = attention_mask.to(torch.long)
            # HF's cumsum(mask) * mask - 1, as a Where: at one token tract turned that Mul into an int64 Square
            # it has no kernel for
            extra["position_ids"] = torch.where(mask != 0, torch.cumsum(mask, dim=1) - 1, -1)
        out = self.model(input_ids=input_ids, attention_mask=pad, use_cache=False, **extra)
        if self.outputs == ("logits",):
            return _logits(out, self.model)
        hidden = out.last_hidden_state
        if self.outputs == ("last_hidden_state",):
            return hidden
        return hidden, pool(hidden, attention_mask, self.pooling or "mean", self.normalize)


class _VisionWrapper(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.model(pixel_values=pixel_values)
        return out.last_hidden_state if is_headless(self.model) else _logits(out, self.model)


def _logits(out: Any, model: nn.Module) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):  # question answering, pre-training heads...
        raise ExportError(f"{type(model).__name__} outputs {output_fields(out)} and no logits; softq exports models "
                          "with one logits output and headless encoders (last_hidden_state)")
    return logits


def wrap_for_export(model: nn.Module, pooling: str | None = None,
                    normalize: bool = False) -> tuple[nn.Module, list[str], list[str]]:
    """The module that is traced, its ONNX input names and its output names.

    Models with a head output ``logits``; headless encoders output
    ``last_hidden_state`` and, with ``pooling`` ("mean", "cls", "max"), also the
    sentence embedding ``sentence_embedding`` (L2-normalised with ``normalize``).
    """
    from softq.hf import POOLING_MODES

    if has_cross_attention(model):
        raise ExportError(f"softq exports self-attention models; this {type(model).__name__} has cross-attention "
                          "layers (add_cross_attention=True: it reads encoder_hidden_states), which the export does "
                          "not take")
    headless = is_headless(model)
    if pooling is not None and (pooling not in POOLING_MODES or not headless):
        raise ExportError(f"pooling={pooling!r}: a sentence embedding needs a headless text encoder and one of "
                          f"{POOLING_MODES}" + ("" if headless else f"; {type(model).__name__} has a task head"))
    if getattr(model, "main_input_name", "input_ids") == "pixel_values":
        return _VisionWrapper(model).eval(), ["pixel_values"], ["last_hidden_state" if headless else "logits"]
    outputs = ("logits",) if not headless else ("last_hidden_state",) if pooling is None else (
        "last_hidden_state", "sentence_embedding")
    return (_TextWrapper(model, is_causal(model), outputs, pooling, normalize).eval(), ["input_ids", "attention_mask"],
            list(outputs))


def example_feeds(model: nn.Module, example_inputs: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """Normalise and check example inputs: a tensor (main input) or a dict of tensors."""
    from softq.calib.data import CalibrationDataError, check_batch

    if isinstance(example_inputs, (torch.Tensor, np.ndarray)):
        example_inputs = {names[0]: example_inputs}
    if not isinstance(example_inputs, Mapping):
        raise ExportError(f"example_inputs must be a tensor or a dict of tensors, got {type(example_inputs).__name__}")
    feeds = {}
    for key, value in example_inputs.items():  # a tokenizer's return_tensors="np" arrays are taken as they are
        if isinstance(value, np.ndarray) and value.dtype != object:
            value = torch.from_numpy(np.ascontiguousarray(value))
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"example input {key!r} must be a tensor (or a numpy array), got {type(value).__name__}")
        feeds[key] = value
    types = feeds.pop("token_type_ids", None)
    if types is not None and bool(types.any()):
        raise ExportError("example token_type_ids are not all 0: the exported graph takes one segment "
                          "(input_ids, attention_mask) and uses token type 0")
    unknown = set(feeds) - set(names)
    if unknown:
        raise ExportError(f"example_inputs has unexpected key(s) {sorted(unknown)}; this model takes {names}")
    if names[0] not in feeds:
        raise ExportError(f"example_inputs needs '{names[0]}'")
    main = feeds[names[0]]
    if names[0] == "input_ids":
        if main.ndim != 2 or main.is_floating_point():
            raise ExportError(f"example input_ids must be an integer tensor [batch, seq], got {main.dtype} {tuple(main.shape)}")
        mask = feeds.get("attention_mask")
        if mask is None:
            feeds["attention_mask"] = torch.ones_like(main)
        elif tuple(mask.shape) != tuple(main.shape):
            raise ExportError(f"example attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(main.shape)}")
    else:
        cfg = model.config
        want = (int(getattr(cfg, "num_channels", 3)), *image_size(cfg))
        if main.ndim != 4 or tuple(main.shape[1:]) != want:
            raise ExportError(f"example pixel_values must have shape [batch, {want[0]}, {want[1]}, {want[2]}], "
                              f"got {tuple(main.shape)}")
    try:
        check_batch(model, {k: v for k, v in feeds.items() if k != "attention_mask"}, 0, "example input")
    except CalibrationDataError as err:
        raise ExportError(str(err)) from err
    # the example's dtypes become the file's input types: the ones tokenizers and image processors give
    # (int32 ids made a file that plain onnxruntime refuses int64 ids for; float64 pixels a double input)
    return {n: feeds[n].to(torch.float32 if n == "pixel_values" else torch.int64) for n in names}


def _trace(wrapper: nn.Module, feeds: dict[str, torch.Tensor], names: list[str], outputs: list[str],
           shapes: list[tuple[int, ...]]) -> onnx.ModelProto:
    """The traced file; ``shapes``: the outputs' shapes on ``feeds`` (:func:`_run_once`).  Outputs declare a
    dynamic batch, a dynamic sequence where they have one (text outputs of rank 3: per token), the rest as
    computed (a sequence classifier's ``[batch, labels]``)."""
    text = "pixel_values" not in names
    dynamic = {n: {0: "batch", 1: "seq"} for n in names} if text else {"pixel_values": {0: "batch"}}
    for o, shape in zip(outputs, shapes):
        dynamic[o] = {0: "batch", 1: "seq"} if text and len(shape) >= 3 else {0: "batch"}
    args = (wrapper, tuple(feeds[n] for n in names))
    kwargs = dict(dynamo=False, opset_version=TORCH_OPSET, input_names=names, output_names=outputs,
                  dynamic_axes=dynamic, custom_opsets={MARKER_DOMAIN: 1}, do_constant_folding=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            buf = io.BytesIO()
            try:
                torch.onnx.export(*args, buf, **kwargs)
                model = onnx.load_from_string(buf.getvalue())
            except RuntimeError as err:
                if "2GiB limit imposed by the protobuf" not in str(err):
                    raise
                # past its 2 GiB estimate torch writes the weights as external data, which needs a file path; read
                # back, what softq's passes make of them is measured below
                del buf
                with tempfile.TemporaryDirectory(prefix="softq-trace-") as tmp:
                    torch.onnx.export(*args, str(Path(tmp) / "traced.onnx"), **kwargs)
                    model = onnx.load(str(Path(tmp) / "traced.onnx"))
        except torch.onnx.errors.UnsupportedOperatorError as err:
            raise ExportError(f"softq cannot export this model: {err}") from err
    size = onnx_utils.tensor_bytes(model)
    if size > onnx_utils.PROTOBUF_LIMIT:
        raise ExportError(f"the exported graph's weights take {size / 1e9:.2f} GB (int8 codes where quantized, float "
                          "elsewhere), over protobuf's 2 GiB limit for one ONNX file, and softq does not write ONNX "
                          "external data yet")
    for value, shape in zip(model.graph.output, shapes):
        dims = value.type.tensor_type.shape.dim
        for axis, dim in enumerate(dims):
            if axis not in dynamic[value.name] and len(dims) == len(shape):
                dim.Clear()
                dim.dim_value = shape[axis]
    return model


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
                                           empty_rows=valid_b is not None)
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
    for node in graph.node:
        if node.domain != MARKER_DOMAIN:
            new_nodes.append(node)
            continue
        key = next(a.i for a in node.attribute if a.name == "key")
        if node.op_type == WEIGHT_MARKER_OP:  # int8 codes -> Cast -> Mul(scales): a constant runtimes fold
            codes, scale, _, _ = _STATE.weights[key]
            p = f"softq/W{key}/"
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


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------


def build_onnx(qmodel: nn.Module, example_inputs: Any, softmax: str | None = None, probs_outputs: bool = False,
               weight_storage: str = "int8", embeddings: str | None = None, pooling: str | None = None,
               normalize: bool = False, linears: str = "integer") -> onnx.ModelProto:
    """The checked ONNX model of a softq-quantized model (not written anywhere)."""
    from softq.quant import is_quantized

    if softmax is not None and softmax not in ALL_FORMS:
        raise ValueError(f"unknown softmax form {softmax!r}; choose one of {', '.join(ALL_FORMS)}")
    if weight_storage not in WEIGHT_STORAGE:
        raise ExportError(f"weight_storage must be one of {WEIGHT_STORAGE}, got {weight_storage!r}")
    if linears not in LINEAR_FORMS:
        raise ExportError(f"linears must be one of {LINEAR_FORMS}, got {linears!r}")
    if embeddings not in (None, "float", "int8"):
        raise ExportError(f"embeddings must be None (as quantized), 'float' or 'int8', got {embeddings!r}")
    if not is_quantized(qmodel):
        raise ExportError(
            f"{type(qmodel).__name__} was not quantized by softq (no softq_quant_config); run softq.quantize(model, "
            "calib_data) first, or use softq.export.to_onnx_float for a float model"
        )
    # a SentenceTransformer: its Hugging Face model, pooling and normalisation; example texts tokenized as it does
    qmodel, example_inputs, pooling, normalize = _unwrap_sentence_transformer(qmodel, example_inputs, pooling, normalize)
    if weight_storage == "uint8" and linears == "integer" and qmodel.softq_quant_config.act_symmetric:
        # onnxruntime fuses that into an s8 x u8 MatMulIntegerToFloat, for which it has no kernel: the file would
        # not load at its default optimisation level
        raise ExportError("weight_storage='uint8' pairs with unsigned activation codes; this model's are signed "
                          "(QuantConfig(act_symmetric=True)), and onnxruntime has no int8 x uint8 integer MatMul: "
                          "export it with weight_storage='int8' (or linears='qdq'; CLI: --weight-storage int8)")
    off = _quantization_off(qmodel)
    if off:
        raise ExportError(f"quantization is switched off at {len(off)} point(s) of this model (first: {off[0]}; "
                          "softq.quant.sensitivity.enable_only or set_mode): the file would quantize them anyway and "
                          "compute something else than the model; switch them back on "
                          "(softq.quant.quantize.set_mode(model, 'quant') and weight_quant.disable_quant = False)")
    if linears == "dynamic" and qmodel.softq_quant_config.act_bits != 8:
        # the static grid's Clip between QuantizeLinear and DequantizeLinear kept the fusion from finding the
        # input quantization: the file came out in the integer form, silently
        raise ExportError(f"linears='dynamic' quantizes Linear inputs to 8 bits per call (DynamicQuantizeLinear); "
                          f"this model's activations have {qmodel.softq_quant_config.act_bits} bits: export it with "
                          "linears='integer' or 'qdq'")
    try:
        return _build(qmodel, example_inputs, softmax, probs_outputs, weight_storage, embeddings, pooling, normalize,
                      linears)
    finally:
        _STATE.clear()


def _quantization_off(qmodel: nn.Module) -> list[str]:
    """Names of the points whose quantization is off: activation or softmax quantizers not in ``quant`` mode,
    quantized Linears or tables with weight quantization disabled, disabled weight-only parametrizations."""
    from softq.quant.layers import QEmbedding, QLinear, WeightOnly
    from softq.quant.quantizers import ActQuantizer, SoftmaxOutputQuantizer

    return [name for name, m in qmodel.named_modules()
            if isinstance(m, (ActQuantizer, SoftmaxOutputQuantizer)) and m.mode != "quant"
            or isinstance(m, (QLinear, QEmbedding)) and m.weight_quant.disable_quant
            or isinstance(m, WeightOnly) and not m.enabled]


def _build(qmodel: nn.Module, example_inputs: Any, softmax: str | None, probs_outputs: bool, weight_storage: str,
           embeddings: str | None, pooling: str | None, normalize: bool, linears: str) -> onnx.ModelProto:
    """:func:`build_onnx` after its argument checks."""
    model, layers = _export_copy(qmodel, weight_storage, embeddings)
    representations = list(dict.fromkeys(info["representation"] for info in layers.values()))
    softmax = softmax or FORMS_FOR[representations[0]][0]
    for representation in representations:
        check_form_for(representation, softmax)
    if softmax != "fast" and any(info.get("rq") is not None and info["rq"].float_scores for info in layers.values()):
        raise ExportError(f"softmax form {softmax!r} takes integer score codes; this model keeps its softmax input float "
                          "(softmax_input='float', what the default 'auto' means for row codes): export it with "
                          "softmax='fast', or quantize with softmax_input='row' (CLI: --softmax-input row)")
    wrapper, names, outputs = wrap_for_export(model, pooling, normalize)
    feeds = example_feeds(qmodel, example_inputs, names)
    if softmax == "ort" and is_causal(qmodel):
        raise ExportError(
            "softmax='ort' cannot export a causal model: QLinearSoftmax has no mask input, so every row's future "
            "keys would keep a weight and every position's output would be wrong; use softmax='qdq' or 'int'")
    if softmax == "ort" and "attention_mask" in names:
        warnings.warn(
            "softmax='ort' on a model with attention masks: QLinearSoftmax has no mask input, so in a padded row "
            "the padding keys enter as the lowest score code and keep a weight exp((qmin - row max) * scale) "
            "each, as much as a real key's where the calibrated score range is narrow: outputs of padded inputs "
            "are wrong by that much (unpadded inputs are exact; softq's runner refuses padded batches for this "
            "file); 'int' and 'qdq' mask exactly", UserWarning, stacklevel=2,
        )
    shapes = _run_once(wrapper, feeds, "the quantized model")
    onnx_model = _trace(wrapper, feeds, names, outputs, shapes)
    onnx_utils.unshare_int_initializers(onnx_model)
    onnx_model = replace_markers(onnx_model, layers, softmax, probs_outputs)
    onnx_model, _ = onnx_utils.dedupe(onnx_utils.prune(onnx_model))
    fuse.fuse(onnx_model, linears=linears != "qdq", dynamic=linears == "dynamic")  # fewer nodes around the integer linears (export/fuse.py)
    onnx_model = onnx_utils.prune(onnx_model)
    check_exportable_ops(onnx_model, softmax)
    onnx_model.producer_name = "softq"
    _mark_max_length(onnx_model, qmodel, names)
    _mark_right_padding(onnx_model, qmodel, names)
    if any(info.get("int64_core") for info in layers.values()):
        from softq.export.runtimes import INT64_CORE_KEY

        entry = onnx_model.metadata_props.add()
        entry.key, entry.value = INT64_CORE_KEY, "true"
    onnx.checker.check_model(onnx_model, full_check=True)
    return onnx_model


def build_onnx_float(model: nn.Module, example_inputs: Any, pooling: str | None = None,
                     normalize: bool = False) -> onnx.ModelProto:
    """The float ONNX model (softq attention, no quantization) with the same inputs and outputs."""
    from softq.attention import configure_attention
    from softq.quant import is_quantized

    if is_quantized(model):
        raise ExportError("build_onnx_float takes the float model; this one is quantized (use to_onnx)")
    model, example_inputs, pooling, normalize = _unwrap_sentence_transformer(model, example_inputs, pooling, normalize)
    model = _float32(copy.deepcopy(model).eval())
    configure_attention(model)
    wrapper, names, outputs = wrap_for_export(model, pooling, normalize)
    feeds = example_feeds(model, example_inputs, names)
    shapes = _run_once(wrapper, feeds, "the float model")
    onnx_model = onnx_utils.drop_identity_casts(onnx_utils.prune(_trace(wrapper, feeds, names, outputs, shapes)))
    _mark_max_length(onnx_model, model, names)
    _mark_right_padding(onnx_model, model, names)
    onnx.checker.check_model(onnx_model, full_check=True)
    return onnx_model


def _mark_right_padding(onnx_model: onnx.ModelProto, model: nn.Module, names: list[str]) -> None:
    """Record in the file's metadata that its first positions must hold real tokens, where the model says so
    ([CLS] residual scales of their own, a constant attention sink): the torch model refuses left-padded batches,
    a graph cannot, and would apply them to pad tokens; :func:`softq.export.runtimes.runner` refuses them."""
    from softq.attention import right_padding_rows
    from softq.export.runtimes import RIGHT_PADDING_KEY, RIGHT_PADDING_WHY_KEY

    rows, why = right_padding_rows(model)
    if rows and "attention_mask" in names:
        for key, value in ((RIGHT_PADDING_KEY, str(rows)), (RIGHT_PADDING_WHY_KEY, why)):
            entry = onnx_model.metadata_props.add()
            entry.key, entry.value = key, value


def _mark_max_length(onnx_model: onnx.ModelProto, model: nn.Module, names: list[str]) -> None:
    """Record a text model's longest sequence (its position table) in the file's metadata, which
    :func:`softq.export.runtimes.runner` checks: past it onnxruntime raises, OpenVINO reads out of bounds."""
    from softq.export.runtimes import MAX_LENGTH_KEY

    limit = max_tokens(getattr(model, "config", None))  # (None where the config sets no limit: no entry)
    if names[0] == "input_ids" and limit is not None:
        entry = onnx_model.metadata_props.add()
        entry.key, entry.value = MAX_LENGTH_KEY, str(limit)


def _run_once(wrapper: nn.Module, feeds: dict[str, torch.Tensor], what: str) -> list[tuple[int, ...]]:
    """The shapes of the wrapper's outputs on ``feeds``; an example that does not fit, one ExportError."""
    try:
        with torch.no_grad():
            out = wrapper(*feeds.values())
        return [tuple(t.shape) for t in (out if isinstance(out, tuple) else (out,))]
    except ExportError:
        raise
    except (RuntimeError, IndexError, ValueError) as err:
        shapes = {k: tuple(v.shape) for k, v in feeds.items()}
        raise ExportError(f"example inputs {shapes} do not fit {what}: {err}") from err


def _unwrap_sentence_transformer(model: nn.Module, example_inputs: Any, pooling: str | None,
                                 normalize: bool) -> tuple[nn.Module, Any, str | None, bool]:
    """A ``sentence_transformers.SentenceTransformer`` as its Hugging Face model, its own pooling and normalisation
    (another ``pooling``, or ``normalize`` without its Normalize module, refused) and, for example texts, the inputs
    it tokenizes them to; anything else as it is."""
    from softq.hf import is_sentence_transformer, sentence_transformer_batches, sentence_transformer_pooling

    if not is_sentence_transformer(model):
        return model, example_inputs, pooling, normalize
    own, own_normalize = sentence_transformer_pooling(model)
    if pooling is not None and pooling != own:
        raise ExportError(f"the SentenceTransformer pools with '{own}'; its file carries that pooling (leave pooling "
                          f"unset), got pooling={pooling!r}")
    if normalize and not own_normalize:
        raise ExportError("the SentenceTransformer has no Normalize module: its embeddings are not normalised "
                          "(leave normalize unset, or add the module to the SentenceTransformer)")
    pooling, normalize = own, own_normalize
    prompt, dims = getattr(model, "default_prompt_name", None), getattr(model, "truncate_dim", None)
    prompt = (getattr(model, "prompts", None) or {}).get(prompt, prompt) if prompt is not None else None
    notes = [("its Pooling leaves prompt tokens out (include_prompt=False); the file pools every token it is given: "
              "the same embedding as encode for texts without a prompt", any(getattr(m, "include_prompt", True) is False
                                                                          for m in model)),
             (f"encode prepends the default prompt {prompt!r}; the file embeds what it is given: prepend it to the "
              "texts you tokenize", prompt is not None),
             (f"encode keeps the first {dims} dimensions (truncate_dim); the file outputs all of them: take "
              f"[:, :{dims}]", dims is not None)]
    for note, applies in notes:
        if applies:
            warnings.warn(f"SentenceTransformer export: {note}", UserWarning, stacklevel=3)
    if isinstance(example_inputs, str):
        example_inputs = [example_inputs]
    if isinstance(example_inputs, Mapping):  # st.tokenize / preprocess output: only its arrays are model inputs
        example_inputs = {k: v for k, v in example_inputs.items() if isinstance(v, (torch.Tensor, np.ndarray))}
    elif not isinstance(example_inputs, (torch.Tensor, np.ndarray)):  # texts (any iterable), or a list of one dict
        batches = sentence_transformer_batches(model, example_inputs, batch_size=1 << 30)
        if not isinstance(batches, list) or len(batches) != 1 or not isinstance(batches[0], Mapping):
            raise ExportError("example_inputs of a SentenceTransformer: texts (a list of strings), its tokenize "
                              "output, or a tensor of token ids")
        example_inputs = {k: v for k, v in batches[0].items() if isinstance(v, (torch.Tensor, np.ndarray))}
    return model[0].auto_model, example_inputs, pooling, normalize


def to_onnx(qmodel: nn.Module, path: str, example_inputs: Any, softmax: str | None = None, overwrite: bool = False,
            probs_outputs: bool = False, weight_storage: str = "int8", embeddings: str | None = None,
            pooling: str | None = None, normalize: bool = False, linears: str = "integer",
            names: str = "short") -> str:
    """Export a softq-quantized model to ONNX with an integer softmax; returns the path written.

    ``softmax``: the form of the attention core, by the model's
    ``softmax_output``.  ``row``/``row_exact`` (default): ``"fast"`` (default;
    float Exp, its codes by QuantizeLinear, integer GEMM with the row sum from the same GEMM) or
    ``"int"`` (exp table indexed by score codes, integer up to the int32 accumulators; for a model
    quantized with ``softmax_input="row"``: the default float softmax input has no codes).  ``edge``:
    ``"qdq"`` (portable default), ``"ort"`` (com.microsoft.QLinearSoftmax) or
    ``"int"`` (standard ops, integer arithmetic only).  A model quantized with a float
    softmax (``QuantConfig(softmax_bits=None)``): ``"float"``, the only form for it, with
    the same integer Linear layers and Q/K/V codes and a float core (``Softmax`` over the
    valid keys, masked keys exactly 0, float ``MatMul`` with the dequantized V): no integer
    softmax, for runtimes with a fast float Softmax.  Batch and sequence
    length are dynamic; inputs are int64 ids and float32 images, and a float16 / bfloat16
    model exports as its float32 equal (the same weights and scales, computed in float32).  The file is written atomically and only after
    ``onnx.checker.check_model(full_check=True)`` passed; an existing file is
    replaced only with ``overwrite=True``.  ``probs_outputs`` adds every layer's
    dequantized softmax output as an extra graph output (for parity checks).

    Weights are symmetric per-output-channel 8-bit codes (-127..127), stored as
    int8 (``weight_storage="int8"``, the default): onnxruntime runs the linear
    layers on its u8s8 kernels (MatMulIntegerToFloat), exact on CPUs with VNNI or
    AMX and on ARM.  On x86 CPUs without VNNI (AVX2 only) that kernel adds pairs of
    u8*s8 products in int16 and can saturate; onnxruntime fixes it at load time,
    only on such CPUs, with the session option ``session.x64quantprecision=1``
    (softq's own sessions set it; set it in yours:
    ``opts.add_session_config_entry("session.x64quantprecision", "1")``).
    ``"uint8"`` stores the same codes shifted by 128 (zero point 128): exact
    everywhere without that option, but the u8u8 kernel measured 2x slower on a
    VNNI CPU (docs/results/export_speed.md); it needs unsigned activation codes (the
    default; ``act_symmetric=True`` models are refused with ``linears="integer"``).
    ``linears``: the form of the Linear layers.  ``"integer"`` (default):
    ``MatMulInteger -> Cast -> Mul -> Add(bias)``, which onnxruntime fuses into one
    ``MatMulIntegerToFloat`` with the bias and tract runs on its int8 kernels;
    ``"qdq"``: ``DequantizeLinear -> MatMul``, the pattern OpenVINO's int8 path
    recognises (all-MiniLM-L6-v2 at batch 1, one thread, docs/results/export_speed.md:
    OpenVINO 0.51x FP32 with ``"qdq"``, 1.30x with ``"integer"``; onnxruntime 0.46x /
    0.45x; tract 1.37x / 0.94x).  Same codes and function either way (float rounding aside), with one
    exception in onnxruntime: where a Linear's input is 2-D (OPT's fc1 and fc2), its ``MatMulAddFusion``
    makes the ``"qdq"`` form a quantized Gemm whose bias it rounds to int32 at the accumulator's scale (a
    rounding the integer form does not have: its bias stays float32); the ``"integer"`` form matches torch there.
    ``"dynamic"``: the integer form with each Linear input quantized per call on its own
    range (``DynamicQuantizeLinear``, what ``quantize_dynamic`` does; onnxruntime fuses it
    into ``DynamicQuantizeMatMul``) instead of the calibrated grid; Q, K, V and the
    softmax keep theirs.  An onnxruntime-only speed option whose outputs are not the torch
    model's: docs/results/export_speed.md measures its speed and accuracy.
    ``embeddings``: ``None`` (default) stores the tables as the model has them:
    int8 codes with one scale per row for ``QuantConfig.embedding_bits`` (the
    default), float otherwise; ``"int8"`` also makes int8 tables of float ones
    (those of at least ``QuantConfig.embedding_min_rows`` rows, as quantization does)
    (the torch model then differs slightly); ``"float"`` stores quantized tables
    dequantized (same outputs, larger file).

    A quantized ``sentence_transformers.SentenceTransformer`` exports as its Hugging Face model with its own
    pooling and normalisation; its example inputs may be texts.
    Models with a head output ``logits``.  Headless encoders (``BertModel``...)
    output ``last_hidden_state``; with ``pooling`` ("mean", "cls", "max") they also
    output ``sentence_embedding`` (L2-normalised with ``normalize``), what a
    sentence-transformers folder computes (``softq.hf.load_model_dir`` reads both).

    ``names``: ``"short"`` (default) gives every internal tensor a short name and
    drops node names (:func:`softq.export.onnx_utils.compact_names`; inputs and
    outputs keep theirs): the exporter's long names take several percent of an
    INT8 file (one copy per producer and per reader).  ``"full"`` keeps them (for reading the graph
    or a profile).
    """
    if names not in ("short", "full"):
        raise ValueError(f"names must be 'short' or 'full', got {names!r}")
    onnx_utils.check_writable(path, overwrite)  # fail before the (slow) export
    model = build_onnx(qmodel, example_inputs, softmax, probs_outputs, weight_storage, embeddings, pooling, normalize,
                       linears)
    if names == "short":
        model, _ = onnx_utils.compact_names(model)
    return str(onnx_utils.save_atomic(model, path, overwrite))


def to_onnx_float(model: nn.Module, path: str, example_inputs: Any, overwrite: bool = False,
                  pooling: str | None = None, normalize: bool = False) -> str:
    """Export the float model with the same interface (the FP32 baseline of the benchmarks)."""
    onnx_utils.check_writable(path, overwrite)
    return str(onnx_utils.save_atomic(build_onnx_float(model, example_inputs, pooling, normalize), path, overwrite))
