"""Softmax codes relative to the row max: the attention core P.V, its numpy reference and ONNX forms.

Representation (``QuantConfig.softmax_output``, ``b`` = softmax output bits, ``L = 2**b - 1``):

* codes ``E = round(L exp(s - rowmax))`` over valid keys (masked keys: 0), so
  the row max is always the top code and a diffuse row keeps its resolution;
* ``"row"``: ``P.V = (E.V) / sum(E)``;
* ``"row_exact"``: ``P.V = (E.V) / (L sum exp(s - rowmax))``;
* ``"row_log"`` (4 bits): the scores on the row-relative grid of step ln(2)/2 and
  ``E = round(G exp(s - rowmax))`` with ``G = LOG_GAIN`` (86.875): a key k steps below
  the max gets ``round(G 2**(-k/2))``, 0 from k = 15; ``P.V = (E.V) / sum(E)`` as ``row``.
  (``row`` and ``row_exact`` are the same formula with ``G = L``.)

The core maps integer score codes ``x`` (grid of :class:`SoftmaxQuant`) and
uint8 V codes ``v`` (scale ``S_v``, zero point ``z``) to the float output
``y = P.V``.  ``E.(v - z)`` is one integer GEMM into int32 (``int`` form: ``MatMulInteger``; ``fast``:
``MatMul`` of two ``DequantizeLinear`` with scale 1, which onnxruntime runs as one ``MatMulIntegerToFloat``,
its integer GEMM writing float32 accumulators, a Cast pass fewer); the division
comes *after* the GEMM, once per output element (``L_q * d`` divisions, not
``L_q * L_k``).  For ``"row"`` the row sum comes from the same GEMM: V gets a
constant column ``z + 1`` (or ``z - 1`` when ``z = 255``), whose
``(v - z)`` is 1.  Then, in float32::

    y = Cast(num) / (Cast(max(den, 1)) * c)

with ``c = 1 / S_v`` (``row``; ``den = sum E``) or ``c = L / (2**16 S_v)``
(``row_exact``, ``int`` form; ``den = sum round(2**16 exp(-d S))``) or
``c = L / S_v`` (``row_exact``, ``fast`` form; ``den`` = float sum of exp).
``max(den, 1)`` only acts on fully masked rows (``num = 0``): they give zeros.

Forms:

``fast``
    ``E = QuantizeLinear(Exp(DQ(x) - DQ(rowmax)), 1/L)``: one float Exp per
    score, then integer GEMM.  The reference's ``E`` is the exactly rounded
    ``round(L exp(-d S))``; onnxruntime's float32 Exp can put a code on the
    other side of a rounding tie, only where ``L exp(-d S)`` lies within
    float32 noise of ``k + 1/2`` (see :func:`tie_distance`): those codes differ
    by one, all others are equal.
``int``
    Integer only from the score codes to the int32 accumulators: ``d = max - x``
    indexes a table ``round(L exp(-d S))`` (Gather, uint8 out), masked keys
    index an extra 0 entry.  ``row_exact`` gathers ``round(2**16 exp(-d S))`` too.
    Bit exact against :func:`reference` (the final float32 Cast/Mul/Div are
    correctly rounded IEEE operations in numpy and onnxruntime alike).

Float scores (``QuantConfig.softmax_input="float"``; ``RowQuant.scores`` is ``None``): the core's input is
the float ``r = s - rowmax`` (:func:`softq.export.int_softmax.relative_scores`: masked keys at -5e29 or
below) and ``E = QuantizeLinear(Exp(r), 1/G)``, rounded once from the float exp; ``fast`` form only.
The reference is the exactly rounded ``round(G exp(r))`` (float64 exp of the float32 ``r``); codes can differ
by one at rounding ties as in the ``fast`` form above.  Masked keys give ``exp = 0`` exactly, so neither the
codes nor ``row_exact``'s float sum need a mask in the core.

Row-relative score codes (``QuantConfig.softmax_input="row"``; ``SoftmaxQuant.relative``):
the codes already are ``qmax - d`` (:func:`softq.export.int_softmax.relative_codes`), so neither form
takes a row max: ``fast`` dequantizes them straight into the Exp, ``int`` indexes the tables by the
code.  Code 0 (masked keys, scores ``T`` or more below the max) gives ``E = 0`` and a 0 exact-sum
entry (checked by :class:`RowQuant`), so the export feeds the core no mask except for
``row_exact``'s float sum (``fast``).

int32 safety: ``|E.(v - z)| <= L * max|v - z| * L_k``; rows longer than
:meth:`RowQuant.max_keys` are refused (about 33k keys with asymmetric uint8 V and
8-bit codes, 66k with symmetric V stored as uint8 around 128).  A runtime that computes the ``fast``
form's ``DequantizeLinear -> MatMul`` in float32 instead of an integer GEMM gets the accumulators exactly
while they stay below 2**24 (always for rows of up to 258 keys with 8-bit codes: 255 * 255 * 258), and
within float32 rounding (relative 6e-8) beyond.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from softq.export.int_softmax import SoftmaxQuant, _Builder, _check_input, _check_valid
from softq.quant.config import LOG_BITS, LOG_STEP, SUM_OF_CODES, row_code_gain

REPRESENTATIONS = ("row", "row_exact", "row_log")
ROW_FORMS = ("fast", "int")
INT32_MAX = 2**31 - 1
SUM_TABLE_BITS = 16  # row_exact, int form: the exact sum of exp on a 2**-16 grid (int32 up to 32767 keys)
MAX_KEYS_SUM_TABLE = 2**15 - 1


@dataclass(frozen=True)
class RowQuant:
    """Grids of one attention core: score codes (``None``: float scores), softmax output bits, V codes (uint8
    storage)."""

    scores: SoftmaxQuant | None
    v_scale: float
    v_zero_point: int
    bits: int = 8
    representation: str = "row"
    v_qmin: int = 0  # the range the V codes can take (e.g. 1..255 for symmetric int8 stored around 128)
    v_qmax: int = 255

    def __post_init__(self) -> None:
        if self.representation not in REPRESENTATIONS:
            raise ValueError(f"row-code representation must be one of {REPRESENTATIONS}, got {self.representation!r}")
        if not isinstance(self.bits, (int, np.integer)) or not 2 <= int(self.bits) <= 8:
            raise ValueError(f"row softmax codes are exported with 2 to 8 bits (uint8), got {self.bits!r}")
        if self.scores is None and self.representation not in ("row", "row_exact"):
            raise ValueError(f"float softmax scores take the row or row_exact codes, got {self.representation!r}")
        if self.scores is not None and self.scores.bits > 8:
            raise ValueError(f"row softmax codes take 8-bit score codes at most, got {self.scores.bits} bits")
        if not (math.isfinite(self.v_scale) and self.v_scale > 0):
            raise ValueError(f"V scale must be a positive finite number, got {self.v_scale!r}")
        if not 0 <= self.v_qmin <= int(self.v_zero_point) <= self.v_qmax <= 255:
            raise ValueError(f"V zero point {self.v_zero_point} and code range [{self.v_qmin}, {self.v_qmax}] "
                             "must lie in the uint8 range with qmin <= zero point <= qmax")
        if self.representation == "row_log" and (int(self.bits) != LOG_BITS
                                                 or self.scores is None or self.scores.scale32 != np.float32(LOG_STEP)):
            raise ValueError(f"row_log codes are {LOG_BITS}-bit with score codes on steps of ln(2)/2 = {LOG_STEP!r}, "
                             f"got {self.bits} bits and step {float(self.scores.scale32)!r}")
        if self.scores is not None and self.scores.relative:  # code 0 (masked keys, scores T or more below the max) must give E = 0
            tables = [code_table(self.scores.scale, self.gain, self.scores.bits)]
            if self.representation == "row_exact":
                tables.append(sum_table(self.scores.scale, self.scores.bits))
            if any(t[self.scores.qmax] != 0 for t in tables):
                raise ValueError(f"row-relative score codes span {self.scores.qmax * float(self.scores.scale32):.3g} "
                                 f"below the row max, too little for the {self.bits}-bit {self.representation} "
                                 "codes: their lowest code must give exp code 0")

    @property
    def levels(self) -> int:
        return 2**self.bits - 1

    @property
    def gain(self) -> float:
        """G in ``E = round(G exp(s - rowmax))`` (``softq.quant.config.row_code_gain``: L, or LOG_GAIN)."""
        return row_code_gain(self.representation, int(self.bits))

    @property
    def top(self) -> int:
        """The largest code, the row max's: ``round(G)``."""
        return int(round(self.gain))

    @property
    def sums_codes(self) -> bool:
        """Whether P.V is divided by the sum of the codes (``row``, ``row_log``; else the exact sum of exp)."""
        return self.representation in SUM_OF_CODES

    @property
    def v_span(self) -> int:
        """The largest ``|v - z|`` a V code can have."""
        return max(int(self.v_zero_point) - self.v_qmin, self.v_qmax - int(self.v_zero_point), 1)

    @property
    def float_scores(self) -> bool:
        """Whether the core takes float scores relative to the row max (``QuantConfig.softmax_input="float"``)."""
        return self.scores is None

    def check_form(self, form: str) -> None:
        check_row_form(form)
        if self.float_scores and form != "fast":
            raise ValueError(f"the {form!r} row core takes integer score codes; float scores (softmax_input='float') "
                             "export with the 'fast' form")

    def max_keys(self, form: str = "int") -> int:
        """Longest row whose int32 accumulators cannot overflow: ``round(G) * max|v - z| * keys <= 2**31 - 1``."""
        keys = INT32_MAX // (self.top * self.v_span)
        if self.representation == "row_exact" and form == "int":
            keys = min(keys, MAX_KEYS_SUM_TABLE)
        return keys

    def check_keys(self, keys: int, form: str = "int") -> None:
        limit = self.max_keys(form)
        if keys > limit:
            raise ValueError(
                f"rows of {keys} keys can overflow the int32 accumulators of the {self.bits}-bit row-code "
                f"attention (|E.(V - zp)| <= {self.top} * {self.v_span} * keys); the longest safe row "
                f"here is {limit} keys")

    @property
    def sum_column(self) -> tuple[int, int]:
        """(code of the appended V column, its sign ``code - z``): ``z + 1``, or ``z - 1`` when ``z = 255``."""
        z = int(self.v_zero_point)
        return (z + 1, 1) if z < 255 else (z - 1, -1)

    def den_factor(self, form: str) -> np.float32:
        """``c`` in ``y = num / (max(den, 1) * c)``."""
        s = float(np.float32(self.v_scale))
        if self.sums_codes:
            return np.float32(1.0 / s)
        if form == "int":
            return np.float32(self.levels / (2.0**SUM_TABLE_BITS * s))
        return np.float32(self.levels / s)


def check_row_form(form: str) -> None:
    if form not in ROW_FORMS:
        raise ValueError(f"unknown row-code attention form {form!r}; choose one of {', '.join(ROW_FORMS)}")


def code_table(scale: float, gain: float, in_bits: int = 8) -> np.ndarray:
    """``round(G exp(-d S))`` for ``d = 0 .. 2**in_bits - 1``, plus a final 0 entry for masked keys."""
    d = np.arange(2**in_bits, dtype=np.float64)
    e = np.round(gain * np.exp(-d * float(np.float32(scale))))
    return np.append(e, 0).astype(np.uint8 if gain < 255.5 else np.int64)


def sum_table(scale: float, in_bits: int = 8) -> np.ndarray:
    """``round(2**16 exp(-d S))`` for ``d = 0 .. 2**in_bits - 1`` plus a final 0 (row_exact's int-form sum)."""
    t16 = np.round(2.0**SUM_TABLE_BITS * np.exp(-np.arange(2**in_bits) * float(np.float32(scale))))
    return np.append(t16, 0).astype(np.int32)


def _row_distance(x: np.ndarray, q: SoftmaxQuant, valid: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """``d = rowmax - x`` over valid keys (int64; ``qmax - x`` for row-relative codes), and the broadcast mask."""
    xi = _check_input(x, q)
    v = _check_valid(xi, valid)
    if q.relative:
        return q.qmax - (xi if v is None else np.where(v, xi, q.qmin)), v
    xm = xi if v is None else np.where(v, xi, q.qmin)
    return xm.max(axis=-1, keepdims=True) - xm, v


def _float_exp(x: np.ndarray, rq: RowQuant, valid: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """``exp(s - rowmax)`` (float64, 0 at masked keys) and the broadcast mask: of the float32 relative scores
    ``x`` (float scores, :func:`softq.export.int_softmax.relative_scores`) or of the score codes' grid."""
    if rq.float_scores:
        x = np.asarray(x)
        if x.dtype != np.float32:
            raise ValueError(f"float scores relative to the row max must be float32, got {x.dtype}")
        v = _check_valid(x, valid)
        ex = np.exp(x.astype(np.float64))
    else:
        d, v = _row_distance(x, rq.scores, valid)
        ex = np.exp(-d * float(rq.scores.scale32))
    return (ex if v is None else np.where(v, ex, 0.0)), v


def row_codes(x: np.ndarray, rq: RowQuant, valid: np.ndarray | None = None) -> np.ndarray:
    """The codes ``E = round(G exp(s - rowmax))`` (uint8), 0 at masked keys."""
    if rq.float_scores:
        ex, _ = _float_exp(x, rq, valid)
        return np.round(rq.gain * ex).astype(np.uint8)
    d, v = _row_distance(x, rq.scores, valid)
    e = code_table(rq.scores.scale, rq.gain, rq.scores.bits)[d]
    return e if v is None else np.where(v, e, 0).astype(e.dtype)


def tie_distance(x: np.ndarray, rq: RowQuant, valid: np.ndarray | None = None) -> np.ndarray:
    """``|G exp(-d S) - (k + 1/2)|``: how close each code is to a rounding tie (float Exp may flip it)."""
    ex, _ = _float_exp(x, rq, valid)
    y = rq.gain * ex
    return np.abs(y - np.floor(y) - 0.5)


def _check_v(v: np.ndarray, rq: RowQuant, keys: int) -> np.ndarray:
    v = np.asarray(v)
    if v.dtype != np.uint8:
        raise ValueError(f"V codes must be uint8 (stored around zero point {rq.v_zero_point}), got {v.dtype}")
    if v.shape[-2] != keys:
        raise ValueError(f"V has {v.shape[-2]} keys, the scores {keys}")
    return v.astype(np.int64) - int(rq.v_zero_point)


def finish(num: np.ndarray, den: np.ndarray, rq: RowQuant, form: str) -> np.ndarray:
    """``num / (max(den, 1) * c)`` in float32, exactly as the graph computes it."""
    den = np.maximum(den, 1)
    return (num.astype(np.float32) / (den.astype(np.float32) * rq.den_factor(form))).astype(np.float32)


def accumulators(
    x: np.ndarray, v: np.ndarray, rq: RowQuant, valid: np.ndarray | None = None, codes: np.ndarray | None = None,
    form: str = "int",
) -> tuple[np.ndarray, np.ndarray]:
    """(num = E.(v - z), den) as the integer graph computes them (``den`` of the ``int`` form).

    ``codes`` overrides ``E`` (to replay a runtime's codes, e.g. the ``fast`` form's).
    """
    rq.check_form(form)
    keys = np.shape(x)[-1]
    rq.check_keys(keys, form)
    vz = _check_v(v, rq, keys)
    e = row_codes(x, rq, valid) if codes is None else np.asarray(codes)
    num = np.matmul(e.astype(np.int64), vz)
    if rq.sums_codes:
        den = e.astype(np.int64).sum(axis=-1, keepdims=True)
    elif rq.float_scores:  # row_exact, fast form: the float sum of exp (see reference)
        den = np.zeros(num.shape[:-1] + (1,), np.int64)
    else:
        d, m = _row_distance(x, rq.scores, valid)
        e16 = sum_table(rq.scores.scale, rq.scores.bits).astype(np.int64)[d]
        den = (e16 if m is None else np.where(m, e16, 0)).sum(axis=-1, keepdims=True)
    assert np.abs(num).max(initial=0) <= INT32_MAX and den.max(initial=0) <= INT32_MAX  # guaranteed by check_keys
    return num, den


def reference(form: str, x: np.ndarray, v: np.ndarray, rq: RowQuant, valid: np.ndarray | None = None) -> np.ndarray:
    """``P.V`` (float32, ``[..., q, d]``) of the ``form`` graph, from score codes ``x`` and V codes ``v``.

    Bit exact for ``int``; for ``fast`` this is the exactly rounded function the
    graph approximates (codes can differ by one at rounding ties, and
    ``row_exact``'s float sum of exp by float32 rounding).
    """
    num, den = accumulators(x, v, rq, valid, form=form)
    if form == "fast" and rq.representation == "row_exact":
        e, _ = _float_exp(x, rq, valid)
        den = e.sum(axis=-1, keepdims=True)
        return (num / (np.maximum(den, 1.0) * float(rq.den_factor(form)))).astype(np.float32)
    return finish(num, den, rq, form)


def probabilities(x: np.ndarray, rq: RowQuant, valid: np.ndarray | None = None) -> np.ndarray:
    """The effective probabilities ``E / sum(E)`` or ``E / (L sum exp)`` (float64), for comparisons."""
    e = row_codes(x, rq, valid).astype(np.float64)
    if rq.sums_codes:
        return e / np.maximum(e.sum(axis=-1, keepdims=True), 1.0)
    ex, _ = _float_exp(x, rq, valid)
    s = ex.sum(axis=-1, keepdims=True)
    return e / (rq.levels * np.maximum(s, 1.0))


# ---------------------------------------------------------------------------
# ONNX
# ---------------------------------------------------------------------------


def _cap(b: _Builder, valid: str, dtype: type, masked: int, base: str, low: bool = False) -> str:
    """Per-key bound that masks by Min (or by Max with ``low``): the type's extreme at valid keys, ``masked`` elsewhere.

    ``Min(x, cap)`` equals ``Where(valid, x, masked)`` whenever every code is >= ``masked``
    (``Max(x, cap)``: <= ``masked``), which holds for the score codes (``masked`` = qmin), the
    exp codes (0) and the table distances (the table's final index).
    """
    info = np.iinfo(dtype)
    open_, shut = (info.min, masked) if low else (info.max, masked)
    return b.op("Where", [valid, b.const(f"{base}_open", open_, dtype), b.const(f"{base}_shut", shut, dtype)])


def build_row_attention(
    form: str, x: str, v: str, y: str, rq: RowQuant, valid: str | None = None, probs: str | None = None,
    prefix: str = "softq_attn/", opset: int = 21, empty_rows: bool = True,
    v_affine: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Nodes computing ``y = P.V`` (float) from score codes ``x`` and uint8 V codes ``v``.

    ``valid`` names a bool tensor broadcastable to ``x``; ``probs`` (optional)
    names an extra float output with the effective probabilities (parity checks).
    ``empty_rows=False`` promises that every row has a key of code E > 0 (a model without
    masks: each row's max gets the top code), so the row sum needs no guard against 0.
    ``v_affine``: ``(z, s)``, V's zero points and scales per head (``[1, h, 1, 1]``) or per head and channel
    (``[1, h, 1, d]``) on the codes ``v - rq.v_zero_point`` (``rq.v_scale`` 1): the zero points' term outside the
    integer GEMM, ``E.(v - z) = E.v - z sum(E)`` (``sum(E)`` from the GEMM's appended column, as ``row``'s), and
    ``s`` in the final division's factor, ``y = num / (den * c / s)``.
    """
    rq.check_form(form)
    if v_affine is not None and rq.v_scale != 1.0:
        raise ValueError("per-head V scales take V codes of scale 1")
    if opset < 13:
        raise ValueError(f"softq's row-code attention needs ONNX opset >= 13, got {opset}")
    q = rq.scores
    b = _Builder(prefix, opset)
    den_f = None
    if form == "fast":
        if rq.float_scores:  # x = s - rowmax (float32, masked keys <= -5e29: exp gives 0)
            if valid is not None:
                raise ValueError("the float-score core takes s - rowmax with the mask already applied "
                                 "(softq.export.int_softmax.build_relative_scores); give it no valid mask")
            f = x
        else:
            # masks as Min/Max with per-key caps (4x faster than a broadcast Where in onnxruntime)
            xm = x if valid is None else b.op("Min", [x, _cap(b, valid, q.in_dtype, q.qmin, "x")])
            s_scale, s_zp = b.const("s_scale", q.scale32, np.float32), b.const("s_zp", q.zero_point, q.in_dtype)
            if q.relative:  # DQ(x) = (x - qmax) S is already s - rowmax; code 0 (masked) gives E = 0
                f = b.op("DequantizeLinear", [xm, s_scale, s_zp])
            else:
                mx = b.reduce("ReduceMax", xm, -1)
                f = b.op("Sub", [b.op("DequantizeLinear", [xm, s_scale, s_zp]),
                                 b.op("DequantizeLinear", [mx, s_scale, s_zp])])
        ex = b.op("Exp", [f])
        e = b.op("QuantizeLinear", [ex, b.const("e_scale", np.float32(1.0 / rq.gain), np.float32),
                                    b.const("e_zp", 0, np.uint8)])
        if valid is not None and not q.relative:
            e = b.op("Min", [e, _cap(b, valid, np.uint8, 0, "e")])
        if rq.representation == "row_exact":
            exm = ex if valid is None else b.op("Mul", [ex, b.op("Cast", [valid], to=TensorProto.FLOAT)])
            den_f = b.at_least(b.reduce("ReduceSum", exm, -1), "one_f", 1.0, np.float32)
    else:
        xi = b.op("Cast", [x], to=TensorProto.INT32)
        if valid is not None:
            xi = b.op("Min", [xi, _cap(b, valid, np.int32, q.qmin, "x")])
        codes, sums = code_table(q.scale, rq.gain, q.bits), sum_table(q.scale, q.bits)
        if q.relative:  # tables indexed by the code itself (d = qmax - x); code 0 gives 0 in both
            d = xi
            codes, sums = codes[q.qmax::-1], sums[q.qmax::-1]
        else:
            d = b.op("Sub", [b.reduce("ReduceMax", xi, -1), xi])
            if valid is not None:  # masked keys index the table's final 0 entry (d of a valid key is < 2**bits)
                d = b.op("Max", [d, _cap(b, valid, np.int32, 2**q.bits, "d", low=True)])
        e = b.op("Gather", [b.const("code_table", codes, np.uint8), d], axis=0)
        if rq.representation == "row_exact":
            e16 = b.op("Gather", [b.const("sum_table", sums, np.int32), d], axis=0)
            den_i = b.at_least(b.reduce("ReduceSum", e16, -1), "one", 1, np.int32)
            den_f = b.op("Cast", [den_i], to=TensorProto.FLOAT)
    v_zp = b.const("v_zp", rq.v_zero_point, np.uint8)

    def gemm(values: str) -> str:
        """``E.(v - z)`` as float32: ``fast``: ``MatMul(DQ(E, 1, 0), DQ(v, 1, z))``, which onnxruntime runs as one
        MatMulIntegerToFloat (its integer GEMM; the accumulators exactly, no Cast pass); ``int``: the integer
        ``MatMulInteger`` and a Cast (integer only up to the accumulators)."""
        e_zp = b.const("e_zp0", 0, np.uint8)
        if form == "fast":
            one = b.const("gemm_one", 1.0, np.float32)
            return b.op("MatMul", [b.op("DequantizeLinear", [e, one, e_zp]), b.op("DequantizeLinear", [values, one, v_zp])])
        return b.op("Cast", [b.op("MatMulInteger", [e, values, e_zp, v_zp])], to=TensorProto.FLOAT)

    if rq.sums_codes or v_affine is not None:
        code, sign = rq.sum_column
        # V [b, h, k, d] padded with one column of ``code`` at the end of d: one Pad instead of
        # Shape/Slice/Concat/Expand/Concat
        pads = b.const("pad_last", [0, 0, 0, 0, 0, 0, 0, 1], np.int64)
        v_col = b.op("Pad", [v, pads, b.const("sum_code", code, np.uint8)], mode="constant")
        acc_f = gemm(v_col)  # one GEMM of the [..., d + 1] accumulators, numerators and row sums
        axes = b.const("last", [-1], np.int64)
        num_f = b.op("Slice", [acc_f, b.const("zero64", [0], np.int64), b.const("m1", [-1], np.int64), axes])
        sum_e = b.op("Slice", [acc_f, b.const("m1b", [-1], np.int64), b.const("big", [INT32_MAX], np.int64), axes])
        if sign < 0:
            sum_e = b.op("Neg", [sum_e])
        if v_affine is not None and np.any(v_affine[0]):  # E.(v - z) = E.v - z sum(E): 0 in a fully masked row
            num_f = b.op("Sub", [num_f, b.op("Mul", [sum_e, b.const("v_offset", v_affine[0], np.float32)])])
        if rq.sums_codes:
            den_f = b.at_least(sum_e, "one_f", 1.0, np.float32) if empty_rows else sum_e  # masked row: 0 / 1 = 0
    else:
        num_f = gemm(v)
    c = rq.den_factor(form) if v_affine is None else (rq.den_factor(form) / v_affine[1]).astype(np.float32)
    scaled = b.op("Mul", [den_f, b.const("c", c, np.float32)])
    b.op("Div", [num_f, scaled], out=y)
    if probs is not None:  # effective probabilities E / den (the scale 1/S_v of c removed again)
        p_den = b.op("Mul", [scaled, b.const("v_scale", np.float32(rq.v_scale), np.float32)]) if v_affine is None \
            else b.op("Mul", [den_f, b.const("p_c", rq.den_factor(form), np.float32)])  # (v_scale 1)
        b.op("Div", [b.op("Cast", [e], to=TensorProto.FLOAT), p_den], out=probs)
    return b.nodes, b.inits


def row_attention_model(form: str, rq: RowQuant, with_valid: bool = False, probs: bool = False,
                        opset: int = 21, empty_rows: bool = True,
                        v_affine: tuple[np.ndarray, np.ndarray] | None = None) -> onnx.ModelProto:
    """A standalone core ``x [b,h,q,k], v [b,h,k,d][, valid] -> y [b,h,q,d]`` (dynamic dims; tests, benchmarks).
    With float scores ``x`` is ``s - rowmax`` (float32; the mask already in it, no ``valid``)."""
    nodes, inits = build_row_attention(form, "x", "v", "y", rq, "valid" if with_valid else None,
                                       "probs" if probs else None, opset=opset, empty_rows=empty_rows,
                                       v_affine=v_affine)
    x_type = TensorProto.FLOAT if rq.float_scores else rq.scores.in_onnx_type
    inputs = [helper.make_tensor_value_info("x", x_type, ["b", "h", "q", "k"]),
              helper.make_tensor_value_info("v", TensorProto.UINT8, ["b", "h", "k", "d"])]
    if with_valid:
        inputs.append(helper.make_tensor_value_info("valid", TensorProto.BOOL, ["vb", "vh", "vq", "k"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "h", "q", "d"])]
    if probs:
        outputs.append(helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["b", "h", "q", "k"]))
    graph = helper.make_graph(nodes, f"softq_row_attention_{form}", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="softq")
    model.ir_version = min(model.ir_version, 10)
    return model
