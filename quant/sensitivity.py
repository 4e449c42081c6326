"""Which quantized parts cost the most: one part quantized at a time (``softq report``'s ranking).

``enable_only`` switches quantization on at a chosen set of points (activation and softmax quantizers,
Linear and embedding weights, weight-only parametrizations) and off elsewhere; ``sensitivity`` ranks the
parts by kind and by layer with it.  Here in ``softq.quant`` because it needs softq's quantizers (calib
stays free of quant imports: quant builds on calib, not the other way round).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

from torch import nn

from softq.attention import attention_points
from softq.calib.diagnostics import save_figure
from softq.models import transformer_blocks
from softq.quant.layers import BiasShift, QEmbedding, QLayerNorm, QLinear, QNorm, WeightOnly
from softq.quant.quantizers import ActQuantizer, SoftmaxOutputQuantizer


def enable_only(qmodel: nn.Module, chosen: set[int]) -> None:
    """Quantization on at the points whose ``id`` is in ``chosen`` (activation and softmax quantizers,
    quantized Linears' and embedding tables' weights, weight-only parametrizations), float elsewhere."""
    # prefix-token rows (QuantConfig.residual_prefix) follow their quantizer's mode; set on their own as points not
    # chosen, they were left float after a ranking "restored" the model
    rows = {id(r) for m in qmodel.modules() if isinstance(m, ActQuantizer) for r in getattr(m, "prefix", ())}
    for m in qmodel.modules():
        if isinstance(m, (ActQuantizer, SoftmaxOutputQuantizer)) and id(m) not in rows:
            m.mode = "quant" if id(m) in chosen else "float"
        if isinstance(m, (QLinear, QEmbedding)):
            m.weight_quant.disable_quant = id(m) not in chosen
        if isinstance(m, WeightOnly):
            m.enabled = id(m) in chosen
    for m in qmodel.modules():  # a weight-only conv's bias correction goes with its weight codes
        plists = getattr(m, "parametrizations", {})
        if "bias" in plists and isinstance(plists["bias"][0], BiasShift) and "weight" in plists:
            plists["bias"][0].enabled = plists["weight"][0].enabled


def quant_parts(qmodel: nn.Module) -> dict[str, set[int]]:
    """Quantization points grouped by tensor kind and by transformer layer."""
    parts: dict[str, set[int]] = {}
    attention_points(qmodel)
    layer_of = {name: i for i, (name, _) in enumerate(transformer_blocks(qmodel))}

    def layer_index(name: str) -> int | None:
        hits = [i for prefix, i in layer_of.items() if name.startswith(prefix + ".")]
        return hits[-1] if hits else None

    for name, m in qmodel.named_modules():
        kinds: list[tuple[str, nn.Module]] = []
        if isinstance(m, QLinear):
            kinds = [("linear weights", m), ("linear inputs", m.input_act)]
        elif isinstance(m, QEmbedding):
            kinds = [("embeddings, conv and position weights", m)]
        elif isinstance(m, WeightOnly):  # a parametrization of a Conv2d or a position table
            kinds = [("embeddings, conv and position weights", m)]
        elif isinstance(m, (QLayerNorm, QNorm)):
            kinds = [("residual stream", m.input_act)]
        elif hasattr(m, "probs") and hasattr(m, "scores") and hasattr(m, "softmax_name"):
            kinds = [(kind, getattr(m, attr)) for kind, attr in
                     (("Q, K inputs", "q"), ("Q, K inputs", "k"), ("softmax input", "scores"),
                      ("softmax output", "probs"), ("V input", "v"))
                     if isinstance(getattr(m, attr), (ActQuantizer, SoftmaxOutputQuantizer))]
        index = layer_index(name)
        for kind, q in kinds:
            parts.setdefault(f"kind: {kind}", set()).add(id(q))
            if index is not None:
                parts.setdefault(f"layer {index}", set()).add(id(q))
    return parts


def sensitivity(qmodel: nn.Module, metric: Callable[[nn.Module], float]) -> list[tuple[str, float]]:
    """Metric with only one part quantized at a time, worst first; restores full quantization after.

    ``metric`` is evaluated once with everything float (the reference, first row,
    named "none (float)") and once per part.
    """
    if getattr(qmodel, "softq_weights_quantized", False):
        raise ValueError("this model was loaded from weight codes (softq.quant.save's default): its float weights "
                         "are the quantized ones, so a ranking would show no weight error; rank the model "
                         "softq.quantize returned, or one saved with softq.quant.save(..., weights='float')")
    parts = quant_parts(qmodel)
    everything = set().union(*parts.values())
    results = []
    try:
        enable_only(qmodel, set())
        results.append(("none (float)", metric(qmodel)))
        for name, ids in parts.items():
            enable_only(qmodel, ids)
            results.append((name, metric(qmodel)))
        enable_only(qmodel, everything)
        results.append(("all (W8A8)", metric(qmodel)))
    finally:
        enable_only(qmodel, everything)
    return results


def plot_sensitivity(rows: list[tuple[str, float]], metric_name: str, path: str | os.PathLike) -> Path:
    """Bar chart of the metric change each quantized part causes alone (PNG, atomic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = rows[0][1]
    parts = rows[1:]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(parts) + 1.2))
    ax.barh([name for name, _ in parts], [value - ref for _, value in parts], color="tab:red")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set(title=f"{metric_name}: change with only this part quantized", xlabel=f"{metric_name} - float")
    fig.tight_layout()
    return save_figure(fig, path)


def format_sensitivity(rows: list[tuple[str, float]], higher_is_better: bool) -> str:
    ref = rows[0][1]
    ranked = sorted(rows[1:-1], key=lambda r: (ref - r[1]) if higher_is_better else (r[1] - ref), reverse=True)
    lines = [f"{'quantized part':<24} {'metric':>10} {'change':>10}"]
    for name, value in [rows[0], *ranked, rows[-1]]:
        change = value - ref
        lines.append(f"{name:<24} {value:>10.4f} {change:>+10.4f}" if math.isfinite(value) else f"{name:<24} {value}")
    return "\n".join(lines)
