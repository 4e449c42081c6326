"""Calibration data: normalise what users pass, and refuse what would give a silently wrong model."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from softq.calib.observers import NonFiniteActivation, valid_tokens

Batch = dict[str, torch.Tensor]


class CalibrationDataError(ValueError):
    """The calibration set is empty, non-finite or does not fit the model."""


def as_batches(model: nn.Module, data: Iterable[torch.Tensor | Mapping[str, torch.Tensor]]) -> list[Batch]:
    """Materialise ``data`` as keyword batches for ``model`` and check every one of them.

    A bare tensor is taken as the model's main input (``input_ids`` for language
    models, ``pixel_values`` for vision models).
    """
    if isinstance(data, (torch.Tensor, Mapping)):
        raise CalibrationDataError(
            "calib_data must be an iterable of batches (e.g. a list of tensors or of dicts), not a single batch; "
            "wrap it in a list"
        )
    if not isinstance(data, Iterable) or isinstance(data, (str, bytes)):
        raise CalibrationDataError(f"calib_data must be an iterable of batches (a list of tensors or of dicts), "
                                   f"not a {type(data).__name__}")
    main_input = getattr(model, "main_input_name", "input_ids")
    batches: list[Batch] = []
    for index, item in enumerate(data):
        if isinstance(item, torch.Tensor):
            batch = {main_input: item}
        elif isinstance(item, Mapping):
            batch = dict(item)
        elif isinstance(item, str):
            raise CalibrationDataError(f"calibration batch {index} is a text; texts are taken as they are only for a "
                                       "SentenceTransformer (a list of texts); tokenize them for a Hugging Face model "
                                       "(tokenizer(texts, padding=True, return_tensors='pt'))")
        else:
            raise CalibrationDataError(f"calibration batch {index} is a {type(item).__name__}; expected a tensor or a dict of tensors")
        check_batch(model, batch, index)
        batches.append(batch)
    if not batches:
        raise CalibrationDataError("the calibration set is empty: pass at least one batch of model inputs")
    return batches


def check_batch(model: nn.Module, batch: Mapping[str, torch.Tensor], index: int | str = 0,
                what: str = "calibration batch") -> None:
    """Raise a :class:`CalibrationDataError` naming the batch and input if ``batch`` cannot be right."""
    config = getattr(model, "config", None)
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise CalibrationDataError(f"{what} {index}: '{key}' is a {type(value).__name__}, not a tensor")
        if value.is_meta:
            raise CalibrationDataError(f"{what} {index}: '{key}' is on the meta device (no values); pass real tensors")
        if value.is_floating_point() and not torch.isfinite(value).all() and not (
                key == "attention_mask" and value.dim() == 2 and not torch.isnan(value).any()):  # 2-D 0/-inf: below
            bad = "NaN" if torch.isnan(value).any() else "Inf"
            raise CalibrationDataError(f"{what} {index}: '{key}' contains {bad}")
    main_input = getattr(model, "main_input_name", "input_ids")
    if main_input not in batch and not (main_input == "input_ids" and "inputs_embeds" in batch):
        raise CalibrationDataError(f"{what} {index} has no '{main_input}' (it has {', '.join(map(repr, batch)) or 'no key'}): "
                                   f"{type(model).__name__} takes {main_input}")
    if "input_ids" in batch:
        ids = batch["input_ids"]
        if ids.dim() != 2:
            raise CalibrationDataError(f"{what} {index}: input_ids must be [batch, seq], got shape {tuple(ids.shape)}")
        vocab = getattr(config, "vocab_size", None)
        if vocab is not None and ids.numel() and (ids.min() < 0 or ids.max() >= vocab):
            raise CalibrationDataError(f"{what} {index}: token ids must be in [0, {vocab}), got [{ids.min().item()}, {ids.max().item()}]")
        from softq.models import max_tokens

        limit = max_tokens(config)
        if limit is not None and ids.shape[1] > limit:
            raise CalibrationDataError(f"{what} {index}: sequence length {ids.shape[1]} exceeds the model's {limit} positions")
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel() and not ((mask == 0) | (mask == 1)).all():
        # an additive mask (0 / -inf) read as 0/1 would keep only the padding's rows
        odd = mask[(mask != 0) & (mask != 1)][0].item()
        raise CalibrationDataError(f"{what} {index}: attention_mask must be 1 at real tokens and 0 at padding (a "
                                   f"tokenizer's mask), it holds {odd:g}; pass the 0/1 mask, not an additive one")
    if isinstance(mask, torch.Tensor) and mask.numel() and not mask.bool().any():
        raise CalibrationDataError(f"{what} {index}: attention_mask is all zeros (no token to attend to)")
    if "pixel_values" in batch:
        px = batch["pixel_values"]
        if not px.is_floating_point():
            raise CalibrationDataError(f"{what} {index}: pixel_values are {str(px.dtype).replace('torch.', '')}; pass "
                                       "float images normalised as the model was trained (its image processor's output)")
        from softq.models import image_size

        channels = getattr(config, "num_channels", None)
        size = image_size(config)
        expected = f"[batch, {channels}, {size[0]}, {size[1]}]" if size else f"[batch, {channels}, height, width]"
        if px.dim() != 4 or (channels is not None and px.shape[1] != channels):
            raise CalibrationDataError(f"{what} {index}: pixel_values must be {expected}, got shape {tuple(px.shape)}")
        if size is not None and tuple(px.shape[2:]) != size:
            raise CalibrationDataError(f"{what} {index}: pixel_values must be {expected}, got shape {tuple(px.shape)}")


@contextmanager
def _eval_no_grad(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def run_batches(model: nn.Module, batches: list[Batch], desc: str | None = None) -> None:
    """Forward every batch in eval mode without gradients (a calibration sweep)."""
    from tqdm.auto import tqdm

    with _eval_no_grad(model):
        for batch in tqdm(batches, desc=desc, disable=desc is None or len(batches) < 4, leave=False):
            try:
                with valid_tokens(batch.get("attention_mask")):  # observers count real tokens' rows only
                    model(**batch)
            except NonFiniteActivation as err:  # the inputs were checked finite (check_batch names those)
                where = next((f"at {n}" for n, m in model.named_modules() if m is err.source), "in an activation")
                raise CalibrationDataError(
                    f"the model computes NaN or Inf {where} on a calibration batch (check its weights; a float16 "
                    "or bfloat16 model may overflow: calibrate it in float32)") from None
