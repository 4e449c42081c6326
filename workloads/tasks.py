"""The reference tasks: a model with the data and the metric it is judged by, in one place.

The CLI, the demo and the benchmarks all go through these, so "perplexity of the reference LM at
context 1024" or "the ViT's encrypted batch" means the same thing everywhere:

* :class:`Task` (quantization): a model with its calibration set, held-out set and metric;
  :func:`reference_task` (the reference LM or ViT), :func:`lm_task` / :func:`vit_task` (any
  character LM or digits ViT), :func:`model_dir_task` (a Hugging Face model directory: cosine to FP32).
* :class:`MPCTask` (encrypted inference): a model with one evaluation batch, its labels and
  training batches for distillation; :func:`mpc_task`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from softq.models import is_headless, output_fields
from softq.workloads.cache import reference_lm, reference_vit
from softq.workloads.data import (
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
        model, tokenizer = reference_lm(seed, attention, size=size, steps=steps, progress=progress)
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
    full = model.config.n_positions
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
    """``lm`` or ``vit`` as an MPC task (trained and cached by :mod:`softq.workloads` on first use).

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
