"""The softmax variants' defining properties, and their plumbing into Hugging Face attention."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_inputs, tiny_model

from softq.attention import AttentionGate, attention_points, configure_attention
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
    torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-5)


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
