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
# see is clipped in more channels
AUTO_SMOOTHING_TIE = 0.02
# input_smoothing="auto" with another observer: this alpha, in models where some Linear input's widest channel
# exceeds this many times its median channel (max |x| over the calibration set)
AUTO_SMOOTHING_ALPHA = 0.8
AUTO_SMOOTHING_RATIO = 16.0
# QuantConfig.embedding_min_rows' default: tables with fewer rows stay float (BERT's token-type table: 2 rows, row 0
# shared by nearly every token, so its rounding error is one shift of every token rather than noise)
EMBEDDING_MIN_ROWS = 16
# residual_prefix: the special tokens a text encoder's tokenizer puts at the start of every sequence, which its
# weights do not show (vision encoders' learned leading tokens are found by running the model: points.constant_prefix)
PREFIX_TOKENS = {"bert": 1, "roberta": 1, "distilbert": 1}
MAX_PREFIX = 8
KV_CACHES = ("auto", "int8", "float")
KV_SCALES = ("tensor", "head", "channel")


@dataclass(frozen=True)
class QuantConfig:
    """W8A8 post-training quantization settings, validated on construction.

    The defaults target CPU runtimes such as onnxruntime; ``softmax_output="edge"`` gives the integer-only
    runtimes' convention (uniform softmax codes, a quantized residual stream).  Each field, its values and the
    measurement behind its default: docs/guides/quantize.md.

    Attributes:
        weight_bits: bits of Linear and patch-Conv2d weights (symmetric, narrow range).
        weight_per_channel: one weight scale per output channel, else one per tensor.
        act_bits: bits of every quantized activation (Linear inputs, Q, K, V, scores, residual stream).
        act_symmetric: signed symmetric activations instead of asymmetric unsigned ones.
        softmax_bits: bits of the softmax output, or ``None`` for a float softmax (scores and output).
        softmax_output: softmax output codes: ``row`` (``E = round((2**b-1) exp(s - rowmax))``, P.V = E.V / sum E),
            ``row_exact`` (divided by the exact sum of exp), ``row_log`` (4-bit log codes), ``edge`` (uniform, 2**-b).
        softmax_input: grid of the scores: ``auto``, ``float`` (codes rounded once from the float exp), ``row``
            (``s - rowmax`` on a fixed step; what the integer-only ``int`` export needs) or ``tensor`` (calibrated).
        softmax_scale: ``edge`` only: ``fixed`` (2**-softmax_bits) or ``calibrated`` (the largest probability seen).
        observer: activation range rule: ``minmax``, ``percentile`` or ``mse`` (padding rows never count).
        percentile: the ``percentile`` observer's clip.
        bias_correction: softmax bias correction per ``tensor``, ``head`` or ``head_row`` (``edge`` / ``row_exact``).
        weight_bias_correction: take the mean output shift ``(W_q - W) E[x]`` of rounded weights off each bias.
        smoothing_into_v: move the attention output's input smoothing onto V (``auto``: where held-out error allows).
        smoothquant_alpha: SmoothQuant folded into pre-LN norms (LayerNorm, RMSNorm) at this alpha, or ``None``.
        input_smoothing: per-channel smoothing of Linear inputs: an alpha, ``None``, or ``auto`` (chosen on held-out
            calibration batches; the choice is recorded in ``model.config.softq_input_smoothing``).
        quantize_residual: quantize the residual stream at every residual norm's input, RMSNorms included (``auto``:
            only with ``edge`` codes).
        residual_groups: residual-stream scales per group of hidden dimensions (``auto``: 4 where outliers are seen).
        residual_prefix: leading special tokens ([CLS], a vision encoder's learned leading tokens) with residual scales
            of their own.
        embedding_bits: bits of embedding tables (one scale per row), or ``None`` to keep them float.
        embedding_min_rows: tables with fewer rows stay float (BERT's 2-row token-type table is added to every token).
        exclude: substrings of module names whose Linear layers and embeddings stay float.
        kv_cache: what a decoder's KV cache stores: ``int8`` (the K and V codes with their static scales,
            ``softq.quant.kv_cache``: a quarter of the float bytes, the same outputs), ``float``, or ``auto``
            (int8 where the codes fit, ``act_bits <= 8``).  On the reference Llama at context 1024 the int8 cache
            holds 0.250x the FP32 bytes at the float cache's perplexity exactly (docs/results/kv_cache.md).
        kv_scales: the scales of the K and V points (and of the int8 cache): one per ``tensor``, per key/value
            ``head``, or per head and ``channel`` (min-max).  ``tensor`` by measurement: per head or channel moved
            the reference Llama's perplexity by +0.011% (8-bit softmax) and -0.027% (4-bit ``row_log``); all three
            export (per-channel K's scores as a float matmul: docs/results/kv_scales_export.md).
        calibration: ``model`` runs every pass on the whole model; ``blocks`` one transformer block at a time on the
            inputs captured at its entrance (peak memory: the model and one block's working set); ``auto``: blocks
            from 256 MiB of weights or where the whole-model path's copies would not fit in free memory.
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
    kv_cache: Literal["auto", "int8", "float"] = "auto"
    kv_scales: Literal["tensor", "head", "channel"] = "tensor"
    calibration: Literal["auto", "model", "blocks"] = "auto"

    def __post_init__(self) -> None:
        if self.calibration not in ("auto", "model", "blocks"):
            raise ValueError(f"calibration must be 'auto', 'model' or 'blocks', got {self.calibration!r}")
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
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
        if self.kv_scales not in KV_SCALES:
            raise ValueError(f"kv_scales must be one of {KV_SCALES}, got {self.kv_scales!r}")
        if self.kv_cache == "int8" and self.act_bits > 8:
            raise ValueError(f"kv_cache='int8' stores the K and V codes, which are act_bits={self.act_bits} wide; "
                             "use act_bits <= 8 or kv_cache='float'")
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
    def int8_kv_cache(self) -> bool:
        """Whether a decoder's KV cache stores int8 codes (``kv_cache`` resolved)."""
        return self.kv_cache == "int8" or (self.kv_cache == "auto" and self.act_bits <= 8)

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
