"""docs/results/llm_scale.md: the LLM-scale tables in one page, each with the command that produced it.

    python benchmarks/llm_scale.py

Each section is copied, unchanged but for its heading level, from the results file its own benchmark wrote
(they take from minutes to half an hour each, so they run separately; rerun one and then this script):

* calibration memory, block by block at 1.1B parameters, and against the whole model at 4 layers:
  ``bench_llm_memory.py``;
* decoder ONNX files with a KV cache: greedy tokens and decode latency per token: ``bench_generate.py``;
* the INT8 KV cache: perplexity at context 1024 and cache bytes: ``bench_kv_cache.py``;
* the peers, llm-compressor's W8A8 and optimum's KV-cache export with ``quantize_dynamic``: ``bench_llm_peers.py``.

A section whose file is missing says so and names the command that writes it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import command_line, write_atomic  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
# (results file, the question it answers, the benchmark that writes it)
SECTIONS = (
    ("llm_memory.md", "Calibration memory: does a decoder quantize in one block's memory?", "bench_llm_memory.py"),
    ("llm_memory_4layers.md", "Calibration memory at 4 layers: block by block against the whole model",
     "bench_llm_memory.py --layers 4 --variants blocks,model --output docs/results/llm_memory_4layers.md"),
    ("generate.md", "Generation from the ONNX file with a KV cache: the same tokens, and how fast per token?",
     "bench_generate.py"),
    ("kv_cache.md", "INT8 KV cache: how many bytes, and what does it cost in perplexity?", "bench_kv_cache.py"),
    ("llm_offload.md", "Models larger than memory: a model offloaded to disk by accelerate",
     "bench_llm_offload.py --repeats 3"),
    ("kv_scales_export.md", "Per-head and per-channel K/V scales in the exported file", "bench_kv_scales_export.py"),
    ("cache_runtimes.md", "Cached decoder files in tract and OpenVINO", "bench_cache_runtimes.py"),
    ("llm_peers.md", "Against llm-compressor and optimum", "bench_llm_peers.py"),
)


def section(name: str, question: str, script: str) -> str:
    """One results file under a second-level heading: its own title becomes a line, its headings go one level down."""
    path = RESULTS / name
    if not path.exists():
        return f"## {question}\n\nNot measured yet: run `python benchmarks/{script}` (writes {name}), then this script.\n"
    lines = path.read_text().splitlines()
    title = re.sub(r"^#\s+", "", lines[0]) if lines and lines[0].startswith("# ") else name
    body = [("#" + line) if line.startswith("#") else line for line in lines[1:]]
    return f"## {question}\n\nFrom [{name}]({name}): {title}.\n" + "\n".join(body).rstrip() + "\n"


def main() -> None:
    parts = [
        "# LLM scale: block-by-block calibration, KV-cache ONNX and generation, INT8 KV cache, peers (generated)\n",
        f"Command: `{command_line()}` (assembles the files below; each section keeps its own command)\n",
    ]
    parts += [section(*entry) for entry in SECTIONS]
    write_atomic(RESULTS / "llm_scale.md", "\n".join(parts))
    print(f"wrote {RESULTS / 'llm_scale.md'}")


if __name__ == "__main__":
    main()
