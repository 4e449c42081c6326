"""Calibration passes: observers and SmoothQuant, on real data and tiny real models."""

from __future__ import annotations

import copy

import numpy as np

import pytest
import torch
from conftest import tiny_inputs, tiny_model

import softq
from softq.calib.observers import MinMaxObserver, MSEObserver, PercentileObserver, fake_quant_range, make_observer
from softq.calib.smoothquant import find_norm_linear_groups, smooth
from softq.models import conv1d_to_linear


def heavy_tailed(n: int = 200_000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[:20] *= 60.0  # a few outliers, as in transformer activations
    return x


def test_minmax_observer_keeps_the_extremes_and_zero() -> None:
    obs = MinMaxObserver()
    obs.update(torch.tensor([0.5, 2.0]))
    obs.update(torch.tensor([1.0, 3.0]))
    r = obs.range(8, signed=False)
    assert (r.lo, r.hi) == (0.0, 3.0)  # lo is pulled to 0 so zero stays representable


def test_percentile_observer_clips_outliers() -> None:
    x = heavy_tailed()
    minmax, pct = MinMaxObserver(), PercentileObserver(99.9)
    minmax.update(x)
    pct.update(x)
    assert pct.range(8, True).hi < minmax.range(8, True).hi / 10


def test_mse_observer_beats_minmax_on_heavy_tails() -> None:
    x = heavy_tailed()
    errors = {}
    for kind in ("minmax", "mse"):
        obs = make_observer(kind)
        obs.update(x)
        r = obs.range(4, signed=True)
        errors[kind] = (fake_quant_range(x, r, 4, True) - x).pow(2).mean().item()
    assert errors["mse"] < errors["minmax"] * 0.8


def test_observer_refuses_nan_and_unknown_kind() -> None:
    with pytest.raises(ValueError, match="NaN or Inf"):
        MSEObserver().update(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="unknown observer 'max'"):
        make_observer("max")
    with pytest.raises(RuntimeError, match="saw no data"):
        MinMaxObserver().range(8, True)


def test_percentile_observer_reads_the_percentile_of_all_values_however_batched() -> None:
    """It averaged each batch's percentiles: the same values in small batches gave a wider range (each small
    batch's 99.9th percentile is nearly its max) than in one batch."""
    x = heavy_tailed(200_000, seed=3)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))]
    sizes = [1000, 7, 50_000, 48_993, 100_000]  # uneven batches, the outliers spread over them
    for q in (99.9, 99.99, 100.0):
        whole, parts = PercentileObserver(q), PercentileObserver(q)
        whole.update(x)
        for part in torch.split(x, sizes):
            parts.update(part)
        expected = torch.quantile(x.double(), torch.tensor([1 - q / 100, q / 100], dtype=torch.float64))
        for obs in (whole, parts):
            r = obs.range(8, True)
            assert (r.lo, r.hi) == pytest.approx((expected[0].item(), expected[1].item()), rel=1e-6)
        assert whole.range(8, True) == parts.range(8, True)
    minmax = MinMaxObserver()
    minmax.update(x)
    assert parts.range(8, True) == minmax.range(8, True)  # q = 100 (the last): the min-max range


def test_percentile_observer_past_its_kept_tail_reads_a_uniform_sample() -> None:
    """A tail longer than the kept extremes (a low percentile on much data): the percentile from the uniform
    sample of every batch, close to the exact one whatever the batching."""
    x = heavy_tailed(400_000, seed=4)
    expected = torch.quantile(x, torch.tensor([0.05, 0.95]))
    for sizes in ([400_000], [20_000] * 20):
        obs = PercentileObserver(95.0)
        obs.TAIL = 1000  # the tail is 20,000 values
        for part in torch.split(x, sizes):
            obs.update(part)
        r = obs.range(8, True)
        assert (r.lo, r.hi) == pytest.approx((expected[0].item(), expected[1].item()), rel=0.02)


def test_mse_observer_keeps_every_value_while_they_fit() -> None:
    """Each batch was cut to an eighth of the reservoir before anything was full: the same values as one batch
    and as eight gave other clips."""
    x = heavy_tailed(65_536, seed=5)
    whole, parts = MSEObserver(), MSEObserver()
    whole.update(x)
    for part in x.chunk(8):
        parts.update(part)
    assert whole.uniform_sample().numel() == x.numel()
    assert whole.range(8, True) == parts.range(8, True)


def test_mse_observer_samples_every_batch_alike() -> None:
    """Each merge of the MSE observer's reservoir weighted everything merged before like one batch: of 24 equal
    batches the last 12 filled most of it, and the same data in reverse order chose another clip."""
    from softq.calib.observers import MSEObserver

    observer = MSEObserver()
    for i in range(24):
        observer.update(torch.full((40000,), 1.0 if i < 12 else 2.0))
    assert abs((observer.uniform_sample() == 2.0).float().mean().item() - 0.5) < 0.02
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(40000, generator=g) * (4.0 if i < 12 else 0.25) for i in range(24)]
    ranges = []
    for order in (batches, batches[::-1]):
        observer = MSEObserver()
        for b in order:
            observer.update(b)
        ranges.append(observer.range(8, True))
    assert ranges[0].hi == pytest.approx(ranges[1].hi, rel=0.02)


@pytest.mark.parametrize("observer", ["minmax", "percentile", "mse"])
def test_every_observer_quantizes_a_model(observer: str) -> None:
    model = tiny_model("vit")
    calib = [tiny_inputs("vit", seed=s) for s in range(3)]
    qmodel = softq.quantize(model, calib, softq.QuantConfig(observer=observer))
    x = tiny_inputs("vit", seed=7)
    with torch.no_grad():
        rel = (qmodel(**x).logits - model(**x).logits).norm() / model(**x).logits.norm()
    assert rel < 0.15


def test_smoothing_a_gpt2_as_loaded_says_to_convert_its_conv1d_layers() -> None:
    """GPT-2's projections are Conv1D: smooth() said it found no LayerNorm to fold into, smooth_inputs() returned []
    (nothing smoothed) without a word."""
    from softq.calib.smoothquant import smooth, smooth_inputs

    calib = [tiny_inputs("gpt2", seed=s) for s in range(2)]
    for call in (lambda m: smooth(m, calib), lambda m: smooth_inputs(m, calib, 0.5)):
        with pytest.raises(ValueError, match=r"Conv1D layers: call softq.models.conv1d_to_linear\(model\) first"):
            call(tiny_model("gpt2"))
    model = tiny_model("gpt2")
    conv1d_to_linear(model)
    assert smooth_inputs(model, calib, 0.5)


@pytest.mark.parametrize("family", ["gpt2", "opt", "vit"])
def test_smoothquant_keeps_the_float_function_and_flattens_channels(family: str) -> None:
    model = tiny_model(family)
    conv1d_to_linear(model)
    with torch.no_grad():  # plant an outlier channel, as trained transformers grow them
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.LayerNorm) and "before" in name or name.endswith(("ln_1", "self_attn_layer_norm")):
                module.weight[3] = 40.0
    calib = [tiny_inputs(family, seed=s) for s in range(3)]
    x = tiny_inputs(family, seed=9)
    groups = find_norm_linear_groups(model, calib[0])
    assert groups and all(g.linears for g in groups)
    with torch.no_grad():
        ref = model(**x).logits
    def channel_spread() -> float:
        spreads = []
        hooks = [g.norm.register_forward_hook(lambda _m, _i, o: spreads.append(
            (o.abs().amax((0, 1)).max() / o.abs().amax((0, 1)).median()).item())) for g in groups]
        with torch.no_grad():
            model(**x)
        for h in hooks:
            h.remove()
        return max(spreads)
    before = channel_spread()
    smoothed = smooth(model, calib, alpha=0.5)
    with torch.no_grad():
        out = model(**x).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert smoothed
    assert channel_spread() < before / 2


def test_smoothquant_improves_w8a8_with_an_outlier_channel() -> None:
    model = tiny_model("opt")
    with torch.no_grad():
        for layer in model.model.decoder.layers:
            layer.self_attn_layer_norm.weight[5] = 60.0
            layer.final_layer_norm.weight[7] = 60.0
    calib = [tiny_inputs("opt", seed=s) for s in range(4)]
    x = tiny_inputs("opt", seed=21)
    with torch.no_grad():
        ref = model(**x).logits
        errs = {}
        for alpha in (None, 0.5):
            # edge softmax codes, as when this bound was set (row codes: 0.045 -> 0.040, a smaller gap to close);
            # float embedding tables: this random tiny model's 8-bit tables add an error as large as the gap
            # and no automatic input smoothing, which would also act on this outlier channel
            q = softq.quantize(model, calib, softq.QuantConfig(smoothquant_alpha=alpha, softmax_output="edge",
                                                               embedding_bits=None, input_smoothing=None))
            errs[alpha] = ((q(**x).logits - ref).norm() / ref.norm()).item()
    assert errs[0.5] < errs[None] * 0.8, errs


def test_smoothquant_refuses_post_ln_models() -> None:
    with pytest.raises(ValueError, match="post-LN"):
        softq.quantize(tiny_model("bert"), [tiny_inputs("bert")], softq.QuantConfig(smoothquant_alpha=0.5))


def test_input_smoothing_keeps_the_function_and_exports_one_mul_per_input(tmp_path) -> None:
    """Explicit SmoothQuant on a post-LN model: weights x s, inputs x 1/s (shared by Q, K and V), the float
    function unchanged; the quantized model saves, loads and exports with one Mul per smoothed input."""
    from softq.calib.smoothquant import smooth_inputs
    from softq.export import onnx_utils as U
    from softq.export.model_export import build_onnx
    from softq.quant.io import load, save
    from softq.quant.layers import QLinear

    model = tiny_model("bert")
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            layer.attention.output.LayerNorm.weight[3] = 40.0  # an outlier channel at the FFN input
    calib = [tiny_inputs("bert", seed=s) for s in range(3)]
    x = tiny_inputs("bert", seed=9)
    smoothed = copy.deepcopy(model)
    names = smooth_inputs(smoothed, calib, 0.8)
    assert any(n.endswith("intermediate.dense") for n in names)
    with torch.no_grad():
        torch.testing.assert_close(smoothed(**x).logits, model(**x).logits, rtol=1e-4, atol=1e-5)
    # save_pretrained wrote the scaled weights without the hooks' 1/s, which from_pretrained loaded back as another
    # function without a word
    with pytest.raises(ValueError, match="smoothed .* save_pretrained does not write"):
        smoothed.save_pretrained(tmp_path / "smoothed")
    assert not (tmp_path / "smoothed").exists()
    with pytest.raises(ValueError, match="quantized by softq"):  # quantized, it says what a quantized model says
        softq.quantize(smoothed, calib).save_pretrained(tmp_path / "smoothed")
    model.save_pretrained(tmp_path / "float")  # the model it was copied from is not affected
    q = softq.quantize(model, calib, softq.QuantConfig(input_smoothing=0.8))
    layer = q.bert.encoder.layer[0]
    qkv = [layer.attention.self.query, layer.attention.self.key, layer.attention.self.value]
    assert all(isinstance(m, QLinear) and m.input_scale.numel() == 32 for m in qkv)
    assert torch.equal(qkv[0].input_scale, qkv[1].input_scale) and torch.equal(qkv[0].input_scale, qkv[2].input_scale)
    ffn_in = layer.intermediate.dense.input_scale
    assert ffn_in[3] < ffn_in.median() / 4  # the outlier channel is scaled down before quantization
    plain = softq.quantize(model, calib, softq.QuantConfig(input_smoothing=None))
    with torch.no_grad():
        ref = model(**x).logits
        err = {k: ((m(**x).logits - ref).norm() / ref.norm()).item() for k, m in (("plain", plain), ("smooth", q))}
    assert err["smooth"] < err["plain"], err
    again = load(save(q, tmp_path / "q"))
    with torch.no_grad():
        torch.testing.assert_close(again(**x).logits, q(**x).logits, rtol=0, atol=0)
    onnx_model = build_onnx(again, x)
    feeds = {"input_ids": x["input_ids"].numpy(), "attention_mask": np.ones_like(x["input_ids"].numpy())}
    out = U.run(onnx_model, feeds, "all")[0]
    assert np.abs(out - q(**x).logits.detach().numpy()).max() <= 0.02 * np.abs(out).max()
    quants = [n for n in onnx_model.graph.node if n.op_type == "QuantizeLinear" and "attention/self/" in n.name
              and "input_act" in n.name]
    assert len(quants) == q.config.num_hidden_layers  # Q, K, V still share one Mul and one QuantizeLinear
    assert all(any(p.op_type == "Mul" for p in onnx_model.graph.node if p.output[0] == n.input[0]) for n in quants)


@pytest.mark.parametrize("family", ["gpt2", "bert", "vit"])
def test_smoothing_into_v_keeps_the_function_and_drops_the_cores_per_channel_divisor(family, tmp_path) -> None:
    """QuantConfig(smoothing_into_v=True): the attention output's smoothing scale moves onto the rows of the
    Linear that produces V (GPT-2: the V third of c_attn; BERT: value), found by value on a calibration batch.
    With every quantizer off the model computes what the unfolded one does (the fold is exact in float); its
    ONNX row cores divide by a scalar (no per-(head, channel) constant left) and match torch; it saves and
    loads bit for bit; with per-tensor weight codes (which it cannot fold into) it is refused."""
    from onnx import numpy_helper

    from softq.export.model_export import build_onnx
    from softq.quant.io import load, save
    from softq.quant.points import set_mode
    from conftest import padded_logit_error

    calib = [tiny_inputs(family, seed=s) for s in range(4)]
    model = tiny_model(family)
    plain = softq.quantize(model, calib, softq.QuantConfig(input_smoothing=0.8, smoothing_into_v=False))
    folded = softq.quantize(model, calib, softq.QuantConfig(input_smoothing=0.8, smoothing_into_v=True))
    layers = folded.config.num_hidden_layers
    assert plain.softq_smoothing_into_v == 0 and folded.softq_smoothing_into_v == layers
    outs = {"attn.c_proj", "attention.output.dense", "attention.o_proj"}
    readers = [m for n, m in folded.named_modules() if any(n.endswith(o) for o in outs)]
    assert len(readers) == layers and all(m.input_scale.numel() == 0 for m in readers)
    x = tiny_inputs(family, seed=9)
    with torch.no_grad():
        quantized = folded(**x)[0]
        set_mode(plain, "float")
        set_mode(folded, "float")
        torch.testing.assert_close(folded(**x)[0], plain(**x)[0], rtol=1e-4, atol=1e-5)
        set_mode(folded, "quant")
    def core_scales(m):  # noqa: ANN001, ANN202 - the row cores' Mul nodes with a non-scalar constant
        consts = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
        consts.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in m.graph.node
                       if n.op_type == "Constant"})
        return [n for n in m.graph.node if n.op_type == "Mul" and "/core/" in n.name
                and any(i in consts and consts[i].size > 1 for i in n.input)]

    set_mode(plain, "quant")
    assert len(core_scales(build_onnx(plain, x, "fast"))) == layers  # the divisor's per-(head, channel) factor
    onnx_model = build_onnx(folded, x, "fast")
    assert core_scales(onnx_model) == []
    if family == "vit":
        from softq.export import onnx_utils as U

        out = U.run(onnx_model, {"pixel_values": x["pixel_values"].numpy()}, "all")[0]
        assert np.abs(out - quantized.numpy()).max() <= 0.02 * np.abs(quantized.numpy()).max()
    elif family == "gpt2":
        assert padded_logit_error(folded, onnx_model, family, seq=20, pad_from=14, seed=9) <= 0.02
    again = load(save(folded, tmp_path / "q"))
    with torch.no_grad():
        torch.testing.assert_close(again(**x)[0], quantized, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs per-channel weight codes"):  # it folded nothing, without a word
        softq.QuantConfig(input_smoothing=0.8, smoothing_into_v=True, weight_per_channel=False)
    with pytest.raises(ValueError, match="smoothing_into_v must be True, False or 'auto'"):
        softq.QuantConfig(smoothing_into_v="yes")


@pytest.mark.parametrize("family", ["gpt2", "vit"])
@pytest.mark.parametrize("fold_wins", [True, False])
def test_smoothing_into_v_auto_keeps_the_fold_only_where_the_held_out_error_is_no_higher(family, fold_wins,
                                                                                         monkeypatch) -> None:
    """smoothing_into_v="auto" (the default) quantizes like smoothing_into_v=True where the folded copy's
    held-out error (after the weight bias correction; the ViT's weight-only patch conv gets its bias
    correction on both copies) is no higher than the unfolded model's, else like smoothing_into_v=False:
    the same logits bit for bit either way, in place too, and the report names the choice."""
    from softq.quant import quantize as Q
    from softq.quant import v_fold

    calib = [tiny_inputs(family, seed=s) for s in range(4)]
    model = tiny_model(family)
    x = tiny_inputs(family, seed=9)
    true_error = v_fold.output_error
    calls = []

    def judged(m, batches, reference):  # noqa: ANN001, ANN202 - the fold's copy is the second model judged
        calls.append(true_error(m, batches, reference))
        if len(calls) == 2:
            return calls[0] * (0.5 if fold_wins else 2.0)
        return calls[-1]

    with monkeypatch.context() as patch:
        patch.setattr(v_fold, "output_error", judged)  # where the fold's "auto" check looks it up
        auto = softq.quantize(model, calib, softq.QuantConfig(input_smoothing=0.8))
        calls.clear()
        inplace = softq.quantize(copy.deepcopy(model), calib, softq.QuantConfig(input_smoothing=0.8), inplace=True)
    layers = model.config.num_hidden_layers
    assert auto.softq_smoothing_into_v == (layers if fold_wins else 0)
    unfolded, folded = auto.softq_v_fold_errors
    assert (folded <= unfolded) == fold_wins
    assert ("folded into V" if fold_wins else "left at the output") in Q.smoothing_report(auto)
    explicit = softq.quantize(model, calib, softq.QuantConfig(input_smoothing=0.8, smoothing_into_v=fold_wins))
    other = softq.quantize(model, calib, softq.QuantConfig(input_smoothing=0.8, smoothing_into_v=not fold_wins))
    with torch.no_grad():
        want = explicit(**x)[0]
        torch.testing.assert_close(auto(**x)[0], want, rtol=0, atol=0)
        torch.testing.assert_close(inplace(**x)[0], want, rtol=0, atol=0)
        assert not torch.equal(other(**x)[0], want)  # the two choices are different models
    plain = softq.quantize(model, calib, softq.QuantConfig(input_smoothing=None))
    assert plain.softq_smoothing_into_v == 0 and plain.softq_v_fold_errors is None  # nothing smoothed, no trial


def test_input_smoothing_config_is_validated() -> None:
    for bad in (1.5, -0.1, "always", True):
        with pytest.raises(ValueError, match="input_smoothing must be an alpha"):
            softq.QuantConfig(input_smoothing=bad)


def test_auto_input_smoothing_keeps_the_candidate_closest_to_float_on_held_out_batches(tmp_path) -> None:
    """input_smoothing="auto" observes ranges on 3 of every 4 calibration batches, judges no smoothing and each of
    AUTO_SMOOTHING_ALPHAS on the 4th (outputs' cosine distance to the float model's) and keeps the best: each
    recorded error is what that alpha gives with ranges from the observed batches alone, and the kept model is
    the explicit-alpha model calibrated on every batch.  A classifier is judged on its last hidden state's
    tokens, not on its one logit row per example.  An outlier input channel gets smoothed; a random tiny
    model, where no candidate comes within reach of the 20% gain, not."""
    from softq.quant.config import AUTO_SMOOTHING_ALPHAS
    from softq.quant.io import load, save
    from softq.quant.held_out import _outputs, output_error
    from softq.quant.quantize import smoothing_report

    model = tiny_model("bert")
    with torch.no_grad():  # one FFN channel 100x larger (its output.dense column 100x smaller): a GELU-output outlier
        ffn = model.bert.encoder.layer[0]
        ffn.intermediate.dense.weight[5] *= 100.0
        ffn.intermediate.dense.bias[5] *= 100.0
        ffn.output.dense.weight[:, 5] /= 100.0
    calib = [tiny_inputs("bert", seed=s) for s in range(8)]
    held, fit = calib[3::4], [b for i, b in enumerate(calib) if i % 4 != 3]
    auto = softq.quantize(model, calib)
    errors = auto.softq_smoothing_errors
    assert list(errors) == [None, *AUTO_SMOOTHING_ALPHAS]
    best = min(errors, key=errors.get)  # a smoothed alpha, more than AUTO_SMOOTHING_MIN_GAIN (20%) below none
    assert best is not None and errors[best] < 0.8 * errors[None]
    kept = auto.softq_input_smoothing  # the smallest alpha within AUTO_SMOOTHING_TIE (2%) of the best
    assert kept == min(a for a in errors if a is not None and errors[a] <= 1.02 * errors[best])
    reference = _outputs(model, held)
    assert [r.shape for r in reference] == [(2 * 24, 32)] * 2  # token rows of the hidden state, not 2 logit rows
    for a in errors:
        # (candidates are judged before the weight bias correction, which the kept model gets afterwards)
        on_fit = softq.quantize(model, fit, softq.QuantConfig(input_smoothing=a, weight_bias_correction=False))
        assert on_fit.softq_smoothing_errors is None and on_fit.softq_input_smoothing == a
        assert output_error(on_fit, held, reference) == pytest.approx(errors[a], rel=1e-3)  # float rounding only
    explicit = softq.quantize(model, calib, softq.QuantConfig(input_smoothing=auto.softq_input_smoothing))
    x = tiny_inputs("bert", seed=21)
    with torch.no_grad():
        assert torch.equal(auto(**x).logits, explicit(**x).logits)
    assert smoothing_report(auto).startswith(f"input smoothing: alpha {auto.softq_input_smoothing:g} (auto: ")
    # a saved model keeps the smoothing, not the record of the choice; the report says so rather than "none"
    assert smoothing_report(load(save(auto, tmp_path / "q"))) == "input smoothing: yes (alpha not recorded)"
    plain = softq.quantize(tiny_model("bert"), [tiny_inputs("bert", seed=10 + i) for i in range(3)])
    plain_errors = plain.softq_smoothing_errors
    assert plain.softq_input_smoothing is None
    assert min(e for a, e in plain_errors.items() if a is not None) > 0.8 * plain_errors[None]  # no 20% gain


def test_auto_input_smoothing_needs_a_20_percent_gain() -> None:
    """Smoothing every input costs a Mul at run time where it cannot be folded, so such a candidate must beat no
    smoothing by AUTO_SMOOTHING_MIN_GAIN, and the LayerNorm-folded candidates (free at run time: any gain over
    none will do) outright; the best such candidate wins."""
    from softq.quant.smoothing_search import pick_smoothing

    assert pick_smoothing({None: 1.0, 0.6: 0.85, 0.8: 0.9, 1.0: 1.2}) == (None, False)  # 15% better: not enough
    assert pick_smoothing({None: 1.0, 0.6: 0.79, 0.8: 0.5, 1.0: 1.2}) == (0.8, False)
    assert pick_smoothing({None: 1.0, 0.6: 0.8}) == (0.6, False)  # exactly 20%
    assert pick_smoothing({None: 1.0}) == (None, False)
    # folded-only candidates: kept if below none, unless an every-input one is 20% below none and below them
    assert pick_smoothing({None: 1.0, 0.6: 0.85}, {0.6: 0.95, 0.8: 0.9}) == (0.8, True)  # 0.85: not 20% below none
    assert pick_smoothing({None: 1.0, 0.6: 0.75}, {0.6: 0.9}) == (0.6, False)
    assert pick_smoothing({None: 1.0, 0.6: 0.75, 0.8: 0.78}, {0.6: 0.9, 0.8: 0.7}) == (0.8, True)
    assert pick_smoothing({None: 1.0, 0.6: 1.1}, {0.6: 1.05, 1.0: 1.2}) == (None, False)
    # candidates within AUTO_SMOOTHING_TIE (2%) of the best are ties, and the smallest alpha wins
    assert pick_smoothing({None: 1.0, 0.6: 0.7, 0.8: 0.5, 1.0: 0.4975}) == (0.8, False)  # 1.0 is 0.5% better
    assert pick_smoothing({None: 1.0, 0.6: 0.7, 0.8: 0.5, 1.0: 0.48}) == (1.0, False)  # 4% better
    assert pick_smoothing({None: 1.0, 0.6: 0.9}, {0.6: 0.701, 0.8: 0.7, 1.0: 0.69}) == (0.6, True)
    # distances of a near-float model can round below 0 (a tiny random model's): still a choice, not a crash
    assert pick_smoothing({None: 1e-8, 0.6: -5.4e-9, 0.8: -2.0e-9, 1.0: 1.1e-8}) == (0.6, False)
    assert pick_smoothing({None: 1e-8, 0.6: -5.4e-9, 0.8: -5.45e-9}) == (0.6, False)


@pytest.mark.parametrize("family", ("vit", "gpt2"))
def test_auto_input_smoothing_prefers_the_scales_that_fold_into_layernorms(family) -> None:
    """In a pre-LN model "auto" also judges smoothing only the inputs that are LayerNorm outputs (Q/K/V and the
    first FFN Linear: their scales fold into the LayerNorm, so the export runs no Mul for them).  With an outlier
    LayerNorm channel the ViT keeps those alone (closer to float than smoothing every input; its other inputs
    unscaled, no Mul in its ONNX file); in the GPT-2 smoothing every input is closer still, and 20% below none."""
    from softq.export import onnx_utils as U
    from softq.export.model_export import build_onnx
    from softq.quant.config import AUTO_SMOOTHING_ALPHAS
    from softq.quant.quantize import smoothing_report
    from softq.quant.layers import QLinear

    model = tiny_model(family)
    with torch.no_grad():
        ln = model.vit.layers[0].layernorm_before if family == "vit" else model.transformer.h[0].ln_1
        ln.weight[3] = 20.0 if family == "vit" else 40.0
    calib = [tiny_inputs(family, seed=s) for s in range(8)]
    auto = softq.quantize(model, calib)
    errors, folded = auto.softq_smoothing_errors, auto.softq_folded_smoothing_errors
    assert list(errors) == [None, *AUTO_SMOOTHING_ALPHAS] and list(folded) == list(AUTO_SMOOTHING_ALPHAS)
    best_folded = min(folded, key=folded.get)
    assert folded[best_folded] < errors[None]
    scaled = {n for n, m in auto.named_modules() if isinstance(m, QLinear) and m.input_scale.numel()}
    after_norm = {n for n in scaled if n.endswith(("q_proj", "k_proj", "v_proj", "fc1", "c_attn", "c_fc"))}
    if family == "vit":
        assert auto.softq_smoothing_folded_only and auto.softq_input_smoothing == best_folded
        assert min(e for a, e in errors.items() if a is not None) > folded[best_folded]
        assert scaled and scaled == after_norm  # o_proj and fc2 unscaled
        assert "at the inputs that fold into a LayerNorm" in smoothing_report(auto)
        plain = softq.quantize(model, calib, softq.QuantConfig(input_smoothing=None))
        example = tiny_inputs(family)
        muls = [sum(n.op_type == "Mul" for n in build_onnx(q, example, "fast").graph.node) for q in (auto, plain)]
        assert muls[0] == muls[1]  # every scale folded into a LayerNorm
        x = tiny_inputs(family, seed=30)
        onnx_out = U.run(build_onnx(auto, example, "fast"), {k: v.numpy() for k, v in x.items()}, "all")[0]
        with torch.no_grad():
            ref = auto(**x).logits.numpy()
        assert abs(onnx_out - ref).max() <= 0.02 * abs(ref).max()
    else:
        best = min((a for a in errors if a is not None), key=errors.get)
        assert not auto.softq_smoothing_folded_only and auto.softq_input_smoothing == best
        assert errors[best] <= 0.8 * errors[None] and errors[best] < folded[best_folded]
        assert scaled > after_norm  # the other inputs too


def test_auto_input_smoothing_without_a_search_gates_or_leaves_a_single_example_alone() -> None:
    """With another observer (no shared-pass search) "auto" smooths at AUTO_SMOOTHING_ALPHA only where some Linear
    input's widest channel exceeds AUTO_SMOOTHING_RATIO times its median one; a single calibration example
    (nothing to hold out) is not smoothed, and the report says why.  A single batch of several examples is cut
    along them and searched."""
    from softq.quant.config import AUTO_SMOOTHING_ALPHA
    from softq.quant.quantize import smoothing_report
    from softq.quant.layers import QLinear

    calib = [tiny_inputs("bert", seed=s) for s in range(3)]
    cfg = softq.QuantConfig(observer="percentile")
    plain = softq.quantize(tiny_model("bert"), calib, cfg)
    assert plain.softq_input_smoothing is None
    assert not any(m.input_scale.numel() for m in plain.modules() if isinstance(m, QLinear))
    model = tiny_model("bert")
    with torch.no_grad():
        model.bert.encoder.layer[0].attention.output.LayerNorm.weight[3] = 40.0
    one = [tiny_inputs("bert", batch=1, seed=0)]
    smoothed = softq.quantize(model, calib, cfg)
    assert smoothed.softq_input_smoothing == AUTO_SMOOTHING_ALPHA and smoothed.softq_smoothing_errors is None
    assert all(m.input_scale.numel() for m in smoothed.modules() if isinstance(m, QLinear))
    single = softq.quantize(model, one)  # the outlier channel is there, but one example cannot tell
    # a batch of several examples with a broadcast (one-example) tensor is still cut along its examples
    ids = tiny_inputs("bert", batch=4, seed=0)["input_ids"]
    broadcast = softq.quantize(model, [{"input_ids": ids, "token_type_ids": torch.zeros(1, ids.shape[1], dtype=torch.long)}])
    assert broadcast.softq_smoothing_errors is not None
    assert single.softq_input_smoothing is None and single.softq_smoothing_errors is None
    assert not any(m.input_scale.numel() for m in single.modules() if isinstance(m, QLinear))
    assert "single calibration example" in smoothing_report(single)
    assert "single" not in smoothing_report(smoothed)
    assert softq.quantize(model, [tiny_inputs("bert", batch=4, seed=0)]).softq_smoothing_errors is not None


def test_input_smoothing_leaves_excluded_layers_float_and_unscaled(tmp_path) -> None:
    from softq.quant.io import load, save

    model = tiny_model("bert")
    calib = [tiny_inputs("bert", seed=s) for s in range(3)]
    q = softq.quantize(model, calib, softq.QuantConfig(input_smoothing=0.8, exclude=("intermediate",)))
    dense = q.bert.encoder.layer[0].intermediate.dense
    assert type(dense) is torch.nn.Linear and torch.equal(dense.weight, model.bert.encoder.layer[0].intermediate.dense.weight)
    assert q.bert.encoder.layer[0].attention.self.query.input_scale.numel() == 32
    x = tiny_inputs("bert", seed=4)
    with torch.no_grad():
        torch.testing.assert_close(load(save(q, tmp_path / "q"))(**x).logits, q(**x).logits, rtol=0, atol=0)


def test_input_recorder_sees_a_layernorm_output_through_a_view() -> None:
    """GPT-2 reads ln_f's output through ``view`` and a ``[:, -0:]`` slice: the same elements, so lm_head's
    input counts as a LayerNorm output (its scale folds); a copy or a part of it does not."""
    from softq.calib.smoothquant import InputRecorder, _same_values, smoothable_linears

    model = tiny_model("gpt2")
    conv1d_to_linear(model)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # as after quantize's prepare
    recorder = InputRecorder(model, smoothable_linears(model))
    try:
        with torch.no_grad():
            model(**tiny_inputs("gpt2", seed=3))
    finally:
        recorder.remove()
    after_norm = {name for g in recorder.groups() if g.after_norm for name, _ in g.linears}
    assert {"lm_head", "transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc"} <= after_norm
    assert not any(n.endswith(("c_proj",)) for n in after_norm)
    x = torch.randn(2, 5, 4)
    assert _same_values(x, x.view(2, 5, 4)) and _same_values(x, x[:, -5:])
    assert not _same_values(x, x.clone()) and not _same_values(x, x[:, 1:]) and not _same_values(x, x.view(10, 4))


# smoothing_into_v=False: "auto" folds or not on a held-out error that the two batchings need not tie on
@pytest.mark.parametrize("family,config", [
    ("bert", dict()), ("bert", dict(input_smoothing=0.8, observer="percentile", smoothing_into_v=False)),
    ("bert", dict(softmax_output="edge", residual_prefix=1)), ("bert", dict(softmax_output="edge", bias_correction="head")),
    ("opt", dict(input_smoothing=None)), ("opt", dict(input_smoothing=0.8, smoothing_into_v=False)),
    ("opt", dict(softmax_output="edge", bias_correction="head", input_smoothing=None))])
def test_padding_rows_are_not_observed(family, config) -> None:
    """The observers and the smoothing statistics counted every row of a padded batch: the pad token's activations
    (here an outlier channel) widened the ranges, and the same texts batched otherwise gave another model.  OPT
    flattens its tokens before the feed-forward layers ([batch * seq, channels]); edge codes observe the scores."""
    from softq.quant.quantizers import ActQuantizer, SoftmaxOutputQuantizer

    lengths = (9, 4, 7, 2)
    pad_id = 0 if family == "bert" else 1
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(2, 64, (n,), generator=g) for n in lengths]
    padded = torch.full((len(texts), max(lengths)), pad_id, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, t in enumerate(texts):
        padded[i, :len(t)], mask[i, :len(t)] = t, 1
    model = tiny_model(family)
    with torch.no_grad():
        pad = model.get_input_embeddings().weight[pad_id]
        pad.zero_()
        pad[0] = 100.0  # the pad token's rows: one channel far outside the real tokens' range
    one_by_one = [{"input_ids": t[None], "attention_mask": torch.ones(1, len(t), dtype=torch.long)} for t in texts]
    cfg = softq.QuantConfig(**config)
    a = softq.quantize(model, one_by_one, cfg)
    b = softq.quantize(model, [{"input_ids": padded, "attention_mask": mask}], cfg)
    scales = [(n, m.scale, other.scale) for (n, m), other in
              zip(a.named_modules(), b.modules()) if isinstance(m, ActQuantizer)]
    assert len(scales) > 10
    for name, sa, sb in scales:
        assert torch.allclose(sa, sb, rtol=1e-5), name
    for m, other in zip(a.modules(), b.modules()):  # softmax bias correction: padding queries' rows not counted
        if isinstance(m, SoftmaxOutputQuantizer) and m.beta is not None:
            assert torch.allclose(m.beta, other.beta, rtol=1e-4, atol=1e-10)
    x = {"input_ids": padded, "attention_mask": mask}
    with torch.no_grad():
        assert torch.allclose(a(**x).logits, b(**x).logits, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_auto_smoothing_holds_out_real_tokens_of_a_single_batch(family) -> None:
    """A single batch whose last example is all padding: "auto" held that example out alone, its distance was
    NaN and the search failed with "min() arg is an empty sequence"."""
    batch = tiny_inputs(family, batch=4, seq=12, seed=3)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][3] = 0
    qmodel = softq.quantize(tiny_model(family), [batch], softq.QuantConfig())
    errors = qmodel.softq_smoothing_errors  # the held-out examples judged the candidates
    assert errors and all(np.isfinite(e) for e in errors.values()) and not qmodel.softq_smoothing_unjudged


def test_the_score_observer_skips_padding_queries() -> None:
    """Edge codes observe the attention scores over valid keys; a padding query's row (what a pad token attends
    with, which no output reads) was observed too."""
    from types import SimpleNamespace

    from softq.attention import _scores_point
    from softq.calib.observers import valid_tokens
    from softq.quant.quantizers import ActQuantizer

    scores = torch.tensor([[1.0, -2.0, 9.0], [0.5, 1.5, 9.0], [80.0, -70.0, 9.0]])[None, None]  # [1, 1, 3, 3]
    keys = torch.tensor([1, 1, 0])
    observer = ActQuantizer(8, True)
    observer.mode = "observe"
    with valid_tokens(keys[None]):
        _scores_point(SimpleNamespace(scores=observer), scores, keys[None, None, None, :])
    observer.finish_calibration()
    assert observer.scale.item() == pytest.approx(2.0 / 127)  # rows 0 and 1 at keys 0 and 1: |s| <= 2
