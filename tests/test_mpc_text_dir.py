"""`softq mpc distill` / `softq mpc run` on a Hugging Face sentence-encoder directory and a text file.

The teacher is a tiny sentence-transformers folder built from a config (test_model_dir's); the
student is distilled from a text file, written as a model directory, loaded back with its
surrogates and run encrypted by two party processes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from softq.cli import main
from test_model_dir import WORDS, _tokenizer, sentence_folder

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SOFTQ_CACHE", str(tmp_path_factory.getbasetemp() / "softq-cache"))


def sharp_teacher(path):
    """The tiny sentence folder with real models' ranges: sharp attention rows and GELU inputs of several
    units (a random tiny BERT's are near 0, where 2Quad and Quad hardly differ from softmax and GELU)."""
    import transformers

    folder = sentence_folder(path, outlier=4.0)
    model = transformers.BertModel.from_pretrained(folder, add_pooling_layer=False)
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(6.0)
            layer.attention.self.key.weight.mul_(6.0)
            layer.intermediate.dense.weight.mul_(8.0)
    model.save_pretrained(folder)
    return folder


def _sentences(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 16)))).capitalize() + "." for _ in range(n)]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    root = tmp_path_factory.mktemp("mpc-text")
    teacher = sharp_teacher(root / "teacher")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(" ".join(_sentences(3, seed)) for seed in range(60)) + "\n")
    student = root / "student"
    code = main(["mpc", "distill", "--model", str(teacher), "--text", str(corpus), "--steps1", "40", "--steps2", "40",
                 "--batch-size", "8", "--seq-len", "32", "--window", "16", "--lr", "1e-3", "--out", str(student)])
    assert code == 0
    return root, teacher, corpus, student


def test_distilled_student_is_a_model_directory_with_its_surrogates(distilled, capsys):
    root, teacher, corpus, student = distilled
    from softq.hf import sentence_pooling
    from softq.mpc.text import load_text_model

    meta = json.loads((student / "softq_student.json").read_text())
    # held out: every 10th line, never trained on; the distilled student is closer to the teacher there
    assert meta["held_out_texts"] == 6 and meta["fit"] is True and meta["recombine"] is True
    assert 1 - meta["cosine_after"] < (1 - meta["cosine_before"]) / 10, meta  # 10x closer at least
    assert sentence_pooling(student) == sentence_pooling(teacher)  # tokenizer and pooling files came along
    loaded = load_text_model(student)
    spec = json.loads(loaded.model.config.softq_mpc_surrogates)
    assert spec["softmax"] == ["2quad", "2quad"] and spec["gelu"] == ["quad", "quad"]
    assert loaded.model.pooler is None
    assert {type(m).__name__ for m in loaded.model.modules()} >= {"SurrogateGELU"}
    # the reloaded student computes what was measured: its held-out cosine again
    held = corpus.read_text().splitlines()[::10]
    ref = load_text_model(teacher)
    batches = ref.batches(held, 32, max_length=32)
    cos = torch.nn.functional.cosine_similarity(loaded.encode(batches), ref.encode(batches))
    assert float(cos.mean()) == pytest.approx(meta["cosine_after"], abs=1e-5)


def test_distillation_continues_from_a_student_directory(distilled, tmp_path):
    """--init DIR: distil a saved student further; it starts where that student ended (its held-out cosine is
    the new run's 'before'), keeps its surrogates, records its lineage, and is not changed on disk."""
    root, teacher, corpus, student = distilled
    first = json.loads((student / "softq_student.json").read_text())
    weights_before = (student / "model.safetensors").read_bytes()
    out = tmp_path / "more"
    code = main(["mpc", "distill", "--model", str(teacher), "--text", str(corpus), "--init", str(student),
                 "--steps1", "0", "--steps2", "20", "--batch-size", "8", "--seq-len", "32", "--window", "16",
                 "--lr", "1e-3", "--out", str(out)])
    assert code == 0
    meta = json.loads((out / "softq_student.json").read_text())
    assert meta["cosine_before"] == pytest.approx(first["cosine_after"], abs=1e-5)
    assert meta["init"] == str(student) and meta["earlier_steps"] == [first["steps"]] and meta["fit"] is False
    assert meta["steps"] == [0, 20] and meta["cosine_after"] != meta["cosine_before"]
    assert (student / "model.safetensors").read_bytes() == weights_before
    from softq.mpc.text import load_text_model

    spec = json.loads(load_text_model(out).model.config.softq_mpc_surrogates)
    assert spec["softmax"] == ["2quad", "2quad"] and spec["gelu"] == ["quad", "quad"]


def test_encrypted_student_from_a_text_file(distilled, capsys, tmp_path):
    root, teacher, corpus, student = distilled
    texts = root / "eval.txt"
    texts.write_text("\n".join(_sentences(2, 1000)) + "\n")
    capsys.readouterr()
    code = main(["mpc", "run", "--model", str(teacher), "--student", str(student), "--text", str(texts),
                 "--seq-len", "16", "--json", "--timeout", "120"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["texts"] == 2 and summary["rounds"] > 0 and summary["bytes"] > 0
    assert summary["max_abs_error"] < 2e-2 and summary["min_cosine_to_plaintext"] > 0.9999
    # the reported cosine to the teacher is the plaintext student's, up to fixed point
    from softq.mpc.text import load_text_model

    t, st = load_text_model(teacher, 16), load_text_model(student, 16)
    batch = [st.tokenize(texts.read_text().splitlines(), max_length=16)]
    cos = torch.nn.functional.cosine_similarity(st.encode(batch), t.encode(batch))
    # (the tiny student is within ~4e-6 of its teacher: compare the distances 1 - cosine, to 30 %)
    assert 1 - summary["mean_cosine_to_model"] == pytest.approx(1 - float(cos.mean()), rel=0.3)
    assert 1 - summary["min_cosine_to_model"] == pytest.approx(1 - float(cos.min()), rel=0.3)
    assert "cosine to" in out and str(teacher) in out


def test_encrypted_model_from_a_text_file_reports_the_encryption_error(distilled, capsys):
    """Without a student the encryption's error is judged against the same surrogates in plaintext (before: the
    exact model, so the surrogates' approximation, cosine far below 1, was reported as the encrypted error), and
    the surrogates' own cost, the cosine to the exact model, on its own."""
    root, teacher, corpus, student = distilled
    texts = root / "eval.txt"
    texts.write_text("\n".join(_sentences(2, 1000)) + "\n")
    capsys.readouterr()
    code = main(["mpc", "run", "--model", str(teacher), "--text", str(texts), "--seq-len", "16", "--json",
                 "--timeout", "120"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["max_abs_error"] < 2e-2 and summary["min_cosine_to_plaintext"] > 0.9999
    assert "with the same surrogates (softmax 2quad, GELU quad)" in out
    from softq.mpc.text import load_text_model
    from softq.mpc.surrogates import configure_surrogates

    t = load_text_model(teacher, 16)
    batch = [t.tokenize(texts.read_text().splitlines(), max_length=16)]
    exact = t.encode(batch)
    configure_surrogates(t.model, softmax="2quad", gelu="quad")
    cos = torch.nn.functional.cosine_similarity(t.encode(batch), exact)
    assert float(cos.min()) < 0.999  # the surrogates cost something on this teacher: the two figures differ
    assert 1 - summary["mean_cosine_to_model"] == pytest.approx(1 - float(cos.mean()), rel=0.3)


def test_bad_text_distillation_input_gets_one_line(distilled, capsys, tmp_path):
    root, teacher, corpus, student = distilled
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    one = tmp_path / "one.txt"
    one.write_text("Just one line of text here.\n")
    cases = [
        (["--model", str(teacher), "--out", str(tmp_path / "s")], "needs --text FILE"),
        (["--model", str(teacher), "--text", str(empty), "--out", str(tmp_path / "s")], "is empty"),
        (["--model", str(teacher), "--text", str(one), "--out", str(tmp_path / "s")], "at least 2"),
        (["--model", str(teacher), "--text", str(corpus), "--window", "0", "--out", str(tmp_path / "s")], "--window"),
        (["--model", str(student), "--text", str(corpus), "--out", str(tmp_path / "s")], "already a surrogate student"),
        (["--model", "lm", "--text", str(corpus), "--out", str(tmp_path / "s")], "lm is not a directory"),
        (["--model", str(teacher), "--text", str(corpus), "--init", str(teacher), "--out", str(tmp_path / "s")],
         "not a student written by softq mpc distill"),
        (["--model", "lm", "--init", str(student), "--out", str(tmp_path / "s")], "needs --text FILE"),
    ]
    for argv, expected in cases:
        capsys.readouterr()
        assert main(["mpc", "distill", *argv]) == 1
        err = capsys.readouterr().err.strip()
        assert expected in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "s").exists()


def test_bad_encrypted_text_input_gets_one_line(distilled, capsys, tmp_path):
    import transformers

    root, teacher, corpus, student = distilled
    classifier = tmp_path / "classifier"
    classifier.mkdir()
    config = transformers.BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    transformers.BertForSequenceClassification(config).save_pretrained(classifier)
    _tokenizer(classifier).save_pretrained(classifier)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cases = [
        (["--model", str(classifier), "--text", str(corpus)], "has a head (BertForSequenceClassification)"),
        (["--model", str(teacher), "--student", str(student), "--text", str(empty)], "--text file"),
        (["--model", str(teacher), "--text", str(corpus), "--inputs", str(corpus)], "not both"),
    ]
    for argv, expected in cases:
        capsys.readouterr()
        assert main(["mpc", "run", *argv]) == 1
        err = capsys.readouterr().err.strip()
        assert expected in err and "Traceback" not in err and len(err.splitlines()) == 1, err
