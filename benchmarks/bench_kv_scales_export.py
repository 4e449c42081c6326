"""Benchmark: decoder files with an int8 KV cache at per-tensor, per-head and per-channel K/V scales.

Writes docs/results/kv_scales_export.md (atomically) with the command that produced it.

    python benchmarks/bench_kv_scales_export.py             # 8 held-out windows, 200 timed decode steps per file
    python benchmarks/bench_kv_scales_export.py --quick     # 2 windows, 20 steps: a smoke run

The reference Llama-architecture LM (``workloads.reference_lm(family="llama")``, 4 query / 2 key-value heads)
quantized with ``QuantConfig(kv_scales=...)`` (everything else the defaults: 8-bit row softmax, int8 cache), each
model exported with ``to_onnx(qmodel, path, example, kv_cache=True)``.  Measured in this one run, per scale:

* perplexity of the file (each held-out window as one prefill from an empty cache, onnxruntime) beside the torch
  model's on the same windows, and the largest logit difference between the two;
* 64 greedy tokens of the file (:func:`softq.export.generate.generate`) after a 64-token held-out prompt against
  the torch model's ``generate()``, and onnxruntime-genai's tokens from the same file;
* decode time per token after a 512-token prompt at one thread, the three files interleaved call by call
  (medians, and each file's median over the per-tensor file's).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import decode_latency, genai_tokens, greedy_tokens  # noqa: E402
from benchutil import command_line, write_atomic  # noqa: E402

import softq  # noqa: E402
from softq.export import onnx_utils as U  # noqa: E402
from softq.export.cache_layout import CacheLayout  # noqa: E402
from softq.export.model_export import to_onnx  # noqa: E402
from workloads.tasks import reference_task  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCALES = ("tensor", "head", "channel")
PROMPT = 512  # the decode-latency prompt (issue 50's)


def losses(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Next-token cross-entropy (nats) of every position but the last."""
    x = logits[:, :-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    log_z = np.log(np.exp(x).sum(-1))
    return log_z - np.take_along_axis(x, ids[:, 1:, None], -1)[..., 0]


def file_perplexity(qmodel: torch.nn.Module, path: Path, windows: list[torch.Tensor]) -> tuple[float, float, float]:
    """(file perplexity, torch perplexity, largest |logit difference| / largest |logit|) on ``windows``, each one
    prefill of the file from an empty cache."""
    session = U.session(str(path), threads=1)
    layout = CacheLayout.of_inputs(session.get_inputs())
    got, want, diff = [], [], 0.0
    for ids in windows:
        ids_np = ids.numpy().astype(np.int64)
        logits = session.run(["logits"], {"input_ids": ids_np, "attention_mask": np.ones_like(ids_np),
                                          "position_ids": np.arange(ids_np.shape[1])[None].repeat(len(ids_np), 0),
                                          **layout.empty(len(ids_np))})[0]
        with torch.no_grad():
            ref = qmodel(input_ids=ids, use_cache=False).logits.numpy()
        got.append(losses(logits, ids_np))
        want.append(losses(ref, ids_np))
        diff = max(diff, float(np.abs(logits - ref).max() / np.abs(ref).max()))
    return (math.exp(float(np.concatenate(got, None).mean())), math.exp(float(np.concatenate(want, None).mean())),
            diff)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 windows, 20 timed steps (smoke run)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "kv_scales_export.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    start = time.time()
    load = [os.getloadavg()[0]]
    windows_n, rounds = (2, 20) if args.quick else (8, 200)
    task = reference_task("lm", family="llama", steps=300, eval_limit=windows_n, calib_size=16)
    windows = [batch["input_ids"][i:i + 1] for batch in task.eval_inputs for i in range(len(batch["input_ids"]))]
    windows = windows[:windows_n]
    prompt = windows[0][:, :64]
    rows, files = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for scales in SCALES:
            t0 = time.time()
            qmodel = softq.quantize(task.model, task.calib, softq.QuantConfig(kv_scales=scales))
            folder = Path(tmp) / scales
            folder.mkdir()
            path = folder / "model.onnx"
            to_onnx(qmodel, str(path), windows[0][:, :32], kv_cache=True)
            files[scales] = path
            ppl, torch_ppl, diff = file_perplexity(qmodel, path, windows)
            n, differ, _, _ = greedy_tokens(qmodel, path, prompt)
            genai = genai_tokens(qmodel, path, prompt)
            rows[scales] = dict(ppl=ppl, torch_ppl=torch_ppl, diff=diff, greedy=(n, differ), genai=genai)
            print(f"{scales}: file perplexity {ppl:.4f}, torch {torch_ppl:.4f}, logit diff {diff:.1e}, greedy "
                  f"{n} first difference {differ}, genai {genai} ({time.time() - t0:.0f}s)", flush=True)
        prompt_ids = torch.cat(windows, 1)[:, :PROMPT].numpy().astype(np.int64)
        times = decode_latency({s: files[s] for s in SCALES}, prompt_ids, rounds)
    medians = {s: float(np.median(times[s])) for s in SCALES}
    print({s: f"{m * 1e3:.3f} ms" for s, m in medians.items()}, flush=True)
    load.append(os.getloadavg()[0])
    write_atomic(args.output, markdown(task, rows, medians, rounds, len(windows), command_line(),
                                       time.time() - start, load))
    print(f"wrote {args.output}")
    return 0


def _tokens(result: tuple[int, int | None] | str) -> str:
    if isinstance(result, str):
        return result
    n, differ = result[0], result[1]
    return f"{n}/{n}" if differ is None else f"first {differ} of {n}"


def markdown(task, rows: dict, medians: dict, rounds: int, windows: int, command: str, seconds: float,  # noqa: ANN001
             load: list[float]) -> str:
    import onnxruntime

    cfg = task.model.config
    lines = [
        "# Int8 KV cache files at per-tensor, per-head and per-channel K/V scales (generated)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
        f"one thread; took {seconds / 60:.1f} min; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
        "(a shared machine: read the interleaved medians' ratios).",
        "",
        f"Model: `workloads.reference_lm(family=\"llama\")`, {cfg.num_hidden_layers} layers, "
        f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} key-value heads of size "
        f"{cfg.hidden_size // cfg.num_attention_heads}, quantized with `QuantConfig(kv_scales=...)` (8-bit row "
        "softmax, int8 cache) on 16 training windows; each exported with `to_onnx(qmodel, path, example, "
        "kv_cache=True)` (int8 past/present codes; per-head K: the scores one MatMulInteger per K/V head with the "
        "scales and zero points outside; per-channel K: a float MatMul per K/V head of the queries times the scales "
        "and the K codes; V per head or channel: the row core's integer GEMM, zero points and scales outside).",
        "",
        f"Perplexity: {windows} held-out windows of 1024 characters, each one prefill of the file from an empty "
        "cache (onnxruntime), beside the quantized torch model on the same windows; 'logit diff': the largest "
        "|file - torch| over the largest |torch logit|. Greedy: 64 new tokens after a 64-token held-out prompt, "
        "the file in onnxruntime (`softq.export.generate.generate`) against torch's `generate()`, and "
        "onnxruntime-genai on the same file against softq's loop.",
        "",
        "| kv_scales | file perplexity | torch perplexity | logit diff | greedy tokens = torch | onnxruntime-genai = "
        f"file | decode ms/token ({PROMPT}-token prompt) | vs per-tensor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s, r in rows.items():
        lines.append(f"| {s} | {r['ppl']:.4f} | {r['torch_ppl']:.4f} | {r['diff']:.1e} | {_tokens(r['greedy'])} | "
                     f"{_tokens(r['genai'])} | {medians[s] * 1e3:.3f} | {medians[s] / medians['tensor']:.2f}x |")
    lines += ["", f"Decode: one new token after the prompt per call, {rounds} calls per file, the files taking turns "
              "(order rotated each round), medians.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
