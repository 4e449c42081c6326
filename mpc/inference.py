"""Encrypted inference of a model directory on saved inputs, as ``softq mpc run --inputs`` does it.

:func:`run_model_dir` runs a Hugging Face ``save_pretrained`` directory (or a student of it) on a ``torch.save``'d
dict of inputs, which are checked against the model before any party starts.  A text model's sentence embeddings
are :func:`softq.mpc.text.embed_texts`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from softq._files import error_line
from softq.mpc.runner import MPCResult, run
from softq.mpc.surrogates import SurrogateSpec, surrogate_choice
from softq.mpc.text import drop_unused_pooler


@dataclass
class EncryptedRun:
    """An encrypted run and the figures ``softq mpc run --json`` prints: ``rounds``, ``bytes``, ``wall_seconds``; a
    task with labels (the benchmarks' reference models) adds ``encrypted_accuracy``, ``plaintext_accuracy``,
    ``max_abs_error``, ``argmax_agreement``."""

    result: MPCResult
    summary: dict[str, Any]
    task: str | None = None  # the reference task's name


def as_model_dir(model: str | os.PathLike) -> Path:
    """``model`` as a model directory, or one line saying it is not one."""
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"{model} is not a model directory")
    return path


def load_any_model(model: str | os.PathLike) -> Any:
    """A Hugging Face ``save_pretrained`` directory (a student of ``softq mpc distill`` included)."""
    path = as_model_dir(model)
    if (path / "weights.pt").is_file() and not (path / "model.safetensors").is_file():
        raise ValueError(f"{path} holds a state dict (weights.pt) with no Hugging Face weights: load the model in "
                         "Python and pass it to softq.mpc.run, or save it with save_pretrained")
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


def run_model_dir(model: str | os.PathLike, inputs: str | os.PathLike, *, student: str | os.PathLike | None = None,
                  softmax: Any = "2quad", gelu: Any = "quad", **run_options: Any) -> EncryptedRun:
    """The model directory ``model`` (or ``student``, a student of it written by ``softq mpc distill``, with its
    own surrogates) run encrypted on ``inputs``, a ``torch.save``'d dict of input tensors (e.g. a tokenizer's
    output), which is read and checked against the model (main input present, ids in the vocabulary, shapes it
    takes) before any party starts.  ``softmax`` / ``gelu``: as for :func:`softq.mpc.run`, or spelt as the command line spells them (``"native"``, comma lists); ``run_options`` go to :func:`softq.mpc.run`.
    """
    path = as_model_dir(student or model)
    batch = read_inputs(inputs)  # a bad file fails before the model loads
    loaded = load_any_model(path)
    check_inputs(batch, inputs, loaded)
    result, _, _ = _run(loaded, batch, bool(student), softmax, gelu, run_options)
    return EncryptedRun(result, _summary(result))
