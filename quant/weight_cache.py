"""How the quantized layers (``layers.py``) hold their weights: the dequantized-weight cache and its switches.

Brevitas re-quantizes a layer's weight on every call; inference instead keeps the
dequantized weight per weight version (:class:`_DequantizedCache`), keyed by the
weight's version, storage and the number of optimizer steps taken (counted here by
a hook on every torch optimizer).  :func:`uncached_weights` turns the cache off for
the current thread (``quantize``'s calibration runs).  Copies of a layer leave the
cache behind and pickling is refused with what to use instead (:class:`_NotPickled`),
and construction skips the random initialisation of weights about to be overwritten
(:class:`_CopiedWeights`).
"""

from __future__ import annotations

import contextvars
import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from softq.quant.quantizers import dequantized_weight


@contextmanager
def _copying(cls: type) -> Iterator[None]:
    cls._copying = True
    try:
        yield
    finally:
        cls._copying = False


class _CopiedWeights:
    """Mixin: skip the random initialisation of weights that the constructor overwrites with copies (on
    all-MiniLM-L6-v2 the embedding table's normal_ alone cost 5% of a calibration pass, profiled ad hoc)."""

    _copying = False

    def reset_parameters(self) -> None:
        if not type(self)._copying:
            super().reset_parameters()


class _NotPickled:
    """Mixin for the layers built on Brevitas: pickling them (``torch.save(model)``, not of its state dict) fails
    deep in Brevitas' injector classes ("Can't pickle <class 'brevitas.inject...'>"); say what works instead.
    Deep copies, which softq makes, copy the attributes as before (``copy.deepcopy`` does not go through it)."""

    def __reduce_ex__(self, protocol: int) -> None:
        raise TypeError(f"{type(self).__name__} (a softq quantized layer) cannot be pickled, so torch.save(model) "
                        "does not work on a quantized model: save it with softq.quant.save(model, directory) and "
                        "load it with softq.quant.load(directory)")

    def __deepcopy__(self, memo: dict) -> nn.Module:
        replica = type(self).__new__(type(self))
        memo[id(self)] = replica
        # not the dequantized-weight cache (_DequantizedCache): keyed by the original weight's storage, a copy's
        # never matches it, and it was a float copy of every weight more in each copy (quantize's trials, export)
        state = {k: v for k, v in self.__getstate__().items() if k != "_cache"}
        replica.__dict__.update(copy.deepcopy(state, memo))
        return replica

    def __copy__(self) -> nn.Module:  # copy.copy goes through __reduce_ex__ too: a shallow copy, as nn.Module's
        replica = type(self).__new__(type(self))
        replica.__dict__.update(self.__getstate__())
        return replica


_optimizer_steps = 0  # steps of any torch optimizer so far: part of the dequantized-weight cache's key
# False inside uncached_weights(): per thread (and asyncio task), so a quantize in one thread leaves another's
# inference cached, and overlapping calls in two threads cannot leave it off
_caching: contextvars.ContextVar[bool] = contextvars.ContextVar("softq_weight_cache", default=True)


@contextmanager
def uncached_weights() -> Iterator[None]:
    """Inference computes each layer's dequantized weight without keeping it (``quantize``'s calibration runs:
    the cache of each model it ran, every smoothing candidate's, was a float copy of the model more)."""
    token = _caching.set(False)
    try:
        yield
    finally:
        _caching.reset(token)


def _count_optimizer_step(*_args: object) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


class _DequantizedCache:
    """Mixin: the dequantized weight of inference, computed once per weight version (Brevitas re-quantizes the
    weight on every call).  The key is the weight's version counter and storage and the number of optimizer steps
    taken (a fused optimizer step moves no version counter); the cache is also dropped whenever the layer changes
    mode (``model.train()`` / ``model.eval()``: what to call after editing weights through ``.data``, which nothing
    sees).  Traced (``torch.jit.trace``) and compiled (``torch.compile``)
    code computes the weight in its graph instead: a Python cache is a branch those record as another graph, and a
    guard on its key per layer."""

    _cache: tuple[tuple[int, int, int], torch.Tensor] | None = None

    def _uncached(self) -> bool:
        """Whether this call computes the dequantized weight without keeping it (``uncached_weights``: calibration,
        and the export's check of its file), outside traced and compiled code."""
        return not torch.jit.is_tracing() and not torch.compiler.is_compiling() and not _caching.get()

    def _cached_dequantized(self, bits: int, per_channel: bool) -> torch.Tensor:
        # an offloaded layer (softq.quant.offload) is loaded for each call: a kept copy would keep every block loaded
        if (torch.jit.is_tracing() or torch.compiler.is_compiling() or not _caching.get()
                or getattr(self, "softq_uncached", False)):
            return dequantized_weight(self.weight, bits, per_channel)
        key = (self.weight._version, self.weight.data_ptr(), _optimizer_steps)
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                self._cache = (key, dequantized_weight(self.weight, bits, per_channel))
        return self._cache[1]

    def train(self, mode: bool = True) -> nn.Module:
        self._cache = None
        return super().train(mode)
