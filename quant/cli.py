"""``softq quantize`` and ``softq report``."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    q = subparsers.add_parser(
        "quantize",
        help="W8A8-quantize a reference model (softmax included), evaluate it, optionally save it",
        description=(
            "Quantize the reference LM ('lm') or ViT ('vit') -- trained and cached in $SOFTQ_CACHE on first use -- "
            "with softq's calibration passes, print float vs quantized metric, and optionally save the quantized "
            "model directory for `softq export`."
        ),
    )
    q.add_argument("model", choices=["lm", "vit"], help="reference workload to quantize")
    _add_quant_options(q)
    q.add_argument("--output", type=Path, help="save the quantized model to this directory")
    q.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    q.add_argument("--no-eval", action="store_true", help="skip the float/quantized evaluation")
    q.set_defaults(handler=_quantize)

    r = subparsers.add_parser(
        "report",
        help="per-layer/head outlier and softmax diagnostics, sensitivity ranking, PNG plot",
        description=(
            "Print per-layer inf-norm and kurtosis, per-head attention-sink rate and quantized softmax row-sum "
            "deficit for a reference model (float and W8A8), rank which quantized part costs the most, and write "
            "a plot."
        ),
    )
    r.add_argument("model", choices=["lm", "vit"], help="reference workload to diagnose")
    _add_quant_options(r)
    r.add_argument("--plot", type=Path, default=Path("softq-report.png"), help="PNG to write (default: %(default)s)")
    r.add_argument("--no-sensitivity", action="store_true", help="skip the one-part-at-a-time sensitivity pass")
    r.set_defaults(handler=_report)


def _add_quant_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--softmax-bits", type=int, default=8, help="softmax output bits, 0 for float softmax (default 8)")
    p.add_argument("--weight-bits", type=int, default=8)
    p.add_argument("--act-bits", type=int, default=8)
    p.add_argument("--bias-correction", choices=["tensor", "head", "head_row"], default=None)
    p.add_argument("--softmax-output", choices=["row", "row_exact", "edge"], default="row",
                   help="softmax output codes: relative to the row max (row, row_exact) or uniform 2^-bits (edge)")
    p.add_argument("--smoothquant", type=float, default=None, metavar="ALPHA", help="SmoothQuant migration strength")
    p.add_argument("--observer", choices=["minmax", "percentile", "mse"], default="minmax")
    p.add_argument("--context", type=int, default=None, help="LM window length (default: the model's full context)")
    p.add_argument("--calib-size", type=int, default=16, help="calibration windows/images (default 16)")
    p.add_argument("--eval-limit", type=int, default=None, help="evaluate on at most this many windows/images")
    p.add_argument("--seed", type=int, default=0, help="which cached reference model (training seed)")
    p.add_argument("--steps", type=int, default=None,
                   help="which cached reference model (training steps; default the reference budget)")
    p.add_argument("--size", choices=["reference", "tiny"], default="reference",
                   help="reference model size; 'tiny' trains in seconds (for trying things out)")


def _config(args: argparse.Namespace):
    from softq.quant.config import QuantConfig

    return QuantConfig(
        weight_bits=args.weight_bits, act_bits=args.act_bits,
        softmax_bits=args.softmax_bits or None, bias_correction=args.bias_correction,
        softmax_output=args.softmax_output,
        smoothquant_alpha=args.smoothquant, observer=args.observer,
    )


def _task(args: argparse.Namespace):
    from softq.quant.tasks import reference_task

    return reference_task(args.model, context=args.context, calib_size=args.calib_size,
                          eval_limit=args.eval_limit, seed=args.seed, size=args.size, steps=args.steps)


def _quantize(args: argparse.Namespace) -> int:
    import softq

    config = _config(args)
    if args.output is not None and args.output.exists() and not args.overwrite:
        raise FileExistsError(f"{args.output} already exists; pass --overwrite to replace it")
    task = _task(args)
    qmodel = softq.quantize(task.model, task.calib, config)
    print(f"{task.name}: {config.describe()}")
    if not args.no_eval:
        fp, q = task.evaluate(), task.evaluate(qmodel)
        print(f"  float     {task.metric_name}: {fp:.4f}")
        print(f"  quantized {task.metric_name}: {q:.4f}  ({(q - fp) / fp * 100:+.2f}% relative)")
    if args.output is not None:
        from softq.quant.io import save

        print(f"  saved to {save(qmodel, args.output, overwrite=args.overwrite)}")
    return 0


def _report(args: argparse.Namespace) -> int:
    import softq
    from softq.calib import diagnostics

    config = _config(args)
    task = _task(args)
    qmodel = softq.quantize(task.model, task.calib, config)
    results = {"float": diagnostics.collect(task.model, task.calib), config.describe(): diagnostics.collect(qmodel, task.calib)}
    for label, diag in results.items():
        print(f"== {task.name}, {label}\n{diag.table()}\n")
    if not args.no_sensitivity:
        # Held-out loss, not the headline metric: it is continuous, so small effects still rank.
        rows = diagnostics.sensitivity(qmodel, lambda m: task.measure(m)[1])
        print("== sensitivity: held-out loss (nats) with one part quantized at a time (worst first)")
        print(diagnostics.format_sensitivity(rows, higher_is_better=False))
        bars = args.plot.with_name(f"{args.plot.stem}-sensitivity{args.plot.suffix}")
        print(f"sensitivity plot written to {diagnostics.plot_sensitivity(rows, 'held-out loss', bars)}")
    print(f"plot written to {diagnostics.plot(results, args.plot)}")
    return 0
