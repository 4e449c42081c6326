"""The reference workloads (benchmarks/workloads): data splits, tokenizer, tiny models that really learn, metrics, cache round trips."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import workloads as W

GATED_CLIPPED = {"softmax": "clipped", "alpha": 4.0, "gated": True, "gate_pi_init": 0.25}


@pytest.fixture(scope="module")
def tok() -> W.CharTokenizer:
    return W.CharTokenizer()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SOFTQ_CACHE", str(cache))
    return cache


def test_cache_dir_follows_env(tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert W.cache_dir() == tmp_cache
    monkeypatch.delenv("SOFTQ_CACHE")
    assert W.cache_dir() == Path.home() / ".cache" / "softq"


def test_tokenizer_round_trip_and_errors(tok: W.CharTokenizer, tmp_path: Path) -> None:
    train, heldout = W.char_corpus()
    sample = heldout[:5000]
    ids = tok.encode(sample)
    assert tok.decode(ids) == sample
    assert tok.decode(torch.tensor(ids)) == sample
    assert max(ids) < tok.vocab_size and tok.vocab_size == len(set(train + heldout))
    assert W.CharTokenizer().chars == tok.chars  # deterministic vocabulary
    tok.save(tmp_path / "t.json")
    assert W.CharTokenizer.load(tmp_path / "t.json").chars == tok.chars
    with pytest.raises(ValueError, match="not in the tokenizer"):
        tok.encode("\u2603 snowman")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_text_split_is_deterministic_and_ten_percent() -> None:
    train, heldout = W.char_corpus()
    assert (train, heldout) == W.char_corpus()
    total = len(train) + len(heldout)
    assert abs(len(heldout) / total - 0.1) < 1e-4
    assert len(train) > 400_000 and "def" in train
    assert not heldout.startswith(train[-200:])  # contiguous split: no overlap


def test_lm_windows(tok: W.CharTokenizer) -> None:
    train, heldout = W.char_corpus()
    evals = W.lm_eval_inputs(128, None, tok)
    assert len(evals) == len(heldout) // 128
    assert tok.decode(evals[1]["input_ids"]) == heldout[128:256]  # non-overlapping, in order
    assert all(e["input_ids"].shape == (1, 128) for e in evals)
    assert len(W.lm_eval_inputs(128, 5, tok)) == 5
    calib = W.lm_calib_inputs(4, 64, tok, seed=3)
    again = W.lm_calib_inputs(4, 64, tok, seed=3)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(calib, again))
    for window in calib:
        assert tok.decode(window["input_ids"]) in train  # calibration never sees heldout text
    batch = next(W.lm_batches("train", 32, 3, 0, tok))
    assert batch["input_ids"].shape == (3, 32) and torch.equal(batch["labels"], batch["input_ids"])
    with pytest.raises(ValueError, match="split"):
        next(W.lm_batches("valid", 32, 3, 0, tok))


def test_uniform_model_perplexity_is_vocab_size(tok: W.CharTokenizer) -> None:
    torch.manual_seed(0)
    model = W.build_model(W.lm_config("tiny", vocab_size=tok.vocab_size))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # tied with the embedding: every logit is 0 -> uniform
    ppl = W.perplexity(model, W.lm_eval_inputs(128, 3, tok))
    assert ppl == pytest.approx(tok.vocab_size, rel=1e-5)


def test_perplexity_is_token_weighted_and_respects_mask(tok: W.CharTokenizer) -> None:
    torch.manual_seed(0)
    model = W.build_model(W.lm_config("tiny", vocab_size=tok.vocab_size)).eval()
    long, short = W.lm_eval_inputs(128, 1, tok)[0], {"input_ids": W.lm_eval_inputs(17, 1, tok)[0]["input_ids"]}
    with torch.no_grad():
        nll_long = model(**long, labels=long["input_ids"]).loss.item()
        nll_short = model(**short, labels=short["input_ids"]).loss.item()
    expected = math.exp((127 * nll_long + 16 * nll_short) / (127 + 16))
    assert W.perplexity(model, [long, short]) == pytest.approx(expected, rel=1e-5)
    # Padding the short window must not change anything once masked out.
    padded = torch.cat([short["input_ids"], torch.zeros(1, 5, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 17), torch.zeros(1, 5)], dim=1).long()
    assert W.perplexity(model, [{"input_ids": padded, "attention_mask": mask}]) == pytest.approx(
        math.exp(nll_short), rel=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "opt", "llama"])
def test_tiny_lm_learns(family: str, tok: W.CharTokenizer) -> None:
    evals = W.lm_eval_inputs(128, 4, tok)
    torch.manual_seed(0)
    untrained = W.perplexity(W.build_model(W.lm_config("tiny", family, vocab_size=tok.vocab_size)), evals)
    model = W.train_lm("tiny", seed=0, steps=30, family=family, tokenizer=tok, progress=False)
    trained = W.perplexity(model, evals)
    assert trained < 0.6 * untrained and trained < 40


def test_training_is_deterministic_by_seed(tok: W.CharTokenizer) -> None:
    a = W.train_lm("tiny", seed=1, steps=3, tokenizer=tok, progress=False)
    b = W.train_lm("tiny", seed=1, steps=3, tokenizer=tok, progress=False)
    c = W.train_lm("tiny", seed=2, steps=3, tokenizer=tok, progress=False)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_digits_split_shapes_and_tokens() -> None:
    x_train, y_train = W.digits_data("train")
    x_test, y_test = W.digits_data("heldout")
    assert x_train.shape == (1437, 1, 32, 32) and x_test.shape == (360, 1, 32, 32)
    assert torch.equal(W.digits_data("heldout")[0], x_test)  # deterministic
    assert -1.0 <= float(x_train.min()) and float(x_train.max()) <= 1.0
    counts = torch.bincount(y_test, minlength=10)
    assert int(counts.min()) >= 35 and int(counts.max()) <= 37  # stratified
    model = W.build_model(W.vit_config("reference"))
    tokens = model.vit.embeddings(x_test[:2])
    assert tokens.shape[1] == 64 + 1  # 64 patches + CLS
    inputs = W.vit_eval_inputs(32, batch_size=100)
    assert [len(i["pixel_values"]) for i in inputs] == [100, 100, 100, 60]
    calib = W.vit_calib_inputs(10, 32, seed=0, batch_size=4)
    assert [len(c["pixel_values"]) for c in calib] == [4, 4, 2]


def test_tiny_vit_beats_chance() -> None:
    model = W.train_vit("tiny", seed=0, progress=False)
    acc = W.top1(model, W.vit_eval_inputs(16), W.digits_data("heldout", 16)[1])
    assert acc > 40.0  # chance is 10%; 300 tiny steps reach ~65%


def test_lm_cache_round_trip_gated_clipped(tok: W.CharTokenizer, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = W.reference_lm(0, GATED_CLIPPED, size="tiny", steps=4, progress=False)
    gates = [n for n in model.state_dict() if ".softq.gate." in n]
    assert len(gates) == 4  # 2 layers x (weight, bias)

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached model should have been loaded, not retrained")

    monkeypatch.setattr(W.cache, "train_lm", no_training)  # what reference_lm calls
    loaded, loaded_tok = W.reference_lm(0, GATED_CLIPPED, size="tiny", steps=4, progress=False)
    assert loaded_tok.chars == tok.chars
    assert loaded.config.softq_softmax == "clipped" and loaded.config.softq_gated
    points = loaded.transformer.h[0].attn.softq
    assert points.softmax_name == "clipped" and points.gate is not None
    for name, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    x = W.lm_eval_inputs(128, 2, tok)[1]
    with torch.no_grad():
        assert torch.equal(model(**x).logits, loaded(**x).logits)
    # The gate really acts: closing it changes the output.
    with torch.no_grad():
        points.gate.bias.fill_(-20.0)
        assert not torch.allclose(model(**x).logits, loaded(**x).logits)
    assert (list(tmp_cache.iterdir())[0] / "meta.json").is_file()


def test_llama_lm_is_llama_and_loads_from_cache(tok: W.CharTokenizer, tmp_cache: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = W.reference_lm(0, None, "llama", size="tiny", steps=3, progress=False)
    config = model.config
    assert config.model_type == "llama" and W.lm_context(config) == 128
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert model.model.layers[0].self_attn.k_proj.out_features == config.num_key_value_heads * config.head_dim
    assert not any(name.endswith(".bias") for name, _ in model.named_parameters())
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    assert not hasattr(model.model, "embed_positions")  # rotary positions, no position table
    (entry,) = list(tmp_cache.iterdir())
    assert entry.name.startswith("lm-llama-tiny-vanilla-seed0-steps3-")
    assert W.cached_meta(entry)["family"] == "llama"

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached model should have been loaded, not retrained")

    monkeypatch.setattr(W.cache, "train_lm", no_training)
    loaded, _ = W.reference_lm(0, None, "llama", size="tiny", steps=3, progress=False)
    x = W.lm_eval_inputs(128, 1, tok)[0]
    with torch.no_grad():
        assert torch.equal(model(**x).logits, loaded(**x).logits)


def test_vit_cache_round_trip(tmp_cache: Path) -> None:
    model = W.reference_vit(0, size="tiny", steps=3, progress=False)
    loaded = W.reference_vit(0, size="tiny", steps=3, progress=False)
    x = W.vit_eval_inputs(16, batch_size=8)[0]
    with torch.no_grad():
        assert torch.equal(model(**x).logits, loaded(**x).logits)
    with pytest.raises(FileNotFoundError, match="not a softq model"):
        W.load_model(tmp_cache)


def test_bad_sizes_are_named() -> None:
    with pytest.raises(ValueError, match="LM size 'huge'"):
        W.lm_config("huge")
    with pytest.raises(ValueError, match="family 'bloom'"):
        W.lm_config("tiny", "bloom")
    with pytest.raises(ValueError, match="ViT size"):
        W.vit_config("big")
