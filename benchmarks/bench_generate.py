"""Benchmark: generation from decoder ONNX files with a KV cache (``to_onnx(..., kv_cache=True)``).

Writes docs/results/generate.md (atomically) with the command that produced it.

    python benchmarks/bench_generate.py             # the reference Llama LM and a compute-bound Llama shape
    python benchmarks/bench_generate.py --quick     # fewer timed steps: a smoke run

Two parts, measured in this one run:

* Greedy tokens: the reference Llama-architecture LM (``workloads.reference_lm(family="llama")``) quantized with
  the default ``QuantConfig()``, its cached INT8 file generating 64 greedy tokens in onnxruntime
  (:func:`softq.export.generate.generate`) after a held-out prompt, against the quantized torch model's
  ``generate()``.
* Decode latency per token at one thread after a 512-token prompt, on the reference LM and on a compute-bound
  Llama shape from a config with random weights (GQA; no perplexity there): softq's INT8 file with its int8 KV
  cache, the same with ``kv_cache="float"`` (a float cache re-quantized at each step), the FP32
  file with cache from the same exporter (``to_onnx_float(..., kv_cache=True)``) and onnxruntime's
  ``quantize_dynamic`` (per-channel QInt8 weights) of that FP32 file.  One decode step (one new token, a past of
  512) is timed per call; the files take turns call by call (the order rotated each round), and the table
  gives each file's median and the ratios of the medians.  Where optimum-onnx's environment exists (``make
  peers``, ``--onnx-venv``), optimum's FP32 export of the compute-bound Llama (written there in a subprocess) and
  its ``quantize_dynamic`` join the same interleaved run as peer rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import command_line, write_atomic  # noqa: E402

import softq  # noqa: E402
from softq.export import onnx_utils as U  # noqa: E402
from softq.export.cache_layout import CacheLayout  # noqa: E402
from softq.export.generate import generate  # noqa: E402
from softq.export.model_export import to_onnx, to_onnx_float  # noqa: E402
from workloads.tasks import reference_task  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT, NEW_TOKENS = 512, 64  # the latency prompt and greedy-token count
TARGET_FP32, TARGET_DYNAMIC = 0.6, 1.0  # softq's decode latency at most 0.6x FP32's and at most quantize_dynamic's
# a Llama shape where the GEMMs, not the per-node overhead, take the time: 6 layers of width 768, GQA 12/4 heads
COMPUTE_SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
                     num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024)


def compute_bound_model() -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """The compute-bound Llama (seeded random weights) and calibration batches of random tokens."""
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**COMPUTE_SHAPE)).eval()
    g = torch.Generator().manual_seed(1)
    calib = [{"input_ids": torch.randint(0, COMPUTE_SHAPE["vocab_size"], (2, 128), generator=g)} for _ in range(4)]
    return model, calib


def export_files(name: str, model: torch.nn.Module, qmodel: torch.nn.Module, example: torch.Tensor,
                 folder: Path) -> dict[str, Path]:
    """softq's INT8, the FP32 and quantize_dynamic's cached files of one model."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    files = {"softq INT8": folder / f"{name}-softq.onnx", "softq INT8, float cache": folder / f"{name}-softqf.onnx",
             "FP32": folder / f"{name}-fp32.onnx", "quantize_dynamic": folder / f"{name}-dynamic.onnx"}
    start = time.time()
    to_onnx(qmodel, str(files["softq INT8"]), example, kv_cache=True)
    to_onnx(qmodel, str(files["softq INT8, float cache"]), example, kv_cache="float")
    to_onnx_float(model, str(files["FP32"]), example, kv_cache=True)
    quantize_dynamic(str(files["FP32"]), str(files["quantize_dynamic"]), per_channel=True, weight_type=QuantType.QInt8)
    print(f"{name}: exported in {time.time() - start:.0f}s", flush=True)
    return files


def cache_bytes_per_token(path: Path) -> int:
    """Bytes the file's cache grows by per token (every layer's key and value, at the element type it declares)."""
    layout = CacheLayout.of_inputs(U.session(str(path), threads=1).get_inputs())
    return layout.layers * layout.kv_heads * (layout.key_dim + layout.value_dim) * np.dtype(layout.dtype).itemsize


def decode_latency(files: dict[str, Path], prompt: np.ndarray, rounds: int) -> dict[str, list[float]]:
    """Seconds of one decode step after ``prompt`` per file, ``rounds`` interleaved calls each."""
    sessions, feeds = {}, {}
    for label, path in files.items():
        session = U.session(str(path), threads=1)
        layout = CacheLayout.of_inputs(session.get_inputs())
        mask = np.ones_like(prompt)
        first = session.run(layout.output_names(), {"input_ids": prompt, "attention_mask": mask,
                                                     "position_ids": np.arange(prompt.shape[1])[None],
                                                     **layout.empty(1)})
        token = first[0][:, -1].argmax(-1)[:, None].astype(np.int64)
        sessions[label] = session
        feeds[label] = {"input_ids": token, "attention_mask": np.ones((1, prompt.shape[1] + 1), np.int64),
                        "position_ids": np.array([[prompt.shape[1]]], np.int64), **layout.next_past(first)}
        for _ in range(3):  # warm-up
            session.run(None, feeds[label])
    times: dict[str, list[float]] = {label: [] for label in files}
    labels = list(files)
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            start = time.perf_counter()
            sessions[label].run(None, feeds[label])
            times[label].append(time.perf_counter() - start)
    return times


def add_optimum(model: torch.nn.Module, files: dict[str, Path], venv: Path, folder: Path) -> str:
    """optimum's FP32 file with cache (written by the peers' environment in a subprocess) and its quantize_dynamic,
    added to ``files``; what was added or why not."""
    python = venv / "bin" / "python"
    if not python.exists():
        return f"no optimum rows: {python} not found (make peers)"
    from bench_llm_peers import onnx_pair

    model.save_pretrained(folder / "compute-hf")
    pair, error, versions = onnx_pair(str(python), folder / "compute-hf", folder / "compute-optimum")
    if error:
        return f"no optimum rows: its export failed ({error})"
    files["optimum FP32"], files["optimum quantize_dynamic"] = pair["fp32"], pair["dynamic"]
    return ("optimum rows: `optimum.exporters.onnx.main_export(task=\"text-generation-with-past\")` of the same "
            "model (saved with `save_pretrained`), run in optimum-onnx's environment, and its "
            "`quantize_dynamic(per_channel=True, weight_type=QInt8)`; "
            + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".")


def greedy_tokens(qmodel: torch.nn.Module, path: Path, prompt: torch.Tensor) -> tuple[int, int | None, float, float]:
    """(tokens compared, first differing new token or None, ONNX seconds, torch seconds) for NEW_TOKENS greedy
    tokens."""
    start = time.time()
    with torch.no_grad():
        ref = qmodel.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0)[0, prompt.shape[1]:].numpy()
    torch_s = time.time() - start
    start = time.time()
    got = generate(str(path), prompt.numpy(), NEW_TOKENS)[0, prompt.shape[1]:]
    onnx_s = time.time() - start
    differ = np.nonzero(got != ref)[0]
    return len(ref), int(differ[0]) if len(differ) else None, onnx_s, torch_s


def genai_tokens(qmodel: torch.nn.Module, path: Path, prompt: torch.Tensor) -> tuple[int, int | None, float] | str:
    """onnxruntime-genai's greedy tokens from a copy of the same file with softq's genai_config.json, compared with
    softq's loop (an error line where it cannot run)."""
    import shutil

    try:
        import onnxruntime_genai as og
    except ImportError:
        return "onnxruntime-genai not installed"
    from softq.export.genai import write_genai_config

    folder = path.parent / "genai"
    folder.mkdir(exist_ok=True)
    shutil.copy(path, folder / "model.onnx")
    write_genai_config(folder / "model.onnx", qmodel.config)
    try:
        start = time.time()
        model = og.Model(str(folder))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=prompt.shape[1] + NEW_TOKENS, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt.numpy().astype(np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        got = np.asarray(generator.get_sequence(0), np.int64)[prompt.shape[1]:]
        seconds = time.time() - start
    except Exception as err:  # noqa: BLE001 - reported in the table
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    want = generate(str(path), prompt.numpy(), NEW_TOKENS)[0, prompt.shape[1]:]
    differ = np.nonzero(got[:len(want)] != want[:len(got)])[0]
    return len(got), int(differ[0]) if len(differ) else None, seconds


def markdown(results: dict, command: str, seconds: float) -> str:
    lines = [
        "# Generation from decoder ONNX files with a KV cache (generated)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, onnxruntime "
        f"{__import__('onnxruntime').__version__}, one thread; took {seconds / 60:.1f} min; load average "
        f"{results['load'][0]:.1f} at the start, {results['load'][1]:.1f} at the end (a machine shared with other "
        "jobs: the medians of interleaved calls and their ratios are what to read, the absolute times move with it).",
        "",
        "Files: `softq.to_onnx(qmodel, path, example, kv_cache=True)` (softq's INT8: integer linears, integer "
        "softmax cores, the int8 KV cache: past/present are the K/V codes), the same with `kv_cache=\"float\"` "
        "(softq INT8, float cache: re-quantized at each step), `to_onnx_float(model, path, example, kv_cache=True)` (FP32, the same exporter) "
        "and onnxruntime's `quantize_dynamic(per_channel=True, weight_type=QInt8)` of that FP32 file. Each takes "
        "`input_ids`, `attention_mask`, `position_ids`, `past_key_values.{i}.key/value` and outputs `logits`, "
        "`present.{i}.key/value`.",
        "",
        "## Greedy tokens: ONNX file with cache vs the quantized torch model's generate()",
        "",
        "| model | prompt tokens | new tokens | the same tokens | first differing new token | ONNX s | torch s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (prompt, n, differ, onnx_s, torch_s) in results["greedy"].items():
        lines.append(f"| {name} | {prompt} | {n} | {'yes' if differ is None else 'no'} | "
                     f"{'-' if differ is None else differ} | {onnx_s:.2f} | {torch_s:.2f} |")
    genai = results.get("genai")
    if genai is not None:
        lines += ["", "onnxruntime-genai on the same file (`softq.export.genai.write_genai_config`), greedy, against "
                  "softq's loop: " + (genai if isinstance(genai, str) else
                                      f"{genai[0]} tokens, {'the same' if genai[1] is None else f'first difference at {genai[1]}'}"
                                      f" ({genai[2]:.2f} s).")]
    lines += ["", f"## Decode latency per token after a {PROMPT}-token prompt (1 thread, medians of interleaved "
              "calls)", "",
              "| model | file | median ms / token | fastest ms | vs FP32 (medians) | vs quantize_dynamic (medians) | "
              "calls | MiB | cache bytes / token |", "|---|---|---|---|---|---|---|---|---|"]
    for name, (times, sizes, cache) in results["latency"].items():
        med = {label: float(np.median(t)) for label, t in times.items()}
        for label, value in med.items():
            lines.append(f"| {name} | {label} | {value * 1e3:.3f} | {min(times[label]) * 1e3:.3f} | "
                         f"{value / med['FP32']:.2f}x | "
                         f"{value / med['quantize_dynamic']:.2f}x | {len(times[label])} | {sizes[label]:.1f} | {cache[label]} |")
    if results.get("optimum"):
        lines += ["", results["optimum"]]
    lines += ["", f"Targets (issue 50): softq's INT8 at most {TARGET_FP32}x the FP32 file's decode latency and at "
              "most quantize_dynamic's.", ""]
    for name, text in results["models"].items():
        lines.append(f"* {name}: {text}")
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer timed calls (smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="timed calls per file (default 300; --quick 10)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "generate.md")
    parser.add_argument("--onnx-venv", type=Path, default=Path("/work/peers-venv-onnx"),
                        help="optimum-onnx's environment (make peers): its FP32 export of the compute-bound Llama and "
                             "that file's quantize_dynamic join the latency run (no such rows without it)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = args.rounds or (10 if args.quick else 300)
    start = time.time()
    results: dict = {"greedy": {}, "latency": {}, "models": {}, "load": [os.getloadavg()[0]]}
    task = reference_task("lm", family="llama", steps=300, eval_limit=2, calib_size=16)
    window = task.eval_inputs[0]["input_ids"][:1]
    qref = softq.quantize(task.model, task.calib, softq.QuantConfig())
    compute, calib = compute_bound_model()
    qcompute = softq.quantize(compute, calib, softq.QuantConfig())
    params = lambda m: sum(p.numel() for p in m.parameters()) / 1e6  # noqa: E731
    cfg = task.model.config
    results["models"]["reference Llama LM"] = (
        f"`workloads.reference_lm(family=\"llama\")`, {cfg.num_hidden_layers} layers of width {cfg.hidden_size}, "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} query/KV heads, {params(task.model):.2f} M parameters, "
        "trained 300 steps; prompts are held-out text, quantized with `QuantConfig()` on 16 training windows.")
    results["models"]["compute-bound Llama"] = (
        f"`LlamaConfig({', '.join(f'{k}={v}' for k, v in COMPUTE_SHAPE.items())})`, seeded random weights, "
        f"{params(compute):.1f} M parameters, quantized with `QuantConfig()` on 4 batches of 2 x 128 random tokens.")
    with tempfile.TemporaryDirectory() as tmp:
        ref_files = export_files("reference", task.model, qref, window[:, :32], Path(tmp))
        prompt = window[:, :64]
        n, differ, onnx_s, torch_s = greedy_tokens(qref, ref_files["softq INT8"], prompt)
        results["greedy"]["reference Llama LM"] = (prompt.shape[1], n, differ, onnx_s, torch_s)
        print(f"greedy: {n} tokens, first difference {differ}", flush=True)
        results["genai"] = genai_tokens(qref, ref_files["softq INT8"], prompt)
        print("onnxruntime-genai:", results["genai"], flush=True)
        g = torch.Generator().manual_seed(2)
        compute_files = export_files("compute", compute, qcompute,
                                     torch.randint(0, COMPUTE_SHAPE["vocab_size"], (1, 32), generator=g), Path(tmp))
        results["optimum"] = add_optimum(compute, compute_files, args.onnx_venv, Path(tmp))
        for name, files, ids in (("reference Llama LM", ref_files, window[:, :PROMPT].numpy()),
                                 ("compute-bound Llama", compute_files,
                                  torch.randint(0, COMPUTE_SHAPE["vocab_size"], (1, PROMPT), generator=g).numpy())):
            times = decode_latency(files, ids.astype(np.int64), rounds)
            sizes = {label: sum(f.stat().st_size for f in path.parent.glob(path.name + "*")) / 2**20
                     for label, path in files.items()}
            cache = {label: cache_bytes_per_token(path) for label, path in files.items()}
            results["latency"][name] = (times, sizes, cache)
            print(name, {k: f"{np.median(v) * 1e3:.3f} ms" for k, v in times.items()}, flush=True)
    results["load"].append(os.getloadavg()[0])
    write_atomic(args.output, markdown(results, command_line(), time.time() - start))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
