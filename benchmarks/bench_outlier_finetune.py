"""Remove the outliers of pretrained all-MiniLM-L6-v2 by fine-tuning: gated attention and clipped softmax vs a control.

Every fine-tune is ``softq.calib.outlier_finetune.finetune_outliers``: a copy of the
model distilled against the original (pooled-embedding cosine + block-output
error, no labels) on random word windows of the *calib* paragraphs of
``pydoc_data.topics``, with an explicit soft penalty on LayerNorm inputs and FFN
outputs above a threshold.  Runs, same steps, data and loss for all:

* ``control``: attention unchanged (the loss alone);
* ``gated``: converted to gated attention first (function-preserving at step 0);
* ``clipped``: clipped softmax (not function-preserving at step 0);
* ``clipped, no penalty`` (first seed only): does clipping alone, repaired by distillation, move outliers?
  (``gated`` and ``control`` without a penalty start at the teacher with zero loss and zero
  gradient, so they cannot move: not run.)

Measured on held-out *eval* paragraphs against the ORIGINAL FP32 model: per layer max |x| and
kurtosis of LayerNorm inputs and FFN outputs (``softq.calib.diagnostics``), attention-sink
rate (mass on the first key, [CLS]), FP32 embedding cosine, W8A8 with a per-tensor 8-bit
residual stream, [CLS] included (``QuantConfig(quantize_residual=True, residual_groups=1, residual_prefix=0,
input_smoothing=None, embedding_bits=None)``; also with ``residual_prefix="auto"``; clipped models with
``softmax_output="row_exact"``, since the default ``row`` codes renormalise rows to sum 1,
which clipped rows need not) and half-paragraph recall@1; for gated models, what the gates learned.
Writes docs/results/outlier_finetune.md and .png (atomically) with the command.
Finished fine-tunes are checkpointed under --checkpoint-dir and reused on a re-run.

    python benchmarks/bench_outlier_finetune.py --steps 200 --seeds 0,1
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_quant import command_line, write_atomic  # noqa: E402
from benchutil import seed_list  # noqa: E402

import softq  # noqa: E402
from softq import corpora, hf  # noqa: E402
from workloads import retrieval  # noqa: E402
from softq.calib import diagnostics  # noqa: E402
from softq.calib.outlier_finetune import OutlierFinetuneConfig, finetune_outliers, gate_values  # noqa: E402


def evaluate(loaded: hf.HFModel, model: torch.nn.Module, data: dict, method: str) -> dict:
    """Everything measured for one model against the original FP32 embeddings ``data['ref']``."""
    cos = lambda a, b: torch.nn.functional.cosine_similarity(a.float(), b.float())  # noqa: E731
    emb = loaded.encode(data["ev"], model)
    r = {"fp_cos": cos(emb, data["ref"]).mean().item(), "fp_cos_min": cos(emb, data["ref"]).min().item(),
         "fp_recall": retrieval.recall_at_1(loaded.encode(data["qb"], model), loaded.encode(data["cb"], model))}
    diag = diagnostics.collect(model, data["ev"])
    r["layers"] = [{"ln_inf": s.ln_input_inf_norm, "ln_kurt": s.ln_input_kurtosis, "ffn_inf": s.ffn_inf_norm,
                    "dims": s.outlier_dims} for s in diag.layers]
    r["ln_inf"] = max(s.ln_input_inf_norm for s in diag.layers)
    r["ffn_inf"] = diag.max_ffn_inf_norm
    r["ln_kurt"] = statistics.mean(s.ln_input_kurtosis for s in diag.layers)
    r["sink"] = diag.mean_sink_rate
    r["sink_heads"] = [h.sink_rate for h in diag.heads]
    # the quantization these results were measured with: per-tensor residual stream (quantized: the issue's
    # measure; the default keeps it float since), [CLS] sharing it (residual_prefix=0; "auto" gives [CLS] its own
    # scales since, reported apart), no input smoothing and float embedding tables
    cfg = softq.QuantConfig(quantize_residual=True, residual_groups=1, residual_prefix=0, input_smoothing=None,
                            embedding_bits=None, softmax_output="row_exact" if method.startswith("clipped") else "row")
    prefixed = softq.quantize(model, data["calib"], dataclasses.replace(cfg, residual_prefix="auto"))
    r["q_cos_prefix"] = cos(loaded.encode(data["ev"], prefixed), data["ref"]).mean().item()
    qmodel = softq.quantize(model, data["calib"], cfg)
    qemb = loaded.encode(data["ev"], qmodel)
    r["q_cos"] = cos(qemb, data["ref"]).mean().item()
    r["q_cos_min"] = cos(qemb, data["ref"]).min().item()
    r["q_cos_self"] = cos(qemb, emb).mean().item()  # quantization error alone: W8A8 vs this model's own FP32
    r["q_recall"] = retrieval.recall_at_1(loaded.encode(data["qb"], qmodel), loaded.encode(data["cb"], qmodel))
    r["gates"] = gate_values(model, data["ev"][:2])
    r["tokens"] = token_outliers(model, data["ev"], loaded.tokenizer.sep_token_id)
    r["cls_constant_cos"] = constant_cls_cosine(loaded, model, data, emb)
    return r


@torch.no_grad()
def constant_cls_cosine(loaded: hf.HFModel, model: torch.nn.Module, data: dict, own: torch.Tensor) -> float:
    """Is [CLS] a constant no-op sink? Mean cosine between ``model``'s embeddings ``own`` (of ``data['ev']``) and the
    same model's with the keys and values of [CLS] in every layer replaced by their mean over the calibration
    paragraphs (1.0: what the other tokens read from [CLS] does not depend on the text): softq's
    ``ConstantSink`` started by ``init_constant_sinks`` on a copy.  A model that has sinks already reads only
    constants there: 1.0 by construction."""
    from softq.attention import configure_attention, init_constant_sinks
    from softq.models import attention_modules

    if any(getattr(getattr(m, "softq", None), "sink", None) is not None for _, m in attention_modules(model)):
        return 1.0
    fixed = copy.deepcopy(model)
    configure_attention(fixed, constant_sink=True)
    init_constant_sinks(fixed, data["calib"])
    return torch.nn.functional.cosine_similarity(loaded.encode(data["ev"], fixed).float(), own.float()).mean().item()


@torch.no_grad()
def token_outliers(model: torch.nn.Module, batches: list[dict], sep_id: int) -> list[dict[str, float]]:
    """Per layer, max |x| over the block's LayerNorm inputs at [CLS], at [SEP] and at every other valid token."""
    from softq.models import transformer_blocks

    out = [{"cls": 0.0, "sep": 0.0, "other": 0.0} for _ in transformer_blocks(model)]
    box: dict[str, torch.Tensor] = {}
    handles = []

    def hook(index: int):
        def fn(_m, inputs):
            a = inputs[0].abs().amax(-1)  # [b, s]
            ids, valid = box["ids"], box["mask"].bool()
            sep = (ids == sep_id) & valid
            other = valid & ~sep
            other[:, 0] = False
            rec = out[index]
            rec["cls"] = max(rec["cls"], a[:, 0].max().item())
            rec["sep"] = max(rec["sep"], a[sep].max().item() if sep.any() else 0.0)
            rec["other"] = max(rec["other"], a[other].max().item() if other.any() else 0.0)
        return fn

    for i, (_, block) in enumerate(transformer_blocks(model)):
        for m in block.modules():
            if isinstance(m, torch.nn.LayerNorm):
                handles.append(m.register_forward_pre_hook(hook(i)))
    was = model.training
    model.eval()
    try:
        for batch in batches:
            box["ids"], box["mask"] = batch["input_ids"], batch["attention_mask"]
            model(**batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return out


def run_name(cfg: OutlierFinetuneConfig) -> str:
    fields = asdict(cfg)
    if not fields["constant_sink"]:  # runs cached before the field existed keep their names
        del fields["constant_sink"]
    digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
    return f"{cfg.method}{'-sink' if cfg.constant_sink else ''}-p{cfg.penalty_weight:g}-s{cfg.seed}-{cfg.steps}-{digest}"


def pm(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def plot(results: dict[str, dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4))
    for label, r in results.items():
        xs = list(range(len(r["layers"])))
        style = dict(marker="o", linewidth=2.5 if label == "original" else 1.3)
        axes[0].plot(xs, [l["ln_inf"] for l in r["layers"]], label=label, **style)
        axes[1].plot(xs, [l["ffn_inf"] for l in r["layers"]], label=label, **style)
        axes[2].plot(xs, [l["ln_kurt"] for l in r["layers"]], label=label, **style)
        axes[3].plot(range(len(r["sink_heads"])), r["sink_heads"], marker=".", linewidth=1, label=label)
    axes[0].set(title="max |x| at LayerNorm inputs (residual sum)", xlabel="layer", yscale="log")
    axes[1].set(title="max |x| of FFN outputs", xlabel="layer", yscale="log")
    axes[2].set(title="kurtosis of LayerNorm inputs", xlabel="layer", yscale="log")
    axes[3].set(title="attention mass on [CLS] (first key) per head", xlabel="layer * 12 + head", ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle("all-MiniLM-L6-v2 before/after outlier fine-tuning (eval paragraphs; fine-tunes: first seed)")
    fig.tight_layout()
    return diagnostics.save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=OutlierFinetuneConfig.steps)
    parser.add_argument("--seeds", type=seed_list, default="0,1", help="comma list of seeds for the three main runs")
    parser.add_argument("--methods", default="none,gated,clipped")
    parser.add_argument("--no-ablation", action="store_true", help="skip 'clipped, no penalty'")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=OutlierFinetuneConfig.lr)
    parser.add_argument("--embed-weight", type=float, default=OutlierFinetuneConfig.embed_weight)
    parser.add_argument("--hidden-weight", type=float, default=OutlierFinetuneConfig.hidden_weight)
    parser.add_argument("--penalty-weight", type=float, default=OutlierFinetuneConfig.penalty_weight)
    parser.add_argument("--threshold", type=float, default=OutlierFinetuneConfig.penalty_threshold)
    parser.add_argument("--gate-lr", type=float, default=OutlierFinetuneConfig.gate_lr)
    parser.add_argument("--pi", type=float, default=OutlierFinetuneConfig.pi_init)
    parser.add_argument("--alpha", type=float, default=OutlierFinetuneConfig.clip_alpha)
    parser.add_argument("--constant-sink", action=argparse.BooleanOptionalAction,
                        default=OutlierFinetuneConfig.constant_sink,
                        help="every run also makes [CLS]'s keys and values per-layer constants "
                             "(OutlierFinetuneConfig.constant_sink, the default; --no-constant-sink: the runs "
                             "before it)")
    parser.add_argument("--eval-limit", type=int, default=128, help="eval paragraphs (default 128)")
    parser.add_argument("--calib-size", type=int, default=64, help="W8A8 calibration paragraphs")
    parser.add_argument("--text", choices=("calib", "recombined"), default="calib",
                        help="training text: the calib paragraphs (default) or 20000 windows of 48 words of their "
                             "sentences recombined at random (softq.corpora.recombined_windows; no sentence of an eval "
                             "paragraph), which helped the MPC distillation generalise (docs/results/mpc.md)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path(os.environ.get("SOFTQ_CACHE", Path.home() / ".cache" / "softq")) / "outlier_finetune")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "outlier_finetune.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()
    seeds = args.seeds
    methods = [m for m in args.methods.split(",") if m]

    loaded = hf.load_minilm(128)
    original = loaded.model
    train_texts = corpora.text_split("calib")
    if args.text == "recombined":
        train_texts = corpora.recombined_windows(train_texts, 48, 20000, exclude=corpora.text_split("eval"))
    texts = corpora.text_split("eval", args.eval_limit)
    first, second = retrieval.halves(texts)
    data = {"ev": loaded.batches(texts, 32), "qb": loaded.batches(first, 32), "cb": loaded.batches(second, 32),
            "calib": loaded.batches(corpora.text_split("calib", args.calib_size), 16)}
    data["ref"] = loaded.encode(data["ev"])

    def config(method: str, seed: int, penalty: float) -> OutlierFinetuneConfig:
        return OutlierFinetuneConfig(method=method, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                     gate_lr=args.gate_lr, embed_weight=args.embed_weight, hidden_weight=args.hidden_weight,
                                     penalty_weight=penalty, penalty_threshold=args.threshold, pi_init=args.pi,
                                     clip_alpha=args.alpha, constant_sink=args.constant_sink, seed=seed)

    runs = [(m, seeds[0], args.penalty_weight) for m in methods]
    if not args.no_ablation and "clipped" in methods:
        runs.append(("clipped", seeds[0], 0.0))
    runs += [(m, s, args.penalty_weight) for s in seeds[1:] for m in methods]
    sink = " + constant sink" if args.constant_sink else ""
    label_of = {"none": "control (no gates) + constant sink" if sink else "control (attention unchanged)", "gated": f"gated{sink}", "clipped": f"clipped{sink}"}

    results: dict[str, dict] = {"original": evaluate(loaded, original, data, "none")}
    print("original", {k: v for k, v in results["original"].items() if isinstance(v, float)}, flush=True)
    per_run: list[tuple[str, int, dict, dict]] = []
    train_seconds = []
    for method, seed, penalty in runs:
        cfg = config(method, seed, penalty)
        ckpt = args.checkpoint_dir / f"{run_name(cfg)}{'' if args.text == 'calib' else '-' + args.text}.pt"
        t = time.time()
        res = finetune_outliers(original, loaded.tokenizer, train_texts, cfg, checkpoint=ckpt, resume=ckpt.exists(),
                                checkpoint_every=50)
        if len(res.history) == cfg.steps and time.time() - t > 30:
            train_seconds.append((time.time() - t) / cfg.steps)
        label = label_of[method] + ("" if penalty else ", no penalty")
        r = evaluate(loaded, res.model, data, method)
        r["history"] = res.history
        per_run.append((label, seed, r, asdict(cfg)))
        print(label, seed, {k: v for k, v in r.items() if isinstance(v, float)}, flush=True)
        if seed == seeds[0]:
            results[label] = r

    # ---------------------------------------------------------------- report
    orig = results["original"]
    cfg0 = config(methods[0], seeds[0], args.penalty_weight)
    lines = ["# Removing the outliers of pretrained all-MiniLM-L6-v2 by fine-tuning (generated)", "",
             f"Command: `{command_line()}`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores ({args.threads} thread), torch {torch.__version__}"
             + (f"; {statistics.mean(train_seconds):.2f} s per fine-tuning step" if train_seconds else "") + ".", "",
             f"Fine-tune (`softq.calib.outlier_finetune.finetune_outliers`): {cfg0.describe()}; loss = "
             f"{cfg0.embed_weight:g} x (1 - cos of mean-pooled embeddings) + {cfg0.hidden_weight:g} x relative squared "
             f"error of the 6 block outputs + penalty weight x mean over the 12 LayerNorm inputs and 6 FFN outputs of "
             f"sum relu(|x| - {cfg0.penalty_threshold:g})^2 / {cfg0.penalty_threshold:g}^2 per token. Teacher: the "
             f"original model. Training text: " + (f"random word windows of the {len(train_texts)} calib paragraphs. "
             if args.text == "calib" else f"{len(train_texts)} windows of 48 words of the calib paragraphs' sentences "
             "recombined at random (no sentence of an eval paragraph). ") +
             f"Evaluation: {len(texts)} held-out eval paragraphs (disjoint); W8A8 calibrated on {args.calib_size} calib "
             f"paragraphs. Gated: pi_init {args.pi}, gate lr {args.gate_lr:g}; clipped: alpha {args.alpha} (gamma = -alpha/T per row). "
             f"Seeds: {', '.join(map(str, seeds))}.", "",
             "Cosines are to the ORIGINAL FP32 model's sentence embeddings. W8A8 = `softq.quantize` with "
             "`QuantConfig(quantize_residual=True, residual_groups=1, residual_prefix=0, input_smoothing=None, "
             "embedding_bits=None)` (per-tensor 8-bit residual stream, [CLS] included, no input smoothing, float "
             "embedding tables; clipped models with `softmax_output=\"row_exact\"`). Last column: the same with "
             "`residual_prefix=\"auto\"` ([CLS] gets residual scales of its own, softq's default for a quantized "
             "residual stream).", "",
             "## Summary (mean ± std over seeds)", "",
             "| model | seeds | max LN-input inf-norm | max FFN-out inf-norm | mean LN-input kurtosis | sink rate | "
             "FP32 cos | FP32 recall@1 | W8A8 cos (mean) | W8A8 cos (min) | W8A8 recall@1 | W8A8 cos to own FP32 | "
             "W8A8 cos, [CLS] own scales |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
             f"| original | - | {orig['ln_inf']:.1f} | {orig['ffn_inf']:.1f} | {orig['ln_kurt']:.1f} | {orig['sink']:.3f} | "
             f"1.0000 | {orig['fp_recall']:.4f} | {orig['q_cos']:.4f} | {orig['q_cos_min']:.4f} | {orig['q_recall']:.4f} | "
             f"{orig['q_cos_self']:.4f} | {orig['q_cos_prefix']:.4f} |"]
    labels = list(dict.fromkeys(label for label, *_ in per_run))
    grouped = {label: [r for l, _, r, _ in per_run if l == label] for label in labels}
    for label, rs in grouped.items():
        col = lambda key: [r[key] for r in rs]  # noqa: E731
        lines.append(f"| {label} | {len(rs)} | {pm(col('ln_inf'), '.1f')} | {pm(col('ffn_inf'), '.1f')} | "
                     f"{pm(col('ln_kurt'), '.1f')} | {pm(col('sink'), '.3f')} | {pm(col('fp_cos'), '.4f')} | "
                     f"{pm(col('fp_recall'), '.4f')} | {pm(col('q_cos'), '.4f')} | {pm(col('q_cos_min'), '.4f')} | "
                     f"{pm(col('q_recall'), '.4f')} | {pm(col('q_cos_self'), '.4f')} | {pm(col('q_cos_prefix'), '.4f')} |")
    lines += ["", "## Every run", "",
              "| model | seed | LN-input inf-norm | FFN-out inf-norm | LN kurtosis | sink | FP32 cos | W8A8 cos | "
              "W8A8 recall@1 | final loss (embed / hidden / penalty) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, seed, r, _ in per_run:
        h = r["history"][-10:]
        avg = {k: statistics.mean(x[k] for x in h) for k in ("embed", "hidden", "penalty")}
        lines.append(f"| {label} | {seed} | {r['ln_inf']:.1f} | {r['ffn_inf']:.1f} | {r['ln_kurt']:.1f} | "
                     f"{r['sink']:.3f} | {r['fp_cos']:.4f} | {r['q_cos']:.4f} | {r['q_recall']:.4f} | "
                     f"{avg['embed']:.4f} / {avg['hidden']:.4f} / {avg['penalty']:.4f} |")
    lines += ["", "(final loss: mean of the last 10 training steps.)", "",
              f"## Per layer (seed {seeds[0]}): LN-input inf-norm / FFN-out inf-norm / LN-input kurtosis [top LN-input dims]", "",
              "| model | " + " | ".join(f"layer {i}" for i in range(len(orig["layers"]))) + " |",
              "|---|" + "---|" * len(orig["layers"])]
    for label, r in results.items():
        cells = [f"{l['ln_inf']:.0f} / {l['ffn_inf']:.0f} / {l['ln_kurt']:.0f} [{','.join(map(str, l['dims']))}]"
                 for l in r["layers"]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", f"## Where the LayerNorm-input outliers sit (seed {seeds[0]}): max |x| at [CLS] / [SEP] / all other tokens", "",
              "| model | " + " | ".join(f"layer {i}" for i in range(len(orig["layers"]))) + " |",
              "|---|" + "---|" * len(orig["layers"])]
    for label, r in results.items():
        lines.append(f"| {label} | " + " | ".join(f"{t['cls']:.0f} / {t['sep']:.0f} / {t['other']:.0f}"
                                                  for t in r["tokens"]) + " |")
    lines += ["", f"## Is [CLS] a constant sink? (seed {seeds[0]})", "",
              "Mean cosine of each model's embeddings to the same model's with the keys and values of [CLS] in every "
              "layer replaced by their mean over the calibration paragraphs: 1.0 means no other token reads anything "
              "text-dependent from [CLS], only a fixed no-op key and value.", "",
              "| model | cosine, [CLS] keys and values constant |", "|---|---|"]
    lines += [f"| {label} | {r['cls_constant_cos']:.5f} |" for label, r in results.items()]
    gated = results.get(label_of["gated"])
    if gated and gated["gates"]:
        lines += ["", f"## What the gates learned (seed {seeds[0]}; conversion opens every gate to pi = {args.pi})", "",
                  "Mean gate opening over valid tokens per head (h0..h11), and at the [CLS] token; "
                  "sink = attention mass on [CLS] of that head after fine-tuning.", "",
                  "| layer | mean gate per head | gate at [CLS] per head | sink per head |", "|---|---|---|---|"]
        heads = len(gated["gates"][0]["mean"])
        for g in gated["gates"]:
            sink = gated["sink_heads"][g["layer"] * heads:(g["layer"] + 1) * heads]
            lines.append(f"| {g['layer']} | {' '.join(f'{v:.2f}' for v in g['mean'])} | "
                         f"{' '.join(f'{v:.2f}' for v in g['first_token'])} | {' '.join(f'{v:.2f}' for v in sink)} |")
        means = torch.tensor([v for g in gated["gates"] for v in g["mean"]])
        sinks = torch.tensor(gated["sink_heads"])
        if means.std() > 0 and sinks.std() > 0:
            corr = torch.corrcoef(torch.stack([means, sinks]))[0, 1].item()
            lines.append(f"\nPearson correlation over the {len(means)} heads between mean gate opening and sink rate: "
                         f"{corr:+.2f}. Gates below 0.25: {(means < 0.25).sum().item()}; above 0.75: "
                         f"{(means > 0.75).sum().item()}.")

    # goals, computed from the numbers above
    lines += ["", "## Goals (computed from the summary rows)", ""]
    ctrl = grouped.get(label_of["none"])
    for label in (label_of["gated"], label_of["clipped"], label_of["none"]):
        rs = grouped.get(label)
        if not rs:
            continue
        ln = statistics.mean(r["ln_inf"] for r in rs)
        ffn = statistics.mean(r["ffn_inf"] for r in rs)
        fp = statistics.mean(r["fp_cos"] for r in rs)
        q = statistics.mean(r["q_cos"] for r in rs)
        ok = lambda b: "met" if b else "NOT met"  # noqa: E731
        items = [f"LN-input inf-norm {orig['ln_inf'] / ln:.1f}x lower, FFN-out {orig['ffn_inf'] / ffn:.1f}x lower "
                 f"(goal >= 4x: {ok(orig['ln_inf'] / ln >= 4 and orig['ffn_inf'] / ffn >= 4)})",
                 f"FP32 cos {fp:.4f} (goal >= 0.98: {ok(fp >= 0.98)})",
                 f"W8A8 cos {q:.4f} (goal >= 0.99: {ok(q >= 0.99)}; original {orig['q_cos']:.4f})"]
        if ctrl and rs is not ctrl:
            cq = statistics.mean(r["q_cos"] for r in ctrl)
            items.append(f"better than the control's {cq:.4f}: {ok(q > cq)}")
        lines.append(f"- **{label}**: " + "; ".join(items) + ".")
    png = args.output.with_suffix(".png")
    plot(results, png)
    lines += ["", f"![per-layer outliers]({png.name})", "", f"Took {time.time() - start:.0f} s.", ""]
    write_atomic(args.output, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
