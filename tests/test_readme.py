"""README.md is a reader's page that cannot rot: its Python blocks run verbatim, in order, as one script; its
links resolve; its support matrix is the generated one; it stays short."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MATRIX = ("<!-- support-matrix:start -->", "<!-- support-matrix:end -->")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None, reason="needs the minilm extra")
def test_readme_python_blocks_run_verbatim(tmp_path) -> None:
    blocks = python_blocks(README)
    assert len(blocks) >= 3 and "softq.quantize" in blocks[0] and "softq.to_onnx" in blocks[0]
    encrypted = importlib.util.find_spec("crypten") is not None  # the mpc extra; without it, the quickstart alone
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks if encrypted else blocks[:1]))
    env = {**os.environ, "TQDM_DISABLE": "1"}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    cosine = float(re.search(r"INT8 ONNX vs FP32 cosine: ([0-9.]+)", out.stdout).group(1))
    assert cosine > 0.99, out.stdout  # the quickstart's file computes the model
    assert (tmp_path / "minilm-int8.onnx").is_file() and (tmp_path / "minilm-int8" / "model.pt").is_file()
    if encrypted:
        private = float(re.search(r"cosine to plaintext: ([0-9.]+)", out.stdout).group(1))
        assert private > 0.9999 and re.search(r"TOTAL\s+\d+", out.stdout), out.stdout  # the encrypted block ran


def test_readme_is_a_short_page_without_history() -> None:
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    assert len(README.splitlines()) <= 250 and len(prose.split()) <= 2500
    text = "\n".join(line for line in prose.splitlines() if not line.startswith(("|", "<!--")))  # tables: cells
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    assert max(len(p.split()) for p in paragraphs) <= 120
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", README), "dates go to CHANGELOG.md"
    assert not re.search(r"\b(at|commit) [0-9a-f]{7,40}\b", README), "commit hashes go to CHANGELOG.md"
    assert not re.search(r"\b[Ii]ssue \d+|\bsession \d+", README)


def test_readme_links_resolve() -> None:
    for target in re.findall(r"\]\(([^)#\s]+)", README):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), target


def test_readme_support_matrix_is_the_generated_one() -> None:
    """No hand-written ticks: README's matrix is what benchmarks/support_matrix.py wrote to docs/results."""
    block = README.split(MATRIX[0])[1].split(MATRIX[1])[0]
    generated = (ROOT / "docs/results/support_matrix.md").read_text(encoding="utf-8")
    rows = [line for line in block.splitlines() if line.startswith("|")]
    assert len(rows) >= 12 and all(row in generated.splitlines() for row in rows)
