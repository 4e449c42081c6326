"""Peak memory of ``softq.quantize`` on a Llama of TinyLlama-1.1B's shape: block by block against the whole model.

A ``LlamaForCausalLM`` from TinyLlama-1.1B's config (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 K/V heads,
32000-token vocabulary; random weights, nothing downloaded), quantized with the default ``QuantConfig()`` (the
"auto" input-smoothing search and ``smoothing_into_v="auto"`` on) and ``calibration="blocks"`` or ``"model"``,
each variant in a fresh process.  Reported: the process's peak resident memory (``ru_maxrss``) over the whole run
(model built, quantized), the resident memory once the float model is built, the FP32 weights' bytes, and the
quantized model's logit distance to the float model on held-out random sequences.  A variant may run under an
address-space limit (``--limit-gb``) so that a whole-model run that would take the machine's memory fails alone.

    python benchmarks/bench_llm_memory.py                       # writes docs/results/llm_memory.md
    python benchmarks/bench_llm_memory.py --layers 2 --output /tmp/llm_memory.md   # a quick look at a smaller model

``--layers 22,4`` runs every variant on each depth (4 layers: the same widths, 0.33B parameters, where the whole-model
path fits beside the machine's other work).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_export_speed import commit  # noqa: E402
from benchutil import command_line, cpu_description, int_list, write_atomic  # noqa: E402

VARIANTS = ("blocks", "model", "model-copy")
TARGET = 1.6  # issue 50: peak resident memory at most this many times the FP32 weights' bytes


def _rss() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))


def child(variant: str, args: argparse.Namespace) -> None:
    """One variant in this process: build, quantize, judge; prints a JSON line."""
    import torch
    import transformers

    import softq

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                      num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=4,
                                      max_position_embeddings=2048, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(config).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    built = _rss()
    g = torch.Generator().manual_seed(1)
    calib = [{"input_ids": torch.randint(3, 32000, (args.batch, args.tokens), generator=g)}
             for _ in range(args.sequences // args.batch)]
    test = {"input_ids": torch.randint(3, 32000, (2, args.tokens), generator=torch.Generator().manual_seed(2))}
    with torch.no_grad():
        ref = model(**test).logits
    calibration = "model" if variant.startswith("model") else "blocks"
    start = time.perf_counter()
    qmodel = softq.quantize(model, calib, softq.QuantConfig(calibration=calibration),
                            inplace=variant != "model-copy")
    seconds = time.perf_counter() - start
    from softq.quant.weight_cache import uncached_weights

    with torch.no_grad(), uncached_weights():
        got = qmodel(**test).logits
    distance = float((1 - torch.nn.functional.cosine_similarity(got.flatten(0, 1), ref.flatten(0, 1), dim=-1)).mean())
    print(json.dumps({"variant": variant, "params": params, "weights": weights, "built": built,
                      "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "seconds": seconds,
                      "distance": distance, "alphas": getattr(qmodel, "softq_block_smoothing", None)
                      or [qmodel.softq_input_smoothing]}))


def run(variant: str, layers: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--hidden", str(args.hidden), "--intermediate",
           str(args.intermediate), "--layers", str(layers), "--sequences", str(args.sequences), "--tokens",
           str(args.tokens), "--batch", str(args.batch), "--threads", str(args.threads)]
    limit = int(args.limit_gb * 2**30) if variant != "blocks" and args.limit_gb else None

    def cap() -> None:
        if limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=cap)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return {"variant": variant, "layers": layers, "error": f"exit {proc.returncode}: {tail}", "limit": limit}
    return {**json.loads(lines[-1]), "layers": layers, "limit": limit}


def write(rows: list[dict], args: argparse.Namespace, path: Path, minutes: float) -> None:
    ok = [r for r in rows if "error" not in r]
    depths = sorted({r["layers"] for r in rows}, reverse=True)
    sizes = ", ".join(f"{r['layers']} layers: {r['params'] / 1e9:.2f}B parameters" for r in
                      {r["layers"]: r for r in ok}.values())
    lines = ["# Calibration memory of a 1.1B-parameter Llama", "",
             "Generated by `benchmarks/bench_llm_memory.py`; do not edit by hand. Command:", "",
             f"    {command_line()}", "",
             f"Machine: {cpu_description()}; {commit()}. Took {minutes:.1f} min; {args.threads} thread(s).", "",
             f"A `LlamaForCausalLM` of TinyLlama-1.1B's config with hidden size {args.hidden}, intermediate "
             f"{args.intermediate}, {' and '.join(map(str, depths))} layers ({sizes}; 32 heads, 4 K/V heads, "
             "32000-token vocabulary), random weights, quantized by `softq.quantize(model, calib, QuantConfig(calibration=...), "
             "inplace=...)` with every other option at its default (the \"auto\" input-smoothing search and "
             f"`smoothing_into_v=\"auto\"` on), on {args.sequences} random sequences of {args.tokens} tokens in "
             f"batches of {args.batch}. Each variant in a fresh process; peak: the process's peak resident memory "
             "(`ru_maxrss`) over building the float model and quantizing it; built: resident memory once the float "
             "model is built (libraries and weights). Distance: mean cosine distance of the quantized model's "
             "logits to the float model's on two other random sequences (random weights: a check that the result "
             "is a quantized model, not a quality figure). "
             f"Target (issue 50): peak at most {TARGET}x the FP32 weights.", "",
             "| layers | variant | FP32 weights GB | built GB | peak GB | peak / weights | quantize s | logit distance |",
             "|---|---|---|---|---|---|---|---|"]
    names = {"blocks": "calibration=\"blocks\", inplace=True", "model": "calibration=\"model\", inplace=True",
             "model-copy": "calibration=\"model\", inplace=False (the default before this change)"}
    for r in rows:
        if "error" in r:
            limit = f" under a {r['limit'] / 2**30:.0f} GiB address-space limit" if r.get("limit") else ""
            lines.append(f"| {r['layers']} | {names[r['variant']]} | | | failed{limit}: {r['error']} | | | |")
            continue
        lines.append(f"| {r['layers']} | {names[r['variant']]} | {r['weights'] / 1e9:.2f} | {r['built'] / 1e9:.2f} | "
                     f"{r['peak'] / 1e9:.2f} | {r['peak'] / r['weights']:.2f} | {r['seconds']:.0f} | "
                     f"{r['distance']:.2e} |")
    for blocks in (r for r in ok if r["variant"] == "blocks"):
        chosen = ", ".join("none" if a is None else f"{a:g}" for a in blocks["alphas"])
        lines += ["", f"{blocks['layers']} layers block by block: \"auto\" chose per block (then for the modules after "
                      f"the blocks): {chosen}."]
    write_atomic(path, "\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int_list, default=[22], help="comma-separated depths (default: 22)")
    p.add_argument("--sequences", type=int, default=16, help="calibration sequences (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--batch", type=int, default=2, help="sequences per calibration batch (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--limit-gb", type=float, default=14.0, help="address-space limit of the whole-model variants, "
                                                                "GiB (0: none; default: %(default)s)")
    p.add_argument("--output", type=Path, default=Path("docs/results/llm_memory.md"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.layers = args.layers[0]
        child(args.child, args)
        return
    start = time.perf_counter()
    rows = []
    variants = args.variants.split(",")
    for variant in variants:
        if variant not in VARIANTS:
            p.error(f"--variants: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    for layers in args.layers:
        for variant in variants:
            rows.append(run(variant, layers, args))
            print(json.dumps(rows[-1]), flush=True)
    write(rows, args, args.output, (time.perf_counter() - start) / 60)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
