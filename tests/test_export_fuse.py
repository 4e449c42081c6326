"""export/fuse.py: onnxruntime fuses every integer Linear with its bias, input smoothing folds into the
LayerNorm weights, the attention's 1/sqrt(d) into the score matmul's scale; the outputs still match torch
and the unfused graph (float rounding apart)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from conftest import tiny_inputs, tiny_model
from onnx import TensorProto, helper, numpy_helper

import softq
from softq.export import fuse
from softq.export import onnx_utils as U
from softq.export.model_export import build_onnx

LOGIT_TOL = 0.02  # as tests/test_export_model.py: max |diff| / max |logit|
FAMILIES = ("vit", "gpt2", "bert")


@pytest.fixture(scope="module")
def smoothed() -> dict[str, torch.nn.Module]:
    """Tiny models with input smoothing at every Linear (the row softmax codes, residual stream in float)."""
    cfg = softq.QuantConfig(input_smoothing=0.8, quantize_residual=False)
    return {f: softq.quantize(tiny_model(f), [tiny_inputs(f, seed=40 + i) for i in range(3)], cfg) for f in FAMILIES}


@pytest.fixture(scope="module")
def graphs(smoothed) -> dict[str, tuple[onnx.ModelProto, onnx.ModelProto]]:
    """family -> (exported graph, the same export without the fuse passes)."""
    out = {}
    for family, qmodel in smoothed.items():
        example = tiny_inputs(family)
        fused = build_onnx(qmodel, example, "fast")
        plain = pytest.MonkeyPatch()
        plain.setattr(fuse, "fuse", lambda model, **_: {})
        try:
            out[family] = (fused, build_onnx(qmodel, example, "fast"))
        finally:
            plain.undo()
    return out


def _feeds(family: str, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    inputs = tiny_inputs(family, batch=3, seq=13, seed=seed)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    if family != "vit":
        feeds.setdefault("attention_mask", np.ones_like(feeds["input_ids"]))
    return inputs, feeds


def _readers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    return readers


def _n_linear(qmodel: torch.nn.Module, biased: bool = False) -> int:
    return sum(type(m).__name__ == "QLinear" and (m.bias is not None or not biased) for m in qmodel.modules())


@pytest.mark.parametrize("family", FAMILIES)
def test_onnxruntime_fuses_each_linear_with_its_bias(smoothed, graphs, tmp_path, family):
    fused, plain = graphs[family]
    for model, with_bias in ((fused, True), (plain, False)):
        path = tmp_path / "opt.onnx"
        U.session(model, "all", optimized_path=str(path))
        opt = onnx.load(path)
        made = {o: n for n in opt.graph.node for o in n.output}
        weights = {i.name for i in opt.graph.initializer}
        linears = [n for n in opt.graph.node if n.op_type == "MatMulIntegerToFloat" and n.input[1] in weights]
        bias_adds = [n for n in opt.graph.node if n.op_type == "Add" and any(i in weights for i in n.input)
                     and any(i in made and made[i].op_type == "MatMulIntegerToFloat" for i in n.input)]
        if with_bias:  # every Linear is one MatMulIntegerToFloat with the bias (if any) as its 7th input, no Add after
            assert len(linears) == _n_linear(smoothed[family])
            assert sum(len(n.input) == 7 for n in linears) == _n_linear(smoothed[family], biased=True)
            assert bias_adds == []
        else:  # the DQ -> MatMul form: fused without the bias, a separate Add each
            assert linears and all(len(n.input) == 6 for n in linears) and bias_adds
    # the scalar 'one' that keeps the fusion's scale a Mul: one DequantizeLinear, one Abs, for the whole graph
    assert sum(n.name.startswith(fuse.ONE) for n in fused.graph.node) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_smoothing_folds_into_layernorm_where_only_linears_read_it(graphs, family):
    fused, plain = graphs[family]
    for model in (plain, fused):
        readers = _readers(model)
        lns = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
        muls = [r for n in lns for r in readers.get(n.output[0], []) if r.op_type == "Mul"]
        if model is plain:
            assert muls  # input smoothing scales every Linear input by an explicit Mul
            plain_muls = len(muls)
        elif family == "bert":
            # post-LN: every LayerNorm output is also the residual stream; its Mul cannot fold
            assert len(muls) == plain_muls
        else:
            # pre-LN: q/k/v and fc1 read the LayerNorm output alone; only LayerNorms read by something else
            # (the final LayerNorm: the classifier / lm head reads a slice) keep their Mul
            assert len(muls) < plain_muls
            for ln in lns:
                kinds = {r.op_type for r in readers.get(ln.output[0], [])}
                assert "Mul" not in kinds or not kinds <= {"Mul", "Shape"}


@pytest.mark.parametrize("family", FAMILIES)
def test_score_scale_folds_into_the_query_dequantization(smoothed, graphs, family):
    fused, plain = graphs[family]
    consts = {i.name: numpy_helper.to_array(i) for i in fused.graph.initializer}
    consts.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in fused.graph.node if n.op_type == "Constant"})
    made = {o: n for n in fused.graph.node for o in n.output}
    readers = _readers(fused)
    scores = [n for n in fused.graph.node if n.op_type == "MatMul"]  # the linears are MatMulInteger now
    layers = smoothed[family].config.num_hidden_layers
    assert len(scores) == layers
    head_dim = smoothed[family].config.hidden_size // smoothed[family].config.num_attention_heads
    for mm in scores:
        assert all(r.op_type != "Mul" for r in readers[mm.output[0]])  # the scores go straight to their codes
        dq = made[mm.input[0]]
        q = made[dq.input[0]]
        assert (dq.op_type, q.op_type) == ("DequantizeLinear", "QuantizeLinear")
        # the quantizer keeps its scale; the dequantization carries scale * head_dim ** -0.5
        expected = np.float32(consts[q.input[1]] * np.float32(head_dim**-0.5))
        assert consts[dq.input[1]] == expected
    assert fuse.fold_matmul_scales(plain) == layers  # the unfused graph had the Mul after each


@pytest.mark.parametrize("family", FAMILIES)
def test_output_projection_smoothing_folds_into_the_core_division(smoothed, graphs, family):
    fused, plain = graphs[family]
    layers = smoothed[family].config.num_hidden_layers

    def smoothing_muls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
        """Muls reading the merged heads: Reshape(Transpose(the row core's Div))."""
        made = {o: n for n in model.graph.node for o in n.output}
        found = []
        for n in (n for n in model.graph.node if n.op_type == "Mul"):
            chain = [made.get(n.input[0])]
            while chain[-1] is not None and chain[-1].op_type in ("Reshape", "Transpose"):
                chain.append(made.get(chain[-1].input[0]))
            if chain[-1] is not None and chain[-1].op_type == "Div" and len(chain) == 3:
                found.append(n)
        return found

    assert len(smoothing_muls(plain)) == layers and smoothing_muls(fused) == []
    consts = {i.name: numpy_helper.to_array(i) for i in fused.graph.initializer}
    # the denominator's constant now has one value per head and channel
    dens = [n for n in fused.graph.node if n.op_type == "Mul" and n.name.startswith("softq/L")
            and any(i in consts and consts[i].ndim == 4 for i in n.input)]
    assert len(dens) == layers


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_outputs_match_torch_and_the_unfused_graph(smoothed, graphs, family):
    fused, plain = graphs[family]
    qmodel = smoothed[family]
    for opt in ("disable", "all"):
        sessions = [U.session(fused, opt), U.session(plain, opt)]
        for seed in (1, 2):
            inputs, feeds = _feeds(family, seed)
            with torch.no_grad():
                out = qmodel(**inputs)
            ref = (out.logits if hasattr(out, "logits") else out.last_hidden_state).numpy()
            got, unfused = (s.run(None, feeds)[0] for s in sessions)
            scale = np.abs(ref).max()
            for y in (got, unfused):
                assert np.abs(y - ref).max() <= LOGIT_TOL * scale
            # float rounding only: most rows are equal, a tie flip moves a few
            rows = np.abs(got - unfused).reshape(-1, got.shape[-1]).max(-1) <= 1e-4 * scale
            assert rows.mean() >= 0.9, f"{opt}: {rows.mean():.2f} of the rows equal the unfused graph's"


def _graph(nodes, inits, x_shape=("b", 8)) -> onnx.ModelProto:
    """Graph outputs y and z through Identity nodes (a pass leaves a tensor that is a graph output alone)."""
    nodes = nodes + [helper.make_node("Identity", [t], [o]) for t, o in (("y0", "y"), ("z0", "z"))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "z")],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_passes_leave_what_they_cannot_fold():
    c1, c2 = np.full(8, 2.0, np.float32), np.full(8, 3.0, np.float32)
    ln = helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1)
    # two readers with different scales: no single gamma serves both
    model = _graph([ln, helper.make_node("Mul", ["n", "c1"], ["y0"]), helper.make_node("Mul", ["n", "c2"], ["z0"])],
                   {"g": np.ones(8, np.float32), "b": np.zeros(8, np.float32), "c1": c1, "c2": c2})
    assert fuse.fold_layernorm_scales(model) == 0 and len(model.graph.node) == 5
    # a Mul and a non-Mul reader (a residual Add): the Mul stays
    model = _graph([ln, helper.make_node("Mul", ["n", "c1"], ["y0"]), helper.make_node("Add", ["n", "x"], ["z0"])],
                   {"g": np.ones(8, np.float32), "b": np.zeros(8, np.float32), "c1": c1})
    assert fuse.fold_layernorm_scales(model) == 0
    # the same scale on every reader folds, and computes the same
    model = _graph([ln, helper.make_node("Mul", ["n", "c1"], ["y0"]), helper.make_node("Mul", ["c1", "n"], ["z0"])],
                   {"g": np.linspace(0.5, 1.5, 8, dtype=np.float32), "b": np.linspace(-1, 1, 8, dtype=np.float32),
                    "c1": np.linspace(0.1, 3, 8, dtype=np.float32)})
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    before = U.run(model, {"x": x}, "disable")
    assert fuse.fold_layernorm_scales(model) == 1
    assert [n.op_type for n in model.graph.node] == ["LayerNormalization", "Identity", "Identity"]
    after = U.run(model, {"x": x}, "disable")
    np.testing.assert_allclose(after[0], before[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(after[0], after[1])
    # a negative scale after a matmul stays a Mul (the fold keeps positive scales only)
    dq = helper.make_node("DequantizeLinear", ["codes", "s", "zp"], ["d"])
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["codes"]), dq,
             helper.make_node("MatMul", ["d", "w"], ["m"]), helper.make_node("Mul", ["m", "c"], ["y0"]),
             helper.make_node("Relu", ["x"], ["z0"])]
    inits = {"s": np.float32(0.1), "zp": np.uint8(128), "w": np.ones((8, 8), np.float32)}
    assert fuse.fold_matmul_scales(_graph(nodes, {**inits, "c": np.float32(-0.5)})) == 0
    model = _graph(nodes, {**inits, "c": np.float32(0.5)})
    before = U.run(model, {"x": x}, "disable")[0]
    assert fuse.fold_matmul_scales(model) == 1 and "Mul" not in {n.op_type for n in model.graph.node}
    np.testing.assert_allclose(U.run(model, {"x": x}, "disable")[0], before, rtol=1e-6)


def test_qdq_linears_keep_the_dequantize_matmul_form(smoothed, graphs, tmp_path):
    """linears="qdq" (OpenVINO's int8 pattern): every Linear stays DequantizeLinear -> MatMul, the other folds
    still apply, and the outputs are the integer form's."""
    from softq.export import runtimes
    from softq.export.model_export import ExportError

    qmodel = smoothed["gpt2"]
    example = tiny_inputs("gpt2")
    qdq = build_onnx(qmodel, example, "fast", linears="qdq")
    # the only MatMulIntegers left are the attention cores' GEMMs
    assert all("/core/" in n.name for n in qdq.graph.node if n.op_type == "MatMulInteger")
    assert sum(1 for n in qdq.graph.node if n.op_type == "MatMul") >= _n_linear(qmodel)
    readers = _readers(qdq)
    assert not [n for n in qdq.graph.node if n.op_type == "LayerNormalization"
                and any(r.op_type == "Mul" for r in readers.get(n.output[0], []))]  # smoothing still folded
    _, feeds = _feeds("gpt2", seed=9)
    paths = {}
    for name, model in (("qdq", qdq), ("integer", graphs["gpt2"][0])):
        paths[name] = tmp_path / f"{name}.onnx"
        onnx.save(model, paths[name])
    ref = runtimes.runner(paths["integer"], "onnxruntime")(feeds)[0]
    runs = ["onnxruntime"] + [r for r in ("openvino",) if runtimes.available(r)]
    for rt in runs:
        out = runtimes.runner(paths["qdq"], rt)(feeds)[0]
        assert np.abs(out - ref).max() <= LOGIT_TOL * np.abs(ref).max(), rt
    with pytest.raises(ExportError, match="linears must be one of"):
        build_onnx(qmodel, example, "fast", linears="int4")


@pytest.mark.parametrize("family", ("vit", "gpt2"))
def test_dynamic_linears_fuse_into_dynamic_quantize_matmul(smoothed, graphs, tmp_path, family):
    """linears="dynamic": one DynamicQuantizeLinear per distinct Linear input (Q, K and V share one), which
    onnxruntime fuses as it fuses quantize_dynamic's graphs; Q, K, V and the softmax keep their static
    grids; the outputs stay within the static file's tolerance of it (another grid per call, not the same
    function)."""
    qmodel = smoothed[family]
    dynamic = build_onnx(qmodel, tiny_inputs(family), "fast", linears="dynamic")
    layers = qmodel.config.num_hidden_layers
    dql = [n for n in dynamic.graph.node if n.op_type == "DynamicQuantizeLinear"]
    static = graphs[family][0]
    made = {o: n for n in static.graph.node for o in n.output}
    inputs = {made[n.input[0]].input[0] for n in static.graph.node if n.op_type == "MatMulInteger" and "/core/" not in n.name}
    assert len(dql) == len(inputs) and {d.input[0] for d in dql} == inputs  # (Q, K and V share one)
    cores = [n for n in dynamic.graph.node if n.op_type == "MatMulInteger" and "/core/" in n.name]
    assert len(cores) == layers and not any(c.input[0] in {o for d in dql for o in d.output} for c in cores)
    U.session(dynamic, "all", optimized_path=str(tmp_path / "opt.onnx"))
    opt = [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node]
    assert opt.count("DynamicQuantizeMatMul") >= 3 * layers and "MatMulInteger" in opt  # the cores stay
    _, feeds = _feeds(family, seed=11)
    ref = U.run(graphs[family][0], feeds, "all")[0]
    out = U.run(dynamic, feeds, "all")[0]
    assert np.abs(out - ref).max() <= LOGIT_TOL * np.abs(ref).max()
    assert not np.array_equal(out, ref)  # the grids really are the per-call ones
