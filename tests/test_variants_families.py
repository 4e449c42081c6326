"""Attention variants (clipped softmax, softpick, gates, constant sinks) and the outlier fine-tune on today's families:
a GQA decoder, Gemma 2 (soft-capping, heads wider than the residual stream), ModernBERT (local windows), a vision
encoder, T5 (position bias as its own argument), Whisper (audio frames at position 0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T

import softq
from softq.attention import attention_points, configure_attention, init_constant_sinks
from softq.calib.outlier_finetune import OutlierFinetuneConfig, finetune_outliers, make_student
from softq.calib.train import convert_to_gated
from test_outlier_finetune import TEXTS, tokenizer  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

C = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def build(name: str, vocab: int = 96) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=vocab, num_key_value_heads=2, max_position_embeddings=256,
                                                 pad_token_id=0, bos_token_id=2, eos_token_id=3, **C))
    elif name == "mistral":
        model = T.MistralForCausalLM(T.MistralConfig(vocab_size=vocab, num_key_value_heads=1, sliding_window=8,
                                                     max_position_embeddings=256, pad_token_id=0, bos_token_id=2,
                                                     eos_token_id=3, **C))
    elif name == "gemma2":  # 4 heads of 16: the heads are twice as wide as the 32-wide residual stream
        model = T.Gemma2ForCausalLM(T.Gemma2Config(vocab_size=vocab, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                                   query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                                                   final_logit_softcapping=None, max_position_embeddings=256,
                                                   pad_token_id=0, bos_token_id=2, eos_token_id=3, **C))
    elif name == "modernbert":
        model = T.ModernBertModel(T.ModernBertConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=3, num_attention_heads=4,
                                                     global_attn_every_n_layers=2, local_attention=8,
                                                     max_position_embeddings=256, pad_token_id=0, bos_token_id=2,
                                                     eos_token_id=3, cls_token_id=2, sep_token_id=3))
    elif name == "dinov2":
        model = T.Dinov2Model(T.Dinov2Config(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, mlp_ratio=2))
    elif name == "t5-encoder":
        model = T.T5EncoderModel(T.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                            relative_attention_num_buckets=8))
    elif name == "whisper-encoder":
        model = T.models.whisper.modeling_whisper.WhisperEncoder(T.WhisperConfig(
            num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64, max_source_positions=16, vocab_size=vocab))
    else:
        raise KeyError(name)
    return model.eval()


def inputs(model: torch.nn.Module, seed: int = 1, batch: int = 2, seq: int = 12) -> dict[str, torch.Tensor]:
    """A batch whose text starts with one fixed token (id 2, [CLS]/BOS), the second sequence right-padded; longer
    than the sliding windows (8), so later queries cannot see position 0."""
    g = torch.Generator().manual_seed(seed)
    if model.main_input_name == "pixel_values":
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=g)}
    if model.main_input_name == "input_features":
        return {"input_features": torch.randn(batch, 16, 32, generator=g)}
    ids = torch.randint(5, 57, (batch, seq), generator=g)
    ids[:, 0] = 2
    mask = torch.ones_like(ids)
    mask[-1, seq - 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def output(model: torch.nn.Module, x: dict) -> torch.Tensor:
    out = model(**x)
    return (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name, softmax, params", [
    ("llama", "softpick", {}),
    ("gemma2", "clipped", {"alpha": 0.5}),
    ("modernbert", "clipped", {"alpha": 0.5}),
    ("dinov2", "softpick", {}),
])
def test_variants_train_save_reload_and_quantize(name, softmax, params, tokenizer, tmp_path: Path) -> None:  # noqa: F811
    model = build(name)
    x = inputs(model)
    configure_attention(model, softmax, gated=True, constant_sink=True, **params)
    init_constant_sinks(model, [inputs(model, seed=2), inputs(model, seed=3)])
    points = [p for _, p in attention_points(model)]
    # one gate per query head (GQA: 4 query heads over 2 key/value heads), reading a per-head slice of the input
    assert all(p.gate.weight.shape == (4, 8) and p.sink.key.shape[0] == 4 for p in points)
    model.train()
    output(model, x).square().mean().backward()
    assert all(p.gate.weight.grad.abs().sum() > 0 and p.sink.value.grad.abs().sum() > 0 for p in points)
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        ref = output(model, x)
    model.save_pretrained(tmp_path)
    if "input_ids" in x:
        tokenizer.save_pretrained(tmp_path)
    loaded = softq.hf.load_model_dir(tmp_path).model
    assert loaded.config.softq_softmax == softmax and loaded.config.softq_softmax_params == params
    assert all(p.gate is not None and p.sink is not None for _, p in attention_points(loaded))
    with torch.no_grad():
        assert torch.equal(output(loaded, x), ref)
    qmodel = softq.quantize(loaded, [inputs(model, seed=s) for s in (2, 3, 4)])
    assert all(p.gate is not None and p.sink is not None and p.softmax_name == softmax
               for _, p in attention_points(qmodel))
    with torch.no_grad():
        assert rel(output(qmodel, x), ref) < 0.1


@pytest.mark.parametrize("name", ["llama", "gemma2", "modernbert", "t5-encoder", "whisper-encoder"])
def test_gated_conversion_keeps_the_function(name) -> None:
    """The output projection is found on the model (Llama's o_proj, ModernBERT's Wo, T5's o, Whisper's out_proj),
    and T5's relative position bias, passed as its own argument, reaches the scores."""
    model = build(name)
    x = inputs(model)
    with torch.no_grad():
        ref = output(model, x)
        configure_attention(model)
        assert rel(output(model, x), ref) < 1e-5  # softq's attention computes the family's own function
        convert_to_gated(model, 0.3)
        assert rel(output(model, x), ref) < 1e-5
    assert all(abs(float(torch.sigmoid(p.gate.bias[0].detach())) - 0.3) < 1e-6 for _, p in attention_points(model))


def test_constant_sink_is_refused_where_position_zero_is_not_one_token() -> None:
    llama = build("llama")
    configure_attention(llama, constant_sink=True)
    x = inputs(llama)
    x["input_ids"][1, 0] = 7  # a text without BOS: its first word is no fixed token
    with pytest.raises(ValueError, match=r"^init_constant_sinks: position 0 is not one fixed token") as err:
        init_constant_sinks(llama, [x])
    assert "\n" not in str(err.value)
    whisper = build("whisper-encoder")  # position 0 is an audio frame
    configure_attention(whisper, constant_sink=True)
    with pytest.raises(ValueError, match="position 0 is not one fixed token"):
        init_constant_sinks(whisper, [inputs(whisper)])


def test_constant_sink_refuses_a_cache_that_dropped_the_first_token() -> None:
    model = build("mistral")
    configure_attention(model, constant_sink=True)
    init_constant_sinks(model, [inputs(model, seed=2)])
    prompt = torch.tensor([[2, 9, 10, 11]])
    out = model.generate(prompt, max_new_tokens=3, do_sample=False, min_new_tokens=3, pad_token_id=0)
    assert out.shape == (1, 7)  # within the window (8) the cache still holds position 0
    with pytest.raises(ValueError, match="cache holds only the last 8 of 9 positions") as err:
        model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8, pad_token_id=0)
    assert "\n" not in str(err.value)


def test_outlier_finetune_on_modernbert(tokenizer) -> None:  # noqa: F811
    model = build("modernbert", vocab=len(tokenizer))
    batch = dict(tokenizer(TEXTS[:3], padding=True, return_tensors="pt"))
    student = make_student(model, OutlierFinetuneConfig(method="gated", pi_init=0.3), [batch])
    with torch.no_grad():  # the student starts as the teacher: gates rescaled into Wo, [CLS] a constant sink
        assert rel(output(student, batch), output(model, batch)) < 1e-3
    config = OutlierFinetuneConfig(method="gated", steps=12, batch_size=3, max_length=24, min_words=3, lr=3e-3,
                                   warmup=1, penalty_weight=1.0, penalty_threshold=1.0)
    result = finetune_outliers(model, tokenizer, TEXTS, config, progress=False, device="cpu")
    first, last = result.history[0], result.history[-1]
    assert first["penalty"] > 0.5 and last["loss"] < 0.5 * first["loss"]
    assert last["ln_input_max"] < 0.8 * first["ln_input_max"]  # RMS/LayerNorm inputs found without a class table
    with torch.no_grad():
        t, s = output(model, batch).mean(1), output(result.model, batch).mean(1)
    assert torch.nn.functional.cosine_similarity(t, s).min() > 0.9
    llama = build("llama", vocab=len(tokenizer))
    with pytest.raises(ValueError, match="pooling='cls' reads the first token, which in a causal model sees only"):
        finetune_outliers(llama, tokenizer, TEXTS, OutlierFinetuneConfig(pooling="cls"), progress=False)


def test_gated_sink_llama_exports(tmp_path: Path) -> None:
    """The gates and sinks of a GQA decoder reach the ONNX file: onnxruntime computes what the quantized model does,
    and not what it does with each gate held at its opening."""
    import numpy as np

    from softq.export import onnx_utils, to_onnx

    model = build("llama")
    convert_to_gated(model, 0.3)
    configure_attention(model, constant_sink=True)
    init_constant_sinks(model, [inputs(model, seed=2)])
    with torch.no_grad():
        for _, p in attention_points(model):
            p.gate.weight.normal_()  # gates that differ between tokens, so that a file without them shows
    qmodel = softq.quantize(model, [inputs(model, seed=s) for s in (2, 3, 4)])
    x = inputs(model)
    with torch.no_grad():
        ref = output(qmodel, x).numpy()
    path = to_onnx(qmodel, tmp_path / "m.onnx", x)
    got = onnx_utils.run(str(path), {k: v.numpy() for k, v in x.items()}, "all")[0]
    valid = x["attention_mask"].numpy().astype(bool)
    error = np.abs(got - ref)[valid].max()
    assert error < 0.02 * np.abs(ref).max()
    with torch.no_grad():
        for _, p in attention_points(qmodel):
            p.gate.weight.zero_()
        constant = output(qmodel, x).numpy()
    assert np.abs(got - constant)[valid].max() > 10 * error


def test_gate_reads_the_input_under_the_forwards_own_name() -> None:
    """An attention module called by keyword: its input is the argument its forward names first (``hidden_states``
    in Llama; MobileBERT's ``query_tensor``, SAM's ``query``)."""
    from softq.attention import _module_input

    class Attention(torch.nn.Module):
        def forward(self, query_tensor, attention_mask=None):
            return query_tensor

    x, mask = torch.ones(1, 2, 8), torch.ones(1, 2)
    assert _module_input(Attention(), (), {"attention_mask": mask, "query_tensor": x}) is x
    assert _module_input(Attention(), (x,), {"attention_mask": mask}) is x
