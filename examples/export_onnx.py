"""Quantize a Hugging Face model folder, export it to ONNX with an integer softmax, run the file in three runtimes.

    python examples/export_onnx.py                               # the bundled all-MiniLM-L6-v2
    python examples/export_onnx.py --model DIR --out model.onnx

The file holds int8 weights and codes (MatMulInteger, integer P.V) in standard ONNX ops; onnxruntime, tract
and OpenVINO run it through one interface (softq.export.runtimes.runner).  Each runtime's output (the sentence
embedding of a sentence-transformers folder) is compared with the quantized torch model's on held-out texts.
"""
import argparse
import tempfile
from pathlib import Path

import torch

import softq
from softq import corpora, hf
from softq.export import runtimes

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", help="Hugging Face model folder (default: the bundled all-MiniLM-L6-v2)")
parser.add_argument("--out", help="ONNX file to write (default: in a temporary folder)")
parser.add_argument("--texts", type=int, default=132, help="calibration texts (default 132, all built-in ones)")
args = parser.parse_args()

loaded = hf.load_model_dir(args.model or hf.minilm_dir())
calib = loaded.batches(corpora.calibration_texts(args.texts), batch_size=16)
qmodel = softq.quantize(loaded.model, calib, softq.QuantConfig())

path = args.out or str(Path(tempfile.mkdtemp()) / "model_int8.onnx")
# example inputs fix nothing but the input names (batch and sequence length stay dynamic); a sentence-transformers
# folder's pooling adds a "sentence_embedding" output after the model's own
path = softq.to_onnx(qmodel, path, calib[0], overwrite=True, pooling=loaded.pooling, normalize=loaded.normalize)
print(f"wrote {path} ({Path(path).stat().st_size / 1e6:.1f} MB)")

batch = loaded.tokenize(corpora.text_split("eval", 8))  # padded: the file masks pad keys as the torch model does
with torch.no_grad():
    out = qmodel(**batch)
mask = batch["attention_mask"]
if loaded.pooling:  # compare the file's last output, the sentence embedding
    reference = hf.pool(out.last_hidden_state, mask, loaded.pooling, loaded.normalize)
else:  # its only output: logits of a model with a head, else the hidden states, on the valid tokens
    reference = out.logits if hasattr(out, "logits") else out.last_hidden_state
valid = mask.bool() if reference.dim() == 3 else slice(None)
feeds = {name: tensor.numpy() for name, tensor in batch.items()}

for name in runtimes.RUNTIMES:
    if not runtimes.available(name):
        print(f"{name}: not installed (pip install {name})")
        continue
    got = torch.from_numpy(runtimes.runner(path, name)(feeds)[-1])  # a list of outputs, in the file's order
    err = (got - reference)[valid].abs().max() / reference[valid].abs().max()
    cos = torch.nn.functional.cosine_similarity(got[valid], reference[valid])
    print(f"{name}: max |{name} - torch| / max |torch| {err:.1e}, min cosine to torch {cos.min():.6f}")
