"""Outlier and softmax diagnostics per layer and head (the per-part sensitivity ranking of a quantized
model is ``softq.quant.sensitivity``).

Per transformer layer, at the three places outliers live:
  * ``inf_norm`` / ``kurtosis``: max |x| and Pearson kurtosis (3 for a Gaussian,
    averaged over calibration batches) of the block's output hidden state.  In a
    pre-LN model (GPT-2, OPT, ViT) that is the residual stream itself;
  * ``ln_input_inf_norm`` / ``ln_input_kurtosis``: the same over the inputs of the
    block's norms (LayerNorm or RMSNorm, found by what they compute: ``softq.norms``).
    In a post-LN model (BERT, RoBERTa) the block output has just been normalised
    (|x| ~ 10 in all-MiniLM-L6-v2) and the outliers sit here, in the residual sum
    entering the LayerNorm (|x| = 223): this is what a per-tensor 8-bit residual
    stream has to cover;
  * ``ffn_inf_norm``: max |x| of the FFN output (the block's last Linear), the
    source of those residual outliers;
  * ``outlier_dims``: the hidden dimensions with the largest |x| at the
    LayerNorm inputs (Bondarenko et al. 2021 find a few fixed ones in BERT);
  * ``peak``: where the largest |x| at a norm input sits (norm, token position,
    dimension) and how many times the median |x| of that input it is: a decoder's
    massive activations (Sun et al. 2024: thousands of times the median, at the first
    token, in fixed dimensions) show here as token 0 of an RMSNorm input.
Per attention head (softmax output as the model computes it, quantized or not):
  * ``sink_rate``: mean attention mass on the first key (query rows that can see
    more than one key), the "attention sink" that heads use to do nothing;
  * ``row_sum_deficit``: mean of ``1 - sum_k p`` over valid rows, the mass lost
    by rounding (0 in float for softmax rows; grows at low softmax bits without
    bias correction); a clipped softmax or sigmoid attention gives up mass by
    design, in float too.
Both are means over every query row of ``batches``, however they are batched.
Collecting switches ``model`` to softq's attention (``configure_attention``,
which computes the same function for the exact softmax) if it is not on it yet.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from softq._files import default_mode
from softq.attention import attention_points
from softq.calib.data import Batch, run_batches
from softq.models import transformer_blocks
from softq.norms import find_norms


OUTLIER_DIMS = 3  # dimensions listed per layer
# a norm-input peak this many times the median |x| is reported as a massive activation (Sun et al. 2024 see ratios
# in the thousands at the first token of LLMs; a Gaussian input of 32 * 24 values peaks near 5x its median)
MASSIVE_RATIO = 100.0


@dataclass
class Peak:
    """The largest |x| seen at one layer's norm inputs: which norm, token position and hidden dimension, and its
    ratio to the median |x| of the input it was found in."""

    value: float
    norm: str
    token: int
    dim: int
    ratio: float

    def describe(self) -> str:
        return (f"|x| = {self.value:.4g} at the input of {self.norm}, token {self.token}, dim {self.dim} "
                f"({self.ratio:.0f}x the median |x|)")


@dataclass
class LayerStats:
    layer: int
    inf_norm: float = 0.0
    kurtosis_sum: float = 0.0
    batches: int = 0
    ln_input_inf_norm: float = 0.0
    ln_kurtosis_sum: float = 0.0
    ln_batches: int = 0
    ffn_inf_norm: float = 0.0
    dim_max: torch.Tensor | None = None  # max |x| per hidden dimension at the LayerNorm inputs
    peak: Peak | None = None  # the largest |x| at a norm input: where it sits

    @property
    def kurtosis(self) -> float:
        return self.kurtosis_sum / max(self.batches, 1)

    @property
    def ln_input_kurtosis(self) -> float:
        return self.ln_kurtosis_sum / max(self.ln_batches, 1)

    @property
    def residual_inf_norm(self) -> float:
        """Largest |x| anywhere on the residual stream of this layer (block output or LayerNorm input)."""
        return max(self.inf_norm, self.ln_input_inf_norm)

    @property
    def outlier_ratio(self) -> float:
        """Largest over median per-dimension max |x| at the LayerNorm inputs (what residual_groups="auto" tests)."""
        if self.dim_max is None:
            return 0.0
        return float(self.dim_max.max() / self.dim_max.median().clamp_min(1e-12))

    @property
    def outlier_dims(self) -> list[int]:
        if self.dim_max is None:
            return []
        return torch.topk(self.dim_max, min(OUTLIER_DIMS, self.dim_max.numel())).indices.tolist()


@dataclass
class HeadStats:
    layer: int
    head: int
    sink_rate: float
    row_sum_deficit: float


@dataclass
class Diagnostics:
    layers: list[LayerStats] = field(default_factory=list)
    heads: list[HeadStats] = field(default_factory=list)

    @property
    def max_inf_norm(self) -> float:
        return max(s.inf_norm for s in self.layers)

    @property
    def mean_kurtosis(self) -> float:
        return sum(s.kurtosis for s in self.layers) / len(self.layers)

    @property
    def max_residual_inf_norm(self) -> float:
        return max(s.residual_inf_norm for s in self.layers)

    @property
    def max_ffn_inf_norm(self) -> float:
        return max(s.ffn_inf_norm for s in self.layers)

    @property
    def mean_sink_rate(self) -> float:
        return sum(h.sink_rate for h in self.heads) / len(self.heads)

    @property
    def mean_row_sum_deficit(self) -> float:
        return sum(h.row_sum_deficit for h in self.heads) / len(self.heads)

    def table(self) -> str:
        """Plain-text tables: one row per layer, then one row per head."""
        lines = ["layer  block-out inf-norm  kurtosis  LN-input inf-norm  kurtosis  max/median dim  FFN-out inf-norm  "
                 "top LN-input dims",
                 "-----  ------------------  --------  -----------------  --------  --------------  ----------------  "
                 "-----------------"]
        lines += [f"{s.layer:>5}  {s.inf_norm:>18.2f}  {s.kurtosis:>8.1f}  {s.ln_input_inf_norm:>17.2f}  "
                  f"{s.ln_input_kurtosis:>8.1f}  {s.outlier_ratio:>14.1f}  {s.ffn_inf_norm:>16.2f}  "
                  f"{','.join(map(str, s.outlier_dims)):>17}" for s in self.layers]
        peaks = [(s.layer, s.peak) for s in self.layers if s.peak is not None and s.peak.ratio >= MASSIVE_RATIO]
        if peaks:
            lines += ["", f"massive activations (at least {MASSIVE_RATIO:g}x the median |x| of a norm input):"]
            lines += [f"  layer {layer}: {peak.describe()}" for layer, peak in peaks]
        lines += ["", "layer  head  sink-rate  row-sum deficit", "-----  ----  ---------  ---------------"]
        lines += [f"{h.layer:>5}  {h.head:>4}  {h.sink_rate:>9.3f}  {h.row_sum_deficit:>15.5f}" for h in self.heads]
        lines += ["", f"max inf-norm {self.max_inf_norm:.2f} (block outputs), {self.max_residual_inf_norm:.2f} "
                  f"(residual stream incl. LayerNorm inputs), {self.max_ffn_inf_norm:.2f} (FFN outputs)   mean kurtosis {self.mean_kurtosis:.1f}   "
                  f"mean sink rate {self.mean_sink_rate:.3f}   mean row-sum deficit {self.mean_row_sum_deficit:.5f}"]
        return "\n".join(lines)


def kurtosis(x: torch.Tensor) -> float:
    """Pearson kurtosis E[(x - mu)^4] / sigma^4 of all values of ``x``."""
    x = x.detach().double().reshape(-1)
    centred = x - x.mean()
    var = centred.pow(2).mean()
    return (centred.pow(4).mean() / var.pow(2)).item() if var > 0 else 0.0


def collect(model: nn.Module, batches: list[Batch]) -> Diagnostics:
    """Run ``batches`` through ``model`` and gather the statistics above."""
    layers = attention_points(model)
    layer_stats = [LayerStats(i) for i in range(len(layers))]
    head_sums: dict[tuple[int, int], list[float]] = {}
    handles = []

    def on_probs(index: int) -> Callable:
        def hook(_m: nn.Module, inputs: tuple, out: torch.Tensor) -> None:
            valid = inputs[1]
            p = out.detach().float()
            mask = torch.ones_like(p) if valid is None else torch.broadcast_to(valid, p.shape).float()
            rows_valid = mask.amax(-1)  # rows with at least one valid key
            rows_multi = (mask.sum(-1) > 1).float()
            # sums and row counts, so the means are over rows whatever the batching (a mean of batch means
            # weighted a batch of 1 like one of 16)
            sink, sink_rows = (p[..., 0] * rows_multi).sum(dim=(0, 2)), rows_multi.sum(dim=(0, 2))
            deficit, deficit_rows = ((1 - p.sum(-1)) * rows_valid).sum(dim=(0, 2)), rows_valid.sum(dim=(0, 2))
            for h in range(p.shape[1]):
                acc = head_sums.setdefault((index, h), [0.0, 0.0, 0.0, 0.0])
                acc[0] += sink[h].item()
                acc[1] += sink_rows[h].item()
                acc[2] += deficit[h].item()
                acc[3] += deficit_rows[h].item()
        return hook

    for i, (_, points) in enumerate(layers):
        handles.append(points.probs.register_forward_hook(on_probs(i)))

    def on_block(index: int) -> Callable:
        def hook(_m: nn.Module, _inputs: tuple, out: torch.Tensor | tuple) -> None:
            hidden = out[0] if isinstance(out, tuple) else out
            s = layer_stats[index]
            s.inf_norm = max(s.inf_norm, hidden.detach().abs().max().item())
            s.kurtosis_sum += kurtosis(hidden)
            s.batches += 1
        return hook

    def on_ln_input(index: int, name: str) -> Callable:
        def hook(_m: nn.Module, inputs: tuple) -> None:
            x = inputs[0].detach()
            s = layer_stats[index]
            magnitude = x.abs().float()
            value = float(magnitude.max())
            if s.peak is None or value > s.peak.value:
                where = torch.unravel_index(magnitude.argmax(), magnitude.shape)
                median = float(magnitude.median())
                s.peak = Peak(value, name, int(where[-2]) if x.dim() > 1 else 0, int(where[-1]),
                              value / median if median > 0 else float("inf"))
            dim_max = magnitude.reshape(-1, x.shape[-1]).amax(0)
            s.dim_max = dim_max if s.dim_max is None or s.dim_max.shape != dim_max.shape else s.dim_max.maximum(dim_max)
            s.ln_input_inf_norm = max(s.ln_input_inf_norm, dim_max.max().item())
            s.ln_kurtosis_sum += kurtosis(x)
            s.ln_batches += 1
        return hook

    def on_ffn(index: int) -> Callable:
        def hook(_m: nn.Module, _inputs: tuple, out: torch.Tensor) -> None:
            s = layer_stats[index]
            s.ffn_inf_norm = max(s.ffn_inf_norm, out.detach().abs().max().item())
        return hook

    for i, (block_name, block) in enumerate(transformer_blocks(model)):
        handles.append(block.register_forward_hook(on_block(i)))
        for name, (module, _) in find_norms(block).items():
            parent_name, _, child = name.rpartition(".")
            parent = block.get_submodule(parent_name)
            if child == "norm" and hasattr(parent, "input_act"):  # a quantized norm (QNorm): the input before it
                module, name = parent, parent_name
            handles.append(module.register_forward_pre_hook(on_ln_input(i, f"{block_name}.{name}")))
        ffn = _last_linear(block)
        if ffn is not None:
            handles.append(ffn.register_forward_hook(on_ffn(i)))
    try:
        run_batches(model, batches, desc="diagnostics")
    finally:
        for h in handles:
            h.remove()
    heads = [HeadStats(l, h, v[0] / max(v[1], 1.0), v[2] / max(v[3], 1.0)) for (l, h), v in sorted(head_sums.items())]
    return Diagnostics(layer_stats, heads)


def _last_linear(block: nn.Module) -> nn.Module | None:
    """The block's last Linear (GPT-2 Conv1D included): the FFN output projection in every supported family."""
    linears = [m for m in block.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]
    return linears[-1] if linears else None


def plot(diagnostics: dict[str, Diagnostics], path: str | os.PathLike) -> Path:
    """Per-layer inf-norm and kurtosis, and per-head sink rate, for one or more models (PNG, atomic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, diag in diagnostics.items():
        xs = [s.layer for s in diag.layers]
        line = axes[0].plot(xs, [s.inf_norm for s in diag.layers], marker="o", label=f"{label}: block output")[0]
        if any(s.ln_batches for s in diag.layers):
            axes[0].plot(xs, [s.ln_input_inf_norm for s in diag.layers], marker="s", linestyle="--",
                         color=line.get_color(), label=f"{label}: LayerNorm input")
            axes[0].plot(xs, [s.ffn_inf_norm for s in diag.layers], marker="^", linestyle=":",
                         color=line.get_color(), label=f"{label}: FFN output")
        axes[1].plot(xs, [s.kurtosis for s in diag.layers], marker="o", label=label)
        axes[2].plot(range(len(diag.heads)), [h.sink_rate for h in diag.heads], marker=".", label=label)
    axes[0].set(title="max |x| per layer: residual stream and FFN output", xlabel="layer", yscale="log")
    axes[1].set(title="kurtosis per layer", xlabel="layer", yscale="log")
    axes[2].set(title="attention-sink rate per head", xlabel="layer * heads + head", ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Write a matplotlib figure atomically (temp file in the same folder, then rename)."""
    import matplotlib.pyplot as plt

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".png.tmp")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, format="png")
        default_mode(tmp)
        os.replace(tmp, target)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return target
