"""softq's ONNX files in runtimes other than onnxruntime: tract and OpenVINO (each skipped when not installed).

Integer-exact parts must equal the numpy reference: the ``int`` edge softmax bit for bit,
the ``int`` row-code core up to its one final float division (1 ulp); whole models must give onnxruntime's outputs (float parts: within float
rounding, which can flip an activation code at a tie, as between torch and onnxruntime).
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
import torch
from conftest import tiny_inputs, tiny_model

import softq
from softq.export import runtimes
from softq.export.int_softmax import SoftmaxQuant, reference_int, relative_codes, relative_codes_model, softmax_model
from softq.export.model_export import build_onnx, to_onnx
from softq.export.row_attention import RowQuant, reference, row_attention_model

OTHERS = [pytest.param(r, marks=pytest.mark.skipif(not runtimes.available(r), reason=f"{r} not installed"))
          for r in ("tract", "openvino")]
LOGIT_TOL = 0.02  # as tests/test_export_model.py: max |diff| / max |logit|


@pytest.fixture(scope="module")
def qmodels() -> dict[str, torch.nn.Module]:
    out = {}
    for family in ("bert", "gpt2", "opt", "vit"):
        calib = [tiny_inputs(family, seed=30 + i) for i in range(3)]
        out[family] = softq.quantize(tiny_model(family), calib, softq.QuantConfig())
        if family == "bert":  # the int form takes score codes
            out["bert-row"] = softq.quantize(tiny_model(family), calib, softq.QuantConfig(softmax_input="row"))
            out["bert-edge"] = softq.quantize(tiny_model(family), calib, softq.QuantConfig(softmax_output="edge"))
        if family in ("bert", "vit"):  # float softmax: the 'float' form
            out[f"{family}-float"] = softq.quantize(tiny_model(family), calib, softq.QuantConfig(softmax_bits=None))
        if family in ("gpt2", "vit"):  # input smoothing folded into the LayerNorms (export/fuse.py)
            out[f"{family}-smooth"] = softq.quantize(tiny_model(family), calib, softq.QuantConfig(input_smoothing=0.8))
    return out


def _feeds(family: str, seed: int) -> dict[str, np.ndarray]:
    x = tiny_inputs(family, batch=2, seq=11, seed=seed)
    if family == "vit":
        return {"pixel_values": x["pixel_values"].numpy()}
    mask = np.ones(tuple(x["input_ids"].shape), np.int64)
    mask[1, 7:] = 0  # padding in the second sequence
    return {"input_ids": x["input_ids"].numpy(), "attention_mask": mask}


@pytest.mark.parametrize("runtime", OTHERS)
# OPT: its position ids are a CumSum of the mask; the exporter's Cast of the int64 mask to int64 made tract fail
# ("TDim is not a number") and OpenVINO name the input port after the Cast (the runner found no attention_mask)
@pytest.mark.parametrize("model_key,form", [("bert", "fast"), ("bert-row", "int"), ("gpt2", "fast"), ("opt", "fast"),
                                            ("vit", "fast"),
                                            ("bert-edge", "qdq"), ("bert-edge", "int"), ("gpt2-smooth", "fast"),
                                            ("vit-smooth", "fast"), ("bert-float", "float"), ("vit-float", "float")])
def test_whole_model_matches_onnxruntime(qmodels, tmp_path, runtime, model_key, form):
    family = model_key.split("-")[0]
    # OPT at seed 5: a code at a rounding tie, on which onnxruntime differs from torch and OpenVINO, moves the
    # 3 later rows of a causal sequence (3 of its 18 rows; the check below allows 10%)
    feeds = _feeds(family, seed=6 if family == "opt" else 5)
    example = {k: torch.from_numpy(v) for k, v in feeds.items()}
    path = tmp_path / "m.onnx"
    onnx.save(build_onnx(qmodels[model_key], example, form), path)
    ref = runtimes.runner(path, "onnxruntime")(feeds)[0]
    run = runtimes.runner(path, runtime)
    out = run(feeds)[0]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.ndim == 3:  # per-token outputs: padded positions are don't-cares
        valid = feeds["attention_mask"].astype(bool)
        out, ref = out[valid], ref[valid]
    assert np.abs(out - ref).max() <= LOGIT_TOL * np.abs(ref).max()
    rows = np.abs(out - ref).reshape(-1, out.shape[-1]).max(-1) <= 1e-5 * np.abs(ref).max()
    assert rows.mean() >= 0.9  # equal but for a rare tie flip
    again = run(_feeds(family, seed=7))[0]  # a second input through the same runner
    assert not np.array_equal(again, run(feeds)[0])


@pytest.mark.parametrize("runtime", OTHERS)
def test_opt_runs_one_token(qmodels, tmp_path, runtime):
    """OPT's positions were cumsum(mask) * mask - 1: at one token tract made that Mul an int64 Square it has no
    kernel for ("Square does not support I64"); they are a Where now."""
    path = tmp_path / "opt.onnx"
    onnx.save(build_onnx(qmodels["opt"], {k: torch.from_numpy(v) for k, v in _feeds("opt", seed=5).items()}, "fast"),
              path)
    for batch in (1, 3):
        feeds = {"input_ids": np.full((batch, 1), 5, np.int64), "attention_mask": np.ones((batch, 1), np.int64)}
        ref = runtimes.runner(path, "onnxruntime")(feeds)[0]
        assert np.abs(runtimes.runner(path, runtime)(feeds)[0] - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("runtime", OTHERS)
def test_int64_integer_softmax_runs_in_tract_and_is_refused_by_openvino(tmp_path, runtime):
    """The int form with bias correction computes in int64; OpenVINO's CPU plugin runs it in int32 and returned
    logits far from onnxruntime's without an error.  The file says so in its metadata and the runner refuses it;
    tract computes it as onnxruntime does."""
    calib = [tiny_inputs("bert", seed=30 + i) for i in range(3)]
    qmodel = softq.quantize(tiny_model("bert"), calib, softq.QuantConfig(softmax_output="edge", bias_correction="head"))
    feeds = _feeds("bert", seed=5)
    path = tmp_path / "m.onnx"
    onnx.save(build_onnx(qmodel, {k: torch.from_numpy(v) for k, v in feeds.items()}, "int"), path)
    if runtime == "openvino":
        with pytest.raises(ValueError, match="computes in int64 .* OpenVINO's CPU plugin runs in int32"):
            runtimes.runner(path, runtime)
        return
    ref = runtimes.runner(path, "onnxruntime")(feeds)[0]
    assert np.abs(runtimes.runner(path, runtime)(feeds)[0] - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("runtime", OTHERS)
@pytest.mark.parametrize("representation", ["row", "row_exact"])
def test_row_int_core_matches_reference(tmp_path, runtime, representation):
    q = SoftmaxQuant(scale=0.05, zero_point=9)
    rq = RowQuant(q, 0.02, 7, 8, representation)
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (2, 3, 7, 33)).astype(np.uint8)
    v = rng.integers(0, 256, (2, 3, 33, 5)).astype(np.uint8)
    valid = np.broadcast_to(rng.random((2, 1, 7, 33)) < 0.6, x.shape).copy()
    valid[0, :, 2] = False  # a fully masked row
    path = tmp_path / "core.onnx"
    onnx.save(row_attention_model("int", rq, with_valid=True), path)
    y = runtimes.runner(path, runtime)({"x": x, "v": v, "valid": valid})[0]
    # integers up to the accumulators; the one float division at the end may round 1 ulp apart
    # (a runtime may multiply by the reciprocal): 2**-22 relative is 2 ulp of float32
    np.testing.assert_allclose(y, reference("int", x, v, rq, valid), rtol=2.0**-22, atol=0)
    assert np.all(y[0, :, 2] == 0)


@pytest.mark.parametrize("runtime", OTHERS)
def test_row_relative_input_stage_bit_exact(tmp_path, runtime):
    # causal rows, padding and a fully masked row
    q = SoftmaxQuant(scale=6.34 / 255, zero_point=255, relative=True)
    rng = np.random.default_rng(7)
    s = (rng.standard_normal((2, 3, 16, 16)) * 3).astype(np.float32)
    valid = np.broadcast_to(np.tril(np.ones((16, 16), bool)), (2, 1, 16, 16)).copy()
    valid[1, :, :, 12:] = False
    valid[0, :, 3] = False
    s += np.where(valid, 0, 50).astype(np.float32)  # masked keys far above the valid ones
    path = tmp_path / "codes.onnx"
    onnx.save(relative_codes_model(q, with_valid=True), path)
    ref = relative_codes(s, q, valid)
    assert (ref > 0).mean() > 0.3  # the check sees real codes, not only masked zeros
    np.testing.assert_array_equal(runtimes.runner(path, runtime)({"s": s, "valid": valid})[0], ref)


@pytest.mark.parametrize("runtime", OTHERS)
def test_the_ort_form_is_refused_outside_onnxruntime(qmodels, tmp_path, runtime):
    """The ``ort`` form's com.microsoft.QLinearSoftmax: OpenVINO ran it with other outputs than onnxruntime's
    and the torch model's, without an error; tract failed deep in its loader."""
    feeds = _feeds("bert", seed=5)
    path = tmp_path / "m.onnx"
    with pytest.warns(UserWarning, match="QLinearSoftmax has no mask input"):
        onnx.save(build_onnx(qmodels["bert-edge"], {k: torch.from_numpy(v) for k, v in feeds.items()}, "ort"), path)
    with pytest.raises(ValueError, match=r"onnxruntime's own QLinearSoftmax .* run it in onnxruntime"):
        runtimes.runner(path, runtime)


def test_the_ort_form_runs_unpadded_batches_only(qmodels, tmp_path):
    """QLinearSoftmax has no mask input: in a padded row the pad keys kept weight and onnxruntime returned other
    numbers than the torch model, with only the export's warning to say so."""
    feeds = _feeds("bert", seed=5)  # the second sequence padded
    path = tmp_path / "m.onnx"
    with pytest.warns(UserWarning, match="QLinearSoftmax has no mask input"):
        onnx.save(build_onnx(qmodels["bert-edge"], {k: torch.from_numpy(v) for k, v in feeds.items()}, "ort"), path)
    run = runtimes.runner(path, "onnxruntime")
    with pytest.raises(ValueError, match="attention_mask has padding, and this file's softmax .* has no mask input"):
        run(feeds)
    whole = {k: v[:1] for k, v in feeds.items()}  # the unpadded sequence: exact
    with torch.no_grad():
        ref = qmodels["bert-edge"](**{k: torch.from_numpy(v) for k, v in whole.items()}).logits.numpy()
    assert np.abs(run(whole)[0] - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("runtime", OTHERS)
def test_edge_int_softmax_bit_exact(tmp_path, runtime):
    q = SoftmaxQuant(scale=0.06, zero_point=0, signed=True)
    x = np.random.default_rng(4).integers(-128, 128, (2, 4, 9, 40)).astype(np.int8)
    path = tmp_path / "sm.onnx"
    onnx.save(softmax_model("int", q), path)
    y = runtimes.runner(path, runtime)({"x": x})[0]
    np.testing.assert_array_equal(y, reference_int(x, q))


def test_runner_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown runtime 'tflite'"):
        runtimes.runner(tmp_path / "m.onnx", "tflite")
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        runtimes.runner(tmp_path / "m.onnx", "onnxruntime", threads=0)


@pytest.mark.parametrize("runtime", [pytest.param("onnxruntime"), *OTHERS])
def test_runner_refuses_ids_outside_the_table_and_missing_inputs(qmodels, tmp_path, runtime):
    # without the check: onnxruntime raises, OpenVINO returns numbers read out of bounds, tract aborts the
    # process, and every runtime takes a negative id as counted from the table's end (the torch model raises)
    path = tmp_path / "bert.onnx"
    feeds = _feeds("bert", 2)
    onnx.save(build_onnx(qmodels["bert"], {k: torch.from_numpy(v) for k, v in feeds.items()}, "fast"), path)
    run = runtimes.runner(path, runtime)
    assert np.isfinite(run(feeds)[0]).all()
    for bad in (64, -3):
        ids = feeds["input_ids"].copy()
        ids[0, 2] = bad
        with pytest.raises(ValueError, match=rf"input_ids must be in \[0, 64\) .*got values from {ids.min()} to {ids.max()}$"):
            run({**feeds, "input_ids": ids})
    with pytest.raises(ValueError, match="missing input 'attention_mask'"):
        run({"input_ids": feeds["input_ids"]})
    # empty batches and sequences failed inside the runtime (onnxruntime: a Reshape of 0 elements)
    for empty, axis in (((0, 8), 0), ((2, 0), 1)):
        with pytest.raises(ValueError, match=re.escape(f"input_ids has shape {empty}: dimension {axis} is empty")):
            run({k: np.zeros(empty, np.int64) for k in feeds})


@pytest.mark.parametrize("runtime", [pytest.param("onnxruntime"), *OTHERS])
def test_longest_sequence_of_roberta_and_opt_files(tmp_path, runtime):
    """RoBERTa's positions start after its padding index: a 130-row table takes 128 tokens (the metadata said 130,
    and OpenVINO returned an empty output for 129); OPT's FP32 file runs in tract too (its int64 -> int64 Cast of
    the mask, which tract cannot take into the CumSum of the positions, is dropped there as in the INT8 file)."""
    from softq.export.model_export import to_onnx_float

    model = tiny_model("roberta")
    assert model.config.max_position_embeddings == 130 and model.config.pad_token_id == 1
    qmodel = softq.quantize(model, [tiny_inputs("roberta", seed=30 + i) for i in range(2)])
    path = to_onnx(qmodel, tmp_path / "roberta.onnx", tiny_inputs("roberta"))
    run = runtimes.runner(path, runtime)
    feeds = {k: np.ones((1, 128), np.int64) * (3 if k == "input_ids" else 1) for k in ("input_ids", "attention_mask")}
    assert np.isfinite(run(feeds)[0]).all() and run(feeds)[0].shape == (1, 3)
    with pytest.raises(ValueError, match="input_ids has 129 tokens; this model takes at most 128"):
        run({k: np.ones((1, 129), np.int64) for k in feeds})
    opt = tiny_model("opt")
    example = tiny_inputs("opt")
    path = to_onnx_float(opt, tmp_path / "opt_fp32.onnx", example)
    graph = onnx.load(path).graph
    assert not [n for n in graph.node if n.op_type == "Cast" and n.input[0] == "attention_mask"
                and n.attribute[0].i == onnx.TensorProto.INT64]  # the int64 mask's identity Cast
    ids = example["input_ids"].numpy()
    out = runtimes.runner(path, runtime)({"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    with torch.no_grad():
        ref = opt(**example).logits.numpy()
    np.testing.assert_allclose(out, ref, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("runtime", [pytest.param("onnxruntime"), *OTHERS])
def test_runner_refuses_feeds_the_file_would_misread(qmodels, tmp_path, runtime):
    """Without the checks OpenVINO returns numbers for a sequence longer than the position table (read out of
    bounds) and for a ViT image of another size, tract aborts the process on the first, and every runtime
    ignores token_type_ids (a sentence pair read as one segment)."""
    path = tmp_path / "bert.onnx"
    feeds = _feeds("bert", 3)
    to_onnx(qmodels["bert"], path, {k: torch.from_numpy(v) for k, v in feeds.items()})  # short names, as users get
    run = runtimes.runner(path, runtime)
    ref = run(feeds)[0]
    positions = qmodels["bert"].config.max_position_embeddings
    long = {k: np.ones((1, positions + 1), np.int64) for k in feeds}
    with pytest.raises(ValueError, match=rf"input_ids has {positions + 1} tokens; this model takes at most {positions} "):
        run(long)
    np.testing.assert_array_equal(run({k: v[:, :positions] for k, v in long.items()})[0].shape, ref[:1].shape)
    with pytest.raises(ValueError, match=r"attention_mask has 10 along '.*' where input_ids has 11: the two must agree"):
        run({**feeds, "attention_mask": feeds["attention_mask"][:, :10]})
    with pytest.raises(ValueError, match=r"input_ids must have 2 dimensions"):
        run({**feeds, "input_ids": feeds["input_ids"][0]})
    pair = np.zeros_like(feeds["input_ids"])
    pair[:, 5:] = 1
    with pytest.raises(ValueError, match="token_type_ids has nonzero values, but this file takes one segment"):
        run({**feeds, "token_type_ids": pair})
    np.testing.assert_array_equal(run({**feeds, "token_type_ids": np.zeros_like(pair)})[0], ref)  # what it computes
    with pytest.raises(ValueError, match=r"unexpected input 'position_ids' \(the file takes input_ids, attention_mask\)"):
        run({**feeds, "position_ids": pair})
    # a tokenizer's int32 ids convert to the file's int64 (onnxruntime raised its own INVALID_ARGUMENT)
    np.testing.assert_array_equal(run({k: v.astype(np.int32) for k, v in feeds.items()})[0], ref)
    with pytest.raises(ValueError, match="attention_mask must be int64, got float32"):
        run({**feeds, "attention_mask": feeds["attention_mask"].astype(np.float32)})
    vit = tmp_path / "vit.onnx"
    pixels = _feeds("vit", 3)["pixel_values"]
    to_onnx(qmodels["vit"], vit, torch.from_numpy(pixels))
    run = runtimes.runner(vit, runtime)
    assert run({"pixel_values": pixels})[0].shape == (2, qmodels["vit"].config.num_labels)
    np.testing.assert_array_equal(run({"pixel_values": pixels.astype(np.float64)})[0], run({"pixel_values": pixels})[0])
    wide = np.zeros(pixels.shape[:2] + (pixels.shape[2] * 2, pixels.shape[3] * 2), np.float32)
    with pytest.raises(ValueError, match=rf"pixel_values must have shape \[.*\], got {re.escape(str(wide.shape))}: "
                                         rf"dimension 2 is fixed to {pixels.shape[2]}"):
        run({"pixel_values": wide})
