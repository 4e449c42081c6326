"""Calibrated surrogates: fit 2Quad and Quad to the model's own activations before distillation.

MPCFormer starts its student from the teacher's weights with the surrogates swapped in, so the
student begins far from the teacher: all-MiniLM-L6-v2's GELU inputs reach -17 / +25, where
Quad's ``0.125 x^2 + 0.25 x + 0.5`` is nothing like GELU, and 2Quad's ``(x + c)^2`` weighs a
row's scores very differently from ``exp``.  (Undistilled, its sentence embeddings have cosine
-0.03 to the model's.)  :func:`fit_surrogates` moves the start point with exact rewrites of the
weights, so the encrypted program and its cost do not change:

* **Quad**, per channel of each FFN: the least-squares quadratic ``a h^2 + b h + c`` to GELU over
  the teacher's fc1 outputs ``h`` on calibration tokens (padding excluded) is
  ``Quad(s h + t) + d`` with ``s = sqrt(8 a)``, ``t = 4 b / s - 1`` and ``d`` a constant; ``s``
  and ``t`` fold into fc1's weight row and bias, ``d`` into fc2's bias (``a`` is kept at least
  ``min_curvature`` so ``t`` stays bounded).
* **2Quad**, per head: ``(s x + c)^2`` normalised, with ``s`` from a grid minimising the KL
  divergence from the softmax of the teacher's scores ``x`` over the valid keys; ``s`` folds
  into the query projection's rows of that head.  Only scales whose row sums stay inside the
  encrypted row division's accurate range, with the range check's margin, are candidates
  (an unconstrained fit sharpens the reference ViT's rows until a row sum falls to 0.024 of
  ``L c^2``, below that range, and :func:`softq.mpc.run` then refuses the student).

The fit reads only where each tensor comes from (the Linear whose output is the GELU's input,
the one reading its output, the projection whose output the query is a view of), so it needs
no per-family table; a layer whose structure it cannot see is left as it is and reported.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from softq.attention import configure_attention
from softq.mpc.ranges import SAFE_RANGES, RangeConfig, _softmax_internals
from softq.mpc.surrogates import SurrogateGELU, activation_kind, layer_index
from softq.softmax import get_softmax

SCALE_GRID = tuple(float(x) for x in torch.logspace(-2.0, 1.0, 61))
MIN_CURVATURE = 0.02
_MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids", "pixel_values")


@dataclass
class SurrogateFit:
    """What :func:`fit_surrogates` changed, per transformer layer."""

    gelu_rms: dict[int, tuple[float, float]] = field(default_factory=dict)  # Quad's rms error to GELU: before, after
    softmax_kl: dict[int, tuple[float, float]] = field(default_factory=dict)  # mean KL to softmax per row: before, after
    scales: dict[int, list[float]] = field(default_factory=dict)  # 2Quad score scale per head
    skipped: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = []
        if self.gelu_rms:
            b = sum(v[0] for v in self.gelu_rms.values()) / len(self.gelu_rms)
            a = sum(v[1] for v in self.gelu_rms.values()) / len(self.gelu_rms)
            parts.append(f"Quad rms error to GELU {b:.3g} -> {a:.3g} ({len(self.gelu_rms)} layers)")
        if self.softmax_kl:
            b = sum(v[0] for v in self.softmax_kl.values()) / len(self.softmax_kl)
            a = sum(v[1] for v in self.softmax_kl.values()) / len(self.softmax_kl)
            parts.append(f"2Quad KL to softmax {b:.3g} -> {a:.3g} ({len(self.softmax_kl)} layers)")
        if self.skipped:
            parts.append("left as they were: " + "; ".join(self.skipped))
        return "; ".join(parts) or "nothing to fit (no Quad GELU or 2Quad softmax)"


class _ScoresRecorder(nn.Module):
    """Stands in for the scores point of a teacher copy: hands (scores, valid) to ``sink``."""

    takes_valid = True

    def __init__(self, sink: Any) -> None:
        super().__init__()
        self.sink = sink

    def forward(self, scores: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        self.sink(scores.detach(), valid)
        return scores


def _is_projection(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def _out_rows(m: nn.Module) -> torch.Tensor:
    """The weight viewed as [out, in] (nn.Linear's layout; Hugging Face's Conv1D stores [in, out])."""
    return m.weight if isinstance(m, nn.Linear) else m.weight.t()


def fit_surrogates(student: nn.Module, teacher: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]],
                   min_curvature: float = MIN_CURVATURE, range_margin: float = RangeConfig.margin) -> SurrogateFit:
    """Fit ``student``'s Quad GELUs and 2Quad softmaxes to ``teacher``'s activations on ``batches``.

    ``student`` is a copy of ``teacher`` switched to surrogates (:func:`softq.mpc.configure_surrogates`);
    its weights are changed in place, ``teacher`` is not.  Returns what changed, layer by layer.
    ``range_margin``: the headroom (as :class:`softq.mpc.ranges.RangeConfig`'s) a 2Quad scale must
    leave inside the row division's accurate range on these batches.
    """
    if student is teacher:
        raise ValueError("fit_surrogates needs the student and its teacher as two models")
    if not min_curvature > 0:
        raise ValueError(f"min_curvature must be > 0, got {min_curvature}")
    if not range_margin >= 1.0:
        raise ValueError(f"range_margin must be >= 1, got {range_margin}")
    s_modules = dict(student.named_modules())
    quad_paths = {p for p, m in s_modules.items() if isinstance(m, SurrogateGELU) and m.name == "quad"
                  and m.kind == "gelu"}
    two_quad = {}  # layer -> c
    for path, m in s_modules.items():
        points = getattr(m, "softq", None)
        if points is not None and points.softmax_name == "2quad":
            idx = layer_index(path)
            if idx is not None:
                two_quad[idx] = float(points.softmax_params.get("c", 5.0))
    fit = SurrogateFit()
    if not quad_paths and not two_quad:
        return fit

    probe = copy.deepcopy(teacher).eval()
    points_by_layer = {}
    if two_quad:
        configure_attention(probe)
        for path, m in probe.named_modules():
            points = getattr(m, "softq", None)
            if points is not None and layer_index(path) in two_quad:
                points_by_layer[layer_index(path)] = points
    t_modules = dict(probe.named_modules())
    gelu_paths = [p for p in quad_paths if p in t_modules and activation_kind(t_modules[p]) == "gelu"]
    fit.skipped += [f"{p} (no GELU at that path in the teacher)" for p in sorted(quad_paths - set(gelu_paths))]

    # where tensors come from: projection outputs by identity (GELU input) and by storage (query views)
    outputs: dict[int, str] = {}
    storages: list[tuple[str, torch.Tensor]] = []
    producer: dict[str, str] = {}
    consumer: dict[str, str] = {}
    query_of: dict[int, tuple[str, int, int]] = {}  # layer -> (projection, first query column, head size)
    gelu_out: dict[int, str] = {}
    stats: dict[str, list[torch.Tensor]] = {}
    grid = torch.tensor(SCALE_GRID)
    kl: dict[int, torch.Tensor] = {}
    rows: dict[int, float] = {}
    admissible: dict[int, torch.Tensor] = {}  # [grid + 1, heads]: row sums inside the division's range
    token_mask: list[torch.Tensor | None] = [None]

    def on_projection(name: str):
        def hook(_m, args, out):
            x = args[0]
            if id(x) in gelu_out:
                consumer.setdefault(gelu_out[id(x)], name)
            outputs[id(out)] = name
            storages.append((name, out))
        return hook

    def on_gelu(name: str):
        def hook(_m, args, out):
            h = args[0]
            if id(h) in outputs:
                producer.setdefault(name, outputs[id(h)])
            gelu_out[id(out)] = name
            flat = h.detach().reshape(-1, h.shape[-1]).double()
            if token_mask[0] is not None and token_mask[0].numel() == flat.shape[0]:
                flat = flat[token_mask[0]]
            g = nn.functional.gelu(flat)
            x = torch.stack([flat * flat, flat, torch.ones_like(flat)], -1)  # [n, C, 3]
            ata, atb = torch.einsum("nci,ncj->cij", x, x), torch.einsum("nci,nc->ci", x, g)
            quad = 0.125 * flat * flat + 0.25 * flat + 0.5
            plain_se = (quad - g).square().sum(0)
            new = (ata, atb, (g * g).sum(0), plain_se, torch.tensor(float(flat.shape[0])))
            old = stats.get(name)
            stats[name] = list(new) if old is None else [a + b for a, b in zip(old, new)]
        return hook

    def on_query(layer: int):
        def hook(_m, args, _out):
            q = args[0]
            for name, out in reversed(storages):
                start = out.data_ptr()
                end = start + out.numel() * out.element_size()
                if start <= q.data_ptr() < end and out.shape[-1] >= q.shape[1] * q.shape[-1]:
                    col = (q.data_ptr() - start) // out.element_size()
                    if col + q.shape[1] * q.shape[-1] <= out.shape[-1]:
                        query_of.setdefault(layer, (name, col, q.shape[-1]))
                    break
        return hook

    def on_scores(layer: int, c: float):
        def sink(scores: torch.Tensor, valid: torch.Tensor | None) -> None:
            valid = torch.ones_like(scores) if valid is None else valid.to(scores.dtype).expand_as(scores)
            live = (valid.sum(-1) > 0).to(scores.dtype)  # rows with a key
            p = get_softmax("softmax")(scores, valid) * live[..., None]
            logp = torch.log(p.clamp_min(1e-30))
            two_quad_fn, params = get_softmax("2quad"), {"c": c}
            losses, ok = [], []
            for s in SCALE_GRID + (1.0,):
                q = two_quad_fn(scores * s, valid, **params)
                row = (p * (logp - torch.log(q.clamp_min(1e-30)))).sum(-1) * live  # [b, h, s]
                losses.append(row.sum((0, 2)))
                # the row sums as the range check sees them (softq.mpc.ranges), inside its safe range with its margin
                (kind, r), = _softmax_internals("2quad", params, scores * s, valid)
                (lo, hi), _ = SAFE_RANGES[kind]
                inside = ((r >= lo * range_margin) & (r <= hi / range_margin)) | (live == 0)  # rows with a key only
                ok.append(inside.all(-1).all(0))  # [heads]
            kl[layer] = torch.stack(losses) + kl.get(layer, 0)
            admissible[layer] = torch.stack(ok) & admissible.get(layer, True)
            rows[layer] = rows.get(layer, 0.0) + float(live.sum()) / scores.shape[1]
        return sink

    handles = []
    for name, m in t_modules.items():
        if _is_projection(m):
            handles.append(m.register_forward_hook(on_projection(name)))
    for name in gelu_paths:
        handles.append(t_modules[name].register_forward_hook(on_gelu(name)))
    for layer, points in points_by_layer.items():
        points.scores = _ScoresRecorder(on_scores(layer, two_quad[layer]))
        handles.append(points.q.register_forward_hook(on_query(layer)))
    try:
        with torch.no_grad():
            for batch in batches:
                inputs = {k: v for k, v in batch.items() if k in _MODEL_KEYS}
                mask = inputs.get("attention_mask")
                token_mask[0] = None if mask is None else mask.reshape(-1).bool()
                outputs.clear()
                storages.clear()
                gelu_out.clear()
                probe(**inputs)
    finally:
        for h in handles:
            h.remove()

    with torch.no_grad():
        for name in sorted(gelu_paths):
            idx = layer_index(name)
            if name not in stats:
                fit.skipped.append(f"{name} (never called)")
                continue
            fc1, fc2 = producer.get(name), consumer.get(name)
            if fc1 is None or fc2 is None or s_modules[fc1].bias is None or s_modules[fc2].bias is None:
                fit.skipped.append(f"{name} (cannot see the Linear layers with biases around it)")
                continue
            ata, atb, gg, plain_se, n = stats[name]
            coef = torch.linalg.solve(ata + 1e-9 * torch.eye(3, dtype=ata.dtype) * ata.diagonal(0, -2, -1).amax(), atb)
            a, b, c = coef.unbind(-1)
            a = a.clamp_min(min_curvature)
            coef = torch.stack([a, b, c], -1)
            # squared error of the fitted quadratic from the normal equations: g'g - 2 coef'A'g + coef'A'A coef
            fitted_se = gg - 2 * (coef * atb).sum(-1) + torch.einsum("ci,cij,cj->c", coef, ata, coef)
            s = (8 * a).sqrt()
            t = 4 * b / s - 1
            d = c - (0.125 * t * t + 0.25 * t + 0.5)
            w1, w2 = _out_rows(s_modules[fc1]), _out_rows(s_modules[fc2])
            w1.mul_(s[:, None].to(w1.dtype))
            s_modules[fc1].bias.mul_(s.to(w1.dtype)).add_(t.to(w1.dtype))
            s_modules[fc2].bias.add_(w2 @ d.to(w2.dtype))
            total = float(n) * a.numel()
            fit.gelu_rms[idx] = (math.sqrt(float(plain_se.sum()) / total), math.sqrt(max(float(fitted_se.sum()), 0.0) / total))
        for layer, losses in sorted(kl.items()):
            if layer not in query_of:
                fit.skipped.append(f"layer {layer} 2Quad (cannot see the query projection)")
                continue
            proj, col, head_dim = query_of[layer]
            if s_modules[proj].bias is None:
                fit.skipped.append(f"layer {layer} 2Quad (query projection without bias)")
                continue
            allowed = admissible[layer]
            candidates = torch.where(allowed, losses, torch.full_like(losses, math.inf))
            best = candidates.argmin(0)  # the grid's last entry is 1.0: no change
            scales = torch.cat([grid, torch.ones(1, dtype=grid.dtype)])[best]
            unfit = ~allowed.any(0)
            if bool(unfit.any()):
                best = torch.where(unfit, torch.full_like(best, len(SCALE_GRID)), best)
                scales = torch.where(unfit, torch.ones_like(scales), scales)
                fit.skipped.append(f"layer {layer} 2Quad heads {unfit.nonzero().flatten().tolist()} (no scale keeps "
                                   "the row sums in the encrypted division's range)")
            heads = scales.numel()
            per_col = scales.repeat_interleave(head_dim).to(s_modules[proj].weight.dtype)
            w = _out_rows(s_modules[proj])
            w[col:col + per_col.numel()].mul_(per_col[:, None])
            s_modules[proj].bias[col:col + per_col.numel()].mul_(per_col)
            fit.scales[layer] = [float(x) for x in scales]
            n_rows = max(rows[layer], 1.0)
            fit.softmax_kl[layer] = (float(losses[-1].mean()) / n_rows, float(losses[best, torch.arange(heads)].mean()) / n_rows)
    return fit
