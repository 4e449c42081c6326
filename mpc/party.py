"""One party of an encrypted inference: the process entry point and its steps.

Roles (explicit, public): the **model owner** (rank ``owner``, default 0) holds the
weights and secret-shares them; the **client** (rank ``client``, default 1) holds
the input, secret-shares it and is the only party the output is revealed to.
Further ranks (world size > 2) hold shares and compute but own nothing.  With
CrypTen's TTP provider, a dealer process of rank ``world_size`` hands out the
Beaver triples (``--role ttp``).

Start every party on its own host with the same rendezvous::

    softq mpc party --rank 0 --world-size 2 --rendezvous tcp://HOST0:29500 --model DIR
    softq mpc party --rank 1 --world-size 2 --rendezvous tcp://HOST0:29500 \\
        --model-config DIR/config.json --inputs inputs.pt --output out.pt

(``RANK``, ``WORLD_SIZE`` and ``RENDEZVOUS`` environment variables work too.)
Before any computation the parties compare a public fingerprint of the
architecture, the exported graph and the surrogate choice, and stop if they differ.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from softq.mpc._crypten_shim import load_crypten
from softq.mpc.errors import ModelMismatchError, MPCError

FAULT_ENV = "SOFTQ_MPC_FAULT"  # test hook: "<rank>:<stage>" makes that party die at that stage
WIRE_LOG_ENV = "SOFTQ_MPC_WIRE_LOG"  # test hook: directory where each party records every message
_COMM_METHODS = ("send", "recv", "isend", "irecv", "broadcast", "all_reduce", "reduce", "gather",
                 "all_gather", "scatter", "send_obj", "recv_obj", "broadcast_obj")


@dataclass
class PartySettings:
    rank: int
    world_size: int = 2
    rendezvous: str = "tcp://127.0.0.1:29500"
    owner: int = 0
    client: int = 1
    provider: str = "TFP"
    timeout: float = 60.0
    model_dir: str | None = None  # owner: a save_pretrained directory
    model_config: str | None = None  # others: the public config.json
    inputs: str | None = None  # client: torch.save'd dict of input tensors
    output: str | None = None  # client: where the revealed outputs go
    report: str | None = None  # optional: this party's communication report (JSON)
    surrogates: dict[str, Any] = field(default_factory=dict)  # configure_surrogates kwargs
    role: str = "party"  # or "ttp"
    truncation: str = "exact"  # or "probabilistic" (CrypTen's own; fails now and then, see softq.mpc.truncation)
    calibration: str | None = None  # owner: torch.save'd input dict (or list of dicts) for the range check
    range_margin: float = 2.0  # softq.mpc.ranges.RangeConfig.margin


def _fault(rank: int, stage: str) -> None:
    want = os.environ.get(FAULT_ENV, "")
    if want == f"{rank}:{stage}":
        print(f"party {rank}: injected fault at {stage}", file=sys.stderr, flush=True)
        os._exit(3)


def configure_crypten(provider: str, truncation: str = "exact") -> Any:
    """Load CrypTen and set softq's configuration (verbose counters, provider, truncation, positive reciprocals)."""
    from softq.mpc.truncation import set_truncation

    crypten = load_crypten()
    if provider not in ("TFP", "TTP"):
        raise ValueError(f"unknown CrypTen provider '{provider}'; use TFP or TTP")
    set_truncation(truncation)
    crypten.cfg.communicator.verbose = True
    crypten.cfg.mpc.provider = provider
    # Every reciprocal softq asks for has a positive denominator (softmax sums), so the
    # secure sign computation is skipped; generic divisions in a graph turn it back on.
    crypten.cfg.functions.reciprocal_all_pos = True
    return crypten


def init_communicator(s: PartySettings) -> Any:
    """crypten.init over gloo with a bounded timeout for joining and for every exchange."""
    import torch.distributed as dist

    crypten = configure_crypten(s.provider, s.truncation)
    os.environ.update(
        RANK=str(s.rank), WORLD_SIZE=str(s.world_size), RENDEZVOUS=s.rendezvous, DISTRIBUTED_BACKEND="gloo"
    )
    td = datetime.timedelta(seconds=s.timeout)
    orig_init, orig_new = dist.init_process_group, dist.new_group
    dist.init_process_group = functools.partial(orig_init, timeout=td)  # type: ignore[assignment]
    dist.new_group = lambda *a, **k: orig_new(*a, **{**k, "timeout": k.get("timeout") or td})  # type: ignore[assignment]
    try:
        crypten.init()
    except Exception as err:  # noqa: BLE001 - torch raises several types here
        raise MPCError(
            f"party {s.rank}: could not reach all {s.world_size} parties at {s.rendezvous} within "
            f"{s.timeout:.0f} s ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        ) from err
    finally:
        dist.init_process_group, dist.new_group = orig_init, orig_new  # type: ignore[assignment]
    return crypten


class WireLog:
    """Records every tensor and object a party sends or receives through CrypTen's communicator."""

    def __init__(self, comm: Any) -> None:
        import pickle

        self.messages: list[torch.Tensor] = []
        for name in _COMM_METHODS:
            orig = getattr(comm, name)

            def wrapped(*args: Any, __orig: Any = orig, **kwargs: Any) -> Any:
                result = __orig(*args, **kwargs)
                for x in (*args, *kwargs.values(), result):
                    self._keep(x, pickle)
                return result

            setattr(comm, name, wrapped)

    def _keep(self, x: Any, pickle: Any) -> None:
        if isinstance(x, torch.Tensor):
            self.messages.append(x.detach().clone().reshape(-1))
        elif isinstance(x, (list, tuple)):
            for y in x:
                self._keep(y, pickle)
        elif x is not None and not isinstance(x, (int, float, str, bool)) and not hasattr(x, "wait"):
            try:
                self.messages.append(torch.frombuffer(bytearray(pickle.dumps(x)), dtype=torch.uint8).clone())
            except Exception:  # noqa: BLE001 - unpicklable handles are not messages
                pass

    def save(self, directory: str, rank: int) -> None:
        _atomic_save(self.messages, Path(directory) / f"wire{rank}.pt")


def _load_model(s: PartySettings) -> torch.nn.Module:
    import transformers

    if s.rank == s.owner:
        if not s.model_dir:
            raise ValueError(f"party {s.rank} is the model owner and needs --model (a save_pretrained directory)")
        config = transformers.AutoConfig.from_pretrained(s.model_dir)
    else:
        if not s.model_config:
            raise ValueError(f"party {s.rank} needs the owner's public --model-config (config.json)")
        config = transformers.AutoConfig.from_pretrained(s.model_config)
    archs = getattr(config, "architectures", None) or []
    if not archs or not hasattr(transformers, archs[0]):
        raise ValueError(f"config has no usable 'architectures' entry ({archs}); save the model with save_pretrained")
    cls = getattr(transformers, archs[0])
    if s.rank == s.owner:
        model = cls.from_pretrained(s.model_dir)
    else:
        torch.manual_seed(0)  # the weights are never used; only their shapes
        model = cls._from_config(config)
    return model.eval()


def _config_hash(model: torch.nn.Module) -> str:
    d = {k: v for k, v in model.config.to_dict().items()
         if not k.startswith("_") and not k.startswith("softq") and k not in ("transformers_version", "name_or_path")}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(model: torch.nn.Module, ep: Any, spec: Any, provider: str, shapes: Mapping[str, Any]) -> dict[str, str]:
    """Public fingerprint, compared by all parties before any secret is shared."""
    from softq.mpc.graph import graph_fingerprint, public_state_fingerprint
    from softq.mpc.truncation import truncation_mode

    crypten = load_crypten()
    return {
        "architecture": _config_hash(model),
        "surrogates": hashlib.sha256(spec.to_json().encode()).hexdigest()[:16],
        "graph": graph_fingerprint(ep),
        "public tensors": public_state_fingerprint(ep),
        "input shapes": json.dumps({k: list(v) for k, v in sorted(shapes.items())}),
        "crypten settings": f"{provider}/precision={crypten.cfg.encoder.precision_bits}/truncation={truncation_mode()}",
    }


def check_fingerprints(rank: int, mine: dict[str, str]) -> None:
    import torch.distributed as dist

    from softq.mpc.graph import load_crypten as _  # noqa: F401 - CrypTen already initialised

    comm = load_crypten().communicator.get()
    gathered: list[Any] = [None] * comm.get_world_size()
    dist.all_gather_object(gathered, mine, group=comm.main_group)
    for other_rank, theirs in enumerate(gathered):
        diff = [k for k in mine if theirs.get(k) != mine[k]]
        if diff:
            details = "; ".join(f"{k}: party {rank} has {mine[k]}, party {other_rank} has {theirs.get(k)}" for k in diff)
            raise ModelMismatchError(f"party {rank}: the parties' models differ ({details}); nothing was computed")


def owner_range_check(s: PartySettings, ep: Any, comm: Any) -> None:
    """The owner checks value ranges on its calibration inputs; every party stops if they do not fit."""
    from softq.mpc.ranges import RangeConfig, RangeError, check_ranges, range_pass

    verdict = ""  # CrypTen cannot broadcast None
    if s.rank == s.owner and s.calibration:
        calib = torch.load(s.calibration, weights_only=True)
        try:
            check_ranges(range_pass(ep, calib if isinstance(calib, list) else [calib]), RangeConfig(s.range_margin))
        except RangeError as err:
            verdict = str(err)
    verdict = comm.broadcast_obj(verdict, s.owner)
    if verdict:
        raise RangeError(f"party {s.rank}: {verdict}")


def _atomic_save(obj: Any, path: str | Path, as_json: bool = False) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    if as_json:
        tmp.write_text(json.dumps(obj, indent=1))
    else:
        torch.save(obj, tmp)
    os.replace(tmp, path)


def run_party(s: PartySettings) -> dict[str, Any] | None:
    """Run one party to completion; the client gets the revealed outputs back."""
    from softq.mpc.accounting import CommRecorder
    from softq.mpc.graph import (PUBLIC_INPUTS, SECRET_INPUTS, GraphInterpreter, SecretOneHot, example_inputs,
                                 export_model, public_positions)
    from softq.mpc.surrogates import configure_surrogates

    _fault(s.rank, "start")
    torch.set_num_threads(1)
    if s.role == "ttp":
        from softq.mpc.truncation import install_ttp_server

        crypten = init_communicator(s)
        install_ttp_server()
        crypten.mpc.provider.TTPServer()
        return None
    if not (0 <= s.owner < s.world_size and 0 <= s.client < s.world_size):
        raise ValueError(f"owner {s.owner} / client {s.client} must be ranks below world size {s.world_size}")
    if s.owner == s.client and s.world_size > 1:
        raise ValueError("the model owner and the client must be different parties")
    client_inputs: dict[str, torch.Tensor] = {}
    if s.rank == s.client:
        if not s.inputs:
            raise ValueError(f"party {s.rank} is the client and needs --inputs")
        client_inputs = dict(torch.load(s.inputs, weights_only=True))
        unknown = set(client_inputs) - set(SECRET_INPUTS) - set(PUBLIC_INPUTS)
        if unknown:
            raise ValueError(f"unsupported model inputs {sorted(unknown)}; use {SECRET_INPUTS + PUBLIC_INPUTS}")
    model = _load_model(s)  # before joining: loading errors then surface on their own
    if s.rank == s.client:
        client_inputs = public_positions(model, client_inputs)  # RoBERTa's positions, from the public mask
    crypten = init_communicator(s)
    comm = crypten.communicator.get()
    wire = WireLog(comm) if os.environ.get(WIRE_LOG_ENV) else None
    _fault(s.rank, "joined")
    try:
        # 1. The client publishes shapes and public inputs (masks), never the secret ones.
        meta = {
            "shapes": {k: tuple(v.shape) for k, v in client_inputs.items()},
            "public": {k: v for k, v in client_inputs.items() if k in PUBLIC_INPUTS},
        } if s.rank == s.client else None
        meta = comm.broadcast_obj(meta, s.client)
        # 2. Everybody exports the same public graph and checks that it is the same.
        spec = configure_surrogates(model, **s.surrogates)
        ep = export_model(model, example_inputs(model, meta["shapes"], meta["public"]))
        check_fingerprints(s.rank, fingerprint(model, ep, spec, s.provider, meta["shapes"]))
        _fault(s.rank, "fingerprinted")
        owner_range_check(s, ep, comm)
        comm.reset_communication_stats()
        recorder = CommRecorder(comm)
        interp = GraphInterpreter(ep, recorder)
        t0 = time.perf_counter()
        with crypten.no_grad():
            # 3. The owner shares its weights, the client its input (no plaintext leaves either).
            params = {}
            for name, shape in interp.parameter_shapes().items():
                value = ep.state_dict[name] if s.rank == s.owner else torch.empty(shape)
                params[name] = crypten.cryptensor(value.detach().float(), src=s.owner)
            inputs: dict[str, Any] = dict(meta["public"])
            for name, shape in meta["shapes"].items():
                if name == "input_ids":
                    vocab = model.get_input_embeddings().weight.shape[0]
                    onehot = (torch.nn.functional.one_hot(client_inputs[name].long(), vocab).float()
                              if s.rank == s.client else torch.empty(*shape, vocab))
                    inputs[name] = SecretOneHot(crypten.cryptensor(onehot, src=s.client), tuple(shape))
                elif name in SECRET_INPUTS:
                    value = client_inputs[name].float() if s.rank == s.client else torch.empty(shape)
                    inputs[name] = crypten.cryptensor(value, src=s.client)
            _fault(s.rank, "shared")
            outputs = interp.run(params, inputs)
            # 4. Only the client learns the result.
            revealed = []
            with recorder.op("reveal", "head"):
                for out in outputs:
                    if isinstance(out, torch.Tensor) or out is None or not hasattr(out, "get_plain_text"):
                        revealed.append(out)
                    else:
                        revealed.append(out.get_plain_text(dst=s.client))
        wall = time.perf_counter() - t0
        report = recorder.report(rank=s.rank, world_size=s.world_size, provider=s.provider, wall_seconds=wall,
                                 truncation=s.truncation)
        if s.report:
            _atomic_save(report.to_dict(), s.report, as_json=True)
        result = None
        if s.rank == s.client:
            result = {"outputs": revealed, "report": report.to_dict(), "fingerprint": None}
            if s.output:
                _atomic_save(result, s.output)
        comm.barrier()
        if wire is not None:
            wire.save(os.environ[WIRE_LOG_ENV], s.rank)
        return result
    except ModelMismatchError:
        raise
    except MPCError:
        raise
    except RuntimeError as err:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        if any(w in text.lower() for w in ("connection", "timed out", "timeout", "peer", "gloo", "closed")):
            raise MPCError(f"party {s.rank}: lost contact with another party ({text}); stopping") from err
        raise


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="softq mpc party", description=__doc__.split("\n\n")[0])
    env = os.environ
    p.add_argument("--rank", type=int, default=int(env["RANK"]) if "RANK" in env else None,
                   help="this party's rank (env RANK)")
    p.add_argument("--world-size", type=int, default=int(env.get("WORLD_SIZE", 2)), help="number of parties (env WORLD_SIZE)")
    p.add_argument("--rendezvous", default=env.get("RENDEZVOUS", "tcp://127.0.0.1:29500"),
                   help="tcp://HOST:PORT of rank 0 (env RENDEZVOUS)")
    p.add_argument("--owner", type=int, default=0, help="rank of the model owner")
    p.add_argument("--client", type=int, default=1, help="rank of the client (input holder, sees the output)")
    p.add_argument("--provider", choices=("TFP", "TTP"), default="TFP",
                   help="Beaver triple provider: TFP trusts party 0, TTP runs a dealer (--role ttp)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a party or a message")
    p.add_argument("--model", dest="model_dir", help="owner: save_pretrained directory with the weights")
    p.add_argument("--model-config", help="non-owner: the owner's public config.json")
    p.add_argument("--inputs", help="client: torch.save'd dict (input_ids/attention_mask or pixel_values)")
    p.add_argument("--output", help="client: where to write the revealed outputs (torch.save)")
    p.add_argument("--report", help="write this party's communication report (JSON) here")
    p.add_argument("--softmax", default="2quad", help="softmax variant (one name, or comma list per layer)")
    p.add_argument("--gelu", default="quad", help="GELU surrogate (erf, tanh, quad, relu, native; comma list per layer)")
    p.add_argument("--role", choices=("party", "ttp"), default="party")
    p.add_argument("--calibration", help="owner: torch.save'd input dict (or list) for the plaintext range check")
    p.add_argument("--range-margin", type=float, default=2.0, help="headroom beyond the calibration ranges (>= 1)")
    p.add_argument("--truncation", choices=("exact", "probabilistic"), default="exact",
                   help="exact: dealer-assisted, never fails (default); probabilistic: CrypTen's own, "
                        "off by ~4.3e9 with probability ~|value|/2^32 per product")
    return p


def _per_layer_arg(text: str) -> Any:
    if text == "native":
        return None
    return text.split(",") if "," in text else text


def settings_from_args(args: argparse.Namespace) -> PartySettings:
    if args.rank is None:
        raise ValueError("give the party's rank with --rank or the RANK environment variable")
    return PartySettings(
        rank=args.rank, world_size=args.world_size, rendezvous=args.rendezvous, owner=args.owner,
        client=args.client, provider=args.provider, timeout=args.timeout, model_dir=args.model_dir,
        model_config=args.model_config, inputs=args.inputs, output=args.output, report=args.report,
        surrogates={"softmax": _per_layer_arg(args.softmax), "gelu": _per_layer_arg(args.gelu)}, role=args.role,
        truncation=args.truncation, calibration=args.calibration, range_margin=args.range_margin,
    )


def _exit_with_launcher() -> None:
    """A party started by softq.mpc.run stops when its launcher is gone (no orphans)."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(4)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = build_arg_parser()
    parser.add_argument("--settings-json", help=argparse.SUPPRESS)  # used by softq.mpc.run
    args = parser.parse_args(argv)
    try:
        if args.settings_json:
            s = PartySettings(**json.loads(Path(args.settings_json).read_text()))
            _exit_with_launcher()
        else:
            s = settings_from_args(args)
        result = run_party(s)
        if result is not None and not s.output:
            print(result["outputs"])
        return exit_skipping_teardown(0)
    except (MPCError, ValueError, FileNotFoundError) as err:
        print(f"softq mpc party: error: {err}", file=sys.stderr, flush=True)
        return exit_skipping_teardown(2)


def _joined() -> bool:
    """Whether this process joined the parties' process group (only then is there a teardown to skip)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def exit_skipping_teardown(code: int) -> int:
    """End a party that joined the process group now, with ``code``: at interpreter exit gloo's process-group
    teardown can find its peer gone (both parties stop at once, after their last barrier) and abort the process
    (exit -6 instead of ``code``: seen in 1 of 4 runs of a two-party script under load).  Everything a party writes
    is written (atomically) before; the output streams are flushed here.  Not joined: ``code``, to return."""
    if _joined():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
