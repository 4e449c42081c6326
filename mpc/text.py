"""Sentence encoders under MPC: a text model directory loaded for ``softq.mpc``, and its encrypted embeddings.

:func:`load_text_model` loads a headless Hugging Face text encoder's directory (a teacher, or a student written by
:func:`softq.mpc.distill_dir`, whose surrogates come back with it); :func:`embed_texts` computes the sentence
embeddings of a list of texts encrypted and measures them against plaintext: what
``softq mpc run --model DIR [--student DIR] --text FILE`` does, as one function.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from softq import hf
from softq.mpc.runner import MPCResult, run
from softq.mpc.surrogates import SurrogateSpec, configure_surrogates, restore_surrogates, surrogate_choice


def drop_unused_pooler(model: Any, pooling: str | None) -> None:
    """A sentence encoder (``pooling`` from its sentence-transformers files) never uses BERT's pooler, which
    would cost a dense layer and a tanh under MPC: it runs without it."""
    if pooling is not None and getattr(model, "pooler", None) is not None:
        model.pooler = None


def load_text_model(path: str | os.PathLike, max_length: int | None = None) -> hf.HFModel:
    """A Hugging Face headless text encoder's directory as a :class:`softq.hf.HFModel`, ready for ``softq.mpc``
    (a model with a head is refused: ``--text`` and text distillation work on sentence embeddings).

    A sentence encoder (a sentence-transformers folder: its embedding is pooled from the hidden states)
    runs without BERT's pooler, which it never uses and which would cost a dense layer and a tanh under
    MPC (:func:`drop_unused_pooler`).  A student written by ``softq mpc distill`` gets its surrogates back.
    """
    with hf.quiet_transformers():
        loaded = hf.load_model_dir(path, max_length=max_length)
    if not loaded.is_text:
        raise hf.ModelDirError(f"{path} is not a text model; --text and distillation from a text file need one")
    drop_unused_pooler(loaded.model, loaded.pooling)
    probe = loaded.tokenize(["a"], max_length=8)
    with torch.no_grad():
        if getattr(loaded.model(**probe), "last_hidden_state", None) is None:
            raise hf.ModelDirError(f"{path} has a head ({type(loaded.model).__name__}); --text works with a headless "
                                   "encoder's sentence embeddings (use --inputs for other models)")
    restore_surrogates(loaded.model)
    return loaded


@dataclass
class EncryptedEmbeddings:
    """What :func:`embed_texts` computed: the run, the embeddings, and how far they are from plaintext."""

    result: MPCResult  # what the client received (outputs[0]: the last hidden state) and what the run cost
    embeddings: torch.Tensor  # [texts, hidden]: the encrypted run's hidden states pooled as the model pools them
    summary: dict[str, Any]  # the figures `softq mpc run --json` prints (see embed_texts)
    softmax: Any  # the surrogates that ran: a student's own, else the ones asked for
    gelu: Any


def embed_texts(model: str | os.PathLike, texts: Sequence[str], *, student: str | os.PathLike | None = None,
                softmax: Any = "2quad", gelu: Any = "quad", max_length: int = 64,
                **run_options: Any) -> EncryptedEmbeddings:
    """Sentence embeddings of ``texts`` by a text model directory, computed encrypted, with their errors.

    ``model``: a headless text encoder's directory (:func:`load_text_model`); its embedding is pooled as its
    sentence-transformers files say, else by the mean.  ``student``: a student of it written by
    :func:`softq.mpc.distill_dir`, which runs instead, with its own surrogates; otherwise ``softmax`` / ``gelu``
    choose them (as for :func:`softq.mpc.run`, or spelt as the command line spells them: ``"native"``, comma lists).
    Every text is cut to ``max_length`` tokens.  ``run_options`` go to :func:`softq.mpc.run` (``world_size``,
    ``provider``, ``timeout``, ``truncation``, ``range_margin``).

    The summary keeps two errors apart.  The encryption's: ``max_abs_error`` of the hidden states and
    ``min_cosine_to_plaintext`` of the embeddings, against the same model with the same surrogates in plaintext
    (the student in plaintext).  The surrogates': ``mean_cosine_to_model`` / ``min_cosine_to_model``, the
    embeddings' cosine to ``model`` computed exactly.  It also holds ``texts``, ``tokens``, ``rounds``, ``bytes``
    and ``wall_seconds``.
    """
    if isinstance(texts, str):
        raise TypeError("texts is a list of texts (read a file with softq.corpora.read_text_file)")
    owner = load_text_model(model, max_length)
    target = load_text_model(student, max_length) if student else owner
    spec = getattr(target.model.config, "softq_mpc_surrogates", None)
    if spec:  # a student: its own surrogates
        spec = SurrogateSpec.from_json(spec)
        softmax, gelu = spec.softmax, spec.gelu
    else:
        softmax, gelu = surrogate_choice(softmax), surrogate_choice(gelu)
    inputs = target.tokenize(texts, max_length=max_length)
    result = run(target.model, inputs, softmax=softmax, gelu=gelu, **run_options)
    mask = inputs["attention_mask"]
    hidden = result.outputs[0]
    # the encryption's error: against the same model with the same surrogates in plaintext (a student carries
    # its own); the surrogates' own error is the cosine to the exact model, reported apart
    reference: nn.Module = target.model
    if not spec:
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
    with torch.no_grad():
        exact = owner.model(**inputs).last_hidden_state
    cos_exact = torch.nn.functional.cosine_similarity(emb, hf.pool(exact, mask, mode))
    summary["mean_cosine_to_model"] = float(cos_exact.mean())
    summary["min_cosine_to_model"] = float(cos_exact.min())
    return EncryptedEmbeddings(result, emb, summary, softmax, gelu)
