"""DeiT and ViT built from a config: how much of the W8A8 logit error is the residual stream's, per layout.

A freshly initialised DeiT starts its CLS and distillation tokens at exactly 0, and
its logits read exactly those rows; if their residual values stay far smaller than
the patch tokens', no per-tensor or per-channel 8-bit scale can serve both.
This probe reports the relative logit error ||q - fp|| / ||fp|| of W8A8 for each
residual layout (channel groups, and scales of their own for the prefix tokens:
``QuantConfig.residual_prefix``), and with the residual stream left float.

    python benchmarks/probe_deit_residual.py      # writes docs/results/deit_residual.md
"""

from __future__ import annotations

import argparse

import functools
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant import command_line, write_atomic  # noqa: E402

import softq  # noqa: E402


def errors(model: torch.nn.Module, configs: list[tuple[str, softq.QuantConfig]]) -> list[tuple[str, float]]:
    torch.manual_seed(0)
    calib = [torch.randn(8, 3, 64, 64) for _ in range(2)]
    x = torch.randn(16, 3, 64, 64)
    with torch.no_grad():
        ref = model(pixel_values=x).logits
    rows = []
    for label, config in configs:
        qmodel = softq.quantize(model, calib, config)
        with torch.no_grad():
            out = qmodel(pixel_values=x).logits
        rows.append((label, ((out - ref).norm() / ref.norm()).item()))
    return rows


def main() -> int:
    start = time.time()
    shape = dict(image_size=64, patch_size=8, hidden_size=192, num_hidden_layers=6, num_attention_heads=3,
                 intermediate_size=768, num_labels=10)
    torch.manual_seed(0)
    deit = transformers.DeiTForImageClassification(transformers.DeiTConfig(**shape)).eval()
    torch.manual_seed(0)
    vit = transformers.ViTForImageClassification(transformers.ViTConfig(**shape)).eval()
    Q = functools.partial(softq.QuantConfig, quantize_residual=True)  # the rows that quantize the residual stream
    shared = [
        ("per tensor, prefix tokens share it (residual_groups=1, residual_prefix=0)", Q(residual_groups=1, residual_prefix=0)),
        ("4 groups, shared (residual_prefix=0)", Q(residual_groups=4, residual_prefix=0)),
        ("per channel (192 groups), shared (residual_prefix=0)", Q(residual_groups=192, residual_prefix=0)),
    ]
    float_row = [("default: residual stream float (quantize_residual='auto' with the row softmax)", softq.QuantConfig())]
    sections = [
        ("DeiT", "CLS and distillation tokens start at exactly 0; the logits read those two rows",
         errors(deit, shared + [
             ("groups auto, CLS row on its own scales (residual_prefix=1)", Q(residual_prefix=1)),
             ("groups auto, CLS and distillation rows on their own scales (residual_prefix='auto' = 2)", Q())]
            + float_row)),
        ("ViT", "the CLS token starts from a truncated normal; the logits read its row",
         errors(vit, shared + [("groups auto, CLS row on its own scales (residual_prefix='auto' = 1)", Q())]
                + float_row)),
    ]
    lines = ["# DeiT and ViT from a config: W8A8 logit error by residual-stream layout", "",
             f"Command: `{command_line()}`", "",
             "64x64 images, patch 8, hidden 192, 6 layers, 3 heads, random init, calibrated on 16 random images, "
             "evaluated on 16 others; relative logit error ||q - fp|| / ||fp||.", ""]
    for name, note, rows in sections:
        lines += [f"## {name} ({note})", "", "| residual stream | relative logit error |", "|---|---|"]
        lines += [f"| {label} | {err:.3f} |" for label, err in rows]
        lines.append("")
    lines += [f"Took {time.time() - start:.0f} s.", ""]
    write_atomic(Path("docs/results/deit_residual.md"), "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # --help; no options
    sys.exit(main())
