"""Greedy decoding and per-token latency of any decoder ONNX file with past_key_values inputs, in a plain
onnxruntime loop (numpy and onnxruntime only, so any script or virtual environment can call it).

The file's interface is read from the file itself:

* inputs: ``input_ids``, optionally ``attention_mask`` and ``position_ids``, and one input per cached
  tensor whose name contains ``past`` (optimum: ``past_key_values.{i}.key`` / ``.value``);
* outputs: ``logits`` first (or by name), and one output per cached tensor whose name contains ``present``,
  matched to its input by name (``past_key_values`` -> ``present``), else by order.

The cache inputs start empty (length 0 on their sequence axis, the one symbolic axis besides batch), so the
first call is the prefill of the whole prompt and each later call feeds one token and the previous call's
present tensors. Cache tensors keep the element type the file declares (float, float16 or int8 codes).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8,
          "tensor(uint8)": np.uint8, "tensor(int64)": np.int64, "tensor(int32)": np.int32}


@dataclass
class Decode:
    """One greedy run: the new tokens, the prefill's seconds and each decode step's seconds."""

    tokens: list[int]
    prefill_s: float
    step_s: list[float] = field(default_factory=list)

    @property
    def per_token_s(self) -> float:
        """Median seconds of one decode step (one new token fed, its logits and cache out)."""
        return statistics.median(self.step_s)


def session(path: str | Path, threads: int = 1):  # noqa: ANN201 - an onnxruntime.InferenceSession
    """An onnxruntime CPU session with ``threads`` intra-op threads, one inter-op thread, all graph passes."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


class CachedDecoder:
    """The file's inputs and outputs sorted into ids, mask, positions, cache in and cache out."""

    def __init__(self, sess) -> None:  # noqa: ANN001 - an onnxruntime.InferenceSession
        self.sess = sess
        inputs = {i.name: i for i in sess.get_inputs()}
        outputs = [o.name for o in sess.get_outputs()]
        if "input_ids" not in inputs:
            raise ValueError(f"the file has no input_ids input (inputs: {', '.join(inputs)})")
        self.past = [n for n in inputs if "past" in n]
        present = [n for n in outputs if "present" in n]
        if not self.past or len(self.past) != len(present):
            raise ValueError(f"the file has {len(self.past)} past inputs and {len(present)} present outputs; "
                             "a decoder with a cache needs one present output per past input")
        by_name = {n.replace("past_key_values", "present"): n for n in self.past}
        self.cache_map = ({n: by_name[n] for n in present} if set(by_name) == set(present)
                          else dict(zip(present, self.past)))
        self.logits = "logits" if "logits" in outputs else outputs[0]
        self.has_mask = "attention_mask" in inputs
        self.has_positions = "position_ids" in inputs
        self.empty = {}
        for name in self.past:
            info = inputs[name]
            shape = [d if isinstance(d, int) else None for d in info.shape]
            symbolic = [i for i, d in enumerate(shape) if d is None]
            if len(symbolic) < 2 or info.type not in _NUMPY:
                raise ValueError(f"past input {name} has shape {info.shape} and type {info.type}; expected a "
                                 "batch axis and a sequence axis left symbolic, and a numeric type")
            shape[symbolic[0]], shape[symbolic[1]] = 1, 0  # batch 1, an empty cache
            if any(d is None for d in shape):
                raise ValueError(f"past input {name} has more than two symbolic axes ({info.shape})")
            self.empty[name] = np.zeros(shape, dtype=_NUMPY[info.type])
        self.out_names = [self.logits, *self.cache_map]

    def feeds(self, ids: np.ndarray, start: int, cache: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = ids.shape[1]
        feed = {"input_ids": ids.astype(np.int64), **cache}
        if self.has_mask:
            feed["attention_mask"] = np.ones((1, start + n), dtype=np.int64)
        if self.has_positions:
            feed["position_ids"] = np.arange(start, start + n, dtype=np.int64)[None]
        return feed

    def step(self, ids: np.ndarray, start: int, cache: dict[str, np.ndarray]
             ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The last position's logits and the new cache after feeding ``ids`` at positions ``start...``."""
        out = self.sess.run(self.out_names, self.feeds(ids, start, cache))
        return out[0][0, -1], {self.cache_map[name]: value for name, value in zip(self.out_names[1:], out[1:])}


def greedy(path_or_session, prompt_ids, new_tokens: int, threads: int = 1) -> Decode:  # noqa: ANN001
    """Greedy decoding of ``new_tokens`` tokens after ``prompt_ids`` (a sequence of ints), timing each call.

    ``path_or_session``: an ONNX file or an open onnxruntime session (reuse one to time several runs).
    """
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(1, -1)
    if prompt.shape[1] < 1:
        raise ValueError("the prompt is empty")
    sess = path_or_session if hasattr(path_or_session, "run") else session(path_or_session, threads)
    dec = CachedDecoder(sess)
    start = time.perf_counter()
    logits, cache = dec.step(prompt, 0, dict(dec.empty))
    prefill = time.perf_counter() - start
    tokens, steps, pos = [int(np.argmax(logits))], [], prompt.shape[1]
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        logits, cache = dec.step(np.array([[tokens[-1]]]), pos, cache)
        steps.append(time.perf_counter() - start)
        tokens.append(int(np.argmax(logits)))
        pos += 1
    return Decode(tokens, prefill, steps)


def interleaved_decode(paths: dict[str, str | Path], prompt_ids, new_tokens: int, rounds: int,
                       threads: int = 1) -> dict[str, list[Decode]]:
    """``rounds`` greedy runs of every file, interleaved (each round runs every file once, in a rotating
    order), one session per file opened before the first round. Returns each file's runs."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    sessions = {name: session(path, threads) for name, path in paths.items()}
    runs: dict[str, list[Decode]] = {name: [] for name in paths}
    names = list(paths)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(greedy(sessions[name], prompt_ids, new_tokens))
    return runs


def summary(runs: list[Decode]) -> tuple[float, float]:
    """(median per-token decode seconds over the rounds' medians, median prefill seconds)."""
    return (statistics.median(r.per_token_s for r in runs), statistics.median(r.prefill_s for r in runs))
