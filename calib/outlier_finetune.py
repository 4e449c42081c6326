"""Remove the activation outliers of a *pretrained* text model by a short distillation fine-tune (issue 13).

Bondarenko et al. (2023) stop outliers from forming when a model is trained from
scratch with clipped softmax or gated attention.  A pretrained model already has
them baked into its weights: all-MiniLM-L6-v2's [CLS] token carries |x| = 223 in
hidden dimension 99 at the LayerNorm inputs of layers 0-3 (the residual sum of a
post-LN BERT), made by the FFN, which is what breaks a per-tensor 8-bit residual
stream.  This module fine-tunes such a model against its original self:

* the student is a copy of the model, optionally converted to gated attention
  (``softq.calib.train.convert_to_gated``: function-preserving at step 0) or to
  clipped softmax (not function-preserving; the distillation repairs it); by default
  ``constant_sink=True`` also makes [CLS]'s keys and values per-layer constants
  (``softq.attention.ConstantSink``, started at their means: [CLS] is a constant
  attention sink in MiniLM, cosine 0.99994), so nothing but pooling reads [CLS]'s
  residual stream, where the largest outliers live;
* the teacher is the original model, frozen;
* the loss, on unlabeled text, is
  ``embed_weight * (1 - cos(student embedding, teacher embedding))``
  ``+ hidden_weight * relative squared error of every block output``
  ``+ penalty_weight * mean over normalisation-layer inputs and FFN outputs of``
  ``sum_{valid tokens, dims} relu(|x| - threshold)^2 / threshold^2 / tokens``:
  the last term is an explicit soft penalty on activations above ``threshold``;
  with ``penalty_weight=0`` the run is pure distillation.

Any text model whose attention softq finds runs here, encoder or decoder (BERT, ModernBERT,
Llama...): the output projections the gates rescale, the normalisation layers whose inputs the
penalty reads (LayerNorm, RMSNorm) and the FFN outputs are found on the model itself, not by
family.  A causal model's embedding is its mean-pooled last hidden state (its first token sees
only itself, so ``pooling="cls"`` is refused there).

Everything goes through softq's attention interface (``configure_attention``);
no Hugging Face model code is edited.  Runs are deterministic per ``seed``
(data windows are drawn from a generator seeded by ``(seed, step)``, dropout is
off), checkpointed atomically, and a resumed run ends bit-identical to an
uninterrupted one on the same machine.

    from softq.calib.outlier_finetune import OutlierFinetuneConfig, finetune_outliers
    result = finetune_outliers(model, tokenizer, texts, OutlierFinetuneConfig())  # constant sinks, no gates
    result.model  # the fine-tuned student; ``model`` itself is left untouched (it is the teacher)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

METHODS = ("gated", "clipped", "none")
POOLINGS = ("mean", "cls")
RUN_KIND = "outlier-finetune-1"


@dataclass(frozen=True)
class OutlierFinetuneConfig:
    """Settings of :func:`finetune_outliers`; every field is validated on construction.

    Attributes:
        method: ``"gated"`` (convert to gated attention, function-preserving),
            ``"clipped"`` (switch the softmax to clipped softmax with ``clip_alpha``)
            or ``"none"`` (no gates, softmax unchanged: the control of the measurements).  The
            default is ``"none"`` because with ``constant_sink`` (the default) gates no longer help
            on all-MiniLM-L6-v2: per-tensor W8A8 0.9906 ± 0.0001 without them, 0.9898 ± 0.0006 with
            them (1200 steps, 2 seeds, docs/results/outlier_finetune_sink.md); without the sink,
            gated was the better one (0.9860 vs 0.9838,
            docs/results/outlier_finetune_lr5e-5_steps1200_control2.md).
        steps: optimizer steps.  The default 1200 (about 25 minutes on one CPU thread for MiniLM, at
            1.2 s per step) is the measured setting of docs/results/outlier_finetune_sink.md; 2400 steps
            gained nothing there (docs/results/outlier_finetune_lr5e-5_steps2400.md).
        batch_size: texts per step.
        max_length: tokens per text (longer ones are truncated).
        min_words: shortest random word window drawn from a text (a window of
            ``min_words`` .. all words of a random text is one training example).
        lr: peak learning rate of the model weights (linear warmup, cosine decay to 10%).  The default
            5e-5 is measured on all-MiniLM-L6-v2 (docs/outliers.md section 6): at 3e-4 the student fits its
            training windows to cosine 0.99 but held-out text only to 0.977; at 5e-5 held-out stays at 0.99+.
        gate_lr: peak learning rate of the gate parameters (``method="gated"``).  At 1e-3 MiniLM's gates stay
            between 0.45 and 0.50 (start 0.5) over 250 steps; the 1e-2 default lets them close (means 0.32-0.50 in
            layers 1-3) and is what the measured runs of docs/results/archive/outlier_finetune_lr5e-5.md use.
        warmup: warmup steps.
        weight_decay: AdamW weight decay of the matrices.
        grad_clip: gradient-norm clip (0 = none).
        pi_init: gate opening at conversion, in (0, 1).
        clip_alpha: clipped softmax ``gamma = -alpha / T`` (T = valid keys of the row).  A row
            can be clipped to all zeros (a head doing nothing) only if ``alpha > T / (T - 1)``,
            so the default 2 (the paper's range is 2-4) lets a pretrained head switch itself off;
            from scratch that same rule kills uniform rows (docs/outliers.md section 3).
        embed_weight: weight of ``1 - cos`` between pooled sentence embeddings.
        hidden_weight: weight of the relative squared error of the block outputs.
        penalty_weight: weight of the activation penalty (0 = pure distillation).  The default 4 is what
            brings MiniLM's LayerNorm inputs and FFN outputs 4x down in 600 steps at ``lr=5e-5``.
        penalty_threshold: |x| above which LayerNorm inputs and FFN outputs are penalised.
        pooling: sentence pooling of the embedding loss (``mean`` or ``cls``).
        constant_sink: also make the keys and values of the first token ([CLS]) in every layer
            per-head constants (:class:`softq.attention.ConstantSink`, started at their means on
            ``SINK_INIT_BATCHES`` training batches), so the other tokens no longer read [CLS]'s
            residual stream and its outliers can go without moving them.  On all-MiniLM-L6-v2
            (gated, 1200 steps, 2 seeds; docs/results/outlier_finetune_sink.md) it raises the FP32
            cosine to the original from 0.9951 to 0.9967 and W8A8 with a per-tensor residual stream
            from 0.9860 to 0.9898, and without gates to 0.9970 and 0.9906 (from 0.9952 and 0.9838),
            hence the default.
        seed: data windows and any random initialisation.
    """

    method: str = "none"
    steps: int = 1200
    batch_size: int = 8
    max_length: int = 128
    min_words: int = 8
    lr: float = 5e-5
    gate_lr: float = 1e-2
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    pi_init: float = 0.5
    clip_alpha: float = 2.0
    embed_weight: float = 10.0
    hidden_weight: float = 1.0
    penalty_weight: float = 4.0
    penalty_threshold: float = 16.0
    pooling: str = "mean"
    constant_sink: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise ValueError(f"OutlierFinetuneConfig: {message}")

        if self.method not in METHODS:
            fail(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.pooling not in POOLINGS:
            fail(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        for name in ("steps", "batch_size", "max_length", "min_words", "warmup", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                fail(f"{name} must be an integer, got {value!r}")
        for name, low in (("steps", 1), ("batch_size", 1), ("max_length", 4), ("min_words", 1), ("warmup", 0),
                          ("seed", 0)):
            if getattr(self, name) < low:
                fail(f"{name} must be at least {low}, got {getattr(self, name)}")
        for name in ("lr", "gate_lr", "weight_decay", "grad_clip", "pi_init", "clip_alpha", "embed_weight",
                     "hidden_weight", "penalty_weight", "penalty_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                fail(f"{name} must be a finite number, got {value!r}")
        for name in ("lr", "gate_lr", "penalty_threshold"):
            if getattr(self, name) <= 0:
                fail(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("weight_decay", "grad_clip", "clip_alpha", "embed_weight", "hidden_weight", "penalty_weight"):
            if getattr(self, name) < 0:
                fail(f"{name} must be non-negative, got {getattr(self, name)}")
        if not isinstance(self.constant_sink, bool):
            fail(f"constant_sink must be True or False, got {self.constant_sink!r}")
        if not 0.0 < self.pi_init < 1.0:
            fail(f"pi_init must be in (0, 1), got {self.pi_init}")
        if self.embed_weight == 0 and self.hidden_weight == 0:
            fail("embed_weight and hidden_weight are both 0: nothing ties the student to the original model")

    def describe(self) -> str:
        what = {"gated": f"gated (pi {self.pi_init})", "clipped": f"clipped (alpha {self.clip_alpha})",
                "none": "no attention change"}[self.method]
        if self.constant_sink:
            what += " + constant [CLS] sink"
        penalty = (f"penalty {self.penalty_weight:g} above |x|={self.penalty_threshold:g}" if self.penalty_weight
                   else "no penalty")
        return f"{what}, {penalty}, {self.steps} steps x {self.batch_size} texts, lr {self.lr:g}"


@dataclass
class OutlierFinetuneResult:
    """The fine-tuned student and its per-step history (``loss``, ``embed``, ``hidden``, ``penalty``)."""

    model: nn.Module
    config: OutlierFinetuneConfig
    history: list[dict[str, float]] = field(default_factory=list)
    step: int = 0

    @property
    def losses(self) -> list[float]:
        return [h["loss"] for h in self.history]


# ---------------------------------------------------------------------------
# Building the student
# ---------------------------------------------------------------------------


def check_model(model: nn.Module) -> None:
    """A text model softq can fine-tune here: one whose attention softq finds (any family through Hugging Face's
    attention interface, encoder or decoder) and that reads token ids, unconverted."""
    from softq.models import model_family

    model_family(model)  # a model whose attention softq cannot see: one line naming why
    main = getattr(model, "main_input_name", "input_ids")
    if main != "input_ids":
        raise ValueError(f"finetune_outliers trains on tokenized text, but {type(model).__name__} reads {main}")
    if getattr(model.config, "softq_gated", False):
        raise ValueError("the model already has gated attention; pass the original (ungated) model as the teacher")
    if getattr(model.config, "softq_constant_sink", False):
        raise ValueError("the model already has a constant attention sink; pass the original model as the teacher")
    if getattr(model.config, "softq_softmax", "softmax") not in ("softmax", None):
        raise ValueError(f"the model already uses softmax variant '{model.config.softq_softmax}'; pass the original model")


SINK_INIT_BATCHES = 8  # training batches whose mean [CLS] keys and values start the constant sinks


def make_student(model: nn.Module, config: OutlierFinetuneConfig,
                 sink_batches: Sequence[dict[str, torch.Tensor]] | None = None) -> nn.Module:
    """A copy of ``model`` with softq attention, converted as ``config.method`` says, dropout off.

    With ``config.constant_sink`` the sinks start at the mean [CLS] keys and values over
    ``sink_batches`` (required then), computed before any other conversion.
    """
    from softq.attention import configure_attention, init_constant_sinks
    from softq.calib.train import convert_to_gated

    check_model(model)
    student = copy.deepcopy(model)
    configure_attention(student)
    if config.constant_sink:
        if not sink_batches:
            raise ValueError("constant_sink=True needs sink_batches: text batches to start the sinks' keys and values")
        configure_attention(student, constant_sink=True)
        init_constant_sinks(student, sink_batches)
    if config.method == "gated":
        convert_to_gated(student, config.pi_init)
    elif config.method == "clipped":
        configure_attention(student, "clipped", alpha=float(config.clip_alpha))
    for m in student.modules():  # deterministic steps (and resumable runs); distillation needs no dropout
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return student


# ---------------------------------------------------------------------------
# Data: deterministic random word windows
# ---------------------------------------------------------------------------


def window_texts(texts: Sequence[str], batch_size: int, min_words: int, seed: int, step: int) -> list[str]:
    """``batch_size`` random word windows of random ``texts`` for ``step`` (a function of (seed, step) only)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    out = []
    for i in torch.randint(len(texts), (batch_size,), generator=gen).tolist():
        words = texts[i].split()
        n = len(words)
        if n <= min_words:
            out.append(" ".join(words))
            continue
        length = int(torch.randint(min_words, n + 1, (1,), generator=gen))
        start = int(torch.randint(0, n - length + 1, (1,), generator=gen))
        out.append(" ".join(words[start:start + length]))
    return out


def _tokenize(tokenizer: Callable, texts: list[str], max_length: int, device: torch.device) -> dict[str, torch.Tensor]:
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return {k: enc[k].to(device) for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}


# ---------------------------------------------------------------------------
# Loss pieces
# ---------------------------------------------------------------------------


def pooled(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    if pooling == "cls":
        return hidden[:, 0]
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)


@torch.no_grad()
def row_normalisers(model: nn.Module, within: Sequence[nn.Module]) -> list[nn.Module]:
    """The normalisation layers inside ``within`` (LayerNorm, RMSNorm, T5's LayerNorm...), found by what they do on
    one probe forward: a leaf module whose output keeps its input's shape and does not change when each input row is
    doubled.  Their inputs are the residual stream where the outliers live."""
    from softq.models import probe_forward

    seen: dict[int, tuple[nn.Module, torch.Tensor]] = {}

    def hook(module: nn.Module, inputs: tuple) -> None:
        x = inputs[0] if len(inputs) == 1 else None
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2 and x.shape[-1] > 1:
            seen.setdefault(id(module), (module, x))

    leaves = list(dict.fromkeys(m for block in within for m in block.modules()
                                if not list(m.children()) and not isinstance(m, (nn.Linear, nn.Dropout))))
    handles = [m.register_forward_pre_hook(hook) for m in leaves]
    try:
        probe_forward(model)
    finally:
        for h in handles:
            h.remove()
    norms = []
    for module, x in seen.values():
        x = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(0)).to(x)  # (a blank probe row is
        out = module.forward(x)  # constant, and a norm's eps then decides its output)
        if not isinstance(out, torch.Tensor) or out.shape != x.shape or not bool(out.abs().amax() > 0):
            continue
        if torch.allclose(module.forward(2 * x), out, rtol=1e-3, atol=1e-5 * float(out.abs().amax())):
            norms.append(module)
    return norms


class ActivationPenalty:
    """Hooks on every LayerNorm input and FFN output of the transformer blocks; sums the soft penalty.

    ``penalty = mean over hooked tensors of sum relu(|x| - t)^2 / t^2 / valid tokens``.
    Also records the largest |x| seen per kind (for progress output).
    """

    def __init__(self, model: nn.Module, threshold: float) -> None:
        from softq.calib.diagnostics import _last_linear
        from softq.models import transformer_blocks

        self.threshold = float(threshold)
        self.mask: torch.Tensor | None = None
        self.terms: list[torch.Tensor] = []
        self.max_abs = {"ln_input": 0.0, "ffn_output": 0.0}
        self.handles = []
        blocks = transformer_blocks(model)
        for norm in row_normalisers(model, [block for _, block in blocks]):
            self.handles.append(norm.register_forward_pre_hook(self._pre_hook))
        for _, block in blocks:
            ffn = _last_linear(block)
            if ffn is not None:
                self.handles.append(ffn.register_forward_hook(self._post_hook))

    def _add(self, x: torch.Tensor, kind: str) -> None:
        if self.mask is None:
            return
        valid = self.mask.to(x.dtype).unsqueeze(-1)
        excess = torch.relu(x.abs() - self.threshold) / self.threshold
        self.terms.append((excess.square() * valid).sum() / valid.sum().clamp_min(1.0))
        self.max_abs[kind] = max(self.max_abs[kind], float((x.detach().abs() * valid).max()))

    def _pre_hook(self, _m: nn.Module, inputs: tuple) -> None:
        self._add(inputs[0], "ln_input")

    def _post_hook(self, _m: nn.Module, _inputs: tuple, out: torch.Tensor) -> None:
        self._add(out, "ffn_output")

    @contextmanager
    def recording(self, mask: torch.Tensor) -> Iterator[None]:
        self.mask, self.terms = mask, []
        self.max_abs = {"ln_input": 0.0, "ffn_output": 0.0}
        try:
            yield
        finally:
            self.mask = None

    def value(self) -> torch.Tensor:
        return torch.stack(self.terms).mean() if self.terms else torch.zeros(())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _last_hidden(output: Any) -> torch.Tensor:
    last = getattr(output, "last_hidden_state", None)
    return output.hidden_states[-1] if last is None else last


def distill_losses(student_out: Any, teacher_out: Any, mask: torch.Tensor, pooling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 - cos of pooled embeddings, mean over blocks of the relative squared error of the block outputs).  The
    embedding pools the last hidden state (a model with a head, a causal LM: its last entry of ``hidden_states``)."""
    s_emb = pooled(_last_hidden(student_out), mask, pooling)
    t_emb = pooled(_last_hidden(teacher_out), mask, pooling)
    embed = (1.0 - nn.functional.cosine_similarity(s_emb, t_emb, dim=-1)).mean()
    valid = mask.to(s_emb.dtype).unsqueeze(-1)
    errors = []
    for s, t in zip(student_out.hidden_states[1:], teacher_out.hidden_states[1:]):
        errors.append(((s - t).square() * valid).sum() / ((t.square() * valid).sum()).clamp_min(1e-12))
    return embed, torch.stack(errors).mean()


# ---------------------------------------------------------------------------
# The verb
# ---------------------------------------------------------------------------


def _param_groups(model: nn.Module, config: OutlierFinetuneConfig) -> list[dict[str, Any]]:
    gates, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if ".gate." in name or name.endswith(".gate.weight") or name.endswith(".gate.bias"):
            gates.append(p)
        elif p.ndim >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay, "base_lr": config.lr},
              {"params": no_decay, "weight_decay": 0.0, "base_lr": config.lr}]
    if gates:
        groups.append({"params": gates, "weight_decay": 0.0, "base_lr": config.gate_lr})
    return [g for g in groups if g["params"]]


def teacher_fingerprint(model: nn.Module) -> list[float]:
    """A few numbers that change if the teacher's weights do (checked on resume)."""
    with torch.no_grad():
        params = [p.detach().double() for p in model.parameters()]
        return [round(float(sum(p.sum() for p in params)), 6), round(float(sum(p.abs().sum() for p in params)), 6)]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch has no CUDA device (torch.cuda.is_available() is False); "
                         "use device='cpu' or 'auto'")
    return dev


def finetune_outliers(
    model: nn.Module,
    tokenizer: Callable,
    texts: Sequence[str],
    config: OutlierFinetuneConfig | None = None,
    *,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 50,
    resume: bool = False,
    stop_after: int | None = None,
    device: str | torch.device | None = "auto",
    progress: bool = True,
) -> OutlierFinetuneResult:
    """Fine-tune a copy of ``model`` (the teacher, left untouched) to remove its outliers; see the module doc.

    ``texts`` are unlabeled training texts; ``tokenizer`` is the model's Hugging Face
    tokenizer (called with ``padding``, ``truncation``, ``max_length``,
    ``return_tensors="pt"``).  With ``checkpoint`` the run is saved atomically every
    ``checkpoint_every`` steps and at its end; ``resume=True`` continues from it
    (same config and teacher required).  ``stop_after`` ends this call after that
    many steps (the schedule still spans ``config.steps``).  ``device="auto"``
    uses a GPU when one is present.
    """
    from softq.calib.train import load_checkpoint, save_checkpoint
    from softq.calib.schedule import lr_at, progress_bar

    config = config or OutlierFinetuneConfig()
    if not isinstance(config, OutlierFinetuneConfig):
        raise ValueError(f"config must be an OutlierFinetuneConfig, got {type(config).__name__}")
    if isinstance(texts, (str, bytes)):  # a string is a sequence too: of one-letter texts
        raise ValueError("texts must be a list of training texts, got one string (it would train on its letters)")
    texts = list(texts)
    wrong = next((t for t in texts if not isinstance(t, str)), None)
    if wrong is not None:
        raise ValueError(f"texts must be strings, got a {type(wrong).__name__} among them")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError("finetune_outliers needs at least one non-empty training text")
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be at least 1, got {checkpoint_every}")
    if stop_after is not None and stop_after < 1:
        raise ValueError(f"stop_after must be at least 1, got {stop_after}")
    if resume and checkpoint is None:
        raise ValueError("resume=True needs a checkpoint path")
    check_model(model)
    from softq.models import is_causal, max_tokens

    if config.pooling == "cls" and is_causal(model):
        raise ValueError("OutlierFinetuneConfig.pooling='cls' reads the first token, which in a causal model sees only "
                         "itself: use pooling='mean'")

    positions = max_tokens(model.config)
    if positions is not None and config.max_length > positions:
        raise ValueError(f"OutlierFinetuneConfig.max_length is {config.max_length}, but this model takes at most "
                         f"{positions} tokens (its position table): set max_length <= {positions}")
    dev = resolve_device(device)

    sink_batches = None
    if config.constant_sink:  # windows no training step draws (steps >= config.steps), on the CPU
        sink_batches = [_tokenize(tokenizer, window_texts(texts, config.batch_size, config.min_words, config.seed,
                                                          config.steps + i), config.max_length, torch.device("cpu"))
                        for i in range(SINK_INIT_BATCHES)]
    student = make_student(model, config, sink_batches)
    teacher = copy.deepcopy(model).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    fingerprint = teacher_fingerprint(teacher)
    run = {"kind": RUN_KIND, "config": asdict(config), "teacher": fingerprint, "history": []}
    history: list[dict[str, float]] = []
    start = 0
    payload = None
    if resume:
        payload = load_checkpoint(checkpoint)
        saved = payload["run"]
        if saved.get("kind") != RUN_KIND:
            raise ValueError(f"{checkpoint} is not a finetune_outliers checkpoint")
        saved["config"].setdefault("constant_sink", False)  # saved before the field existed
        if saved["config"] != run["config"]:
            diff = [f.name for f in fields(config) if saved["config"].get(f.name) != run["config"][f.name]]
            raise ValueError(f"resume: checkpoint was made with a different config ({', '.join(diff)} differ)")
        if saved["teacher"] != fingerprint:
            raise ValueError("resume: the model passed is not the teacher the checkpoint was trained against")
        student.load_state_dict(payload["state_dict"], strict=True)
        start, history = int(payload["step"]), list(saved["history"])
    elif checkpoint is not None and Path(checkpoint).exists():
        raise FileExistsError(f"checkpoint {checkpoint} exists; pass resume=True to continue it or remove it")

    student.to(dev)
    teacher.to(dev)
    groups = _param_groups(student, config)
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.999))
    if payload is not None:
        optimizer.load_state_dict(payload["optimizer"])

    end = config.steps if stop_after is None else min(config.steps, start + stop_after)
    penalty = ActivationPenalty(student, config.penalty_threshold)
    student.train()
    from softq.attention import fast_training

    bar = progress_bar(range(start, end), progress, desc=f"finetune {config.method}", initial=start, total=config.steps)
    try:
        with fast_training(student):
            for step in bar:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step, config.steps, group["base_lr"], max(1, config.warmup))
                batch = _tokenize(tokenizer, window_texts(texts, config.batch_size, config.min_words, config.seed, step),
                                  config.max_length, dev)
                with torch.no_grad():
                    t_out = teacher(**batch, output_hidden_states=True)
                with penalty.recording(batch["attention_mask"]):
                    s_out = student(**batch, output_hidden_states=True)
                embed, hidden = distill_losses(s_out, t_out, batch["attention_mask"], config.pooling)
                pen = penalty.value().to(embed.device)
                loss = config.embed_weight * embed + config.hidden_weight * hidden + config.penalty_weight * pen
                if not torch.isfinite(loss):
                    raise RuntimeError(f"finetune_outliers diverged at step {step} (loss {float(loss)})")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if config.grad_clip:
                    nn.utils.clip_grad_norm_(student.parameters(), config.grad_clip)
                optimizer.step()
                history.append({"loss": loss.item(), "embed": embed.item(), "hidden": hidden.item(),
                                "penalty": pen.item(), "ln_input_max": penalty.max_abs["ln_input"],
                                "ffn_output_max": penalty.max_abs["ffn_output"]})
                if progress:
                    bar.set_postfix(loss=f"{loss.item():.4f}", cos=f"{1 - embed.item():.4f}",
                                    ln_max=f"{penalty.max_abs['ln_input']:.0f}")
                done = step + 1
                if checkpoint is not None and (done % checkpoint_every == 0 or done == end):
                    save_checkpoint(checkpoint, student, optimizer, done, [h["loss"] for h in history],
                                    {**run, "history": history})
    finally:
        penalty.remove()
    student.eval()
    return OutlierFinetuneResult(student, config, history, max(start, end))


# ---------------------------------------------------------------------------
# What the gates learned
# ---------------------------------------------------------------------------


@torch.no_grad()
def gate_values(model: nn.Module, batches: Sequence[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """Per layer: mean gate opening per head over valid tokens, and the opening at the first token ([CLS]).

    Empty for an ungated model.
    """
    from softq.models import attention_modules

    sums: dict[int, list[torch.Tensor]] = {}
    handles = []
    mask_box: dict[str, torch.Tensor] = {}
    layers = [m.softq for _, m in attention_modules(model) if getattr(m, "softq", None) is not None
              and m.softq.gate is not None]
    if not layers:
        return []

    def hook(index: int) -> Callable:
        def fn(_m: nn.Module, _inputs: tuple, out: torch.Tensor) -> None:
            g = out.squeeze(-1).float()  # [b, heads, s]
            mask = mask_box["mask"]  # no attention_mask (a vision model, unpadded text): every token
            valid = g.new_ones(g.shape[0], 1, g.shape[2]) if mask is None else mask.to(g)[:, None, :]
            acc = sums.setdefault(index, [torch.zeros(g.shape[1]), torch.zeros(g.shape[1]), 0.0, 0.0])
            acc[0] += (g * valid).sum(dim=(0, 2)).cpu()
            acc[1] += g[:, :, 0].sum(0).cpu()
            acc[2] += float(valid.sum())
            acc[3] += float(g.shape[0])
        return fn

    for i, points in enumerate(layers):
        handles.append(points.gate.register_forward_hook(hook(i)))
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            mask_box["mask"] = batch.get("attention_mask")
            model(**batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return [{"layer": i, "mean": (acc[0] / acc[2]).tolist(), "first_token": (acc[1] / acc[3]).tolist()}
            for i, acc in sorted(sums.items())]
