"""Why softmax bias correction does or does not help a model: an oracle study.

Quantizes *only* the softmax output (8-bit, scale 2^-8; everything else float) of a
reference model and compares perplexity / loss for:

* ``none``: plain rounding, Q(p);
* ``oracle (head, row)``: Q(p) + beta, with beta = mean_valid(p - Q(p)) computed on the
  very input being evaluated (the best any per-(head, row) constant can do);
* ``oracle (truncated only)``: the lost mass given back exactly to the entries that
  rounded to zero (the best a "restore the truncated tail" correction can do).

If even the oracles do not close the gap, the gap is rounding *noise*, not bias, and no
offline correction can remove it.  Also prints, per layer, the mean row-sum deficit and
the relative error of the attention output P.V.  Writes docs/results/bias_correction.md.

    python examples/probe_bias_correction.py --bits 8
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from softq.attention import ProbsQuantizer, attention_points
from softq.quant.tasks import reference_task

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from bench_quant import command_line, write_atomic  # noqa: E402


class OracleProbs(ProbsQuantizer):
    """Softmax-output rounding with an optional oracle correction (analysis only, not for deployment)."""

    def __init__(self, bits: int, mode: str) -> None:
        super().__init__()
        self.steps, self.mode = 2**bits, mode

    def forward(self, p: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        q = (p * self.steps).round().clamp(0, self.steps - 1) / self.steps
        if self.mode == "none":
            return q
        valid = torch.ones_like(p) if valid is None else torch.broadcast_to(valid, p.shape)
        lost = ((p - q) * valid).sum(-1, keepdim=True)
        if self.mode == "oracle_row":
            return q + lost / valid.sum(-1, keepdim=True) * valid
        zeros = (q == 0).float() * valid
        return q + zeros * lost / zeros.sum(-1, keepdim=True).clamp_min(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["lm", "vit"], default="lm")
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--eval-limit", type=int, default=6, help="held-out windows (LM) / images (ViT)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "bias_correction.md")
    args = parser.parse_args()
    task = reference_task(args.model, eval_limit=args.eval_limit, calib_size=1)
    layers = attention_points(task.model)
    fp_metric, fp_loss = task.measure()
    rows = [("float softmax", fp_metric, fp_loss)]
    for mode, label in (("none", f"{args.bits}-bit softmax output"), ("oracle_row", "  + oracle beta (head, row)"),
                        ("oracle_trunc", "  + oracle, truncated entries only")):
        for _, points in layers:
            points.probs = OracleProbs(args.bits, mode)
        metric, loss = task.measure()
        rows.append((label, metric, loss))
        print(f"{label:<40} {task.metric_name} {metric:.4f} loss {loss:.5f}", flush=True)

    # per-layer anatomy of the rounding error on one held-out input
    probs, values = [], []
    for _, points in layers:
        points.probs = ProbsQuantizer()
        points.probs.register_forward_hook(lambda _m, i, o: probs.append((o.detach(), i[1])))
        points.v.register_forward_hook(lambda _m, _i, o: values.append(o.detach()))
    with torch.no_grad():
        task.model(**task.eval_inputs[0])
    anatomy = []
    for index, ((p, valid), v) in enumerate(zip(probs, values)):
        valid = torch.ones_like(p) if valid is None else torch.broadcast_to(valid, p.shape)
        q = (p * 2**args.bits).round().clamp(0, 2**args.bits - 1) / 2**args.bits
        ref = p @ v
        deficit = ((p - q) * valid).sum(-1).mean().item()
        truncated = (p * (q == 0) * valid).sum(-1).mean().item()
        err = ((q @ v - ref).norm() / ref.norm()).item()
        beta = ((p - q) * valid).sum(-1, keepdim=True) / valid.sum(-1, keepdim=True)
        err_beta = (((q + beta * valid) @ v - ref).norm() / ref.norm()).item()
        anatomy.append((index, deficit, truncated, err, err_beta))

    lines = ["# Softmax bias correction: oracle study (generated)", "", f"Command: `{command_line()}`  ",
             f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}. Model: reference {task.name}; "
             f"only the softmax output is quantized; {len(task.eval_inputs)} held-out batches.", "",
             f"| softmax output | {task.metric_name} | held-out loss |", "|---|---|---|"]
    lines += [f"| {label.strip()} | {metric:.4f} | {loss:.5f} |" for label, metric, loss in rows]
    lines += ["", "Per layer, first held-out input: mean row-sum deficit (mass lost by rounding), mass of entries "
              "that round to 0, and the relative error of the attention output P.V without and with the oracle "
              "per-(head, row) beta.", "",
              "| layer | row-sum deficit | truncated mass | P.V error | P.V error + oracle beta |", "|---|---|---|---|---|"]
    lines += [f"| {i} | {d:.4f} | {t:.4f} | {e:.4f} | {eb:.4f} |" for i, d, t, e, eb in anatomy]
    write_atomic(args.output, "\n".join(lines) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
