"""softq.mpc never silently wrong: exact truncation, range-safe approximations, the plaintext range pass."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from softq.mpc import RangeConfig, RangeError, run
from softq.mpc.party import PartySettings
from softq.mpc.ranges import check_model
from softq.mpc.runner import free_port, launch_parties
from softq.mpc.surrogates import configure_surrogates
from test_mpc import bert_inputs, crypten1, tiny_bert  # noqa: F401 - crypten1 is a fixture

torch.set_num_threads(1)


# ---------------------------------------------------------------------------
# truncation: 2 real processes
# ---------------------------------------------------------------------------

_TRUNCATION_PARTY = textwrap.dedent("""
    import sys, torch
    from softq.mpc.party import PartySettings, init_communicator
    from softq.mpc.truncation import STATS, set_truncation
    rank, port = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    crypten = init_communicator(PartySettings(rank=rank, world_size=2, rendezvous=f"tcp://127.0.0.1:{port}", timeout=60))
    v = (torch.rand(1_000_000, generator=torch.Generator().manual_seed(0)) * 2 - 1) * 2e5
    for mode in ("probabilistic", "exact"):
        set_truncation(mode)
        STATS.reset()
        bad = 0
        for _ in range(2):
            got = (crypten.cryptensor(v, src=0) * 1.0).get_plain_text()  # one truncation per element
            bad += int(((got - v).abs() > 1.0).sum())
            small = float((got - v).abs()[(got - v).abs() <= 1.0].max())
        if rank == 0:
            print(mode, STATS.elements, bad, small, flush=True)
""")


def _two_parties(tmp_path, source: str) -> str:
    """Run ``source`` as ranks 0 and 1 (argv: rank, port) in two processes; rank 0's stdout."""
    script = tmp_path / "party.py"
    # both parties meet before leaving, and leave without the process-group teardown: a party whose peer had
    # already gone aborted in gloo's destructor at interpreter exit ("terminate called without an active
    # exception", exit -6; 1 run in 4 here), as softq.mpc.party's own error path avoids with os._exit
    script.write_text(source + textwrap.dedent("""
        import os as _os, crypten.communicator as _comm
        _comm.get().barrier()
        sys.stdout.flush()
        _os._exit(0)
    """))
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return outs[0][0].strip()


def test_exact_truncation_never_fails_where_crypten_local_truncation_does(tmp_path):
    """Values up to 2e5: CrypTen's 2-party truncation fails ~|v| / 2^32 per element (~46 expected in 2e6)."""
    rows = {line.split()[0]: line.split()[1:] for line in _two_parties(tmp_path, _TRUNCATION_PARTY).splitlines()}
    n_prob, bad_prob, _ = int(rows["probabilistic"][0]), int(rows["probabilistic"][1]), float(rows["probabilistic"][2])
    n_exact, bad_exact, small_exact = int(rows["exact"][0]), int(rows["exact"][1]), float(rows["exact"][2])
    assert n_prob == n_exact == 2_000_000
    assert bad_prob >= 10  # CrypTen's own truncation is wrong by ~4.3e9 on these elements
    assert bad_exact == 0 and small_exact <= 2**-15


def test_floor_div_unsigned_matches_python_integers():
    from softq.mpc.truncation import floor_div_unsigned

    v = torch.tensor([0, 1, -1, 2**62, -(2**63), 2**63 - 1, -12345678901234], dtype=torch.long)
    for d in (2, 3, 2**16, 1000003):
        got = floor_div_unsigned(v, d).tolist()
        assert got == [(int(x) % 2**64) // d for x in v.tolist()], d


# ---------------------------------------------------------------------------
# approximations (1-party arithmetic)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["erf", "tanh"])
def test_gelu_is_accurate_far_outside_cryptens_range(crypten1, name):
    from softq.mpc.surrogates import get_gelu

    x = torch.cat([torch.linspace(-8, 8, 801), torch.tensor([-1000.0, -546.0, -17.0, 25.0, 546.0, 3000.0])])
    got = get_gelu(name)(crypten1.cryptensor(x)).get_plain_text()
    ref = torch.nn.functional.gelu(x.double(), approximate="none" if name == "erf" else "tanh")
    assert (got.double() - ref).abs().max() < 1e-4


def test_exp_and_reciprocal_are_accurate_on_their_declared_ranges(crypten1):
    from softq.mpc.approx import EXP_RANGE, RECIPROCAL_RANGE, exp, reciprocal

    x = torch.linspace(EXP_RANGE[0], 0.0, 4001)
    got = exp(crypten1.cryptensor(x)).get_plain_text().double()
    assert (got - x.double().exp()).abs().max() < 1e-4
    crypten_own = crypten1.cryptensor(x[-400:]).exp().get_plain_text().double()
    assert (crypten_own - x[-400:].double().exp()).abs().max() > 1e-3  # what softq's exp replaces
    x = torch.linspace(RECIPROCAL_RANGE[0], RECIPROCAL_RANGE[1], 4001)
    got = reciprocal(crypten1.cryptensor(x)).get_plain_text().double()
    err = (got - 1.0 / x.double()).abs()
    assert (err <= 1e-3 / x.double() + 2**-15).all()  # 0.1 % or two units of the last 16-bit place
    from softq.mpc.approx import accurate_functions

    d = torch.cat([-x, x])  # a division by a secret of either sign (graph `div`)
    with accurate_functions(), crypten1.cfg.temp_override({"functions.reciprocal_all_pos": False}):
        got = crypten1.cryptensor(d).reciprocal().get_plain_text().double()
    assert ((got - 1.0 / d.double()).abs() <= 1e-3 / d.double().abs() + 2**-15).all()


# ---------------------------------------------------------------------------
# the range pass
# ---------------------------------------------------------------------------


def _scaled_bert(what: str, factor: float) -> torch.nn.Module:
    model = tiny_bert()
    with torch.no_grad():
        if what == "query":
            model.bert.encoder.layer[0].attention.self.query.weight *= factor
        elif what == "pooler":
            model.bert.pooler.dense.weight *= factor
        elif what == "embeddings":
            model.bert.embeddings.word_embeddings.weight *= factor
            model.bert.embeddings.LayerNorm.weight *= factor
    return model


@pytest.mark.parametrize("what,factor,message", [
    ("query", 300.0, "layer0 softmax:softmax (softmax): exp input"),
    ("pooler", 200.0, "head tanh (tanh): tanh input"),
    ("embeddings", 2e9, "embeddings"),
])
def test_range_pass_refuses_blown_up_models_naming_layer_and_op(what, factor, message):
    model = _scaled_bert(what, factor)
    configure_surrogates(model, softmax="softmax", gelu="tanh")
    with pytest.raises(RangeError, match="refused before any secret was shared") as info:
        check_model(model, bert_inputs())
    assert message in str(info.value) and "\n" not in str(info.value)


def test_range_pass_sees_masked_keys_as_the_encrypted_softmax_does():
    """Encrypted softmax pushes masked keys to -1e4 before the row max; where every valid score of a padded row lies
    below that, a masked key is the max and the row's denominator vanishes (CrypTen's reciprocal of ~0: garbage).
    The range pass masked with -inf, saw a healthy row (exp inputs 0, denominator 5) and let it run."""
    model = tiny_bert()
    with torch.no_grad():  # every score of layer 0 is q.k / 4 = 16 * 100 * -50 / 4 = -2e4
        attention = model.bert.encoder.layer[0].attention.self
        attention.query.weight.zero_()
        attention.query.bias.fill_(100.0)
        attention.key.weight.zero_()
        attention.key.bias.fill_(-50.0)
    configure_surrogates(model, softmax="softmax", gelu="tanh")
    with pytest.raises(RangeError, match="layer0 softmax:softmax"):
        check_model(model, bert_inputs())
    unpadded = {k: v[:1] for k, v in bert_inputs().items()}  # no masked key: the same scores are fine
    check_model(model, unpadded)


def test_range_pass_accepts_a_sane_model_and_records_every_approximation():
    model = tiny_bert()
    configure_surrogates(model, softmax="softmax", gelu="tanh")
    records = check_model(model, bert_inputs())
    quantities = {(r.layer, r.quantity) for r in records}
    for layer in ("layer0", "layer1"):
        assert {(layer, "exp input"), (layer, "reciprocal input"), (layer, "layernorm variance")} <= quantities
    assert ("head", "tanh input") in quantities
    exp0 = next(r for r in records if r.layer == "layer0" and r.quantity == "exp input")
    assert exp0.high == 0.0 and exp0.low < -0.1


def test_margin_is_validated_and_changes_the_verdict():
    for bad in (0.5, float("nan"), float("inf"), "2"):
        with pytest.raises(ValueError, match="margin"):
            RangeConfig(bad)
    with pytest.raises(ValueError, match="margin"):
        run(tiny_bert(), bert_inputs(), range_margin=0.9)
    model = _scaled_bert("query", 45.0)  # exp input near -200
    configure_surrogates(model, softmax="softmax", gelu="tanh")
    check_model(model, bert_inputs(), config=RangeConfig(1.0))
    with pytest.raises(RangeError, match="margin 4"):
        check_model(model, bert_inputs(), config=RangeConfig(4.0))


def test_run_refuses_before_starting_any_party():
    t0 = time.monotonic()
    with pytest.raises(RangeError, match="layer0 softmax:softmax"):
        run(_scaled_bert("query", 300.0), bert_inputs(), softmax="softmax", gelu="tanh", timeout=30)
    assert time.monotonic() - t0 < 30
    with pytest.raises(ValueError, match="truncation"):
        run(tiny_bert(), bert_inputs(), truncation="sloppy")


def test_run_checks_its_inputs_even_with_calibration_batches():
    # calibration used to replace the inputs in the range pass: pixels 1e4 x the calibrated ones went to the
    # parties and came back ~4e4 off (logits ~2) without an error
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(2)
    vit = ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                              num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                              num_labels=5, initializer_range=0.2)).eval()
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(7))
    t0 = time.monotonic()
    with pytest.raises(RangeError, match="refused before any secret was shared"):
        run(vit, {"pixel_values": pixels * 1e4}, softmax="2quad", gelu="quad", timeout=30,
            calibration=[{"pixel_values": pixels}])
    assert time.monotonic() - t0 < 30


def test_owner_refuses_on_its_calibration_inputs_and_every_party_stops(tmp_path):
    _scaled_bert("query", 300.0).save_pretrained(tmp_path / "model")
    torch.save(bert_inputs(), tmp_path / "in.pt")
    torch.save([bert_inputs()], tmp_path / "calib.pt")
    port = free_port()
    surrogates = {"softmax": "softmax", "gelu": "tanh"}
    settings = [
        PartySettings(rank=0, rendezvous=f"tcp://127.0.0.1:{port}", timeout=30, model_dir=str(tmp_path / "model"),
                      calibration=str(tmp_path / "calib.pt"), surrogates=surrogates),
        PartySettings(rank=1, rendezvous=f"tcp://127.0.0.1:{port}", timeout=30,
                      model_config=str(tmp_path / "model" / "config.json"), inputs=str(tmp_path / "in.pt"),
                      output=str(tmp_path / "out.pt"), surrogates=surrogates),
    ]
    results = launch_parties(settings, tmp_path, timeout=30)
    for code, err in results:
        assert code == 2 and "refused before any secret was shared" in err and "exp input" in err
    assert not (tmp_path / "out.pt").exists()


def test_minilm_gelu_range_is_recorded_and_accepted():
    pytest.importorskip("all_minilm_l6_v2")
    from softq.corpora import text_split
    from softq.hf import load_minilm

    hm = load_minilm()
    inputs = hm.tokenize(text_split("eval", 2), max_length=32)
    configure_surrogates(hm.model, softmax="softmax", gelu="tanh")
    records = check_model(hm.model, inputs)
    gelu_out = max(r.high for r in records if r.op == "gelu:tanh")
    assert gelu_out > 15  # the inputs that broke CrypTen's tanh GELU are accepted now


def test_headless_encoder_distils_on_pooled_embeddings():
    from transformers import BertConfig, BertModel

    from softq.mpc.distill import distill, prediction_loss

    torch.manual_seed(13)
    teacher = BertModel(BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=32, initializer_range=0.2),
                        add_pooling_layer=False).eval()
    gen = torch.Generator().manual_seed(14)

    def batches():
        while True:
            yield {"input_ids": torch.randint(0, 40, (8, 8), generator=gen), "attention_mask": torch.ones(8, 8, dtype=torch.long)}

    batch = next(batches())
    with torch.no_grad():
        out = teacher(**batch)
        assert float(prediction_loss(out, out, batch)) == pytest.approx(0.0, abs=1e-6)
    student, history = distill(teacher, batches(), softmax="2quad", gelu="quad", steps=(5, 20), lr=(1e-3, 1e-3),
                               progress=False)
    assert len(history.stage2) == 20 and sum(history.stage2[-5:]) < sum(history.stage2[:5])


def test_stage2_hidden_weight_and_continuing_a_student():
    from transformers import BertConfig, BertModel

    from softq.mpc.distill import _layer_loss, distill, prediction_loss

    torch.manual_seed(15)
    teacher = BertModel(BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=32, initializer_range=0.2),
                        add_pooling_layer=False).eval()
    batch = {"input_ids": torch.randint(0, 40, (8, 8), generator=torch.Generator().manual_seed(16)),
             "attention_mask": torch.ones(8, 8, dtype=torch.long)}

    def batches():
        while True:
            yield batch

    fresh, history = distill(teacher, batches(), steps=(0, 0), progress=False, dropout=False, fit=False)
    assert history.stage1 == [] and history.stage2 == []
    with torch.no_grad():
        t_out = teacher(**batch, output_hidden_states=True)
        s_out = fresh(**batch, output_hidden_states=True)
        cosine_part = float(prediction_loss(s_out, t_out, batch))
        hidden_part = float(_layer_loss(s_out, t_out))
    assert hidden_part > 0.1 * cosine_part > 0
    weights = {name: p.detach().clone() for name, p in fresh.named_parameters()}
    teacher_weights = {name: p.detach().clone() for name, p in teacher.named_parameters()}
    student, history = distill(teacher, batches(), steps=(0, 3), lr=(1e-3, 1e-3), progress=False, dropout=False,
                               stage2_hidden_weight=10.0, student=fresh)
    assert student is fresh  # continued in place, not a fresh copy of the teacher
    # the first step's loss is the cosine term plus 10 x the hidden-state MSE of the continued student
    assert history.stage2[0] == pytest.approx(cosine_part + 10.0 * hidden_part, rel=1e-4)
    assert history.stage2[-1] < history.stage2[0]
    assert any(not torch.equal(p, weights[name]) for name, p in student.named_parameters())
    assert all(torch.equal(p, teacher_weights[name]) for name, p in teacher.named_parameters())
    assert all(p.requires_grad for p in teacher.parameters())
    with pytest.raises(ValueError, match="stage2_hidden_weight must be >= 0"):
        distill(teacher, batches(), steps=(0, 1), stage2_hidden_weight=-1.0, progress=False)
    with pytest.raises(ValueError, match="separate model from the teacher"):
        distill(teacher, batches(), steps=(0, 1), student=teacher, progress=False)


# ---------------------------------------------------------------------------
# comparison-selected brackets: LayerNorm, 2Quad's row division, Quad GELU
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind,ratio,bound", [("rsqrt", 2.0, 8e-5), ("reciprocal", 4.0, 9e-3)])
def test_bracket_polynomials_reach_their_stated_relative_error(kind, ratio, bound):
    import numpy as np

    from softq.mpc.approx import bracket_polynomial

    m, a = bracket_polynomial(kind, ratio)
    z = np.linspace(ratio**-0.5, ratio**0.5, 10001)
    f = z**-0.5 if kind == "rsqrt" else 1.0 / z
    err = np.abs(np.polynomial.polynomial.polyval(z - m, a) / f - 1.0).max()
    assert bound / 3 < err < bound  # near-minimax: not far below the bound either


@pytest.mark.parametrize("weight", ["secret", "public", "none"])
def test_layer_norm_brackets_are_accurate_over_the_declared_variances(crypten1, weight):
    from softq.mpc.approx import LN_VAR_RANGE
    from softq.mpc.surrogates import layer_norm

    torch.manual_seed(3)
    lo, hi = (math.log2(v) for v in LN_VAR_RANGE)
    std = torch.exp2(torch.linspace(lo + 0.01, hi - 0.01, 200) / 2)[:, None]  # every bracket, both edges
    x = torch.randn(200, 64)
    x = (x - x.mean(-1, keepdim=True)) / x.std(-1, unbiased=False, keepdim=True) * std + 3.0
    w, b = torch.randn(64), torch.randn(64)
    wt = {"secret": crypten1.cryptensor(w), "public": w, "none": None}[weight]
    got = layer_norm(crypten1.cryptensor(x), [64], wt, b, 1e-5).get_plain_text()
    ref = torch.nn.functional.layer_norm(x.double(), [64], w.double() if weight != "none" else None, b.double(), 1e-5)
    err = (got.double() - ref).abs().max(-1).values
    # 16-bit inputs: x - mean is known to 2^-16 only, i.e. to 2^-16 / std after normalising
    ok = err <= 1e-4 * ref.abs().max() + 4 * 2**-16 / std[:, 0].double() * (w.abs().max() if weight != "none" else 1)
    assert ok.all(), (err[~ok], std[~ok.nonzero()[:, 0]])
    assert err[(std[:, 0] > 0.1)].max() < 1e-3


def test_row_division_is_accurate_over_the_declared_row_sums(crypten1):
    from softq.mpc.approx import ROW_RANGE, normalize_rows

    torch.manual_seed(4)
    scale = 800.0  # 2Quad with 32 keys, c = 5
    target = torch.exp2(torch.linspace(math.log2(ROW_RANGE[0]) + 0.01, math.log2(ROW_RANGE[1]) - 0.01, 300))
    num = torch.rand(300, 32) * (torch.rand(300, 32) < 0.8)  # some exact zeros (masked keys)
    num = num / num.sum(-1, keepdim=True) * (target * scale)[:, None]
    got = normalize_rows(crypten1.cryptensor(num), scale).get_plain_text().double()
    ref = num.double() / num.double().sum(-1, keepdim=True)
    assert ((got - ref).abs() <= 2e-4 * ref + 2 * 2**-16).all()
    assert (got[num == 0] == 0).all()
    with pytest.raises(ValueError, match="row scale"):
        normalize_rows(crypten1.cryptensor(num), 2.0**13)


def test_quad_gelu_under_mpc_is_the_plaintext_polynomial(crypten1):
    from softq.mpc.approx import quadratic
    from softq.mpc.surrogates import get_gelu

    x = torch.linspace(-40, 40, 4001)
    got = get_gelu("quad")(crypten1.cryptensor(x)).get_plain_text().double()
    exact_input = torch.trunc(x.double() * 2**16) / 2**16  # the 16-bit encoding of x (CrypTen truncates)
    assert (got - get_gelu("quad")(exact_input)).abs().max() <= 2**-16 + 1e-5  # one rounding (+ float32 decode)
    with pytest.raises(ValueError, match="dyadic|2\\^-p"):
        quadratic(crypten1.cryptensor(x), 0.3, 0.25, 0.5)


@pytest.mark.parametrize("what,message", [
    ("ln_weight", "layer0 layernorm"),
    ("scores", "layer0 softmax:2quad (softmax): row sum"),
])
def test_range_pass_refuses_outside_the_bracketed_intervals(what, message):
    model = tiny_bert()
    with torch.no_grad():
        if what == "ln_weight":  # LayerNorm output beyond the lazy product's bound
            model.bert.encoder.layer[0].attention.output.LayerNorm.weight *= 1e4
        else:  # 2Quad row sums beyond the brackets
            model.bert.encoder.layer[0].attention.self.query.weight *= 300.0
    configure_surrogates(model, softmax="2quad", gelu="quad")
    with pytest.raises(RangeError, match="refused before any secret was shared") as info:
        check_model(model, bert_inputs())
    assert message in str(info.value)
    if what == "ln_weight":
        assert "layernorm output" in str(info.value)
    records = check_model(_surrogate_bert(), bert_inputs())
    assert {"row sum", "layernorm output", "layernorm variance"} <= {r.quantity for r in records}


def _surrogate_bert() -> torch.nn.Module:
    model = tiny_bert()
    configure_surrogates(model, softmax="2quad", gelu="quad")
    return model


_ROUNDS_PARTY = textwrap.dedent("""
    import json, sys, torch
    from softq.mpc.party import PartySettings, init_communicator
    from softq.mpc.truncation import set_truncation
    rank, port = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    crypten = init_communicator(PartySettings(rank=rank, world_size=2, rendezvous=f"tcp://127.0.0.1:{port}", timeout=60))
    set_truncation("exact")
    from softq.mpc.approx import accurate_functions
    from softq.mpc.graph import reciprocal_scale
    from softq.mpc.surrogates import get_gelu, layer_norm
    from softq.softmax import get_softmax
    comm = crypten.communicator.get()
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 8, 64, generator=g) * 3, torch.rand(64, generator=g) + 0.5, torch.rand(64, generator=g)
    scores, valid = torch.randn(2, 4, 8, 8, generator=g) * 3, torch.ones(2, 1, 1, 8)
    X, W, B, S = (crypten.cryptensor(t, src=0) for t in (x, w, b, scores))

    def quad2():
        with accurate_functions(), reciprocal_scale("2quad", {"c": 5.0}, 8):
            return get_softmax("2quad")(S, valid, c=5.0)

    cases = {
        "layernorm": (lambda: layer_norm(X, [64], W, B, 1e-12), torch.nn.functional.layer_norm(x, [64], w, b, 1e-12)),
        "2quad": (quad2, get_softmax("2quad")(scores, valid, c=5.0)),
        "quad": (lambda: get_gelu("quad")(X), get_gelu("quad")(x)),
    }
    for name, (f, ref) in cases.items():
        comm.reset_communication_stats()
        got = f().get_plain_text()
        rounds = comm.get_communication_stats()["rounds"] - 1  # the reveal
        if rank == 0:
            print(json.dumps({"op": name, "rounds": rounds, "err": float((got - ref).abs().max())}), flush=True)
""")


def test_bracketed_approximations_cut_the_measured_rounds(tmp_path):
    """2 processes, exact truncation: rounds measured by CrypTen's communicator (before: 49, 67 and 4)."""
    import json

    rows = {r["op"]: r for r in map(json.loads, _two_parties(tmp_path, _ROUNDS_PARTY).splitlines())}
    assert rows["layernorm"]["rounds"] == 21 and rows["layernorm"]["err"] < 2e-3
    assert rows["2quad"]["rounds"] == 23 and rows["2quad"]["err"] < 1e-4
    assert rows["quad"]["rounds"] == 2 and rows["quad"]["err"] < 1e-4


def test_2quad_row_division_is_fused_only_below_its_lazy_product_bound():
    from softq.mpc.approx import ROW_SCALE_LIMIT
    from softq.mpc.graph import fused_row_scale

    assert fused_row_scale("2quad", {"c": 5.0}, 32) == 800.0  # MiniLM's 32 keys
    assert fused_row_scale("2quad", {"c": 5.0}, 128) == 3200.0  # BERT-base attention block
    assert 327 * 25 < ROW_SCALE_LIMIT <= 328 * 25
    assert fused_row_scale("2quad", {"c": 5.0}, 328) is None  # num (S y) would pass 2^62 at scale 2^48
    assert fused_row_scale("softmax", {}, 32) is None and fused_row_scale("2relu", {}, 32) is None
