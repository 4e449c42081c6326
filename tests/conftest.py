"""Tiny Hugging Face models built from configs (no downloads), shared by the test files."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import transformers

# The benchmarks' reference workloads (a character LM, a digits ViT) are not part of the installed package: tests
# of them import ``workloads`` from benchmarks/, as the benchmark scripts do.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
# With pytest-xdist's workers (one per core) each worker takes one thread; alone, the run takes both cores.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models train as fast on one thread, and far faster on a busy machine; used by a module with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer model of ``family`` with hidden size 32 and 4 heads, in eval mode."""
    torch.manual_seed(seed)
    common = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    elif family == "opt":
        cfg = transformers.OPTConfig(vocab_size=64, ffn_dim=64, max_position_embeddings=128, word_embed_proj_dim=32,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=1, **common)
        model = transformers.OPTForCausalLM(cfg)
    elif family == "bert":
        model = transformers.BertForSequenceClassification(
            transformers.BertConfig(vocab_size=64, max_position_embeddings=128, num_labels=3, **common))
    elif family == "roberta":
        model = transformers.RobertaForSequenceClassification(
            transformers.RobertaConfig(vocab_size=64, max_position_embeddings=130, num_labels=3, pad_token_id=1, **common))
    elif family == "vit":
        model = transformers.ViTForImageClassification(
            transformers.ViTConfig(image_size=16, patch_size=4, num_channels=1, num_labels=10, **common))
    elif family == "deit":
        model = transformers.DeiTForImageClassification(
            transformers.DeiTConfig(image_size=16, patch_size=4, num_channels=1, num_labels=10, **common))
    else:
        raise ValueError(family)
    if family in ("vit", "deit"):
        # Fresh ViT/DeiT class tokens are (near) zero, so the token the classifier reads has
        # almost no variance and LayerNorm blows up any rounding: trained models never look
        # like that.  Give the special tokens a trained-like spread.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("cls_token", "distillation_token")):
                    param.normal_()
    return model.eval()


def tiny_inputs(family: str, batch: int = 2, seq: int = 24, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if family in ("vit", "deit"):
        return {"pixel_values": torch.randn(batch, 1, 16, 16, generator=g)}
    return {"input_ids": torch.randint(2, 64, (batch, seq), generator=g)}


def padded_logit_error(qmodel, onnx_model, family: str, seq: int, pad_from: int, seed: int) -> float:
    """max |ONNX - torch| / max |torch| logits over the valid tokens of a batch of 2 whose second
    sequence is padded from position ``pad_from`` (onnxruntime, all optimisations)."""
    import numpy as np

    from softq.export import onnx_utils

    inputs = tiny_inputs(family, batch=2, seq=seq, seed=seed)
    mask = torch.ones_like(inputs["input_ids"])
    mask[1, pad_from:] = 0
    with torch.no_grad():
        ref = qmodel(input_ids=inputs["input_ids"], attention_mask=mask).logits.numpy()
    out = onnx_utils.run(onnx_model, {"input_ids": inputs["input_ids"].numpy(), "attention_mask": mask.numpy()},
                         "all")[0]
    valid = mask.numpy().astype(bool)
    return float(np.abs(out - ref)[valid].max() / np.abs(ref).max())


def assert_cached_decoding_matches(qmodel, ids, prefix: int) -> None:
    """The logits of decoding ``ids`` with a KV cache (``prefix`` tokens at once, then one at a time) equal one
    full pass without the cache, to float rounding."""
    import torch

    with torch.no_grad():
        full = qmodel(input_ids=ids, use_cache=False).logits
        out = qmodel(input_ids=ids[:, :prefix], use_cache=True)
        steps, past = [out.logits], out.past_key_values
        for t in range(prefix, ids.shape[1]):
            out = qmodel(input_ids=ids[:, t:t + 1], past_key_values=past, use_cache=True)
            steps.append(out.logits)
            past = out.past_key_values
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5 * float(full.abs().max()))


@pytest.fixture
def make_tiny():
    return tiny_model
