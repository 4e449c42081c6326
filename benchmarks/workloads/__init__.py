"""softq's reference workloads: a character LM and a digits ViT, trained here, never downloaded.

softq must be testable and benchmarkable with no network, so its workloads are
built from data that ships with Python and scikit-learn:

* **Text**: Python's own help topics (``pydoc_data.topics``), ~465k characters of
  technical English, modelled character by character (GPT-2, OPT or Llama family).
* **Images**: scikit-learn's bundled 8x8 handwritten digits, upsampled so a
  patch-4 ViT sees 64 tokens.

Every model is built from a config only and trained deterministically by seed,
so two machines produce the same reference models.  Trained models are cached
under :func:`cache_dir`; the cache key names size, family, attention variant,
seed, steps and :data:`VERSION` (bump it when data or training change).

Attention variants (clipped softmax, gated attention, ...) go through
``softq.attention.configure_attention`` *before* training, so every variant is
trained by the very same loop as the baseline.

The package's modules: :mod:`~workloads.data` (text and digits, batches, tokenizer, perplexity,
top-1), :mod:`~workloads.models` (configs, fresh models, attention options),
:mod:`~workloads.training` (the one training loop, the LM / ViT recipes) and
:mod:`~workloads.cache` (trained models on disk: ``reference_lm``, ``reference_vit``) and
:mod:`~workloads.tasks` (a model with what it is judged by: ``reference_task`` for quantization,
``mpc_task`` for encrypted inference).
Everything is importable from ``workloads`` itself.
"""

from __future__ import annotations

from workloads.data import (
    HELDOUT_FRACTION, DIGITS_SEED, char_corpus, CharTokenizer, lm_batches, lm_eval_inputs,
    lm_calib_inputs, perplexity, digits_data, vit_eval_inputs, vit_calib_inputs, top1,
    vit_batches,
)
from workloads.models import (
    LM_SIZES, LM_FAMILIES, VIT_SIZES, lm_config, lm_context, vit_config, build_model, variant_name, attention_options,
)
from workloads.training import (
    LM_BUDGETS, VIT_BUDGETS, run_training, train_lm, train_vit, add_training_args,
    attention_from_args,
)
from workloads.cache import (
    VERSION, cache_dir, cache_key, save_model, load_model, reference_lm, reference_vit, cached_meta,
)
from workloads.tasks import (
    TASKS, Task, reference_task, lm_task, vit_task, MPCTask, mpc_task,
)
from softq.evaluation import model_dir_task

__all__ = [
    "HELDOUT_FRACTION", "DIGITS_SEED", "char_corpus", "CharTokenizer", "lm_batches", "lm_eval_inputs",
    "lm_calib_inputs", "perplexity", "digits_data", "vit_eval_inputs", "vit_calib_inputs", "top1",
    "vit_batches", "LM_SIZES", "LM_FAMILIES", "VIT_SIZES", "lm_config", "lm_context", "vit_config", "build_model",
    "variant_name",
    "attention_options", "LM_BUDGETS", "VIT_BUDGETS", "run_training", "train_lm", "train_vit",
    "add_training_args", "attention_from_args", "VERSION", "cache_dir", "cache_key", "save_model",
    "load_model", "reference_lm", "reference_vit", "cached_meta", "TASKS", "Task", "reference_task", "lm_task",
    "vit_task", "model_dir_task", "MPCTask", "mpc_task",
]
