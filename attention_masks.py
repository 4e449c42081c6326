"""What Hugging Face's attention interface hands softq's attention functions, turned into softq's terms.

The mask becomes a public 0/1 ``valid`` tensor (padding, causal, sliding-window and local masks alike) plus,
where a family carries one there, an additive position bias; grouped K/V heads are repeated; learned sink logits
become an extra softmax column.  Shared by ``softq.attention`` (torch, quantization, export) and
``softq.mpc.surrogates``; :func:`recording` is how ``softq.models.discover`` sees who calls the interface.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def _sliced(attention_mask: torch.Tensor, key_len: int) -> torch.Tensor:
    # Slice only a longer mask: an exported graph (no cache, mask as long as the keys) then reads
    # the mask once instead of slicing it again in every layer from that layer's key shape,
    # so the layers share one valid tensor (onnx_utils.dedupe merges the equal comparisons).
    return attention_mask if attention_mask.shape[-1] == key_len else attention_mask[..., :key_len]


def valid_from_mask(attention_mask: torch.Tensor | None, key_len: int) -> torch.Tensor | None:
    """0/1 float mask of attendable keys from a Hugging Face attention mask (additive or boolean)."""
    if attention_mask is None:
        return None
    mask = _sliced(attention_mask, key_len)
    if mask.dtype == torch.bool:
        return mask.to(torch.float32)
    return (mask > torch.finfo(mask.dtype).min / 2).to(torch.float32)


def mask_bias(module: nn.Module, attention_mask: torch.Tensor | None, key_len: int) -> torch.Tensor | None:
    """The additive position bias a family carries in its float mask (T5's relative buckets, MPNet's), zero at masked
    keys; None where the mask holds only 0 and the dtype's minimum.  Whether a module's mask carries one is found
    on its first call and kept on the module (``softq_mask_bias``), so an exported graph computes the bias only for
    the families that have one."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return None
    carries = getattr(module, "softq_mask_bias", None)
    mask = _sliced(attention_mask, key_len)
    if carries is None:
        if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling():
            return None  # (set by every eager forward with a mask before an export traces; none there: no bias)
        carries = bool(((mask != 0) & (mask > torch.finfo(mask.dtype).min / 2)).any())
        module.softq_mask_bias = carries
    if not carries:
        return None
    return torch.where(mask > torch.finfo(mask.dtype).min / 2, mask, torch.zeros((), dtype=mask.dtype))


class _Recording:
    modules: list[tuple[nn.Module, bool]] | None = None


def _masks_the_future(module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                      kwargs: dict[str, Any]) -> bool:
    """Whether a call is causal: the module says so (``is_causal``, as an attribute or a keyword: CLIP's text
    encoder passes it), or its mask hides every key after the query's position."""
    if bool(getattr(module, "is_causal", False)) or bool(kwargs.get("is_causal", False)):
        return True
    q_len, k_len = query.shape[-2], key.shape[-2]
    if attention_mask is None or q_len < 2 or q_len != k_len:
        return False
    valid = valid_from_mask(attention_mask, k_len).reshape(-1, q_len, k_len)
    future = torch.ones(q_len, k_len, dtype=torch.bool, device=valid.device).triu(1)
    return bool((valid[:, future] == 0).all())


@contextmanager
def recording(modules: list[tuple[nn.Module, bool]]) -> Iterator[None]:
    """Append (module, causal) for every call of softq's attention function to ``modules``
    (``softq.models.discover``)."""
    before = _Recording.modules
    _Recording.modules = modules
    try:
        yield
    finally:
        _Recording.modules = before


def _extra_column(scores: torch.Tensor, valid: torch.Tensor | None, sinks: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores and valid mask with the learned sink logits (``s_aux``, one per head) as a last key column that every
    row may attend to: it joins the row's max and sum, and no value reads it."""
    b, h, q, _ = scores.shape
    column = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(b, h, q, 1)
    scores = torch.cat((scores, column), dim=-1)
    if valid is not None:
        valid = valid.expand(*scores.shape[:-1], valid.shape[-1]) if valid.dim() == 4 else valid.expand(q, -1)
        valid = torch.cat((valid, torch.ones(*valid.shape[:-1], 1, dtype=valid.dtype, device=valid.device)), dim=-1)
    return scores, valid


def attention_inputs(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
    """What every softq attention function needs first: (key, value, valid mask, scaling).

    Repeats K/V for grouped-query attention, turns the Hugging Face mask into a
    public 0/1 ``valid`` tensor (a causal one when the module is causal and got
    no mask), and defaults ``scaling`` to ``1/sqrt(head_dim)``.
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if key.shape[1] != query.shape[1]:  # grouped-query attention
        rep = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    valid = valid_from_mask(attention_mask, key.shape[-2])
    if valid is None and getattr(module, "is_causal", False) and query.shape[-2] > 1:
        q_len, k_len = query.shape[-2], key.shape[-2]
        valid = torch.ones(q_len, k_len, device=query.device).tril(k_len - q_len)
    return key, value, valid, scaling
