"""Block-by-block calibration (``QuantConfig.calibration="blocks"``): one transformer block at a time.

The calibration inputs are captured where they enter the transformer blocks (the items of the list that holds the
discovered attention modules), in one forward pass per batch stopped at the last block; each block's own keyword
inputs are kept (Gemma 2 gives its sliding and global layers different masks).  Then each block, and last the
modules after the blocks (final norm, ``lm_head``), is calibrated as a small model of its own (:class:`_Stage`) by
the passes ``quantize`` runs on a whole model: range observation, ``input_smoothing="auto"``'s search (its
candidates are copies of the one block), ``smoothing_into_v``, the weight and softmax bias corrections.  Only the
block inputs are kept, never a copy of the model: peak memory is the model and one block's working set.

Each pass sees the inputs it sees in the whole-model path, carried from block to block as separate streams: the
observation pass the observed model's outputs (float activations, the weights as they were before smoothing), the
weight bias correction the uncorrected quantized model's, the softmax bias correction the weight-corrected
model's.  So with a fixed ``input_smoothing`` (an alpha or ``None``) and no fold into V (``smoothing_into_v=False``,
or grouped-query attention, where nothing folds) the result is bit-identical to the whole-model path, every range,
scale and bias shift (tests/test_sequential.py).  What differs:

* ``input_smoothing="auto"`` picks an alpha per block, judged on the block's output (the float model's output of
  that block against the block fed by the quantized blocks before it), where the whole-model path picks one alpha
  for the model on its output; without a search, "auto"'s outlier rule is applied per block, not to the model;
* ``smoothing_into_v`` re-observes V's range on the quantized blocks' outputs (the whole model observes all V
  at once, the earlier ones still float) and, under ``"auto"``, judges the fold per block.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from softq.attention import AttentionPoints
from softq.calib.data import Batch, run_batches
from softq.calib.smoothquant import InputRecorder
from softq.models import _NAMES, _no_cache, discover, probe_forward
from softq.quant.config import QuantConfig
from softq.quant.copies import COLLECT_ABOVE_BYTES, _collect, _trim, model_bytes
from softq.quant.held_out import _outputs, valid_rows
from softq.quant.layers import QEmbedding, QLinear
from softq.quant.offload import Offloaded
from softq.quant.points import _finish, act_quantizers, set_mode
from softq.quant.quantizers import SoftmaxOutputQuantizer
from softq.quant.smoothing_search import _scope, _search_smoothing, _smooth_observed
from softq.quant.softmax_bias import correct_softmax_bias
from softq.quant.v_fold import _fold_into_v_if_better, fold_smoothing_into_v
from softq.quant.weight_bias import _weight_only_convs, correct_weight_bias


# calibration="auto" goes block by block from this many bytes of weights (a 67M-parameter float32 model): the
# whole-model path holds up to three copies of the model at once (bench_llm_memory.py measures both)
BLOCKS_ABOVE_BYTES = 2**28


# the modules after the blocks are judged a piece of positions at a time (held_out.output_error), at most this many
# bytes of float32 logits a piece (the candidate's and the float reference's): 131 positions at 32000 words
LOGITS_PIECE_BYTES = 2**24


class _Stop(Exception):
    """Ends the capture forward at the last block."""


class _Shared:
    """What a stage's copies (the searches' candidates) share with it rather than copy: the captured calls."""

    def __init__(self, **items: object) -> None:
        self.__dict__.update(items)

    def __deepcopy__(self, memo: dict) -> _Shared:
        return self


def blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformer blocks, in order: the items of the innermost ``nn.ModuleList`` that holds every discovered
    attention module (T5's ``encoder.block``, not the ``layer`` list inside a block whose first item is attention)."""
    names = discover(model)
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)
             and all(a.startswith(f"{n}.") if n else True for a in names)]
    if not lists:
        raise ValueError("calibration='blocks' needs the transformer blocks in one list (nn.ModuleList) holding every "
                         "attention module; this model has none (an encoder-decoder has two): use calibration='model'")
    name, blocks = max(lists, key=lambda item: item[0].count(".") + (1 if item[0] else 0))
    if len({id(b) for b in blocks}) != len(blocks):
        raise ValueError("calibration='blocks' needs one module per transformer layer; this model runs one block "
                         "several times (shared layers): use calibration='model'")
    return [(f"{name}.{i}" if name else str(i), b) for i, b in enumerate(blocks)]


def _batch_size(batch: Batch) -> int:
    return max((v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0), default=1)


def _cut(value: object, n: int, keep: int) -> object:
    """``value`` (a tensor, or a tuple/list of them) cut to its first ``keep`` examples where its first dim is ``n``."""
    if isinstance(value, torch.Tensor):
        return value[:keep] if value.dim() > 0 and value.shape[0] == n and keep < n else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cut(v, n, keep) for v in value)
    return value


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, x: torch.Tensor, n: int) -> tuple[tuple, dict]:
    """The block call with ``x`` as its hidden states (and every other input cut to ``x``'s examples)."""
    keep = x.shape[0]
    rest = {k: _cut(v, n, keep) for k, v in kwargs.items() if k != "hidden_states"}
    if args:
        return (x, *(_cut(a, n, keep) for a in args[1:])), rest
    return (), {**rest, "hidden_states": x}


def _as_block_output(template: object, x: torch.Tensor) -> object:
    """``x`` in the form the block returns (a tensor, or a tuple whose first item is the hidden states)."""
    return x if isinstance(template, torch.Tensor) else (x, *template[1:])


class _Stage(nn.Module):
    """One step of the walk, run like a model by the calibration passes: ``stage(hidden_states=..., attention_mask=...,
    call=...)`` with ``call`` the index of the calibration batch (whose other block inputs were captured).  A block
    stage holds one transformer block; the tail stage the modules after the last block, run through the model's own
    forward with every block skipped (the last one returning the given hidden states)."""

    def __init__(self, parts: dict[str, nn.Module], shared: _Shared, index: int | None) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({name.replace(".", "/"): m for name, m in parts.items()})
        self.shared, self.index = shared, index
        self.training = shared.model.training  # the passes restore a stage's mode onto its parts when done
        # dropped copies (the searches' candidates) collected at once when the model is large (copies._collect)
        self.softq_collect = model_bytes(shared.model) >= COLLECT_ABOVE_BYTES
        configured = tuple(f"parts.{key}.{n}" if n else f"parts.{key}" for key, m in self.parts.items()
                           for n, sub in m.named_modules()
                           if isinstance(getattr(sub, "softq", None), AttentionPoints))
        self.__dict__[_NAMES] = configured  # models.discover's cache: the attention modules of this stage

    def softq_token_pieces(self, batch: Batch) -> list[torch.Tensor] | None:
        """The modules after the blocks, where the model computes logits for chosen positions (``logits_to_keep``):
        the positions of ``batch`` in pieces of at most ``LOGITS_PIECE_BYTES`` of logits, for
        :func:`~softq.quant.held_out.output_error` to compare one piece at a time; None for a block."""
        if self.index is not None or not self.shared.pieces:
            return None
        n = batch["hidden_states"].shape[1]
        step = max(1, LOGITS_PIECE_BYTES // (4 * batch["hidden_states"].shape[0] * self.shared.vocab))
        step = 1 << (step.bit_length() - 1)  # a power of two positions
        return [torch.arange(a, min(a + step, n)) for a in range(0, n, step)]

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                call: torch.Tensor | None = None, logits_to_keep: torch.Tensor | None = None, **_: object) -> object:
        i = int(call)
        shared = self.shared
        if self.index is not None:
            args, kwargs = shared.calls[self.index][i]
            args, kwargs = _with_hidden(args, kwargs, hidden_states, shared.sizes[i])
            if shared.dispatch is not None:
                args, kwargs = shared.dispatch.to_device(self.index, (args, kwargs))
            out = next(iter(self.parts.values()))(*args, **kwargs)
            y = out if isinstance(out, torch.Tensor) else out[0]
            return SimpleNamespace(last_hidden_state=y, logits=None, hidden_states=None)
        batch = {k: _cut(v, shared.sizes[i], hidden_states.shape[0]) for k, v in shared.batches[i].items()}
        if logits_to_keep is not None:
            batch["logits_to_keep"] = logits_to_keep
        return _run_tail(shared, dict(zip(shared.tail_names, self.parts.values())), batch, hidden_states)


def _swap(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Put ``modules`` into ``model`` at their names; returns what was there."""
    before = {}
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        before[name] = getattr(owner, child)
        setattr(owner, child, module)
    return before


def _run_tail(shared: _Shared, tail: dict[str, nn.Module], batch: Batch, x: torch.Tensor) -> object:
    """The model's forward on ``batch`` with its blocks skipped and ``x`` leaving the last block, ``tail`` (a copy's
    modules, or the model's own) in place of the modules after the blocks: the model's output."""
    model, blocks = shared.model, shared.blocks
    last = len(blocks) - 1

    def skip(j: int):  # noqa: ANN202
        def forward(*args: object, **kwargs: object) -> object:
            hidden = x if j == last else _hidden(args, kwargs)
            return _as_block_output(shared.template, hidden)
        return forward

    before = _swap(model, tail)
    try:
        with _forwards(blocks, skip):
            return model(**batch, **_no_cache(model))
    finally:
        _swap(model, before)


@contextlib.contextmanager
def _forwards(blocks: list[nn.Module], make: Callable[[int], Callable]) -> Iterator[None]:
    """Block ``j`` runs ``make(j)`` instead of its forward inside the block; its own forward (an instance attribute
    such as accelerate's hook wrapper, or the class's) comes back after."""
    saved = [b.__dict__.get("forward") for b in blocks]
    try:
        for j, b in enumerate(blocks):
            b.forward = make(j)
        yield
    finally:
        for b, f in zip(blocks, saved):
            if f is None:
                del b.forward
            else:
                b.forward = f


def _capture(model: nn.Module, blocks: list[nn.Module], batches: list[Batch],
             dispatch: Offloaded | None = None) -> tuple[list[list], list[torch.Tensor], object]:
    """Every block's (args, kwargs) on every batch (without the hidden states), the first block's hidden states,
    from one forward per batch stopped at the last block, and the form of a block's output (the first block run
    once on the first batch; an offloaded block loaded for its run).  A block that returns its hidden states alone
    is skipped (its input handed on): what the next block is given besides comes from the model, not from it.  A
    block that returns more (T5 hands its position bias on) runs."""
    calls: list[list] = [[None] * len(batches) for _ in blocks]
    first: list[torch.Tensor | None] = [None] * len(batches)
    state: dict[str, object] = {"i": 0, "template": None}
    last = len(blocks) - 1
    forwards = [b.forward for b in blocks]

    def real(j: int, *args: object, **kwargs: object) -> object:
        if dispatch is None:
            return forwards[j](*args, **kwargs)
        with dispatch.loaded(j):
            args, kwargs = dispatch.to_device(j, (args, kwargs))
            return forwards[j](*args, **kwargs)

    def recorder(j: int):  # noqa: ANN202
        def forward(*args: object, **kwargs: object) -> object:
            if j == 0:
                first[state["i"]] = _hidden(args, kwargs)
            # kept without the hidden states: the stage gives its own
            calls[j][state["i"]] = ((None, *args[1:]), kwargs) if args else ((), {k: v for k, v in kwargs.items()
                                                                                 if k != "hidden_states"})
            if j == last:
                raise _Stop
            if state["template"] is None:
                state["template"] = out = real(j, *args, **kwargs)
                return out
            if isinstance(state["template"], torch.Tensor):
                return _hidden(args, kwargs)
            return real(j, *args, **kwargs)
        return forward

    with _forwards(blocks, recorder), torch.no_grad():
        for i, batch in enumerate(batches):
            state["i"] = i
            try:
                model(**batch, **_no_cache(model))
            except _Stop:
                pass
    if state["template"] is None:  # a single block: it never handed anything on
        args, kwargs = _with_hidden(*calls[0][0], first[0], _batch_size(batches[0]))
        with torch.no_grad():
            state["template"] = real(0, *args, **kwargs)
    template = state["template"]
    if not isinstance(template, torch.Tensor):
        template = (template[0], *(None for _ in template[1:]))
    return calls, first, template


def _stage_batches(xs: list[torch.Tensor], batches: list[Batch], idx: list[int]) -> list[Batch]:
    out = []
    for i in idx:
        b = {"hidden_states": xs[i], "call": torch.tensor(i)}
        mask = batches[i].get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            b["attention_mask"] = mask
        out.append(b)
    return out


def keeps_logits(model: nn.Module) -> bool:
    """Whether the model's forward computes its logits for chosen positions only (Hugging Face's ``logits_to_keep``,
    which causal LMs take)."""
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@torch.no_grad()
def float_references(model: nn.Module, held: list[Batch]) -> tuple[list[torch.Tensor] | None,
                                                                   list[list[torch.Tensor]], list[torch.Tensor]]:
    """The float model's outputs on the held-out batches (:func:`_outputs`), per block its output rows there (what
    each block's ``"auto"`` candidates are judged against), and the last block's whole outputs.  Run before
    ``prepare``.  Where the model computes logits for chosen positions (:func:`keeps_logits`), its outputs are not
    kept (None): vocabulary-wide rows, 62 MiB per 512 tokens at 32000 words; the modules after the blocks are judged
    against :class:`_TailReference`, the float tail run on the last block's outputs a piece of positions at a
    time."""
    blocks = [b for _, b in blocks_of(model)]
    per_block: list[list[torch.Tensor]] = [[] for _ in blocks]
    last: list[torch.Tensor] = []
    current: dict[str, Batch] = {}

    def hook(j: int):  # noqa: ANN202
        def record(_m: nn.Module, _args: tuple, out: object) -> None:
            y = out if isinstance(out, torch.Tensor) else out[0]
            per_block[j].append(valid_rows(y, current["batch"]))
            if j == len(blocks) - 1:
                last.append(y)
        return record

    def batch_of(_m: nn.Module, _args: tuple, kwargs: dict) -> None:
        current["batch"] = kwargs

    handles = [b.register_forward_hook(hook(j)) for j, b in enumerate(blocks)]
    handles.append(model.register_forward_pre_hook(batch_of, with_kwargs=True))
    try:
        if keeps_logits(model):
            reference = None
            for batch in held:  # the logits of one position: the blocks' outputs are what is kept
                model(**batch, **_no_cache(model), logits_to_keep=1)
        else:
            reference = _outputs(model, held)
    finally:
        for h in handles:
            h.remove()
    return reference, per_block, last


@contextlib.contextmanager
def floated(module: nn.Module) -> Iterator[None]:
    """``module`` computing in float inside: every activation point in float mode, every quantized layer's weight
    unquantized (its weights as they are: before any calibration pass changed them, the float model's outputs)."""
    quantizers = act_quantizers(module)
    weights = [m.weight_quant for m in module.modules() if isinstance(m, (QLinear, QEmbedding))]
    modes, off = [q.mode for q in quantizers], [w.disable_quant for w in weights]
    try:
        for q in quantizers:
            q.mode = "float"
        for w in weights:
            w.disable_quant = True
        yield
    finally:
        for q, mode in zip(quantizers, modes):
            q.mode = mode
        for w, was in zip(weights, off):
            w.disable_quant = was


class _TailReference:
    """The float model's logits on the held-out batches, computed when asked (:func:`float_references`): the tail
    stage, before its own calibration changes its weights, run :func:`floated` on the float model's last-block
    outputs.  ``piece(i, keep)``: held-out batch ``i``'s logits at positions ``keep`` (None: all)."""

    def __init__(self, stage: _Stage, judge: list[Batch]) -> None:
        self.stage, self.judge = stage, judge  # the judge batches' stage inputs: the float last-block outputs

    @torch.no_grad()
    def piece(self, i: int, keep: torch.Tensor | None) -> torch.Tensor:
        with floated(self.stage):
            return self.stage(**self.judge[i], logits_to_keep=keep).logits.float()

    def __getitem__(self, i: int) -> torch.Tensor:
        """Batch ``i``'s rows, as :func:`_outputs` gives them (valid tokens only)."""
        return valid_rows(self.piece(i, None), self.judge[i])

    def __len__(self) -> int:
        return len(self.judge)


def outside_blocks_quantized(model: nn.Module) -> list[str]:
    """Quantized modules that run before the first block (an embedding LayerNorm with a quantized residual stream,
    a Linear or conv there): block-by-block calibration starts at the first block and would leave them uncalibrated.
    Told by running the model (:func:`probe_forward`) up to the first block."""
    first = blocks_of(model)[0][0]
    names = {id(m): n for n, m in model.named_modules()}
    quantized = ({id(m) for m in act_quantizers(model)} | {id(m) for m in _weight_only_convs(model).values()}
                 | {id(m) for m in model.modules() if isinstance(m, QLinear)})
    ran: list[str] = []

    def pre(m: nn.Module, _args: tuple) -> None:
        if names[id(m)] == first:
            raise _Stop
        if id(m) in quantized:
            ran.append(names[id(m)])

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    try:
        probe_forward(model)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return ran


@dataclass
class Plan:
    """What ``quantize`` decided before calibrating, for every stage."""

    alphas: tuple[float | None, ...]
    search: bool
    min_ratio: float
    one_pass: bool
    foldable: bool
    fold_auto: bool
    skip: tuple[str, ...]
    chosen: list = field(default_factory=list)  # per stage: (alpha, folded only, errors, folded-only errors)
    v_folded: int = 0
    v_errors: list = field(default_factory=list)


def _local_skip(stage: _Stage, model: nn.Module, skip: tuple[str, ...]) -> tuple[str, ...]:
    """``skip`` (substrings of the model's module names) as the stage's names of the modules it matches."""
    global_names = {id(m): n for n, m in model.named_modules()}
    return tuple(n for n, m in stage.named_modules() if n and any(p in global_names.get(id(m), "") for p in skip))


def _keep(stage: _Stage, into: list) -> object:
    """A hook storing the stage's output hidden states at the index of their batch (a tail has none to store)."""
    def keep(_m: nn.Module, _args: tuple, kwargs: dict, out: object) -> None:
        into[int(kwargs["call"])] = getattr(out, "last_hidden_state", None)
    return stage.register_forward_hook(keep, with_kwargs=True)


def _run(stage: _Stage, batches: list[Batch], desc: str | None, into: list | None) -> None:
    """``run_batches`` on the stage, its outputs' hidden states (``last_hidden_state``) stored at their batch index."""
    handle = _keep(stage, into) if into is not None else None
    try:
        run_batches(stage, batches, desc=desc)
    finally:
        if handle is not None:
            handle.remove()


def calibrate(qmodel: nn.Module, config: QuantConfig, batches: list[Batch], fit: list[Batch], held: list[Batch],
              judge: list[Batch], reference: list[torch.Tensor] | None, block_refs: list[list[torch.Tensor]] | None,
              plan: Plan, dispatch: Offloaded | None = None, last: list[torch.Tensor] | None = None) -> None:
    """Calibrate the prepared ``qmodel`` block by block (the module docstring).  The batches play the parts they play
    in the whole-model path: ranges observed on ``fit`` then ``held`` (after the search), the corrections measured on
    ``batches``, "auto"'s candidates judged on ``judge`` against the float model's outputs there, ``reference``
    (the model's; None: computed from ``last``, the float model's last-block outputs there, by
    :class:`_TailReference`) and ``block_refs`` (each block's).  ``dispatch``: a model dispatched by accelerate, each
    block loaded on its execution device while calibrated, then written back (``offload.py``)."""
    from tqdm.auto import tqdm

    pool = list(batches)
    for b in fit + held + judge:  # a single batch is cut into pieces for the search: those run too
        if not any(b is p for p in pool):
            pool.append(b)

    def where(part: list[Batch]) -> list[int]:
        return [next(i for i, p in enumerate(pool) if p is b) for b in part]

    idx = {"every": where(batches), "fit": where(fit), "held": where(held), "judge": where(judge)}
    named = blocks_of(qmodel)
    blocks = [b for _, b in named]
    set_mode(qmodel, "float")
    calls, first, template = _capture(qmodel, blocks, pool, dispatch)
    head = qmodel.get_output_embeddings() if hasattr(qmodel, "get_output_embeddings") else None
    vocab = getattr(head, "out_features", None)
    shared = _Shared(model=qmodel, blocks=blocks, calls=calls, template=template, batches=pool,
                     sizes=[_batch_size(b) for b in pool], tail_names=[], dispatch=dispatch,
                     pieces=reference is None and bool(vocab), vocab=vocab or 1)
    streams = {"obs": list(first), "q0": list(first), "q1": list(first), "q": list(first)}
    first = None  # the streams hold them
    inside = {id(m) for b in blocks for m in b.modules()}
    tail = _tail_modules(qmodel, inside)
    shared.tail_names = list(tail)
    stages = [(name, _Stage({name: b}, shared, j)) for j, (name, b) in enumerate(named)]
    if tail:
        stages.append(("after the blocks", _Stage(tail, shared, None)))
    bar = tqdm(stages, desc="calibrating blocks", disable=len(stages) < 2)
    for j, (name, stage) in enumerate(bar):
        bar.set_postfix_str(name)
        ref = block_refs[j] if block_refs is not None and j < len(blocks) else reference
        if ref is None and last is not None and j == len(blocks):
            xs: list = [None] * len(pool)
            for k, i in enumerate(idx["judge"]):
                xs[i] = last[k]
            ref = _TailReference(stage, _stage_batches(xs, pool, idx["judge"]))
        if dispatch is not None and j < len(blocks):
            dispatch.load(j)
        _calibrate_stage(qmodel, stage, config, plan, streams, pool, idx, ref, last=j == len(stages) - 1)
        if dispatch is not None and j < len(blocks):
            dispatch.store(j)
        ref = None
        if block_refs is not None and j < len(blocks):
            block_refs[j] = None  # read by this block's candidates only
        _collect(stage)  # the stage's dropped trials and temporaries, before the next stage's


def _tail_modules(model: nn.Module, inside: set[int]) -> dict[str, nn.Module]:
    """The quantized modules outside every block and after the first one (final norm, ``lm_head``, a pooler): the
    highest such modules of the module tree, by name."""
    acts = {id(m) for m in act_quantizers(model)}
    quantized = [(n, m) for n, m in model.named_modules() if id(m) not in inside
                 and (isinstance(m, QLinear) or id(m) in acts)]
    names = [n for n, _ in quantized]
    top = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
    modules = dict(model.named_modules())
    # a quantizer's parent (QNorm's input_act) goes with its module
    out: dict[str, nn.Module] = {}
    for n in top:
        parent = n.rpartition(".")[0] if n.endswith("input_act") else n
        out.setdefault(parent, modules[parent] if parent else model)
    return out


def _calibrate_stage(qmodel: nn.Module, stage: _Stage, config: QuantConfig, plan: Plan, streams: dict,
                     pool: list[Batch], idx: dict[str, list[int]], ref: list[torch.Tensor] | None, last: bool) -> None:
    """One stage through the whole-model passes, each on its stream; the streams move on to the stage's outputs."""
    n = len(pool)
    obs, q0, q1, qf = ([None] * n for _ in range(4))

    def on(stream: str, part: str) -> list[Batch]:
        return _stage_batches(streams[stream], pool, idx[part])

    skip = _local_skip(stage, qmodel, plan.skip)
    set_mode(stage, "observe")
    recorder = InputRecorder(stage, _smoothable(stage, qmodel)) if plan.one_pass else None
    errors = folded_errors = None
    folded = False
    alphas = plan.alphas
    try:
        _run(stage, on("obs", "fit"), None, obs)
        if plan.search:
            recorder.remove()  # a copy must not carry the recording hooks
            alpha, folded, errors, folded_errors = _search_smoothing(stage, recorder, alphas, skip, on("q", "judge"),
                                                                     ref, plan.foldable)
            alphas = (alpha,)
            recorder.resume()
            _run(stage, on("obs", "held"), None, obs)  # the final ranges see every batch
    finally:
        if recorder is not None:
            recorder.remove()
    # each stream's old outputs are dropped after their last pass here, not when the stage ends: the old and the new
    # outputs of every stream at once were a block's working set more
    _release(stage, streams, "obs")
    alpha = alphas[0]
    if recorder is not None and alpha is not None and not _smooth_observed(
            _scope(recorder.groups(), folded), alpha, plan.min_ratio, skip):
        alpha = None
    _finish(stage)
    plan.chosen.append((alpha, folded and alpha is not None, errors, folded_errors))
    corrected = False
    if config.smoothing_into_v is True:
        plan.v_folded += fold_smoothing_into_v(stage, on("q0", "every"), config, explicit=True)
    elif plan.fold_auto and idx["judge"] and alpha is not None:
        count, v_errors, corrected = _fold_into_v_if_better(stage, on("q0", "every"), config, on("q", "judge"), ref)
        plan.v_folded += count
        if v_errors is not None:
            plan.v_errors.append(v_errors)
        _collect(stage)  # the fold's trial copy of the block
    if corrected:  # the fold's trial corrected the weight bias already: the corrected outputs carry on
        _run(stage, on("q0", "every"), None, q0)
    elif config.weight_bias_correction:  # its pass runs the uncorrected stage: the outputs the next stage's sees
        handle = _keep(stage, q0)
        try:
            correct_weight_bias(stage, on("q0", "every"))
        finally:
            handle.remove()
    elif not last:
        _run(stage, on("q0", "every"), None, q0)
    _release(stage, streams, "q0")
    if config.bias_correction is not None:
        if any(isinstance(m, SoftmaxOutputQuantizer) for m in stage.modules()):
            handle = _keep(stage, q1)
            try:
                correct_softmax_bias(stage, on("q1", "every"), config.bias_correction)
            finally:
                handle.remove()
        elif not last:
            _run(stage, on("q1", "every"), None, q1)
    _release(stage, streams, "q1")
    if idx["judge"] and not last:
        _run(stage, on("q", "judge"), None, qf)
    streams.update(obs=obs, q0=q0, q1=q1 if config.bias_correction is not None else q0, q=qf)


def _release(stage: _Stage, streams: dict, name: str) -> None:
    """Drop ``streams[name]`` (the stage's inputs on that stream, read for the last time) and, in a large model, hand
    the freed heap back (:func:`~softq.quant.copies._trim`)."""
    streams[name] = None
    if stage.softq_collect:
        _trim()


def _smoothable(stage: _Stage, model: nn.Module) -> dict[str, nn.Linear]:
    """The stage's Linear layers whose weights no other module of the whole model shares (a tied ``lm_head``)."""
    from softq.calib.smoothquant import smoothable_linears

    ok = {id(m) for m in smoothable_linears(model).values()}
    return {name: m for name, m in stage.named_modules() if isinstance(m, nn.Linear) and id(m) in ok}


def report(qmodel: nn.Module, plan: Plan, unjudged: bool) -> None:
    """``quantize``'s record of what was chosen: the alpha most stages took as ``softq_input_smoothing``, each stage's
    (the blocks in order, then the modules after them) in ``softq_block_smoothing``."""
    alphas = [c[0] for c in plan.chosen]
    common = Counter(alphas).most_common(1)[0][0] if alphas else None
    qmodel.softq_input_smoothing = common
    qmodel.softq_block_smoothing = alphas
    qmodel.softq_smoothing_errors = None
    qmodel.softq_smoothing_unjudged = unjudged
    qmodel.softq_smoothing_folded_only = any(c[1] for c in plan.chosen if c[0] == common)
    qmodel.softq_folded_smoothing_errors = None
    qmodel.softq_smoothing_into_v = plan.v_folded
    qmodel.softq_v_fold_errors = None


def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def copy_fits(model: nn.Module) -> bool:
    """Whether a copy of ``model`` and the calibration's working set (half a model more, measured block by block on
    bench_llm_memory.py's 1.1B Llama) fit in the memory available now (unknown: yes)."""
    free = _available_bytes()
    return free is None or 1.5 * model_bytes(model) <= free


def wanted(model: nn.Module, config: QuantConfig) -> bool:
    """Whether ``config.calibration`` asks for blocks: ``"auto"`` where the model has at least ``BLOCKS_ABOVE_BYTES`` of
    weights or the whole-model path's copies (the model, the search's observed model and one candidate) would not fit in
    the memory available now."""
    if config.calibration != "auto":
        return config.calibration == "blocks"
    size = model_bytes(model)
    free = _available_bytes()
    return size >= BLOCKS_ABOVE_BYTES or (free is not None and 2 * size > free)


def runs_blocks(qmodel: nn.Module, config: QuantConfig) -> bool:
    """After ``prepare``: whether the blocks can be calibrated one at a time.  Not where quantized modules run before the
    first block (a quantized embedding LayerNorm) or one block runs several times; ``calibration="blocks"`` refuses
    those in one line, ``"auto"`` calibrates the whole model."""
    try:
        blocks_of(qmodel)
    except ValueError:
        if config.calibration == "blocks":
            raise
        return False
    before = outside_blocks_quantized(qmodel)
    if before and config.calibration == "blocks":
        raise ValueError(f"calibration='blocks' starts at the first transformer block, but {before[0]} is quantized "
                         "and runs before it; use calibration='model'")
    return not before
