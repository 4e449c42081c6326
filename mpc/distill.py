"""MPCFormer-style distillation of a surrogate student from its plaintext teacher.

Replacing softmax by 2Quad and GELU by Quad changes the function a lot; MPCFormer
(ICLR 2023) recovers the accuracy by distilling in two stages:

1. **Layer-wise**: MSE between student and teacher hidden states (embedding
   output included) and attention maps;
2. **Prediction**: soft cross-entropy between the teacher's and the student's
   logits (temperature ``T``); for a headless encoder (a sentence-embedding model
   such as all-MiniLM-L6-v2, no ``logits``) ``1 - cosine`` of the mean-pooled
   sentence embeddings instead.

The student is a copy of the teacher switched to the surrogates with
:func:`softq.mpc.configure_surrogates`; its plaintext forward is exactly what the
encrypted run computes (up to fixed point), so the student is then run with
:func:`softq.mpc.run` unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from softq.models import has_cross_attention
from softq.mpc.fit import SurrogateFit, fit_surrogates
from softq.mpc.surrogates import configure_surrogates

_MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids", "pixel_values")
NORM_BATCHES = 4  # batches whose teacher hidden states set the channel scales of normalize_hidden


@dataclass
class DistillHistory:
    stage1: list[float] = field(default_factory=list)
    stage2: list[float] = field(default_factory=list)
    fit: SurrogateFit | None = None  # what fit_surrogates changed before stage 1 (None: not fitted)


def _model_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k in _MODEL_KEYS}


def _layer_loss(student_out: Any, teacher_out: Any, scales: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    loss = torch.zeros(())
    for i, (s, t) in enumerate(zip(student_out.hidden_states, teacher_out.hidden_states)):
        if scales is not None:
            s, t = s * scales[i], t * scales[i]
        loss = loss + nn.functional.mse_loss(s, t)
    s_maps, t_maps = getattr(student_out, "attentions", None), getattr(teacher_out, "attentions", None)
    if s_maps is not None and t_maps is not None:
        if len(s_maps) != len(t_maps):  # zip would silently drop the attention term
            raise RuntimeError(f"the teacher returned {len(t_maps)} attention maps and the student {len(s_maps)}")
        for s, t in zip(s_maps, t_maps):
            loss = loss + nn.functional.mse_loss(s, t)
    return loss


def hidden_scales(teacher: nn.Module, batches: Sequence[Mapping[str, torch.Tensor]],
                  min_var: float = 1e-3) -> list[torch.Tensor]:
    """Per hidden state of ``teacher`` (embedding output first), ``1 / std`` of each channel over the valid tokens
    of ``batches`` (variance floored at ``min_var``): the weights of ``distill(normalize_hidden=True)``'s MSE, so
    that every channel counts by its error relative to its own spread instead of a few large-magnitude
    channels deciding the loss."""
    if not batches:
        raise ValueError("hidden_scales needs at least one batch")
    sums: list[list[torch.Tensor]] = []
    with torch.no_grad():
        for batch in batches:
            out = teacher(**_model_inputs(batch), output_hidden_states=True)
            mask = batch.get("attention_mask")
            for i, h in enumerate(out.hidden_states):
                rows = (h[mask.bool()] if mask is not None and tuple(mask.shape) == tuple(h.shape[:2])
                        else h.reshape(-1, h.shape[-1])).double()
                part = [rows.sum(0), (rows * rows).sum(0), torch.tensor(float(rows.shape[0]), dtype=torch.float64)]
                if len(sums) <= i:
                    sums.append(part)
                else:
                    sums[i] = [a + b for a, b in zip(sums[i], part)]
    scales = []
    for total, squares, n in sums:
        mean = total / n
        var = (squares / n - mean * mean).clamp_min(min_var)
        scales.append(var.rsqrt().float())
    return scales


@contextlib.contextmanager
def _eager_attention(model: nn.Module) -> Iterator[None]:
    """The model computes its attention maps while the block runs: Hugging Face's SDPA attention (the default of
    a loaded BERT such as all-MiniLM-L6-v2) returns none for ``output_attentions=True``, which left stage 1
    without its attention term.  The implementation is switched to eager and back (the same function)."""
    from softq.families import set_implementation

    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    if before not in ("sdpa", "flash_attention_2") or not hasattr(model, "set_attn_implementation"):
        yield
        return
    set_implementation(model, "eager")
    try:
        yield
    finally:
        set_implementation(model, before)


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    t = torch.softmax(teacher_logits / temperature, dim=-1)
    return -(t * torch.log_softmax(student_logits / temperature, dim=-1)).sum(-1).mean() * temperature**2


def prediction_loss(student_out: Any, teacher_out: Any, batch: Mapping[str, torch.Tensor],
                    temperature: float = 1.0) -> torch.Tensor:
    """Stage-2 loss: soft cross-entropy on logits, or ``1 - cosine`` of pooled embeddings for an encoder."""
    if getattr(teacher_out, "logits", None) is not None:
        return soft_cross_entropy(student_out.logits, teacher_out.logits, temperature)
    from softq.hf import pool

    hidden = teacher_out.last_hidden_state
    mask = batch.get("attention_mask")
    mask = torch.ones(hidden.shape[:2], dtype=torch.long) if mask is None else mask
    s, t = pool(student_out.last_hidden_state, mask), pool(hidden, mask)
    return (1.0 - nn.functional.cosine_similarity(s, t, dim=-1)).mean()


def augment_tokens(batches: Iterator[Mapping[str, torch.Tensor]], rate: float, seed: int = 0,
                   pool: torch.Tensor | None = None, keep: Sequence[int] = ()) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the batches of ``batches`` with a fraction ``rate`` of their tokens replaced, fresh each time.

    Unlabelled distillation can show the teacher inputs it never had: each attended token whose id is not
    in ``keep`` (e.g. [CLS], [SEP]) is replaced with probability ``rate`` by an id drawn from ``pool``
    (e.g. every token occurrence of the training text: its unigram distribution), new draws at every step,
    so cycling a fixed set of windows keeps producing new contexts for the same words.  ``rate=0`` yields
    the batches unchanged.  The teacher sees the same replaced ids as the student (no labels involved).
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"token replacement rate must be in [0, 1), got {rate}")
    if rate > 0 and (pool is None or pool.numel() == 0 or pool.dtype not in (torch.int32, torch.int64)):
        raise ValueError("token replacement needs a non-empty integer tensor of candidate ids (pool)")
    g = torch.Generator().manual_seed(seed)
    keep_ids = torch.tensor(sorted(set(int(k) for k in keep)), dtype=torch.long)
    for batch in batches:
        if rate == 0:
            yield dict(batch)
            continue
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        eligible = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        if keep_ids.numel():
            eligible &= ~torch.isin(ids, keep_ids)
        hit = eligible & (torch.rand(ids.shape, generator=g) < rate)
        draws = pool.reshape(-1)[torch.randint(pool.numel(), ids.shape, generator=g)].to(ids.dtype)
        yield {**batch, "input_ids": torch.where(hit, draws, ids)}


def distill(
    teacher: nn.Module,
    batches: Iterator[Mapping[str, torch.Tensor]],
    softmax: str | Sequence[str] | Mapping[int, str] = "2quad",
    gelu: str | Sequence[str] | Mapping[int, str] | None = "quad",
    steps: tuple[int, int] = (200, 200),
    lr: tuple[float, float] = (1e-3, 3e-4),
    temperature: float = 1.0,
    progress: bool = True,
    softmax_params: Mapping[str, float] | None = None,
    dropout: bool = True,
    stage2_hidden_weight: float = 0.0,
    student: nn.Module | None = None,
    fit: bool = False,
    fit_batches: int = 8,
    normalize_hidden: bool = False,
) -> tuple[nn.Module, DistillHistory]:
    """Return a surrogate student distilled from ``teacher`` (left unchanged) and the loss curves.

    ``dropout=False`` trains the student in eval mode (no dropout): it then fits the
    teacher's deterministic function directly, which is what the encrypted run computes.
    ``stage2_hidden_weight`` adds that multiple of the hidden-state MSE (stage 1's loss
    without the attention maps) to the stage-2 loss. ``student``: continue distilling this
    surrogate model (trained in place; e.g. an earlier student) instead of a fresh copy of
    the teacher switched to ``softmax`` / ``gelu``.  ``fit=True``: before stage 1, fit the
    fresh student's Quad GELUs and 2Quad softmaxes to the teacher's activations on the first
    ``fit_batches`` batches (:func:`softq.mpc.fit.fit_surrogates`: exact weight rewrites, same
    encrypted cost); on all-MiniLM-L6-v2 it starts the student at embedding cosine 0.53 instead
    of -0.03 and ends 300 + 300 steps at 0.960 instead of 0.942 (docs/results/mpc.md).  Not the
    default: on the reference ViT the fitted and distilled 2Quad student's row sums leave the
    encrypted division's range (the range check refuses it) where the plain copy's came back into it.
    ``normalize_hidden=True``: the hidden-state MSE (both stages) weighs each channel by ``1 / std`` of the
    teacher's channel (:func:`hidden_scales` on the first ``NORM_BATCHES`` training batches, which are then
    trained on as usual) instead of letting a few large-magnitude channels decide it; on all-MiniLM-L6-v2's
    wide-text recipe it ends 1000 + 1000 steps at held-out cosine 0.9758 instead of 0.9744 (docs/results/mpc.md,
    ``minilm-distill-recombined-wide-fit-normalized``).  Off by default here (not measured on the reference
    LM / ViT); ``softq mpc distill --model DIR`` uses it.
    """
    if min(steps) < 0:
        raise ValueError(f"distillation steps must be >= 0, got {steps}")
    if has_cross_attention(teacher):  # the student would be one softq.mpc cannot run (graph.export_model)
        raise ValueError(f"softq's MPC runs self-attention models; this {type(teacher).__name__} has cross-attention "
                         "layers (add_cross_attention=True), so no student of it can run encrypted")
    if fit and fit_batches < 1:
        raise ValueError(f"fit_batches must be >= 1 when fit=True, got {fit_batches}")
    if not stage2_hidden_weight >= 0.0:
        raise ValueError(f"stage2_hidden_weight must be >= 0, got {stage2_hidden_weight}")
    teacher = teacher.eval()
    fresh = student is None
    if student is None:
        student = copy.deepcopy(teacher)
        configure_surrogates(student, softmax=softmax, gelu=gelu, softmax_params=softmax_params)
    elif student is teacher:
        raise ValueError("the student to continue must be a separate model from the teacher")
    student.train(dropout)
    for p in teacher.parameters():
        p.requires_grad_(False)
    history = DistillHistory()
    if fit and fresh:
        history.fit = fit_surrogates(student, teacher, [next(batches) for _ in range(fit_batches)])
    scales = None
    if normalize_hidden:
        head = list(itertools.islice(batches, NORM_BATCHES))
        scales = hidden_scales(teacher, head)
        batches = itertools.chain(head, batches)
    with _eager_attention(teacher):
        _train(student, teacher, batches, steps, lr, temperature, stage2_hidden_weight, progress, history, scales)
    student.eval()
    for p in teacher.parameters():
        p.requires_grad_(True)
    return student, history


def _train(student: nn.Module, teacher: nn.Module, batches: Iterator[Mapping[str, torch.Tensor]],
           steps: tuple[int, int], lr: tuple[float, float], temperature: float, stage2_hidden_weight: float,
           progress: bool, history: DistillHistory, scales: Sequence[torch.Tensor] | None = None) -> None:
    """The two stages' optimisation loops (see :func:`distill`)."""
    for stage, (n_steps, stage_lr) in enumerate(zip(steps, lr), start=1):
        if n_steps == 0:
            continue
        opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=stage_lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=n_steps)
        bar = tqdm(range(n_steps), desc=f"distill stage {stage}", disable=not progress, dynamic_ncols=True)
        for _ in bar:
            batch = _model_inputs(next(batches))
            hidden = stage == 1 or stage2_hidden_weight > 0
            with torch.no_grad():
                t_out = teacher(**batch, output_hidden_states=hidden, output_attentions=stage == 1)
            s_out = student(**batch, output_hidden_states=hidden, output_attentions=stage == 1)
            if stage == 1:
                loss = _layer_loss(s_out, t_out, scales)
            else:
                loss = prediction_loss(s_out, t_out, batch, temperature)
                if stage2_hidden_weight > 0:
                    loss = loss + stage2_hidden_weight * _layer_loss(s_out, t_out, scales)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            opt.step()
            sched.step()
            value = float(loss.detach())
            (history.stage1 if stage == 1 else history.stage2).append(value)
            bar.set_postfix(loss=f"{value:.4f}")
