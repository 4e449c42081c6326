"""The quantized layers: Linear, norms and embedding table, and weight-only codes for other parameters.

``QLinear`` is Brevitas' ``QuantLinear`` (per-channel or per-tensor int weights,
float bias) behind a softq activation quantizer (``quantizers.py``); ``QEmbedding``
a per-row int table; ``QLayerNorm`` (``nn.LayerNorm``) and ``QNorm`` (any other norm,
e.g. RMSNorm) quantize the residual stream at their input.
Conv2d weights and a vision encoder's position table get weight-only codes as
torch parametrizations (:class:`WeightOnly`).  The quantized model is an ordinary
``nn.Module``.
"""

from __future__ import annotations

import torch
from brevitas.nn import QuantEmbedding, QuantLinear
from brevitas.quant import Int8WeightPerChannelFloat, Int8WeightPerTensorFloat
from torch import nn

from softq.quant.quantizers import ActQuantizer, dequantized_weight, weight_codes
from softq.quant.weight_cache import _copying, _CopiedWeights, _DequantizedCache, _NotPickled
from softq.softmax import HALF_DTYPES

# a calibration run computes a large Linear's product (more than twice this many bytes of weights) a piece of output
# channels of this many bytes of weights at a time (QLinear._linear_in_pieces)
PIECE_BYTES = 2**22


def _straight_through(weight: torch.Tensor, bits: int, per_channel: bool) -> torch.Tensor:
    """:func:`dequantized_weight` with an identity (straight-through) gradient, for float16 / bfloat16 weights: Brevitas'
    quantizer divides a float16 all-zero row by a scale rounded to 0, and rounds bfloat16 codes differently from
    float32.  Brevitas also differentiates through each row's abs-max scale; this gradient does not (softq trains
    no quantized weights: bias and scale calibration read the dequantized weights)."""
    return weight + (dequantized_weight(weight.detach(), bits, per_channel) - weight).detach()


class WeightOnly(nn.Module):
    """Parametrization storing a float parameter as symmetric int codes, one scale per slice along ``axis``.

    For weights that are not a Linear's or an embedding table's: a ViT's patch projection
    (``Conv2d``, one scale per output channel) and its learned position table (one per
    position).  The same formula as :func:`weight_codes` (Brevitas' per-channel
    weight quantizer): scale ``max(max|w|, 1e-10) / (2^(b-1) - 1)``, codes
    ``round(w / scale)`` clamped to the narrow range.  Weight-only: the module computes
    in float on the dequantized values, which is what the ONNX export stores as int8
    codes and scales (``Cast -> Mul``, folded to a constant by runtimes at load time).
    Gradients pass straight through the rounding.
    """

    def __init__(self, bits: int, axis: int) -> None:
        super().__init__()
        self.bits, self.axis = bits, axis
        self.enabled = True  # False: the float parameter itself (softq.quant.sensitivity)

    def codes_and_scale(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Integer codes (as float) and the scale, shaped to broadcast against ``w``."""
        return weight_codes(w, self.bits, self.axis)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return w
        codes, scale = self.codes_and_scale(w)
        q = codes * scale
        # straight-through only when training: w + (q - w) can differ from q by a rounding step
        return w + (q - w).detach() if w.requires_grad and torch.is_grad_enabled() else q

    def extra_repr(self) -> str:
        return f"bits={self.bits}, axis={self.axis}"


class BiasShift(nn.Module):
    """Parametrization of a weight-only ``Conv2d``'s bias: ``bias + shift``, the weight bias correction
    (:func:`softq.quant.weight_bias.correct_weight_bias`), while ``enabled`` (``softq.quant.sensitivity``
    switches it with the weight's :class:`WeightOnly`)."""

    def __init__(self, shift: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("shift", shift.detach().clone().float())
        self.enabled = True

    def forward(self, b: torch.Tensor) -> torch.Tensor:
        return b + self.shift.to(b.dtype) if self.enabled else b


def quantize_weight_only(model: nn.Module, weight_bits: int, table_bits: int | None,
                         exclude: tuple[str, ...] = ()) -> None:
    """Weight-only codes for the parameters no quantized module holds, in place: every ``Conv2d``
    weight (``weight_bits``, per output channel) and a vision encoder's learned position table
    (a 3-D ``position_embeddings`` parameter, ``table_bits`` per position; ``None`` leaves it float)."""
    from torch.nn.utils import parametrize

    for name, module in list(model.named_modules()):
        if any(pattern in name for pattern in exclude):
            continue
        if type(module) is nn.Conv2d:
            parametrize.register_parametrization(module, "weight", WeightOnly(weight_bits, axis=0))
        table = getattr(module, "position_embeddings", None)
        if table_bits is not None and isinstance(table, nn.Parameter) and table.dim() == 3:
            parametrize.register_parametrization(module, "position_embeddings", WeightOnly(table_bits, axis=1))


def _take_parameters(layer: nn.Module, source: nn.Module, names: tuple[str, ...], adopt: bool) -> None:
    """``source``'s parameters in ``layer``: the same ``nn.Parameter`` objects (``adopt``: the layer replaces
    ``source`` in its model, which shares them with no other module), else copies.  Adopting keeps the weights in
    the memory they were loaded into: a copy of a model loaded from safetensors (memory-mapped pages, kept mapped
    while any of its tensors lives) would hold the whole model twice in RSS."""
    for name in names:
        param = getattr(source, name)
        if param is None:
            continue
        if adopt:
            setattr(layer, name, param)
        else:
            with torch.no_grad():
                getattr(layer, name).copy_(param)


class QLayerNorm(nn.LayerNorm):
    """LayerNorm whose input (the residual stream) is quantized first."""

    def __init__(self, norm: nn.LayerNorm, act: ActQuantizer) -> None:
        super().__init__(norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.elementwise_affine,
                         bias=norm.bias is not None, device=norm.weight.device if norm.weight is not None else None)
        self.load_state_dict(norm.state_dict())
        self.input_act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.input_act(x))


class QNorm(nn.Module):
    """A norm of another class than ``nn.LayerNorm`` (an RMSNorm: Llama's, Gemma's ``1 + w``, T5's; ``softq.norms``)
    whose input, the residual stream, is quantized first.  The norm itself is kept, unchanged, as ``norm``."""

    def __init__(self, norm: nn.Module, act: ActQuantizer) -> None:
        super().__init__()
        self.norm = norm
        self.input_act = act

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.norm(self.input_act(x), *args, **kwargs)


class QLinear(_NotPickled, _DequantizedCache, _CopiedWeights, QuantLinear):
    """Brevitas ``QuantLinear`` (int weights, float bias) behind a softq activation quantizer."""

    def __init__(self, linear: nn.Linear, weight_bits: int, per_channel: bool, act: ActQuantizer,
                 adopt: bool = False) -> None:
        weight_quant = Int8WeightPerChannelFloat if per_channel else Int8WeightPerTensorFloat
        # an offloaded layer (weights on the meta device, softq.quant.offload): built on the CPU, where Brevitas'
        # constants get their values, then given meta weights that its block's loading fills
        offloaded = linear.weight.is_meta
        with _copying(QLinear):
            super().__init__(
                linear.in_features, linear.out_features, bias=linear.bias is not None,
                weight_quant=weight_quant, weight_bit_width=weight_bits, return_quant_tensor=False,
                device="cpu" if offloaded else linear.weight.device, dtype=linear.weight.dtype,
            )
        if offloaded:  # into _parameters: assigning the attribute makes Brevitas rebuild its quantizer on meta
            self._parameters["weight"] = nn.Parameter(torch.empty_like(linear.weight))
            if linear.bias is not None:
                self._parameters["bias"] = nn.Parameter(torch.empty_like(linear.bias))
        else:
            _take_parameters(self, linear, ("weight", "bias"), adopt)
        self.input_act = act
        self.weight_bits, self.per_channel = weight_bits, per_channel
        # per-input-channel 1/s of input smoothing (softq.calib.smoothquant.smooth_inputs); empty: none
        scale = getattr(linear, "softq_input_scale", None)
        self.register_buffer("input_scale", torch.ones(0) if scale is None else scale.detach().clone().float())
        # weight bias correction (softq.quant.weight_bias.correct_weight_bias): added to the bias while the weights
        # are quantized, so switching weight quantization off (softq.quant.sensitivity) gives the float layer back
        self.register_buffer("bias_shift", torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale.numel():
            x = x * self.input_scale
        x = self.input_act(x)
        if self.weight.dtype in HALF_DTYPES and not self.weight_quant.disable_quant and (self.training
                                                                                  or torch.is_grad_enabled()):
            # Brevitas' half arithmetic: its 1e-10 scale floor is 0 in float16 (an all-zero row: NaN), and bfloat16
            # codes differ from float32's; the inference path's codes, straight-through
            return nn.functional.linear(x, _straight_through(self.weight, self.weight_bits, self.per_channel),
                                        self.effective_bias())
        if self.training or torch.is_grad_enabled() or self.weight_quant.disable_quant:
            y = super().forward(x)
            return y + self.bias_shift if self.bias_shift.numel() and not self.weight_quant.disable_quant else y
        # inference: the same product on the dequantized weight, cached (tests check the outputs are equal)
        if self.pieces_when_calibrating() and self._uncached() or "weight_factor" in self.__dict__:
            return self._linear_in_pieces(x)
        return nn.functional.linear(x, self.dequantized_weight(), self.effective_bias())

    def pieces_when_calibrating(self) -> bool:
        """Whether runs that keep no dequantized weight (calibration, the export's check) compute this layer's product
        in pieces (:meth:`_linear_in_pieces`): per-channel weights of more than twice ``PIECE_BYTES``."""
        return self.per_channel and self.weight.numel() * self.weight.element_size() > 2 * PIECE_BYTES

    def _linear_in_pieces(self, x: torch.Tensor) -> torch.Tensor:
        """The inference product computed a piece of output channels at a time, each piece's weight dequantized
        just for it (per-channel codes: a row's depend on that row alone), so calibration, which keeps no
        dequantized weight, never holds a whole one (94 MiB for a 32000-word lm_head of width 768).  Each output is
        the same dot product as in the whole product.  A smoothing candidate that shares this weight with the model
        (``smoothing_search``) has its per-input-channel factors in ``weight_factor``: each piece is scaled by them
        first, as the weight itself would have been."""
        bias = self.effective_bias()
        w = self.weight.detach()
        factor = self.__dict__.get("weight_factor")
        if factor is not None and (torch.is_grad_enabled() or not self._uncached()):
            raise RuntimeError("a smoothing candidate sharing its weight runs in calibration only")
        step = 1 << max(0, (PIECE_BYTES // (4 * w.shape[1])).bit_length() - 1)  # a power of two channels
        out = x.new_empty(*x.shape[:-1], w.shape[0])
        for a in range(0, w.shape[0], step):
            rows = slice(a, a + step)
            piece = w[rows] if factor is None or not factor.numel() else w[rows] * factor
            out[..., rows] = nn.functional.linear(x, dequantized_weight(piece, self.weight_bits, True),
                                                  None if bias is None else bias[rows])
        return out

    def effective_bias(self) -> torch.Tensor | None:
        """The bias the quantized layer adds: ``bias + bias_shift`` (weight bias correction) while its
        weights are quantized; what the ONNX export stores."""
        if not self.bias_shift.numel() or self.weight_quant.disable_quant:
            return self.bias
        return self.bias_shift if self.bias is None else self.bias + self.bias_shift

    def dequantized_weight(self) -> torch.Tensor:
        return self._cached_dequantized(self.weight_bits, self.per_channel)

    def weight_scale(self) -> torch.Tensor:
        """Per-output-channel (or scalar) weight scale, shape [out] or []."""
        return self.quant_weight().scale.detach().reshape(-1)

    def int_weight(self) -> torch.Tensor:
        return self.quant_weight().int().detach()


class QEmbedding(_NotPickled, _DequantizedCache, _CopiedWeights, QuantEmbedding):
    """Brevitas ``QuantEmbedding`` with per-row symmetric int weights (one scale per table row).

    Weight-only: the looked-up rows are the dequantized codes, exactly what the
    ONNX export stores (int8 codes, DequantizeLinear(axis=0), Gather), so the
    file is about a quarter of FP32 and torch and ONNX agree.  Brevitas' own
    ``QuantEmbedding.forward`` takes per-tensor scales only, so the lookup is
    done here on ``quant_weight()``; in inference the dequantized table is
    computed once and cached (``_DequantizedCache``).
    """

    def __init__(self, emb: nn.Embedding, bits: int, adopt: bool = False) -> None:
        with _copying(QEmbedding):
            super().__init__(emb.num_embeddings, emb.embedding_dim, padding_idx=emb.padding_idx,
                             weight_quant=Int8WeightPerChannelFloat, weight_bit_width=bits,
                             return_quant_tensor=False, device=emb.weight.device, dtype=emb.weight.dtype)
        _take_parameters(self, emb, ("weight",), adopt)
        self.bits = bits

    def dequantized(self) -> torch.Tensor:
        if self.weight_quant.disable_quant:  # the float table (softq.quant.sensitivity)
            return self.weight
        if self.training or torch.is_grad_enabled() and self.weight.requires_grad:
            if self.weight.dtype in HALF_DTYPES:  # Brevitas' scale floor is 0 in float16 (a zero row, padding: NaN)
                return _straight_through(self.weight, self.bits, True)
            return self.quant_weight().value
        return self._cached_dequantized(self.bits, True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if (not self.training and not (torch.is_grad_enabled() and self.weight.requires_grad)
                and not self.weight_quant.disable_quant and self._uncached()):
            # calibration keeps no dequantized table: the rows looked up, dequantized alone (per-row codes depend
            # on their row only), where the whole table was a temporary of its size on every call (94 MiB at
            # 32000 x 768, in each model run of calibration)
            rows = self.weight.detach()[ids.reshape(-1)]
            return dequantized_weight(rows, self.bits, True).reshape(*ids.shape, rows.shape[-1])
        return nn.functional.embedding(ids, self.dequantized(), self.padding_idx)

    def weight_scale(self) -> torch.Tensor:
        """Per-row weight scale, shape [num_embeddings]."""
        return self.quant_weight().scale.detach().reshape(-1)

    def int_weight(self) -> torch.Tensor:
        return self.quant_weight().int().detach()
