"""One measurement of bench_llm_peers.py, run in a fresh process of the virtual environment that holds the tool
measured (softq's own, or the peers' environments of ``make peers``), so that each process's peak RSS is its
own calibration's.

    python llm_peers_worker.py calibrate {softq,softq-linears,llmcompressor} MODEL_DIR DATA.pt OUT.json [--eval]
    python llm_peers_worker.py export-optimum MODEL_DIR OUT_DIR

``MODEL_DIR`` is a plain Hugging Face LlamaForCausalLM directory (save_pretrained); ``DATA.pt`` holds
``calib`` (and ``eval`` for ``--eval``), int64 token windows [n, context]. ``calibrate`` writes to OUT.json:
the process's peak RSS after loading (imports, the model with every weight read, data) and after calibrating,
the calibration's seconds, and with ``--eval`` the held-out perplexity of the FP32 model and of the quantized
one, both computed here. Imports only torch, transformers and the tool measured.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path


def peak_rss_mib() -> float:
    """This process's peak resident set so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def perplexity(model, windows) -> float:  # noqa: ANN001 - a causal LM and an int64 tensor [n, context]
    """exp of the mean next-token NLL over every predicted token of the windows (workloads.perplexity's rule)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for row in windows:
            ids = row.unsqueeze(0)
            logits = model(input_ids=ids).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                    reduction="sum")
            total, count = total + float(nll), count + ids.shape[1] - 1
    return math.exp(total / count)


def load(model_dir: str):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype="float32")
    for p in model.parameters():  # read every weight: memory-mapped pages count in RSS only once touched
        p.detach().sum()
    return model.eval()


def calibrate_softq(model, calib, linears_only: bool = False) -> object:  # noqa: ANN001
    """softq's default ``QuantConfig()``; ``linears_only``: ``softmax_bits=None``, the softmax and P.V float as in
    llm-compressor's W8A8.  In place, as llm-compressor's ``oneshot`` quantizes the model it is given."""
    import softq

    config = softq.QuantConfig(softmax_bits=None) if linears_only else softq.QuantConfig()
    return softq.quantize(model, [{"input_ids": row.unsqueeze(0)} for row in calib], config, inplace=True)


def id_tokenizer(vocab_size: int):  # noqa: ANN201 - a PreTrainedTokenizerFast
    """A tokenizer whose token i is the word "t{i}": oneshot requires a processor whenever it gets a dataset,
    although the windows here are token ids already and it never tokenizes them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0")


def calibrate_llmcompressor(model, calib) -> object:  # noqa: ANN001
    """llm-compressor's W8A8 example recipe: SmoothQuant (strength 0.8), then GPTQ with the W8A8 scheme (int8
    per-channel weights, int8 per-token dynamic activations) on every Linear except lm_head."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

    recipe = [SmoothQuantModifier(smoothing_strength=0.8),
              GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])]
    data = Dataset.from_dict({"input_ids": [row.tolist() for row in calib],
                              "attention_mask": [[1] * len(row) for row in calib]})
    oneshot(model=model, dataset=data, recipe=recipe, processor=id_tokenizer(model.config.vocab_size),
            num_calibration_samples=len(calib), max_seq_length=calib.shape[1], shuffle_calibration_samples=False)
    return model


def calibrate(tool: str, model_dir: str, data_path: str, out_path: str, evaluate: bool) -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = torch.load(data_path, weights_only=True)
    model = load(model_dir)
    if tool == "llmcompressor":
        import llmcompressor  # noqa: F401 - its import cost belongs to the loaded state, not to calibration
    else:
        import softq  # noqa: F401
    result = {"tool": tool, "rss_loaded_mib": peak_rss_mib()}
    start = time.perf_counter()
    if tool == "llmcompressor":
        quantized = calibrate_llmcompressor(model, data["calib"])
    else:
        quantized = calibrate_softq(model, data["calib"], linears_only=tool == "softq-linears")
    result["calib_s"] = time.perf_counter() - start
    result["rss_peak_mib"] = peak_rss_mib()
    if evaluate:
        result["ppl_quant"] = perplexity(quantized, data["eval"])
        result["ppl_fp32"] = perplexity(load(model_dir), data["eval"])
    import transformers

    result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    if tool == "llmcompressor":
        import compressed_tensors
        import llmcompressor

        result["versions"].update(llmcompressor=llmcompressor.__version__,
                                  compressed_tensors=compressed_tensors.__version__)
    Path(out_path).write_text(json.dumps(result))


def export_optimum(model_dir: str, out_dir: str) -> None:
    """optimum's ONNX export of the decoder with its KV cache (task text-generation-with-past)."""
    from importlib.metadata import version

    from optimum.exporters.onnx import main_export

    main_export(model_dir, output=out_dir, task="text-generation-with-past", device="cpu", do_validation=False)
    (Path(out_dir) / "versions.json").write_text(json.dumps(
        {name: version(name) for name in ("optimum", "optimum-onnx", "transformers", "torch", "onnx")}))


def main(argv: list[str]) -> int:
    if argv[:1] == ["calibrate"] and len(argv) in (5, 6) and argv[1] in ("softq", "softq-linears", "llmcompressor"):
        calibrate(argv[1], argv[2], argv[3], argv[4], "--eval" in argv[5:])
        return 0
    if argv[:1] == ["export-optimum"] and len(argv) == 3:
        export_optimum(argv[1], argv[2])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
