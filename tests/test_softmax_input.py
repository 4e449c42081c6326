"""The softmax input: codes relative to the row max (QuantConfig.softmax_input="row") and float scores ("float",
the default for row codes): torch fake-quant, the numpy reference and onnxruntime agree; masks, empty rows and
the span."""

from __future__ import annotations

import json
import math
import zlib

import numpy as np
import pytest
import torch

import softq
from softq.attention import attention_points
from softq.export import onnx_utils as U
from softq.export.int_softmax import SoftmaxQuant, relative_codes, relative_codes_model
from softq.export.row_attention import RowQuant, reference, row_attention_model
from softq.quant import io
from softq.quant.config import softmax_input_span
from softq.quant.quantizers import RowScoresQuantizer
from conftest import padded_logit_error, tiny_inputs, tiny_model

OPTS = ("disable", "all")


def _grid(representation: str = "row", out_bits: int = 8, in_bits: int = 8) -> SoftmaxQuant:
    top = 2**in_bits - 1
    return SoftmaxQuant(scale=softmax_input_span(representation, out_bits) / top, zero_point=top, bits=in_bits,
                        relative=True)


def _scores(seed: str, shape=(2, 3, 9, 40), spread=6.0):
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    s = (rng.standard_normal(shape) * spread).astype(np.float32)
    valid = rng.random((shape[0], 1, shape[2], shape[3])) < 0.7
    valid[0, 0, 3] = False  # a fully masked row
    s[1, :, 2, 5] = 1e4  # a masked outlier above the row's valid max must not move the grid
    valid[1, 0, 2, 5] = False
    return s, valid


def test_span_is_where_the_output_code_reaches_zero():
    for bits in (8, 6, 4):
        t = softmax_input_span("row", bits)
        assert round((2**bits - 1) * math.exp(-t)) == 0 < round((2**bits - 1) * math.exp(-0.95 * t))
    assert softmax_input_span("row", 8) == pytest.approx(6.34, abs=0.01)
    for representation in ("row_exact", "edge"):  # the 2^-16 sum grid reaches 0 there too
        assert round(2**16 * math.exp(-softmax_input_span(representation, 8))) == 0
    with pytest.raises(ValueError, match="softmax_input must be one of"):
        softq.QuantConfig(softmax_input="channel")
    # auto: float scores for row and row_exact codes, relative to the row max for row_log (its log grid), the
    # per-tensor convention for edge outputs
    assert softq.QuantConfig().float_scores and softq.QuantConfig(softmax_output="row_exact").float_scores
    assert softq.QuantConfig(softmax_output="row_log", softmax_bits=4).row_relative_input
    assert softq.QuantConfig(softmax_input="row").row_relative_input
    assert not softq.QuantConfig(softmax_output="edge").row_relative_input
    assert not softq.QuantConfig(softmax_output="edge").float_scores
    assert softq.QuantConfig(softmax_output="edge", softmax_input="row").row_relative_input


@pytest.mark.parametrize("opt", OPTS)
def test_onnx_codes_bit_exact_with_the_reference(opt):
    """Min/ReduceMax/Max/Sub/QuantizeLinear in onnxruntime give the reference's codes exactly: the top
    code at each row's valid max, 0 at masked keys and in a fully masked row, 0 beyond the span."""
    q = _grid()
    s, valid = _scores("codes")
    x = U.run(relative_codes_model(q, with_valid=True), {"s": s, "valid": np.broadcast_to(valid, s.shape).copy()},
              opt)[0]
    ref = relative_codes(s, q, valid)
    assert x.dtype == np.uint8
    np.testing.assert_array_equal(x, ref)
    vb = np.broadcast_to(valid, s.shape)
    assert np.all(x[~vb] == 0) and np.all(x[0, :, 3] == 0)
    assert np.all(x[vb.any(-1)].max(-1) == 255)
    far = vb & (s < np.where(vb, s, -np.inf).max(-1, keepdims=True) - softmax_input_span("row", 8) - 0.1)
    assert far.any() and np.all(x[far] == 0)
    unmasked = U.run(relative_codes_model(q), {"s": s}, opt)[0]
    np.testing.assert_array_equal(unmasked, relative_codes(s, q))


@pytest.mark.parametrize("representation,form", [("row", "int"), ("row", "fast"), ("row_exact", "int")])
def test_codes_then_core_without_a_mask_equal_the_masked_reference(representation, form):
    """The export feeds the row core relative codes without the mask: code 0 gives exp code 0 (and a 0
    exact-sum entry), so the unmasked core equals the masked reference bit for bit."""
    q = _grid(representation)
    rq = RowQuant(q, 0.02, 9, 8, representation)
    s, valid = _scores(f"core{representation}{form}")
    x = relative_codes(s, q, valid)
    v = np.random.default_rng(3).integers(0, 256, (2, 3, 40, 6)).astype(np.uint8)
    y = U.run(row_attention_model(form, rq), {"x": x, "v": v}, "all")[0]
    np.testing.assert_array_equal(y, reference(form, x, v, rq, valid))
    assert np.all(y[0, :, 3] == 0) and not np.isnan(y).any()
    # the core's tables are indexed by the code itself: no ReduceMax in the core
    ops = {n.op_type for n in row_attention_model(form, rq).graph.node}
    assert "ReduceMax" not in ops


def test_too_short_span_is_refused():
    short = SoftmaxQuant(scale=4.0 / 255, zero_point=255, relative=True)  # exp(-4) * 255 = 4.7: not 0
    with pytest.raises(ValueError, match="lowest code must give exp code 0"):
        RowQuant(short, 0.1, 0, 8, "row")
    row_span = _grid("row", 8)  # enough for row codes, not for row_exact's 2^-16 sum
    with pytest.raises(ValueError, match="too little for the 8-bit row_exact codes"):
        RowQuant(row_span, 0.1, 0, 8, "row_exact")
    with pytest.raises(ValueError, match="unsigned with zero point 255"):
        SoftmaxQuant(scale=0.1, zero_point=0, relative=True)


def test_torch_codes_equal_the_reference():
    """RowScoresQuantizer (round((s - rowmax) / S) + q, QuantizeLinear's order) gives the reference's codes on
    every valid key (Brevitas' order, q added before rounding, differed at float32 ties)."""
    q = _grid()
    point = RowScoresQuantizer(8, softmax_input_span("row", 8))
    point.mode = "quant"
    s, valid = _scores("torch", shape=(4, 4, 32, 64))
    st, vt = torch.from_numpy(s), torch.from_numpy(valid.astype(np.float32))
    codes = point.int_repr(st, vt).numpy()
    ref = relative_codes(s, q, valid)
    vb = np.broadcast_to(valid, s.shape)
    diff = (codes != ref) & vb
    m = np.where(vb, s, -np.inf).max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):  # the fully masked row's max is -inf
        ratio = (s - m) / q.scale32
        tie = np.abs(np.abs(ratio - np.floor(ratio)) - 0.5)
    assert not diff.any(), (int(diff.sum()), tie[diff][:5])
    # the point's output: the dequantized codes around the row max, code 0 (T or more below it: weight 0,
    # like the integer tables) as the lowest float; no NaN
    out = point(st, vt).numpy()
    assert not np.isnan(out).any()
    expected = np.broadcast_to(m + (codes.astype(np.float32) - 255) * q.scale32, s.shape)
    expected = np.where(codes == 0, np.finfo(np.float32).min, expected)
    assert (vb & (codes == 0)).any()
    np.testing.assert_allclose(out[vb], expected[vb], rtol=0, atol=1e-5)


def test_row_input_needs_no_score_calibration_and_fully_masked_rows_give_zeros():
    """The row-relative grid is fixed by the span (step T/255, zero point 255); a padded GPT-2 batch with an
    all-padding sequence gives finite logits for the rest and the same logits as unpadded."""
    qmodel = softq.quantize(tiny_model("gpt2"), [tiny_inputs("gpt2", seed=s) for s in range(2)],
                            softq.QuantConfig(softmax_input="row"))
    for _, points in attention_points(qmodel):
        assert isinstance(points.scores, RowScoresQuantizer)
        assert float(points.scores.scale) == pytest.approx(softmax_input_span("row", 8) / 255)
    inputs = tiny_inputs("gpt2", batch=2, seq=12, seed=5)
    mask = torch.ones_like(inputs["input_ids"])
    mask[1, 6:] = 0
    with torch.no_grad():
        padded = qmodel(input_ids=inputs["input_ids"], attention_mask=mask).logits
        alone = qmodel(input_ids=inputs["input_ids"][1:, :6]).logits
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded[1, :6], alone[0], rtol=1e-4, atol=1e-4)


def test_save_load_and_older_files_load_with_their_grid(tmp_path):
    """Saved models load with the softmax input they were quantized with: the default's float scores, a
    row-relative grid, a file written when "auto" meant the row-relative grid (no record of what it resolved
    to), and the tensor grid of files written before the field existed."""
    calib = [tiny_inputs("vit", seed=s) for s in range(2)]
    x = tiny_inputs("vit", seed=8)
    q = softq.quantize(tiny_model("vit"), calib)
    io.save(q, tmp_path / "f")
    loaded = io.load(tmp_path / "f")
    assert isinstance(attention_points(loaded)[0][1].scores, torch.nn.Identity)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**x).logits, q(**x).logits, rtol=0, atol=0)
    q = softq.quantize(tiny_model("vit"), calib, softq.QuantConfig(softmax_input="row"))
    io.save(q, tmp_path / "q", weights="float")  # format 1, as older files
    meta_path = tmp_path / "q" / "quant_config.json"
    meta = json.loads(meta_path.read_text())
    meta["quant_config"]["softmax_input"] = "auto"  # a file from before "auto" meant float scores
    del meta["softmax_input_resolved"]
    del meta["digest"]  # (and before the digest)
    meta_path.write_text(json.dumps(meta))
    loaded = io.load(tmp_path / "q")
    assert loaded.softq_quant_config.softmax_input == "row"
    with torch.no_grad():
        torch.testing.assert_close(loaded(**x).logits, q(**x).logits, rtol=0, atol=0)
    assert isinstance(attention_points(loaded)[0][1].scores, RowScoresQuantizer)
    meta = json.loads(meta_path.read_text())
    del meta["quant_config"]["softmax_input"]  # written before the field existed
    meta_path.write_text(json.dumps(meta))
    old = io.load(tmp_path / "q")
    assert old.softq_quant_config.softmax_input == "tensor"
    assert not isinstance(attention_points(old)[0][1].scores, RowScoresQuantizer)


@pytest.mark.parametrize("form", ["qdq", "int"])
def test_edge_output_with_a_row_relative_input_exports_with_parity(form):
    """softmax_input='row' also works for edge outputs: the edge forms take the relative codes (their row max
    is always the top code); onnxruntime matches torch within the export tests' tolerance."""
    from softq.export.model_export import build_onnx

    family = "gpt2"
    qmodel = softq.quantize(tiny_model(family), [tiny_inputs(family, seed=s) for s in range(2)],
                            softq.QuantConfig(softmax_output="edge", softmax_input="row"))
    model = build_onnx(qmodel, tiny_inputs(family), form)
    assert padded_logit_error(qmodel, model, family, seq=20, pad_from=14, seed=9) <= 0.02


# --------------------------------------------------------------------------- softmax_input="float"


def test_float_input_config():
    """'float' keeps the scores float for row and row_exact codes; the other outputs take integer score codes."""
    config = softq.QuantConfig(softmax_input="float")
    assert config.float_scores and not config.row_relative_input
    assert softq.QuantConfig(softmax_input="float", softmax_output="row_exact").float_scores
    assert not softq.QuantConfig(softmax_input="float", softmax_bits=None).float_scores  # nothing quantized there
    with pytest.raises(ValueError, match="row-relative softmax input"):
        softq.QuantConfig(softmax_input="float", softmax_output="row_log", softmax_bits=4)
    with pytest.raises(ValueError, match="softmax_input='float' takes softmax_output 'row' or 'row_exact'"):
        softq.QuantConfig(softmax_input="float", softmax_output="edge")


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("representation", ["row", "row_exact"])
def test_float_scores_core_matches_the_reference(opt, representation):
    """Float scores: the graph's s - rowmax equals the reference's bit for bit (masked keys and a fully masked
    row at -5e29 or below); the core rounds E = round(G exp(s - rowmax)) once from the float Exp, equal to the
    exactly rounded reference off rounding ties ('row' bit exact there, 'row_exact' by its float32 sum) and
    within one code's worth at ties; masked keys weigh nothing, the fully masked row gives zeros."""
    from softq.export.int_softmax import relative_scores
    from softq.export.row_attention import row_codes, tie_distance

    s, valid = _scores(f"float{representation}{opt}")
    vb = np.broadcast_to(valid, s.shape).copy()
    r = U.run(relative_codes_model(None, with_valid=True), {"s": s, "valid": vb}, opt)[0]
    np.testing.assert_array_equal(r, relative_scores(s, valid))
    assert r.dtype == np.float32 and np.all(r[~vb] <= -5e29) and np.all(r[vb.any(-1)].max(-1) == 0)
    rq = RowQuant(None, 0.02, 9, 8, representation)
    v = np.random.default_rng(4).integers(0, 256, (2, 3, 40, 6)).astype(np.uint8)
    y = U.run(row_attention_model("fast", rq), {"x": r, "v": v}, opt)[0]
    ref = reference("fast", r, v, rq)
    near = (tie_distance(r, rq) < 1e-4).any(-1)
    assert (~near).mean() > 0.9
    if representation == "row":
        np.testing.assert_array_equal(y[~near], ref[~near])
    else:
        np.testing.assert_allclose(y[~near], ref[~near], rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    np.testing.assert_allclose(y, ref, atol=250 * 0.02 / 255)
    assert np.all(y[0, :, 3] == 0) and not np.isnan(y).any()
    # masked keys weigh exactly nothing; each valid row's max gets the top code
    p = U.run(row_attention_model("fast", rq, probs=True), {"x": r, "v": v}, opt)[1]
    assert np.all(p[~vb] == 0) and np.all(row_codes(r, rq)[vb.any(-1)].max(-1) == 255)
    # the integer form takes score codes; a mask belongs in the scores, not in the float core
    with pytest.raises(ValueError, match="export with the 'fast' form"):
        row_attention_model("int", rq)
    with pytest.raises(ValueError, match="give it no valid mask"):
        row_attention_model("fast", rq, with_valid=True)
    with pytest.raises(ValueError, match="row or row_exact"):
        RowQuant(None, 0.02, 9, 4, "row_log")


@pytest.mark.parametrize("family", ["gpt2", "opt", "vit"])
def test_float_input_model_exports_with_parity(family):
    """softmax_input='float': the scores point stays float in torch; the fast form's ONNX feeds s - rowmax
    straight into the Exp (no QuantizeLinear/DequantizeLinear before it) and matches torch, padding included;
    the int form is refused with one line that says what to do."""
    from softq.export.errors import ExportError
    from softq.export.model_export import build_onnx

    calib = [tiny_inputs(family, seed=s) for s in range(2)]
    qmodel = softq.quantize(tiny_model(family), calib, softq.QuantConfig(softmax_input="float"))
    assert all(isinstance(points.scores, torch.nn.Identity) for _, points in attention_points(qmodel))
    model = build_onnx(qmodel, tiny_inputs(family), "fast")
    made_by = {o: n for n in model.graph.node for o in n.output}
    exps = [n for n in model.graph.node if n.op_type == "Exp"]
    assert exps and all(made_by[n.input[0]].op_type == "Sub" for n in exps)
    if family == "vit":
        x = tiny_inputs(family, seed=7)
        with torch.no_grad():
            ref = qmodel(**x).logits.numpy()
        out = U.run(model, {"pixel_values": x["pixel_values"].numpy()}, "all")[0]
        assert np.abs(out - ref).max() / np.abs(ref).max() <= 0.02
    else:
        assert padded_logit_error(qmodel, model, family, seq=20, pad_from=14, seed=9) <= 0.02
    with pytest.raises(ExportError, match="softmax form 'int' takes integer score codes.*softmax_input='row'"):
        build_onnx(qmodel, tiny_inputs(family), "int")
