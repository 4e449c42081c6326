"""Residual-stream scales of their own for special prefix tokens (QuantConfig.residual_prefix), the
one-pass input smoothing of softq.quantize, and the inference caches of quantized weights."""

from __future__ import annotations

import copy
import functools

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from conftest import assert_cached_decoding_matches, tiny_inputs, tiny_model

import softq
from softq.calib.smoothquant import smooth_inputs
from softq.quant.layers import QEmbedding, QLayerNorm, QLinear
from softq.quant.points import residual_prefix
from softq.quant.quantizers import ActQuantizer, dequantized_weight

# the residual stream quantized (the default only with the edge softmax): what prefix scales are for
RQ = functools.partial(softq.QuantConfig, quantize_residual=True)


def fresh_deit(seed: int = 0) -> torch.nn.Module:
    """A DeiT as its config builds it: CLS and distillation tokens start at exactly 0."""
    torch.manual_seed(seed)
    cfg = transformers.DeiTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, intermediate_size=128, num_labels=10)
    return transformers.DeiTForImageClassification(cfg).eval()


def rel_error(qmodel, model, x) -> float:
    with torch.no_grad():
        ref = model(pixel_values=x).logits
        return float((qmodel(pixel_values=x).logits - ref).norm() / ref.norm())


def test_fresh_deit_logits_within_10_percent_only_with_prefix_scales() -> None:
    model = fresh_deit()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(8, 3, 32, 32, generator=g) for _ in range(2)]
    x = torch.randn(16, 3, 32, 32, generator=g)
    shared = rel_error(softq.quantize(model, calib, RQ(residual_prefix=0)), model, x)
    default = rel_error(softq.quantize(model, calib, RQ()), model, x)
    assert shared > 0.15, f"the failure this fixes did not show: {shared:.3f}"
    assert default < 0.10, f"W8A8 relative logit error {default:.3f} with [CLS]/distillation scales"


def test_prefix_rows_get_their_own_scales_and_the_rest_ignores_them() -> None:
    act = ActQuantizer(8, False, prefix=2)
    act.mode = "observe"
    x = torch.rand(3, 10, 6)
    x[:, 0] *= 0.01  # a [CLS]-like row far below the others
    x[:, 1] *= 100.0  # an outlier row
    assert act(x) is x  # observing passes the input through untouched
    act.finish_calibration()
    act.mode = "quant"
    assert act.prefix[0].scale < act.scale < act.prefix[1].scale
    with torch.no_grad():
        y = act(x)
    per_row = torch.cat([act.prefix[0](x[:, :1]), act.prefix[1](x[:, 1:2]), act._forward(x[:, 2:])], dim=1)
    assert torch.equal(y, per_row)
    assert (y[:, 0] - x[:, 0]).abs().max() <= act.prefix[0].scale / 2 + 1e-9
    assert torch.equal(act(x[:, :1]), act.prefix[0](x[:, :1]))  # shorter than the prefix: still exact
    flat = torch.rand(4, 6)  # no sequence axis: the main scales only
    assert torch.equal(act(flat), act._forward(flat))


def test_auto_prefix_follows_the_family_and_causal_lms_take_one_only_when_asked() -> None:
    cfg = RQ()
    assert residual_prefix(tiny_model("bert"), cfg) == 1
    assert residual_prefix(tiny_model("deit"), cfg) == 2
    assert residual_prefix(tiny_model("gpt2"), cfg) == 0
    assert residual_prefix(tiny_model("gpt2"), RQ(residual_prefix=1)) == 1
    for bad in (-1, 9, 1.5, True, "all"):
        with pytest.raises(ValueError, match="residual_prefix"):
            RQ(residual_prefix=bad)
    q = softq.quantize(tiny_model("bert"), [tiny_inputs("bert")], RQ())
    norms = [m for m in q.modules() if isinstance(m, QLayerNorm)]
    assert norms and all(len(m.input_act.prefix) == 1 for m in norms)


def bert_decoder(**extra) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BertLMHeadModel(transformers.BertConfig(
        vocab_size=64, max_position_embeddings=64, is_decoder=True, num_hidden_layers=2, num_attention_heads=4,
        hidden_size=32, intermediate_size=64, initializer_range=0.2, **extra)).eval()


def test_bert_decoder_gets_no_prefix_and_decodes_with_a_cache_as_in_one_pass() -> None:
    """A BERT built as a decoder (is_decoder=True) is causal: 'auto' gives it no prefix rows; with an explicit one,
    a cached step's row 0 is not position 0 and takes the shared scales (with [CLS]'s it left the full pass)."""
    model = bert_decoder()
    assert residual_prefix(model, RQ()) == 0
    ids = tiny_inputs("bert", batch=1, seq=12, seed=5)["input_ids"]
    for prefix in ("auto", 1):
        qmodel = softq.quantize(model, [tiny_inputs("bert", seed=s) for s in range(3)], RQ(residual_prefix=prefix))
        assert_cached_decoding_matches(qmodel, ids, prefix=8)


def test_bert_decoder_export_refuses_what_it_cannot_mask_or_read(tmp_path) -> None:
    """softmax='ort' (QLinearSoftmax: no mask) is refused for a BERT decoder as for GPT-2; a model with
    cross-attention is refused in one line (the graph would drop the encoder states)."""
    from softq.export.errors import ExportError
    from softq.export.model_export import build_onnx, to_onnx_float

    qmodel = softq.quantize(bert_decoder(), [tiny_inputs("bert", seed=s) for s in range(2)],
                            softq.QuantConfig(softmax_output="edge"))
    with pytest.raises(ExportError, match="cannot export a causal model"):
        build_onnx(qmodel, tiny_inputs("bert"), "ort")
    with pytest.raises(ExportError, match="cross-attention"):
        to_onnx_float(bert_decoder(add_cross_attention=True), str(tmp_path / "x.onnx"), tiny_inputs("bert"))


def test_prefix_scales_save_load_and_export_with_parity(tmp_path) -> None:
    from softq.export import to_onnx
    from softq.quant.io import load, save

    model = fresh_deit()
    g = torch.Generator().manual_seed(2)
    calib = [torch.randn(4, 3, 32, 32, generator=g) for _ in range(2)]
    q = softq.quantize(model, calib, RQ())
    x = torch.randn(3, 3, 32, 32, generator=g)
    loaded = load(save(q, tmp_path / "q"))
    with torch.no_grad():
        ref = q(pixel_values=x).logits
        assert torch.equal(loaded(pixel_values=x).logits, ref)
    path = to_onnx(q, str(tmp_path / "q.onnx"), {"pixel_values": x})
    sess = ort.InferenceSession(path)
    out = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    # same codes up to float-rounding ties (one step of one row, spread by attention)
    assert np.abs(out - ref.numpy()).max() < 0.05 * np.abs(ref.numpy()).max()
    assert np.argmax(out, -1).tolist() == ref.argmax(-1).tolist()


def test_one_pass_input_smoothing_matches_a_separate_stats_pass() -> None:
    """softq.quantize decides smoothing after its one observation pass and derives the smoothed inputs'
    ranges from per-channel ranges; the result matches smoothing on the float model first (16-bit weights,
    float tables, so that the two observation passes see the same activations up to weight rounding)."""
    model = tiny_model("bert")
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            layer.attention.output.LayerNorm.weight[3] = 40.0  # an outlier channel at the FFN input
    calib = [tiny_inputs("bert", seed=s) for s in range(3)]
    one = softq.quantize(model, calib, RQ(input_smoothing=0.8, weight_bits=16, embedding_bits=None,
                                          smoothing_into_v=False))  # V's rows as the two-pass model has them
    smoothed = copy.deepcopy(model)
    assert smooth_inputs(smoothed, calib, 0.8)
    two = softq.quantize(smoothed, calib, RQ(input_smoothing=None, weight_bits=16, embedding_bits=None))
    pairs = [(a, b) for a, b in zip(one.modules(), two.modules()) if isinstance(a, QLinear)]
    assert sum(a.input_scale.numel() > 0 for a, _ in pairs) >= 4
    for a, b in pairs:
        torch.testing.assert_close(a.input_scale, b.input_scale, rtol=5e-3, atol=0)
        torch.testing.assert_close(a.input_act.scale, b.input_act.scale, rtol=5e-3, atol=0)
        torch.testing.assert_close(a.input_act.zero_point, b.input_act.zero_point, rtol=0, atol=1)
        torch.testing.assert_close(a.weight, b.weight, rtol=5e-3, atol=1e-6)


def test_input_smoothing_with_another_observer_still_smooths_first() -> None:
    model = tiny_model("bert")
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            layer.attention.output.LayerNorm.weight[3] = 40.0
    calib = [tiny_inputs("bert", seed=s) for s in range(3)]
    q = softq.quantize(model, calib, RQ(input_smoothing=0.8, observer="percentile"))
    ffn_in = q.bert.encoder.layer[0].intermediate.dense.input_scale
    assert ffn_in.numel() == 32 and ffn_in[3] < ffn_in.median() / 4


@pytest.mark.parametrize("bits", [2, 4, 7, 8])
def test_cached_weights_equal_brevitas(bits: int) -> None:
    torch.manual_seed(bits)
    for per_channel in (True, False):
        lin = torch.nn.Linear(24, 16)
        with torch.no_grad():
            lin.weight[3] = 0.0  # Brevitas' minimum scale
            lin.weight[5] *= 1e3
        q = QLinear(lin, bits, per_channel, ActQuantizer(8, False)).eval()
        assert torch.equal(q.weight, lin.weight)  # copied, not re-initialised
        assert torch.equal(dequantized_weight(q.weight, bits, per_channel), q.quant_weight().value.detach())
        x = torch.randn(2, 5, 24)
        with torch.no_grad():
            fast = q(x)  # the cached inference path
        assert torch.equal(fast, super(QLinear, q).forward(x))  # Brevitas' own forward
        with torch.no_grad():
            q.weight.mul_(2.0)  # a changed weight invalidates the cache
            assert torch.equal(q(x), super(QLinear, q).forward(x))
    emb = torch.nn.Embedding(50, 8, padding_idx=0)
    qe = QEmbedding(emb, bits)
    assert torch.equal(dequantized_weight(qe.weight, bits, True), qe.quant_weight().value.detach())


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_calibration_attention_shortcut_observes_what_the_eager_path_does(family: str, monkeypatch) -> None:
    """Calibration computes an exact-softmax layer's output by SDPA when nothing reads its probabilities;
    the ranges it fits equal the eager path's (padding and causal masks included)."""
    import softq.attention as attention

    model = tiny_model(family)
    calib = [tiny_inputs(family, seed=s) for s in range(2)]
    calib[0]["attention_mask"] = torch.ones_like(calib[0]["input_ids"])
    calib[0]["attention_mask"][0, 15:] = 0  # padding
    calls = []
    original = attention._observing_attention
    monkeypatch.setattr(attention, "_observing_attention", lambda *a: calls.append(1) or original(*a))
    fast = softq.quantize(model, calib, RQ())
    assert len(calls) == 2 * len(calib)  # two layers, every batch
    monkeypatch.setattr(attention, "_observing_only", lambda points: False)
    eager = softq.quantize(model, calib, RQ())
    pairs = [(a, b) for a, b in zip(fast.modules(), eager.modules()) if isinstance(a, ActQuantizer)]
    assert len(pairs) > 10
    for a, b in pairs:
        torch.testing.assert_close(a.scale, b.scale, rtol=1e-5, atol=0)
        torch.testing.assert_close(a.zero_point, b.zero_point, rtol=0, atol=1)


def test_left_padded_batch_is_refused_with_prefix_scales() -> None:
    model = tiny_model("bert")
    q = softq.quantize(model, [tiny_inputs("bert", seed=s) for s in range(2)], RQ())
    x = tiny_inputs("bert", seed=3)
    right = torch.ones_like(x["input_ids"])
    right[0, 20:] = 0
    with torch.no_grad():
        q(input_ids=x["input_ids"], attention_mask=right)  # right padding: fine
        left = right.flip(-1)
        with pytest.raises(ValueError, match="left-padded"):
            q(input_ids=x["input_ids"], attention_mask=left)
        q0 = softq.quantize(model, [tiny_inputs("bert", seed=s) for s in range(2)], RQ(residual_prefix=0))
        q0(input_ids=x["input_ids"], attention_mask=left)  # no prefix scales: nothing to refuse


def test_exported_file_with_prefix_scales_refuses_left_padding_in_the_runner(tmp_path) -> None:
    """The torch model refuses left padding, but its ONNX file took it silently: the graph applies the [CLS] scales to
    position 0, a pad token there (all-MiniLM-L6-v2's embeddings far from FP32's).  The file
    now records its special positions and softq's runner refuses such a batch in one line."""
    from softq.export import to_onnx
    from softq.export.runtimes import RIGHT_PADDING_KEY, runner

    model = tiny_model("bert")
    x = tiny_inputs("bert", seed=3)
    right = torch.ones_like(x["input_ids"])
    right[0, 20:] = 0
    left = right.flip(-1)
    for prefix, refused in ((None, True), (0, False)):
        q = softq.quantize(model, [tiny_inputs("bert", seed=s) for s in range(2)],
                           RQ() if prefix is None else RQ(residual_prefix=prefix))
        path = to_onnx(q, str(tmp_path / f"q{prefix}.onnx"), x)
        import onnx

        meta = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
        assert (meta.get(RIGHT_PADDING_KEY) == "1") == refused
        run = runner(path)
        run({"input_ids": x["input_ids"].numpy(), "attention_mask": right.numpy()})
        feeds = {"input_ids": x["input_ids"].numpy(), "attention_mask": left.numpy()}
        if refused:
            with pytest.raises(ValueError, match="left-padded; the model was quantized with residual scales"):
                run(feeds)
        else:
            run(feeds)


def test_softmax_input_range_comes_from_the_keys_a_row_can_see() -> None:
    """Masked scores (padding, a causal model's future) never reach the softmax, so they do not widen
    the softmax-input step."""
    from softq.attention import AttentionPoints, _scores_point

    points = AttentionPoints(num_heads=2)
    points.scores = ActQuantizer(8, False)
    points.scores.mode = "observe"
    scores = torch.rand(1, 2, 4, 4)
    scores[..., 0, 3] = 1000.0  # a future key of the first query: masked
    causal = torch.ones(4, 4).tril()
    assert _scores_point(points, scores, causal) is scores  # observing leaves the scores alone
    points.scores.finish_calibration()
    assert points.scores.scale < 1.0 / 255 + 1e-6  # the valid scores span [0, 1)


def test_sensitivity_ranking_leaves_the_prefix_rows_quantized() -> None:
    """enable_only set every quantizer's mode, the prefix rows too, which follow their quantizer's mode: a row never
    chosen on its own was left float, so after a ranking "restored" the model its prefix tokens went unquantized."""
    from softq.quant.points import act_quantizers
    from softq.quant.sensitivity import sensitivity

    model = fresh_deit()
    g = torch.Generator().manual_seed(2)
    calib = [torch.randn(4, 3, 32, 32, generator=g) for _ in range(2)]
    q = softq.quantize(model, calib, RQ())
    assert any(len(getattr(m, "prefix", ())) for m in q.modules())
    x = torch.randn(3, 3, 32, 32, generator=g)
    with torch.no_grad():
        before = q(pixel_values=x).logits
        rows = sensitivity(q, lambda m: float(m(pixel_values=x).logits.sum()))
        assert torch.equal(q(pixel_values=x).logits, before)
    assert rows[-1][1] == pytest.approx(float(before.sum()))
    assert {m.mode for m in act_quantizers(q)} == {"quant"}
