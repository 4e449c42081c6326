"""Benchmark: softq against the LLM tools' peers on the Llama-architecture reference LM, in one run.

Writes docs/results/llm_peers.md (atomically) with the command that produced it.

    make peers                                   # the peers' two virtual environments (below), once
    python benchmarks/bench_llm_peers.py         # 3+3 calibration rounds, 5 decode rounds (17 min on 2 cores)
    python benchmarks/bench_llm_peers.py --quick # 1 calibration round, 2 decode rounds, 16 tokens: a smoke run
    python benchmarks/bench_llm_peers.py --only scale  # the memory-at-scale section alone (12 min), rewritten in
                                                       # place in the existing file with its own command

* Calibration: llm-compressor's W8A8 example recipe (SmoothQuantModifier(smoothing_strength=0.8), then
  GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])) and softq's ``quantize`` with the default
  ``QuantConfig()`` (and with ``softmax_bits=None``, the linears alone, as llm-compressor's W8A8 leaves attention
  float), on the same 16 calibration windows of 1024 tokens, each in a fresh process of its own
  virtual environment, one torch thread, in a rotating order over the rounds: the process's peak RSS after
  loading (imports, model, data) and after calibrating, and the calibration's seconds (medians over the rounds);
  held-out perplexity (45 windows of 1024) of each quantized model against the FP32 model, both computed in
  that process (first round). The same memory and time on a compute-bound Llama shape (87 M parameters,
  random weights, random-id windows), where the weights, not the libraries, dominate the process.
* Decoding: optimum's ONNX export with a KV cache (task ``text-generation-with-past``) of the FP32 model, and
  onnxruntime's ``quantize_dynamic`` (per-channel QInt8 weights) of that file, run by kv_decode.py's plain
  onnxruntime loop at one thread: a 512-token held-out prompt, then greedy tokens one at a time feeding
  past_key_values; per-token decode latency (median step of each run, median over interleaved rounds) and the
  greedy tokens against torch's FP32 ``generate``. The same for a compute-bound Llama shape from a config with
  random weights (latency only). kv_decode.greedy runs any file with past_key_values inputs.

The peers' virtual environments (``make peers``; never softq's own): llm-compressor 0.14.0.1 requires
transformers 5.15-5.17 and optimum-onnx 0.1.0 requires transformers < 4.58, so they get one each:

    python3 -m venv /work/peers-venv
    /work/peers-venv/bin/pip install torch==2.13.0
    /work/peers-venv/bin/pip install -c <(echo torch==2.13.0) llmcompressor==0.14.0.1
    python3 -m venv /work/peers-venv-onnx
    /work/peers-venv-onnx/bin/pip install torch==2.13.0
    /work/peers-venv-onnx/bin/pip install -c <(echo torch==2.13.0) optimum-onnx==0.1.0 onnxruntime==1.32.0

(resolved there: transformers 5.17.0, compressed-tensors 0.19.0, datasets 5.2.0 for llm-compressor;
transformers 4.57.6, optimum 2.1.0 for optimum-onnx). The model goes to both as a plain Hugging Face
LlamaForCausalLM directory (``save_pretrained``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_decode as K  # noqa: E402
from benchutil import command_line, cpu_description, write_atomic  # noqa: E402
from workloads.tasks import reference_task  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "llm_peers_worker.py"
STEPS = 300  # the cached Llama reference of bench_llama_lm.py
PROMPT = 512
# A compute-bound Llama shape (random weights): 6 layers of width 768, GQA 12/4 heads, SwiGLU 2048, a
# 32000-token vocabulary, untied: 87 M parameters (332 MiB in FP32), so per-token work dwarfs the per-call
# overhead and the weights, not the libraries, dominate calibration memory.
SCALE_CALIB = (8, 512)  # random-id calibration windows of the compute-bound shape (memory and time only)
BIG = dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=4,
           intermediate_size=2048, vocab_size=32000, max_position_embeddings=1024, tie_word_embeddings=False)
TOOLS = ("softq", "softq-linears", "llmcompressor")


def plain_llama(config, state: dict | None, path: Path) -> Path:  # noqa: ANN001 - a LlamaConfig
    """A plain Hugging Face LlamaForCausalLM directory (eager attention) with ``state``, or seeded random weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(type(config).from_dict(config.to_dict()))
    if state is not None:
        model.load_state_dict(state, strict=True)
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return path


def run_worker(python: str, args: list[str], log: Path, env: dict | None = None) -> str | None:
    """Run the worker; None on success, else its last stderr line (the table shows it)."""
    with open(log, "w") as err:
        proc = subprocess.run([python, str(WORKER), *args], stdout=err, stderr=subprocess.STDOUT, env=env)
    if proc.returncode == 0:
        return None
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    return (lines[-1] if lines else f"exit status {proc.returncode}")[:300]


def calibrate_all(pythons: dict[str, str], model_dir: Path, data: Path, rounds: int, work: Path,
                  evaluate: bool = True, tools: tuple[str, ...] = TOOLS) -> dict[str, dict]:
    """Each tool's calibration in a fresh process per round, in a rotating order."""
    import softq

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    where = Path(softq.__file__).parent.parent  # the softq this run imports, for its worker too
    if (where / "softq").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(where), os.environ.get("PYTHONPATH")) if p)
    results: dict[str, dict] = {t: {"runs": []} for t in tools}
    for r in range(rounds):
        for tool in tools[r % len(tools):] + tools[:r % len(tools)]:
            if "error" in results[tool]:
                continue
            out = work / f"{model_dir.name}-{tool}-{r}.json"
            args = ["calibrate", tool, str(model_dir), str(data), str(out)] + (["--eval"] if evaluate and r == 0
                                                                                 else [])
            error = run_worker(pythons[tool], args, out.with_suffix(".log"), env)
            if error:
                results[tool]["error"] = error
                print(f"{tool}: failed: {error}", flush=True)
                continue
            run = json.loads(out.read_text())
            results[tool]["runs"].append(run)
            print(f"{model_dir.name}: {tool} round {r}: {run['calib_s']:.1f} s, peak RSS {run['rss_peak_mib']:.0f} MiB"
                  + (f", perplexity {run['ppl_quant']:.4f} (FP32 {run['ppl_fp32']:.4f})" if "ppl_quant" in run else ""),
                  flush=True)
    return results


def onnx_pair(python: str, model_dir: Path, out: Path) -> tuple[dict[str, Path], str | None, dict]:
    """optimum's FP32 export with a KV cache and its quantize_dynamic file; (files, error, versions)."""
    error = run_worker(python, ["export-optimum", str(model_dir), str(out)], out.with_suffix(".log"))
    if error:
        return {}, error, {}
    from onnxruntime.quantization import QuantType, quantize_dynamic

    files = {"fp32": out / "model.onnx", "dynamic": out / "model_int8.onnx"}
    quantize_dynamic(str(files["fp32"]), str(files["dynamic"]), per_channel=True, weight_type=QuantType.QInt8)
    return files, None, json.loads((out / "versions.json").read_text())


def torch_greedy(model_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


FILE_LABELS = {"fp32": "optimum FP32 export with past_key_values",
               "dynamic": "same file, onnxruntime quantize_dynamic (per-channel QInt8)"}


def latency_lines(title: str, files: dict[str, Path], runs: dict[str, list[K.Decode]], reference: list[int] | None,
                  reference_label: str) -> list[str]:
    lines = [f"## {title}", "", f"| file | MiB | decode ms/token | prefill ms ({PROMPT} tokens) | greedy tokens "
             f"= {reference_label} |", "|---|---|---|---|---|"]
    for name, path in files.items():
        per_token, prefill = K.summary(runs[name])
        tokens = runs[name][0].tokens
        ref = reference if reference is not None else runs["fp32"][0].tokens
        same = sum(a == b for a, b in zip(tokens, ref))
        lines.append(f"| {FILE_LABELS[name]} | {path.stat().st_size / 2**20:.2f} | {per_token * 1e3:.3f} | "
                     f"{prefill * 1e3:.1f} | {same}/{len(ref)} |")
    return lines + [""]


def calibration_lines(title: str, results: dict[str, dict], rounds: int, weights_mib: float) -> list[str]:
    evaluated = any("ppl_quant" in r for res in results.values() for r in res["runs"])
    lines = [f"## {title}", "",
             ("| tool | held-out perplexity | FP32 (same process) | change " if evaluated else "| tool ")
             + "| calibration s | RSS loaded MiB | peak RSS MiB (range) | peak / FP32 weights | peak - loaded MiB | "
             "(peak - loaded) / FP32 weights |",
             "|---|" + ("---|" * 3 if evaluated else "") + "---|---|---|---|---|---|"]
    labels = {"softq": "softq `quantize`, `QuantConfig()` (W8A8, 8-bit softmax)",
              "softq-linears": "softq `quantize`, `QuantConfig(softmax_bits=None)` (the linears alone, as "
                               "llm-compressor's W8A8)",
              "llmcompressor": "llm-compressor `oneshot`, SmoothQuant 0.8 + GPTQ W8A8"}
    for tool, res in results.items():
        if "error" in res and not res["runs"]:
            lines.append(f"| {labels[tool]} | could not run: `{res['error']}` |" + " |" * (8 if evaluated else 5))
            continue
        runs, first = res["runs"], res["runs"][0]

        def med(key: str) -> float:
            return statistics.median(r[key] for r in runs)

        delta = statistics.median(r["rss_peak_mib"] - r["rss_loaded_mib"] for r in runs)
        quality = (f"{first['ppl_quant']:.4f} | {first['ppl_fp32']:.4f} | "
                   f"{(first['ppl_quant'] / first['ppl_fp32'] - 1) * 100:+.3f}% | ") if evaluated else ""
        peaks = [r["rss_peak_mib"] for r in runs]
        spread = f" ({min(peaks):.0f}-{max(peaks):.0f})" if len(peaks) > 1 else ""
        lines.append(f"| {labels[tool]} | {quality}{med('calib_s'):.1f} | {med('rss_loaded_mib'):.0f} | "
                     f"{med('rss_peak_mib'):.0f}{spread} | {med('rss_peak_mib') / weights_mib:.2f}x | {delta:.0f} | "
                     f"{delta / weights_mib:.2f}x |")
    lines.append("")
    lines.append(f"Medians over {rounds} round(s) of fresh processes" + (
        " (perplexity: the first round; both tools are deterministic)." if evaluated else "."))
    return lines + [""]


SCALE_HEADING = "## Calibration memory at scale"


def scale_title(weights_mib: float) -> str:
    return (f"{SCALE_HEADING[3:]}: the compute-bound shape below ({weights_mib:.0f} MiB of FP32 weights, random "
            f"weights), {SCALE_CALIB[0]} random-id windows of {SCALE_CALIB[1]} tokens, 1 thread")


def big_weights_mib() -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):  # parameter count only
        meta = LlamaForCausalLM(LlamaConfig(**BIG))
    return sum(p.numel() for p in meta.parameters()) * 4 / 2**20


def scale_only(args: argparse.Namespace) -> int:
    """``--only scale``: the memory-at-scale calibrations (softq and llm-compressor in the same run), their section
    of the existing output replaced, with this run's command and machine under its heading."""
    if not args.output.exists() or SCALE_HEADING not in args.output.read_text():
        print(f"--only scale replaces the section '{SCALE_HEADING}' of {args.output}, which has none: run the "
              "full benchmark first", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    start = time.time()
    from transformers import LlamaConfig

    pythons = {"softq": sys.executable, "llmcompressor": str(args.peers_venv / "bin" / "python")}
    with tempfile.TemporaryDirectory(prefix="softq-peers-") as tmp:
        work = Path(tmp)
        big_dir = plain_llama(LlamaConfig(**BIG), None, work / "big")
        big_data = work / "big-data.pt"
        torch.save({"calib": torch.randint(0, BIG["vocab_size"], SCALE_CALIB,
                                           generator=torch.Generator().manual_seed(1))}, big_data)
        results = calibrate_all(pythons, big_dir, big_data, args.scale_rounds, work, evaluate=False,
                                tools=("softq", "llmcompressor"))
    section = calibration_lines(scale_title(big_weights_mib()), results, args.scale_rounds, big_weights_mib())
    section.insert(2, f"This section: `{command_line()}` ({cpu_description()}; took {(time.time() - start) / 60:.1f} "
                      "min), softq and llm-compressor measured in the same run.")
    section.insert(3, "")
    text = args.output.read_text()
    begin = text.index(SCALE_HEADING)
    end = text.index("\n\n", text.index("Medians over", begin)) + 2  # the table's note ends the section
    text = text[:begin] + "\n".join(section) + "\n" + text[end:]
    write_atomic(args.output, text)
    print(f"wrote {args.output} ({(time.time() - start) / 60:.1f} min)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 calibration round, 2 decode rounds, 16 tokens")
    parser.add_argument("--calib-rounds", type=int, default=3, help="calibration rounds on the reference LM")
    parser.add_argument("--scale-rounds", type=int, default=3,
                        help="calibration rounds on the compute-bound shape (0: skip; about 4 min a round)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved decode rounds per file")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--peers-venv", type=Path, default=Path("/work/peers-venv"),
                        help="llm-compressor's virtual environment (make peers)")
    parser.add_argument("--onnx-venv", type=Path, default=Path("/work/peers-venv-onnx"),
                        help="optimum-onnx's virtual environment (make peers)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "llm_peers.md")
    parser.add_argument("--only", choices=("scale",), help="run one section and replace it in the existing output")
    args = parser.parse_args()
    if args.only == "scale":
        return scale_only(args)
    if args.quick:
        args.calib_rounds, args.scale_rounds, args.rounds, args.new_tokens = 1, 0, 2, 16
    torch.set_num_threads(1)
    start = time.time()
    task = reference_task("lm", family="llama", steps=STEPS)
    cfg = task.model.config
    pythons = {"softq": sys.executable, "softq-linears": sys.executable,
               "llmcompressor": str(args.peers_venv / "bin" / "python")}
    onnx_python = str(args.onnx_venv / "bin" / "python")
    with tempfile.TemporaryDirectory(prefix="softq-peers-") as tmp:
        work = Path(tmp)
        model_dir = plain_llama(cfg, task.model.state_dict(), work / "reference")
        data = work / "data.pt"
        torch.save({"calib": torch.cat([c["input_ids"] for c in task.calib]),
                    "eval": torch.cat([e["input_ids"] for e in task.eval_inputs])}, data)
        calib = calibrate_all(pythons, model_dir, data, args.calib_rounds, work)
        from transformers import LlamaConfig

        big_dir = plain_llama(LlamaConfig(**BIG), None, work / "big")
        big_data = work / "big-data.pt"
        torch.save({"calib": torch.randint(0, BIG["vocab_size"], SCALE_CALIB,
                                           generator=torch.Generator().manual_seed(1))}, big_data)
        big_calib = (calibrate_all(pythons, big_dir, big_data, args.scale_rounds, work, evaluate=False,
                                   tools=("softq", "llmcompressor"))
                     if args.scale_rounds else None)

        prompt = task.eval_inputs[0]["input_ids"][0, :PROMPT].tolist()
        ref_files, ref_error, versions = onnx_pair(onnx_python, model_dir, work / "onnx-reference")
        ref_runs = K.interleaved_decode(ref_files, prompt, args.new_tokens, args.rounds) if ref_files else {}
        ref_torch = torch_greedy(model_dir, prompt, args.new_tokens)

        big_prompt = torch.randint(0, BIG["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(0))
        big_files, big_error, _ = onnx_pair(onnx_python, big_dir, work / "onnx-big")
        big_runs = (K.interleaved_decode(big_files, big_prompt.tolist(), args.new_tokens, args.rounds)
                    if big_files else {})

        import onnxruntime

        lines = [
            "# LLM peers on the Llama reference LM: llm-compressor W8A8, optimum + onnxruntime with a KV cache "
            "(generated)", "",
            f"Command: `{command_line()}`  ",
            f"Machine: {cpu_description()}; softq's side: torch {torch.__version__}, transformers "
            f"{__import__('transformers').__version__}, onnxruntime {onnxruntime.__version__}; took "
            f"{(time.time() - start) / 60:.1f} min.", "",
            f"Model: `workloads.reference_lm(family=\"llama\", steps={STEPS})` saved as a plain Hugging Face "
            f"LlamaForCausalLM: {cfg.num_hidden_layers} layers, width {cfg.hidden_size}, "
            f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} query/key-value heads, context 1024, "
            f"{sum(p.numel() for p in task.model.parameters()) / 1e6:.2f} M parameters (tied embeddings, a "
            f"{cfg.vocab_size}-character vocabulary). Calibration: its 16 training-split windows of 1024; "
            f"evaluation: its {len(task.eval_inputs)} held-out windows of 1024.", "",
        ]
        mib = {"reference": sum(p.numel() for p in task.model.parameters()) * 4 / 2**20, "big": big_weights_mib()}
        lines += calibration_lines("Calibration on the reference LM (16 windows of 1024 tokens, 1 thread)",
                                   calib, args.calib_rounds, mib["reference"])
        if big_calib is not None:
            lines += calibration_lines(scale_title(mib["big"]), big_calib, args.scale_rounds, mib["big"])
        llmc_versions = next((r["versions"] for r in calib["llmcompressor"]["runs"]), {})
        lines += [
            "What each one quantizes: llm-compressor's W8A8 scheme = int8 per-channel symmetric weights (GPTQ) "
            "and int8 per-token *dynamic* symmetric inputs of every Linear except lm_head (here the tied "
            "embedding stays float, so the output layer is float); attention (Q, K, softmax, V) float. softq's "
            "default = int8 per-channel weights, *static* (calibrated) asymmetric int8 Linear inputs, Q, K, V, "
            "the embedding table (tied: the output layer too) in int8, and an 8-bit softmax (row codes). Fake "
            "quantization in torch on CPU for both (llm-compressor's model after `oneshot` is in compressed-"
            "tensors' frozen state: weights on the int8 grid, activations quantized in forward).",
            f"llm-compressor's environment: {json.dumps(llmc_versions)}.", "",
        ]
        if ref_error:
            lines += ["## Decoding with a KV cache", "", f"optimum's export could not run: `{ref_error}`", ""]
        else:
            lines += latency_lines("Decoding with a KV cache, reference LM (1 thread)", ref_files, ref_runs,
                                   ref_torch, "torch FP32 `generate`")
        if big_error:
            lines += [f"Compute-bound shape: optimum's export could not run: `{big_error}`", ""]
        else:
            lines += latency_lines(
                f"Decoding with a KV cache, compute-bound Llama shape (random weights, 1 thread): "
                f"{BIG['num_hidden_layers']} layers, width {BIG['hidden_size']}, {BIG['num_attention_heads']}/"
                f"{BIG['num_key_value_heads']} heads, SwiGLU {BIG['intermediate_size']}, vocabulary "
                f"{BIG['vocab_size']}", big_files, big_runs, None, "the FP32 file's")
        lines += [
            f"A {PROMPT}-token prompt (the reference LM: the start of its first held-out window; the "
            f"compute-bound shape: random ids), then {args.new_tokens} greedy tokens; 'decode ms/token' = the "
            f"median decode step of each run, median over {args.rounds} interleaved rounds (rotating order, one "
            "onnxruntime session per file, 1 intra-op thread, sequential execution, all graph optimisations). "
            "Files run by `benchmarks/kv_decode.py`, which runs any decoder file with past_key_values inputs. "
            f"optimum's environment: {json.dumps(versions)}.", "",
        ]
    write_atomic(args.output, "\n".join(lines))
    print(f"wrote {args.output} ({(time.time() - start) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
