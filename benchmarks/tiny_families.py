"""Tiny models of today's Hugging Face families, from configs (no downloads), and inputs for them: shared by
tests/test_export_families.py and benchmarks/bench_export_families.py.

Each family in :data:`FAMILIES` has 2-3 layers, hidden size 32 and 4 heads, with the feature that family brings:
grouped K/V heads (Llama, Qwen2, Mistral with one K/V head), sliding windows of 8 (Mistral, Gemma 2, gpt-oss),
Gemma 2's soft-capping and ``query_pre_attn_scalar``, ModernBERT's local windows, CLIP's causal text encoder,
T5's relative position bias, Whisper's audio encoder and gpt-oss's learned sink logits (its routed experts
swapped for a dense feed-forward: :func:`dense_gpt_oss`).
"""

from __future__ import annotations

import numpy as np
import torch
import transformers as T
from torch import nn

FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "phi3", "gpt_oss", "modernbert", "clip-text", "t5-encoder",
            "clip-vision", "dinov2", "whisper-encoder")

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
DECODER = dict(vocab_size=96, max_position_embeddings=256, **COMMON)


def build(family: str) -> nn.Module:
    """A fresh model of ``family`` (seeded), in train mode as Hugging Face builds it."""
    torch.manual_seed(0)
    if family == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(num_key_value_heads=2, **DECODER))
    if family == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(num_key_value_heads=2, **DECODER))
    if family == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(num_key_value_heads=1, sliding_window=8, **DECODER))
    if family == "gemma2":
        return T.Gemma2ForCausalLM(T.Gemma2Config(
            num_key_value_heads=2, head_dim=8, sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
            final_logit_softcapping=None, **DECODER))
    if family == "phi3":
        return T.Phi3ForCausalLM(T.Phi3Config(num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                              **DECODER))
    if family == "gpt_oss":  # learned sink logits (s_aux); the MoE feed-forward swapped for a dense one below
        return T.GptOssForCausalLM(T.GptOssConfig(
            vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
            max_position_embeddings=256))
    if family == "modernbert":
        return T.ModernBertModel(T.ModernBertConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            global_attn_every_n_layers=2, local_attention=8, max_position_embeddings=256, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))
    if family == "clip-text":
        return T.CLIPTextModel(T.CLIPTextConfig(vocab_size=96, max_position_embeddings=64, **COMMON))
    if family == "t5-encoder":
        return T.T5EncoderModel(T.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                           relative_attention_num_buckets=8))
    if family == "clip-vision":
        return T.CLIPVisionModel(T.CLIPVisionConfig(image_size=32, patch_size=8, **COMMON))
    if family == "dinov2":
        return T.Dinov2Model(T.Dinov2Config(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, mlp_ratio=2))
    if family == "whisper-encoder":
        return T.models.whisper.modeling_whisper.WhisperEncoder(T.WhisperConfig(
            num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64, max_source_positions=16, vocab_size=96))
    raise ValueError(family)


class DenseFeedForward(nn.Module):
    """Stands in for gpt-oss's routed experts, whose routing the export refuses: the attention (with its sinks) is
    what is tested."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.down(torch.relu(self.up(x))), None


def inputs(model: nn.Module, seed: int, batch: int, seq: int, padded: bool) -> dict[str, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    main = model.main_input_name
    if main == "pixel_values":
        return {main: torch.randn(batch, 3, 32, 32, generator=g).numpy()}
    if main == "input_features":
        return {main: torch.randn(batch, 16, 32, generator=g).numpy()}
    ids = torch.randint(3, 96, (batch, seq), generator=g).numpy()
    mask = np.ones_like(ids)
    if padded:  # right padding of two lengths, one shorter than every window
        mask[1, seq - 6:] = 0
        mask[-1, 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def dense_gpt_oss() -> nn.Module:
    """gpt-oss with its routed experts swapped for :class:`DenseFeedForward` and sink logits that take a real share
    of each row (a fresh model's are near zero)."""
    model = build("gpt_oss").eval()
    for layer in model.model.layers:
        layer.mlp = DenseFeedForward(32)
        with torch.no_grad():
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def traced_inputs(model: nn.Module) -> dict[str, np.ndarray]:
    """What the files are traced on: 2 unpadded sequences of 12 tokens (2 images, 2 audio clips)."""
    return inputs(model, 9, 2, 12, padded=False)


def other_inputs(model: nn.Module, padded: bool = True) -> dict[str, np.ndarray]:
    """A shape the files were not traced on: 3 sequences of 17 tokens, two of them padded (3 images, 3 clips)."""
    return inputs(model, 5, 3, 17, padded)


def torch_output(qmodel: nn.Module, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The model's logits (a head) or last hidden state, called as a user calls it (the 2-D mask)."""
    with torch.no_grad():
        out = qmodel(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    return (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).numpy()


def relative_error(got: np.ndarray, ref: np.ndarray, feeds: dict[str, np.ndarray]) -> float:
    """Relative L2 error of ``got`` to ``ref`` over the valid tokens (padded positions are don't-cares)."""
    if got.shape != ref.shape:
        raise ValueError(f"output shape {got.shape}, expected {ref.shape}")
    mask = feeds.get("attention_mask")
    if mask is not None and ref.ndim == 3:
        got, ref = got[mask.astype(bool)], ref[mask.astype(bool)]
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
