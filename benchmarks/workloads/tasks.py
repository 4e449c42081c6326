"""The reference tasks: a model with the data and the metric it is judged by, in one place.

The CLI, the demo and the benchmarks all go through these, so "perplexity of the reference LM at
context 1024" or "the ViT's encrypted batch" means the same thing everywhere:

* :class:`Task` (quantization): a model with its calibration set, held-out set and metric;
  :func:`reference_task` (the reference LM or ViT), :func:`lm_task` / :func:`vit_task` (any
  character LM or digits ViT); :func:`softq.evaluation.model_dir_task` makes the same kind of Task of a
  Hugging Face model directory.
* :class:`MPCTask` (encrypted inference): a model with one evaluation batch, its labels and
  training batches for distillation; :func:`mpc_task`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from softq.evaluation import Task
from workloads.cache import reference_lm, reference_vit
from workloads.models import lm_context
from workloads.data import (
    CharTokenizer, digits_data, lm_batches, lm_calib_inputs, lm_eval_inputs, perplexity, vit_batches,
    vit_calib_inputs,
)

TASKS = ("lm", "vit")


@torch.no_grad()
def _classify(model: nn.Module, inputs: list[dict[str, torch.Tensor]], labels: torch.Tensor) -> tuple[float, float]:
    """(top-1 %, mean cross-entropy) of an image classifier."""
    was_training = model.training
    model.eval()
    try:
        logits = torch.cat([model(**batch).logits for batch in inputs])
    finally:
        model.train(was_training)
    top1 = 100.0 * (logits.argmax(-1) == labels).float().mean().item()
    return top1, torch.nn.functional.cross_entropy(logits, labels).item()


def reference_task(
    name: str,
    *,
    context: int | None = None,
    calib_size: int = 16,
    eval_limit: int | None = None,
    seed: int = 0,
    attention: dict[str, Any] | None = None,
    size: str = "reference",
    steps: int | None = None,
    family: str = "gpt2",
    progress: bool = True,
) -> Task:
    """The reference LM (perplexity) or ViT (top-1) task, trained and cached on first use.

    ``context`` (LM only) evaluates and calibrates on windows of that length (the
    model is trained at its full context, at least 1024).  ``eval_limit`` caps the
    held-out windows (LM) or images (ViT) for quick runs; ``None`` uses all.
    ``steps`` overrides the training budget (a separate cache entry); ``family``
    picks the LM's architecture (``gpt2``, ``opt``, ``llama``).
    """
    if name == "lm":
        model, tokenizer = reference_lm(seed, attention, family, size=size, steps=steps, progress=progress)
        return lm_task(model, tokenizer, context=context, calib_size=calib_size, eval_limit=eval_limit, seed=seed)
    if name == "vit":
        model = reference_vit(seed, attention, size=size, steps=steps, progress=progress)
        return vit_task(model, calib_size=calib_size, eval_limit=eval_limit, seed=seed)
    raise ValueError(f"unknown task '{name}'; choose one of {', '.join(TASKS)}")


def lm_task(
    model: nn.Module,
    tokenizer: CharTokenizer,
    *,
    context: int | None = None,
    calib_size: int = 16,
    eval_limit: int | None = None,
    seed: int = 0,
) -> Task:
    """Perplexity task of any character LM (cached or still training); see :func:`reference_task`."""
    full = lm_context(model.config)
    context = context or full
    if context > full:
        raise ValueError(f"context {context} exceeds the LM's {full} positions")
    calib = lm_calib_inputs(calib_size, context, tokenizer, seed=1000 + seed)
    eval_inputs = lm_eval_inputs(context, eval_limit, tokenizer)

    def lm_measure(m: nn.Module, inputs: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        ppl = perplexity(m, inputs, progress=False)
        return ppl, math.log(ppl)

    return Task(f"lm@{context}", model, calib, eval_inputs, "perplexity", False, lm_measure)


def vit_task(model: nn.Module, *, calib_size: int = 16, eval_limit: int | None = None, seed: int = 0) -> Task:
    """Top-1 task of any digits ViT (cached or still training); see :func:`reference_task`."""
    image_size = model.config.image_size
    calib = vit_calib_inputs(calib_size, image_size, seed=1000 + seed, batch_size=min(calib_size, 16))
    images, labels = digits_data("heldout", image_size)
    if eval_limit is not None:
        images, labels = images[:eval_limit], labels[:eval_limit]
    eval_inputs = [{"pixel_values": images[i:i + 128]} for i in range(0, len(images), 128)]
    return Task("vit", model, calib, eval_inputs, "top-1 %", True, lambda m, inputs: _classify(m, inputs, labels))


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
        if self.name == "lm":
            seq = self.inputs["input_ids"].shape[1]
            return lm_batches("train", seq, batch_size, seed, self.tokenizer)
        size = self.model.config.image_size
        return vit_batches("train", size, batch_size, seed, augment=True)


def mpc_task(name: str, n: int = 32, seq_len: int = 64, progress: bool = True) -> MPCTask:
    """``lm`` or ``vit`` as an MPC task (trained and cached by :mod:`workloads` on first use).

    Encrypted runs are costly, so an MPC task evaluates one batch: ``n`` held-out digit images for
    the ViT, ``n`` held-out text windows of ``seq_len`` characters for the character LM (metric:
    next-character accuracy).  The same batch is run in plaintext, so encrypted and plaintext
    numbers are directly comparable.
    """
    if name == "vit":
        model = reference_vit(progress=progress)
        images, labels = digits_data("heldout", model.config.image_size)
        if not 1 <= n <= len(images):
            raise ValueError(f"n must be in 1..{len(images)} for the ViT task, got {n}")
        return MPCTask("vit", model, {"pixel_values": images[:n]}, labels[:n])
    if name == "lm":
        model, tok = reference_lm(progress=progress)
        windows = lm_eval_inputs(seq_len, n, tok)
        if len(windows) < n:
            raise ValueError(f"only {len(windows)} held-out windows of {seq_len} characters")
        ids = torch.cat([w["input_ids"] for w in windows])
        return MPCTask("lm", model, {"input_ids": ids}, ids, tok)
    raise ValueError(f"unknown reference task '{name}'; choose lm or vit")
