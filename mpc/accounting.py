"""Communication accounting of an encrypted run: rounds, bytes and time per op kind and layer.

Counts come from CrypTen's communicator with ``communicator.verbose`` on, read
before and after every graph node in a real multi-process run (the in-process
thread communicator counts nothing).  Each round is one message exchange; in a
2-party run party 0's byte count is the total on the wire.

The modeled network time ``rounds x RTT + bytes / bandwidth`` turns the counts
into a LAN or WAN estimate independent of the loopback machine the run used.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class NetworkProfile:
    name: str
    bandwidth_bps: float
    rtt_s: float

    def seconds(self, rounds: float, nbytes: float) -> float:
        return rounds * self.rtt_s + nbytes * 8.0 / self.bandwidth_bps


NETWORK_PROFILES: dict[str, NetworkProfile] = {
    "lan": NetworkProfile("lan", 1e9, 0.5e-3),  # 1 Gbit/s, 0.5 ms round trip
    "wan": NetworkProfile("wan", 100e6, 40e-3),  # 100 Mbit/s, 40 ms round trip
}


@dataclass
class CommRow:
    kind: str
    layer: str
    rounds: int = 0
    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    truncations: int = 0  # truncated elements: secret products, matmul entries, divisions by public integers


@dataclass
class CommReport:
    """Per (op kind, layer) communication of one party, plus totals."""

    rank: int = 0
    world_size: int = 2
    provider: str = "TFP"
    rows: list[CommRow] = field(default_factory=list)
    wall_seconds: float = 0.0
    truncation: str = "exact"

    @property
    def rounds(self) -> int:
        return sum(r.rounds for r in self.rows)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def truncations(self) -> int:
        return sum(r.truncations for r in self.rows)

    @property
    def compute_seconds(self) -> float:
        return sum(r.seconds for r in self.rows)

    def modeled_seconds(self, profile: str | NetworkProfile) -> float:
        p = NETWORK_PROFILES[profile] if isinstance(profile, str) else profile
        return p.seconds(self.rounds, self.bytes)

    def _group(self, key: str) -> dict[str, CommRow]:
        out: dict[str, CommRow] = {}
        for r in self.rows:
            k = getattr(r, key)
            g = out.setdefault(k, CommRow(kind=k if key == "kind" else "*", layer=k if key == "layer" else "*"))
            g.rounds += r.rounds
            g.bytes += r.bytes
            g.seconds += r.seconds
            g.calls += r.calls
            g.truncations += r.truncations
        return out

    def by_kind(self) -> dict[str, CommRow]:
        return self._group("kind")

    def by_layer(self) -> dict[str, CommRow]:
        return self._group("layer")

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "provider": self.provider,
            "wall_seconds": self.wall_seconds,
            "truncation": self.truncation,
            "rows": [asdict(r) for r in self.rows],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CommReport:
        return cls(
            rank=d["rank"], world_size=d["world_size"], provider=d["provider"],
            wall_seconds=d["wall_seconds"], rows=[CommRow(**r) for r in d["rows"]],
            truncation=d.get("truncation", "exact"),
        )

    def table(self, by: str = "kind") -> str:
        """A plain-text table (by ``kind`` or ``layer``) with totals and modeled LAN/WAN time."""
        groups = self.by_kind() if by == "kind" else self.by_layer()
        lines = [f"{by:<24} {'rounds':>7} {'MB':>10} {'trunc.':>11} {'seconds':>8} {'LAN s':>8} {'WAN s':>8}"]
        for name, g in sorted(groups.items(), key=lambda kv: -kv[1].bytes):
            lines.append(
                f"{name:<24} {g.rounds:>7d} {g.bytes / 1e6:>10.3f} {g.truncations:>11d} {g.seconds:>8.3f} "
                f"{NETWORK_PROFILES['lan'].seconds(g.rounds, g.bytes):>8.3f} "
                f"{NETWORK_PROFILES['wan'].seconds(g.rounds, g.bytes):>8.3f}"
            )
        lines.append(
            f"{'TOTAL':<24} {self.rounds:>7d} {self.bytes / 1e6:>10.3f} {self.truncations:>11d} {self.compute_seconds:>8.3f} "
            f"{self.modeled_seconds('lan'):>8.3f} {self.modeled_seconds('wan'):>8.3f}"
        )
        lines.append(f"(party {self.rank} of {self.world_size}, provider {self.provider}, truncation {self.truncation}, "
                     f"wall {self.wall_seconds:.2f} s; trunc. = truncated elements, one per secret product)")
        return "\n".join(lines)


class CommRecorder:
    """Attributes the communicator's counters to (kind, layer) around each operation."""

    def __init__(self, communicator: Any | None) -> None:
        self.comm = communicator
        self._rows: dict[tuple[str, str], CommRow] = defaultdict(lambda: CommRow("", ""))

    def _stats(self) -> tuple[int, int, int]:
        from softq.mpc.truncation import STATS

        if self.comm is None:
            return 0, 0, STATS.elements
        s = self.comm.get_communication_stats()
        return int(s["rounds"]), int(s["bytes"]), STATS.elements

    @contextlib.contextmanager
    def op(self, kind: str, layer: str) -> Iterator[None]:
        r0, b0, t_0 = self._stats()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            r1, b1, t_1 = self._stats()
            row = self._rows[(kind, layer)]
            row.kind, row.layer = kind, layer
            row.rounds += r1 - r0
            row.bytes += b1 - b0
            row.truncations += t_1 - t_0
            row.seconds += time.perf_counter() - t0
            row.calls += 1

    def report(self, **kwargs: Any) -> CommReport:
        rows = [r for r in self._rows.values() if r.rounds or r.bytes or r.seconds > 1e-3]
        return CommReport(rows=rows, **kwargs)
