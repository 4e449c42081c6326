"""Where a Hugging Face model's attention lives, discovered from the model itself.

softq never edits or copies Hugging Face model code, and keeps no table of class names.
Every family that computes attention through ``ALL_ATTENTION_FUNCTIONS`` calls the
function with the calling module as its first argument, so one forward with softq's
function installed finds every attention module of any family (:func:`discover`).
Per-family code is kept only where that call cannot see something: RoBERTa's
positions (:func:`max_tokens`) and the families that compute attention in their own
forward (``softq.families``).  A model with no interface call is refused in one line
that names its attention class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

# model_type -> the family softq treats it as where that matters (RoBERTa's position table starts after its padding
# index and numbers positions from the ids that are not padding: XLM-RoBERTa, CamemBERT and MPNet share it, and are
# post-LN with one leading special token as RoBERTa is; ELECTRA is BERT with a projection from its embedding size)
FAMILY_OF: dict[str, str] = {"xlm-roberta": "roberta", "camembert": "roberta", "mpnet": "roberta", "electra": "bert"}
_NAMES = "_softq_attention_names"  # discovered attention module names, cached on the model instance
_CAUSAL = "_softq_causal"  # whether the discovery forward's attention masked the future


class UnsupportedModelError(ValueError):
    """The model cannot be handled by softq; the message names the feature that stops it."""


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
    """The Hugging Face ``model_type`` of ``model``, once its attention has been found (:func:`discover`)."""
    discover(model)
    return model.config.model_type


def model_family(model: nn.Module) -> str:
    """The family softq treats ``model`` as: its ``model_type``, RoBERTa for XLM-RoBERTa and CamemBERT, BERT for
    ELECTRA; raises :class:`UnsupportedModelError` where softq cannot find the model's attention."""
    return family_of(model_type(model))


def is_causal(model: nn.Module) -> bool:
    """Whether the model's self-attention is causal: ``is_decoder`` in its config, or what :func:`discover` saw
    (an attention module or call saying ``is_causal``, or a mask hiding every later key)."""
    if bool(getattr(getattr(model, "config", None), "is_decoder", False)):
        return True
    modules = list(attention_modules(model))
    if _CAUSAL in model.__dict__:
        return bool(model.__dict__[_CAUSAL])
    return any(bool(getattr(m, "is_causal", False)) for _, m in modules)


def has_cross_attention(model: nn.Module) -> bool:
    """Whether the model has cross-attention layers reading ``encoder_hidden_states`` (``add_cross_attention``),
    which softq's export and MPC do not take (a model run without those states computes another function)."""
    return bool(getattr(getattr(model, "config", None), "add_cross_attention", False))


def probe_inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    """A small input of the model's main kind (8 tokens, a blank image, silent audio features) for :func:`discover`."""
    config = model.config
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    main = getattr(model, "main_input_name", "input_ids")
    if main == "input_ids":
        vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", 8)
        length = min(8, max_tokens(config) or 8)
        ids = (torch.arange(length, device=device) % max(int(vocab) - 1, 1) + 1)[None]
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if getattr(config, "is_encoder_decoder", False):
            batch["decoder_input_ids"] = ids[:, :2]
        return batch
    if main == "pixel_values":
        height, width = image_size(config) or (224, 224)
        channels = int(getattr(config, "num_channels", 3))
        return {"pixel_values": torch.zeros(1, channels, height, width, device=device, dtype=dtype)}
    if main == "input_features":  # a speech encoder reads a fixed number of frames: two per position after its convs
        frames = 2 * int(getattr(config, "max_source_positions", 1500))
        return {"input_features": torch.zeros(1, int(config.num_mel_bins), frames, device=device, dtype=dtype)}
    raise UnsupportedModelError(f"softq cannot build an input for {type(model).__name__}'s main input "
                                f"'{main}' to find its attention; pass a calibration batch first")


def _attention_class_names(model: nn.Module) -> list[str]:
    """Class names that look like attention, for the message refusing a model whose attention softq cannot see."""
    names = [type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__]
    return sorted(set(names), key=names.index)


def discover(model: nn.Module, batch: Mapping[str, torch.Tensor] | None = None) -> tuple[str, ...]:
    """Names of the modules that call the attention interface, in call order, found by running ``model`` once
    (on ``batch``, else :func:`probe_inputs`) with softq's attention function recording its callers.

    Cached on the model; modules softq has already configured are taken as they are.  Raises
    :class:`UnsupportedModelError` naming the feature that stops softq: no Hugging Face config, a family that
    computes attention in its own forward, or attention modules that never run."""
    from softq import attention as A
    from softq.families import adapt

    cached = model.__dict__.get(_NAMES)
    modules = dict(model.named_modules())
    if cached is not None and all(n in modules for n in cached):
        return cached
    configured = tuple(n for n, m in modules.items() if isinstance(getattr(m, "softq", None), A.AttentionPoints))
    if configured:
        model.__dict__[_NAMES] = configured
        return configured
    from softq.hf import is_sentence_transformer

    if is_sentence_transformer(model):
        raise UnsupportedModelError("softq takes the SentenceTransformer's Hugging Face model here: pass "
                                    "st[0].auto_model")
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise UnsupportedModelError(f"softq takes Hugging Face models (transformers PreTrainedModel); a "
                                    f"{type(model).__name__} has no Hugging Face config")
    from softq.families import set_implementation

    if not adapt(model) and not type(model)._can_set_attn_implementation():
        raise _no_interface(model)
    seen: list[tuple[nn.Module, bool]] = []
    before = config._attn_implementation
    was_training = model.training
    try:
        set_implementation(model, A.ATTN_IMPLEMENTATION)
        model.eval()
        with A.recording(seen), torch.no_grad():
            model(**dict(batch if batch is not None else probe_inputs(model)), **_no_cache(model))
    except UnsupportedModelError:
        raise
    except Exception as err:  # noqa: BLE001 -- any failure of the probe forward is reported in one line
        raise UnsupportedModelError(f"softq could not run {type(model).__name__} once to find its attention "
                                    f"modules: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    finally:
        model.train(was_training)
        if before != A.ATTN_IMPLEMENTATION:
            with contextlib.suppress(Exception):
                set_implementation(model, before)
    names = {id(m): n for n, m in modules.items()}
    found = tuple(dict.fromkeys(names[id(m)] for m, _ in seen if id(m) in names))
    if not found:
        raise _no_interface(model)
    model.__dict__[_NAMES] = found
    model.__dict__[_CAUSAL] = any(causal for _, causal in seen)
    return found


def check_class(model_class: type, config: object) -> None:
    """Refuse, before any weight is loaded, a model class whose family computes attention in its own forward
    (transformers' own test of its source for an interface call) and that has no adapter in ``softq.families``."""
    from softq.families import ADAPTERS

    can_set = getattr(model_class, "_can_set_attn_implementation", None)
    model_type = getattr(config, "model_type", None)
    if callable(can_set) and not can_set() and model_type not in ADAPTERS:
        raise UnsupportedModelError(f"softq does not support model_type '{model_type}': it computes attention in "
                                    f"its own forward ({model_class.__name__}), not through Hugging Face's "
                                    "attention interface")


def _no_interface(model: nn.Module) -> UnsupportedModelError:
    classes = _attention_class_names(model)
    where = f"in {', '.join(classes[:3])}" if classes else "anywhere softq can see"
    return UnsupportedModelError(
        f"softq does not support model_type '{getattr(model.config, 'model_type', '?')}': it computes attention in its "
        f"own forward ({where}), not through Hugging Face's attention interface")


def _no_cache(model: nn.Module) -> dict[str, bool]:
    """``use_cache=False`` where the forward takes it: the probe must leave no cache behind."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


def probe_forward(model: nn.Module) -> None:
    """Run ``model`` once on :func:`probe_inputs` in eval mode, without gradients or a cache, for the hooks a caller
    has registered to read what its modules see; the model's mode is restored."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(**probe_inputs(model), **_no_cache(model))
    finally:
        model.train(was)


def attention_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every attention module that calls the attention interface, in order (:func:`discover`)."""
    modules = dict(model.named_modules())
    for name in discover(model):
        yield name, modules[name]


def num_heads(module: nn.Module) -> int:
    """Number of query heads of one attention module (names differ by family)."""
    for attr in ("num_attention_heads", "num_heads", "n_head", "n_heads"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value
    config = getattr(module, "config", None)
    for attr in ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads"):
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
