"""The export copy: a float32 copy of the quantized model with every quantization point swapped for its export
layer (:mod:`softq.export.modules`), and the parameters of each attention core read from its quantizers.

The copy leaves the caller's model untouched; the per-layer parameters (score and V grids, softmax-output
representation, bias correction) are what :func:`softq.export.cores.replace_markers` builds each core from,
and they are checked here, before the trace, so that a model the forms cannot export fails in one line.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
from torch import nn

from softq.export.errors import ExportError
from softq.export.int_softmax import OUT_SCALE, SoftmaxQuant
from softq.export.modules import (AttentionMarker, ExportAct, ExportEmbedding, ExportKV, ExportLinear,
                                  ExportWeightOnly, FloatEmbedding, ScoresTap, ValidTap)
from softq.export.row_attention import RowQuant
from softq.models import max_tokens
from softq.quant.config import FLOAT_INPUT_OUTPUTS

EXPORTABLE_SOFTMAX = ("softmax",)


def _is_act_quantizer(m: nn.Module) -> bool:
    from softq.quant.quantizers import ActQuantizer

    return isinstance(m, ActQuantizer)


def _is_row_scores(m: nn.Module) -> bool:
    from softq.quant.quantizers import RowScoresQuantizer

    return isinstance(m, RowScoresQuantizer)


def _replace_children(model: nn.Module, match, make) -> None:  # noqa: ANN001
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if match(child):
                setattr(parent, name, make(child))


def _extend_rows(beta: np.ndarray | None, beta_head: np.ndarray | None, rows: int) -> np.ndarray | None:
    """Per-row beta padded to ``rows`` query rows with the per-head beta (torch's fallback)."""
    if beta is None or beta.shape[2] == 1 or beta_head is None or beta.shape[2] >= rows:
        return beta
    pad = np.broadcast_to(beta_head, (1, beta.shape[1], rows - beta.shape[2], 1))
    return np.concatenate([beta, pad], axis=2)


def _softmax_params(name: str, points: nn.Module, key: int) -> dict[str, Any]:
    from softq.quant.quantizers import SoftmaxOutputQuantizer

    if points.softmax_name not in EXPORTABLE_SOFTMAX:
        raise ExportError(
            f"softq cannot export softmax variant '{points.softmax_name}' (attention layer '{name}'); "
            f"the integer softmax forms implement: {', '.join(EXPORTABLE_SOFTMAX)}"
        )
    scores, probs = points.scores, points.probs
    if not _is_act_quantizer(scores) and not isinstance(probs, SoftmaxOutputQuantizer):
        if not all(_is_act_quantizer(m) for m in (points.q, points.k, points.v)):
            raise ExportError(f"attention layer '{name}' has float Q, K or V; the float-softmax core needs them "
                              "quantized (softq.quantize does)")
        return {"name": name, "representation": "float"}  # quantized with softmax_bits=None
    if (not _is_act_quantizer(scores) and isinstance(probs, SoftmaxOutputQuantizer)
            and probs.representation in FLOAT_INPUT_OUTPUTS):  # softmax_input="float": row codes from float scores
        return {"name": name, "q": None, "representation": probs.representation,
                "rq": _row_quant(name, points, None)}
    if not _is_act_quantizer(scores) or not isinstance(probs, SoftmaxOutputQuantizer):
        raise ExportError(
            f"attention layer '{name}' has a float softmax {'input' if not _is_act_quantizer(scores) else 'output'} "
            "and a quantized softmax "
            f"{'output' if not _is_act_quantizer(scores) else 'input'}; the ONNX export takes both quantized "
            "(softmax_bits=8) or both float (softmax_bits=None)"
        )
    if int(scores.bits) > 8:
        raise ExportError(f"attention layer '{name}': {scores.bits}-bit softmax inputs are not exportable (max 8)")
    q = SoftmaxQuant(scale=float(scores.scale), zero_point=int(round(float(scores.zero_point))),
                     bits=int(scores.bits), signed=bool(scores.signed), out_signed=False,
                     relative=_is_row_scores(scores))
    if probs.representation != "edge":
        return {"name": name, "q": q, "representation": probs.representation, "rq": _row_quant(name, points, q)}
    if abs(float(probs.scale) - float(OUT_SCALE)) > 0 or int(probs.bits) != 8 or float(probs.zero_point) != 0:
        raise ExportError(
            f"attention layer '{name}': softmax output quantizer has scale {float(probs.scale):.6g}, "
            f"{int(probs.bits)} bits; the export emits the edge convention 2**-8, 8 bits, zero point 0 "
            "(quantize with softmax_bits=8, softmax_scale='fixed')"
        )
    beta = None if probs.beta.numel() == 0 else probs.beta.detach().cpu().numpy().astype(np.float64)
    beta_head = None if probs.beta_head.numel() == 0 else probs.beta_head.detach().cpu().numpy().astype(np.float64)
    return {"name": name, "q": q, "representation": "edge", "beta": beta, "beta_head": beta_head,
            "causal_rows": bool(probs.causal_rows)}


def _row_quant(name: str, points: nn.Module, q: SoftmaxQuant | None) -> RowQuant:
    """The grids of a row-code attention core (``q`` None: float scores); V codes stored as uint8 (signed ones
    shifted by 128)."""
    probs, v = points.probs, points.v
    if probs.beta.numel():
        raise ExportError(f"attention layer '{name}': softmax bias correction is exported for "
                          f"softmax_output='edge' only, this layer uses '{probs.representation}'")
    if not _is_act_quantizer(v) or int(v.bits) > 8:
        raise ExportError(f"attention layer '{name}': the row-code attention needs V quantized to at most 8 bits")
    shift = 128 if v.signed else 0
    lo, hi = ((-(2 ** (v.bits - 1)) + 1, 2 ** (v.bits - 1) - 1) if v.signed else (0, 2**v.bits - 1))
    scale, zero_point = (float(v.scale), int(round(float(v.zero_point)))) if v.scale.numel() == 1 else (1.0, None)
    if zero_point is None:  # per head or channel: the core reads the stored int8 codes (ExportKV), 128 higher
        zero_point, shift = 0, 128
        lo, hi = (-127, 127) if v.signed else (-128, 127)
    try:
        return RowQuant(q, scale, zero_point + shift, int(probs.bits), probs.representation, lo + shift, hi + shift)
    except ValueError as err:
        raise ExportError(f"attention layer '{name}': {err}") from err


def _per_head_points(points: nn.Module, info: dict[str, Any]) -> ExportKV | None:
    """K and V points with per-head or per-channel scales swapped for :class:`ExportKV`: their codes go through the
    GEMMs with the scales outside (K; V of a row core), or their values through a float matmul (V of a float or
    edge softmax).  Returns the V point whose codes the row core reads, whose zero points and scales go in
    ``info["v_affine"]``."""
    for part in ("k", "v"):
        point = getattr(points, part)
        if getattr(point, "granularity", "tensor") != "tensor":
            dequantize = part == "v" and info["representation"] in ("float", "edge")
            setattr(points, part, ExportKV(point, points.num_heads, dequantize))
    v = points.v
    if not isinstance(v, ExportKV) or v.dequantize:
        return None
    info["v_affine"] = (v.z.numpy()[None], v.s.numpy()[None])  # [1, heads, 1, 1 | head_dim]
    return v


def _max_positions(model: nn.Module) -> int:
    """The longest sequence the model takes (:func:`softq.models.max_tokens`), 4096 where its config sets none."""
    return max_tokens(getattr(model, "config", None)) or 4096


def as_float32(model: nn.Module) -> nn.Module:
    """A float16 / bfloat16 model (a copy) as float32, exactly (its weights and scales are float32 values): the file
    computes in float32, as runtimes run such graphs, so its outputs are the float32 model's (the half model's
    within its own rounding)."""
    from softq.softmax import HALF_DTYPES

    if any(t.dtype in HALF_DTYPES for t in (*model.parameters(), *model.buffers())):
        model.float()
    return model


def export_copy(qmodel: nn.Module, weight_storage: str = "int8",
                embeddings: str | None = None) -> tuple[nn.Module, dict[int, dict[str, Any]]]:
    """The export copy of ``qmodel`` and, by marker key, the parameters of each attention core."""
    from softq.attention import attention_points
    from softq.quant.layers import QEmbedding, QLinear
    from softq.softmax import HALF_DTYPES

    # the copy shares the quantized weights, which it only reads (into int8 codes) before replacing their layers: a
    # copy of each was a float copy of the model more; not in a float16 / bfloat16 model, whose copy is made float32
    shared = {} if any(t.dtype in HALF_DTYPES for t in (*qmodel.parameters(), *qmodel.buffers())) else {
        id(m.weight): m.weight for m in qmodel.modules() if isinstance(m, (QLinear, QEmbedding))}
    model = as_float32(copy.deepcopy(qmodel, shared).eval())
    layers: dict[int, dict[str, Any]] = {}
    for key, (name, points) in enumerate(attention_points(model)):
        layers[key] = info = _softmax_params(name, points, key)
        values = _per_head_points(points, info)
        if info["representation"] == "edge":
            # rows past the calibrated ones take the per-head beta (SoftmaxOutputQuantizer.beta_for)
            info["beta_rows"] = 0 if info["beta"] is None else info["beta"].shape[2]
            info["beta"] = _extend_rows(info["beta"], info["beta_head"], _max_positions(model))
        elif info["representation"] != "float":
            try:
                info["rq"].check_keys(_max_positions(model))
            except ValueError as err:
                raise ExportError(f"attention layer '{name}': {err}; the model takes "
                                  f"{_max_positions(model)} positions") from err
        points.prefix_rows = 0  # the left-padding check is torch's; ONNX graphs cannot refuse an input
        tap = ScoresTap()
        points.scores = tap
        points.probs = ValidTap(tap)
        points.pv = AttentionMarker(tap, key, values)
    counter = iter(range(10**9))
    _replace_children(model, lambda m: isinstance(m, QLinear), lambda m: ExportLinear(m, weight_storage))
    _replace_children(model, _is_act_quantizer, lambda m: ExportAct(m, next(counter)))
    from softq.quant.layers import WeightOnly

    if embeddings == "float":
        _replace_children(model, lambda m: isinstance(m, QEmbedding), FloatEmbedding)
    else:
        _replace_children(model, lambda m: isinstance(m, QEmbedding), ExportEmbedding)
    for module in list(model.modules()):  # Conv2d weights, a vision encoder's position table
        for plist in getattr(module, "parametrizations", {}).values():
            if len(plist) == 1 and isinstance(plist[0], WeightOnly):
                plist[0] = ExportWeightOnly(plist[0], plist.original, next(counter))
    if embeddings == "int8":
        # exact nn.Embedding only: subclasses (OPT's learned positions) have their own forward
        min_rows = qmodel.softq_quant_config.embedding_min_rows
        _replace_children(model, lambda m: type(m) is nn.Embedding and m.num_embeddings >= min_rows,
                          ExportEmbedding)
    return model, layers
