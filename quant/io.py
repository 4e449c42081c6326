"""Save and load quantized models as a directory, written atomically.

Layout of a saved model::

    config.json          the Hugging Face model config (architecture, softq attention choice)
    quant_config.json    the QuantConfig, plus per-layer bias-correction metadata and a SHA-256 digest of
                         itself and config.json (a directory edited after saving is refused at load)
    model.pt             the state dict of the quantized model: every quantized weight (Linear, embedding table,
                         conv and position weights) as its integer codes (``<name>:codes``, int8; int16 above 8
                         bits, but not in a float16 / bfloat16 model) and float32 scales (``<name>:scale``) with
                         ``weights="codes"``, the default (a quarter to a third of the float size,
                         docs/results/save.md), or as the float weights after SmoothQuant with
                         ``weights="float"``; activation scales, zero points, betas

Loading rebuilds the float architecture from the config, inserts the same
quantization points with :func:`softq.quant.points.prepare` and loads the state
dict; no calibration data is needed.  A weight stored as codes loads as ``codes * scale``, a float weight that
quantizes to the same codes and scale (checked for each weight when saving; one that would not is saved float): the
loaded model computes what the saved one did, bit for bit, but its float weights are the quantized ones, so
switching weight quantization off
(:func:`softq.quant.sensitivity.sensitivity`) has nothing to show; save with ``weights="float"`` for that.
"""

from __future__ import annotations


import dataclasses
import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
import transformers
from torch import nn
from torch.nn.utils import parametrize

from softq._files import atomic_directory, error_line
from softq.attention import configure_from_config
from softq.quant.config import BIAS_CORRECTION_GRANULARITIES, DEFAULT_PERCENTILE, EMBEDDING_MIN_ROWS, QuantConfig
from softq.quant import offload
from softq.quant.layers import BiasShift, QEmbedding, QLinear, WeightOnly
from softq.quant.points import prepare, set_mode
from softq.quant.quantize import is_quantized
from softq.quant.quantizers import ActQuantizer, SoftmaxOutputQuantizer, weight_codes32

FORMAT_VERSION = 2  # 2: weights as codes (quant_config.json "coded_weights"); 1: float weights (weights="float")
WEIGHT_FORMATS = ("codes", "float")
CODES, SCALE = ":codes", ":scale"  # suffixes of a coded weight's two tensors in model.pt


def save(qmodel: nn.Module, path: str | os.PathLike, overwrite: bool = False,
         sidecars_from: str | os.PathLike | None = None, weights: str = "codes") -> Path:
    """Write ``qmodel`` (from :func:`softq.quantize`) to the directory ``path``, atomically.

    ``weights``: ``"codes"`` (default) stores each quantized weight as int8 codes and one float per scale slice,
    a quarter to a third of the float file, and loads bit-exact; ``"float"`` stores the float weights, what a
    sensitivity ranking or further fine-tuning of the loaded model needs.

    ``sidecars_from``: a Hugging Face model directory whose tokenizer and
    sentence-transformers files (pooling, normalisation) are copied along, so the
    quantized directory is as usable as the original (``softq export --pooled``).  A quantized
    ``SentenceTransformer`` is written as its Hugging Face model with its tokenizer and sentence files;
    :func:`load` gives back the Hugging Face model.
    """
    from softq.hf import is_sentence_transformer, write_sentence_files

    if not is_quantized(qmodel):
        raise ValueError("softq.quant.save expects a model returned by softq.quantize")
    offload.refuse(qmodel, "softq.quant.save")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(map(repr, WEIGHT_FORMATS))}, got {weights!r}")
    sentence = qmodel if is_sentence_transformer(qmodel) else None  # its model, tokenizer and pooling files
    if sentence is not None:
        qmodel = sentence[0].auto_model
    target = Path(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass overwrite=True (CLI: --overwrite) to replace it")
    with atomic_directory(target) as tmp:
        qmodel.config.architectures = [type(qmodel).__name__]
        qmodel.config.save_pretrained(tmp)
        probs = {name: {"granularity": m.granularity, "causal_rows": m.causal_rows}
                 for name, m in qmodel.named_modules() if isinstance(m, SoftmaxOutputQuantizer)}
        config = qmodel.softq_quant_config
        state = qmodel.state_dict()
        coded = _encode_weights(qmodel, state) if weights == "codes" else {}
        meta = {"format": FORMAT_VERSION if coded else 1, "quant_config": dataclasses.asdict(config),
                "softmax_outputs": probs,
                "softmax_input_resolved": config.resolved_softmax_input}  # what "auto" meant when written
        if coded:
            meta["coded_weights"] = coded
        meta["dtype"] = str(_weights_dtype(qmodel.parameters())).removeprefix("torch.")
        if getattr(qmodel, "softq_weights_quantized", False):  # loaded from codes: its float weights are the codes'
            meta["weights_quantized"] = True
        init = _init_kwargs(qmodel)
        if init:
            meta["init_kwargs"] = init
        meta["digest"] = _digest(meta, json.loads((tmp / "config.json").read_text(encoding="utf-8")))
        (tmp / "quant_config.json").write_text(json.dumps(meta, indent=2))
        torch.save(state, tmp / "model.pt")
        if sidecars_from is not None:
            from softq.hf import copy_sidecars

            copy_sidecars(sidecars_from, tmp)
        if sentence is not None:
            write_sentence_files(sentence, tmp)
    return target


def _weights_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The floating dtype most of ``tensors`` have (float32 if none is floating)."""
    counts = Counter(t.dtype for t in tensors if t.is_floating_point())
    return counts.most_common(1)[0][0] if counts else torch.float32


def _coded_weights(model: nn.Module) -> dict[str, tuple[int, int | None]]:
    """State-dict key -> (bits, axis) of every weight the model computes with as :func:`weight_codes`: quantized
    Linears (per output channel or tensor), embedding tables (per row), weight-only parametrizations (conv
    weights, position tables)."""
    found: dict[str, tuple[int, int | None]] = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, QLinear) and not m.weight_quant.disable_quant:
            found[prefix + "weight"] = (m.weight_bits, 0 if m.per_channel else None)
        elif isinstance(m, QEmbedding) and not m.weight_quant.disable_quant:
            found[prefix + "weight"] = (m.bits, 0)
        for pname, plist in getattr(m, "parametrizations", {}).items():
            if len(plist) == 1 and isinstance(plist[0], WeightOnly) and plist[0].enabled:
                found[f"{prefix}parametrizations.{pname}.original"] = (plist[0].bits, plist[0].axis)
    return found


def _code_dtype(bits: int) -> torch.dtype:
    """The integer type a weight's codes are stored in: int8 up to 8 bits, int16 above (``weight_bits`` up to 16)."""
    return torch.int8 if bits <= 8 else torch.int16


def _decode_weight(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float weight of integer ``codes`` and their float32 ``scale`` (:func:`weight_codes32`): one whose
    :func:`weight_codes` are the same codes and scale (each slice's max |w| comes back as its max code times the
    scale, which can round to a neighbouring float, but divided by the max code it gives the same scale: what
    :func:`_encode_weights` checks per weight)."""
    return (codes.float() * scale).to(dtype)


def _encode_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Replace in ``state`` each quantized weight by its integer codes and float32 scales where the decoded weight
    gives the same codes and scales (checked per weight; one that would not stays float), in place; returns the
    coded keys with their dtypes."""
    coded = {}
    for key, (bits, axis) in _coded_weights(model).items():
        w = state.get(key)
        if w is None or not w.is_floating_point() or _code_dtype(bits).itemsize >= w.element_size():
            continue  # not a weight, or codes no smaller than it (above 8 bits in float16 / bfloat16)
        codes, scale = weight_codes32(w, bits, axis)
        small = codes.to(_code_dtype(bits))
        again, scale_again = weight_codes32(_decode_weight(small, scale, w.dtype), bits, axis)
        if not (torch.equal(again, codes) and torch.equal(scale_again, scale)):
            continue
        del state[key]
        state[key + CODES], state[key + SCALE] = small.cpu(), scale.cpu()
        coded[key] = str(w.dtype).removeprefix("torch.")
    return coded


def _decode_weights(model: nn.Module, state: dict[str, torch.Tensor], coded: object, source: Path) -> None:
    """Put back in ``state`` the float weights of the coded keys (from quant_config.json), in place."""
    expected = _coded_weights(model)
    if not isinstance(coded, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in coded.items()):
        raise ValueError(f"{source / 'quant_config.json'} is not a softq quantization record (malformed coded_weights)")
    for key, dtype_name in coded.items():
        if key not in expected:
            raise ValueError(f"{source / 'quant_config.json'} lists coded weights for {key!r}, which the model does "
                             "not quantize")
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"{source / 'quant_config.json'}: coded weight {key} has dtype {dtype_name!r}, not a "
                             "floating-point one")
        if key + CODES not in state and key + SCALE not in state:
            continue  # another model's state: _check_state names what is missing
        if key in state:
            raise ValueError(f"{source / 'model.pt'} holds both float weights and codes for {key}")
        codes, scale = state.pop(key + CODES, None), state.pop(key + SCALE, None)
        bits, axis = expected[key]
        if codes is None or scale is None or codes.dtype != _code_dtype(bits):
            raise ValueError(f"{source / 'model.pt'} does not hold the codes of {key} that quant_config.json lists")
        qmax = 2 ** (bits - 1) - 1
        reach = int(codes.to(torch.int32).abs().max()) if codes.numel() else 0  # |-128| is -128 in int8
        if reach > qmax:
            raise ValueError(f"{source / 'model.pt'}: the codes of {key} reach {reach}, outside the {bits}-bit range "
                             f"+-{qmax}")
        if not scale.is_floating_point() or not bool(torch.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"{source / 'model.pt'}: the scales of {key} are not all positive finite floats")
        shape = () if axis is None else tuple(n if d == axis % codes.dim() else 1 for d, n in enumerate(codes.shape))
        if scale.shape != shape:
            raise ValueError(f"{source / 'model.pt'}: the codes of {key} ({tuple(codes.shape)}) and their scales "
                             f"({tuple(scale.shape)}) do not fit together")
        state[key] = _decode_weight(codes, scale, dtype)


def _digest(meta: dict, hf_config: object) -> str:
    """SHA-256 of the quantization record (without its digest) and of config.json's content: a saved directory whose
    options were edited afterwards would load and re-quantize ``model.pt``'s float weights under the new options,
    a plausible model computing something else."""
    record = {k: v for k, v in meta.items() if k != "digest"}
    text = json.dumps([record, hf_config], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _init_kwargs(model: nn.Module) -> dict:
    """Constructor arguments the config does not hold: a BERT-style encoder built without its pooler
    (``BertModel(config, add_pooling_layer=False)``, what sentence encoders use) must be rebuilt so."""
    return {"add_pooling_layer": False} if hasattr(model, "pooler") and model.pooler is None else {}


def _check_state(model: nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    """One line naming what does not fit when ``model.pt`` is not the state of the model the configs describe."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        parts = [f"{len(v)} {what} (first: {v[0]})" for v, what in ((missing, "missing"), (unexpected, "unexpected"),
                                                                   (shapes, "of another shape")) if v]
        raise ValueError(f"{source / 'model.pt'} does not match the model of {source / 'config.json'} and "
                         f"quant_config.json: tensors {'; '.join(parts)}")


def load(path: str | os.PathLike) -> nn.Module:
    """Rebuild a quantized model saved by :func:`save`."""
    source = Path(path)
    missing = [f for f in ("config.json", "quant_config.json", "model.pt") if not (source / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{source} is not a softq quantized model directory (missing {', '.join(missing)})")
    try:
        meta = json.loads((source / "quant_config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{source / 'quant_config.json'} is not valid JSON ({err})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{source / 'quant_config.json'} is not a softq quantization record")
    if meta.get("format") not in (1, FORMAT_VERSION):
        raise ValueError(f"{source}: unsupported softq format {meta.get('format')!r} (this softq reads 1 to "
                         f"{FORMAT_VERSION})")
    raw = meta.get("quant_config")
    if not isinstance(raw, dict) or not isinstance(meta.get("softmax_outputs", {}), dict):
        raise ValueError(f"{source / 'quant_config.json'} is not a softq quantization record (no 'quant_config')")
    if "digest" not in meta and meta.get("format") != 1:  # the digest is older than format 2: an edited file
        raise ValueError(f"{source / 'quant_config.json'} has no digest: it was changed after softq saved it")
    if "digest" in meta:  # directories saved before the digest existed load as they are
        try:
            hf_raw = json.loads((source / "config.json").read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{source / 'config.json'} is not valid JSON ({err})") from None
        if meta["digest"] != _digest(meta, hf_raw):
            raise ValueError(f"{source}: quant_config.json or config.json was changed after softq saved them (their "
                             "digest differs); the weights were quantized with the saved options: re-quantize the "
                             "float model (softq quantize) to change them")
    init_kwargs = meta.get("init_kwargs", {})
    records = meta.get("softmax_outputs", {})
    if not isinstance(init_kwargs, dict) or not all(
            isinstance(r, dict) and r.get("granularity", "") in (None, *BIAS_CORRECTION_GRANULARITIES)
            and isinstance(r.get("causal_rows"), bool) for r in records.values()):
        raise ValueError(f"{source / 'quant_config.json'} is not a softq quantization record (malformed "
                         f"{'init_kwargs' if not isinstance(init_kwargs, dict) else 'softmax_outputs'})")
    raw.setdefault("softmax_output", "edge")  # saved before the field existed: the uniform edge codes
    raw.setdefault("embedding_bits", None)  # saved before the field existed: float embedding tables
    raw.setdefault("embedding_min_rows", EMBEDDING_MIN_ROWS)  # saved before the field existed: the constant it replaced
    raw.setdefault("input_smoothing", None)  # saved before the field existed: no input smoothing
    raw.setdefault("residual_prefix", 0)  # saved before the field existed: no prefix-token scales
    if raw.get("quantize_residual") is False:  # the layout of a residual stream a file left float means nothing
        raw["residual_groups"] = raw["residual_prefix"] = "auto"
    raw.setdefault("softmax_input", "tensor")  # saved before the field existed: one calibrated grid per tensor
    raw.setdefault("weight_bias_correction", False)  # saved before the field existed: biases as trained
    raw.setdefault("smoothing_into_v", False)  # saved before the field existed: nothing folded into V
    raw.setdefault("kv_cache", "float")  # saved before the field existed: Hugging Face's float cache
    raw.setdefault("kv_scales", "tensor")  # saved before the field existed: per-tensor K and V scales
    # settings a file may hold from before QuantConfig refused them as doing nothing: read as what they did
    if raw.get("softmax_bits") is None:  # a float softmax: no softmax grid, whatever the file says
        raw["softmax_input"] = "auto" if raw.get("softmax_input") in ("row", "tensor") else raw["softmax_input"]
        raw["softmax_scale"] = "fixed"
    if raw.get("observer", "minmax") != "percentile":  # no percentile observer read it
        raw["percentile"] = DEFAULT_PERCENTILE
    if raw.get("smoothing_into_v") is True and (raw.get("input_smoothing") is None
                                                or raw.get("weight_per_channel") is False):
        raw["smoothing_into_v"] = False  # it folded nothing
    try:
        config = QuantConfig(**{**raw, "exclude": tuple(raw.get("exclude", ()))})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source / 'quant_config.json'}: {err}") from None
    if config.softmax_input == "auto" and config.softmax_bits is not None:  # "auto" meant "row" for row codes
        # before it meant "float": the file's grid
        was = meta.get("softmax_input_resolved") or ("tensor" if config.softmax_output == "edge" else "row")
        if was != config.resolved_softmax_input:
            config = dataclasses.replace(config, softmax_input=was)
    try:
        hf_config = transformers.AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(f"{source / 'config.json'}: {error_line(err)}") from None
    arch = (hf_config.architectures or [None])[0]
    from softq.hf import architecture_class

    model_class = architecture_class(hf_config)
    if model_class is None:
        raise ValueError(f"{source}/config.json names no known Hugging Face architecture ({arch!r})")
    try:
        state = torch.load(source / "model.pt", map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - truncated, not a torch file, or unpicklable: all one answer
        raise ValueError(f"{source / 'model.pt'} cannot be read (truncated or not saved by softq: {error_line(err)})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{source / 'model.pt'} is not a state dict saved by softq")
    # the precision the model was quantized in: a float16 / bfloat16 model rebuilt in float32 computed something
    # else (its quantizers' buffers were built in float32 and the weights cast to them); files from before the
    # record: the weights' own dtype
    dtype = getattr(torch, str(meta.get("dtype", "")), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        dtype = _weights_dtype(v for k, v in state.items() if k.endswith((".weight", ".original")))
    try:
        model = model_class(hf_config, **init_kwargs).to(dtype).eval()
    except TypeError as err:
        raise ValueError(f"{source / 'quant_config.json'}: init_kwargs do not fit {arch} ({err})") from None
    configure_from_config(model)
    prepare(model, config)
    modules = dict(model.named_modules())
    for name, module in modules.items():  # per-group activation points keep vector scales
        for buffer in ("scale", "zero_point"):
            saved = state.get(f"{name}.{buffer}")
            if isinstance(module, ActQuantizer) and saved is not None and saved.shape != getattr(module, buffer).shape:
                setattr(module, buffer, torch.zeros_like(saved))
        for buffer in ("input_scale", "bias_shift"):  # smoothed Linear inputs, weight bias correction
            saved = state.get(f"{name}.{buffer}")
            if isinstance(module, QLinear) and saved is not None and saved.shape != getattr(module, buffer).shape:
                setattr(module, buffer, torch.zeros_like(saved))
        saved = state.get(f"{name}.parametrizations.bias.0.shift")  # a weight-only conv's bias correction
        if saved is not None and isinstance(module, nn.Conv2d) and not parametrize.is_parametrized(module, "bias"):
            parametrize.register_parametrization(module, "bias", BiasShift(torch.zeros_like(saved)))
    for name, info in records.items():
        quantizer = modules.get(name)
        if not isinstance(quantizer, SoftmaxOutputQuantizer):
            raise ValueError(f"{source / 'quant_config.json'} names a softmax quantizer {name!r} the model does not have")
        for buffer in ("beta", "beta_head"):
            if f"{name}.{buffer}" in state:
                setattr(quantizer, buffer, torch.zeros_like(state[f"{name}.{buffer}"]))
        quantizer.granularity = info["granularity"]
        quantizer.causal_rows = info["causal_rows"]
    if meta.get("coded_weights"):
        _decode_weights(model, state, meta["coded_weights"], source)
    _check_state(model, state, source)
    model.load_state_dict(state, strict=True)
    # sensitivity refuses such a model: its float weights are its codes' (still set after a fine-tune moved them)
    model.softq_weights_quantized = bool(meta.get("coded_weights") or meta.get("weights_quantized"))
    for m in model.modules():
        if hasattr(m, "observer"):
            m.observer = None
    set_mode(model, "quant")
    return model
