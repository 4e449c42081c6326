"""Private sentence embeddings under CrypTen: the client's text and the owner's weights stay secret-shared.

    python examples/encrypted_embeddings.py                         # the bundled all-MiniLM-L6-v2, 2 texts
    python examples/encrypted_embeddings.py --model DIR --text FILE # a text encoder folder, one text per line

What `softq mpc run --model DIR --text FILE` does: 2 parties in separate processes on loopback (party 0 holds
the weights, party 1 the token ids and sees the output).  The exact path (softmax, erf GELU) is the default;
--softmax 2quad --gelu quad picks MPCFormer's cheaper surrogates (distil a student for them: softq mpc distill).
"""
import argparse

import torch

import softq.mpc
from softq import corpora, hf

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", help="headless text encoder folder (default: the bundled all-MiniLM-L6-v2)")
parser.add_argument("--text", help="texts to embed, one per line (default: --texts paragraphs of Python's docs)")
parser.add_argument("--texts", type=int, default=2, help="how many texts (default 2)")
parser.add_argument("--seq-len", type=int, default=32, help="tokens per text (default 32)")
parser.add_argument("--softmax", default="softmax", help="softmax under MPC: softmax (exact), 2quad, ...")
parser.add_argument("--gelu", default="erf", help="GELU under MPC: erf (exact), tanh, quad, relu")
args = parser.parse_args()

torch.set_num_threads(1)
texts = (corpora.read_text_file(args.text, "--text file") if args.text else corpora.text_split("eval"))[:args.texts]
# the folder's model and tokenizer; the client secret-shares the token ids, the owner the weights
private = softq.mpc.embed_texts(args.model or hf.minilm_dir(), texts, softmax=args.softmax, gelu=args.gelu,
                                max_length=args.seq_len, timeout=600)
summary, report = private.summary, private.result.report
print(f"{summary['texts']} texts, {summary['tokens']} tokens, softmax={args.softmax}, GELU={args.gelu}, "
      f"{summary['wall_seconds']:.0f} s with process start-up")
# against the same model and surrogates in plaintext: what encryption costs; against the exact model: the surrogates
print(f"embedding cosine to plaintext: min {summary['min_cosine_to_plaintext']:.6f} "
      f"(to the exact model: {summary['min_cosine_to_model']:.4f})")
print(f"communication: {report.rounds} rounds, {report.bytes / 1e6:.1f} MB; modeled {report.modeled_seconds('lan'):.1f} "
      f"s on a LAN, {report.modeled_seconds('wan'):.0f} s on a WAN")
