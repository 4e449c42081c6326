"""A sentence_transformers.SentenceTransformer to W8A8 (softmax included), its embeddings vs FP32, then ONNX.

    python examples/sentence_transformers_int8.py               # the bundled all-MiniLM-L6-v2
    python examples/sentence_transformers_int8.py --model DIR   # any sentence-transformers folder softq computes

softq.quantize takes the SentenceTransformer and plain texts: it returns a copy whose .encode runs the quantized
model.  softq.to_onnx exports it with its pooling and normalisation (output "sentence_embedding").
"""
import argparse
import tempfile
from pathlib import Path

import torch
from sentence_transformers import SentenceTransformer

import softq
from softq import corpora, hf
from softq.export import runtimes

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", help="sentence-transformers folder (default: the bundled all-MiniLM-L6-v2)")
parser.add_argument("--out", help="ONNX file to write (default: in a temporary folder)")
parser.add_argument("--texts", type=int, default=132, help="calibration texts (default 132, all built-in ones)")
args = parser.parse_args()

st = SentenceTransformer(str(args.model or hf.minilm_dir()), device="cpu")
qst = softq.quantize(st, corpora.calibration_texts(args.texts))  # texts are tokenized as st tokenizes them

sentences = corpora.text_split("eval", 64)  # held out: other texts than the calibration ones
fp32 = st.encode(sentences, convert_to_tensor=True)
int8 = qst.encode(sentences, convert_to_tensor=True)
cos = torch.nn.functional.cosine_similarity(int8, fp32)
print(f"{len(sentences)} held-out texts, embedding cosine INT8 to FP32: mean {cos.mean():.4f} min {cos.min():.4f}")
hits = (int8 @ fp32.T).argmax(1) == torch.arange(len(sentences))  # each INT8 embedding finds its own FP32 one
print(f"INT8 query -> FP32 corpus, recall@1: {hits.float().mean():.3f}")

path = args.out or str(Path(tempfile.mkdtemp()) / "sentence_int8.onnx")
path = softq.to_onnx(qst, path, ["an example sentence"], overwrite=True)  # example inputs may be texts
enc = st.tokenizer(sentences[:8], padding=True, truncation=True, max_length=st.max_seq_length, return_tensors="np")
feeds = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
hidden, embedding = runtimes.runner(path, "onnxruntime")(feeds)  # outputs: last_hidden_state, sentence_embedding
onnx = torch.from_numpy(embedding)
to_int8, to_fp32 = (torch.nn.functional.cosine_similarity(onnx, ref[:8]).min() for ref in (int8, fp32))
print(f"wrote {path} ({Path(path).stat().st_size / 1e6:.1f} MB); onnxruntime embedding cosine to "
      f"INT8 .encode: min {to_int8:.6f}, to FP32: min {to_fp32:.4f}")
