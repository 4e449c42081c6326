"""softq.mpc on today's families: RMSNorm, SiLU / SwiGLU, GeGLU, RoPE, GQA, local windows, T5's bias.

Accuracy of the new operators against torch over the ranges real models produce (massive
activations included), the exact path of a tiny Llama (GQA, RoPE, RMSNorm, SwiGLU), ModernBERT
(GeGLU, RoPE, local/global attention, no biases) and T5 encoder (relative position bias, no
scaling) in the in-process 1-party CrypTen, one run in real parties, SiLU surrogates in
distillation, and the one-line refusals.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import transformers as T

from softq.mpc.graph import GraphInterpreter, SecretOneHot, export_model
from softq.mpc.party import configure_crypten
from softq.mpc.runner import free_port
from softq.mpc.surrogates import activation_kind, configure_surrogates

torch.set_num_threads(1)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             initializer_range=0.2)  # trained-model scale (as tests/test_mpc.py)


def tiny_llama(seed: int = 0) -> T.LlamaForCausalLM:
    torch.manual_seed(seed)
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, num_key_value_heads=2, max_position_embeddings=64,
                                            **SMALL)).eval()


def tiny_modernbert() -> T.ModernBertModel:
    torch.manual_seed(1)
    return T.ModernBertModel(T.ModernBertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        global_attn_every_n_layers=2, local_attention=4, max_position_embeddings=64, pad_token_id=0,
        cls_token_id=1, sep_token_id=2, bos_token_id=None, eos_token_id=None, initializer_range=0.2)).eval()


def tiny_t5() -> T.T5EncoderModel:
    torch.manual_seed(2)
    return T.T5EncoderModel(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                       relative_attention_num_buckets=8, initializer_factor=1.0)).eval()


def text_inputs(seq: int = 10, seed: int = 3) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 64, (2, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, seq - 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def crypten1():
    os.environ.setdefault("RENDEZVOUS", f"tcp://127.0.0.1:{free_port()}")
    crypten = configure_crypten("TFP")
    crypten.init()
    return crypten


def encrypted(crypten, model, inputs, softmax="softmax", gelu=None):
    """(encrypted output, plaintext output of the same surrogate model), in one process."""
    configure_surrogates(model, softmax=softmax, gelu=gelu)
    with torch.no_grad():
        out = model(**inputs)
    plain = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    ep = export_model(model, inputs)
    interp = GraphInterpreter(ep)
    params = {n: crypten.cryptensor(ep.state_dict[n].float()) for n in interp.parameter_names()}
    vocab = model.get_input_embeddings().weight.shape[0]
    onehot = torch.nn.functional.one_hot(inputs["input_ids"], vocab).float()
    secret = {**inputs, "input_ids": SecretOneHot(crypten.cryptensor(onehot), tuple(inputs["input_ids"].shape))}
    with crypten.no_grad():
        return interp.run(params, secret)[0].get_plain_text(), plain


def relative(out, plain, mask):
    valid = mask.bool()
    return float((out - plain)[valid].norm() / plain[valid].norm())


# ---------------------------------------------------------------------------
# operators (1-party arithmetic)
# ---------------------------------------------------------------------------


def test_silu_swiglu_and_geglu_match_torch_over_the_whole_line(crypten1):
    from softq.mpc.approx import glu, silu

    x = torch.cat([torch.linspace(-16, 16, 3201), torch.tensor([-3000.0, -546.0, -11.4, -11.2, 11.2, 11.4, 546.0, 3000.0])])
    got = silu(crypten1.cryptensor(x)).get_plain_text().double()
    err = (got - torch.nn.functional.silu(x.double())).abs()
    assert err.max() < 2.6e-4  # the docstring's bound: 2.4e-4 (+ 16-bit rounding)
    assert err[(x.abs() > 12)].max() < 1e-4  # the identity / zero tails, far from the join
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(4, 64, generator=g) * 4, torch.randn(4, 64, generator=g) * 20
    up[0, :4] = 1000.0  # a massive activation in the up projection
    G, U = crypten1.cryptensor(gate), crypten1.cryptensor(up)
    for act, ref in (("silu", torch.nn.functional.silu(gate.double())),
                     ("erf", torch.nn.functional.gelu(gate.double())),
                     ("tanh", torch.nn.functional.gelu(gate.double(), approximate="tanh"))):
        bound = (2.5e-4 if act == "silu" else 5e-5) * up.abs().double() + 2**-15 * (ref.abs() + up.abs())
        assert ((glu(G, U, act).get_plain_text().double() - ref * up.double()).abs() <= bound).all(), act


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_is_accurate_with_massive_activations(crypten1, offset):
    from softq.mpc.norms import rms_norm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, 64, generator=g) * torch.tensor([0.02, 1.0, 30.0, 300.0]).view(4, 1, 1)
    x[:, 0, 7] = 3000.0  # Sun et al.'s massive activations: thousands, one dimension, the first token
    w = torch.rand(64, generator=g) + 0.5 - offset  # Gemma's gain is 1 + w
    ref = rms_norm(x.double(), w.double(), 1e-6, offset)
    got = rms_norm(crypten1.cryptensor(x), crypten1.cryptensor(w), 1e-6, offset).get_plain_text().double()
    err = (got - ref).abs() / ref.abs().amax(-1, keepdim=True)
    assert err.max() < 5e-4  # the docstring's bound, relative to the row's largest output
    assert err[:, 0].max() < 5e-4 and ref[:, 0, 7].abs().min() > 3  # the massive token, normalised (sqrt(64) w)


def test_rms_norms_and_activations_are_found_by_what_they_compute():
    from transformers.activations import ACT2FN

    from softq.mpc.norms import rms_norms

    llama = tiny_llama()
    norms = rms_norms(llama)
    assert len(norms) == 2 * 2 + 1 and set(norms.values()) == {(llama.config.rms_norm_eps, 0.0)}
    gemma = T.Gemma2ForCausalLM(T.Gemma2Config(vocab_size=64, num_key_value_heads=2, head_dim=8, **SMALL))
    assert {offset for _, offset in rms_norms(gemma).values()} == {1.0}  # x (1 + w)
    assert rms_norms(tiny_modernbert()) == {}  # LayerNorm without bias is not RMSNorm (off-centre probe)
    assert [activation_kind(ACT2FN[n]) for n in ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu", "relu")] == [
        "silu", "gelu", "gelu", None, None]


# ---------------------------------------------------------------------------
# the exact path on the new families (1-party arithmetic)
# ---------------------------------------------------------------------------


def test_llama_exact_path_gqa_rope_rmsnorm_swiglu(crypten1):
    from softq.mpc.ranges import RangePass

    model, x = tiny_llama(), text_inputs()
    out, plain = encrypted(crypten1, model, x)
    assert relative(out, plain, x["attention_mask"]) < 1e-2
    with torch.no_grad():  # the surrogate model is the model: exact softmax and native SiLU
        assert torch.allclose(plain, tiny_llama()(**x).logits, atol=1e-5)
    ep = export_model(model, x)
    ops = {str(n.target) for n in ep.graph.nodes}
    assert "softq_mpc.rms_norm.default" in ops and "aten.rsqrt.default" not in ops  # one node per RMSNorm
    rp = RangePass(ep)
    rp.run(x)
    secret = {r.node for r in rp.records.values()}
    tables = [n.name for n in ep.graph.nodes if str(n.target) in ("aten.cos.default", "aten.sin.default")]
    assert tables and not secret & set(tables)  # RoPE's cos/sin: public, computed in plaintext by every party
    assert any(n.startswith("repeat_interleave") for n in secret)  # GQA: 2 K/V heads for 4 query heads


@pytest.mark.parametrize("build", [tiny_modernbert, tiny_t5], ids=["modernbert", "t5-encoder"])
def test_encoder_exact_path(crypten1, build):
    """ModernBERT: GeGLU, RoPE, local (window 4 of 10 tokens) and global layers, no biases; T5: relative
    position bias as a keyword of its own, no 1/sqrt(d) scaling."""
    model, x = build(), text_inputs()
    out, plain = encrypted(crypten1, model, x, gelu="erf" if build is tiny_modernbert else None)
    assert relative(out, plain, x["attention_mask"]) < 1e-2
    eager = build()
    eager.set_attn_implementation("eager")
    with torch.no_grad():  # softq's attention computes the model's own function (T5's bias included)
        ref = eager(**x).last_hidden_state
    valid = x["attention_mask"].bool()
    assert torch.allclose(plain[valid], ref[valid], atol=1e-4)


def test_softcap_and_bad_activation_names_are_refused_in_one_line():
    gemma = T.Gemma2ForCausalLM(T.Gemma2Config(vocab_size=64, num_key_value_heads=2, head_dim=8,
                                               attn_logit_softcapping=5.0, **SMALL)).eval()
    configure_surrogates(gemma, softmax="softmax", gelu=None)
    with pytest.raises(ValueError, match=r"soft-capping .*tanh\(scores / 5\) \* 5"):
        export_model(gemma, text_inputs())
    with pytest.raises(ValueError, match="activation is SILU: 'erf' is not one of its surrogates"):
        configure_surrogates(tiny_llama(), gelu="erf")
    with pytest.raises(ValueError, match="activation is GELU: 'silu' is not one of its surrogates"):
        configure_surrogates(tiny_modernbert(), gelu="silu")


# ---------------------------------------------------------------------------
# SiLU surrogates in distillation, real parties
# ---------------------------------------------------------------------------


def test_llama_student_with_quad_silu_distils_and_runs_encrypted(crypten1):
    from softq.mpc.distill import distill

    teacher = tiny_llama(seed=4)
    gen = torch.Generator().manual_seed(5)

    def batches():
        while True:
            yield {"input_ids": torch.randint(0, 64, (8, 8), generator=gen), "attention_mask": torch.ones(8, 8, dtype=torch.long)}

    probe = {"input_ids": torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(6))}
    before = copy.deepcopy(teacher)
    configure_surrogates(before, softmax="2quad", gelu="quad")
    student, history = distill(teacher, batches(), softmax="2quad", gelu="quad", steps=(30, 30), lr=(3e-3, 1e-3),
                               progress=False, dropout=False)
    acts = [m for m in student.modules() if type(m).__name__ == "SurrogateGELU"]
    assert len(acts) == 2 and {(m.kind, m.name) for m in acts} == {("silu", "quad")}
    assert sum(history.stage1[-5:]) < 0.8 * sum(history.stage1[:5]) and len(history.stage2) == 30
    with torch.no_grad():
        t = teacher(**probe).logits
        gap_before = (before(**probe).logits - t).pow(2).mean()
        gap_after = (student(**probe).logits - t).pow(2).mean()
    assert gap_after < 0.7 * gap_before  # 0.56 measured
    x = text_inputs(seq=8)
    out, plain = encrypted(crypten1, student, x, softmax="2quad", gelu="quad")
    assert relative(out, plain, x["attention_mask"]) < 1e-2


def test_llama_in_two_parties_with_rounds_of_the_new_ops():
    from softq.mpc import run

    model, x = tiny_llama(), text_inputs(seq=8)
    result = run(model, x, softmax="softmax", gelu=None, timeout=90)
    ref = copy.deepcopy(model)
    configure_surrogates(ref, softmax="softmax", gelu=None)
    with torch.no_grad():
        plain = ref(**x).logits
    assert relative(result.logits, plain, x["attention_mask"]) < 1e-2
    kinds = result.report.by_kind()
    assert kinds["rmsnorm"].calls == 5 and kinds["silu:native"].calls == 2
    # measured rounds per call: LayerNorm's 21 less the mean's truncation; SiLU as GELU (comparison + depth-4 series)
    assert kinds["rmsnorm"].rounds == 20 * 5 and kinds["silu:native"].rounds == 20 * 2
    assert kinds["silu:native"].bytes > 0 and result.report.rounds < 600


def test_range_check_covers_rms_norm():
    from softq.mpc import RangeError
    from softq.mpc.ranges import check_model

    model = tiny_llama()
    configure_surrogates(model, softmax="softmax", gelu=None)
    records = check_model(model, text_inputs())
    assert {("rmsnorm", "layernorm variance"), ("rmsnorm", "layernorm output"), ("silu:native", "value")} <= {
        (r.op, r.quantity) for r in records}
    with torch.no_grad():  # an RMSNorm output beyond the lazy product's bound (2^13)
        model.model.layers[0].post_attention_layernorm.weight *= 1e4
    with pytest.raises(RangeError, match="layer0 rmsnorm .*layernorm output"):
        check_model(model, text_inputs())
