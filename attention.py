"""softq's attention function for Hugging Face models, plugged in through ``AttentionInterface``.

One function serves every use: choosing a softmax variant (training the attention
fixes), quantizing the score and P.V matmuls with softmax input and output
(``softq.quant``), and recording statistics (``softq.calib``).  Per-layer state is an
:class:`AttentionPoints` module attached to each attention module as
``module.softq``; a model without it behaves exactly like Hugging Face's eager
attention.

Pitfall handled here (see shared REFERENCES): registering only the attention
function makes transformers pass ``attention_mask=None`` for padded BERT and
causal GPT-2, silently leaking padding and the future.  softq therefore also
registers the eager mask builder under the same name.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from softq.attention_masks import (  # noqa: F401  (re-exported: part of softq.attention's interface)
    _Recording, _extra_column, _masks_the_future, attention_inputs, mask_bias, recording, valid_from_mask,
)
from softq.calib.observers import token_mask
from softq.models import attention_modules, model_family, num_heads
from softq.softmax import compiled_softmax, get_softmax

ATTN_IMPLEMENTATION = "softq"


class ProbsQuantizer(nn.Module):
    """Interface of the softmax-output quantization point: it also sees the valid mask."""

    def forward(self, probs: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:  # pragma: no cover
        return probs


class ProbsTimesV(nn.Module):
    """The P.V matmul of the attention core (``softq.export`` swaps it for a marker covering scores -> P.V)."""

    def forward(self, probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return torch.matmul(probs, value)


class AttentionGate(nn.Module):
    """Gated attention (Bondarenko et al. 2023): ``sigmoid(G(x_h))`` scales each query head's output.

    ``G`` is one ``Linear(head_dim -> 1)`` per query head applied to that head's slice of
    the token's input (the attention module's input split into ``num_heads`` equal slices:
    ``head_dim`` is the input width over the heads, which is the attention head size in
    BERT-like models but not in Gemma or Qwen3), shared across tokens.  The bias starts at
    ``logit(pi_init)`` so a fresh gate is open to ``pi_init``; the weights start at zero.
    """

    def __init__(self, num_heads: int, head_dim: int, pi_init: float = 0.5) -> None:
        super().__init__()
        if isinstance(pi_init, torch.Tensor) and pi_init.numel() == 1:
            pi_init = float(pi_init)
        if isinstance(pi_init, bool) or not isinstance(pi_init, numbers.Real):  # numpy scalars are Real
            raise TypeError(f"gate pi_init must be a number in (0, 1), got {type(pi_init).__name__} {pi_init!r}")
        if not 0.0 < pi_init < 1.0:
            raise ValueError(f"gate pi_init must be in (0, 1), got {pi_init}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.weight = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.bias = nn.Parameter(torch.full((num_heads,), math.log(pi_init / (1.0 - pi_init))))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [b, s, heads*head_dim] -> gate [b, heads, s, 1] in (0, 1)."""
        b, s, _ = hidden.shape
        x = hidden.reshape(b, s, self.num_heads, self.head_dim)
        logits = torch.einsum("bshd,hd->bhs", x, self.weight) + self.bias[None, :, None]
        return torch.sigmoid(logits).unsqueeze(-1)


class ConstantSink(nn.Module):
    """The first position's keys and values as constants of the layer: an explicit attention sink.

    A pretrained encoder's [CLS] (a decoder's first token) is an attention sink: heads
    that have nothing to add park their attention on it, and what they read there hardly
    depends on the text.  In all-MiniLM-L6-v2, replacing [CLS]'s keys and values in every
    layer by their mean over calibration text changes the sentence embeddings by cosine
    0.99994 (docs/outliers.md, section 6).  The model keeps that state constant with a
    huge residual coordinate (|x| = 223), which is what breaks a per-tensor 8-bit residual
    stream.  With the keys and values at position 0 replaced by these per-head constants
    (``key``, ``value``: [heads, head_dim], trainable), no other token reads [CLS]'s
    residual stream any more, and a fine-tune can remove its outliers without moving
    what the other tokens compute (``OutlierFinetuneConfig(constant_sink=True)``).

    While :func:`init_constant_sinks` runs calibration batches, the sink leaves keys and values
    unchanged and sums what arrives at position 0, to start the constants at those means.
    """

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.key = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.value = nn.Parameter(torch.zeros(num_heads, head_dim))
        # [sum of keys, sum of values, rows, smallest keys, largest keys] while init_constant_sinks runs
        self._record: list | None = None

    def forward(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, heads, keys, head_dim] keys and values with position 0 replaced by the constants."""
        if self._record is not None:
            rec = self._record
            rec[0] += key[:, :, 0].detach().double().sum(0).cpu()
            rec[1] += value[:, :, 0].detach().double().sum(0).cpu()
            rec[2] += float(key.shape[0])
            first = key[:, :, 0].detach().double().cpu()
            rec[3] = torch.minimum(rec[3], first.amin(0))
            rec[4] = torch.maximum(rec[4], first.amax(0))
            return key, value
        b = key.shape[0]
        k0 = self.key.to(key.dtype)[None, :, None, :].expand(b, -1, 1, -1)
        v0 = self.value.to(value.dtype)[None, :, None, :].expand(b, -1, 1, -1)
        return torch.cat((k0, key[:, :, 1:]), dim=2), torch.cat((v0, value[:, :, 1:]), dim=2)


class AttentionPoints(nn.Module):
    """Per-layer softq state: softmax variant, quantization points, optional gate and constant sink.

    Every point is an identity until a pass replaces it:
    ``q``/``k`` (inputs of the score matmul), ``scores`` (softmax input),
    ``probs`` (softmax output, a :class:`ProbsQuantizer`), ``v`` (V input of P.V);
    ``pv`` is the P.V matmul itself.
    """

    def __init__(self, num_heads: int, softmax: str = "softmax", softmax_params: dict[str, float] | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.set_softmax(softmax, **(softmax_params or {}))
        self.q: nn.Module = nn.Identity()
        self.k: nn.Module = nn.Identity()
        self.scores: nn.Module = nn.Identity()
        self.probs: nn.Module = ProbsQuantizer()
        self.v: nn.Module = nn.Identity()
        self.pv: nn.Module = ProbsTimesV()
        self.gate: AttentionGate | None = None
        self.sink: ConstantSink | None = None
        # Set by :func:`fast_training` while a training loop runs: exact softmax goes through
        # PyTorch SDPA, other variants through their torch.compile'd form.
        self.fast_training = False
        # Leading positions whose residual-stream rows have scales of their own (QuantConfig.residual_prefix):
        # the special tokens must be there, so a left-padded batch is refused.
        self.prefix_rows = 0
        # The attention module's input, stashed by a pre-hook when a gate needs it.
        self._hidden: torch.Tensor | None = None

    def set_softmax(self, name: str, **params: float) -> None:
        variant = get_softmax(name)
        variant(torch.zeros(1, 2), None, **params)  # validates parameter names and values now
        self.softmax_name = name
        self.softmax_params = dict(params)
        probs = self._modules.get("probs")  # (not there yet while __init__ runs)
        if hasattr(probs, "sums_to_one"):  # a quantized point: row codes divide by their sum only if rows sum to 1
            probs.sums_to_one = variant.sums_to_one

    def extra_repr(self) -> str:
        return f"softmax={self.softmax_name}, params={self.softmax_params}"


def softq_attention(
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
    """Attention with softq's softmax variant and quantization points; [b, s, h, d] out.

    Takes everything the interface passes: grouped K/V heads, any ``scaling`` (Gemma's
    ``query_pre_attn_scalar``, T5's 1.0), sliding-window and local masks, an additive position
    bias carried in the mask or passed as ``position_bias`` (T5's relative buckets), logit
    soft-capping (``softcap``: ``tanh(s / cap) * cap`` before the softmax) and learned sink
    logits (``s_aux``: an extra column of the softmax no value reads).  RoPE and q/k norms are applied by the module before the call."""
    if _Recording.modules is not None:
        _Recording.modules.append((module, _masks_the_future(module, query, key, attention_mask, kwargs)))
        module.softq_head_dim = int(query.shape[-1])  # for gates and sinks where the module names it otherwise
        module.softq_kv_heads = int(key.shape[1])  # before grouped-query attention repeats them: per-head KV scales
    points: AttentionPoints | None = getattr(module, "softq", None)
    bias = mask_bias(module, attention_mask, key.shape[-2])
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    key, value, valid, scaling = attention_inputs(module, query, key, value, attention_mask, scaling)
    if points is not None and points.prefix_rows and valid is not None and query.shape[-2] == key.shape[-2]:
        # a pass from position 0 (not a cached step); a key no query row sees is padding (a sliding window hides
        # the first keys from later rows only)
        _check_prefix_rows(valid.amax(-2) if valid.dim() > 1 else valid, points.prefix_rows)
    if points is not None and points.sink is not None:
        _check_first_key(key, kwargs.get("position_ids"))
        if valid is not None:
            _check_prefix_rows(valid, 1, SINK_PADDING)
        key, value = points.sink(key, value)
    plain = bias is None and softcap is None and s_aux is None

    if plain and points is not None and points.fast_training and module.training and _points_are_identity(points):
        return _fast_training_attention(points, query, key, value, valid, scaling, dropout)
    if plain and points is not None and not module.training and _observing_only(points):
        return _observing_attention(points, query, key, value, valid, scaling)
    q, k = (query, key) if points is None else (points.q(query), points.k(key))
    # an exported K point with per-head scales hands over its codes and computes Q.K^T from them
    product = getattr(points.k, "key_product", None) if points is not None else None
    scores = (torch.matmul(q, k.transpose(-1, -2)) if product is None else product(q, k)).mul_(scaling)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    keys = scores.shape[-1]
    if s_aux is not None:
        scores, valid = _extra_column(scores, valid, s_aux)
    if points is None:
        probs = get_softmax("softmax")(scores, valid)
    else:
        scores = _scores_point(points, scores, valid)
        probs = get_softmax(points.softmax_name)(scores, valid, **points.softmax_params)
        probs = points.probs(probs, valid)
    if s_aux is not None:
        probs = probs[..., :keys]
    weights = nn.functional.dropout(probs, p=dropout, training=module.training)
    if points is None:
        out = torch.matmul(weights, value)
    else:
        v = points.v(value)
        if weights.dtype != v.dtype:  # a bf16/fp16 model: the quantizers may hand back float32 probs
            weights = weights.to(v.dtype)
        out = points.pv(weights, v)
        out = _gated(points, out)
    return out.transpose(1, 2).contiguous(), probs


def _scores_point(points: AttentionPoints, scores: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The softmax-input point.  While observing, it sees only the scores a row can attend to: masked
    keys (padding, a causal model's future) never reach the softmax, so their range would only coarsen
    the step (on the 2400-step reference LM the future scores widen it, docs/results/softmax_input.md)."""
    if getattr(points.scores, "takes_valid", False):  # a grid relative to each row's max over valid keys
        return points.scores(scores, valid)
    if valid is not None and getattr(points.scores, "mode", None) == "observe":
        keep = valid.expand_as(scores) != 0
        rows = token_mask(scores)  # a calibration batch's padding queries' rows (calib.observers.valid_tokens)
        if rows is not None:
            keep = keep & rows[:, None, :, None]
        points.scores(scores.masked_select(keep))
        return scores
    return points.scores(scores)


SINK_PADDING = "has a constant attention sink at its first position (the [CLS] or first token's keys and values)"


def prefix_padding(rows: int) -> str:
    return (f"was quantized with residual scales of their own for its first {rows} position(s) (the special tokens, "
            "QuantConfig.residual_prefix)")


def right_padding_rows(model: nn.Module) -> tuple[int, str]:
    """(first positions that must hold real tokens, why) of ``model``; (0, "") where padding may go either side.
    The torch model refuses left-padded batches there (:func:`_check_prefix_rows`); exported files record it."""
    points = [p for _, p in attention_points(model)]
    rows = max((int(p.prefix_rows) for p in points), default=0)
    if rows:
        return rows, prefix_padding(rows)
    if any(p.sink is not None for p in points):
        return 1, SINK_PADDING
    return 0, ""


def _check_first_key(key: torch.Tensor, position_ids: torch.Tensor | None) -> None:
    """Refuse a call whose keys do not start at the sequence's first position, where a constant sink would replace
    a real token's keys and values: a sliding-window cache that has dropped the first tokens (Mistral's, Gemma 2's
    local layers while generating past the window)."""
    if position_ids is None or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return
    last = int(position_ids.max())
    if key.shape[-2] < last + 1:
        raise ValueError(f"the model has a constant attention sink at its first position, but this layer's cache holds "
                         f"only the last {key.shape[-2]} of {last + 1} positions (a sliding-window cache dropped the "
                         "first token): keep generation within the sliding window, or configure the model without "
                         "constant_sink")


def _check_prefix_rows(valid: torch.Tensor, rows: int, why: str | None = None) -> None:
    """Refuse a batch whose special prefix tokens are not its first rows (left padding).  A key counts as present
    where any query may attend to it: a sliding window hides the first keys from late queries, padding from all."""
    keys = valid if valid.dim() == 2 else valid.amax(-2)
    keys = keys.reshape(-1, keys.shape[-1])
    padded_first = (keys[:, :rows] == 0).any(-1) & (keys[:, rows:] != 0).any(-1)
    if bool(padded_first.any()):
        why = why or prefix_padding(rows)
        raise ValueError(f"a sequence of this batch is left-padded: the model {why}, so pad on the right "
                         f"(tokenizer.padding_side='right')")


def _gated(points: AttentionPoints, out: torch.Tensor) -> torch.Tensor:
    """Gated attention's per-head gate applied to the [b, h, s, d] output (identity without a gate)."""
    if points.gate is None:
        return out
    if points._hidden is None:
        raise RuntimeError("gated attention needs the module input; use softq.attention.configure_attention")
    out = out * points.gate(points._hidden)
    points._hidden = None
    return out


def _points_are_identity(points: AttentionPoints) -> bool:
    """True when no quantizer or observer is attached (so nothing needs the probabilities)."""
    return (all(isinstance(m, nn.Identity) for m in (points.q, points.k, points.scores, points.v))
            and type(points.probs) is ProbsQuantizer and type(points.pv) is ProbsTimesV)


def _observing_only(points: AttentionPoints) -> bool:
    """Calibration of an exact-softmax layer whose probabilities nobody reads: the scores are observed,
    not changed, and the softmax-output point has nothing to observe (no hooks on it either)."""
    probs, scores = points.probs, points.scores
    # a float softmax input (softmax_input="float") observes nothing: calibration is when the V point observes
    observing = (getattr(scores, "mode", None) == "observe"
                 or isinstance(scores, nn.Identity) and getattr(points.v, "mode", None) == "observe")
    return (points.softmax_name == "softmax" and observing
            and type(points.pv) is ProbsTimesV and not probs._forward_hooks and not probs._forward_pre_hooks
            and (type(probs) is ProbsQuantizer or not getattr(probs, "needs_probs", lambda: True)()))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, scaling: float,
          dropout: float = 0.0) -> torch.Tensor:
    """Exact softmax attention by PyTorch SDPA with softq's 0/1 ``valid`` mask (fully masked rows give 0)."""
    mask = None if valid is None else valid.to(torch.bool)
    return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)


def _observing_attention(
    points: AttentionPoints,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, None]:
    """The eager path's function for a calibration pass at about half its cost: the scores are computed
    for their observer, the output by SDPA (no masked copy, no probability tensor, no P.V matmul)."""
    q, k, v = points.q(query), points.k(key), points.v(value)
    # a row-relative grid and a float input observe nothing
    if not getattr(points.scores, "takes_valid", False) and not isinstance(points.scores, nn.Identity):
        _scores_point(points, torch.matmul(q, k.transpose(-1, -2)).mul_(scaling), valid)
    out = _gated(points, _sdpa(q, k, v, valid, scaling))
    return out.transpose(1, 2).contiguous(), None


def _fast_training_attention(
    points: AttentionPoints,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
    dropout: float,
) -> tuple[torch.Tensor, None]:
    """The same function as the eager path, computed faster for training (no probabilities returned)."""
    if points.softmax_name == "softmax":
        out = _sdpa(query, key, value, valid, scaling, dropout)
    else:
        scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
        probs = compiled_softmax(points.softmax_name)(scores, valid, **points.softmax_params)
        out = torch.matmul(nn.functional.dropout(probs, p=dropout, training=True), value)
    out = _gated(points, out)
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def fast_training(model: nn.Module) -> Iterator[None]:
    """Train faster without changing the function: SDPA for exact softmax, fused variants otherwise.

    Only layers without quantizers or observers take the fast path, and only in
    training mode; evaluation always sees the eager path (which also returns the
    probabilities), and calibration too unless nothing reads a layer's probabilities
    (then its output comes from SDPA, see ``_observing_only``).
    """
    points = [module.softq for _, module in attention_modules(model) if getattr(module, "softq", None) is not None]
    before = [p.fast_training for p in points]
    for p in points:
        p.fast_training = True
    try:
        yield
    finally:
        for p, flag in zip(points, before):
            p.fast_training = flag


def _module_input(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor an attention module computes its queries from: its first argument, positional or by the name its
    forward gives it (``hidden_states`` in most families)."""
    if args:
        return args[0]
    name = getattr(module, "softq_input_name", None)
    if name is None:
        import inspect

        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        name = module.softq_input_name = params[0].name if params else "hidden_states"
    return kwargs.get(name)


def _stash_hidden(module: nn.Module, args: tuple, kwargs: dict) -> None:
    module.softq._hidden = _module_input(module, args, kwargs)


@torch.no_grad()
def _input_widths(model: nn.Module, modules: list[nn.Module]) -> list[int]:
    """The last dimension of each attention module's input, seen on one probe forward (``models.probe_inputs``):
    a gate splits that input into one slice per query head."""
    from softq.models import probe_forward

    widths: dict[int, int] = {}

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = _module_input(module, args, kwargs)
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
            widths.setdefault(id(module), int(hidden.shape[-1]))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        probe_forward(model)
    finally:
        for h in handles:
            h.remove()
    missing = [m for m in modules if id(m) not in widths]
    if missing:
        raise ValueError(f"gated attention reads the attention module's input, but {type(missing[0]).__name__} "
                         "takes no [batch, tokens, width] tensor as its first argument")
    return [widths[id(m)] for m in modules]


def register() -> None:
    """Register softq's attention and mask builder with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, softq_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


register()


def _variant_for(current: AttentionPoints | None, softmax: str | None,
                 params: dict[str, float]) -> tuple[str, dict[str, float]] | None:
    """The (variant, parameters) a layer gets: parameters given change those of the variant it has (also when that
    variant is named again: naming it to add gates kept nothing of its alpha before); None: unchanged."""
    name, given = ("softmax", {}) if current is None else (current.softmax_name, current.softmax_params)
    if softmax is None and not params:
        return None
    if softmax is None or softmax == name:
        return name, {**given, **params}
    return softmax, dict(params)


def _head_dim(module: nn.Module) -> int:
    """The size of one attention head: as the module names it, else as its query arrived on the discovery probe."""
    for attr in ("head_dim", "attention_head_size", "softq_head_dim"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def configure_attention(
    model: nn.Module,
    softmax: str | None = None,
    gated: bool = False,
    gate_pi_init: float = 0.5,
    constant_sink: bool = False,
    **softmax_params: float,
) -> list[AttentionPoints]:
    """Switch ``model`` to softq attention; optionally set its softmax variant, gates and constant sinks.

    Idempotent: state already attached (quantizers, trained gates) is kept and only
    what is asked for changes (softmax parameters without ``softmax``, or with the variant the layers have: those
    parameters of it; another variant starts from its defaults).  The choice is also written to ``model.config``
    (``softq_softmax``, ``softq_softmax_params``, ``softq_gated``, ``softq_constant_sink``)
    so a saved config records it and :func:`configure_from_config` can rebuild it.
    ``constant_sink=True`` attaches a :class:`ConstantSink` (zeros: start it with
    :func:`init_constant_sinks`).  A ``sentence_transformers.SentenceTransformer``: its Hugging Face model.
    """
    from softq.families import set_implementation
    from softq.hf import is_sentence_transformer

    if is_sentence_transformer(model):
        model = model[0].auto_model
    model_family(model)
    modules = [module for _, module in attention_modules(model)]
    for module in modules:  # refuse anything wrong before any layer changes (a half-configured model, its config
        current = getattr(module, "softq", None)  # written from the first layer, would misdescribe it)
        wanted = _variant_for(current, softmax, softmax_params)
        if wanted is not None:
            get_softmax(wanted[0])(torch.zeros(1, 2), None, **wanted[1])
        if gated and (current is None or current.gate is None):
            AttentionGate(1, 1, gate_pi_init)  # checks pi_init
        if constant_sink and not _head_dim(module):
            raise ValueError(f"cannot tell the head size of {type(module).__name__} for a constant sink")
    new_gates = [m for m in modules if gated and (getattr(m, "softq", None) is None or m.softq.gate is None)]
    slices: dict[int, int] = {}
    for module, width in zip(new_gates, _input_widths(model, new_gates) if new_gates else []):
        heads = num_heads(module)
        if width % heads:
            raise ValueError(f"gated attention gives each of the {heads} query heads of {type(module).__name__} an "
                             f"equal slice of its input, but the input width {width} is not a multiple of {heads}")
        slices[id(module)] = width // heads
    points_list: list[AttentionPoints] = []
    for module in modules:
        points = getattr(module, "softq", None)
        if points is None:
            points = AttentionPoints(num_heads(module))
            module.softq = points
        wanted = _variant_for(points, softmax, softmax_params)
        if wanted is not None:
            points.set_softmax(wanted[0], **wanted[1])
        ref = next(module.parameters())
        if constant_sink and points.sink is None:
            points.sink = ConstantSink(points.num_heads, _head_dim(module)).to(ref.device, ref.dtype)
        if gated and points.gate is None:
            points.gate = AttentionGate(points.num_heads, slices[id(module)], gate_pi_init).to(ref.device, ref.dtype)
            module.register_forward_pre_hook(_stash_hidden, with_kwargs=True)
        points_list.append(points)
    set_implementation(model, ATTN_IMPLEMENTATION)
    first = points_list[0]
    model.config.softq_softmax = first.softmax_name
    model.config.softq_softmax_params = dict(first.softmax_params)
    model.config.softq_gated = first.gate is not None
    model.config.softq_constant_sink = first.sink is not None
    return points_list


@torch.no_grad()
def init_constant_sinks(model: nn.Module, batches: Iterable[torch.Tensor | Mapping[str, torch.Tensor]]) -> int:
    """Start every :class:`ConstantSink` of ``model`` at the mean key and value its layer computes at position 0
    over ``batches`` (run with the sinks passing keys and values through).  Returns the rows seen per layer.
    ``batches`` as ``softq.quantize``'s calibration data: tensors (the main input) or dicts of tensors."""
    from softq.calib.data import as_batches

    sinks = [m.softq.sink for _, m in attention_modules(model)
             if getattr(m, "softq", None) is not None and m.softq.sink is not None]
    if not sinks:
        raise ValueError("the model has no constant sinks; configure_attention(model, constant_sink=True) first")
    batches = as_batches(model, batches)
    was = model.training
    model.eval()
    for s in sinks:
        zeros = torch.zeros(s.key.shape, dtype=torch.float64)
        s._record = [zeros, torch.zeros(s.value.shape, dtype=torch.float64), 0.0, zeros + math.inf, zeros - math.inf]
    try:
        for batch in batches:
            model(**batch)
        rows = int(sinks[0]._record[2])
        if rows == 0:
            raise ValueError("init_constant_sinks got no batches")
        _check_fixed_first_token(sinks[0]._record)
        for s in sinks:
            s.key.copy_((s._record[0] / s._record[2]).to(s.key.dtype))
            s.value.copy_((s._record[1] / s._record[2]).to(s.value.dtype))
    finally:
        for s in sinks:
            s._record = None
        model.train(was)
    return rows


def _check_fixed_first_token(record: list) -> None:
    """Refuse batches whose first position is not one fixed token ([CLS], BOS, a class embedding).  The first
    attention layer's keys at position 0 depend only on that token (and position 0), so they are the same in every
    sequence exactly when it is; where they differ, a constant sink would replace real content (a text's first
    word, an audio frame)."""
    spread = float((record[4] - record[3]).abs().max())
    size = float(record[4].abs().max().clamp_min(1e-12))
    if spread > 1e-4 * size:
        raise ValueError("init_constant_sinks: position 0 is not one fixed token in these batches (its first-layer "
                         f"keys differ between sequences by {spread / size:.2g} of their size), so a constant sink would "
                         "replace real content: start every sequence with the same token (BOS or [CLS]) or leave "
                         "constant_sink off")


def configure_from_config(model: nn.Module) -> list[AttentionPoints] | None:
    """Rebuild softq attention from ``model.config`` fields written by :func:`configure_attention`."""
    name = getattr(model.config, "softq_softmax", None)
    if name is None:
        return None
    params = dict(getattr(model.config, "softq_softmax_params", {}) or {})
    return configure_attention(model, name, gated=bool(getattr(model.config, "softq_gated", False)),
                               constant_sink=bool(getattr(model.config, "softq_constant_sink", False)), **params)


def attention_points(model: nn.Module) -> list[tuple[str, AttentionPoints]]:
    """(name, points) of every configured attention layer, configuring softq attention if needed."""
    if any(getattr(m, "softq", None) is None for _, m in attention_modules(model)):
        configure_attention(model)
    return [(name, module.softq) for name, module in attention_modules(model)]
