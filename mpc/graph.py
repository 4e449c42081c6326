"""softq's own PyTorch -> CrypTen converter: export a model, then interpret its aten graph.

Why not ``crypten.nn.from_pytorch``: it goes through CrypTen's ONNX importer,
which no longer works on current torch and cannot express masks, one-hot token
inputs or softq's surrogates.  Here the model is exported with
``torch.export`` at a fixed example shape, and every node is evaluated with
either plaintext torch (when all its inputs are public: shapes, masks,
position ids, constants) or CrypTensor operations (when any input is secret).

Who holds what:

* parameters are secret (shared by the model owner), buffers and constants are
  public (they follow from the public architecture, e.g. position ids);
* ``input_ids`` arrive as a secret one-hot matrix, so an embedding lookup is a
  matmul with the secret embedding table; ``pixel_values`` / ``inputs_embeds``
  are secret tensors;
* ``attention_mask``, ``token_type_ids`` and ``position_ids`` are public.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from softq.models import has_cross_attention, is_causal, model_family
from softq.mpc._crypten_shim import load_crypten
from softq.mpc.accounting import CommRecorder
from softq.mpc.approx import ROW_SCALE_LIMIT, accurate_functions, normalize_rows
from softq.mpc.approx import exp as approx_exp
from softq.mpc.surrogates import exporting, from_op_name, get_gelu, layer_index, layer_norm, silu_exact
from softq.softmax import get_softmax

SECRET_INPUTS = ("input_ids", "pixel_values", "inputs_embeds")
PUBLIC_INPUTS = ("attention_mask", "token_type_ids", "position_ids")
# A public value added to a secret must stay far inside CrypTen's fixed-point range
# (16 fractional bits in a 64-bit ring): an additive -3.4e38 mask would wrap around.
MAX_PUBLIC_ADDEND = 2.0**30


class ConversionError(ValueError):
    """The exported graph uses an operation softq.mpc cannot run on secret values."""


@dataclass
class SecretOneHot:
    """Secret token ids, held as a one-hot CrypTensor ``[*ids_shape, vocab]``."""

    value: Any
    ids_shape: tuple[int, ...]

    def reshape(self, shape: list[int]) -> SecretOneHot:
        shape = list(shape)
        n = math.prod(self.ids_shape)
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = n // known
        return SecretOneHot(self.value.reshape(*shape, self.value.shape[-1]), tuple(shape))


# ---------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------


def example_inputs(model: nn.Module, shapes: Mapping[str, tuple[int, ...]], public: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Inputs for ``torch.export``: zeros of the right shape for the secret inputs, the real public ones."""
    kwargs: dict[str, Any] = {}
    for name, shape in shapes.items():
        if name in public:
            kwargs[name] = public[name]
        elif name == "input_ids":
            kwargs[name] = torch.zeros(shape, dtype=torch.long)
        else:
            kwargs[name] = torch.zeros(shape, dtype=torch.float32)
    if is_causal(model):
        kwargs["use_cache"] = False
    return kwargs


def public_positions(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``inputs``, with a RoBERTa-family model's ``position_ids`` added from the public ``attention_mask``.

    RoBERTa (XLM-RoBERTa, CamemBERT) numbers its positions from the token ids that are not its padding id, a
    comparison of the secret ids that no party can make; the mask shows the same padding, so the positions are
    public: ``cumsum(mask) * mask + pad`` (transformers' ``create_position_ids_from_input_ids``).  Where the ids
    put their padding id elsewhere than the mask does, the model would number them otherwise: refused."""
    if (model_family(model) != "roberta" or "position_ids" in inputs or not isinstance(inputs.get("input_ids"), torch.Tensor)
            or inputs["input_ids"].is_floating_point()):
        return dict(inputs)
    ids = inputs["input_ids"]
    pad = model.config.pad_token_id
    mask = inputs.get("attention_mask")
    keep = (torch.ones_like(ids) if mask is None else mask.ne(0)).long()
    if keep.shape != ids.shape:
        raise ValueError(f"attention_mask is {tuple(keep.shape)} but input_ids are {tuple(ids.shape)}")
    held = ids.eq(pad) & keep.bool()
    if not torch.equal(ids.ne(pad), keep.bool()):
        problem = ("these input_ids hold that id at a token the attention_mask keeps" if mask is not None and held.any()
                   else "these input_ids hold that id with no attention_mask" if held.any()
                   else "the attention_mask drops a token whose id is not that id")
        raise ValueError(f"{type(model).__name__} numbers its positions from the input_ids that are not its padding id "
                         f"{pad}, and {problem}: its positions would come from the secret ids; pass an attention_mask "
                         "that is 0 exactly at the padding tokens, or position_ids")
    return {**inputs, "position_ids": keep.cumsum(-1) * keep + pad}


def export_model(model: nn.Module, kwargs: Mapping[str, Any]) -> torch.export.ExportedProgram:
    """``torch.export`` the surrogate-configured model at a fixed shape (no dynamic dims)."""
    if has_cross_attention(model):
        raise ConversionError(f"softq's MPC runs self-attention models; this {type(model).__name__} has cross-attention "
                              "layers (add_cross_attention=True: it reads encoder_hidden_states), which it does not take")
    model.eval()
    if is_causal(model):
        model.config.use_cache = False
    with exporting(model), torch.no_grad():
        model(**kwargs)  # on real tensors first: whether a mask carries a bias is settled there (attention.mask_bias)
        return torch.export.export(model, (), dict(kwargs), strict=False)


def graph_fingerprint(ep: torch.export.ExportedProgram) -> str:
    """Hash of the exported graph: ops, their public arguments and every parameter's shape."""
    h = hashlib.sha256()
    h.update(ep.graph_module.code.encode())
    for spec in ep.graph_signature.input_specs:
        h.update(f"{spec.kind.name}:{spec.arg.name}:{spec.target}".encode())
    for name, t in sorted(ep.state_dict.items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
    return h.hexdigest()[:16]


def public_state_fingerprint(ep: torch.export.ExportedProgram) -> str:
    """Hash of the public tensors (buffers, constants): both parties must agree on them."""
    h = hashlib.sha256()
    params = {s.target for s in ep.graph_signature.input_specs if s.kind.name == "PARAMETER"}
    for name, t in sorted({**ep.state_dict, **ep.constants}.items()):
        if name in params or not isinstance(t, torch.Tensor):
            continue
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------
# Helpers on mixed public / secret values
# ---------------------------------------------------------------------------


def _is_secret(x: Any) -> bool:
    crypten = load_crypten()
    return isinstance(x, (crypten.CrypTensor, SecretOneHot))


def _any_secret(args: Any, kwargs: Any) -> bool:
    leaves, _ = tree_flatten((args, kwargs))
    return any(_is_secret(x) for x in leaves)


def _check_addend(x: Any) -> None:
    if isinstance(x, torch.Tensor) and x.numel() and x.is_floating_point():
        if x.abs().max().item() > MAX_PUBLIC_ADDEND:
            raise ConversionError(
                "a public value of magnitude > 2^30 is added to a secret (probably an additive "
                "attention mask); it would overflow CrypTen's fixed point.  Use softq attention "
                "(configure_surrogates), which passes masks as a 0/1 valid tensor."
            )
    elif isinstance(x, (int, float)) and abs(x) > MAX_PUBLIC_ADDEND:
        raise ConversionError(f"public constant {x} added to a secret overflows CrypTen's fixed point")


def _t(x: Any) -> Any:
    return x.transpose(-1, -2)


def matmul(a: Any, b: Any) -> Any:
    if _is_secret(a):
        return a.matmul(b)
    if _is_secret(b):
        if a.dim() == 1:
            return b.transpose(-1, -2).matmul(a)
        return _t(_t(b).matmul(_t(a)))
    return torch.matmul(a, b)


def add(a: Any, b: Any, alpha: float = 1) -> Any:
    if alpha != 1:
        b = b * alpha
    if _is_secret(a):
        _check_addend(b)
        return a + b
    _check_addend(a)
    return b + a


def sub(a: Any, b: Any, alpha: float = 1) -> Any:
    return add(a, -b if not _is_secret(b) else b.neg(), alpha)


def mul(a: Any, b: Any) -> Any:
    return a * b if _is_secret(a) else b * a


def div(a: Any, b: Any, rounding_mode: str | None = None) -> Any:
    if rounding_mode is not None:
        raise ConversionError(f"division with rounding_mode={rounding_mode!r} on a secret")
    if not _is_secret(b):
        return a * (1.0 / b)
    crypten = load_crypten()
    with crypten.cfg.temp_override({"functions.reciprocal_all_pos": False}), accurate_functions():
        return mul(a, b.reciprocal())


def _index_slices(dim: int, ndim: int, idx: Any) -> tuple[Any, ...]:
    dim = dim % ndim
    return (slice(None),) * dim + (idx,)


def _slice(x: Any, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1) -> Any:
    size = x.shape[dim]
    start = 0 if start is None else start
    end = size if end is None else min(end, size)
    return x[_index_slices(dim, x.dim(), slice(start, end, step))]


def _select(x: Any, dim: int, index: int) -> Any:
    return x[_index_slices(dim, x.dim(), index)]


def _cat(tensors: list[Any], dim: int = 0) -> Any:
    crypten = load_crypten()
    return crypten.cat([t if _is_secret(t) else crypten.cryptensor(t, src=0) * 1.0 for t in tensors], dim=dim)


def _stack(tensors: list[Any], dim: int = 0) -> Any:
    crypten = load_crypten()
    return crypten.stack([t if _is_secret(t) else crypten.cryptensor(t, src=0) for t in tensors], dim=dim)


def _embedding(weight: Any, ids: Any, *rest: Any, **kw: Any) -> Any:
    if isinstance(ids, SecretOneHot):
        return ids.value.matmul(weight)
    one_hot = nn.functional.one_hot(ids.long(), weight.shape[0]).to(torch.float32)
    return matmul(one_hot, weight)


def _linear(x: Any, w: Any, b: Any = None) -> Any:
    y = matmul(x, _t(w))
    return y if b is None else add(y, b)


def _conv2d(x: Any, w: Any, b: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1) -> Any:
    if not _is_secret(x):
        raise ConversionError("conv2d with a public input and secret kernel is not supported")
    if isinstance(padding, str):
        raise ConversionError(f"conv2d padding={padding!r} is not supported under MPC")
    y = x.conv2d(w, stride=tuple(stride) if isinstance(stride, list) else stride,
                 padding=tuple(padding) if isinstance(padding, list) else padding,
                 dilation=tuple(dilation) if isinstance(dilation, list) else dilation, groups=groups)
    return y if b is None else add(y, b.reshape(1, -1, 1, 1) if _is_secret(b) else b.view(1, -1, 1, 1))


def _where(cond: Any, a: Any, b: Any) -> Any:
    if _is_secret(cond):
        raise ConversionError("torch.where with a secret condition is not supported")
    c = cond.to(torch.float32)
    return add(mul(a, c) if _is_secret(a) or not isinstance(a, (int, float)) else c * a,
               mul(b, 1.0 - c) if _is_secret(b) or not isinstance(b, (int, float)) else (1.0 - c) * b)


def _masked_fill(x: Any, mask: Any, value: float) -> Any:
    m = mask.to(torch.float32)
    _check_addend(value)
    return add(x * (1.0 - m), m * float(value))


def _pow(x: Any, exponent: Any) -> Any:
    if isinstance(exponent, (int, float)) and float(exponent).is_integer() and exponent >= 0:
        e = int(exponent)
        if e == 2:
            return x.square()
        return x.pow(e)
    raise ConversionError(f"pow with exponent {exponent!r} on a secret")


def _sum(x: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Any:
    if dim is None:
        return x.sum()
    dims = [dim] if isinstance(dim, int) else list(dim)
    for d in sorted((d % x.dim() for d in dims), reverse=True):
        x = x.sum(dim=d, keepdim=keepdim)
    return x


def _mean(x: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Any:
    if dim is None:
        return x.mean()
    dims = [dim] if isinstance(dim, int) else list(dim)
    n = math.prod(x.shape[d] for d in dims)
    return _sum(x, dims, keepdim) * (1.0 / n)


def _softmax_aten(x: Any, dim: int, *rest: Any) -> Any:
    with accurate_functions(), reciprocal_scale("softmax", {}, x.shape[dim]):
        return get_softmax("softmax")(x, None, dim=dim)


def _identity(x: Any, *args: Any, **kwargs: Any) -> Any:
    return x


def _unflatten_view(x: Any, shape: list[int]) -> Any:
    if isinstance(x, SecretOneHot):
        return x.reshape(shape)
    return x.reshape(*shape)


def _expand(x: Any, size: list[int], *, implicit: bool = False) -> Any:
    size = [x.shape[i - (len(size) - x.dim())] if s == -1 else s for i, s in enumerate(size)]
    return x.expand(*size)


def _split(x: Any, split_size: Any, dim: int = 0) -> list[Any]:
    n = x.shape[dim]
    sizes = [split_size] * (n // split_size) + ([n % split_size] if n % split_size else []) if isinstance(split_size, int) else list(split_size)
    out, start = [], 0
    for s in sizes:
        out.append(_slice(x, dim, start, start + s))
        start += s
    return out


def _repeat_interleave(x: Any, repeats: Any, dim: int | None = None, *, output_size: Any = None) -> Any:
    """Grouped-query attention's K/V head repetition: each slice along ``dim`` ``repeats`` times in a row."""
    if not isinstance(repeats, int) or dim is None:
        raise ConversionError("repeat_interleave of a secret needs an integer count and a dim")
    dim = dim % x.dim()
    shape = list(x.shape)
    expanded = x.unsqueeze(dim + 1).expand(*shape[: dim + 1], repeats, *shape[dim + 1:])
    return expanded.reshape(*shape[:dim], shape[dim] * repeats, *shape[dim + 1:])


def _chunk(x: Any, chunks: int, dim: int = 0) -> list[Any]:
    return _split(x, -(-x.shape[dim] // chunks), dim)


def _unbind(x: Any, dim: int = 0) -> list[Any]:
    return [_select(x, dim, i) for i in range(x.shape[dim])]


def _index(x: Any, indices: list[Any]) -> Any:
    idx = tuple(slice(None) if i is None else i for i in indices)
    return x[idx]


# Operation name -> (handler, op kind for the report).
SecretOp = Callable[..., Any]
HANDLERS: dict[str, tuple[SecretOp, str]] = {
    "linear": (_linear, "linear"),
    "matmul": (matmul, "matmul"),
    "bmm": (matmul, "matmul"),
    "mm": (matmul, "matmul"),
    "addmm": (lambda bias, a, b, beta=1, alpha=1: add(matmul(a, b) * alpha if alpha != 1 else matmul(a, b), bias, beta), "linear"),
    "embedding": (_embedding, "embedding"),
    "conv2d": (_conv2d, "conv2d"),
    "add": (add, "add"),
    "sub": (sub, "add"),
    "rsub": (lambda a, b, alpha=1: sub(b, a, alpha), "add"),
    "mul": (mul, "mul"),
    "div": (div, "div"),
    "neg": (lambda x: x.neg(), "add"),
    "pow": (_pow, "pow"),
    "square": (lambda x: x.square(), "pow"),
    "tanh": (lambda x: x.tanh(), "tanh"),
    "sigmoid": (lambda x: x.sigmoid(), "sigmoid"),
    "relu": (lambda x: x.relu(), "relu"),
    "exp": (lambda x: approx_exp(x), "exp"),
    "gelu": (lambda x, approximate="none": get_gelu("tanh" if approximate == "tanh" else "erf")(x), "gelu:native"),
    "silu": (silu_exact, "silu:native"),
    "layer_norm": (lambda x, shape, w=None, b=None, eps=1e-5, *rest: layer_norm(x, shape, w, b, eps), "layernorm"),
    "softmax": (_softmax_aten, "softmax:aten"),
    "_softmax": (_softmax_aten, "softmax:aten"),
    "sum": (_sum, "sum"),
    "mean": (_mean, "sum"),
    "where": (_where, "where"),
    "masked_fill": (_masked_fill, "where"),
    "view": (_unflatten_view, "shape"),
    "reshape": (_unflatten_view, "shape"),
    "_unsafe_view": (_unflatten_view, "shape"),
    "permute": (lambda x, dims: x.permute(*dims), "shape"),
    "transpose": (lambda x, a, b: x.transpose(a, b), "shape"),
    "t": (lambda x: x.t(), "shape"),
    "unsqueeze": (lambda x, d: x.unsqueeze(d), "shape"),
    "squeeze": (lambda x, d=None: x.squeeze() if d is None else x.squeeze(d), "shape"),
    "flatten": (lambda x, s=0, e=-1: x.flatten(s, e), "shape"),
    "expand": (_expand, "shape"),
    "slice": (_slice, "shape"),
    "select": (_select, "shape"),
    "index": (_index, "shape"),
    "cat": (_cat, "shape"),
    "stack": (_stack, "shape"),
    "split": (_split, "shape"),
    "unbind": (_unbind, "shape"),
    "chunk": (_chunk, "shape"),
    "repeat_interleave": (_repeat_interleave, "shape"),
    "split_with_sizes": (_split, "shape"),
    "contiguous": (_identity, "shape"),
    "clone": (lambda x, **kw: x.clone(), "shape"),
    "dropout": (_identity, "shape"),
    "alias": (_identity, "shape"),
    "detach": (_identity, "shape"),
    "to": (_identity, "shape"),
    "_to_copy": (_identity, "shape"),
    "type_as": (_identity, "shape"),
    "lift_fresh_copy": (_identity, "shape"),
    "_assert_tensor_metadata": (lambda *a, **k: None, "shape"),
}
# Ops whose result depends only on the shape of their (secret) input: run them on zeros.
SHAPE_ONLY = {"zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_full",
              "new_empty", "sym_size", "size"}


def _op_name(target: Any) -> tuple[str, str]:
    name = getattr(target, "_opname", None)
    namespace = getattr(target, "namespace", "")
    if name is None:
        name = getattr(target, "__name__", str(target))
    return namespace, name


def _layer_of(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "head"
    path = list(stack.values())[-1][0]
    idx = layer_index(path)
    if idx is not None:
        return f"layer{idx}"
    return "embeddings" if "embed" in path.lower() else "head"


class GraphInterpreter:
    """Evaluates an exported graph on a mix of plaintext tensors and CrypTensors."""

    def __init__(self, ep: torch.export.ExportedProgram, recorder: CommRecorder | None = None) -> None:
        self.ep = ep
        self.recorder = recorder or CommRecorder(None)
        self.input_specs = list(ep.graph_signature.input_specs)

    def parameter_names(self) -> list[str]:
        return [s.target for s in self.input_specs if s.kind.name == "PARAMETER"]

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(self.ep.state_dict[n].shape) for n in self.parameter_names()}

    def user_inputs(self) -> list[str]:
        return [s.arg.name for s in self.input_specs if s.kind.name == "USER_INPUT"]

    def run(self, params: Mapping[str, Any], inputs: Mapping[str, Any]) -> list[Any]:
        """Evaluate; ``params`` maps parameter names to CrypTensors, ``inputs`` user inputs by name."""
        env: dict[str, Any] = {}
        placeholders = [n for n in self.ep.graph.nodes if n.op == "placeholder"]
        for node, spec in zip(placeholders, self.input_specs):
            kind = spec.kind.name
            if kind == "PARAMETER":
                env[node.name] = params[spec.target]
            elif kind in ("BUFFER", "CONSTANT_TENSOR"):
                value = self.ep.state_dict.get(spec.target)
                env[node.name] = value if value is not None else self.ep.constants[spec.target]
            elif kind == "USER_INPUT":
                if spec.arg.name in inputs:
                    env[node.name] = inputs[spec.arg.name]
                else:
                    env[node.name] = None
            else:
                raise ConversionError(f"unsupported graph input kind {kind} ({spec.arg.name})")
        outputs: list[Any] = []
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = [env[a.name] if isinstance(a, torch.fx.Node) else a for a in tree_flatten(node.args[0])[0]]
                break
            if node.op != "call_function":
                raise ConversionError(f"unsupported graph node {node.op} {node.target}")
            args = tree_map(lambda a: env[a.name] if isinstance(a, torch.fx.Node) else a, node.args)
            kwargs = tree_map(lambda a: env[a.name] if isinstance(a, torch.fx.Node) else a, node.kwargs)
            env[node.name] = self._call(node, args, kwargs)
        return outputs

    def _call(self, node: torch.fx.Node, args: Any, kwargs: Any) -> Any:
        target = node.target
        if target is operator.getitem:
            return args[0][args[1]]
        if not _any_secret(args, kwargs):
            return target(*args, **kwargs)
        namespace, name = _op_name(target)
        layer = _layer_of(node)
        if namespace == "softq_mpc":
            return self._custom(name, layer, args, kwargs)
        if name in SHAPE_ONLY:
            zeros = tree_map(lambda a: torch.zeros(a.shape) if _is_secret(a) else a, args)
            return target(*zeros, **kwargs)
        if any(isinstance(a, SecretOneHot) for a in tree_flatten((args, kwargs))[0]) and name not in (
            "embedding", "view", "reshape", "_unsafe_view"
        ):
            raise ConversionError(
                f"the secret input_ids reach '{name}' ({node.name}); softq.mpc only supports token ids "
                "used by embedding lookups (they are a one-hot secret)"
            )
        if name not in HANDLERS:
            raise ConversionError(
                f"no MPC implementation of '{namespace}::{name}' (graph node {node.name}, module "
                f"{_layer_of(node)}) with a secret input"
            )
        fn, kind = HANDLERS[name]
        with self.recorder.op(kind, layer):
            return fn(*args, **kwargs)

    def _custom(self, name: str, layer: str, args: Any, kwargs: Any) -> Any:
        if name == "softmax":
            scores, valid, spec_text = args
            spec = json.loads(spec_text)
            with self.recorder.op(f"softmax:{spec['name']}", layer), accurate_functions(), \
                    reciprocal_scale(spec["name"], spec["params"], scores.shape[-1]):
                return get_softmax(spec["name"])(scores, valid, **spec["params"])
        if name == "gelu":
            x, gelu_name = args
            kind, _, short = gelu_name.rpartition("/")
            with self.recorder.op(f"{kind or 'gelu'}:{short}", layer):
                return from_op_name(gelu_name)(x)
        if name == "rms_norm":
            from softq.mpc.norms import rms_norm

            with self.recorder.op("rmsnorm", layer):
                return rms_norm(*args)
        raise ConversionError(f"unknown softq_mpc op {name}")


# ---------------------------------------------------------------------------
# Reciprocal range: a public scale per softmax variant
# ---------------------------------------------------------------------------


def _denominator_scale(name: str, params: Mapping[str, float], key_len: int) -> float | None:
    """Public typical size of a variant's row denominator, to bring it near 1 before 1/x.

    CrypTen's Newton-Raphson reciprocal is accurate for inputs in about
    [0.01, 100]; a 2Quad row sum over 128 keys is ~128 * 25.  Dividing by a public
    constant before and after the reciprocal changes nothing mathematically and
    costs no communication.
    """
    if name in ("softmax", "clipped"):
        return math.sqrt(key_len)  # the sum of exps is in [1, L]
    if name == "2quad":
        return key_len * max(float(params.get("c", 5.0)) ** 2, 1.0)
    if name == "2relu":
        return float(key_len)
    return None


def fused_row_scale(name: str, params: Mapping[str, float], key_len: int) -> float | None:
    """The public row scale of the variants whose row division is :func:`softq.mpc.approx.normalize_rows`.

    2Quad only (its denominator's reciprocal dominated its rounds), while ``L c^2`` stays
    below :data:`~softq.mpc.approx.ROW_SCALE_LIMIT`; None: the variant divides by
    ``num * reciprocal(row sum)``.
    """
    scale = _denominator_scale(name, params, key_len) if name == "2quad" else None
    return scale if scale is not None and scale < ROW_SCALE_LIMIT else None


class reciprocal_scale:  # noqa: N801 - used as a context manager
    """Within the block, ``MPCTensor.reciprocal(x)`` computes ``reciprocal(x / s) / s``.

    For the variants of :func:`fused_row_scale` it also installs
    ``MPCTensor.softq_normalize_rows`` (used by :func:`softq.softmax.normalize`).
    """

    def __init__(self, name: str, params: Mapping[str, float], key_len: int) -> None:
        self.scale = _denominator_scale(name, params, key_len)
        self.fused = fused_row_scale(name, params, key_len)

    def __enter__(self) -> None:
        if self.scale is None:
            return
        crypten = load_crypten()
        cls = crypten.mpc.MPCTensor
        if self.fused is not None:
            fused = self.fused
            cls.softq_normalize_rows = lambda x, dim=-1: normalize_rows(x, fused, dim)
        self._orig = cls.__dict__.get("reciprocal")
        orig = cls.reciprocal
        inv = 1.0 / self.scale

        def scaled(x: Any, *args: Any, **kwargs: Any) -> Any:
            return orig(x * inv, *args, **kwargs) * inv

        cls.reciprocal = scaled

    def __exit__(self, *exc: Any) -> None:
        if self.scale is None:
            return
        cls = load_crypten().mpc.MPCTensor
        if self.fused is not None:
            del cls.softq_normalize_rows
        if self._orig is None:
            del cls.reciprocal
        else:
            cls.reciprocal = self._orig
