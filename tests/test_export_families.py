"""Today's families exported to ONNX: each file computes the quantized torch model on shapes it was not traced on.

Files are traced on 2 sequences of 12 tokens and run on 3 of 17, two of them padded (one down to 3 tokens): past
the sliding windows (8) of Mistral, Gemma 2 and gpt-oss and ModernBERT's local windows, with RoPE positions, grouped
K/V heads, Gemma 2's soft-capping and scaling, gpt-oss's sink logits, T5's relative position bias in the mask and
CLIP's causal text encoder.  Images and audio features have a fixed size: their files run on another batch size.
The reference is the quantized model called as a user calls it (the 2-D mask, Hugging Face's own masks).
"""

from __future__ import annotations

import pytest
import torch
from tiny_families import (FAMILIES, build, dense_gpt_oss, inputs, other_inputs, relative_error, torch_output,
                           traced_inputs)
from torch import nn

import softq
from softq.export import runtimes
from softq.export.errors import ExportError
from softq.export.model_export import build_onnx, to_onnx_float

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 2e-2  # relative L2 error over the valid tokens
# the other cores without input smoothing's search (the default files cover smoothing): a third of the time
CONFIGS = {"default": {}, "row": {"softmax_input": "row", "input_smoothing": None},
           "edge": {"softmax_output": "edge", "input_smoothing": None}, "float": {"softmax_bits": None, "input_smoothing": None}}


def _tensors(feeds):  # noqa: ANN001, ANN202
    return {k: torch.from_numpy(v) for k, v in feeds.items()}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(family, config, form) -> (quantized model, path of its file), each made once and shared by the tests."""
    models: dict[tuple[str, str], nn.Module] = {}
    files: dict[tuple[str, str, str | None], tuple[nn.Module, str]] = {}
    folder = tmp_path_factory.mktemp("families")

    def get(family: str, config: str = "default", form: str | None = None) -> tuple[nn.Module, str]:
        if (family, config) not in models:
            model = dense_gpt_oss() if family == "gpt_oss" else build(family).eval()
            calib = [_tensors(inputs(model, seed, 2, 12, padded=True)) for seed in range(2)]
            models[family, config] = softq.quantize(model, calib, softq.QuantConfig(**CONFIGS[config]))
        if (family, config, form) not in files:
            qmodel = models[family, config]
            path = str(folder / f"{family}-{config}-{form}.onnx")
            softq.to_onnx(qmodel, path, _tensors(traced_inputs(qmodel)), softmax=form)
            files[family, config, form] = qmodel, path
        return files[family, config, form]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_default_file_matches_torch_on_another_shape(exported, family):
    qmodel, path = exported(family)
    feeds = other_inputs(qmodel)
    assert relative_error(runtimes.runner(path)(feeds)[0], torch_output(qmodel, feeds), feeds) <= TOL


# every core: a decoder with sliding windows, soft-capping, grouped K/V and its own scaling, and an encoder whose
# position bias arrives in the mask (the edge int form on one of them; 'ort' refuses causal models)
CORES = [("gemma2", "row", "int"), ("gemma2", "edge", "qdq"), ("gemma2", "edge", "int"), ("gemma2", "float", "float"),
         ("t5-encoder", "row", "int"), ("t5-encoder", "edge", "qdq"), ("t5-encoder", "edge", "ort"),
         ("t5-encoder", "float", "float")]


@pytest.mark.filterwarnings("ignore:softmax='ort' on a model with attention masks")  # its own test: test_export_model
@pytest.mark.parametrize("family,config,form", CORES)
def test_every_core_matches_torch_on_another_shape(exported, family, config, form):
    qmodel, path = exported(family, config, form)
    feeds = other_inputs(qmodel, padded=form != "ort")  # QLinearSoftmax has no mask input: runners refuse padding
    assert relative_error(runtimes.runner(path)(feeds)[0], torch_output(qmodel, feeds), feeds) <= TOL


OTHER_RUNTIMES = [pytest.param(r, marks=pytest.mark.skipif(not runtimes.available(r), reason=f"{r} not installed"))
                  for r in ("tract", "openvino")]


@pytest.mark.parametrize("runtime", OTHER_RUNTIMES)
@pytest.mark.parametrize("family,config,form", [("gemma2", "default", None), ("gemma2", "edge", "qdq"),
                                                ("t5-encoder", "default", None), ("t5-encoder", "row", "int")])
def test_other_runtimes_match_torch_on_another_shape(exported, runtime, family, config, form):
    qmodel, path = exported(family, config, form)
    feeds = other_inputs(qmodel)
    if runtime == "tract" and (family, config) == ("gemma2", "edge"):
        # 'edge' codes quantize the residual stream: tract's optimiser fuses the RMSNorm after that
        # DequantizeLinear into its RmsNorm op and fails there; the runner says so in one line
        with pytest.raises(RuntimeError, match=r"^tract cannot run .*RmsNorm: axis 2 is out of bounds[^\n]*$"):
            runtimes.runner(path, runtime)(feeds)
        return
    assert relative_error(runtimes.runner(path, runtime)(feeds)[0], torch_output(qmodel, feeds), feeds) <= TOL


def test_mixture_of_experts_is_refused_in_one_line(tmp_path):
    model = build("gpt_oss").eval()
    with pytest.raises(ExportError, match=r"mixture-of-experts .*\(model\.layers\.0\.mlp\.experts\)") as err:
        to_onnx_float(model, str(tmp_path / "m.onnx"), _tensors(traced_inputs(model)))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "m.onnx").exists()


def test_audio_features_of_the_wrong_shape_are_refused_in_one_line(exported):
    qmodel, _ = exported("whisper-encoder")
    with pytest.raises(ExportError, match=r"input_features must be float \[batch, 16, frames\]") as err:
        build_onnx(qmodel, {"input_features": torch.zeros(1, 8, 32)})
    assert "\n" not in str(err.value)
