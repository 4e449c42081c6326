"""Quantizer arithmetic built on Brevitas: activation points, softmax input and output points, weight codes.

Activations use Brevitas' ``IntQuant`` core (round, clamp, dequantize with a
straight-through gradient) driven by scales and zero points that softq's observers
(``softq.calib``) fit on calibration data, so the calibration rule is softq's
choice, the arithmetic is Brevitas'.  Weights are symmetric narrow-range codes
(:func:`weight_codes`), the formula of Brevitas' per-channel int8 weight quantizer
that the quantized layers (``layers.py``) use.

Every activation point has three modes:
``float`` (pass-through), ``observe`` (pass-through, feeding its observer) and
``quant`` (fake-quantize).
"""

from __future__ import annotations

from typing import Literal

import torch
from brevitas.core.function_wrapper import RoundSte, TensorClamp
from brevitas.core.function_wrapper.misc import Identity
from brevitas.core.quant.int_base import IntQuant
from torch import nn

from softq.attention import ProbsQuantizer
from softq.calib.observers import (ChannelRange, NonFiniteActivation, Observer, make_observer, scale_and_zero_point,
                                   token_mask, token_rows)
from softq.quant.config import SOFTMAX_OUTPUTS, SUM_OF_CODES, row_code_gain
from softq.softmax import HALF_DTYPES, TINY

Mode = Literal["float", "observe", "quant"]


# float16 / bfloat16 activations are fake-quantized in float32 and cast back: the codes are then those of the
# same values in float32 (what an exported float32 graph computes), and a row of zeros stays zeros (the TINY
# clamps round to 0 in float16: 0 / 0)
def _float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 if it is float16 / bfloat16 (exactly), else as it is."""
    return x.float() if x.dtype in HALF_DTYPES else x


def _brevitas_int_quant(signed: bool) -> IntQuant:
    # Signed points are symmetric and narrow (-127..127), unsigned ones 0..255.
    return IntQuant(
        narrow_range=signed, signed=signed, input_view_impl=Identity(),
        float_to_int_impl=RoundSte(), tensor_clamp_impl=TensorClamp(),
    )


# Groups used by residual_groups="auto" at the points where outliers are seen (other points stay per
# tensor: one QuantizeLinear instead of the six-op grouped form).  On all-MiniLM-L6-v2, auto with 8 groups
# measured the same as with 4 in an earlier run of examples/bench_minilm.py (embedding cosine within
# 0.0001); grouping every residual point (an explicit residual_groups=K) gains a little more (minilm.md).
AUTO_GROUPS = 4
OUTLIER_RATIO = 16.0  # "outliers": widest channel range > this many times the median channel range


class ActQuantizer(nn.Module):
    """Activation quantizer with an observer-fitted scale and zero point.

    ``groups=1`` (the default) is per-tensor.  ``groups=K > 1`` is per-embedding-group
    quantization (PEG, Bondarenko et al. 2021) over the last (hidden) dimension:
    channels are sorted by their calibrated range and cut into K groups that
    minimise the relative rounding noise (:func:`softq.calib.observers.range_groups`),
    so the few outlier dimensions get scales of their own and the rest keep a fine
    one.  Scale and zero point then are vectors over the hidden dimension, which
    ONNX expresses as a per-axis ``QuantizeLinear``.  Group ranges are the min/max
    of their channels.  ``groups="auto"`` uses :data:`AUTO_GROUPS` groups when the
    widest channel range exceeds :data:`OUTLIER_RATIO` times the median one (a
    all-MiniLM-L6-v2: about 100x), else per-tensor with the configured observer.

    ``prefix=k > 0`` gives each of the first k sequence positions (dimension -2:
    special tokens such as [CLS] or a DeiT's distillation token) a quantizer of its
    own, with the same groups; this one then observes and quantizes the other rows.
    Inputs of fewer than 3 dimensions are not sequences and use this one alone.
    ``row_offset``: the position of the input's first row (a decoder's cached step starts past the prefix; set
    per call by :func:`softq.quant.points.cache_offset_hook`).
    """

    def __init__(self, bits: int, signed: bool, observer: str = "minmax", percentile: float = 99.99,
                 groups: int | str = 1, prefix: int = 0):
        super().__init__()
        if groups != "auto" and (not isinstance(groups, int) or isinstance(groups, bool) or groups < 1):
            raise ValueError(f"activation groups must be a positive integer or 'auto', got {groups!r}")
        self.bits = bits
        self.signed = signed
        self.groups = groups
        self.mode: Mode = "float"
        self.observer: Observer | None = make_observer(observer, percentile) if groups in (1, "auto") else None
        self.channels: ChannelRange | None = ChannelRange() if groups != 1 else None
        self.quant = _brevitas_int_quant(signed)
        self.register_buffer("scale", torch.tensor(1.0))
        self.register_buffer("zero_point", torch.tensor(0.0))
        self.register_buffer("bit_width", torch.tensor(float(bits)))
        self.prefix = nn.ModuleList(ActQuantizer(bits, signed, observer, percentile, groups) for _ in range(prefix))
        self.row_offset = 0

    @property
    def mode(self) -> Mode:
        return self._mode

    @mode.setter
    def mode(self, value: Mode) -> None:  # the prefix rows follow
        self._mode = value
        for row in getattr(self, "prefix", ()):
            row.mode = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # observing a calibration batch: padding rows are not observed (calib.observers.valid_tokens)
        valid = token_mask(x) if self.mode == "observe" else None
        if len(self.prefix) > self.row_offset and x.dim() >= 3 and self.mode != "float":
            p = len(self.prefix) - self.row_offset  # the input's rows that are prefix positions
            rows = [q._forward(x[..., i:i + 1, :], None if valid is None else valid[:, i:i + 1])
                    for i, q in enumerate(self.prefix[self.row_offset:])]  # empty past a short input's end
            rest = self._forward(x[..., p:, :], None if valid is None else valid[:, p:])
            return x if self.mode == "observe" else torch.cat([*rows, rest], dim=-2)
        return self._forward(x, valid)

    def _forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        if self.mode == "quant":
            if x.dtype in HALF_DTYPES:
                return self._forward(x.float()).to(x.dtype)
            if torch.is_grad_enabled():
                return self.quant(self.scale, self.zero_point, self.bit_width, x)
            return self.fake_quant_inference(x)
        if self.mode == "observe":
            seen = token_rows(x, valid)
            try:
                if self.observer is not None:
                    self.observer.update(seen)
                if self.channels is not None:
                    self.channels.update(seen)
            except NonFiniteActivation as err:
                err.source = err.source or self
                raise
        return x

    def fake_quant_inference(self, x: torch.Tensor) -> torch.Tensor:
        """ONNX ``QuantizeLinear`` -> ``DequantizeLinear`` arithmetic, op for op: divide, round half to even,
        add the zero point, clamp, subtract, multiply (in place, one ``clamp``), for evaluation without
        gradients.  Brevitas' ``IntQuant`` (``self.quant``, which trains) adds the zero point before rounding:
        the same integer in exact arithmetic, but in float32 ``x / s + z`` can round onto a half that
        ``x / s`` was not on (x / s = -61.500004, z = 127: 65.5, rounded to 66 where onnxruntime gives 65),
        a code the exported file does not compute; one such code in an OPT's first layer moved every later
        token's logits.  Grouped scales export as Div -> Add -> QuantizeLinear(1, 0), Brevitas' order, which
        they keep here (tests: test_inference_fast_path_is_the_exported_quantizer)."""
        qmin, qmax = self.quant.min_int(self.bit_width), self.quant.max_int(self.bit_width)
        if not torch.compiler.is_compiling():  # eager: Python numbers clamp faster; compiled: no .item() break
            qmin, qmax = float(qmin), float(qmax)
        y = self._codes_(x / self.scale)
        y.clamp_(qmin, qmax).sub_(self.zero_point)
        return y.mul_(self.scale)

    def _codes_(self, y: torch.Tensor) -> torch.Tensor:
        """``y = x / scale`` rounded to codes (zero point added, not clamped), in place, in the exported file's
        order: QuantizeLinear's round-then-add, or for grouped scales (exported as Div -> Add(zp) ->
        QuantizeLinear(1, 0)) add-then-round."""
        if self.scale.numel() > 1:
            return y.add_(self.zero_point).round_()
        return y.round_().add_(self.zero_point)

    def restart_observation(self, observer: str, percentile: float) -> None:
        """Observe afresh with the range rule ``observer`` (after a pass changed what reaches this point)."""
        self.observer = make_observer(observer, percentile)
        self.mode = "observe"

    def finish_calibration(self, groups: int | None = None) -> None:
        """Fix scale and zero point from what the observers saw, then drop them.

        ``groups="auto"`` decides on the whole point, prefix rows included (their
        outliers are the point's outliers: all-MiniLM-L6-v2's dimension 99 sits on
        [CLS] in layers 0-3), and the prefix rows use the same number of groups.
        """
        if self.observer is None and self.channels is None:
            return
        if groups is None:
            groups = self.groups
        if groups == "auto":
            seen = [self.channels] + [row.channels for row in self.prefix
                                      if row.channels is not None and row.channels.batches]
            groups = AUTO_GROUPS if ChannelRange.merged(seen).outlier_ratio(self.signed) > OUTLIER_RATIO else 1
        if groups == 1:
            r = self.observer.range(self.bits, self.signed)
            scale, zero_point = scale_and_zero_point(r, self.bits, self.signed)
            self.scale.fill_(scale)
            self.zero_point.fill_(zero_point)
        else:
            scale, zero_point = self.channels.group_params(groups, self.bits, self.signed)
            self.scale = scale.to(self.scale.dtype)
            self.zero_point = zero_point.to(self.zero_point.dtype)
        self.observer = self.channels = None
        for row in self.prefix:  # a prefix row never seen (inputs without a sequence axis) takes these scales
            seen = row.observer if row.observer is not None else row.channels
            if seen is not None and seen.batches == 0:
                row.scale, row.zero_point = self.scale.clone(), self.zero_point.clone()
                row.observer = row.channels = None
            else:
                row.finish_calibration(groups)

    def int_repr(self, x: torch.Tensor) -> torch.Tensor:
        """Integer codes of ``x`` (what an integer runtime stores), for export and tests: the codes evaluation
        computes (:meth:`fake_quant_inference`'s rounding order), zero point included."""
        qmin, qmax = float(self.quant.min_int(self.bit_width)), float(self.quant.max_int(self.bit_width))
        return self._codes_(_float32(x) / self.scale).clamp_(qmin, qmax)

    def extra_repr(self) -> str:
        if self.scale.numel() > 1:
            return (f"bits={self.bits}, signed={self.signed}, mode={self.mode}, groups={self.groups}, "
                    f"scales={self.scale.unique().numel()} in [{self.scale.min().item():.4g}, {self.scale.max().item():.4g}]")
        return f"bits={self.bits}, signed={self.signed}, mode={self.mode}, scale={self.scale.item():.4g}, zp={self.zero_point.item():g}"


class RowScoresQuantizer(ActQuantizer):
    """Softmax input codes relative to the row max (``QuantConfig.softmax_input="row"``).

    ``x = clamp(round((s - m) / S) + q, 0, q)`` with ``m`` the row max over valid
    keys, ``q = 2**bits - 1`` (the zero point: the row max is always the top code)
    and the fixed step ``S = T / q``; the point outputs ``m + S (x - q)``, except
    for code 0, which means "T or more below the max: weight 0" and is output as the
    lowest float (the integer forms' tables give it 0).  Rounded on ``s - m`` as the
    exported ``QuantizeLinear`` rounds (Brevitas' ``IntQuant``, with gradients, adds
    ``q`` before rounding: a code apart at float ties).  No calibration: the grid follows each
    row, and ``T`` (:func:`softq.quant.config.softmax_input_span`) is where the
    softmax output code reaches 0, so dropping those keys changes no output code of
    ``row``, and the others' exp sums only below their 2**-16 grid.  A fully masked
    row gives the softmax nothing to attend (zeros).
    """

    takes_valid = True

    def __init__(self, bits: int, span: float) -> None:
        super().__init__(bits, signed=False)
        self.observer = None
        self.span = float(span)
        top = 2**bits - 1
        self.scale.fill_(self.span / top)
        self.zero_point.fill_(float(top))

    def row_max(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        if valid is None:
            return x.amax(dim=-1, keepdim=True)
        m = x.masked_fill(valid == 0, float("-inf")).amax(dim=-1, keepdim=True)
        return torch.where(torch.isfinite(m), m, torch.zeros_like(m))

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        if self.mode != "quant":
            return x
        dtype = x.dtype
        x = _float32(x)
        m = self.row_max(x, valid)
        r = self._forward(x - m)  # Brevitas' IntQuant (with gradients) or QuantizeLinear's arithmetic
        # code 0 (T or more below the max) means exp = 0, as in the integer forms' tables
        dropped = r <= -self.span * (1 - 1e-6)
        return (r + m).to(dtype).masked_fill_(dropped, torch.finfo(dtype).min)

    def int_repr(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """The codes ``x`` above (masked keys: whatever their score gives; exports make them 0)."""
        x = _float32(x)
        return super().int_repr(x - self.row_max(x, valid))

    def extra_repr(self) -> str:
        return f"bits={self.bits}, relative to the row max, span={self.span:.4g}, step={self.scale.item():.4g}, mode={self.mode}"


class SoftmaxOutputQuantizer(ProbsQuantizer):
    """Unsigned quantizer of softmax probabilities with optional bias correction.

    Representations (``QuantConfig.softmax_output``):

    * ``"row"`` (default): codes relative to the row max,
      ``E = round((2**b - 1) exp(s - rowmax))`` over valid keys, output
      ``E / sum(E)`` (so P.V = (E.V) / sum(E), one division per output element
      after an integer GEMM).  ``exp(s - rowmax) = p / max_row(p)``, so the codes
      come from the probabilities alone: Brevitas' ``IntQuant`` with the per-row
      scale ``max_row(p) / (2**b - 1)``.
    * ``"row_exact"``: the same codes, output ``E max_row(p) / (2**b - 1)``, i.e.
      ``E / ((2**b - 1) sum exp(s - rowmax))``: the exact-sum denominator.
    * ``"row_log"`` (4 bits): ``E = round(G p / max_row(p))`` with the gain
      ``G = softq.quant.config.LOG_GAIN``; the scores reach it on the row-relative grid of
      step ln(2)/2, so ``p / max_row(p) = 2**(-k/2)`` and ``E`` takes 16 values (``G``
      rounded down the powers of sqrt(2), 0 from k = 15); output ``E / sum(E)`` as ``row``.
      Brevitas' quantizer then runs at 8 bits (it must hold ``round(G) = 87``).
    * ``"edge"``: uniform codes at scale ``2**-bits`` (the edge convention: uint8
      (1/256, 0)), or calibrated from the largest probability.

    ``row`` and ``row_log`` divide by ``sum(E)`` only when the attention's softmax variant sums to 1
    (``sums_to_one``, kept current by ``AttentionPoints.set_softmax``); a clipped softmax's, softpick's,
    2ReLU's or sigmoid's row keeps its own mass: ``E max_row(p) / G``, as ``row_exact``.

    Zero point 0 everywhere, so masked probabilities (exactly 0) stay exactly 0,
    and a fully masked row (all zeros) gives zeros.

    Bias correction (Pandey et al. 2023): rounding pushes small probabilities to 0,
    so E[p - Q(p)] > 0 and rows of Q(p) sum to less than 1.  ``beta`` is that
    expectation measured on calibration data over valid (unmasked) entries, at
    the granularity chosen in the config; inference adds ``beta`` to valid entries.
    Folding into integer arithmetic: (Q(P) + beta) V = Q(P) V + beta * sum_valid(V),
    i.e. a (fractional) zero-point shift of P that the P.V requantization absorbs
    (see docs/ARCHITECTURE.md and softq.export).
    """

    def __init__(self, bits: int, num_heads: int, scale_policy: str = "fixed", representation: str = "edge") -> None:
        super().__init__()
        if representation not in SOFTMAX_OUTPUTS:
            raise ValueError(f"softmax output representation must be one of {SOFTMAX_OUTPUTS}, got {representation!r}")
        self.bits = bits
        self.num_heads = num_heads
        self.scale_policy = scale_policy
        self.representation = representation
        # row codes: E = round(gain p / max_row(p)), held in a Brevitas quantizer of code_bits
        self.gain = None if representation == "edge" else row_code_gain(representation, bits)
        code_bits = 8 if representation == "row_log" else bits
        self.mode: Mode = "float"
        self.quant = _brevitas_int_quant(signed=False)
        self.register_buffer("scale", torch.tensor(2.0**-bits))
        self.register_buffer("zero_point", torch.tensor(0.0))
        self.register_buffer("bit_width", torch.tensor(float(code_bits)))
        self.register_buffer("beta", torch.zeros(0))  # empty: no correction
        self.register_buffer("beta_head", torch.zeros(0))  # per-head fallback for other row counts
        self.max_seen = 0.0
        self.granularity: str | None = None
        self.causal_rows = False  # the model is causal (set by quantize): per-row beta goes by position
        # the attention's softmax variant sums to 1 (set by quantize): only then do ``row`` / ``row_log`` codes
        # divide by their sum; a clipped softmax's or sigmoid's rows keep their own mass on the row-relative grid
        self.sums_to_one = True
        self._lengths: set[int] = set()  # query lengths seen while measuring the bias
        self.measuring = False
        self._err_sum: torch.Tensor | None = None
        self._count: torch.Tensor | None = None
        self._head_err: torch.Tensor | None = None
        self._head_count: torch.Tensor | None = None

    def _scale_for(self, probs: torch.Tensor) -> torch.Tensor:
        if self.representation == "edge":
            return self.scale
        # per-row scale max_row(p) / G: codes round(G p / max_row(p)); empty rows stay 0
        return probs.amax(dim=-1, keepdim=True).clamp_min(TINY) / self.gain

    def quantize(self, probs: torch.Tensor) -> torch.Tensor:
        q = self.quant(self._scale_for(probs), self.zero_point, self.bit_width, probs)
        if self.representation in SUM_OF_CODES and self.sums_to_one:  # normalise by the codes' sum (scale cancels)
            q = q / q.sum(dim=-1, keepdim=True).clamp_min(TINY)
        return q

    def int_repr(self, probs: torch.Tensor) -> torch.Tensor:
        """Integer codes of ``probs``: uniform codes (``edge``) or the row codes ``E`` (``row``, ``row_exact``, ``row_log``)."""
        probs = _float32(probs)
        return self.quant.to_int(self._scale_for(probs), self.zero_point, self.bit_width, probs)

    def needs_probs(self) -> bool:
        """Whether this point reads the probabilities now (else calibration may skip computing them)."""
        return self.mode == "quant" or self.measuring or (
            self.mode == "observe" and self.representation == "edge" and self.scale_policy == "calibrated")

    def forward(self, probs: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        if self.mode == "observe":
            if self.representation == "edge" and self.scale_policy == "calibrated":  # the only use of max_seen
                self.max_seen = max(self.max_seen, probs.detach().max().item())
            return probs
        if self.mode != "quant":
            return probs
        if probs.dtype in HALF_DTYPES:
            return self.forward(probs.float(), valid).to(probs.dtype)
        q = self.quantize(probs)
        if self.measuring:
            self._accumulate(probs, q, valid)
            return q
        beta = self.beta_for(q, valid)
        if beta is None:
            return q
        return q + beta if valid is None else q + beta * valid

    # -- calibration -------------------------------------------------------
    def finish_calibration(self) -> None:
        if self.representation == "edge" and self.scale_policy == "calibrated" and self.max_seen > 0:
            self.scale.fill_(min(self.max_seen, 1.0) / (2**self.bits - 1))

    def start_bias_measurement(self, granularity: str) -> None:
        self.granularity = granularity
        self.measuring = True
        self._err_sum = self._count = self._head_err = self._head_count = None
        self._lengths = set()

    def _accumulate(self, probs: torch.Tensor, q: torch.Tensor, valid: torch.Tensor | None) -> None:
        err = (probs - q).detach()
        weight = torch.ones_like(err) if valid is None else torch.broadcast_to(valid, err.shape).to(err.dtype)
        rows = token_mask(err)  # a calibration batch's padding queries (observers.valid_tokens): not counted
        if rows is not None:
            weight = weight * rows[:, None, :, None].to(err.dtype)
        # per (batch, head, row): summed over keys; per-row statistics go to each row's slot (its position)
        err_bhq, cnt_bhq = (err * weight).sum(3), weight.sum(3)
        self._head_err = err_bhq.sum((0, 2)) + (0 if self._head_err is None else self._head_err)
        self._head_count = cnt_bhq.sum((0, 2)) + (0 if self._head_count is None else self._head_count)
        slots = self.row_slots(valid, err.shape, err.device).expand(err.shape[0], err.shape[2])
        size = max(err.shape[2], 0 if self._err_sum is None else self._err_sum.shape[1])
        err_hs = err.new_zeros(err.shape[1], size + 1)  # the last column collects rows without a slot
        cnt_hs = err.new_zeros(err.shape[1], size + 1)
        index = torch.where(slots >= 0, slots, size).reshape(-1).repeat(err.shape[1], 1)
        err_hs.scatter_add_(1, index, err_bhq.transpose(0, 1).reshape(err.shape[1], -1))
        cnt_hs.scatter_add_(1, index, cnt_bhq.transpose(0, 1).reshape(err.shape[1], -1))
        if self._err_sum is not None and self._count is not None:
            err_hs[:, :self._err_sum.shape[1]] += self._err_sum
            cnt_hs[:, :self._count.shape[1]] += self._count
        self._err_sum, self._count = err_hs[:, :size], cnt_hs[:, :size]
        self._lengths.add(int(err.shape[-2]))

    def row_slots(self, valid: torch.Tensor | None, shape: torch.Size | tuple[int, ...],
                  device: torch.device | str | None = None, length: int | None = None) -> torch.Tensor:
        """[B, q_len] per-row correction slot of each row of a [b, h, q_len, k_len] output (B is b or 1); -1: none.

        A row's slot is its position in its sequence as it runs alone, without padding.  A causal row's is its
        number of valid keys minus one: the same row alone, right- or left-padded in a batch, or a KV cache's query
        row gets the same one.  A bidirectional row sees its whole sequence, so its slot is its position among the
        valid keys, and only if that sequence has ``length`` valid tokens (the length calibrated; while
        measuring, ``k_len``): a sentence of that length padded in a batch gets the slots it gets alone, any other
        sentence takes the per-head beta.  A padding row has none.
        """
        q_len, k_len = shape[-2], shape[-1]
        if self.causal_rows:
            if valid is None:  # the causal triangle (a KV cache's rows: the last positions)
                count = torch.arange(k_len - q_len + 1, k_len + 1, device=device).unsqueeze(0)
            else:
                count = (valid != 0).sum(-1, dtype=torch.long)  # [B', H', q'] (masks do not differ per head)
                count = count.amax(1) if count.dim() == 3 else count.reshape(-1, count.shape[-1])
                count = count.expand(count.shape[0], q_len)
            return count - 1
        length = k_len if length is None else length
        if q_len != k_len:  # not a sequence attending to itself
            return torch.full((1, q_len), -1, dtype=torch.long, device=device)
        if valid is None:
            rows = torch.arange(q_len, device=device).unsqueeze(0)
            return rows if k_len == length else torch.full_like(rows, -1)
        batch = valid.shape[0] if valid.dim() >= 3 else 1  # [B', H', q', k] or [B', q', k]; [q', k]: one for all
        keys = (valid != 0).expand(*valid.shape[:-1], k_len).reshape(batch, -1, k_len).any(1).to(torch.long)
        position = keys.cumsum(-1) - 1
        fits = (keys.sum(-1, keepdim=True) == length) & (keys == 1)
        return torch.where(fits, position, -1).to(device)

    def finish_bias_measurement(self) -> None:
        err, count = self._err_sum, self._count
        head_err, head_count = self._head_err, self._head_count
        self._err_sum = self._count = self._head_err = self._head_count = None
        self.measuring = False
        if err is None or count is None or head_err is None or head_count is None or err.numel() == 0:
            raise RuntimeError("softmax bias correction saw no calibration data")
        per_head = (head_err / head_count.clamp_min(1)).reshape(1, -1, 1, 1)
        if self.granularity == "tensor":
            beta = (head_err.sum() / head_count.sum().clamp_min(1)).reshape(1, 1, 1, 1)
        elif self.granularity == "head":
            beta = per_head
        elif self.causal_rows or len(self._lengths) == 1:  # head_row: slots no calibration row filled take the head's
            rows = torch.where(count > 0, err / count.clamp_min(1), per_head.reshape(-1, 1))
            beta = rows.reshape(1, err.shape[0], err.shape[1], 1)
        else:  # a bidirectional row's error depends on the whole length: calibrated on several, no row is "the" row
            beta = per_head
        self.beta = beta.to(self.scale.dtype)
        self.beta_head = per_head.to(self.scale.dtype)

    def beta_for(self, q: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor | None:
        """The correction for a [b, h, q_len, k_len] output whose valid keys are ``valid`` (None: all).

        Per-row beta (``head_row``) belongs to a row's slot (:meth:`row_slots`).  A causal model's row at
        position i sees keys 0..i whatever the sequence's length or padding, so rows keep their calibrated beta at
        any length, padded or with a KV cache; positions past the calibrated ones take the per-head beta.  A
        bidirectional row sees the whole sequence: its per-row beta holds for sequences of the calibrated length,
        alone or padded, every other row takes the per-head beta (calibrated on several lengths, it is per-head:
        :meth:`finish_bias_measurement`).  The ONNX export computes the same
        (``softq.export.cores._beta_nodes``).
        """
        if self.beta.numel() == 0:
            return None
        rows = self.beta.shape[2]
        if rows == 1:
            return self.beta
        slots = self.row_slots(valid, q.shape, self.beta.device, length=rows).to(self.beta.device)
        slots = torch.where((slots >= 0) & (slots < rows), slots, rows)
        table = torch.cat([self.beta, self.beta_head], dim=2)[0, :, :, 0]  # [h, rows + 1]: the last is per-head
        return table[:, slots].permute(1, 0, 2).unsqueeze(-1)  # [B, h, q_len, 1]

    def extra_repr(self) -> str:
        corr = "none" if self.beta.numel() == 0 else f"{self.granularity} {tuple(self.beta.shape)}"
        scale = f"scale={self.scale.item():.4g}" if self.representation == "edge" else f"scale=rowmax/{self.gain:g}"
        return f"bits={self.bits}, {self.representation}, {scale}, mode={self.mode}, bias_correction={corr}"


WEIGHT_SCALE_MIN = 1e-10  # Brevitas' scaling_min_val of Int8WeightPer{Channel,Tensor}Float (on max |w|)


def weight_codes(weight: torch.Tensor, bits: int, axis: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric narrow-range codes (as float) and scale of ``weight``: one scale per slice along ``axis``
    (``None``: one for the tensor), ``max(max|w|, 1e-10) / (2^(b-1) - 1)``, codes ``round(w / scale)``
    clamped to +-(2^(b-1) - 1); the scale keeps dimensions so that ``codes * scale`` broadcasts.  Computed in
    float32 for float16 / bfloat16 weights and returned in their dtype: the 1e-10 floor is 0 in float16, and an
    all-zero row (a padding token's embedding) gave 0 / 0 codes, NaN embeddings."""
    codes, scale = weight_codes32(weight, bits, axis)
    return codes.to(weight.dtype), scale.to(weight.dtype)


def weight_codes32(weight: torch.Tensor, bits: int, axis: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`weight_codes` in float32, before the cast to a float16 / bfloat16 weight's dtype (the scale the codes
    were divided by)."""
    w = _float32(weight.detach())
    # max |w| as max(max w, -min w), and the codes rounded and clamped in place: no temporary of the weight's size
    # besides the codes (an lm_head of a 32000-token vocabulary is 94 MiB a copy)
    if axis is None:
        absmax = torch.maximum(w.max(), -w.min())
    else:
        dims = tuple(d for d in range(w.dim()) if d != axis % w.dim())
        absmax = torch.maximum(w.amax(dim=dims, keepdim=True), -w.amin(dim=dims, keepdim=True))
    qmax = 2 ** (bits - 1) - 1
    scale = absmax.clamp_min(WEIGHT_SCALE_MIN) / qmax
    return (w / scale).round_().clamp_(-qmax, qmax), scale


def dequantized_weight(weight: torch.Tensor, bits: int, per_channel: bool) -> torch.Tensor:
    """What Brevitas' ``Int8WeightPerChannelFloat`` / ``Int8WeightPerTensorFloat`` (any bit width) returns
    as ``quant_weight().value``, computed in plain torch at about 4x its speed (timed ad hoc), for inference caches
    (tests check equality with Brevitas bit for bit): :func:`weight_codes` per row (output channel) or tensor."""
    codes, scale = weight_codes(weight, bits, 0 if per_channel else None)
    return codes.mul_(scale)  # codes is a new tensor: the product in its place
