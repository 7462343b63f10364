"""Who is at the other end of a connection, as errors and logs name it."""

from __future__ import annotations

from typing import NamedTuple


class PeerRef(NamedTuple):
    """Who is at the other end: rank (None if not known yet), host, port."""

    rank: int | None
    host: str
    port: int

    def __str__(self):
        addr = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        return addr if self.rank is None else f"rank {self.rank} ({addr})"
