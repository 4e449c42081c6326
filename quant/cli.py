"""``softq quantize`` and ``softq report``."""

from __future__ import annotations

import argparse
from pathlib import Path

from softq.cli import calib_size_kwargs, positive_int


def register(subparsers: argparse._SubParsersAction) -> dict[str, argparse.ArgumentParser]:
    """Add ``quantize`` and ``report``; returns their parsers by name.  Each reads its model through
    ``args.load_task`` (default :func:`load_task`, a model directory), which another front end may replace."""
    q = subparsers.add_parser(
        "quantize",
        help="W8A8-quantize a Hugging Face model directory (softmax included), evaluate it, save it",
        description=(
            "Quantize MODEL with softq's calibration passes, print float vs quantized metric, and optionally save the "
            "quantized model directory for `softq export`. MODEL is a Hugging Face model directory (config.json, "
            "weights, tokenizer; sentence-transformers folders included), calibrated on --calib texts and compared "
            "with its float self by cosine similarity of the sentence embedding (or logits) on held-out texts."
        ),
    )
    q.add_argument("model", help="Hugging Face model directory")
    _add_quant_options(q)
    q.add_argument("--output", type=Path, help="save the quantized model to this directory")
    q.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    q.add_argument("--float-weights", action="store_true",
                   help="save the float weights instead of int8 codes (3-4x larger): what ranking the loaded "
                        "model's weight sensitivity or fine-tuning it further needs")
    q.add_argument("--no-eval", action="store_true", help="skip the float/quantized evaluation")
    q.set_defaults(handler=_quantize, load_task=load_task)

    r = subparsers.add_parser(
        "report",
        help="per-layer/head outlier and softmax diagnostics, sensitivity ranking, PNG plot",
        description=(
            "Print per-layer inf-norm and kurtosis (block outputs, LayerNorm inputs, FFN outputs), per-head "
            "attention-sink rate and quantized softmax row-sum deficit for a model directory "
            "(float and W8A8), rank which quantized part costs the most, and write "
            "a plot (needs matplotlib: pip install 'softq[plot]')."
        ),
    )
    r.add_argument("model", help="Hugging Face model directory")
    _add_quant_options(r)
    r.add_argument("--plot", type=Path, default=Path("softq-report.png"), help="PNG to write (default: %(default)s)")
    r.add_argument("--no-sensitivity", action="store_true", help="skip the one-part-at-a-time sensitivity pass")
    r.add_argument("--overwrite", action="store_true", help="replace existing plot files")
    r.set_defaults(handler=_report, load_task=load_task)
    return {"quantize": q, "report": r}


def _add_quant_options(p: argparse.ArgumentParser) -> None:
    from softq.quant.config import EMBEDDING_MIN_ROWS

    p.add_argument("--softmax-bits", type=int, default=8, help="softmax output bits, 0 for float softmax (default 8)")
    p.add_argument("--weight-bits", type=int, default=8)
    p.add_argument("--act-bits", type=int, default=8)
    p.add_argument("--bias-correction", choices=["tensor", "head", "head_row"], default=None)
    p.add_argument("--softmax-output", choices=["row", "row_exact", "row_log", "edge"], default="row",
                   help="softmax output codes: relative to the row max (row, row_exact; row_log: 4-bit log codes, with "
                        "--softmax-bits 4) or uniform 2^-bits (edge)")
    p.add_argument("--softmax-input", choices=["auto", "float", "row", "tensor"], default="auto",
                   help="softmax input: float scores (what 'auto' means for row and row_exact codes; export form "
                        "'fast'), codes on a grid relative to the row max (row: what the integer-only 'int' form "
                        "takes; auto for row_log) or one calibrated grid per tensor (tensor: auto for edge)")
    p.add_argument("--smoothquant", type=float, default=None, metavar="ALPHA", help="SmoothQuant migration strength")
    p.add_argument("--observer", choices=["minmax", "percentile", "mse"], default="minmax")
    p.add_argument("--percentile", type=float, default=None,
                   help="--observer percentile: the percentile of the values its range clips to (default 99.99)")
    p.add_argument("--residual-groups", type=_groups, default=None, metavar="K",
                   help="scales per residual-stream point: K groups of hidden dimensions, 1 = per tensor, "
                        "'auto' (default) = groups only where outlier dimensions are seen")
    p.add_argument("--residual-prefix", type=_groups, default=None, metavar="K",
                   help="leading positions with residual-stream scales of their own (special tokens): K, or "
                        "'auto' (default: [CLS] for BERT/RoBERTa/ViT, [CLS] + distillation for DeiT, none for LMs)")
    residual = p.add_mutually_exclusive_group()
    residual.add_argument("--residual", dest="residual", action="store_const", const=True, default="auto",
                          help="quantize the residual stream (LayerNorm inputs); default: only with --softmax-output edge")
    residual.add_argument("--no-residual", dest="residual", action="store_const", const=False,
                          help="leave the residual stream (LayerNorm inputs) float")
    p.add_argument("--input-smoothing", type=_smoothing, default="auto", metavar="ALPHA|auto|none",
                   help="per-channel input smoothing of Linear layers (SmoothQuant as an explicit Mul, post-LN "
                        "models included): an alpha in [0, 1], auto (default: none or alpha 0.6, 0.8 or 1.0, whichever "
                        "quantized model is closest to the float one on calibration batches held out from range "
                        "observation; in pre-LN models also applied only where it folds into a LayerNorm, free at "
                        "run time; smoothing every input only if 20%% closer than none and closer than those) or "
                        "none")
    p.add_argument("--smoothing-into-v", choices=["auto", "on", "off"], nargs="?", const="on", default="auto",
                   help="move the attention output's input-smoothing scale onto V (one Mul fewer per exported "
                        "layer): auto (default: where the held-out calibration batches are no further from the "
                        "float model with it), on (the bare flag) or off; see v_fold_probe.md")
    p.add_argument("--no-weight-bias-correction", dest="weight_bias_correction", action="store_false",
                   help="keep the trained biases (default: each quantized layer's bias takes off the mean output "
                        "shift of its rounded weights on the calibration data)")
    p.add_argument("--embedding-bits", type=int, default=8,
                   help="bits of the embedding tables (per row, weight only); 0 keeps them float (default 8)")
    p.add_argument("--embedding-min-rows", type=int, default=EMBEDDING_MIN_ROWS, metavar="N",
                   help=f"tables of fewer rows stay float (default {EMBEDDING_MIN_ROWS}: BERT's 2-row token-type "
                        "table stays float; 1 quantizes every table)")
    p.add_argument("--calib", type=Path, default=None, metavar="FILE",
                   help="calibration texts, one per line or JSONL with a 'text' field "
                        "(default: paragraphs of Python's documentation and short everyday English)")
    p.add_argument("--eval", type=Path, default=None, metavar="FILE",
                   help="evaluation texts, same format (default: other documentation paragraphs)")
    p.add_argument("--max-length", type=positive_int, default=None,
                   help="tokens per text (default 128, or the model's positions if fewer)")
    p.add_argument("--calib-size", type=positive_int, default=None,
                   help="calibration texts (default: the first 64 of --calib, or all 132 built-in ones)")
    p.add_argument("--eval-limit", type=positive_int, default=None, help="evaluate on at most this many texts")


def _groups(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def _smoothing(text: str) -> float | str | None:
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an alpha in [0, 1], 'auto' or 'none', got {text!r}") from None


def _config(args: argparse.Namespace):
    from softq.quant.config import QuantConfig

    extra = {} if args.residual_groups is None else {"residual_groups": args.residual_groups}
    if args.residual_prefix is not None:
        extra["residual_prefix"] = args.residual_prefix
    if args.percentile is not None:
        extra["percentile"] = args.percentile
    return QuantConfig(
        weight_bits=args.weight_bits, act_bits=args.act_bits,
        softmax_bits=args.softmax_bits or None, bias_correction=args.bias_correction,
        softmax_output=args.softmax_output,
        softmax_input=args.softmax_input,
        smoothquant_alpha=args.smoothquant, observer=args.observer, quantize_residual=args.residual,
        embedding_bits=args.embedding_bits or None, embedding_min_rows=args.embedding_min_rows,
        input_smoothing=args.input_smoothing, weight_bias_correction=args.weight_bias_correction,
        smoothing_into_v={"on": True, "off": False}.get(args.smoothing_into_v, args.smoothing_into_v), **extra,
    )


def load_task(args: argparse.Namespace):  # noqa: ANN201 - a softq.evaluation.Task
    """The model directory named on the command line, with its calibration texts and (for commands with
    ``--eval``) its evaluation texts."""
    from softq import corpora, hf
    from softq.evaluation import model_dir_task

    # Read the texts before loading the model: a bad file fails in a second, not after the load.
    calib = corpora.read_text_file(args.calib, "--calib file") if args.calib is not None else None
    evaluates = hasattr(args, "eval")  # softq export only quantizes: no evaluation texts to tokenize
    evaluation = corpora.read_text_file(args.eval, "--eval file") if evaluates and args.eval is not None else None
    loaded = hf.load_model_dir(args.model, max_length=args.max_length, default_length=128)
    limit = args.eval_limit if getattr(args, "eval_limit", None) is not None else 128
    return model_dir_task(loaded, calib, evaluation if evaluates else [], eval_limit=limit, **calib_size_kwargs(args))


def _quantize(args: argparse.Namespace) -> int:
    import softq
    from softq._files import check_writable_parent
    from softq.quant.quantize import smoothing_report

    config = _config(args)
    if args.float_weights and args.output is None:
        raise ValueError("--float-weights says how --output saves the model: pass --output DIR too")
    if args.output is not None:  # before any work: a bad path fails in a second, not after calibration
        if args.output.exists() and not args.overwrite:
            raise FileExistsError(f"{args.output} already exists; pass --overwrite to replace it")
        check_writable_parent(args.output)
    task = args.load_task(args)
    qmodel = softq.quantize(task.model, task.calib, config)
    print(f"{task.name}: {config.describe()}")
    print(f"  {smoothing_report(qmodel)}")
    if not args.no_eval:
        fp, q = task.evaluate(), task.evaluate(qmodel)
        digits = 5 if task.metric_name.startswith("cosine") else 4
        print(f"  float     {task.metric_name}: {fp:.{digits}f}")
        print(f"  quantized {task.metric_name}: {q:.{digits}f}  ({(q - fp) / fp * 100:+.3f}% relative)")
    if args.output is not None:
        from softq.quant.io import save

        written = save(qmodel, args.output, overwrite=args.overwrite,
                       sidecars_from=task.source.path if task.source is not None else None,
                       weights="float" if args.float_weights else "codes")
        print(f"  saved to {written}")
    return 0


def _report(args: argparse.Namespace) -> int:
    import softq
    from softq._files import check_writable_parent
    from softq.calib import diagnostics
    from softq.quant import sensitivity

    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:  # before any slow work
        raise ImportError("softq report draws its plots with matplotlib, which is not installed: "
                          "pip install 'softq[plot]'")
    config = _config(args)
    bars = args.plot.with_name(f"{args.plot.stem}-sensitivity{args.plot.suffix}")
    if args.plot.suffix.lower() != ".png":
        raise ValueError(f"--plot {args.plot}: expected a .png file name")
    for path in (args.plot,) if args.no_sensitivity else (args.plot, bars):
        if path.is_dir():
            raise IsADirectoryError(f"--plot: {path} is a directory")
        if path.exists() and not args.overwrite:
            raise FileExistsError(f"--plot: {path} already exists; pass --overwrite to replace it")
        check_writable_parent(path)
    task = args.load_task(args)
    qmodel = softq.quantize(task.model, task.calib, config)
    results = {"float": diagnostics.collect(task.model, task.calib), config.describe(): diagnostics.collect(qmodel, task.calib)}
    for label, diag in results.items():
        print(f"== {task.name}, {label}\n{diag.table()}\n")
    if not args.no_sensitivity:
        # Held-out loss, not the headline metric: it is continuous, so small effects still rank.
        rows = sensitivity.sensitivity(qmodel, lambda m: task.measure(m)[1])
        print(f"== sensitivity: {task.loss_name} with one part quantized at a time (worst first)")
        print(sensitivity.format_sensitivity(rows, higher_is_better=False))
        print(f"sensitivity plot written to {sensitivity.plot_sensitivity(rows, task.loss_name, bars)}")
    print(f"plot written to {diagnostics.plot(results, args.plot)}")
    return 0
