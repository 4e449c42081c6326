"""Which Hugging Face model families softq supports, and where their attention lives.

softq never edits or copies Hugging Face model code.  It only needs to know, per
family, which module class calls ``ALL_ATTENTION_FUNCTIONS`` (so it can attach
per-layer state there) -- everything else is found generically.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

# model_type -> class names of the module that calls the attention interface.
# Names moved between transformers releases (ViT's ``ViTSelfAttention`` became
# ``ViTAttention`` in 5.x), so both are listed and the innermost match wins.
ATTENTION_CLASSES: dict[str, tuple[str, ...]] = {
    "bert": ("BertSelfAttention",),
    "roberta": ("RobertaSelfAttention",),
    "opt": ("OPTAttention",),
    "gpt2": ("GPT2Attention",),
    "vit": ("ViTSelfAttention", "ViTAttention"),
    "deit": ("DeiTSelfAttention", "DeiTAttention"),
    "xlm-roberta": ("XLMRobertaSelfAttention",),
    "camembert": ("CamembertSelfAttention",),
    "electra": ("ElectraSelfAttention",),
    "distilbert": ("DistilBertSelfAttention",),
}
# model_type -> the family softq treats it as: the same layers and positions under other class names
# (XLM-RoBERTa and CamemBERT are RoBERTa; ELECTRA is BERT, with a Linear from its embedding size where that differs)
FAMILY_OF: dict[str, str] = {"xlm-roberta": "roberta", "camembert": "roberta", "electra": "bert"}
SUPPORTED_FAMILIES = tuple(ATTENTION_CLASSES)
CAUSAL_FAMILIES = ("gpt2", "opt")  # decoders: every attention row is masked past its own position


class UnsupportedModelError(ValueError):
    """The model is not one of the Hugging Face families softq knows."""


def is_headless(model: nn.Module) -> bool:
    """A bare encoder/decoder (``BertModel``, ``GPT2Model``, ``ViTModel``...): no task head, no logits.  A Hugging Face
    model is its own ``base_model`` exactly when it has no head (``BertLMHeadModel``'s name ends in "Model" too, and
    its head is ``cls``)."""
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module):
        return base is model
    return type(model).__name__.endswith("Model") and not hasattr(model, "lm_head") and not hasattr(model, "classifier")


def max_tokens(config: object) -> int | None:
    """The longest sequence a text model takes (its position table), or None where the config has no such limit.
    RoBERTa's positions start after its padding index (``pad_token_id + 1``): a 514-row table takes 512 tokens."""
    positions = next((v for v in (getattr(config, a, None) for a in ("max_position_embeddings", "n_positions"))
                      if isinstance(v, int) and v > 0), None)
    if positions is not None and family_of(getattr(config, "model_type", None)) == "roberta":
        pad = getattr(config, "pad_token_id", None)
        positions -= (pad if isinstance(pad, int) else 1) + 1
    return positions


def image_size(config: object) -> tuple[int, int] | None:
    """(height, width) of a vision config's ``image_size``: an int (square) or a pair."""
    size = getattr(config, "image_size", None)
    if isinstance(size, int):
        return size, size
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(v, int) for v in size):
        return int(size[0]), int(size[1])
    return None


def output_fields(output: object) -> str:
    """The fields of a Hugging Face model output, for a message saying which one is missing."""
    keys = getattr(output, "keys", None)
    return ", ".join(keys()) if callable(keys) else type(output).__name__


def family_of(model_type: str | None) -> str | None:
    """The family softq treats a Hugging Face ``model_type`` as (``xlm-roberta`` -> ``roberta``; itself else)."""
    return FAMILY_OF.get(model_type, model_type) if isinstance(model_type, str) else model_type


def model_type(model: nn.Module) -> str:
    """The Hugging Face ``model_type`` of ``model``, checked against the supported list."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in ATTENTION_CLASSES:
        what = f"model_type '{family}'" if family else f"a {type(model).__name__} without a Hugging Face config"
        raise UnsupportedModelError(
            f"softq does not support {what}; supported Hugging Face families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return family


def model_family(model: nn.Module) -> str:
    """The family softq treats ``model`` as: its checked ``model_type``, RoBERTa for XLM-RoBERTa and CamemBERT,
    BERT for ELECTRA (:data:`FAMILY_OF`)."""
    return family_of(model_type(model))


def is_causal(model: nn.Module) -> bool:
    """Whether the model's self-attention is causal: GPT-2 and OPT, and BERT / RoBERTa built as decoders
    (``is_decoder=True``: ``BertLMHeadModel``, ``RobertaForCausalLM``), which decode with a KV cache too."""
    return model_family(model) in CAUSAL_FAMILIES or bool(getattr(model.config, "is_decoder", False))


def has_cross_attention(model: nn.Module) -> bool:
    """Whether the model has cross-attention layers reading ``encoder_hidden_states`` (``add_cross_attention``),
    which softq's export and MPC do not take (a model run without those states computes another function)."""
    return bool(getattr(getattr(model, "config", None), "add_cross_attention", False))


def attention_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every attention module that calls the attention interface, in order."""
    wanted = ATTENTION_CLASSES[model_type(model)]

    def matches(module: nn.Module) -> bool:
        return type(module).__name__ in wanted

    found = False
    for name, module in model.named_modules():
        if matches(module) and not any(matches(m) for m in list(module.modules())[1:]):
            found = True
            yield name, module
    if not found:
        raise UnsupportedModelError(f"no {' or '.join(wanted)} module found in {type(model).__name__}")


def num_heads(module: nn.Module) -> int:
    """Number of query heads of one attention module (names differ by family)."""
    for attr in ("num_attention_heads", "num_heads", "n_head"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value
    config = getattr(module, "config", None)
    for attr in ("num_attention_heads", "n_head"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    raise UnsupportedModelError(f"cannot tell the number of heads of {type(module).__name__}")


def conv1d_to_linear(model: nn.Module) -> int:
    """Replace GPT-2's ``Conv1D`` (a transposed Linear) by ``nn.Linear``; returns how many.

    Quantizers, SmoothQuant and export then see one kind of layer.  The function
    computed is unchanged (same weights, transposed).
    """
    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child).__name__ == "Conv1D" and hasattr(child, "nf"):
                in_features, out_features = child.weight.shape
                linear = nn.Linear(in_features, out_features, bias=child.bias is not None)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                linear.to(child.weight.device, child.weight.dtype)
                setattr(parent, child_name, linear)
                replaced += 1
    return replaced


def block_name(attention_name: str) -> str:
    """The transformer block that holds an attention module: the prefix ending at the layer index.

    ``transformer.h.3.attn`` -> ``transformer.h.3``; ``bert.encoder.layer.0.attention.self`` ->
    ``bert.encoder.layer.0``.
    """
    parts = attention_name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    raise UnsupportedModelError(f"cannot find the layer index in module name '{attention_name}'")


def transformer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of every transformer layer, in order (one per attention module)."""
    modules = dict(model.named_modules())
    return [(block_name(name), modules[block_name(name)]) for name, _ in attention_modules(model)]
