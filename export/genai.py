"""onnxruntime-genai's ``genai_config.json`` for a decoder file with a KV cache, so that its generator runs the file.

onnxruntime-genai runs any decoder graph whose inputs and outputs its config names: softq's cached file
(:mod:`softq.export.cache_layout`: ``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.%d.key``
... -> ``logits``, ``present.%d.key`` ...) needs no GroupQueryAttention or other contrib op, only the config.  The
cache is past-and-present (``past_present_share_buffer: false``): each step's present, one token longer, is the next
past, as softq's file computes it; an int8 cache runs as it is (the generator allocates the cache tensors with
the element type the file declares: the same greedy tokens as softq's loop, tests/test_export_cache.py).  Layers, heads and sizes are read from the file itself; the model type and the
special tokens from the model's Hugging Face config (onnxruntime-genai accepts the decoder types it knows:
llama, mistral, qwen2, phi3, gemma2...).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from softq._files import atomic_file
from softq.export.cache_layout import INPUTS, LOGITS, PARTS, PAST, PRESENT, CacheLayout

CONFIG_NAME = "genai_config.json"


def genai_config(path: str | os.PathLike, hf_config: Any) -> dict[str, Any]:
    """The config for the cached file at ``path`` of a model with Hugging Face config ``hf_config``."""
    from softq.export import onnx_utils

    session = onnx_utils.session(str(path))
    layout = CacheLayout.of_inputs(session.get_inputs())
    vocab = session.get_outputs()[0].shape[-1]
    heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
    hidden = int(getattr(hf_config, "hidden_size", 0) or 0)
    eos = getattr(hf_config, "eos_token_id", None)
    eos = [] if eos is None else [int(t) for t in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
    # a model without an end-of-sequence token (a character LM) gets an empty list: generation stops at max_length
    special: dict[str, Any] = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    for key in ("bos_token_id", "pad_token_id"):
        value = getattr(hf_config, key, None)
        special[key] = int(value) if isinstance(value, int) else eos[0] if eos else 0
    from softq.models import max_tokens

    return {
        "model": {
            **special,
            "context_length": int(max_tokens(hf_config) or 2048),
            "type": str(hf_config.model_type),
            "vocab_size": int(vocab) if isinstance(vocab, int) else int(hf_config.vocab_size),
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": Path(path).name,
                "head_size": layout.key_dim,
                "hidden_size": hidden or heads * layout.key_dim,
                "num_attention_heads": heads or layout.kv_heads,
                "num_hidden_layers": layout.layers,
                "num_key_value_heads": layout.kv_heads,
                "inputs": {**{n: n for n in INPUTS}, "past_key_names": PAST.format(layer="%d", part=PARTS[0]),
                           "past_value_names": PAST.format(layer="%d", part=PARTS[1])},
                "outputs": {"logits": LOGITS, "present_key_names": PRESENT.format(layer="%d", part=PARTS[0]),
                            "present_value_names": PRESENT.format(layer="%d", part=PARTS[1])},
            },
        },
        "search": {"do_sample": False, "max_length": int(max_tokens(hf_config) or 2048), "min_length": 0,
                   "num_beams": 1, "num_return_sequences": 1, "past_present_share_buffer": False,
                   "temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0},
    }


def write_genai_config(path: str | os.PathLike, hf_config: Any) -> Path:
    """Write ``genai_config.json`` beside the cached file at ``path`` (atomically); returns its path.  The folder
    then opens with ``onnxruntime_genai.Model(folder)``."""
    from softq.export.onnx_utils import check_writable

    target = Path(path).parent / CONFIG_NAME
    check_writable(target, overwrite=True)
    text = json.dumps(genai_config(path, hf_config), indent=2) + "\n"
    with atomic_file(target) as f:
        f.write(text)
    return target
