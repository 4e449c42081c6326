"""Private sentence embeddings under CrypTen: the client's text and the owner's weights stay secret-shared.

    python examples/encrypted_embeddings.py                         # the bundled all-MiniLM-L6-v2, 2 texts
    python examples/encrypted_embeddings.py --model DIR --text FILE # a text encoder folder, one text per line

What `softq mpc run --model DIR --text FILE` does: 2 parties in separate processes on loopback (party 0 holds
the weights, party 1 the token ids and sees the output).  The exact path (softmax, erf GELU) is the default;
--softmax 2quad --gelu quad picks MPCFormer's cheaper surrogates (distil a student for them: softq mpc distill).
"""
import argparse
import copy

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
loaded = hf.load_model_dir(args.model or hf.minilm_dir(), max_length=args.seq_len)
model = loaded.model
if loaded.pooling is not None and getattr(model, "pooler", None) is not None:
    model.pooler = None  # a sentence encoder never reads BERT's pooler: no dense layer and tanh to pay for under MPC
texts = (corpora.read_text_file(args.text, "--text file") if args.text else corpora.text_split("eval"))[:args.texts]
inputs = loaded.tokenize(texts)  # input_ids, attention_mask (token_type_ids): what the client secret-shares

result = softq.mpc.run(model, inputs, softmax=args.softmax, gelu=args.gelu, timeout=600)
hidden = result.outputs[0]  # last_hidden_state, revealed to the client only

plain_model = copy.deepcopy(model)  # the same function in plaintext: same surrogates, no encryption
softq.mpc.configure_surrogates(plain_model, softmax=args.softmax, gelu=args.gelu)
with torch.no_grad():
    plain, exact = plain_model(**inputs).last_hidden_state, model(**inputs).last_hidden_state
mask, mode = inputs["attention_mask"], loaded.pooling or "mean"


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(hf.pool(a, mask, mode), hf.pool(b, mask, mode)).min())


rep = result.report
print(f"{len(texts)} texts x {inputs['input_ids'].shape[1]} tokens, softmax={args.softmax}, GELU={args.gelu}, "
      f"{result.wall_seconds:.0f} s with process start-up")
print(f"embedding cosine to plaintext: min {cosine(hidden, plain):.6f} (to the exact model: {cosine(hidden, exact):.4f})")
print(f"communication: {rep.rounds} rounds, {rep.bytes / 1e6:.1f} MB; modeled {rep.modeled_seconds('lan'):.1f} s "
      f"on a LAN, {rep.modeled_seconds('wan'):.0f} s on a WAN")
