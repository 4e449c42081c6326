"""The reference workloads as MPC tasks: model, one evaluation batch, training batches, metric.

Encrypted runs are costly, so an MPC task evaluates one batch: ``n`` held-out
digit images for the ViT, ``n`` held-out text windows of ``seq_len`` characters
for the character LM (metric: next-character accuracy).  The same batch is run
in plaintext, so encrypted and plaintext numbers are directly comparable.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class MPCTask:
    name: str
    model: nn.Module
    inputs: dict[str, torch.Tensor]
    labels: torch.Tensor
    tokenizer: Any = None

    def accuracy(self, logits: torch.Tensor) -> float:
        """Top-1 (ViT) or next-character (LM) accuracy in percent."""
        if self.name == "lm":
            pred, target = logits[:, :-1].argmax(-1), self.labels[:, 1:]
        else:
            pred, target = logits.argmax(-1), self.labels
        return 100.0 * float((pred == target).float().mean())

    def train_batches(self, batch_size: int = 16, seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        from softq import workloads

        if self.name == "lm":
            seq = self.inputs["input_ids"].shape[1]
            return workloads.lm_batches("train", seq, batch_size, seed, self.tokenizer)
        size = self.model.config.image_size
        return workloads.vit_batches("train", size, batch_size, seed, augment=True)


def reference_task(name: str, n: int = 32, seq_len: int = 64, progress: bool = True) -> MPCTask:
    """``lm`` or ``vit`` (trained and cached by :mod:`softq.workloads` on first use)."""
    from softq import workloads

    if name == "vit":
        model = workloads.reference_vit(progress=progress)
        images, labels = workloads.digits_data("heldout", model.config.image_size)
        if not 1 <= n <= len(images):
            raise ValueError(f"n must be in 1..{len(images)} for the ViT task, got {n}")
        return MPCTask("vit", model, {"pixel_values": images[:n]}, labels[:n])
    if name == "lm":
        model, tok = workloads.reference_lm(progress=progress)
        windows = workloads.lm_eval_inputs(seq_len, n, tok)
        if len(windows) < n:
            raise ValueError(f"only {len(windows)} held-out windows of {seq_len} characters")
        ids = torch.cat([w["input_ids"] for w in windows])
        return MPCTask("lm", model, {"input_ids": ids}, ids, tok)
    raise ValueError(f"unknown reference task '{name}'; choose lm or vit")


def take(it: Iterator[Any], n: int) -> list[Any]:
    return list(itertools.islice(it, n))
