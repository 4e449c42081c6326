"""Where the 2400-step reference LM's W8A8 and 4-bit softmax losses come from, and what did not fix them.

Issue 9 asks for +0.3% perplexity at 8 bits and +1.5% with a 4-bit softmax on the reference LM
trained 2400 steps (context 1024, all 12 held-out windows); quant_lm_steps2400.md has the default
`row` at +0.38% and +2.08%.  This probe writes docs/results/lm2400_probe.md:

1. the 8-bit loss by part: only that kind of quantization point on (the rest float), held-out
   loss change in nats;
2. input smoothing: what ``input_smoothing="auto"`` (the default) picks, and each alpha; SmoothQuant strengths
   ``smoothquant_alpha`` (folded into the LayerNorms: free in ONNX); then two calibration-driven fixes tried here only: the
   SmoothQuant alpha chosen per LayerNorm by the W8A8 output error of the Linear it feeds on the
   calibration set (alpha in 0.1 .. 0.9 or none), and empirical bias correction of every Linear (its
   mean output error on the calibration set, the quantized model's own inputs, subtracted from its bias);
3. the 4-bit softmax by layer: only that layer's softmax input and output quantized at 4 bits
   (every Linear at 8 bits as usual, the other layers' softmax float), for `row`, `row_exact` and the 4-bit
   log codes `row_log`;
4. two 4-bit code variants tried in torch only (monkeypatched here, not in softq): a code gain
   ``E = min(L, round(g L p / max p))`` (the top keys saturate, the tail gets finer steps; the
   row-relative input span widened to match) and dithered rounding ``E = floor(L p / max p + u)``
   with a fixed per-key (golden-ratio) or per-(query, key) offset ``u`` in [0, 1) (unbiased mass).

Usage (the command used for the committed file is written into it)::

    python benchmarks/probe_lm2400.py --threads 1
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch

import softq
from softq.attention import attention_points
from softq.calib.data import as_batches, run_batches
from softq.calib.smoothquant import find_norm_linear_groups
from softq.models import conv1d_to_linear
from softq.quant import quantizers as QZ
from softq.quant.quantize import smoothing_report
from softq.quant.sensitivity import enable_only
from softq.quant.layers import QLinear
from softq.quant.quantizers import SoftmaxOutputQuantizer
from workloads.tasks import reference_task

ROOT = Path(__file__).resolve().parents[1]
PHI = (math.sqrt(5) - 1) / 2
PARTS = [("attention input (c_attn: Q, K, V projections)", ".attn.c_attn.input_act"),
         ("attention output projection input (attn.c_proj)", ".attn.c_proj.input_act"),
         ("MLP up-projection input (c_fc)", ".mlp.c_fc.input_act"),
         ("MLP down-projection input (mlp.c_proj, after GELU)", ".mlp.c_proj.input_act"),
         ("Linear weights", ".weight"), ("Q, K, V", (".q", ".k", ".v")),
         ("softmax input and output", (".scores", ".probs")), ("embedding tables", (".wte", ".wpe"))]


def only(qmodel: torch.nn.Module, keep) -> None:  # noqa: ANN001
    """Quantization on at the points whose name ``keep`` accepts (a Linear's weights as ``<name>.weight``),
    off elsewhere (embedding tables included), by softq.quant.sensitivity.enable_only."""
    enable_only(qmodel, {id(m) for name, m in qmodel.named_modules()
                         if keep(f"{name}.weight" if isinstance(m, QLinear) else name)})


class CodeVariant:
    """Monkeypatches SoftmaxOutputQuantizer.quantize with a gain or a dither (``row`` normalisation)."""

    def __init__(self) -> None:
        self.gain, self.dither = 1.0, None
        self.original = QZ.SoftmaxOutputQuantizer.quantize

    def __enter__(self) -> CodeVariant:
        variant = self

        def quantize(q: SoftmaxOutputQuantizer, probs: torch.Tensor) -> torch.Tensor:
            levels = 2**q.bits - 1
            r = probs / probs.amax(dim=-1, keepdim=True).clamp_min(1e-30) * levels * variant.gain
            if variant.dither is None:
                e = torch.clamp(torch.round(r), 0, levels)
            else:
                k = torch.arange(r.shape[-1], dtype=torch.float64)
                u = k * PHI if variant.dither == "key" else (
                    k * PHI + torch.arange(r.shape[-2], dtype=torch.float64)[:, None] * 0.7548776662466927)
                e = torch.clamp(torch.floor(r + torch.frac(u).float()), 0, levels)
            return e / e.sum(dim=-1, keepdim=True).clamp_min(1e-30)

        QZ.SoftmaxOutputQuantizer.quantize = quantize
        return self

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        QZ.SoftmaxOutputQuantizer.quantize = self.original


def _act_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """``x`` through softq's default activation quantizer (8-bit asymmetric, min-max range of ``x`` itself)."""
    q = QZ.ActQuantizer(8, signed=False)
    q.mode = "observe"
    q(x)
    q.finish_calibration()
    q.mode = "quant"
    return q(x)


@torch.no_grad()
def searched_smoothing(model: torch.nn.Module, calib: list) -> tuple[torch.nn.Module, dict[str, float | None]]:  # noqa: ANN001
    """A copy of ``model`` with SmoothQuant folded into each LayerNorm at the alpha (0.1 .. 0.9, or none)
    whose W8A8 output of the Linear it feeds is closest, in mean squared error, to the float output on
    4096 calibration tokens; returns the copy and the alphas chosen."""
    model = copy.deepcopy(model)
    conv1d_to_linear(model)
    batches = as_batches(model, calib)
    groups = find_norm_linear_groups(model, batches[0])
    seen: dict[str, list[torch.Tensor]] = {g.norm_name: [] for g in groups}
    hooks = [g.norm.register_forward_hook(lambda _m, _i, out, n=g.norm_name: seen[n].append(out.reshape(-1, out.shape[-1])))
             for g in groups]
    run_batches(model, batches)
    for h in hooks:
        h.remove()
    chosen = {}
    for g in groups:
        x_all = torch.cat(seen[g.norm_name])
        x = x_all[torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))[:4096]]
        amax = x_all.abs().amax(0).clamp_min(1e-5)
        wmax = torch.stack([lin.weight.abs().amax(0) for _, lin in g.linears]).amax(0).clamp_min(1e-5)
        scales = {None: torch.ones_like(amax), **{a: (amax**a / wmax ** (1 - a)).clamp_min(1e-5)
                                                  for a in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)}}

        def error(s: torch.Tensor) -> float:
            xq = _act_fake_quant(x / s)
            return sum(float((xq @ QZ.dequantized_weight(lin.weight * s, 8, True).T - x @ lin.weight.T).pow(2).mean())
                       for _, lin in g.linears)

        alpha = min(scales, key=lambda a: error(scales[a]))
        chosen[g.norm_name] = alpha
        s = scales[alpha]
        g.norm.weight.div_(s)
        g.norm.bias.div_(s)
        for _, lin in g.linears:
            lin.weight.mul_(s)
    return model, chosen


@torch.no_grad()
def linear_bias_corrected(qmodel: torch.nn.Module, calib: list) -> torch.nn.Module:  # noqa: ANN001
    """Every quantized Linear's mean output error (W8A8 output minus the float Linear on the same input,
    over the calibration set as the quantized model runs it) subtracted from its bias, in place."""
    sums: dict[str, list] = {}

    def hook(name: str):  # noqa: ANN202
        def record(m: QLinear, inp: tuple, out: torch.Tensor) -> None:
            x = inp[0] * m.input_scale if m.input_scale.numel() else inp[0]
            d = (out - torch.nn.functional.linear(x, m.weight, m.bias)).reshape(-1, out.shape[-1])
            total = sums.setdefault(name, [0.0, 0])
            total[0], total[1] = total[0] + d.sum(0), total[1] + d.shape[0]
        return record

    hooks = [m.register_forward_hook(hook(n)) for n, m in qmodel.named_modules() if isinstance(m, QLinear)]
    run_batches(qmodel, as_batches(qmodel, calib))
    for h in hooks:
        h.remove()
    modules = dict(qmodel.named_modules())
    for name, (total, count) in sums.items():
        if modules[name].bias is not None:
            modules[name].bias -= total / count
    return qmodel


def token_losses(model: torch.nn.Module, task) -> torch.Tensor:  # noqa: ANN001
    """Next-token cross-entropy (nats) of every held-out token, in order."""
    out = []
    with torch.no_grad():
        for batch in task.eval_inputs:
            logp = torch.log_softmax(model(**batch).logits[:, :-1].float(), -1)
            out.append(-logp.gather(-1, batch["input_ids"][:, 1:, None]).flatten())
    return torch.cat(out)


def task_tokens(task) -> int:  # noqa: ANN001
    return sum(b["input_ids"][:, 1:].numel() for b in task.eval_inputs)


def delta_standard_error(task, qmodel: torch.nn.Module) -> float:  # noqa: ANN001
    """Standard error of the mean per-token loss change FP32 -> ``qmodel`` (tokens taken as independent)."""
    d = token_losses(qmodel, task) - token_losses(task.model, task)
    return float(d.std() / math.sqrt(d.numel()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "lm2400_probe.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()
    task = reference_task("lm", steps=args.steps, eval_limit=12, progress=False)
    fp, fp_loss = task.measure()

    deltas: dict[str, float] = {}

    def row(name: str, qmodel: torch.nn.Module) -> str:
        ppl, loss = task.measure(qmodel)
        deltas[name] = loss - fp_loss
        print(f"{name}: {100 * (ppl / fp - 1):+.2f}%", flush=True)
        return f"| {name} | {ppl:.4f} | {100 * (ppl / fp - 1):+.2f}% | {loss - fp_loss:+.5f} |"

    head = ["| setting | perplexity | vs FP32 | loss change (nats) |", "|---|---|---|---|"]
    lines = [f"# The {args.steps}-step reference LM: where W8A8 and the 4-bit softmax lose (probe)", "",
             "Generated by `benchmarks/probe_lm2400.py`; do not edit by hand. Command:", "",
             "    python benchmarks/probe_lm2400.py " + " ".join(sys.argv[1:]), "",
             f"Context 1024, all 12 held-out windows, FP32 perplexity {fp:.4f}. W8A8 = `QuantConfig()` "
             "(row softmax codes, residual stream float) unless a row says otherwise.", "",
             "## 1. The 8-bit loss by part (only that part quantized)", "", *head]
    q8 = softq.quantize(task.model, task.calib, softq.QuantConfig())
    only(q8, lambda n: True)
    lines.append(row("everything (the default W8A8)", q8))
    se = delta_standard_error(task, q8)
    for label, pattern in PARTS:
        pats = pattern if isinstance(pattern, tuple) else (pattern,)
        only(q8, lambda n, pats=pats: n.endswith(pats))
        lines.append(row(label, q8))
    parts = sum(deltas[label] for label, _ in PARTS)
    lines += ["", f"The parts do not add up: alone they sum to {parts:+.5f} nats, all together "
              f"{deltas['everything (the default W8A8)']:+.5f}; their errors interact at this level, so the rows rank "
              "the parts only roughly.",
              "",
              f"Resolution: the default's per-token loss change has a standard error of {se:.5f} nats "
              f"({100 * se:.2f} points of perplexity change) over the {task_tokens(task)} held-out tokens, so "
              "rows that differ by less than about twice that are not told apart by this held-out set."]
    auto = softq.quantize(task.model, task.calib, softq.QuantConfig())
    lines += ["", "## 2. Input smoothing and SmoothQuant strength, and two calibration-driven fixes (8-bit)", "",
              "`input_smoothing='auto'` (the default) observes ranges on 12 of the 16 calibration windows and judges no "
              "smoothing and alphas 0.6 / 0.8 / 1.0 on the other 4 (cosine distance of the logits to FP32's), each at "
              "every Linear input and at the LayerNorm outputs' inputs alone (c_attn, c_fc: their scales fold into the "
              "LayerNorm, free at run time, kept if closer than none); smoothing every input costs Muls at run time "
              "and is kept only if at least 20% closer than none and closer than those. Here, "
              f"{smoothing_report(auto)}.", "", *head]
    chosen = auto.softq_input_smoothing
    where = " at the LayerNorm-folded inputs" if auto.softq_smoothing_folded_only else ""
    lines.append(row(f"default: `input_smoothing='auto'` (picks {'none' if chosen is None else f'alpha {chosen:g}'}"
                     f"{where} on held-out calibration batches)", auto))
    none = softq.QuantConfig(input_smoothing=None)
    for label, cfg in [("no input smoothing (`input_smoothing=None`)", none)] + [
            (f"input_smoothing={a} (every Linear input)", softq.QuantConfig(input_smoothing=a))
            for a in (0.5, 0.6, 0.8, 1.0)] + [
            (f"smoothquant_alpha={a} (folded into the LayerNorms), no input smoothing",
             softq.QuantConfig(smoothquant_alpha=a, input_smoothing=None)) for a in (0.5, 0.6, 0.7, 0.8, 0.9)]:
        lines.append(row(label, softq.quantize(task.model, task.calib, cfg)))
    smoothed, alphas = searched_smoothing(task.model, task.calib)
    picked = ", ".join("none" if a is None else f"{a:g}" for a in alphas.values())
    lines.append(row(f"SmoothQuant alpha per LayerNorm by calibration output error ({picked}), no input smoothing",
                     softq.quantize(smoothed, task.calib, none)))
    lines.append(row("empirical bias correction of every Linear (calibration mean output error)",
                     linear_bias_corrected(softq.quantize(task.model, task.calib, softq.QuantConfig()), task.calib)))
    lines += ["", "## 3. The 4-bit softmax by layer (that layer's softmax input and output at 4 bits, the others "
              "float; Linears 8-bit)", "", *head]
    for rep in ("row", "row_exact", "row_log"):
        q4 = softq.quantize(task.model, task.calib, softq.QuantConfig(softmax_bits=4, softmax_output=rep,
                                                                      softmax_input="row"))  # as measured
        points = [p for _, p in attention_points(q4)]
        for i in [*range(len(points)), None]:
            for j, p in enumerate(points):
                p.probs.mode = p.scores.mode = "quant" if i is None or i == j else "float"
            lines.append(row(f"`{rep}`, 4-bit softmax in " + ("every layer" if i is None else f"layer {i} only"), q4))
    q8f = softq.quantize(task.model, task.calib, softq.QuantConfig(softmax_bits=None))
    lines.append(row("W8A8 with a float softmax (reference for this section)", q8f))
    lines += ["", "## 4. 4-bit code variants (torch only, `row` normalisation)", "", *head]
    q4 = softq.quantize(task.model, task.calib, softq.QuantConfig(softmax_bits=4, softmax_input="row"))
    points = [p for _, p in attention_points(q4)]  # (the input span follows the code gain below)
    with CodeVariant() as variant:
        for gain in (1.0, 1.5, 2.0, 3.0):
            variant.gain = gain
            for p in points:  # the input span follows: keys whose code is 0 at this gain
                p.scores.span = math.log(15 * gain / 0.45)
                p.scores.scale.fill_(p.scores.span / 255)
            lines.append(row(f"code gain {gain:g}: E = min(15, round({15 * gain:g} p / max p))", q4))
        variant.gain = 1.0
        for p in points:
            p.scores.span = math.log(15 / 0.45)
            p.scores.scale.fill_(p.scores.span / 255)
        for dither in ("key", "query-key"):
            variant.dither = dither
            lines.append(row(f"dithered rounding, fixed {dither} offsets", q4))
    lines += ["", f"Took {(time.time() - start) / 60:.1f} min."]
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
