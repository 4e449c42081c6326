"""The cache of trained reference models: keys, atomic save / load, ``reference_lm`` / ``reference_vit``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from softq._files import atomic_directory, cache_dir
from workloads.data import (CharTokenizer, check_choice, digits_data, lm_eval_inputs, perplexity, top1,
                                  vit_eval_inputs)
from workloads.models import LM_SIZES, VIT_SIZES, build_model, lm_context, variant_name
from workloads.training import LM_BUDGETS, VIT_BUDGETS, train_lm, train_vit


# Bump when the data, model sizes or training recipe change: old cache entries are then ignored.
VERSION = "1"


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
    with atomic_directory(path) as tmp:
        model.config.save_pretrained(tmp)
        torch.save(model.state_dict(), tmp / "weights.pt")
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer.json")
        (tmp / "meta.json").write_text(json.dumps(meta or {}, indent=2, sort_keys=True))
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
    check_choice("LM size", size, LM_SIZES)
    steps = int(steps or LM_BUDGETS[size]["steps"])
    path = cache_dir() / cache_key("lm", size, family, attention, seed, steps)
    if path.exists() and not force:
        return load_model(path), CharTokenizer.load(path / "tokenizer.json")
    _log(f"training {path.name} (cached afterwards in {path.parent})", progress)
    tokenizer = CharTokenizer()
    start = time.time()
    model = train_lm(size, seed, steps, family=family, attention=attention, tokenizer=tokenizer, progress=progress)
    train_seconds = time.time() - start
    ppl = perplexity(model, lm_eval_inputs(lm_context(model.config), None, tokenizer), progress=progress)
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
    check_choice("ViT size", size, VIT_SIZES)
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
