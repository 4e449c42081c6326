"""softq.calib.outlier_finetune: distillation fine-tune of a pretrained encoder to gated / clipped attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from softq.calib.outlier_finetune import (OutlierFinetuneConfig, finetune_outliers, gate_values, make_student,
                                          window_texts)
from softq.models import attention_modules

LETTERS = "abcdefghijklmnopqrstuvwxyz"
TEXTS = [
    "the quick brown fox jumps over the lazy dog and runs away into the forest",
    "a module is a file containing python definitions and statements for reuse",
    "exceptions are raised when an error is detected during the execution of code",
    "the import statement combines two operations it searches for the named module",
    "a class definition is an executable statement that binds the class name",
    "when a generator function is called it returns an iterator known as a generator",
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    """A character-level WordPiece tokenizer (letters and ##letters), built in memory."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *LETTERS, *("##" + c for c in LETTERS)]
    tok = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    assert len(tok) == len(vocab)
    return tok


def tiny_bert(tokenizer, seed: int = 0) -> torch.nn.Module:
    """A 2-layer BERT whose [CLS] token carries a large value in one dimension after each FFN (a planted outlier)."""
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=128)
    model = transformers.BertModel(cfg, add_pooling_layer=False)
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.output.dense.bias[5] = 12.0  # every token's residual gets |x| ~ 12 in dim 5
    return model.eval()


def _inputs(tokenizer):
    return tokenizer(TEXTS[:3], padding=True, truncation=True, max_length=40, return_tensors="pt")


def small_config(**kw) -> OutlierFinetuneConfig:
    base = dict(steps=6, batch_size=3, max_length=24, min_words=3, lr=1e-3, gate_lr=1e-2, warmup=1,
                penalty_threshold=4.0, constant_sink=False)  # the sink has tests of its own (test_constant_sink.py)
    return OutlierFinetuneConfig(**{**base, **kw})


def test_gated_student_preserves_function_at_step0(tokenizer) -> None:
    model = tiny_bert(tokenizer)
    x = _inputs(tokenizer)
    with torch.no_grad():
        before = model(**x).last_hidden_state
        gated = make_student(model, small_config(method="gated", pi_init=0.3))
        after = gated(**x).last_hidden_state
        clipped = make_student(model, small_config(method="clipped", clip_alpha=2.0))
        clipped_out = clipped(**x).last_hidden_state
    points = [m.softq for _, m in attention_modules(gated)]
    assert all(p.gate is not None for p in points)
    assert torch.allclose(after, before, atol=1e-5)
    # the teacher is untouched, and clipped softmax is not function-preserving (the fine-tune repairs it)
    assert not getattr(model.config, "softq_gated", False)
    assert (clipped_out - before).abs().max() > 1e-3


def test_resume_reproduces_uninterrupted_run(tokenizer, tmp_path: Path) -> None:
    model = tiny_bert(tokenizer)
    cfg = small_config(method="gated")
    full = finetune_outliers(model, tokenizer, TEXTS, cfg, progress=False, device="cpu")
    ckpt = tmp_path / "run.pt"
    first = finetune_outliers(model, tokenizer, TEXTS, cfg, checkpoint=ckpt, checkpoint_every=2, stop_after=4,
                              progress=False, device="cpu")
    assert first.step == 4 and len(first.history) == 4
    resumed = finetune_outliers(model, tokenizer, TEXTS, cfg, checkpoint=ckpt, resume=True, progress=False,
                                device="cpu")
    assert resumed.step == 6
    assert resumed.history == full.history
    full_state, resumed_state = full.model.state_dict(), resumed.model.state_dict()
    assert full_state.keys() == resumed_state.keys()
    assert all(torch.equal(full_state[k], resumed_state[k]) for k in full_state)
    # a changed config or a fresh run over an existing checkpoint is refused
    with pytest.raises(ValueError, match="different config .*lr"):
        finetune_outliers(model, tokenizer, TEXTS, small_config(method="gated", lr=2e-3), checkpoint=ckpt,
                          resume=True, progress=False, device="cpu")
    with pytest.raises(FileExistsError):
        finetune_outliers(model, tokenizer, TEXTS, cfg, checkpoint=ckpt, progress=False, device="cpu")
    with pytest.raises(ValueError, match="not the teacher"):
        finetune_outliers(tiny_bert(tokenizer, seed=1), tokenizer, TEXTS, cfg, checkpoint=ckpt, resume=True,
                          progress=False, device="cpu")


def test_penalty_shrinks_outliers_while_distillation_holds(tokenizer) -> None:
    model = tiny_bert(tokenizer)
    cfg = small_config(method="none", steps=40, lr=1e-2, penalty_weight=1.0, embed_weight=1.0, hidden_weight=0.1)
    result = finetune_outliers(model, tokenizer, TEXTS, cfg, progress=False, device="cpu")
    first, last = result.history[0], result.history[-1]
    assert first["penalty"] > 0.3
    assert last["penalty"] < 0.05 * first["penalty"]
    assert last["ln_input_max"] < 0.5 * first["ln_input_max"]
    x = _inputs(tokenizer)
    with torch.no_grad():
        t, s = model(**x).last_hidden_state.mean(1), result.model(**x).last_hidden_state.mean(1)
    assert torch.nn.functional.cosine_similarity(t, s).min() > 0.98
    # pure distillation (no penalty) leaves the planted outlier where it is
    keep = finetune_outliers(model, tokenizer, TEXTS, small_config(method="none", steps=40, lr=1e-2, penalty_weight=0.0),
                             progress=False, device="cpu")
    assert keep.history[-1]["ln_input_max"] > 0.9 * keep.history[0]["ln_input_max"]


def test_gate_values_report(tokenizer) -> None:
    model = tiny_bert(tokenizer)
    gated = make_student(model, small_config(method="gated", pi_init=0.25))
    batches = [dict(_inputs(tokenizer))]
    report = gate_values(gated, batches)
    assert len(report) == 2 and len(report[0]["mean"]) == 4
    assert report[0]["mean"][0] == pytest.approx(0.25, abs=1e-5)  # fresh gates: weights 0, bias logit(pi)
    assert gate_values(model, batches) == []
    # batches without an attention mask (unpadded text, a vision model) failed with KeyError: 'attention_mask'
    unmasked = [{"input_ids": batches[0]["input_ids"]}]
    assert gate_values(gated, unmasked)[0]["mean"][0] == pytest.approx(0.25, abs=1e-5)


def test_windows_are_deterministic_per_step() -> None:
    a = window_texts(TEXTS, 4, 3, seed=0, step=7)
    assert a == window_texts(TEXTS, 4, 3, seed=0, step=7)
    assert a != window_texts(TEXTS, 4, 3, seed=0, step=8)
    assert all(len(t.split()) >= 3 for t in a)


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="softpick"), "method must be one of"),
    (dict(steps=0), "steps must be at least 1"),
    (dict(lr=0.0), "lr must be positive"),
    (dict(pi_init=1.0), r"pi_init must be in \(0, 1\)"),
    (dict(penalty_weight=-1.0), "penalty_weight must be non-negative"),
    (dict(embed_weight=0.0, hidden_weight=0.0), "nothing ties the student"),
    (dict(batch_size=2.5), "batch_size must be an integer"),
    (dict(penalty_threshold=float("nan")), "penalty_threshold must be a finite number"),
    (dict(pooling="max"), "pooling must be one of"),
])
def test_bad_config_is_one_clear_value_error(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message) as err:
        OutlierFinetuneConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_bad_inputs(tokenizer) -> None:
    model = tiny_bert(tokenizer)
    with pytest.raises(ValueError, match="at least one non-empty training text"):
        finetune_outliers(model, tokenizer, ["  "], small_config(), progress=False)
    vit = transformers.ViTModel(transformers.ViTConfig(image_size=16, patch_size=4, num_channels=1, hidden_size=32,
                                                         num_hidden_layers=1, num_attention_heads=4, intermediate_size=64))
    with pytest.raises(ValueError, match="trains on tokenized text, but ViTModel reads pixel_values"):
        finetune_outliers(vit, tokenizer, TEXTS, small_config(), progress=False)
    gated = make_student(model, small_config(method="gated"))
    with pytest.raises(ValueError, match="already has gated attention"):
        finetune_outliers(gated, tokenizer, TEXTS, small_config(), progress=False)
    with pytest.raises(ValueError, match="resume=True needs a checkpoint"):
        finetune_outliers(model, tokenizer, TEXTS, small_config(), resume=True, progress=False)
    # one string trained on its letters; non-strings were dropped; a max_length past the position table and a
    # missing CUDA device failed deep in torch
    for texts, message in ((" ".join(TEXTS), "got one string"), ([*TEXTS, b"bytes"], "got a bytes among them")):
        with pytest.raises(ValueError, match=message):
            finetune_outliers(model, tokenizer, texts, small_config(), progress=False)
    for config in (small_config(max_length=200), small_config(max_length=200, constant_sink=True)):
        with pytest.raises(ValueError, match=r"max_length is 200, but this model takes at most 128 tokens"):
            finetune_outliers(model, tokenizer, TEXTS, config, progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="this torch has no CUDA device"):
            finetune_outliers(model, tokenizer, TEXTS, small_config(), device="cuda", progress=False)
    with pytest.raises(ValueError, match="is not a torch device"):
        finetune_outliers(model, tokenizer, TEXTS, small_config(), device="gpu0", progress=False)


def test_minilm_gated_conversion_preserves_embeddings() -> None:
    pytest.importorskip("all_minilm_l6_v2")
    from softq import corpora, hf

    loaded = hf.load_minilm(64)
    batch = loaded.tokenize(corpora.text_split("eval", 4), 64)
    student = make_student(loaded.model, OutlierFinetuneConfig(method="gated", pi_init=0.5, constant_sink=False))
    before, after = loaded.encode([batch]), loaded.encode([batch], student)
    assert torch.nn.functional.cosine_similarity(before, after).min() > 0.99999
