"""A worker's on-disk cache of weight slices, so a restarted worker is not sent its weights again
(distributed-llama's workers re-download everything at every start).

Content-addressed: a slice is stored under its sha256, so the key covers the model, the plan and
the slice at once, and identical slices are shared. Files are memory-mapped when used, so the
page cache holds them, not the worker's heap. Writes go through a temporary file and a rename,
so a crash never leaves a partial slice under a valid name.

The digests come from the root, that is from the network: the cache only ever touches regular
files named `<64 lowercase hex>.bin` directly inside its folder, whatever a manifest says.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .slices import DIGEST, TensorEntry, checksum


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dllama" / "slices"


class SliceCache:
    def __init__(self, directory: str | os.PathLike | None):
        self.dir = Path(directory).resolve() if directory else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, entry: TensorEntry) -> Path | None:
        """Where entry's slice lives, or None if the cache is off or the digest is not one (it
        is then no name of ours: nothing is read, written or removed for it)."""
        if self.dir is None or not isinstance(entry.sha256, str) or not DIGEST.fullmatch(entry.sha256):
            return None
        path = self.dir / f"{entry.sha256}.bin"
        return path if path.parent == self.dir else None

    def _own_file(self, path: Path | None) -> bool:
        """A regular file of ours: not a symlink (its target may be anyone's), inside the folder."""
        return path is not None and not path.is_symlink() and path.is_file()

    def has(self, entry: TensorEntry) -> bool:
        p = self._path(entry)
        return self._own_file(p) and p.stat().st_size == entry.nbytes

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
        path = self._path(entry)
        if self._own_file(path):
            path.unlink(missing_ok=True)
        return None

    def store(self, entry: TensorEntry, raw: np.ndarray) -> None:
        path = self._path(entry)
        if path is None or self.has(entry):
            return
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            with open(tmp, "xb") as f:  # x: never write through a file or link someone left there
                f.write(memoryview(raw))
            os.replace(tmp, path)
        except OSError:
            if self._own_file(tmp):
                tmp.unlink(missing_ok=True)  # a full disk only costs the cache, never the session
