"""MPC-friendly surrogates for the non-linear layers, and how a model is switched to them.

Softmax variants are *not* defined here: they live in :mod:`softq.softmax` and
run unchanged on CrypTensors.  This module adds the other non-linearities:

* GELU: ``erf`` (the exact form) and ``tanh`` (its tanh form), both evaluated under
  MPC by :func:`softq.mpc.approx.gelu` (accurate for any input), ``quad``
  (MPCFormer's ``0.125x^2 + 0.25x + 0.5``, one multiplication) and ``relu``.
* SiLU (SwiGLU's gate): ``silu`` (:func:`softq.mpc.approx.silu`), ``quad`` and ``relu``.
  Which activation a module is comes from running it on a probe (:func:`activation_kind`);
  the ``gelu`` choice applies to whichever the model has.
* LayerNorm: exact (:func:`layer_norm`; under MPC :func:`softq.mpc.approx.layer_norm`,
  a comparison-selected normaliser and a polynomial inverse square root).

Every body uses only tensor methods, so the same function is the plaintext
student (used by distillation and accuracy runs) and the encrypted operator.

:func:`configure_surrogates` switches a Hugging Face model to the chosen
surrogates, per layer.  During ``torch.export`` (inside :func:`exporting`) the
surrogate calls become the custom ops ``softq_mpc::softmax`` and
``softq_mpc::gelu``, so the exported graph names each surrogate as one node
that :mod:`softq.mpc.graph` maps to the CrypTen implementation.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from softq.attention import AttentionPoints, attention_inputs, configure_attention, mask_bias
from softq.models import attention_modules, model_family
from softq.softmax import get_softmax

MPC_ATTN_IMPLEMENTATION = "softq_mpc"
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _plain(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


# ---------------------------------------------------------------------------
# GELU surrogates
# ---------------------------------------------------------------------------


def gelu_erf(x: Any) -> Any:
    """Exact GELU ``x/2 (1 + erf(x / sqrt 2))``.

    Under MPC: :func:`softq.mpc.approx.gelu` (comparison-selected branches and a
    Chebyshev series, max error ~3e-5 for any input); CrypTen's own erf series
    diverges for |x| > ~3.
    """
    if _plain(x):
        return nn.functional.gelu(x)
    from softq.mpc.approx import gelu

    return gelu(x, "erf")


def gelu_tanh(x: Any) -> Any:
    """Tanh form ``x/2 (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))``.

    Under MPC: :func:`softq.mpc.approx.gelu` fitted to this form (max error ~3e-5
    for any input); CrypTen's tanh wraps around the ring for tanh arguments beyond
    ~500 (MiniLM reaches 546), returning errors of ~2^32.
    """
    if not _plain(x):
        from softq.mpc.approx import gelu

        return gelu(x, "tanh")
    inner = (x + x.square() * x * 0.044715) * _SQRT_2_OVER_PI
    return x * (inner.tanh() + 1.0) * 0.5


def gelu_quad(x: Any) -> Any:
    """MPCFormer's Quad ``0.125 x^2 + 0.25 x + 0.5``: one multiplication, needs distillation.

    Under MPC: :func:`softq.mpc.approx.quadratic` (one Beaver round and one truncation).
    """
    if not _plain(x):
        from softq.mpc.approx import quadratic

        return quadratic(x, 0.125, 0.25, 0.5)
    return x.square() * 0.125 + x * 0.25 + 0.5


def gelu_relu(x: Any) -> Any:
    """ReLU in place of GELU: one comparison."""
    return x.relu()


GELU_VARIANTS: dict[str, Callable[[Any], Any]] = {
    "erf": gelu_erf,
    "tanh": gelu_tanh,
    "quad": gelu_quad,
    "relu": gelu_relu,
}


def get_gelu(name: str) -> Callable[[Any], Any]:
    try:
        return GELU_VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown GELU surrogate '{name}'; choose one of {sorted(GELU_VARIANTS)}") from None


# ---------------------------------------------------------------------------
# SiLU surrogates (Llama, Qwen, Mistral, Phi-3: SwiGLU's gate)
# ---------------------------------------------------------------------------


def silu_exact(x: Any) -> Any:
    """SiLU ``x sigmoid(x)``.  Under MPC: :func:`softq.mpc.approx.silu` (piecewise, max error ~2.4e-4)."""
    if _plain(x):
        return nn.functional.silu(x)
    from softq.mpc.approx import silu

    return silu(x)


SILU_QUAD = (0.125, 0.5, 0.15)  # least squares on [-4, 4] with a2 = 2^-3 and a1 / a2 an integer (max error 0.22)


def silu_quad(x: Any) -> Any:
    """Quad for SiLU ``0.125 x^2 + 0.5 x + 0.15``: one multiplication, needs distillation (as MPCFormer's GELU Quad)."""
    a2, a1, a0 = SILU_QUAD
    if not _plain(x):
        from softq.mpc.approx import quadratic

        return quadratic(x, a2, a1, a0)
    return x.square() * a2 + x * a1 + a0


SILU_VARIANTS: dict[str, Callable[[Any], Any]] = {"silu": silu_exact, "quad": silu_quad, "relu": gelu_relu}
# activation kind -> its surrogates; ``quad`` and ``relu`` exist for both kinds
ACTIVATIONS: dict[str, dict[str, Callable[[Any], Any]]] = {"gelu": GELU_VARIANTS, "silu": SILU_VARIANTS}


def get_activation(kind: str, name: str) -> Callable[[Any], Any]:
    """The surrogate ``name`` of a ``kind`` ("gelu" or "silu") activation; one line naming the choices else."""
    variants = ACTIVATIONS[kind]
    if name not in variants:
        raise ValueError(f"'{name}' is not a surrogate of a {kind.upper()} activation; choose one of {sorted(variants)}")
    return variants[name]


def op_name(kind: str, name: str) -> str:
    """The surrogate as the exported ``softq_mpc::gelu`` node names it: ``quad`` (GELU), ``silu/quad`` (SiLU)."""
    return name if kind == "gelu" else f"{kind}/{name}"


def from_op_name(text: str) -> Callable[[Any], Any]:
    kind, _, name = text.rpartition("/")
    return get_activation(kind or "gelu", name)


_PROBE = torch.linspace(-6.0, 6.0, 49)


def activation_kind(module: nn.Module) -> str | None:
    """``"gelu"`` or ``"silu"`` when ``module`` computes that activation (found by running it on a probe), else None.

    Only leaf modules with no parameters or buffers are run; a GELU's tanh form and its fast
    variants count as GELU (within 2e-3); QuickGELU (``x sigmoid(1.702 x)``) is neither."""
    if isinstance(module, SurrogateGELU):
        return module.kind
    if any(True for _ in module.children()) or any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return None
    try:
        with torch.no_grad():
            out = module(_PROBE.clone())
    except Exception:  # another signature: not an activation
        return None
    if not isinstance(out, torch.Tensor) or out.shape != _PROBE.shape or not out.is_floating_point():
        return None
    if (out - nn.functional.silu(_PROBE)).abs().max() < 1e-4:
        return "silu"
    if (out - nn.functional.gelu(_PROBE)).abs().max() < 2e-3:
        return "gelu"
    return None


# ---------------------------------------------------------------------------
# LayerNorm
# ---------------------------------------------------------------------------

# Public thresholds that bracket the (scaled) variance for the normaliser guess:
# var in [4^k, 4^(k+1)) gets 1/sqrt(2 * 4^k), within a factor sqrt 2 of 1/sqrt(var).
_LN_THRESHOLDS = [4.0**k for k in range(-6, 12)]


def _bits_to_fixed(bits: Any) -> Any:
    """CrypTen returns comparison bits with scale 1; give them the standard fixed-point scale.

    (Multiplying scale-1 bits by a public float would round the float to an integer.)
    """
    from softq.mpc._crypten_shim import load_crypten

    crypten = load_crypten()
    standard = crypten.encoder.FixedPointEncoder()
    if bits.encoder.scale == standard.scale:
        return bits
    out = bits * int(standard.scale // bits.encoder.scale)
    out.encoder = standard
    return out


def _range_guess(var: Any) -> Any:
    """A secret ``g`` with ``g^2 var`` in [1/2, 2]: one batched comparison against public powers of 4."""
    thresholds = torch.tensor(_LN_THRESHOLDS)
    guesses = [1.0 / math.sqrt(2.0 * _LN_THRESHOLDS[0] / 4.0)] + [1.0 / math.sqrt(2.0 * t) for t in _LN_THRESHOLDS]
    steps = torch.tensor([b - a for a, b in zip(guesses[:-1], guesses[1:])])
    above = _bits_to_fixed(var.gt(thresholds))  # [..., 1] vs [K] -> [..., K] bits
    return (above * steps).sum(dim=-1, keepdim=True) + guesses[0]


def _nr_inv_sqrt(z: Any, y: Any, iters: int) -> Any:
    """CrypTen's Newton-Raphson step for 1/sqrt(z): ``y <- y (3 - z y^2) / 2``."""
    for _ in range(iters):
        y_sq = y * y if isinstance(y, float) else y.square()
        y = (3.0 - z * y_sq) * y * 0.5
    return y


def inv_sqrt(var: Any, iters: int = 5) -> Any:
    """``1 / sqrt(var)`` for positive ``var`` (plaintext: exact; CrypTensor: Newton-Raphson).

    CrypTen's own ``inv_sqrt`` starts from an exp-based guess that is only good for
    var in roughly [0.05, 100]; here the start comes from :func:`_range_guess`
    (covers 2.4e-4 .. 1.7e7).
    """
    if _plain(var):
        return var.rsqrt()
    return _nr_inv_sqrt(var, _range_guess(var), iters)


def layer_norm(x: Any, normalized_shape: Sequence[int], weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Any:
    """LayerNorm over the last ``len(normalized_shape)`` dims, exact up to fixed point.

    Under MPC: :func:`softq.mpc.approx.layer_norm` (a normaliser ``s ~ 1/std`` picked by
    one batched comparison of the variance with public powers of 2, then ``z^-1/2`` of
    the normalised variance ``z`` in [2^-1/2, 2^1/2] by a polynomial; 21 rounds).
    """
    n_dims = len(normalized_shape)
    flat = x.flatten(-n_dims) if n_dims > 1 else x
    fold = not _plain(x) and weight is not None and n_dims == 1  # MPC: weight folded into the last product
    if _plain(x):
        centred = flat - flat.mean(dim=-1, keepdim=True)
        out = centred * (centred.square().mean(dim=-1, keepdim=True) + eps).rsqrt()
    else:
        from softq.mpc.approx import layer_norm as mpc_layer_norm

        out = mpc_layer_norm(flat, weight if fold else None, eps)
    if n_dims > 1:
        out = out.reshape(*x.shape) if not _plain(out) else out.view(x.shape)
    if weight is not None and not fold:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out


# ---------------------------------------------------------------------------
# Custom ops: one graph node per surrogate in the exported program
# ---------------------------------------------------------------------------


def softmax_spec(name: str, params: Mapping[str, float]) -> str:
    return json.dumps({"name": name, "params": dict(params)}, sort_keys=True)


@torch.library.custom_op("softq_mpc::softmax", mutates_args=())
def _softmax_op(scores: torch.Tensor, valid: torch.Tensor | None, spec: str) -> torch.Tensor:
    s = json.loads(spec)
    return get_softmax(s["name"])(scores, valid, **s["params"]).clone()


@_softmax_op.register_fake
def _(scores: torch.Tensor, valid: torch.Tensor | None, spec: str) -> torch.Tensor:
    return torch.empty_like(scores)


@torch.library.custom_op("softq_mpc::gelu", mutates_args=())
def _gelu_op(x: torch.Tensor, name: str) -> torch.Tensor:
    return from_op_name(name)(x).clone()


@_gelu_op.register_fake
def _(x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(x)


_EXPORTING = False


@contextlib.contextmanager
def exporting(model: nn.Module) -> Iterator[None]:
    """Within this block the model's surrogates trace to the ``softq_mpc::*`` custom ops."""
    from softq.families import set_implementation

    global _EXPORTING
    from softq.mpc.norms import swapped

    previous_impl = model.config._attn_implementation
    set_implementation(model, MPC_ATTN_IMPLEMENTATION)
    _EXPORTING = True
    try:
        with swapped(model):
            yield
    finally:
        _EXPORTING = False
        set_implementation(model, previous_impl)


class SurrogateGELU(nn.Module):
    """Replaces a GELU (``kind="gelu"``) or SiLU (``kind="silu"``) activation module by a named surrogate."""

    def __init__(self, name: str, kind: str = "gelu") -> None:
        super().__init__()
        get_activation(kind, name)
        self.name = name
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _EXPORTING:
            return torch.ops.softq_mpc.gelu(x, op_name(self.kind, self.name))
        return get_activation(self.kind, self.name)(x)

    def extra_repr(self) -> str:
        return f"name={self.name}" if self.kind == "gelu" else f"name={self.name}, kind={self.kind}"


def mpc_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention as exported for MPC: the softmax variant is one ``softq_mpc::softmax`` node.

    The valid mask is derived from the (public) attention mask with plaintext ops,
    so the graph interpreter keeps it public; sliding windows and local attention are
    such masks.  Grouped K/V heads are repeated (:func:`softq.attention.attention_inputs`);
    RoPE's tables are functions of the public positions, so rotating q and k costs
    only local products.  A relative position bias (T5's ``position_bias``, MPNet's, passed apart from the
    mask: ``takes_position_bias``) is a lookup of the secret bias table at public buckets, added to the scores
    locally.  Soft-capping (``tanh``, costly and inaccurate under MPC) and learned sink logits are refused.
    """
    if softcap is not None:
        raise ValueError(f"softq.mpc does not run attention logit soft-capping ({type(module).__name__}: "
                         f"tanh(scores / {softcap:g}) * {softcap:g}); set the config's attn_logit_softcapping to None "
                         "and distil, or use another model")
    if s_aux is not None:
        raise ValueError(f"softq.mpc does not run learned attention sink logits (s_aux of {type(module).__name__})")
    points: AttentionPoints | None = getattr(module, "softq", None)
    if points is None:
        raise RuntimeError("MPC export needs softq attention state; call softq.mpc.configure_surrogates first")
    if points.gate is not None or points.sink is not None or not all(
        isinstance(getattr(points, n), nn.Identity) for n in ("q", "k", "scores", "v")
    ):
        raise ValueError("softq.mpc does not run quantized, gated or constant-sink attention; pass the float model")
    bias = mask_bias(module, attention_mask, key.shape[-2])
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    key, value, valid, scaling = attention_inputs(module, query, key, value, attention_mask, scaling)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if bias is not None:  # secret where it is the model's bias table: added locally
        scores = scores + bias
    probs = torch.ops.softq_mpc.softmax(scores, valid, softmax_spec(points.softmax_name, points.softmax_params))
    out = torch.matmul(probs, value)
    return out.transpose(1, 2).contiguous(), probs


mpc_attention.takes_position_bias = True  # type: ignore[attr-defined]  # (softq.families passes it apart)
AttentionInterface.register(MPC_ATTN_IMPLEMENTATION, mpc_attention)
AttentionMaskInterface.register(MPC_ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


# ---------------------------------------------------------------------------
# Switching a model to surrogates
# ---------------------------------------------------------------------------

_LAYER_RE = re.compile(r"(?:^|\.)(?:layer|layers|h|block|blocks)\.(\d+)(?:\.|$)")


def layer_index(module_path: str) -> int | None:
    """Transformer block index in a module path (``bert.encoder.layer.3.x`` -> 3)."""
    match = _LAYER_RE.search(module_path)
    return int(match.group(1)) if match else None


def _per_layer(choice: str | Sequence[str] | Mapping[int, str] | None, n_layers: int, what: str) -> list[str | None]:
    if choice is None or isinstance(choice, str):
        return [choice] * n_layers
    if isinstance(choice, Mapping):
        bad = [k for k in choice if not 0 <= int(k) < n_layers]
        if bad:
            raise ValueError(f"{what}: layer(s) {bad} out of range for a model with {n_layers} layers")
        return [choice.get(i, choice.get(str(i))) for i in range(n_layers)]  # type: ignore[call-overload]
    choice = list(choice)
    if len(choice) != n_layers:
        raise ValueError(f"{what}: got {len(choice)} per-layer choices for a model with {n_layers} layers")
    return choice


@dataclass
class SurrogateSpec:
    """Which surrogate every layer uses; public, and part of the parties' fingerprint."""

    softmax: list[str]
    softmax_params: dict[str, float] = field(default_factory=dict)
    gelu: list[str | None] = field(default_factory=list)
    layer_norm: str = "exact"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SurrogateSpec:
        return cls(**json.loads(text))

    def short(self) -> str:
        sm = sorted(set(self.softmax))
        ge = sorted({g for g in self.gelu if g})
        return f"softmax={'/'.join(sm)} gelu={'/'.join(ge) or 'native'}"


def configure_surrogates(
    model: nn.Module,
    softmax: str | Sequence[str] | Mapping[int, str] = "2quad",
    gelu: str | Sequence[str] | Mapping[int, str] | None = "quad",
    softmax_params: Mapping[str, float] | None = None,
) -> SurrogateSpec:
    """Switch ``model`` (in place) to softq attention with the given softmax and GELU surrogates.

    ``softmax`` / ``gelu`` are one name for every layer, a list with one name per
    layer, or a ``{layer: name}`` dict (unlisted layers keep the exact softmax /
    their native activation).  ``gelu=None`` keeps the native activation.  The
    plaintext model then computes exactly what the encrypted one approximates.
    """
    from softq.hf import is_sentence_transformer

    if is_sentence_transformer(model):  # softq.mpc runs Hugging Face models; the pooling is the client's
        raise ValueError("softq.mpc takes the SentenceTransformer's Hugging Face model: pass st[0].auto_model (inputs "
                         "from st.tokenize) and pool its revealed hidden states with softq.hf.pool")
    model_family(model)
    points = configure_attention(model)
    n_layers = len(points)
    params = dict(softmax_params or {})
    softmax_names = [s or "softmax" for s in _per_layer(softmax, n_layers, "softmax")]
    for p, name in zip(points, softmax_names):
        if get_softmax(name).mpc_ok is False:
            raise ValueError(f"softmax variant '{name}' cannot run under MPC")
        variant_params = {k: v for k, v in params.items() if k in get_softmax(name).defaults}
        p.set_softmax(name, **variant_params)
    gelu_names = _per_layer(gelu, n_layers, "gelu")
    known = set(GELU_VARIANTS) | set(SILU_VARIANTS)
    for name in gelu_names:
        if name is not None and name not in known:
            raise ValueError(f"unknown GELU surrogate '{name}'; choose one of {sorted(GELU_VARIANTS)} (GELU models) "
                             f"or {sorted(SILU_VARIANTS)} (SiLU models)")
    found = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            path = f"{parent_name}.{child_name}" if parent_name else child_name
            idx = layer_index(path)
            if idx is None or idx >= n_layers:
                continue
            kind = activation_kind(child)
            if kind is not None:
                found.append((parent, child_name, idx, kind))
    for _, _, idx, kind in found:  # every name checked before any module is replaced
        name = gelu_names[idx]
        if name is not None and name not in ACTIVATIONS[kind]:
            raise ValueError(f"{type(model).__name__}'s activation is {kind.upper()}: '{name}' is not one of its "
                             f"surrogates; choose one of {sorted(ACTIVATIONS[kind])}")
    used: list[str | None] = [None] * n_layers
    for parent, child_name, idx, kind in found:
        name = gelu_names[idx]
        if name is not None:
            setattr(parent, child_name, SurrogateGELU(name, kind))
            used[idx] = name
    spec = SurrogateSpec(
        softmax=softmax_names,
        softmax_params={k: float(v) for k, v in params.items()},
        gelu=used,
    )
    model.config.softq_mpc_surrogates = spec.to_json()
    return spec


def surrogate_choice(choice: Any) -> Any:
    """A surrogate choice as ``softq mpc --softmax/--gelu`` spell it, for :func:`configure_surrogates`:
    ``"native"`` is None (the model's own function), ``"a,b"`` one name per layer; any other value as it is."""
    if choice is None or choice == "native":
        return None
    return choice.split(",") if isinstance(choice, str) and "," in choice else choice


def restore_surrogates(model: nn.Module) -> nn.Module:
    """Switch a student back to the surrogates its config records (``softq_mpc_surrogates``), if any."""
    spec = getattr(model.config, "softq_mpc_surrogates", None)
    if spec:
        spec = SurrogateSpec.from_json(spec)
        configure_surrogates(model, softmax=spec.softmax, gelu=spec.gelu, softmax_params=spec.softmax_params)
    return model


def attention_layer_names(model: nn.Module) -> list[str]:
    return [name for name, _ in attention_modules(model)]
