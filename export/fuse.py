"""Graph rewrites that leave onnxruntime fewer nodes around softq's integer linear layers.

Each pass rewrites a pattern of the traced graph into standard ONNX ops that compute the same
function up to float rounding (tract and OpenVINO run the file as before) and that
onnxruntime's CPU fusions absorb:

* :func:`fuse_linears`: ``MatMul(DQ(x codes), DQ(W codes, axis=1)) + bias`` becomes
  ``MatMulInteger -> Cast -> Mul(Mul(one, x_scale * w_scale)) -> Add(bias)``, the pattern of
  onnxruntime's ``MatMulIntegerToFloatFusion``, which takes the bias into the fused node.  From
  the DQ form, its QDQ selector builds ``MatMulIntegerToFloat`` *without* the bias and leaves a
  separate ``Add`` per linear.  The fusion needs the scale product to be a ``Mul`` node, and its
  constant folding would fold a ``Mul`` of two constants first; ``one`` is ``Abs(DequantizeLinear(1))``,
  which onnxruntime does not fold while QDQ optimisations are on: two scalar nodes per graph (other
  runtimes fold them).  Not the DQ alone: onnxruntime gives each reader of a DequantizeLinear its
  own copy (EnsureUniqueDQForNodeUnit), one more node per linear.
* :func:`fold_layernorm_scales`: ``Mul(LayerNorm(x), c)`` (input smoothing's per-channel
  ``QLinear.input_scale``) becomes ``LayerNorm`` with ``gamma * c`` and ``beta * c`` where every
  reader of the LayerNorm output multiplies it by the same ``c`` (``Shape`` readers aside), also past a
  ``Reshape`` that keeps the channels last (GPT-2's ``ln_f`` -> ``lm_head``).
* :func:`fold_attention_output_scales`: input smoothing's Mul on the attention output (after the
  heads' Transpose and Reshape) becomes a per-(head, channel) constant in the row core's final
  division's denominator (``Div(N, Mul(rowsum, k / c))``).
* :func:`fold_matmul_scales`: ``Mul(MatMul(DQ(q codes, s), k), c)`` (the attention's
  ``1/sqrt(d)``) becomes ``MatMul(DQ(q codes, s * c), k)``; the ``QuantizeLinear`` keeps ``s``.
* :func:`fold_quantizer_input_scales`: ``QuantizeLinear(Mul(x, c), s)`` with a scalar ``c`` (OPT's query
  scaling before the query's quantizer) becomes ``QuantizeLinear(x, s / c)``.
* :func:`fuse_shared_linears`: integer Linear layers that read the same codes (an attention's Q, K
  and V projections) become one ``MatMulInteger`` over the concatenated weights and a ``Split``:
  one GEMM call instead of three.
* :func:`fold_split_quantizers`: where a Linear's output is only split into parts that are each
  quantized again per tensor (that GEMM's Q, K and V, or GPT-2's ``c_attn``), the parts' scales and
  zero points fold into the GEMM's column scales and bias, and one ``QuantizeLinear`` (scale 1, zero
  point 0) before the ``Split`` replaces one per part; the heads' Reshape/Transpose then move codes.
* :func:`fold_sum_columns`: the ``row`` core's Pad of V with a column of ``z + 1`` (its row sums) becomes
  one more column per head in that GEMM (zero weights, the code as bias): a copy of V fewer per layer.
* :func:`fold_row_scales`: the core's scalar factor in ``Div(N, Mul(D, c))`` moves into the scale of the
  ``QuantizeLinear`` that reads the attention output: one Mul fewer per layer.
* :func:`merge_head_splits`: the Q/K/V codes' per-part ``Reshape -> Transpose`` into heads becomes one
  ``Reshape -> Transpose -> Reshape -> Split`` for all parts (Q and K padded to V's width with zero-point
  columns that add exact zeros to the scores): 3 nodes fewer per layer, the same outputs.
* :func:`quantize_before_layout`: a per-tensor ``QuantizeLinear`` after Reshape/Transpose nodes (the
  attention output merged from its heads) moves before them: the same codes, a quarter of the bytes moved.
* :func:`drop_requantize`: ``QuantizeLinear(DequantizeLinear(c))`` on one grid is ``c`` (a decoder's int8 KV
  cache read by the K and V points); a cached decoder's file then reads its cache per K/V head
  (:func:`softq.export.fuse_cache.group_query_heads`, run by the exporter after these passes).
* :func:`static_reshapes`: ``Reshape`` targets the exporter builds at run time
  (``Shape -> Gather -> Unsqueeze -> Concat``, e.g. ``[batch, seq, heads, head_dim]``) become
  constants, with 0 ("copy this dimension") where ONNX shape inference shows that the gathered
  dimension is the Reshape input's own dimension at that position (the same symbol, or the same size
  at three probe shapes where a mask's broadcast loses the symbols): about 7 nodes per attention
  layer fewer, which at batch 1 on a small model is several percent of the run time.

This module is the entry point, :func:`fuse`, which runs the passes in order.  They live by concern:
:mod:`softq.export.fuse_linear` (the Linear layers), :mod:`softq.export.fuse_scales` (scale folds),
:mod:`softq.export.fuse_shapes` (shape inference and static Reshape targets) and
:mod:`softq.export.fuse_layout` (the attention heads' layout), on the graph view of
:mod:`softq.export.fuse_graph`.
"""

from __future__ import annotations

import onnx

from softq.export import onnx_utils
from softq.export.fuse_layout import drop_requantize, fold_sum_columns, merge_head_splits, quantize_before_layout
from softq.export.fuse_linear import fold_split_quantizers, fuse_linears, fuse_shared_linears
from softq.export.fuse_scales import (fold_attention_output_scales, fold_layernorm_scales, fold_matmul_scales,
                                      fold_quantizer_input_scales, fold_row_scales)
from softq.export.fuse_shapes import static_reshapes


def fuse(model: onnx.ModelProto, linears: bool = True, dynamic: bool = False) -> dict[str, int]:
    """All passes, in order (``linears=False``: the Linear layers keep their DequantizeLinear -> MatMul
    form, which OpenVINO's int8 path needs; ``dynamic``: see :func:`fuse_linears`); returns what each changed."""
    done = {"layernorm_scales": fold_layernorm_scales(model), "matmul_scales": fold_matmul_scales(model),
            "attention_output_scales": fold_attention_output_scales(model),
            "quantizer_input_scales": fold_quantizer_input_scales(model),
            "linears": fuse_linears(model, dynamic) if linears else 0}
    done["static_reshapes"] = static_reshapes(model)
    onnx_utils.prune(model)  # the shape nodes the constants replaced read the projections' outputs
    done["shared_linears"] = fuse_shared_linears(model) if linears else 0
    done["split_quantizers"] = fold_split_quantizers(model) if linears else 0
    done["sum_columns"] = fold_sum_columns(model) if linears else 0
    done["row_scales"] = fold_row_scales(model)
    done["head_splits"] = merge_head_splits(model) if linears else 0
    done["layout_quantizers"] = quantize_before_layout(model) if linears else 0
    done["requantize"] = drop_requantize(model)
    return done
