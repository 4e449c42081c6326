"""How softq's model-directory commands judge a quantized model: a :class:`Task` is a model with its calibration
inputs, held-out inputs and the metric it is judged by; :func:`model_dir_task` makes one for a Hugging Face
model directory (cosine to FP32).  ``softq quantize``, ``softq report`` and ``softq export`` go through it, and
the benchmarks' reference tasks are Tasks too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from softq.models import is_headless, output_fields


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
    loss_name: str = "held-out loss (nats)"  # what measure()'s second value is, for reports

    def evaluate(self, model: nn.Module | None = None) -> float:
        """The task's headline metric (perplexity or top-1 %)."""
        return self.measure(model)[0]

    def measure(self, model: nn.Module | None = None) -> tuple[float, float]:
        """(metric, loss) from one pass over the held-out set: the mean cross-entropy in nats (reference tasks) or
        ``1 - mean cosine`` to FP32 (model directories); :attr:`loss_name` says which.

        The loss is continuous, so it resolves what top-1 on a few hundred images cannot.
        """
        return self._measure(self.model if model is None else model, self.eval_inputs)


CALIB_FILE_TEXTS = 64  # model_dir_task: calibration texts taken from a given list (--calib) by default


def model_dir_task(
    loaded: Any,
    calib_texts: list[str] | None = None,
    eval_texts: list[str] | None = None,
    *,
    calib_size: int | None = None,
    eval_limit: int | None = 128,
    batch_size: int = 16,
) -> Task:
    """Fidelity task of any Hugging Face model directory (:class:`softq.hf.HFModel`): cosine to FP32.

    Headless encoders are compared on their sentence embedding (the directory's
    sentence-transformers pooling, else mean pooling), models with a head on their
    logits (per example).  Calibration texts default to :func:`softq.corpora.calibration_texts`
    (Python documentation paragraphs and short everyday English; ``calib_size``: that many,
    else all 132; of given texts the first ``calib_size``, else 64), the evaluation texts to
    paragraphs disjoint from the calibration ones (``softq.corpora.text_split``).
    The loss used by the sensitivity ranking is ``1 - mean cosine``.
    """
    from softq import corpora

    if not loaded.is_text:
        raise ValueError(f"{loaded.path}: softq's model-directory commands take text models; "
                         "quantize vision models from Python with softq.quantize(model, calib_images)")
    if calib_size is not None and (not isinstance(calib_size, int) or calib_size < 1):
        raise ValueError(f"calib_size must be a positive integer, got {calib_size!r}")
    calib_texts = (calib_texts[:calib_size if calib_size is not None else CALIB_FILE_TEXTS] if calib_texts is not None
                   else corpora.calibration_texts(calib_size))
    eval_texts = eval_texts if eval_texts is not None else corpora.text_split("eval", eval_limit)
    calib = loaded.batches(calib_texts, batch_size)
    eval_inputs = loaded.batches(eval_texts, batch_size)
    if not is_headless(loaded.model):  # a head without one logits output (question answering...): before any work
        with torch.no_grad():
            out = loaded.model.eval()(**{k: v[:1] for k, v in calib[0].items()})
        if not isinstance(getattr(out, "logits", None), torch.Tensor):
            raise ValueError(f"{loaded.path}: {type(loaded.model).__name__} outputs {output_fields(out)} and no "
                             "logits; softq's model-directory commands take headless encoders (sentence embeddings) "
                             "and models with one logits output: quantize it from Python with softq.quantize")

    @torch.no_grad()
    def outputs(m: nn.Module, inputs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        if is_headless(loaded.model):
            return loaded.encode(inputs, m)
        m.eval()
        return torch.cat([m(**b).logits.flatten(1) for b in inputs])

    reference: list[torch.Tensor] = []

    def cosine_measure(m: nn.Module, inputs: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        if not reference:
            reference.append(outputs(loaded.model, inputs))
        cos = _mean_cosine64(outputs(m, inputs), reference[0])
        return cos, 1.0 - cos

    return Task(loaded.path.name, loaded.model, calib, eval_inputs, "cosine to FP32", True, cosine_measure, loaded,
                "held-out 1 - mean cosine to FP32")


def _mean_cosine64(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine of the rows of ``a`` and ``b`` summed in float64 one row at a time: over a row of tokens x
    vocabulary logits (millions of values) float32 sums drift by as much as the quantization loss (the float
    model read against itself above 1; tests/test_model_dir.py), and
    float64 copies of the whole [n, tokens x vocabulary] outputs would double the peak memory."""
    total = 0.0
    for x, y in zip(a, b):
        x, y = x.double(), y.double()
        total += float(x @ y / (x.norm() * y.norm()).clamp_min(1e-300))
    return total / len(a)
