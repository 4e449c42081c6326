"""The user scripts in examples/ run end to end, each as ``python examples/NAME.py --model DIR``, on tiny model folders.

The folders are 2-layer BERTs (hidden 32, 4 heads) built from a config, with all-MiniLM-L6-v2's tokenizer and
sentence-transformers files (modules.json, 1_Pooling/, sentence_bert_config.json) copied in, so that both
``softq.hf.load_model_dir`` and ``sentence_transformers.SentenceTransformer`` load them.  Weights are drawn
with a wider spread than BERT's initialisation so that the layers matter (8-bit activations keep the embedding
cosine above 0.999, 6-bit ones do not); the second folder plants a [CLS] outlier of |x| ~ 1400 in one residual
dimension, as all-MiniLM-L6-v2 has one of 223.  Each test reads the numbers the script prints.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

pytest.importorskip("all_minilm_l6_v2")  # the tokenizer and sentence-transformers files come from its folder

from softq import hf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"([-+0-9.e]+)"
OUTLIER_DIM = 5


def tiny_folder(path: Path, outlier: float = 0.0) -> Path:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=512, initializer_range=0.25)
    model = transformers.BertModel(config).eval()
    with torch.no_grad():
        model.embeddings.word_embeddings.weight.normal_()  # tokens far apart: texts get distinct embeddings
        if outlier:  # FFN unit 0 fires on [CLS] only (position 0 stands out in one dimension) and writes into it
            model.embeddings.position_embeddings.weight[0, OUTLIER_DIM] = 20.0
            for layer in model.encoder.layer:
                layer.intermediate.dense.weight[0] = 0.0
                layer.intermediate.dense.weight[0, OUTLIER_DIM] = 4.0
                layer.intermediate.dense.bias[0] = -8.0
                layer.output.dense.weight[:, 0] = 0.0
                layer.output.dense.weight[OUTLIER_DIM, 0] = outlier
            model.encoder.layer[-1].output.LayerNorm.weight[OUTLIER_DIM] = 0.05  # as post-LN models damp it
    model.save_pretrained(path)
    hf.copy_sidecars(hf.minilm_dir(), path)  # tokenizer, modules.json, 1_Pooling/, sentence_bert_config.json
    pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
    (path / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "word_embedding_dimension": 32}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("examples")
    return {"plain": tiny_folder(base / "tiny-bert"), "outlier": tiny_folder(base / "tiny-bert-outlier", 150.0)}


def run(script: str, *args: object) -> str:
    """The script's stdout; its stderr in the failure message."""
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "TQDM_DISABLE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{script} exited with {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.stdout


def numbers(pattern: str, text: str) -> list[float]:
    match = re.search(pattern, text)
    assert match, f"no {pattern!r} in:\n{text}"
    return [float(g) for g in match.groups()]


def test_quantize_hf_model_saves_loads_and_stays_close_to_fp32(folders, tmp_path) -> None:
    out = run("quantize_hf_model.py", "--model", folders["plain"], "--out", tmp_path / "q", "--texts", 8)
    mean, low = numbers(rf"cosine to FP32 on 64 held-out rows: mean {NUMBER} min {NUMBER}", out)
    assert mean > 0.999 and low > 0.995, out  # 0.9995 and 0.9966 here; 6-bit activations 0.9975 and 0.9919
    assert numbers(rf"max \|loaded - quantized\| {NUMBER}", out) == [0.0]  # the saved folder loads bit-exact
    assert (tmp_path / "q" / "quant_config.json").is_file() and (tmp_path / "q" / "tokenizer.json").is_file()


def test_export_onnx_agrees_with_torch_in_every_installed_runtime(folders, tmp_path) -> None:
    from softq.export import runtimes

    out = run("export_onnx.py", "--model", folders["plain"], "--out", tmp_path / "m.onnx", "--texts", 8)
    assert (tmp_path / "m.onnx").is_file()
    assert "onnxruntime" in runtimes.installed()
    for name in runtimes.installed():  # the file's sentence embedding against the quantized torch model's
        err, cos = numbers(rf"{name}: max \|{name} - torch\| / max \|torch\| {NUMBER}, min cosine to torch {NUMBER}", out)
        assert err < 1e-4 and cos > 0.99999, out


def test_sentence_transformers_int8_encodes_and_exports_with_pooling(folders, tmp_path) -> None:
    pytest.importorskip("sentence_transformers")
    out = run("sentence_transformers_int8.py", "--model", folders["plain"], "--out", tmp_path / "s.onnx", "--texts", 8)
    mean, low = numbers(rf"embedding cosine INT8 to FP32: mean {NUMBER} min {NUMBER}", out)
    assert mean > 0.999 and low > 0.99, out
    assert numbers(rf"recall@1: {NUMBER}", out) == [1.0]
    onnx_int8, onnx_fp32 = numbers(rf"embedding cosine to INT8 .encode: min {NUMBER}, to FP32: min {NUMBER}", out)
    assert onnx_int8 > 0.99999 and onnx_fp32 > 0.99, out


def test_encrypted_embeddings_match_plaintext(folders) -> None:
    if importlib.util.find_spec("crypten") is None:
        pytest.skip("CrypTen is not installed")
    out = run("encrypted_embeddings.py", "--model", folders["plain"], "--texts", 1, "--seq-len", 8)
    assert numbers(rf"embedding cosine to plaintext: min {NUMBER}", out)[0] > 0.9999, out
    rounds, megabytes = numbers(rf"communication: {NUMBER} rounds, {NUMBER} MB", out)
    assert rounds > 100 and megabytes > 1, out  # real 2-party traffic: every layer's secret products


def test_outlier_finetune_shrinks_the_outlier_and_helps_per_tensor_w8a8(folders) -> None:
    out = run("outlier_finetune.py", "--model", folders["outlier"], "--steps", 100, "--lr", 1e-3, "--texts", 8)
    row = rf"max \|LayerNorm input\| +{NUMBER}; FP32 mean {NUMBER} \(min {NUMBER}\), " \
          rf"W8A8 per-tensor residual mean {NUMBER} \(min {NUMBER}\)"
    before, _, _, q_before, _ = numbers(r"original: " + row, out)
    after, fp32, _, q_after, _ = numbers(r"fine-tuned: " + row, out)
    assert before > 1000 and after < before / 2, out  # the planted outlier (~1400), fine-tuned down
    assert fp32 > 0.97, out  # the distillation keeps the embeddings
    assert q_after > q_before + 0.02, out  # 0.925 -> 0.969 here: one residual scale now fits the stream
