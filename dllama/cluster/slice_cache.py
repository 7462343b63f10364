"""A worker's on-disk cache of weight slices, so a restarted worker is not sent its weights again
(distributed-llama's workers re-download everything at every start).

Content-addressed: a slice is stored under its sha256, so the key covers the model, the plan and
the slice at once, and identical slices are shared. Files are memory-mapped when used, so the
page cache holds them, not the worker's heap. Writes go through a temporary file and a rename,
so a crash never leaves a partial slice under a valid name.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .slices import TensorEntry, checksum


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dllama" / "slices"


class SliceCache:
    def __init__(self, directory: str | os.PathLike | None):
        self.dir = Path(directory) if directory else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, entry: TensorEntry) -> Path:
        return self.dir / f"{entry.sha256}.bin"

    def has(self, entry: TensorEntry) -> bool:
        if self.dir is None:
            return False
        p = self._path(entry)
        return p.exists() and p.stat().st_size == entry.nbytes

    def load(self, entry: TensorEntry) -> np.ndarray:
        if entry.nbytes == 0:
            return np.zeros(0, np.uint8)
        return np.memmap(self._path(entry), dtype=np.uint8, mode="r")

    def load_verified(self, entry: TensorEntry) -> np.ndarray | None:
        """The cached bytes of entry, or None if absent or damaged (a damaged file is removed)."""
        if not self.has(entry):
            return None
        raw = self.load(entry)
        if checksum(raw) == entry.sha256:
            return raw
        del raw
        self._path(entry).unlink(missing_ok=True)
        return None

    def store(self, entry: TensorEntry, raw: np.ndarray) -> None:
        if self.dir is None or self.has(entry):
            return
        tmp = self._path(entry).with_suffix(f".tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(memoryview(raw))
            os.replace(tmp, self._path(entry))
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk only costs the cache, never the session
