"""Block-by-block calibration (``QuantConfig(calibration="blocks")``, softq/quant/sequential.py) against the
whole-model path: bit-identical where the passes see the same inputs, within a stated tolerance under "auto"."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import tiny_model
from tiny_families import build

import softq
from softq.quant import sequential
from softq.quant.quantizers import ActQuantizer

pytestmark = pytest.mark.usefixtures("one_thread")


def _calib(vocab: int, n: int = 4, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for i in range(n):
        mask = torch.ones(2, seq, dtype=torch.long)
        if i % 2:
            mask[1, seq - 5:] = 0  # padding: its rows are never observed, on both paths
        batches.append({"input_ids": torch.randint(3, vocab, (2, seq), generator=g), "attention_mask": mask})
    return batches


def _output(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**batch)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _identical(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_blocks_equal_the_whole_model_with_a_fixed_smoothing(family: str) -> None:
    # a fixed alpha: each pass sees on the block what it sees in the whole model (observation: the observed
    # model's outputs before smoothing; weight bias correction: the uncorrected quantized model's), so every range,
    # smoothing scale and bias shift is the same, bit for bit
    model = build("llama").eval() if family == "llama" else tiny_model("bert")
    vocab = model.config.vocab_size
    calib = _calib(vocab)
    config = dict(input_smoothing=0.8, smoothing_into_v=False)
    whole = softq.quantize(model, calib, softq.QuantConfig(calibration="model", **config))
    blocks = softq.quantize(model, calib, softq.QuantConfig(calibration="blocks", **config))
    assert _identical(whole, blocks)
    assert blocks.softq_block_smoothing == [0.8] * len(blocks.softq_block_smoothing)
    test = _calib(vocab, 1)[0]
    assert torch.equal(_output(whole, test), _output(blocks, test))
    assert not blocks.training and not any(m.training for m in blocks.modules())


def test_blocks_equal_the_whole_model_with_softmax_bias_correction() -> None:
    # the softmax bias correction measures on the weight-corrected model: a third stream carried block to block
    model, calib = build("llama").eval(), _calib(96)
    config = dict(input_smoothing=None, softmax_output="row_exact", bias_correction="head")
    whole = softq.quantize(model, calib, softq.QuantConfig(calibration="model", **config))
    blocks = softq.quantize(model, calib, softq.QuantConfig(calibration="blocks", **config))
    assert _identical(whole, blocks)


def test_auto_search_block_by_block_copies_one_block_and_stays_near_the_whole_model(monkeypatch) -> None:
    # "auto" judges each block's candidates on that block's output (the float model's there), so its alphas may
    # differ from the whole model's single one; the result stays within 25% of the whole-model path's output error
    # (tiny Llama: 0.0196 whole, 0.0162 blocks when written)
    model, calib = build("llama").eval(), _calib(96, 2)
    whole = softq.quantize(model, calib, softq.QuantConfig(calibration="model"))
    copied: list[int] = []
    from softq.quant import copies, smoothing_search, v_fold

    def counting(m: torch.nn.Module, shared: tuple = ()) -> torch.nn.Module:
        copied.append(sum(p.numel() for p in m.parameters() if not any(p is s for s in shared)))
        return copies.independent_copy(m, shared)

    monkeypatch.setattr(smoothing_search, "independent_copy", counting)
    monkeypatch.setattr(v_fold, "independent_copy", counting)
    blocks = softq.quantize(model, calib, softq.QuantConfig(calibration="blocks"), inplace=False)
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    tail = sum(p.numel() for p in model.lm_head.parameters()) + sum(p.numel() for p in model.model.norm.parameters())
    assert copied and max(copied) <= max(block, tail) < sum(p.numel() for p in model.parameters()) / 2
    assert len(blocks.softq_block_smoothing) == len(model.model.layers) + 1  # the blocks, then lm_head's stage
    test = _calib(96, 1, 24)[0]
    ref = _output(model, test)

    def err(q: torch.nn.Module) -> float:
        return float((_output(q, test) - ref).norm() / ref.norm())

    assert err(blocks) <= 1.25 * err(whole)
    assert err(blocks) < 0.05


def test_calibration_choice_and_refusals(monkeypatch) -> None:
    with pytest.raises(ValueError, match="calibration must be 'auto', 'model' or 'blocks'"):
        softq.QuantConfig(calibration="layers")
    small = build("llama").eval()
    assert not sequential.wanted(small, softq.QuantConfig())  # a tiny model: the whole-model path
    assert sequential.wanted(small, softq.QuantConfig(calibration="blocks"))
    # a quantized module before the first block (a ViT's patch projection): blocks refused in one line
    vit = build("clip-vision").eval()
    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="embeddings.patch_embedding is quantized and runs before it"):
        softq.quantize(vit, [px, px], softq.QuantConfig(calibration="blocks", input_smoothing=None))
    monkeypatch.setattr(sequential, "_available_bytes", lambda: sequential.model_bytes(small))  # no room for 2 copies
    assert sequential.wanted(small, softq.QuantConfig())


def test_a_copy_that_would_not_fit_quantizes_in_place(monkeypatch) -> None:
    model, calib = build("llama").eval(), _calib(96, 2)
    monkeypatch.setattr(sequential, "_available_bytes", lambda: sequential.model_bytes(model))
    with pytest.warns(UserWarning, match="would not fit in the free memory; quantizing it in place"):
        q = softq.quantize(model, calib, softq.QuantConfig(input_smoothing=None))
    assert q is model and any(isinstance(m, ActQuantizer) for m in model.modules())
    assert sequential.wanted(model, softq.QuantConfig())  # and calibrated block by block


def test_gemma2_layers_keep_their_own_masks() -> None:
    # Gemma 2 alternates sliding-window and global layers, each given its own mask by the model: every block's
    # inputs are captured, not the first block's reused
    model = build("gemma2").eval()
    calib = _calib(96, 4, 24)  # longer than the window of 8
    config = dict(input_smoothing=0.8, smoothing_into_v=False)
    whole = softq.quantize(model, calib, softq.QuantConfig(calibration="model", **config))
    blocks = softq.quantize(model, calib, softq.QuantConfig(calibration="blocks", **config))
    assert _identical(whole, blocks)


def _dispatched(tmp_path, devices: dict[int, str] | None = None) -> torch.nn.Module:
    """The tiny Llama dispatched by accelerate, its blocks offloaded to disk in ``tmp_path`` (or on ``devices``)."""
    accelerate = pytest.importorskip("accelerate")
    model = build("llama").eval()
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    for i in range(len(model.model.layers)):
        device_map[f"model.layers.{i}"] = (devices or {}).get(i, "disk")
    return accelerate.dispatch_model(model, device_map, offload_dir=str(tmp_path))


@pytest.fixture(scope="module")
def loaded_blocks(one_thread) -> torch.nn.Module:
    """The tiny Llama quantized loaded, block by block: what an offloaded or dispatched one must equal."""
    return softq.quantize(build("llama").eval(), _calib(96, 4), softq.QuantConfig(calibration="blocks"))


def _same_as_loaded(loaded: torch.nn.Module, model: torch.nn.Module) -> None:
    test = _calib(96, 1)[0]
    assert torch.equal(_output(loaded, test), _output(model, test))
    ids = test["input_ids"][:1, :6]
    assert torch.equal(loaded.generate(ids, max_new_tokens=6, do_sample=False),
                       model.generate(ids, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("where", ["disk", "cpu"])
def test_offloaded_model_equals_the_loaded_one(tmp_path, loaded_blocks, where: str) -> None:
    # accelerate's disk offload (.dat files) and CPU offload (a CPU state dict): each block loaded while it is
    # calibrated, then written back quantized where it came from and loaded per call by one hook; forward and
    # generate equal the model quantized loaded
    accelerate = pytest.importorskip("accelerate")
    if where == "disk":
        model = _dispatched(tmp_path)
    else:
        model = build("llama").eval()
        weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
        floats = [weakref.ref(t) for n, t in weights.items() if n.startswith("model.layers.")]
        model = accelerate.cpu_offload(model, execution_device="cpu", state_dict=weights)
        del weights  # held by accelerate's hooks alone
    with pytest.warns(UserWarning, match="offloaded by accelerate; quantizing it in place"):
        offloaded = softq.quantize(model, _calib(96, 4), softq.QuantConfig())
    assert offloaded is model and offloaded.softq_block_smoothing == loaded_blocks.softq_block_smoothing
    layers = offloaded.model.layers
    assert all(t.is_meta for t in layers.state_dict().values())  # kept offloaded: nothing of the blocks in memory
    if where == "disk":
        assert (tmp_path / "softq-quantized" / "model.layers.1" / "index.json").is_file()
    else:  # the float CPU state dict accelerate loaded from is not kept alive (by the hooks outside the blocks)
        gc.collect()
        assert floats and not any(ref() is not None for ref in floats)
    _same_as_loaded(loaded_blocks, offloaded)
    assert all(t.is_meta for t in layers.state_dict().values())
    with pytest.raises(ValueError, match="offloaded by accelerate .* quantize the model loaded without offload"):
        softq.quant.save(offloaded, tmp_path / "q")


def test_dispatched_model_is_copied_with_hooks_of_its_own(loaded_blocks) -> None:
    # dispatched by accelerate, nothing offloaded, inplace=False: the copy is quantized (its hooks deep-copied with
    # it), the original keeps its weights and outputs, and the copy's .to moves the copy (accelerate's wrapper of
    # .to is bound to the original)
    accelerate = pytest.importorskip("accelerate")
    model = build("llama").eval()
    model = accelerate.dispatch_model(model, {"": "cpu"}, force_hooks=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qmodel = softq.quantize(model, _calib(96, 4), softq.QuantConfig(calibration="blocks"))
    assert qmodel is not model and _identical(qmodel, loaded_blocks)
    _same_as_loaded(loaded_blocks, qmodel)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    qmodel.to(torch.float64)
    assert model.lm_head.weight.dtype == torch.float32 and qmodel.lm_head.weight.dtype == torch.float64


def test_offloaded_model_refuses_in_one_line(tmp_path) -> None:
    with pytest.raises(ValueError, match="calibration='model' would load them all at once; use calibration='blocks'"):
        softq.quantize(_dispatched(tmp_path), _calib(96, 2), softq.QuantConfig(calibration="model"))
    model = _dispatched(tmp_path / "gone")
    (tmp_path / "gone" / "model.layers.1.mlp.up_proj.weight.dat").unlink()
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight is offloaded by accelerate to .*\.dat, "
                                         "which does not exist: the offload folder was deleted or moved"):
        softq.quantize(model, _calib(96, 2), softq.QuantConfig())
    model = _dispatched(tmp_path / "hooked")
    hooks = pytest.importorskip("accelerate.hooks")
    hooks.add_hook_to_module(model.model.layers[0].mlp, hooks.ModelHook(), append=True)
    with pytest.raises(ValueError, match="model.layers.0 is offloaded by accelerate and has a ModelHook, an accelerate "
                                         "hook softq does not know"):
        softq.quantize(model, _calib(96, 2), softq.QuantConfig())


def test_meta_weights_without_accelerate_hooks_are_refused_in_one_line() -> None:
    model = build("llama").eval()
    model.model.layers[1].to_empty(device="meta")
    with pytest.raises(ValueError, match="on the meta device .* load real weights first"):
        softq.quantize(model, _calib(96, 2), softq.QuantConfig(calibration="blocks"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_blocks_on_cuda_equal_the_whole_model() -> None:
    # the block inputs stay where the model computes them (the block's device)
    model = build("llama").eval().cuda()
    calib = [{k: v.cuda() for k, v in b.items()} for b in _calib(96, 4)]
    config = dict(input_smoothing=0.8, smoothing_into_v=False)
    whole = softq.quantize(model, calib, softq.QuantConfig(calibration="model", **config))
    blocks = softq.quantize(model, calib, softq.QuantConfig(calibration="blocks", **config))
    assert _identical(whole, blocks)
    assert all(t.is_cuda for t in blocks.state_dict().values() if t.numel())


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs CUDA")
def test_device_map_blocks_calibrate_on_their_own_devices(tmp_path) -> None:
    # a device_map with blocks on cuda:0 (or cuda:1), cpu and disk: each block calibrated where it runs
    devices = {0: "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0", 1: "cpu"}
    calib = _calib(96, 4)
    config = softq.QuantConfig(calibration="blocks", input_smoothing=0.8, smoothing_into_v=False)
    loaded = softq.quantize(build("llama").eval(), calib, config)
    mapped = softq.quantize(_dispatched(tmp_path, devices), calib, config)
    assert all(t.device.type == "cuda" for t in mapped.model.layers[0].state_dict().values() if t.numel())
    test = _calib(96, 1)[0]
    torch.testing.assert_close(_output(mapped, test).cpu(), _output(loaded, test), rtol=1e-4, atol=1e-4)


def test_pieces_judge_and_calibrate_as_the_whole_rows(monkeypatch) -> None:
    # at scale the modules after the blocks are judged a piece of positions at a time against the float tail run
    # when asked (no vocabulary-wide rows of every held-out batch kept), and large weights are shared with the
    # smoothing candidates and dequantized a piece of channels at a time: every error the search computes, and the
    # result, are those of the whole rows, bit for bit.  Small piece sizes force all of it on a tiny Llama.
    from softq.quant import layers, smoothing_search

    model = build("llama").eval()
    calib = _calib(model.config.vocab_size, 8)  # 2 held-out batches, one with padding

    def run() -> tuple[torch.nn.Module, list[float]]:
        seen: list[float] = []
        real = smoothing_search.output_error

        def recording(m: torch.nn.Module, batches: list, reference: object) -> float:
            seen.append(real(m, batches, reference))
            return seen[-1]

        with monkeypatch.context() as patch:
            patch.setattr(smoothing_search, "output_error", recording)
            return softq.quantize(model, calib, softq.QuantConfig(calibration="blocks")), seen

    with monkeypatch.context() as patch:
        patch.setattr(sequential, "keeps_logits", lambda m: False)  # the float logits kept, judged whole
        whole, whole_errors = run()
    with monkeypatch.context() as patch:
        patch.setattr(sequential, "LOGITS_PIECE_BYTES", 4 * 2 * model.config.vocab_size * 4)  # 4 positions a piece
        pieces, piece_errors = run()
    assert len(whole_errors) > len(whole.model.layers) and piece_errors == whole_errors
    assert _identical(whole, pieces)
    # every Linear shared with the candidates (their smoothing factors beside the weight) and computed 8 output
    # channels at a time: the same choices; the errors equal up to float rounding (a product cut into pieces of 8
    # channels sums in another order on this tiny width; cut in powers of two at bench_llm_peers.py's lm_head, the
    # outputs were identical)
    with monkeypatch.context() as patch:
        patch.setattr(sequential, "LOGITS_PIECE_BYTES", 4 * 2 * model.config.vocab_size * 4)
        patch.setattr(layers, "PIECE_BYTES", 4 * model.config.hidden_size * 8)
        shared, shared_errors = run()
    assert shared_errors == pytest.approx(whole_errors, rel=1e-3)
    assert shared.softq_block_smoothing == whole.softq_block_smoothing
    test = _calib(model.config.vocab_size, 1)[0]
    assert torch.allclose(_output(shared, test), _output(whole, test), rtol=1e-4, atol=1e-5)
