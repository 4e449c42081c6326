"""The encrypted-inference steps of ``make demo``: the reference ViT, and private MiniLM sentence embeddings."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch


def encrypted_demo(samples: int = 32, softmax: str = "softmax", gelu: str = "tanh") -> int:
    """Run the reference ViT on ``samples`` held-out digits encrypted; print accuracy and the cost table.

    Then run the MPCFormer surrogates (2Quad softmax, Quad GELU) on the same digits and print
    both side by side: the surrogates cost a fraction of the communication, and without
    distillation (``softq mpc distill``) they lose the accuracy.
    """
    from workloads.tasks import mpc_task
    from softq.mpc.runner import run
    from softq.mpc.surrogates import configure_surrogates

    task = mpc_task("vit", n=samples)
    print(f"model owner: party 0 (weights secret-shared); client: party 1 (images secret-shared, "
          f"sees the logits); {samples} held-out digits; softmax={softmax}, GELU={gelu}", flush=True)
    result = run(task.model, task.inputs, softmax=softmax, gelu=gelu, world_size=2, timeout=300)
    plain_model = copy.deepcopy(task.model)
    configure_surrogates(plain_model, softmax=softmax, gelu=gelu)
    with torch.no_grad():
        plain = plain_model(**task.inputs).logits
    enc = result.logits
    print(result.report.table("kind"))
    print(f"\nencrypted accuracy {task.accuracy(enc):.2f}% (plaintext {task.accuracy(plain):.2f}%), "
          f"max |logit error| {float((enc - plain).abs().max()):.2e}, "
          f"argmax agreement {100.0 * float((enc.argmax(-1) == plain.argmax(-1)).float().mean()):.1f}%, "
          f"{result.wall_seconds:.1f} s with process start-up")

    from softq.mpc.ranges import RangeError

    rows = [(f"{softmax} + {gelu} (exact)", result)]
    try:
        rows.append(("2quad + quad (no distill.)", run(task.model, task.inputs, softmax="2quad", gelu="quad",
                                                        world_size=2, timeout=300)))
    except RangeError as err:  # the range pass refuses what fixed point would get wrong: say so, go on
        print(f"\n2quad + quad (no distillation): {err}")
    print(f"\n{'softmax + GELU':<28} {'accuracy':>9} {'rounds':>7} {'MB':>9} {'LAN s':>7} {'WAN s':>7}")
    for label, res in rows:
        rep = res.report
        print(f"{label:<28} {task.accuracy(res.logits):>8.2f}% {rep.rounds:>7} {rep.bytes / 1e6:>9.1f} "
              f"{rep.modeled_seconds('lan'):>7.2f} {rep.modeled_seconds('wan'):>7.2f}")
    print("surrogate accuracy comes back with `softq mpc distill` (see docs/results/mpc.md)")
    return 0


def minilm_task(sentences: int = 2, seq_len: int = 32) -> tuple[torch.nn.Module, dict[str, torch.Tensor], list[str]]:
    """all-MiniLM-L6-v2 without its (unused) pooler, and ``sentences`` pydoc paragraphs cut to ``seq_len`` tokens."""
    import transformers

    from softq.corpora import text_split
    from softq.hf import load_minilm, minilm_dir

    hm = load_minilm()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the checkpoint's pooler weights are left out on purpose
    try:
        model = transformers.BertModel.from_pretrained(minilm_dir(), add_pooling_layer=False).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)
    texts = text_split("eval", sentences)
    return model, hm.tokenize(texts, max_length=seq_len), texts


def embedding_errors(hidden: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(max abs error of the last hidden state on valid tokens, smallest cosine of the pooled embeddings)."""
    from softq.hf import pool

    err = float((hidden - ref).abs()[mask.bool()].max())
    cos = torch.nn.functional.cosine_similarity(pool(hidden, mask, "mean", True), pool(ref, mask, "mean", True))
    return err, float(cos.min())


def private_embeddings(sentences: int = 2, seq_len: int = 32, **run_kwargs: Any) -> tuple[float, float]:
    """Sentence embeddings of all-MiniLM-L6-v2 where the client's text stays private (about a minute on 2 cores).

    The client secret-shares its token ids, the model owner its weights; the exact path
    (softmax, erf GELU, exact truncation) runs in 2 processes, and the client compares
    the revealed embeddings with the plaintext model's.  Returns (max abs error of the
    last hidden state, smallest embedding cosine).
    """
    from softq.mpc.runner import run

    torch.set_num_threads(1)
    model, inputs, texts = minilm_task(sentences, seq_len)
    print(f"client: {sentences} paragraphs of Python's docs ({inputs['input_ids'].shape[1]} tokens each), "
          f"e.g. {texts[0][:60]!r}...; model owner: all-MiniLM-L6-v2's weights", flush=True)
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
    t0 = time.perf_counter()
    result = run(model, inputs, softmax="softmax", gelu="erf", timeout=600, **run_kwargs)
    err, cos = embedding_errors(result.outputs[0], ref, inputs["attention_mask"])
    rep = result.report
    print(f"encrypted in {time.perf_counter() - t0:.0f} s: embedding cosine to plaintext >= {cos:.6f}, "
          f"max |hidden state error| {err:.1e}")
    print(f"cost: {rep.rounds} rounds, {rep.bytes / 1e6:.0f} MB, {rep.truncations / 1e6:.1f}M exact truncations; "
          f"modeled {rep.modeled_seconds('lan'):.1f} s on a LAN, {rep.modeled_seconds('wan'):.0f} s on a WAN; "
          f"largest share: {max(rep.by_kind().values(), key=lambda g: g.bytes).kind}")
    return err, cos
