"""``softq.quantize``: W8A8 post-training quantization of a whole Hugging Face model.

What is quantized (each point is a Brevitas quantizer, see ``quantizers.py`` and ``layers.py``):

* every ``nn.Linear`` weight (symmetric, per output channel) and its input;
* the Q and K inputs of the score matmul and the softmax input (scores);
* the softmax output (unsigned codes relative to the row max by default, see
  ``QuantConfig.softmax_output``) and the V input of P.V;
* LayerNorm inputs, i.e. the residual stream (``quantize_residual``; by default only
  with the ``edge`` softmax output).

Embedding tables, the ViT patch-embedding convolution and LayerNorm arithmetic
stay float, as in the usual W8A8 deployments.  Attention is hooked through
``transformers.AttentionInterface`` (``softq.attention``); Hugging Face code is
never edited.

The passes run in this order, each on the calibration set:
SmoothQuant (optional) -> range observation -> softmax bias correction (optional).
Input smoothing (``QuantConfig.input_smoothing``) needs no pass of its own with the
min-max observer: the observation pass also records each Linear input's per-channel
ranges, smoothing is decided from them afterwards, and the smoothed inputs' ranges
follow exactly (a positive per-channel factor maps each channel's min and max to the
scaled input's).  Other observers get a statistics pass first.

``points.py`` inserts the points; each calibration pass has a file of its own:
``smoothing_search.py`` (``input_smoothing="auto"``, judged on ``held_out.py``'s
held-out batches), ``v_fold.py`` (``smoothing_into_v``), ``weight_bias.py`` and
``softmax_bias.py``.  This module runs them in order and reports what was chosen.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from softq.attention import attention_points
from softq.calib.data import Batch, as_batches, run_batches
from softq.calib.smoothquant import InputRecorder, post_ln, smooth, smooth_inputs, smoothable_linears
from softq.hf import (is_sentence_transformer, refuse_save_pretrained, sentence_transformer_batches,
                      sentence_transformer_pooling)
from softq.models import conv1d_to_linear, discover
from softq.quant.config import (AUTO_SMOOTHING_ALPHA, AUTO_SMOOTHING_ALPHAS, AUTO_SMOOTHING_MIN_GAIN,
                                AUTO_SMOOTHING_RATIO, AUTO_SMOOTHING_TIE, QuantConfig)
from softq.quant.copies import _collect, independent_copy, model_bytes, prompt_release
from softq.quant.held_out import _held_out_split, _outputs
from softq.quant.layers import QLinear
from softq.quant import kv_cache, offload, sequential
from softq.quant.points import _finish, prepare, residual_prefix, set_mode
from softq.quant.quantizers import SoftmaxOutputQuantizer
from softq.quant.smoothing_search import _scope, _search_smoothing, _smooth_observed
from softq.quant.softmax_bias import correct_softmax_bias
from softq.quant.v_fold import _fold_into_v_if_better, fold_smoothing_into_v
from softq.quant.weight_bias import correct_weight_bias
from softq.quant.weight_cache import uncached_weights


def quantize(
    model: nn.Module,
    calib_data: Iterable[torch.Tensor | Mapping[str, torch.Tensor]],
    config: QuantConfig | None = None,
    inplace: bool = False,
) -> nn.Module:
    """Quantize ``model`` with ``config`` using ``calib_data``; returns the fake-quantized model.

    ``calib_data`` is an iterable of model inputs (tensors taken as the main
    input, or dicts of keyword inputs).  The result is called and evaluated
    exactly like the original model.  The original is left untouched unless
    ``inplace=True``, or unless a copy of it would not fit in the free memory (then a warning says it is quantized
    in place).  A ``sentence_transformers.SentenceTransformer`` also takes a list of
    texts: its Hugging Face model is quantized (:func:`_quantize_sentence_transformer`).
    """
    if is_sentence_transformer(model):
        return _quantize_sentence_transformer(model, calib_data, config, inplace)
    # no dequantized-weight caches while calibrating: each model run here (the search's candidates above all) kept
    # a float copy of its weights; the quantized model makes its cache when it is first run
    # a large model's freed activations go back to the system at once (copies.prompt_release)
    with uncached_weights(), kv_cache.calibrating(), prompt_release(model):
        return _quantize(model, calib_data, config, inplace)


def _quantize(model: nn.Module, calib_data: Iterable[torch.Tensor | Mapping[str, torch.Tensor]],
              config: QuantConfig | None, inplace: bool) -> nn.Module:
    """:func:`quantize` of a Hugging Face model."""
    config = QuantConfig() if config is None else config
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a softq.QuantConfig, got a {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got a {type(model).__name__}")
    if is_quantized(model):
        raise ValueError("the model is already quantized (returned by softq.quantize); pass the float model")
    offloaded = offload.has_meta(model)
    if offloaded and not offload.dispatched(model):
        raise ValueError("the model's weights are on the meta device (no values): load real weights first "
                         "(e.g. from_pretrained without device_map='meta', or model.to_empty() and load_state_dict)")
    if offloaded:
        offload.check(model, config)  # settings that need every weight, a deleted offload folder
    names = [name for name, _ in model.named_modules()]
    unmatched = [pattern for pattern in config.exclude if not any(pattern in name for name in names)]
    if unmatched:
        raise ValueError(f"exclude: {', '.join(map(repr, unmatched))} matches no module name of the model "
                         f"(names look like {names[-1]!r})")
    batches = as_batches(model, calib_data)
    discover(model, batches[0])  # finds the attention modules, or one line on what stops softq
    residual_prefix(model, config)  # and for a prefix a causal LM cannot have
    _try_forward(model, batches[0])
    if not inplace and not offloaded and not sequential.copy_fits(model):
        warnings.warn(f"softq.quantize: a copy of the model ({model_bytes(model) / 1e9:.1f} GB) would not "
                      "fit in the free memory; quantizing it in place (inplace=True)", UserWarning, stacklevel=3)
        inplace = True
    qmodel = model if inplace or offloaded else independent_copy(model)
    # accelerate's device_map / offload: calibrated block by block, each block loaded on its execution device
    dispatch = (offload.Offloaded(qmodel, sequential.blocks_of(qmodel))
                if offload.dispatched(qmodel) and (offloaded or sequential.wanted(qmodel, config)) else None)
    if not inplace and offloaded:
        warnings.warn("softq.quantize: the model's weights are offloaded by accelerate; quantizing it in place "
                      "(inplace=True), each block written back to where it was offloaded", UserWarning, stacklevel=3)
    qmodel.eval()
    conv1d_to_linear(qmodel)
    attention_points(qmodel)  # switches to softq attention, keeps an already chosen variant
    foldable = not post_ln(qmodel, batches[0])  # a forward pass: before prepare inserts observers
    if config.smoothquant_alpha is not None:
        smooth(qmodel, batches, config.smoothquant_alpha)
    # input smoothing: an explicit alpha, or "auto"'s candidates (None = no smoothing)
    alphas: tuple[float | None, ...] = (None,)
    if config.input_smoothing == "auto":
        alphas = (None, *AUTO_SMOOTHING_ALPHAS)
    elif config.input_smoothing is not None:
        alphas = (float(config.input_smoothing),)
    # "auto" searches on held-out calibration batches (every 4th, or the last of 2 or 3; a single batch is
    # cut into up to 4 along its examples): ranges observed on the others, candidates judged on batches their
    # ranges never saw, so an alpha that only fits the observed ranges (clipping on new inputs) loses.  With
    # another observer, the gate rule; with a single example, no smoothing (below).
    # smoothing_into_v="auto" judges the fold on the same held-out batches (it can only fold a smoothing)
    fold_auto = (config.smoothing_into_v == "auto" and config.input_smoothing is not None
                 and config.weight_per_channel)
    wants_search = len(alphas) > 1 and config.observer == "minmax"
    split = _held_out_split(batches) if wants_search or fold_auto else None
    search = split is not None and wants_search
    # a single calibration example: nothing to judge a smoothing on, and per-channel scales fitted on one input's
    # tokens need not carry to others
    unjudged = wants_search and not search
    if unjudged:
        alphas = (None,)
    elif len(alphas) > 1 and not search:
        alphas = (AUTO_SMOOTHING_ALPHA,)
    min_ratio = AUTO_SMOOTHING_RATIO if config.input_smoothing == "auto" and not search else 0.0
    # Min-max ranges of a smoothed input follow from its per-channel ranges, so smoothing is decided
    # after the one observation pass; other observers need the smoothed values themselves: a stats pass first.
    one_pass = alphas != (None,) and config.observer == "minmax"
    if alphas != (None,) and not one_pass:
        smoothed = smooth_inputs(qmodel, batches, alphas[0], min_ratio, exclude=config.exclude)
        alphas = (alphas[0] if smoothed else None,)
    fit, held = split if search else (batches, [])
    blocks = offloaded or sequential.wanted(qmodel, config)
    # the float model's outputs on the held-out batches (before prepare: an inplace model is qmodel), and block by
    # block each block's outputs there
    block_refs = last = None
    if split is not None and blocks:
        reference, block_refs, last = sequential.float_references(qmodel, split[1])
    else:
        reference = _outputs(qmodel, split[1]) if split is not None else None
    if dispatch is not None:
        dispatch.detach()
    prepare(qmodel, config)
    skip = config.exclude + tuple(name for name, m in qmodel.named_modules()
                                         if isinstance(m, nn.Linear) and not isinstance(m, QLinear))
    runs = blocks and sequential.runs_blocks(qmodel, config)
    if offloaded and not runs:
        raise ValueError("the model's weights are offloaded by accelerate, which softq calibrates block by block, but "
                         f"{sequential.outside_blocks_quantized(qmodel)[0]} is quantized and runs before the first "
                         "block: load the model without offload")
    if runs:
        plan = sequential.Plan(alphas, search, min_ratio, one_pass, foldable, fold_auto, skip)
        sequential.calibrate(qmodel, config, batches, fit, held, split[1] if split else [], reference, block_refs,
                             plan, dispatch, last)
        sequential.report(qmodel, plan, unjudged)
        if config.bias_correction is not None and not any(isinstance(m, SoftmaxOutputQuantizer)
                                                          for m in qmodel.modules()):
            raise ValueError("softmax bias correction needs a quantized softmax output (softmax_bits)")
        _collect(qmodel)
        return qmodel

    if split is not None and reference is None:  # blocks were wanted but cannot run: the float outputs, unchanged yet
        with sequential.floated(qmodel):
            reference = _outputs(qmodel, split[1])
    set_mode(qmodel, "observe")
    recorder = InputRecorder(qmodel, smoothable_linears(qmodel)) if one_pass else None
    errors = folded_errors = None
    folded = False  # smoothing only the inputs that fold into a LayerNorm (no run-time cost)
    # groups never smoothed (skip, above): excluded, or reading into a Linear that stays float.  A tied Linear
    # (GPT-2's lm_head, which shares the token table) may be: prepare gave the quantized Linear weights of its own,
    # and those are what the smoothing scales (the reference LM at 256 characters: logit distance to FP32 9.3e-6 ->
    # 6.3e-6)
    try:
        run_batches(qmodel, fit, desc="calibrating ranges")
        if search:
            recorder.remove()  # a copy must not carry the recording hooks
            alpha, folded, errors, folded_errors = _search_smoothing(qmodel, recorder, alphas, skip, held, reference,
                                                                     foldable)
            alphas = (alpha,)
            recorder.resume()
            run_batches(qmodel, held, desc="calibrating ranges")  # the final ranges see every batch
    finally:
        if recorder is not None:
            recorder.remove()
    alpha = alphas[0]
    if recorder is not None and alpha is not None and not _smooth_observed(
            _scope(recorder.groups(), folded), alpha, min_ratio, skip):
        alpha = None
    _finish(qmodel)
    # what was chosen, for reports: the alpha (None: no smoothing), whether only the LayerNorm-folded inputs got
    # it, and, after "auto"'s search, each candidate's error on the held-out calibration batches (:func:`output_error`)
    qmodel.softq_input_smoothing, qmodel.softq_smoothing_errors = alpha, errors
    qmodel.softq_smoothing_unjudged = unjudged
    qmodel.softq_smoothing_folded_only = folded and alpha is not None
    qmodel.softq_folded_smoothing_errors = folded_errors
    # the attention outputs' smoothing moved into V (before the weight bias correction sees the rows); "auto":
    # where the fold is no further from the float model on the held-out batches (errors recorded for reports)
    qmodel.softq_v_fold_errors = None
    corrected = False
    if config.smoothing_into_v is True:
        qmodel.softq_smoothing_into_v = fold_smoothing_into_v(qmodel, batches, config, explicit=True)
    elif config.smoothing_into_v == "auto" and split is not None and alpha is not None:
        qmodel.softq_smoothing_into_v, qmodel.softq_v_fold_errors, corrected = _fold_into_v_if_better(
            qmodel, batches, config, split[1], reference)
    else:
        qmodel.softq_smoothing_into_v = 0

    if config.weight_bias_correction and not corrected:
        correct_weight_bias(qmodel, batches)
    if config.bias_correction is not None:
        correct_softmax_bias(qmodel, batches, config.bias_correction)
    _collect(qmodel)  # the copies calibration dropped ("auto"'s observed model, smoothing_into_v's trial)
    return qmodel


def _quantize_sentence_transformer(st: nn.Module, calib_data: Any, config: QuantConfig | None, inplace: bool) -> nn.Module:
    """:func:`quantize` for a ``sentence_transformers.SentenceTransformer``: its Hugging Face model quantized in a copy
    (or in place), calibrated on texts tokenized as the SentenceTransformer does (or on its model inputs); the
    result's ``encode`` runs the quantized model, and :func:`softq.export.to_onnx` exports it with its pooling."""
    sentence_transformer_pooling(st)  # a pipeline softq does not compute: one line before any work
    batches = sentence_transformer_batches(st, calib_data)
    target = st if inplace else independent_copy(st)
    quantize(target[0].auto_model, batches, config, inplace=True)
    refuse_save_pretrained(target)
    return target


def smoothing_report(qmodel: nn.Module) -> str:
    """One line on the input smoothing ``quantize`` applied, with "auto"'s candidates and their errors."""
    def name(alpha: float | None) -> str:
        return "none" if alpha is None else f"alpha {alpha:g}"

    if not hasattr(qmodel, "softq_input_smoothing"):  # e.g. a model loaded from disk: the alpha is not saved
        smoothed = any(m.input_scale.numel() for m in qmodel.modules() if isinstance(m, QLinear))
        return f"input smoothing: {'yes (alpha not recorded)' if smoothed else 'none'}"
    text = f"input smoothing: {name(qmodel.softq_input_smoothing)}"
    if getattr(qmodel, "softq_smoothing_unjudged", False):
        text += (" (auto: a single calibration example leaves none to hold out and judge a smoothing on; "
                 "calibrate on more examples)")
    if getattr(qmodel, "softq_smoothing_folded_only", False):
        text += " at the inputs that fold into a LayerNorm"
    errors = getattr(qmodel, "softq_smoothing_errors", None)
    if errors:
        folded = getattr(qmodel, "softq_folded_smoothing_errors", None) or {}
        text += (" (auto: the lowest mean cosine distance of the outputs to the float model's on held-out "
                 "calibration batches; " + ", ".join(f"{name(a)} {e:.3g}" for a, e in errors.items()))
        if folded:
            text += ("; at LayerNorm-folded inputs only (no run-time cost, kept if below none): "
                     + ", ".join(f"{name(a)} {e:.3g}" for a, e in folded.items()))
        text += (f"; every input, which costs a Mul where one cannot fold, only if {AUTO_SMOOTHING_MIN_GAIN:.0%} "
                 "below none" + (" and below the folded ones" if folded else "")
                 + f"; alphas within {AUTO_SMOOTHING_TIE:.0%} of the lowest are ties, the smallest kept)")
    folded_v = getattr(qmodel, "softq_smoothing_into_v", 0)
    v_errors = getattr(qmodel, "softq_v_fold_errors", None)
    if folded_v or v_errors:
        text += f"; the attention output's smoothing {'folded into V' if folded_v else 'left at the output'}"
        text += f" ({folded_v} layers" if folded_v else " ("
        if v_errors:
            text += (f"{', ' if folded_v else ''}auto: held-out error {v_errors[1]:.3g} folded against "
                     f"{v_errors[0]:.3g} unfolded, folded if no higher")
        text += ")"
    return text


def _try_forward(model: nn.Module, batch: Batch) -> None:
    """Run one example of the first batch through the float model, so a mismatch fails here, named,
    not deep inside a pass (one example: a fraction of a calibration pass)."""
    try:
        run_batches(model, [{k: v[:1] for k, v in batch.items()}])
    except (RuntimeError, IndexError, ValueError, TypeError, AttributeError, KeyError) as err:
        shapes = {k: tuple(v.shape) for k, v in batch.items()}
        raise ValueError(f"calibration batch 0 with shapes {shapes} does not fit {type(model).__name__}: {err}") from err


def is_quantized(model: nn.Module) -> bool:
    """True for a model returned by :func:`quantize` (a SentenceTransformer: its Hugging Face model)."""
    if is_sentence_transformer(model):
        model = model[0].auto_model
    return isinstance(getattr(model, "softq_quant_config", None), QuantConfig)
