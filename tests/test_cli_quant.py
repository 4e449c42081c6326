"""softq's quantize, report and export commands end to end on tiny reference models (trained in seconds), through
benchmarks/reference.py, which runs the same handlers with the model read from the reference workloads."""

from __future__ import annotations

import json
import re

import pytest

from reference import main
from softq.cli import main as softq_main


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SOFTQ_CACHE", str(tmp_path_factory.getbasetemp() / "softq-cache"))


def test_quantize_cli_evaluates_and_saves(tmp_path, capsys) -> None:
    out = tmp_path / "q"
    assert main(["quantize", "vit", "--size", "tiny", "--softmax-output", "edge", "--bias-correction", "head",
                 "--eval-limit", "64", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "float     top-1 %" in text and "quantized top-1 %" in text
    # what input_smoothing="auto" chose, with each candidate's error on the held-out calibration pieces
    assert re.search(r"input smoothing: (none|alpha [0-9.]+)( at the inputs that fold into a LayerNorm)? \(auto: "
                     r".*none [0-9.e-]+, alpha 0\.6 .*at LayerNorm-folded inputs only", text), text
    assert (out / "model.pt").is_file()
    assert json.loads((out / "quant_config.json").read_text())["coded_weights"]  # int8 codes by default
    assert main(["quantize", "vit", "--size", "tiny", "--output", str(tmp_path / "f"), "--no-eval",
                 "--float-weights"]) == 0
    assert "coded_weights" not in json.loads((tmp_path / "f" / "quant_config.json").read_text())
    assert main(["quantize", "vit", "--size", "tiny", "--no-eval", "--float-weights"]) == 1  # says how --output saves
    assert "--float-weights says how --output saves the model: pass --output DIR too" in capsys.readouterr().err
    # an existing output is not overwritten without --overwrite, and the failure is a clear message
    assert main(["quantize", "vit", "--size", "tiny", "--output", str(out), "--no-eval"]) == 1
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    # settings that only apply when export quantizes the model itself are refused for a saved one
    assert softq_main(["export", str(out), "--softmax-bits", "0", "-o", str(tmp_path / "m.onnx")]) == 1
    err = capsys.readouterr().err
    assert "--softmax-bits apply when MODEL is quantized here" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m.onnx").exists()


def test_quantize_cli_refuses_bad_bits(tmp_path, capsys) -> None:
    assert main(["quantize", "lm", "--size", "tiny", "--softmax-bits", "1"]) == 1
    assert "softmax_bits must be an integer from 2 to 16" in capsys.readouterr().err
    assert main(["quantize", "lm", "--size", "tiny", "--bias-correction", "head"]) == 1
    assert "zero by construction for softmax_output='row'" in capsys.readouterr().err
    assert main(["quantize", "lm", "--size", "tiny", "--embedding-min-rows", "0"]) == 1
    assert "embedding_min_rows must be a positive integer, got 0" in capsys.readouterr().err
    # row_log is 4-bit only; the export command checks its settings before it loads or trains anything
    assert main(["quantize", "lm", "--size", "tiny", "--softmax-output", "row_log"]) == 1
    assert "'row_log' is defined for 4-bit softmax outputs" in capsys.readouterr().err
    assert main(["export", "lm", "--softmax-output", "row_log", "--softmax-bits", "8", "-o", str(tmp_path / "m.onnx")]) == 1
    err = capsys.readouterr().err
    assert "got softmax_bits=8" in err and len(err.strip().splitlines()) == 1


def test_report_cli_prints_tables_and_writes_plot(tmp_path, capsys) -> None:
    png = tmp_path / "r.png"
    assert main(["report", "lm", "--size", "tiny", "--eval-limit", "2", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "sink-rate" in text and "kurtosis" in text and "sensitivity: held-out loss (nats)" in text and "all (W8A8)" in text
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "r-sensitivity.png").read_bytes()[:4] == b"\x89PNG"
    # an existing plot is kept unless asked (was replaced without a word), refused before any work
    before = png.read_bytes()
    assert main(["report", "lm", "--size", "tiny", "--eval-limit", "2", "--plot", str(png)]) == 1
    assert "already exists; pass --overwrite" in capsys.readouterr().err and png.read_bytes() == before


def test_reference_cli_refuses_a_context_of_zero(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["quantize", "lm", "--context", "0"])
    assert exit_.value.code == 2 and "expected a positive" in capsys.readouterr().err


def test_quantize_cli_steps_and_family_select_another_cached_model(tmp_path_factory, capsys) -> None:
    cache = tmp_path_factory.getbasetemp() / "softq-cache"
    assert main(["quantize", "lm", "--family", "llama", "--size", "tiny", "--steps", "7", "--eval-limit", "1"]) == 0
    assert "quantized perplexity" in capsys.readouterr().out
    assert [p.name for p in cache.glob("lm-*-steps7-*")] == ["lm-llama-tiny-vanilla-seed0-steps7-v1"]
    assert main(["quantize", "vit", "--family", "llama", "--size", "tiny"]) == 1
    assert "the vit workload has none" in capsys.readouterr().err


def test_import_softq_exposes_its_parts_lazily() -> None:
    """`import softq` loads no torch; its parts (softq.export, softq.mpc, ...) are attributes on first use."""
    import subprocess
    import sys

    code = ("import sys, softq; assert 'torch' not in sys.modules; "
            "assert callable(softq.export.to_onnx) and callable(softq.mpc.run) and callable(softq.quant.load); "
            "assert softq.calib.__name__ == 'softq.calib' and {'quantize', 'save', 'load', 'to_onnx', 'QuantConfig'} <= set(softq.__all__); "
            "print(all(hasattr(softq, p) for p in softq.PARTS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]
    import softq

    with pytest.raises(AttributeError, match="module 'softq' has no attribute 'nope'"):
        softq.nope  # noqa: B018


def test_quantize_cli_can_keep_the_trained_biases() -> None:
    import argparse

    from softq.quant.cli import _add_quant_options, _config

    parser = argparse.ArgumentParser()
    _add_quant_options(parser)
    assert _config(parser.parse_args([])).weight_bias_correction is True
    assert _config(parser.parse_args(["--no-weight-bias-correction"])).weight_bias_correction is False


def test_quantize_cli_smoothing_into_v_is_auto_on_or_off() -> None:
    import argparse

    from softq.quant.cli import _add_quant_options, _config

    parser = argparse.ArgumentParser()
    _add_quant_options(parser)
    assert _config(parser.parse_args([])).smoothing_into_v == "auto"
    assert _config(parser.parse_args(["--smoothing-into-v"])).smoothing_into_v is True  # the bare flag: on
    assert _config(parser.parse_args(["--smoothing-into-v", "on"])).smoothing_into_v is True
    assert _config(parser.parse_args(["--smoothing-into-v", "off"])).smoothing_into_v is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--smoothing-into-v", "yes"])


def test_quantize_cli_sets_the_percentile_of_the_percentile_observer() -> None:
    """The percentile observer's clip had no flag (always 99.99); given with another observer it does nothing."""
    import argparse

    from softq.quant.cli import _add_quant_options, _config

    parser = argparse.ArgumentParser()
    _add_quant_options(parser)
    config = _config(parser.parse_args(["--observer", "percentile", "--percentile", "99.9"]))
    assert config.observer == "percentile" and config.percentile == 99.9
    assert _config(parser.parse_args([])).percentile == 99.99
    with pytest.raises(ValueError, match="observer='minmax' does not read it"):
        _config(parser.parse_args(["--percentile", "99.9"]))


@pytest.mark.parametrize("command", ["quantize", "report", "export"])
def test_softq_cli_carries_no_reference_model_flags(command, capsys) -> None:
    """The installed CLI is for the user's models: the reference models' flags live in benchmarks/reference.py."""
    from softq.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    text = capsys.readouterr().out
    assert not {"--seed", "--steps", "--size", "--context"} & set(re.findall(r"--[a-z-]+", text)), text
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--help"])
    assert "invalid choice: 'train'" in capsys.readouterr().err
    assert softq_main([command, "lm", *(["-o", "x.onnx"] if command == "export" else [])]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lm" in err, err
