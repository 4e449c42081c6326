"""What is traced: the wrapper around a Hugging Face (or sentence-transformers) model that fixes the file's inputs
and outputs, and the example inputs it is traced on.

Text models take ``input_ids`` and ``attention_mask`` (the 2-D mask, from which Hugging Face builds each layer's
own), vision models ``pixel_values``, speech encoders ``input_features``; models with a head output ``logits``, headless encoders
``last_hidden_state`` and, pooled, ``sentence_embedding``.  A ``SentenceTransformer`` exports as its Hugging Face
model with its own pooling and normalisation.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from softq.export.errors import ExportError
from softq.models import _no_cache, has_cross_attention, image_size, is_headless, output_fields

TEXT_OUTPUTS = ("logits", "last_hidden_state", "sentence_embedding")
# fixed-size float main inputs: images, a speech encoder's log-mel frames (batch the only dynamic axis)
FEATURE_INPUTS = ("pixel_values", "input_features")


class _TextWrapper(nn.Module):
    """input_ids, attention_mask -> logits (models with a head) or last_hidden_state (headless encoders),
    plus the pooled sentence embedding when asked.  The 2-D mask goes to the model as it is: Hugging Face builds
    each layer's mask from it (causal, padding, sliding windows, local and bidirectional windows, a relative
    position bias added to it), in ops that trace with the batch and sequence dynamic."""

    def __init__(self, model: nn.Module, outputs: tuple[str, ...], pooling: str | None, normalize: bool) -> None:
        super().__init__()
        self.model = model
        self.outputs = outputs
        self.pooling = pooling
        self.normalize = normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        from softq.hf import pool

        extra = {}
        if self.model.config.model_type == "opt":  # OPT derives positions from the 2-D mask, as here
            mask = attention_mask.to(torch.long)
            # HF's cumsum(mask) * mask - 1, as a Where: at one token tract turned that Mul into an int64 Square
            # it has no kernel for
            extra["position_ids"] = torch.where(mask != 0, torch.cumsum(mask, dim=1) - 1, -1)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **_no_cache(self.model), **extra)
        if self.outputs == ("logits",):
            return _logits(out, self.model)
        hidden = out.last_hidden_state
        if self.outputs == ("last_hidden_state",):
            return hidden
        return hidden, pool(hidden, attention_mask, self.pooling or "mean", self.normalize)


class _MainInputWrapper(nn.Module):
    """One fixed-size float input (a vision model's ``pixel_values``, a speech encoder's ``input_features``) ->
    logits or last_hidden_state."""

    def __init__(self, model: nn.Module, name: str) -> None:
        super().__init__()
        self.model = model
        self.name = name

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        out = self.model(**{self.name: features})
        return out.last_hidden_state if is_headless(self.model) else _logits(out, self.model)


def _logits(out: Any, model: nn.Module) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):  # question answering, pre-training heads...
        raise ExportError(f"{type(model).__name__} outputs {output_fields(out)} and no logits; softq exports models "
                          "with one logits output and headless encoders (last_hidden_state)")
    return logits


def wrap_for_export(model: nn.Module, pooling: str | None = None,
                    normalize: bool = False) -> tuple[nn.Module, list[str], list[str]]:
    """The module that is traced, its ONNX input names and its output names.

    Models with a head output ``logits``; headless encoders output
    ``last_hidden_state`` and, with ``pooling`` ("mean", "cls", "max"), also the
    sentence embedding ``sentence_embedding`` (L2-normalised with ``normalize``).
    """
    from softq.hf import POOLING_MODES

    if has_cross_attention(model):
        raise ExportError(f"softq exports self-attention models; this {type(model).__name__} has cross-attention "
                          "layers (add_cross_attention=True: it reads encoder_hidden_states), which the export does "
                          "not take")
    experts = next((name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"), None)
    if experts is not None:
        raise ExportError(f"softq does not export mixture-of-experts models: the routing of each token to its "
                          f"experts ({experts}) has no ONNX form in the trace")
    headless = is_headless(model)
    if pooling is not None and (pooling not in POOLING_MODES or not headless):
        raise ExportError(f"pooling={pooling!r}: a sentence embedding needs a headless text encoder and one of "
                          f"{POOLING_MODES}" + ("" if headless else f"; {type(model).__name__} has a task head"))
    main = getattr(model, "main_input_name", "input_ids")
    if main in FEATURE_INPUTS:
        return _MainInputWrapper(model, main).eval(), [main], ["last_hidden_state" if headless else "logits"]
    if main != "input_ids":
        raise ExportError(f"softq exports models whose main input is input_ids, {' or '.join(FEATURE_INPUTS)}; "
                          f"{type(model).__name__} takes {main}")
    outputs = ("logits",) if not headless else ("last_hidden_state",) if pooling is None else (
        "last_hidden_state", "sentence_embedding")
    return (_TextWrapper(model, outputs, pooling, normalize).eval(), ["input_ids", "attention_mask"], list(outputs))


def example_feeds(model: nn.Module, example_inputs: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """Normalise and check example inputs: a tensor (main input) or a dict of tensors."""
    from softq.calib.data import CalibrationDataError, check_batch

    if isinstance(example_inputs, (torch.Tensor, np.ndarray)):
        example_inputs = {names[0]: example_inputs}
    if not isinstance(example_inputs, Mapping):
        raise ExportError(f"example_inputs must be a tensor or a dict of tensors, got {type(example_inputs).__name__}")
    feeds = {}
    for key, value in example_inputs.items():  # a tokenizer's return_tensors="np" arrays are taken as they are
        if isinstance(value, np.ndarray) and value.dtype != object:
            value = torch.from_numpy(np.ascontiguousarray(value))
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"example input {key!r} must be a tensor (or a numpy array), got {type(value).__name__}")
        feeds[key] = value
    types = feeds.pop("token_type_ids", None)
    if types is not None and bool(types.any()):
        raise ExportError("example token_type_ids are not all 0: the exported graph takes one segment "
                          "(input_ids, attention_mask) and uses token type 0")
    unknown = set(feeds) - set(names)
    if unknown:
        raise ExportError(f"example_inputs has unexpected key(s) {sorted(unknown)}; this model takes {names}")
    if names[0] not in feeds:
        raise ExportError(f"example_inputs needs '{names[0]}'")
    main = feeds[names[0]]
    if names[0] == "input_ids":
        if main.ndim != 2 or main.is_floating_point():
            raise ExportError(f"example input_ids must be an integer tensor [batch, seq], got {main.dtype} {tuple(main.shape)}")
        mask = feeds.get("attention_mask")
        if mask is None:
            feeds["attention_mask"] = torch.ones_like(main)
        elif tuple(mask.shape) != tuple(main.shape):
            raise ExportError(f"example attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(main.shape)}")
    elif names[0] == "input_features":  # [batch, mel bins, frames]; the frame count the model checks itself
        bins = int(getattr(model.config, "num_mel_bins", 0)) or None
        if main.ndim != 3 or not main.is_floating_point() or bins is not None and main.shape[1] != bins:
            raise ExportError(f"example input_features must be float [batch, {bins or 'mel bins'}, frames], got "
                              f"{main.dtype} {tuple(main.shape)}")
    else:
        cfg = model.config
        want = (int(getattr(cfg, "num_channels", 3)), *image_size(cfg))
        if main.ndim != 4 or tuple(main.shape[1:]) != want:
            raise ExportError(f"example pixel_values must have shape [batch, {want[0]}, {want[1]}, {want[2]}], "
                              f"got {tuple(main.shape)}")
    try:
        check_batch(model, {k: v for k, v in feeds.items() if k != "attention_mask"}, 0, "example input")
    except CalibrationDataError as err:
        raise ExportError(str(err)) from err
    # the example's dtypes become the file's input types: the ones tokenizers and image processors give
    # (int32 ids made a file that plain onnxruntime refuses int64 ids for; float64 pixels a double input)
    return {n: feeds[n].to(torch.float32 if n in FEATURE_INPUTS else torch.int64) for n in names}


def unwrap_sentence_transformer(model: nn.Module, example_inputs: Any, pooling: str | None,
                                normalize: bool) -> tuple[nn.Module, Any, str | None, bool]:
    """A ``sentence_transformers.SentenceTransformer`` as its Hugging Face model, its own pooling and normalisation
    (another ``pooling``, or ``normalize`` without its Normalize module, refused) and, for example texts, the inputs
    it tokenizes them to; anything else as it is."""
    from softq.hf import is_sentence_transformer, sentence_transformer_batches, sentence_transformer_pooling

    if not is_sentence_transformer(model):
        return model, example_inputs, pooling, normalize
    own, own_normalize = sentence_transformer_pooling(model)
    if pooling is not None and pooling != own:
        raise ExportError(f"the SentenceTransformer pools with '{own}'; its file carries that pooling (leave pooling "
                          f"unset), got pooling={pooling!r}")
    if normalize and not own_normalize:
        raise ExportError("the SentenceTransformer has no Normalize module: its embeddings are not normalised "
                          "(leave normalize unset, or add the module to the SentenceTransformer)")
    pooling, normalize = own, own_normalize
    prompt, dims = getattr(model, "default_prompt_name", None), getattr(model, "truncate_dim", None)
    prompt = (getattr(model, "prompts", None) or {}).get(prompt, prompt) if prompt is not None else None
    notes = [("its Pooling leaves prompt tokens out (include_prompt=False); the file pools every token it is given: "
              "the same embedding as encode for texts without a prompt", any(getattr(m, "include_prompt", True) is False
                                                                          for m in model)),
             (f"encode prepends the default prompt {prompt!r}; the file embeds what it is given: prepend it to the "
              "texts you tokenize", prompt is not None),
             (f"encode keeps the first {dims} dimensions (truncate_dim); the file outputs all of them: take "
              f"[:, :{dims}]", dims is not None)]
    for note, applies in notes:
        if applies:
            warnings.warn(f"SentenceTransformer export: {note}", UserWarning, stacklevel=3)
    if isinstance(example_inputs, str):
        example_inputs = [example_inputs]
    if isinstance(example_inputs, Mapping):  # st.tokenize / preprocess output: only its arrays are model inputs
        example_inputs = {k: v for k, v in example_inputs.items() if isinstance(v, (torch.Tensor, np.ndarray))}
    elif not isinstance(example_inputs, (torch.Tensor, np.ndarray)):  # texts (any iterable), or a list of one dict
        batches = sentence_transformer_batches(model, example_inputs, batch_size=1 << 30)
        if not isinstance(batches, list) or len(batches) != 1 or not isinstance(batches[0], Mapping):
            raise ExportError("example_inputs of a SentenceTransformer: texts (a list of strings), its tokenize "
                              "output, or a tensor of token ids")
        example_inputs = {k: v for k, v in batches[0].items() if isinstance(v, (torch.Tensor, np.ndarray))}
    return model[0].auto_model, example_inputs, pooling, normalize
