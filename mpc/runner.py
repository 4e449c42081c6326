"""``softq.mpc.run``: an encrypted inference with every party in its own process on loopback.

The caller's process plays no party: it writes the owner's weights, the public
config and the client's input into separate files, starts one process per party
(plus the dealer with the TTP provider), and reads back what the client received
and the parties' communication reports.  A party that dies or never joins makes
the others stop within ``timeout`` seconds; the launcher then reports every
party's error.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from softq.models import model_family
from softq.mpc.accounting import CommReport
from softq.mpc.errors import MPCError
from softq.mpc.party import PartySettings


@dataclass
class MPCResult:
    """What the client received, and what the run cost."""

    outputs: list[Any]
    report: CommReport  # party 0's counters (in 2-party runs: the total on the wire)
    reports: list[CommReport] = field(default_factory=list)  # every party's
    wall_seconds: float = 0.0  # launcher's view: process start to last exit

    @property
    def logits(self) -> torch.Tensor:
        return self.outputs[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_parties(
    settings: Sequence[PartySettings],
    workdir: str | Path,
    timeout: float,
    env: Mapping[str, str] | None = None,
    deadline: float | None = None,
) -> list[tuple[int, str]]:
    """Start one ``python -m softq.mpc.party`` per settings entry; wait; return (exit code, stderr).

    If a party fails, the others get ``timeout`` + 10 s to notice and stop on
    their own (they should: gloo reports the broken connection or times out);
    stragglers are then killed, so the launcher never hangs.
    """
    workdir = Path(workdir)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    base_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for i, s in enumerate(settings):
        path = workdir / f"party{i}.json"
        path.write_text(json.dumps(asdict(s)))
        log = workdir / f"party{i}.stderr"
        logs.append(log)
        with open(log, "wb") as err, open(workdir / f"party{i}.stdout", "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "softq.mpc.party", "--settings-json", str(path)],
                cwd=workdir, env=base_env, stdout=out, stderr=err,
            ))
    start = time.monotonic()
    hard_deadline = start + (deadline if deadline is not None else 3600.0)
    first_failure: float | None = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
                first_failure = now
            if first_failure is not None and now - first_failure > timeout + 10.0:
                break
            if now > hard_deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, log.read_text(errors="replace")) for p, log in zip(procs, logs)]


def _last_error(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "error" in ln.lower():
            return ln.strip()
    return lines[-1].strip() if lines else "no output"


def run(
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor] | torch.Tensor,
    softmax: str | Sequence[str] | Mapping[int, str] = "2quad",
    gelu: str | Sequence[str] | Mapping[int, str] | None = "quad",
    world_size: int = 2,
    provider: str = "TFP",
    timeout: float = 60.0,
    owner: int = 0,
    client: int = 1,
    softmax_params: Mapping[str, float] | None = None,
    workdir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    truncation: str = "exact",
    calibration: Sequence[Mapping[str, torch.Tensor]] | None = None,
    range_margin: float = 2.0,
) -> MPCResult:
    """Run ``model`` on ``inputs`` under CrypTen with ``world_size`` real processes on loopback.

    ``inputs`` is a dict of ``input_ids`` (+ ``attention_mask``, ``token_type_ids``)
    or ``pixel_values``; a bare tensor is taken as ``input_ids`` (integer) or
    ``pixel_values`` (float).  ``softmax``/``gelu`` pick the surrogates (one name
    or per layer, see :func:`softq.mpc.configure_surrogates`); ``"softmax"`` with
    ``gelu="tanh"`` is the accurate path.  ``provider`` is CrypTen's Beaver-triple
    provider (``"TFP"``: party 0 generates them; ``"TTP"``: a separate dealer
    process).  ``truncation="exact"`` (default) never fails; ``"probabilistic"`` is
    CrypTen's own (see :mod:`softq.mpc.truncation`).  Before any party starts, the
    plaintext range pass (:mod:`softq.mpc.ranges`) runs on ``inputs`` and any ``calibration``
    batches and raises :class:`softq.mpc.ranges.RangeError` naming the layer and
    op if a value, widened by ``range_margin``, would leave its safe range.  Raises
    :class:`MPCError` naming the failing party.
    """
    model_family(model)
    if world_size < 2:
        raise ValueError(f"an encrypted run needs at least 2 parties, got world_size={world_size}")
    if provider not in ("TFP", "TTP"):
        raise ValueError(f"unknown provider '{provider}'; use TFP or TTP")
    from softq.mpc.graph import public_positions
    from softq.mpc.ranges import RangeConfig, check_model
    from softq.mpc.surrogates import configure_surrogates
    from softq.mpc.truncation import TRUNCATION_MODES

    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"unknown truncation {truncation!r}; choose one of {TRUNCATION_MODES}")
    range_config = RangeConfig(range_margin)
    if isinstance(inputs, torch.Tensor):
        inputs = {"input_ids" if not inputs.is_floating_point() else "pixel_values": inputs}
    inputs = {k: v for k, v in inputs.items() if v is not None}
    public_positions(model, inputs)  # what the client party would refuse (RoBERTa's padding ids off the mask), here
    checked = copy.deepcopy(model)
    configure_surrogates(checked, softmax=softmax, gelu=gelu, softmax_params=softmax_params)
    # the run's own inputs are always checked (this launcher holds them); calibration adds batches, it never
    # replaces them: an input outside every calibrated range used to go to the parties and come back wrong
    check_model(checked, inputs, None if calibration is None else [*calibration, inputs], range_config)
    del checked
    own_tmp = workdir is None
    tmp = Path(tempfile.mkdtemp(prefix="softq-mpc-")) if own_tmp else Path(workdir)  # type: ignore[arg-type]
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "owner").mkdir(exist_ok=True)
    (tmp / "client").mkdir(exist_ok=True)
    (tmp / "public").mkdir(exist_ok=True)
    model.save_pretrained(tmp / "owner" / "model")
    (tmp / "public" / "config.json").write_text((tmp / "owner" / "model" / "config.json").read_text())
    torch.save({k: v.detach().cpu() for k, v in inputs.items()}, tmp / "client" / "inputs.pt")
    surrogates = {"softmax": softmax if isinstance(softmax, str) else (dict(softmax) if isinstance(softmax, Mapping) else list(softmax)),
                  "gelu": gelu if gelu is None or isinstance(gelu, str) else (dict(gelu) if isinstance(gelu, Mapping) else list(gelu)),
                  "softmax_params": dict(softmax_params or {})}
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    settings = []
    for rank in range(world_size):
        settings.append(PartySettings(
            rank=rank, world_size=world_size, rendezvous=rendezvous, owner=owner, client=client,
            provider=provider, timeout=timeout,
            model_dir=str(tmp / "owner" / "model") if rank == owner else None,
            model_config=str(tmp / "public" / "config.json") if rank != owner else None,
            inputs=str(tmp / "client" / "inputs.pt") if rank == client else None,
            output=str(tmp / "client" / "outputs.pt") if rank == client else None,
            report=str(tmp / f"report{rank}.json"), surrogates=surrogates, truncation=truncation,
        ))
    if provider == "TTP":
        settings.append(PartySettings(rank=world_size, world_size=world_size, rendezvous=rendezvous,
                                      provider=provider, timeout=timeout, role="ttp", truncation=truncation))
    t0 = time.perf_counter()
    results = launch_parties(settings, tmp, timeout, env=env)
    wall = time.perf_counter() - t0
    failed = [(i, code, err) for i, (code, err) in enumerate(results) if code != 0]
    if failed:
        lines = [f"party {i} exited with code {code}: {_last_error(err)}" for i, code, err in failed]
        raise MPCError("encrypted run failed:\n  " + "\n  ".join(lines) + f"\n(logs in {tmp})")
    received = torch.load(tmp / "client" / "outputs.pt", weights_only=False)
    reports = [CommReport.from_dict(json.loads((tmp / f"report{r}.json").read_text())) for r in range(world_size)]
    if own_tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return MPCResult(outputs=received["outputs"], report=reports[0], reports=reports, wall_seconds=wall)
