"""softq.calib.train and the reference models' ``train`` command (benchmarks/reference.py): function-preserving gated conversion, fine-tuning, resumable runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workloads as W
from softq.calib.train import convert_to_gated, load_checkpoint
from workloads.resumable import finetune_to_gated
from reference import main as reference_main
from softq.cli import main as softq_main
from softq.models import attention_modules


pytestmark = pytest.mark.usefixtures("one_thread")


def _model_and_input(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "vit":
        model = W.build_model(W.vit_config("tiny"))
        x = {"pixel_values": W.digits_data("heldout", 16)[0][:4]}
    else:
        tok = W.CharTokenizer()
        model = W.build_model(W.lm_config("tiny", family, vocab_size=tok.vocab_size))
        x = W.lm_eval_inputs(128, 2, tok)[1]
    # Give weights a trained-like spread so a wrong conversion cannot hide behind tiny activations.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 or "cls_token" in name:
                p.normal_(0.0, 0.2)
    return model.eval(), x


@pytest.mark.parametrize("family", ["gpt2", "opt", "vit"])
def test_convert_to_gated_preserves_function(family: str) -> None:
    model, x = _model_and_input(family)
    with torch.no_grad():
        before = model(**x).logits
    convert_to_gated(model, pi_init=0.25)
    points = [m.softq for _, m in attention_modules(model)]
    assert all(p.gate is not None for p in points) and model.config.softq_gated
    assert torch.allclose(torch.sigmoid(points[0].gate.bias), torch.full((points[0].num_heads,), 0.25))
    with torch.no_grad():
        after = model(**x).logits
    assert (after - before).abs().max() < 1e-2 * max(1.0, float(before.abs().max())) / 10
    # Without the output-projection compensation, the same gates do change the function.
    naive, _ = _model_and_input(family)
    from softq.attention import configure_attention

    configure_attention(naive, gated=True, gate_pi_init=0.25)
    with torch.no_grad():
        assert (naive(**x).logits - before).abs().max() > 1e-1
    with pytest.raises(ValueError, match="already has gated attention"):
        convert_to_gated(model)
    # a quantized model's projections would be rescaled under its weight codes (and its cached dequantized
    # weights, edited through .data, were used as they were): convert the float model, then quantize
    import softq

    quantized = softq.quantize(_model_and_input(family)[0], [x])
    with pytest.raises(ValueError, match="convert the float model, then quantize"):
        convert_to_gated(quantized)


def test_convert_keeps_softmax_variant_and_rejects_bad_pi() -> None:
    model, x = _model_and_input("gpt2")
    from softq.attention import configure_attention

    configure_attention(model, softmax="clipped", alpha=4.0)
    with torch.no_grad():
        before = model(**x).logits
    convert_to_gated(model, pi_init=0.5)
    assert model.config.softq_softmax == "clipped"
    with torch.no_grad():
        assert (model(**x).logits - before).abs().max() < 1e-3
    other, _ = _model_and_input("gpt2")
    with pytest.raises(ValueError, match="pi_init"):
        convert_to_gated(other, pi_init=1.0)


def test_finetune_to_gated_trains_gates_and_round_trips(tmp_path: Path) -> None:
    tok = W.CharTokenizer()
    model = W.train_lm("tiny", seed=0, steps=30, tokenizer=tok, progress=False)
    evals = W.lm_eval_inputs(128, 3, tok)
    base = W.perplexity(model, evals)
    model, losses = finetune_to_gated(model, steps=15, pi_init=0.5, lr=1e-3, tokenizer=tok, progress=False)
    assert len(losses) == 15
    gate = model.transformer.h[0].attn.softq.gate
    assert gate.weight.abs().max() > 0  # the gates learned something
    assert W.perplexity(model, evals) < base * 1.05  # fine-tuning did not break the model
    W.save_model(model, tmp_path / "m", tok)
    loaded = W.load_model(tmp_path / "m")
    with torch.no_grad():
        assert torch.equal(loaded(**evals[0]).logits, model(**evals[0]).logits)


def _train(out: Path, *extra: str) -> int:
    return reference_main(["train", "--model", "lm", "--size", "tiny", "--steps", "6", "--checkpoint-every", "2",
                       "--softmax", "clipped", "--out", str(out), "--quiet", *extra])


def test_train_cli_resume_continues_from_saved_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _train(tmp_path / "full") == 0
    assert _train(tmp_path / "split", "--stop-after", "3") == 0
    assert "stopped at step 3/6" in capsys.readouterr().out
    ckpt = load_checkpoint(tmp_path / "split" / "checkpoint.pt")
    assert ckpt["step"] == 3 and len(ckpt["losses"]) == 3
    assert not (tmp_path / "split" / "model").exists()
    # Starting again without --resume would silently lose the run.
    assert _train(tmp_path / "split") == 1
    assert "pass --resume" in capsys.readouterr().err
    assert _train(tmp_path / "split", "--resume") == 0
    assert "heldout perplexity" in capsys.readouterr().out
    resumed = load_checkpoint(tmp_path / "split" / "checkpoint.pt")
    full = load_checkpoint(tmp_path / "full" / "checkpoint.pt")
    assert resumed["step"] == 6 and resumed["losses"] == full["losses"]
    for name, value in full["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][name]), name
    model = W.load_model(tmp_path / "split" / "model")
    assert model.config.softq_softmax == "clipped"


def test_train_cli_resume_rejects_other_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _train(tmp_path / "r", "--stop-after", "2") == 0
    assert reference_main(["train", "--model", "lm", "--size", "tiny", "--steps", "6", "--seed", "1",
                       "--out", str(tmp_path / "r"), "--quiet", "--resume", "--softmax", "clipped"]) == 1
    assert "seed" in capsys.readouterr().err
    assert reference_main(["train", "--model", "vit", "--size", "tiny", "--out", str(tmp_path / "none"),
                       "--quiet", "--resume"]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    # an explicit exact softmax is a mismatch with a clipped checkpoint, not "as saved"
    lm = ["train", "--model", "lm", "--size", "tiny", "--out", str(tmp_path / "r"), "--quiet", "--resume"]
    assert reference_main([*lm, "--softmax", "softmax"]) == 1
    assert "trained with softmax='clipped', not 'softmax'" in capsys.readouterr().err
    # resumed without attention flags: it continues as saved, and says so (it used to print "vanilla")
    assert reference_main(lm) == 0
    assert "trained lm tiny alpha=0.5,softmax=clipped to step 6" in capsys.readouterr().out
    # a model written by the reference train command is not a Hugging Face directory: one line saying what it is
    assert softq_main(["quantize", str(tmp_path / "r" / "model"), "--no-eval"]) == 1
    assert "holds a state dict (weights.pt) with no Hugging Face weights" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"", b"hello", None])
def test_train_cli_unreadable_checkpoint_or_bad_out_is_one_line(tmp_path: Path, capsys, content) -> None:
    if content is None:  # --out is a file: refused before the first step, not when the first checkpoint is saved
        (tmp_path / "out").write_text("a file")
        message = "is a file; give a directory"
    else:
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "checkpoint.pt").write_bytes(content)
        message = "cannot be read (truncated or not a softq training checkpoint"
    assert _train(tmp_path / "out", "--resume") == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_train_cli_refuses_flags_it_would_ignore_and_outs_it_would_clobber(tmp_path: Path, capsys) -> None:
    """--lr (of --finetune-gated) and --pi without --gated did nothing, silently; an --out holding model/ but no
    checkpoint lost model/ (and what else it held) at the end of the run; --out under a file failed at the first
    checkpoint, after training.  Each is one line now, before the first step."""
    lm = ["train", "--model", "lm", "--size", "tiny", "--steps", "2", "--quiet"]
    for extra, message in ((["--lr", "100"], "--lr is the learning rate of --finetune-gated"),
                           (["--pi", "0.9"], "--pi sets the gates' initial opening")):
        assert reference_main([*lm, *extra, "--out", str(tmp_path / "x")]) == 1
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1 and not (tmp_path / "x").exists()
    (tmp_path / "kept" / "model").mkdir(parents=True)
    (tmp_path / "kept" / "model" / "notes.txt").write_text("mine")
    assert reference_main([*lm, "--out", str(tmp_path / "kept")]) == 1
    assert "already holds model/ and no checkpoint.pt" in capsys.readouterr().err
    assert (tmp_path / "kept" / "model" / "notes.txt").read_text() == "mine"
    (tmp_path / "a_file").write_text("x")
    assert reference_main([*lm, "--out", str(tmp_path / "a_file" / "run")]) == 1
    assert "a_file is a file" in capsys.readouterr().err


def test_train_cli_clipped_default_keeps_a_fresh_models_rows_alive() -> None:
    """softq train's clipped softmax took alpha 4 (the registry default): every row of a fresh model is clipped to
    zero, no gradient reaches Q and K (docs/outliers.md section 3).  It trains from scratch: alpha 0.5."""
    import argparse

    from workloads.train_cli import attention_from_args

    from softq.attention import configure_attention

    options = attention_from_args(argparse.Namespace(softmax="clipped", alpha=None, gated=False, pi=None, lr=None))
    model = W.build_model(W.vit_config("tiny"))
    configure_attention(model, **options)
    x = W.vit_eval_inputs(model.config.image_size, batch_size=2)[0]["pixel_values"]
    out = model(pixel_values=x, output_attentions=True)
    assert all(a.max() > 0 for a in out.attentions)  # rows survive the clip
    out.logits.sum().backward()
    query = next(p for n, p in model.named_parameters() if "q_proj" in n and n.endswith("weight"))
    assert query.grad.abs().max() > 0


def test_clipped_softmax_refuses_non_finite_parameters(capsys) -> None:
    from softq.softmax import get_softmax

    scores = torch.randn(1, 4)
    for params in ({"alpha": float("nan")}, {"alpha": float("inf")}, {"zeta": float("inf")}):
        with pytest.raises(ValueError, match="clipped softmax.s (alpha|zeta) must be in"):
            get_softmax("clipped")(scores, None, **params)
    assert reference_main(["train", "--model", "lm", "--size", "tiny", "--steps", "2", "--softmax", "clipped",
                       "--alpha", "nan", "--out", "unused", "--quiet"]) == 1
    assert "clipped softmax's alpha must be in [0, 1e+06], got nan" in capsys.readouterr().err


def test_train_cli_vit_gated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert reference_main(["train", "--model", "vit", "--size", "tiny", "--steps", "3", "--gated", "--pi", "0.25",
                       "--out", str(tmp_path / "v"), "--quiet"]) == 0
    assert "heldout top-1" in capsys.readouterr().out
    model = W.load_model(tmp_path / "v" / "model")
    assert model.config.softq_gated


def test_train_cli_finetune_gated_from_saved_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = W.CharTokenizer()
    W.save_model(W.train_lm("tiny", seed=0, steps=5, tokenizer=tok, progress=False), tmp_path / "base", tok)
    args = ["train", "--model", "lm", "--size", "tiny", "--finetune-gated", str(tmp_path / "base"), "--steps", "3",
            "--pi", "0.25", "--out", str(tmp_path / "g"), "--quiet"]
    assert reference_main(args) == 0
    assert "fine-tuned 3 steps" in capsys.readouterr().out
    gated = W.load_model(tmp_path / "g" / "model")
    assert gated.config.softq_gated
    before = (tmp_path / "g" / "model").stat().st_mtime_ns
    assert reference_main(args) == 1  # the same --out again: refused before the fine-tune (it replaced model/)
    assert "already holds model/" in capsys.readouterr().err
    assert (tmp_path / "g" / "model").stat().st_mtime_ns == before
    for extra in (["--softmax", "clipped"], ["--alpha", "0.5"]):  # were silently ignored
        assert reference_main([*args[:-3], "--out", str(tmp_path / "c"), *extra, "--quiet"]) == 1
        assert "drop --softmax/--alpha" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("x")  # --out under a file: refused before the fine-tune, not at the save
    assert reference_main([*args[:-3], "--out", str(tmp_path / "a_file" / "run"), "--quiet"]) == 1
    assert "a_file" in capsys.readouterr().err
    # --alpha does nothing without the clipped softmax: refused (it was ignored)
    assert reference_main(["train", "--model", "lm", "--size", "tiny", "--alpha", "0.5", "--out", str(tmp_path / "n")]) == 1
    assert "--alpha sets the clipped softmax's gamma" in capsys.readouterr().err and not (tmp_path / "n").exists()
    # A gated model cannot be converted again (its output projection is already rescaled).
    args[args.index("--finetune-gated") + 1] = str(tmp_path / "g" / "model")
    args[args.index("--out") + 1] = str(tmp_path / "g2")
    assert reference_main(args) == 1
    assert "already has gated attention" in capsys.readouterr().err
    assert reference_main(["train", "--model", "vit", "--finetune-gated", str(tmp_path / "base"),
                       "--out", str(tmp_path / "x"), "--quiet"]) == 1
    assert "holds a gpt2 model, not --model vit" in capsys.readouterr().err
    assert reference_main(["train", "--model", "lm", "--family", "opt", "--finetune-gated", str(tmp_path / "base"),
                       "--out", str(tmp_path / "x"), "--quiet"]) == 1
    assert "holds a gpt2 model, not --model lm --family opt" in capsys.readouterr().err
