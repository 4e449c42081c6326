"""softq.mpc on today's families: exact-path error per family, and the cost of a tiny Llama vs a tiny BERT.

    python benchmarks/bench_mpc_families.py [--seq 16] [--hidden 64]

1. Exact path (exact softmax, the model's own GELU / SiLU, RMSNorm / LayerNorm) of tiny models built from
   configs (weights at trained-model scale, initializer_range 0.2), 2 sequences with padding, in a 1-party
   CrypTen in this process (the same fixed-point arithmetic as the parties): relative error
   ``||enc - plain|| / ||plain||`` over the valid tokens, as tests/test_mpc.py measures it.
2. One forward of a tiny Llama (GQA, RoPE, RMSNorm, SwiGLU) and of a tiny BERT of the same configured size
   (hidden, layers, heads, intermediate, vocabulary, sequence) in 2 real parties (separate processes, gloo on
   loopback, exact truncation): rounds and bytes from CrypTen's communicator (party 0: the total on the
   wire), per op kind, on the exact path and on MPCFormer's surrogates (2Quad, Quad; not distilled, so that
   path runs weights of Hugging Face's initial scale 0.02, inside the 2Quad division's brackets).  BERT keeps its
   pooler (a 64 x 64 dense and tanh: the "tanh" row); Llama has its LM head (64 x 64) instead.

Writes docs/results/mpc_families.md (atomically) with this command at the top.
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import sys
from pathlib import Path

import torch
import transformers as T

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "mpc_families.md"


def configs(hidden: int, init: float = 0.2) -> dict[str, object]:
    small = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                 initializer_range=init)
    dec = dict(vocab_size=64, num_key_value_heads=2, max_position_embeddings=128, **small)
    return {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**dec)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**dec)),
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(head_dim=hidden // 4, **dec)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(sliding_window=8, **dec)),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(pad_token_id=0, **dec)),
        "gemma2 (softcap 50)": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(head_dim=hidden // 4, sliding_window=8,
                                                                          **dec)),
        "modernbert": lambda: T.ModernBertModel(T.ModernBertConfig(
            vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3, num_attention_heads=4,
            global_attn_every_n_layers=2, local_attention=8, max_position_embeddings=128, pad_token_id=0,
            cls_token_id=1, sep_token_id=2, bos_token_id=None, eos_token_id=None, initializer_range=0.2)),
        "t5-encoder": lambda: T.T5EncoderModel(T.T5Config(vocab_size=64, d_model=hidden, d_kv=hidden // 4,
                                                          d_ff=2 * hidden, num_layers=2, num_heads=4,
                                                          relative_attention_num_buckets=8)),
        "bert": lambda: T.BertModel(T.BertConfig(vocab_size=64, max_position_embeddings=128, **small)),
    }


def text_inputs(seq: int, batch: int = 2) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 64, (batch, seq), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[-1, seq - 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def exact_path_errors(builders: dict[str, object], seq: int) -> list[str]:
    from softq.mpc.graph import GraphInterpreter, SecretOneHot, export_model
    from softq.mpc.party import configure_crypten
    from softq.mpc.runner import free_port
    from softq.mpc.surrogates import configure_surrogates

    os.environ.setdefault("RENDEZVOUS", f"tcp://127.0.0.1:{free_port()}")
    crypten = configure_crypten("TFP")
    crypten.init()
    rows = ["| family | what it exercises | relative error (exact path) |", "|---|---|---|"]
    what = {"llama": "GQA, RoPE, RMSNorm, SwiGLU", "qwen2": "GQA, RoPE, RMSNorm, SwiGLU, q/k/v biases",
            "qwen3": "as Qwen2 + per-head q/k RMSNorm", "mistral": "sliding window 8", "phi3": "fused qkv, RoPE",
            "gemma2 (softcap 50)": "attention logit soft-capping", "modernbert": "GeGLU, RoPE, local/global, no biases",
            "t5-encoder": "relative position bias (keyword), RMSNorm, no scaling", "bert": "(reference)"}
    x = text_inputs(seq)
    for name, build in builders.items():
        torch.manual_seed(0)
        model = build().eval()
        try:
            configure_surrogates(model, softmax="softmax", gelu=None)
            with torch.no_grad():
                out = model(**x)
            plain = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
            ep = export_model(model, x)
            interp = GraphInterpreter(ep)
            params = {n: crypten.cryptensor(ep.state_dict[n].float()) for n in interp.parameter_names()}
            onehot = torch.nn.functional.one_hot(x["input_ids"], model.get_input_embeddings().weight.shape[0]).float()
            secret = {**x, "input_ids": SecretOneHot(crypten.cryptensor(onehot), tuple(x["input_ids"].shape))}
            with crypten.no_grad():
                enc = interp.run(params, secret)[0].get_plain_text()
            valid = x["attention_mask"].bool()
            err = f"{float((enc - plain)[valid].norm() / plain[valid].norm()):.2e}"
        except ValueError as e:
            err = f"refused: {str(e).splitlines()[0]}"
        rows.append(f"| {name} | {what[name]} | {err} |")
        print(rows[-1], flush=True)
    return rows


def party_costs(hidden: int, seq: int) -> list[str]:
    from softq.mpc import run
    from softq.mpc.surrogates import configure_surrogates

    x = text_inputs(seq, batch=1)
    lines = []
    summary = ["| model | parameters | path | rounds | MB | modelled LAN s | modelled WAN s | max abs error |",
               "|---|---|---|---|---|---|---|---|"]
    for name in ("llama", "bert"):
        for softmax, gelu in (("softmax", None), ("2quad", "quad")):
            torch.manual_seed(0)
            # undistilled 2Quad on weights of scale 0.2 leaves the row division's brackets (the range check refuses
            # it): that path runs Hugging Face's initial scale 0.02; rounds and bytes do not depend on the weights
            model = configs(hidden, 0.2 if softmax == "softmax" else 0.02)[name]().eval()
            result = run(model, x, softmax=softmax, gelu=gelu, timeout=300)
            ref = copy.deepcopy(model)
            configure_surrogates(ref, softmax=softmax, gelu=gelu)
            with torch.no_grad():
                out = ref(**x)
            plain = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
            rep = result.report
            got = result.outputs[0]
            path = "exact" if softmax == "softmax" else "2Quad + Quad"
            n_params = sum(p.numel() for p in model.parameters())
            summary.append(f"| {name} | {n_params} | {path} | {rep.rounds} | {rep.bytes / 1e6:.2f} | "
                           f"{rep.modeled_seconds('lan'):.3f} | {rep.modeled_seconds('wan'):.2f} | "
                           f"{float((got - plain).abs().max()):.1e} |")
            print(summary[-1], flush=True)
            lines += [f"\n### {name}, {path}: per op kind (party 0)\n", "```", rep.table("kind"), "```"]
    return summary + lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    builders = configs(args.hidden)
    command = "python benchmarks/bench_mpc_families.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    parts = [f"# softq.mpc on today's families\n\n`{command.strip()}`\n",
             f"Tiny models from configs (hidden {args.hidden}, 2 layers (ModernBERT 3), 4 heads, intermediate "
             f"{2 * args.hidden}, vocabulary 64, initializer_range 0.2).\n",
             f"## Exact path, 1-party CrypTen in process (2 sequences of {args.seq} tokens, one padded)\n",
             *exact_path_errors(builders, args.seq),
             f"\n## One forward in 2 parties (separate processes, exact truncation, 1 sequence of {args.seq} tokens)\n",
             "BERT keeps its pooler (a dense layer and tanh: the `tanh` rows); Llama has its LM head instead.\n",
             *party_costs(args.hidden, args.seq)]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_name(f".{RESULTS.name}.tmp{os.getpid()}")
    tmp.write_text("\n".join(parts) + "\n")
    os.replace(tmp, RESULTS)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
