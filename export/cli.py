"""``softq export``: a quantized model (saved directory or reference workload) -> ONNX file."""

from __future__ import annotations

import argparse
from pathlib import Path

REFERENCE_NAMES = ("lm", "vit")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="export a quantized model to ONNX with an integer softmax",
        description=(
            "Export a softq-quantized model to ONNX (dynamic batch and sequence length, per-channel 8-bit weights, "
            "QDQ activations). Softmax codes relative to the row max (softmax_output row/row_exact, the default): "
            "attention core 'fast' (float exp inside Q/DQ, integer GEMM; default) or 'int' (exp table, integer "
            "only). Uniform edge codes: softmax 'qdq' (DequantizeLinear->Softmax->QuantizeLinear, portable; "
            "default), 'ort' (com.microsoft.QLinearSoftmax) or 'int' (standard ops, integer arithmetic only). MODEL is a "
            "directory written by `softq quantize --output` or a reference workload name ('lm', 'vit'), which is "
            "then quantized here first."
        ),
    )
    p.add_argument("model", help="quantized model directory, or 'lm' / 'vit' (reference workload)")
    p.add_argument("--softmax", choices=["fast", "int", "qdq", "ort"], default=None,
                   help="softmax / attention-core form (default: fast for row codes, qdq for edge codes)")
    p.add_argument("--output", "-o", type=Path, required=True, help="ONNX file to write")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("--weight-storage", choices=["uint8", "int8"], default="uint8",
                   help="storage of the symmetric 8-bit weight codes (default uint8 with zero point 128; "
                        "int8 triggers onnxruntime's u8s8 saturation on AVX2-only x86 CPUs)")
    p.add_argument("--embeddings", choices=["float", "int8"], default="float",
                   help="also store embedding tables as per-row int8 (smaller file; default %(default)s)")
    g = p.add_argument_group("when MODEL is a reference workload")
    g.add_argument("--bias-correction", choices=["tensor", "head", "head_row"], default=None)
    g.add_argument("--softmax-output", choices=["row", "row_exact", "edge"], default="row",
                   help="softmax output codes (default %(default)s; bias correction is exported for edge only)")
    g.add_argument("--calib-size", type=int, default=16, help="calibration windows/images (default 16)")
    g.add_argument("--seed", type=int, default=0, help="which cached reference model (training seed)")
    p.set_defaults(handler=_export)


def _example_inputs(model):  # noqa: ANN001, ANN202
    import torch

    cfg = model.config
    if getattr(model, "main_input_name", "input_ids") == "pixel_values":
        return {"pixel_values": torch.zeros(1, int(getattr(cfg, "num_channels", 3)), cfg.image_size, cfg.image_size)}
    return {"input_ids": torch.arange(16).remainder(cfg.vocab_size).unsqueeze(0)}


def load_quantized(args: argparse.Namespace):  # noqa: ANN201
    """The quantized model named on the command line (loaded, or quantized from a reference workload)."""
    if args.model in REFERENCE_NAMES:
        import softq
        from softq.quant.tasks import reference_task

        task = reference_task(args.model, calib_size=args.calib_size, seed=args.seed)
        return softq.quantize(task.model, task.calib, softq.QuantConfig(bias_correction=args.bias_correction,
                                                                        softmax_output=args.softmax_output))
    path = Path(args.model)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither a quantized model directory nor one of {', '.join(REFERENCE_NAMES)}")
    from softq.quant.io import load

    return load(path)


def _export(args: argparse.Namespace) -> int:
    from softq.export import onnx_utils
    from softq.export.model_export import to_onnx

    onnx_utils.check_writable(args.output, args.overwrite)  # before any slow work
    qmodel = load_quantized(args)
    written = to_onnx(qmodel, args.output, _example_inputs(qmodel), softmax=args.softmax,
                      overwrite=args.overwrite, weight_storage=args.weight_storage,
                      embeddings=args.embeddings)
    size = Path(written).stat().st_size
    print(f"wrote {written} ({size / 1e6:.2f} MB, softmax={args.softmax or 'default'})")
    return 0
