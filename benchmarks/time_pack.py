"""Time the export-speed benchmark's ONNX files on another machine, without shipping their weights.

``python benchmarks/bench_export_speed.py --pack DIR`` exports and measures accuracy and size where softq runs,
then writes a *pack*: every variant's ONNX file with its large tensors stripped (:func:`strip`), the latency
inputs, and the accuracy/size results. A BERT-base pack is a few MB instead of 1.4 GB. This script needs only
numpy, onnx and onnxruntime (and softq's ``export/onnx_utils.py`` for the session options) on the machine that
times it. It refills the stripped tensors (:func:`refill`), times the files as bench_export_speed.py does, and
writes the same table::

    python benchmarks/time_pack.py DIR --threads 1,4,16 --batches 1,8 --output docs/results/export_speed_host.md

Why the refill does not change the timing: the graph, its types and shapes and every small tensor (scales, zero
points, biases, LayerNorm parameters, shape constants, the scalars onnxruntime's fusions check) are kept. Only
the values of tensors of at least ``min_bytes`` are redrawn: the weights and embedding tables. Float tensors
are drawn from a normal with the tensor's own mean and standard deviation. 8-bit codes (and any tensor with at
most 256 distinct values) are drawn from the tensor's own value histogram, so codes stay in the range the file
was exported with. onnxruntime's CPU kernels for these operators do not branch on values. The pack checks this
claim where it is made: on the packing machine it times each variant with real and with refilled weights,
interleaved. time_pack.py reports that check beside its own table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import (MODELS, VARIANTS, command_line, cpu_description, int_list, interleaved,  # noqa: E402
                       table_lines, timing_sentence, variants_paragraph, write_atomic)

MARK = "softq.time_pack refill "
# 64 KiB: every weight matrix and embedding table of the benchmark's four models (MiniLM's 384 x 384 int8: 144 KiB),
# no scale or bias (BERT-base's widest: 3072 floats, 12 KiB)
MIN_BYTES = 1 << 16
FORMAT = 1


def _tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """The graph's constant tensors: initializers and Constant nodes' values (softq writes its weights as those)."""
    yield from model.graph.initializer
    for node in model.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    yield a.t


def strip(model: onnx.ModelProto, min_bytes: int = MIN_BYTES) -> onnx.ModelProto:
    """A copy of ``model`` whose constant tensors (initializers, Constant nodes) of at least ``min_bytes`` keep
    their name, type and shape and carry, instead of their values, a description to draw new ones from (in the
    tensor's doc_string)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in _tensors(out):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            raise ValueError(f"tensor {t.name!r} is stored outside the file; load the model with its data first")
        arr = numpy_helper.to_array(t)
        if arr.nbytes < min_bytes or arr.dtype.kind not in "fiu":
            continue
        if arr.dtype.itemsize == 1:
            counts = np.bincount(arr.view(np.uint8).ravel(), minlength=256)
            values = np.flatnonzero(counts).astype(np.uint8).view(arr.dtype)
            desc = {"kind": "histogram", "values": values.tolist(), "counts": counts[counts > 0].tolist()}
        else:
            few = len(np.unique(arr.ravel()[:1 << 16])) <= 256  # a sample first: sorting a weight matrix is slow
            if few and len(np.unique(arr)) <= 256:
                values, counts = np.unique(arr, return_counts=True)
                desc = {"kind": "histogram", "values": values.tolist(), "counts": counts.tolist()}
            elif arr.dtype.kind == "f" and np.isfinite(arr).all():
                desc = {"kind": "normal", "mean": float(arr.mean(dtype=np.float64)),
                        "std": float(arr.std(dtype=np.float64))}
            else:
                continue  # keep it: no description that would not change what the graph computes on it
        name, dims, dtype = t.name, list(t.dims), t.data_type
        t.Clear()
        t.name, t.data_type = name, dtype
        t.dims.extend(dims)
        t.doc_string = MARK + json.dumps(desc)
    return out


def refill(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """``model`` (changed in place and returned) with every stripped tensor's values drawn again."""
    rng = np.random.default_rng(seed)
    for t in _tensors(model):
        if not t.doc_string.startswith(MARK):
            continue
        desc = json.loads(t.doc_string[len(MARK):])
        dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        shape = tuple(t.dims)
        if desc["kind"] == "normal":
            arr = (rng.standard_normal(shape, dtype=np.float32) * desc["std"] + desc["mean"]).astype(dtype)
        else:
            cdf = np.cumsum(np.asarray(desc["counts"], np.float64))
            index = np.searchsorted(cdf, rng.random(shape) * cdf[-1], side="right")
            arr = np.asarray(desc["values"], dtype)[np.minimum(index, len(cdf) - 1)]
        t.raw_data = np.ascontiguousarray(arr).tobytes()
        t.doc_string = ""
    return model


# --------------------------------------------------------------------------- the pack


def write_pack(directory: Path, results: list[dict], files: dict[str, dict[str, Path]],
               feeds: dict[str, dict[int, dict[str, np.ndarray]]], meta: dict) -> Path:
    """Write the pack atomically (a directory: the old one or the new one, never half of one)."""
    from softq._files import atomic_directory

    with atomic_directory(directory) as tmp:
        index: dict[str, dict[str, str]] = {}
        for model, paths in files.items():
            (tmp / model).mkdir()
            index[model] = {}
            for variant, path in paths.items():
                name = f"{model}/{Path(path).name}"
                onnx.save_model(strip(onnx.load(str(path))), str(tmp / name))
                index[model][variant] = name
            for size, feed in feeds[model].items():
                np.savez(tmp / model / f"feeds_b{size}.npz", **feed)
        pack = dict(meta, format=FORMAT, results=results, files=index,
                    batches={m: sorted(f) for m, f in feeds.items()})
        (tmp / "pack.json").write_text(json.dumps(pack, indent=1))
    return directory


def read_pack(directory: Path) -> dict:
    path = directory / "pack.json"
    if not path.is_file():
        raise SystemExit(f"error: {directory} is not a pack (no pack.json); write one with "
                         "`python benchmarks/bench_export_speed.py --pack DIR`")
    pack = json.loads(path.read_text())
    if pack.get("format") != FORMAT:
        raise SystemExit(f"error: {path} has pack format {pack.get('format')}, this script reads {FORMAT}")
    return pack


def load_feeds(directory: Path, model: str, size: int) -> dict[str, np.ndarray]:
    with np.load(directory / model / f"feeds_b{size}.npz") as f:
        return {k: f[k] for k in f.files}


def refilled_files(directory: Path, pack: dict, model: str, workdir: Path) -> dict[str, Path]:
    """Each variant's file with its weights drawn again, written to ``workdir``."""
    out = {}
    for variant, name in pack["files"][model].items():
        m = onnx.load(str(directory / name))
        path = workdir / Path(name).name
        onnx.save_model(refill(m), str(path))
        out[variant] = path
    return out


def session(path: Path, threads: int) -> ort.InferenceSession:
    from softq.export.onnx_utils import session as softq_session

    return softq_session(path, "all", threads=threads)


def time_model(paths: dict[str, Path], feeds: dict[int, dict[str, np.ndarray]], threads: list[int],
               rounds: int, rounds_large: int, label: str, min_seconds: float = 0.0
               ) -> tuple[dict[tuple[int, int], dict[str, float]], dict[str, bool]]:
    """Seconds per call of every variant, interleaved, per (threads, batch) cell; and whether each variant's
    outputs are finite (first thread count's sessions, first batch's inputs)."""
    lat, finite = {}, {}
    for t in threads:
        sessions = {v: session(p, t) for v, p in paths.items()}
        if not finite:
            feed = next(iter(feeds.values()))
            finite = {v: bool(all(np.isfinite(o).all() for o in s.run(None, feed))) for v, s in sessions.items()}
        for size, feed in feeds.items():
            lat[(t, size)] = interleaved({v: (lambda s=s: s.run(None, feed)) for v, s in sessions.items()},
                                         rounds_large if size > 1 else rounds, min_seconds)
            print(f"[{label}] {t} thread(s), batch {size}: "
                  + ", ".join(f"{v} {1e3 * x:.1f} ms" for v, x in lat[(t, size)].items()), file=sys.stderr, flush=True)
    return lat, finite


def refill_check_lines(results: list[dict]) -> list[str]:
    """The packing machine's check that refilled weights time like the real ones (ratios to FP32 both ways)."""
    lines = ["| model | variant | real weights: time / FP32 | refilled: time / FP32 | refilled / real time |",
             "|---|---|---|---|---|"]
    for r in results:
        c = r.get("refill_check")
        if not c:
            continue
        for v in [v for v in VARIANTS if v in c["real"]]:
            real, new = c["real"][v] / c["real"]["FP32"], c["refilled"][v] / c["refilled"]["FP32"]
            lines.append(f"| {r['name']} | {v} | {real:.2f} | {new:.2f} | {c['refilled'][v] / c['real'][v]:.2f} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pack", type=Path, help="a directory written by bench_export_speed.py --pack")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of the pack's models")
    p.add_argument("--threads", type=int_list, default="1,2")
    p.add_argument("--batches", type=int_list, default="1,8", help="batch sizes (the pack holds inputs for the ones it was packed with)")
    p.add_argument("--rounds", type=int, default=7, help="timed runs per variant at batch 1")
    p.add_argument("--rounds-large", type=int, default=3, help="timed runs per variant at larger batches")
    p.add_argument("--min-seconds", type=float, default=30.0,
                   help="time each cell for at least this long, adding rounds (default 30, as bench_export_speed.py)")
    p.add_argument("--output", type=Path, required=True, help="the results file to write")
    args = p.parse_args()
    pack = read_pack(args.pack)
    models = [m for m in args.models.split(",") if m]
    missing = [m for m in models if m not in pack["files"]]
    if missing:
        print(f"skipping {missing}: not in the pack (it holds {list(pack['files'])})", file=sys.stderr)
    models = [m for m in models if m in pack["files"]]
    threads, batches = args.threads, args.batches
    for m in models:
        if set(batches) - set(pack["batches"][m]):
            raise SystemExit(f"error: the pack has {m} inputs for batches {pack['batches'][m]}, not {batches}; pass "
                             "--batches from those, or write the pack again with the batches wanted")
    start = time.perf_counter()
    by_name = {r["name"]: r for r in pack["results"]}
    results, finite = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in models:
            t0 = time.perf_counter()
            paths = refilled_files(args.pack, pack, m, Path(tmp))
            print(f"[{m}] refilled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            feeds = {b: load_feeds(args.pack, m, b) for b in batches}
            r = dict(by_name[m])
            r["latency"], finite[m] = time_model(paths, feeds, threads, args.rounds, args.rounds_large, m,
                                                 args.min_seconds)
            results.append(r)
            for path in paths.values():
                path.unlink()
            write(results, finite, pack, args, threads, batches, (time.perf_counter() - start) / 60)
    print(args.output)


def write(results: list[dict], finite: dict[str, dict[str, bool]], pack: dict, args: argparse.Namespace,
          threads: list[int], batches: list[int], minutes: float) -> None:
    cells = [(t, s) for t in threads for s in batches]
    not_finite = [f"{m}: {v}" for m, f in finite.items() for v, ok in f.items() if not ok]
    lines = [
        "# INT8 ONNX speed on another machine's CPU, from a pack of the benchmark's files",
        "",
        "Generated by `benchmarks/time_pack.py`; do not edit by hand. Commands: the pack was written where softq ran,",
        "",
        f"    {pack['command']}",
        "",
        "(accuracy, distance and size columns: measured there on the real files, "
        f"{pack['machine']}; onnxruntime {pack['onnxruntime']}, torch {pack['torch']}; softq {pack['commit']}), "
        "and timed here with",
        "",
        f"    {command_line()}",
        "",
        f"Timing machine: {cpu_description()}; onnxruntime {ort.__version__}, numpy {np.__version__}. Graph "
        "optimisation ORT_ENABLE_ALL; session options as softq's `export.onnx_utils.session` sets them. "
        + timing_sentence(args.rounds, args.rounds_large, args.min_seconds) + f" Took {minutes:.0f} min.",
        "",
        "The files timed here are the packed files with their large tensors (weights, embedding tables) drawn "
        "again from each tensor's own value distribution (`benchmarks/time_pack.py`, `refill`): same graphs, "
        "types, shapes, scales, zero points and biases; the kernels' time does not depend on the values. The "
        "packing machine's check of that claim is the last table. Their outputs were "
        + ("finite for every file." if not not_finite else f"not finite for {', '.join(not_finite)} (the timing "
           "stands; their values mean nothing)."),
        "",
        variants_paragraph(pack["calib_batches"]),
        "",
    ]
    lines += table_lines(results, cells, others=False)
    packed_bad = [f"{r['name']}: {v}" for r in results for v, ok in (r.get("refill_check") or {}).get("finite", {}).items()
                  if not ok]
    lines += ["## The refill check (packing machine, 1 thread, batch 1)", "",
              "Each variant timed with its real weights and with refilled ones, all interleaved in one run. The "
              "refilled files' outputs there were " + ("finite for every file." if not packed_bad else
                                                        f"not finite for {', '.join(packed_bad)}."), ""]
    lines += refill_check_lines(results) + [""]
    write_atomic(args.output, "\n".join(lines))


if __name__ == "__main__":
    main()
