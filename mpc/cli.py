"""``softq mpc``: encrypted inference (``run``), one party of a multi-host run (``party``), distillation.

The handlers parse, call the library (:mod:`softq.mpc.inference`, :mod:`softq.mpc.text`,
:mod:`softq.mpc.students`, :mod:`softq.mpc.party`) and print; heavy imports happen inside them so that
``softq --help`` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from softq.cli import positive_float


def _run_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(softmax=args.softmax, gelu=args.gelu, world_size=args.world_size, provider=args.provider,
                timeout=args.timeout, truncation=args.truncation, range_margin=args.range_margin)


def _write_output(args: argparse.Namespace, result: Any, summary: dict[str, Any]) -> None:
    """``--output`` (the revealed outputs, the report and the summary) and ``--json`` (the summary line)."""
    if args.output:
        import torch

        torch.save({"outputs": result.outputs, "report": result.report.to_dict(), "summary": summary}, args.output)
    if args.json:
        print(json.dumps(summary))


def _run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    if args.text:
        return _run_text(args)
    from softq.mpc.inference import as_model_dir, run_model_dir

    as_model_dir(args.student or args.model)  # a missing directory is named before a missing --inputs
    if not args.inputs:
        raise ValueError("a model directory needs --inputs (a torch.save'd dict of input tensors) or, for a text "
                         "model, --text FILE")
    done = run_model_dir(args.model, args.inputs, student=args.student, **_run_options(args))
    result, summary = done.result, done.summary
    print(result.report.table("kind"))
    print()
    print(result.report.table("layer"))
    if done.task is not None:
        print(f"\n{done.task}: encrypted accuracy {summary['encrypted_accuracy']:.2f}%  plaintext "
              f"{summary['plaintext_accuracy']:.2f}%  max |logit error| {summary['max_abs_error']:.2e}  "
              f"argmax agreement {summary['argmax_agreement']:.1f}%")
    _write_output(args, result, summary)
    return 0


def _run_text(args: argparse.Namespace) -> int:
    """``softq mpc run --model DIR [--student DIR] --text FILE``: encrypted sentence embeddings of a text model."""
    from softq import corpora
    from softq.mpc.text import embed_texts

    if args.inputs:
        raise ValueError("give --inputs or --text, not both")
    # the texts are read before the models load: a bad file fails in a second
    texts = corpora.read_text_file(args.text, "--text file")[:args.samples]
    done = embed_texts(args.model, texts, student=args.student, max_length=args.seq_len, **_run_options(args))
    summary = done.summary
    print(done.result.report.table("kind"))
    what = "the student in plaintext" if args.student else \
        f"the model in plaintext with the same surrogates ({_surrogate_text(done.softmax, done.gelu)})"
    line = (f"\n{len(texts)} texts, {summary['tokens']} tokens: max |hidden-state error| {summary['max_abs_error']:.2e} and "
            f"min embedding cosine {summary['min_cosine_to_plaintext']:.6f} to {what}")
    if args.student:
        line += (f"; embedding cosine to {args.model} (the model it was distilled from): mean "
                 f"{summary['mean_cosine_to_model']:.4f}, min {summary['min_cosine_to_model']:.4f}")
    else:
        line += (f"; embedding cosine to the exact model (what the surrogates cost; softq mpc distill trains a "
                 f"student for them): mean {summary['mean_cosine_to_model']:.4f}, min {summary['min_cosine_to_model']:.4f}")
    print(line)
    _write_output(args, done.result, summary)
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


def _distill(args: argparse.Namespace) -> int:
    from softq.mpc.students import check_output_dir, distill_dir

    check_output_dir(args.out, args.overwrite)  # before any work
    student = distill_dir(args.model, args.text, args.out, eval_text=args.eval_text, init=args.init,
                          window=args.window, recombine=args.recombine, softmax=args.softmax, gelu=args.gelu,
                          steps=(args.steps1, args.steps2), batch_size=args.batch_size, seq_len=args.seq_len,
                          seed=args.seed, fit=args.fit, lr=args.lr, hidden_weight=args.hidden_weight,
                          normalize_hidden=args.normalize_hidden, overwrite=args.overwrite)
    _print_fit(student.history)
    before, after = student.cosine_before, student.cosine_after
    print(f"embedding cosine to the teacher on {student.meta['held_out_texts']} held-out texts: "
          f"{f'the student from {args.init}' if args.init else 'surrogates not distilled'} mean "
          f"{float(before.mean()):.4f} (min {float(before.min()):.4f}); distilled mean {float(after.mean()):.4f} "
          f"(min {float(after.min()):.4f})")
    print(f"student saved to {args.out}; run it with: softq mpc run --model {args.model} --student {args.out} "
          f"--text FILE")
    return 0


def _print_fit(history: Any) -> None:
    if history.fit is not None:
        print(f"fitted the surrogates to the teacher before distilling: {history.fit.summary()}")


def _add_surrogate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--softmax", default="2quad",
                   help="softmax variant: softmax (exact), 2quad, 2relu, relu_len, sigmoid_len; comma list per layer")
    p.add_argument("--gelu", default="quad",
                   help="surrogate of the model's activation: GELU models erf, tanh, quad, relu; SiLU models (Llama, "
                        "Qwen, Mistral) silu, quad, relu; or native; comma list per layer")


def register(subparsers: Any) -> None:
    mpc = subparsers.add_parser("mpc", help="private inference under CrypTen (run, party, distill)")
    sub = mpc.add_subparsers(dest="mpc_command", metavar="MPC_COMMAND")
    mpc.set_defaults(handler=lambda args: (mpc.print_help(), 2)[1])

    r = sub.add_parser("run", help="encrypted inference with every party in its own process on loopback")
    r.add_argument("--model", required=True, help="a Hugging Face model directory")
    r.add_argument("--inputs", help="torch.save'd dict of inputs (for a model directory)")
    r.add_argument("--student", help="a distilled student from `softq mpc distill` (uses its surrogates)")
    r.add_argument("--text", help="a text model directory: encrypt the embeddings of these texts (one per line, or "
                                  "JSONL with 'text'); reports the error to the plaintext model (and, with --student, "
                                  "the cosine to --model's embeddings)")
    r.add_argument("--samples", type=int, default=32, help="the first N texts of --text")
    r.add_argument("--seq-len", type=int, default=64, help="tokens per text (--text)")
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
    d.add_argument("--model", required=True, help="a Hugging Face text-model directory (the teacher)")
    _add_surrogate_args(d)
    d.add_argument("--steps1", type=int, default=300, help="stage 1 steps (hidden states + attention maps, MSE)")
    d.add_argument("--steps2", type=int, default=300,
                   help="stage 2 steps (logits: soft cross-entropy; a headless encoder: 1 - cosine of its embeddings)")
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--seq-len", type=int, default=64)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--fit", action=argparse.BooleanOptionalAction, default=None,
                   help="fit Quad GELU per channel and 2Quad per head to the teacher's activations first "
                        "(exact weight rewrites, same encrypted cost; default on)")
    d.add_argument("--text", help="distillation text, one paragraph per line (or JSONL with 'text'); "
                                  "every 10th line is held out for the before/after cosine")
    d.add_argument("--eval-text", help="held-out texts instead of every 10th line of --text")
    d.add_argument("--window", type=int, default=48, help="words per training window")
    d.add_argument("--recombine", action=argparse.BooleanOptionalAction, default=True,
                   help="train on windows of random sentences of --text (default; new contexts for "
                        "the same words) instead of its consecutive windows")
    d.add_argument("--lr", type=float, default=None,
                   help="stage-1 learning rate, stage 2 half of it (default: 2e-4 / 1e-4)")
    d.add_argument("--hidden-weight", type=float, default=None,
                   help="stage 2 also minimises this multiple of the hidden-state MSE (default 0.5)")
    d.add_argument("--normalize-hidden", action=argparse.BooleanOptionalAction, default=None,
                   help="weigh each hidden-state channel of the MSE terms by 1 / the teacher's standard deviation "
                        "(default on: better on all-MiniLM-L6-v2, docs/results/mpc.md)")
    d.add_argument("--init", metavar="DIR",
                   help="continue distilling this student (written by `softq mpc distill` from "
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
