"""softq's reference workloads: a character LM and a digits ViT, trained here, never downloaded.

softq must be testable and benchmarkable with no network, so its workloads are
built from data that ships with Python and scikit-learn:

* **Text**: Python's own help topics (``pydoc_data.topics``), ~465k characters of
  technical English, modelled character by character (GPT-2 or OPT family).
* **Images**: scikit-learn's bundled 8x8 handwritten digits, upsampled so a
  patch-4 ViT sees 64 tokens.

Every model is built from a config only and trained deterministically by seed,
so two machines produce the same reference models.  Trained models are cached
under :func:`cache_dir`; the cache key names size, family, attention variant,
seed, steps and :data:`VERSION` (bump it when data or training change).

Attention variants (clipped softmax, gated attention, ...) go through
``softq.attention.configure_attention`` *before* training, so every variant is
trained by the very same loop as the baseline.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

# Bump when the data, model sizes or training recipe change: old cache entries are then ignored.
VERSION = "1"
HELDOUT_FRACTION = 0.1
DIGITS_SEED = 0

# Sizes.  "reference" is what the examples train and benchmarks use; "tiny" is for tests.
LM_SIZES: dict[str, dict[str, int]] = {
    "reference": {"layers": 4, "d_model": 128, "heads": 4, "context": 1024},
    "tiny": {"layers": 2, "d_model": 32, "heads": 2, "context": 128},
}
VIT_SIZES: dict[str, dict[str, int]] = {
    "reference": {"layers": 4, "d_model": 128, "heads": 4, "image_size": 32, "patch_size": 4},
    "tiny": {"layers": 2, "d_model": 32, "heads": 2, "image_size": 16, "patch_size": 4},
}
# Training budgets (steps, batch size, peak learning rate) per size.  The reference LM
# budget is set by wall-clock on a shared 2-core machine, not by convergence: at 800
# steps of 4 x 1024 characters the model is just leaving the bigram plateau (its loss
# is still near the corpus bigram entropy), so more steps lower its perplexity a lot.
# Changing a budget changes the cache key (it contains the step count), so cached
# models never go stale silently.
LM_BUDGETS: dict[str, dict[str, float]] = {
    "reference": {"steps": 800, "batch_size": 4, "lr": 3e-3},
    "tiny": {"steps": 30, "batch_size": 8, "lr": 3e-3},
}
VIT_BUDGETS: dict[str, dict[str, float]] = {
    "reference": {"steps": 600, "batch_size": 64, "lr": 2e-3},
    "tiny": {"steps": 300, "batch_size": 32, "lr": 3e-3},
}


def _check_choice(what: str, value: str, choices: Iterable[str]) -> None:
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"unknown {what} '{value}'; choose one of {choices}")


# ---------------------------------------------------------------------------
# Cache location
# ---------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where trained reference models live: ``$SOFTQ_CACHE`` or ``~/.cache/softq``."""
    env = os.environ.get("SOFTQ_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "softq"


# ---------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------


def _full_corpus() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def char_corpus() -> tuple[str, str]:
    """(train, heldout) text: the help topics in sorted-key order, the last 10% held out.

    A contiguous split (not random windows) so held-out text is whole topics the
    model has never seen, which makes perplexity an honest generalisation figure.
    """
    text = _full_corpus()
    cut = int(len(text) * (1.0 - HELDOUT_FRACTION))
    return text[:cut], text[cut:]


class CharTokenizer:
    """Character-level tokenizer whose vocabulary is the sorted set of corpus characters.

    Built from the whole corpus (train and heldout) so held-out text never hits an
    unknown character; deterministic because the vocabulary is sorted.
    """

    def __init__(self, chars: Sequence[str] | None = None) -> None:
        if chars is None:
            chars = sorted(set(_full_corpus()))
        chars = list(chars)
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise ValueError("CharTokenizer needs a list of distinct single characters")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the tokenizer's vocabulary") from None

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        try:
            return "".join(self.chars[i] for i in ids)
        except IndexError:
            raise ValueError(f"token id out of range 0..{len(self.chars) - 1}") from None

    def save(self, path: str | Path) -> None:
        _atomic_write_text(Path(path), json.dumps({"chars": self.chars}, ensure_ascii=False))

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        return cls(json.loads(Path(path).read_text(encoding="utf-8"))["chars"])


def _split_ids(split: str, tokenizer: CharTokenizer) -> torch.Tensor:
    _check_choice("split", split, ("train", "heldout"))
    train, heldout = char_corpus()
    return torch.tensor(tokenizer.encode(train if split == "train" else heldout), dtype=torch.long)


def lm_config(
    size: str = "reference",
    family: str = "gpt2",
    context: int | None = None,
    vocab_size: int | None = None,
) -> Any:
    """Config of a reference ("reference") or test ("tiny") character LM; dropout off.

    ``context`` defaults to the size's context (1024 reference, 128 tiny) and
    ``vocab_size`` to the :class:`CharTokenizer` vocabulary.
    """
    _check_choice("LM size", size, LM_SIZES)
    _check_choice("LM family", family, ("gpt2", "opt"))
    s = LM_SIZES[size]
    context = int(context or s["context"])
    vocab_size = int(vocab_size or CharTokenizer().vocab_size)
    if context < 2:
        raise ValueError(f"context must be at least 2, got {context}")
    if family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=vocab_size, n_positions=context, n_embd=s["d_model"], n_layer=s["layers"],
            n_head=s["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=vocab_size, hidden_size=s["d_model"], num_hidden_layers=s["layers"],
        ffn_dim=4 * s["d_model"], num_attention_heads=s["heads"], max_position_embeddings=context,
        word_embed_proj_dim=s["d_model"], dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        layerdrop=0.0, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def lm_batches(
    split: str, context: int, batch_size: int, seed: int, tokenizer: CharTokenizer
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless random windows ``{"input_ids", "labels"}`` of shape [batch_size, context], seeded."""
    ids = _split_ids(split, tokenizer)
    if len(ids) <= context:
        raise ValueError(f"the {split} split ({len(ids)} tokens) is shorter than context {context}")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(context)
    while True:
        starts = torch.randint(0, len(ids) - context + 1, (batch_size,), generator=gen)
        batch = ids[starts[:, None] + offsets]
        yield {"input_ids": batch, "labels": batch}


def lm_eval_inputs(
    context: int, max_windows: int | None, tokenizer: CharTokenizer, split: str = "heldout"
) -> list[dict[str, torch.Tensor]]:
    """Non-overlapping windows ``{"input_ids": [1, context]}`` from the start of ``split``."""
    ids = _split_ids(split, tokenizer)
    count = len(ids) // context
    if max_windows is not None:
        count = min(count, int(max_windows))
    if count < 1:
        raise ValueError(f"the {split} split has no full window of context {context}")
    return [{"input_ids": ids[i * context:(i + 1) * context].unsqueeze(0)} for i in range(count)]


def lm_calib_inputs(n: int, context: int, tokenizer: CharTokenizer, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` random windows ``{"input_ids": [1, context]}`` from the TRAIN split (never heldout)."""
    if n < 1:
        raise ValueError(f"need at least one calibration window, got n={n}")
    batch = next(lm_batches("train", context, n, seed, tokenizer))["input_ids"]
    return [{"input_ids": row.unsqueeze(0)} for row in batch]


def _progress(iterable: Any, enabled: bool, **kwargs: Any) -> Any:
    return tqdm(iterable, disable=not enabled, dynamic_ncols=True, **kwargs)


@torch.no_grad()
def perplexity(model: nn.Module, inputs: Sequence[dict[str, torch.Tensor]], progress: bool | None = None) -> float:
    """exp of the token-weighted mean next-token NLL over every predicted token of ``inputs``.

    An ``attention_mask`` in an input excludes padded positions from the count.
    """
    if len(inputs) == 0:
        raise ValueError("perplexity needs at least one input")
    if progress is None:
        progress = sys.stderr.isatty() and len(inputs) > 8
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for inp in _progress(inputs, progress, desc="perplexity", leave=False):
            logits = model(**inp).logits[:, :-1].float()
            target = inp["input_ids"][:, 1:]
            nll = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
            mask = inp.get("attention_mask")
            if mask is not None:
                keep = (mask[:, 1:] * mask[:, :-1]).reshape(-1).to(nll.dtype)
                total += float((nll * keep).sum())
                count += int(keep.sum())
            else:
                total += float(nll.sum())
                count += nll.numel()
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("no predicted tokens in the inputs")
    return math.exp(total / count)


# ---------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------


def digits_data(split: str, image_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(images [N, 1, S, S] float, labels [N] long) of scikit-learn's digits.

    Stratified 80/20 split with a fixed seed; pixels scaled from 0..16 to -1..1;
    the 8x8 images are upsampled bilinearly to ``image_size`` so that with patch 4
    the reference ViT sees 8x8 = 64 tokens.
    """
    _check_choice("split", split, ("train", "heldout", "test"))
    if image_size < 8:
        raise ValueError(f"image_size must be at least 8, got {image_size}")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    idx_train, idx_test = train_test_split(
        list(range(len(data.target))), test_size=0.2, random_state=DIGITS_SEED, stratify=data.target
    )
    idx = idx_train if split == "train" else idx_test
    images = torch.tensor(data.images[idx], dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    if image_size != 8:
        images = nn.functional.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return images.contiguous(), torch.tensor(data.target[idx], dtype=torch.long)


def vit_config(size: str = "reference") -> Any:
    """ViTForImageClassification config for 1-channel digits, 10 labels, dropout off."""
    _check_choice("ViT size", size, VIT_SIZES)
    from transformers import ViTConfig

    s = VIT_SIZES[size]
    return ViTConfig(
        hidden_size=s["d_model"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        intermediate_size=4 * s["d_model"], image_size=s["image_size"], patch_size=s["patch_size"],
        num_channels=1, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )


def _batched(images: torch.Tensor, batch_size: int) -> list[dict[str, torch.Tensor]]:
    return [{"pixel_values": images[i:i + batch_size]} for i in range(0, len(images), batch_size)]


def vit_eval_inputs(image_size: int = 32, batch_size: int = 128, split: str = "heldout") -> list[dict[str, torch.Tensor]]:
    """All images of ``split`` as ``{"pixel_values"}`` batches, in the order of ``digits_data(split)[1]``."""
    return _batched(digits_data(split, image_size)[0], batch_size)


def vit_calib_inputs(n: int, image_size: int = 32, seed: int = 0, batch_size: int = 1) -> list[dict[str, torch.Tensor]]:
    """``n`` random TRAIN images as ``{"pixel_values"}`` batches of ``batch_size``."""
    images, _ = digits_data("train", image_size)
    if not 1 <= n <= len(images):
        raise ValueError(f"n must be in 1..{len(images)}, got {n}")
    pick = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))[:n]
    return _batched(images[pick], batch_size)


@torch.no_grad()
def top1(model: nn.Module, inputs: Sequence[dict[str, torch.Tensor]], labels: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """Top-1 accuracy in percent; ``labels`` is [N] in input order (or one tensor per input)."""
    if not isinstance(labels, torch.Tensor):
        labels = torch.cat(list(labels))
    was_training = model.training
    model.eval()
    try:
        preds = torch.cat([model(**inp).logits.argmax(-1) for inp in inputs])
    finally:
        model.train(was_training)
    if preds.shape != labels.shape:
        raise ValueError(f"{preds.numel()} predictions but {labels.numel()} labels")
    return 100.0 * float((preds == labels).float().mean())


def _augment(images: torch.Tensor, gen: torch.Generator, max_shift: int) -> torch.Tensor:
    """Random translation by up to ``max_shift`` pixels (background fill): digits are small data."""
    if max_shift <= 0:
        return images
    b, _, h, w = images.shape
    padded = nn.functional.pad(images, (max_shift,) * 4, value=-1.0)
    dy = torch.randint(0, 2 * max_shift + 1, (b,), generator=gen)
    dx = torch.randint(0, 2 * max_shift + 1, (b,), generator=gen)
    rows = (dy[:, None] + torch.arange(h))[:, :, None]
    cols = (dx[:, None] + torch.arange(w))[:, None, :]
    return padded[torch.arange(b)[:, None, None], 0, rows, cols].unsqueeze(1)


# ---------------------------------------------------------------------------
# Models and training
# ---------------------------------------------------------------------------


def build_model(config: Any) -> nn.Module:
    """A fresh model for an LM or ViT config (random init, eager attention)."""
    if config.model_type == "gpt2":
        from transformers import GPT2LMHeadModel as cls
    elif config.model_type == "opt":
        from transformers import OPTForCausalLM as cls
    elif config.model_type == "vit":
        from transformers import ViTForImageClassification as cls
    else:
        raise ValueError(f"softq workloads build gpt2, opt or vit models, not '{config.model_type}'")
    model = cls(config)
    model.set_attn_implementation("eager")
    return model


def _configure(model: nn.Module, attention: dict[str, Any] | None) -> None:
    if attention:
        from softq.attention import configure_attention

        configure_attention(model, **attention)


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2 and "gate" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and (p.ndim < 2 or "gate" in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )


@contextmanager
def _fast_attention(model: nn.Module) -> Iterator[None]:
    """Train with the fastest path that computes the same function, then switch back.

    A model without softq attention trains with PyTorch SDPA (about 3x faster than
    eager attention on CPU at context 1024); a model with a softq variant or gates
    trains through :func:`softq.attention.fast_training` (SDPA for exact softmax,
    ``torch.compile``'d variants otherwise).
    """
    if getattr(model.config, "softq_softmax", None) is not None:
        from softq.attention import fast_training

        with fast_training(model):
            yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation("eager")


def run_training(
    model: nn.Module,
    batches: Iterator[dict[str, torch.Tensor]],
    steps: int,
    lr: float,
    *,
    start_step: int = 0,
    end_step: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    warmup: int | None = None,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    progress: bool = True,
    desc: str = "train",
    on_step: Any = None,
) -> list[float]:
    """The one training loop: AdamW, warmup + cosine, gradient clipping; returns per-step losses.

    ``on_step(step, model, optimizer, losses)`` runs after every step (checkpointing).
    ``start_step``/``optimizer`` let a resumed run continue the same schedule;
    ``end_step`` stops early (the schedule still spans ``steps``).
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    optimizer = optimizer or _optimizer(model, lr, weight_decay)
    warmup = max(1, min(100, steps // 10)) if warmup is None else max(1, warmup)
    losses: list[float] = []
    model.train()
    end_step = steps if end_step is None else min(steps, end_step)
    bar = _progress(range(start_step, end_step), progress, desc=desc, initial=start_step, total=steps)
    with _fast_attention(model):
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, steps, lr, warmup)
            batch = next(batches)
            loss = model(**batch).loss
            if not torch.isfinite(loss):
                raise RuntimeError(f"training diverged at step {step} (loss {float(loss)})")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip:
                nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            losses.append(loss.item())
            if progress and step % 10 == 0:
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if on_step is not None:
                on_step(step + 1, model, optimizer, losses)
    model.eval()
    return losses


def vit_batches(split: str, image_size: int, batch_size: int, seed: int, augment: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """Endless shuffled epochs ``{"pixel_values", "labels"}`` with random shifts, seeded."""
    images, labels = digits_data(split, image_size)
    gen = torch.Generator().manual_seed(seed)
    shift = max(1, image_size // 8) if augment else 0  # one original 8x8 pixel
    while True:
        order = torch.randperm(len(images), generator=gen)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            pick = order[i:i + batch_size]
            yield {"pixel_values": _augment(images[pick], gen, shift), "labels": labels[pick]}


def train_lm(
    size: str = "reference",
    seed: int = 0,
    steps: int | None = None,
    *,
    family: str = "gpt2",
    batch_size: int | None = None,
    lr: float | None = None,
    context: int | None = None,
    attention: dict[str, Any] | None = None,
    tokenizer: CharTokenizer | None = None,
    progress: bool = True,
    on_step: Any = None,
) -> nn.Module:
    """Train a character LM from scratch, deterministically by ``seed``; returns it in eval mode.

    ``attention`` (e.g. ``{"softmax": "clipped", "alpha": 4.0}`` or
    ``{"gated": True, "gate_pi_init": 0.25}``) configures softq attention before
    the first step, so the variant is what gets trained.  ``on_step`` is passed
    to :func:`run_training` (checkpoints, measurements during training).
    """
    _check_choice("LM size", size, LM_SIZES)
    budget = LM_BUDGETS[size]
    tokenizer = tokenizer or CharTokenizer()
    torch.manual_seed(seed)
    config = lm_config(size, family, context, tokenizer.vocab_size)
    model = build_model(config)
    _configure(model, attention)
    batches = lm_batches("train", config.max_position_embeddings if family == "opt" else config.n_positions,
                         int(batch_size or budget["batch_size"]), seed, tokenizer)
    run_training(model, batches, int(steps or budget["steps"]), float(lr or budget["lr"]),
                 progress=progress, desc=f"train {family} {size}", on_step=on_step)
    return model


def train_vit(
    size: str = "reference",
    seed: int = 0,
    steps: int | None = None,
    *,
    batch_size: int | None = None,
    lr: float | None = None,
    attention: dict[str, Any] | None = None,
    augment: bool = True,
    progress: bool = True,
    on_step: Any = None,
) -> nn.Module:
    """Train a digits ViT from scratch, deterministically by ``seed``; returns it in eval mode.

    ``on_step(step, model, optimizer, losses)`` runs after every step (see :func:`run_training`).
    """
    _check_choice("ViT size", size, VIT_SIZES)
    budget = VIT_BUDGETS[size]
    torch.manual_seed(seed)
    config = vit_config(size)
    model = build_model(config)
    _configure(model, attention)
    batches = vit_batches("train", config.image_size, int(batch_size or budget["batch_size"]), seed, augment)
    run_training(model, batches, int(steps or budget["steps"]), float(lr or budget["lr"]),
                 weight_decay=0.05, progress=progress, desc=f"train vit {size}", on_step=on_step)
    return model


# ---------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def variant_name(attention: dict[str, Any] | None) -> str:
    """Stable short name of an attention configuration, used in cache keys ("vanilla" if none)."""
    if not attention:
        return "vanilla"
    parts = []
    for key in sorted(attention):
        value = attention[key]
        if isinstance(value, float):
            value = f"{value:g}"
        parts.append(f"{key}={value}")
    return ",".join(parts).replace("/", "_")


def add_training_args(parser: Any, sizes: Iterable[str]) -> None:
    """The command-line flags shared by ``examples/train_lm.py`` and ``examples/train_vit.py``."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the size's budget)")
    parser.add_argument("--size", choices=sorted(sizes), default="reference")
    parser.add_argument("--softmax", default=None, help="softq softmax variant to train with (e.g. clipped)")
    parser.add_argument("--alpha", type=float, default=4.0, help="clipped softmax: gamma = -alpha / T")
    parser.add_argument("--gated", action="store_true", help="train with gated attention")
    parser.add_argument("--pi", type=float, default=0.5, help="gated attention: initial gate opening")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--force", action="store_true", help="retrain even if the model is cached")


def attention_from_args(parser: Any, args: Any) -> dict[str, Any] | None:
    """Validate the flags of :func:`add_training_args` (a parser error on bad ones) and apply --threads."""
    try:
        attention = attention_options(args.softmax, args.alpha, args.gated, args.pi)
    except ValueError as err:
        parser.error(str(err))
    if args.threads:
        torch.set_num_threads(args.threads)
    return attention


def attention_options(
    softmax: str | None = None, alpha: float = 4.0, gated: bool = False, pi_init: float = 0.5
) -> dict[str, Any] | None:
    """``configure_attention`` keywords for command-line style choices (None = vanilla).

    ``alpha`` only applies to the clipped softmax and ``pi_init`` only to gates,
    so unrelated flags never change a cache key.
    """
    attention: dict[str, Any] = {}
    if softmax and softmax != "softmax":
        from softq.softmax import get_softmax

        get_softmax(softmax)  # unknown names fail here, with the list of choices
        attention["softmax"] = softmax
        if softmax == "clipped":
            attention["alpha"] = float(alpha)
    if gated:
        attention.update(gated=True, gate_pi_init=float(pi_init))
    return attention or None


def cache_key(kind: str, size: str, family: str, attention: dict[str, Any] | None, seed: int, steps: int) -> str:
    return f"{kind}-{family}-{size}-{variant_name(attention)}-seed{seed}-steps{steps}-v{VERSION}"


def save_model(model: nn.Module, path: str | Path, tokenizer: CharTokenizer | None = None,
               meta: dict[str, Any] | None = None) -> Path:
    """Save config, full state dict (softq gates included) and tokenizer to ``path``, atomically.

    The state dict is saved with ``torch.save`` rather than ``save_pretrained``
    because Hugging Face's loader drops keys it does not know, such as the
    ``*.softq.gate.*`` parameters of gated attention.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        model.config.save_pretrained(tmp)
        torch.save(model.state_dict(), tmp / "weights.pt")
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer.json")
        (tmp / "meta.json").write_text(json.dumps(meta or {}, indent=2, sort_keys=True))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def load_model(path: str | Path) -> nn.Module:
    """Load a model saved by :func:`save_model`, restoring softq attention (variant and gates)."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "weights.pt").is_file():
        raise FileNotFoundError(f"{path} is not a softq model directory (config.json and weights.pt expected)")
    from transformers import AutoConfig

    from softq.attention import configure_from_config

    config = AutoConfig.from_pretrained(path)
    model = build_model(config)
    configure_from_config(model)
    state = torch.load(path / "weights.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    model.eval()
    return model


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def reference_lm(
    seed: int = 0,
    attention: dict[str, Any] | None = None,
    family: str = "gpt2",
    *,
    size: str = "reference",
    steps: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> tuple[nn.Module, CharTokenizer]:
    """The cached reference character LM (trained and cached on first use) and its tokenizer."""
    _check_choice("LM size", size, LM_SIZES)
    steps = int(steps or LM_BUDGETS[size]["steps"])
    path = cache_dir() / cache_key("lm", size, family, attention, seed, steps)
    if path.exists() and not force:
        return load_model(path), CharTokenizer.load(path / "tokenizer.json")
    _log(f"training {path.name} (cached afterwards in {path.parent})", progress)
    tokenizer = CharTokenizer()
    start = time.time()
    model = train_lm(size, seed, steps, family=family, attention=attention, tokenizer=tokenizer, progress=progress)
    train_seconds = time.time() - start
    context = model.config.max_position_embeddings if family == "opt" else model.config.n_positions
    ppl = perplexity(model, lm_eval_inputs(context, None, tokenizer), progress=progress)
    meta = {"kind": "lm", "size": size, "family": family, "attention": attention, "seed": seed, "steps": steps,
            "version": VERSION, "train_seconds": round(train_seconds, 1), "threads": torch.get_num_threads(),
            "heldout_perplexity": ppl}
    save_model(model, path, tokenizer, meta)
    return model, tokenizer


def reference_vit(
    seed: int = 0,
    attention: dict[str, Any] | None = None,
    *,
    size: str = "reference",
    steps: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> nn.Module:
    """The cached reference digits ViT (trained and cached on first use)."""
    _check_choice("ViT size", size, VIT_SIZES)
    steps = int(steps or VIT_BUDGETS[size]["steps"])
    path = cache_dir() / cache_key("vit", size, "vit", attention, seed, steps)
    if path.exists() and not force:
        return load_model(path)
    _log(f"training {path.name} (cached afterwards in {path.parent})", progress)
    start = time.time()
    model = train_vit(size, seed, steps, attention=attention, progress=progress)
    train_seconds = time.time() - start
    image_size = model.config.image_size
    acc = top1(model, vit_eval_inputs(image_size), digits_data("heldout", image_size)[1])
    meta = {"kind": "vit", "size": size, "attention": attention, "seed": seed, "steps": steps, "version": VERSION,
            "train_seconds": round(train_seconds, 1), "threads": torch.get_num_threads(), "heldout_top1": acc}
    save_model(model, path, None, meta)
    return model


def cached_meta(model_dir: str | Path) -> dict[str, Any]:
    """Training metadata (time, heldout metric, ...) stored next to a cached model."""
    return json.loads((Path(model_dir) / "meta.json").read_text())
