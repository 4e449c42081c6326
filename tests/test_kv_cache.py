"""INT8 KV cache (softq.quant.kv_cache) on the tiny Llama of benchmarks/tiny_families.py (GQA: 4 query heads,
2 key/value heads): what it stores, that decoding with it equals the full forward, its integer reference, its
configuration and its save/load round trip."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import tiny_families as TF  # noqa: E402

import softq  # noqa: E402
from softq.export.kv_reference import cache_attention  # noqa: E402
from softq.quant.kv_cache import Int8KVCache, cache_bytes, stored_zero_point  # noqa: E402

FAST = dict(input_smoothing=None, weight_bias_correction=False)  # the passes these tests do not need


@pytest.fixture(scope="module")
def llama():
    model = TF.build("llama").eval()
    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, 96, (2, 24), generator=g) for _ in range(3)]
    ids = torch.randint(0, 96, (2, 20), generator=g)
    return model, calib, ids


@pytest.fixture(scope="module")
def per_channel(llama):
    model, calib, _ = llama
    return softq.quantize(model, calib, softq.QuantConfig(kv_scales="channel", **FAST))


def _decode(model, ids, prefill):
    """Logits of a prefill of ``prefill`` tokens and one-token cached steps over the rest, and the final cache."""
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        cache, logits = out.cache, [out.logits]
        for i in range(prefill, ids.shape[1]):
            out = model(ids[:, i:i + 1], cache=cache, use_cache=True)
            cache = out.cache
            logits.append(out.logits)
    return torch.cat(logits, 1), cache


@pytest.mark.parametrize("scales", ["tensor", "channel"])
def test_int8_cache_stores_codes_and_decodes_as_the_full_forward(llama, per_channel, scales):
    model, calib, ids = llama
    qmodel = per_channel if scales == "channel" else softq.quantize(model, calib, softq.QuantConfig(**FAST))
    with torch.no_grad():
        full = qmodel(ids, use_cache=False).logits
        prefilled = qmodel(ids)  # use_cache from the config: the int8 cache, read back exactly as the points round
    assert isinstance(prefilled.cache, Int8KVCache)
    assert torch.equal(prefilled.logits, full)
    decoded, cache = _decode(qmodel, ids, 12)
    assert isinstance(cache, Int8KVCache)
    assert (decoded - full).abs().max() < 1e-5
    layers, (b, n) = qmodel.config.num_hidden_layers, ids.shape
    kv, d = qmodel.config.num_key_value_heads, qmodel.config.hidden_size // qmodel.config.num_attention_heads
    for layer in cache.layers:
        assert layer.keys.dtype == torch.int8 and layer.values.dtype == torch.int8
        assert tuple(layer.keys.shape) == tuple(layer.values.shape) == (b, kv, n, d)
    params = 1 if scales == "tensor" else kv * d  # scales and zero points per point
    assert cache_bytes(cache) == layers * 2 * (b * kv * n * d + params * 5)
    with torch.no_grad():
        floats = qmodel(ids, cache=DynamicCache(config=qmodel.config), use_cache=True).cache
    assert isinstance(floats, Int8KVCache)  # an empty DynamicCache (what generate makes) is replaced
    float_bytes = layers * 2 * b * kv * n * d * 4
    assert cache_bytes(cache) <= 0.3 * float_bytes


def test_float_cache_config_and_generate(llama, per_channel):
    model, calib, ids = llama
    floated = softq.quantize(model, calib, softq.QuantConfig(kv_scales="channel", kv_cache="float", **FAST))
    with torch.no_grad():
        out = floated(ids)
        assert type(out.cache) is DynamicCache and out.cache.layers[0].keys.dtype == torch.float32
        assert torch.equal(out.logits, per_channel(ids).logits)  # the same codes, stored or rounded at each read
        kwargs = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
        a = per_channel.generate(ids[:1, :6], **kwargs)
        b = floated.generate(ids[:1, :6], **kwargs)
    assert isinstance(a.cache, Int8KVCache) and type(b.cache) is DynamicCache
    assert torch.equal(a.sequences, b.sequences)


def test_integer_reference_reads_the_codes(llama, per_channel):
    """One decode step's P.V per layer: the numpy integer GEMM of row codes and stored V codes against torch."""
    _, _, ids = llama
    attn = [layer.self_attn for layer in per_channel.model.layers]
    seen = {}
    hooks = [a.softq.q.register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(("q", k), o))
             for k, a in enumerate(attn)]
    hooks += [a.softq.pv.register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(("pv", k), o))
              for k, a in enumerate(attn)]
    try:
        _, cache = _decode(per_channel, ids, ids.shape[1] - 1)
    finally:
        for h in hooks:
            h.remove()
    for k, a in enumerate(attn):
        layer = cache.layers[k]
        kp, vp = layer.key_point, layer.value_point
        ref = cache_attention(seen["q", k].numpy(), layer.keys.numpy(), kp.scale.numpy(),
                              stored_zero_point(kp).numpy(), layer.values.numpy(), vp.scale.numpy(),
                              stored_zero_point(vp).numpy(), a.scaling, softmax_bits=8)
        np.testing.assert_allclose(ref, seen["pv", k].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("field, value", [("kv_cache", "int4"), ("kv_cache", None), ("kv_scales", "token"),
                                          ("act_bits", 12)])
def test_bad_kv_config_is_refused_in_one_line(field, value):
    kwargs = {field: value, "kv_cache": "int8"} if field == "act_bits" else {field: value}
    with pytest.raises(ValueError) as err:
        softq.QuantConfig(**kwargs)
    assert "\n" not in str(err.value) and field.split("_")[0] in str(err.value)
    assert softq.QuantConfig(act_bits=12).int8_kv_cache is False  # "auto": float where the codes do not fit int8


def test_kv_cache_factory_refuses_a_float_model(llama):
    with pytest.raises(ValueError, match="softq.quantize"):
        softq.kv_cache(llama[0])


def test_save_load_keeps_the_kv_scales(llama, per_channel, tmp_path):
    _, _, ids = llama
    softq.save(per_channel, tmp_path / "q")
    loaded = softq.load(tmp_path / "q")
    for a, b in zip(per_channel.model.layers, loaded.model.layers):
        for point in ("k", "v"):
            pa, pb = getattr(a.self_attn.softq, point), getattr(b.self_attn.softq, point)
            assert type(pb) is type(pa)
            assert torch.equal(pa.scale, pb.scale) and torch.equal(pa.zero_point, pb.zero_point)
    decoded, cache = _decode(loaded, ids, 12)
    assert isinstance(cache, Int8KVCache)
    assert torch.equal(decoded, _decode(per_channel, ids, 12)[0])
