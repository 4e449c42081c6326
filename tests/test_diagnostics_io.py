"""Diagnostics, sensitivity ranking, and save/load of quantized models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_inputs, tiny_model

import softq
from softq.calib import diagnostics
from softq.quant import io, sensitivity


def test_diagnostics_measure_planted_outliers_and_sinks() -> None:
    model = tiny_model("opt")
    calib = [tiny_inputs("opt", seed=s) for s in range(2)]
    base = diagnostics.collect(model, calib)
    with torch.no_grad():  # an outlier channel in layer 1's output, as trained LMs grow
        model.model.decoder.layers[1].fc2.bias[4] = 80.0
    planted = diagnostics.collect(model, calib)
    assert planted.layers[1].inf_norm >= 80.0 > base.layers[1].inf_norm
    assert planted.layers[1].kurtosis > 5 * base.layers[1].kurtosis
    assert planted.layers[0].inf_norm == pytest.approx(base.layers[0].inf_norm)
    assert len(planted.heads) == 2 * 4
    assert all(abs(h.row_sum_deficit) < 1e-5 for h in base.heads)  # float softmax loses nothing


def test_sink_rate_sees_a_head_that_attends_to_the_first_token() -> None:
    from softq.attention import attention_points

    model = tiny_model("bert")
    x = [tiny_inputs("bert", seq=16)]
    captured = diagnostics.collect(model, x)
    # make every query attend to key 0: huge score for key 0 through the softmax input point
    class Sink(torch.nn.Module):
        def forward(self, scores):
            scores = scores.clone()
            scores[..., 0] += 50.0
            return scores
    for _, points in attention_points(model):
        points.scores = Sink()
    sunk = diagnostics.collect(model, x)
    assert captured.mean_sink_rate < 0.2
    assert sunk.mean_sink_rate > 0.99


def test_head_statistics_are_means_over_rows_however_batched() -> None:
    """sink_rate and row_sum_deficit were means of per-batch means: the same 17 sequences gave other figures as one
    batch and as batches of 1 + 16 (a batch of one weighed as much as sixteen)."""
    model = tiny_model("bert")
    with torch.no_grad():  # attention that is not uniform, and one odd sequence
        for layer in model.bert.encoder.layer:
            layer.attention.self.query.weight.mul_(8)
    ids = tiny_inputs("bert", batch=17, seq=10, seed=3)["input_ids"]
    ids[0] = ids[0, 0]
    softq.configure_attention(model)
    with torch.no_grad():
        attentions = model(input_ids=ids, output_attentions=True).attentions
    rows = torch.stack([a[..., 0].mean((0, 2)) for a in attentions]).reshape(-1)
    for batches in ([{"input_ids": ids}], [{"input_ids": ids[:1]}, {"input_ids": ids[1:]}]):
        sinks = torch.tensor([h.sink_rate for h in diagnostics.collect(model, batches).heads])
        torch.testing.assert_close(sinks, rows, rtol=1e-5, atol=1e-6)


def test_quantized_softmax_row_sum_deficit_is_reported() -> None:
    model = tiny_model("bert")
    calib = [tiny_inputs("bert", batch=4, seq=96, seed=s) for s in range(2)]
    q = softq.quantize(model, calib, softq.QuantConfig(softmax_bits=4, softmax_output="edge"))
    assert diagnostics.collect(q, calib).mean_row_sum_deficit > 0.05
    table = diagnostics.collect(q, calib).table()
    assert "row-sum deficit" in table and "kurtosis" in table
    # codes relative to the row max (the default), normalised by their sum, lose no mass
    row = softq.quantize(model, calib, softq.QuantConfig(softmax_bits=4))
    assert diagnostics.collect(row, calib).mean_row_sum_deficit < 1e-6


def test_sensitivity_ranks_the_part_that_breaks_quantization(tmp_path) -> None:
    model = tiny_model("vit")
    calib = [tiny_inputs("vit", seed=s) for s in range(2)]
    q = softq.quantize(model, calib, softq.QuantConfig(weight_bits=2))
    x = tiny_inputs("vit", seed=5)
    with torch.no_grad():
        ref = model(**x).logits

    def error(m) -> float:
        with torch.no_grad():
            return (m(**x).logits - ref).norm().item()

    rows = sensitivity.sensitivity(q, error)
    names = [r[0] for r in rows]
    assert names[0] == "none (float)" and names[-1] == "all (W8A8)"
    assert rows[0][1] < 1e-5  # all quantizers really off
    by_name = dict(rows)
    kinds = {k: v for k, v in by_name.items() if k.startswith("kind:")}
    assert max(kinds, key=kinds.get) == "kind: linear weights"  # the 2-bit part dominates
    assert {"layer 0", "layer 1"} <= set(by_name)
    assert error(q) == pytest.approx(rows[-1][1])  # quantization restored afterwards
    text = sensitivity.format_sensitivity(rows, higher_is_better=False)
    assert text.splitlines()[2].split()[0] in ("kind:", "layer")
    png = diagnostics.plot({"float": diagnostics.collect(model, calib)}, tmp_path / "plots" / "d.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("family", ["gpt2", "vit"])
def test_save_and_load_round_trip(family: str, tmp_path) -> None:
    calib = [tiny_inputs(family, seed=s) for s in range(2)]
    # embedding_min_rows=100: the tiny GPT-2's 64-row token table stays float, its 128 positions do not
    config = softq.QuantConfig(bias_correction="head_row", softmax_bits=6, smoothquant_alpha=0.5,
                               softmax_output="edge", embedding_min_rows=100)
    q = softq.quantize(tiny_model(family), calib, config)
    if family == "gpt2":
        assert type(q.transformer.wte) is torch.nn.Embedding and type(q.transformer.wpe) is not torch.nn.Embedding
    io.save(q, tmp_path / "q")
    loaded = io.load(tmp_path / "q")
    x = tiny_inputs(family, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**x).logits, q(**x).logits, rtol=0, atol=0)
    assert loaded.softq_quant_config == config
    with pytest.raises(FileExistsError, match="overwrite"):
        io.save(q, tmp_path / "q")
    io.save(q, tmp_path / "q", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # no temp or backup left behind


def _floats(family: str, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tiny_inputs(family, seed=seed).items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, config", [
    ("gpt2", softq.QuantConfig()),  # per-channel Linears, both embedding tables (64 and 128 rows)
    ("vit", softq.QuantConfig(weight_bits=4, weight_per_channel=False)),  # one scale per Linear; conv, positions
    ("bert", softq.QuantConfig(weight_bits=12, embedding_bits=4)),  # int16 codes for the Linears, int8 for tables
])
def test_saved_weights_are_int8_codes_and_load_bit_exact(family, config, dtype, tmp_path) -> None:
    import copy
    import json

    from softq.quant.layers import QEmbedding, QLinear
    from softq.quant.quantizers import weight_codes

    calib = [_floats(family, s, dtype) for s in range(2)]
    q = softq.quantize(tiny_model(family).to(dtype), calib, config)
    io.save(q, tmp_path / "codes")
    io.save(q, tmp_path / "float", weights="float")
    meta = json.loads((tmp_path / "codes" / "quant_config.json").read_text())
    quantized = io._coded_weights(q)
    smaller = {k for k, (bits, _) in quantized.items() if (2 if bits > 8 else 1) < dtype.itemsize}
    assert meta["format"] == 2 and set(meta["coded_weights"]) == smaller  # every quantized weight codes shrink
    # which are: the quantized Linears' and tables' weights, the conv's and the position table's parametrizations
    assert set(quantized) == {f"{n}.weight" for n, m in q.named_modules() if isinstance(m, (QLinear, QEmbedding))} | {
        n for n, _ in q.named_parameters()
        if n.endswith((".parametrizations.weight.original", ".parametrizations.position_embeddings.original"))}
    assert sum(k.endswith(".original") for k in quantized) == (2 if family == "vit" else 0)
    assert len(quantized) == {"gpt2": 11, "vit": 15, "bert": 16}[family]
    state = torch.load(tmp_path / "codes" / "model.pt", weights_only=True)
    assert not smaller & set(state) and set(quantized) - smaller <= set(state)
    assert all(state[k + io.CODES].dtype == (torch.int16 if bits > 8 else torch.int8)
               for k, (bits, _) in quantized.items() if k in smaller)
    assert (tmp_path / "codes" / "model.pt").stat().st_size < (tmp_path / "float" / "model.pt").stat().st_size
    x = _floats(family, 8, dtype)
    with torch.no_grad():
        reference = q(**x).logits
    for fmt in ("codes", "float"):
        loaded = io.load(tmp_path / fmt)
        assert next(loaded.parameters()).dtype == dtype  # a half model came back as float32, computing otherwise
        with torch.no_grad():
            torch.testing.assert_close(loaded(**x).logits, reference, rtol=0, atol=0)
        assert loaded.softq_weights_quantized == (fmt == "codes")
    loaded_state = loaded.state_dict()  # the float-format model; the codes one's quantizers, Brevitas' and softq's:
    coded = io.load(tmp_path / "codes")
    modules = dict(coded.named_modules())
    for key, (bits, axis) in quantized.items():
        w = dict(coded.named_parameters())[key]
        for mine, theirs in zip(weight_codes(w, bits, axis), weight_codes(loaded_state[key], bits, axis)):
            assert torch.equal(mine, theirs), key
        module = modules[key.rsplit(".", 1)[0]]
        if isinstance(module, (QLinear, QEmbedding)):  # Brevitas' codes, in float32 as the ONNX export takes them
            mine, twin = (copy.deepcopy(m).float() for m in (module, dict(q.named_modules())[key.rsplit(".", 1)[0]]))
            assert torch.equal(mine.int_weight(), twin.int_weight()), key
            assert torch.equal(mine.weight_scale(), twin.weight_scale()), key
    # a file from before the dtype was recorded: the weights' dtype
    meta_path = tmp_path / "float" / "quant_config.json"
    old = json.loads(meta_path.read_text())
    del old["dtype"], old["digest"]
    meta_path.write_text(json.dumps(old))
    with torch.no_grad():
        torch.testing.assert_close(io.load(tmp_path / "float")(**x).logits, reference, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits, axis", [(8, 0), (4, None), (8, 1)])
def test_decoded_weights_quantize_to_the_saved_codes(dtype, bits, axis) -> None:
    """What load rebuilds from int8 codes and float32 scales gives back the same codes and scales (the float32 scale:
    the bfloat16 one a bfloat16 weight's dtype holds moves some codes by a step)."""
    from softq.quant.quantizers import weight_codes, weight_codes32

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(4000, 64, generator=g) * torch.rand(4000, 1, generator=g) * 3).to(dtype)
    w[5] = 0  # an all-zero row (a padding token's embedding)
    codes, scale = weight_codes(w, bits, axis)
    again = weight_codes(io._decode_weight(codes.to(torch.int8), weight_codes32(w, bits, axis)[1], dtype), bits, axis)
    assert torch.equal(again[0], codes) and torch.equal(again[1], scale)


def test_a_weight_whose_codes_would_not_come_back_is_saved_float(tmp_path, monkeypatch) -> None:
    q = softq.quantize(tiny_model("gpt2"), [tiny_inputs("gpt2", seed=s) for s in range(2)],
                       softq.QuantConfig(input_smoothing=None))
    decode = io._decode_weight
    off = q.transformer.h[1].mlp.c_proj.weight  # its decoded weight a step off in one row
    monkeypatch.setattr(io, "_decode_weight", lambda codes, scale, dtype: decode(codes, scale, dtype) + (
        torch.nn.functional.pad(scale.expand(-1, 1), (0, codes.shape[1] - 1)) if codes.shape == off.shape else 0))
    io.save(q, tmp_path / "q")
    monkeypatch.undo()
    state = torch.load(tmp_path / "q" / "model.pt", weights_only=True)
    shaped = [k for k, (_, _) in io._coded_weights(q).items() if q.get_parameter(k).shape == off.shape]
    assert shaped and all(k in state and k + io.CODES not in state for k in shaped)  # float, as before
    assert any(k + io.CODES in state for k in io._coded_weights(q))
    x = tiny_inputs("gpt2", seed=8)
    with torch.no_grad():
        torch.testing.assert_close(io.load(tmp_path / "q")(**x).logits, q(**x).logits, rtol=0, atol=0)


def test_sensitivity_refuses_a_model_loaded_from_codes(tmp_path) -> None:
    calib = [tiny_inputs("bert", seed=s) for s in range(2)]
    q = softq.quantize(tiny_model("bert"), calib, softq.QuantConfig(input_smoothing=None))
    x = tiny_inputs("bert", seed=8)

    def metric(m) -> float:  # noqa: ANN001
        with torch.no_grad():
            return float((m(**x).logits - q(**x).logits).abs().max())

    io.save(q, tmp_path / "codes")
    coded = io.load(tmp_path / "codes")
    with pytest.raises(ValueError, match="loaded from weight codes .* weights='float'"):
        sensitivity.sensitivity(coded, metric)
    io.save(coded, tmp_path / "again", weights="float")  # float weights that are the codes': still flagged
    assert io.load(tmp_path / "again").softq_weights_quantized
    io.save(q, tmp_path / "float", weights="float")
    rows = dict(sensitivity.sensitivity(io.load(tmp_path / "float"), metric))
    assert rows["kind: linear weights"] > 0 and rows["all (W8A8)"] == 0
    with pytest.raises(ValueError, match="weights must be one of 'codes', 'float', got 'int8'"):
        io.save(q, tmp_path / "bad", weights="int8")
    assert not (tmp_path / "bad").exists()


def test_hugging_face_save_and_pickling_refused_with_what_works(tmp_path) -> None:
    # save_pretrained wrote the float weights plus the quantizers' tensors, which from_pretrained called ignorable
    # and dropped: a float model back without an error; torch.save failed inside Brevitas' injector classes
    import copy
    import io as bytes_io

    calib = [tiny_inputs("bert", seed=s) for s in range(2)]
    q = softq.quantize(tiny_model("bert"), calib)
    for save in (q.save_pretrained, q.push_to_hub):
        with pytest.raises(ValueError, match=r"unquantized: use softq\.quant\.save"):
            save(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(TypeError, match=r"torch\.save\(model\) does not work .* softq\.quant\.save"):
        torch.save(q, bytes_io.BytesIO())
    io.save(q, tmp_path / "q")
    with pytest.raises(ValueError, match="softq.quant.save"):
        io.load(tmp_path / "q").save_pretrained(tmp_path / "hf")
    twin = copy.deepcopy(q)  # softq copies models: deep copies still work, and are independent
    x = tiny_inputs("bert", seed=8)
    with torch.no_grad():
        torch.testing.assert_close(twin(**x).logits, q(**x).logits, rtol=0, atol=0)
        twin.bert.encoder.layer[0].output.dense.weight.add_(1.0)
        assert not torch.equal(twin(**x).logits, q(**x).logits)
    tiny_model("bert").save_pretrained(tmp_path / "float")  # a float model is not affected


def test_encoder_without_pooler_round_trip(tmp_path) -> None:
    # sentence encoders are BertModel(config, add_pooling_layer=False): load must rebuild it without the pooler
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, max_position_embeddings=128, num_hidden_layers=2,
                                  num_attention_heads=4, hidden_size=32, intermediate_size=64)
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    with torch.no_grad():  # biases as trained (nonzero): the loaded model's layers were left in training mode,
        for name, p in model.named_parameters():  # whose Brevitas path adds the bias apart (outputs off)
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    calib = [tiny_inputs("bert", seed=s) for s in range(2)]
    q = softq.quantize(model, calib)
    io.save(q, tmp_path / "q")
    loaded = io.load(tmp_path / "q")
    assert loaded.pooler is None
    assert not any(m.training for m in loaded.modules())
    x = tiny_inputs("bert", seed=8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**x).last_hidden_state, q(**x).last_hidden_state, rtol=0, atol=0)


def test_row_codes_round_trip_and_older_files_load_as_edge(tmp_path) -> None:
    import json

    calib = [tiny_inputs("gpt2", seed=s) for s in range(2)]
    # quantize_residual=True: what every file saved before the field took "auto" holds; a score grid, as every
    # file saved before softmax_output existed has
    q = softq.quantize(tiny_model("gpt2"), calib, softq.QuantConfig(softmax_bits=4, softmax_output="row_exact",
                                                                    quantize_residual=True, softmax_input="row"))
    io.save(q, tmp_path / "q", weights="float")  # format 1, as older files
    loaded = io.load(tmp_path / "q")
    x = tiny_inputs("gpt2", seed=8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**x).logits, q(**x).logits, rtol=0, atol=0)
    # a file written before softmax_output existed holds the uniform edge codes
    meta_path = tmp_path / "q" / "quant_config.json"
    meta = json.loads(meta_path.read_text())
    del meta["quant_config"]["softmax_output"]
    del meta["softmax_input_resolved"]  # recorded since softmax_input="auto" resolves to "float" for row codes
    del meta["digest"]  # and the digest since 2026-12-05
    meta_path.write_text(json.dumps(meta))
    old = io.load(tmp_path / "q")
    assert old.softq_quant_config.softmax_output == "edge"
    assert {m.representation for m in old.modules() if hasattr(m, "representation")} == {"edge"}


@pytest.mark.parametrize("saved", [
    # accepted with softmax_bits=None before 2026-12-05 (the residual stream float, as in the saved model)
    {"softmax_scale": "calibrated", "softmax_output": "edge", "quantize_residual": False},
    {"softmax_input": "tensor"},
    {"softmax_input": None},  # a file from before softmax_input existed (the field absent)
])
def test_float_softmax_files_with_settings_now_refused_still_load(tmp_path, saved) -> None:
    """QuantConfig now refuses settings that did nothing (a softmax grid with softmax_bits=None, smoothing_into_v=True
    with nothing to fold); files saved with them, or with defaults that now read as them, still load as what they
    computed: load used to fail on its own default (softmax_input 'tensor' for a file without the field)."""
    import json

    calib = [tiny_inputs("bert", seed=s) for s in range(2)]
    q = softq.quantize(tiny_model("bert"), calib, softq.QuantConfig(softmax_bits=None))
    io.save(q, tmp_path / "q", weights="float")  # format 1, as older files
    meta_path = tmp_path / "q" / "quant_config.json"
    meta = json.loads(meta_path.read_text())
    for key, value in {**saved, "smoothing_into_v": True, "input_smoothing": None, "percentile": 90.0}.items():
        if value is None:
            meta["quant_config"].pop(key)
        else:
            meta["quant_config"][key] = value
    meta.pop("softmax_input_resolved", None)
    del meta["digest"]  # an older file
    meta_path.write_text(json.dumps(meta))
    loaded = io.load(tmp_path / "q")
    config = loaded.softq_quant_config
    assert config.softmax_bits is None and config.softmax_scale == "fixed" and config.smoothing_into_v is False
    assert config.softmax_input in ("auto", "float") and config.observer == "minmax" and config.percentile == 99.99


def test_load_and_save_refuse_bad_input(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="missing config.json, quant_config.json, model.pt"):
        io.load(tmp_path)
    with pytest.raises(ValueError, match="expects a model returned by softq.quantize"):
        io.save(tiny_model("gpt2"), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_load_names_the_damaged_file(tmp_path) -> None:
    import json
    import shutil

    q = softq.quantize(tiny_model("gpt2"), [tiny_inputs("gpt2", seed=s) for s in range(2)],
                       softq.QuantConfig(input_smoothing=None))
    io.save(q, tmp_path / "good")
    io.save(q, tmp_path / "good1", weights="float")  # format 1, as every directory saved before 2026-12-05

    def damaged(name: str, change) -> Path:  # noqa: ANN001 - a copy of the saved model with one file changed
        target = tmp_path / name
        shutil.copytree(tmp_path / "good", target)
        change(target)
        return target

    def truncate(d: Path) -> None:
        data = (d / "model.pt").read_bytes()
        (d / "model.pt").write_bytes(data[:len(data) // 2])

    def config(d: Path) -> None:  # another width: the weights no longer fit (a directory saved before the digest)
        cfg = json.loads((d / "config.json").read_text())
        older(d)
        (d / "config.json").write_text(json.dumps({**cfg, "n_embd": 64}))

    def older(d: Path) -> None:  # the float-weights file (format 1) without its digest: as saved before the digest
        shutil.rmtree(d)
        shutil.copytree(tmp_path / "good1", d)
        edit(d, lambda meta: meta.pop("digest"))

    def edit(d: Path, change) -> None:  # noqa: ANN001 - quant_config.json changed in place
        meta = json.loads((d / "quant_config.json").read_text())
        change(meta)
        (d / "quant_config.json").write_text(json.dumps(meta))

    def resave(d: Path, change) -> None:  # noqa: ANN001 - model.pt changed in place
        state = torch.load(d / "model.pt", weights_only=True)
        change(state)
        torch.save(state, d / "model.pt")

    def option(d: Path) -> None:  # loaded, it would re-quantize model.pt's float weights as symmetric
        edit(d, lambda meta: meta["quant_config"].update(act_symmetric=True))

    def old_and_malformed(key: str, value: object):  # noqa: ANN202 - no digest (an older file), a bad record
        return lambda d: (older(d), edit(d, lambda meta: meta.update({key: value})))

    def resigned(key: str, value: object):  # noqa: ANN202 - a bad record under a digest that fits it
        def change(d: Path) -> None:
            hf_config = json.loads((d / "config.json").read_text())
            edit(d, lambda meta: (meta.update({key: value}), meta.update(digest=io._digest(meta, hf_config))))
        return change

    cases = [
        ("truncated", truncate, r"model.pt cannot be read \(truncated or not saved by softq"),
        ("foreign", lambda d: torch.save({"weight": torch.zeros(2)}, d / "model.pt"),
         r"model.pt does not match the model of .*config.json and quant_config.json: tensors .*missing"),
        ("not_tensors", lambda d: torch.save([1, 2], d / "model.pt"), "model.pt is not a state dict saved by softq"),
        ("bad_meta", lambda d: (d / "quant_config.json").write_text("{'format': 1"), "quant_config.json is not valid JSON"),
        ("empty_config", lambda d: (d / "config.json").write_text(""), "config.json"),
        ("other_width", config, "tensors .* of another shape"),
        ("edited_option", option, "quant_config.json or config.json was changed after softq saved them"),
        ("edited_hf_config", lambda d: (d / "config.json").write_text(
            (d / "config.json").read_text().replace('"gelu_new"', '"relu"')), "changed after softq saved them"),
        ("bad_init_kwargs", old_and_malformed("init_kwargs", {"foo": 1}), "init_kwargs do not fit GPT2LMHeadModel"),
        ("init_kwargs_list", old_and_malformed("init_kwargs", [1]), r"malformed init_kwargs"),
        ("bad_record", old_and_malformed("softmax_outputs", {"transformer.h.0.attn.softq.probs": {"causal_rows": True}}),
         "malformed softmax_outputs"),
        ("newer", lambda d: edit(d, lambda meta: meta.update(format=3)), r"unsupported softq format 3 \(this softq "
         "reads 1 to 2"),
        ("codes_list", resigned("coded_weights", ["transformer.h.0.mlp.c_fc.weight"]),
         "malformed coded_weights"),
        ("codes_of_float", resigned("coded_weights", {"transformer.ln_f.weight": "float32"}),
         "lists coded weights for 'transformer.ln_f.weight', which the model does not quantize"),
        ("codes_without_scales", lambda d: resave(d, lambda state: state.pop("lm_head.weight" + io.SCALE)),
         "does not hold the codes of lm_head.weight that quant_config.json lists"),
        ("codes_as_ints", resigned("coded_weights", {"lm_head.weight": "int8"}),
         "coded weight lm_head.weight has dtype 'int8', not a floating-point one"),
        ("codes_and_floats", lambda d: resave(d, lambda state: state.update({"lm_head.weight": torch.zeros(64, 32)})),
         "model.pt holds both float weights and codes for lm_head.weight"),
        ("codes_as_floats", lambda d: resave(d, lambda state: state.update(
            {"lm_head.weight" + io.CODES: state["lm_head.weight" + io.CODES].float()})), "does not hold the codes"),
        ("no_digest", lambda d: edit(d, lambda meta: meta.pop("digest")), "quant_config.json has no digest: it was "
         "changed after softq saved it"),
        ("codes_out_of_range", lambda d: resave(d, lambda state: state[f"lm_head.weight{io.CODES}"].__setitem__(
            (0, 0), -128)), "the codes of lm_head.weight reach 128, outside the 8-bit range"),
        ("scales_nan", lambda d: resave(d, lambda state: state[f"lm_head.weight{io.SCALE}"].__setitem__(
            (1, 0), float("nan"))), "the scales of lm_head.weight are not all positive finite floats"),
        ("scales_as_ints", lambda d: resave(d, lambda state: state.update(
            {f"lm_head.weight{io.SCALE}": state[f"lm_head.weight{io.SCALE}"].to(torch.int8)})), "not all positive "
         "finite floats"),
        ("scales_of_another_shape", lambda d: resave(d, lambda state: state.update(
            {"lm_head.weight" + io.SCALE: state["lm_head.weight" + io.SCALE][:3]})),
         r"the codes of lm_head.weight \(\(64, 32\)\) and their scales \(\(3, 1\)\) do not fit together"),
    ]
    for name, change, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            io.load(damaged(name, change))
        assert len(str(err.value).splitlines()) == 1, str(err.value)


def test_save_replaces_a_file_and_is_not_blocked_by_a_leftover(tmp_path) -> None:
    q = softq.quantize(tiny_model("gpt2"), [tiny_inputs("gpt2", seed=s) for s in range(2)],
                       softq.QuantConfig(input_smoothing=None))
    (tmp_path / "q").write_text("a file where the model goes")
    (tmp_path / ".q.old").mkdir()  # what an interrupted run of an older version could leave
    (tmp_path / ".q.old" / "x").write_text("x")
    io.save(q, tmp_path / "q", overwrite=True)
    assert (tmp_path / "q" / "model.pt").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".q.old", "q"]
    with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
        io.save(q, tmp_path / "q" / "model.pt" / "inner")


def test_the_package_never_imports_the_benchmarks() -> None:
    """The reference workloads and benchmark helpers live in benchmarks/, outside the installed package: no module
    of softq may import them, not even inside a function (a wheel has no benchmarks/)."""
    import ast
    from pathlib import Path

    root = Path(softq.__file__).parent
    offenders = []
    for path in sorted([*root.glob("*.py"), *(p for part in softq.PARTS[:4] for p in (root / part).glob("*.py"))]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(root)}: {n}" for n in names
                          if n.split(".")[0] in ("workloads", "benchutil", "reference", "benchmarks")
                          or n.startswith("softq.workloads")]
    assert offenders == []


@pytest.mark.parametrize("package, forbidden", [
    ("calib", ("quant",)),  # quant builds on calib (observers, SmoothQuant, data checks): no cycle
])
def test_layering_no_upward_imports(package: str, forbidden: tuple[str, ...]) -> None:
    """A lower package never imports a higher one, not even inside a function."""
    import ast
    from pathlib import Path

    root = Path(getattr(softq, package).__file__).parent
    offenders = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if isinstance(node, ast.ImportFrom) and node.module == "softq":
                names = [f"softq.{a.name}" for a in node.names]
            offenders += [f"{path.name}: {n}" for n in names
                          if any(n == f"softq.{f}" or n.startswith(f"softq.{f}.") for f in forbidden)]
    assert offenders == []


def test_written_files_get_the_default_mode(tmp_path) -> None:
    # mkstemp / mkdtemp make 0600 / 0700 entries: a saved model or an exported file was readable by its owner only
    import os

    from softq.export import to_onnx

    mask = os.umask(0)
    os.umask(mask)
    q = softq.quantize(tiny_model("gpt2"), [tiny_inputs("gpt2", seed=s) for s in range(2)],
                       softq.QuantConfig(input_smoothing=None))
    saved = io.save(q, tmp_path / "q")
    onnx_path = to_onnx(q, tmp_path / "q.onnx", tiny_inputs("gpt2"))
    assert (saved.stat().st_mode & 0o777) == 0o777 & ~mask
    assert (Path(onnx_path).stat().st_mode & 0o777) == 0o666 & ~mask
    assert ((saved / "model.pt").stat().st_mode & 0o777) == 0o666 & ~mask
