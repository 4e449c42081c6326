"""The reference models (``lm``, ``vit``) under MPC: an encrypted run on held-out data measured against the same
model in plaintext, and a surrogate student distilled on the model's own training data.  Students are written
with :func:`workloads.save_model` (``weights.pt``: gates and surrogates kept) and read back by
:func:`load_student`."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from softq.mpc.distill import distill
from softq.mpc.inference import EncryptedRun, _run, _summary
from softq.mpc.students import DistilledStudent, check_output_dir
from softq.mpc.surrogates import configure_surrogates, restore_surrogates, surrogate_choice


def load_student(path: str | os.PathLike) -> Any:
    """Load a student written by :func:`distill_reference`, with its surrogates restored."""
    from workloads import load_model

    return restore_surrogates(load_model(path))


def run_reference(name: str, *, student: str | os.PathLike | None = None, samples: int = 32, seq_len: int = 64,
                  softmax: Any = "2quad", gelu: Any = "quad", **run_options: Any) -> EncryptedRun:
    """The reference model ``name`` (``lm`` or ``vit``; ``student``: a student of it written by
    :func:`distill_reference`, with its own surrogates) run encrypted on ``samples`` held-out images or
    text windows of ``seq_len`` characters, and measured against the same model and surrogates in plaintext.

    ``softmax`` / ``gelu``: as for :func:`softq.mpc.run`, or spelt as the command line spells them (``"native"``,
    comma lists); ``run_options`` go to :func:`softq.mpc.run`.
    """
    from workloads.tasks import mpc_task

    task = mpc_task(name, n=samples, seq_len=seq_len)
    model, inputs = task.model, task.inputs
    if student:
        model = load_student(student)
    result, softmax, gelu = _run(model, inputs, bool(student), softmax, gelu, run_options)
    summary = _summary(result)
    ref = copy.deepcopy(model)
    if not student:
        configure_surrogates(ref, softmax=softmax, gelu=gelu)
    with torch.no_grad():
        plain = ref(**inputs).logits
    enc = result.logits
    summary.update(
        encrypted_accuracy=task.accuracy(enc), plaintext_accuracy=task.accuracy(plain),
        max_abs_error=float((enc - plain).abs().max()),
        argmax_agreement=100.0 * float((enc.argmax(-1) == plain.argmax(-1)).float().mean()),
    )
    return EncryptedRun(result, summary, task.name)



def distill_reference(name: str, out: str | os.PathLike, *, softmax: Any = "2quad", gelu: Any = "quad",
                      steps: tuple[int, int] = (300, 300), batch_size: int = 16, samples: int = 360, seq_len: int = 64,
                      lr: float | None = None, hidden_weight: float | None = None, fit: bool | None = None,
                      normalize_hidden: bool | None = None, seed: int = 0, overwrite: bool = False,
                      progress: bool = True) -> DistilledStudent:
    """A surrogate student of the reference model ``name`` (``lm`` or ``vit``), distilled on its own training data
    and written to ``out`` (refused if it exists, unless ``overwrite``) with ``workloads.save_model``.

    The teacher's, the undistilled surrogates' and the student's plaintext accuracy on ``samples`` held-out
    samples are in the returned ``meta`` (``teacher_accuracy``, ``before``, ``after``).  ``lr``: stage 1's
    learning rate, stage 2 half of it (default 1e-3 / 3e-4); ``hidden_weight``, ``fit`` and ``normalize_hidden``
    are off unless given (see :func:`softq.mpc.distill.distill`).
    """
    check_output_dir(out, overwrite)
    from workloads import save_model
    from workloads.tasks import mpc_task

    torch.manual_seed(seed)
    task = mpc_task(name, n=samples, seq_len=seq_len)
    lrs = (1e-3, 3e-4) if lr is None else (lr, lr / 2)
    student, history = distill(task.model, task.train_batches(batch_size, seed),
                               softmax=surrogate_choice(softmax), gelu=surrogate_choice(gelu),
                               steps=tuple(steps), fit=bool(fit), lr=lrs,
                               stage2_hidden_weight=hidden_weight or 0.0,
                               normalize_hidden=bool(normalize_hidden), progress=progress)
    with torch.no_grad():
        before_model = copy.deepcopy(task.model)
        configure_surrogates(before_model, softmax=surrogate_choice(softmax), gelu=surrogate_choice(gelu))
        teacher_acc = task.accuracy(task.model(**task.inputs).logits)
        before = task.accuracy(before_model(**task.inputs).logits)
        after = task.accuracy(student(**task.inputs).logits)
    meta = {"kind": f"mpc-student-{task.name}", "softmax": softmax, "gelu": gelu,
            "steps": list(steps), "fit": fit, "teacher_accuracy": teacher_acc,
            "before": before, "after": after, "stage1_final_loss": history.stage1[-1:] or None,
            "stage2_final_loss": history.stage2[-1:] or None}
    save_model(student, out, task.tokenizer, meta)
    return DistilledStudent(Path(out), student, meta, history)
