"""Today's families through softq.quantize: pre-norm RMSNorm decoders (Llama, Qwen2, Qwen3, Mistral, Gemma 2,
Phi-3) and encoders (ModernBERT, CLIP text and vision, DINOv2, the T5 and Whisper encoders), tiny models from
configs.  Norms are found by what they compute (softq.norms), SmoothQuant folds into RMSNorm gains (Gemma's 1 + w
too), the residual stream is quantized at every residual norm's input and saves and loads bit for bit, diagnostics
name a massive activation's norm and token, and the quantized decoders decode with a KV cache as in one pass."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers as T

import softq
from softq.calib import diagnostics
from softq.calib.smoothquant import smooth, smooth_inputs
from softq.norms import classify, fold_scale, post_ln, residual_norms
from softq.quant.io import load, save
from softq.quant.layers import QNorm
from softq.quant.points import residual_prefix

from conftest import tiny_model

C = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
DECODERS = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3"]
ENCODERS = ["modernbert", "clip-text", "clip-vision", "dinov2", "t5-encoder", "whisper-encoder"]


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=96, num_key_value_heads=2, max_position_embeddings=256, **C))
    elif name == "qwen2":
        model = T.Qwen2ForCausalLM(T.Qwen2Config(vocab_size=96, num_key_value_heads=2, max_position_embeddings=256, **C))
    elif name == "qwen3":
        model = T.Qwen3ForCausalLM(T.Qwen3Config(vocab_size=96, num_key_value_heads=2, head_dim=8,
                                                 max_position_embeddings=256, **C))
    elif name == "mistral":
        model = T.MistralForCausalLM(T.MistralConfig(vocab_size=96, num_key_value_heads=1, sliding_window=8,
                                                     max_position_embeddings=256, **C))
    elif name == "gemma2":
        model = T.Gemma2ForCausalLM(T.Gemma2Config(
            vocab_size=96, num_key_value_heads=2, head_dim=8, sliding_window=8, query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0, final_logit_softcapping=None, max_position_embeddings=256, **C))
    elif name == "phi3":
        model = T.Phi3ForCausalLM(T.Phi3Config(vocab_size=96, num_key_value_heads=2, max_position_embeddings=256,
                                               pad_token_id=0, bos_token_id=1, eos_token_id=2, **C))
    elif name == "modernbert":
        model = T.ModernBertModel(T.ModernBertConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            global_attn_every_n_layers=2, local_attention=8, max_position_embeddings=256, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))
    elif name == "clip-text":
        model = T.CLIPTextModel(T.CLIPTextConfig(vocab_size=96, max_position_embeddings=64, bos_token_id=1,
                                                 eos_token_id=2, **C))
    elif name == "clip-vision":
        model = T.CLIPVisionModel(T.CLIPVisionConfig(image_size=32, patch_size=8, **C))
    elif name == "dinov2":
        model = T.Dinov2Model(T.Dinov2Config(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, mlp_ratio=2))
    elif name == "t5-encoder":
        model = T.T5EncoderModel(T.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                            relative_attention_num_buckets=8))
    elif name == "whisper-encoder":
        model = T.models.whisper.modeling_whisper.WhisperEncoder(T.WhisperConfig(
            num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64, max_source_positions=16,
            vocab_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1))
    else:
        raise KeyError(name)
    return model.eval()


def inputs(model: torch.nn.Module, seed: int, batch: int = 2, seq: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    main = model.main_input_name
    if main == "pixel_values":
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=g)}
    if main == "input_features":
        return {"input_features": torch.randn(batch, 16, 32, generator=g)}
    ids = torch.randint(3, 96, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, seq - 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def output(model: torch.nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**x)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float()


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


@functools.cache
def quantized(name: str, **config) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(float, quantized) models of ``name``, calibrated on 3 batches; built once per configuration."""
    model = build(name)
    return model, softq.quantize(model, [inputs(model, s) for s in range(3)], softq.QuantConfig(**config))


@pytest.mark.parametrize("name", DECODERS + ENCODERS)
def test_default_w8a8_is_quantized_and_close_on_held_out_input(name: str) -> None:
    model, qmodel = quantized(name)
    x = inputs(model, 9)
    err = rel_error(output(qmodel, x), output(model, x))
    assert 1e-4 < err <= 0.1, err


def test_norms_are_told_by_what_they_compute() -> None:
    """Llama's RMSNorm (w), Gemma's (1 + w, weights 0 when fresh), T5's, ModernBERT's bias-free LayerNorm; Qwen3's
    per-head q/k norms are norms but not the residual stream's; an attention or MLP module is no norm."""
    forms = {name: {n: f for n, (_, f) in residual_norms(build(name)).items()}
             for name in ("llama", "gemma2", "t5-encoder", "modernbert", "qwen3")}
    assert {(f.centred, f.offset, f.bias) for f in forms["llama"].values()} == {(False, 0.0, False)}
    assert {(f.centred, f.offset, f.bias) for f in forms["gemma2"].values()} == {(False, 1.0, False)}
    assert len(forms["gemma2"]) == 4 * 2 + 1  # input, post-attention, pre- and post-feedforward norms, final norm
    assert {(f.centred, f.offset) for f in forms["t5-encoder"].values()} == {(False, 0.0)}
    assert {(f.centred, f.bias) for f in forms["modernbert"].values()} == {(True, False)}
    qwen3 = build("qwen3")
    assert classify(qwen3.model.layers[0].self_attn.q_norm) is not None
    assert not any("q_norm" in n or "k_norm" in n for n in forms["qwen3"])
    assert classify(qwen3.model.layers[0].self_attn) is None and classify(qwen3.model.layers[0].mlp) is None


@pytest.mark.parametrize("name", ["llama", "gemma2", "t5-encoder", "modernbert"])
def test_fold_scale_keeps_each_norm_form_exact(name: str) -> None:
    model = build(name)
    module, form = next(iter(residual_norms(model).values()))
    x = torch.randn(2, 5, 32) * 4 + 1
    s = torch.rand(32) * 3 + 0.2
    with torch.no_grad():
        before = module(x)
        fold_scale(module, form, s)
        assert torch.allclose(module(x) * s, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gemma2", "phi3", "t5-encoder", "modernbert"])
def test_smoothquant_folds_into_rmsnorm_gains_and_keeps_the_function(name: str) -> None:
    """Every norm whose output only Linear layers read is smoothed (ModernBERT's embedding norm also feeds layer
    0's residual: left alone); the float function is unchanged."""
    model = build(name)
    x = inputs(model, 9)
    ref = output(model, x)
    done = smooth(model, [inputs(model, s) for s in range(2)], alpha=0.5)
    blocks = len(model.config.layer_types) if name == "modernbert" else 2
    assert len(done) >= blocks and not any("embeddings" in n for n in done), done
    assert rel_error(output(model, x), ref) < 1e-5


@pytest.mark.parametrize("name", ["llama", "gemma2", "t5-encoder"])
def test_smoothquant_and_quantized_residual_stream_save_and_load_bit_exact(name: str, tmp_path) -> None:
    """Each RMSNorm form: SmoothQuant folded into it, its input quantized (QNorm; not Qwen3-style q/k norms), the
    quantized model close to float, and a saved model that loads computing the same bits."""
    model, qmodel = quantized(name, smoothquant_alpha=0.5, quantize_residual=True, input_smoothing=None)
    wrapped = [n for n, m in qmodel.named_modules() if isinstance(m, QNorm)]
    assert len(wrapped) == len(residual_norms(model)), wrapped
    x = inputs(model, 9)
    got = output(qmodel, x)
    assert 1e-4 < rel_error(got, output(model, x)) <= 0.1
    save(qmodel, tmp_path / "q")
    assert torch.equal(output(load(tmp_path / "q"), x), got)


@pytest.mark.parametrize("name, down", [("llama", "model.layers.{}.mlp.down_proj"),
                                        ("gemma2", "model.layers.{}.mlp.down_proj"), ("modernbert", "layers.{}.mlp.Wo")])
def test_input_smoothing_reaches_the_gated_mlp_down_projection(name: str, down: str) -> None:
    """The input of a SwiGLU / GeGLU down projection (act(gate) * up, read by no norm) gets a smoothing of its own,
    by smooth_inputs and by quantize's one-pass smoothing; the float function is kept."""
    model = build(name)
    x = inputs(model, 9)
    ref = output(model, x)
    done = smooth_inputs(model, [inputs(model, s) for s in range(2)], alpha=0.5)
    assert down.format(0) in done and down.format(1) in done
    assert rel_error(output(model, x), ref) < 1e-5
    if name == "llama":
        _, qmodel = quantized(name, input_smoothing=0.5, weight_bias_correction=False)
        assert qmodel.get_submodule(down.format(0)).input_scale.numel() == 64


def test_post_ln_is_told_from_the_forward_pass() -> None:
    assert post_ln(tiny_model("bert")) and not post_ln(tiny_model("gpt2"))
    assert not any(post_ln(build(name)) for name in ("llama", "gemma2", "modernbert", "dinov2"))
    torch.manual_seed(0)
    opt = T.OPTForCausalLM(T.OPTConfig(vocab_size=64, ffn_dim=64, max_position_embeddings=128, hidden_size=32,
                                       num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
                                       do_layer_norm_before=False))  # OPT-350m's layout
    assert post_ln(opt.eval())


def test_diagnostics_name_the_norm_input_and_token_of_a_massive_activation() -> None:
    model = build("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[1, 5] = 300.0  # token id 1 (a BOS) carries a massive activation in dim 5
    batches = [inputs(model, s) for s in range(2)]
    for batch in batches:
        batch["input_ids"][:, 0] = 1
    stats = diagnostics.collect(model, batches)
    peak = stats.layers[0].peak
    assert (peak.norm, peak.token, peak.dim) == ("model.layers.0.input_layernorm", 0, 5) and peak.ratio > 1000
    assert "input of model.layers.0.input_layernorm, token 0, dim 5" in stats.table()
    quiet = diagnostics.collect(build("llama"), batches)
    assert "massive activations" not in quiet.table()
    _, qmodel = quantized("llama", smoothquant_alpha=0.5, quantize_residual=True, input_smoothing=None)
    peak = diagnostics.collect(qmodel, batches).layers[1].peak  # the QNorm's input, before its quantizer
    assert peak.norm.startswith("model.layers.1.") and peak.norm.endswith("layernorm")


def _decode(qmodel: torch.nn.Module, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """Logits of ``prefix`` tokens at once, then one token at a time with the KV cache."""
    out = qmodel(input_ids=ids[:, :prefix], use_cache=True)
    steps = [out.logits]
    for t in range(prefix, ids.shape[1]):
        out = qmodel(input_ids=ids[:, t:t + 1], cache=out.cache if hasattr(out, "cache") else out.past_key_values,
                     use_cache=True)
        steps.append(out.logits)
    return torch.cat(steps, 1)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gemma2", "phi3"])
def test_kv_cache_decoding_and_generate_equal_full_passes(name: str) -> None:
    """14 tokens: past Mistral's and Gemma 2's sliding window of 8; Gemma 2 with its logit softcap and
    query_pre_attn_scalar.  Greedy generate() gives the argmax of full passes."""
    _, qmodel = quantized(name)
    ids = torch.randint(3, 96, (1, 14), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = qmodel(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(_decode(qmodel, ids, 6), full, rtol=0, atol=1e-5 * float(full.abs().max()))
        generated = qmodel.generate(ids[:, :6], max_new_tokens=6, do_sample=False, pad_token_id=0)
        expected = ids[:, :6]
        for _ in range(6):
            step = qmodel(input_ids=expected, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, step], 1)
    assert torch.equal(generated, expected)


def test_residual_prefix_follows_the_learned_leading_tokens() -> None:
    """'auto': the vision encoders' learned leading tokens (CLIP's class embedding, DINOv2's [CLS] and registers),
    found by running the model; none for a decoder or the Whisper encoder; an explicit count is refused where the
    model puts no token first that is not input, and taken by a text encoder or a decoder."""
    cfg = softq.QuantConfig(quantize_residual=True)
    assert residual_prefix(build("clip-vision"), cfg) == 1 and residual_prefix(build("dinov2"), cfg) == 1
    registers = T.Dinov2WithRegistersModel(T.Dinov2WithRegistersConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
        num_register_tokens=4)).eval()
    assert residual_prefix(registers, cfg) == 5
    assert residual_prefix(build("llama"), cfg) == 0 and residual_prefix(build("modernbert"), cfg) == 0
    whisper = build("whisper-encoder")
    assert residual_prefix(whisper, cfg) == 0
    with pytest.raises(ValueError, match="puts no learned token"):
        residual_prefix(whisper, softq.QuantConfig(quantize_residual=True, residual_prefix=1))
    modernbert = build("modernbert")  # local attention: later query rows do not see the first keys
    x = inputs(modernbert, 9)
    qmodel = softq.quantize(modernbert, [inputs(modernbert, s) for s in range(2)],
                            softq.QuantConfig(quantize_residual=True, residual_prefix=1, input_smoothing=None))
    assert rel_error(output(qmodel, x), output(modernbert, x)) <= 0.1
    with pytest.raises(ValueError, match="left-padded"):
        qmodel(input_ids=x["input_ids"], attention_mask=x["attention_mask"].flip(-1))


def test_smoothing_into_v_is_refused_where_grouped_query_attention_leaves_nothing_to_fold() -> None:
    model = build("mistral")  # one key-value head for four query heads
    with pytest.raises(ValueError, match="grouped-query attention"):
        softq.quantize(model, [inputs(model, s) for s in range(2)],
                       softq.QuantConfig(input_smoothing=0.5, smoothing_into_v=True, weight_bias_correction=False))


def test_decoder_prefix_scales_take_a_massive_first_token_and_keep_cached_decoding_exact() -> None:
    """A Llama whose first token carries a massive activation (300 in dim 5): one residual scale for every token
    loses the other tokens' dim 5; residual_prefix=1 gives position 0 scales of its own, and a cached step (whose
    first row is a later position) takes the shared ones, as the full pass does."""
    model = build("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[1, 5] = 300.0
    calib, held = [inputs(model, s) for s in range(3)], inputs(model, 9)
    for batch in [*calib, held]:
        batch["input_ids"][:, 0] = 1
    ref = output(model, held)
    errors = {}
    for prefix in (0, 1):
        qmodel = softq.quantize(model, calib, softq.QuantConfig(quantize_residual=True, residual_prefix=prefix,
                                                                input_smoothing=None))
        errors[prefix] = rel_error(output(qmodel, held), ref)
    assert errors[1] < errors[0] / 2, errors
    ids = held["input_ids"][:1]
    with torch.no_grad():
        full = qmodel(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(_decode(qmodel, ids, 4), full, rtol=0, atol=1e-5 * float(full.abs().max()))
