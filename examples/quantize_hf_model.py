"""Quantize a Hugging Face model folder to W8A8, softmax included; save it, load it back, compare with FP32.

    python examples/quantize_hf_model.py                        # the bundled all-MiniLM-L6-v2
    python examples/quantize_hf_model.py --model DIR --out DIR  # any supported folder (BERT, RoBERTa, GPT-2, ViT...)

Prints the cosine of the quantized outputs to FP32 on held-out texts (the sentence embedding of a headless
encoder, the logits of a model with a head), before saving and after loading back.
"""
import argparse
import tempfile

import torch

import softq
from softq import corpora, hf

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", help="Hugging Face model folder (default: the bundled all-MiniLM-L6-v2)")
parser.add_argument("--out", help="folder to save the quantized model in (default: a temporary one)")
parser.add_argument("--texts", type=int, default=132, help="calibration texts (default 132, all built-in ones)")
args = parser.parse_args()

folder = args.model or hf.minilm_dir()
loaded = hf.load_model_dir(folder)  # the model (class from config.json), its tokenizer, its sentence pooling
calib = loaded.batches(corpora.calibration_texts(args.texts), batch_size=16)  # a list of tokenized model inputs
held_out = loaded.batches(corpora.text_split("eval", 64), batch_size=32)  # other texts than the calibration ones

qmodel = softq.quantize(loaded.model, calib, softq.QuantConfig())  # a quantized copy; the float model is untouched
out = softq.save(qmodel, args.out or tempfile.mkdtemp(), overwrite=True, sidecars_from=folder)  # + tokenizer files
reloaded = softq.load(out)  # rebuilt from the saved folder alone, no calibration data needed


@torch.no_grad()
def outputs(model: torch.nn.Module) -> torch.Tensor:
    """One row per text (sentence embedding or logits), or per valid token for token-level logits."""
    if not hasattr(model(**held_out[0]), "logits"):
        return loaded.encode(held_out, model)  # headless encoder: pooled as the sentence-transformers folder says
    rows = []
    for batch in held_out:
        logits = model(**batch).logits
        rows.append(logits[batch["attention_mask"].bool()] if logits.dim() == 3 else logits)
    return torch.cat(rows)


fp32, int8, again = outputs(loaded.model), outputs(qmodel), outputs(reloaded)
cos = torch.nn.functional.cosine_similarity(int8, fp32)
print(f"quantized {folder} ({softq.QuantConfig().describe()}, {args.texts} calibration texts), saved in {out}")
print(f"cosine to FP32 on {len(cos)} held-out rows: mean {cos.mean():.4f} min {cos.min():.4f}")
print(f"loaded back: max |loaded - quantized| {(again - int8).abs().max():.2e}")
