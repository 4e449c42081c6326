"""The three ONNX forms of a quantized softmax, and a numpy reference for each.

Every form maps a quantized input ``X`` (integer tensor, scale ``S``) to a
quantized output ``Y`` with scale exactly ``2**-8`` (float32) and zero point 0
(``uint8``) or -128 (``int8``): the TFLite / Qualcomm convention.  ``1/255`` is
never used, because onnxruntime fuses a QDQ softmax into ``QLinearSoftmax``,
whose kernel uses ``floor(1/y_scale)`` and so changes the result for ``1/255``
(see ``tests/test_export_softmax.py``).

Forms:

``qdq``
    ``DequantizeLinear -> Softmax -> QuantizeLinear`` (portable default).  The
    middle is float, so the result depends on the runtime's ``exp``: onnxruntime
    agrees with the exact reference except where ``256 p`` lies within float32
    noise of a rounding tie (documented, tested).
``ort``
    ``com.microsoft.QLinearSoftmax`` with ``opset`` and ``axis`` written
    explicitly.  The reference emulates the onnxruntime kernel (float32 exp table,
    ``floor(1/y_scale)``) and is bit exact.
``int``
    Standard ONNX ops only and integer arithmetic only between ``X`` and ``Y``.
    8-bit input: ``d = max - x`` in 0..255 indexes a 256-entry table
    ``round(2**16 exp(-d S))`` (Gather), then ``(e*256 + sum/2) / sum`` in int32
    (every operand non-negative, so truncating Div is floor: a rounded division;
    rows up to 32767 keys).  With bias correction: table ``2**20``, int64.
    Wider input: the I-BERT integer exp ``x = -ln2 z + r``,
    ``exp(r) ~ a (r + b)^2 + c`` evaluated on integers, shifted right by ``z``
    through a Gather of powers of two (signed BitShift needs opset 28).

Masking: ``valid`` (bool, broadcastable to ``X``) marks attendable keys.  Masked
entries give exactly the output zero point.  ``qdq`` and ``int`` exclude masked
keys from max and sum exactly; ``ort`` can only feed masked keys to the kernel
as the input's minimum code, so each keeps the weight ``exp((qmin - max) S)`` in
the denominator -- the reference reproduces that.  It is small only when the row's
largest valid code lies far above ``qmin``: with valid codes near the bottom of the
input range, or thousands of masked keys, the valid outputs shrink by whole steps
(a lone valid key among thousands of masked ones keeps 255 only if its code is near
the top of the range).
Use ``qdq`` or ``int`` with masks; ``softq.export.to_onnx`` refuses ``ort`` for
masked or causal models.

Bias correction (``int`` only; see :func:`rounding_constants`): the additive
softmax correction ``beta`` (probability units, per head or per head and row)
moves the rounding point of the final integer division from 1/2 to
``1/2 + beta / 2**-8``: ``out = (e*256*K + sum*c) / (sum*K)`` with the integer
constant ``c = round(K (1/2 + beta/S_out))``, ``K = 2**8``.  Cost against the
uncorrected form: one integer Mul by a constant (``sum*K``; ``sum*c`` replaces
``sum/2``), no float op, and masked keys stay exactly 0 because ``c < K``.  (A
zero-op fold is not possible: DequantizeLinear zero points are integers and beta
is a fraction of an output step.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FORMS = ("qdq", "ort", "int")
OUT_SCALE = np.float32(2.0**-8)
TABLE_BITS = 20  # exp table entries are round(2**20 * exp(-d S)) (int64 arithmetic)
# Without bias correction an 8-bit softmax runs in int32 (about twice as fast in onnxruntime):
# table entries round(2**16 exp(-d S)), so row sums stay below 2**31 for rows shorter than 2**15.
TABLE_BITS_INT32 = 16
MAX_ROW_INT32 = 2**15 - 1
ROUND_BITS = 8  # resolution of the bias-corrected rounding constant: 1/256 of a step
# I-BERT second-order fit of exp on (-ln2, 0]: exp(r) ~ A (r + B)^2 + C.
IBERT_A = 0.35815147
IBERT_B = 0.96963238 / (2 * IBERT_A)
IBERT_C = 1.0 - IBERT_A * IBERT_B**2
# The I-BERT path rescales the input grid into [2**-14, 2**-13): fine enough for
# the polynomial, small enough that int64 never overflows for rows up to 2**20.
IBERT_SCALE_LO = 2.0**-14
MAX_SHIFT = 62
LOWEST = np.finfo(np.float32).min


@dataclass(frozen=True)
class SoftmaxQuant:
    """Quantization of one softmax: input grid (scale, zero point, bits, sign) and output sign.

    The output grid is fixed: scale ``2**-8``, zero point 0 (``uint8``) or -128
    (``int8``).  The input zero point does not change the result of ``ort`` and
    ``int`` (softmax is shift invariant); it is kept for ``qdq``'s DequantizeLinear.
    """

    scale: float
    zero_point: int = 0
    bits: int = 8
    signed: bool = False
    out_signed: bool = False
    # codes relative to the row max (QuantConfig.softmax_input="row"): zero point qmax, the row max of
    # valid keys is always code qmax, masked keys arrive as code 0 (:func:`relative_codes`)
    relative: bool = False

    def __post_init__(self) -> None:
        if self.relative and (self.signed or int(self.zero_point) != self.qmax):
            raise ValueError(f"row-relative softmax input codes are unsigned with zero point {self.qmax} "
                             f"(the row max), got zero point {self.zero_point}{' signed' if self.signed else ''}")
        if not (isinstance(self.scale, (float, int, np.floating)) and math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"softmax input scale must be a positive finite number, got {self.scale!r}")
        if not isinstance(self.bits, (int, np.integer)) or not 2 <= int(self.bits) <= 32:
            raise ValueError(f"softmax input bits must be an integer from 2 to 32, got {self.bits!r}")
        if not self.qmin <= int(self.zero_point) <= self.qmax:
            raise ValueError(
                f"softmax input zero point {self.zero_point} is outside the {self.bits}-bit "
                f"{'signed' if self.signed else 'unsigned'} range [{self.qmin}, {self.qmax}]"
            )

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.signed else 2**self.bits - 1

    @property
    def in_dtype(self) -> np.dtype:
        """Storage type of the input codes: the narrowest ONNX quantized type that holds them."""
        if self.bits <= 8:
            return np.dtype(np.int8 if self.signed else np.uint8)
        if self.bits <= 16:
            return np.dtype(np.int16 if self.signed else np.uint16)
        return np.dtype(np.int32)

    @property
    def in_onnx_type(self) -> int:
        return helper.np_dtype_to_tensor_dtype(self.in_dtype)

    @property
    def out_dtype(self) -> np.dtype:
        return np.dtype(np.int8 if self.out_signed else np.uint8)

    @property
    def out_onnx_type(self) -> int:
        return helper.np_dtype_to_tensor_dtype(self.out_dtype)

    @property
    def out_zero_point(self) -> int:
        return -128 if self.out_signed else 0

    @property
    def scale32(self) -> np.float32:
        return np.float32(self.scale)


# ---------------------------------------------------------------------------
# Shared integer pieces (used by both the references and the graph builders)
# ---------------------------------------------------------------------------


def exp_table(scale: float, bits: int = 8, table_bits: int = TABLE_BITS) -> np.ndarray:
    """``round(2**table_bits exp(-d S))`` for ``d = 0 .. 2**bits - 1`` (int64)."""
    d = np.arange(2**bits, dtype=np.float64)
    return np.round(np.exp(-d * np.float64(np.float32(scale))) * 2.0**table_bits).astype(np.int64)


def uses_int32(q: SoftmaxQuant, beta: np.ndarray | None) -> bool:
    """The int form computes in int32 for 8-bit inputs without bias correction (rows < 2**15 keys)."""
    return q.bits <= 8 and beta is None


@dataclass(frozen=True)
class IbertConsts:
    """Integer constants of the I-BERT exp for one input scale (all int64)."""

    up: int  # multiply d by this first (coarse scales) ...
    down: int  # ... or floor-divide by this (very fine scales); one of them is 1
    q_ln2: int
    q_b: int
    q_c: int


def ibert_consts(scale: float) -> IbertConsts:
    """Constants that put the input grid in ``[2**-14, 2**-13)`` and encode ln2, B, C on it."""
    s = float(np.float32(scale))
    k = math.floor(math.log2(s / IBERT_SCALE_LO))
    # k < 0: the grid is finer than needed, coarsen d (floor division); k > 0: refine it.
    up, down = (1, 2**-k) if k < 0 else (2**k, 1)
    s_eff = s * down / up
    return IbertConsts(
        up=up,
        down=down,
        q_ln2=max(1, round(math.log(2.0) / s_eff)),
        q_b=round(IBERT_B / s_eff),
        q_c=round(IBERT_C / (IBERT_A * s_eff * s_eff)),
    )


def rounding_constants(beta: np.ndarray | float | None) -> np.ndarray | None:
    """Integer rounding points ``round(2**8 (1/2 + beta / 2**-8))`` for the ``int`` form.

    ``beta`` is the additive softmax bias correction in probability units; it is
    clipped to less than half an output step either way so masked keys stay 0.
    """
    if beta is None:
        return None
    k = 2**ROUND_BITS
    c = np.round(k * (0.5 + np.asarray(beta, dtype=np.float64) / float(OUT_SCALE)))
    return np.clip(c, 1, k - 1).astype(np.int64)


def _check_valid(x: np.ndarray, valid: np.ndarray | None) -> np.ndarray | None:
    if valid is None:
        return None
    valid = np.asarray(valid).astype(bool)
    try:
        np.broadcast_shapes(valid.shape, x.shape)
    except ValueError:
        raise ValueError(f"valid mask of shape {valid.shape} does not broadcast to softmax input {x.shape}") from None
    return np.broadcast_to(valid, x.shape)


def _check_input(x: np.ndarray, q: SoftmaxQuant) -> np.ndarray:
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"softmax input must hold integer codes, got dtype {x.dtype}")
    if x.size and (x.min() < q.qmin or x.max() > q.qmax):
        raise ValueError(f"softmax input codes outside the {q.bits}-bit range [{q.qmin}, {q.qmax}]")
    return x.astype(np.int64)


def _finish(q_unsigned: np.ndarray, q: SoftmaxQuant) -> np.ndarray:
    """Saturate a 0..256 integer result and move it to the output zero point."""
    return (np.minimum(q_unsigned, 255) + q.out_zero_point).astype(q.out_dtype)


# ---------------------------------------------------------------------------
# Row-relative input codes (QuantConfig.softmax_input="row")
# ---------------------------------------------------------------------------

# Masked keys get MASKED_SCORE added before the row max; the max is raised to at least EMPTY_ROW_MAX, so
# a fully masked row (max about MASKED_SCORE) still puts its keys far below it: every masked key gets code 0.
MASKED_SCORE = np.float32(-1.0e30)
EMPTY_ROW_MAX = np.float32(-5.0e29)


def relative_codes(s: np.ndarray, q: SoftmaxQuant, valid: np.ndarray | None = None) -> np.ndarray:
    """Codes ``clamp(round((s - m) / S) + qmax, 0, qmax)`` of float32 scores ``s``, ``m`` the row max over
    valid keys; masked keys (and every key of a fully masked row) get 0.  Float32 throughout, exactly as
    :func:`build_relative_codes` computes them (Min with the mask, ReduceMax, a floor, Sub, QuantizeLinear)."""
    if not q.relative:
        raise ValueError("relative_codes needs a SoftmaxQuant with relative=True")
    r = np.rint(relative_scores(s, valid) / q.scale32)  # float32 Sub and Div, round half to even: QuantizeLinear
    return (np.clip(r, -q.qmax, 0) + q.qmax).astype(q.in_dtype)


def relative_scores(s: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    """Float32 ``s - m``, ``m`` the row max over valid keys, masked keys (and every key of a fully masked row)
    at -5e29 or below (``exp`` gives exactly 0): what :func:`build_relative_scores` computes, and the input of
    the row cores with float scores (``QuantConfig.softmax_input="float"``)."""
    s = np.asarray(s)
    if s.dtype != np.float32:
        raise ValueError(f"softmax scores must be float32, got {s.dtype}")
    v = _check_valid(s, valid)
    if v is not None:
        s = np.minimum(s, np.where(v, -MASKED_SCORE, MASKED_SCORE))  # as the graph's Min with the mask
        m = np.maximum(s.max(axis=-1, keepdims=True), EMPTY_ROW_MAX)
    else:
        m = s.max(axis=-1, keepdims=True)
    return (s - m).astype(np.float32)


def build_relative_scores(b: "_Builder", s: str, valid: str | None = None, valid_float: str | None = None) -> str:
    """Nodes of :func:`relative_scores` (``valid``: bool, broadcastable to ``s``; ``valid_float``: the same mask
    as float 0/1, if the graph has it); returns the name of ``s - m``.  See :func:`build_relative_codes`."""
    if valid_float is not None:
        cap = b.op("Sub", [b.op("Mul", [valid_float, b.const("two", -2 * MASKED_SCORE, np.float32)]),
                           b.const("one", -MASKED_SCORE, np.float32)])
    elif valid is not None:  # (a Cast of a bool mask into that Mul broke OpenVINO 2026.4's fused kernel)
        cap = b.op("Where", [valid, b.const("open", -MASKED_SCORE, np.float32), b.const("shut", MASKED_SCORE, np.float32)])
    if valid is not None or valid_float is not None:
        s = b.op("Min", [s, cap])
        m = b.at_least(b.reduce("ReduceMax", s, -1), "empty_row", EMPTY_ROW_MAX, np.float32)
    else:
        m = b.reduce("ReduceMax", s, -1)
    return b.op("Sub", [s, m])


def build_relative_codes(b: "_Builder", s: str, q: SoftmaxQuant, valid: str | None = None, out: str | None = None,
                         valid_float: str | None = None) -> str:
    """Nodes of :func:`relative_codes` (``valid``: bool, broadcastable to ``s``); returns the codes' name.

    ``valid_float``: the same mask as float 0/1, if the graph has it (then no Cast is needed).  The mask is
    applied as ``Min(s, valid * 2e30 - 1e30)``: ``s`` itself at valid keys, -1e30 at masked ones, computed
    on the small mask and broadcast once.  Two other forms give the same float32 values but not the same
    runtimes: ``Where`` on the broadcast mask is slower in onnxruntime (a select over the whole score
    tensor instead of a Min; the row core avoids it for the same reason), and adding
    ``(valid - 1) 1e30`` made OpenVINO (2026.4) fuse the input stage into different codes on most causal
    rows (tests/test_export_runtimes.py checks all three runtimes)."""
    return b.op("QuantizeLinear", [build_relative_scores(b, s, valid, valid_float),
                                   b.const("r_scale", q.scale32, np.float32), b.const("r_zp", q.qmax, q.in_dtype)],
                out=out)


# ---------------------------------------------------------------------------
# numpy references
# ---------------------------------------------------------------------------


def reference_int(
    x: np.ndarray, q: SoftmaxQuant, axis: int = -1, valid: np.ndarray | None = None, beta: np.ndarray | None = None
) -> np.ndarray:
    """Integer-only softmax; exactly what the ``int`` ONNX subgraph computes."""
    xi = _check_input(x, q)
    v = _check_valid(xi, valid)
    xm = xi if v is None else np.where(v, xi, q.qmin)
    d = xm.max(axis=axis, keepdims=True) - xm
    narrow = uses_int32(q, beta)
    if narrow and xi.shape[axis] > MAX_ROW_INT32:
        raise ValueError(f"the int32 integer softmax takes rows of at most {MAX_ROW_INT32} keys, got {xi.shape[axis]}")
    if q.bits <= 8:
        e = exp_table(q.scale, q.bits, TABLE_BITS_INT32 if narrow else TABLE_BITS)[d]
    else:
        e = _ibert_exp(d, check_ibert_range(q))
    if v is not None:
        e = np.where(v, e, 0)
    s = np.maximum(e.sum(axis=axis, keepdims=True), 1)
    c = rounding_constants(beta)
    if c is None:
        out = (e * 256 + s // 2) // s
    else:
        k = 2**ROUND_BITS
        out = (e * (256 * k) + s * c) // (s * k)
    return _finish(out, q)


def check_ibert_range(q: SoftmaxQuant) -> IbertConsts:
    """The I-BERT constants of ``q``, refusing grids whose rescaled ``d`` could overflow int64."""
    c = ibert_consts(q.scale)
    if (q.qmax - q.qmin) * c.up >= 2**62:
        raise ValueError(f"softmax input scale {q.scale} at {q.bits} bits is too coarse for the integer exp; "
                         "use fewer bits or a finer scale")
    return c


def _ibert_exp(d: np.ndarray, c: IbertConsts) -> np.ndarray:
    """I-BERT exp of ``-d S`` on integers: ``((q_b - (d mod q_ln2))^2 + q_c) >> z``."""
    d = d * c.up // c.down
    z = d // c.q_ln2
    t = c.q_b - (d - z * c.q_ln2)
    poly = t * t + c.q_c
    return poly // (np.int64(1) << np.minimum(z, MAX_SHIFT))


def _exact_probs(xi: np.ndarray, q: SoftmaxQuant, axis: int, v: np.ndarray | None) -> np.ndarray:
    """Exact float64 softmax of the dequantized codes ``xi`` over valid keys (fully masked rows: 0)."""
    xf = (xi - q.zero_point).astype(np.float64) * float(q.scale32)
    if v is not None:
        xf = np.where(v, xf, -np.inf)
    m = xf.max(axis=axis, keepdims=True)
    e = np.exp(xf - np.where(np.isfinite(m), m, 0.0))
    return e / np.maximum(e.sum(axis=axis, keepdims=True), np.finfo(np.float64).tiny)


def reference_qdq(x: np.ndarray, q: SoftmaxQuant, axis: int = -1, valid: np.ndarray | None = None) -> np.ndarray:
    """Exact softmax (float64) of the dequantized input, quantized half-to-even to ``2**-8``."""
    xi = _check_input(x, q)
    v = _check_valid(xi, valid)
    p = _exact_probs(xi, q, axis, v)
    if v is not None:
        p = np.where(v, p, 0.0)
    return _finish(np.rint(p * 256.0).astype(np.int64), q)


def tie_distance(x: np.ndarray, q: SoftmaxQuant, axis: int = -1, valid: np.ndarray | None = None) -> np.ndarray:
    """``|256 p - (k + 1/2)|``: how close each exact output is to a rounding tie.

    Float runtimes may round the other way where this is within float32 noise.
    """
    xi = _check_input(x, q)
    y = 256.0 * _exact_probs(xi, q, axis, _check_valid(xi, valid))
    return np.abs(y - np.floor(y) - 0.5)


def ort_kernel_table(scale: float, reduce_len: int) -> np.ndarray:
    """onnxruntime's QLinearSoftmax exp table (float32, indexed by code + 255 - max)."""
    bit_shift = math.log(float(np.finfo(np.float32).max) / reduce_len)
    bit_shift = max(0.0, bit_shift - 5.0) / float(np.float32(scale))
    i = np.arange(256, dtype=np.float64)
    return np.exp((i - 255.0 + bit_shift) * float(np.float32(scale))).astype(np.float32)


def reference_ort(x: np.ndarray, q: SoftmaxQuant, axis: int = -1, valid: np.ndarray | None = None) -> np.ndarray:
    """Emulation of onnxruntime's ``com.microsoft.QLinearSoftmax`` (opset 13 semantics).

    Masked keys are fed to the kernel as the minimum code (see module docstring)
    and their outputs are then set to the output zero point.
    """
    if q.bits != 8:
        raise ValueError("the 'ort' softmax form (QLinearSoftmax) takes 8-bit inputs only")
    xi = _check_input(x, q)
    v = _check_valid(xi, valid)
    xm = xi if v is None else np.where(v, xi, q.qmin)
    xm = np.moveaxis(xm, axis, -1)
    n = xm.shape[-1]
    table = ort_kernel_table(q.scale, n)
    idx = xm - xm.max(axis=-1, keepdims=True) + 255
    vals = table[idx]
    # The kernel accumulates the row sum in float32 sequentially.
    vsum = np.cumsum(vals, axis=-1, dtype=np.float32)[..., -1:]
    y_scale = np.float32(math.floor(np.float32(1.0) / OUT_SCALE))
    with np.errstate(over="ignore"):
        # A row of length 1 overflows the kernel's float32 product to inf; it saturates.
        vq = np.minimum(np.rint((vals * y_scale) / vsum), 256.0).astype(np.int64)
    out = np.moveaxis(_finish(vq, q), -1, axis)
    if v is not None:
        out = np.where(v, out, q.out_zero_point).astype(q.out_dtype)
    return out


REFERENCES = {"qdq": reference_qdq, "ort": reference_ort, "int": reference_int}


def reference(
    form: str, x: np.ndarray, q: SoftmaxQuant, axis: int = -1, valid: np.ndarray | None = None,
    beta: np.ndarray | None = None,
) -> np.ndarray:
    """The numpy reference of ``form`` (``beta`` is supported by ``int`` only)."""
    check_form(form)
    if beta is not None and form != "int":
        raise ValueError(f"the '{form}' form carries bias correction outside the softmax; pass beta=None")
    if form == "int":
        return reference_int(x, q, axis, valid, beta)
    return REFERENCES[form](x, q, axis, valid)


def check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"unknown softmax form {form!r}; choose one of {', '.join(FORMS)}")


# ---------------------------------------------------------------------------
# ONNX subgraph builders
# ---------------------------------------------------------------------------


class _Builder:
    """Collects nodes and initializers under a unique name prefix."""

    def __init__(self, prefix: str, opset: int) -> None:
        self.prefix = prefix
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def name(self, base: str) -> str:
        self._n += 1
        return f"{self.prefix}{base}_{self._n}"

    def const(self, base: str, value: np.ndarray | int | float, dtype: np.dtype | type) -> str:
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], domain: str = "", out: str | None = None, **attrs: object) -> str:
        out = out or self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.name(op_type), domain=domain, **attrs))
        return out

    def at_least(self, x: str, base: str, value: int | float, dtype: type) -> str:
        """``max(x, value)`` for a scalar ``value``, as ``Clip(x, value)``: the same values as ``Max`` with a
        scalar constant, and a little faster in onnxruntime in side-by-side trials of the reference LM's file
        (no repo benchmark isolates it; the row floors of the attention core are where it runs)."""
        return self.op("Clip", [x, self.const(base, value, dtype)])

    def reduce(self, op_type: str, x: str, axis: int) -> str:
        """ReduceMax/ReduceSum with keepdims, axes as attribute or input depending on opset."""
        takes_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        if takes_input:
            return self.op(op_type, [x, self.const("axes", [axis], np.int64)], keepdims=1)
        return self.op(op_type, [x], axes=[axis], keepdims=1)


@dataclass
class SoftmaxGraph:
    """Nodes and initializers of one softmax, to splice into a graph."""

    nodes: list[onnx.NodeProto]
    initializers: list[onnx.TensorProto]
    opset_imports: dict[str, int]


def build_softmax(
    form: str,
    x: str,
    y: str,
    q: SoftmaxQuant,
    axis: int = -1,
    valid: str | None = None,
    beta: np.ndarray | None = None,
    prefix: str = "softq_softmax/",
    opset: int = 21,
) -> SoftmaxGraph:
    """Nodes computing ``y`` (quantized probabilities) from ``x`` (quantized scores).

    ``valid`` names a bool tensor broadcastable to ``x`` (True = attend).  ``beta``
    (``int`` form only) is the bias correction folded into the rounding point.
    """
    check_form(form)
    if opset < 13:
        raise ValueError(f"softq's softmax forms need ONNX opset >= 13, got {opset}")
    if q.in_dtype.itemsize == 2 and opset < 21:
        raise ValueError(f"{q.bits}-bit softmax inputs are int16/uint16 tensors, which need opset >= 21 (got {opset})")
    if beta is not None and form != "int":
        raise ValueError(f"the '{form}' form carries bias correction after DequantizeLinear, not in the softmax")
    b = _Builder(prefix, opset)
    domains = {"": opset}
    if form == "qdq":
        _qdq(b, x, y, q, axis, valid)
    elif form == "ort":
        _ort(b, x, y, q, axis, valid)
        domains["com.microsoft"] = 1
    else:
        _int(b, x, y, q, axis, valid, beta)
    return SoftmaxGraph(b.nodes, b.inits, domains)


def _qdq(b: _Builder, x: str, y: str, q: SoftmaxQuant, axis: int, valid: str | None) -> None:
    if q.in_dtype == np.int32 and q.zero_point != 0:
        raise ValueError("DequantizeLinear of int32 codes has no zero point; a >16-bit softmax input needs zero point 0")
    xf = b.op("DequantizeLinear", [x, b.const("x_scale", q.scale32, np.float32), b.const("x_zp", q.zero_point, q.in_dtype)])
    if valid is not None:
        xf = b.op("Where", [valid, xf, b.const("lowest", LOWEST, np.float32)])
    p = b.op("Softmax", [xf], axis=axis)
    if valid is not None:
        p = b.op("Where", [valid, p, b.const("zero", 0.0, np.float32)])
    b.op("QuantizeLinear", [p, b.const("y_scale", OUT_SCALE, np.float32), b.const("y_zp", q.out_zero_point, q.out_dtype)],
         out=y)


def _ort(b: _Builder, x: str, y: str, q: SoftmaxQuant, axis: int, valid: str | None) -> None:
    if q.bits != 8:
        raise ValueError(f"the 'ort' softmax form (QLinearSoftmax) takes 8-bit inputs only, got {q.bits} bits")
    if q.signed != q.out_signed:
        raise ValueError("QLinearSoftmax gives the output its input's type: use out_signed == signed for the 'ort' form")
    if q.signed:
        require_fixed_int8_qlinear_softmax()
    xin = x
    if valid is not None:
        xin = b.op("Where", [valid, x, b.const("qmin", q.qmin, q.in_dtype)])
    out = b.name("qsm") if valid is not None else y
    b.op(
        "QLinearSoftmax",
        [xin, b.const("x_scale", q.scale32, np.float32), b.const("x_zp", q.zero_point, q.in_dtype),
         b.const("y_scale", OUT_SCALE, np.float32), b.const("y_zp", q.out_zero_point, q.out_dtype)],
        domain="com.microsoft", out=out, opset=13, axis=axis,
    )
    if valid is not None:
        b.op("Where", [valid, out, b.const("y_zp", q.out_zero_point, q.out_dtype)], out=y)


def _int(b: _Builder, x: str, y: str, q: SoftmaxQuant, axis: int, valid: str | None, beta: np.ndarray | None) -> None:
    narrow = uses_int32(q, beta)
    it = np.int32 if narrow else np.int64
    xi = b.op("Cast", [x], to=TensorProto.INT32 if narrow else TensorProto.INT64)
    if valid is not None:
        xi = b.op("Where", [valid, xi, b.const("qmin", q.qmin, it)])
    d = b.op("Sub", [b.reduce("ReduceMax", xi, axis), xi])
    if q.bits <= 8:
        table = exp_table(q.scale, q.bits, TABLE_BITS_INT32 if narrow else TABLE_BITS)
        e = b.op("Gather", [b.const("exp_table", table, it), d], axis=0)
    else:
        c = check_ibert_range(q)
        if c.up > 1:
            d = b.op("Mul", [d, b.const("up", c.up, np.int64)])
        if c.down > 1:
            d = b.op("Div", [d, b.const("down", c.down, np.int64)])
        z = b.op("Div", [d, b.const("q_ln2", c.q_ln2, np.int64)])
        rem = b.op("Sub", [d, b.op("Mul", [z, b.const("q_ln2", c.q_ln2, np.int64)])])
        t = b.op("Sub", [b.const("q_b", c.q_b, np.int64), rem])
        poly = b.op("Add", [b.op("Mul", [t, t]), b.const("q_c", c.q_c, np.int64)])
        pow2 = np.left_shift(np.int64(1), np.arange(MAX_SHIFT + 1, dtype=np.int64))
        shift = b.op("Gather", [b.const("pow2", pow2, np.int64),
                                b.op("Min", [z, b.const("max_shift", MAX_SHIFT, np.int64)])], axis=0)
        e = b.op("Div", [poly, shift])
    if valid is not None:
        e = b.op("Where", [valid, e, b.const("zero", 0, it)])
    s = b.reduce("ReduceSum", e, axis)
    if valid is not None:
        s = b.at_least(s, "one", 1, it)  # fully masked row: 0 / 1
    consts = rounding_constants(beta)
    if consts is None:
        num = b.op("Add", [b.op("Mul", [e, b.const("c256", 256, it)]), b.op("Div", [s, b.const("two", 2, it)])])
        out = b.op("Div", [num, s])
    else:
        k = 2**ROUND_BITS
        num = b.op("Add", [b.op("Mul", [e, b.const("c256k", 256 * k, np.int64)]),
                           b.op("Mul", [s, b.const("round_point", consts, np.int64)])])
        out = b.op("Div", [num, b.op("Mul", [s, b.const("k", k, np.int64)])])
    out = b.op("Min", [out, b.const("c255", 255, it)])
    if q.out_zero_point:
        out = b.op("Add", [out, b.const("out_zp", q.out_zero_point, it)])
    b.op("Cast", [out], out=y, to=q.out_onnx_type)


def softmax_model(
    form: str,
    q: SoftmaxQuant,
    axis: int = -1,
    rank: int = 4,
    with_valid: bool = False,
    beta: np.ndarray | None = None,
    opset: int = 21,
) -> onnx.ModelProto:
    """A standalone model ``x[, valid] -> y`` with all dimensions dynamic (tests and benchmarks)."""
    dims = [f"d{i}" for i in range(rank)]
    g = build_softmax(form, "x", "y", q, axis=axis, valid="valid" if with_valid else None, beta=beta, opset=opset)
    inputs = [helper.make_tensor_value_info("x", q.in_onnx_type, dims)]
    if with_valid:
        # symbols of its own: a mask broadcast along any axis ([1, 1, q, k]) is a valid feed
        inputs.append(helper.make_tensor_value_info("valid", TensorProto.BOOL, [f"v{i}" for i in range(rank)]))
    graph = helper.make_graph(g.nodes, f"softq_softmax_{form}", inputs,
                              [helper.make_tensor_value_info("y", q.out_onnx_type, dims)], g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in g.opset_imports.items()],
                              producer_name="softq")
    model.ir_version = min(model.ir_version, 10)  # onnxruntime 1.2x reads IR <= 10
    return model


def relative_codes_model(q: SoftmaxQuant | None, with_valid: bool = False, opset: int = 21) -> onnx.ModelProto:
    """A standalone model ``s [b,h,q,k] float32[, valid bool] -> x``: uint8 row-relative codes, or with ``q``
    None the float ``s - rowmax`` of :func:`relative_scores` (tests, benchmarks)."""
    b = _Builder("softq_input/", opset)
    valid = "valid" if with_valid else None
    if q is None:
        b.op("Identity", [build_relative_scores(b, "s", valid)], out="x")
    else:
        build_relative_codes(b, "s", q, valid, out="x")
    inputs = [helper.make_tensor_value_info("s", TensorProto.FLOAT, ["b", "h", "q", "k"])]
    if with_valid:
        inputs.append(helper.make_tensor_value_info("valid", TensorProto.BOOL, ["vb", "vh", "vq", "k"]))
    x_type = TensorProto.FLOAT if q is None else q.in_onnx_type
    graph = helper.make_graph(b.nodes, "softq_relative_codes", inputs,
                              [helper.make_tensor_value_info("x", x_type, ["b", "h", "q", "k"])], b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="softq")
    model.ir_version = min(model.ir_version, 10)
    return model


def require_fixed_int8_qlinear_softmax() -> None:
    """Refuse int8 QLinearSoftmax on onnxruntime <= 1.28, whose int8 kernel saturates at 255 (ORT #29727)."""
    try:
        import onnxruntime as ort
    except ImportError:  # exporting without a runtime: nothing to guard
        return
    major, minor = (int(p) for p in ort.__version__.split(".")[:2])
    if (major, minor) < (1, 29):
        raise RuntimeError(
            f"onnxruntime {ort.__version__} has the int8 QLinearSoftmax saturation bug (fixed in 1.29); "
            "use softmax='int' or 'qdq', or an unsigned (uint8) softmax input"
        )
