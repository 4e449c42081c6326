"""Benchmark softq.mpc: the cost of one attention layer per softmax variant, and end-to-end runs.

Every number comes from real 2-party CrypTen runs (separate processes, gloo on
loopback, ``communicator.verbose`` on).  Rounds and bytes are party 0's counters
(in a 2-party run that is the total on the wire); "LAN"/"WAN" are the modeled
network time ``rounds x RTT + bytes / bandwidth`` (1 Gbit/s, 0.5 ms / 100 Mbit/s,
40 ms).

    python benchmarks/bench_mpc.py attention            # BERT-base attention layer, random data
    python benchmarks/bench_mpc.py e2e --models bert-tiny,vit,lm [--distill-steps 300]
    python benchmarks/bench_mpc.py minilm --runs 3      # private sentence embeddings, all-MiniLM-L6-v2
    python benchmarks/bench_mpc.py minilm-distill --steps 1000 --stage2-steps 1000 --text recombined \
        --hidden-weight 0.5   # fitted surrogates, then distilled; student cached in ~/.cache/softq
    python benchmarks/bench_mpc.py minilm-distill --steps 0 --stage2-steps 800 --text recombined --hidden-weight 0.5 \
        --init KEY   # continue the cached student KEY (see the minilm-distill-recombined* blocks)
    python benchmarks/bench_mpc.py minilm-distill ... --no-fit   # MPCFormer's plain copy as the start (earlier blocks)
    python benchmarks/bench_mpc.py minilm-distill ... --text recombined-wide   # all pydoc prose but the held-out paragraphs
    python benchmarks/bench_mpc.py truncation --exact-elements 1000000000

Results replace their marked blocks in docs/results/mpc.md (atomically).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ["softmax", "2quad", "2relu", "relu_len", "sigmoid_len"]
LABELS = {"softmax": "exact", "2quad": "2Quad", "2relu": "2ReLU", "relu_len": "ReLU/L", "sigmoid_len": "sigmoid(x - ln L)"}


RESULTS = ROOT / "docs" / "results" / "mpc.md"


def _write(section: str, text: str) -> None:
    """Replace the ``<!-- bench:section -->`` block of docs/results/mpc.md (atomically)."""
    start, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    doc = RESULTS.read_text() if RESULTS.exists() else ""
    block = f"{start}\n{text.rstrip()}\n{end}"
    if start in doc and end in doc:
        doc = doc[: doc.index(start)] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip() + "\n\n" + block + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_name(f".{RESULTS.name}.tmp{os.getpid()}")
    tmp.write_text(doc)
    os.replace(tmp, RESULTS)


# ---------------------------------------------------------------------------
# 1. One attention layer, BERT-base shape
# ---------------------------------------------------------------------------


def attention_party(rank: int, rendezvous: str, out: str, heads: int, seq: int, head_dim: int, repeats: int) -> None:
    """One party: for each variant, (a) softmax on secret scores, (b) the attention core QK^T -> softmax -> PV."""
    from softq.mpc.approx import accurate_functions
    from softq.mpc.graph import reciprocal_scale
    from softq.mpc.party import PartySettings, init_communicator
    from softq.softmax import get_softmax

    torch.set_num_threads(1)
    crypten = init_communicator(PartySettings(rank=rank, world_size=2, rendezvous=rendezvous, timeout=120))
    comm = crypten.communicator.get()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, seq, head_dim, generator=gen)
    k = torch.randn(1, heads, seq, head_dim, generator=gen)
    v = torch.randn(1, heads, seq, head_dim, generator=gen)
    scale = head_dim**-0.5
    scores = q @ k.transpose(-1, -2) * scale
    rows = []
    for name in VARIANTS:
        variant = get_softmax(name)
        for what in ("softmax", "attention"):
            best: dict[str, Any] | None = None
            for _ in range(repeats):
                with crypten.no_grad():
                    if what == "softmax":
                        x = crypten.cryptensor(scores, src=0)
                        comm.barrier()
                        comm.reset_communication_stats()
                        t0 = time.perf_counter()
                        with accurate_functions(), reciprocal_scale(name, variant.defaults, seq):
                            y = variant(x, None)
                        secs = time.perf_counter() - t0
                        stats = comm.get_communication_stats()
                        expected = variant(scores, None)
                    else:
                        qs, ks, vs = (crypten.cryptensor(t, src=0) for t in (q, k, v))
                        comm.barrier()
                        comm.reset_communication_stats()
                        t0 = time.perf_counter()
                        s = qs.matmul(ks.transpose(-1, -2)) * scale
                        with accurate_functions(), reciprocal_scale(name, variant.defaults, seq):
                            p = variant(s, None)
                        y = p.matmul(vs)
                        secs = time.perf_counter() - t0
                        stats = comm.get_communication_stats()
                        expected = variant(scores, None) @ v
                    got = y.get_plain_text()
                row = {"variant": name, "what": what, "rounds": int(stats["rounds"]), "bytes": int(stats["bytes"]),
                       "seconds": secs, "max_error": float((got - expected).abs().max())}
                if best is None or row["seconds"] < best["seconds"]:
                    best = row
            rows.append(best)
    if rank == 0:
        Path(out).write_text(json.dumps(rows, indent=1))
    comm.barrier()


def bench_attention(args: argparse.Namespace) -> None:
    from softq.mpc.accounting import NETWORK_PROFILES
    from softq.mpc.runner import free_port

    out = ROOT / "docs" / "results" / ".mpc_attention.json"
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, __file__, "_attention_party", str(r), rendezvous, str(out),
                               str(args.heads), str(args.seq), str(args.head_dim), str(args.repeats)],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in (0, 1)]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("attention benchmark: a party failed")
    rows = json.loads(out.read_text())
    out.unlink()
    lan, wan = NETWORK_PROFILES["lan"], NETWORK_PROFILES["wan"]
    exact = {r["what"]: r for r in rows if r["variant"] == "softmax"}
    lines = [
        f"Command: `python benchmarks/bench_mpc.py attention --heads {args.heads} --seq {args.seq} --head-dim {args.head_dim}`",
        f"(2 parties, TFP, exact truncation, loopback, 1 thread each; seconds = best of {args.repeats}; max error vs "
        "the same variant in plaintext float32).",
        "",
    ]
    for what, title in (("softmax", f"Softmax alone on secret scores [1, {args.heads}, {args.seq}, {args.seq}]"),
                        ("attention", f"Attention core QK^T -> softmax -> PV, Q/K/V [1, {args.heads}, {args.seq}, {args.head_dim}]")):
        lines += [f"### {title}", "",
                  "| Softmax | Rounds | MB | Seconds | LAN s | WAN s | Max error | Bytes vs exact | Rounds vs exact |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["what"] == what):
            e = exact[what]
            lines.append(
                f"| {LABELS[r['variant']]} | {r['rounds']} | {r['bytes'] / 1e6:.1f} | {r['seconds']:.2f} | "
                f"{lan.seconds(r['rounds'], r['bytes']):.2f} | {wan.seconds(r['rounds'], r['bytes']):.2f} | "
                f"{r['max_error']:.1e} | 1/{e['bytes'] / max(r['bytes'], 1):.1f} | 1/{e['rounds'] / max(r['rounds'], 1):.1f} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    _write("attention", text)


# ---------------------------------------------------------------------------
# 2. End to end
# ---------------------------------------------------------------------------

SURROGATE_SETS: list[tuple[str, str, str | None]] = [
    # (label, softmax, gelu)
    ("exact (softmax + tanh GELU)", "softmax", "tanh"),
    ("2Quad + Quad", "2quad", "quad"),
    ("2ReLU + ReLU", "2relu", "relu"),
    ("ReLU/L + ReLU", "relu_len", "relu"),
    ("sigmoid + Quad", "sigmoid_len", "quad"),
]


def _bert_tiny_task(seq: int) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    from workloads.tasks import MPCTask

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=512, max_position_embeddings=512, num_labels=2)
    model = BertForSequenceClassification(cfg).eval()
    ids = torch.randint(0, 30522, (1, seq), generator=torch.Generator().manual_seed(1))
    return MPCTask("bert-tiny", model, {"input_ids": ids, "attention_mask": torch.ones(1, seq, dtype=torch.long)},
                   torch.zeros(1, dtype=torch.long))


def _plain_logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor], softmax: str, gelu: str | None,
                  surrogates: bool = True) -> torch.Tensor:
    from softq.mpc.surrogates import configure_surrogates

    m = copy.deepcopy(model)
    if surrogates:
        configure_surrogates(m, softmax=softmax, gelu=gelu)
    with torch.no_grad():
        return m(**inputs).logits


def bench_e2e(args: argparse.Namespace) -> None:
    from softq.mpc import RangeError, run
    from softq.mpc.accounting import NETWORK_PROFILES
    from softq.mpc.distill import distill
    from workloads.tasks import mpc_task

    torch.set_num_threads(max(1, args.threads))
    lan, wan = NETWORK_PROFILES["lan"], NETWORK_PROFILES["wan"]
    sets = [s for s in SURROGATE_SETS if s[1] in args.sets.split(",")]
    lines = [
        f"Command: `python benchmarks/bench_mpc.py e2e --models {args.models} --samples {args.samples} "
        f"--seq-len {args.seq_len} --distill-steps {args.distill_steps} --sets {args.sets}{' --fit' if args.fit else ''}`",
        "",
        "2 parties (separate processes, TFP, exact truncation, loopback). *Plain* = the same surrogate model in float32 on the same "
        "batch; *enc.* = revealed encrypted logits. Accuracy: ViT top-1 on held-out digits, LM next-character "
        f"accuracy on held-out windows of {args.seq_len} characters, BERT-tiny shape has random weights (error and "
        "cost only). *Distilled* = MPCFormer two-stage distillation "
        f"({args.distill_steps} + {args.distill_steps} steps) from the plaintext exact model"
        + (", the student's Quad GELU and 2Quad softmax first fitted to the teacher's activations "
           "(`softq.mpc.distill.distill(..., fit=True)`)." if args.fit else " (a plain copy with the surrogates swapped in)."),
        "",
        "| Model | Surrogates | Distilled | Acc. plain | Acc. enc. | Max abs logit error | Argmax agree | Rounds | MB | Wall s | LAN s | WAN s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    block = f"e2e-{args.models.replace(',', '-')}" + ("" if args.sets == E2E_SETS else f"-{args.sets.replace(',', '-')}")
    for name in args.models.split(","):
        if name == "bert-tiny":
            task = _bert_tiny_task(args.bert_seq)
        else:
            task = mpc_task(name, n=args.samples, seq_len=args.seq_len)
        teacher_logits = _plain_logits(task.model, task.inputs, "softmax", None, surrogates=False)
        teacher_acc = task.accuracy(teacher_logits) if name != "bert-tiny" else float("nan")
        teacher_txt = f"{teacher_acc:.2f}" if name != "bert-tiny" else "-"
        lines.append(f"| {name} | teacher (float, native GELU) | - | {teacher_txt} | - | - | - | - | - | - | - | - |")
        for label, softmax, gelu in sets:
            variants = [(False, task.model)]
            if args.distill_steps and name != "bert-tiny" and softmax != "softmax":
                print(f"[{name}] distilling {label}", flush=True)
                student, _ = distill(task.model, task.train_batches(16, 0), softmax=softmax, gelu=gelu,
                                     steps=(args.distill_steps, args.distill_steps), fit=args.fit)
                variants.append((True, student))
            for distilled, model in variants:
                plain = _plain_logits(model, task.inputs, softmax, gelu)
                acc_plain = task.accuracy(plain) if name != "bert-tiny" else float("nan")
                if distilled or softmax == "softmax" or name == "bert-tiny" or args.encrypt_undistilled:
                    print(f"[{name}] encrypted run: {label}{' (distilled)' if distilled else ''}", flush=True)
                    t0 = time.perf_counter()
                    try:
                        res = run(model, task.inputs, softmax=softmax, gelu=gelu, timeout=600)
                    except RangeError as err:
                        reason = str(err).split(": ", 1)[1].split(" on the calibration")[0]
                        lines.append(f"| {name} | {label} | {'yes' if distilled else 'no'} | - | refused by the range "
                                     f"check: {reason} | - | - | - | - | - | - | - |")
                        print(lines[-1], flush=True)
                        continue
                    wall = time.perf_counter() - t0
                    enc = res.logits
                    err = float((enc - plain).abs().max())
                    agree = 100.0 * float((enc.argmax(-1) == plain.argmax(-1)).float().mean())
                    acc_enc = f"{task.accuracy(enc):.2f}" if name != "bert-tiny" else "-"
                    r = res.report
                    cost = (f"{r.rounds} | {r.bytes / 1e6:.1f} | {wall:.1f} | {lan.seconds(r.rounds, r.bytes):.2f} | "
                            f"{wan.seconds(r.rounds, r.bytes):.1f}")
                    row = f"{acc_enc} | {err:.1e} | {agree:.1f}% | {cost}"
                    if name == "bert-tiny" and softmax == "softmax":
                        detail = r.table("kind")
                        lines_detail.append(f"\nPer op kind, {name}, {label}:\n\n```\n{detail}\n```\n")
                else:
                    row = "(not run) | - | - | - | - | - | - | -"
                acc_p = f"{acc_plain:.2f}" if name != "bert-tiny" else "-"
                lines.append(f"| {name} | {label} | {'yes' if distilled else 'no'} | {acc_p} | {row} |")
                print(lines[-1], flush=True)
                _write(block, "\n".join(lines + lines_detail))
    text = "\n".join(lines + lines_detail) + "\n"
    print(text)
    _write(block, text)


lines_detail: list[str] = []
E2E_SETS = "softmax,2quad,2relu,relu_len,sigmoid_len"


# ---------------------------------------------------------------------------
# 3. Private sentence embeddings: all-MiniLM-L6-v2
# ---------------------------------------------------------------------------


def bench_minilm(args: argparse.Namespace) -> None:
    from softq.mpc import run
    from softq.mpc.accounting import NETWORK_PROFILES
    from workloads.mpc_demo import embedding_errors, minilm_task

    from bench_quant import command_line  # noqa: PLC0415 - benchmarks/ helper

    torch.set_num_threads(1)
    lan, wan = NETWORK_PROFILES["lan"], NETWORK_PROFILES["wan"]
    model, inputs, _ = minilm_task(args.sentences, args.seq_len)
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
    mask = inputs["attention_mask"]
    plans = [(f"exact path, run {i + 1}", "softmax", "erf", "exact") for i in range(args.runs)]
    plans.append(("exact path, probabilistic truncation (opt-in)", "softmax", "erf", "probabilistic"))
    plans.append(("2Quad + Quad, not distilled", "2quad", "quad", "exact"))
    lines = [
        f"Command: `{command_line()}`",
        "",
        f"all-MiniLM-L6-v2 (the real pretrained model, without its unused pooler), {args.sentences} paragraphs of "
        f"`pydoc_data.topics` cut to {inputs['input_ids'].shape[1]} tokens. 2 parties in separate processes (TFP, "
        "loopback): the model owner secret-shares the weights, the client the token ids (one-hot) and sees the "
        "output. Errors against the FP32 model in plaintext (native erf GELU): max abs error of "
        "`last_hidden_state` on valid tokens and the smallest cosine of the mean-pooled, L2-normalised sentence "
        "embeddings. *Trunc.* = truncated elements (one per secret product or matmul entry).",
        "",
        "| Run | Truncation | Max abs error | Min cosine | Rounds | MB | Trunc. | Wall s | LAN s | WAN s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    detail = ""
    for label, softmax, gelu, truncation in plans:
        print(f"[minilm] {label}", flush=True)
        t0 = time.perf_counter()
        res = run(model, inputs, softmax=softmax, gelu=gelu, truncation=truncation, timeout=900)
        wall = time.perf_counter() - t0
        err, cos = embedding_errors(res.outputs[0], ref, mask)
        r = res.report
        lines.append(f"| {label} | {truncation} | {err:.1e} | {cos:.6f} | {r.rounds} | {r.bytes / 1e6:.1f} | "
                     f"{r.truncations / 1e6:.2f}M | {wall:.1f} | {lan.seconds(r.rounds, r.bytes):.2f} | "
                     f"{wan.seconds(r.rounds, r.bytes):.1f} |")
        print(lines[-1], flush=True)
        if not detail:
            detail = f"\nPer op kind, exact path (run 1):\n\n```\n{r.table('kind')}\n```\n"
        _write("minilm", "\n".join(lines) + "\n" + detail)


NORMALIZED_NOTE = " (each channel divided by the teacher's standard deviation on the first {} training batches)"
DISTILL_TEXTS = {
    "prose": "the `pydoc_data.topics` prose paragraphs",
    "all": "the `pydoc_data.topics` blocks (prose, code, tables)",
    "docstrings": "the prose paragraphs of the docstrings of the standard library, numpy, torch and transformers",
    "mixed": "the `pydoc_data.topics` prose paragraphs and the prose paragraphs of the docstrings of the standard "
             "library, numpy, torch and transformers",
    "recombined": "windows of random sentences of the `pydoc_data.topics` prose paragraphs (seed 0; no sentence that "
                  "occurs in an `eval` paragraph)",
    "recombined-wide": "windows of random sentences of the `pydoc_data.topics` prose paragraphs, the `eval` split's "
                       "included except its first --eval-texts paragraphs, the held-out ones (seed 0; no sentence that "
                       "occurs in a held-out paragraph)",
}
RECOMBINED_WINDOWS = 20_000


@functools.lru_cache(maxsize=2)
def _distill_texts(window: int, source: str = "prose", held_out_texts: int = 64) -> list[str]:
    """Distillation text, cut into windows of ``window`` words, none from the ``eval`` split: the
    ``pydoc_data.topics`` paragraphs outside it, either prose only (>= 100 characters: the calibration paragraphs,
    short and long ones) or ``all`` blocks (also code listings and tables); or ``docstrings``: the prose paragraphs
    of installed code's docstrings (:func:`softq.corpora.docstring_paragraphs`), none sharing 12 words with ``eval``;
    or ``mixed``: the pydoc prose and the docstrings; or ``recombined``: ``RECOMBINED_WINDOWS`` windows of random
    sentences of the pydoc prose (new contexts for the same words), leaving out every sentence found in ``eval``;
    or ``recombined-wide``: the same from all pydoc prose except the first ``held_out_texts`` ``eval`` paragraphs (what
    the benchmark evaluates on), leaving out every sentence found in those (twice the words of ``recombined``)."""
    from pydoc_data.topics import topics

    from softq.corpora import docstring_paragraphs, pydoc_paragraphs, recombined_windows, text_split

    held_out = set(text_split("eval", held_out_texts if source == "recombined-wide" else None))
    if source in ("prose", "recombined", "recombined-wide"):
        paragraphs = pydoc_paragraphs(min_chars=100, max_chars=10**9)
    elif source in ("docstrings", "mixed"):
        paragraphs = docstring_paragraphs(exclude=held_out)
        if source == "mixed":
            paragraphs = pydoc_paragraphs(min_chars=100, max_chars=10**9) + paragraphs
    else:
        paragraphs = list(dict.fromkeys(" ".join(b.split()) for name in sorted(topics) for b in topics[name].split("\n\n")))
    if source in ("recombined", "recombined-wide"):
        return recombined_windows([p for p in paragraphs if p not in held_out], window, RECOMBINED_WINDOWS,
                                  exclude=held_out)
    texts = []
    for paragraph in paragraphs:
        if paragraph in held_out:
            continue
        words = paragraph.split()
        texts += [" ".join(words[i:i + window]) for i in range(0, len(words), window) if len(words[i:i + window]) >= 8]
    return texts


FIT_BATCHES = 8  # training batches softq.mpc.distill fits the surrogates on (its fit_batches)


def _train_batches(args: argparse.Namespace, hm: Any) -> list[dict[str, torch.Tensor]]:
    """The distillation batches in training order (shuffled with seed 0): distill fits on the first FIT_BATCHES."""
    import random

    train = hm.batches(_distill_texts(args.window, args.text, args.eval_texts), batch_size=args.batch_size, max_length=args.train_len)
    random.Random(0).shuffle(train)
    return train


def _fits(args: argparse.Namespace) -> bool:
    """Whether the student is fitted before distillation: a fresh student with --fit (a continued one keeps its weights)."""
    return bool(args.fit) and not args.init


def _short_key(key: str, limit: int = 96) -> str:
    """A cached student's key as part of another key: a chain of continuations would pass the file-name limit
    (255 bytes), so a long key is cut and tagged with a hash of the whole."""
    import hashlib

    return key if len(key) <= limit else f"{key[:limit - 13]}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def _distilled_minilm(model: torch.nn.Module, args: argparse.Namespace, hm: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The distilled 2Quad + Quad MiniLM student: from ~/.cache/softq/minilm-distill (keyed by every setting)
    or distilled now and cached there (atomically: state dict and metadata)."""
    import itertools

    from softq.mpc.distill import augment_tokens, distill
    from softq.mpc.surrogates import configure_surrogates
    from workloads import cache_dir

    steps2 = args.steps if args.stage2_steps is None else args.stage2_steps
    lr2 = args.lr / 2 if args.stage2_lr is None else args.stage2_lr
    key = (f"minilm-2quad-quad-v3-s{args.steps}-lr{args.lr:g}-s{steps2}-lr{lr2:g}-b{args.batch_size}"
           f"-len{args.train_len}-w{args.window}{'' if args.text == 'prose' else '-' + args.text}{f'{args.eval_texts}' if args.text == 'recombined-wide' else ''}-dropout{int(args.dropout)}"
           f"{f'-hw{args.hidden_weight:g}' if args.hidden_weight else ''}{f'-aug{args.augment:g}' if args.augment else ''}"
           f"{'-nh' if args.normalize_hidden else ''}{f'-from-{_short_key(args.init)}' if args.init else ''}"
           f"{'-fit' if _fits(args) else ''}-seed0")
    folder = cache_dir() / "minilm-distill"
    path = folder / f"{key}.pt"

    def load(file: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
        saved = torch.load(file, map_location="cpu", weights_only=True)
        student = copy.deepcopy(model)
        configure_surrogates(student, softmax="2quad", gelu="quad")
        student.load_state_dict(saved["state_dict"])
        print(f"[minilm-distill] loaded the student from {file}", flush=True)
        return student.eval(), saved["meta"]

    if path.exists() and not args.force:
        return load(path)
    init, init_meta = None, None
    if args.init:
        if not (folder / f"{args.init}.pt").exists():
            raise SystemExit(f"--init: no cached student {args.init!r} in {folder} (run its minilm-distill command first)")
        init, init_meta = load(folder / f"{args.init}.pt")
    texts = _distill_texts(args.window, args.text, args.eval_texts)
    train = _train_batches(args, hm)
    batches = itertools.cycle(train)
    if args.augment:  # the unigram distribution of the training windows' words; special tokens stay
        special = hm.tokenizer.all_special_ids
        ids = torch.cat([b["input_ids"][b["attention_mask"].bool()] for b in train])
        pool = ids[~torch.isin(ids, torch.tensor(special))]
        skip = FIT_BATCHES if _fits(args) else 0  # the surrogates are fitted on the plain first batches
        batches = itertools.chain(train[:skip], augment_tokens(itertools.islice(batches, skip, None), args.augment,
                                                               seed=0, pool=pool, keep=special))
    t0 = time.perf_counter()
    student, hist = distill(model, batches, softmax="2quad", gelu="quad",
                            steps=(args.steps, steps2), lr=(args.lr, lr2), dropout=args.dropout,
                            stage2_hidden_weight=args.hidden_weight, student=init, fit=_fits(args),
                            fit_batches=FIT_BATCHES, normalize_hidden=args.normalize_hidden)
    meta = {"fit": hist.fit.summary() if hist.fit is not None else None,
            "minutes": (time.perf_counter() - t0) / 60, "stage1": hist.stage1, "stage2": hist.stage2,
            "init_minutes": init_meta["minutes"] + init_meta.get("init_minutes", 0.0) if init_meta else 0.0,
            "steps": (args.steps, steps2), "lr": (args.lr, lr2), "texts": len(texts), "words": sum(len(t.split()) for t in texts)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save({"state_dict": student.state_dict(), "meta": meta}, tmp)
    os.replace(tmp, path)
    print(f"[minilm-distill] saved the student to {path}", flush=True)
    return student, meta


def _loss_trace(losses: list[float], points: int = 5) -> str:
    """Loss at a few evenly spaced steps (mean of the 10 steps up to each), e.g. ``2.9 -> 0.8 -> 0.5``."""
    if not losses:
        return "-"
    ends = sorted({max(1, round(len(losses) * k / (points - 1))) for k in range(points)})
    return " -> ".join(f"{sum(losses[max(0, e - 10):e]) / len(losses[max(0, e - 10):e]):.4g}" for e in ends)


def bench_minilm_distill(args: argparse.Namespace) -> None:
    """MPCFormer distillation of MiniLM to 2Quad + Quad on pydoc text (no labels), then cost vs the exact path."""
    from softq.corpora import text_split
    from softq.hf import load_minilm
    from softq.mpc import run
    from workloads.mpc_demo import embedding_errors, minilm_task
    from softq.mpc.distill import NORM_BATCHES
    from softq.mpc.surrogates import configure_surrogates

    from bench_quant import command_line  # noqa: PLC0415 - benchmarks/ helper

    torch.set_num_threads(max(1, args.threads))
    model, inputs, _ = minilm_task(args.sentences, args.seq_len)
    hm = load_minilm()
    evals = hm.batches(text_split("eval", args.eval_texts), batch_size=32, max_length=args.train_len)

    def cosines(m: torch.nn.Module) -> torch.Tensor:
        return torch.nn.functional.cosine_similarity(hm.encode(evals, m), hm.encode(evals, model))

    undistilled = copy.deepcopy(model)
    configure_surrogates(undistilled, softmax="2quad", gelu="quad")
    student, meta = _distilled_minilm(model, args, hm)
    fitted_note = ""
    if _fits(args):  # the same fit distill made, on the same first training batches, without the distillation
        from softq.mpc.fit import fit_surrogates

        fitted = copy.deepcopy(undistilled)
        fit_surrogates(fitted, model, _train_batches(args, hm)[:FIT_BATCHES])
        cos_fitted = cosines(fitted)
        fitted_note = (f"; fitted (`softq.mpc.fit.fit_surrogates` on the first {FIT_BATCHES} training batches: "
                       f"{meta.get('fit') or '-'}), not distilled: mean {float(cos_fitted.mean()):.4f} "
                       f"(min {float(cos_fitted.min()):.4f})")
    (steps1, steps2), (lr1, lr2), hist1, hist2 = meta["steps"], meta["lr"], meta["stage1"], meta["stage2"]
    cos_before, cos_after = cosines(undistilled), cosines(student)
    texts = _distill_texts(args.window, args.text, args.eval_texts)
    seen = hm.batches(texts[::max(1, len(texts) // args.eval_texts)][:args.eval_texts], batch_size=32,
                      max_length=args.train_len)
    cos_seen = torch.nn.functional.cosine_similarity(hm.encode(seen, student), hm.encode(seen, model))
    print(f"[minilm-distill] plaintext cosine on {args.eval_texts} eval paragraphs: not distilled mean "
          f"{float(cos_before.mean()):.4f}; distilled mean {float(cos_after.mean()):.4f} (min {float(cos_after.min()):.4f}); "
          f"on {len(cos_seen)} of its training windows mean {float(cos_seen.mean()):.4f}", flush=True)
    continued = f", continuing the student `{args.init}` (earlier {meta['init_minutes']:.1f} min)" if args.init else ""
    lines = [
        f"Command: `{command_line()}`",
        "",
        f"Student: all-MiniLM-L6-v2 with 2Quad softmax and Quad GELU in every layer, distilled from the FP32 model "
        f"on {DISTILL_TEXTS[args.text].replace('--eval-texts', str(args.eval_texts))}"
        f"{'' if args.text == 'recombined-wide' else ' outside the `eval` split'} ({meta['texts']} windows of <= {args.window} "
        f"words, {meta['words']} words; no labels; {args.train_len} tokens, batch {args.batch_size}, "
        f"{f'{args.augment:g} of the words replaced by words drawn from the training text, new draws every step, ' if args.augment else ''}"
        f"{'no dropout' if not args.dropout else 'dropout on'}): stage 1 MSE on hidden states"
        f"{NORMALIZED_NOTE.format(NORM_BATCHES) if args.normalize_hidden else ''} and attention maps "
        f"({steps1} steps, lr {lr1:g}), stage 2 1 - cosine of the pooled embeddings"
        f"{f' + {args.hidden_weight:g} x hidden-state MSE' if args.hidden_weight else ''}"
        f"{' (normalised the same way)' if args.normalize_hidden and args.hidden_weight else ''} ({steps2} steps, lr {lr2:g}), "
        f"AdamW, cosine schedule; {meta['minutes']:.1f} min on {args.threads} thread(s) (cached afterwards)"
        f"{continued}. "
        f"Plaintext cosine to the FP32 embeddings on {args.eval_texts} `eval` paragraphs: not distilled mean "
        f"{float(cos_before.mean()):.4f} (min {float(cos_before.min()):.4f}){fitted_note}; distilled mean "
        f"{float(cos_after.mean()):.4f} (min {float(cos_after.min()):.4f}); on {len(cos_seen)} of the student's training "
        f"windows (evenly spaced) mean {float(cos_seen.mean()):.4f}. Stage losses first -> last: "
        f"{_loss_trace(hist1)}; {_loss_trace(hist2)}.",
    ]
    fitted_lineage = _fits(args) or bool(args.init and "-fit-" in args.init)  # fitted, or continuing a fitted student
    block = args.block or (("minilm-distill" if args.text == "prose" else f"minilm-distill-{args.text}")
                           + ("-fit" if fitted_lineage else "") + ("-continued" if args.init and fitted_lineage else ""))
    if args.encrypt:
        with torch.no_grad():
            ref = model(**inputs).last_hidden_state
        rows = []
        for label, m, softmax, gelu in (("exact path", model, "softmax", "erf"), ("2Quad + Quad, distilled", student, "2quad", "quad")):
            print(f"[minilm-distill] encrypted run: {label}", flush=True)
            res = run(m, inputs, softmax=softmax, gelu=gelu, timeout=900)
            rows.append((label, res, embedding_errors(res.outputs[0], ref, inputs["attention_mask"])))
        exact = rows[0][1].report
        lines += [
            "",
            "Encrypted (2 parties, TFP, exact truncation) on the benchmark's "
            f"{args.sentences} x {inputs['input_ids'].shape[1]} tokens; cosine to the FP32 model:",
            "",
            "| Model | Min cosine | Rounds | MB | Bytes vs exact | Rounds vs exact | LAN s | WAN s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, res, (err, cos) in rows:
            r = res.report
            lines.append(f"| {label} | {cos:.4f} | {r.rounds} | {r.bytes / 1e6:.1f} | 1/{exact.bytes / r.bytes:.1f} | "
                         f"1/{exact.rounds / r.rounds:.2f} | {r.modeled_seconds('lan'):.2f} | {r.modeled_seconds('wan'):.1f} |")
        for label, res, _ in rows:
            lines += ["", f"Per op kind, {label}:", "", "```", res.report.table("kind"), "```"]
    elif args.block is None:  # a plaintext-only run writes nothing unless it is given a block of its own
        return
    text = "\n".join(lines) + "\n"
    print(text)
    _write(block, text)


# ---------------------------------------------------------------------------
# 4. Truncation failures per multiplication
# ---------------------------------------------------------------------------


def truncation_party(rank: int, rendezvous: str, out: str, magnitude: float, chunk: int,
                     exact_elements: int, probabilistic_elements: int) -> None:
    """One party: truncate ``x * 1.0`` (one product per element) in both modes; count elements off by > 1."""
    from softq.mpc.party import PartySettings, init_communicator
    from softq.mpc.truncation import STATS, set_truncation

    torch.set_num_threads(1)
    crypten = init_communicator(PartySettings(rank=rank, world_size=2, rendezvous=rendezvous, timeout=300))
    comm = crypten.communicator.get()
    rows = []
    for mode, total in (("probabilistic", probabilistic_elements), ("exact", exact_elements)):
        set_truncation(mode)
        STATS.reset()
        comm.reset_communication_stats()
        gen = torch.Generator().manual_seed(0)
        bad, abs_sum, worst_small, worst = 0, 0.0, 0.0, 0.0
        t0 = time.perf_counter()
        rounds = nbytes = 0
        for start in range(0, total, chunk):
            v = (torch.rand(min(chunk, total - start), generator=gen) * 2 - 1) * magnitude
            x = crypten.cryptensor(v, src=0)
            s0 = comm.get_communication_stats()
            y = x * 1.0
            s1 = comm.get_communication_stats()
            rounds += s1["rounds"] - s0["rounds"]
            nbytes += s1["bytes"] - s0["bytes"]
            err = (y.get_plain_text() - v).abs()
            wrong = err > 1.0
            bad += int(wrong.sum())
            worst = max(worst, float(err.max()))
            worst_small = max(worst_small, float(err[~wrong].max()))
            abs_sum += float(v.abs().double().sum())
        rows.append({"mode": mode, "elements": STATS.elements, "bad": bad, "abs_sum": abs_sum, "worst": worst,
                     "worst_small": worst_small, "seconds": time.perf_counter() - t0, "rounds": rounds,
                     "bytes": nbytes})
    if rank == 0:
        Path(out).write_text(json.dumps(rows, indent=1))
    comm.barrier()


def bench_truncation(args: argparse.Namespace) -> None:
    from softq.mpc.runner import free_port

    from bench_quant import command_line  # noqa: PLC0415 - benchmarks/ helper

    out = ROOT / "docs" / "results" / ".mpc_truncation.json"
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, __file__, "_truncation_party", str(r), rendezvous, str(out),
                               str(args.magnitude), str(args.chunk), str(args.exact_elements),
                               str(args.probabilistic_elements)],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in (0, 1)]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("truncation benchmark: a party failed")
    rows = json.loads(out.read_text())
    out.unlink()
    lines = [
        f"Command: `{command_line()}`",
        "",
        f"2 parties (separate processes, TFP, loopback). Each element is one secret product `x * 1.0` of a value "
        f"drawn uniformly from [-{args.magnitude:g}, {args.magnitude:g}], truncated from scale 2^32 to 2^16 and "
        "revealed; *wrong* = off by more than 1.0 (a failed truncation is off by about 2^32 = 4.3e9). Expected "
        "failures of CrypTen's local truncation: sum |v| * 2^32 / 2^64. Rounds and bytes: party 0's counters for "
        "the truncations (and the public multiplication) only, per chunk of "
        f"{args.chunk:,} elements.",
        "",
        "| Truncation | Elements | Wrong (> 1.0) | Expected sum\\|v\\|/2^32 | Rate per element | Largest error | "
        "Largest error of the others | Rounds per chunk | Bytes per element | Seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        chunks = max(1, -(-r["elements"] // args.chunk))
        lines.append(f"| {r['mode']} | {r['elements']:,} | {r['bad']} | {r['abs_sum'] / 2**32:.1f} | "
                     f"{r['bad'] / max(r['elements'], 1):.1e} | {r['worst']:.3g} | {r['worst_small']:.1e} | "
                     f"{r['rounds'] / chunks:.0f} | {r['bytes'] / max(r['elements'], 1):.1f} | {r['seconds']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    _write("truncation", text)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_truncation_party":
        r, rdv, out, mag, chunk, ne, npb = sys.argv[2:9]
        truncation_party(int(r), rdv, out, float(mag), int(chunk), int(ne), int(npb))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_attention_party":
        r, rdv, out, h, s, d, rep = sys.argv[2:9]
        attention_party(int(r), rdv, out, int(h), int(s), int(d), int(rep))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    a = sub.add_parser("attention")
    a.add_argument("--heads", type=int, default=12)
    a.add_argument("--seq", type=int, default=128)
    a.add_argument("--head-dim", type=int, default=64)
    a.add_argument("--repeats", type=int, default=2)
    e = sub.add_parser("e2e")
    e.add_argument("--models", default="bert-tiny,vit,lm")
    e.add_argument("--samples", type=int, default=64)
    e.add_argument("--seq-len", type=int, default=64)
    e.add_argument("--bert-seq", type=int, default=128)
    e.add_argument("--distill-steps", type=int, default=300)
    e.add_argument("--sets", default=E2E_SETS)
    e.add_argument("--encrypt-undistilled", action="store_true", help="also run the undistilled surrogates encrypted")
    e.add_argument("--threads", type=int, default=1)
    e.add_argument("--fit", action=argparse.BooleanOptionalAction, default=False,
                   help="fit the students' surrogates to the teacher before distilling (softq.mpc.distill.distill(..., fit=True))")
    m = sub.add_parser("minilm")
    m.add_argument("--runs", type=int, default=3, help="repeated exact-path runs")
    m.add_argument("--sentences", type=int, default=2)
    m.add_argument("--seq-len", type=int, default=32)
    md = sub.add_parser("minilm-distill")
    md.add_argument("--steps", type=int, default=300, help="steps per distillation stage")
    md.add_argument("--lr", type=float, default=2e-4)
    md.add_argument("--batch-size", type=int, default=16)
    md.add_argument("--train-len", type=int, default=64)
    md.add_argument("--eval-texts", type=int, default=64)
    md.add_argument("--sentences", type=int, default=2)
    md.add_argument("--seq-len", type=int, default=32)
    md.add_argument("--threads", type=int, default=2)
    md.add_argument("--stage2-steps", type=int, default=None, help="stage-2 steps (default: --steps)")
    md.add_argument("--stage2-lr", type=float, default=None, help="stage-2 learning rate (default: --lr / 2)")
    md.add_argument("--window", type=int, default=48, help="words per training text window")
    md.add_argument("--text", choices=tuple(DISTILL_TEXTS), default="prose",
                    help="distillation text outside the eval split: " + "; ".join(f"{k}: {v}" for k, v in DISTILL_TEXTS.items()))
    md.add_argument("--hidden-weight", type=float, default=0.0,
                    help="stage 2 also minimises this multiple of the hidden-state MSE")
    md.add_argument("--normalize-hidden", action=argparse.BooleanOptionalAction, default=False,
                    help="divide each hidden-state channel by the teacher's standard deviation in the MSE terms "
                         "(softq.mpc.distill.distill(..., normalize_hidden=True))")
    md.add_argument("--init", default=None, metavar="KEY",
                    help="continue from the cached student KEY (a file stem in ~/.cache/softq/minilm-distill)")
    md.add_argument("--encrypt", action=argparse.BooleanOptionalAction, default=True,
                    help="run the encrypted comparison and write the results block (--no-encrypt: plaintext cosines only)")
    md.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=False,
                    help="keep dropout on while distilling (default off: fit the deterministic teacher)")
    md.add_argument("--augment", type=float, default=0.0, metavar="RATE",
                    help="replace this fraction of each training window's words (not [CLS]/[SEP]) by tokens drawn "
                         "from the training text, new draws every step (softq.mpc.distill.augment_tokens)")
    md.add_argument("--force", action="store_true", help="distill again even if the student is cached")
    md.add_argument("--block", default=None, metavar="NAME",
                    help="the docs/results/mpc.md block to write (default: named after --text and --fit; a "
                         "--no-encrypt run writes its plaintext cosines only when given one)")
    md.add_argument("--fit", action=argparse.BooleanOptionalAction, default=True,
                    help="fit the fresh student's surrogates to the teacher first (softq.mpc.distill.distill(..., fit=True); "
                         "--no-fit: MPCFormer's plain copy, the earlier blocks)")
    t = sub.add_parser("truncation")
    t.add_argument("--magnitude", type=float, default=1000.0)
    t.add_argument("--chunk", type=int, default=10_000_000)
    t.add_argument("--exact-elements", type=int, default=1_000_000_000)
    t.add_argument("--probabilistic-elements", type=int, default=200_000_000)
    args = parser.parse_args()
    if args.what == "minilm-distill" and not args.hidden_weight >= 0:
        parser.error(f"--hidden-weight must be >= 0, got {args.hidden_weight}")
    if args.what == "minilm-distill" and not 0 <= args.augment < 1:
        parser.error(f"--augment must be in [0, 1), got {args.augment}")
    {"attention": bench_attention, "e2e": bench_e2e, "minilm": bench_minilm, "minilm-distill": bench_minilm_distill,
     "truncation": bench_truncation}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
