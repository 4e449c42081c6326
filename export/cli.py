"""``softq export``: a quantized model (a saved directory, or a Hugging Face directory quantized here) -> ONNX."""

from __future__ import annotations

import argparse
from pathlib import Path

from softq.cli import positive_int

# defaults of the options that only apply when export quantizes MODEL itself (a saved model refuses others)
QUANTIZE_DEFAULTS = {"softmax_output": "row", "softmax_bits": 8, "bias_correction": None, "calib": None,
                     "max_length": None, "calib_size": None}


def register(subparsers: argparse._SubParsersAction) -> dict[str, argparse.ArgumentParser]:
    """Add ``export``; returns its parser.  A model that is not a saved quantized directory is read through
    ``args.load_task`` (default :func:`softq.quant.cli.load_task`) and quantized here."""
    p = subparsers.add_parser(
        "export",
        help="export a quantized model to ONNX with an integer softmax",
        description=(
            "Export a softq-quantized model to ONNX (dynamic batch and sequence length, per-channel 8-bit weights, "
            "QDQ activations). Softmax codes relative to the row max (softmax_output row/row_exact, the default): "
            "attention core 'fast' (float exp inside Q/DQ, integer GEMM; default) or 'int' (exp table, integer "
            "only). Uniform edge codes: softmax 'qdq' (DequantizeLinear->Softmax->QuantizeLinear, portable; "
            "default), 'ort' (com.microsoft.QLinearSoftmax) or 'int' (standard ops, integer arithmetic only). A model "
            "quantized with a float softmax (--softmax-bits 0, QuantConfig(softmax_bits=None)) exports as 'float': "
            "the same integer linears, onnxruntime's Softmax and a float P.V. MODEL is a "
            "directory written by `softq quantize --output`, or a Hugging Face model directory, quantized here first "
            "with the default QuantConfig on --calib texts. Headless encoders (BertModel...) output last_hidden_state; --pooled adds "
            "the sentence embedding (the directory's sentence-transformers pooling and normalisation)."
        ),
    )
    p.add_argument("model", help="quantized model directory (softq quantize --output) or Hugging Face model "
                                 "directory")
    p.add_argument("--softmax", choices=["fast", "int", "qdq", "ort", "float"], default=None,
                   help="softmax / attention-core form (default: fast for row codes, qdq for edge codes, float for "
                        "a float softmax)")
    p.add_argument("--output", "-o", type=Path, required=True, help="ONNX file to write")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("--linears", choices=["integer", "qdq", "dynamic"], default="integer",
                   help="form of the Linear layers (default integer: MatMulInteger, fused with its bias by "
                        "onnxruntime, int8 kernels in tract; qdq: DequantizeLinear -> MatMul, for OpenVINO; "
                        "dynamic: integer with inputs quantized per call on their own range, onnxruntime only)")
    p.add_argument("--keep-names", action="store_true",
                   help="keep the exporter's tensor and node names (default: short tensor names, no node "
                        "names: a smaller file)")
    p.add_argument("--weight-storage", choices=["int8", "uint8"], default="int8",
                   help="storage of the symmetric 8-bit weight codes (default int8: onnxruntime's fast u8s8 "
                        "kernels; on AVX2-only x86 CPUs run it with the session option "
                        "session.x64quantprecision=1; uint8: zero point 128, exact without it, slower, for models "
                        "with unsigned activation codes, the default)")
    p.add_argument("--embeddings", choices=["float", "int8"], default=None,
                   help="embedding tables: default as quantized (int8 codes, one scale per row, unless quantized "
                        "with embedding_bits=None); int8 also converts float tables; float stores them dequantized")
    p.add_argument("--pooled", action="store_true",
                   help="headless text encoders: also output 'sentence_embedding' (pooling from the directory's "
                        "sentence-transformers files, else mean pooling)")
    h = p.add_argument_group("when MODEL is a Hugging Face model directory (quantized here first)")
    h.add_argument("--calib", type=Path, default=None, metavar="FILE",
                   help="calibration texts, one per line or JSONL with 'text' (default: Python documentation paragraphs and short everyday English, softq.corpora.calibration_texts)")
    h.add_argument("--max-length", type=positive_int, default=QUANTIZE_DEFAULTS["max_length"], help="tokens per calibration text (default 128, or the model's positions if fewer)")
    h.add_argument("--bias-correction", choices=["tensor", "head", "head_row"], default=None,
                   help="softmax bias correction when MODEL is quantized here (edge and row_exact codes)")
    p.add_argument("--softmax-output", choices=["row", "row_exact", "row_log", "edge"],
                   default=QUANTIZE_DEFAULTS["softmax_output"],
                   help="softmax output codes when MODEL is quantized here (default %(default)s; bias correction "
                        "is exported for edge only)")
    p.add_argument("--softmax-bits", type=int, default=QUANTIZE_DEFAULTS["softmax_bits"],
                   help="softmax output bits when MODEL is quantized here (default %(default)s; row_log takes 4; "
                        "0: a float softmax, exported as the 'float' form)")
    p.add_argument("--calib-size", type=positive_int, default=QUANTIZE_DEFAULTS["calib_size"], help="calibration texts (default: the first 64 of --calib, or all 132 built-in ones), as softq quantize")
    from softq.quant.cli import load_task

    p.set_defaults(handler=_export, load_task=load_task)
    return {"export": p}


def _example_inputs(model):  # noqa: ANN001, ANN202
    import torch

    cfg = model.config
    if getattr(model, "main_input_name", "input_ids") != "input_ids":  # one blank image or silent audio features
        from softq.models import probe_inputs

        return probe_inputs(model)
    from softq.models import max_tokens

    length = min(16, max_tokens(cfg) or 16)  # a model of fewer positions gets an example it takes
    return {"input_ids": torch.arange(length).remainder(cfg.vocab_size).unsqueeze(0)}


def _config(args: argparse.Namespace):  # noqa: ANN202
    import softq

    # the int form of row codes indexes its tables by score codes: a model quantized here for it gets them
    codes = args.softmax == "int" and args.softmax_output in ("row", "row_exact") and bool(args.softmax_bits)
    return softq.QuantConfig(bias_correction=args.bias_correction, softmax_output=args.softmax_output,
                             softmax_bits=args.softmax_bits or None, softmax_input="row" if codes else "auto")


def load_quantized(args: argparse.Namespace):  # noqa: ANN201
    """The quantized model named on the command line: loaded from a saved quantized directory, or quantized here
    from what ``args.load_task`` reads."""
    import softq

    config = _config(args)  # a bad combination fails before any slow work
    path = Path(args.model)
    if (path / "quant_config.json").is_file():
        from softq.quant.io import load

        given = ["--" + name.replace("_", "-") for name, default in QUANTIZE_DEFAULTS.items()
                 if getattr(args, name) != default]
        if given:
            raise ValueError(f"{' and '.join(given)} apply when MODEL is quantized here; {path} is already quantized "
                             "(its settings are in its quant_config.json: re-quantize with softq quantize to change them)")
        return load(path)
    task = args.load_task(args)
    return softq.quantize(task.model, task.calib, config)


def _pooling(args: argparse.Namespace) -> tuple[str | None, bool]:
    """(pooling, normalize) for --pooled: the model directory's sentence-transformers settings, else mean."""
    if not args.pooled:
        return None, False
    from softq import hf

    path = Path(args.model)
    pooling, normalize = hf.sentence_pooling(path) if path.is_dir() else (None, False)
    return pooling or "mean", normalize


def _export(args: argparse.Namespace) -> int:
    from softq.export import onnx_utils
    from softq.export.cores import default_form
    from softq.export.model_export import to_onnx

    onnx_utils.check_writable(args.output, args.overwrite)  # before any slow work
    qmodel = load_quantized(args)
    pooling, normalize = _pooling(args)
    written = to_onnx(qmodel, args.output, _example_inputs(qmodel), softmax=args.softmax,
                      overwrite=args.overwrite, weight_storage=args.weight_storage,
                      embeddings=args.embeddings, pooling=pooling, normalize=normalize, linears=args.linears,
                      names="full" if args.keep_names else "short")
    size = Path(written).stat().st_size
    outputs = "last_hidden_state, sentence_embedding" if pooling else None
    print(f"wrote {written} ({size / 1e6:.2f} MB, softmax={args.softmax or default_form(qmodel.softq_quant_config)}"
          + (f", outputs {outputs}" if outputs else "") + ")")
    return 0
