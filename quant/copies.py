"""Copies of a model for ``quantize``'s trials, and freeing them as soon as they are dropped.

``input_smoothing="auto"`` and ``smoothing_into_v="auto"`` judge candidates on copies
of the model being calibrated; :func:`independent_copy` makes copies whose
parametrizations stay their own, and :func:`_collect` runs the cyclic collector for
large models, whose dropped copies would otherwise stay in memory.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import gc
from collections.abc import Iterator

from torch import nn
from torch.nn.utils import parametrize


# Models of at least this many bytes of parameters are collected as soon as quantize drops a copy of them: Brevitas'
# quantizers hold reference cycles, so a dropped copy waits for the cyclic collector (up to seven copies of a
# 650M-parameter OPT in input_smoothing="auto"'s search: out of memory at 24 GB).  A full collection costs time in
# a process holding many objects, which small models (the test suite's) need not pay.
COLLECT_ABOVE_BYTES = 2**26


def model_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _collect(model: nn.Module) -> None:
    """Collect dropped copies of ``model`` where it is large, or part of a large one (``softq_collect``: a block
    calibrated on its own, ``sequential.py``)."""
    if getattr(model, "softq_collect", False) or model_bytes(model) >= COLLECT_ABOVE_BYTES:
        gc.collect()
        _trim()


# glibc's mallopt parameter and the thresholds :func:`prompt_release` sets: during calibration every allocation from
# 4 MiB up is its own mapping, handed back when freed; after it, 32 MiB, the most glibc's own rule raises it to
M_MMAP_THRESHOLD = -3
CALIBRATION_MMAP_THRESHOLD = 2**22
AFTER_MMAP_THRESHOLD = 2**25


@contextlib.contextmanager
def prompt_release(model: nn.Module) -> Iterator[None]:
    """Inside, a large model's calibration (``COLLECT_ABOVE_BYTES``) gets freed memory back to the system at once
    (glibc only).  glibc's rule raises its mmap threshold to the largest block freed so far (up to 32 MiB), so a
    forward pass's attention scores and activations come from the heap after the first, and what the passes free
    there stays in the process, fragmented, an amount over the working set that varies from run to run.  A fixed
    threshold of 4 MiB maps each larger tensor on its own, at some cost in calibration time (the peak and the time
    with it: bench_llm_peers.py --only scale).  Setting it ends glibc's adjusting for the process, so after
    calibration the threshold is left at 32 MiB, the value glibc's own rule reaches once a block that large is
    freed."""
    libc = _libc()
    large = libc and model_bytes(model) >= COLLECT_ABOVE_BYTES
    if large:
        libc.mallopt(M_MMAP_THRESHOLD, CALIBRATION_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if large:
            libc.mallopt(M_MMAP_THRESHOLD, AFTER_MMAP_THRESHOLD)
            libc.malloc_trim(0)


def _libc() -> ctypes.CDLL | None:
    """glibc (its ``mallopt`` and ``malloc_trim``), once looked up; None elsewhere."""
    global _LIBC
    if _LIBC is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
        except OSError:
            _LIBC = False
    return _LIBC or None


_LIBC = None


def _trim() -> None:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere nothing): what the
    passes freed below the mmap threshold stays in the process otherwise."""
    libc = _libc()
    if libc:
        libc.malloc_trim(0)


def independent_copy(model: nn.Module, shared: tuple[nn.Parameter, ...] = ()) -> nn.Module:
    """``copy.deepcopy(model)`` whose parametrized modules have classes of their own.  torch's parametrize
    injects a class per module and a deep copy shares it, so a parametrization registered on the copy later
    (``prepare``'s weight quantizers, the weight bias correction's conv ``bias``) would put its property on
    the original's class too, and the original would look up a parametrization it does not have.  ``shared``:
    parameters the copy holds as they are, not copied."""
    copied = copy.deepcopy(model, {id(p): p for p in shared})
    for module in copied.modules():
        cls = module.__class__
        if parametrize.is_parametrized(module):
            module.__class__ = type(cls.__name__, cls.__bases__, dict(cls.__dict__))
        _drop_foreign_wrappers(module)
    return copied


def _drop_foreign_wrappers(module: nn.Module) -> None:
    """Remove the instance attributes of a copied ``module`` that wrap another module's bound method.  A deep copy
    keeps functions as they are, so such a wrapper still calls the original: accelerate's ``dispatch_model`` wraps
    ``model.to`` (and ``.cuda``) with a warning, and the copy's ``.to`` would move the original model.  Without the
    attribute, the copy's own method (the class's) is used."""
    for name, value in list(vars(module).items()):
        bound = getattr(getattr(value, "__wrapped__", None), "__self__", None)
        if isinstance(bound, nn.Module) and bound is not module:
            delattr(module, name)
