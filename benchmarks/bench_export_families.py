"""Benchmark: today's families exported to ONNX, each core in each runtime, against the quantized torch model at a
shape the file was not traced on.

Tiny models from configs (benchmarks/tiny_families.py), quantized on 2 padded batches of 2 x 12 tokens, exported on
2 x 12 unpadded and run on 3 x 17, two sequences padded (one to 3 tokens): past the sliding and local windows (8).
Images and audio features have a fixed size: their files run on batch 3.  Each cell: relative L2 error over the
valid tokens (and max |diff| / max |torch|) of the file's output to the quantized model called as users call it.
Writes docs/results/export_families.md (atomically) with the command that produced it.

    python benchmarks/bench_export_families.py                        # every family, core and installed runtime
    python benchmarks/bench_export_families.py --families llama,t5-encoder --configs default   # smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import command_line, cpu_description, write_atomic  # noqa: E402
from tiny_families import (FAMILIES, build, dense_gpt_oss, inputs, other_inputs, relative_error,  # noqa: E402
                           torch_output, traced_inputs)

import softq  # noqa: E402
from softq.export import runtimes  # noqa: E402
from softq.models import is_causal  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# quantization settings -> the softmax forms that export them
CONFIGS = {"default": ({}, ("fast",)), "row": ({"softmax_input": "row"}, ("int",)),
           "edge": ({"softmax_output": "edge"}, ("qdq", "int", "ort")), "float": ({"softmax_bits": None}, ("float",))}


def _tensors(feeds: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in feeds.items()}


def _cell(path: str, runtime: str, qmodel: torch.nn.Module, feeds: dict[str, np.ndarray]) -> str:
    try:
        got = runtimes.runner(path, runtime)(feeds)[0]
    except Exception as err:  # noqa: BLE001 -- a runtime that refuses or fails the file is a result
        return f"fails: {str(err).splitlines()[0][:80]}"
    ref = torch_output(qmodel, feeds)
    worst = float(np.abs(got - ref)[feeds["attention_mask"].astype(bool)].max() if "attention_mask" in feeds
                  else np.abs(got - ref).max()) / float(np.abs(ref).max())
    return f"{relative_error(got, ref, feeds):.1e} ({worst:.1e})"


def measure(family: str, config: str, rts: list[str]) -> list[list[str]]:
    """One row per softmax form of ``config``: family, quantization, form, then a cell per runtime."""
    settings, forms = CONFIGS[config]
    model = dense_gpt_oss() if family == "gpt_oss" else build(family).eval()
    calib = [_tensors(inputs(model, seed, 2, 12, padded=True)) for seed in range(2)]
    qmodel = softq.quantize(model, calib, softq.QuantConfig(**settings))
    rows = []
    for form in forms:
        if form == "ort" and is_causal(qmodel):
            continue  # refused: QLinearSoftmax has no mask input
        feeds = other_inputs(qmodel, padded=form != "ort")  # runners refuse padded batches for the ort form
        with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = str(Path(folder) / "m.onnx")
            try:
                softq.to_onnx(qmodel, path, _tensors(traced_inputs(qmodel)), softmax=form)
            except Exception as err:  # noqa: BLE001 -- a refused export is a result
                rows.append([family, config, form, f"export refused: {str(err).splitlines()[0][:120]}"]
                            + [""] * (len(rts) - 1))
                continue
            rows.append([family, config, form] + [_cell(path, rt, qmodel, feeds) if form != "ort" or rt == "onnxruntime"
                                                  else "onnxruntime only" for rt in rts])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "export_families.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    families = [f for f in args.families.split(",") if f]
    configs = [c for c in args.configs.split(",") if c]
    bad = [f for f in families if f not in FAMILIES] + [c for c in configs if c not in CONFIGS]
    if bad:
        parser.error(f"unknown family or config {', '.join(bad)}; families: {', '.join(FAMILIES)}; configs: "
                     f"{', '.join(CONFIGS)}")
    rts = runtimes.installed()
    rows = []
    for family in families:
        for config in configs:
            for row in measure(family, config, rts):
                rows.append(row)
                print(" | ".join(row), flush=True)
    lines = [
        "# Today's families in ONNX: each core, each runtime, at a shape the file was not traced on", "",
        f"`{command_line()}`", "",
        f"Machine: {cpu_description()}; torch {torch.__version__}, "
        + ", ".join(f"{rt} {version(rt)}" for rt in rts) + ".", "",
        "Tiny models from configs (benchmarks/tiny_families.py), quantized on 2 padded batches of 2 x 12 tokens "
        "(quantization: `default` is `QuantConfig()`, `row` adds `softmax_input='row'`, `edge` "
        "`softmax_output='edge'`, `float` `softmax_bits=None`), exported on 2 x 12 tokens and run on 3 x 17 with two "
        "sequences padded (one to 3 tokens), past every sliding or local window (8); images and audio features on "
        "batch 3. Cells: relative L2 error over the valid tokens of the file's output to the quantized torch model's "
        "(in brackets max |diff| / max |torch|). The `ort` form runs unpadded (its QLinearSoftmax has no mask "
        "input) and is refused for causal models. gpt-oss has its routed experts swapped for a dense feed-forward "
        "(the export refuses mixture-of-experts routing); its attention keeps its learned sink logits.", "",
        "| family | quantization | softmax form | " + " | ".join(rts) + " |",
        "|---|---|---|" + "---|" * len(rts),
        *("| " + " | ".join(r) + " |" for r in rows), "",
    ]
    write_atomic(args.output, "\n".join(lines))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
