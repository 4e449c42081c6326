"""softq demo: quantize the reference models to INT8 (softmax included) and evaluate them.

The first run trains the two reference models (a character LM on Python's own
documentation, a ViT on scikit-learn's digits; a few minutes each on 2 cores) and
caches them in $SOFTQ_CACHE (default ~/.cache/softq); later runs reuse them.

    python examples/demo.py            # what `make demo` runs
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import softq
from softq.quant.tasks import reference_task


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def quantize_and_compare(name: str, eval_limit: int | None) -> tuple[object, torch.nn.Module]:
    task = reference_task(name, eval_limit=eval_limit)
    config = softq.QuantConfig()  # W8A8, 8-bit softmax codes relative to the row max (see docs/results/quant.md)
    start = time.time()
    qmodel = softq.quantize(task.model, task.calib, config)
    fp, q = task.evaluate(), task.evaluate(qmodel)
    unit = "%" if task.higher_is_better else ""
    print(f"{task.name}: float {task.metric_name} {fp:.3f}{unit}  ->  {config.describe()} {q:.3f}{unit}"
          f"  (quantized in {time.time() - start:.0f}s)")
    return task, qmodel


def export_and_run(task, qmodel: torch.nn.Module, out_dir: Path) -> None:
    """Export with softmax="int" (standard ONNX ops, integer arithmetic only) and compare with torch."""
    from softq import workloads
    from softq.export import to_onnx
    from softq.export.onnx_utils import session

    out_dir.mkdir(parents=True, exist_ok=True)
    path = to_onnx(qmodel, str(out_dir / "vit_int8.onnx"), task.calib[0], softmax="int", overwrite=True)
    sess = session(path)
    preds = torch.cat([torch.from_numpy(sess.run(["logits"], {"pixel_values": b["pixel_values"].numpy()})[0]).argmax(-1)
                       for b in task.eval_inputs])
    labels = workloads.digits_data("heldout", qmodel.config.image_size)[1]
    onnx_top1 = 100.0 * (preds == labels).float().mean().item()
    size_mb = Path(path).stat().st_size / 1e6
    print(f"{path} ({size_mb:.2f} MB): onnxruntime top-1 {onnx_top1:.3f}%  vs  torch INT8 {task.evaluate(qmodel):.3f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval-limit", type=int, default=12, help="held-out LM windows to evaluate (default 12)")
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the exported ONNX file")
    args = parser.parse_args()
    torch.manual_seed(0)

    step("1. INT8 language model: W8A8, softmax input and output included (8-bit codes relative to the row max)")
    quantize_and_compare("lm", args.eval_limit)

    step("2. INT8 vision transformer (digits)")
    vit_task, vit_int8 = quantize_and_compare("vit", None)

    step("3. ONNX with an integer-only softmax, run in onnxruntime (CPU)")
    export_and_run(vit_task, vit_int8, args.out)

    step("4. Encrypted inference (CrypTen, 2 party processes on loopback): reference ViT")
    from softq.mpc.demo import encrypted_demo

    encrypted_demo(samples=16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
