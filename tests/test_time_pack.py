"""benchmarks/time_pack.py: ONNX files without their large tensors, refilled on the timing machine."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import time_pack  # noqa: E402

from softq.export import onnx_utils as U  # noqa: E402


def _model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x [b, 256] -> MatMul(W) -> MatMul(dequantized int8 codes + a two-valued float table) + bias; the codes
    are a Constant node's value, as softq writes its weights, the rest initializers."""
    rng = np.random.default_rng(0)
    tensors = {
        "W": (rng.standard_normal((256, 512)) * 2.0 + 0.5).astype(np.float32),  # 512 KiB float: "normal"
        "C": rng.integers(-64, 64, (512, 512)).astype(np.int8),  # 256 KiB of 7-bit codes: "histogram"
        "M": np.where(rng.random((512, 512)) < 0.25, -1e4, 0.0).astype(np.float32),  # 2 values: "histogram"
        "s": np.float32(0.01),
        "bias": rng.standard_normal(512).astype(np.float32),  # 2 KiB: kept as it is
    }
    nodes = [
        helper.make_node("Constant", [], ["C"], value=numpy_helper.from_array(tensors["C"])),
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("DequantizeLinear", ["C", "s"], ["d"]),
        helper.make_node("Add", ["d", "M"], ["dm"]),
        helper.make_node("MatMul", ["h", "dm"], ["h2"]),
        helper.make_node("Add", ["h2", "bias"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 512])],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in tensors.items() if k != "C"])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, tensors


def _arrays(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    out = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node if n.op_type == "Constant"})
    return out


def _protos(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    out = {t.name: t for t in model.graph.initializer}
    out.update({n.output[0]: n.attribute[0].t for n in model.graph.node if n.op_type == "Constant"})
    return out


def test_strip_keeps_small_tensors_and_describes_large_ones():
    model, tensors = _model()
    stripped = time_pack.strip(model)
    assert len(stripped.SerializeToString()) < 0.01 * len(model.SerializeToString())
    by_name = _protos(stripped)
    for name in ("W", "C", "M"):
        t = by_name[name]
        assert t.doc_string.startswith(time_pack.MARK) and not t.raw_data
        assert list(t.dims) == list(tensors[name].shape)
        assert helper.tensor_dtype_to_np_dtype(t.data_type) == tensors[name].dtype
    for name in ("s", "bias"):  # scales and biases travel as they are
        assert numpy_helper.to_array(by_name[name]).tobytes() == np.asarray(tensors[name]).tobytes()
    assert _arrays(model)["W"].tobytes() == tensors["W"].tobytes()  # the input model is not changed


def test_refill_draws_from_each_tensors_own_distribution():
    model, tensors = _model()
    refilled = _arrays(time_pack.refill(time_pack.strip(model), seed=1))
    w = refilled["W"]
    assert w.shape == tensors["W"].shape and w.dtype == np.float32
    assert not np.array_equal(w, tensors["W"])
    assert abs(w.mean() - tensors["W"].mean()) < 0.05 and abs(w.std() / tensors["W"].std() - 1) < 0.02
    c = refilled["C"]
    assert c.dtype == np.int8 and c.min() >= -64 and c.max() <= 63  # codes stay in the exported range
    assert not np.array_equal(c, tensors["C"])
    m = refilled["M"]
    assert set(np.unique(m)) <= {0.0, np.float32(-1e4)}
    assert abs((m < 0).mean() - (tensors["M"] < 0).mean()) < 0.01
    again = _arrays(time_pack.refill(time_pack.strip(model), seed=1))
    assert all(np.array_equal(again[k], refilled[k]) for k in refilled)  # one seed, one draw


def test_refilled_model_runs_in_onnxruntime():
    model, _ = _model()
    x = np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32)
    expected = U.run(model, {"x": x})[0]
    got = U.run(time_pack.refill(time_pack.strip(model)), {"x": x})[0]
    assert got.shape == expected.shape and got.dtype == expected.dtype and np.isfinite(got).all()


def test_pack_round_trip(tmp_path):
    model, _ = _model()
    src = tmp_path / "tiny_fp32.onnx"
    onnx.save_model(model, str(src))
    feeds = {1: {"x": np.ones((1, 256), np.float32)}, 4: {"x": np.ones((4, 256), np.float32)}}
    results = [{"name": "tiny", "rows": {"FP32": {"size": 1.0, "acc": 1.0, "distance": 0.0}}}]
    pack_dir = time_pack.write_pack(tmp_path / "pack", results, {"tiny": {"FP32": src}}, {"tiny": feeds},
                                    {"command": "cmd", "calib_batches": 1})
    assert (pack_dir / "tiny" / "tiny_fp32.onnx").stat().st_size < 0.01 * src.stat().st_size
    pack = time_pack.read_pack(pack_dir)
    assert pack["results"] == results and pack["batches"] == {"tiny": [1, 4]} and pack["command"] == "cmd"
    paths = time_pack.refilled_files(pack_dir, pack, "tiny", tmp_path)
    out = U.run(paths["FP32"], time_pack.load_feeds(pack_dir, "tiny", 4))[0]
    assert out.shape == (4, 512)


def test_read_pack_refuses_a_directory_that_is_not_one(tmp_path):
    with pytest.raises(SystemExit, match="not a pack"):
        time_pack.read_pack(tmp_path)
