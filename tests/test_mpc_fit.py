"""Calibrated surrogates (softq.mpc.fit): exact weight rewrites that start a 2Quad + Quad student near its teacher."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_inputs, tiny_model

from softq.mpc.distill import distill
from softq.mpc.fit import MIN_CURVATURE, fit_surrogates
from softq.mpc.surrogates import configure_surrogates


def _calib(family: str) -> list[dict[str, torch.Tensor]]:
    batches = [tiny_inputs(family, batch=4, seq=16, seed=s) for s in range(3)]
    if family != "vit":
        for b in batches:
            b["attention_mask"] = torch.ones_like(b["input_ids"])
        batches[0]["attention_mask"][1, 10:] = 0  # padded tokens: left out of the GELU fit
    return batches


def _out(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", ["bert", "gpt2", "vit"])
def test_fit_starts_the_student_nearer_its_teacher(family):
    teacher = tiny_model(family, seed=3)
    if family != "vit":  # wider activations than a fresh init, as trained models have
        with torch.no_grad():
            for p in teacher.parameters():
                if p.dim() == 2:
                    p.mul_(4.0)
    plain = copy.deepcopy(teacher)
    configure_surrogates(plain, softmax="2quad", gelu="quad")
    fitted = copy.deepcopy(plain)
    teacher_weights = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    report = fit_surrogates(fitted, teacher, _calib(family))
    assert report.skipped == []
    assert sorted(report.gelu_rms) == sorted(report.softmax_kl) == [0, 1]
    for before, after in report.gelu_rms.values():
        assert after < 0.5 * before
    for before, after in report.softmax_kl.values():
        assert after <= before
    assert all(len(s) == 4 for s in report.scales.values())
    held_out = tiny_inputs(family, batch=4, seq=16, seed=11)
    t = _out(teacher, held_out)
    assert (_out(fitted, held_out) - t).pow(2).mean() < 0.5 * (_out(plain, held_out) - t).pow(2).mean()
    assert all(torch.equal(p, teacher_weights[n]) for n, p in teacher.named_parameters())
    assert "Quad rms error to GELU" in report.summary()


def test_quad_fold_is_the_per_channel_least_squares_quadratic():
    """Checked against an independent fit: the student's FFN output is fc2 of the least-squares quadratic of
    the teacher's fc1 output (padding excluded), channel by channel, with exact softmax left alone."""
    teacher = tiny_model("bert", seed=5)
    with torch.no_grad():
        for layer in teacher.bert.encoder.layer:
            layer.intermediate.dense.weight.mul_(6.0)
    student = copy.deepcopy(teacher)
    configure_surrogates(student, softmax="softmax", gelu="quad")
    calib = _calib("bert")
    fit_surrogates(student, teacher, calib)
    fc1 = teacher.bert.encoder.layer[0].intermediate.dense
    h_all, keep = [], []
    hook = fc1.register_forward_hook(lambda _m, _a, out: h_all.append(out.reshape(-1, out.shape[-1])))
    for batch in calib:
        _out(teacher, batch)
        keep.append(batch["attention_mask"].reshape(-1).bool())
    hook.remove()
    h = torch.cat(h_all)[torch.cat(keep)].double()
    g = torch.nn.functional.gelu(h)
    coef = []
    for ch in range(h.shape[1]):
        x = torch.stack([h[:, ch] ** 2, h[:, ch], torch.ones_like(h[:, ch])], -1)
        coef.append(torch.linalg.lstsq(x, g[:, ch : ch + 1]).solution[:, 0])
    a, b, c = torch.stack(coef).unbind(-1)
    assert (a > MIN_CURVATURE).all()  # no clamping in this model: the fold must reproduce the fit exactly
    probe = tiny_inputs("bert", batch=2, seq=12, seed=7)
    with torch.no_grad():
        hp = fc1(teacher.bert.embeddings(probe["input_ids"])).double()
        emb = student.bert.embeddings(probe["input_ids"])
        s_layer = student.bert.encoder.layer[0]
        got = s_layer.output.dense(s_layer.intermediate(emb)).double()
        fc2 = teacher.bert.encoder.layer[0].output.dense
        want = (a * hp * hp + b * hp + c) @ fc2.weight.double().t() + fc2.bias.double()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_distill_fits_fresh_students_only_and_refuses_bad_arguments():
    teacher = tiny_model("bert", seed=4)
    batch = tiny_inputs("bert", batch=4, seq=8, seed=2)

    def batches():
        while True:
            yield batch

    student, history = distill(teacher, batches(), steps=(0, 0), progress=False, fit=True, fit_batches=2)
    assert history.fit is not None and sorted(history.fit.gelu_rms) == [0, 1]
    _, plain_history = distill(teacher, batches(), steps=(0, 0), progress=False)  # default: a plain copy
    assert plain_history.fit is None
    _, continued = distill(teacher, batches(), steps=(0, 1), progress=False, student=student, fit=True)
    assert continued.fit is None  # a student being continued keeps its weights
    with pytest.raises(ValueError, match="fit_batches must be >= 1"):
        distill(teacher, batches(), steps=(0, 1), progress=False, fit=True, fit_batches=0)
    with pytest.raises(ValueError, match="two models"):
        fit_surrogates(teacher, teacher, [batch])


def test_two_quad_scales_keep_the_encrypted_row_division_in_range():
    """Only scales whose 2Quad row sums stay inside the encrypted division's range (with the range check's margin)
    are candidates: the fitted student passes the range check, and where no scale can, the head is left alone."""
    from softq.mpc.ranges import check_model

    teacher = tiny_model("bert", seed=6)
    with torch.no_grad():
        for layer in teacher.bert.encoder.layer:
            layer.attention.self.query.weight.mul_(40.0)
    calib = _calib("bert")
    student = copy.deepcopy(teacher)
    configure_surrogates(student, softmax="2quad", gelu=None)
    report = fit_surrogates(student, teacher, calib)
    assert report.skipped == [] and any(s != 1.0 for scales in report.scales.values() for s in scales)
    check_model(student, calib[1], calibration=calib)
    strict = copy.deepcopy(teacher)
    configure_surrogates(strict, softmax="2quad", gelu=None)
    weights = {n: p.detach().clone() for n, p in strict.named_parameters()}
    strict_report = fit_surrogates(strict, teacher, calib, range_margin=1e6)  # no row sum can be that central
    assert all(s == 1.0 for scales in strict_report.scales.values() for s in scales)
    assert len(strict_report.skipped) == 2 and "no scale keeps the row sums" in strict_report.skipped[0]
    assert all(torch.equal(p, weights[n]) for n, p in strict.named_parameters())
    with pytest.raises(ValueError, match="range_margin must be >= 1"):
        fit_surrogates(strict, teacher, calib, range_margin=0.5)


def test_augment_tokens_replaces_words_only_with_fresh_draws_each_step():
    from softq.mpc.distill import augment_tokens

    ids = torch.tensor([[101, 5, 6, 7, 8, 9, 10, 11, 102, 0, 0],
                        [101, 12, 13, 14, 15, 16, 17, 18, 19, 20, 102]])
    mask = (ids != 0).long()
    batch = {"input_ids": ids, "attention_mask": mask}
    pool = torch.tensor([1000, 1001, 1002])
    special = [0, 101, 102]
    plain = next(augment_tokens(iter([batch]), 0.0))
    assert torch.equal(plain["input_ids"], ids)
    out = [b["input_ids"] for b in augment_tokens(iter([batch] * 200), 0.3, seed=1, pool=pool, keep=special)]
    words = mask.bool() & ~torch.isin(ids, torch.tensor(special))
    for o in out:
        assert torch.equal(o[~words], ids[~words])  # [CLS], [SEP] and padding never change
        changed = o[words] != ids[words]
        assert torch.isin(o[words][changed], pool).all()  # replacements come from the pool
    rate = torch.stack([(o != ids)[words].float().mean() for o in out]).mean()
    assert 0.25 < float(rate) < 0.35
    assert not torch.equal(out[0], out[1])  # fresh draws at every step
    again = [b["input_ids"] for b in augment_tokens(iter([batch] * 2), 0.3, seed=1, pool=pool, keep=special)]
    assert torch.equal(again[0], out[0]) and torch.equal(again[1], out[1])  # seeded
    with pytest.raises(ValueError, match="rate must be in"):
        next(augment_tokens(iter([batch]), 1.0, pool=pool))
    with pytest.raises(ValueError, match="candidate ids"):
        next(augment_tokens(iter([batch]), 0.1))
