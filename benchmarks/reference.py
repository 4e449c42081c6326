"""The reference models' command line: softq's ``quantize``, ``report`` and ``export`` on the reference LM
('lm', a character GPT-2 on Python's documentation) and ViT ('vit', on scikit-learn's digits), and ``train``.

The models are trained here on first use and cached in $SOFTQ_CACHE (default ~/.cache/softq); nothing is
downloaded.  The commands are softq's own, with the model read from the benchmarks' workloads:

    python benchmarks/reference.py quantize lm --softmax-output row_log --softmax-bits 4
    python benchmarks/reference.py export vit -o vit.onnx
    python benchmarks/reference.py report lm --size tiny --eval-limit 2
    python benchmarks/reference.py report lm --family llama --eval-limit 2
    python benchmarks/reference.py train --model lm --softmax clipped --out runs/lm-clipped
"""

from __future__ import annotations

import argparse
import sys

from softq.cli import calib_size_kwargs, positive_int, run_handler
from softq.export import cli as export_cli
from softq.quant import cli as quant_cli
from workloads import train_cli
from workloads.models import LM_FAMILIES
from workloads.tasks import TASKS


def _reference_task(args: argparse.Namespace):  # noqa: ANN202 - a softq.evaluation.Task
    from workloads.tasks import reference_task

    if getattr(args, "calib", None) is not None or getattr(args, "eval", None) is not None:
        raise ValueError("--calib/--eval take text files for a model directory, not the reference workloads")
    if args.family is not None and args.model != "lm":
        raise ValueError(f"--family picks the LM's architecture; the {args.model} workload has none: drop --family")
    return reference_task(args.model, context=getattr(args, "context", None), eval_limit=getattr(args, "eval_limit", None),
                          seed=args.seed, size=args.size, steps=args.steps, family=args.family or "gpt2",
                          **calib_size_kwargs(args))


def _as_reference(parser: argparse.ArgumentParser) -> None:
    """Make a softq subcommand read MODEL as a reference workload name."""
    helps = {"model": "reference workload: " + " or ".join(TASKS),
             "calib_size": "calibration windows (lm) or images (vit) (default 16)",
             "eval_limit": "evaluate on at most this many held-out windows or images"}
    for action in parser._actions:  # softq's own arguments, read here as the reference workloads' (private API)
        if action.dest in helps:
            action.help = helps[action.dest]
        if action.dest == "model":
            action.choices = TASKS
    g = parser.add_argument_group("reference workloads")
    g.add_argument("--seed", type=int, default=0, help="which cached reference model (training seed)")
    g.add_argument("--steps", type=positive_int, default=None,
                   help="which cached reference model (training steps; default the reference budget)")
    g.add_argument("--size", choices=["reference", "tiny"], default="reference",
                   help="reference model size; 'tiny' trains in seconds (for trying things out)")
    g.add_argument("--family", choices=LM_FAMILIES, default=None, help="LM architecture (lm only; default gpt2)")
    if parser.prog.endswith(("quantize", "report")):
        g.add_argument("--context", type=positive_int, default=None,
                       help="LM window length (default: the model's full context)")
    parser.set_defaults(load_task=_reference_task)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/reference.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for p in {**quant_cli.register(sub), **export_cli.register(sub)}.values():
        _as_reference(p)
    train_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_handler(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
