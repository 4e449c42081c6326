"""Reference model configs (sizes), fresh models, and attention-variant options."""

from __future__ import annotations

from typing import Any

from torch import nn

from softq.softmax import CLIPPED_ALPHA, check_param
from workloads.data import CharTokenizer, check_choice


# Sizes.  "reference" is what the benchmarks train and use; "tiny" is for tests.
LM_SIZES: dict[str, dict[str, int]] = {
    "reference": {"layers": 4, "d_model": 128, "heads": 4, "kv_heads": 2, "context": 1024},
    "tiny": {"layers": 2, "d_model": 32, "heads": 2, "kv_heads": 1, "context": 128},
}
LM_FAMILIES = ("gpt2", "opt", "llama")
VIT_SIZES: dict[str, dict[str, int]] = {
    "reference": {"layers": 4, "d_model": 128, "heads": 4, "image_size": 32, "patch_size": 4},
    "tiny": {"layers": 2, "d_model": 32, "heads": 2, "image_size": 16, "patch_size": 4},
}


def lm_config(
    size: str = "reference",
    family: str = "gpt2",
    context: int | None = None,
    vocab_size: int | None = None,
) -> Any:
    """Config of a reference ("reference") or test ("tiny") character LM; dropout off.

    ``context`` defaults to the size's context (1024 reference, 128 tiny) and
    ``vocab_size`` to the :class:`CharTokenizer` vocabulary.  ``llama`` is the
    Llama architecture at the same width and depth: RoPE, grouped-query attention
    (``kv_heads`` key/value heads), RMSNorm, a SwiGLU MLP with the parameter count
    of GPT-2's 4x MLP, no biases, input and output embeddings tied as GPT-2's are.
    """
    check_choice("LM size", size, LM_SIZES)
    check_choice("LM family", family, LM_FAMILIES)
    s = LM_SIZES[size]
    context = int(context or s["context"])
    vocab_size = int(vocab_size or CharTokenizer().vocab_size)
    if context < 2:
        raise ValueError(f"context must be at least 2, got {context}")
    if family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=vocab_size, n_positions=context, n_embd=s["d_model"], n_layer=s["layers"],
            n_head=s["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
    if family == "llama":
        from transformers import LlamaConfig

        d = s["d_model"]
        swiglu = 8 * ((8 * d // 3 + 7) // 8)  # 3 matrices of d x 8d/3 = GPT-2's 2 of d x 4d; multiple of 8
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=d, intermediate_size=swiglu,
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
            max_position_embeddings=context, rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False,
            attention_dropout=0.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
            pad_token_id=None,
        )
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=vocab_size, hidden_size=s["d_model"], num_hidden_layers=s["layers"],
        ffn_dim=4 * s["d_model"], num_attention_heads=s["heads"], max_position_embeddings=context,
        word_embed_proj_dim=s["d_model"], dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        layerdrop=0.0, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def lm_context(config: Any) -> int:
    """The context (longest sequence) of an LM config of any workload family."""
    return int(getattr(config, "n_positions", None) or config.max_position_embeddings)


def vit_config(size: str = "reference") -> Any:
    """ViTForImageClassification config for 1-channel digits, 10 labels, dropout off."""
    check_choice("ViT size", size, VIT_SIZES)
    from transformers import ViTConfig

    s = VIT_SIZES[size]
    return ViTConfig(
        hidden_size=s["d_model"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        intermediate_size=4 * s["d_model"], image_size=s["image_size"], patch_size=s["patch_size"],
        num_channels=1, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )


def build_model(config: Any) -> nn.Module:
    """A fresh model for an LM or ViT config (random init, eager attention)."""
    if config.model_type == "gpt2":
        from transformers import GPT2LMHeadModel as cls
    elif config.model_type == "opt":
        from transformers import OPTForCausalLM as cls
    elif config.model_type == "llama":
        from transformers import LlamaForCausalLM as cls
    elif config.model_type == "vit":
        from transformers import ViTForImageClassification as cls
    else:
        raise ValueError(f"softq workloads build gpt2, opt, llama or vit models, not '{config.model_type}'")
    model = cls(config)
    model.set_attn_implementation("eager")
    return model


def _configure(model: nn.Module, attention: dict[str, Any] | None) -> None:
    if attention:
        from softq.attention import configure_attention

        configure_attention(model, **attention)


def variant_name(attention: dict[str, Any] | None) -> str:
    """Stable short name of an attention configuration, used in cache keys ("vanilla" if none)."""
    if not attention:
        return "vanilla"
    parts = []
    for key in sorted(attention):
        value = attention[key]
        if isinstance(value, float):
            value = f"{value:g}"
        parts.append(f"{key}={value}")
    return ",".join(parts).replace("/", "_")


def attention_options(
    softmax: str | None = None, alpha: float = CLIPPED_ALPHA, gated: bool = False, pi_init: float = 0.5
) -> dict[str, Any] | None:
    """``configure_attention`` keywords for command-line style choices (None = vanilla).

    ``alpha`` only applies to the clipped softmax and ``pi_init`` only to gates,
    so unrelated flags never change a cache key.
    """
    attention: dict[str, Any] = {}
    if softmax and softmax != "softmax":
        from softq.softmax import get_softmax

        get_softmax(softmax)  # unknown names fail here, with the list of choices
        attention["softmax"] = softmax
        if softmax == "clipped":
            attention["alpha"] = check_param("clipped softmax", "alpha", alpha, 0.0)
    if gated:
        attention.update(gated=True, gate_pi_init=float(pi_init))
    return attention or None
