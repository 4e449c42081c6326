"""softq.mpc: CrypTen shim, graph converter, surrogates, real multi-process runs, faults, privacy.

In-process checks use a 1-party CrypTen (same fixed-point arithmetic and
approximations, no network); everything about parties, the wire and faults
runs real separate processes on loopback.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertLMHeadModel,
    GPT2Config,
    GPT2LMHeadModel,
    ViTConfig,
    ViTForImageClassification,
)

from softq.mpc import load_crypten, run
from softq.mpc.graph import ConversionError, GraphInterpreter, SecretOneHot, export_model
from softq.mpc.party import PartySettings, configure_crypten
from softq.mpc.runner import free_port, launch_parties
from softq.mpc.surrogates import configure_surrogates, get_gelu, inv_sqrt, layer_norm
from softq.softmax import get_softmax

torch.set_num_threads(1)


def tiny_bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=3,
                     initializer_range=0.2)  # trained-model scale; 0.02 sits at the fixed-point limit
    return BertForSequenceClassification(cfg).eval()


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(1)
    cfg = GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0,
                     initializer_range=0.2)
    return GPT2LMHeadModel(cfg).eval()


def tiny_vit() -> ViTForImageClassification:
    torch.manual_seed(2)
    cfg = ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, num_labels=3, initializer_range=0.2)
    return ViTForImageClassification(cfg).eval()


def bert_inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    return {"input_ids": torch.randint(0, 40, (2, 8)), "attention_mask": mask}


@pytest.fixture(scope="module")
def crypten1():
    """A 1-party CrypTen in this process (no network): checks arithmetic, not protocol."""
    os.environ.setdefault("RENDEZVOUS", f"tcp://127.0.0.1:{free_port()}")
    crypten = configure_crypten("TFP")
    crypten.init()
    return crypten


def encrypted_local(crypten, model, inputs, softmax, gelu):
    """Export + interpret in one process; returns (encrypted, plaintext surrogate) outputs."""
    configure_surrogates(model, softmax=softmax, gelu=gelu)
    with torch.no_grad():
        out = model(**inputs)
        plain = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    ep = export_model(model, inputs)
    interp = GraphInterpreter(ep)
    params = {n: crypten.cryptensor(ep.state_dict[n].float()) for n in interp.parameter_names()}
    secret = dict(inputs)
    if "input_ids" in inputs:
        vocab = model.get_input_embeddings().weight.shape[0]
        onehot = torch.nn.functional.one_hot(inputs["input_ids"], vocab).float()
        secret["input_ids"] = SecretOneHot(crypten.cryptensor(onehot), tuple(inputs["input_ids"].shape))
    if "pixel_values" in inputs:
        secret["pixel_values"] = crypten.cryptensor(inputs["pixel_values"])
    with crypten.no_grad():
        out = interp.run(params, secret)[0].get_plain_text()
    return out, plain


# ---------------------------------------------------------------------------
# import shim
# ---------------------------------------------------------------------------


def test_missing_crypten_gives_install_command():
    code = ("import sys; sys.modules['crypten'] = None\n"
            "from softq.mpc import load_crypten, CrypTenMissingError\n"
            "try:\n    load_crypten()\nexcept CrypTenMissingError as e:\n    print('MSG', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
    assert "MSG" in out.stdout and "pip install --no-deps crypten==0.4.1" in out.stdout


def test_crypten_imports_on_current_torch():
    crypten = load_crypten()
    assert hasattr(crypten, "cryptensor") and torch.__version__ >= "2.9"


# ---------------------------------------------------------------------------
# surrogates against their plaintext registry counterparts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["softmax", "2quad", "2relu", "relu_len", "sigmoid_len"])
def test_softmax_variants_match_registry_and_respect_mask(crypten1, name):
    from softq.mpc.graph import reciprocal_scale

    torch.manual_seed(4)
    scores = torch.randn(2, 2, 8, 8) * 2
    valid = torch.ones(2, 1, 8, 8)
    valid[1, ..., 5:] = 0
    variant = get_softmax(name)
    expected = variant(scores, valid)
    with reciprocal_scale(name, variant.defaults, 8):
        got = variant(crypten1.cryptensor(scores), valid).get_plain_text()
    assert (got - expected).abs().max() < 2e-2, name
    assert got[1, ..., 5:].abs().max() == 0  # masked keys get exactly zero
    if name == "2relu":  # a row whose only positive score is small: plaintext gave 1.0, CrypTen 0.91 (its offset)
        small = torch.tensor([[0.01, -0.5, -0.2, -1.0]])
        with reciprocal_scale(name, variant.defaults, 4):
            got = variant(crypten1.cryptensor(small), None).get_plain_text()
        assert (got - variant(small, None)).abs().max() < 2e-2


@pytest.mark.parametrize("name", ["tanh", "quad", "relu"])
def test_gelu_surrogates_match_plaintext(crypten1, name):
    x = torch.linspace(-6, 6, 97)
    got = get_gelu(name)(crypten1.cryptensor(x)).get_plain_text()
    assert (got - get_gelu(name)(x)).abs().max() < 1e-2
    if name == "tanh":
        assert (got - torch.nn.functional.gelu(x)).abs().max() < 1e-2


def test_layer_norm_is_exact_over_a_wide_variance_range(crypten1):
    var = torch.tensor([[1e-3], [0.05], [1.0], [40.0], [2000.0]])
    got = inv_sqrt(crypten1.cryptensor(var)).get_plain_text()
    assert ((got - var.rsqrt()) / var.rsqrt()).abs().max() < 1e-2
    torch.manual_seed(5)
    x = torch.randn(3, 16) * torch.tensor([[0.1], [1.0], [30.0]])  # 16-bit fixed point limits tiny inputs
    w, b = torch.randn(16), torch.randn(16)
    got = layer_norm(crypten1.cryptensor(x), [16], crypten1.cryptensor(w), crypten1.cryptensor(b), 1e-5).get_plain_text()
    assert (got - torch.nn.functional.layer_norm(x, [16], w, b, 1e-5)).abs().max() < 1e-2


# ---------------------------------------------------------------------------
# converter on the three families (1-party arithmetic)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("softmax,gelu", [("softmax", "tanh"), ("2quad", "quad")])
def test_bert_encrypted_matches_plaintext(crypten1, softmax, gelu):
    out, plain = encrypted_local(crypten1, tiny_bert(), bert_inputs(), softmax, gelu)
    assert (out - plain).abs().max() < 1e-2


def test_fitted_student_runs_encrypted(crypten1):
    """fit_surrogates only rewrites weights: the encrypted program of a fitted student is the plaintext one."""
    from softq.mpc.fit import fit_surrogates

    teacher = tiny_bert()
    student = copy.deepcopy(teacher)
    configure_surrogates(student, softmax="2quad", gelu="quad")
    report = fit_surrogates(student, teacher, [bert_inputs()])
    assert report.skipped == [] and sorted(report.scales) == [0, 1]
    out, plain = encrypted_local(crypten1, student, bert_inputs(), "2quad", "quad")
    assert (out - plain).abs().max() < 1e-2


def test_gpt2_without_cache_and_causal_mask(crypten1):
    model = tiny_gpt2()
    ids = torch.randint(0, 40, (1, 8), generator=torch.Generator().manual_seed(6))
    out, plain = encrypted_local(crypten1, model, {"input_ids": ids}, "2relu", "tanh")
    assert out.shape == (1, 8, 40) and (out - plain).abs().max() < 1e-2
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 40  # a future token must not move earlier logits
    out2, _ = encrypted_local(crypten1, model, {"input_ids": changed}, "2relu", "tanh")
    assert (out2[0, :-1] - out[0, :-1]).abs().max() < 1e-3


def test_bert_decoder_without_cache_and_causal_mask(crypten1):
    """A BERT built as a decoder (is_decoder=True) is causal like GPT-2: exported without its KV cache (torch.export
    refused the DynamicCache output with a long traceback) and no future token reaches an earlier position."""
    torch.manual_seed(0)
    model = BertLMHeadModel(BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=32, is_decoder=True,
                                       initializer_range=0.2)).eval()
    ids = torch.randint(0, 40, (1, 8), generator=torch.Generator().manual_seed(6))
    out, plain = encrypted_local(crypten1, model, {"input_ids": ids}, "2relu", "tanh")
    scale = float(plain.abs().max())  # fixed-point errors grow with the logits
    assert out.shape == (1, 8, 40) and (out - plain).abs().max() < 1e-2 * scale
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 40
    out2, _ = encrypted_local(crypten1, model, {"input_ids": changed}, "2relu", "tanh")
    assert (out2[0, :-1] - out[0, :-1]).abs().max() < 1e-3 * scale
    cross = BertLMHeadModel(BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, is_decoder=True, add_cross_attention=True)).eval()
    with pytest.raises(ConversionError, match="cross-attention"):  # it would run without its encoder states
        export_model(cross, {"input_ids": ids})
    from softq.mpc.distill import distill

    with pytest.raises(ValueError, match="no student of it can run encrypted"):  # refused before any step
        distill(cross, iter([]))


def test_vit_encrypted_matches_plaintext(crypten1):
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(7))
    out, plain = encrypted_local(crypten1, tiny_vit(), {"pixel_values": pixels}, "sigmoid_len", "relu")
    assert (out - plain).abs().max() < 1e-2


def test_additive_mask_on_a_secret_is_refused(crypten1):
    from softq.mpc.graph import add

    with pytest.raises(ConversionError, match="overflow"):
        add(crypten1.cryptensor(torch.zeros(2)), torch.tensor([0.0, -3.4e38]))


# ---------------------------------------------------------------------------
# real parties: separate processes on loopback
# ---------------------------------------------------------------------------


def _contains(message: torch.Tensor, needle: torch.Tensor) -> bool:
    """Does ``needle`` (int64) occur as a contiguous run inside ``message``?"""
    if message.dtype != torch.int64 or message.numel() < needle.numel():
        return False
    starts = (message[: message.numel() - needle.numel() + 1] == needle[0]).nonzero().flatten()
    return any(torch.equal(message[i: i + needle.numel()], needle) for i in starts[:1000].tolist())


def test_two_processes_exact_path_and_nothing_secret_on_the_wire(tmp_path):
    model, inputs = tiny_bert(), bert_inputs()
    wire = tmp_path / "wire"
    wire.mkdir()
    result = run(model, inputs, softmax="softmax", gelu="tanh", timeout=60, env={"SOFTQ_MPC_WIRE_LOG": str(wire)})
    ref = copy.deepcopy(model)
    configure_surrogates(ref, softmax="softmax", gelu="tanh")
    with torch.no_grad():
        plain = ref(**inputs).logits
    assert (result.logits - plain).abs().max() < 1e-2
    assert torch.equal(result.logits.argmax(-1), plain.argmax(-1))
    rep = result.report
    assert rep.rounds > 50 and rep.bytes > 10_000
    assert {"layer0", "layer1"} <= set(rep.by_layer()) and "softmax:softmax" in rep.by_kind()
    assert rep.modeled_seconds("wan") > rep.modeled_seconds("lan") > 0

    messages = [m for r in (0, 1) for m in torch.load(wire / f"wire{r}.pt")]
    assert sum(m.numel() for m in messages) > 10_000
    scale = 2**16
    secrets = {
        "word embeddings": (model.bert.embeddings.word_embeddings.weight[:4].flatten() * scale).round().long(),
        "query weight": (model.bert.encoder.layer[0].attention.self.query.weight[0] * scale).round().long(),
        "classifier": (model.classifier.weight.flatten() * scale).round().long(),
        "input one-hot": torch.nn.functional.one_hot(inputs["input_ids"][0], 40).flatten().long() * scale,
        "input ids": inputs["input_ids"][0].long(),
    }
    # the detector does find a secret when it is on the wire:
    assert _contains(torch.cat([torch.randint(0, 9, (50,)), secrets["query weight"]]), secrets["query weight"])
    for name, needle in secrets.items():
        assert not any(_contains(m, needle) for m in messages), f"{name} appears on the wire"
    raw = b"".join(bytes(m.numpy()) for m in messages if m.dtype == torch.uint8)
    assert model.classifier.weight.detach().numpy().tobytes()[:64] not in raw


def _settings(rank: int, tmp: Path, port: int, timeout: float, **kw) -> PartySettings:
    model_dir, cfg = str(tmp / "model"), str(tmp / "model" / "config.json")
    return PartySettings(rank=rank, world_size=2, rendezvous=f"tcp://127.0.0.1:{port}", timeout=timeout,
                         model_dir=model_dir if rank == 0 else None, model_config=cfg if rank == 1 else None,
                         inputs=str(tmp / "in.pt") if rank == 1 else None, output=str(tmp / "out.pt") if rank == 1 else None,
                         **kw)


def _prepare(tmp: Path) -> None:
    tiny_bert().save_pretrained(tmp / "model")
    torch.save(bert_inputs(), tmp / "in.pt")


def test_party_that_never_joins_stops_the_other_within_timeout(tmp_path):
    _prepare(tmp_path)
    t0 = time.monotonic()
    (code, err), = launch_parties([_settings(0, tmp_path, free_port(), 4.0)], tmp_path, timeout=4.0)
    assert code == 2 and "could not reach all 2 parties" in err
    assert time.monotonic() - t0 < 40


def test_party_that_dies_mid_run_gives_clear_error(tmp_path):
    _prepare(tmp_path)
    port = free_port()
    t0 = time.monotonic()
    results = launch_parties([_settings(r, tmp_path, port, 8.0) for r in (0, 1)], tmp_path, timeout=8.0,
                             env={"SOFTQ_MPC_FAULT": "1:fingerprinted"})
    assert results[1][0] == 3
    assert results[0][0] == 2 and "lost contact" in results[0][1]
    assert time.monotonic() - t0 < 60


def test_parties_with_different_models_refuse_to_compute(tmp_path):
    _prepare(tmp_path)
    port = free_port()
    settings = [_settings(0, tmp_path, port, 20.0, surrogates={"softmax": "2quad", "gelu": "quad"}),
                _settings(1, tmp_path, port, 20.0, surrogates={"softmax": "2quad", "gelu": "relu"})]
    results = launch_parties(settings, tmp_path, timeout=20.0)
    for code, err in results:
        assert code == 2 and "models differ" in err and "surrogates" in err
    assert not (tmp_path / "out.pt").exists()


def test_multi_host_launch_with_environment_variables(tmp_path):
    """Each party started on its own (as on separate hosts) through `softq mpc party` and env vars."""
    _prepare(tmp_path)
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    common = ["--softmax", "2quad", "--gelu", "quad", "--timeout", "30"]
    procs = []
    for rank, extra in ((0, ["--model", str(tmp_path / "model")]),
                        (1, ["--model-config", str(tmp_path / "model" / "config.json"),
                             "--inputs", str(tmp_path / "in.pt"), "--output", str(tmp_path / "out.pt")])):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "RENDEZVOUS": rendezvous, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "softq.cli", "mpc", "party", *common, *extra],
                                      env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "TOTAL" in outs[1][0]  # the client prints its communication table
    got = torch.load(tmp_path / "out.pt", weights_only=False)["outputs"][0]
    ref = tiny_bert()
    configure_surrogates(ref, softmax="2quad", gelu="quad")
    with torch.no_grad():
        assert (got - ref(**bert_inputs()).logits).abs().max() < 1e-2


def test_two_stage_distillation_brings_the_surrogate_student_closer_to_the_teacher():
    from softq.mpc.distill import distill

    teacher = tiny_bert(seed=8)
    gen = torch.Generator().manual_seed(9)

    def batches():
        while True:
            yield {"input_ids": torch.randint(0, 40, (8, 8), generator=gen), "attention_mask": torch.ones(8, 8, dtype=torch.long)}

    probe = {"input_ids": torch.randint(0, 40, (16, 8), generator=torch.Generator().manual_seed(10))}
    before = copy.deepcopy(teacher)
    configure_surrogates(before, softmax="2quad", gelu="quad")
    student, history = distill(teacher, batches(), softmax="2quad", gelu="quad", steps=(30, 30), lr=(3e-3, 1e-3),
                               progress=False)
    with torch.no_grad():
        t = teacher(**probe).logits
        gap_before = (before(**probe).logits - t).pow(2).mean()
        gap_after = (student(**probe).logits - t).pow(2).mean()
    assert len(history.stage1) == 30 and len(history.stage2) == 30
    assert sum(history.stage1[-5:]) < sum(history.stage1[:5])
    assert gap_after < 0.5 * gap_before
    assert student.config.softq_mpc_surrogates == before.config.softq_mpc_surrogates
    assert teacher.config._attn_implementation != "softq_mpc"


def test_stage_one_distils_attention_maps_of_an_sdpa_teacher():
    """A loaded Hugging Face BERT runs SDPA attention, which returns no attention maps: stage 1 must still
    have its attention term (the teacher computes them eagerly while distilling) and give the teacher back
    with its own attention implementation."""
    import transformers

    from softq.mpc.distill import distill

    torch.manual_seed(3)
    config = transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32, attn_implementation="sdpa")
    teacher = transformers.BertModel(config, add_pooling_layer=False).eval()
    assert teacher.config._attn_implementation == "sdpa"
    batch = {"input_ids": torch.randint(0, 40, (4, 8), generator=torch.Generator().manual_seed(4)),
             "attention_mask": torch.ones(4, 8, dtype=torch.long)}
    student = copy.deepcopy(teacher)
    configure_surrogates(student, softmax="2quad", gelu="quad")
    eager = copy.deepcopy(teacher)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        s_out = student(**batch, output_hidden_states=True, output_attentions=True)
        t_out = eager(**batch, output_hidden_states=True, output_attentions=True)
    hidden = sum(torch.nn.functional.mse_loss(a, b) for a, b in zip(s_out.hidden_states, t_out.hidden_states))
    maps = sum(torch.nn.functional.mse_loss(a, b) for a, b in zip(s_out.attentions, t_out.attentions))
    assert len(t_out.attentions) == 2 and float(maps) > 1e-6
    _, history = distill(teacher, iter([batch]), softmax="2quad", gelu="quad", steps=(1, 0), lr=(0.0, 0.0),
                         progress=False, dropout=False)
    assert history.stage1[0] == pytest.approx(float(hidden + maps), rel=1e-5)
    assert teacher.config._attn_implementation == "sdpa"


def test_normalized_hidden_loss_weighs_each_channel_by_the_teachers_spread():
    """normalize_hidden: each hidden-state channel's error counts relative to the teacher's spread of that
    channel over valid tokens (padding excluded), measured on the first NORM_BATCHES batches, which are
    then trained on in their original order."""
    import transformers

    from softq.mpc.distill import NORM_BATCHES, distill, hidden_scales

    torch.manual_seed(5)
    config = transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32, attn_implementation="eager")
    teacher = transformers.BertModel(config, add_pooling_layer=False).eval()
    gen = torch.Generator().manual_seed(6)
    batches = []
    for i in range(NORM_BATCHES + 1):
        mask = torch.ones(4, 8, dtype=torch.long)
        mask[:, 8 - 1 - i % 3:] = 0  # padding at the end of every row
        batches.append({"input_ids": torch.randint(0, 40, (4, 8), generator=gen), "attention_mask": mask})
    scales = hidden_scales(teacher, batches[:NORM_BATCHES])
    with torch.no_grad():
        outs = [teacher(**b, output_hidden_states=True).hidden_states for b in batches[:NORM_BATCHES]]
    assert len(scales) == config.num_hidden_layers + 1
    for layer, scale in enumerate(scales):
        rows = torch.cat([h[layer][b["attention_mask"].bool()] for h, b in zip(outs, batches)])
        assert torch.allclose(scale, rows.var(0, unbiased=False).clamp_min(1e-3).rsqrt(), rtol=1e-4)
        padded = torch.cat([h[layer].reshape(-1, 32) for h in outs])
        assert not torch.allclose(scale, padded.var(0, unbiased=False).clamp_min(1e-3).rsqrt(), rtol=1e-2)

    student = copy.deepcopy(teacher)
    configure_surrogates(student, softmax="2quad", gelu="quad")
    with torch.no_grad():
        s_out = student(**batches[0], output_hidden_states=True, output_attentions=True)
        t_out = teacher(**batches[0], output_hidden_states=True, output_attentions=True)
    weighted = sum(torch.nn.functional.mse_loss(a * w, b * w)
                   for a, b, w in zip(s_out.hidden_states, t_out.hidden_states, scales))
    plain = sum(torch.nn.functional.mse_loss(a, b) for a, b in zip(s_out.hidden_states, t_out.hidden_states))
    maps = sum(torch.nn.functional.mse_loss(a, b) for a, b in zip(s_out.attentions, t_out.attentions))
    assert abs(float(weighted) - float(plain)) > 0.1 * float(plain)
    for normalize, expected in ((True, weighted + maps), (False, plain + maps)):
        _, history = distill(teacher, iter(batches), softmax="2quad", gelu="quad", steps=(1, 0), lr=(0.0, 0.0),
                             progress=False, dropout=False, normalize_hidden=normalize)
        assert history.stage1[0] == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(ValueError, match="at least one batch"):
        hidden_scales(teacher, [])


def test_per_layer_surrogates_and_bad_arguments():
    model = tiny_bert()
    spec = configure_surrogates(model, softmax=["softmax", "2quad"], gelu={1: "relu"})
    assert spec.softmax == ["softmax", "2quad"] and spec.gelu == [None, "relu"]
    assert type(model.bert.encoder.layer[1].intermediate.intermediate_act_fn).__name__ == "SurrogateGELU"
    assert type(model.bert.encoder.layer[0].intermediate.intermediate_act_fn).__name__ != "SurrogateGELU"
    with pytest.raises(ValueError, match="2 per-layer choices|per-layer"):
        configure_surrogates(tiny_bert(), softmax=["2quad"])
    with pytest.raises(ValueError, match="unknown GELU"):
        configure_surrogates(tiny_bert(), gelu="swish")
    with pytest.raises(ValueError, match="cannot run under MPC"):
        configure_surrogates(tiny_bert(), softmax="softpick")
    with pytest.raises(ValueError, match="at least 2 parties"):
        run(tiny_bert(), bert_inputs(), world_size=1)
    with pytest.raises(ValueError, match="provider"):
        run(tiny_bert(), bert_inputs(), provider="HE")


@pytest.mark.parametrize("model_type", ["xlm-roberta", "camembert", "electra", "distilbert"])
def test_model_types_run_as_their_families(crypten1, model_type):
    """The model types softq runs as one of its families, with padding; RoBERTa's positions from the public mask
    (the two-process run and the refusals: test_families.py)."""
    from test_families import build, inputs

    from softq.mpc.graph import public_positions

    model, x = build(model_type), inputs(5, seq=10)
    x["attention_mask"][-1, 6:] = 0
    x["input_ids"][-1, 6:] = 1
    x = public_positions(model, x)
    assert ("position_ids" in x) == (model_type in ("xlm-roberta", "camembert"))
    out, plain = encrypted_local(crypten1, model, x, "softmax", "tanh")
    valid = x["attention_mask"].bool()
    assert (out - plain)[valid].abs().max() < 1e-2 * plain.abs().max()


def test_opt_with_public_attention_mask(crypten1):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(11)
    model = OPTForCausalLM(OPTConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                     num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32,
                                     init_std=0.2, pad_token_id=None, bos_token_id=None, eos_token_id=None)).eval()
    ids = torch.randint(0, 40, (1, 8), generator=torch.Generator().manual_seed(12))
    out, plain = encrypted_local(crypten1, model, {"input_ids": ids, "attention_mask": torch.ones(1, 8, dtype=torch.long)},
                                 "2quad", None)
    assert (out - plain).abs().max() < 1e-2


def test_cli_reports_bad_model_clearly(capsys):
    from softq.cli import main

    assert main(["mpc", "run", "--model", "/nonexistent/model"]) == 1
    assert "/nonexistent/model is not a model directory" in capsys.readouterr().err


def test_ttp_provider_runs_with_a_separate_dealer_process():
    model, inputs = tiny_bert(), bert_inputs()
    result = run(model, inputs, softmax="2quad", gelu="quad", provider="TTP", timeout=60)
    ref = copy.deepcopy(model)
    configure_surrogates(ref, softmax="2quad", gelu="quad")
    with torch.no_grad():
        assert (result.logits - ref(**inputs).logits).abs().max() < 1e-2
    assert result.report.provider == "TTP" and result.report.rounds > 0


def test_negative_fixed_point_values_decode_correctly():
    crypten = load_crypten()
    enc = crypten.encoder.FixedPointEncoder()
    x = torch.tensor([-63.9999, -20.99995, -5.25, 3.5, -1.0])
    assert (enc.decode(enc.encode(x)) - x).abs().max() < 1e-4  # CrypTen 0.4.1 alone is off by 1.0 here
