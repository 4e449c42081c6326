"""Peak memory of ``softq.quantize`` on a Llama whose blocks accelerate offloads to disk, against the same model loaded.

A ``LlamaForCausalLM`` with random weights (default: 8 layers of width 1024, intermediate 2816, a 4096-token
vocabulary, so the blocks hold most of the weights) is saved once with ``save_pretrained``; then, each in a fresh
process, it is loaded by ``from_pretrained`` either whole (``loaded``) or with every block offloaded to disk
(``device_map`` with ``model.layers.*`` on ``"disk"`` and an ``offload_folder``: ``offload``), and quantized with
``QuantConfig()`` (block by block, "auto" searches on).  The two variants alternate, ``--repeats`` times, medians
reported.  Peak: the process's peak resident memory (``ru_maxrss``) over loading and quantizing; loaded: the resident
memory once the model is loaded.  Both results' logits are compared on held-out random sequences.

    python benchmarks/bench_llm_offload.py          # writes docs/results/llm_offload.md
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_export_speed import commit  # noqa: E402
from benchutil import command_line, cpu_description, write_atomic  # noqa: E402

VARIANTS = ("loaded", "offload")


def _rss() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))


def _config(args: argparse.Namespace):  # noqa: ANN202
    import transformers

    return transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                    num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
                                    max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)


def child(variant: str, args: argparse.Namespace) -> None:
    """One variant in this process: load, quantize; prints a JSON line (and saves the logits for the comparison)."""
    import warnings

    import torch
    import transformers

    import softq

    torch.set_num_threads(args.threads)
    kwargs = {}
    if variant == "offload":
        device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                      **{f"model.layers.{i}": "disk" for i in range(args.layers)}}
        kwargs = {"device_map": device_map, "offload_folder": tempfile.mkdtemp(prefix="softq-offload-")}
    model = transformers.LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32, **kwargs).eval()
    loaded = _rss()
    g = torch.Generator().manual_seed(1)
    calib = [{"input_ids": torch.randint(3, args.vocab, (args.batch, args.tokens), generator=g)}
             for _ in range(args.sequences // args.batch)]
    test = {"input_ids": torch.randint(3, args.vocab, (2, args.tokens), generator=torch.Generator().manual_seed(2))}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = softq.quantize(model, calib, softq.QuantConfig(), inplace=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.no_grad():
        torch.save(qmodel(**test).logits, Path(args.model) / f"logits-{variant}.pt")
    print(json.dumps({"variant": variant, "loaded": loaded, "peak": peak, "seconds": seconds}))


def run(variant: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--model", str(args.model), "--vocab", str(args.vocab),
           "--hidden", str(args.hidden), "--intermediate", str(args.intermediate), "--layers", str(args.layers),
           "--sequences", str(args.sequences), "--tokens", str(args.tokens), "--batch", str(args.batch),
           "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"{variant}: exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sequences", type=int, default=8, help="calibration sequences (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--batch", type=int, default=2, help="sequences per calibration batch (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating (default: %(default)s)")
    p.add_argument("--output", type=Path, default=Path("docs/results/llm_offload.md"))
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args)
    import torch
    import transformers

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="softq-llm-") as folder:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(_config(args))
        weights = sum(t.numel() * t.element_size() for t in model.parameters())
        block = sum(t.numel() * t.element_size() for t in model.model.layers[0].parameters())
        model.save_pretrained(folder)
        del model
        args.model = Path(folder)
        rows = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                rows[variant].append(run(variant, args))
        logits = {v: torch.load(Path(folder) / f"logits-{v}.pt") for v in VARIANTS}
    same = torch.equal(logits["loaded"], logits["offload"])
    gap = float((logits["loaded"] - logits["offload"]).abs().max())
    minutes = (time.perf_counter() - start) / 60
    med = {v: {k: statistics.median(r[k] for r in rows[v]) for k in ("loaded", "peak", "seconds")} for v in VARIANTS}
    names = {"loaded": "loaded whole (`from_pretrained(dir)`)",
             "offload": "blocks offloaded to disk (`device_map`, `offload_folder`)"}
    lines = ["# Calibration memory of a disk-offloaded Llama", "",
             "Generated by `benchmarks/bench_llm_offload.py`; do not edit by hand. Command:", "",
             f"    {command_line()}", "",
             f"Machine: {cpu_description()}; {commit()}. Took {minutes:.1f} min; {args.threads} thread(s).", "",
             f"A `LlamaForCausalLM` with random weights: {args.layers} layers of width {args.hidden} (intermediate "
             f"{args.intermediate}, 16 heads), a {args.vocab}-token vocabulary, untied; FP32 weights "
             f"{weights / 1e6:.0f} MB, one block {block / 1e6:.0f} MB. Quantized by `softq.quantize(model, calib, "
             f"QuantConfig(), inplace=True)` (block by block, the \"auto\" searches on) on {args.sequences} random "
             f"sequences of {args.tokens} tokens in batches of {args.batch}. Each run a fresh process; the variants "
             f"alternate, {args.repeats} runs each, medians. Peak: the process's peak resident memory (`ru_maxrss`) "
             "over loading and quantizing; loaded: resident memory once `from_pretrained` returns (libraries "
             "included). The offloaded model's quantized blocks are written back to the offload folder and loaded "
             "per call.", "",
             "| variant | loaded MB | peak MB | peak - loaded MB | peak / FP32 weights | quantize s |",
             "|---|---|---|---|---|---|"]
    for v in VARIANTS:
        m = med[v]
        lines.append(f"| {names[v]} | {m['loaded'] / 1e6:.0f} | {m['peak'] / 1e6:.0f} | "
                     f"{(m['peak'] - m['loaded']) / 1e6:.0f} | {m['peak'] / weights:.2f} | {m['seconds']:.0f} |")
    lines += ["", f"Offloaded peak / loaded peak: **{med['offload']['peak'] / med['loaded']['peak']:.2f}x**. "
              f"Logits of the two quantized models on two held-out random sequences: "
              f"{'bit-identical' if same else f'max difference {gap:.3g}'}."]
    write_atomic(args.output, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
