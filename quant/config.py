"""``QuantConfig``: everything ``softq.quantize`` can be asked to do, validated up front."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

DEFAULT_PERCENTILE = 99.99  # QuantConfig.percentile: the percentile observer's clip
BIAS_CORRECTION_GRANULARITIES = ("tensor", "head", "head_row")
SOFTMAX_OUTPUTS = ("row", "row_exact", "row_log", "edge")
# Representations whose P.V is divided by the sum of the codes (rows sum to exactly 1; the rest: the exact sum of exp;
# in torch only for softmax variants whose rows sum to 1, SoftmaxOutputQuantizer.sums_to_one)
SUM_OF_CODES = ("row", "row_log")
SOFTMAX_INPUTS = ("auto", "row", "tensor", "float")
# softmax_input="float" keeps the scores float: the row codes are rounded from the float exp (CPU runtimes)
FLOAT_INPUT_OUTPUTS = ("row", "row_exact")
# Grid of the exact sums of exp that integer softmax forms accumulate (row_exact's sum table, the edge int form)
SUM_GRID = 2**16
# A row-relative softmax input stops at the distance T below the row max where the output code is
# round(K exp(-T)) = round(ROW_INPUT_TAIL) = 0, with K the output grid: its last code means "exp is 0"
ROW_INPUT_TAIL = 0.45
# softmax_output="row_log": the score distance to the row max on steps of ln(2)/2 (float32), so the code
# of a key k steps below the max is round(LOG_GAIN 2**(-k/2)): 15 powers of sqrt(2) and 0 (k >= 15)
LOG_BITS = 4
LOG_STEP = 0.3465735912322998  # float32(ln(2) / 2), exactly representable: every form uses this value
# The largest multiple of 1/16 below 2**7.5 / 2 (so that k = 15 rounds to 0) whose 16 products keep at
# least 0.02 from a rounding tie (float32 exp in torch and onnxruntime rounds them as the exact value)
LOG_GAIN = 86.875


def row_code_gain(softmax_output: str, softmax_bits: int) -> float:
    """G in the row codes ``E = round(G exp(s - rowmax))``: ``2**b - 1`` (``row``, ``row_exact``), ``LOG_GAIN``
    (``row_log``, whose scores sit on the ``LOG_STEP`` grid); the row max always gets the top code ``round(G)``."""
    if softmax_output == "row_log":
        if softmax_bits != LOG_BITS:
            raise ValueError(f"row_log codes are {LOG_BITS}-bit, got {softmax_bits} bits")
        return LOG_GAIN
    if softmax_output not in ("row", "row_exact"):
        raise ValueError(f"row codes are 'row', 'row_exact' or 'row_log', got {softmax_output!r}")
    return float(2**softmax_bits - 1)


def softmax_input_span(softmax_output: str, softmax_bits: int, act_bits: int = 8) -> float:
    """T of ``softmax_input="row"``: scores further than T below their row max get output code 0.

    ``"row"`` outputs ``round((2**b - 1) exp(-d))``, so ``T = ln((2**b - 1) / 0.45)`` (6.34 at 8 bits,
    3.51 at 4); ``"row_exact"`` and ``"edge"`` also sum exp on the integer forms' 2**-16 grid, so
    ``T = ln(2**16 / 0.45)`` (11.89), where that sum's entry is 0 too.  ``"row_log"`` fixes the step
    instead, ``LOG_STEP``: ``T = (2**act_bits - 1) LOG_STEP`` (88.4 at 8 bits; every code from 15 steps
    down gives 0).
    """
    if softmax_output not in SOFTMAX_OUTPUTS:
        raise ValueError(f"softmax output representation must be one of {SOFTMAX_OUTPUTS}, got {softmax_output!r}")
    if softmax_output == "row_log":
        return (2**act_bits - 1) * LOG_STEP
    grid = 2**softmax_bits - 1 if softmax_output == "row" else SUM_GRID
    return math.log(grid / ROW_INPUT_TAIL)
MIN_BITS, MAX_BITS = 2, 16
# input_smoothing="auto" (min-max observer): no smoothing or one of these alphas, whichever gives outputs (a language
# model's per-token logits, else the last hidden state's tokens) closest to the float model's on calibration
# batches held out from range observation
AUTO_SMOOTHING_ALPHAS = (0.6, 0.8, 1.0)
# ... and a candidate smoothing every input must cut that distance by at least this fraction below no smoothing's
# (and be closer than smoothing only the inputs that are LayerNorm outputs, in pre-LN models; those scales fold into
# the LayerNorm, free at run time, so they need no margin): at an input that follows no LayerNorm (a GELU output, the
# attention output) smoothing is one more Mul at run time
AUTO_SMOOTHING_MIN_GAIN = 0.2
# ... and among candidates whose held-out distances lie within this fraction of the best one's, the smallest alpha is
# kept: a larger alpha gives every input channel more of the quantizer's range, so an input the calibration did not
# see is clipped in more channels (the reference ViT of docs/results/export_speed.md: alpha 1.0 and 0.8 nearly tied on
# the held-out tokens, logit distance to FP32 on the evaluation images 8.5e-5 against 5.9e-5)
AUTO_SMOOTHING_TIE = 0.02
# input_smoothing="auto" with another observer: this alpha, in models where some Linear input's widest channel
# exceeds this many times its median channel (max |x| over the calibration set)
AUTO_SMOOTHING_ALPHA = 0.8
AUTO_SMOOTHING_RATIO = 16.0
# QuantConfig.embedding_min_rows' default: tables with fewer rows stay float (BERT's token-type table: 2 rows, row 0
# shared by nearly every token, so its rounding error is one shift of every token rather than noise)
EMBEDDING_MIN_ROWS = 16
# residual_prefix: special tokens at the start of every sequence, per encoder family
PREFIX_TOKENS = {"bert": 1, "roberta": 1, "distilbert": 1, "vit": 1, "deit": 2}
MAX_PREFIX = 8


@dataclass(frozen=True)
class QuantConfig:
    """W8A8 post-training quantization settings.

    The defaults target CPU runtimes such as onnxruntime; ``softmax_output="edge"`` gives the
    integer-only runtimes' convention (uniform softmax codes, a quantized residual stream).

    Attributes:
        weight_bits: bits of Linear weights (symmetric, narrow range), and of ``Conv2d``
            weights (a ViT's patch projection: weight-only, per output channel, float input).
        weight_per_channel: one scale per output channel (else one per tensor).
        act_bits: bits of every quantized activation (Linear inputs, Q, K, V,
            softmax input, residual stream).
        act_symmetric: signed symmetric activations instead of asymmetric unsigned.
        softmax_bits: bits of the softmax output (unsigned), or ``None`` to keep
            the softmax input and output in float ("W8A8 with float softmax").
        softmax_output: representation of the quantized softmax output.
            ``"row"`` (default): codes relative to the row max,
            ``E = round((2**b - 1) exp(s - rowmax))``, and P.V = (E.V) / sum(E);
            ``"row_exact"``: the same codes divided by ``(2**b - 1)`` times the
            exact sum of exp; ``"row_log"`` (4-bit softmax only): log codes, the
            scores' distance to the row max on steps of ln(2)/2 (k steps:
            ``E = round(86.875 * 2**(-k/2))``, 0 from k = 15: 16 levels that reach
            ``2**-7`` of the max where ``row``'s 4-bit codes stop at 1/30), normalised
            like ``row``: measured (docs/results/quant_lm_steps2400.md) the 2400-step
            LM +2.08% -> +1.16% perplexity at 4 bits, all-MiniLM-L6-v2 embedding cosine
            0.9852 -> 0.9969 (minilm.md); ``"edge"``: uniform codes at
            scale ``softmax_scale`` (the TFLite/QNN convention).  ``row`` and
            ``row_log`` divide by the codes' sum only for softmax variants whose rows
            sum to 1; a clipped softmax, softpick, ``relu_len`` or ``sigmoid_len`` row
            keeps its own mass (its codes on the row-relative grid, as ``row_exact``).
        softmax_input: grid of the softmax input (the attention scores), used when
            ``softmax_bits`` is set.  ``"auto"`` (default): ``"float"`` for ``row`` and
            ``row_exact`` outputs, ``"row"`` for ``row_log`` (its log grid), ``"tensor"`` for ``edge`` (the
            TFLite/QNN convention its runtimes' softmax kernels take); before 2026-12-04 ``"row"`` for
            ``row`` and ``row_exact`` too (saved models record which).  ``"row"``: codes of ``s - rowmax``
            (over the keys the row may attend) on ``[-T, 0]`` with the fixed step
            ``T / (2**act_bits - 1)``, no calibration; ``T`` is where the output code
            becomes 0 (:func:`softmax_input_span`: 6.34 for 8-bit ``row`` outputs;
            ``row_log`` fixes the step at ln(2)/2 instead), so
            the clamp loses nothing the output keeps and the step does not grow with
            the score range.  ``"tensor"``: one calibrated grid per tensor (the
            observer's), the common PTQ convention; the 2400-step reference LM's
            layer-1 scores span [-80, 53], a step of 0.52 (docs/results/softmax_input.md).
            ``"float"`` (``row`` and ``row_exact`` outputs): no input grid, the codes
            ``E = round((2**b - 1) exp(s - rowmax))`` come from the float scores, as a
            runtime with a float ``Exp`` computes them anyway (onnxruntime, OpenVINO, tract:
            the ``fast`` form): one rounding instead of two, and a ``QuantizeLinear`` /
            ``DequantizeLinear`` pair fewer per layer.  Only the ``fast`` form exports it
            (the ``int`` form indexes its tables by integer score codes: quantize with ``"row"``
            for it).  Measured: docs/results/export_speed.md (the ``fast, score codes`` rows are
            ``"row"``) and quant.md.
        softmax_scale: ``"edge"`` output only. ``"fixed"`` uses ``2**-softmax_bits``
            (the TFLite/QNN edge convention, what the ONNX export emits);
            ``"calibrated"`` fits the scale to the largest probability seen.
        observer: range rule for activations: ``minmax``, ``percentile`` or ``mse``.
        percentile: the percentile of the ``percentile`` observer.
        bias_correction: softmax bias correction granularity (``tensor``,
            ``head``, ``head_row``) or ``None`` for no correction (``edge`` and
            ``row_exact`` outputs; a ``row`` output's rows sum to 1, so its
            correction is zero).  ``head_row`` is per query position: a causal
            model's row at position i (its valid keys minus one, so padding on
            either side and a KV cache do not move it) keeps its calibrated beta
            at any length (positions past them take the per-head one), a
            bidirectional model's rows hold theirs in sentences of the
            calibrated length, alone or padded in a batch (by position among
            the valid tokens), every other row takes the per-head beta (always
            when the calibration batches had several lengths).
        smoothquant_alpha: SmoothQuant migration strength in [0, 1] applied to
            Linear layers fed by a LayerNorm, or ``None`` to skip.
        input_smoothing: SmoothQuant's per-channel migration for any Linear input,
            post-LN models included: the weight columns are multiplied by
            ``s = max|X|^alpha / max|W|^(1-alpha)`` and the input by ``1/s`` (an
            explicit per-channel Mul before the input quantizer, shared by Linear
            layers reading the same tensor; in ONNX one Mul, folded into a LayerNorm or
            the attention core where one precedes it).  An alpha in [0, 1] applies it at
            every Linear input; ``None`` never.  ``"auto"`` (default) measures: ranges are
            observed on 3 of every 4 calibration batches (a single batch is cut into up to
            4 along its examples), then no smoothing and alphas 0.6, 0.8 and 1.0 are each
            judged on the held-out 4th batches (mean cosine distance to the float model's
            outputs: a language model's per-token logits, else the tokens of the last hidden
            state, also for classifiers, whose one logit row per example is too few rows to
            judge by).  In a pre-LN model (ViT, GPT-2) the alphas are also judged applied
            only to the inputs that are LayerNorm outputs (Q/K/V, the first FFN Linear, a
            language model's head), whose scales fold into the LayerNorm and cost nothing
            at run time: the best of
            those is kept if closer than no smoothing.  Smoothing every input costs a Mul
            at run time at each input that follows no LayerNorm (a GELU output, the
            attention output), so it is kept only if at least 20% closer than no smoothing
            and closer than those.  "Best" among candidates within 2% of each other is the
            smallest alpha (``AUTO_SMOOTHING_TIE``): a larger alpha spreads every channel over
            more of the quantizer's range, so inputs the calibration did not see clip in more
            channels; on the ViT of export_speed.md alpha 1.0 was a near tie with 0.8 on its
            held-out tokens and gave logits further from FP32's on the evaluation images (8.5e-5
            against 5.9e-5 for 0.8, two runs of the benchmark).  The choice is calibrated on
            every batch.  One observation pass
            serves all candidates (min-max ranges of a smoothed input follow from its
            per-channel ones).  A head whose weights the token table shares in the float
            model (GPT-2's lm_head) is smoothed too: the quantized model's Linear has weights
            of its own (the reference LM at 256 characters: logit distance to FP32 9.3e-6 ->
            6.3e-6, quantize_dynamic's 8.0e-6; export_speed.md).
            Holding batches out matters: judged on the batches that set the ranges, alpha 1.0
            looks best on the 2400-step reference LM and on tiny random models, where it clips
            new inputs (tests/test_calib.py).  Chosen (quant_lm_steps2400.md, quant.md, export_speed.md): the
            2400-step reference LM 0.6 at the LayerNorm-folded inputs (held-out logit
            distance 2.5e-4 against 3.1e-4 for none; its 12 evaluation windows read
            perplexity +0.63% against +0.55%, within their resolution), the 800-step one
            0.8 at the LayerNorm-folded inputs (no Mul at run time), the reference ViT
            rebuilt on the 2-core machine 0.8 at every input (held-out error 3.5e-5 against
            4.7e-5 folded only and 5.2e-5 for none; its logits 4.5e-5 from FP32's,
            quantize_dynamic's 4.7e-5; export_speed.md), the LM at 256
            characters 0.8 at every input (logit distance 5.9e-6, quantize_dynamic 8.0e-6); all-MiniLM-L6-v2 0.8, as the outlier gate did (minilm.md:
            held-out error 0.0029 against 0.0109 for none; embedding cosine 0.9979, 0.9935
            without smoothing, 0.9879 at 0.5).  The search costs calibration time: on MiniLM
            6.17x one FP32 pass over the calibration set (5.97x in the run before), 1.43x with
            the gate alone; 8.49x since the weight bias correction's pass (minilm.md).
            With another observer there is no shared pass, and "auto" applies alpha 0.8
            where some Linear input's widest channel exceeds 16x its median one, else
            nothing.  With a single calibration example there is nothing to hold out:
            "auto" does not smooth (scales fitted on one input's tokens need not carry to
            others; the report says so).
            ``quantize`` records the choice (``softq_input_smoothing``,
            ``softq_smoothing_folded_only``, and the candidates' errors in
            ``softq_smoothing_errors`` and ``softq_folded_smoothing_errors``);
            ``softq quantize`` prints it.  Candidates are judged before the weight bias
            correction (below), which the kept model gets afterwards.
        weight_bias_correction: take the mean output shift of the rounded weights,
            ``(W_q - W) E[x]``, off each layer's bias (default ``True``): ``E[x]`` is the mean
            input each quantized Linear sees after its input quantizer (valid tokens only)
            and each weight-only Conv2d sees, from one pass over the calibration batches after
            range calibration (``softq.quant.quantize.correct_weight_bias``; Nagel et al.
            2019's bias correction with the calibration data's mean).  It is the bias: no
            run-time cost; a Linear without a bias (GPT-2's lm_head) gets one.  Measured on
            export_speed.md's models (docs/results/weight_bias_correction.md, torch
            fake-quant, cosine distance of the outputs to FP32's): BERT-base shape 1.5e-4 ->
            8.6e-6, all-MiniLM-L6-v2 2.11e-3 -> 1.71e-3 (embedding cosine 0.9979 -> 0.9983),
            the reference LM 6.3e-6 -> 6.0e-6, the reference ViT 5.9e-5 -> 4.7e-5 (top-1 =
            FP32's); with a float softmax 0.06x to 0.93x as well.
        smoothing_into_v: where input smoothing scales the attention output (the output
            projection's input, at every input), apply that per-channel ``1/s`` to V instead:
            the rows and bias of the Linear that produces V (found by matching values on one
            calibration batch: v_proj, BERT's value, GPT-2's V third of c_attn), whose per-channel
            weight codes do not change, and V's range is observed again on the calibration
            batches.  The same function in float; in the ONNX row core the division's
            per-(head, channel) constant becomes a scalar that folds away, one full-size Mul
            fewer per layer.  V's per-tensor grid then covers the scaled channels, which can
            cost accuracy, so ``"auto"`` (default) folds on a copy and keeps it only where the
            outputs on the held-out calibration batches (those ``input_smoothing="auto"``
            judges on; after the weight bias correction of both copies) are no further from
            the float model's than without it; ``quantize`` records the two errors
            (``softq_v_fold_errors``; ``smoothing_report``).  Where input smoothing scaled an
            attention output it costs a copy of the model, a pass to observe V again and a
            second weight bias correction, whichever way it decides (all-MiniLM-L6-v2's
            calibration 11.4x one FP32 pass against 6.7x, minilm.md).  Measured (docs/results/v_fold_probe.md, one thread, batch 1 /
            32, folded against unfolded): the reference ViT 0.573x / 0.533x FP32 against
            0.580x / 0.548x and closer to FP32 (4.39e-5 against 4.49e-5), the reference LM
            0.490x / 0.495x against 0.515x / 0.511x at the same distance (5.91e-6 against
            5.88e-6): "auto" folds both; all-MiniLM-L6-v2 8% further from FP32 folded (1.86e-3
            against 1.72e-3, cosine 0.9981 against 0.9983): "auto" does not fold it.
        quantize_residual: also quantize LayerNorm inputs (the residual stream).
            ``"auto"`` (default): only with the ``edge`` softmax output (the integer-only
            runtimes' convention, where every tensor between ops is 8-bit); with ``row`` and
            ``row_exact`` the residual stream and LayerNorm stay float, as in onnxruntime's
            quantizers and SmoothQuant's W8A8, and every Linear input, Q, K, V and the
            softmax stay 8-bit.  Measured (docs/results/quant_lm_steps2400.md, quant.md,
            minilm.md): the 2400-step reference LM +0.84% -> +0.63% perplexity (+0.66% -> +0.22% on the
            model trained before it),
            all-MiniLM-L6-v2 cosine 0.9973 -> 0.9979, the 800-step LM and the ViT unchanged
            within their noise; the exported ViT runs fewer nodes (export_speed.md).
            ``True`` / ``False`` force it.
        residual_groups: scales of each residual-stream point over the hidden
            dimension: ``1`` per tensor; ``K`` per-embedding-group quantization with
            K groups chosen by channel range (outlier dimensions get their own
            scale; exported as Div/Add/QuantizeLinear/DequantizeLinear/Sub/Mul with
            per-channel vectors); ``"auto"`` (default) uses 4 groups at points whose
            widest channel range (prefix rows included) exceeds 16x the median one
            (all-MiniLM-L6-v2: about 100x) and per-tensor elsewhere (softq's reference
            LM and ViT: about 2x; `softq report` prints it).  See docs/results/minilm.md.
        residual_prefix: leading sequence positions whose residual-stream rows get
            scales of their own (special tokens whose values live on another scale
            than the text or patch tokens': a DeiT's CLS and distillation tokens
            start at exactly 0 and its logits read only those rows).  ``"auto"``
            (default): the family's special prefix tokens (BERT/RoBERTa [CLS] 1,
            ViT CLS 1, DeiT CLS + distillation 2); ``0`` for none.  Causal models
            (GPT-2, OPT, BERT / RoBERTa with ``is_decoder``) take 0 only: with a KV
            cache a decoding step's one row is not position 0.  The special tokens
            must be the first rows: right padding,
            as BERT/RoBERTa tokenizers pad (left-padded batches would give a pad
            token [CLS]'s scales).  Exported as slices with Q/DQ pairs of their own.
            Measured: DeiT / ViT from a config, relative logit error 0.35 -> 0.039
            and 0.12 -> 0.040 (docs/results/deit_residual.md); all-MiniLM-L6-v2,
            cosine 0.9964 -> 0.9973 (minilm.md).
        embedding_bits: bits of the embedding tables (``nn.Embedding``: token,
            position and token-type tables, and a ViT's / DeiT's learned position
            table, one scale per position), symmetric with one scale per row,
            weight only; ``None`` keeps them float.  8 (default) makes the ONNX
            file about a quarter of FP32 (MiniLM's token table is half its
            weights) at no measurable cost (docs/results/export_speed.md).
            Tables of fewer than ``embedding_min_rows`` rows stay float.
        embedding_min_rows: the smallest embedding table ``embedding_bits`` quantizes
            (default 16; 1 quantizes every table).  BERT's token-type table has 2,
            and its row 0 is added to nearly every token, so its rounding error is the
            same shift on every token instead of noise that averages out; it weighs nothing (1.5k values).  Measured on a BERT-base
            shape (random weights, pooled embeddings): quantizing that table alone costs
            a cosine distance of 4.0e-5, the 30522-row token table 2.8e-7, and the
            whole default model 5.2e-5 with it, 8.6e-6 without it (onnxruntime
            quantize_dynamic: 1.87e-4); all-MiniLM-L6-v2 1.87e-3 -> 1.71e-3
            (docs/results/embedding_tables.md).
        exclude: substrings of module names whose Linear layers and embeddings stay float
            (e.g. ``("lm_head",)``).
    """

    weight_bits: int = 8
    weight_per_channel: bool = True
    act_bits: int = 8
    act_symmetric: bool = False
    softmax_bits: int | None = 8
    softmax_output: Literal["row", "row_exact", "row_log", "edge"] = "row"
    softmax_input: Literal["auto", "row", "tensor", "float"] = "auto"
    softmax_scale: Literal["fixed", "calibrated"] = "fixed"
    observer: Literal["minmax", "percentile", "mse"] = "minmax"
    percentile: float = DEFAULT_PERCENTILE
    bias_correction: Literal["tensor", "head", "head_row"] | None = None
    weight_bias_correction: bool = True
    smoothing_into_v: bool | Literal["auto"] = "auto"
    smoothquant_alpha: float | None = None
    input_smoothing: float | Literal["auto"] | None = "auto"
    quantize_residual: bool | Literal["auto"] = "auto"
    residual_groups: int | Literal["auto"] = "auto"
    residual_prefix: int | Literal["auto"] = "auto"
    embedding_bits: int | None = 8
    embedding_min_rows: int = EMBEDDING_MIN_ROWS
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("weight_bits", "act_bits", "softmax_bits"):
            value = getattr(self, name)
            if name == "softmax_bits" and value is None:
                continue
            if not isinstance(value, int) or not MIN_BITS <= value <= MAX_BITS:
                raise ValueError(f"{name} must be an integer from {MIN_BITS} to {MAX_BITS}, got {value!r}")
        for name in ("weight_per_channel", "act_symmetric"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.percentile, bool) or not isinstance(self.percentile, (int, float)) \
                or not 50.0 < self.percentile <= 100.0:
            raise ValueError(f"percentile must be a number in (50, 100], got {self.percentile!r}")
        if isinstance(self.exclude, (str, bytes)) or not isinstance(self.exclude, (tuple, list)) \
                or not all(isinstance(e, str) and e for e in self.exclude):
            raise ValueError(f"exclude must be a tuple of module-name substrings, e.g. ('classifier',), got {self.exclude!r}")
        object.__setattr__(self, "exclude", tuple(self.exclude))
        if self.softmax_scale not in ("fixed", "calibrated"):
            raise ValueError(f"softmax_scale must be 'fixed' or 'calibrated', got {self.softmax_scale!r}")
        if self.softmax_output not in SOFTMAX_OUTPUTS:
            raise ValueError(f"softmax_output must be one of {SOFTMAX_OUTPUTS}, got {self.softmax_output!r}")
        if self.softmax_input not in SOFTMAX_INPUTS:
            raise ValueError(f"softmax_input must be one of {SOFTMAX_INPUTS}, got {self.softmax_input!r}")
        if self.softmax_output == "row_log" and self.softmax_bits != LOG_BITS:
            raise ValueError(f"softmax_output='row_log' is defined for {LOG_BITS}-bit softmax outputs (15 powers of "
                             f"sqrt(2) and 0), got softmax_bits={self.softmax_bits!r}; use 'row' at other widths")
        if self.softmax_output == "row_log" and self.softmax_input in ("tensor", "float"):
            raise ValueError("softmax_output='row_log' needs the row-relative softmax input (its step is the log "
                             "grid); use softmax_input='auto' or 'row'")
        if self.softmax_input == "float" and self.softmax_output not in FLOAT_INPUT_OUTPUTS:
            raise ValueError(f"softmax_input='float' takes softmax_output 'row' or 'row_exact' (codes rounded from the "
                             f"float exp), got {self.softmax_output!r}, whose forms take integer score codes")
        if self.softmax_output == "row_log" and self.act_bits < LOG_BITS:
            raise ValueError(f"softmax_output='row_log' needs act_bits >= {LOG_BITS} (the score codes must reach "
                             f"{2**LOG_BITS - 1} steps below the row max), got {self.act_bits}")
        if self.softmax_scale != "fixed" and self.softmax_output != "edge":
            raise ValueError(f"softmax_scale={self.softmax_scale!r} applies to softmax_output='edge' only; "
                             f"'{self.softmax_output}' codes are scaled by each row's max")
        if self.observer not in ("minmax", "percentile", "mse"):
            raise ValueError(f"observer must be 'minmax', 'percentile' or 'mse', got {self.observer!r}")
        if self.percentile != DEFAULT_PERCENTILE and self.observer != "percentile":
            raise ValueError(f"percentile={self.percentile!r} sets the percentile observer's clip; observer="
                             f"{self.observer!r} does not read it: add observer='percentile' or drop percentile")
        if self.bias_correction is not None and self.bias_correction not in BIAS_CORRECTION_GRANULARITIES:
            raise ValueError(
                f"bias_correction must be one of {BIAS_CORRECTION_GRANULARITIES} or None, got {self.bias_correction!r}"
            )
        if not isinstance(self.weight_bias_correction, bool):
            raise ValueError(f"weight_bias_correction must be True or False, got {self.weight_bias_correction!r}")
        if not isinstance(self.smoothing_into_v, bool) and self.smoothing_into_v != "auto":
            raise ValueError(f"smoothing_into_v must be True, False or 'auto', got {self.smoothing_into_v!r}")
        if self.embedding_bits is not None and (not isinstance(self.embedding_bits, int)
                                                or isinstance(self.embedding_bits, bool)
                                                or not MIN_BITS <= self.embedding_bits <= 8):
            raise ValueError(f"embedding_bits must be an integer from {MIN_BITS} to 8 or None, got {self.embedding_bits!r}")
        if not isinstance(self.embedding_min_rows, int) or isinstance(self.embedding_min_rows, bool) \
                or self.embedding_min_rows < 1:
            raise ValueError(f"embedding_min_rows must be a positive integer, got {self.embedding_min_rows!r}")
        if self.bias_correction is not None and self.softmax_bits is None:
            raise ValueError("bias_correction corrects the quantized softmax output; it needs softmax_bits")
        if self.softmax_bits is None and (self.softmax_input in ("row", "tensor") or self.softmax_scale != "fixed"):
            what = (f"softmax_input={self.softmax_input!r}" if self.softmax_input in ("row", "tensor")
                    else f"softmax_scale={self.softmax_scale!r}")
            raise ValueError(f"{what} sets the grid of a quantized softmax; softmax_bits=None keeps the softmax "
                             "(its scores and output) float, so it would do nothing: drop it or set softmax_bits")
        if self.smoothing_into_v is True and (self.input_smoothing is None or not self.weight_per_channel):
            why = ("input_smoothing=None leaves nothing to fold" if self.input_smoothing is None else
                   "the fold needs per-channel weight codes (weight_per_channel=True)")
            raise ValueError(f"smoothing_into_v=True moves the attention output's input smoothing into V; {why}")
        if self.quantize_residual != "auto" and not isinstance(self.quantize_residual, bool):
            raise ValueError(f"quantize_residual must be True, False or 'auto', got {self.quantize_residual!r}")
        if self.residual_groups != "auto" and (not isinstance(self.residual_groups, int)
                                               or isinstance(self.residual_groups, bool) or self.residual_groups < 1):
            raise ValueError(f"residual_groups must be a positive integer or 'auto', got {self.residual_groups!r}")
        if self.residual_prefix != "auto" and (not isinstance(self.residual_prefix, int)
                                               or isinstance(self.residual_prefix, bool)
                                               or not 0 <= self.residual_prefix <= MAX_PREFIX):
            raise ValueError(f"residual_prefix must be an integer from 0 to {MAX_PREFIX} or 'auto', "
                             f"got {self.residual_prefix!r}")
        if not self.residual_quantized and (self.residual_groups != "auto" or self.residual_prefix != "auto"):
            raise ValueError("residual_groups and residual_prefix lay out a quantized residual stream, which this "
                             f"config leaves float (quantize_residual={self.quantize_residual!r} with softmax_output="
                             f"{self.softmax_output!r}); set quantize_residual=True (CLI: --residual) to quantize it")
        if self.bias_correction is not None and self.softmax_output in SUM_OF_CODES:
            raise ValueError(f"bias_correction is zero by construction for softmax_output='{self.softmax_output}' (its rows sum to "
                             "exactly 1, so the mean rounding error over a row is 0); use it with 'edge' or 'row_exact'")
        if self.input_smoothing not in (None, "auto") and (
                isinstance(self.input_smoothing, bool) or not isinstance(self.input_smoothing, (int, float))
                or not 0.0 <= self.input_smoothing <= 1.0):
            raise ValueError(f"input_smoothing must be an alpha in [0, 1], 'auto' or None, got {self.input_smoothing!r}")
        if self.smoothquant_alpha is not None and (
                isinstance(self.smoothquant_alpha, bool) or not isinstance(self.smoothquant_alpha, (int, float))
                or not 0.0 <= self.smoothquant_alpha <= 1.0):
            raise ValueError(f"smoothquant_alpha must be in [0, 1] or None, got {self.smoothquant_alpha!r}")

    @property
    def resolved_softmax_input(self) -> str:
        """``softmax_input`` with ``"auto"`` resolved: ``"float"`` for ``row`` and ``row_exact`` outputs, ``"row"``
        for ``row_log``, ``"tensor"`` for ``edge``."""
        if self.softmax_input != "auto":
            return self.softmax_input
        if self.softmax_output in FLOAT_INPUT_OUTPUTS:
            return "float"
        return "row" if self.softmax_output == "row_log" else "tensor"

    @property
    def row_relative_input(self) -> bool:
        """Whether the softmax input is quantized relative to the row max (``softmax_input`` resolved)."""
        return self.resolved_softmax_input == "row"

    @property
    def float_scores(self) -> bool:
        """Whether the softmax input stays float (``softmax_input`` resolved to ``"float"``, with a quantized
        softmax output)."""
        return self.resolved_softmax_input == "float" and self.softmax_bits is not None

    @property
    def residual_quantized(self) -> bool:
        """Whether LayerNorm inputs (the residual stream) are quantized (``quantize_residual`` resolved)."""
        if self.quantize_residual == "auto":
            return self.softmax_output == "edge"
        return bool(self.quantize_residual)

    def describe(self) -> str:
        """Short human-readable summary of the non-default settings."""
        default = QuantConfig()
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)]
        return f"W{self.weight_bits}A{self.act_bits}" + (f" ({', '.join(changed)})" if changed else "")
