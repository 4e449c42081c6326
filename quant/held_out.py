"""Judging a calibration choice on held-out calibration batches, against the float model's outputs.

``input_smoothing="auto"`` and ``smoothing_into_v="auto"`` observe ranges on some
calibration batches (:func:`_held_out_split`) and compare each candidate's output rows
(:func:`_outputs`) with the float model's on the others: :func:`output_error`, the
mean cosine distance, is what they minimise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from softq.calib.data import Batch


def _held_out_split(batches: list[Batch]) -> tuple[list[Batch], list[Batch]] | None:
    """(observed, held-out) calibration batches for "auto"'s search, or None when nothing can be held out.

    Every 4th batch is held out (the last one of 2 or 3); a single batch is first cut into up to 4 along its
    examples (min-max ranges over the pieces are those over the batch), its examples without a real token
    (all padding) left out.  Held-out batches without a real token judge nothing and are not held out."""
    if len(batches) == 1:
        batch = batches[0]
        sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
        n = max(sizes, default=0)
        if n < 2 or not sizes <= {1, n}:  # tensors of one example (size 1) broadcast over the others
            return None
        mask = batch.get("attention_mask")
        keep = mask.reshape(n, -1).any(1) if isinstance(mask, torch.Tensor) and mask.shape[0] == n else None

        def kept(v: object) -> object:
            return v[keep] if keep is not None and isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n else v

        batch = {k: kept(v) for k, v in batch.items()}
        n = n if keep is None else int(keep.sum())
        if n < 2:
            return None
        pieces = min(4, n)

        def piece(v: object, i: int) -> object:
            return v.tensor_split(pieces)[i] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n else v

        batches = [{k: piece(v, i) for k, v in batch.items()} for i in range(pieces)]
    held = [h for h in (batches[3::4] if len(batches) >= 4 else batches[-1:]) if _has_tokens(h)]
    if not held:
        return None
    return [b for b in batches if not any(b is h for h in held)], held


def _has_tokens(batch: Batch) -> bool:
    """Whether ``batch`` has a real token (an attention mask not all zero; inputs without a mask do)."""
    mask = batch.get("attention_mask")
    return not isinstance(mask, torch.Tensor) or bool(mask.any())


def _rows_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The model's output rows on one batch (:func:`_outputs`)."""
    result = model(**batch, output_hidden_states=True)
    y = getattr(result, "logits", None)
    if y is None or y.dim() < 3:
        hidden = getattr(result, "hidden_states", None)
        y = (result.last_hidden_state if getattr(result, "last_hidden_state", None) is not None
             else hidden[-1] if hidden else result[0])
    return valid_rows(y, batch)


def valid_rows(y: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``y`` ([batch, tokens, width], or any output) as float rows, one per valid token of ``batch`` where its
    attention mask matches ``y``'s tokens (every row otherwise)."""
    y = y.float()
    mask = batch.get("attention_mask")
    flat = y.reshape(-1, y.shape[-1])
    return flat[mask.reshape(-1).bool()] if mask is not None and tuple(mask.shape) == tuple(y.shape[:-1]) else flat


@torch.no_grad()
def _outputs(model: nn.Module, batches: list[Batch]) -> list[torch.Tensor]:
    """The model's output rows on ``batches``, one row per token (valid tokens only): its logits where they have
    a row per token (a language model), else its last hidden state (``[rows, features]`` each).

    A classifier's logits are one row per example: a handful per held-out batch, too few to tell candidates
    apart (the reference ViT's 4 held-out images picked a smoothing that its 260 token rows, and its held-out
    loss, did not), so classifiers are judged on the tokens of the last hidden state their head reads."""
    return [_rows_of(model, batch) for batch in batches]


@torch.no_grad()
def output_error(model: nn.Module, batches: list[Batch], reference: Sequence[torch.Tensor]) -> float:
    """Mean cosine distance of ``model``'s output rows (:func:`_outputs`) to ``reference`` (the float model's):
    what ``input_smoothing="auto"`` minimises on its held-out calibration batches.

    One batch at a time, compared and dropped: a language model's rows are vocabulary-wide (62 MiB per 512 tokens at
    32000 words), so holding every batch's was the calibration's peak.  A model that computes its logits for a
    subset of the positions (``softq_token_pieces``: the modules after the blocks of a block-by-block calibration,
    through the model's ``logits_to_keep``) is compared a piece of positions at a time against ``reference.piece``,
    each row's distance the same as from the whole batch's rows, and in the same order."""
    dist = []
    pieces_of = getattr(model, "softq_token_pieces", None)
    for i, batch in enumerate(batches):
        pieces = pieces_of(batch) if pieces_of is not None else None
        if not pieces:
            got, ref = _rows_of(model, batch), reference[i]
            dist.append(1.0 - nn.functional.cosine_similarity(got, ref, dim=-1))
            got = ref = None
            continue
        mask = batch.get("attention_mask")
        rows = torch.empty(batch["hidden_states"].shape[:2])
        for keep in pieces:
            got = model(**batch, logits_to_keep=keep).logits.float()
            rows[:, keep] = 1.0 - nn.functional.cosine_similarity(got, reference.piece(i, keep), dim=-1)
            got = None
        dist.append(rows.reshape(-1)[mask.reshape(-1).bool()] if mask is not None
                    and tuple(mask.shape) == tuple(rows.shape) else rows.reshape(-1))
    return float(torch.cat(dist).mean())
