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
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from softq.attention import AttentionPoints, attention_points
from softq.calib.data import Batch, CalibrationDataError, as_batches, run_batches
from softq.calib.observers import MinMaxObserver, NoCalibrationData, make_observer
from softq.calib.smoothquant import (InputGroup, InputRecorder, post_ln, skipped, smooth, smooth_inputs,
                                     smoothable_linears, smoothing_scales)
from softq.hf import (is_sentence_transformer, refuse_save_pretrained, sentence_transformer_batches,
                      sentence_transformer_pooling)
from softq.models import conv1d_to_linear, is_causal, model_family
from softq.quant.config import AUTO_SMOOTHING_ALPHA, AUTO_SMOOTHING_ALPHAS, AUTO_SMOOTHING_MIN_GAIN, AUTO_SMOOTHING_RATIO, AUTO_SMOOTHING_TIE, PREFIX_TOKENS, QuantConfig, softmax_input_span
from softq.quant.layers import BiasShift, QEmbedding, QLayerNorm, QLinear, WeightOnly, quantize_weight_only
from softq.quant.quantizers import ActQuantizer, RowScoresQuantizer, SoftmaxOutputQuantizer
from softq.quant.weight_cache import uncached_weights


def _act(config: QuantConfig, groups: int | str = 1, prefix: int = 0) -> ActQuantizer:
    return ActQuantizer(config.act_bits, config.act_symmetric, config.observer, config.percentile, groups, prefix)


def residual_prefix(model: nn.Module, config: QuantConfig) -> int:
    """How many leading positions get residual-stream scales of their own (``QuantConfig.residual_prefix``)."""
    family = model_family(model)
    causal = is_causal(model)
    if config.residual_prefix == "auto":
        return 0 if causal else PREFIX_TOKENS.get(family, 0)
    if config.residual_prefix and (causal or family not in PREFIX_TOKENS):
        what = f"a {family} decoder (is_decoder=True)" if family in PREFIX_TOKENS else f"a {family} model"
        raise ValueError(f"residual_prefix applies to encoders ({', '.join(PREFIX_TOKENS)}); {what} "
                         "decodes with a KV cache, where a step's first row is not position 0; use residual_prefix=0 "
                         "(what 'auto' picks for it)")
    return int(config.residual_prefix)


def _replace_modules(model: nn.Module, config: QuantConfig) -> None:
    """Swap Linear -> QLinear, LayerNorm -> QLayerNorm and Embedding -> QEmbedding in place; Conv2d weights
    and a vision encoder's position table get weight-only codes (:func:`quantize_weight_only`)."""
    prefix = residual_prefix(model, config)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if any(pattern in full for pattern in config.exclude):
                continue
            if type(child) is nn.Linear:
                setattr(parent, child_name, QLinear(child, config.weight_bits, config.weight_per_channel, _act(config)))
            elif type(child) is nn.LayerNorm and config.residual_quantized:
                setattr(parent, child_name, QLayerNorm(child, _act(config, config.residual_groups, prefix)))
            elif (type(child) is nn.Embedding and config.embedding_bits is not None
                  and child.num_embeddings >= config.embedding_min_rows):
                setattr(parent, child_name, QEmbedding(child, config.embedding_bits))
    quantize_weight_only(model, config.weight_bits, config.embedding_bits, config.exclude)


def _attach_attention_quantizers(points: AttentionPoints, config: QuantConfig, causal: bool) -> None:
    points.q = _act(config)
    points.k = _act(config)
    points.v = _act(config)
    if config.softmax_bits is not None:
        if config.row_relative_input:
            points.scores = RowScoresQuantizer(config.act_bits, softmax_input_span(config.softmax_output,
                                                                                   config.softmax_bits, config.act_bits))
        elif not config.float_scores:  # softmax_input="float": the scores stay float (nn.Identity)
            points.scores = _act(config)
        points.probs = SoftmaxOutputQuantizer(config.softmax_bits, points.num_heads, config.softmax_scale,
                                              config.softmax_output)
        points.probs.causal_rows = causal  # per-row bias correction by position (SoftmaxOutputQuantizer.beta_for)
        points.set_softmax(points.softmax_name, **points.softmax_params)  # the quantizer learns if rows sum to 1


def act_quantizers(model: nn.Module) -> list[nn.Module]:
    """Every activation and softmax-output quantizer in ``model``."""
    return [m for m in model.modules() if isinstance(m, (ActQuantizer, SoftmaxOutputQuantizer))]


def set_mode(model: nn.Module, mode: str) -> None:
    for q in act_quantizers(model):
        q.mode = mode


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
    ``inplace=True``.  A ``sentence_transformers.SentenceTransformer`` also takes a list of
    texts: its Hugging Face model is quantized (:func:`_quantize_sentence_transformer`).
    """
    if is_sentence_transformer(model):
        return _quantize_sentence_transformer(model, calib_data, config, inplace)
    # no dequantized-weight caches while calibrating: each model run here (the search's candidates above all) kept
    # a float copy of its weights; the quantized model makes its cache when it is first run
    with uncached_weights():
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
    model_family(model)  # clear error for unsupported families before any work
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ValueError("the model's weights are on the meta device (no values): load real weights first "
                         "(e.g. from_pretrained without device_map='meta', or model.to_empty() and load_state_dict)")
    names = [name for name, _ in model.named_modules()]
    unmatched = [pattern for pattern in config.exclude if not any(pattern in name for name in names)]
    if unmatched:
        raise ValueError(f"exclude: {', '.join(map(repr, unmatched))} matches no module name of the model "
                         f"(names look like {names[-1]!r})")
    residual_prefix(model, config)  # and for a prefix a causal LM cannot have
    batches = as_batches(model, calib_data)
    _try_forward(model, batches[0])
    qmodel = model if inplace else independent_copy(model)
    qmodel.eval()
    conv1d_to_linear(qmodel)
    attention_points(qmodel)  # switches to softq attention, keeps an already chosen variant
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
    # the float model's outputs on the held-out batches (before prepare: an inplace model is qmodel)
    reference = _outputs(qmodel, split[1]) if split is not None else None
    prepare(qmodel, config)

    set_mode(qmodel, "observe")
    recorder = InputRecorder(qmodel, smoothable_linears(qmodel)) if one_pass else None
    errors = folded_errors = None
    folded = False  # smoothing only the inputs that fold into a LayerNorm (no run-time cost)
    foldable = not post_ln(qmodel)
    # groups never smoothed: excluded, or reading into a Linear that stays float.  A tied Linear (GPT-2's lm_head,
    # which shares the token table) may be: prepare gave the quantized Linear weights of its own, and those are
    # what the smoothing scales (the reference LM at 256 characters: logit distance to FP32 9.3e-6 -> 6.3e-6)
    skip = config.exclude + tuple(name for name, m in qmodel.named_modules()
                                         if isinstance(m, nn.Linear) and not isinstance(m, QLinear))
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
        qmodel.softq_smoothing_into_v = fold_smoothing_into_v(qmodel, batches, config)
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


def _finish(qmodel: nn.Module) -> None:
    prefix = max((getattr(points, "prefix_rows", 0) for _, points in attention_points(qmodel)), default=0)
    for name, q in qmodel.named_modules():
        if not isinstance(q, (ActQuantizer, SoftmaxOutputQuantizer)):
            continue
        try:
            q.finish_calibration()
        except NoCalibrationData:
            why = (f"; the model gives its first {prefix} position(s) scales of their own (QuantConfig.residual_"
                   f"prefix): calibration sequences of {prefix} token(s) reach only those" if prefix else "")
            raise CalibrationDataError(f"no calibration value reached {name}{why}") from None
    set_mode(qmodel, "quant")


# Models of at least this many bytes of parameters are collected as soon as quantize drops a copy of them: Brevitas'
# quantizers hold reference cycles, so a dropped copy waits for the cyclic collector (up to seven copies of a
# 650M-parameter OPT in input_smoothing="auto"'s search: out of memory at 24 GB).  A full collection costs time in
# a process holding many objects, which small models (the test suite's) need not pay.
COLLECT_ABOVE_BYTES = 2**26


def _collect(model: nn.Module) -> None:
    if sum(p.numel() * p.element_size() for p in model.parameters()) >= COLLECT_ABOVE_BYTES:
        gc.collect()


def independent_copy(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` whose parametrized modules have classes of their own.  torch's parametrize
    injects a class per module and a deep copy shares it, so a parametrization registered on the copy later
    (``prepare``'s weight quantizers, the weight bias correction's conv ``bias``) would put its property on
    the original's class too, and the original would look up a parametrization it does not have."""
    copied = copy.deepcopy(model)
    for module in copied.modules():
        cls = module.__class__
        if parametrize.is_parametrized(module):
            module.__class__ = type(cls.__name__, cls.__bases__, dict(cls.__dict__))
    return copied


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


def _first_example(batch: Batch) -> Batch:
    """``batch`` cut to its first example (every tensor with a batch dimension, when they share one)."""
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(sizes) != 1:
        return batch
    return {k: v[:1] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}


@torch.no_grad()
def _outputs(model: nn.Module, batches: list[Batch]) -> list[torch.Tensor]:
    """The model's output rows on ``batches``, one row per token (valid tokens only): its logits where they have
    a row per token (a language model), else its last hidden state (``[rows, features]`` each).

    A classifier's logits are one row per example: a handful per held-out batch, too few to tell candidates
    apart (the reference ViT's 4 held-out images picked a smoothing that its 260 token rows, and its held-out
    loss, did not), so classifiers are judged on the tokens of the last hidden state their head reads."""
    out = []
    for batch in batches:
        result = model(**batch, output_hidden_states=True)
        y = getattr(result, "logits", None)
        if y is None or y.dim() < 3:
            hidden = getattr(result, "hidden_states", None)
            y = (result.last_hidden_state if getattr(result, "last_hidden_state", None) is not None
                 else hidden[-1] if hidden else result[0])
        y = y.float()
        mask = batch.get("attention_mask")
        flat = y.reshape(-1, y.shape[-1])
        out.append(flat[mask.reshape(-1).bool()] if mask is not None and tuple(mask.shape) == tuple(y.shape[:-1])
                   else flat)
    return out


def output_error(model: nn.Module, batches: list[Batch], reference: list[torch.Tensor]) -> float:
    """Mean cosine distance of ``model``'s output rows (:func:`_outputs`) to ``reference`` (the float model's):
    what ``input_smoothing="auto"`` minimises on its held-out calibration batches."""
    got = _outputs(model, batches)
    dist = torch.cat([1.0 - nn.functional.cosine_similarity(a, b, dim=-1) for a, b in zip(got, reference)])
    return float(dist.mean())


def _scope(groups: list[InputGroup], folded_only: bool) -> list[InputGroup]:
    """The groups a smoothing applies to: all, or those whose input is a LayerNorm output (``folded_only``)."""
    return [g for g in groups if g.after_norm] if folded_only else groups


def _search_smoothing(observed: nn.Module, recorder: InputRecorder, alphas: tuple[float | None, ...],
                      skip: tuple[str, ...], held: list[Batch], reference: list[torch.Tensor], foldable: bool,
                      ) -> tuple[float | None, bool, dict[float | None, float], dict[float, float]]:
    """``input_smoothing="auto"``: each candidate alpha (``None``: no smoothing) applied to a copy of the model
    observed so far, finished and run on the held-out batches, at every input and, in a pre-LN model with
    other inputs too, at the LayerNorm outputs alone (their scales fold into the LayerNorm: free at run time).
    Returns (alpha, folded only, every-input errors, folded-only errors) by :func:`pick_smoothing`.  Min-max
    ranges of smoothed inputs follow from the recorded per-channel ones, so the candidates share one
    observation pass."""
    errors: dict[float | None, float] = {}
    folded: dict[float, float] = {}
    for scope in (False, True):
        if scope and not foldable:
            break
        for alpha in alphas if not scope else [a for a in alphas if a is not None]:
            trial = independent_copy(observed)
            groups = recorder.groups(dict(trial.named_modules()))
            if alpha is not None:
                done = _smooth_observed(_scope(groups, scope), alpha, 0.0, skip)
                everything = len([g for g in groups if not skipped(g, skip)])
                if not done or scope and done == everything:  # nothing smoothed, or the every-input candidate
                    break
            _finish(trial)
            (folded if scope else errors)[alpha] = output_error(trial, held, reference)
            trial = None
            _collect(observed)
    trial = None  # a candidate left by a break
    _collect(observed)
    alpha, folded_only = pick_smoothing(errors, folded)
    return alpha, folded_only, errors, folded


def pick_smoothing(errors: dict[float | None, float], folded: dict[float, float] | None = None,
                   ) -> tuple[float | None, bool]:
    """"auto"'s rule, as (alpha, folded only); "the lowest error" of a set of candidates means the smallest alpha
    within ``AUTO_SMOOTHING_TIE`` of the lowest.  The every-input alpha with the lowest error if it is at least
    ``AUTO_SMOOTHING_MIN_GAIN`` below no smoothing's (``errors[None]``: at run time it costs a Mul at each input
    that does not follow a LayerNorm, a GELU output or the attention output, whose scale takes the place of the
    row core's factor that export/fuse.py otherwise folds away) and below every LayerNorm-folded candidate's;
    else the LayerNorm-folded candidate (``folded``) with the lowest error if below no smoothing's (it costs
    nothing at run time); else no smoothing."""
    if None not in errors:
        return None, False
    best_folded = _smallest_near_best(folded) if folded else None
    smoothed = {a: e for a, e in errors.items() if a is not None}
    if smoothed:
        best = _smallest_near_best(smoothed)
        if (smoothed[best] <= (1.0 - AUTO_SMOOTHING_MIN_GAIN) * errors[None]
                and (best_folded is None or smoothed[best] < folded[best_folded])):
            return best, False
    if best_folded is not None and folded[best_folded] < errors[None]:
        return best_folded, True
    return None, False


def _smallest_near_best(errors: dict[float, float]) -> float:
    """The smallest alpha whose error is within ``AUTO_SMOOTHING_TIE`` of the lowest (ties go to the milder scales)."""
    low = min(errors.values())
    # |low|: a distance of a near-float model can round to a tiny negative number
    return min(a for a, e in errors.items() if e <= low + AUTO_SMOOTHING_TIE * abs(low))


def _smooth_observed(groups: list[InputGroup], alpha: float, min_ratio: float, skip: tuple[str, ...]) -> int:
    """Input smoothing decided from the observation pass just run (``smooth_inputs`` without a pass of its
    own): weight columns x s, ``input_scale`` = 1/s, and each input quantizer's min-max range set to what it
    would have seen on the smoothed input, min/max over channels of the channel's min/max times 1/s (exact:
    scaling by a positive factor and rounding are both monotonic).  Returns how many groups it smoothed."""
    done = 0
    with torch.no_grad():
        for group, s in smoothing_scales(groups, alpha, min_ratio, skip):
            done += 1
            inv = 1.0 / s
            lo, hi = float((group.lo * inv).min()), float((group.hi * inv).max())
            for _, lin in group.linears:
                lin.weight.mul_(s.to(lin.weight.dtype))
                lin.input_scale = inv.to(lin.weight.dtype).clone()
                observer = lin.input_act.observer
                if not isinstance(observer, MinMaxObserver) or lin.input_act.channels is not None:
                    raise RuntimeError("one-pass input smoothing needs per-tensor min-max input observers")
                observer.lo, observer.hi = lo, hi
    return done


def prepare(model: nn.Module, config: QuantConfig) -> nn.Module:
    """Insert every quantization point into ``model`` in place (no calibration yet).

    Used by :func:`quantize` before calibrating and by ``softq.quant.load`` to
    rebuild the structure a saved quantized model's state dict fits.
    """
    conv1d_to_linear(model)
    layers = attention_points(model)
    _replace_modules(model, config)
    prefix = residual_prefix(model, config) if config.residual_quantized else 0
    causal = is_causal(model)
    for _, points in layers:
        _attach_attention_quantizers(points, config, causal)
        points.prefix_rows = prefix
    model.softq_quant_config = config
    refuse_save_pretrained(model)
    model.train(model.training)  # the inserted modules in the model's mode (new modules are in training mode)
    return model


def _weight_only_convs(qmodel: nn.Module) -> dict[str, nn.Conv2d]:
    return {name: m for name, m in qmodel.named_modules() if isinstance(m, nn.Conv2d)
            and parametrize.is_parametrized(m, "weight") and isinstance(m.parametrizations.weight[0], WeightOnly)}


@torch.no_grad()
def fold_smoothing_into_v(qmodel: nn.Module, batches: list[Batch], config: QuantConfig) -> int:
    """``QuantConfig.smoothing_into_v``: each attention output's input-smoothing scale ``1/s`` (the output
    projection's ``input_scale``) moved onto V, i.e. onto the rows (and bias) of the Linear whose output V is;
    returns how many attention layers were folded.

    P.V is linear in V channel by channel, so ``(P.V) / s = P.(V / s)``: the same function in float.  Which
    Linear reads the attention output and which Linear's output (or which ``H d``-wide slice of it: GPT-2's
    c_attn) is V is found by comparing values on the first calibration batch, not by module names.  Only
    with per-channel weight codes (a row's scale then leaves its codes as they are).  V's quantizer, now
    seeing V / s, observes its range again over ``batches``; runs after the other ranges are fixed and
    before the weight bias correction, which then sees the scaled rows.
    """
    if not config.weight_per_channel:
        return 0
    layers = attention_points(qmodel)
    linears = {n: m for n, m in qmodel.named_modules() if isinstance(m, QLinear)}
    values: dict[int, torch.Tensor] = {}
    pvs: dict[int, torch.Tensor] = {}
    seen_in: dict[str, torch.Tensor] = {}
    seen_out: dict[str, torch.Tensor] = {}
    hooks = []
    for i, (_, points) in enumerate(layers):
        hooks.append(points.v.register_forward_pre_hook(lambda _m, args, i=i: values.__setitem__(i, args[0])))
        hooks.append(points.pv.register_forward_hook(lambda _m, _args, out, i=i: pvs.__setitem__(i, out)))

    def record(name: str):  # noqa: ANN202 - a forward hook returning None keeps the layer's output
        def hook(_m: nn.Module, args: tuple, out: torch.Tensor) -> None:
            seen_in[name], seen_out[name] = args[0], out
        return hook

    for name, lin in linears.items():
        hooks.append(lin.register_forward_hook(record(name)))
    try:
        run_batches(qmodel, [_first_example(batches[0])])  # which tensor is which: one example tells
    finally:
        for hook in hooks:
            hook.remove()
    folded = []
    for i, (_, points) in enumerate(layers):
        v, pv = values.get(i), pvs.get(i)
        if v is None or pv is None or v.dim() != 4 or pv.dim() != 4 or pv.shape[:2] != v.shape[:2] \
                or pv.shape[3] != v.shape[3]:
            continue
        b, h, n, d = v.shape
        width = h * d
        flat_pv = pv.transpose(1, 2).reshape(b, pv.shape[2], width)
        readers = [k for k, x in seen_in.items() if x.shape == flat_pv.shape and torch.equal(x, flat_pv)]
        flat_v = v.transpose(1, 2).reshape(b, n, width)
        sources = [(k, j) for k, y in seen_out.items() if y.dim() == 3 and tuple(y.shape[:2]) == (b, n)
                   and y.shape[-1] % width == 0 for j in range(0, y.shape[-1], width)
                   if torch.equal(y[..., j:j + width], flat_v)]
        if len(readers) != 1 or len(sources) != 1:
            continue
        out, (src, j) = linears[readers[0]], sources[0]
        if out.input_scale.numel() != width:
            continue
        inv = out.input_scale.to(linears[src].weight.dtype)
        rows = slice(j, j + width)
        linears[src].weight[rows] *= inv[:, None]
        if linears[src].bias is not None:
            linears[src].bias[rows] *= inv
        out.input_scale = torch.ones(0, dtype=out.input_scale.dtype, device=out.input_scale.device)
        points.v.observer = make_observer(config.observer, config.percentile)
        points.v.mode = "observe"
        folded.append(points.v)
    if folded:
        run_batches(qmodel, batches, desc="calibrating V")
        for quantizer in folded:
            quantizer.finish_calibration()
            quantizer.mode = "quant"
    return len(folded)


@torch.no_grad()
def _fold_into_v_if_better(qmodel: nn.Module, batches: list[Batch], config: QuantConfig, held: list[Batch],
                           reference: list[torch.Tensor]) -> tuple[int, tuple[float, float] | None, bool]:
    """``smoothing_into_v="auto"``: :func:`fold_smoothing_into_v` on a copy, kept (copied into ``qmodel``) if
    its outputs on the held-out batches are no further from the float model's (:func:`output_error`) than the
    unfolded model's, both judged as they will be returned (after the weight bias correction, which the fold
    changes): it saves a Mul per layer at run time, so a tie goes to the fold.  Returns (layers folded,
    (unfolded error, folded error), whether the weight bias correction has run); (0, None, False) where there
    was nothing to fold."""
    trial = independent_copy(qmodel)  # the conv bias correction below adds a parametrization to the copy
    count = fold_smoothing_into_v(trial, batches, config)
    if not count:
        return 0, None, False
    if config.weight_bias_correction:
        correct_weight_bias(trial, batches)
        correct_weight_bias(qmodel, batches)
    errors = (output_error(qmodel, held, reference), output_error(trial, held, reference))
    if errors[1] > errors[0]:
        return 0, errors, config.weight_bias_correction
    mine, theirs = dict(qmodel.named_modules()), dict(trial.named_modules())
    for name, module in mine.items():  # the folded output projections' empty input_scale, the bias shifts
        if isinstance(module, QLinear):
            module.input_scale = torch.zeros_like(theirs[name].input_scale)
            module.bias_shift = torch.zeros_like(theirs[name].bias_shift)
    qmodel.load_state_dict(trial.state_dict())  # V's scale and zero point are buffers: its new range comes along
    return count, errors, config.weight_bias_correction


@torch.no_grad()
def correct_weight_bias(qmodel: nn.Module, batches: list[Batch]) -> int:
    """Weight bias correction (``QuantConfig.weight_bias_correction``); returns how many layers it corrected.

    Rounding a layer's weights to codes moves the mean of its outputs by ``(W_q - W) E[x]``, ``E[x]`` the mean
    input the quantized layer sees on the calibration batches (tokens a batch's ``attention_mask`` marks valid;
    a weight-only ``Conv2d``: over images and positions).  That shift is taken off the bias (Nagel et al. 2019,
    data-free quantization's bias correction, here with the calibration data's mean): ``QLinear.bias_shift``, a
    :class:`~softq.quant.layers.BiasShift` on a conv's bias.  One pass over the batches, all layers at once
    (the means the quantized model sees before any correction); free at run time, it is the bias.
    """
    linears = {name: m for name, m in qmodel.named_modules() if isinstance(m, QLinear)}
    convs = {name: m for name, m in _weight_only_convs(qmodel).items() if m.bias is not None}
    sums: dict[str, list] = {}
    current: dict[str, torch.Tensor | None] = {"mask": None}

    def add(name: str, total: torch.Tensor, count: float) -> None:
        acc = sums.setdefault(name, [0.0, 0.0])
        acc[0], acc[1] = acc[0] + total, acc[1] + count

    def linear_hook(name: str):  # noqa: ANN202 - on the layer's input quantizer: its output is what W_q reads
        def hook(_q: nn.Module, _inp: tuple, out: torch.Tensor) -> None:
            mask = current["mask"]
            rows = out.detach().reshape(-1, out.shape[-1])
            # [batch, seq, ..] or OPT's flattened [batch * seq, ..] feed-forward inputs
            if mask is not None and (tuple(mask.shape) == tuple(out.shape[:-1])
                                     or out.dim() == 2 and mask.dim() == 2 and out.shape[0] == mask.numel()):
                rows = rows[mask.reshape(-1).bool()]
            add(name, rows.sum(0, dtype=torch.float64), float(rows.shape[0]))
        return hook

    errors = {name: (m.weight - m.parametrizations.weight.original).double() for name, m in convs.items()}

    def conv_hook(name: str):  # noqa: ANN202 - the convolution is linear: E[conv(x, dW)] = conv(E_batch[x], dW)
        def hook(m: nn.Conv2d, inp: tuple) -> None:
            x = inp[0].detach().double()
            y = nn.functional.conv2d(x.mean(0, keepdim=True), errors[name], None, m.stride, m.padding, m.dilation,
                                     m.groups)
            add(name, y.mean(dim=(0, 2, 3)) * x.shape[0], float(x.shape[0]))
        return hook

    def batch_mask(_m: nn.Module, _args: tuple, kwargs: dict) -> None:
        current["mask"] = kwargs.get("attention_mask")

    handles = [qmodel.register_forward_pre_hook(batch_mask, with_kwargs=True)]
    handles += [m.input_act.register_forward_hook(linear_hook(n)) for n, m in linears.items()]
    handles += [m.register_forward_pre_hook(conv_hook(n)) for n, m in convs.items()]
    try:
        run_batches(qmodel, batches, desc="weight bias correction")
    finally:
        for h in handles:
            h.remove()
    done = 0
    for name, m in linears.items():
        if name in sums and sums[name][1] > 0:
            mean = sums[name][0] / sums[name][1]
            w_q, w = m.dequantized_weight(), m.weight
            shift = torch.empty(w.shape[0], dtype=torch.float64, device=w.device)
            for i in range(0, w.shape[0], 4096):  # float64 a block of rows at a time: a 50k-row lm_head whole took
                rows = slice(i, i + 4096)  # two float64 copies and their difference, 6x its float32 size
                shift[rows] = (w_q[rows].double() - w[rows].double()) @ mean
            m.bias_shift = (-shift).to(m.weight.dtype)
            done += 1
    for name, m in convs.items():
        if name in sums and sums[name][1] > 0:
            shift = -(sums[name][0] / sums[name][1])
            if parametrize.is_parametrized(m, "bias"):  # corrected before (a second call): a new shift, not two
                m.parametrizations.bias[0].shift = shift.float()
            else:
                parametrize.register_parametrization(m, "bias", BiasShift(shift))
            done += 1
    return done


def correct_softmax_bias(qmodel: nn.Module, batches: list[Batch], granularity: str) -> None:
    """Measure E[p - Q(p)] on the quantized model and store it as each layer's ``beta``."""
    outputs = [m for m in qmodel.modules() if isinstance(m, SoftmaxOutputQuantizer)]
    if not outputs:
        raise ValueError("softmax bias correction needs a quantized softmax output (softmax_bits)")
    for q in outputs:
        q.start_bias_measurement(granularity)
    run_batches(qmodel, batches, desc="softmax bias correction")
    for q in outputs:
        q.finish_bias_measurement()


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
