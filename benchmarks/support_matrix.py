"""The support matrix: every family softq supports, run tiny from a config through each stage, and the families it
refuses with the one line it refuses them with.  Nothing here is written by hand: a cell is what the run measured.

    python benchmarks/support_matrix.py                 # writes docs/results/support_matrix.md and README's matrix
    python benchmarks/support_matrix.py --no-mpc        # without the encrypted runs (minutes)

Stages, each on a 2-layer model of hidden size 32 with random weights, on inputs other than the calibration ones:
* quantize: default ``QuantConfig()``; relative output error ||q - fp|| / ||fp|| at most 0.1;
* save/load: ``softq.save`` then ``softq.load`` computes bit for bit what was saved;
* cached decoding (decoders): the quantized model decoding token by token with its KV cache against its full
  forward, relative error of the logits at most 1e-4;
* onnxruntime / tract / OpenVINO: ``softq.to_onnx`` traced on one shape, run on another (batch 3, 13 tokens, the
  last text padded); relative error to the quantized torch model at most 2e-2;
* MPC: the exact path (softmax, erf GELU or exact SiLU) under CrypTen, 2 parties; relative error to plaintext at most 1e-2;
* attention variants: gated attention, clipped softmax and softpick configured, quantized (within the quantize
  bound of the float variant) and exported (onnxruntime within the runtime bound), or the export's refusal.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

import softq
from benchutil import command_line, write_atomic
from softq.export import runtimes
from softq.models import is_causal

ROOT = Path(__file__).resolve().parents[1]
MARKERS = ("<!-- support-matrix:start -->", "<!-- support-matrix:end -->")
QUANT_BOUND, ONNX_BOUND, MPC_BOUND, DECODE_BOUND = 0.1, 2e-2, 1e-2, 1e-4
COMMON = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64)
TEXT = dict(vocab_size=64, max_position_embeddings=128)


def supported() -> dict[str, callable]:
    """model_type -> a builder of a tiny model of that family (headless encoders, causal LMs, image classifiers)."""
    t = transformers
    return {
        "bert": lambda: t.BertModel(t.BertConfig(**TEXT, **COMMON), add_pooling_layer=False),
        "roberta": lambda: t.RobertaModel(t.RobertaConfig(vocab_size=64, max_position_embeddings=130, pad_token_id=1,
                                                          **COMMON), add_pooling_layer=False),
        "xlm-roberta": lambda: t.XLMRobertaModel(t.XLMRobertaConfig(vocab_size=64, max_position_embeddings=130,
                                                                    pad_token_id=1, **COMMON), add_pooling_layer=False),
        "camembert": lambda: t.CamembertModel(t.CamembertConfig(vocab_size=64, max_position_embeddings=130,
                                                                pad_token_id=1, **COMMON), add_pooling_layer=False),
        "electra": lambda: t.ElectraModel(t.ElectraConfig(**TEXT, embedding_size=16, **COMMON)),
        "distilbert": lambda: t.DistilBertModel(t.DistilBertConfig(vocab_size=64, max_position_embeddings=128,
                                                                   n_layers=2, n_heads=4, dim=32, hidden_dim=64,
                                                                   pad_token_id=1)),
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128)),
        "opt": lambda: t.OPTForCausalLM(t.OPTConfig(**TEXT, ffn_dim=64, word_embed_proj_dim=32, pad_token_id=1,
                                                    **COMMON)),
        "vit": lambda: t.ViTForImageClassification(t.ViTConfig(image_size=16, patch_size=4, num_channels=3,
                                                               num_labels=10, **COMMON)),
        "deit": lambda: t.DeiTForImageClassification(t.DeiTConfig(image_size=16, patch_size=4, num_channels=3,
                                                                  num_labels=10, **COMMON)),
    }


def modern() -> dict[str, callable]:
    """Today's families: decoders with RoPE, GQA, RMSNorm and gated MLPs; encoders with local/global attention,
    relative position biases, registers or speech inputs."""
    t = transformers
    small = dict(vocab_size=64, max_position_embeddings=128, **COMMON)
    return {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**small, num_key_value_heads=2)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**small, num_key_value_heads=2)),
        "qwen3": lambda: t.Qwen3ForCausalLM(t.Qwen3Config(**small, num_key_value_heads=2, head_dim=8)),
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(**small, num_key_value_heads=1, sliding_window=8)),
        "gemma2": lambda: t.Gemma2ForCausalLM(t.Gemma2Config(**small, num_key_value_heads=2, head_dim=8,
                                                             sliding_window=8, query_pre_attn_scalar=16,
                                                             attn_logit_softcapping=5.0)),
        "phi3": lambda: t.Phi3ForCausalLM(t.Phi3Config(**small, num_key_value_heads=2, pad_token_id=0)),
        "modernbert": lambda: t.ModernBertModel(t.ModernBertConfig(
            vocab_size=64, max_position_embeddings=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, global_attn_every_n_layers=2, local_attention=8, pad_token_id=0)),
        "mpnet": lambda: t.MPNetModel(t.MPNetConfig(vocab_size=64, max_position_embeddings=130, **COMMON),
                                      add_pooling_layer=False),
        "t5 (encoder)": lambda: t.T5EncoderModel(t.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                             num_heads=4, relative_attention_num_buckets=8)),
        "clip (text)": lambda: t.CLIPTextModel(t.CLIPTextConfig(vocab_size=64, max_position_embeddings=64,
                                                                **COMMON)),
        "clip (vision)": lambda: t.CLIPVisionModel(t.CLIPVisionConfig(image_size=16, patch_size=4, **COMMON)),
        "dinov2": lambda: t.Dinov2Model(t.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                       mlp_ratio=2, image_size=16, patch_size=4)),
        "whisper (encoder)": lambda: t.models.whisper.modeling_whisper.WhisperEncoder(t.WhisperConfig(
            num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
            max_source_positions=16, vocab_size=64)),
    }


def refused() -> dict[str, callable]:
    """Families that compute attention in their own forward, outside Hugging Face's attention interface, with no
    adapter in ``softq.families``: what softq says when given one."""
    t = transformers
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return {
        "deberta-v2": lambda: t.DebertaV2Model(t.DebertaV2Config(**small)),
        "bloom": lambda: t.BloomForCausalLM(t.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)),
        "funnel": lambda: t.FunnelModel(t.FunnelConfig(vocab_size=64, d_model=32, n_head=4, d_head=8, d_inner=64,
                                                       block_sizes=[1, 1])),
        "xlnet": lambda: t.XLNetModel(t.XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, d_inner=64)),
    }


def built(build) -> torch.nn.Module:
    """A fresh model in eval mode.  Fresh ViT / DeiT class and distillation tokens are (near) zero, which no
    trained model has (LayerNorm then blows up any rounding of those rows): they get a trained-like spread."""
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("cls_token", "distillation_token")):
                param.normal_()
    return model


def inputs(model: torch.nn.Module, seed: int, batch: int, seq: int, pad: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if model.main_input_name == "pixel_values":
        size = model.config.image_size
        return {"pixel_values": torch.randn(batch, model.config.num_channels, size, size, generator=g)}
    if model.main_input_name == "input_features":  # a speech encoder: a fixed number of frames
        frames = 2 * model.config.max_source_positions
        return {"input_features": torch.randn(batch, model.config.num_mel_bins, frames, generator=g)}
    ids = torch.randint(3, 64, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    if pad and not is_causal(model):  # right padding in the last text
        mask[-1, seq - 4:] = 0
        ids[mask == 0] = 1
    return {"input_ids": ids, "attention_mask": mask}


@torch.no_grad()
def output(model: torch.nn.Module, x: dict[str, torch.Tensor]) -> np.ndarray:
    out = model(**x)
    value = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    if "attention_mask" in x:
        value = value[x["attention_mask"].bool()]
    return value.float().numpy()


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def cell(ok: bool, value: float | None = None) -> str:
    text = "yes" if ok else "**no**"
    return f"{text} ({value:.1e})" if value is not None else text


def onnx_errors(qmodel: torch.nn.Module, model: torch.nn.Module, path: Path, calib: list[dict],
                which: tuple[str, ...]) -> dict[str, float]:
    softq.to_onnx(qmodel, str(path), calib[0], overwrite=True)
    x = inputs(model, 99, 3, 13, pad=True)
    ref = output(qmodel, x)
    feeds = {k: v.numpy() for k, v in x.items()}
    errors = {}
    for runtime in which:
        out = runtimes.runner(path, runtime)(feeds)[0]
        if "attention_mask" in x:
            out = out[x["attention_mask"].numpy().astype(bool)]
        errors[runtime] = rel(out, ref)
    return errors


@torch.no_grad()
def decode_error(qmodel: torch.nn.Module, model: torch.nn.Module) -> float | None:
    """A decoder's cached decoding (8-token prefill, then one token a step with the KV cache) against its full
    forward, relative error of the last 4 positions' logits; None for an encoder."""
    if not is_causal(model) or getattr(qmodel, "lm_head", None) is None:
        return None
    ids = inputs(model, 31, 2, 12, pad=False)["input_ids"]
    full = qmodel(input_ids=ids).logits[:, 8:]
    out = qmodel(input_ids=ids[:, :8], use_cache=True)
    past, steps = out.past_key_values, []
    for i in range(8, 12):
        out = qmodel(input_ids=ids[:, i:i + 1], past_key_values=past, use_cache=True)
        past = out.past_key_values
        steps.append(out.logits)
    return rel(torch.cat(steps, 1).float().numpy(), full.float().numpy())


def mpc_error(model: torch.nn.Module) -> float:
    import softq.mpc

    x = inputs(model, 7, 2, 12, pad=True)
    # the exact path: exact softmax and the model's own activation computed exactly (GELU by erf, or SiLU)
    activation = "silu" if getattr(model.config, "hidden_act", None) in ("silu", "swish") else "erf"
    result = softq.mpc.run(model, x, softmax="softmax", gelu=activation, world_size=2, timeout=600)
    got = result.outputs[0]
    got = got[x["attention_mask"].bool()] if "attention_mask" in x else got
    return rel(got.float().numpy(), output(model, x))


def variants(build, workdir: Path) -> str:
    """Each attention variant configured on the family: quantized (error to the float variant within the quantize
    bound) and exported (onnxruntime within the runtime bound), or what stops it."""
    cells = {}
    for name, kwargs in (("gated", dict(gated=True)), ("clipped", dict(softmax="clipped", alpha=0.5)),
                         ("softpick", dict(softmax="softpick"))):
        model = built(build)
        try:
            softq.configure_attention(model, **kwargs)
            calib = [inputs(model, s, 2, 20, pad=True) for s in range(3)]
            held = inputs(model, 50, 3, 13, pad=True)
            qmodel = softq.quantize(model, calib, softq.QuantConfig())
            err = rel(output(qmodel, held), output(model, held))
        except Exception as exc:  # noqa: BLE001 - a table cell says what failed
            cells[name] = f"**no**: {str(exc).splitlines()[0][:60]}"
            continue
        if not err <= QUANT_BOUND:
            cells[name] = f"**no** ({err:.1e})"
            continue
        try:
            onnx_err = onnx_errors(qmodel, model, workdir / f"{name}.onnx", calib, ("onnxruntime",))["onnxruntime"]
            cells[name] = "quantize, ONNX" if onnx_err <= ONNX_BOUND else f"quantize; ONNX **{onnx_err:.1e}**"
        except ValueError:  # the export refuses the variant in one line
            cells[name] = "quantize (export refused)"
    grouped: dict[str, list[str]] = {}
    for name, cell in cells.items():
        grouped.setdefault(cell, []).append(name)
    return "; ".join(f"{', '.join(names)}: {cell}" for cell, names in grouped.items())


def failed(exc: BaseException) -> str:
    """A cell saying in one line what stopped a stage."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"**no**: {text[:110].replace('|', '/')}"


def run_family(name: str, build, workdir: Path, mpc: bool) -> list[str]:
    model = built(build)
    calib = [inputs(model, s, 2, 20, pad=True) for s in range(3)]
    held = inputs(model, 50, 3, 13, pad=True)
    try:
        qmodel = softq.quantize(model, calib, softq.QuantConfig())
    except Exception as exc:  # noqa: BLE001 - a table row says what failed
        return [name, failed(exc)] + ["not run"] * 7
    q_err = rel(output(qmodel, held), output(model, held))
    cells = [name, cell(q_err <= QUANT_BOUND, q_err)]
    try:
        softq.save(qmodel, workdir / name, overwrite=True)
        loaded = softq.load(workdir / name)
        cells.append(cell(bool(np.array_equal(output(loaded, held), output(qmodel, held)))))
    except Exception as exc:  # noqa: BLE001
        cells.append(failed(exc))
    try:
        decode = decode_error(qmodel, model)
        cells.append("encoder" if decode is None else cell(decode <= DECODE_BOUND, decode))
    except Exception as exc:  # noqa: BLE001
        cells.append(failed(exc))
    which = tuple(r for r in ("onnxruntime", "tract", "openvino") if runtimes.available(r))
    try:
        errors = onnx_errors(qmodel, model, workdir / f"{name}.onnx", calib, which)
        cells += [cell(errors[r] <= ONNX_BOUND, errors[r]) if r in errors else "not installed"
                  for r in ("onnxruntime", "tract", "openvino")]
    except Exception as exc:  # noqa: BLE001
        cells += [failed(exc)] * 3
    if mpc:
        try:
            m_err = mpc_error(model)
            cells.append(cell(m_err <= MPC_BOUND, m_err))
        except Exception as exc:  # noqa: BLE001
            cells.append(failed(exc))
    else:
        cells.append("not run")
    cells.append(variants(build, workdir))
    return cells


def refusal(build) -> str:
    torch.manual_seed(0)
    model = build().eval()
    try:
        softq.quantize(model, [{"input_ids": torch.randint(3, 64, (1, 8))}], softq.QuantConfig())
    except ValueError as err:
        return str(err).splitlines()[0]
    return "**not refused**"


def matrix(mpc: bool) -> str:
    header = ["family", "quantize", "save / load", "cached decoding", "onnxruntime", "tract", "OpenVINO", "MPC exact path",
              "attention variants"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in {**supported(), **modern()}.items():
            start = time.time()
            rows.append("| " + " | ".join(run_family(name, build, Path(tmp), mpc)) + " |")
            print(f"{name}: {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    lines = [*rows, "", "Refused, each in one line (families that compute attention outside Hugging Face's attention interface):", "",
             "| family | what softq says |", "|---|---|"]
    for name, build in refused().items():
        lines.append(f"| {name} | {refusal(build).split(';')[0].replace('|', '/')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-mpc", dest="mpc", action="store_false", help="skip the encrypted runs")
    parser.add_argument("--output", type=Path, default=ROOT / "docs/results/support_matrix.md")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md", help="README whose matrix is replaced")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.time()
    table = matrix(args.mpc)
    cells = (f"In each cell, the measured relative error where there is one. Bounds: quantize {QUANT_BOUND}, "
             f"runtimes {ONNX_BOUND:.0e} on a shape other than the traced one, MPC {MPC_BOUND:.0e}.")
    write_atomic(args.output, "\n".join([
        "# Support matrix", "", "Generated by `benchmarks/support_matrix.py`; do not edit by hand. Command:", "",
        f"    {command_line()}", "", f"torch {torch.__version__}, transformers {transformers.__version__}; took "
        f"{(time.time() - start) / 60:.1f} min.", "", __doc__.split("\n\n", 2)[2].strip(), "", cells, "", table, ""]))
    readme = args.readme.read_text()
    pattern = re.compile(re.escape(MARKERS[0]) + ".*?" + re.escape(MARKERS[1]), re.S)
    if not pattern.search(readme):
        raise SystemExit(f"{args.readme} has no {MARKERS[0]} ... {MARKERS[1]} block")
    block = f"{MARKERS[0]}\n{table}\n\n{cells} Generated by `python benchmarks/support_matrix.py`.\n{MARKERS[1]}"
    write_atomic(args.readme, pattern.sub(lambda _: block, readme))
    print(f"wrote {args.output} and the matrix in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
