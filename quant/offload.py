"""Models that accelerate dispatched (``from_pretrained(device_map=...)``, ``accelerate.dispatch_model``,
``cpu_offload``, ``disk_offload``): block-by-block calibration with each block's weights loaded only while it is
calibrated, on the block's own execution device.

accelerate keeps an offloaded module's parameters on the meta device and its ``AlignDevicesHook`` loads them from
a weights map (a CPU state dict, or ``.dat`` files in the offload folder) for each call.  ``quantize`` replaces the
Linear layers those hooks sit on, so for each block with offloaded weights (:class:`Offloaded`):

* before ``prepare``, the block's hooks are removed (without loading anything) and where each offloaded tensor comes
  from is kept: the hook's weights map and key, found again after ``prepare`` by the module that holds it (a norm
  kept inside softq's ``QNorm``) or by its path (a Linear replaced at the same place by ``QLinear``);
* while the block is calibrated, its tensors are loaded from there onto its execution device (:meth:`load`);
* once calibrated, the quantized block (weights, scales, bias shifts) is written back: to
  ``<offload folder>/softq-quantized/<block>/`` with accelerate's ``offload_state_dict`` where it came from disk, to
  a CPU state dict where it came from CPU, and one accelerate ``AlignDevicesHook`` on the block loads it for each
  call (:meth:`store`).  So peak memory stays near one block, during calibration and at inference.

Modules outside the blocks (embeddings, final norm, ``lm_head``) that are offloaded are loaded onto their execution
device once, and stay loaded: calibration runs them on every batch.  Blocks that are not offloaded (a ``device_map``
placing them on ``cuda:0``, ``cuda:1``, ``cpu``) keep their hooks; the modules ``prepare`` adds to them are moved to
their execution device, and their inputs move there with them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from softq.quant.config import QuantConfig


def _accelerate():  # noqa: ANN202
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise ValueError("the model is dispatched by accelerate with weights offloaded (on the meta device), and "
                         "softq needs accelerate to load them block by block: pip install 'softq[offload]'") from None
    from accelerate import hooks, utils
    return hooks, utils


def _hooks(module: nn.Module) -> list:
    """The accelerate hooks on ``module`` itself (a ``SequentialHook``'s parts)."""
    hook = module.__dict__.get("_hf_hook")
    if hook is None:
        return []
    return list(getattr(hook, "hooks", (hook,)))


def dispatched(model: nn.Module) -> bool:
    """Whether accelerate hooks sit on any of ``model``'s modules."""
    return any("_hf_hook" in m.__dict__ for m in model.modules())


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def refuse(model: nn.Module, what: str) -> None:
    """One line where ``model``'s weights are offloaded by accelerate: ``what`` (save, export) reads them all at once."""
    if has_meta(model) and dispatched(model):
        raise ValueError(f"{what} needs every weight in memory, and this model's blocks are offloaded by accelerate "
                         "(their weights are on the meta device, loaded per call): quantize the model loaded without "
                         "offload (device_map=None, or devices that hold it) to save or export it")


def execution_device(module: nn.Module) -> torch.device:
    """Where accelerate runs ``module`` (its hooks' execution device), else where its first loaded tensor is."""
    for m in module.modules():
        for hook in _hooks(m):
            device = getattr(hook, "execution_device", None)
            if device is not None:
                return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    for t in (*module.parameters(), *module.buffers()):
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


def _offloaded_tensors(module: nn.Module) -> Iterator[tuple[str, object, str, bool]]:
    """``(name, weights map, key, from disk)`` of each of ``module``'s own tensors an offloading hook loads."""
    for hook in _hooks(module):
        weights = getattr(hook, "weights_map", None)
        if not getattr(hook, "offload", False) or weights is None:
            continue
        own = dict(module.named_parameters(recurse=False))
        if getattr(hook, "offload_buffers", False):
            own.update(module.named_buffers(recurse=False))
        dataset = getattr(weights, "dataset", weights)
        prefix = getattr(weights, "prefix", "")
        index = getattr(dataset, "index", {}) or {}
        for name, t in own.items():
            if t.is_meta:
                yield name, weights, name, f"{prefix}{name}" in index


class Offloaded:
    """The offload of one ``quantize`` call: its checks, and each block's loading and writing back (module
    docstring).  ``blocks`` are ``sequential.blocks_of(model)``."""

    def __init__(self, model: nn.Module, config: QuantConfig, blocks: list[tuple[str, nn.Module]]) -> None:
        self.hooks, self.utils = _accelerate()
        offloaded = has_meta(model)
        if offloaded and config.calibration == "model":
            raise ValueError("the model's weights are offloaded by accelerate (on the meta device): "
                             "calibration='model' would load them all at once; use calibration='blocks' (or 'auto')")
        if offloaded and (config.smoothquant_alpha is not None or (config.input_smoothing is not None and config.observer != "minmax")):
            raise ValueError("the model's weights are offloaded by accelerate: smoothquant_alpha (and input smoothing "
                             "with a percentile or mse observer) edit every weight before calibration; use "
                             "smoothquant_alpha=None and observer='minmax'")
        self.blocks = blocks
        inside = {id(m) for _, b in blocks for m in b.modules()}
        self._load_outside(model, inside)
        self.managed = [has_meta(b) for _, b in blocks]
        self.devices = [execution_device(b) for _, b in blocks]
        self.sources: list[dict[str, tuple[object, str]]] = [{} for _ in blocks]
        self.paths: list[dict[int, str]] = [{} for _ in blocks]
        self.disk = [False] * len(blocks)
        self.folder = None

    def _load_outside(self, model: nn.Module, inside: set[int]) -> None:
        """Load the offloaded tensors of the modules outside the blocks onto their execution device, for good (their
        hooks stop offloading; tied weights stay tied)."""
        done: dict[int, nn.Parameter] = {}
        for m in model.modules():
            if id(m) in inside:
                continue
            for name, weights, key, _ in list(_offloaded_tensors(m)):
                old = getattr(m, name)
                if id(old) in done:
                    setattr(m, name, done[id(old)])
                    continue
                self.utils.set_module_tensor_to_device(m, name, execution_device(m), value=weights[key])
                done[id(old)] = getattr(m, name)
            for hook in _hooks(m):
                if getattr(hook, "offload", False):
                    hook.offload = False

    def detach(self) -> None:
        """Before ``prepare``: each offloaded block's sources kept, its hooks removed without loading anything."""
        for j, (_, block) in enumerate(self.blocks):
            if not self.managed[j]:
                continue
            for path, m in block.named_modules():
                self.paths[j][id(m)] = path
                for name, weights, key, disk in _offloaded_tensors(m):
                    self.sources[j][f"{path}.{name}" if path else name] = (weights, key)
                    self.disk[j] |= disk
                    folder = getattr(getattr(weights, "dataset", weights), "save_folder", None)
                    if disk and folder and self.folder is None:
                        self.folder = folder
                for hook in _hooks(m):
                    hook.offload = False  # removing an offloading hook would load its weights back
            self.hooks.remove_hook_from_module(block, recurse=True)
            missing = [n for n, t in (*block.named_parameters(), *block.named_buffers())
                       if t.is_meta and n not in self.sources[j]]
            if missing:
                raise ValueError(f"{self.blocks[j][0]}.{missing[0]} is on the meta device and no accelerate hook "
                                 "loads it: dispatch the model with accelerate (device_map / offload) or load it")

    def _tensors(self, j: int) -> Iterator[tuple[nn.Module, str, torch.Tensor, str | None]]:
        """Block ``j``'s own tensors per module: ``(module, name, tensor, source key or None)``."""
        block = self.blocks[j][1]
        before = set(self.paths[j].values())
        for path, m in block.named_modules():
            origin = self.paths[j].get(id(m), path if path in before else None)
            for name, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)):
                key = None if origin is None else (f"{origin}.{name}" if origin else name)
                yield m, name, t, key if key in self.sources[j] else None

    def load(self, j: int) -> None:
        """Block ``j``'s tensors on its execution device: offloaded ones read from their source, the ones ``prepare``
        added moved there."""
        device = self.devices[j]
        for m, name, t, key in list(self._tensors(j)):
            if t.is_meta:
                if key is None:
                    raise ValueError(f"{self.blocks[j][0]}: {type(m).__name__}.{name} is on the meta device and "
                                     "softq found no offloaded weight for it")
                weights, source = self.sources[j][key]
                self.utils.set_module_tensor_to_device(m, name, device, value=weights[source])
            elif t.device != device:
                self.utils.set_module_tensor_to_device(m, name, device)

    @contextmanager
    def loaded(self, j: int) -> Iterator[None]:
        """Block ``j`` loaded for one float run (the capture's), back on the meta device after."""
        if not self.managed[j]:
            yield
            return
        self.load(j)
        try:
            yield
        finally:
            for m, name, _, key in list(self._tensors(j)):
                if key is not None:
                    self.utils.set_module_tensor_to_device(m, name, "meta")

    def store(self, j: int) -> None:
        """Calibrated block ``j`` written back (to disk where it came from disk, else CPU) and offloaded again behind
        one accelerate hook that loads it for each call."""
        if not self.managed[j]:
            return
        from softq.quant.weight_cache import _DequantizedCache

        name, block = self.blocks[j]
        tensors = {n: t.detach().cpu() for n, t in self.utils.named_module_tensors(
            block, include_buffers=True, recurse=True, remove_non_persistent=True)}
        if self.disk[j] and self.folder is not None:
            folder = os.path.join(self.folder, "softq-quantized", name)
            self.utils.offload_state_dict(folder, tensors)
            weights = self.utils.OffloadedWeightsLoader(save_folder=folder)
        else:
            weights = self.utils.OffloadedWeightsLoader(state_dict=tensors)
        for m in block.modules():
            if isinstance(m, _DequantizedCache):
                m.softq_uncached = True  # a cached dequantized weight would keep every block loaded
        self.hooks.add_hook_to_module(block, self.hooks.AlignDevicesHook(
            execution_device=self.devices[j], offload=True, io_same_device=False, weights_map=weights,
            offload_buffers=True, place_submodules=True))

    def to_device(self, j: int, value: object) -> object:
        """``value`` (a block call's inputs) on block ``j``'s execution device."""
        return self.utils.send_to_device(value, self.devices[j])
