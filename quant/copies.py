"""Copies of a model for ``quantize``'s trials, and freeing them as soon as they are dropped.

``input_smoothing="auto"`` and ``smoothing_into_v="auto"`` judge candidates on copies
of the model being calibrated; :func:`independent_copy` makes copies whose
parametrizations stay their own, and :func:`_collect` runs the cyclic collector for
large models, whose dropped copies would otherwise stay in memory.
"""

from __future__ import annotations

import copy
import gc

from torch import nn
from torch.nn.utils import parametrize


# Models of at least this many bytes of parameters are collected as soon as quantize drops a copy of them: Brevitas'
# quantizers hold reference cycles, so a dropped copy waits for the cyclic collector (up to seven copies of a
# 650M-parameter OPT in input_smoothing="auto"'s search: out of memory at 24 GB).  A full collection costs time in
# a process holding many objects, which small models (the test suite's) need not pay.
COLLECT_ABOVE_BYTES = 2**26


def _collect(model: nn.Module) -> None:
    """Collect dropped copies of ``model`` where it is large, or part of a large one (``softq_collect``: a block
    calibrated on its own, ``sequential.py``)."""
    if getattr(model, "softq_collect", False) or sum(
            p.numel() * p.element_size() for p in model.parameters()) >= COLLECT_ABOVE_BYTES:
        gc.collect()


def independent_copy(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` whose parametrized modules have classes of their own.  torch's parametrize
    injects a class per module and a deep copy shares it, so a parametrization registered on the copy later
    (``prepare``'s weight quantizers, the weight bias correction's conv ``bias``) would put its property on
    the original's class too, and the original would look up a parametrization it does not have."""
    copied = copy.deepcopy(model)
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
