"""The export layers: small modules that stand in for each quantized module of the export copy.

Each takes its codes, scales and zero points from the quantized module it replaces (activation quantizers,
quantized Linears, embedding tables, weight-only parametrizations, the attention core's softmax points) and
calls one :mod:`softq.export.functions` Function, so the trace computes the quantized model's numbers and
writes their ONNX form.  :func:`softq.export.prepare.export_copy` puts them in place.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from softq.export.errors import ExportError
from softq.export.functions import (STATE, TORCH_OPSET, AttentionMarkerFn, EmbeddingLookupFn, GroupQDQFn, QDQFn,
                                    WeightDQFn, WeightOnlyFn, stored_grid)
from softq.quant.quantizers import weight_codes


class ExportWeightOnly(nn.Module):
    """Stands in for a :class:`WeightOnly` parametrization in the export copy (its input, the float
    original, is then unused and leaves the graph)."""

    def __init__(self, quant: nn.Module, original: torch.Tensor, key: int) -> None:
        super().__init__()
        codes, scale = quant.codes_and_scale(original)
        if codes.abs().max() > 127:
            raise ExportError(f"weight-only codes of {quant.bits} bits do not fit int8")
        STATE.weights[key] = (codes.to(torch.int8).numpy(), scale.to(torch.float32).numpy(), None, None)
        self.register_buffer("w_deq", codes * scale)
        self.key = key

    def forward(self, _original: torch.Tensor) -> torch.Tensor:
        return WeightOnlyFn.apply(self.w_deq, self.key)


class ExportAct(nn.Module):
    def __init__(self, quantizer: nn.Module, key: int) -> None:
        super().__init__()
        self.signed = bool(quantizer.signed)
        bits = int(quantizer.bits)
        if bits > 8:
            raise ExportError(f"softq exports activations of at most 8 bits (ONNX opset {TORCH_OPSET}); got {bits}")
        self.qmin, self.qmax = ((-(2 ** (bits - 1)) + 1, 2 ** (bits - 1) - 1) if self.signed else (0, 2**bits - 1))
        self.key = key
        self.grouped = quantizer.scale.numel() > 1
        if self.grouped:  # per-embedding-group: one (scale, zero point) per hidden channel
            if (self.qmin, self.qmax) not in ((0, 255), (-127, 127)):
                raise ExportError(f"per-group activations export at 8 bits only; got {bits}")
            scale = quantizer.scale.detach().float().reshape(-1)
            zp = quantizer.zero_point.detach().round().reshape(-1)
            STATE.acts[key] = (scale.numpy().astype(np.float32),
                               zp.numpy().astype(np.int8 if self.signed else np.uint8), self.signed)
            self.register_buffer("scale_v", scale)
            self.register_buffer("zp_v", zp.float())
        else:
            self.scale = float(quantizer.scale)
            self.zp = int(round(float(quantizer.zero_point)))
        # prefix-token rows (QuantConfig.residual_prefix): Slice -> their own Q/DQ -> Concat, as in torch
        self.prefix = nn.ModuleList(ExportAct(row, -(key * 16 + i + 1))
                                    for i, row in enumerate(getattr(quantizer, "prefix", ())))

    def store_in_cache(self) -> None:
        """Emit this K or V point's codes on the int8 KV cache's grid (unsigned codes shifted to int8 with the
        zero point; the same float values), so that the cache's codes and this point's are one tensor."""
        if not self.signed:
            self.zp, self.qmin, self.qmax = stored_grid(self.zp, self.qmin, self.qmax, self.signed)
            self.signed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.prefix) and x.dim() >= 3:
            rows = [q(x[..., i:i + 1, :]) for i, q in enumerate(self.prefix)]  # empty past a short input's end
            return torch.cat([*rows, self._forward(x[..., len(self.prefix):, :])], dim=-2)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            return GroupQDQFn.apply(x, self.scale_v, self.zp_v, self.key, self.qmin, self.qmax)
        return QDQFn.apply(x, self.scale, self.zp, self.qmin, self.qmax, self.signed)


class ExportKV(nn.Module):
    """Stands in for a K or V point with one scale and zero point per key/value head or per head and channel
    (:class:`softq.quant.kv_cache.KVQuantizer`, ``QuantConfig.kv_scales``).

    It emits the int8 cache's stored codes (the point's codes, minus 128 where asymmetric: ``round(x / s) + z``,
    clipped, as the point rounds) as one per-tensor ``QuantizeLinear -> DequantizeLinear`` pair of scale 1 and zero
    point 0, the grid a per-tensor point's codes have in the graph, so the integer GEMMs read them as they read a
    per-tensor point's.  The per-head scale and zero point are factors outside those GEMMs:

    * K: :meth:`key_product` is the score matmul in place of ``q . k^T``: per head ``(q . codes^T - z * sum(q)) * s``
      (an integer GEMM of the query and K codes); per channel, whose scale varies along the contracted dimension
      and so does not factor out of it, ``(q * s) . codes^T - (q * s) . z^T`` (a float GEMM of the scaled queries
      and the codes, what torch computes to float rounding);
    * V (per head or channel): the row attention core subtracts ``z * sum(E)`` from ``E . codes`` and divides by
      ``sum(E) / s`` (``prepare.export_copy`` hands it ``z`` and ``s``; :class:`AttentionMarker` computes the same in
      torch);
    * ``dequantize`` (V of a float or edge softmax, whose P.V is a float MatMul): the point outputs the values
      ``(codes - z) * s``, which the float matmul reads.

    ``s`` and ``z`` are ``[heads, 1, 1 | head_dim]``, the key/value heads' repeated to the ``heads`` query heads.
    In a cached decoder (:meth:`store_in_cache`) the point reads the stored codes themselves (the cache layer hands
    it ``DequantizeLinear(codes, 1, 0)``), so its pair is the one a per-tensor point's cache read becomes."""

    def __init__(self, quantizer: nn.Module, heads: int, dequantize: bool) -> None:
        super().__init__()
        from softq.quant.kv_cache import stored_zero_point

        bits = int(quantizer.bits)
        if bits != 8:
            raise ExportError(f"K and V points with per-{quantizer.granularity} scales export at 8 bits, and this "
                              f"model's have {bits}: quantize with act_bits=8, or kv_scales='tensor'")
        self.signed = True  # the stored int8 grid (zero point 0, scale 1: the codes themselves)
        self.scale, self.zp = 1.0, 0
        self.qmin, self.qmax = (-127, 127) if quantizer.signed else (-128, 127)
        self.register_buffer("s", quantizer._expand(quantizer.scale.detach().float(), heads).clone())
        self.register_buffer("z", quantizer._expand(stored_zero_point(quantizer).detach().float(), heads).clone())
        # the key/value heads' own (a cache stores the keys and values before they are repeated to the query heads)
        self.register_buffer("s_kv", quantizer.scale.detach().float().clone())
        self.register_buffer("z_kv", stored_zero_point(quantizer).detach().float().clone())
        self.granularity = quantizer.granularity
        self.offset = bool(self.z.any())  # a zero point's term in the score GEMM (asymmetric K)
        self.dequantize = dequantize
        self.cached = False

    def store_in_cache(self) -> None:
        """Read the cache's stored codes (see the class docstring) instead of float keys or values."""
        self.cached = True

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """The stored codes of ``x`` (float, ``[batch, heads or kv_heads, tokens, head_dim]``): round, then add
        the zero point, as the point rounds."""
        s, z = (self.s, self.z) if x.shape[1] == self.s.shape[0] else (self.s_kv, self.z_kv)
        return torch.clamp(torch.round(x / s) + z, self.qmin, self.qmax)

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """What the codes stand for, ``(codes - z) * s``."""
        return (codes - self.z) * self.s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes = QDQFn.apply(x if self.cached else self.to_grid(x), 1.0, 0, self.qmin, self.qmax, True)
        return self.values(codes) if self.dequantize else codes

    def key_product(self, q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """``q . k^T`` from the K codes (see the class docstring)."""
        if self.granularity == "head":  # per head: the zero point's term and the scale outside the integer GEMM
            product = torch.matmul(q, codes.transpose(-1, -2))
            if self.offset:
                product = product - q.sum(-1, keepdim=True) * self.z
            return product * self.s
        scaled = q * self.s  # per channel: the scale on each query channel
        product = torch.matmul(scaled, codes.transpose(-1, -2))
        return product - torch.matmul(scaled, self.z.transpose(-1, -2)) if self.offset else product


class ExportLinear(nn.Module):
    def __init__(self, layer: nn.Module, storage: str) -> None:
        super().__init__()
        # the codes inference computes with (QLinear.dequantized_weight; Brevitas' int_weight() bit for bit, with
        # a few weight-sized temporaries fewer)
        codes, scale = weight_codes(layer.weight, layer.weight_bits, 0 if layer.per_channel else None)
        if codes.abs().max() > 127:
            raise ExportError(f"weights of {type(layer).__name__} do not fit int8 (weight_bits > 8 is not exportable)")
        codes = codes.t().to(torch.int8).contiguous()  # [in, out]: MatMul(x, W^T), axis=1
        scale = scale.reshape(-1 if scale.numel() > 1 else ()).to(torch.float32)
        zp = torch.zeros(scale.shape, dtype=torch.int8)
        if storage == "uint8":  # same symmetric grid, stored shifted by 128 (see to_onnx)
            codes = (codes.to(torch.int16) + 128).to(torch.uint8)
            zp = torch.full(scale.shape, 128, dtype=torch.uint8)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("zp", zp)
        bias = layer.effective_bias()  # with the weight bias correction
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.input_act = layer.input_act
        self.register_buffer("input_scale", layer.input_scale.detach().clone())

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] the layer computes with: Hugging Face code reads a Linear's weight
        (T5's feed-forward its dtype); a read whose result the graph does not use leaves no node."""
        return WeightDQFn.apply(self.codes, self.scale, self.zp).t()

    @property
    def in_features(self) -> int:
        return self.codes.shape[0]

    @property
    def out_features(self) -> int:
        return self.codes.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale.numel():  # input smoothing: one Mul, merged for Linear layers sharing the input
            x = x * self.input_scale
        y = torch.matmul(self.input_act(x), WeightDQFn.apply(self.codes, self.scale, self.zp))
        return y if self.bias is None else y + self.bias


class ExportEmbedding(nn.Module):
    """Weight-only int8 embedding table (symmetric, one scale per row): int8 codes and float scales, both gathered.

    From a :class:`softq.quant.layers.QEmbedding` (``QuantConfig.embedding_bits``, the
    default): its own codes and scales, so ONNX computes what the torch model does.  From a
    float ``nn.Embedding`` (``embeddings="int8"`` on a model quantized with
    ``embedding_bits=None``): 8-bit codes made here, which the torch model does not use.
    """

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        if hasattr(emb, "int_weight"):  # a QEmbedding: the codes its inference computes with
            codes, scale = weight_codes(emb.weight, emb.bits, 0)
            if codes.abs().max() > 127:
                raise ExportError(f"embedding codes of {emb.bits} bits do not fit int8")
            codes, scale = codes.to(torch.int8), scale.reshape(-1).to(torch.float32)
        else:
            w = emb.weight.detach().to(torch.float32)
            scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
            codes = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        self.padding_idx = emb.padding_idx
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale.reshape(-1, 1).to(torch.float32))

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table: Hugging Face code reads an embedding's weight (CLIP's text embeddings its number
        of rows); a read whose result the graph does not use leaves no node."""
        return self.codes.float() * self.scale

    @property
    def num_embeddings(self) -> int:
        return self.codes.shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.codes.shape[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return EmbeddingLookupFn.apply(ids, self.codes, self.scale)


class FloatEmbedding(nn.Module):
    """A QEmbedding exported as a float table of its dequantized codes (``embeddings="float"``)."""

    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.padding_idx = emb.padding_idx
        self.weight = nn.Parameter(emb.dequantized().detach().clone(), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight, self.padding_idx)


class ScoresTap(nn.Module):
    """Passes the float scores through and remembers them (and the mask) for the attention marker."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x
        return x


class ValidTap(nn.Module):
    """Stands in for the softmax-output quantizer: remembers the mask, passes the probabilities on."""

    def __init__(self, tap: ScoresTap) -> None:
        super().__init__()
        self.tap = [tap]  # a list: not a submodule

    def forward(self, probs: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        self.tap[0].valid = valid
        return probs


class AttentionMarker(nn.Module):
    """Replaces the P.V matmul: one marker from (scores, V, valid) to P.V."""

    def __init__(self, tap: ScoresTap, key: int, values: ExportKV | None = None) -> None:
        super().__init__()
        self.tap = [tap]
        self.key = key
        self.values = [values]  # a list: not a submodule (V as per-head codes: their values, for torch)

    def forward(self, probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        tap = self.tap[0]
        codes = self.values[0]
        out = torch.matmul(probs, value if codes is None else codes.values(value))
        extra = tap.seen.shape[-1] - value.shape[-2]
        if extra > 0:  # learned sink logits (s_aux): score columns no value reads, so the core reads zero rows there
            zero = torch.zeros_like(value[..., :extra, :])
            value = torch.cat([value, zero if codes is None else zero + codes.z], dim=-2)  # codes of the value 0
        return AttentionMarkerFn.apply(tap.seen, value, tap.valid, out, self.key)
