"""Whole-model ONNX export of a softq-quantized Hugging Face model.

How (and why this way): tracing Brevitas' fake-quant modules gives an
unreadable graph, so export works on a copy of the model in which every
quantization point is swapped for a tiny module whose ``torch.autograd.Function``
has an ONNX ``symbolic``:

* activation quantizers -> ``QuantizeLinear -> DequantizeLinear`` with the
  calibrated scale and zero point;
* quantized Linear layers -> ``MatMul(x, DequantizeLinear(W_int8^T, scale, axis=1))``
  (+ float bias), per-channel int8 weights stored as int8 initializers (rewritten after the
  trace, see below);
* each attention core (the scores tap, the softmax, the probs quantizer and the
  P.V matmul) -> one marker node ``softq::QAttention(scores, v[, valid])`` whose
  output is P.V.

The TorchScript exporter (``dynamo=False``) traces that copy; afterwards each
marker is replaced, after the softmax input stage (the default float input: ``s - rowmax``,
:func:`softq.export.int_softmax.build_relative_scores`; score codes: ``QuantizeLinear`` of ``s - rowmax``
for the row-relative grid, :func:`softq.export.int_softmax.build_relative_codes`, of ``s`` for a
per-tensor grid), by the form chosen for the layer's softmax-output representation:

* ``row`` / ``row_exact`` (:mod:`softq.export.row_attention`): ``fast`` or
  ``int``, integer codes relative to the row max, ``MatMulInteger`` with the
  uint8 V codes, one division per output element;
* ``edge`` (:mod:`softq.export.int_softmax`): ``qdq``, ``ort`` or ``int``
  softmax, ``DequantizeLinear`` of the probabilities (scale ``2**-8``), then
  ``MatMul`` with the dequantized V;

then :func:`softq.export.fuse.fuse` rewrites the linears into the form onnxruntime fuses with
their bias (``MatMulInteger -> Cast -> Mul -> Add``) and folds
input smoothing's Mul into LayerNorms and the attention core's division, and the attention's
``1/sqrt(d)`` into the query's DequantizeLinear, and dead nodes are removed.  Language models get their 2-D ``attention_mask`` and
Hugging Face's own mask code builds each layer's mask from it in the graph (causal, padding, sliding and local
windows, an additive position bias), with batch and sequence dynamic.

Softmax bias correction ``beta`` (``softq.quant`` adds it to valid entries
after dequantization; exported for ``edge`` only):

* ``int`` form: folded into the rounding point of the integer division
  (:func:`softq.export.int_softmax.rounding_constants`): one extra integer Mul,
  no float op;
* ``qdq``/``ort``: an explicit ``Add(DQ(P), beta * valid)`` after the output
  DequantizeLinear (one Mul and one Add; a DQ zero point must be an integer and
  beta is a fraction of a step, so it cannot be absorbed there).

The parts, one module each: :mod:`softq.export.functions` (the autograd Functions and their symbolics),
:mod:`softq.export.modules` (the export layers), :mod:`softq.export.prepare` (the export copy and each attention
core's parameters), :mod:`softq.export.wrappers` (the traced wrapper and example inputs),
:mod:`softq.export.cores` (the attention cores that replace the markers); this module runs them in order:
checks, copy, trace, cores, graph passes, metadata, final check.
"""

from __future__ import annotations

import copy
import io
import tempfile
import warnings
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from softq.export import fuse, onnx_utils
from softq.export.cores import ALL_FORMS, FORMS_FOR, check_exportable_ops, check_form_for, replace_markers
from softq.export.errors import ExportError
from softq.export.functions import MARKER_DOMAIN, STATE, TORCH_OPSET
from softq.export.prepare import as_float32, export_copy
from softq.export.decoder_export import CachedCheck, cache_kind, trace_inputs
from softq.export.fuse_cache import group_query_heads, read_signed_values, row_sums_from_codes
from softq.export.fuse_layout import drop_requantize
from softq.export.verify import ExportCheck
from softq.export.wrappers import example_feeds, unwrap_sentence_transformer, wrap_for_export
from softq.models import is_causal, max_tokens

WEIGHT_STORAGE = ("uint8", "int8")
# Linear layers in the graph: "integer" (MatMulInteger, Cast, Mul, Add: onnxruntime fuses it bias included,
# tract runs int8 kernels on it), "qdq" (DequantizeLinear -> MatMul: OpenVINO's int8 path) or "dynamic" (the
# integer form on DynamicQuantizeLinear codes: inputs quantized per call); export/fuse.py
LINEAR_FORMS = ("integer", "qdq", "dynamic")


def _trace(wrapper: nn.Module, feeds: dict[str, torch.Tensor], names: list[str], outputs: list[str],
           shapes: list[tuple[int, ...]], dynamic: dict[str, dict[int, str]] | None = None) -> onnx.ModelProto:
    """The traced file; ``shapes``: the outputs' shapes on ``feeds`` (:func:`_run_once`).  Outputs declare a
    dynamic batch, a dynamic sequence where they have one (text outputs of rank 3: per token), the rest as
    computed (a sequence classifier's ``[batch, labels]``); ``dynamic``, where given, names every dynamic axis
    instead (a decoder with a KV cache: :meth:`softq.export.cache_layout.CacheLayout.dynamic_axes`)."""
    if dynamic is None:
        text = names[0] == "input_ids"  # images and audio features: a fixed size, the batch dynamic
        dynamic = {n: {0: "batch", 1: "seq"} if text else {0: "batch"} for n in names}
        for o, shape in zip(outputs, shapes):
            dynamic[o] = {0: "batch", 1: "seq"} if text and len(shape) >= 3 else {0: "batch"}
    args = (wrapper, tuple(feeds[n] for n in names))
    kwargs = dict(dynamo=False, opset_version=TORCH_OPSET, input_names=names, output_names=outputs,
                  dynamic_axes=dynamic, custom_opsets={MARKER_DOMAIN: 1}, do_constant_folding=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            buf = io.BytesIO()
            try:
                torch.onnx.export(*args, buf, **kwargs)
                model = onnx.load_from_string(buf.getvalue())
            except RuntimeError as err:
                if "2GiB limit imposed by the protobuf" not in str(err):
                    raise
                # past its 2 GiB estimate torch writes the weights as external data, which needs a file path; read
                # back, what softq's passes make of them is measured below
                del buf
                with tempfile.TemporaryDirectory(prefix="softq-trace-") as tmp:
                    torch.onnx.export(*args, str(Path(tmp) / "traced.onnx"), **kwargs)
                    model = onnx.load(str(Path(tmp) / "traced.onnx"))
        except torch.onnx.errors.UnsupportedOperatorError as err:
            raise ExportError(f"softq cannot export this model: {err}") from err
    for value, shape in zip(model.graph.output, shapes):
        dims = value.type.tensor_type.shape.dim
        for axis, dim in enumerate(dims):
            if axis not in dynamic[value.name] and len(dims) == len(shape):
                dim.Clear()
                dim.dim_value = shape[axis]
    return model


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------


def build_onnx(qmodel: nn.Module, example_inputs: Any, softmax: str | None = None, probs_outputs: bool = False,
               weight_storage: str = "int8", embeddings: str | None = None, pooling: str | None = None,
               normalize: bool = False, linears: str = "integer", kv_cache: bool | str = False) -> onnx.ModelProto:
    """The checked ONNX model of a softq-quantized model (not written anywhere)."""
    return _build_checked(qmodel, example_inputs, softmax, probs_outputs, weight_storage, embeddings, pooling,
                          normalize, linears, verify=False, kv_cache=kv_cache)[0]


def _build_checked(qmodel: nn.Module, example_inputs: Any, softmax: str | None, probs_outputs: bool,
                   weight_storage: str, embeddings: str | None, pooling: str | None, normalize: bool,
                   linears: str, verify: bool = True, kv_cache: bool | str = False
                   ) -> tuple[onnx.ModelProto, ExportCheck | CachedCheck | None]:
    """:func:`build_onnx`, and with ``verify`` what the written file must reproduce (:class:`ExportCheck`, one
    forward of the quantized model on the example; None without ``verify``)."""
    from softq.quant import is_quantized, offload
    from softq.quant.weight_cache import uncached_weights

    offload.refuse(qmodel, "the ONNX export")
    if softmax is not None and softmax not in ALL_FORMS:
        raise ValueError(f"unknown softmax form {softmax!r}; choose one of {', '.join(ALL_FORMS)}")
    if weight_storage not in WEIGHT_STORAGE:
        raise ExportError(f"weight_storage must be one of {WEIGHT_STORAGE}, got {weight_storage!r}")
    if linears not in LINEAR_FORMS:
        raise ExportError(f"linears must be one of {LINEAR_FORMS}, got {linears!r}")
    if embeddings not in (None, "float", "int8"):
        raise ExportError(f"embeddings must be None (as quantized), 'float' or 'int8', got {embeddings!r}")
    if not is_quantized(qmodel):
        raise ExportError(
            f"{type(qmodel).__name__} was not quantized by softq (no softq_quant_config); run softq.quantize(model, "
            "calib_data) first, or use softq.export.to_onnx_float for a float model"
        )
    # a SentenceTransformer: its Hugging Face model, pooling and normalisation; example texts tokenized as it does
    qmodel, example_inputs, pooling, normalize = unwrap_sentence_transformer(qmodel, example_inputs, pooling, normalize)
    if weight_storage == "uint8" and linears == "integer" and qmodel.softq_quant_config.act_symmetric:
        # onnxruntime fuses that into an s8 x u8 MatMulIntegerToFloat, for which it has no kernel: the file would
        # not load at its default optimisation level
        raise ExportError("weight_storage='uint8' pairs with unsigned activation codes; this model's are signed "
                          "(QuantConfig(act_symmetric=True)), and onnxruntime has no int8 x uint8 integer MatMul: "
                          "export it with weight_storage='int8' (or linears='qdq'; CLI: --weight-storage int8)")
    off = _quantization_off(qmodel)
    if off:
        raise ExportError(f"quantization is switched off at {len(off)} point(s) of this model (first: {off[0]}; "
                          "softq.quant.sensitivity.enable_only or set_mode): the file would quantize them anyway and "
                          "compute something else than the model; switch them back on "
                          "(softq.quant.quantize.set_mode(model, 'quant') and weight_quant.disable_quant = False)")
    if linears == "dynamic" and qmodel.softq_quant_config.act_bits != 8:
        # the static grid's Clip between QuantizeLinear and DequantizeLinear kept the fusion from finding the
        # input quantization: the file came out in the integer form, silently
        raise ExportError(f"linears='dynamic' quantizes Linear inputs to 8 bits per call (DynamicQuantizeLinear); "
                          f"this model's activations have {qmodel.softq_quant_config.act_bits} bits: export it with "
                          "linears='integer' or 'qdq'")
    # the check's forwards of qmodel keep no dequantized weights on it: each cached layer is a float copy more
    # for the rest of the export, the embedding table and LM head's the largest
    try:
        with uncached_weights():
            return _build(qmodel, example_inputs, softmax, probs_outputs, weight_storage, embeddings, pooling,
                          normalize, linears, verify, kv_cache)
    finally:
        STATE.clear()


def _quantization_off(qmodel: nn.Module) -> list[str]:
    """Names of the points whose quantization is off: activation or softmax quantizers not in ``quant`` mode,
    quantized Linears or tables with weight quantization disabled, disabled weight-only parametrizations."""
    from softq.quant.layers import QEmbedding, QLinear, WeightOnly
    from softq.quant.quantizers import ActQuantizer, SoftmaxOutputQuantizer

    return [name for name, m in qmodel.named_modules()
            if isinstance(m, (ActQuantizer, SoftmaxOutputQuantizer)) and m.mode != "quant"
            or isinstance(m, (QLinear, QEmbedding)) and m.weight_quant.disable_quant
            or isinstance(m, WeightOnly) and not m.enabled]


def _build(qmodel: nn.Module, example_inputs: Any, softmax: str | None, probs_outputs: bool, weight_storage: str,
           embeddings: str | None, pooling: str | None, normalize: bool, linears: str, verify: bool,
           kv_cache: bool | str = False) -> tuple[onnx.ModelProto, ExportCheck | CachedCheck | None]:
    """:func:`build_onnx` after its argument checks, with the quantized torch model's outputs on the example."""
    model, layers = export_copy(qmodel, weight_storage, embeddings)
    representations = list(dict.fromkeys(info["representation"] for info in layers.values()))
    softmax = softmax or FORMS_FOR[representations[0]][0]
    for representation in representations:
        check_form_for(representation, softmax)
    if softmax != "fast" and any(info.get("rq") is not None and info["rq"].float_scores for info in layers.values()):
        raise ExportError(f"softmax form {softmax!r} takes integer score codes; this model keeps its softmax input float "
                          "(softmax_input='float', what the default 'auto' means for row codes): export it with "
                          "softmax='fast', or quantize with softmax_input='row' (CLI: --softmax-input row)")
    dynamic = None
    if kv_cache:
        if pooling is not None:
            raise ExportError("kv_cache exports a language model's logits; pooling takes a headless encoder")
        wrapper, names, outputs, feeds, dynamic = trace_inputs(qmodel, model, example_inputs, cache_kind(kv_cache))
    else:
        wrapper, names, outputs = wrap_for_export(model, pooling, normalize)
        feeds = example_feeds(qmodel, example_inputs, names)
    if softmax == "ort" and is_causal(qmodel):
        raise ExportError(
            "softmax='ort' cannot export a causal model: QLinearSoftmax has no mask input, so every row's future "
            "keys would keep a weight and every position's output would be wrong; use softmax='qdq' or 'int'")
    if softmax == "ort" and "attention_mask" in names:
        warnings.warn(
            "softmax='ort' on a model with attention masks: QLinearSoftmax has no mask input, so in a padded row "
            "the padding keys enter as the lowest score code and keep a weight exp((qmin - row max) * scale) "
            "each, as much as a real key's where the calibrated score range is narrow: outputs of padded inputs "
            "are wrong by that much (unpadded inputs are exact; softq's runner refuses padded batches for this "
            "file); 'int' and 'qdq' mask exactly", UserWarning, stacklevel=2,
        )
    shapes = _run_once(wrapper, feeds, "the quantized model")
    # QLinearSoftmax has no mask input: the 'ort' file is exact on unpadded examples only (warned above)
    if kv_cache:
        check = CachedCheck.of(qmodel, example_inputs, wrapper.layout) if verify else None
    else:
        check = ExportCheck.of(qmodel, feeds, pooling, normalize, unpadded_only=softmax == "ort") if verify else None
    onnx_model = _trace(wrapper, feeds, names, outputs, shapes, dynamic)
    onnx_utils.unshare_int_initializers(onnx_model)
    onnx_model = replace_markers(onnx_model, layers, softmax, probs_outputs)
    onnx_model, _ = onnx_utils.dedupe(onnx_utils.prune(onnx_model))
    fuse.fuse(onnx_model, linears=linears != "qdq", dynamic=linears == "dynamic")  # fewer nodes around the integer linears (export/fuse.py)
    if kv_cache and linears != "qdq":  # attention reads the cache's codes per K/V head (export/fuse_cache.py)
        drop_requantize(onnx_model, flip_sign=True)
        group_query_heads(onnx_model)
        onnx_model = onnx_utils.prune(onnx_model)  # the matmuls it replaced: the next passes count readers
        read_signed_values(onnx_model)
        row_sums_from_codes(onnx_model)
    onnx_model = onnx_utils.prune(onnx_model)
    check_exportable_ops(onnx_model, softmax)
    onnx_model.producer_name = "softq"
    _mark_max_length(onnx_model, qmodel, names)
    _mark_right_padding(onnx_model, qmodel, names)
    if any(info.get("int64_core") for info in layers.values()):
        from softq.export.runtimes import INT64_CORE_KEY

        entry = onnx_model.metadata_props.add()
        entry.key, entry.value = INT64_CORE_KEY, "true"
    onnx_utils.check(onnx_model)
    return onnx_model, check


def build_onnx_float(model: nn.Module, example_inputs: Any, pooling: str | None = None,
                     normalize: bool = False, kv_cache: bool | str = False) -> onnx.ModelProto:
    """The float ONNX model (softq attention, no quantization) with the same inputs and outputs (``kv_cache``:
    a decoder's file with past and present keys and values, as :func:`to_onnx`)."""
    from softq.attention import configure_attention
    from softq.quant import is_quantized

    if is_quantized(model):
        raise ExportError("build_onnx_float takes the float model; this one is quantized (use to_onnx)")
    model, example_inputs, pooling, normalize = unwrap_sentence_transformer(model, example_inputs, pooling, normalize)
    model = as_float32(copy.deepcopy(model).eval())
    configure_attention(model)
    dynamic = None
    if kv_cache:
        cache_kind(kv_cache)
        wrapper, names, outputs, feeds, dynamic = trace_inputs(model, model, example_inputs)
    else:
        wrapper, names, outputs = wrap_for_export(model, pooling, normalize)
        feeds = example_feeds(model, example_inputs, names)
    shapes = _run_once(wrapper, feeds, "the float model")
    onnx_model = onnx_utils.drop_identity_casts(onnx_utils.prune(_trace(wrapper, feeds, names, outputs, shapes,
                                                                        dynamic)))
    _mark_max_length(onnx_model, model, names)
    _mark_right_padding(onnx_model, model, names)
    onnx_utils.check(onnx_model)
    return onnx_model


def _mark_right_padding(onnx_model: onnx.ModelProto, model: nn.Module, names: list[str]) -> None:
    """Record in the file's metadata that its first positions must hold real tokens, where the model says so
    ([CLS] residual scales of their own, a constant attention sink): the torch model refuses left-padded batches,
    a graph cannot, and would apply them to pad tokens; :func:`softq.export.runtimes.runner` refuses them."""
    from softq.attention import right_padding_rows
    from softq.export.runtimes import RIGHT_PADDING_KEY, RIGHT_PADDING_WHY_KEY

    rows, why = right_padding_rows(model)
    if rows and "attention_mask" in names:
        for key, value in ((RIGHT_PADDING_KEY, str(rows)), (RIGHT_PADDING_WHY_KEY, why)):
            entry = onnx_model.metadata_props.add()
            entry.key, entry.value = key, value


def _mark_max_length(onnx_model: onnx.ModelProto, model: nn.Module, names: list[str]) -> None:
    """Record a text model's longest sequence (its position table) in the file's metadata, which
    :func:`softq.export.runtimes.runner` checks: past it onnxruntime raises, OpenVINO reads out of bounds."""
    from softq.export.runtimes import MAX_LENGTH_KEY

    limit = max_tokens(getattr(model, "config", None))  # (None where the config sets no limit: no entry)
    if names[0] == "input_ids" and limit is not None:
        entry = onnx_model.metadata_props.add()
        entry.key, entry.value = MAX_LENGTH_KEY, str(limit)


def _run_once(wrapper: nn.Module, feeds: dict[str, torch.Tensor], what: str) -> list[tuple[int, ...]]:
    """The shapes of the wrapper's outputs on ``feeds``; an example that does not fit, one ExportError."""
    try:
        with torch.no_grad():
            out = wrapper(*feeds.values())
        return [tuple(t.shape) for t in (out if isinstance(out, tuple) else (out,))]
    except ExportError:
        raise
    except (RuntimeError, IndexError, ValueError) as err:
        shapes = {k: tuple(v.shape) for k, v in feeds.items()}
        raise ExportError(f"example inputs {shapes} do not fit {what}: {err}") from err


def to_onnx(qmodel: nn.Module, path: str, example_inputs: Any, softmax: str | None = None, overwrite: bool = False,
            probs_outputs: bool = False, weight_storage: str = "int8", embeddings: str | None = None,
            pooling: str | None = None, normalize: bool = False, linears: str = "integer",
            names: str = "short", verify: bool = True, kv_cache: bool | str = False) -> str:
    """Export a softq-quantized model to ONNX with an integer softmax; returns the path written.

    The file checks itself before it replaces anything at ``path``: onnxruntime runs it on ``example_inputs`` and
    each output must be within ``EXPORT_TOLERANCE`` (relative L2 error over the valid tokens) of the quantized
    torch model's, else :class:`ExportError` names the output and nothing is written (``verify=False`` skips it).

    ``softmax``: the form of the attention core, by the model's
    ``softmax_output``.  ``row``/``row_exact`` (default): ``"fast"`` (default;
    float Exp, its codes by QuantizeLinear, integer GEMM with the row sum from the same GEMM) or
    ``"int"`` (exp table indexed by score codes, integer up to the int32 accumulators; for a model
    quantized with ``softmax_input="row"``: the default float softmax input has no codes).  ``edge``:
    ``"qdq"`` (portable default), ``"ort"`` (com.microsoft.QLinearSoftmax) or
    ``"int"`` (standard ops, integer arithmetic only).  A model quantized with a float
    softmax (``QuantConfig(softmax_bits=None)``): ``"float"``, the only form for it, with
    the same integer Linear layers and Q/K/V codes and a float core (``Softmax`` over the
    valid keys, masked keys exactly 0, float ``MatMul`` with the dequantized V): no integer
    softmax, for runtimes with a fast float Softmax.  Batch and sequence
    length are dynamic; inputs are int64 ids and float32 images, and a float16 / bfloat16
    model exports as its float32 equal (the same weights and scales, computed in float32).  The file is written atomically and only after
    ``onnx.checker.check_model(full_check=True)`` passed; an existing file is
    replaced only with ``overwrite=True``.  ``probs_outputs`` adds every layer's
    dequantized softmax output as an extra graph output (for parity checks).

    Weights are symmetric per-output-channel 8-bit codes (-127..127), stored as
    int8 (``weight_storage="int8"``, the default): onnxruntime runs the linear
    layers on its u8s8 kernels (MatMulIntegerToFloat), exact on CPUs with VNNI or
    AMX and on ARM.  On x86 CPUs without VNNI (AVX2 only) that kernel adds pairs of
    u8*s8 products in int16 and can saturate; onnxruntime fixes it at load time,
    only on such CPUs, with the session option ``session.x64quantprecision=1``
    (softq's own sessions set it; set it in yours:
    ``opts.add_session_config_entry("session.x64quantprecision", "1")``).
    ``"uint8"`` stores the same codes shifted by 128 (zero point 128): exact
    everywhere without that option, but the u8u8 kernel measured 2x slower on a
    VNNI CPU (docs/results/export_speed.md); it needs unsigned activation codes (the
    default; ``act_symmetric=True`` models are refused with ``linears="integer"``).
    ``linears``: the form of the Linear layers.  ``"integer"`` (default):
    ``MatMulInteger -> Cast -> Mul -> Add(bias)``, which onnxruntime fuses into one
    ``MatMulIntegerToFloat`` with the bias and tract runs on its int8 kernels;
    ``"qdq"``: ``DequantizeLinear -> MatMul``, the pattern OpenVINO's int8 path
    recognises (all-MiniLM-L6-v2 at batch 1, one thread, docs/results/export_speed.md:
    OpenVINO 0.51x FP32 with ``"qdq"``, 1.30x with ``"integer"``; onnxruntime 0.46x /
    0.45x; tract 1.37x / 0.94x).  Same codes and function either way (float rounding aside), with one
    exception in onnxruntime: where a Linear's input is 2-D (OPT's fc1 and fc2), its ``MatMulAddFusion``
    makes the ``"qdq"`` form a quantized Gemm whose bias it rounds to int32 at the accumulator's scale (a
    rounding the integer form does not have: its bias stays float32); the ``"integer"`` form matches torch there.
    ``"dynamic"``: the integer form with each Linear input quantized per call on its own
    range (``DynamicQuantizeLinear``, what ``quantize_dynamic`` does; onnxruntime fuses it
    into ``DynamicQuantizeMatMul``) instead of the calibrated grid; Q, K, V and the
    softmax keep theirs.  An onnxruntime-only speed option whose outputs are not the torch
    model's: docs/results/export_speed.md measures its speed and accuracy.
    ``embeddings``: ``None`` (default) stores the tables as the model has them:
    int8 codes with one scale per row for ``QuantConfig.embedding_bits`` (the
    default), float otherwise; ``"int8"`` also makes int8 tables of float ones
    (those of at least ``QuantConfig.embedding_min_rows`` rows, as quantization does)
    (the torch model then differs slightly); ``"float"`` stores quantized tables
    dequantized (same outputs, larger file).

    A quantized ``sentence_transformers.SentenceTransformer`` exports as its Hugging Face model with its own
    pooling and normalisation; its example inputs may be texts.
    Models with a head output ``logits``.  Headless encoders (``BertModel``...)
    output ``last_hidden_state``; with ``pooling`` ("mean", "cls", "max") they also
    output ``sentence_embedding`` (L2-normalised with ``normalize``), what a
    sentence-transformers folder computes (``softq.hf.load_model_dir`` reads both).

    ``kv_cache``: a causal language model's file for generation (:mod:`softq.export.decoder_export`): inputs
    ``input_ids``, ``attention_mask`` (past and new tokens), ``position_ids`` and ``past_key_values.{i}.key`` /
    ``.value`` per layer, outputs ``logits`` and ``present.{i}.key`` / ``.value``; one file for the prefill (a past
    of 0 tokens) and the decode steps, the same integer softmax cores; the check runs a prefill of
    ``example_inputs`` (at least 2 tokens) and one decode step.  :func:`softq.export.generate.generate` runs it.
    The cache is the model's own: int8 codes where its ``QuantConfig.kv_cache`` resolves to int8 (each step
    quantizes only the new tokens, the cores read the codes; the check wants the torch cache's codes, equal or one
    apart); ``kv_cache="float"`` keeps it float (onnxruntime-genai takes float caches only).

    ``names``: ``"short"`` (default) gives every internal tensor a short name and
    drops node names (:func:`softq.export.onnx_utils.compact_names`; inputs and
    outputs keep theirs): the exporter's long names take several percent of an
    INT8 file (one copy per producer and per reader).  ``"full"`` keeps them (for reading the graph
    or a profile).
    """
    if names not in ("short", "full"):
        raise ValueError(f"names must be 'short' or 'full', got {names!r}")
    onnx_utils.check_writable(path, overwrite)  # fail before the (slow) export
    model, check = _build_checked(qmodel, example_inputs, softmax, probs_outputs, weight_storage, embeddings, pooling,
                                  normalize, linears, verify, kv_cache)
    if names == "short":
        model, _ = onnx_utils.compact_names(model)
    return str(onnx_utils.save_atomic(model, path, overwrite, verify=check.verify if check else None))


def to_onnx_float(model: nn.Module, path: str, example_inputs: Any, overwrite: bool = False,
                  pooling: str | None = None, normalize: bool = False, kv_cache: bool | str = False) -> str:
    """Export the float model with the same interface (the FP32 baseline of the benchmarks)."""
    onnx_utils.check_writable(path, overwrite)
    return str(onnx_utils.save_atomic(build_onnx_float(model, example_inputs, pooling, normalize, kv_cache), path,
                                      overwrite))
