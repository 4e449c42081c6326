"""``softq mpc``: encrypted inference (``run``), one party of a multi-host run (``party``), distillation."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _per_layer(text: str | None) -> Any:
    if text is None or text == "native":
        return None
    return text.split(",") if "," in text else text


def _load_any(model: str) -> Any:
    """A model directory (softq save_model or Hugging Face save_pretrained)."""
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"{model} is neither 'lm', 'vit' nor a model directory")
    if (path / "weights.pt").is_file():
        from softq.workloads import load_model

        return load_student(path) if _has_surrogates(path) else load_model(path)
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, (config.architectures or ["AutoModel"])[0])
    return cls.from_pretrained(path).eval()


def _has_surrogates(path: Path) -> bool:
    return "softq_mpc_surrogates" in json.loads((path / "config.json").read_text())


def load_student(path: str | Path) -> Any:
    """Load a distilled student saved by ``softq mpc distill`` with its surrogates restored."""
    from softq.mpc.surrogates import SurrogateSpec, configure_surrogates
    from softq.workloads import load_model

    model = load_model(path)
    spec = SurrogateSpec.from_json(model.config.softq_mpc_surrogates)
    configure_surrogates(model, softmax=spec.softmax, gelu=spec.gelu, softmax_params=spec.softmax_params)
    return model


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
    else:
        model = _load_any(args.model)
        if not args.inputs:
            raise ValueError("a model directory needs --inputs (a torch.save'd dict of input tensors)")
        inputs = torch.load(args.inputs, weights_only=True)
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


def _party(args: argparse.Namespace) -> int:
    from softq.mpc.party import run_party, settings_from_args

    result = run_party(settings_from_args(args))
    if result is not None:
        from softq.mpc.accounting import CommReport

        print(CommReport.from_dict(result["report"]).table())
        if not args.output:
            print(result["outputs"])
    return 0


def _distill(args: argparse.Namespace) -> int:
    import torch

    from softq.mpc.distill import distill
    from softq.workloads.tasks import mpc_task
    from softq.workloads import save_model

    torch.manual_seed(args.seed)
    task = mpc_task(args.model, n=args.samples, seq_len=args.seq_len)
    student, history = distill(task.model, task.train_batches(args.batch_size, args.seed),
                               softmax=_per_layer(args.softmax), gelu=_per_layer(args.gelu),
                               steps=(args.steps1, args.steps2), fit=args.fit)
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
    r.add_argument("--samples", type=int, default=32, help="held-out images / text windows (reference models)")
    r.add_argument("--seq-len", type=int, default=64, help="text window length (lm)")
    _add_surrogate_args(r)
    r.add_argument("--world-size", type=int, default=2, help="number of parties (processes)")
    r.add_argument("--provider", choices=("TFP", "TTP"), default="TFP",
                   help="Beaver triples: TFP (party 0 generates them; trusted) or TTP (separate dealer process)")
    r.add_argument("--timeout", type=float, default=120.0, help="seconds before a silent or missing party is an error")
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
    d.add_argument("--model", required=True, choices=("lm", "vit"))
    _add_surrogate_args(d)
    d.add_argument("--steps1", type=int, default=300, help="stage 1 steps (hidden states + attention maps, MSE)")
    d.add_argument("--steps2", type=int, default=300, help="stage 2 steps (logits, soft cross-entropy)")
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--samples", type=int, default=360, help="held-out samples for the before/after accuracy")
    d.add_argument("--seq-len", type=int, default=64)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--fit", action=argparse.BooleanOptionalAction, default=False,
                   help="fit Quad GELU per channel and 2Quad per head to the teacher's activations first "
                        "(exact weight rewrites, same encrypted cost; default off, see docs/results/mpc.md)")
    d.add_argument("--out", required=True, help="directory for the student")
    d.set_defaults(handler=_distill)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="softq")
    register(parser.add_subparsers(dest="command"))
    ns = parser.parse_args()
    sys.exit(int(ns.handler(ns) or 0))
