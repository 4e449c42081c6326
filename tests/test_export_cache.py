"""Decoder files with a KV cache (``to_onnx(..., kv_cache=True)``) and generation from them in onnxruntime.

The tiny Llama (grouped K/V heads, RoPE) is quantized once; its cached file must give the quantized torch model's
greedy ``generate()`` tokens (left-padded batches included), sample reproducibly, refuse a file whose decode step
is wrong, and write ONNX external data past protobuf's limit (lowered here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_families import build, inputs

import softq
from softq.cli import main
from softq.export import onnx_utils, runtimes
from softq.export.cache_layout import CacheLayout
from softq.export.decoder_export import CachedDecoder
from softq.export.errors import ExportError
from softq.export.generate import generate
from softq.export.kv_reference import cache_attention
from softq.export.model_export import to_onnx
from softq.quant.kv_cache import stored_zero_point

pytestmark = pytest.mark.usefixtures("one_thread")
EOS = 2  # the tiny Llama's end-of-sequence id (LlamaConfig's default)


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """(quantized tiny Llama, its cached file, the folder)."""
    model = build("llama").eval()
    calib = [{k: torch.from_numpy(v) for k, v in inputs(model, seed, 2, 12, padded=False).items()} for seed in range(2)]
    qmodel = softq.quantize(model, calib, softq.QuantConfig())
    folder = tmp_path_factory.mktemp("cache")
    example = torch.from_numpy(inputs(model, 9, 2, 12, padded=False)["input_ids"])
    return qmodel, to_onnx(qmodel, str(folder / "llama.onnx"), example, kv_cache=True), folder


def _prompt(seed: int, batch: int, tokens: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 96, (batch, tokens))


def test_file_has_past_and_present_of_every_layer(cached):
    qmodel, path, _ = cached
    session = onnx_utils.session(path)
    names = [i.name for i in session.get_inputs()]
    layers = qmodel.config.num_hidden_layers
    assert names == ["input_ids", "attention_mask", "position_ids",
                     *(f"past_key_values.{i}.{p}" for i in range(layers) for p in ("key", "value"))]
    assert [o.name for o in session.get_outputs()] == ["logits", *(f"present.{i}.{p}" for i in range(layers)
                                                                   for p in ("key", "value"))]
    assert session.get_inputs()[3].shape[1] == qmodel.config.num_key_value_heads  # the cache keeps the K/V heads


def test_greedy_tokens_equal_torch_generate_left_padded_batch(cached):
    """Prefill from an empty past, then one step per token on the file's own present: torch's generate() tokens,
    a left-padded row included (positions from the mask), finished rows padded with the end-of-sequence id."""
    qmodel, path, _ = cached
    ids = _prompt(3, 3, 9)
    mask = np.ones_like(ids)
    mask[1, :4] = 0  # left padding, as generate() batches prompts
    ids[1, :4] = 0
    with torch.no_grad():
        want = qmodel.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=12,
                               do_sample=False, pad_token_id=EOS, eos_token_id=EOS).numpy()
    got = generate(path, ids, 12, attention_mask=mask, eos_token_id=EOS)
    assert got.shape == want.shape and got.shape[1] > ids.shape[1] + 4
    np.testing.assert_array_equal(got, want)


def test_sampling_is_seeded_and_top_k_one_is_greedy(cached):
    _, path, _ = cached
    ids = _prompt(4, 2, 6)
    runs = [generate(path, ids, 8, do_sample=True, temperature=1.5, top_k=40, top_p=0.95, seed=s) for s in (7, 7, 8)]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])
    assert runs[0].min() >= 0 and runs[0].max() < 96
    np.testing.assert_array_equal(generate(path, ids, 8, do_sample=True, top_k=1, seed=3), generate(path, ids, 8))


def test_a_file_wrong_at_decode_is_refused(cached, tmp_path, monkeypatch):
    """A graph that ignores its past is right at the prefill and wrong at every decode step: the check's decode step
    refuses it in one line, and nothing is written."""
    qmodel, _, _ = cached
    forward = CachedDecoder.forward

    def forgetful(self, input_ids, attention_mask, position_ids, *past):  # noqa: ANN001, ANN202
        return forward(self, input_ids, attention_mask, position_ids, *(p * 0 for p in past))

    monkeypatch.setattr(CachedDecoder, "forward", forgetful)
    with pytest.raises(ExportError, match=r"^the exported file's decode logits is .*% off the quantized torch model"
                                          r"[^\n]*nothing was written$"):
        to_onnx(qmodel, str(tmp_path / "bad.onnx"), torch.from_numpy(_prompt(5, 1, 8)), kv_cache=True)
    assert list(tmp_path.iterdir()) == []


def test_bad_inputs_are_one_line(cached, tmp_path):
    qmodel, path, _ = cached
    with pytest.raises(ExportError, match="at least 2 tokens"):
        to_onnx(qmodel, str(tmp_path / "m.onnx"), torch.tensor([[5]]), kv_cache=True)
    with pytest.raises(ValueError, match="outside this file's vocabulary of 96"):
        generate(path, [[3, 400]], 2)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        generate(path, [[3, 4]], 2, do_sample=True, top_p=1.5)
    full = to_onnx(qmodel, str(tmp_path / "full.onnx"), torch.from_numpy(_prompt(6, 1, 8)))
    with pytest.raises(ValueError, match=r"^this ONNX file has no KV cache inputs \(past_key_values\.0\.key \.\.\.\)$"):
        generate(full, [[3, 4]], 2)


def test_external_data_past_the_protobuf_limit(cached, tmp_path, monkeypatch):
    """Past the limit (lowered to a few KB) the weights go to one data file beside the .onnx, named afresh on each
    write: the checked, verified file generates the same tokens, and a rewrite removes the data it replaced."""
    qmodel, path, _ = cached
    monkeypatch.setattr(onnx_utils, "PROTOBUF_LIMIT", 4096)
    example = torch.from_numpy(inputs(qmodel, 9, 2, 12, padded=False)["input_ids"])
    target = tmp_path / "big.onnx"
    to_onnx(qmodel, str(target), example, kv_cache=True)
    first = sorted(p.name for p in tmp_path.iterdir())
    assert len(first) == 2 and first[0] == "big.onnx" and first[1].startswith("big.onnx.")
    assert target.stat().st_size < (tmp_path / first[1]).stat().st_size  # the weights are in the data file
    ids = _prompt(8, 2, 5)
    np.testing.assert_array_equal(generate(str(target), ids, 6), generate(path, ids, 6))
    to_onnx(qmodel, str(target), example, kv_cache=True, overwrite=True)
    second = sorted(p.name for p in tmp_path.iterdir())
    assert len(second) == 2 and second[1] != first[1]


def test_cli_generates_from_a_quantized_directory_and_a_file(cached, tmp_path, capsys):
    from softq.quant.io import save

    qmodel, path, _ = cached
    save(qmodel, tmp_path / "q")
    want = generate(path, [[50, 60, 70]], 5, eos_token_id=EOS)[0, 3:].tolist()
    assert len(want) == 5 and EOS not in want
    assert main(["generate", str(tmp_path / "q"), "--prompt-ids", "50,60,70", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in want]
    assert main(["generate", path, "--prompt-ids", "50,60,70", "--max-new-tokens", "5", "--sample", "--seed", "1"]) == 0
    sampled = capsys.readouterr().out.split()  # a file carries no end-of-sequence id: all 5 tokens
    assert sampled == [str(t) for t in generate(path, [[50, 60, 70]], 5, do_sample=True, seed=1)[0, 3:]]
    assert main(["generate", path, "--prompt", "hello"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("softq generate: error: ") and "has no tokenizer" in err and "--prompt-ids" in err
    assert len(err.splitlines()) == 1


def test_onnxruntime_genai_runs_the_file_with_its_config(cached, tmp_path):
    """onnxruntime-genai's generator runs softq's cached file as it is, given the genai_config.json softq writes:
    the same greedy tokens."""
    og = pytest.importorskip("onnxruntime_genai")
    import shutil

    from softq.export.genai import write_genai_config

    qmodel, path, _ = cached
    shutil.copy(path, tmp_path / "model.onnx")
    write_genai_config(tmp_path / "model.onnx", qmodel.config)
    model = og.Model(str(tmp_path))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=15, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([[50, 60, 70, 11, 12]], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    want = generate(path, [[50, 60, 70, 11, 12]], 10, eos_token_id=EOS)[0]
    np.testing.assert_array_equal(np.asarray(generator.get_sequence(0), np.int64), want)


@pytest.mark.parametrize("runtime", ["tract", "openvino"])
def test_tract_and_openvino_run_the_cached_file(cached, runtime, capsys):
    """tract and OpenVINO run the int8-cache file as onnxruntime does (its int8 sign flip, grouped heads, the empty
    past of a prefill): the runner's prefill and decode step give onnxruntime's logits and cache codes bit for bit,
    and generate() in each gives onnxruntime's greedy tokens on a left-padded batch, as does ``softq generate
    --runtime`` (tract builds one runner for the prefill and one for every decode step: the cache's axes stay
    symbolic)."""
    if not runtimes.available(runtime):
        pytest.skip(f"{runtime} is not installed")
    _, path, _ = cached
    ids = _prompt(8, 2, 6)
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    layout = CacheLayout.of_file(path)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": np.where(mask == 0, 1, mask.cumsum(1) - 1),
             **layout.empty(2)}
    ours, theirs = runtimes.runner(path), runtimes.runner(path, runtime)
    for _ in range(2):  # the prefill, then a decode step on onnxruntime's present
        want = ours(feeds)
        for a, b in zip(theirs(feeds), want):
            np.testing.assert_array_equal(a, b)
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
        feeds = {"input_ids": want[0][:, -1:].argmax(-1), "attention_mask": mask,
                 "position_ids": mask.cumsum(1)[:, -1:] - 1, **layout.next_past(want)}
    got = generate(path, ids, 4, attention_mask=mask[:, :6], runtime=runtime)
    np.testing.assert_array_equal(got, generate(path, ids, 4, attention_mask=mask[:, :6]))
    for name in ("onnxruntime", runtime):
        assert main(["generate", path, "--prompt-ids", "50,60,70", "--max-new-tokens", "4", "--runtime", name]) == 0
    ours, theirs = capsys.readouterr().out.splitlines()
    assert len(ours.split()) == 4 and theirs == ours


def test_the_file_caches_the_torch_int8_codes(cached):
    """A model whose cache is int8 (QuantConfig().kv_cache resolves so at 8 bits) exports int8 past and present
    tensors: after a prefill and a decode step they are the codes of the torch model's Int8KVCache (within one
    code, a rounding tie), and the cores read the cache's codes, grouped per K/V head rather than repeated to the
    query heads: K's in the score MatMulInteger, V's as stored in the P.V GEMM (their one reader the GEMM's
    DequantizeLinear of scale 1, which onnxruntime fuses into MatMulIntegerToFloat: no conversion to the core's
    uint8 grid, no padded row-sum column, no float copy)."""
    import onnx
    from onnx import numpy_helper

    qmodel, path, _ = cached
    session = onnx_utils.session(path)
    assert {i.type for i in session.get_inputs()[3:]} == {"tensor(int8)"}
    ids = _prompt(11, 2, 7)
    with torch.no_grad():
        out = qmodel(input_ids=torch.from_numpy(ids), use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        out = qmodel(input_ids=nxt, cache=out.past_key_values, use_cache=True)
    want = [t.numpy() for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
    assert want[0].dtype == np.int8
    full = np.concatenate([ids, nxt.numpy()], 1)
    got = generate(path, full, 1)  # a prefill of the prompt and the next token's decode step, through the file
    np.testing.assert_array_equal(got[:, :-1], full)
    layers = qmodel.config.num_hidden_layers
    names = ["logits", *(f"present.{i}.{p}" for i in range(layers) for p in ("key", "value"))]
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(7), (2, 1)),
             **{f"past_key_values.{i}.{p}": np.zeros((2, qmodel.config.num_key_value_heads, 0, 8), np.int8)
                for i in range(layers) for p in ("key", "value")}}
    first = session.run(names, feeds)
    feeds.update({"input_ids": nxt.numpy(), "attention_mask": np.ones_like(full), "position_ids": np.full((2, 1), 7)})
    feeds.update(zip((n.replace("present", "past_key_values") for n in names[1:]), first[1:]))
    second = session.run(names, feeds)
    for a, b in zip(second[1:], want):
        assert a.dtype == np.int8 and a.shape == b.shape
        gap = np.abs(a.astype(np.int32) - b.astype(np.int32))
        assert gap.max() <= 1 and (gap == 0).mean() > 0.999
    graph = onnx.load(path).graph
    keys, values = {o.name for o in graph.output[1::2]}, {o.name for o in graph.output[2::2]}
    assert {n.op_type for n in graph.node if set(n.input) & keys} == {"Transpose", "Shape"}
    assert not [n for n in graph.node if n.op_type == "Tile"]  # 2 query heads per K/V head: grouped, not repeated
    readers = [n for n in graph.node if set(n.input) & values and n.op_type != "Shape"]
    assert [n.op_type for n in readers] == ["DequantizeLinear"] * layers
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    consts.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node if n.op_type == "Constant"})
    assert all(consts[n.input[1]] == 1.0 for n in readers)


def test_a_float_cache_on_request(cached, tmp_path):
    """``kv_cache="float"`` keeps the file's cache float (the same greedy tokens as the int8 file); an unknown
    kv_cache value is refused in one line."""
    qmodel, path, _ = cached
    example = torch.from_numpy(_prompt(5, 1, 8))
    floats = to_onnx(qmodel, str(tmp_path / "float.onnx"), example, kv_cache="float")
    assert onnx_utils.session(floats).get_inputs()[3].type == "tensor(float)"
    ids = _prompt(12, 2, 6)
    np.testing.assert_array_equal(generate(floats, ids, 6), generate(path, ids, 6))
    with pytest.raises(ExportError, match=r"^kv_cache must be False, True .* got 'int4'$"):
        to_onnx(qmodel, str(tmp_path / "x.onnx"), example, kv_cache="int4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["float.onnx"]


@pytest.mark.parametrize("scales", ["head", "channel"])
def test_per_head_and_per_channel_kv_scales_export(tmp_path, scales):
    """K and V points with a scale and zero point per K/V head (or per head and channel) export, with and without
    the cache: the cached file's present tensors after a prefill and a decode step are the torch model's int8 codes
    (each K/V head on its own grid), from which the numpy integer reference (export/kv_reference.py) computes the
    torch step's P.V; its greedy tokens are torch's, and the full-sequence file's logits torch's.  Per
    head, the scores stay one MatMulInteger of the query codes and the cache's K codes per K/V head (no Tile, no
    DequantizeLinear of the cache), the scales outside; per channel, K's scale does not factor out of Q.K^T, and
    the scores are a float MatMul per K/V head of the queries times the scales and the cache's K codes."""
    import onnx

    model = build("llama").eval()
    calib = [{k: torch.from_numpy(v) for k, v in inputs(model, 0, 2, 12, padded=False).items()}]
    qmodel = softq.quantize(model, calib, softq.QuantConfig(kv_scales=scales, input_smoothing=None,
                                                            weight_bias_correction=False))
    kv = qmodel.config.num_key_value_heads
    assert tuple(qmodel.model.layers[0].self_attn.softq.k.scale.shape) == ((kv, 1, 1) if scales == "head" else (kv, 1, 8))
    example = torch.from_numpy(_prompt(5, 2, 8))
    path = to_onnx(qmodel, str(tmp_path / "cached.onnx"), example, kv_cache=True)
    ids = _prompt(11, 2, 7)
    points = [layer.self_attn.softq for layer in qmodel.model.layers]
    seen = {}
    with torch.no_grad():
        out = qmodel(input_ids=torch.from_numpy(ids), use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        hooks = [p.q.register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(("q", k), o.numpy()))
                 for k, p in enumerate(points)]
        hooks += [p.pv.register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(("pv", k), o.numpy()))
                  for k, p in enumerate(points)]
        step = qmodel(input_ids=nxt, cache=out.past_key_values, use_cache=True)
        for h in hooks:
            h.remove()
        full_logits = qmodel(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
    want = [t.numpy() for layer in step.past_key_values.layers for t in (layer.keys, layer.values)]
    layers = qmodel.config.num_hidden_layers
    names = ["logits", *(f"present.{i}.{p}" for i in range(layers) for p in ("key", "value"))]
    session = onnx_utils.session(path)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(7), (2, 1)),
             **{f"past_key_values.{i}.{p}": np.zeros((2, kv, 0, 8), np.int8) for i in range(layers)
                for p in ("key", "value")}}
    first = session.run(names, feeds)
    feeds.update({"input_ids": nxt.numpy(), "attention_mask": np.ones((2, 8), np.int64),
                  "position_ids": np.full((2, 1), 7)})
    feeds.update(zip((n.replace("present", "past_key_values") for n in names[1:]), first[1:]))
    second = session.run(names, feeds)
    for a, b in zip(second[1:], want):
        assert a.dtype == b.dtype == np.int8
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(second[0][:, -1], step.logits[:, -1].numpy(), rtol=1e-4, atol=1e-5)
    for k, p in enumerate(points):  # the numpy integer reference on the file's codes: torch's P.V of the step
        grid = lambda point: (point.scale.numpy(), stored_zero_point(point).numpy())  # noqa: E731
        ref = cache_attention(seen["q", k], second[1 + 2 * k], *grid(p.k), second[2 + 2 * k], *grid(p.v),
                              qmodel.model.layers[k].self_attn.scaling)
        np.testing.assert_allclose(ref, seen["pv", k], rtol=1e-5, atol=1e-6)
    prompt = _prompt(12, 1, 5)
    with torch.no_grad():
        greedy = qmodel.generate(torch.from_numpy(prompt), max_new_tokens=6, do_sample=False).numpy()
    np.testing.assert_array_equal(generate(path, prompt, 6), greedy)
    graph = onnx.load(path).graph
    cache = {i.name for i in graph.input[3:]}
    readers = [n for n in graph.node if set(n.input) & cache]
    assert not [n for n in graph.node if n.op_type == "Tile"]  # the cache read per K/V head, never repeated
    if scales == "head":
        assert not [n for n in readers if n.op_type == "DequantizeLinear"]
        assert sum(n.op_type == "MatMulInteger" for n in graph.node) == 2 * layers + 7  # 7 layers' projections
    full = to_onnx(qmodel, str(tmp_path / "full.onnx"), example)
    got = onnx_utils.session(full).run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    np.testing.assert_allclose(got, full_logits, rtol=1e-4, atol=1e-5)


def test_a_sliding_window_model_exports_its_int8_cache(tmp_path):
    """Mistral's sliding window is the mask's in the file, whose int8 cache keeps every token: the check's torch
    reference keeps them too, and the file generates the torch model's greedy tokens past the window."""
    model = build("mistral").eval()
    assert model.config.sliding_window < 12
    calib = [{k: torch.from_numpy(v) for k, v in inputs(model, 0, 2, 12, padded=False).items()}]
    qmodel = softq.quantize(model, calib, softq.QuantConfig())
    path = to_onnx(qmodel, str(tmp_path / "m.onnx"), torch.from_numpy(inputs(model, 9, 2, 12, padded=False)["input_ids"]),
                   kv_cache=True)
    ids = _prompt(13, 1, 6)
    with torch.no_grad():
        want = qmodel.generate(torch.from_numpy(ids), max_new_tokens=10, do_sample=False, pad_token_id=EOS,
                               eos_token_id=EOS).numpy()
    np.testing.assert_array_equal(generate(path, ids, 10, eos_token_id=EOS), want)
