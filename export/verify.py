"""An export checks itself: the written file, run by onnxruntime on the example inputs, must reproduce the
quantized torch model, or it is refused before it replaces anything.  A graph can pass ``onnx.checker`` and still
compute another function (a family whose structure the export misreads); only running it shows that."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from softq.export.errors import ExportError
from softq.export.wrappers import wrap_for_export

# Relative L2 error of a file's output to the torch model's on the example inputs, over the valid tokens: room for
# codes that land on a rounding tie, flip between runtimes and spread through the layers, not for a misread model.
EXPORT_TOLERANCE = 0.1
POOLED_OUTPUT = "sentence_embedding"


@dataclass
class ExportCheck:
    """What the file must reproduce: its feeds, the quantized torch model's outputs, and the valid tokens."""

    feeds: dict[str, np.ndarray]
    names: list[str]
    reference: list[np.ndarray]
    valid: np.ndarray | None

    @classmethod
    def of(cls, qmodel: nn.Module, feeds: dict[str, torch.Tensor], pooling: str | None, normalize: bool,
           unpadded_only: bool = False) -> ExportCheck | None:
        """Run the quantized model itself (not the export copy) through the same wrapper as the trace;
        ``unpadded_only`` keeps the examples without padding (None if there is none)."""
        if unpadded_only and "attention_mask" in feeds:
            full = feeds["attention_mask"].bool().all(dim=1)
            if not bool(full.any()):
                return None
            feeds = {k: v[full] for k, v in feeds.items()}
        wrapper, _, names = wrap_for_export(qmodel, pooling, normalize)
        dtype = next((p.dtype for p in qmodel.parameters() if p.is_floating_point()), torch.float32)
        args = [v.to(dtype) if v.is_floating_point() else v for v in feeds.values()]
        with torch.no_grad():
            out = wrapper(*args)
        outs = out if isinstance(out, tuple) else (out,)
        mask = feeds.get("attention_mask")
        return cls({k: v.numpy() for k, v in feeds.items()}, list(names),
                   [o.float().numpy() for o in outs], None if mask is None else mask.numpy().astype(bool))

    def errors(self, path: str | Path) -> dict[str, float]:
        """Each output's relative L2 error (valid tokens only) of the file at ``path``, run by onnxruntime."""
        from softq.export import onnx_utils

        got = onnx_utils.session(str(path)).run(self.names, self.feeds)
        errors = {}
        for name, file_out, ref in zip(self.names, got, self.reference):
            if self.valid is not None and ref.ndim >= 3 and ref.shape[:2] == self.valid.shape:
                file_out, ref = file_out[self.valid], ref[self.valid]
            errors[name] = float(np.linalg.norm(file_out - ref) / max(float(np.linalg.norm(ref)), 1e-30))
        return errors

    def verify(self, path: str | Path) -> None:
        """Raise :class:`ExportError` if an output of the file at ``path`` is off the torch model's.  A pooled file
        is judged on its ``sentence_embedding``, what it is for: a quantized encoder's per-token states can move a
        few percent between runtimes where 8-bit codes sit on rounding ties, and the mean over tokens averages
        those moves out, while a misread model moves the embedding as much as the states."""
        errors = self.errors(path)
        if POOLED_OUTPUT in errors:
            errors = {POOLED_OUTPUT: errors[POOLED_OUTPUT]}
        for name, error in errors.items():
            if not error <= EXPORT_TOLERANCE:
                raise ExportError(f"the exported file's {name!r} is {error:.1%} off the quantized torch model on the "
                                  f"example inputs (relative L2 error, at most {EXPORT_TOLERANCE:.0%} allowed): the "
                                  "export does not compute this model, and nothing was written")
