"""Fine-tune the activation outliers out of a pretrained encoder, then quantize its residual stream per tensor.

    python examples/outlier_finetune.py                     # the bundled all-MiniLM-L6-v2, 300 steps
    python examples/outlier_finetune.py --model DIR --steps 1200

all-MiniLM-L6-v2 carries |x| = 223 in one hidden dimension at its LayerNorm inputs, which a single 8-bit scale
for the whole residual stream cannot hold.  finetune_outliers distils a copy against the original (embedding
cosine + block outputs) with a penalty on activations above a threshold and a constant [CLS] attention sink;
the measured setting is 1200 steps (about 25 min on one CPU thread, docs/results/outlier_finetune_sink.md).
"""
import argparse

import torch

import softq
from softq import corpora, hf
from softq.calib.diagnostics import collect
from softq.calib.outlier_finetune import OutlierFinetuneConfig, finetune_outliers

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", help="BERT, RoBERTa or DistilBERT encoder folder (default: all-MiniLM-L6-v2)")
parser.add_argument("--steps", type=int, default=300, help="fine-tuning steps of 8 texts (default 300)")
parser.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (default 5e-5, measured on MiniLM)")
parser.add_argument("--texts", type=int, default=132, help="calibration texts (default 132, all built-in ones)")
args = parser.parse_args()

loaded = hf.load_model_dir(args.model or hf.minilm_dir())
config = OutlierFinetuneConfig(steps=args.steps, lr=args.lr)  # constant [CLS] sink, penalty above |x| = 16
result = finetune_outliers(loaded.model, loaded.tokenizer, corpora.text_split("calib"), config)  # unlabeled texts

calib = loaded.batches(corpora.calibration_texts(args.texts), batch_size=16)
held_out = loaded.batches(corpora.text_split("eval", 64), batch_size=32)  # other texts than training and calibration
reference = loaded.encode(held_out)  # the ORIGINAL model in FP32
# one 8-bit scale for the whole residual stream, [CLS] included, no input smoothing (docs/results/outlier_finetune*.md;
# softq's default keeps the residual stream float, or gives [CLS] and outlier dimensions scales of their own)
per_tensor = softq.QuantConfig(quantize_residual=True, residual_groups=1, residual_prefix=0, input_smoothing=None)


def cosine(model: torch.nn.Module) -> str:
    cos = torch.nn.functional.cosine_similarity(loaded.encode(held_out, model), reference)
    return f"mean {cos.mean():.4f} (min {cos.min():.4f})"


print(f"fine-tuned: {config.describe()}\non 64 held-out texts, cosines to the original FP32 model's embeddings:")
for name, model in (("original", loaded.model), ("fine-tuned", result.model)):
    outliers = max(layer.ln_input_inf_norm for layer in collect(model, held_out).layers)
    print(f"{name:>10}: max |LayerNorm input| {outliers:6.1f}; FP32 {cosine(model)}, "
          f"W8A8 per-tensor residual {cosine(softq.quantize(model, calib, per_tensor))}")
