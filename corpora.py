"""Text corpora: the default calibration texts, distillation corpora, held-out evaluation text, text files.

Everything here is text that softq builds or reads without a download, kept apart from :mod:`softq.hf` (a user's
model directory), so that a model directory and the texts it is calibrated, distilled or evaluated on are
separate choices:

* :func:`calibration_texts`: what ``softq quantize DIR`` and ``softq export DIR`` calibrate on by default (Python
  documentation paragraphs and :data:`softq.calib.texts.EVERYDAY_TEXTS`);
* :func:`text_split`: disjoint ``calib`` / ``eval`` paragraphs of Python's documentation (:func:`pydoc_paragraphs`);
* :func:`docstring_paragraphs`, :func:`recombined_windows`, :func:`text_windows`: distillation text;
* :func:`read_text_file`: a user's text file (``--calib``, ``--eval``, ``--text``), one text per line or JSONL.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path


from softq.hf import ModelDirError

# Installed code whose docstrings make the MiniLM distillation corpus (docstring_paragraphs).
DOCSTRING_PACKAGES = ("stdlib", "numpy", "torch", "transformers")
_FIELD_PREFIXES = ("Args", "Arguments", "Parameters", "Returns", "Return", "Raises", "Yields", "Example", "Examples",
                   "Note:", "See Also", "Attributes", "Usage", "Input", "Output", "Shape")


def pydoc_paragraphs(min_chars: int = 200, max_chars: int = 1200) -> list[str]:
    """Prose paragraphs of Python's own documentation (``pydoc_data.topics``), deterministic order."""
    from pydoc_data.topics import topics

    seen: set[str] = set()
    out: list[str] = []
    for name in sorted(topics):
        for block in topics[name].split("\n\n"):
            text = " ".join(block.split())
            if not min_chars <= len(text) <= max_chars or text in seen:
                continue
            if sum(c.isalpha() for c in text) < 0.7 * len(text):  # skip code listings and tables
                continue
            seen.add(text)
            out.append(text)
    return out


def _docstring_blocks(source: str) -> Iterable[str]:
    """Docstrings of a module's source and of its classes and functions (parsed, never imported), in source order."""
    import ast
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


def _source_root(package: str) -> Path:
    import importlib.util
    import sysconfig

    if package == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"docstring source {package!r} is not an installed package (nor 'stdlib')")
    return Path(next(iter(spec.submodule_search_locations)))


_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "testing", "idlelib", "__pycache__", "lib2to3", "_vendor"}


def docstring_paragraphs(packages: Sequence[str] = DOCSTRING_PACKAGES, min_chars: int = 100, max_chars: int = 1200,
                         exclude: Iterable[str] = ()) -> list[str]:
    """Prose paragraphs of the docstrings of installed Python code, deterministic for a given environment.

    ``packages``: installed package names, or ``"stdlib"`` for Python's own library. Every ``.py`` file under each
    (sorted; tests and vendored code skipped) is parsed with :mod:`ast`, never imported; the docstrings of modules,
    classes and functions are split into paragraphs at blank lines, whitespace-normalised and kept when they read
    as prose: ``min_chars``..``max_chars`` long, at least 70% letters, starting with a capital letter, no doctest
    (``>>>``) nor reST/Google field lists. Duplicates are dropped, and so is every paragraph that shares a run of
    12 words with a text in ``exclude`` (e.g. ``text_split("eval")``, so that a held-out set stays held out).
    """
    if not packages:
        raise ValueError("docstring_paragraphs needs at least one package (or 'stdlib')")
    shingle = 12
    banned = set()
    for text in exclude:
        words = text.split()
        banned.update(" ".join(words[i:i + shingle]) for i in range(max(1, len(words) - shingle + 1)))
    seen: set[str] = set()
    out: list[str] = []
    for package in packages:
        root = _source_root(package)
        files = sorted(p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))
        for file in files:
            try:
                source = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            for doc in _docstring_blocks(source):
                for block in doc.split("\n\n"):
                    text = " ".join(block.split())
                    if not min_chars <= len(text) <= max_chars or text in seen or not text[0].isupper():
                        continue
                    if ">>>" in text or "::" in text or text.startswith(_FIELD_PREFIXES):
                        continue
                    if sum(c.isalpha() for c in text) < 0.7 * len(text):
                        continue
                    words = text.split()
                    if any(" ".join(words[i:i + shingle]) in banned for i in range(max(1, len(words) - shingle + 1))):
                        continue
                    seen.add(text)
                    out.append(text)
    if not out:
        raise ValueError(f"no prose docstring paragraphs of {min_chars}..{max_chars} characters in {', '.join(packages)}")
    return out


def recombined_windows(paragraphs: Sequence[str], window: int, count: int, exclude: Iterable[str] = (),
                       seed: int = 0) -> list[str]:
    """``count`` texts of ``window`` words, each made of random sentences of ``paragraphs`` (deterministic for
    ``seed``): the same words in new contexts, for distillation on a small corpus. Sentences of fewer than 4 words
    and every sentence that occurs in a text of ``exclude`` (e.g. ``text_split("eval")``) are left out."""
    import random
    import re

    if window < 1 or count < 1:
        raise ValueError(f"recombined_windows needs window >= 1 and count >= 1, got {window} and {count}")
    held_out = "\n".join(exclude)
    sentences = [x for p in paragraphs for x in re.split(r"(?<=[.!?])\s+(?=[A-Z])", p)
                 if len(x.split()) >= 4 and x not in held_out]
    if not sentences:
        raise ValueError("recombined_windows: no sentence of 4 or more words outside the excluded texts")
    rng, texts = random.Random(seed), []
    while len(texts) < count:
        words: list[str] = []
        while len(words) < window:
            words += rng.choice(sentences).split()
        texts.append(" ".join(words[:window]))
    return texts


def text_windows(paragraphs: list[str], window: int) -> list[str]:
    """Texts of at most ``window`` words: each paragraph cut into consecutive windows (a last piece of fewer
    than 8 words is dropped unless it is the whole paragraph)."""
    out = []
    for paragraph in paragraphs:
        words = paragraph.split()
        out += [" ".join(words[i:i + window]) for i in range(0, len(words), window)
                if len(words[i:i + window]) >= min(8, len(words))]
    return out


def text_split(split: str, n: int | None = None) -> list[str]:
    """Disjoint ``calib`` / ``eval`` paragraphs: every 4th paragraph is calibration, the rest evaluation."""
    paragraphs = pydoc_paragraphs()
    if split == "calib":
        chosen = paragraphs[::4]
    elif split == "eval":
        chosen = [p for i, p in enumerate(paragraphs) if i % 4]
    else:
        raise ValueError(f"split must be 'calib' or 'eval', got {split!r}")
    return chosen[:n] if n is not None else chosen


DEFAULT_CALIB_PARAGRAPHS = 32  # of calibration_texts(): with softq.calib.texts.EVERYDAY_TEXTS' 100, 132 texts


def calibration_texts(n: int | None = None) -> list[str]:
    """The default calibration texts of a model directory: 32 ``calib`` paragraphs of Python's documentation
    (:func:`text_split`, long technical prose) and :data:`softq.calib.texts.EVERYDAY_TEXTS` (short everyday
    English: queries, messages, reviews, news); ``n``: that many, in the same proportion.  Either source alone
    costs accuracy on the other's kind of text (docs/results/calibration_text.md)."""
    from softq.calib.texts import EVERYDAY_TEXTS

    paragraphs, everyday = text_split("calib", DEFAULT_CALIB_PARAGRAPHS), list(EVERYDAY_TEXTS)
    if n is not None and not 1 <= n <= len(paragraphs) + len(everyday):
        raise ValueError(f"the built-in calibration set has {len(paragraphs) + len(everyday)} texts, {n} asked for: "
                         "give your own texts for more (softq quantize/export --calib FILE)")
    if n is not None:
        k = round(n * len(paragraphs) / (len(paragraphs) + len(everyday)))
        paragraphs, everyday = paragraphs[:k], everyday[:n - k]
    return paragraphs + everyday  # by source: batches of like lengths, little padding


def read_text_file(path: str | os.PathLike, what: str = "calibration file") -> list[str]:
    """Texts from a file: one text per line, or JSONL with a ``text`` field per line (``what`` names the file in errors)."""
    path = Path(path)
    if path.is_dir():
        raise ModelDirError(f"{what} {path} is a directory, not a text file")
    if not path.is_file():
        raise ModelDirError(f"{what} {path} does not exist")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ModelDirError(f"{what} {path} is not UTF-8 text (byte {err.start})") from None
    lines = [line.strip() for line in raw.splitlines() if line.strip()]
    if not lines:
        raise ModelDirError(f"{what} {path} is empty")
    if path.suffix == ".jsonl" or all(line.startswith("{") for line in lines):
        texts = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ModelDirError(f"{path}:{number}: not a JSON object") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ModelDirError(f"{path}:{number}: JSONL records need a string field 'text'")
            texts.append(record["text"])
        lines = [t for t in texts if t.strip()]
        if not lines:
            raise ModelDirError(f"{what} {path} has no non-empty 'text'")
    return lines
