"""The softmax variants' defining properties, and their plumbing into Hugging Face attention."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_inputs, tiny_model

from softq.attention import AttentionGate, attention_points, configure_attention, fast_training
from softq.softmax import SOFTMAX_VARIANTS, get_softmax

CAUSAL = torch.ones(7, 7).tril()


def scores(seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(2, 3, 7, 7, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("name", sorted(SOFTMAX_VARIANTS))
def test_every_variant_keeps_masked_positions_exactly_zero(name: str) -> None:
    probs = get_softmax(name)(scores(), CAUSAL)
    assert torch.all(probs[..., CAUSAL == 0] == 0)
    assert torch.isfinite(probs).all() and probs.min() >= 0


@pytest.mark.parametrize("name", ["softmax", "2quad", "2relu"])
def test_normalised_variants_sum_to_one_over_valid_keys(name: str) -> None:
    x = scores() + 0.5  # 2relu needs a positive score per row
    x[..., 0] = x[..., 0].abs() + 0.1
    sums = get_softmax(name)(x, CAUSAL).sum(-1)
    expected = torch.ones_like(sums)
    if name == "2relu":  # the offset CrypTen's reciprocal needs, in plaintext too: s / (s + eps)
        from softq.softmax import RELU2_EPS

        s = (x.relu() * CAUSAL).sum(-1)
        expected = s / (s + RELU2_EPS)
        assert (expected < 1 - 1e-5).any()
    torch.testing.assert_close(sums, expected, rtol=0, atol=1e-5)


def test_half_precision_rows_match_float32() -> None:
    """2Quad's and 2ReLU's row sums and softpick's e^x - 1 run in float32 on float16 / bfloat16 scores: a 1024-key
    2Quad row near 4 summed to inf in float16 (a row of zeros) and bfloat16 softpick cancelled (0.5 for 0.457)."""
    cases = [("2quad", torch.full((1, 1024), 4.0)), ("2relu", torch.full((1, 1024), 80.0)),
             ("softpick", torch.tensor([[0.01, -0.01, 0.002, 0.0]]))]
    for name, x in cases:
        variant = get_softmax(name)
        for dtype in (torch.float16, torch.bfloat16):
            low = x.to(dtype)
            got = variant(low, None)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), variant(low.float(), None).to(dtype).float(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="2quad's shift c must be in"):
        get_softmax("2quad")(torch.zeros(1, 2), None, c=float("nan"))


def test_softmax_matches_torch_without_mask() -> None:
    x = scores()
    torch.testing.assert_close(get_softmax("softmax")(x, None), torch.softmax(x, -1))


def test_clipped_softmax_gives_exact_zeros_and_ones() -> None:
    x = torch.tensor([[12.0, 0.0, 0.0, 0.0], [0.3, 0.2, 0.1, 0.0]])
    p = get_softmax("clipped")(x, None, zeta=1.003, alpha=4.0)
    assert p[0, 0] == 1.0 and torch.all(p[0, 1:] == 0.0)  # finite logits, exact one and zeros
    # gamma = -alpha/T with T = 4 keys
    plain = torch.softmax(x[1], -1)
    torch.testing.assert_close(p[1], ((1.003 + 4 / 4) * plain - 4 / 4).clamp(0, 1))
    # with zeta = 1 (the reference setting) zeros are exact, ones are not reachable
    p1 = get_softmax("clipped")(x, None, zeta=1.0, alpha=4.0)
    assert torch.all(p1[0, 1:] == 0.0) and p1[0, 0] < 1.0


def test_clipped_softmax_gamma_uses_the_valid_row_length() -> None:
    x = torch.zeros(1, 1, 4, 4)
    p = get_softmax("clipped")(x, torch.ones(4, 4).tril(), alpha=0.5)
    # row i has T = i+1 valid keys, each softmax 1/T: (1 + a/T)/T - a/T
    for i in range(4):
        t = i + 1
        torch.testing.assert_close(p[0, 0, i, :t], torch.full((t,), (1 + 0.5 / t) / t - 0.5 / t))
        assert torch.all(p[0, 0, i, t:] == 0)


def test_softpick_is_zero_for_non_positive_logits_and_can_sum_below_one() -> None:
    x = torch.tensor([[-1.0, 0.0, 0.5, 2.0], [-3.0, -2.0, -1.0, 0.0]])
    p = get_softmax("softpick")(x, None)
    assert p[0, 0] == 0 and p[0, 1] == 0 and p[0, 2] > 0
    assert torch.all(p[1] == 0)  # a head can attend to nothing
    assert p[0].sum() < 1
    expected = torch.relu(torch.exp(x[0]) - 1) / (torch.exp(x[0]) - 1).abs().sum()
    torch.testing.assert_close(p[0], expected)


def test_softpick_is_stable_for_huge_logits() -> None:
    x = torch.tensor([[1000.0, 999.0, -5.0]])
    p = get_softmax("softpick")(x, None)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(), torch.tensor(1.0), atol=1e-3, rtol=0)


def test_surrogate_formulas() -> None:
    x = scores(seed=3)
    t = CAUSAL.sum(-1, keepdim=True)
    torch.testing.assert_close(get_softmax("2quad")(x, CAUSAL), ((x + 5) ** 2 * CAUSAL) / ((x + 5) ** 2 * CAUSAL).sum(-1, keepdim=True))
    torch.testing.assert_close(get_softmax("relu_len")(x, CAUSAL), x.relu() * CAUSAL / t)
    torch.testing.assert_close(get_softmax("sigmoid_len")(x, CAUSAL), torch.sigmoid(x - torch.log(t)) * CAUSAL)


def test_unknown_variant_and_parameter_are_named() -> None:
    with pytest.raises(ValueError, match="unknown softmax variant 'sofmax'"):
        get_softmax("sofmax")
    with pytest.raises(TypeError, match="has no parameter"):
        get_softmax("clipped")(scores(), None, beta=1.0)


@pytest.mark.parametrize("family", ["gpt2", "bert", "vit"])
def test_gate_fully_open_equals_vanilla_attention(family: str) -> None:
    model = tiny_model(family)
    x = tiny_inputs(family)
    with torch.no_grad():
        ref = model(**x).logits
        configure_attention(model, gated=True)
        for _, points in attention_points(model):
            points.gate.bias.fill_(40.0)  # sigmoid(40) == 1 in float32
            points.gate.weight.normal_()
        torch.testing.assert_close(model(**x).logits, ref, rtol=1e-5, atol=1e-5)
        for _, points in attention_points(model):
            points.gate.bias.fill_(0.0)
            points.gate.weight.zero_()
        assert (model(**x).logits - ref).abs().max() > 1e-3 * ref.abs().max()


def test_gate_initialisation_and_validation() -> None:
    gate = AttentionGate(num_heads=2, head_dim=4, pi_init=0.25)
    out = gate(torch.randn(3, 5, 8))
    assert out.shape == (3, 2, 5, 1)
    torch.testing.assert_close(out, torch.full_like(out, 0.25))
    with pytest.raises(ValueError, match="pi_init"):
        AttentionGate(2, 4, pi_init=1.0)


def test_variant_choice_is_written_to_the_config_and_changes_the_model() -> None:
    model = tiny_model("opt")
    x = tiny_inputs("opt")
    with torch.no_grad():
        ref = model(**x).logits
        configure_attention(model, softmax="clipped", alpha=4.0)
        clipped = model(**x).logits
    assert model.config.softq_softmax == "clipped" and model.config.softq_softmax_params == {"alpha": 4.0}
    assert not torch.allclose(ref, clipped)
    assert math.isfinite(clipped.abs().max().item())
    # parameters alone change those of the variant the layers have (they were silently ignored)
    configure_attention(model, alpha=0.5)
    assert model.config.softq_softmax == "clipped" and model.config.softq_softmax_params == {"alpha": 0.5}
    with torch.no_grad():
        assert not torch.allclose(model(**x).logits, clipped)
    with pytest.raises(TypeError, match="softmax variant 'softmax' has no parameter"):
        configure_attention(tiny_model("opt"), alpha=0.5)
    # naming the variant the layers have again (to add gates) kept none of its parameters: alpha back to 4
    configure_attention(model, softmax="clipped", zeta=1.1)
    configure_attention(model, softmax="clipped", gated=True)
    assert model.config.softq_softmax_params == {"alpha": 0.5, "zeta": 1.1} and model.config.softq_gated
    configure_attention(model, softmax="softpick")  # another variant starts from its own defaults
    assert model.config.softq_softmax == "softpick" and model.config.softq_softmax_params == {}


def test_a_refused_configuration_changes_no_layer() -> None:
    """An invalid gate_pi_init was refused after layer 0 had its new softmax: a half-clipped model whose config
    (written from the first layer by the next call) described every layer as clipped."""
    from softq.models import attention_modules

    model = tiny_model("bert")
    configure_attention(model)
    with pytest.raises(ValueError, match="pi_init"):
        configure_attention(model, softmax="clipped", alpha=0.5, gated=True, gate_pi_init=1.0)
    with pytest.raises(TypeError, match="no parameter"):
        configure_attention(model, softmax="clipped", alpah=0.5)
    layers = [module.softq for _, module in attention_modules(model)]
    assert [p.softmax_name for p in layers] == ["softmax", "softmax"] and all(p.gate is None for p in layers)
    configure_attention(model, gated=True)
    assert model.config.softq_softmax == "softmax" and model.config.softq_gated


@pytest.mark.parametrize(
    "family, options",
    [("gpt2", {"softmax": "clipped", "alpha": 0.5}), ("bert", {"softmax": "softpick"}), ("gpt2", {"gated": True}),
     ("bert", {"gated": True, "softmax": "clipped", "zeta": 1.1})],
)
def test_fast_training_path_computes_the_same_loss_and_gradients(family: str, options: dict) -> None:
    """SDPA (exact softmax) and torch.compile'd variants must train the very same function."""
    model = tiny_model(family)
    configure_attention(model, **options)
    with torch.no_grad():  # open the gates' weights so a wrong gate path would show
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x = tiny_inputs(family)
    if family == "bert":  # padded second sequence: the fast path must honour the mask
        x["attention_mask"] = torch.ones_like(x["input_ids"])
        x["attention_mask"][1, 15:] = 0
    model.train()
    for module in model.modules():  # dropout draws differ between paths; the maths must not
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logits = model(**x).logits
        loss = (logits * torch.linspace(-1, 1, logits.shape[-1])).sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ref_loss, ref_grads = loss_and_grads()
    with fast_training(model):
        assert all(points.fast_training for _, points in attention_points(model))
        loss, grads = loss_and_grads()
    assert not any(points.fast_training for _, points in attention_points(model))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    assert len(grads) == len(ref_grads)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5)


def test_fast_training_path_handles_a_fully_padded_sequence() -> None:
    """A row with no valid key gives zeros on the eager path; SDPA (torch 2.13) must too, not NaN."""
    model = tiny_model("bert")
    configure_attention(model, gated=True)
    x = tiny_inputs("bert")
    x["attention_mask"] = torch.ones_like(x["input_ids"])
    x["attention_mask"][1] = 0
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    ref = model(**x).logits
    with fast_training(model):
        out = model(**x).logits
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref)


def test_fast_training_path_is_not_taken_by_quantized_or_evaluating_models() -> None:
    """Quantizers and observers need the eager path (they see the probabilities)."""
    model = tiny_model("gpt2")
    configure_attention(model, softmax="clipped", alpha=0.5)
    x = tiny_inputs("gpt2")
    seen: list[torch.Tensor] = []
    _, points = attention_points(model)[0]
    handle = points.probs.register_forward_hook(lambda _m, _i, out: seen.append(out))
    with fast_training(model), torch.no_grad():
        model.eval()
        model(**x)
        assert len(seen) == 1  # eval mode: eager path, probabilities observed
        model.train()
        model(**x)
        assert len(seen) == 1  # training, no quantizer: fast path
        points.v = torch.nn.Linear(8, 8)  # any attached point (here a stand-in quantizer) disables it
        model(**x)
        assert len(seen) == 2
    handle.remove()


def test_compiled_variant_falls_back_to_eager_when_the_compiler_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import softq.softmax as S

    def broken_compile(fn, **_kw):
        def run(*_a, **_k):
            raise OSError("no C++ compiler")
        return run

    monkeypatch.setattr(S, "_COMPILED", {})
    monkeypatch.setattr(S.torch, "compile", broken_compile)
    s, valid = scores(), torch.ones(7, 7).tril()
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        out = S.compiled_softmax("clipped")(s, valid, alpha=0.5)
    torch.testing.assert_close(out, get_softmax("clipped")(s, valid, alpha=0.5))
    torch.testing.assert_close(S.compiled_softmax("clipped")(s, valid, alpha=0.5), out)  # eager from now on
    with pytest.raises(ValueError, match="unknown softmax"):
        S.compiled_softmax("sofmax")


@pytest.mark.parametrize("name", sorted(SOFTMAX_VARIANTS))
def test_non_finite_scores_at_masked_keys_stay_out(name: str) -> None:
    # the promise is "zero, exactly, wherever valid is 0": a NaN or inf score at a masked key used to come out
    # as NaN there (inf * 0), and through the row max or row sum spoil the whole row
    torch.manual_seed(0)
    scores, valid = torch.randn(2, 3, 4, 5), torch.ones(2, 1, 4, 5)
    valid[..., 3] = 0
    ref = get_softmax(name)(scores, valid)
    for bad in (float("nan"), float("inf"), -float("inf")):
        spoiled = scores.clone()
        spoiled[..., 3] = bad
        out = get_softmax(name)(spoiled, valid)
        assert (out[..., 3] == 0).all() and torch.equal(out, ref), (name, bad)


@pytest.mark.parametrize("name", sorted(SOFTMAX_VARIANTS))
def test_float16_rows_stay_finite(name: str) -> None:
    # the plaintext denominators' floor (1e-12) and softpick's eps round to 0 in float16: 0 / 0 on rows of
    # small or non-positive scores
    torch.manual_seed(1)
    x = torch.randn(2, 3, 4, 5)
    for scores in (x * 1e-4, -x.abs(), x):
        assert torch.isfinite(get_softmax(name)(scores.half(), None)).all(), name
    out = get_softmax(name)(x.half(), torch.zeros(2, 1, 4, 5, dtype=torch.half))  # every key masked: zeros
    assert torch.isfinite(out).all() and not out.any(), name


@pytest.mark.parametrize("name, params, error, message", [
    ("clipped", {"alpha": 1e39}, ValueError, "clipped softmax's alpha must be in"),  # inf in float32: NaN rows
    ("clipped", {"alpha": 1e300}, ValueError, "alpha must be in"),
    ("clipped", {"alpha": "0.5"}, TypeError, "alpha must be a number, got str"),
    ("clipped", {"alpha": True}, TypeError, "alpha must be a number, got bool"),  # was taken as 1
    ("clipped", {"alpha": torch.tensor([0.5, 1.0])}, TypeError, "alpha must be a number, got Tensor"),
    ("clipped", {"zeta": None}, TypeError, "zeta must be a number"),
    ("2quad", {"c": 1e20}, ValueError, "2quad's shift c must be in"),  # (x + c)^2 overflows float32: NaN rows
    ("2quad", {"c": "5"}, TypeError, "shift c must be a number"),
])
def test_variant_parameters_out_of_range_or_of_the_wrong_type_are_one_line(name, params, error, message) -> None:
    """Finite Python floats that overflow float32 passed and gave NaN rows (and NaN logits after configure_attention);
    strings, bools and tensors failed deep inside (or, a bool, were taken as a number)."""
    with pytest.raises(error, match=message):
        get_softmax(name)(scores(), CAUSAL, **params)
    model = tiny_model("gpt2")
    with pytest.raises(error, match=message):
        configure_attention(model, softmax=name, **params)
    for bad in ("0.5", None):
        with pytest.raises(TypeError, match="pi_init must be a number"):
            AttentionGate(2, 4, pi_init=bad)
    import numpy as np

    edge = get_softmax(name)(scores(), CAUSAL, **{key: np.float32(1.0) for key in params})  # numpy scalars are numbers
    assert torch.isfinite(edge).all()


@pytest.mark.parametrize("name", sorted(SOFTMAX_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_scores_give_half_probabilities_with_or_without_a_mask(name, dtype) -> None:
    """softmax, clipped, relu_len and sigmoid_len returned float32 for float16 / bfloat16 scores as soon as a (float32)
    mask came with them, the input's dtype without one."""
    x = scores().to(dtype)
    for valid in (None, CAUSAL, CAUSAL.bool()):
        assert get_softmax(name)(x, valid).dtype == dtype, valid


@pytest.mark.parametrize("name", sorted(SOFTMAX_VARIANTS))
def test_rows_without_keys_give_empty_rows(name) -> None:
    """A zero-length key axis: clipped and relu_len divided by zero, sigmoid_len took log(0), softpick's amax failed."""
    for valid in (None, torch.ones(7, 0)):
        out = get_softmax(name)(torch.zeros(2, 3, 7, 0), valid)
        assert out.shape == (2, 3, 7, 0)
