"""softq.quantize on real Brevitas quantizers: what is quantized, masks, bias correction, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from conftest import assert_cached_decoding_matches, tiny_inputs, tiny_model

import softq
from softq.attention import attention_points
from softq.calib.data import CalibrationDataError
from softq.models import UnsupportedModelError
from softq.quant.layers import QLinear
from softq.quant.quantizers import ActQuantizer, SoftmaxOutputQuantizer

FAMILIES = ["gpt2", "opt", "bert", "roberta", "vit", "deit"]


def calib_for(family: str, n: int = 3) -> list[dict[str, torch.Tensor]]:
    return [tiny_inputs(family, seed=10 + i) for i in range(n)]


def capture_probs(qmodel: torch.nn.Module) -> list[torch.Tensor]:
    """Record what every softmax-output quantizer returns on the next forward."""
    captured: list[torch.Tensor] = []
    for _, points in attention_points(qmodel):
        points.probs.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    return captured


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_model_runs_like_the_original_and_is_close(family: str) -> None:
    model = tiny_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qmodel = softq.quantize(model, calib_for(family))
    inputs = tiny_inputs(family, seed=99)
    with torch.no_grad():
        ref = model(**inputs).logits
        out = qmodel(**inputs).logits
    assert out.shape == ref.shape
    rel = (out - ref).norm() / ref.norm()
    assert rel < 0.1, f"W8A8 relative logit error {rel:.3f}"
    # every Linear became a Brevitas QLinear, and the original model was not touched
    assert not any(type(m) is torch.nn.Linear for m in qmodel.modules())
    assert any(isinstance(m, QLinear) for m in qmodel.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert softq.quant.is_quantized(qmodel) and not softq.quant.is_quantized(model)


def test_per_channel_weight_scales_follow_weight_ranges() -> None:
    qmodel = softq.quantize(tiny_model("opt"), calib_for("opt"))
    for layer in (m for m in qmodel.modules() if isinstance(m, QLinear)):
        expected = layer.weight.detach().abs().amax(dim=1) / 127.0
        torch.testing.assert_close(layer.weight_scale(), expected, rtol=1e-5, atol=1e-9)
        codes = layer.int_weight()
        assert codes.abs().max() <= 127
        live = expected > 0  # OPT's padding row of the tied lm_head is all zeros
        assert live.sum() >= len(live) - 1
        torch.testing.assert_close(codes.abs().amax(dim=1).float()[live], torch.full_like(expected[live], 127.0))


def test_every_attention_point_is_quantized_with_fixed_edge_softmax_scale() -> None:
    qmodel = softq.quantize(tiny_model("gpt2"), calib_for("gpt2"), softq.QuantConfig(softmax_output="edge"))
    for _, points in attention_points(qmodel):
        for point in (points.q, points.k, points.scores, points.v):
            assert isinstance(point, ActQuantizer) and point.mode == "quant"
        assert isinstance(points.probs, SoftmaxOutputQuantizer)
        assert points.probs.scale.item() == 2.0**-8
        assert points.probs.zero_point.item() == 0.0
    captured = capture_probs(qmodel)
    with torch.no_grad():
        qmodel(**tiny_inputs("gpt2"))
    for probs in captured:
        codes = probs * 256
        assert torch.equal(codes, codes.round()) and codes.min() >= 0 and codes.max() <= 255


@pytest.mark.parametrize("bits,softmax_input", [(8, "row"), (4, "row"), (8, "tensor")])
def test_row_codes_are_relative_to_the_row_max(bits: int, softmax_input: str) -> None:
    """Default representation: E = round((2^b-1) exp(s - rowmax)), the torch codes equal the numpy
    reference's from the score codes; 'row' divides by sum(E), 'row_exact' by (2^b-1) sum(exp); 'row_log'
    (4 bits, row-relative scores) takes round(G 2^(-k/2)) at k log steps below the max and divides by sum(E)."""
    import numpy as np

    from softq.export.int_softmax import SoftmaxQuant
    from softq.export.row_attention import RowQuant, row_codes

    from softq.quant.config import LOG_GAIN

    levels = 2**bits - 1
    log_codes = {0} | {round(LOG_GAIN * 2 ** (-k / 2)) for k in range(15)}
    for representation in ("row", "row_exact") + (("row_log",) if (bits, softmax_input) == (4, "row") else ()):
        config = softq.QuantConfig(softmax_bits=bits, softmax_output=representation, softmax_input=softmax_input)
        qmodel = softq.quantize(tiny_model("gpt2"), calib_for("gpt2"), config)
        points = attention_points(qmodel)[0][1]
        seen = {}
        points.scores.register_forward_hook(lambda _m, i, out: seen.update(scores=out.detach(), s_in=i))
        points.probs.register_forward_hook(lambda _m, i, out: seen.update(p=i[0].detach(), valid=i[1], out=out.detach()))
        with torch.no_grad():
            qmodel(**tiny_inputs("gpt2", seq=30, seed=4))
        sq = points.scores
        relative = softmax_input == "row"
        if relative:  # codes of s - rowmax over valid keys, zero point 2^8 - 1: the row max is the top code
            codes = sq.int_repr(*seen["s_in"]).to(torch.uint8).numpy()
            assert float(sq.zero_point) == 255
        else:
            codes = torch.round(seen["scores"] / sq.scale + sq.zero_point).to(torch.uint8).numpy()
        q = SoftmaxQuant(scale=float(sq.scale), zero_point=int(sq.zero_point), relative=relative)
        valid = np.broadcast_to(seen["valid"].numpy().astype(bool), codes.shape)
        rq = RowQuant(q, 0.1, 0, bits, representation)
        expected = row_codes(codes, rq, valid)
        e = points.probs.int_repr(seen["p"])
        np.testing.assert_array_equal(e.numpy(), expected)
        assert torch.all(e.amax(-1) == rq.top)  # the row max is always the top code
        if representation == "row_log":  # 16 levels, on the log grid's step
            assert rq.top == 87 and float(sq.scale) == np.float32(np.log(2) / 2)
            assert set(e.unique().tolist()) <= log_codes
        out = seen["out"]
        if representation in ("row", "row_log"):
            torch.testing.assert_close(out, e / e.sum(-1, keepdim=True))
        else:
            torch.testing.assert_close(out, e * seen["p"].amax(-1, keepdim=True) / levels)
            assert torch.all(out[~torch.from_numpy(valid.copy())] == 0)


def test_row_log_codes_are_powers_of_sqrt2() -> None:
    """A key k log steps (ln(2)/2) below its row max, give or take 0.4 of a step, gets code round(G 2^(-k/2)):
    15 powers of sqrt(2) from 87 down to 1, then 0; the output is E / sum(E)."""
    from softq.quant.config import LOG_GAIN, LOG_STEP, softmax_input_span
    from softq.quant.quantizers import RowScoresQuantizer

    scores_q = RowScoresQuantizer(8, softmax_input_span("row_log", 4, 8))
    probs_q = SoftmaxOutputQuantizer(bits=4, num_heads=1, representation="row_log")
    scores_q.mode = probs_q.mode = "quant"
    k = torch.arange(24.0)
    jitter = torch.linspace(-0.4, 0.4, 24)
    s = (3.0 - (k + jitter) * LOG_STEP).reshape(1, 1, 1, -1)
    p = softq.softmax.softmax(scores_q(s), None)
    e = probs_q.int_repr(p).flatten()
    expected = torch.where(k < 15, torch.round(LOG_GAIN * 2 ** (-k / 2)), torch.zeros(24))
    torch.testing.assert_close(e, expected, rtol=0, atol=0)
    assert e[:15].tolist() == [87, 61, 43, 31, 22, 15, 11, 8, 5, 4, 3, 2, 1, 1, 1]
    torch.testing.assert_close(probs_q(p, None).flatten(), expected / expected.sum())
    with pytest.raises(ValueError, match="row_log codes are 4-bit, got 8 bits"):
        SoftmaxOutputQuantizer(bits=8, num_heads=1, representation="row_log")


def test_row_codes_fully_masked_row_gives_zeros() -> None:
    for representation in ("row", "row_exact", "row_log"):
        quantizer = SoftmaxOutputQuantizer(bits=4 if representation == "row_log" else 8, num_heads=2,
                                           representation=representation)
        quantizer.mode = "quant"
        valid = torch.ones(1, 1, 3, 5)
        valid[..., 1, :] = 0
        valid[..., 2, 3:] = 0
        probs = softq.softmax.softmax(torch.randn(2, 2, 3, 5), valid)
        out = quantizer(probs, valid)
        assert not torch.isnan(out).any()
        assert torch.all(out[:, :, 1] == 0) and torch.all(out[:, :, 2, 3:] == 0)
        assert torch.all(out[:, :, 2, :3].sum(-1) > 0.9)


def test_float_softmax_option_leaves_scores_and_probs_unquantized() -> None:
    qmodel = softq.quantize(tiny_model("gpt2"), calib_for("gpt2"), softq.QuantConfig(softmax_bits=None))
    for _, points in attention_points(qmodel):
        assert isinstance(points.scores, torch.nn.Identity)
        assert not isinstance(points.probs, SoftmaxOutputQuantizer)
        assert isinstance(points.q, ActQuantizer)


@pytest.mark.parametrize("correction", [None, "tensor", "head", "head_row"])
def test_causal_mask_stays_exactly_zero(correction: str | None) -> None:
    config = softq.QuantConfig(softmax_bits=4, bias_correction=correction, softmax_output="edge")
    qmodel = softq.quantize(tiny_model("gpt2"), calib_for("gpt2"), config)
    captured = capture_probs(qmodel)
    with torch.no_grad():
        qmodel(**tiny_inputs("gpt2"))
    seq = captured[0].shape[-1]
    future = torch.ones(seq, seq).triu(1).bool()
    for probs in captured:
        assert torch.all(probs[..., future] == 0)
        if correction is not None:
            assert torch.any(probs[..., ~future] != (probs[..., ~future] * 16).round() / 16), "beta not applied"


def test_padding_mask_stays_exactly_zero_and_padding_does_not_leak() -> None:
    config = softq.QuantConfig(bias_correction="head", softmax_output="edge")
    model = tiny_model("bert")
    qmodel = softq.quantize(model, calib_for("bert"), config)
    inputs = tiny_inputs("bert", seq=12)
    inputs["attention_mask"] = torch.tensor([[1] * 12, [1] * 8 + [0] * 4])
    captured = capture_probs(qmodel)
    with torch.no_grad():
        out = qmodel(**inputs).logits
        changed = {k: v.clone() for k, v in inputs.items()}
        changed["input_ids"][1, 9] = (changed["input_ids"][1, 9] + 7) % 64
        out_changed = qmodel(**changed).logits
    for probs in captured[: len(captured) // 2]:
        assert torch.all(probs[1, :, :, 8:] == 0)
    torch.testing.assert_close(out[1], out_changed[1], rtol=0, atol=0)


def test_changing_a_future_token_does_not_move_earlier_logits() -> None:
    qmodel = softq.quantize(tiny_model("opt"), calib_for("opt"), softq.QuantConfig(bias_correction="head_row",
                                                                                       softmax_output="edge"))
    inputs = tiny_inputs("opt")
    changed = {"input_ids": inputs["input_ids"].clone()}
    changed["input_ids"][:, 15] = (changed["input_ids"][:, 15] + 5) % 64
    with torch.no_grad():
        a, b = qmodel(**inputs).logits, qmodel(**changed).logits
    torch.testing.assert_close(a[:, :15], b[:, :15], rtol=0, atol=0)
    assert not torch.allclose(a[:, 15:], b[:, 15:])


def test_head_row_beta_follows_the_row_position() -> None:
    """Per-row beta by position: a causal model's calibrated rows keep theirs at any length, later rows and a KV
    cache's query rows (the last positions) take theirs or the per-head beta; a bidirectional model uses per-row
    beta at the calibrated length only."""
    quantizer = SoftmaxOutputQuantizer(bits=8, num_heads=2)
    quantizer.beta = torch.arange(8.0).reshape(1, 2, 4, 1)  # head h, row r: 4h + r
    quantizer.beta_head = torch.tensor([-1.0, -2.0]).reshape(1, 2, 1, 1)

    def rows(q_len: int, k_len: int) -> list[list[float]]:
        return quantizer.beta_for(torch.zeros(1, 2, q_len, k_len)).expand(1, 2, q_len, 1)[0, :, :, 0].tolist()

    quantizer.causal_rows = True
    assert rows(2, 2) == [[0, 1], [4, 5]]
    assert rows(6, 6) == [[0, 1, 2, 3, -1, -1], [4, 5, 6, 7, -2, -2]]
    assert rows(1, 3) == [[2], [6]]  # generating position 2 with positions 0-1 cached
    assert rows(2, 5) == [[3, -1], [7, -2]]
    quantizer.causal_rows = False
    assert rows(4, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rows(3, 3) == [[-1] * 3, [-2] * 3]
    assert rows(5, 5) == [[-1] * 5, [-2] * 5]

    def masked_rows(valid: torch.Tensor) -> list:
        q_len, k_len = valid.shape[-2], valid.shape[-1]
        return quantizer.beta_for(torch.zeros(valid.shape[0], 2, q_len, k_len), valid)[..., 0].tolist()

    # padding: a row's slot is its number of valid keys (causal) or, in a sequence of the calibrated length (4),
    # its position among the valid keys (bidirectional): as the sequence alone
    right = torch.tensor([1.0, 1, 1, 0]).expand(4, 4).reshape(1, 1, 4, 4)  # a 3-token sentence padded to 4
    assert masked_rows(torch.cat([torch.ones(1, 1, 4, 4), right])) == [[[0, 1, 2, 3], [4, 5, 6, 7]],
                                                                      [[-1] * 4, [-2] * 4]]  # as alone (length 3)
    four = torch.tensor([[1.0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]).reshape(2, 1, 1, 6).expand(2, 1, 6, 6)
    assert masked_rows(four) == [[[0, 1, 2, 3, -1, -1], [4, 5, 6, 7, -2, -2]],
                                 [[-1, -1, 0, 1, 2, 3], [-2, -2, 4, 5, 6, 7]]]  # 4 tokens padded to 6
    quantizer.causal_rows = True
    left = torch.ones(4, 4).tril()
    left[:, 0] = 0  # one pad token on the left: the real tokens are positions 0-2
    assert masked_rows(left.reshape(1, 1, 4, 4))[0] == [[-1, 0, 1, 2], [-2, 4, 5, 6]]  # row 0 (padding): per-head


def test_cached_decoding_with_head_row_correction_equals_the_full_pass() -> None:
    """With a KV cache the query rows are the last positions: they get those positions' beta (not row 0's).
    Calibrated on right-padded batches as a tokenizer pads them (the model's causality is the model's, not read
    off a calibration mask: a padded first example had made it bidirectional)."""
    calib = calib_for("gpt2")
    for batch in calib:
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["attention_mask"][0, -5:] = 0
    qmodel = softq.quantize(tiny_model("gpt2"), calib, softq.QuantConfig(bias_correction="head_row",
                                                                          softmax_output="edge"))
    assert all(points.probs.causal_rows for _, points in attention_points(qmodel))
    ids = tiny_inputs("gpt2", batch=1, seq=12, seed=3)["input_ids"]
    assert_cached_decoding_matches(qmodel, ids, prefix=8)


@pytest.mark.parametrize("family, side", [("gpt2", "left"), ("gpt2", "right"), ("bert", "right")])
def test_head_row_correction_is_the_same_for_a_sequence_alone_and_padded(family: str, side: str) -> None:
    """Per-row beta went by the row's index in the padded tensor: a left-padded GPT-2 token took another
    position's beta, and a BERT sentence right-padded to the calibrated length took per-row betas it does not
    get alone (per-head at its own length): padded and alone differed by as much as the quantization error."""
    calib = [tiny_inputs(family, seq=12, seed=s) for s in range(3)]
    qmodel = softq.quantize(tiny_model(family), calib, softq.QuantConfig(bias_correction="head_row",
                                                                          softmax_output="edge"))
    ids = tiny_inputs(family, batch=2, seq=12, seed=7)["input_ids"]
    mask = torch.ones_like(ids)
    real = slice(4, 12) if side == "left" else slice(0, 8)
    mask[1] = 0
    mask[1, real] = 1
    kwargs = {}
    if family == "gpt2":  # as generate() pads decoder batches: positions count the real tokens only
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        padded = qmodel(input_ids=ids, attention_mask=mask, **kwargs).logits[1, real]
        alone = qmodel(input_ids=ids[1:, real]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-5)


def test_bidirectional_sentence_of_the_calibrated_length_keeps_its_row_betas_when_padded() -> None:
    """A BERT sentence of the calibrated length (16) got its per-row betas alone and the per-head beta when padded
    in a batch, as far apart as the quantization error itself, on a model whose attention is not uniform (weights
    at initializer_range 0.2; the betas of the tiny default models are too small to see)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, initializer_range=0.2)
    model = transformers.BertModel(cfg).eval()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randint(3, 100, (4, 16), generator=g) for _ in range(4)]
    qmodel = softq.quantize(model, calib, softq.QuantConfig(softmax_output="edge", bias_correction="head_row"))
    probs = attention_points(qmodel)[0][1].probs
    assert probs.beta.shape[2] == 16 and (probs.beta - probs.beta_head).abs().max() > 1e-4
    for n in (15, 16, 17):
        x = torch.randint(3, 100, (1, n), generator=g)
        padded = torch.zeros(2, 24, dtype=torch.long)
        padded[0] = torch.randint(3, 100, (24,), generator=g)
        padded[1, :n] = x
        mask = torch.ones_like(padded)
        mask[1, n:] = 0
        with torch.no_grad():
            alone = qmodel(input_ids=x).last_hidden_state[0]
            in_batch = qmodel(input_ids=padded, attention_mask=mask).last_hidden_state[1, :n]
        torch.testing.assert_close(in_batch, alone, rtol=0, atol=1e-5)


def test_bidirectional_head_row_calibrated_on_several_lengths_is_per_head() -> None:
    """A bidirectional row's rounding error depends on the sequence's length: calibrated on one length, per-row
    beta (used at that length); on several, no row of one length stands for the others: the per-head beta."""
    one = softq.quantize(tiny_model("bert"), [tiny_inputs("bert", seq=20, seed=s) for s in range(2)],
                         softq.QuantConfig(bias_correction="head_row", softmax_output="edge"))
    mixed = softq.quantize(tiny_model("bert"), [tiny_inputs("bert", seq=n, seed=s) for s, n in enumerate((20, 16))],
                           softq.QuantConfig(bias_correction="head_row", softmax_output="edge"))
    for (_, a), (_, b) in zip(attention_points(one), attention_points(mixed)):
        assert not a.probs.causal_rows and a.probs.beta.shape == (1, 4, 20, 1)
        assert b.probs.beta.shape == (1, 4, 1, 1)


@pytest.mark.parametrize("variant,params", [("clipped", {"alpha": 0.5}), ("sigmoid_len", {})])
def test_row_codes_keep_the_mass_of_variants_that_do_not_sum_to_one(variant, params) -> None:
    """Clipped softmax and sigmoid attention rows sum to less than 1 (a head can do nothing): the default row codes
    keep that mass on the row-relative grid instead of dividing by the codes' sum (which set every quantized row's
    sum to 1: another function than the float model's)."""
    model = tiny_model("gpt2")
    softq.configure_attention(model, softmax=variant, **params)
    inputs = tiny_inputs("gpt2", seed=9)
    with torch.no_grad():
        ref = model(**inputs, output_attentions=True)
    qmodel = softq.quantize(model, calib_for("gpt2", 4), softq.QuantConfig())
    point = attention_points(qmodel)[0][1]
    assert not point.probs.sums_to_one
    with torch.no_grad():
        float_sums = ref.attentions[0].sum(-1)
        quant_sums = point.probs(ref.attentions[0], None).sum(-1)
        logits = qmodel(**inputs).logits
    assert float_sums.min() < 0.9 and (quant_sums - float_sums).abs().max() < 0.02
    assert (logits - ref.logits).abs().max() / ref.logits.abs().max() < 0.02
    # the flag follows the variant when it changes after quantization (it went stale until saved and loaded)
    softq.configure_attention(qmodel, softmax="softmax")
    assert point.probs.sums_to_one
    softq.configure_attention(qmodel, softmax=variant, **params)
    assert not point.probs.sums_to_one


def test_bias_correction_beta_is_the_mean_rounding_error_over_valid_entries() -> None:
    torch.manual_seed(0)
    quantizer = SoftmaxOutputQuantizer(bits=4, num_heads=3)
    quantizer.mode = "quant"
    quantizer.start_bias_measurement("head")
    valid = torch.ones(6, 6).tril()
    probs = [torch.softmax(torch.randn(2, 3, 6, 6).masked_fill(valid == 0, -math.inf), -1) for _ in range(3)]
    for p in probs:
        quantizer(p, valid)
    quantizer.finish_bias_measurement()
    err = torch.stack([(p - (p * 16).round().clamp(0, 15) / 16) * valid for p in probs])
    expected = err.sum(dim=(0, 1, 3, 4)) / (valid.sum() * 2 * 3)
    torch.testing.assert_close(quantizer.beta.reshape(-1), expected, rtol=1e-5, atol=1e-7)
    assert torch.all(quantizer.beta > 0), "rounding small probabilities to 0 biases the output down"


def _row_sums(qmodel, inputs) -> torch.Tensor:
    captured = capture_probs(qmodel)
    with torch.no_grad():
        qmodel(**inputs)
    return torch.stack([p.sum(-1) for p in captured])


def test_corrected_softmax_rows_sum_to_one() -> None:
    """At 4 bits on 96-key rows, uncorrected rows lose mass; head_row correction restores it."""
    model = tiny_model("bert")
    calib = [tiny_inputs("bert", batch=4, seq=96, seed=s) for s in range(4)]
    held_out = tiny_inputs("bert", batch=4, seq=96, seed=50)
    plain = softq.quantize(model, calib, softq.QuantConfig(softmax_bits=4, softmax_output="edge"))
    corrected = softq.quantize(model, calib, softq.QuantConfig(softmax_bits=4, bias_correction="head_row",
                                                               softmax_output="edge"))
    deficit_plain = (1 - _row_sums(plain, held_out)).abs().mean().item()
    deficit_corr = (1 - _row_sums(corrected, held_out)).abs().mean().item()
    assert deficit_plain > 0.05
    assert deficit_corr < 0.02
    assert deficit_corr < deficit_plain / 3
    # codes relative to the row max lose no mass: 'row' rows sum to 1, 'row_exact' within a few steps
    row = softq.quantize(model, calib, softq.QuantConfig(softmax_bits=4))
    exact = softq.quantize(model, calib, softq.QuantConfig(softmax_bits=4, softmax_output="row_exact"))
    assert (1 - _row_sums(row, held_out)).abs().max().item() < 1e-5
    assert (1 - _row_sums(exact, held_out)).abs().mean().item() < deficit_plain / 3


# --- bad input -------------------------------------------------------------------


def test_empty_calibration_set_is_refused() -> None:
    with pytest.raises(CalibrationDataError, match="empty"):
        softq.quantize(tiny_model("gpt2"), [])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_calibration_batch_is_named(bad: float) -> None:
    calib = calib_for("vit", 4)
    calib[2]["pixel_values"][0, 0, 3, 3] = bad
    with pytest.raises(CalibrationDataError, match=r"batch 2: 'pixel_values' contains (NaN|Inf)"):
        softq.quantize(tiny_model("vit"), calib)


def test_a_model_computing_nan_names_the_point_and_batch() -> None:
    """Finite inputs, a NaN weight: the error said only "non-finite activation (NaN or Inf) reached an observer"."""
    model = tiny_model("bert")
    with torch.no_grad():
        model.bert.encoder.layer[1].intermediate.dense.weight[3, 5] = math.nan
    with pytest.raises(CalibrationDataError, match=r"the model computes NaN or Inf at "
                                                   r"bert\.encoder\.layer\.1\.output\.dense\..*input"):
        softq.quantize(model, calib_for("bert", 2))


def test_a_family_that_computes_attention_in_its_own_forward_is_refused_in_one_line() -> None:
    deberta = transformers.DebertaV2Model(transformers.DebertaV2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(UnsupportedModelError, match=r"model_type 'deberta-v2': it computes attention in its own "
                                                    r"forward \(in DebertaV2Attention.*\), not through Hugging Face"):
        softq.quantize(deberta, [torch.randint(0, 64, (1, 8))])
    with pytest.raises(UnsupportedModelError, match="a Linear has no Hugging Face config"):
        softq.quantize(torch.nn.Linear(4, 4), [torch.randn(1, 4)])


@pytest.mark.parametrize("field", ["weight_bits", "act_bits", "softmax_bits"])
@pytest.mark.parametrize("bits", [1, 17, 0])
def test_bits_outside_2_to_16_are_refused(field: str, bits: int) -> None:
    with pytest.raises(ValueError, match=f"{field} must be an integer from 2 to 16"):
        softq.QuantConfig(**{field: bits})


@pytest.mark.parametrize("fields, message", [
    ({"softmax_bits": None, "softmax_input": "row"}, "softmax_input='row' sets the grid of a quantized softmax"),
    ({"softmax_bits": None, "softmax_input": "tensor"}, "softmax_input='tensor' sets the grid"),
    ({"softmax_bits": None, "softmax_output": "edge", "softmax_scale": "calibrated"}, "softmax_scale='calibrated'"),
    ({"smoothing_into_v": True, "input_smoothing": None}, "input_smoothing=None leaves nothing to fold"),
    ({"smoothing_into_v": True, "weight_per_channel": False}, "needs per-channel weight codes"),
])
def test_config_settings_that_would_do_nothing_are_refused(fields: dict, message: str) -> None:
    """Accepted, and the model came out exactly as without them (the softmax stays float with softmax_bits=None;
    no smoothing, or per-tensor weights, fold nothing into V), as bias_correction without softmax_bits is refused."""
    with pytest.raises(ValueError, match=message):
        softq.QuantConfig(**fields)
    softq.QuantConfig(softmax_bits=None, softmax_input="float")  # says what softmax_bits=None does: fine
    softq.QuantConfig(smoothing_into_v=True)  # input_smoothing="auto" may pick a smoothing to fold


def test_export_cli_config_for_a_float_softmax_sets_no_score_grid() -> None:
    """softq export --softmax int --softmax-bits 0 asked QuantConfig for score codes of a float softmax, which it now
    refuses with advice (drop softmax_input) the CLI gives no way to follow."""
    import argparse

    from softq.export.cli import _config

    args = argparse.Namespace(softmax="int", softmax_output="row", softmax_bits=0, bias_correction=None)
    assert _config(args).softmax_bits is None and _config(args).softmax_input == "auto"
    assert _config(argparse.Namespace(**{**vars(args), "softmax_bits": 8})).softmax_input == "row"


def test_inputs_that_do_not_fit_the_model_are_refused() -> None:
    with pytest.raises(CalibrationDataError, match="exceeds the model's 128 positions"):
        softq.quantize(tiny_model("gpt2"), [torch.randint(0, 64, (1, 200))])
    with pytest.raises(CalibrationDataError, match=r"token ids must be in \[0, 64\)"):
        softq.quantize(tiny_model("gpt2"), [torch.randint(60, 90, (1, 8))])
    with pytest.raises(CalibrationDataError, match=r"pixel_values must be \[batch, 1, 16, 16\]"):
        softq.quantize(tiny_model("vit"), [torch.randn(1, 3, 16, 16)])
    with pytest.raises(CalibrationDataError, match=r"input_ids must be \[batch, seq\]"):
        softq.quantize(tiny_model("bert"), [torch.randint(0, 64, (8,))])
    # one-token sequences with [CLS] scales of their own: every value went to the prefix row's quantizers, and the
    # others failed with "observer saw no data", naming no layer and not why
    with pytest.raises(CalibrationDataError, match=r"no calibration value reached .*input_act; the model gives its "
                                                   r"first 1 position\(s\) scales of their own.*of 1 token"):
        softq.quantize(tiny_model("bert"), [torch.randint(0, 64, (2, 1))], softq.QuantConfig(softmax_output="edge"))


@pytest.mark.parametrize("field, value, message", [
    ("weight_per_channel", "no", "weight_per_channel must be True or False"),
    ("act_symmetric", 2, "act_symmetric must be True or False"),
    ("percentile", "99", r"percentile must be a number in \(50, 100\]"),
    ("percentile", 40.0, r"percentile must be a number in \(50, 100\]"),
    ("percentile", 90.0, "observer='minmax' does not read it"),  # was ignored: the min-max ranges
    ("smoothquant_alpha", "0.5", r"smoothquant_alpha must be in \[0, 1\] or None"),
    ("smoothquant_alpha", True, r"smoothquant_alpha must be in \[0, 1\] or None"),
    ("exclude", "classifier", "exclude must be a tuple of module-name substrings"),
    ("exclude", None, "exclude must be a tuple of module-name substrings"),
    ("exclude", [1, 2], "exclude must be a tuple of module-name substrings"),
])
def test_config_fields_of_the_wrong_type_are_refused(field: str, value: object, message: str) -> None:
    # each of these was accepted (and, for the two booleans, silently read as True) or failed deep inside quantize
    with pytest.raises(ValueError, match=message):
        softq.QuantConfig(**{field: value})
    assert softq.QuantConfig(exclude=["classifier"]).exclude == ("classifier",)


def test_misuse_of_quantize_is_named() -> None:
    model, calib = tiny_model("bert"), calib_for("bert", 2)
    with pytest.raises(TypeError, match="config must be a softq.QuantConfig, got a dict"):
        softq.quantize(model, calib, {"weight_bits": 4})
    for bad in (None, 5, "text"):
        with pytest.raises(CalibrationDataError, match="calib_data must be an iterable of batches"):
            softq.quantize(model, bad)
    qmodel = softq.quantize(model, calib, softq.QuantConfig(input_smoothing=None))
    with pytest.raises(ValueError, match="already quantized"):
        softq.quantize(qmodel, calib)
    # a typo in exclude used to match nothing and quantize everything without a word
    with pytest.raises(ValueError, match="'layer.0.attention.self.qery' matches no module name"):
        softq.quantize(model, calib, softq.QuantConfig(exclude=("layer.0.attention.self.qery",)))
    # a batch whose attention mask selects no token (a single empty row among valid ones is fine)
    empty = {**calib[0], "attention_mask": torch.zeros_like(calib[0]["input_ids"])}
    with pytest.raises(CalibrationDataError, match="batch 1: attention_mask is all zeros"):
        softq.quantize(model, [calib[1], empty])
    # an additive float mask (0 at real tokens, -inf at padding): read as 0/1, calibration would observe the padding
    additive = {**calib[0], "attention_mask": torch.zeros(calib[0]["input_ids"].shape)}
    for pad in (float("-inf"), -10000.0):
        additive["attention_mask"][0, -2:] = pad
        with pytest.raises(CalibrationDataError, match=f"batch 0: attention_mask must be 1 at real tokens and 0 at padding.*{pad:g}"):
            softq.quantize(model, [additive])
    additive["attention_mask"][0, -2:] = float("nan")
    with pytest.raises(CalibrationDataError, match="batch 0: 'attention_mask' contains NaN"):
        softq.quantize(model, [additive])
    four_d = {**calib[0], "attention_mask": torch.zeros(calib[0]["input_ids"].shape)[:, None, None, :]}
    with pytest.raises(CalibrationDataError, match="batch 0: attention_mask is all zeros"):
        softq.quantize(model, [four_d])
    one_empty = {**calib[0], "attention_mask": torch.ones_like(calib[0]["input_ids"])}
    one_empty["attention_mask"][0] = 0
    softq.quantize(model, [calib[1], one_empty], softq.QuantConfig(input_smoothing=None))


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_bfloat16_models_quantize(family: str) -> None:
    # GPT-2 in bfloat16 failed in P.V (float32 probabilities from the quantizers against bfloat16 V)
    calib = calib_for(family)
    q = softq.quantize(tiny_model(family).to(torch.bfloat16), calib)
    x = tiny_inputs(family, seed=9)
    with torch.no_grad():
        ref, out = tiny_model(family)(**x).logits, q(**x).logits.float()
    assert torch.nn.functional.cosine_similarity(ref.flatten(), out.flatten(), dim=0) > 0.999


@pytest.mark.parametrize("variant", ["2relu", "softpick", "2quad"])
def test_float16_models_with_all_zero_probability_rows_stay_finite(variant: str) -> None:
    """The softmax-output quantizer's floors (1e-12) round to 0 in float16: a row of zero probabilities (2ReLU or
    softpick with no positive score, a left-padded 2Quad row) gave 0 / 0, and every logit of a float16 GPT-2 came
    out NaN.  Half-precision points now quantize in float32 (the codes of the same values in float32)."""
    from softq.attention import configure_attention

    model = tiny_model("gpt2")
    configure_attention(model, softmax=variant)
    x = tiny_inputs("gpt2", seed=9)
    x["attention_mask"] = torch.ones_like(x["input_ids"])
    x["attention_mask"][0, : x["input_ids"].shape[1] // 2] = 0  # a left-padded row
    with torch.no_grad():
        ref = model(**x).logits
    q = softq.quantize(model.to(torch.float16), calib_for("gpt2"), softq.QuantConfig(input_smoothing=None))
    with torch.no_grad():
        out = q(**x).logits.float()
    valid = x["attention_mask"].bool()
    assert torch.isfinite(out[valid]).all()
    assert torch.nn.functional.cosine_similarity(ref[valid].flatten(), out[valid].flatten(), dim=0) > 0.99


def test_float16_weights_with_all_zero_rows_stay_finite() -> None:
    """A padding token's embedding row is all zeros (RoBERTa, nn.Embedding(padding_idx=...)); the weight scale floor
    1e-10 rounds to 0 in float16, so its codes were 0 / 0: NaN embeddings for every padded sequence, with and
    without gradients (Brevitas' quantizer on the gradient path)."""
    model = tiny_model("roberta")
    with torch.no_grad():
        model.roberta.embeddings.word_embeddings.weight[1] = 0  # the padding row, as from_pretrained leaves it
        model.classifier.dense.weight[3] = 0  # an all-zero output row of a Linear
    q = softq.quantize(model.to(torch.float16), calib_for("roberta"))
    x = tiny_inputs("roberta", seed=9)
    x["attention_mask"] = torch.ones_like(x["input_ids"])
    x["input_ids"][1, -4:], x["attention_mask"][1, -4:] = 1, 0  # padded with the pad id
    with torch.no_grad():
        ref = q(**x).logits
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(q(**x).logits.detach(), ref, rtol=0, atol=0)  # gradient path: the same codes
    emb = q.roberta.embeddings.word_embeddings
    assert not emb(torch.tensor([1])).any() and not q.classifier.dense.dequantized_weight()[3].any()
    with torch.no_grad():  # training mode (dropout on) without gradients took Brevitas' float16 path: NaN
        assert torch.isfinite(q.train()(**x).logits).all()
    q.eval()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_have_the_same_codes_with_and_without_gradients(dtype) -> None:
    """With gradients on (a plain q(**x)), Brevitas computed bfloat16 codes in bfloat16: others than the inference
    path's (and the export's) float32 codes of the same weights."""
    q = softq.quantize(tiny_model("bert").to(dtype), calib_for("bert"), softq.QuantConfig(input_smoothing=None))
    x = tiny_inputs("bert", seed=9)
    with torch.no_grad():
        ref = q(**x).logits
    torch.testing.assert_close(q(**x).logits.detach(), ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_codes_are_the_float32_codes_of_the_same_values(dtype) -> None:
    """Quantizer arithmetic in float16 / bfloat16 rounded some codes differently from float32 on the very same values,
    so a half-precision model could not match its float32 export."""
    from softq.quant.config import softmax_input_span
    from softq.quant.quantizers import RowScoresQuantizer

    g = torch.Generator().manual_seed(0)
    s = (torch.randn(1, 2, 16, 512, generator=g) * 2 + 10).to(dtype)
    valid = torch.ones(16, 512).tril(512 - 16)
    rows = RowScoresQuantizer(8, softmax_input_span("row", 8))
    out = SoftmaxOutputQuantizer(8, 2, "fixed", "row")
    act = ActQuantizer(8, signed=True)
    act.scale.fill_(0.037)
    for point in (rows, out, act):
        point.mode = "quant"
    probs = torch.softmax(s.float(), -1).to(dtype)
    assert torch.equal(rows.int_repr(s, valid), rows.int_repr(s.float(), valid))
    assert torch.equal(out.int_repr(probs), out.int_repr(probs.float()))
    assert torch.equal(act.int_repr(s), act.int_repr(s.float()))
    with torch.no_grad():
        ref = rows(s.float(), valid)  # dropped keys (code 0) are each dtype's lowest number
        ref = ref.masked_fill(ref == torch.finfo(torch.float32).min, torch.finfo(dtype).min)
        for got, ref in ((rows(s, valid), ref), (out(probs, None), out(probs.float(), None)), (act(s), act(s.float()))):
            assert got.dtype == dtype
            torch.testing.assert_close(got, ref.to(dtype), rtol=0, atol=0)


def test_meta_weights_and_inputs_without_the_main_input_are_one_line() -> None:
    """A meta-device model (or batch) failed 40 frames deep in an observer's .item(); a ViT given text batches with an
    AttributeError inside transformers."""
    with torch.device("meta"):
        meta = tiny_model("bert")
    with pytest.raises(ValueError, match="weights are on the meta device"):
        softq.quantize(meta, calib_for("bert"))
    ids = {k: v.to("meta") for k, v in calib_for("bert")[0].items()}
    with pytest.raises(CalibrationDataError, match="'input_ids' is on the meta device"):
        softq.quantize(tiny_model("bert"), [ids])
    with pytest.raises(CalibrationDataError, match="has no 'pixel_values' .*ViTForImageClassification takes pixel_values"):
        softq.quantize(tiny_model("vit"), calib_for("bert"))


def test_integer_images_are_refused() -> None:
    # uint8 pixels (an image file's bytes, not the processor's normalised floats) calibrate ranges 100x too wide
    images = [torch.randint(0, 256, (2, 1, 16, 16), dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(CalibrationDataError, match="pixel_values are uint8; pass float images"):
        softq.quantize(tiny_model("vit"), images)


def test_bias_correction_without_quantized_softmax_is_refused() -> None:
    with pytest.raises(ValueError, match="needs softmax_bits"):
        softq.QuantConfig(softmax_bits=None, bias_correction="head")


def test_softmax_output_is_validated() -> None:
    with pytest.raises(ValueError, match="softmax_output must be one of"):
        softq.QuantConfig(softmax_output="log2")
    with pytest.raises(ValueError, match="applies to softmax_output='edge' only"):
        softq.QuantConfig(softmax_scale="calibrated")
    assert softq.QuantConfig(softmax_scale="calibrated", softmax_output="edge").softmax_output == "edge"
    assert softq.QuantConfig().softmax_output == "row"
    with pytest.raises(ValueError, match="zero by construction for softmax_output='row'"):
        softq.QuantConfig(bias_correction="head")
    assert softq.QuantConfig(bias_correction="head", softmax_output="row_exact").bias_correction == "head"
    # row_log: 4-bit log codes on the row-relative score grid only
    assert softq.QuantConfig(softmax_bits=4, softmax_output="row_log").row_relative_input
    with pytest.raises(ValueError, match="'row_log' is defined for 4-bit softmax outputs.*got softmax_bits=8"):
        softq.QuantConfig(softmax_output="row_log")
    with pytest.raises(ValueError, match="'row_log' needs the row-relative softmax input"):
        softq.QuantConfig(softmax_bits=4, softmax_output="row_log", softmax_input="tensor")
    with pytest.raises(ValueError, match="'row_log' needs act_bits >= 4"):
        softq.QuantConfig(softmax_bits=4, softmax_output="row_log", act_bits=3)
    with pytest.raises(ValueError, match="zero by construction for softmax_output='row_log'"):
        softq.QuantConfig(softmax_bits=4, softmax_output="row_log", bias_correction="head")


def test_residual_stream_quantized_only_with_the_edge_softmax_by_default() -> None:
    from softq.quant.layers import QLayerNorm

    calib = [tiny_inputs("bert", seed=s) for s in range(2)]
    x = tiny_inputs("bert", seed=5)

    def norms(config):
        q = softq.quantize(tiny_model("bert"), calib, config)
        with torch.no_grad():
            assert torch.isfinite(q(**x).logits).all()
        return [m for m in q.modules() if isinstance(m, QLayerNorm)]

    assert not norms(softq.QuantConfig())  # row: LayerNorm inputs stay float
    assert not norms(softq.QuantConfig(softmax_output="row_exact"))
    edge = norms(softq.QuantConfig(softmax_output="edge"))
    assert edge and all(m.input_act.mode == "quant" for m in edge)
    assert norms(softq.QuantConfig(quantize_residual=True))
    assert not norms(softq.QuantConfig(softmax_output="edge", quantize_residual=False))
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="quantize_residual must be True, False or 'auto'"):
            softq.QuantConfig(quantize_residual=bad)
    for layout in ({"residual_groups": 4}, {"residual_prefix": 0}):  # would silently do nothing
        with pytest.raises(ValueError, match="lay out a quantized residual stream.*set quantize_residual=True"):
            softq.QuantConfig(**layout)
        assert softq.QuantConfig(softmax_output="edge", **layout).residual_quantized


def _padded_calib(n: int = 3) -> list[dict[str, torch.Tensor]]:
    batches = []
    for i in range(n):
        x = tiny_inputs("bert", seed=30 + i)
        mask = torch.ones_like(x["input_ids"])
        mask[1, 10:] = 0  # the second text padded
        batches.append({**x, "attention_mask": mask})
    return batches


def test_weight_bias_correction_takes_the_rounding_shift_of_each_linear_off_its_bias() -> None:
    """On the calibration batches' valid tokens, each corrected Linear's mean output with its int weights equals
    the mean with its float weights on the same quantized inputs (those the uncorrected model feeds it: the
    correction is measured in one pass before any bias changes); padded tokens do not count."""
    model = tiny_model("bert")
    calib = _padded_calib()
    cfg = softq.QuantConfig(weight_bits=4)  # coarse weights: shifts well above float noise
    fixed = softq.quantize(model, calib, cfg)
    plain = softq.quantize(model, calib, softq.QuantConfig(weight_bits=4, weight_bias_correction=False))
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [m.input_act.register_forward_hook(lambda _q, _i, out, n=n: seen.setdefault(n, []).append(out.detach()))
             for n, m in plain.named_modules() if isinstance(m, QLinear)]
    with torch.no_grad():
        for b in calib:
            plain(**b)
    for h in hooks:
        h.remove()
    layers = dict(fixed.named_modules())
    assert set(seen) == {n for n, m in fixed.named_modules() if isinstance(m, QLinear)}
    worst_before = worst_after = 0.0
    for name, inputs in seen.items():
        layer, twin = layers[name], dict(plain.named_modules())[name]
        assert twin.bias_shift.numel() == 0 and torch.equal(twin.bias, layer.bias)  # the float bias stays as trained
        assert layer.bias_shift.shape == (layer.out_features,)
        valid = [b["attention_mask"].bool() for b in calib]
        with torch.no_grad():
            def mean(weight: torch.Tensor, bias: torch.Tensor, masked: bool = True) -> torch.Tensor:
                rows = [torch.nn.functional.linear(x, weight, bias) for x in inputs]  # (a head reads [batch, features])
                rows = [y[v] if masked and y.shape[:-1] == v.shape else y.reshape(-1, y.shape[-1])
                        for y, v in zip(rows, valid)]
                return torch.cat(rows).double().mean(0)
            target = mean(layer.weight, layer.bias)
            before = (mean(layer.dequantized_weight(), layer.bias) - target).abs().max().item()
            after = (mean(layer.dequantized_weight(), layer.effective_bias()) - target).abs().max().item()
            unmasked = (mean(layer.dequantized_weight(), layer.effective_bias(), masked=False)
                        - mean(layer.weight, layer.bias, masked=False)).abs().max().item()
        assert after < 1e-5 * max(1.0, target.abs().max().item())
        worst_before, worst_after = max(worst_before, before), max(worst_after, after)
        if inputs[0].shape[:-1] == valid[0].shape:
            assert unmasked > after  # the padded tokens are left out of the mean
    assert worst_before > 100 * worst_after
    x = tiny_inputs("bert", seed=3)
    with torch.no_grad():  # the correction is the only difference between the two models
        assert not torch.equal(fixed(**x).logits, plain(**x).logits)
        for layer in (m for m in fixed.modules() if isinstance(m, QLinear)):
            layer.bias_shift = torch.zeros(0)
        torch.testing.assert_close(fixed(**x).logits, plain(**x).logits, rtol=0, atol=0)


def test_weight_bias_correction_of_a_weight_only_patch_convolution() -> None:
    """A ViT's patch convolution (weight-only int8 codes): its bias gets the mean shift of the rounded kernel over
    the calibration images and patch positions; switching the weight codes off (sensitivity) drops it too."""
    from softq.quant.layers import BiasShift
    from softq.quant.sensitivity import enable_only

    model = tiny_model("vit")
    calib = calib_for("vit", 3)
    q = softq.quantize(model, calib, softq.QuantConfig(weight_bits=4))
    conv = next(m for m in q.modules() if isinstance(m, torch.nn.Conv2d))
    assert isinstance(conv.parametrizations.bias[0], BiasShift)
    original = conv.parametrizations.weight.original
    images = torch.cat([b["pixel_values"] for b in calib])
    with torch.no_grad():
        def mean(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.conv2d(images, weight, bias, conv.stride, conv.padding).double().mean((0, 2, 3))
        target = mean(original, conv.parametrizations.bias.original)
        before = (mean(conv.weight, conv.parametrizations.bias.original) - target).abs().max().item()
        after = (mean(conv.weight, conv.bias) - target).abs().max().item()
    assert after < 1e-6 and before > 100 * after
    from softq.quant.weight_bias import correct_weight_bias

    shift = conv.parametrizations.bias[0].shift.clone()
    assert correct_weight_bias(q, calib) == 1 + sum(isinstance(m, QLinear) for m in q.modules())
    assert len(conv.parametrizations.bias) == 1  # measured again: the same shift, not a second one on top
    torch.testing.assert_close(conv.parametrizations.bias[0].shift, shift, rtol=0, atol=1e-7)
    enable_only(q, set())
    assert torch.equal(conv.bias, conv.parametrizations.bias.original) and torch.equal(conv.weight, original)
    x = tiny_inputs("vit", seed=4)
    with torch.no_grad():
        float_out = model(**x).logits
        assert (q(**x).logits - float_out).abs().max() < 1e-5  # every correction off with its quantizer
    plain = softq.quantize(model, calib, softq.QuantConfig(weight_bits=4, weight_bias_correction=False))
    conv_plain = next(m for m in plain.modules() if isinstance(m, torch.nn.Conv2d))
    assert "bias" not in conv_plain.parametrizations


def test_weight_bias_correction_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="weight_bias_correction must be True or False, got 'yes'"):
        softq.QuantConfig(weight_bias_correction="yes")


def test_inference_uses_the_weights_after_updates_the_version_counter_misses() -> None:
    """Inference reused a dequantized weight cached by version counter and storage: a fused AdamW step (which moves
    neither) left the no-grad outputs on the old weights, far from the grad-enabled ones.  The cache is dropped
    on the gradient path and on every mode change (the documented way after editing ``.data``)."""
    import copy

    model = tiny_model("bert")
    calib = [tiny_inputs("bert", seed=s) for s in range(2)]
    qmodel = softq.quantize(model, calib)
    x = tiny_inputs("bert", seed=5)
    labels = torch.tensor([0, 1])

    def both(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            plain = m(**x).logits
        return plain, m(**x).logits.detach()

    with torch.no_grad():
        before = qmodel(**x).logits
    for switch_modes in (True, False, None):  # a step in train mode; in eval mode; and a metric between
        tuned = copy.deepcopy(qmodel)  # backward and step, in eval mode (no mode change after the step)
        with torch.no_grad():
            tuned(**x)  # the cache filled before the step
        opt = torch.optim.AdamW(tuned.parameters(), lr=0.05, fused=True)
        tuned.train(bool(switch_modes))
        tuned(**x, labels=labels).loss.backward()
        if switch_modes is None:
            tuned.eval()
            with torch.no_grad():
                tuned(**x)
        opt.step()
        if switch_modes is not None:
            tuned.eval()
        plain, grad = both(tuned)
        assert (plain - before).abs().max() > 1e-2  # the step moved the model
        torch.testing.assert_close(plain, grad, rtol=0, atol=1e-5)
    layer = qmodel.bert.encoder.layer[0].output.dense  # copy.copy goes through pickling's __reduce_ex__ too
    assert copy.copy(layer).weight is layer.weight
    edited = copy.deepcopy(qmodel)
    with torch.no_grad():
        edited(**x)  # fills the cache
    edited.bert.encoder.layer[0].attention.self.query.weight.data.mul_(3.0)
    edited.bert.embeddings.word_embeddings.weight.data.mul_(3.0)
    edited.eval()
    plain, grad = both(edited)
    assert (plain - before).abs().max() > 1e-2
    torch.testing.assert_close(plain, grad, rtol=0, atol=1e-5)


def test_tracing_a_copied_quantized_model() -> None:
    """torch.jit.trace of a quantized model whose weight cache was empty (a deep copy, a loaded model) recorded
    the cache-filling branch and failed its own check ("Graphs differed across invocations"); traced and compiled
    code computes the dequantized weight in the graph."""
    import copy

    qmodel = softq.quantize(tiny_model("bert"), [tiny_inputs("bert", seed=s) for s in range(2)])
    twin = copy.deepcopy(qmodel)
    x = tiny_inputs("bert", seed=5)["input_ids"]
    with torch.no_grad():
        traced = torch.jit.trace(twin, (x,), strict=False)
        ref = qmodel(x).logits
    torch.testing.assert_close(traced(x)["logits"], ref, rtol=0, atol=1e-6)


def test_torch_compile_fullgraph_of_a_quantized_model() -> None:
    """torch.compile(fullgraph=True) failed on the weight cache's data_ptr key ("Data pointer comparison"), and the
    default compile broke the graph at every activation quantizer (.item()) and hit the recompile limit."""
    qmodel = softq.quantize(tiny_model("bert"), [tiny_inputs("bert", seed=s) for s in range(2)])
    x = tiny_inputs("bert", seed=5)["input_ids"]
    with torch.no_grad():
        compiled = torch.compile(qmodel, fullgraph=True)(x).logits
        ref = qmodel(x).logits
    torch.testing.assert_close(compiled, ref, rtol=0, atol=1e-6)


def test_auto_searches_free_their_trial_copies() -> None:
    """input_smoothing="auto" and smoothing_into_v="auto" try candidates on copies of the model; Brevitas'
    quantizers hold reference cycles, so a copy left to the cyclic collector stayed in memory (seven copies of a
    650M-parameter OPT ran a 24 GB machine out of memory).  With the collector off, no copy survives quantize (of a
    model of 64 MiB or more: smaller ones are left to the collector)."""
    import gc

    from softq.quant.layers import QLinear

    import softq.quant.copies as copies
    import softq.quant.quantize as qmod
    import softq.quant.smoothing_search as search
    import softq.quant.v_fold as v_fold

    copiers = (qmod, search, v_fold)  # the modules that copy the model during quantize
    model, calib = tiny_model("bert"), calib_for("bert", 4)
    live: list[int] = []  # quantized Linears alive as each copy is made
    copy_of = copies.independent_copy

    def counting_copy(m, *shared):  # noqa: ANN001, ANN002, ANN202
        live.append(sum(type(o) is QLinear and id(o) not in earlier for o in gc.get_objects()))
        return copy_of(m, *shared)

    gc.collect()
    gc.disable()
    earlier = {id(o) for o in gc.get_objects() if type(o) is QLinear}  # other tests' models a fixture still holds
    for module in copiers:
        module.independent_copy = counting_copy
    above, copies.COLLECT_ABOVE_BYTES = copies.COLLECT_ABOVE_BYTES, 0  # as for a model of 64 MiB or more
    try:
        qmodel = softq.quantize(model, calib, softq.QuantConfig(input_smoothing="auto", smoothing_into_v="auto"))
        mine = {id(m) for m in qmodel.modules()}
        stray = [o for o in gc.get_objects() if type(o) is QLinear and id(o) not in mine and id(o) not in earlier]
    finally:
        for module in copiers:
            module.independent_copy = copy_of
        copies.COLLECT_ABOVE_BYTES = above
        gc.enable()
    per_model = sum(isinstance(m, QLinear) for m in qmodel.modules())
    assert len(qmodel.softq_smoothing_errors) >= 4 and not stray, len(stray)  # candidates were tried, none is left
    assert max(live) <= 2 * per_model, (live, per_model)  # the model and the observed copy, no trial piling up


def test_uncached_weights_is_per_thread() -> None:
    """quantize turns the weight cache off for its own runs; with one flag for the process, a quantize in another
    thread made this thread's inference recompute its weights, and two overlapping calls left it off for good."""
    import threading

    from softq.quant.weight_cache import _caching, uncached_weights

    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with uncached_weights():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    inside.wait(10)
    assert _caching.get()  # this thread still caches while the other quantizes
    with uncached_weights():  # overlapping: entered after the other thread, left before it
        assert not _caching.get()
    release.set()
    thread.join()
    assert _caching.get()


def test_quantize_keeps_no_dequantized_weights_while_calibrating() -> None:
    """Each model quantize ran (the observed copy, every smoothing candidate, the weight bias correction's passes)
    kept its dequantized weights (the inference cache, a float copy of the model each): with the float model, the
    observed copy and a candidate, a 1.3B-parameter model's search ran out of 24 GB.  None is kept while
    calibrating now; the quantized model makes its cache when it is first run."""
    import gc

    from softq.quant.layers import QLinear

    import softq.quant.copies as copies
    import softq.quant.quantize as qmod
    import softq.quant.smoothing_search as search
    import softq.quant.v_fold as v_fold

    copiers = (qmod, search, v_fold)  # the modules that copy the model during quantize
    model, calib = tiny_model("bert"), calib_for("bert", 4)
    before = {id(o) for o in gc.get_objects() if type(o) is QLinear}
    cached: list[int] = []  # quantized Linears holding a dequantized weight as each copy is made
    copy_of = copies.independent_copy

    def counting_copy(m, *shared):  # noqa: ANN001, ANN002, ANN202
        cached.append(sum(type(o) is QLinear and id(o) not in before and o._cache is not None
                          for o in gc.get_objects()))
        return copy_of(m, *shared)

    for module in copiers:
        module.independent_copy = counting_copy
    try:
        qmodel = softq.quantize(model, calib, softq.QuantConfig(input_smoothing="auto", smoothing_into_v="auto"))
    finally:
        for module in copiers:
            module.independent_copy = copy_of
    assert len(cached) >= 4 and max(cached) == 0, cached
    assert all(m._cache is None for m in qmodel.modules() if isinstance(m, QLinear))
    with torch.no_grad():
        qmodel(**calib[0])
    assert all(m._cache is not None for m in qmodel.modules() if isinstance(m, QLinear))
