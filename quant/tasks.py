"""Evaluation tasks: a model with its calibration set, held-out set and metric.

The CLI, the demo and the benchmarks all quantize and evaluate through a
:class:`Task`, so "perplexity of the reference LM at context 1024" means the same
thing everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from softq import workloads

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


@dataclass
class Task:
    name: str
    model: nn.Module
    calib: list[dict[str, torch.Tensor]]
    eval_inputs: list[dict[str, torch.Tensor]]
    metric_name: str
    higher_is_better: bool
    _measure: Callable[[nn.Module, list[dict[str, torch.Tensor]]], tuple[float, float]]
    source: Any = None  # the softq.hf.HFModel a model-directory task was built from

    def evaluate(self, model: nn.Module | None = None) -> float:
        """The task's headline metric (perplexity or top-1 %)."""
        return self.measure(model)[0]

    def measure(self, model: nn.Module | None = None) -> tuple[float, float]:
        """(metric, mean held-out cross-entropy in nats) from one pass over the held-out set.

        The loss is continuous, so it resolves what top-1 on a few hundred images cannot.
        """
        return self._measure(self.model if model is None else model, self.eval_inputs)


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
    progress: bool = True,
) -> Task:
    """The reference LM (perplexity) or ViT (top-1) task, trained and cached on first use.

    ``context`` (LM only) evaluates and calibrates on windows of that length (the
    model is trained at its full context, at least 1024).  ``eval_limit`` caps the
    held-out windows (LM) or images (ViT) for quick runs; ``None`` uses all.
    ``steps`` overrides the training budget (a separate cache entry).
    """
    if name == "lm":
        model, tokenizer = workloads.reference_lm(seed, attention, size=size, steps=steps, progress=progress)
        return lm_task(model, tokenizer, context=context, calib_size=calib_size, eval_limit=eval_limit, seed=seed)
    if name == "vit":
        model = workloads.reference_vit(seed, attention, size=size, steps=steps, progress=progress)
        return vit_task(model, calib_size=calib_size, eval_limit=eval_limit, seed=seed)
    raise ValueError(f"unknown task '{name}'; choose one of {', '.join(TASKS)}")


def lm_task(
    model: nn.Module,
    tokenizer: workloads.CharTokenizer,
    *,
    context: int | None = None,
    calib_size: int = 16,
    eval_limit: int | None = None,
    seed: int = 0,
) -> Task:
    """Perplexity task of any character LM (cached or still training); see :func:`reference_task`."""
    full = model.config.n_positions
    context = context or full
    if context > full:
        raise ValueError(f"context {context} exceeds the LM's {full} positions")
    calib = workloads.lm_calib_inputs(calib_size, context, tokenizer, seed=1000 + seed)
    eval_inputs = workloads.lm_eval_inputs(context, eval_limit, tokenizer)

    def lm_measure(m: nn.Module, inputs: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        ppl = workloads.perplexity(m, inputs, progress=False)
        return ppl, math.log(ppl)

    return Task(f"lm@{context}", model, calib, eval_inputs, "perplexity", False, lm_measure)


def vit_task(model: nn.Module, *, calib_size: int = 16, eval_limit: int | None = None, seed: int = 0) -> Task:
    """Top-1 task of any digits ViT (cached or still training); see :func:`reference_task`."""
    image_size = model.config.image_size
    calib = workloads.vit_calib_inputs(calib_size, image_size, seed=1000 + seed, batch_size=min(calib_size, 16))
    images, labels = workloads.digits_data("heldout", image_size)
    if eval_limit is not None:
        images, labels = images[:eval_limit], labels[:eval_limit]
    eval_inputs = [{"pixel_values": images[i:i + 128]} for i in range(0, len(images), 128)]
    return Task("vit", model, calib, eval_inputs, "top-1 %", True, lambda m, inputs: _classify(m, inputs, labels))


def model_dir_task(
    loaded: Any,
    calib_texts: list[str] | None = None,
    eval_texts: list[str] | None = None,
    *,
    calib_size: int = 64,
    eval_limit: int | None = 128,
    batch_size: int = 16,
) -> Task:
    """Fidelity task of any Hugging Face model directory (:class:`softq.hf.HFModel`): cosine to FP32.

    Headless encoders are compared on their sentence embedding (the directory's
    sentence-transformers pooling, else mean pooling), models with a head on their
    logits (per example).  Calibration texts default to paragraphs of Python's
    documentation, the evaluation texts to disjoint ones (``softq.hf.text_split``).
    The loss used by the sensitivity ranking is ``1 - mean cosine``.
    """
    from softq import hf

    if not loaded.is_text:
        raise ValueError(f"{loaded.path}: softq's model-directory commands take text models; "
                         "quantize vision models from Python with softq.quantize(model, calib_images)")
    calib_texts = calib_texts if calib_texts is not None else hf.text_split("calib", calib_size)
    eval_texts = eval_texts if eval_texts is not None else hf.text_split("eval", eval_limit)
    calib = loaded.batches(calib_texts[:calib_size], batch_size)
    eval_inputs = loaded.batches(eval_texts, batch_size)

    @torch.no_grad()
    def outputs(m: nn.Module, inputs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        from softq.export.model_export import is_headless

        if is_headless(loaded.model):
            return loaded.encode(inputs, m)
        m.eval()
        return torch.cat([m(**b).logits.flatten(1) for b in inputs])

    reference: list[torch.Tensor] = []

    def cosine_measure(m: nn.Module, inputs: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        if not reference:
            reference.append(outputs(loaded.model, inputs))
        cos = nn.functional.cosine_similarity(outputs(m, inputs), reference[0], dim=-1).mean().item()
        return cos, 1.0 - cos

    return Task(loaded.path.name, loaded.model, calib, eval_inputs, "cosine to FP32", True, cosine_measure, loaded)
