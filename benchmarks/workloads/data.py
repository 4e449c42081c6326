"""Reference data: the pydoc help-topics text (character LM) and scikit-learn's digits (ViT), with
their splits, batches, tokenizer and metrics (perplexity, top-1)."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from softq._files import default_mode
from softq.calib.schedule import progress_bar


HELDOUT_FRACTION = 0.1
DIGITS_SEED = 0


def check_choice(what: str, value: str, choices: Iterable[str]) -> None:
    """One clear ValueError naming ``what`` when ``value`` is not one of ``choices``."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"unknown {what} '{value}'; choose one of {choices}")


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        default_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    check_choice("split", split, ("train", "heldout"))
    train, heldout = char_corpus()
    return torch.tensor(tokenizer.encode(train if split == "train" else heldout), dtype=torch.long)


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
        for inp in progress_bar(inputs, progress, desc="perplexity", leave=False):
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


def digits_data(split: str, image_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(images [N, 1, S, S] float, labels [N] long) of scikit-learn's digits.

    Stratified 80/20 split with a fixed seed; pixels scaled from 0..16 to -1..1;
    the 8x8 images are upsampled bilinearly to ``image_size`` so that with patch 4
    the reference ViT sees 8x8 = 64 tokens.
    """
    check_choice("split", split, ("train", "heldout", "test"))
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
