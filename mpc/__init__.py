"""softq.mpc: private inference of Hugging Face transformers under CrypTen.

The model owner secret-shares its weights, the client secret-shares its input,
and only the client sees the output.  softq exports the model with
``torch.export`` and interprets the aten graph with CrypTensor operations
(:mod:`softq.mpc.graph`); attention uses the softmax variants of
:mod:`softq.softmax`, GELU and LayerNorm the surrogates of
:mod:`softq.mpc.surrogates`.

What the ``softq mpc`` commands do is one function each: :func:`embed_texts` (encrypted sentence embeddings
of a text model directory), :func:`run_model_dir` (a model directory on saved inputs), :func:`distill_dir` (a
surrogate student, written as a directory).

Importing this package is cheap: CrypTen is only loaded (through the torch
compatibility shim) when a function that needs it is used.
"""

from __future__ import annotations

from typing import Any

from softq.mpc._crypten_shim import CrypTenMissingError, load_crypten

__all__ = [
    "CrypTenMissingError",
    "load_crypten",
    "run",
    "MPCResult",
    "CommReport",
    "MPCError",
    "RangeError",
    "RangeConfig",
    "configure_surrogates",
    "NETWORK_PROFILES",
    "embed_texts",
    "EncryptedEmbeddings",
    "load_text_model",
    "run_model_dir",
    "EncryptedRun",
    "distill_dir",
    "DistilledStudent",
]

_LAZY = {
    "run": "softq.mpc.runner",
    "MPCResult": "softq.mpc.runner",
    "MPCError": "softq.mpc.errors",
    "RangeError": "softq.mpc.ranges",
    "RangeConfig": "softq.mpc.ranges",
    "CommReport": "softq.mpc.accounting",
    "NETWORK_PROFILES": "softq.mpc.accounting",
    "configure_surrogates": "softq.mpc.surrogates",
    "embed_texts": "softq.mpc.text",
    "EncryptedEmbeddings": "softq.mpc.text",
    "load_text_model": "softq.mpc.text",
    "run_model_dir": "softq.mpc.inference",
    "EncryptedRun": "softq.mpc.inference",
    "distill_dir": "softq.mpc.students",
    "DistilledStudent": "softq.mpc.students",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'softq.mpc' has no attribute '{name}'")
    import importlib

    return getattr(importlib.import_module(module_name), name)
