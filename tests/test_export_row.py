"""Row-code attention core (softmax codes relative to the row max): onnxruntime vs the numpy reference."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from softq.export import onnx_utils as U
from softq.export.int_softmax import SoftmaxQuant
from softq.export.row_attention import (
    REPRESENTATIONS,
    ROW_FORMS,
    RowQuant,
    accumulators,
    finish,
    probabilities,
    reference,
    row_attention_model,
    row_codes,
    tie_distance,
)

OPTS = ("disable", "all")
# A float32 Exp can round L*exp(-d S) to the other side of k + 1/2 only this close to the tie (in codes).
TIE_BAND = 1e-4


def _inputs(seed: str, q: SoftmaxQuant, shape=(2, 3, 7, 33), d=5, masked=True):
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    x = rng.integers(q.qmin, q.qmax + 1, shape).astype(q.in_dtype)
    v = rng.integers(0, 256, (*shape[:2], shape[3], d)).astype(np.uint8)
    valid = None
    if masked:
        valid = rng.random((shape[0], 1, shape[2], shape[3])) < 0.6
        valid[0, 0, 2] = False  # a fully masked row
    return x, v, valid


def _run(form, rq, x, v, valid, opt, probs=False):
    model = row_attention_model(form, rq, with_valid=valid is not None, probs=probs)
    feeds = {"x": x, "v": v}
    if valid is not None:
        feeds["valid"] = np.broadcast_to(valid, x.shape).copy()
    return U.run(model, feeds, opt)


def _rows_near_tie(x, rq, valid):
    near = tie_distance(x, rq, valid) < TIE_BAND
    if valid is not None:
        near &= np.broadcast_to(valid, near.shape)
    return near.any(-1)


LINEAR_REPRESENTATIONS = tuple(r for r in REPRESENTATIONS if r != "row_log")  # any score step and bits


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("representation", LINEAR_REPRESENTATIONS)
@pytest.mark.parametrize("signed,bits,v_zp", [(False, 8, 7), (True, 8, 128), (False, 4, 255), (False, 6, 0)])
def test_int_form_bit_exact(opt, representation, signed, bits, v_zp):
    q = SoftmaxQuant(scale=0.05, zero_point=-3 if signed else 9, signed=signed)
    rq = RowQuant(q, 0.02, v_zp, bits, representation)
    x, v, valid = _inputs(f"{representation}{signed}{bits}", q)
    y, p = _run("int", rq, x, v, valid, opt, probs=True)
    ref = reference("int", x, v, rq, valid)
    assert y.dtype == np.float32 and y.shape == ref.shape
    np.testing.assert_array_equal(y, ref)
    assert np.all(y[0, :, 2] == 0) and not np.isnan(y).any()  # fully masked row: zeros, not NaN
    # the effective probabilities: masked keys exactly 0, the top code is 2^b - 1
    e = row_codes(x, rq, valid)
    vb = np.broadcast_to(valid, x.shape)
    assert np.all(p[~vb] == 0) and np.all(e[vb.any(-1)].max(-1) == rq.levels)
    if representation == "row":
        np.testing.assert_allclose(p, probabilities(x, rq, valid), atol=1e-7)
    else:  # the int form's exact sum is on a 2^-16 grid
        np.testing.assert_allclose(p, probabilities(x, rq, valid), atol=x.shape[-1] * 2.0**-17)


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("representation", LINEAR_REPRESENTATIONS)
def test_fast_form_matches_reference_off_ties(opt, representation):
    """The fast form's float Exp may flip a code exactly at a rounding tie; elsewhere its codes are the
    reference's. 'row' then divides integers like the reference (bit exact); 'row_exact' divides by a
    float32 sum of exp (relative error of a float32 sum, <= 1e-5 here)."""
    for scale in (0.01, 0.05, 0.3):
        q = SoftmaxQuant(scale=scale, zero_point=100)
        rq = RowQuant(q, 0.03, 120, 8, representation)
        x, v, valid = _inputs(f"fast{scale}{representation}", q, shape=(2, 4, 16, 64), d=8)
        y = _run("fast", rq, x, v, valid, opt)[0]
        ref = reference("fast", x, v, rq, valid)
        off = ~_rows_near_tie(x, rq, valid)
        assert off.mean() > 0.5
        if representation == "row":
            np.testing.assert_array_equal(y[off], ref[off])
        else:
            np.testing.assert_allclose(y[off], ref[off], rtol=1e-5, atol=1e-6 * np.abs(ref).max())
        # near ties: within one code's worth, max|v - z| * S_v / sum(E) with sum(E) >= 2^b - 1
        np.testing.assert_allclose(y, ref, atol=135 * 0.03 / rq.levels)
        assert np.all(y[0, :, 2] == 0)


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("relative", [True, False])
def test_row_log_forms(opt, relative):
    """row_log: score codes on steps of ln(2)/2, 4-bit log codes round(G 2^(-d/2)) (0 from d = 15). Both
    forms equal the reference bit for bit (G keeps every code 0.02 from a tie, so the fast form's float Exp
    cannot flip one), masked keys and a fully masked row included."""
    from softq.quant.config import LOG_GAIN, LOG_STEP

    q = SoftmaxQuant(scale=LOG_STEP, zero_point=255 if relative else 40, relative=relative)
    rq = RowQuant(q, 0.02, 7, 4, "row_log")
    assert rq.top == 87 and rq.sums_codes
    assert tie_distance(np.arange(256, dtype=np.uint8)[None], rq).min() >= 0.02
    x, v, valid = _inputs(f"log{relative}", q, shape=(2, 3, 7, 40))
    if relative:  # codes near the top, where the log codes differ
        x = (255 - np.random.default_rng(3).integers(0, 20, x.shape)).astype(np.uint8)
    ref = reference("int", x, v, rq, valid)
    for form in ROW_FORMS:
        y, p = _run(form, rq, x, v, valid, opt, probs=True)
        np.testing.assert_array_equal(y, ref)
        np.testing.assert_array_equal(reference(form, x, v, rq, valid), ref)
        assert np.all(y[0, :, 2] == 0) and not np.isnan(y).any()
        np.testing.assert_allclose(p, probabilities(x, rq, valid), atol=1e-7)
    e = row_codes(x, rq, valid)
    table = [round(LOG_GAIN * 2 ** (-k / 2)) for k in range(15)]
    assert set(np.unique(e)) <= {0, *table} and len(np.unique(e)) >= 12
    d = 255 - x.astype(int) if relative else None
    if relative:
        vb = np.broadcast_to(valid, x.shape)
        assert np.all(e[vb & (d >= 15)] == 0) and np.all(e[vb & (d < 15)] == np.take(table, d[vb & (d < 15)]))


def test_fast_form_tie_flip_is_one_code():
    """Construct a row whose code sits on a float32 tie: the graph may differ by exactly one code there,
    which the reference's accumulators replayed with that code reproduce bit for bit."""
    q = SoftmaxQuant(scale=0.05, zero_point=0)
    rq = RowQuant(q, 0.02, 128, 8)
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (1, 1, 64, 256)).astype(np.uint8)
    v = rng.integers(0, 256, (1, 1, 256, 4)).astype(np.uint8)
    y, p = _run("fast", rq, x, v, None, "all", probs=True)
    num, den = accumulators(x, v, rq)
    codes = np.rint(p * den).astype(np.int64)  # the graph's own codes
    assert np.abs(codes - row_codes(x, rq)).max() <= 1
    num2, den2 = accumulators(x, v, rq, codes=codes)
    np.testing.assert_array_equal(y, finish(num2, den2, rq, "fast"))


@pytest.mark.parametrize("form", ROW_FORMS)
def test_worst_case_row_at_the_int32_bound(form):
    """All-equal scores (every code 255) and V at the far end of its range: the accumulators reach
    255 * 255 * keys; at the longest safe row that is just below 2^31 and the graph is still exact."""
    q = SoftmaxQuant(scale=0.1)
    rq = RowQuant(q, 0.01, 0, 8, "row")
    keys = rq.max_keys(form)
    assert keys == (2**31 - 1) // (255 * 255) == 33025
    x = np.full((1, 1, 1, keys), 17, np.uint8)
    v = np.full((1, 1, keys, 1), 255, np.uint8)
    y = _run(form, rq, x, v, None, "all")[0]
    num, den = accumulators(x, v, rq, form=form)
    assert num.max() == 255 * 255 * keys < 2**31
    np.testing.assert_array_equal(y, reference(form, x, v, rq))
    np.testing.assert_allclose(y, 255 * 0.01, rtol=1e-6)  # the mean of V
    with pytest.raises(ValueError, match=r"rows of 33026 keys can overflow.*longest safe row here is 33025 keys"):
        reference(form, np.full((1, 1, 1, keys + 1), 17, np.uint8), np.zeros((1, 1, keys + 1, 1), np.uint8), rq)
    # symmetric V (codes 1..255 around 128) doubles the safe length
    assert RowQuant(q, 0.01, 128, 8, "row", 1, 255).max_keys() == (2**31 - 1) // (255 * 127)


def test_masked_keys_do_not_matter():
    q = SoftmaxQuant(scale=0.05)
    rq = RowQuant(q, 0.02, 30, 8)
    x, v, valid = _inputs("mask", q)
    y = _run("int", rq, x, v, valid, "all")[0]
    rng = np.random.default_rng(2)
    x2 = np.where(np.broadcast_to(valid, x.shape), x, rng.integers(0, 256, x.shape)).astype(np.uint8)
    np.testing.assert_array_equal(_run("int", rq, x2, v, valid, "all")[0], y)
    # a masked row equals the attention over its valid keys alone
    keep = np.flatnonzero(valid[1, 0, 3])
    alone = _run("int", rq, x[1:2, :, 3:4][..., keep], v[1:2][:, :, keep], None, "all")[0]
    np.testing.assert_allclose(alone[0, :, 0], y[1, :, 3], rtol=1e-6)


@pytest.mark.parametrize("form", ROW_FORMS)
def test_unmasked_core_drops_the_empty_row_guard(form):
    """Without a mask every row has its top code (E > 0), so the row sum needs no floor max(sum, 1): same outputs,
    one node fewer; with a mask the guard stays and a fully masked row gives 0."""
    q = SoftmaxQuant(scale=0.05)
    rq = RowQuant(q, 0.02, 30, 8)
    x, v, _ = _inputs("guard", q, masked=False)
    guarded = row_attention_model(form, rq)
    bare = row_attention_model(form, rq, empty_rows=False)
    ops = lambda m: [n.op_type for n in m.graph.node]  # noqa: E731
    assert ops(guarded).count("Clip") == ops(bare).count("Clip") + 1
    for opt in OPTS:
        np.testing.assert_array_equal(U.run(bare, {"x": x, "v": v}, opt)[0], U.run(guarded, {"x": x, "v": v}, opt)[0])
    x, v, valid = _inputs("guard-masked", q)
    y = _run(form, rq, x, v, valid, "all")[0]
    assert np.isfinite(y).all() and np.all(y[0, :, 2] == 0)


@pytest.mark.parametrize("representation", LINEAR_REPRESENTATIONS)
@pytest.mark.parametrize("per", ["head", "channel"])
def test_per_head_v_scales_outside_the_integer_gemm(representation, per):
    """V codes with a zero point and scale per head (or per head and channel), as an exported K/V point with
    ``kv_scales="head"`` hands them to the core: ``E.(v - z)`` is the integer GEMM of the codes minus ``z sum(E)``,
    the scales divide the denominator; a fully masked row still gives 0."""
    q = SoftmaxQuant(scale=0.05)
    rq = RowQuant(q, 1.0, 128, 8, representation)  # the stored int8 codes, 128 higher, on a grid of scale 1
    x, v, valid = _inputs(f"affine-{per}", q)
    rng = np.random.default_rng(5)
    shape = (1, x.shape[1], 1, 1 if per == "head" else v.shape[-1])
    z = rng.integers(-100, 100, shape).astype(np.float32)
    s = rng.uniform(0.01, 0.2, shape).astype(np.float32)
    y = U.run(row_attention_model("int", rq, with_valid=True, v_affine=(z, s)),
              {"x": x, "v": v, "valid": np.broadcast_to(valid, x.shape).copy()}, "all")[0]
    num, den = accumulators(x, v, rq, valid)  # E.(v - 128) and the row's denominator
    sum_e = row_codes(x, rq, valid).astype(np.int64).sum(-1, keepdims=True)
    want = (num - z * sum_e) * s / (np.maximum(den, 1) * rq.den_factor("int"))
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=1e-6)
    assert np.all(y[0, :, 2] == 0)


def test_bad_parameters():
    q = SoftmaxQuant(scale=0.1)
    with pytest.raises(ValueError, match="representation must be one of"):
        RowQuant(q, 0.1, 0, 8, "log2")
    with pytest.raises(ValueError, match="2 to 8 bits"):
        RowQuant(q, 0.1, 0, 12)
    with pytest.raises(ValueError, match=r"row_log codes are 4-bit with score codes on steps of ln\(2\)/2.*step 0.1"):
        RowQuant(q, 0.1, 0, 4, "row_log")
    with pytest.raises(ValueError, match="row_log codes are 4-bit.*got 8 bits"):
        RowQuant(SoftmaxQuant(scale=0.3465735912322998), 0.1, 0, 8, "row_log")
    with pytest.raises(ValueError, match="8-bit score codes at most"):
        RowQuant(SoftmaxQuant(scale=0.1, bits=12, signed=True), 0.1, 0)
    with pytest.raises(ValueError, match="V scale"):
        RowQuant(q, 0.0, 0)
    with pytest.raises(ValueError, match="V zero point 300"):
        RowQuant(q, 0.1, 300)
    with pytest.raises(ValueError, match="unknown row-code attention form 'qdq'"):
        row_attention_model("qdq", RowQuant(q, 0.1, 0))
    with pytest.raises(ValueError, match="V codes must be uint8"):
        reference("int", np.zeros((1, 4), np.uint8), np.zeros((4, 2), np.int8), RowQuant(q, 0.1, 0))
