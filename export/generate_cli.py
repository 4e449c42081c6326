"""``softq generate``: text from a quantized decoder, through its ONNX file with a KV cache, in onnxruntime (or tract
or OpenVINO: ``--runtime``)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from softq.cli import positive_float, positive_int
from softq.export.runtimes import RUNTIMES


def register(subparsers: argparse._SubParsersAction) -> dict[str, argparse.ArgumentParser]:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a quantized decoder through its ONNX file with a KV cache",
        description=(
            "Generate from a causal language model. MODEL is a directory written by `softq quantize --output` "
            "(exported here first with a KV cache: softq.to_onnx(..., kv_cache=True), checked against the torch "
            "model) or an ONNX file exported with a KV cache. The prompt is tokenized with MODEL's tokenizer (an "
            "ONNX file's folder, or --tokenizer); a model without one takes --prompt-ids. Greedy by default; "
            "--sample draws with --temperature, --top-k, --top-p and --seed (the same seed, the same tokens)."
        ),
    )
    p.add_argument("model", help="quantized model directory (softq quantize --output) or ONNX file with a KV cache")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma-separated (e.g. 1,2,3)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to generate (default %(default)s)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: all)")
    p.add_argument("--top-p", type=positive_float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    p.add_argument("--seed", type=int, default=None, help="random seed of the sampling (default: a fresh one)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer directory (default: MODEL's directory, or the ONNX file's folder)")
    p.add_argument("--save-onnx", type=Path, default=None, metavar="FILE",
                   help="when MODEL is a quantized directory: keep its exported file here (default: a temporary one)")
    p.add_argument("--threads", type=positive_int, default=1, help="CPU threads of the runtime (default 1)")
    p.add_argument("--runtime", choices=RUNTIMES, default="onnxruntime",
                   help="runtime that runs the file (default onnxruntime; tract and openvino where installed)")
    p.set_defaults(handler=_generate)
    return {"generate": p}


def _tokenizer(folder: Path):  # noqa: ANN202
    """The Hugging Face tokenizer in ``folder``, or None where it has none."""
    from softq.hf import TOKENIZER_FILES

    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        from softq._files import error_line

        raise ValueError(f"cannot load the tokenizer in {folder}: {error_line(err)}") from None


def _prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:  # noqa: ANN001
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.replace(" ", "").split(",") if t]
        except ValueError:
            raise ValueError(f"--prompt-ids takes comma-separated integers, got {args.prompt_ids!r}") from None
        if not ids or min(ids) < 0:
            raise ValueError(f"--prompt-ids takes token ids of at least 0, got {args.prompt_ids!r}")
        return ids
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer (tokenizer.json, vocab.json...): give the prompt as "
                         "--prompt-ids, or a tokenizer directory as --tokenizer")
    ids = tokenizer(args.prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise ValueError("--prompt tokenizes to no tokens")
    return list(ids)


def _onnx_of(model: Path, args: argparse.Namespace, folder: str) -> tuple[str, int | None]:
    """(the ONNX file to run, the end-of-sequence id from the model's config) for MODEL."""
    if model.is_file():
        return str(model), None
    if not (model / "quant_config.json").is_file():
        raise ValueError(f"{model} is neither an ONNX file nor a quantized model directory (no quant_config.json): "
                         "quantize it first with softq quantize --output DIR")
    from softq.export.cli import _example_inputs
    from softq.export.model_export import to_onnx
    from softq.quant.io import load

    qmodel = load(model)
    path = args.save_onnx or Path(folder) / "model.onnx"
    written = to_onnx(qmodel, str(path), _example_inputs(qmodel), kv_cache=True, overwrite=args.save_onnx is None)
    eos = getattr(qmodel.config, "eos_token_id", None)
    return written, eos if isinstance(eos, int) else None


def _generate(args: argparse.Namespace) -> int:
    from softq.export.generate import generate

    model = Path(args.model)
    if not model.exists():
        raise FileNotFoundError(f"no model at {model}")
    if args.save_onnx is not None:
        from softq.export.onnx_utils import check_writable

        check_writable(args.save_onnx, overwrite=False)
    tokenizer = _tokenizer(args.tokenizer or (model if model.is_dir() else model.parent))
    ids = _prompt_ids(args, tokenizer)
    with tempfile.TemporaryDirectory(prefix="softq-generate-") as folder:
        path, eos = _onnx_of(model, args, folder)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos = tokenizer.eos_token_id
        out = generate(path, [ids], args.max_new_tokens, do_sample=args.sample, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_id=eos, threads=args.threads,
                       runtime=args.runtime)
    new = [int(t) for t in out[0, len(ids):]]
    if tokenizer is None:
        print(" ".join(map(str, new)))
    else:
        print(tokenizer.decode(ids + new, skip_special_tokens=True))
    return 0
