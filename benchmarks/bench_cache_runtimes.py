"""Benchmark: a decoder file with an int8 KV cache in onnxruntime, tract and OpenVINO.

Writes docs/results/cache_runtimes.md (atomically) with the command that produced it.

    python benchmarks/bench_cache_runtimes.py            # 200 timed decode steps per file and runtime
    python benchmarks/bench_cache_runtimes.py --quick    # 20 steps: a smoke run

The reference Llama-architecture LM (``workloads.reference_lm(family="llama")``) quantized with the default
``QuantConfig()`` (8-bit row softmax, int8 cache) and exported with ``to_onnx(qmodel, path, example,
kv_cache=True)``, beside its FP32 file with a float cache (``to_onnx_float(..., kv_cache=True)``).  Each file runs
through :func:`softq.export.runtimes.runner` in every installed runtime at one thread.  Measured in this one run:

* 64 greedy tokens after a 64-token held-out prompt (:func:`softq.export.generate.generate` with ``runtime=``)
  against onnxruntime's from the same file, and the largest difference of the prefill's logits and cache from
  onnxruntime's;
* the INT8 file's cache codes that differ from onnxruntime's after a 512-token prompt;
* decode time per token after a 512-token prompt, every (file, runtime) pair interleaved call by call (medians),
  and the INT8 file's median over the FP32 file's in the same runtime.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import command_line, write_atomic  # noqa: E402

import softq  # noqa: E402
from softq.export import runtimes  # noqa: E402
from softq.export.cache_layout import CacheLayout  # noqa: E402
from softq.export.generate import generate  # noqa: E402
from softq.export.model_export import to_onnx, to_onnx_float  # noqa: E402
from workloads.tasks import reference_task  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = 512  # the decode-latency prompt (issue 50's)
NEW_TOKENS = 64


def prefill(path: Path, runtime: str, ids: np.ndarray) -> list[np.ndarray]:
    """The file's outputs for the prompt from an empty cache (logits, then the presents)."""
    layout = CacheLayout.of_file(str(path))
    return runtimes.runner(path, runtime)({"input_ids": ids, "attention_mask": np.ones_like(ids),
                                           "position_ids": np.arange(ids.shape[1])[None], **layout.empty(1)})


def codes_differing(path: Path, runtime: str, ids: np.ndarray) -> tuple[int, int]:
    """(cache codes differing from onnxruntime's, of how many) after the prompt ``ids``."""
    ours, theirs = prefill(path, "onnxruntime", ids), prefill(path, runtime, ids)
    return sum(int((a != b).sum()) for a, b in zip(theirs[1:], ours[1:])), sum(b.size for b in ours[1:])


def decode_latency(runs: dict[tuple[str, str], Path], prompt: np.ndarray, rounds: int) -> dict:
    """Seconds of one decode step after ``prompt`` per (file, runtime), ``rounds`` interleaved calls each."""
    steps, feeds = {}, {}
    for (label, runtime), path in runs.items():
        layout = CacheLayout.of_file(str(path))
        run = runtimes.runner(path, runtime)
        first = run({"input_ids": prompt, "attention_mask": np.ones_like(prompt),
                     "position_ids": np.arange(prompt.shape[1])[None], **layout.empty(1)})
        token = first[0][:, -1].argmax(-1)[:, None].astype(np.int64)
        steps[label, runtime] = run
        feeds[label, runtime] = {"input_ids": token, "attention_mask": np.ones((1, prompt.shape[1] + 1), np.int64),
                                 "position_ids": np.array([[prompt.shape[1]]], np.int64), **layout.next_past(first)}
        for _ in range(3):  # warm-up (tract builds its decode runner here)
            run(feeds[label, runtime])
    times: dict = {key: [] for key in runs}
    keys = list(runs)
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            start = time.perf_counter()
            steps[key](feeds[key])
            times[key].append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 timed steps (smoke run)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "cache_runtimes.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    start, load = time.time(), [os.getloadavg()[0]]
    rounds = 20 if args.quick else 200
    names = [r for r in runtimes.RUNTIMES if runtimes.available(r)]
    task = reference_task("lm", family="llama", steps=300, eval_limit=8, calib_size=16)
    windows = [batch["input_ids"][i:i + 1] for batch in task.eval_inputs for i in range(len(batch["input_ids"]))]
    prompt = windows[0][:, :64].numpy().astype(np.int64)
    qmodel = softq.quantize(task.model, task.calib, softq.QuantConfig())
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = {"softq INT8": Path(tmp) / "int8.onnx", "FP32": Path(tmp) / "fp32.onnx"}
        to_onnx(qmodel, str(files["softq INT8"]), windows[0][:, :32], kv_cache=True)
        to_onnx_float(task.model, str(files["FP32"]), windows[0][:, :32], kv_cache=True)
        for label, path in files.items():
            want = generate(path, prompt, NEW_TOKENS)
            ref = prefill(path, "onnxruntime", prompt)
            for runtime in names:
                got = generate(path, prompt, NEW_TOKENS, runtime=runtime)
                same = int((got[0, prompt.shape[1]:] == want[0, prompt.shape[1]:]).sum())
                diff = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in
                           zip(prefill(path, runtime, prompt), ref))
                rows[label, runtime] = dict(tokens=same, diff=diff)
                print(f"{label} in {runtime}: {same}/{NEW_TOKENS} greedy tokens = onnxruntime's, prefill outputs "
                      f"within {diff:.1e}", flush=True)
        long_prompt = torch.cat(windows, 1)[:, :PROMPT].numpy().astype(np.int64)
        for runtime in names:
            rows["softq INT8", runtime]["codes"] = codes_differing(files["softq INT8"], runtime, long_prompt)
            print(runtime, "cache codes differing from onnxruntime's:", rows["softq INT8", runtime]["codes"],
                  flush=True)
        times = decode_latency({(label, r): path for label, path in files.items() for r in names}, long_prompt,
                               rounds)
    medians = {key: float(np.median(t)) for key, t in times.items()}
    print({f"{k[0]} {k[1]}": f"{m * 1e3:.3f} ms" for k, m in medians.items()}, flush=True)
    load.append(os.getloadavg()[0])
    write_atomic(args.output, markdown(task, names, rows, medians, rounds, command_line(), time.time() - start, load))
    print(f"wrote {args.output}")
    return 0


def _versions(names: list[str]) -> str:
    from importlib.metadata import version

    return ", ".join(f"{n} {version(n)}" for n in names)


def markdown(task, names: list[str], rows: dict, medians: dict, rounds: int, command: str,  # noqa: ANN001
             seconds: float, load: list[float]) -> str:
    cfg = task.model.config
    lines = [
        "# A decoder file with an int8 KV cache in onnxruntime, tract and OpenVINO (generated)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, {_versions(names)}, one thread; took "
        f"{seconds / 60:.1f} min; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (a shared "
        "machine: read the interleaved medians' ratios).",
        "",
        f"Model: `workloads.reference_lm(family=\"llama\")`, {cfg.num_hidden_layers} layers, width "
        f"{cfg.hidden_size}, {cfg.num_attention_heads} query / {cfg.num_key_value_heads} key-value heads, quantized "
        "with `QuantConfig()` (8-bit row softmax, int8 cache) on 16 training windows and exported with "
        "`to_onnx(qmodel, path, example, kv_cache=True)`; FP32: `to_onnx_float(model, path, example, "
        "kv_cache=True)` (float cache). Each file runs through `softq.export.runtimes.runner(path, runtime)` "
        "(tract: one runner for the prefill, one for every decode step, the cache's axes symbolic; OpenVINO: "
        "`INFERENCE_PRECISION_HINT=f32`).",
        "",
        f"Greedy: {NEW_TOKENS} new tokens after a 64-token held-out prompt, `softq.export.generate.generate(path, "
        "prompt, runtime=...)` against onnxruntime's tokens from the same file; 'prefill diff': the largest "
        "|runtime - onnxruntime| over the prefill's logits and every present tensor (int8 codes for the INT8 file).",
        "",
        f"| file | runtime | greedy tokens = onnxruntime | prefill diff | cache codes != onnxruntime ({PROMPT} "
        f"tokens) | decode ms/token ({PROMPT}-token prompt) | INT8 / FP32 in this runtime |",
        "|---|---|---|---|---|---|---|",
    ]
    for (label, runtime), r in rows.items():
        ratio = (f"{medians['softq INT8', runtime] / medians['FP32', runtime]:.2f}x" if label == "softq INT8"
                 else "")
        codes = f"{r['codes'][0]} of {r['codes'][1]}" if "codes" in r else ""
        lines.append(f"| {label} | {runtime} | {r['tokens']}/{NEW_TOKENS} | {r['diff']:.1e} | {codes} | "
                     f"{medians[label, runtime] * 1e3:.3f} | {ratio} |")
    lines += ["", f"Decode: one new token after the prompt per call, {rounds} calls per (file, runtime), all pairs "
              "taking turns (order rotated each round), medians.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
