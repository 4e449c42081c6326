"""The learning-rate schedule and progress bar shared by softq's fine-tunes and the reference training loop."""

from __future__ import annotations

import math
from typing import Any

from tqdm.auto import tqdm


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def progress_bar(iterable: Any, enabled: bool, **kwargs: Any) -> Any:
    """``iterable`` behind a tqdm bar, or bare when ``enabled`` is false."""
    return tqdm(iterable, disable=not enabled, dynamic_ncols=True, **kwargs)
