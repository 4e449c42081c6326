"""The encrypted-inference step of ``make demo``: the reference ViT under CrypTen, 2 parties."""

from __future__ import annotations

import copy

import torch


def encrypted_demo(samples: int = 32, softmax: str = "softmax", gelu: str = "tanh") -> int:
    """Run the reference ViT on ``samples`` held-out digits encrypted; print accuracy and the cost table.

    Then run the MPCFormer surrogates (2Quad softmax, Quad GELU) on the same digits and print
    both side by side: the surrogates cost a fraction of the communication, and without
    distillation (``softq mpc distill``) they lose the accuracy.
    """
    from softq.mpc.reference import reference_task
    from softq.mpc.runner import run
    from softq.mpc.surrogates import configure_surrogates

    task = reference_task("vit", n=samples)
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

    surrogate = run(task.model, task.inputs, softmax="2quad", gelu="quad", world_size=2, timeout=300)
    print(f"\n{'softmax + GELU':<28} {'accuracy':>9} {'rounds':>7} {'MB':>9} {'LAN s':>7} {'WAN s':>7}")
    for label, res in ((f"{softmax} + {gelu} (exact)", result),
                       ("2quad + quad (no distill.)", surrogate)):
        rep = res.report
        print(f"{label:<28} {task.accuracy(res.logits):>8.2f}% {rep.rounds:>7} {rep.bytes / 1e6:>9.1f} "
              f"{rep.modeled_seconds('lan'):>7.2f} {rep.modeled_seconds('wan'):>7.2f}")
    print("surrogate accuracy comes back with `softq mpc distill` (see docs/results/mpc.md)")
    return 0
