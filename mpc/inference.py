"""Encrypted inference of a reference model, or of a model directory on saved inputs, as ``softq mpc run`` does it.

:func:`run_reference` runs ``lm`` / ``vit`` (or a student of one) encrypted on held-out data and compares it with
the same model in plaintext (accuracy, logit error, argmax agreement); :func:`run_model_dir` runs a model
directory (softq's ``save_model`` or Hugging Face ``save_pretrained``) on a ``torch.save``'d dict of inputs, which
are checked against the model before any party starts.  A text model's sentence embeddings are
:func:`softq.mpc.text.embed_texts`'s.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from softq._files import error_line
from softq.mpc.runner import MPCResult, run
from softq.mpc.students import has_surrogates, load_student
from softq.mpc.surrogates import SurrogateSpec, configure_surrogates, surrogate_choice
from softq.mpc.text import drop_unused_pooler


@dataclass
class EncryptedRun:
    """An encrypted run and the figures ``softq mpc run --json`` prints: ``rounds``, ``bytes``, ``wall_seconds``; a
    reference task adds ``encrypted_accuracy``, ``plaintext_accuracy``, ``max_abs_error``, ``argmax_agreement``."""

    result: MPCResult
    summary: dict[str, Any]
    task: str | None = None  # the reference task's name


def as_model_dir(model: str | os.PathLike) -> Path:
    """``model`` as a model directory, or one line saying it is neither a reference model nor a directory."""
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"{model} is neither 'lm', 'vit' nor a model directory")
    return path


def load_any_model(model: str | os.PathLike) -> Any:
    """A model directory (softq save_model or Hugging Face save_pretrained)."""
    path = as_model_dir(model)
    if (path / "weights.pt").is_file():
        from softq.workloads import load_model

        return load_student(path) if has_surrogates(path) else load_model(path)
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

    drop_unused_pooler(model, sentence_pooling(path)[0])
    return model


def read_inputs(path: str | os.PathLike) -> dict:
    """``--inputs``: a torch.save'd dict of input tensors (one line if it is not)."""
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


def check_inputs(inputs: dict, path: str | os.PathLike, model: Any) -> None:
    """``--inputs`` against the model: its main input present, ids in its vocabulary, shapes it takes."""
    from softq.calib.data import check_batch

    main = getattr(model, "main_input_name", "input_ids")
    if main not in inputs:
        raise ValueError(f"--inputs {path} has no '{main}' (keys: {', '.join(map(str, inputs))})")
    check_batch(model, inputs, what="--inputs", index=path)


def _run(model: Any, inputs: dict, student: bool, softmax: Any, gelu: Any, run_options: dict[str, Any]
         ) -> tuple[MPCResult, Any, Any]:
    """The encrypted run with a student's own surrogates, else the ones asked for; and those surrogates."""
    softmax, gelu = surrogate_choice(softmax), surrogate_choice(gelu)
    if student:
        spec = SurrogateSpec.from_json(model.config.softq_mpc_surrogates)
        softmax, gelu = spec.softmax, spec.gelu
    return run(model, inputs, softmax=softmax, gelu=gelu, **run_options), softmax, gelu


def _summary(result: MPCResult) -> dict[str, Any]:
    return {"rounds": result.report.rounds, "bytes": result.report.bytes, "wall_seconds": result.wall_seconds}


def run_reference(name: str, *, student: str | os.PathLike | None = None, samples: int = 32, seq_len: int = 64,
                  softmax: Any = "2quad", gelu: Any = "quad", **run_options: Any) -> EncryptedRun:
    """The reference model ``name`` (``lm`` or ``vit``; ``student``: a student of it written by
    :func:`softq.mpc.distill_reference`, with its own surrogates) run encrypted on ``samples`` held-out images or
    text windows of ``seq_len`` characters, and measured against the same model and surrogates in plaintext.

    ``softmax`` / ``gelu``: as for :func:`softq.mpc.run`, or spelt as the command line spells them (``"native"``,
    comma lists); ``run_options`` go to :func:`softq.mpc.run`.
    """
    from softq.workloads.tasks import mpc_task

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


def run_model_dir(model: str | os.PathLike, inputs: str | os.PathLike, *, student: str | os.PathLike | None = None,
                  softmax: Any = "2quad", gelu: Any = "quad", **run_options: Any) -> EncryptedRun:
    """The model directory ``model`` (or ``student``, a student of it written by ``softq mpc distill``, with its
    own surrogates) run encrypted on ``inputs``, a ``torch.save``'d dict of input tensors (e.g. a tokenizer's
    output), which is read and checked against the model (main input present, ids in the vocabulary, shapes it
    takes) before any party starts.  ``softmax`` / ``gelu`` and ``run_options`` as for :func:`run_reference`.
    """
    path = as_model_dir(student or model)
    batch = read_inputs(inputs)  # a bad file fails before the model loads
    loaded = load_any_model(path)
    check_inputs(batch, inputs, loaded)
    result, _, _ = _run(loaded, batch, bool(student), softmax, gelu, run_options)
    return EncryptedRun(result, _summary(result))
