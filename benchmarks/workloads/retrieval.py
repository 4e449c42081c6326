"""Half-paragraph retrieval, the benchmarks' metric of sentence embeddings: each paragraph's first half must find
its own second half among all second halves."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def halves(texts: Sequence[str]) -> tuple[list[str], list[str]]:
    """First and second half (by words) of each paragraph: the queries and the corpus of retrieval."""
    first, second = [], []
    for text in texts:
        words = text.split()
        mid = len(words) // 2
        first.append(" ".join(words[:mid]))
        second.append(" ".join(words[mid:]))
    return first, second


def recall_at_1(queries: torch.Tensor, corpus: torch.Tensor) -> float:
    """Fraction of queries whose most cosine-similar corpus entry is their own other half."""
    q = nn.functional.normalize(queries.float(), dim=-1)
    c = nn.functional.normalize(corpus.float(), dim=-1)
    hits = (q @ c.T).argmax(dim=1) == torch.arange(len(q))
    return hits.float().mean().item()
