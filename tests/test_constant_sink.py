"""softq.attention.ConstantSink: [CLS]'s keys and values as per-layer constants, and the fine-tune that uses them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import softq
from softq.attention import attention_points, configure_attention, configure_from_config, init_constant_sinks
from softq.calib.outlier_finetune import finetune_outliers, make_student
from test_outlier_finetune import TEXTS, _inputs, small_config, tiny_bert, tokenizer  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def _perturbed_first_token(model: torch.nn.Module, x: dict, noise: float) -> torch.Tensor:
    """Last hidden state with ``noise`` x a fixed random vector added to the first token's embedding output."""
    def hook(_m, _i, out):
        out = out.clone()
        out[:, 0] += noise * torch.randn(out.shape[-1], generator=torch.Generator().manual_seed(0))
        return out

    handle = model.embeddings.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model(**x).last_hidden_state
    finally:
        handle.remove()


def test_other_tokens_stop_reading_the_first_token(tokenizer) -> None:  # noqa: F811
    model = tiny_bert(tokenizer)
    x = dict(_inputs(tokenizer))
    configure_attention(model)
    base, moved = _perturbed_first_token(model, x, 0.0), _perturbed_first_token(model, x, 5.0)
    assert (moved[:, 1:] - base[:, 1:]).abs().max() > 1e-4  # without a sink, every token reads [CLS]
    configure_attention(model, constant_sink=True)
    init_constant_sinks(model, [x])
    base, moved = _perturbed_first_token(model, x, 0.0), _perturbed_first_token(model, x, 5.0)
    valid = x["attention_mask"].bool()
    valid[:, 0] = False
    assert (moved - base).abs().amax(-1)[valid].max() < 1e-7  # with it, only [CLS]'s own row changes
    assert (moved[:, 0] - base[:, 0]).abs().max() > 1e-2
    assert model.config.softq_constant_sink is True


def test_sinks_start_at_the_first_tokens_mean_keys_and_values(tokenizer) -> None:  # noqa: F811
    model = tiny_bert(tokenizer)
    one = tokenizer([TEXTS[0]] * 2, return_tensors="pt")  # the same sequence twice: its mean is its own [CLS]
    with torch.no_grad():
        ref = model(**one).last_hidden_state
    configure_attention(model, constant_sink=True)
    assert init_constant_sinks(model, [one]) == 2
    # bare tensors are the main input, as in softq.quantize's calibration data (a TypeError before)
    assert init_constant_sinks(model, [one["input_ids"]]) == 2
    assert init_constant_sinks(model, [one]) == 2  # back to the masked batch for the checks below
    with torch.no_grad():
        out = model(**one).last_hidden_state
    assert torch.allclose(out, ref, atol=1e-5)
    sinks = [p.sink for _, p in attention_points(model)]
    assert all(s.key.abs().sum() > 0 and s.value.abs().sum() > 0 for s in sinks)
    # a restored config rebuilds the sinks, and their constants travel in the state dict
    fresh = tiny_bert(tokenizer)
    fresh.config.softq_softmax, fresh.config.softq_constant_sink = "softmax", True
    configure_from_config(fresh)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.allclose(fresh(**one).last_hidden_state, out, atol=1e-6)


def test_left_padding_and_missing_init_are_refused(tokenizer) -> None:  # noqa: F811
    model = tiny_bert(tokenizer)
    with pytest.raises(ValueError, match="no constant sinks"):
        init_constant_sinks(model, [dict(_inputs(tokenizer))])
    configure_attention(model, constant_sink=True)
    x = dict(_inputs(tokenizer))
    mask = x["attention_mask"].clone()
    mask[0] = 1
    mask[0, :2] = 0  # the first sequence padded on the left
    with pytest.raises(ValueError, match="left-padded: the model has a constant attention sink"):
        with torch.no_grad():
            model(input_ids=x["input_ids"], attention_mask=mask)
    with pytest.raises(ValueError, match="needs sink_batches"):
        make_student(tiny_bert(tokenizer), small_config(constant_sink=True))
    with pytest.raises(ValueError, match="constant_sink must be True or False"):
        small_config(constant_sink=1)


def test_sink_finetune_resumes_quantizes_and_exports(tokenizer, tmp_path: Path) -> None:  # noqa: F811
    model = tiny_bert(tokenizer)
    cfg = small_config(method="gated", constant_sink=True)
    full = finetune_outliers(model, tokenizer, TEXTS, cfg, progress=False, device="cpu")
    ckpt = tmp_path / "run.pt"
    finetune_outliers(model, tokenizer, TEXTS, cfg, checkpoint=ckpt, stop_after=3, progress=False, device="cpu")
    resumed = finetune_outliers(model, tokenizer, TEXTS, cfg, checkpoint=ckpt, resume=True, progress=False,
                                device="cpu")
    assert resumed.history == full.history
    student = full.model
    assert student.config.softq_constant_sink and student.config.softq_gated
    assert not getattr(model.config, "softq_constant_sink", False)  # the teacher is untouched
    with pytest.raises(ValueError, match="already has a constant attention sink"):
        finetune_outliers(make_student(model, small_config(method="none", constant_sink=True),
                                       [dict(_inputs(tokenizer))]), tokenizer, TEXTS, small_config(), progress=False)
    # W8A8 keeps the sinks, and the ONNX export computes what the quantized torch model does
    x = dict(_inputs(tokenizer))
    with torch.no_grad():  # constants far from anything [CLS] computes, so that a graph without them shows
        for _, p in attention_points(student):
            p.sink.value.add_(1.0)
    qmodel = softq.quantize(student, [x], softq.QuantConfig(quantize_residual=True, residual_groups=1, residual_prefix=0))
    assert all(p.sink is not None for _, p in attention_points(qmodel))
    with torch.no_grad():
        ref = qmodel(**x).last_hidden_state.numpy()
    path = tmp_path / "sink.onnx"
    from softq.export import onnx_utils, to_onnx

    to_onnx(qmodel, path, x)
    out = onnx_utils.run(str(path), {"input_ids": x["input_ids"].numpy(), "attention_mask": x["attention_mask"].numpy()},
                         "all")[0]
    valid = x["attention_mask"].numpy().astype(bool)
    error = np.abs(out - ref)[valid].max()
    assert error < 1e-3 * np.abs(ref).max()
    points = [p for _, p in attention_points(qmodel)]
    sinks = [p.sink for p in points]
    for p in points:
        p.sink = None
    with torch.no_grad():
        without = qmodel(**x).last_hidden_state.numpy()
    for p, sink in zip(points, sinks):
        p.sink = sink
    assert np.abs(out - without)[valid].max() > 100 * max(error, 1e-6)  # the export carries the sinks


def test_minilm_cls_is_a_constant_sink() -> None:
    """all-MiniLM-L6-v2's [CLS] keys and values hardly depend on the text: constants at their calibration
    means keep its sentence embeddings (docs/outliers.md section 6 measures 0.99994 on 128 paragraphs)."""
    pytest.importorskip("all_minilm_l6_v2")
    import copy

    from softq import corpora, hf

    loaded = hf.load_minilm(64)
    calib = [loaded.tokenize(corpora.text_split("calib", 16), 64)]
    batch = loaded.tokenize(corpora.text_split("eval", 8), 64)
    model = copy.deepcopy(loaded.model)
    configure_attention(model, constant_sink=True)
    init_constant_sinks(model, calib)
    before, after = loaded.encode([batch]), loaded.encode([batch], model)
    assert torch.nn.functional.cosine_similarity(before, after).min() > 0.9995
    # zero constants instead (an uninitialised sink) are far from function-preserving
    for _, p in attention_points(model):
        torch.nn.init.zeros_(p.sink.key)
        torch.nn.init.zeros_(p.sink.value)
    assert torch.nn.functional.cosine_similarity(before, loaded.encode([batch], model)).min() < 0.99


def test_saved_quantized_sink_model_keeps_its_sinks(tmp_path: Path) -> None:
    from conftest import tiny_inputs, tiny_model

    from softq.quant import io

    model = tiny_model("bert")
    x = tiny_inputs("bert")
    x["input_ids"][:, 0] = 1  # a fixed first token ([CLS]), which a constant sink stands for
    configure_attention(model, constant_sink=True)
    init_constant_sinks(model, [x])
    with torch.no_grad():
        for _, p in attention_points(model):
            p.sink.value.add_(1.0)  # far from what position 0 computes, so a load that dropped them would show
    qmodel = softq.quantize(model, [x], softq.QuantConfig())
    io.save(qmodel, tmp_path / "q")
    loaded = io.load(tmp_path / "q")
    assert all(p.sink is not None for _, p in attention_points(loaded))
    with torch.no_grad():
        ref, again = qmodel(**x).logits, loaded(**x).logits
        for _, p in attention_points(loaded):
            p.sink = None
        without = loaded(**x).logits
    assert torch.allclose(again, ref, atol=1e-6)
    assert (without - ref).abs().max() > 100 * max((again - ref).abs().max().item(), 1e-7)
