"""Model types softq runs as one of its families (softq.models.FAMILY_OF): XLM-RoBERTa and CamemBERT as RoBERTa,
ELECTRA as BERT, and DistilBERT, from quantization through ONNX, save/load, the outlier fine-tune and MPC."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import softq
from softq.export import onnx_utils
from softq.export.model_export import to_onnx
from softq.models import attention_modules, model_family

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64)
FAMILY = {"xlm-roberta": "roberta", "camembert": "roberta", "electra": "bert", "distilbert": "distilbert"}


def build(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer encoder of ``model_type`` (no head: its last hidden state is compared token by token)."""
    torch.manual_seed(seed)
    if model_type == "xlm-roberta":
        cfg = transformers.XLMRobertaConfig(vocab_size=64, max_position_embeddings=130, pad_token_id=1, **COMMON)
        return transformers.XLMRobertaModel(cfg, add_pooling_layer=False).eval()
    if model_type == "camembert":
        cfg = transformers.CamembertConfig(vocab_size=64, max_position_embeddings=130, pad_token_id=1, **COMMON)
        return transformers.CamembertModel(cfg, add_pooling_layer=False).eval()
    if model_type == "electra":  # embedding size 16 < hidden size: a Linear projects the embeddings
        cfg = transformers.ElectraConfig(vocab_size=64, max_position_embeddings=128, embedding_size=16, **COMMON)
        return transformers.ElectraModel(cfg).eval()
    cfg = transformers.DistilBertConfig(vocab_size=64, max_position_embeddings=128, n_layers=2, n_heads=4, dim=32,
                                        hidden_dim=64, pad_token_id=1)
    return transformers.DistilBertModel(cfg).eval()


def inputs(seed: int, batch: int = 2, seq: int = 20) -> dict[str, torch.Tensor]:
    """Token ids (never the padding id 1) with the second text padded from position 14 (padding id there)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, 14:] = 0
    ids[mask == 0] = 1
    return {"input_ids": ids, "attention_mask": mask}


@torch.no_grad()
def hidden(model: torch.nn.Module, x: dict[str, torch.Tensor]) -> np.ndarray:
    return model(**x).last_hidden_state.numpy()


@pytest.mark.parametrize("model_type", list(FAMILY))
def test_quantize_export_and_reload(model_type: str, tmp_path) -> None:
    model = build(model_type)
    assert model_family(model) == FAMILY[model_type] and len(list(attention_modules(model))) == 2
    calib = [inputs(seed) for seed in range(3)]
    with pytest.raises(ValueError, match="is post-LN"):  # LayerNorm outputs feed the residual: no fold possible
        softq.quantize(model, calib, softq.QuantConfig(smoothquant_alpha=0.5))
    q = softq.quantize(model, calib)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    quantized = {n for n, m in q.named_modules() if type(m).__name__ == "QLinear"}
    assert set(linears) <= quantized, set(linears) - quantized  # every Linear, the ELECTRA projection included
    x = inputs(9)
    valid = x["attention_mask"].numpy().astype(bool)
    ref, got = hidden(model, x), hidden(q, x)
    err = np.abs(got - ref)[valid].max() / np.abs(ref).max()
    assert 1e-4 < err < 0.02, err  # quantized, and close
    path = to_onnx(q, tmp_path / "m.onnx", x)
    out = onnx_utils.run(path, {k: v.numpy() for k, v in x.items()}, "all")[0]
    assert np.abs(out - got)[valid].max() / np.abs(got).max() < 0.02
    softq.quant.save(q, tmp_path / "saved")
    np.testing.assert_array_equal(hidden(softq.quant.load(tmp_path / "saved"), x), got)


@pytest.mark.parametrize("model_type", list(FAMILY))
def test_gated_student_starts_as_the_teacher(model_type: str) -> None:
    """The gated student rescales the attention output projection (DistilBERT's ``out_lin``, the others' sibling
    ``output.dense``) so that, at step 0, it computes the teacher's function."""
    from softq.calib.outlier_finetune import OutlierFinetuneConfig, make_student

    model, x = build(model_type), inputs(4)
    student = make_student(model, OutlierFinetuneConfig(method="gated", pi_init=0.3, constant_sink=False))
    assert all(m.softq.gate is not None for _, m in attention_modules(student))
    np.testing.assert_allclose(hidden(student, x), hidden(model, x), atol=1e-5)


def test_roberta_positions_are_public_in_mpc() -> None:
    """RoBERTa numbers positions from the token ids that are not its padding id: under MPC the ids are secret, so
    the positions come from the public mask, which numbers them as the model does; ids that put the padding id
    elsewhere than the mask are refused before any party starts."""
    from softq.mpc import run
    from softq.mpc.graph import public_positions

    model, x = build("xlm-roberta"), inputs(5, seq=10)
    x["attention_mask"][-1, 6:] = 0
    x["input_ids"][-1, 6:] = 1
    with torch.no_grad():
        own = model(**x).last_hidden_state
        given = model(**public_positions(model, x)).last_hidden_state
    torch.testing.assert_close(given, own, rtol=0, atol=0)
    assert "position_ids" not in public_positions(build("distilbert"), x)  # other families number by place
    result = run(model, x, softmax="softmax", gelu="tanh", timeout=60)
    valid = x["attention_mask"].bool()
    assert (result.logits - own)[valid].abs().max() < 1e-2 * own.abs().max()
    bad = {**x, "input_ids": x["input_ids"].clone()}
    bad["input_ids"][0, 3] = 1  # the padding id at a token the mask keeps
    with pytest.raises(ValueError, match="XLMRobertaModel numbers its positions from the input_ids that are not its "
                                         "padding id 1, and these input_ids hold that id at a token the attention_mask"):
        run(model, bad, softmax="softmax", gelu="tanh", timeout=60)
    dropped = {**x, "attention_mask": x["attention_mask"].clone()}
    dropped["attention_mask"][0, 3] = 0  # a real token the mask leaves out
    with pytest.raises(ValueError, match="and the attention_mask drops a token whose id is not that id"):
        public_positions(model, dropped)
    with pytest.raises(ValueError, match="hold that id with no attention_mask"):
        public_positions(model, {"input_ids": x["input_ids"]})
