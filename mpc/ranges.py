"""The plaintext range pass: refuse, before any secret is shared, a run whose values would not fit.

CrypTen computes in 16-bit fixed point in a 64-bit ring, and its (and softq's)
approximations of exp, reciprocal, tanh and sigmoid are accurate on a bounded
input range only; outside it they wrap around and return garbage with no error.
The model owner therefore evaluates the exported graph once in plaintext on
calibration inputs (:func:`range_pass`), records the smallest and largest value
at every secret operation and at every approximation's input
(:class:`RangeRecord`), and :func:`check_ranges` raises :class:`RangeError`
naming the layer, op and quantity whose observed range, widened by the safety
margin, leaves the safe interval (:data:`SAFE_RANGES`).

A margin ``m`` widens an observed value ``v`` to ``v * m`` when that moves it away
from zero and to ``v / m`` when the safe interval has a positive lower bound
(reciprocals): unseen inputs may have values ``m`` times larger or smaller.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from softq.mpc.approx import EXP_RANGE, LN_OUTPUT_LIMIT, LN_VAR_RANGE, RECIPROCAL_RANGE, ROW_RANGE
from softq.mpc.errors import MPCError
from softq.mpc.truncation import EXACT_TRUNCATION_LIMIT
from softq.softmax import RELU2_EPS, _masked_for_max

# Every secret value (and every product before truncation) stays inside this.
FIXED_POINT_LIMIT = EXACT_TRUNCATION_LIMIT
# Measured with a 1-party CrypTen (max abs error <= 5e-3 inside, ~1e10 at +-300 for tanh).
TANH_RANGE = (-100.0, 100.0)
SIGMOID_RANGE = (-300.0, 300.0)
# softq's LayerNorm brackets cover these variances (softq.mpc.approx.layer_norm).
LAYER_NORM_VAR_RANGE = LN_VAR_RANGE

SAFE_RANGES: dict[str, tuple[tuple[float, float], str]] = {
    "value": ((-FIXED_POINT_LIMIT, FIXED_POINT_LIMIT), "16-bit fixed point in a 64-bit ring, exact truncation"),
    "exp input": (EXP_RANGE, "softq exp (1 + y + y^2/2)^256"),
    "reciprocal input": (RECIPROCAL_RANGE, "Newton-Raphson reciprocal after the public row scale"),
    "tanh input": (TANH_RANGE, "CrypTen tanh"),
    "sigmoid input": (SIGMOID_RANGE, "CrypTen sigmoid"),
    "layernorm variance": (LAYER_NORM_VAR_RANGE, "LayerNorm variance brackets"),
    "layernorm output": ((-LN_OUTPUT_LIMIT, LN_OUTPUT_LIMIT), "LayerNorm's lazily truncated last product (before bias)"),
    "row sum": (ROW_RANGE, "2Quad row division brackets, after the public row scale"),
}


class RangeError(MPCError):
    """A value of the model leaves the safe range of the fixed-point encoding or of an approximation."""


@dataclass
class RangeConfig:
    """How much headroom the range check demands beyond the calibration inputs' values."""

    margin: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool) or not math.isfinite(self.margin) \
                or self.margin < 1.0:
            raise ValueError(f"range margin must be a finite number >= 1, got {self.margin!r}")


@dataclass
class RangeRecord:
    layer: str
    op: str
    node: str
    quantity: str
    low: float
    high: float

    def merge(self, low: float, high: float) -> None:
        self.low, self.high = min(self.low, low), max(self.high, high)


def _widen(value: float, bound_low: float, margin: float, upper: bool) -> float:
    if upper:
        return value * margin if value > 0 else value / margin
    if value < 0:
        return value * margin
    return value / margin if bound_low > 0 else value


def violation(record: RangeRecord, margin: float) -> str | None:
    """The reason ``record`` (widened by ``margin``) is unsafe, or None."""
    (lo, hi), what = SAFE_RANGES[record.quantity]
    low = _widen(record.low, lo, margin, upper=False)
    high = _widen(record.high, lo, margin, upper=True)
    if low >= lo and high <= hi:
        return None
    return (f"{record.layer} {record.op} ({record.node}): {record.quantity} reaches [{record.low:.4g}, {record.high:.4g}] "
            f"on the calibration inputs; with margin {margin:g} it must stay within [{lo:.4g}, {hi:.4g}] ({what})")


def check_ranges(records: Iterable[RangeRecord], config: RangeConfig | None = None) -> None:
    """Raise :class:`RangeError` for the first unsafe record (in graph order)."""
    config = config or RangeConfig()
    for record in records:
        reason = violation(record, config.margin)
        if reason is not None:
            raise RangeError(f"refused before any secret was shared: {reason}")


def _minmax(t: torch.Tensor) -> tuple[float, float] | None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return None
    return float(t.min()), float(t.max())


def _softmax_internals(name: str, params: Mapping[str, float], scores: torch.Tensor,
                       valid: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
    """(quantity, values) of the approximations inside a softmax variant, over valid entries."""
    from softq.mpc.graph import _denominator_scale

    key_len = scores.shape[-1]
    v = torch.ones_like(scores) if valid is None else valid.expand_as(scores).to(scores.dtype)
    keep = v > 0
    out: list[tuple[str, torch.Tensor]] = []
    scale = _denominator_scale(name, params, key_len)
    if name in ("softmax", "clipped"):
        # masked keys pushed to -MASK_PUSH as the encrypted branch does: where every valid score of a row lies
        # below that, a masked key is the row max and the row's denominator vanishes (refused here)
        shifted = _masked_for_max(scores, None if valid is None else v)
        shifted = shifted - shifted.amax(-1, keepdim=True)
        rows = keep.any(-1)
        out.append(("exp input", shifted[keep]))
        den = (shifted.exp() * v).sum(-1)[rows]
        out.append(("reciprocal input", den / scale))
    elif name == "2quad":
        from softq.mpc.graph import fused_row_scale

        den = ((scores + float(params.get("c", 5.0))).square() * v).sum(-1)
        out.append(("row sum" if fused_row_scale(name, params, key_len) else "reciprocal input", den / scale))
    elif name == "2relu":
        den = (scores.relu() * v).sum(-1)
        den = den[den > 0]
        out.append(("reciprocal input", (den + RELU2_EPS) / scale))
    elif name == "sigmoid_len":
        count = v.sum(-1, keepdim=True).clamp_min(1.0)
        out.append(("sigmoid input", (scores - count.log())[keep]))
    return out


def _custom_kind(name: str, args: Any) -> str:
    """A ``softq_mpc`` node's op kind as the graph interpreter reports it (``softmax:2quad``, ``silu:quad``, ``rmsnorm``)."""
    if name == "softmax":
        return f"softmax:{json.loads(args[2])['name']}"
    if name == "gelu":
        kind, _, short = args[1].rpartition("/")
        return f"{kind or 'gelu'}:{short}"
    return "rmsnorm" if name == "rms_norm" else name


class RangePass:
    """Evaluates an exported graph in plaintext and records the ranges of its secret values."""

    def __init__(self, ep: torch.export.ExportedProgram) -> None:
        self.ep = ep
        self.records: dict[tuple[str, str, str, str], RangeRecord] = {}

    def _record(self, layer: str, op: str, node: str, quantity: str, values: torch.Tensor) -> None:
        mm = _minmax(values)
        if mm is None:
            return
        key = (layer, op, node, quantity)
        if key in self.records:
            self.records[key].merge(*mm)
        else:
            self.records[key] = RangeRecord(layer, op, node, quantity, *mm)

    def run(self, inputs: Mapping[str, torch.Tensor]) -> None:
        from softq.mpc.graph import HANDLERS, SECRET_INPUTS, _layer_of, _op_name

        env: dict[str, Any] = {}
        secret: set[str] = set()
        placeholders = [n for n in self.ep.graph.nodes if n.op == "placeholder"]
        for node, spec in zip(placeholders, self.ep.graph_signature.input_specs):
            kind = spec.kind.name
            if kind == "PARAMETER":
                env[node.name] = self.ep.state_dict[spec.target].detach()
                secret.add(node.name)
            elif kind in ("BUFFER", "CONSTANT_TENSOR"):
                value = self.ep.state_dict.get(spec.target)
                env[node.name] = value if value is not None else self.ep.constants[spec.target]
            else:
                env[node.name] = inputs.get(spec.arg.name)
                if spec.arg.name in SECRET_INPUTS:
                    secret.add(node.name)
        for node in self.ep.graph.nodes:
            if node.op != "call_function":
                continue
            args = tree_map(lambda a: env[a.name] if isinstance(a, torch.fx.Node) else a, node.args)
            kwargs = tree_map(lambda a: env[a.name] if isinstance(a, torch.fx.Node) else a, node.kwargs)
            with torch.no_grad():
                env[node.name] = args[0][args[1]] if node.target is operator.getitem else node.target(*args, **kwargs)
            deps = [a.name for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, torch.fx.Node)]
            if not any(d in secret for d in deps):
                continue
            secret.add(node.name)
            namespace, name = _op_name(node.target)
            if node.target is operator.getitem or name in ("sym_size", "size"):
                continue
            layer = _layer_of(node)
            if namespace == "softq_mpc":
                op = _custom_kind(name, args)
            else:
                op = HANDLERS.get(name, (None, name))[1]
            for out in tree_flatten(env[node.name])[0]:
                if isinstance(out, torch.Tensor):
                    self._record(layer, op, node.name, "value", out)
            secret_divisor = len(node.args) > 1 and isinstance(node.args[1], torch.fx.Node) and node.args[1].name in secret
            self._internals(namespace, name, layer, op, node.name, args, secret_divisor)

    def _internals(self, namespace: str, name: str, layer: str, op: str, node: str, args: Any,
                   secret_divisor: bool = False) -> None:
        if namespace == "softq_mpc" and name == "softmax":
            spec = json.loads(args[2])
            for quantity, values in _softmax_internals(spec["name"], spec["params"], args[0], args[1]):
                self._record(layer, op, node, quantity, values)
        elif namespace == "softq_mpc" and name == "rms_norm":  # LayerNorm's steps without the mean
            x, weight, eps, offset = args
            var = x.square().mean(-1, keepdim=True) + eps
            self._record(layer, op, node, "layernorm variance", var)
            self._record(layer, op, node, "layernorm output", x * var.rsqrt() * (weight + offset))
        elif name in ("softmax", "_softmax"):
            for quantity, values in _softmax_internals("softmax", {}, args[0].movedim(args[1], -1), None):
                self._record(layer, op, node, quantity, values)
        elif name == "exp":
            self._record(layer, op, node, "exp input", args[0])
        elif name == "tanh":
            self._record(layer, op, node, "tanh input", args[0])
        elif name == "sigmoid":
            self._record(layer, op, node, "sigmoid input", args[0])
        elif name == "div" and secret_divisor and isinstance(args[1], torch.Tensor) and args[1].is_floating_point():
            self._record(layer, op, node, "reciprocal input", args[1].abs())
        elif name == "layer_norm":
            x, shape = args[0], args[1]
            dims = tuple(range(-len(shape), 0))
            eps = args[4] if len(args) > 4 else 1e-5
            var = x.var(dim=dims, unbiased=False, keepdim=True) + eps
            self._record(layer, op, node, "layernorm variance", var)
            normalized = (x - x.mean(dim=dims, keepdim=True)) * var.rsqrt()
            weight = args[2] if len(args) > 2 else None
            self._record(layer, op, node, "layernorm output", normalized * weight if weight is not None else normalized)


def range_pass(ep: torch.export.ExportedProgram, calibration: Iterable[Mapping[str, torch.Tensor]]) -> list[RangeRecord]:
    """Ranges of every secret value and approximation input over the calibration batches (graph order).

    Every batch must have the exported shapes (the graph is fixed-shape).
    """
    rp = RangePass(ep)
    n = 0
    for batch in calibration:
        rp.run(batch)
        n += 1
    if n == 0:
        raise ValueError("the range pass needs at least one calibration batch")
    return list(rp.records.values())


def check_model(model: torch.nn.Module, inputs: Mapping[str, torch.Tensor],
                calibration: Iterable[Mapping[str, torch.Tensor]] | None = None,
                config: RangeConfig | None = None) -> list[RangeRecord]:
    """Export ``model`` (already switched to its surrogates) at ``inputs``' shapes and check its ranges.

    ``calibration`` defaults to ``[inputs]``.  Returns the records; raises :class:`RangeError`.
    """
    from softq.mpc.graph import PUBLIC_INPUTS, example_inputs, export_model

    shapes = {k: tuple(v.shape) for k, v in inputs.items()}
    public = {k: v for k, v in inputs.items() if k in PUBLIC_INPUTS}
    ep = export_model(model, example_inputs(model, shapes, public))
    records = range_pass(ep, list(calibration) if calibration is not None else [dict(inputs)])
    check_ranges(records, config)
    return records
