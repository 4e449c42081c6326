"""Numpy reference of one attention read from an INT8 KV cache (``softq.quant.kv_cache``): row softmax codes from
float scores (``QuantConfig.softmax_input="float"``, the default), P.V as one integer GEMM of those codes and the
stored V codes.

The cache representation, per layer (what an exported file's past/present tensors carry):

* ``key_codes``, ``value_codes``: ``int8 [batch, kv_heads, seq, head_dim]``;
* ``*_scale``: float32 of shape ``[]``, ``[kv_heads, 1, 1]`` or ``[kv_heads, 1, head_dim]`` (``QuantConfig.kv_scales``
  ``tensor``, ``head``, ``channel``), broadcast over the codes;
* ``*_zero_point``: integers of the scale's shape (within int8), the stored codes' zero point;
* value ``(codes - zero_point) * scale``.

With query heads ``heads = rep * kv_heads``, query head ``h`` reads key/value head ``h // rep``.  The read::

    S = Q . K^T * scaling                         float32, K = (key_codes - zk) * sk
    E = round(G exp(S - rowmax))                  row codes (G = 2**b - 1), 0 at masked keys
    num = E . (value_codes - zv)                  integer GEMM, int64 here (int32 in a file: |num| <= G * 255 * keys)
    out = num * sv / sum(E)                       float32; sv per head or per channel is a per-column factor

The torch model computes ``(E / sum E) . ((value_codes - zv) * sv)`` in float32, so the two agree to float rounding
(a row code can differ by one where ``G exp(S - rowmax)`` lies within float32 noise of a rounding tie).
"""

from __future__ import annotations

import numpy as np

from softq.export.int_softmax import relative_scores


def dequantize(codes: np.ndarray, scale: np.ndarray | float, zero_point: np.ndarray | float) -> np.ndarray:
    """float32 ``(codes - zero_point) * scale`` of int8 cache codes."""
    codes = np.asarray(codes)
    if codes.dtype != np.int8:
        raise ValueError(f"KV cache codes must be int8, got {codes.dtype}")
    return ((codes.astype(np.float32) - np.float32(zero_point)) * np.asarray(scale, np.float32)).astype(np.float32)


def _per_query_head(t: np.ndarray, heads: int) -> np.ndarray:
    """A [kv_heads, ...] scale or zero point (or [b, kv_heads, ...] codes: ``axis`` 1) repeated to the query heads."""
    t = np.asarray(t)
    if t.ndim == 0 or t.shape[0] == heads:
        return t
    return np.repeat(t, heads // t.shape[0], axis=0)


def cache_attention(query: np.ndarray, key_codes: np.ndarray, key_scale: np.ndarray, key_zero_point: np.ndarray,
                    value_codes: np.ndarray, value_scale: np.ndarray, value_zero_point: np.ndarray, scaling: float,
                    softmax_bits: int = 8, valid: np.ndarray | None = None) -> np.ndarray:
    """``P.V`` (float32 ``[batch, heads, q, head_dim]``) of the quantized query ``query`` (float32, the Q point's
    output, ``[batch, heads, q, head_dim]``) over the cached codes; ``valid`` (0/1, broadcast to
    ``[batch, heads, q, keys]``) masks keys."""
    query = np.asarray(query, np.float32)
    heads, kv = query.shape[1], np.shape(key_codes)[1]
    if heads % kv:
        raise ValueError(f"{heads} query heads are not a multiple of the cache's {kv} key/value heads")
    rep = heads // kv
    keys = np.repeat(dequantize(key_codes, key_scale, key_zero_point), rep, axis=1)
    scores = (np.matmul(query, np.swapaxes(keys, -1, -2)) * np.float32(scaling)).astype(np.float32)
    rel = relative_scores(scores, valid)
    gain = 2**softmax_bits - 1
    e = np.round(gain * np.exp(rel.astype(np.float64))).astype(np.int64)  # masked keys: exp(-5e29) = 0
    vcodes = np.repeat(np.asarray(value_codes), rep, axis=1).astype(np.int64)
    vz = np.round(_per_query_head(np.asarray(value_zero_point, np.float64), heads)).astype(np.int64)
    num = np.matmul(e, vcodes - vz)  # the integer GEMM
    den = np.maximum(e.sum(axis=-1, keepdims=True), 1)
    sv = _per_query_head(np.asarray(value_scale, np.float32), heads)
    return (num.astype(np.float32) * sv / den.astype(np.float32)).astype(np.float32)
