"""Integer softmax forms: onnxruntime vs the numpy references, edge cases, op lists, quirks."""

from __future__ import annotations

import os
import zlib

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper

from softq.export import onnx_utils as U
from softq.export.int_softmax import (
    FORMS,
    OUT_SCALE,
    SoftmaxQuant,
    build_softmax,
    reference,
    reference_ort,
    reference_qdq,
    softmax_model,
    tie_distance,
)

OPTS = ("disable", "all")
# Float runtimes may round the other way only this close to a rounding tie (in output steps).
TIE_BAND = 1e-4


def _q(form: str, signed: bool, bits: int = 8, scale: float = 0.05, zp: int = 0) -> SoftmaxQuant:
    return SoftmaxQuant(scale=scale, zero_point=zp, bits=bits, signed=signed, out_signed=signed)


def _codes(rng: np.random.Generator, q: SoftmaxQuant, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(q.qmin, q.qmax + 1, shape).astype(q.in_dtype)


def _run(form, q, x, valid=None, opt="all", axis=-1, beta=None):
    model = softmax_model(form, q, axis=axis, rank=x.ndim, with_valid=valid is not None, beta=beta)
    feeds = {"x": x} if valid is None else {"x": x, "valid": valid}
    return U.run(model, feeds, opt)[0]


def _assert_matches(form, y, x, q, valid=None, axis=-1, beta=None):
    ref = reference(form, x, q, axis=axis, valid=valid, beta=beta)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    if form != "qdq":
        np.testing.assert_array_equal(y, ref)
        return
    # qdq's middle is a float Softmax: equal except where 256p sits on a rounding tie.
    diff = y.astype(int) - ref.astype(int)
    near_tie = tie_distance(x, q, axis=axis, valid=valid) < TIE_BAND
    assert np.all(diff[~near_tie] == 0)
    assert np.all(np.abs(diff) <= 1)


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_bit_exact_vs_reference(form, signed, masked, opt):
    rng = np.random.default_rng(zlib.crc32(repr((form, signed, masked)).encode()))
    q = _q(form, signed, zp=(-3 if signed else 7))
    x = _codes(rng, q, (2, 3, 7, 33))
    valid = rng.random((2, 1, 7, 33)) < 0.6 if masked else None
    _assert_matches(form, _run(form, q, x, valid, opt), x, q, valid)


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("bits", [12, 16])
def test_int_wide_inputs_bit_exact_and_close_to_exact_softmax(bits, opt):
    rng = np.random.default_rng(bits)
    q = SoftmaxQuant(scale=8.0 / 2**bits, bits=bits, signed=True, out_signed=False)
    x = _codes(rng, q, (4, 9, 40))
    valid = rng.random((1, 9, 40)) < 0.8
    y = _run("int", q, x, valid, opt)
    _assert_matches("int", y, x, q, valid)
    # The I-BERT exp is an approximation: at most one output step from the exact softmax.
    assert np.abs(y.astype(int) - reference_qdq(x, q, valid=valid).astype(int)).max() <= 1
    # qdq takes the same int16 input (opset 21) and agrees with its reference.
    if bits == 16:
        _assert_matches("qdq", _run("qdq", q, x, valid, opt), x, q, valid)


def test_int_8bit_table_is_the_exact_rounding_away_from_ties():
    """The 2**16 (int32) exp table with a rounded division gives the exactly rounded softmax
    except within 2e-3 of a rounding tie (a handful in 10**5 entries), by one step at most."""
    rng = np.random.default_rng(3)
    for scale in (1e-3, 0.05, 0.5):
        q = SoftmaxQuant(scale=scale)
        x = _codes(rng, q, (2000, 50))
        diff = reference("int", x, q).astype(int) - reference_qdq(x, q).astype(int)
        assert np.abs(diff).max() <= 1 and (diff != 0).sum() <= 20
        assert np.all(diff[tie_distance(x, q) >= 2e-3] == 0)
    with pytest.raises(ValueError, match="at most 32767 keys"):
        reference("int", np.zeros((1, 2**15), np.uint8), SoftmaxQuant(scale=0.1))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("signed", [False, True])
def test_edge_rows(form, signed):
    q = _q(form, signed, scale=0.1)
    top, zp = (127, -128) if signed else (255, 0)
    # one dominant logit saturates at the top code; all others are the zero point
    x = np.full((1, 1, 2, 16), q.qmin, dtype=q.in_dtype)
    x[..., 5] = q.qmax
    for opt in OPTS:
        y = _run(form, q, x, opt=opt)
        assert np.all(y[..., 5] == top) and np.all(np.delete(y, 5, axis=-1) == zp)
        _assert_matches(form, y, x, q)
    # row length 1: probability 1 -> saturates
    x1 = _codes(np.random.default_rng(0), q, (3, 2, 4, 1))
    for opt in OPTS:
        assert np.all(_run(form, q, x1, opt=opt) == top)
    # all-equal rows: round(256 / n) + zp, for several n
    for n in (2, 3, 7, 100):
        xe = np.full((1, 2, 3, n), 17, dtype=q.in_dtype)
        y = _run(form, q, xe)
        assert np.all(y.astype(int) == min(round(256 / n), 255) + zp)


@pytest.mark.parametrize("form", FORMS)
def test_row_length_4096(form):
    rng = np.random.default_rng(4096)
    q = _q(form, False, scale=0.02)
    x = _codes(rng, q, (1, 1, 2, 4096))
    x[0, 0, 1] = 200  # all-equal long row: 256/4096 = 1/16 step rounds to 0
    for opt in OPTS:
        y = _run(form, q, x, opt=opt)
        _assert_matches(form, y, x, q)
        assert np.all(y[0, 0, 1] == 0)


@pytest.mark.parametrize("form", FORMS)
def test_masked_positions(form):
    rng = np.random.default_rng(7)
    q = _q(form, False, scale=0.05)
    x = _codes(rng, q, (2, 2, 6, 12))
    valid = np.tril(np.ones((6, 12), dtype=bool), k=6)[None, None].repeat(2, 0)
    valid[1, :, 2, :] = False  # a fully masked row gives zeros, never NaN
    y = _run(form, q, x, valid)
    _assert_matches(form, y, x, q, valid)
    assert np.all(y[~np.broadcast_to(valid, y.shape)] == 0)
    assert np.all(y[1, :, 2] == 0)
    if form != "ort":
        # Masked keys are fully excluded: changing their codes changes nothing, and
        # a masked row equals the softmax of its valid part alone.
        x2 = np.where(valid, x, _codes(rng, q, x.shape)).astype(q.in_dtype)
        np.testing.assert_array_equal(_run(form, q, x2, valid), y)
        np.testing.assert_array_equal(y[0, 0, 0, :7], _run(form, q, x[:1, :1, :1, :7])[0, 0, 0])
    else:
        # QLinearSoftmax has no mask input: masked keys enter as the minimum code, which
        # costs at most the weight exp((qmin - max) S) per masked key.
        free = reference_qdq(x, q, valid=valid).astype(int)
        assert np.abs(y.astype(int) - free).max() <= 1


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("scale", [1e-6, 1e-3, 2.0, 100.0])
def test_extreme_input_scales(form, scale):
    rng = np.random.default_rng(11)
    q = _q(form, True, scale=scale)
    x = _codes(rng, q, (3, 4, 20))
    for opt in OPTS:
        _assert_matches(form, _run(form, q, x, opt=opt), x, q)
    if scale == 1e-6:  # near-uniform rows
        assert np.all(np.abs(reference("int", x, q).astype(int) + 128 - round(256 / 20)) <= 1)


@pytest.mark.parametrize("form", FORMS)
def test_dynamic_shapes_and_axis(form):
    q = _q(form, False, scale=0.07)
    model = softmax_model(form, q, axis=1, rank=3)
    sess = U.session(model, "all")
    rng = np.random.default_rng(5)
    for shape in [(1, 5, 2), (3, 17, 4), (2, 1, 9)]:
        x = _codes(rng, q, shape)
        _assert_matches(form, sess.run(None, {"x": x})[0], x, q, axis=1)


def test_op_allow_lists():
    q8, q16 = SoftmaxQuant(scale=0.05), SoftmaxQuant(scale=1e-3, bits=16, signed=True)
    qdq_ops = {("", "DequantizeLinear"), ("", "Softmax"), ("", "QuantizeLinear"), ("", "Where")}
    for masked in (False, True):
        qdq = softmax_model("qdq", q8, with_valid=masked)
        U.check_allowed_ops(qdq.graph.node, qdq_ops)
        assert U.contrib_ops(qdq) == []
        ort = softmax_model("ort", q8, with_valid=masked)
        U.check_allowed_ops(ort.graph.node, {("com.microsoft", "QLinearSoftmax"), ("", "Where")})
        qls = [n for n in ort.graph.node if n.op_type == "QLinearSoftmax"][0]
        assert {a.name: a.i for a in qls.attribute} == {"opset": 13, "axis": -1}
        for q in (q8, q16):
            m = softmax_model("int", q, with_valid=masked, beta=np.full((1, 1, 1, 1), 1e-3))
            U.check(m)
            assert U.contrib_ops(m) == []
            assert U.float_valued_nodes(m) == []  # integer arithmetic only, x to y
            ops = {n.op_type for n in m.graph.node}
            assert not ops & {"Softmax", "Exp", "DequantizeLinear", "QuantizeLinear", "QLinearSoftmax"}
    with pytest.raises(ValueError, match="allow-list: ai.onnx::Softmax"):
        U.check_allowed_ops(softmax_model("qdq", q8).graph.node, {("", "DequantizeLinear"), ("", "QuantizeLinear")})


def _with_output_scale(model: onnx.ModelProto, scale: float) -> onnx.ModelProto:
    for init in model.graph.initializer:
        if "y_scale" in init.name:
            init.CopyFrom(numpy_helper.from_array(np.array(scale, np.float32), init.name))
    return model


def test_qdq_fusion_quirk_1_over_255_vs_2_pow_minus_8(tmp_path):
    """onnxruntime fuses DQ->Softmax->Q into QLinearSoftmax, which uses floor(1/y_scale).

    With y_scale = 1/255 that floor is 254: fused and unfused results differ by a
    step in a few percent of the entries (those with larger probabilities).  With
    2**-8 (softq) fused and unfused both give the exact rounding away from ties.
    """
    rng = np.random.default_rng(255)
    q = SoftmaxQuant(scale=0.05)
    x = _codes(rng, q, (1, 1, 400, 37))
    bad = _with_output_scale(softmax_model("qdq", q, rank=4), 1.0 / 255.0)
    good = softmax_model("qdq", q, rank=4)
    assert U.optimized_op_types(good, "all", tmp_path) == ["QLinearSoftmax"]
    assert U.optimized_op_types(good, "disable", tmp_path) == ["DequantizeLinear", "Softmax", "QuantizeLinear"]
    b0, b1 = (U.run(bad, {"x": x}, o)[0].astype(int) for o in OPTS)
    assert (b0 != b1).mean() > 0.01 and np.abs(b0 - b1).max() == 1
    g0, g1 = (U.run(good, {"x": x}, o)[0] for o in OPTS)
    np.testing.assert_array_equal(g1, reference_ort(x, q))  # fused: the kernel, bit exact
    far = tie_distance(x, q) >= TIE_BAND
    exact = reference_qdq(x, q)
    assert np.all(g1[far] == exact[far]) and np.all(g0[far] == exact[far])  # fused or not: exact off ties


def test_int_bias_correction_in_rounding_point():
    rng = np.random.default_rng(9)
    q = SoftmaxQuant(scale=0.02)
    x = _codes(rng, q, (2, 3, 8, 64))
    valid = np.tril(np.ones((8, 64), dtype=bool), k=56)[None, None]
    beta = np.array([0.0, 1e-3, -1e-3]).reshape(1, 3, 1, 1)
    for opt in OPTS:
        y = _run("int", q, x, valid, opt, beta=beta)
        _assert_matches("int", y, x, q, valid, beta=beta)
    plain = reference("int", x, q, valid=valid).astype(int)
    y = y.astype(int)
    v = np.broadcast_to(valid, y.shape)
    np.testing.assert_array_equal(y[:, 0], plain[:, 0])  # beta 0 = no correction
    assert np.all(y[~v] == 0)  # masked keys stay exactly 0
    # mean output moves by about beta / 2**-8 steps (here +-0.256)
    shift = [(y[:, h][v[:, h]] - plain[:, h][v[:, h]]).mean() for h in (1, 2)]
    assert 0.1 < shift[0] < 0.4 and -0.4 < shift[1] < -0.1


def test_output_scale_is_exactly_2_pow_minus_8():
    for form in ("qdq", "ort"):
        for signed in (False, True):
            g = build_softmax(form, "x", "y", _q(form, signed))
            inits = {i.name: numpy_helper.to_array(i) for i in g.initializers}
            (scale,) = [v for k, v in inits.items() if "y_scale" in k]
            (zp,) = [v for k, v in inits.items() if "y_zp" in k][:1]
            assert scale.dtype == np.float32 and scale == OUT_SCALE == np.float32(1 / 256)
            assert zp == (-128 if signed else 0) and zp.dtype == (np.int8 if signed else np.uint8)


def test_bad_parameters():
    with pytest.raises(ValueError, match="scale"):
        SoftmaxQuant(scale=0.0)
    with pytest.raises(ValueError, match="bits"):
        SoftmaxQuant(scale=0.1, bits=1)
    with pytest.raises(ValueError, match="zero point 300"):
        SoftmaxQuant(scale=0.1, zero_point=300)
    with pytest.raises(ValueError, match="unknown softmax form 'float'"):
        softmax_model("float", SoftmaxQuant(scale=0.1))
    with pytest.raises(ValueError, match="8-bit inputs only"):
        softmax_model("ort", SoftmaxQuant(scale=0.1, bits=12))
    with pytest.raises(ValueError, match="input's type"):
        softmax_model("ort", SoftmaxQuant(scale=0.1, signed=True, out_signed=False))
    with pytest.raises(ValueError, match="opset >= 21"):
        softmax_model("int", SoftmaxQuant(scale=0.1, bits=16), opset=18)
    with pytest.raises(ValueError, match="bias correction"):
        softmax_model("qdq", SoftmaxQuant(scale=0.1), beta=np.zeros(1))
    with pytest.raises(ValueError, match="outside the 8-bit range"):
        reference("int", np.array([300]), SoftmaxQuant(scale=0.1))
    with pytest.raises(ValueError, match="does not broadcast"):
        reference("int", np.zeros((2, 3), np.uint8), SoftmaxQuant(scale=0.1), valid=np.ones((4,), bool))


def test_int8_ort_form_refused_on_old_onnxruntime(monkeypatch):
    """onnxruntime <= 1.28's int8 QLinearSoftmax saturates at 255 (#29727): refuse it there."""
    q = SoftmaxQuant(scale=0.1, signed=True, out_signed=True)
    softmax_model("ort", q)  # fine on this onnxruntime
    monkeypatch.setattr(onnxruntime, "__version__", "1.28.1")
    with pytest.raises(RuntimeError, match="int8 QLinearSoftmax"):
        softmax_model("ort", q)
    softmax_model("ort", SoftmaxQuant(scale=0.1))  # uint8 is unaffected


def test_save_atomic(tmp_path):
    model = softmax_model("int", SoftmaxQuant(scale=0.1))
    path = tmp_path / "sm.onnx"
    U.save_atomic(model, path)
    assert onnx.load(str(path)).graph.name == model.graph.name
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="overwrite"):
        U.save_atomic(softmax_model("qdq", SoftmaxQuant(scale=0.1)), path)
    assert path.read_bytes() == before
    U.save_atomic(softmax_model("qdq", SoftmaxQuant(scale=0.1)), path, overwrite=True)
    assert onnx.load(str(path)).graph.name.endswith("qdq")
    # a model that fails the full check is never moved into place, and no temp file stays
    broken = softmax_model("int", SoftmaxQuant(scale=0.1))
    broken.graph.node[0].input[0] = "nothing"
    with pytest.raises(onnx.checker.ValidationError):
        U.save_atomic(broken, tmp_path / "broken.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sm.onnx"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        U.save_atomic(model, tmp_path / "no" / "x.onnx")
    with pytest.raises(ValueError, match="is a directory"):
        U.save_atomic(model, tmp_path)


def test_save_atomic_unwritable_directory(tmp_path):
    if os.geteuid() == 0:  # root ignores mode bits; sysfs refuses new files even to root
        target = "/sys/kernel/softq_test.onnx"
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "x.onnx"
    with pytest.raises(PermissionError, match="writable|cannot write"):
        U.save_atomic(softmax_model("int", SoftmaxQuant(scale=0.1)), target)
    assert not os.path.exists(target)
