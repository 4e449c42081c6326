"""An export checks itself: the written file runs in onnxruntime on the example inputs and must reproduce the
quantized torch model, or nothing is written."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import numpy_helper

import softq
from softq.export import model_export
from softq.export.errors import ExportError
from softq.export.verify import EXPORT_TOLERANCE
from conftest import tiny_inputs, tiny_model


def _quantized(family: str):
    model = tiny_model(family)
    calib = [tiny_inputs(family, seed=s) for s in range(3)]
    return softq.quantize(model, calib, softq.QuantConfig()), calib


@pytest.mark.parametrize("family", ["bert", "gpt2", "vit"])
def test_a_file_that_computes_another_function_is_refused_and_not_written(family, tmp_path, monkeypatch) -> None:
    qmodel, calib = _quantized(family)
    good = tmp_path / "good.onnx"
    assert softq.to_onnx(qmodel, good, calib[0]) == str(good)  # the faithful file passes its own check
    fuse = model_export.fuse.fuse

    def misread(model: onnx.ModelProto, **kwargs):  # a structure read wrong: every LayerNorm scale doubled
        result = fuse(model, **kwargs)
        doubled = 0
        for node in model.graph.node:
            if node.op_type == "LayerNormalization":
                for init in model.graph.initializer:
                    if init.name == node.input[1]:
                        init.CopyFrom(numpy_helper.from_array(2 * numpy_helper.to_array(init), init.name))
                        doubled += 1
        assert doubled
        return result

    monkeypatch.setattr(model_export.fuse, "fuse", misread)
    bad = tmp_path / "bad.onnx"
    with pytest.raises(ExportError, match=r"off the quantized torch model on the example inputs.*nothing was written"):
        softq.to_onnx(qmodel, bad, calib[0])
    assert not bad.exists() and [p.name for p in tmp_path.iterdir()] == ["good.onnx"]  # no temporary file left
    # an existing file is not replaced by a refused one
    with pytest.raises(ExportError):
        softq.to_onnx(qmodel, good, calib[0], overwrite=True)
    assert good.stat().st_size > 0
    model_export.to_onnx(qmodel, bad, calib[0], verify=False)  # the check can be skipped, and then writes
    assert bad.exists()


def test_the_check_measures_the_file_against_the_torch_model(tmp_path) -> None:
    qmodel, calib = _quantized("bert")
    path = softq.to_onnx(qmodel, tmp_path / "m.onnx", calib[0])
    feeds = dict(calib[0], attention_mask=torch.ones_like(calib[0]["input_ids"]))
    feeds["attention_mask"][1, 15:] = 0
    _, check = model_export._build_checked(qmodel, feeds, None, False, "int8", None, None, False, "integer")
    assert check.names == ["logits"] and check.valid is not None and not check.valid.all()
    assert check.errors(path)["logits"] < 1e-3  # the same graph on other (padded) inputs: the file computes the model
    check.reference[0] = check.reference[0] * (1 + 2 * EXPORT_TOLERANCE)  # a reference the file does not reach
    with pytest.raises(ExportError, match="'logits' is"):
        check.verify(path)


def test_a_pooled_file_is_judged_on_its_sentence_embedding(tmp_path) -> None:
    """Per-token states of a quantized encoder can move between runtimes where codes sit on rounding ties; a pooled
    file is checked on what it is for, and refused when its embedding is off."""
    import transformers

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                           num_attention_heads=4, intermediate_size=64),
                                   add_pooling_layer=False).eval()
    calib = [{"input_ids": torch.randint(3, 64, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
             for _ in range(3)]
    qmodel = softq.quantize(model, calib, softq.QuantConfig())
    path = softq.to_onnx(qmodel, tmp_path / "m.onnx", calib[0], pooling="mean", normalize=True)
    _, check = model_export._build_checked(qmodel, calib[1], None, False, "int8", None, "mean", True, "integer")
    assert set(check.names) == {"last_hidden_state", "sentence_embedding"}
    states = check.names.index("last_hidden_state")
    check.reference[states] = check.reference[states] * (1 + 2 * EXPORT_TOLERANCE)  # states off, embedding right
    assert check.errors(path)["last_hidden_state"] > EXPORT_TOLERANCE
    check.verify(path)
    pooled = check.names.index("sentence_embedding")
    check.reference[pooled] = -check.reference[pooled]
    with pytest.raises(ExportError, match="'sentence_embedding' is"):
        check.verify(path)
