"""Relative output error of today's families after softq.quantize, with and without SmoothQuant and a quantized
residual stream (every residual norm's input, RMSNorms included), on the tiny models of
tests/test_modern_families.py (2 layers, hidden size 32, random weights from their configs).

    python benchmarks/bench_modern_quant.py                      # writes docs/results/modern_quant.md

Error: ||q - fp|| / ||fp|| of the logits (decoders) or last hidden state (encoders) on 3 held-out batches
(2 sequences of 12 tokens, the second padded by 3; or 2 images / feature maps), calibrated on 3 other batches.
Also one Llama whose token id 1 carries a massive activation (300 in hidden dim 5, about 20000x the median
norm input), put first in every sequence as a BOS token: the case per-tensor residual scales break on, and
what residual_prefix=1 (position 0's residual rows with scales of their own) is for.
Random tiny models say whether a path works and how far it moves the output, not what a trained model loses.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import softq  # noqa: E402
from benchutil import command_line, cpu_description, write_atomic  # noqa: E402
from test_modern_families import DECODERS, ENCODERS, build, inputs, output, rel_error  # noqa: E402

CONFIGS = {
    "default W8A8": {},
    "+ SmoothQuant 0.5": {"smoothquant_alpha": 0.5},
    "residual quantized": {"quantize_residual": True},
    "residual quantized + SmoothQuant 0.5": {"quantize_residual": True, "smoothquant_alpha": 0.5},
    "residual quantized, residual_prefix=1": {"quantize_residual": True, "residual_prefix": 1},
}
MASSIVE = "llama, token-0 massive activation"


def model_for(name: str) -> torch.nn.Module:
    if name != MASSIVE:
        return build(name)
    model = build("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[1, 5] = 300.0
    return model


def batches_for(model: torch.nn.Module, name: str, seeds: range) -> list[dict[str, torch.Tensor]]:
    out = [inputs(model, s) for s in seeds]
    if name == MASSIVE:
        for batch in out:
            batch["input_ids"][:, 0] = 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "modern_quant.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    start = time.time()
    for name in [*DECODERS, *ENCODERS, MASSIVE]:
        model = model_for(name)
        calib, held = batches_for(model, name, range(3)), batches_for(model, name, range(9, 12))
        ref = torch.cat([output(model, x).flatten() for x in held])
        cells = []
        for config in CONFIGS.values():
            try:
                q = softq.quantize(model, calib, softq.QuantConfig(**config))
                cells.append(f"{rel_error(torch.cat([output(q, x).flatten() for x in held]), ref):.4f}")
            except ValueError as err:
                cells.append(f"refused: {str(err).splitlines()[0][:60]}...")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    lines = ["# Today's families: relative output error after softq.quantize", "", f"`{command_line()}`", "",
             (__doc__ or "").split("\n\n")[0].replace("\n", " "), "",
             (__doc__ or "").split("\n\n")[2].replace("\n", " "), "",
             "| family | " + " | ".join(CONFIGS) + " |", "|---|" + "---|" * len(CONFIGS), *rows, "",
             f"{cpu_description()}; torch {torch.__version__}, 1 thread, {time.time() - start:.0f} s."]
    write_atomic(args.out, "\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
