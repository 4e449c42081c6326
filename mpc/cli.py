"""``softq mpc``: encrypted inference (``run``), one party of a multi-host run (``party``), distillation."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from softq._files import error_line
from softq.cli import positive_float


def _per_layer(text: str | None) -> Any:
    if text is None or text == "native":
        return None
    return text.split(",") if "," in text else text


def _model_dir(model: str) -> Path:
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"{model} is neither 'lm', 'vit' nor a model directory")
    return path


def _load_any(model: str) -> Any:
    """A model directory (softq save_model or Hugging Face save_pretrained)."""
    path = _model_dir(model)
    if (path / "weights.pt").is_file():
        from softq.workloads import load_model

        return load_student(path) if _has_surrogates(path) else load_model(path)
    import transformers

    from softq.hf import quiet_transformers

    with quiet_transformers():
        try:
            config = transformers.AutoConfig.from_pretrained(path)
            cls = getattr(transformers, (config.architectures or ["AutoModel"])[0], transformers.AutoModel)
            model = cls.from_pretrained(path, local_files_only=True).eval()
        except Exception as err:  # noqa: BLE001 - unreadable config or weights: one line naming the directory
            raise ValueError(f"cannot load the model in {path}: {error_line(err)}") from None
    from softq.hf import sentence_pooling

    _drop_unused_pooler(model, sentence_pooling(path)[0])
    return model


def _drop_unused_pooler(model: Any, pooling: str | None) -> None:
    """A sentence encoder (``pooling`` from its sentence-transformers files) never uses BERT's pooler, which
    would cost a dense layer and a tanh under MPC: it runs without it."""
    if pooling is not None and getattr(model, "pooler", None) is not None:
        model.pooler = None


def _restore_surrogates(model: Any) -> Any:
    """Switch a student back to the surrogates its config records (``softq_mpc_surrogates``), if any."""
    from softq.mpc.surrogates import SurrogateSpec, configure_surrogates

    spec = getattr(model.config, "softq_mpc_surrogates", None)
    if spec:
        spec = SurrogateSpec.from_json(spec)
        configure_surrogates(model, softmax=spec.softmax, gelu=spec.gelu, softmax_params=spec.softmax_params)
    return model


def _has_surrogates(path: Path) -> bool:
    return "softq_mpc_surrogates" in json.loads((path / "config.json").read_text())


def load_student(path: str | Path) -> Any:
    """Load a distilled student saved by ``softq mpc distill`` with its surrogates restored."""
    from softq.workloads import load_model

    return _restore_surrogates(load_model(path))


def _read_inputs(path: str) -> dict:
    """``--inputs``: a torch.save'd dict of input tensors (one line if it is not)."""
    import torch

    if not Path(path).is_file():
        raise FileNotFoundError(f"--inputs {path} does not exist")
    try:
        inputs = torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - truncated, not a torch file, or unpicklable: all one answer
        raise ValueError(f"--inputs {path} cannot be read as a torch.save'd dict of tensors ({error_line(err)})") from None
    if not isinstance(inputs, dict) or not inputs:
        raise ValueError(f"--inputs {path} holds a {type(inputs).__name__}; expected a dict of input tensors "
                         "(e.g. a tokenizer's output)")
    return inputs


def _check_inputs(inputs: dict, path: str, model: Any) -> None:
    """``--inputs`` against the model: its main input present, ids in its vocabulary, shapes it takes."""
    from softq.calib.data import check_batch

    main = getattr(model, "main_input_name", "input_ids")
    if main not in inputs:
        raise ValueError(f"--inputs {path} has no '{main}' (keys: {', '.join(map(str, inputs))})")
    check_batch(model, inputs, what="--inputs", index=path)


def _run(args: argparse.Namespace) -> int:
    import torch

    from softq.mpc.runner import run
    from softq.mpc.surrogates import SurrogateSpec

    torch.set_num_threads(1)
    task = None
    if args.model in ("lm", "vit"):
        from softq.workloads.tasks import mpc_task

        task = mpc_task(args.model, n=args.samples, seq_len=args.seq_len)
        model, inputs = task.model, task.inputs
        if args.student:
            model = load_student(args.student)
    elif args.text:
        return _run_text(args)
    else:
        _model_dir(args.student or args.model)
        if not args.inputs:
            raise ValueError("a model directory needs --inputs (a torch.save'd dict of input tensors) or, for a text "
                             "model, --text FILE")
        inputs = _read_inputs(args.inputs)  # a bad file fails before the model loads
        model = _load_any(args.student or args.model)
        _check_inputs(inputs, args.inputs, model)
    softmax, gelu = _per_layer(args.softmax), _per_layer(args.gelu)
    if args.student:
        spec = SurrogateSpec.from_json(model.config.softq_mpc_surrogates)
        softmax, gelu = spec.softmax, spec.gelu
    result = run(model, inputs, softmax=softmax, gelu=gelu, world_size=args.world_size,
                 provider=args.provider, timeout=args.timeout, truncation=args.truncation,
                 range_margin=args.range_margin)
    print(result.report.table("kind"))
    print()
    print(result.report.table("layer"))
    summary: dict[str, Any] = {"rounds": result.report.rounds, "bytes": result.report.bytes,
                               "wall_seconds": result.wall_seconds}
    if task is not None:
        import copy

        from softq.mpc.surrogates import configure_surrogates

        ref = copy.deepcopy(model)
        if not args.student:
            configure_surrogates(ref, softmax=softmax, gelu=gelu)
        with torch.no_grad():
            plain = ref(**inputs).logits
        enc = result.logits
        summary.update(
            encrypted_accuracy=task.accuracy(enc), plaintext_accuracy=task.accuracy(plain),
            max_abs_error=float((enc - plain).abs().max()),
            argmax_agreement=100.0 * float((enc.argmax(-1) == plain.argmax(-1)).float().mean()),
        )
        print(f"\n{task.name}: encrypted accuracy {summary['encrypted_accuracy']:.2f}%  plaintext "
              f"{summary['plaintext_accuracy']:.2f}%  max |logit error| {summary['max_abs_error']:.2e}  "
              f"argmax agreement {summary['argmax_agreement']:.1f}%")
    if args.output:
        torch.save({"outputs": result.outputs, "report": result.report.to_dict(), "summary": summary}, args.output)
    if args.json:
        print(json.dumps(summary))
    return 0


def load_text_model(path: str | Path, max_length: int | None = None) -> Any:
    """A Hugging Face headless text encoder's directory as a :class:`softq.hf.HFModel`, ready for ``softq.mpc``
    (a model with a head is refused: ``--text`` and text distillation work on sentence embeddings).

    A sentence encoder (a sentence-transformers folder: its embedding is pooled from the hidden states)
    runs without BERT's pooler, which it never uses and which would cost a dense layer and a tanh under
    MPC (:func:`_drop_unused_pooler`).  A student written by ``softq mpc distill`` gets its surrogates back.
    """
    import torch

    from softq import hf

    with hf.quiet_transformers():
        loaded = hf.load_model_dir(path, max_length=max_length)
    if not loaded.is_text:
        raise hf.ModelDirError(f"{path} is not a text model; --text and distillation from a text file need one")
    _drop_unused_pooler(loaded.model, loaded.pooling)
    probe = loaded.tokenize(["a"], max_length=8)
    with torch.no_grad():
        if getattr(loaded.model(**probe), "last_hidden_state", None) is None:
            raise hf.ModelDirError(f"{path} has a head ({type(loaded.model).__name__}); --text works with a headless "
                                   "encoder's sentence embeddings (use --inputs for other models)")
    _restore_surrogates(loaded.model)
    return loaded


def _run_text(args: argparse.Namespace) -> int:
    """``softq mpc run --model DIR [--student DIR] --text FILE``: encrypted sentence embeddings of a text model."""
    import torch

    from softq import corpora, hf
    from softq.mpc.runner import run
    from softq.mpc.surrogates import SurrogateSpec

    torch.set_num_threads(1)
    if args.inputs:
        raise ValueError("give --inputs or --text, not both")
    owner = load_text_model(args.model, args.seq_len)
    target = load_text_model(args.student, args.seq_len) if args.student else owner
    spec = getattr(target.model.config, "softq_mpc_surrogates", None)
    if spec:  # a student: its own surrogates
        spec = SurrogateSpec.from_json(spec)
        softmax, gelu = spec.softmax, spec.gelu
    else:
        softmax, gelu = _per_layer(args.softmax), _per_layer(args.gelu)
    texts = corpora.read_text_file(args.text, "--text file")[:args.samples]
    inputs = target.tokenize(texts, max_length=args.seq_len)
    result = run(target.model, inputs, softmax=softmax, gelu=gelu, world_size=args.world_size,
                 provider=args.provider, timeout=args.timeout, truncation=args.truncation,
                 range_margin=args.range_margin)
    print(result.report.table("kind"))
    mask = inputs["attention_mask"]
    hidden = result.outputs[0]
    # the encryption's error: against the same model with the same surrogates in plaintext (a student carries
    # its own); the surrogates' own error is the cosine to the exact model, reported apart
    reference = target.model
    if not spec:
        import copy

        from softq.mpc.surrogates import configure_surrogates

        reference = copy.deepcopy(target.model)
        configure_surrogates(reference, softmax=softmax, gelu=gelu)
    with torch.no_grad():
        plain = reference(**inputs).last_hidden_state
    mode = owner.pooling or "mean"
    emb = hf.pool(hidden, mask, mode)
    cos_plain = torch.nn.functional.cosine_similarity(emb, hf.pool(plain, mask, mode))
    summary: dict[str, Any] = {
        "texts": len(texts), "tokens": int(mask.sum()), "rounds": result.report.rounds, "bytes": result.report.bytes,
        "wall_seconds": result.wall_seconds,
        "max_abs_error": float((hidden - plain).abs()[mask.bool()].max()),
        "min_cosine_to_plaintext": float(cos_plain.min()),
    }
    what = "the student in plaintext" if args.student else \
        f"the model in plaintext with the same surrogates ({_surrogate_text(softmax, gelu)})"
    line = (f"\n{len(texts)} texts, {summary['tokens']} tokens: max |hidden-state error| {summary['max_abs_error']:.2e} and "
            f"min embedding cosine {summary['min_cosine_to_plaintext']:.6f} to {what}")
    with torch.no_grad():
        exact = owner.model(**inputs).last_hidden_state
    cos_exact = torch.nn.functional.cosine_similarity(emb, hf.pool(exact, mask, mode))
    summary["mean_cosine_to_model"] = float(cos_exact.mean())
    summary["min_cosine_to_model"] = float(cos_exact.min())
    if args.student:
        line += (f"; embedding cosine to {args.model} (the model it was distilled from): mean "
                 f"{summary['mean_cosine_to_model']:.4f}, min {summary['min_cosine_to_model']:.4f}")
    else:
        line += (f"; embedding cosine to the exact model (what the surrogates cost; softq mpc distill trains a "
                 f"student for them): mean {summary['mean_cosine_to_model']:.4f}, min {summary['min_cosine_to_model']:.4f}")
    print(line)
    if args.output:
        torch.save({"outputs": result.outputs, "report": result.report.to_dict(), "summary": summary}, args.output)
    if args.json:
        print(json.dumps(summary))
    return 0


def _surrogate_text(softmax: Any, gelu: Any) -> str:
    name = (lambda v: v if isinstance(v, str) else ",".join(map(str, v.values() if isinstance(v, dict) else v)))
    return f"softmax {name(softmax)}, GELU {name(gelu) if gelu is not None else 'native'}"


def _party(args: argparse.Namespace) -> int:
    from softq.mpc.party import exit_skipping_teardown, run_party, settings_from_args

    try:
        result = run_party(settings_from_args(args))
    except (ValueError, OSError, RuntimeError) as err:  # softq's CLI line, then no teardown where one could abort
        print(f"softq mpc: error: {err}", file=sys.stderr)
        return exit_skipping_teardown(1)
    if result is not None:
        from softq.mpc.accounting import CommReport

        print(CommReport.from_dict(result["report"]).table())
        if not args.output:
            print(result["outputs"])
    return exit_skipping_teardown(0)


def _distill_dir(args: argparse.Namespace) -> int:
    """``softq mpc distill --model DIR --text FILE``: a surrogate student of a text model, no labels needed.

    The teacher's own outputs are the targets (stage 2: ``1 - cosine`` of the pooled embeddings for a headless
    encoder, plus ``--hidden-weight`` x the hidden-state MSE).  Every 10th line of ``--text`` is held out (or
    ``--eval-text``); the student never sees those lines or any sentence in them, and the cosine of its
    embeddings to the teacher's on them is reported before and after.  Defaults are the recipe measured on
    all-MiniLM-L6-v2 (docs/results/mpc.md): fitted surrogates, windows of random sentences, hidden-state
    term 0.5 with each channel normalised by the teacher's spread, no dropout, lr 2e-4 / 1e-4.
    """
    import copy
    import itertools
    import random

    import torch

    from softq import corpora
    from softq.mpc.distill import distill
    from softq.mpc.surrogates import configure_surrogates

    if not args.text:
        raise ValueError("a model directory needs --text FILE: the distillation text (one paragraph per line, or JSONL "
                         "with a 'text' field)")
    for flag, value in (("--window", args.window), ("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    torch.manual_seed(args.seed)
    loaded = load_text_model(args.model, args.seq_len)
    if getattr(loaded.model.config, "softq_mpc_surrogates", None):
        raise ValueError(f"{args.model} is already a surrogate student; distill from the model it came from")
    init, init_meta = _init_student(args.init, loaded.model) if args.init else (None, {})
    lines = corpora.read_text_file(args.text, "--text file")
    if args.eval_text:
        held, train = corpora.read_text_file(args.eval_text, "--eval-text file"), lines
    else:
        if len(lines) < 2:
            raise ValueError(f"{args.text}: one line; give at least 2 (every 10th is held out) or --eval-text")
        held, train = lines[::10], [t for i, t in enumerate(lines) if i % 10]
    held_set = set(held)
    train = [t for t in train if t not in held_set]
    if not train:
        raise ValueError(f"{args.text}: no training line is left outside the held-out text")
    steps = (args.steps1, args.steps2)
    if args.recombine:  # the same words in new contexts: the lever that helped most on a small corpus
        windows = corpora.recombined_windows(train, args.window, max(1, sum(steps)) * args.batch_size, exclude=held,
                                        seed=args.seed)
    else:
        windows = corpora.text_windows(train, args.window)
    batches = loaded.batches(windows, batch_size=args.batch_size, max_length=args.seq_len)
    random.Random(args.seed).shuffle(batches)
    evals = loaded.batches(held, batch_size=32, max_length=args.seq_len)
    ref = loaded.encode(evals)

    def cosine(model: Any) -> torch.Tensor:
        return torch.nn.functional.cosine_similarity(loaded.encode(evals, model), ref)

    if init is None:  # where distillation starts: the teacher with the surrogates, or the student to continue
        start = copy.deepcopy(loaded.model)
        configure_surrogates(start, softmax=_per_layer(args.softmax), gelu=_per_layer(args.gelu))
        before = cosine(start)
        del start
    else:
        before = cosine(init)  # before distill trains it in place
    lr = args.lr if args.lr is not None else 2e-4
    student, history = distill(loaded.model, itertools.cycle(batches), softmax=_per_layer(args.softmax),
                               gelu=_per_layer(args.gelu), steps=steps, lr=(lr, lr / 2), dropout=False,
                               stage2_hidden_weight=0.5 if args.hidden_weight is None else args.hidden_weight,
                               fit=args.fit is not False and init is None,
                               normalize_hidden=args.normalize_hidden is not False,
                               student=init, progress=True)
    if history.fit is not None:
        print(f"fitted the surrogates to the teacher before distilling: {history.fit.summary()}")
    after = cosine(student)
    print(f"embedding cosine to the teacher on {len(held)} held-out texts: "
          f"{f'the student from {args.init}' if init is not None else 'surrogates not distilled'} mean "
          f"{float(before.mean()):.4f} (min {float(before.min()):.4f}); distilled mean {float(after.mean()):.4f} "
          f"(min {float(after.min()):.4f})")
    meta = {"kind": "mpc-student", "teacher": str(args.model), "softmax": init_meta.get("softmax", args.softmax),
            "gelu": init_meta.get("gelu", args.gelu), "init": str(args.init) if args.init else None,
            "earlier_steps": [*init_meta.get("earlier_steps", []), init_meta["steps"]] if "steps" in init_meta else [],
            "steps": list(steps), "lr": [lr, lr / 2], "fit": history.fit is not None, "text": str(args.text),
            "normalize_hidden": args.normalize_hidden is not False,
            "windows": len(windows), "recombine": args.recombine, "held_out_texts": len(held),
            "cosine_before": float(before.mean()), "cosine_after": float(after.mean()),
            "cosine_after_min": float(after.min())}
    save_student_dir(student, args.out, args.model, meta)
    print(f"student saved to {args.out}; run it with: softq mpc run --model {args.model} --student {args.out} "
          f"--text FILE")
    return 0


def _init_student(path: str | Path, teacher: Any) -> tuple[Any, dict[str, Any]]:
    """``--init DIR``: a student written by ``softq mpc distill`` from this teacher, to distil further, and its
    ``softq_student.json``."""
    folder = Path(path)
    meta_file = folder / "softq_student.json"
    if not meta_file.is_file():
        raise ValueError(f"--init {path}: not a student written by softq mpc distill (no softq_student.json)")
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError:
        raise ValueError(f"--init {path}: softq_student.json is not valid JSON") from None
    student = load_text_model(folder).model
    if not getattr(student.config, "softq_mpc_surrogates", None):
        raise ValueError(f"--init {path}: its config records no surrogates; not a student written by softq mpc distill")
    theirs = student.state_dict()
    for name, value in teacher.state_dict().items():
        if name not in theirs or theirs[name].shape != value.shape:
            raise ValueError(f"--init {path}: its weights do not fit --model's ({name}); a student of another model?")
    return student, meta


def save_student_dir(student: Any, path: str | Path, source: str | Path, meta: dict[str, Any]) -> Path:
    """Write a distilled Hugging Face student as a model directory (weights, config with its surrogates, the
    teacher's tokenizer and sentence-transformers files, ``softq_student.json``), atomically."""
    from softq import hf
    from softq._files import atomic_directory

    target = Path(path)
    with atomic_directory(target) as tmp:
        student.config.architectures = [type(student).__name__]
        student.save_pretrained(tmp)
        hf.copy_sidecars(source, tmp)
        (tmp / "softq_student.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return target


def _distill(args: argparse.Namespace) -> int:
    import torch

    from softq._files import check_writable_parent

    out = Path(args.out)  # before any work: a student is never written over something without --overwrite
    if (out.exists() or out.is_symlink()) and not args.overwrite:
        raise FileExistsError(f"--out {out} already exists; pass --overwrite to replace it")
    check_writable_parent(out)

    if args.model not in ("lm", "vit"):
        return _distill_dir(args)
    for flag, value in (("--text", args.text), ("--eval-text", args.eval_text), ("--init", args.init)):
        if value:
            raise ValueError(f"{flag} is for a model directory; the reference {args.model} distils on its own data")

    from softq.mpc.distill import distill
    from softq.workloads.tasks import mpc_task
    from softq.workloads import save_model

    torch.manual_seed(args.seed)
    task = mpc_task(args.model, n=args.samples, seq_len=args.seq_len)
    lr = (1e-3, 3e-4) if args.lr is None else (args.lr, args.lr / 2)
    student, history = distill(task.model, task.train_batches(args.batch_size, args.seed),
                               softmax=_per_layer(args.softmax), gelu=_per_layer(args.gelu),
                               steps=(args.steps1, args.steps2), fit=bool(args.fit), lr=lr,
                               stage2_hidden_weight=args.hidden_weight or 0.0,
                               normalize_hidden=bool(args.normalize_hidden))
    if history.fit is not None:
        print(f"fitted the surrogates to the teacher before distilling: {history.fit.summary()}")
    with torch.no_grad():
        before_model = __import__("copy").deepcopy(task.model)
        from softq.mpc.surrogates import configure_surrogates

        configure_surrogates(before_model, softmax=_per_layer(args.softmax), gelu=_per_layer(args.gelu))
        teacher_acc = task.accuracy(task.model(**task.inputs).logits)
        before = task.accuracy(before_model(**task.inputs).logits)
        after = task.accuracy(student(**task.inputs).logits)
    print(f"{task.name} plaintext accuracy on {args.samples} held-out samples: teacher {teacher_acc:.2f}%, "
          f"surrogates before distillation {before:.2f}%, after {after:.2f}%")
    meta = {"kind": f"mpc-student-{task.name}", "softmax": args.softmax, "gelu": args.gelu,
            "steps": [args.steps1, args.steps2], "fit": args.fit, "teacher_accuracy": teacher_acc,
            "before": before, "after": after, "stage1_final_loss": history.stage1[-1:] or None,
            "stage2_final_loss": history.stage2[-1:] or None}
    save_model(student, args.out, task.tokenizer, meta)
    print(f"student saved to {args.out}; run it with: softq mpc run --model {task.name} --student {args.out}")
    return 0


def _add_surrogate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--softmax", default="2quad",
                   help="softmax variant: softmax (exact), 2quad, 2relu, relu_len, sigmoid_len; comma list per layer")
    p.add_argument("--gelu", default="quad", help="GELU surrogate: erf, tanh, quad, relu or native; comma list per layer")


def register(subparsers: Any) -> None:
    mpc = subparsers.add_parser("mpc", help="private inference under CrypTen (run, party, distill)")
    sub = mpc.add_subparsers(dest="mpc_command", metavar="MPC_COMMAND")
    mpc.set_defaults(handler=lambda args: (mpc.print_help(), 2)[1])

    r = sub.add_parser("run", help="encrypted inference with every party in its own process on loopback")
    r.add_argument("--model", required=True, help="lm, vit (the reference models) or a model directory")
    r.add_argument("--inputs", help="torch.save'd dict of inputs (for a model directory)")
    r.add_argument("--student", help="a distilled student from `softq mpc distill` (uses its surrogates)")
    r.add_argument("--text", help="a text model directory: encrypt the embeddings of these texts (one per line, or "
                                  "JSONL with 'text'); reports the error to the plaintext model (and, with --student, "
                                  "the cosine to --model's embeddings)")
    r.add_argument("--samples", type=int, default=32,
                   help="held-out images / text windows (reference models); the first N texts of --text")
    r.add_argument("--seq-len", type=int, default=64, help="text window length (lm) / tokens per text (--text)")
    _add_surrogate_args(r)
    r.add_argument("--world-size", type=int, default=2, help="number of parties (processes)")
    r.add_argument("--provider", choices=("TFP", "TTP"), default="TFP",
                   help="Beaver triples: TFP (party 0 generates them; trusted) or TTP (separate dealer process)")
    r.add_argument("--timeout", type=positive_float, default=120.0, help="seconds before a silent or missing party is an error")
    r.add_argument("--truncation", choices=("exact", "probabilistic"), default="exact",
                   help="exact (default, never fails) or CrypTen's probabilistic truncation (opt-in)")
    r.add_argument("--range-margin", type=float, default=2.0,
                   help="headroom the plaintext range check demands beyond the inputs' values (>= 1)")
    r.add_argument("--output", help="save revealed outputs and the report here (torch.save)")
    r.add_argument("--json", action="store_true", help="also print a JSON summary line")
    r.set_defaults(handler=_run)

    from softq.mpc.party import build_arg_parser

    p = sub.add_parser("party", help="run ONE party of a multi-host encrypted inference (see docs/results/mpc.md)")
    build_arg_parser(p)
    p.set_defaults(handler=_party)

    d = sub.add_parser("distill", help="MPCFormer two-stage distillation of a surrogate student")
    d.add_argument("--model", required=True,
                   help="lm or vit (the reference models) or a Hugging Face text-model directory (with --text)")
    _add_surrogate_args(d)
    d.add_argument("--steps1", type=int, default=300, help="stage 1 steps (hidden states + attention maps, MSE)")
    d.add_argument("--steps2", type=int, default=300,
                   help="stage 2 steps (logits: soft cross-entropy; a headless encoder: 1 - cosine of its embeddings)")
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--samples", type=int, default=360, help="held-out samples for the before/after accuracy")
    d.add_argument("--seq-len", type=int, default=64)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--fit", action=argparse.BooleanOptionalAction, default=None,
                   help="fit Quad GELU per channel and 2Quad per head to the teacher's activations first "
                        "(exact weight rewrites, same encrypted cost; default on for a model directory, off for "
                        "lm/vit, whose fitted students leave the encrypted division's range: docs/results/mpc.md)")
    d.add_argument("--text", help="model directory: distillation text, one paragraph per line (or JSONL with 'text'); "
                                  "every 10th line is held out for the before/after cosine")
    d.add_argument("--eval-text", help="model directory: held-out texts instead of every 10th line of --text")
    d.add_argument("--window", type=int, default=48, help="model directory: words per training window")
    d.add_argument("--recombine", action=argparse.BooleanOptionalAction, default=True,
                   help="model directory: train on windows of random sentences of --text (default; new contexts for "
                        "the same words) instead of its consecutive windows")
    d.add_argument("--lr", type=float, default=None,
                   help="stage-1 learning rate, stage 2 half of it (default: 2e-4 / 1e-4 for a model directory, "
                        "1e-3 / 3e-4 for lm/vit)")
    d.add_argument("--hidden-weight", type=float, default=None,
                   help="stage 2 also minimises this multiple of the hidden-state MSE (default 0.5 for a model "
                        "directory, 0 for lm/vit)")
    d.add_argument("--normalize-hidden", action=argparse.BooleanOptionalAction, default=None,
                   help="weigh each hidden-state channel of the MSE terms by 1 / the teacher's standard deviation "
                        "(default on for a model directory: better on all-MiniLM-L6-v2, docs/results/mpc.md; off for "
                        "lm/vit, where it has not been measured)")
    d.add_argument("--init", metavar="DIR",
                   help="model directory: continue distilling this student (written by `softq mpc distill` from "
                        "--model; its surrogates are kept, --softmax/--gelu/--fit do not apply), e.g. --steps1 0 "
                        "--steps2 1200 for more stage-2 steps (how the 0.98 MiniLM student was trained: docs/results/mpc.md)")
    d.add_argument("--out", required=True, help="directory for the student")
    d.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    d.set_defaults(handler=_distill)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="softq")
    register(parser.add_subparsers(dest="command"))
    ns = parser.parse_args()
    sys.exit(int(ns.handler(ns) or 0))
