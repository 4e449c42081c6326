"""Surrogate students: distil one, write it as a model directory, load it back, distil it further.

What ``softq mpc distill`` does, as a function: :func:`distill_dir` distils a Hugging Face text encoder's
directory on a text file, no labels needed (the teacher's own embeddings are the targets).  A student's config
records its surrogates (``softq_mpc_surrogates``), so loading it (:func:`softq.mpc.text.load_text_model`) gives back
the model that was measured; it also holds ``softq_student.json``, how it was made.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from softq import corpora
from softq.mpc.distill import DistillHistory, distill
from softq.mpc.surrogates import configure_surrogates, surrogate_choice
from softq.mpc.text import load_text_model


@dataclass
class DistilledStudent:
    """What a distillation wrote: the student's directory and model, its record and the loss curves."""

    path: Path
    model: nn.Module
    meta: dict[str, Any]  # softq_student.json of a model directory's student; the reference models' save_model meta
    history: DistillHistory
    # a model directory's student: the embedding cosine to the teacher on each held-out text, before and after
    cosine_before: torch.Tensor | None = None
    cosine_after: torch.Tensor | None = None


def check_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """``out`` where a student will be written, checked before any work: a student is never written over something
    without ``overwrite``, nor started where it cannot be written."""
    from softq._files import check_writable_parent

    out = Path(out)
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise FileExistsError(f"--out {out} already exists; pass --overwrite to replace it")
    check_writable_parent(out)
    return out


def has_surrogates(path: str | os.PathLike) -> bool:
    """Whether the model directory's config records surrogates (a student's does)."""
    return "softq_mpc_surrogates" in json.loads((Path(path) / "config.json").read_text())


def init_student(path: str | os.PathLike, teacher: Any) -> tuple[Any, dict[str, Any]]:
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


def save_student_dir(student: Any, path: str | os.PathLike, source: str | os.PathLike, meta: dict[str, Any]) -> Path:
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


def distill_dir(model: str | os.PathLike, text: str | os.PathLike, out: str | os.PathLike, *,
                eval_text: str | os.PathLike | None = None, init: str | os.PathLike | None = None,
                softmax: Any = "2quad", gelu: Any = "quad", steps: tuple[int, int] = (300, 300),
                batch_size: int = 16, seq_len: int = 64, window: int = 48, recombine: bool = True,
                lr: float | None = None, hidden_weight: float | None = None, fit: bool | None = None,
                normalize_hidden: bool | None = None, seed: int = 0, overwrite: bool = False,
                progress: bool = True) -> DistilledStudent:
    """A surrogate student of the text model directory ``model``, distilled on the text file ``text`` (one
    paragraph per line, or JSONL with a ``text`` field) and written to ``out``, no labels needed.

    The teacher's own outputs are the targets (stage 2: ``1 - cosine`` of the pooled embeddings for a headless
    encoder, plus ``hidden_weight`` x the hidden-state MSE).  Every 10th line of ``text`` is held out (or the
    lines of ``eval_text``); the student never sees those lines or any sentence in them, and the cosine of its
    embeddings to the teacher's on them is measured before and after (:attr:`DistilledStudent.cosine_before` /
    ``cosine_after``).  Defaults are the recipe measured on all-MiniLM-L6-v2 (docs/results/mpc.md): fitted
    surrogates (``fit``), windows of ``window`` words of random sentences (``recombine``; else consecutive
    windows), hidden-state term 0.5 with each channel normalised by the teacher's spread (``hidden_weight``,
    ``normalize_hidden``), no dropout, ``lr`` 2e-4 for stage 1 and half of it for stage 2.  ``init``: a student
    of ``model`` written here before, distilled further (its surrogates are kept; ``softmax``, ``gelu`` and
    ``fit`` do not apply).  ``steps``: (stage 1, stage 2) steps of ``batch_size`` windows of at most ``seq_len``
    tokens.  Writes ``out`` (refused if it exists, unless ``overwrite``) with ``softq_student.json``.
    """
    check_output_dir(out, overwrite)
    if not text:
        raise ValueError("a model directory needs --text FILE: the distillation text (one paragraph per line, or JSONL "
                         "with a 'text' field)")
    for flag, value in (("--window", window), ("--batch-size", batch_size), ("--seq-len", seq_len)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    torch.manual_seed(seed)
    loaded = load_text_model(model, seq_len)
    if getattr(loaded.model.config, "softq_mpc_surrogates", None):
        raise ValueError(f"{model} is already a surrogate student; distill from the model it came from")
    start_from, init_meta = init_student(init, loaded.model) if init else (None, {})
    lines = corpora.read_text_file(text, "--text file")
    if eval_text:
        held, train = corpora.read_text_file(eval_text, "--eval-text file"), lines
    else:
        if len(lines) < 2:
            raise ValueError(f"{text}: one line; give at least 2 (every 10th is held out) or --eval-text")
        held, train = lines[::10], [t for i, t in enumerate(lines) if i % 10]
    held_set = set(held)
    train = [t for t in train if t not in held_set]
    if not train:
        raise ValueError(f"{text}: no training line is left outside the held-out text")
    steps = tuple(steps)
    if recombine:  # the same words in new contexts: the lever that helped most on a small corpus
        windows = corpora.recombined_windows(train, window, max(1, sum(steps)) * batch_size, exclude=held, seed=seed)
    else:
        windows = corpora.text_windows(train, window)
    batches = loaded.batches(windows, batch_size=batch_size, max_length=seq_len)
    random.Random(seed).shuffle(batches)
    evals = loaded.batches(held, batch_size=32, max_length=seq_len)
    ref = loaded.encode(evals)

    def cosine(candidate: Any) -> torch.Tensor:
        return torch.nn.functional.cosine_similarity(loaded.encode(evals, candidate), ref)

    if start_from is None:  # where distillation starts: the teacher with the surrogates, or the student to continue
        start = copy.deepcopy(loaded.model)
        configure_surrogates(start, softmax=surrogate_choice(softmax), gelu=surrogate_choice(gelu))
        before = cosine(start)
        del start
    else:
        before = cosine(start_from)  # before distill trains it in place
    lr = lr if lr is not None else 2e-4
    student, history = distill(loaded.model, itertools.cycle(batches), softmax=surrogate_choice(softmax),
                               gelu=surrogate_choice(gelu), steps=steps, lr=(lr, lr / 2), dropout=False,
                               stage2_hidden_weight=0.5 if hidden_weight is None else hidden_weight,
                               fit=fit is not False and start_from is None,
                               normalize_hidden=normalize_hidden is not False,
                               student=start_from, progress=progress)
    after = cosine(student)
    meta = {"kind": "mpc-student", "teacher": str(model), "softmax": init_meta.get("softmax", softmax),
            "gelu": init_meta.get("gelu", gelu), "init": str(init) if init else None,
            "earlier_steps": [*init_meta.get("earlier_steps", []), init_meta["steps"]] if "steps" in init_meta else [],
            "steps": list(steps), "lr": [lr, lr / 2], "fit": history.fit is not None, "text": str(text),
            "normalize_hidden": normalize_hidden is not False,
            "windows": len(windows), "recombine": recombine, "held_out_texts": len(held),
            "cosine_before": float(before.mean()), "cosine_after": float(after.mean()),
            "cosine_after_min": float(after.min())}
    path = save_student_dir(student, out, model, meta)
    return DistilledStudent(path, student, meta, history, before, after)
