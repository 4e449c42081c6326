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
from softq.export import fuse, fuse_layout, fuse_linear, fuse_scales, fuse_shapes
from softq.export import onnx_utils as U
from softq.export.model_export import build_onnx

LOGIT_TOL = 0.02  # as tests/test_export_model.py: max |diff| / max |logit|
FAMILIES = ("vit", "gpt2", "bert")


@pytest.fixture(scope="module")
def smoothed() -> dict[str, torch.nn.Module]:
    """Tiny models with input smoothing at every Linear (the row softmax codes, residual stream in float), the
    attention output's scale left at the output projection's input (not folded into V: the fuse pass's case)."""
    cfg = softq.QuantConfig(input_smoothing=0.8, quantize_residual=False, smoothing_into_v=False)
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
    # biased: the exported bias, the weight bias correction's included (it gives GPT-2's lm_head one)
    return sum(type(m).__name__ == "QLinear" and (m.effective_bias() is not None or not biased) for m in qmodel.modules())


SHARED = ("q_proj", "k_proj", "v_proj", "query", "key", "value")  # Linear layers reading one input: one GEMM


def _n_gemms(qmodel: torch.nn.Module) -> int:
    """GEMMs after fuse_shared_linears: every Linear, with each attention's separate Q, K, V counted once."""
    names = [n for n, m in qmodel.named_modules() if type(m).__name__ == "QLinear"]
    shared = [n for n in names if n.rsplit(".", 1)[-1] in SHARED]
    return len(names) - len(shared) + len({n.rsplit(".", 1)[0] for n in shared})


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
        if with_bias:  # one MatMulIntegerToFloat per Linear (Q, K and V: one for all three), the bias its 7th input
            assert len(linears) == _n_gemms(smoothed[family]) < _n_linear(smoothed[family]) + (family == "gpt2")
            unbiased = _n_linear(smoothed[family]) - _n_linear(smoothed[family], biased=True)  # (a head)
            assert sum(len(n.input) == 7 for n in linears) == len(linears) - unbiased
            assert bias_adds == []
        else:  # the DQ -> MatMul form: fused without the bias, a separate Add each
            assert linears and all(len(n.input) == 6 for n in linears) and bias_adds
    # the scalar 'one' that keeps the fusion's scale a Mul: one DequantizeLinear, one Abs, for the whole graph
    assert sum(n.name.startswith(fuse_linear.ONE) for n in fused.graph.node) == 2


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
    # the linears are MatMulInteger now; the row core's GEMM is a MatMul of codes dequantized at scale 1
    scores = [n for n in fused.graph.node if n.op_type == "MatMul" and "/core/" not in n.name]
    layers = smoothed[family].config.num_hidden_layers
    assert len(scores) == layers
    head_dim = smoothed[family].config.hidden_size // smoothed[family].config.num_attention_heads
    plain_consts = {i.name: numpy_helper.to_array(i) for i in plain.graph.initializer}
    plain_consts.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in plain.graph.node
                         if n.op_type == "Constant"})
    plain_made = {o: n for n in plain.graph.node for o in n.output}
    plain_readers = _readers(plain)
    plain_scores = [n for n in plain.graph.node if n.op_type == "MatMul"  # the ones the 1/sqrt(d) Mul follows
                    and any(r.op_type == "Mul" for r in plain_readers.get(n.output[0], []))]
    assert len(plain_scores) == layers
    for mm, mm_plain in zip(scores, plain_scores):
        assert all(r.op_type != "Mul" for r in readers[mm.output[0]])  # the scores go straight to their codes
        dq = made[mm.input[0]]
        q = made[dq.input[0]]
        while q.op_type in ("Reshape", "Transpose"):  # Q's quantizer is the fused Q/K/V GEMM's (a Split of codes)
            q = made[q.input[0]]
        assert dq.op_type == "DequantizeLinear" and q.op_type in ("QuantizeLinear", "Split")
        # the quantizer keeps its scale; the dequantization carries scale * head_dim ** -0.5
        q_plain = plain_made[plain_made[mm_plain.input[0]].input[0]]
        assert q_plain.op_type == "QuantizeLinear"
        expected = np.float32(plain_consts[q_plain.input[1]] * np.float32(head_dim**-0.5))
        assert consts[dq.input[1]] == expected
    assert fuse_scales.fold_matmul_scales(plain) == layers  # the unfused graph had the Mul after each


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


def test_layernorm_scale_folds_past_a_reshape_that_keeps_the_channels_last():
    """GPT-2's ln_f -> view -> lm_head: a Reshape whose output keeps the last dimension maps rows to rows, so the
    Mul after it folds into the LayerNorm; a Reshape that moves channels (last dimension changed) blocks it."""
    c = np.linspace(0.1, 3, 8, dtype=np.float32)
    inits = {"g": np.linspace(0.5, 1.5, 8, dtype=np.float32), "b": np.linspace(-1, 1, 8, dtype=np.float32), "c": c}
    x = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32)
    for target, folds in (([2, 3, 8], True), ([-1, 8], True), ([3, 16], False)):
        nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1),
                 helper.make_node("Reshape", ["n", "t"], ["r"]), helper.make_node("Mul", ["r", "c"], ["y0"]),
                 helper.make_node("Relu", ["x"], ["z0"])]
        mul_c = c if target[-1] == 8 else np.tile(c, 2)
        model = _graph(nodes, {**inits, "c": mul_c, "t": np.array(target, np.int64)}, x_shape=(6, 8))
        before = U.run(model, {"x": x}, "disable")[0]
        assert fuse_scales.fold_layernorm_scales(model) == int(folds)
        assert ("Mul" in {n.op_type for n in model.graph.node}) != folds
        np.testing.assert_allclose(U.run(model, {"x": x}, "disable")[0], before, rtol=1e-5, atol=1e-6)
    # a target built at run time (batch and tokens read by Shape): the last dimension from shape inference
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1),
             helper.make_node("Shape", ["x"], ["sh"]), helper.make_node("Slice", ["sh", "zero", "one"], ["lead"]),
             helper.make_node("Concat", ["lead", "eight"], ["t"], axis=0),
             helper.make_node("Reshape", ["n", "t"], ["r"]), helper.make_node("Mul", ["r", "c"], ["y0"]),
             helper.make_node("Relu", ["x"], ["z0"])]
    model = _graph(nodes, {**inits, "zero": np.array([0], np.int64), "one": np.array([1], np.int64),
                           "eight": np.array([8], np.int64)}, x_shape=("b", 8))
    before = U.run(model, {"x": x}, "disable")[0]
    assert fuse_scales.fold_layernorm_scales(model) == 1 and "Mul" not in {n.op_type for n in model.graph.node}
    np.testing.assert_allclose(U.run(model, {"x": x}, "disable")[0], before, rtol=1e-5, atol=1e-6)


def test_tied_lm_head_is_smoothed_and_folds_into_the_final_layernorm(smoothed, graphs):
    """GPT-2's lm_head shares the token table, but the quantized Linear has weights of its own, so input smoothing
    scales them (the table keeps its values) and the scale folds into ln_f past GPT-2's view."""
    qmodel = smoothed["gpt2"]
    original = tiny_model("gpt2")
    assert original.lm_head.weight is original.transformer.wte.weight  # tied in the float model
    assert qmodel.lm_head.input_scale.numel() == qmodel.config.n_embd
    torch.testing.assert_close(qmodel.lm_head.weight * qmodel.lm_head.input_scale, original.lm_head.weight)
    torch.testing.assert_close(qmodel.transformer.wte.weight, original.transformer.wte.weight)
    fused, plain = graphs["gpt2"]
    for model, muls in ((plain, 1), (fused, 0)):
        readers = _readers(model)
        ln_f = [n for n in model.graph.node if n.op_type == "LayerNormalization"][-1]
        # the view, then the Mul; fused: no Mul, the lm_head's QuantizeLinear before the view (quantize_before_layout)
        first = readers[ln_f.output[0]]
        views = [r for r in first if r.op_type == "Reshape"] or [
            r for q in first if q.op_type == "QuantizeLinear" for r in readers[q.output[0]] if r.op_type == "Reshape"]
        assert views and sum(r.op_type == "Mul" for v in views for r in readers.get(v.output[0], [])) == muls


def test_passes_leave_what_they_cannot_fold():
    c1, c2 = np.full(8, 2.0, np.float32), np.full(8, 3.0, np.float32)
    ln = helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1)
    # two readers with different scales: no single gamma serves both
    model = _graph([ln, helper.make_node("Mul", ["n", "c1"], ["y0"]), helper.make_node("Mul", ["n", "c2"], ["z0"])],
                   {"g": np.ones(8, np.float32), "b": np.zeros(8, np.float32), "c1": c1, "c2": c2})
    assert fuse_scales.fold_layernorm_scales(model) == 0 and len(model.graph.node) == 5
    # a Mul and a non-Mul reader (a residual Add): the Mul stays
    model = _graph([ln, helper.make_node("Mul", ["n", "c1"], ["y0"]), helper.make_node("Add", ["n", "x"], ["z0"])],
                   {"g": np.ones(8, np.float32), "b": np.zeros(8, np.float32), "c1": c1})
    assert fuse_scales.fold_layernorm_scales(model) == 0
    # the same scale on every reader folds, and computes the same
    model = _graph([ln, helper.make_node("Mul", ["n", "c1"], ["y0"]), helper.make_node("Mul", ["c1", "n"], ["z0"])],
                   {"g": np.linspace(0.5, 1.5, 8, dtype=np.float32), "b": np.linspace(-1, 1, 8, dtype=np.float32),
                    "c1": np.linspace(0.1, 3, 8, dtype=np.float32)})
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    before = U.run(model, {"x": x}, "disable")
    assert fuse_scales.fold_layernorm_scales(model) == 1
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
    assert fuse_scales.fold_matmul_scales(_graph(nodes, {**inits, "c": np.float32(-0.5)})) == 0
    model = _graph(nodes, {**inits, "c": np.float32(0.5)})
    before = U.run(model, {"x": x}, "disable")[0]
    assert fuse_scales.fold_matmul_scales(model) == 1 and "Mul" not in {n.op_type for n in model.graph.node}
    np.testing.assert_allclose(U.run(model, {"x": x}, "disable")[0], before, rtol=1e-6)


def test_qdq_linears_keep_the_dequantize_matmul_form(smoothed, graphs, tmp_path):
    """linears="qdq" (OpenVINO's int8 pattern): every Linear stays DequantizeLinear -> MatMul, the other folds
    still apply, and the outputs are the integer form's."""
    from softq.export import runtimes
    from softq.export.errors import ExportError

    qmodel = smoothed["gpt2"]
    example = tiny_inputs("gpt2")
    qdq = build_onnx(qmodel, example, "fast", linears="qdq")
    # no MatMulInteger left: the Linears and the attention cores' GEMMs are all DequantizeLinear -> MatMul
    assert not [n for n in qdq.graph.node if n.op_type == "MatMulInteger"]
    cores = sum(1 for n in qdq.graph.node if n.op_type == "MatMul" and "/core/" in n.name)
    assert cores == qmodel.config.num_hidden_layers
    assert sum(1 for n in qdq.graph.node if n.op_type == "MatMul") >= _n_linear(qmodel) + cores
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
    static = _export_without(qmodel, family, "quantize_before_layout")  # each Linear's float input by name
    made = {o: n for n in static.graph.node for o in n.output}
    inputs = {made[n.input[0]].input[0] for n in static.graph.node if n.op_type == "MatMulInteger" and "/core/" not in n.name}
    assert len(dql) == len(inputs) and {d.input[0] for d in dql} == inputs  # (Q, K and V share one)
    made = {o: n for n in dynamic.graph.node for o in n.output}
    cores = [n for n in dynamic.graph.node if n.op_type == "MatMul" and "/core/" in n.name]
    assert len(cores) == layers
    assert not any(made[c.input[0]].input[0] in {o for d in dql for o in d.output} for c in cores)
    U.session(dynamic, "all", optimized_path=str(tmp_path / "opt.onnx"))
    opt = [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node]
    # the cores stay static: MatMulIntegerToFloat from their DequantizeLinear(scale 1) -> MatMul
    assert opt.count("DynamicQuantizeMatMul") >= 3 * layers and opt.count("MatMulIntegerToFloat") >= layers
    _, feeds = _feeds(family, seed=11)
    ref = U.run(graphs[family][0], feeds, "all")[0]
    out = U.run(dynamic, feeds, "all")[0]
    assert np.abs(out - ref).max() <= LOGIT_TOL * np.abs(ref).max()
    assert not np.array_equal(out, ref)  # the grids really are the per-call ones


def test_dynamic_linears_of_symmetric_activations_see_the_unclipped_input():
    """act_symmetric clips each static grid's input at -127 steps (a float Clip before QuantizeLinear); a dynamic
    Linear quantizes the tensor on its own range per call, so it reads the input before that Clip."""
    qmodel = softq.quantize(tiny_model("vit"), [tiny_inputs("vit", seed=s) for s in range(3)],
                            softq.QuantConfig(act_symmetric=True))
    dynamic = build_onnx(qmodel, tiny_inputs("vit"), "fast", linears="dynamic")
    made = {o: n for n in dynamic.graph.node for o in n.output}
    dql = [n for n in dynamic.graph.node if n.op_type == "DynamicQuantizeLinear"]
    assert dql and not any(d.input[0] in made and made[d.input[0]].op_type == "Clip" for d in dql)


def test_dynamic_linears_of_narrower_activations_are_refused():
    """act_bits < 8: the static grid's Clip kept the fusion from finding the input quantization, and the file came
    out in the integer form, byte for byte, with no word."""
    from softq.export.errors import ExportError

    qmodel = softq.quantize(tiny_model("vit"), [tiny_inputs("vit", seed=s) for s in range(3)],
                            softq.QuantConfig(act_bits=4))
    with pytest.raises(ExportError, match="linears='dynamic' quantizes Linear inputs to 8 bits .* 4 bits"):
        build_onnx(qmodel, tiny_inputs("vit"), "fast", linears="dynamic")
    assert build_onnx(qmodel, tiny_inputs("vit"), "fast", linears="integer").graph.node


def _shared_graph(requant: bool, extra_reader: bool = False) -> onnx.ModelProto:
    """x -> codes -> three integer Linears (fuse_linears' form) on the same codes; each then quantized again
    (the second through Reshape -> Transpose, as Q/K/V are) or, with ``requant=False``, output in float."""
    rng = np.random.default_rng(3)
    inits = {"s": np.float32(0.05), "zp": np.uint8(120), "shape": np.array([0, 2, 3], np.int64),
             "one_code": np.uint8(1), "one_scale": np.float32(1.0)}
    # fuse_linears' scalar 1 that onnxruntime does not fold (so the scale stays a Mul it fuses)
    nodes = [helper.make_node("DequantizeLinear", ["one_code", "one_scale"], ["one_dq"]),
             helper.make_node("Abs", ["one_dq"], ["one"]),
             helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["codes"])]
    outputs = []
    for i, n in enumerate((6, 6, 4)):
        inits.update({f"w{i}": rng.integers(-127, 128, (8, n)).astype(np.int8), f"wz{i}": np.zeros(n, np.int8),
                      f"S{i}": rng.uniform(1e-3, 3e-3, n).astype(np.float32),
                      f"b{i}": rng.standard_normal(n).astype(np.float32)})
        nodes += [helper.make_node("MatMulInteger", ["codes", f"w{i}", "zp", f"wz{i}"], [f"acc{i}"]),
                  helper.make_node("Cast", [f"acc{i}"], [f"accf{i}"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", ["one", f"S{i}"], [f"scale{i}"]),
                  helper.make_node("Mul", [f"accf{i}", f"scale{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"])]
        y = f"y{i}"
        if i == 1:  # layout ops between the Linear and its quantizer
            nodes += [helper.make_node("Reshape", [y, "shape"], [f"r{i}"]),
                      helper.make_node("Transpose", [f"r{i}"], [f"t{i}"], perm=[0, 2, 1])]
            y = f"t{i}"
        if requant:
            inits.update({f"qs{i}": np.float32(0.02 * (i + 1)), f"qz{i}": np.uint8(100 + 20 * i)})
            nodes.append(helper.make_node("QuantizeLinear", [y, f"qs{i}", f"qz{i}"], [f"out{i}"]))
            outputs.append(helper.make_tensor_value_info(f"out{i}", TensorProto.UINT8, None))
        else:
            nodes.append(helper.make_node("Identity", [y], [f"out{i}"]))
            outputs.append(helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, None))
    if extra_reader:  # the first Linear's float output is also read by something else
        nodes.append(helper.make_node("Relu", ["y0"], ["extra"]))
        outputs.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 8])], outputs,
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("case", ("requantized", "float", "read elsewhere"))
def test_shared_linears_become_one_gemm_with_the_same_outputs(case):
    model = _shared_graph(requant=case != "float", extra_reader=case == "read elsewhere")
    x = np.random.default_rng(4).standard_normal((200, 8)).astype(np.float32) * 3
    before = U.run(model, {"x": x}, "disable")
    assert fuse_linear.fuse_shared_linears(model) == 1
    assert fuse_linear.fold_split_quantizers(model) == (case == "requantized")
    U.prune(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulInteger") == 1 and ops.count("Split") == 1
    # quantizers fold into the GEMM only where every part is quantized again and nothing else reads it
    assert ops.count("QuantizeLinear") == (2 if case == "requantized" else 4 if case == "read elsewhere" else 1)
    after = U.run(model, {"x": x}, "disable")
    for b, a in zip(before, after):
        assert a.dtype == b.dtype and a.shape == b.shape
        if b.dtype == np.uint8:  # the same codes up to float rounding at ties
            d = np.abs(a.astype(int) - b.astype(int))
            assert d.max() <= 1 and (d == 0).mean() >= 0.99
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # onnxruntime fuses the one chain into one MatMulIntegerToFloat
    assert [o for o in U.optimized_op_types(model, "all", "/tmp") if "MatMul" in o] == ["MatMulIntegerToFloat"]


def test_linears_on_different_inputs_stay_apart():
    model = _shared_graph(requant=True)
    for node in model.graph.node:  # the third Linear reads other codes
        if node.op_type == "MatMulInteger" and node.input[1] == "w2":
            node.input[0] = "codes2"
    model.graph.node.insert(3, helper.make_node("Abs", ["x"], ["xa"]))
    model.graph.node.insert(4, helper.make_node("QuantizeLinear", ["xa", "s", "zp"], ["codes2"]))
    assert fuse_linear.fuse_shared_linears(model) == 1  # the first two still share theirs
    assert sum(n.op_type == "MatMulInteger" for n in model.graph.node) == 2


def _reshape_graph() -> onnx.ModelProto:
    """x [b, s, 8] -> Reshape to [b, s, 2, 4] by its own dims (provable); w [c, t, 8] -> Reshape by x's dims
    (not provable: another input's batch and sequence)."""
    inits = {"i0": np.int64(0), "i1": np.int64(1), "ax": np.array([0], np.int64), "two": np.array([2], np.int64),
             "four": np.array([4], np.int64)}
    nodes = [helper.make_node("Shape", ["x"], ["sx"])]
    for i in (0, 1):
        nodes += [helper.make_node("Gather", ["sx", f"i{i}"], [f"g{i}"], axis=0),
                  helper.make_node("Unsqueeze", [f"g{i}", "ax"], [f"u{i}"])]
    nodes += [helper.make_node("Concat", ["u0", "u1", "two", "four"], ["target"], axis=0),
              helper.make_node("Reshape", ["x", "target"], ["y"]),
              helper.make_node("Reshape", ["w", "target"], ["z"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 8]),
                                       helper.make_tensor_value_info("w", TensorProto.FLOAT, ["c", "t", 8])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "z")],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_static_reshapes_rewrite_only_what_shape_inference_proves():
    model = _reshape_graph()
    assert fuse_shapes.static_reshapes(model) == 1
    U.prune(model)
    made = {o: n for n in model.graph.node for o in n.output}
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    y, z = (next(n for n in model.graph.node if n.output[0] == o) for o in ("y", "z"))
    assert consts[y.input[1]].tolist() == [0, 0, 2, 4]  # copy batch and sequence, constant heads and size
    assert made[z.input[1]].op_type == "Concat"  # w's reshape still reads x's dims at run time
    rng = np.random.default_rng(5)
    for b, s in ((1, 3), (4, 7)):
        x = rng.standard_normal((b, s, 8)).astype(np.float32)
        y_out, z_out = U.run(model, {"x": x, "w": x[::-1].copy()}, "disable")
        np.testing.assert_array_equal(y_out, x.reshape(b, s, 2, 4))
        np.testing.assert_array_equal(z_out, x[::-1].reshape(b, s, 2, 4))


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_attention_reshapes_are_constant(graphs, family):
    """The heads' split and merge read no Shape at run time (the example's batch and length are not baked in:
    test_fused_outputs_match_torch_and_the_unfused_graph runs other shapes)."""
    fused, plain = graphs[family]
    for model, static in ((fused, True), (plain, False)):
        made = {o: n for n in model.graph.node for o in n.output}
        attention = [n for n in model.graph.node if n.op_type == "Reshape" and "attention" in n.output[0] + n.name
                     or n.op_type == "Reshape" and "attn" in n.output[0] + n.name]
        assert attention
        dynamic = [n for n in attention if n.input[1] in made and made[n.input[1]].op_type == "Concat"]
        assert (not dynamic) if static else dynamic


@pytest.mark.parametrize("family", FAMILIES)
def test_query_key_value_codes_come_from_one_quantizer(smoothed, graphs, family):
    """Separate Q/K/V projections (ViT, BERT) and GPT-2's one c_attn alike: one GEMM per layer, its output
    quantized once and split as codes (the unfused graph quantizes Q, K and V one by one)."""
    fused, plain = graphs[family]
    layers = smoothed[family].config.num_hidden_layers
    splits = [split for split, _ in _qkv_splits(fused)]
    assert len(splits) == layers and all(len(n.output) == 3 for n in splits)
    value_types = U.value_types(fused)
    assert all(value_types.get(o) == TensorProto.UINT8 for n in splits for o in n.output)
    count = [sum(n.op_type == "QuantizeLinear" for n in m.graph.node) for m in (fused, plain)]
    assert count[0] == count[1] - 2 * layers - _requantized(plain)


def _requantized(model: onnx.ModelProto) -> int:
    """QuantizeLinear nodes that read a DequantizeLinear of their own grid (drop_requantize removes them)."""
    made = {o: n for n in model.graph.node for o in n.output}
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    consts.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
                   if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})

    def grid(node: onnx.NodeProto) -> tuple | None:
        s, z = consts.get(node.input[1]), consts.get(node.input[2]) if len(node.input) > 2 else None
        return None if s is None or z is None or s.size != 1 else (s.item(), z.item(), z.dtype)

    return sum(1 for n in model.graph.node if n.op_type == "QuantizeLinear" and made.get(n.input[0]) is not None
               and made[n.input[0]].op_type == "DequantizeLinear" and grid(n) is not None
               and grid(n) == grid(made[n.input[0]]))


def _qkv_splits(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, onnx.NodeProto]]:
    """(Split, QuantizeLinear) where a Split reads a QuantizeLinear's codes, directly or through the heads'
    Reshape/Transpose (merge_head_splits)."""
    made = {o: n for n in model.graph.node for o in n.output}
    out = []
    for split in (n for n in model.graph.node if n.op_type == "Split"):
        node = made.get(split.input[0])
        while node is not None and node.op_type in ("Reshape", "Transpose"):
            node = made.get(node.input[0])
        if node is not None and node.op_type == "QuantizeLinear":
            out.append((split, node))
    return out


def _core_pads(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "Pad"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_query_key_value_gemm_writes_the_row_sum_column(smoothed, graphs, family):
    """The row core's V column of z + 1 (whose E.(v - z) is the row sum) comes out of the Q/K/V GEMM, one
    zero-weight column per head, instead of a Pad copying V; test_fused_outputs_match_torch_and_the_unfused_graph
    checks the outputs."""
    fused, plain = graphs[family]
    cfg = smoothed[family].config
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    assert len(_core_pads(plain)) == layers and _core_pads(fused) == []
    consts = {i.name: numpy_helper.to_array(i) for i in fused.graph.initializer}
    made = {o: n for n in fused.graph.node for o in n.output}
    gemms = [made[ql.input[0]] for _, ql in _qkv_splits(fused)]
    for add in gemms:  # QuantizeLinear(Add(Mul(Cast(MatMulInteger)), bias)): 3 x hidden + one column per head
        mm = made[made[made[add.input[0]].input[0]].input[0]]  # each, Q and K too (merge_head_splits), ...
        w = consts[mm.input[1]]
        assert w.shape == (cfg.hidden_size, 3 * cfg.hidden_size + 3 * heads)
        assert (w == 0).all(axis=0).sum() >= 3 * heads
        bias = consts[add.input[1]].reshape(3, heads, -1)[:, :, -1]  # ... one more column per head
        assert (bias[2] == bias[2, 0]).all()  # V's: the code z + 1
    assert len(gemms) == layers


@pytest.fixture(scope="module")
def unsmoothed() -> dict[str, tuple[torch.nn.Module, onnx.ModelProto, onnx.ModelProto]]:
    """family -> (quantized without input smoothing, its export, the export without the fuse passes)."""
    cfg = softq.QuantConfig(input_smoothing=None, quantize_residual=False)
    out = {}
    for family in FAMILIES:
        qmodel = softq.quantize(tiny_model(family), [tiny_inputs(family, seed=40 + i) for i in range(3)], cfg)
        fused = build_onnx(qmodel, tiny_inputs(family), "fast")
        with pytest.MonkeyPatch.context() as plain:
            plain.setattr(fuse, "fuse", lambda model, **_: {})
            out[family] = (qmodel, fused, build_onnx(qmodel, tiny_inputs(family), "fast"))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_row_scale_folds_into_the_attention_output_quantizer(unsmoothed, family):
    """Without smoothing the core's ``Div(N, Mul(D, c))`` has a scalar c: it moves into the scale of the
    QuantizeLinear that reads the attention output (s * c), and the outputs still match torch and the
    unfused graph."""
    qmodel, fused, plain = unsmoothed[family]
    layers = qmodel.config.num_hidden_layers

    def core_muls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
        made = {o: n for n in model.graph.node for o in n.output}
        return [made[n.input[1]] for n in model.graph.node if n.op_type == "Div" and n.name.startswith("softq/L")
                and n.input[1] in made and made[n.input[1]].op_type == "Mul"]

    assert len(core_muls(plain)) == layers and core_muls(fused) == []
    for opt in ("disable", "all"):
        sessions = [U.session(fused, opt), U.session(plain, opt)]
        inputs, feeds = _feeds(family, 3)
        with torch.no_grad():
            out = qmodel(**inputs)
        ref = (out.logits if hasattr(out, "logits") else out.last_hidden_state).numpy()
        got, unfused = (s.run(None, feeds)[0] for s in sessions)
        scale = np.abs(ref).max()
        assert np.abs(got - ref).max() <= LOGIT_TOL * scale
        rows = np.abs(got - unfused).reshape(-1, got.shape[-1]).max(-1) <= 1e-4 * scale
        assert rows.mean() >= 0.9, f"{opt}: {rows.mean():.2f} of the rows equal the unfused graph's"


def test_sum_column_and_row_scale_stay_where_something_else_reads_the_tensors(unsmoothed):
    """Where another reader (here a graph output) sees a layer's V codes or its core's division, that layer's Pad
    and Mul stay; the other layers still fold."""
    qmodel, _, plain = unsmoothed["vit"]
    layers = qmodel.config.num_hidden_layers
    model = onnx.ModelProto()
    model.CopyFrom(plain)
    pad = _core_pads(model)[0]
    div = next(n for n in model.graph.node if n.op_type == "Div" and n.name.startswith("softq/L1/"))
    model.graph.output.extend([helper.make_tensor_value_info(pad.input[0], TensorProto.UINT8, None),
                               helper.make_tensor_value_info(div.output[0], TensorProto.FLOAT, None)])
    done = fuse.fuse(model)
    assert done["sum_columns"] == layers - 1 and len(_core_pads(model)) == 1
    assert done["row_scales"] == layers - 1
    made = {o: n for n in model.graph.node for o in n.output}
    assert made[div.input[1]].op_type == "Mul"


def _export_without(qmodel: torch.nn.Module, family: str, fuse_pass: str) -> onnx.ModelProto:
    """The export with every fuse pass but ``fuse_pass``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fuse, fuse_pass, lambda model: 0)
        return build_onnx(qmodel, tiny_inputs(family), "fast")


@pytest.fixture(scope="module")
def unmerged(smoothed) -> dict[str, onnx.ModelProto]:
    """family -> the export with every fuse pass but merge_head_splits."""
    return {family: _export_without(qmodel, family, "merge_head_splits") for family, qmodel in smoothed.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_heads_of_query_key_value_move_in_one_transpose_with_the_same_outputs(smoothed, graphs, unmerged, family):
    """merge_head_splits: per layer one Reshape -> Transpose -> Reshape -> Split of the Q/K/V codes instead of a
    Split and a Reshape and Transpose per part (3 nodes fewer), Q and K one zero-point column wider per head;
    the scores gain exact zeros only, so onnxruntime's outputs are the unmerged graph's, bit for bit, at other
    batch sizes and lengths than the example's."""
    fused, merged_off = graphs[family][0], unmerged[family]
    layers = smoothed[family].config.num_hidden_layers
    assert len(fused.graph.node) == len(merged_off.graph.node) - 3 * layers
    count = {op: [sum(n.op_type == op for n in m.graph.node) for m in (fused, merged_off)] for op in ("Transpose", "Reshape")}
    assert count["Transpose"][0] == count["Transpose"][1] - 2 * layers
    assert count["Reshape"][0] == count["Reshape"][1] - layers
    for seed in (5, 6):
        feeds = _feeds(family, seed)[1]
        got, ref = (U.session(m, "all").run(None, feeds)[0] for m in (fused, merged_off))
        assert np.array_equal(got, ref)
        got, ref = (U.session(m, "disable").run(None, feeds)[0] for m in (fused, merged_off))
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_heads_stay_apart_where_a_padded_part_has_another_reader(unmerged):
    """A layer whose query codes something else reads too (here a graph output) keeps its per-part Reshape and
    Transpose and its GEMM width; the other layers merge."""
    model = onnx.ModelProto()
    model.CopyFrom(unmerged["vit"])
    layers = sum(1 for _ in _qkv_splits(model))
    split = _qkv_splits(model)[0][0]
    readers = _readers(model)
    query = readers[readers[split.output[0]][0].output[0]][0]  # Split -> Reshape -> Transpose
    assert query.op_type == "Transpose"
    model.graph.output.extend([helper.make_tensor_value_info(query.output[0], TensorProto.UINT8, None)])
    feeds = _feeds("vit", 7)[1]
    before = U.session(model, "all").run(None, feeds)
    assert fuse_layout.merge_head_splits(model) == layers - 1
    kept = list(split.output)
    assert any(n.op_type == "Split" and list(n.output) == kept for n in model.graph.node)
    after = U.session(model, "all").run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_output_is_quantized_before_the_heads_merge(smoothed, graphs, family):
    """quantize_before_layout: the output projection's QuantizeLinear reads the core's division itself and the
    heads' Transpose/Reshape move its uint8 codes; the outputs are bit for bit those without the pass."""
    fused = graphs[family][0]
    layers = smoothed[family].config.num_hidden_layers
    without = _export_without(smoothed[family], family, "quantize_before_layout")
    cores = [n for n in fused.graph.node if n.op_type == "Div" and n.name.startswith("softq/L")]
    assert len(cores) == layers
    readers, value_types = _readers(fused), U.value_types(fused)
    for div in cores:
        (ql,) = readers[div.output[0]]
        assert ql.op_type == "QuantizeLinear"
        (transpose,) = readers[ql.output[0]]
        (reshape,) = readers[transpose.output[0]]
        assert transpose.op_type == "Transpose" and reshape.op_type == "Reshape"
        assert value_types[transpose.output[0]] == value_types[reshape.output[0]] == TensorProto.UINT8
    for seed in (8, 9):
        feeds = _feeds(family, seed)[1]
        got, ref = (U.session(m, "all").run(None, feeds)[0] for m in (fused, without))
        assert np.array_equal(got, ref)


def test_opt_query_scaling_folds_into_its_quantizer():
    """OPT multiplies q_proj's output by 1/sqrt(d) before the query's quantizer: fold_quantizer_input_scales
    moves it into that quantizer's scale, so Q/K/V are quantized once and split as codes and the heads merge as
    in the other families; the outputs match torch and the unfolded graph (float rounding at ties apart)."""
    qmodel = softq.quantize(tiny_model("opt"), [tiny_inputs("opt", seed=40 + i) for i in range(3)], softq.QuantConfig())
    layers = qmodel.config.num_hidden_layers
    fused = build_onnx(qmodel, tiny_inputs("opt"), "fast")
    unfolded = _export_without(qmodel, "opt", "fold_quantizer_input_scales")
    assert len(_qkv_splits(fused)) == layers and _qkv_splits(unfolded) == []
    made = {o: n for n in unfolded.graph.node for o in n.output}
    scaled = [n for n in unfolded.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in made
              and made[n.input[0]].op_type == "Mul"]
    assert len(scaled) == layers  # the query's quantizer reads the scaling Mul there
    inputs, feeds = _feeds("opt", 12)
    with torch.no_grad():
        ref = qmodel(**inputs).logits.numpy()
    got, plain = (U.session(m, "all").run(None, feeds)[0] for m in (fused, unfolded))
    assert np.abs(got - ref).max() <= LOGIT_TOL * np.abs(ref).max()
    rows = np.abs(got - plain).reshape(-1, got.shape[-1]).max(-1) <= 1e-4 * np.abs(ref).max()
    assert rows.mean() >= 0.9


def test_quantizer_input_scale_folds_only_a_positive_scalar_on_a_linear_output():
    """A per-channel or negative Mul before a QuantizeLinear stays (neither is one scale of the quantizer), and so
    does a scalar Mul on anything but a Linear's output (GELU's final 0.5 belongs to onnxruntime's Gelu fusion)."""
    def graph(c: np.ndarray, linear: bool = True) -> onnx.ModelProto:
        nodes = [helper.make_node("MatMul" if linear else "Erf", ["x", "w"] if linear else ["x"], ["h"]),
                 helper.make_node("Mul", ["h", "c"], ["m"]), helper.make_node("QuantizeLinear", ["m", "s", "z"], ["y"])]
        inits = [numpy_helper.from_array(c.astype(np.float32), "c"), numpy_helper.from_array(np.float32(0.1), "s"),
                 numpy_helper.from_array(np.uint8(128), "z")] + (
                     [numpy_helper.from_array(np.array([[1, 0, 2, -1], [0.5, 1, 0, 3]], np.float32), "w")] if linear else [])
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2 if linear else 4])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, [2, 4])], inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    for c, linear, folds in ((np.array(0.5), True, True), (np.array(-0.5), True, False),
                             (np.array([0.5, 1, 2, 4]), True, False), (np.array(0.5), False, False)):
        model = graph(c, linear)
        x = np.array([[0.31, -1.2], [-0.7, 0.26]] if linear else [[0.31, -1.2, 2.5, 0.049], [-0.7, 0.26, 1.1, -3.0]],
                     np.float32)
        before = U.run(model, {"x": x}, "disable")[0]
        assert fuse_scales.fold_quantizer_input_scales(model) == int(folds)
        assert sum(n.op_type == "Mul" for n in model.graph.node) == int(not folds)
        assert np.array_equal(U.run(model, {"x": x}, "disable")[0], before)
