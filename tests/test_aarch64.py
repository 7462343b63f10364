"""The kernels on the workers' real CPU: INNER_TESTS run on aarch64, where dllama/kernels/simd.py
takes its NEON path (no x86 machine runs it otherwise), in an arm64 Debian chroot under qemu-user.

`make aarch64` (tests/aarch64/build_chroot.sh, part of `make test`) builds the chroot once in
.aarch64/. The run happens in a private mount namespace: the checkout is bind-mounted read-only
at /src, /proc and a fresh tmpfs /tmp (numba's cache, pytest's tmp_path) are mounted, and all of
it goes away with the process, whatever happens to it. Tests that need llama-cpp-python are
skipped inside (tests/aarch64/inner_plugin.py)."""

from __future__ import annotations

import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The test files run inside, in one pytest process. Add files here: tests that need llama.cpp skip
# inside by themselves; keep the total reasonable under emulation (~10x slower than native).
INNER_TESTS = ["tests/test_kernels.py", "tests/test_quant.py", "tests/test_plan.py", "tests/test_batch_invariance.py"]

ROOT = Path(__file__).resolve().parent.parent
CHROOT = ROOT / ".aarch64"
ROOTFS = CHROOT / "rootfs"
BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
TIMEOUT = 1200

pytestmark = pytest.mark.slow


def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "needs Linux (chroot, binfmt_misc)"
    if platform.machine() in ("aarch64", "arm64"):
        return "this machine is aarch64: the rest of the suite runs the NEON path natively"
    if os.geteuid() != 0:
        return "needs root (mount, chroot)"
    if not (CHROOT / ".rootfs-built").exists() or not any(CHROOT.glob(".pip-*")):
        why = CHROOT / "SKIPPED"  # the line in which `make aarch64` said why it could not
        return "the aarch64 chroot is not built: " + (why.read_text().strip() if why.exists() else
                                                      "run `make aarch64`")
    try:
        registered = BINFMT.read_text().splitlines()[0] == "enabled"
    except OSError:
        registered = False
    if not registered:
        return "qemu-aarch64 is not registered with binfmt_misc: run `make aarch64`"
    return None


# Mounts in the new namespace, then the chroot. The tmpfs /tmp gives numba a fresh cache each run:
# its cache does not notice edits to the simd*.py intrinsics (only to the file that holds the jitted function).
_INNER = r"""
set -e
mount --bind "$SRC" "$R/src"
mount -o remount,bind,ro "$R/src"
mount -t proc proc "$R/proc"
mount -t tmpfs -o size=4g tmpfs "$R/tmp"
exec chroot "$R" /bin/sh -c 'cd /src && exec /opt/venv/bin/python -m pytest -p no:cacheprovider \
    -p tests.aarch64.inner_plugin --color=no "$@"' sh "$@"
"""


def test_kernels_on_aarch64_under_qemu(report_in_summary):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    (ROOTFS / "src").mkdir(exist_ok=True)
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
        "R": str(ROOTFS), "SRC": str(ROOT),
        "NUMBA_CACHE_DIR": "/tmp/numba", "HYPOTHESIS_STORAGE_DIRECTORY": "/tmp/hypothesis",
        "DLLAMA_MODELS_DIR": "/src/models",  # the read-only checkout's, which `make test` pulled
        "PYTHONDONTWRITEBYTECODE": "1",  # nothing written into the checkout from inside
        "NUMBA_NUM_THREADS": "1",  # one core: emulation is slow enough without a busy machine
    }
    start = time.monotonic()
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", _INNER, "sh",
                             *INNER_TESTS], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:  # timed out, or this test was interrupted: end the whole inner run
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    elapsed = time.monotonic() - start
    lines = out.splitlines()
    tail = "\n".join(lines[-60:])
    check = next((line for line in lines if line.startswith("aarch64-check:")), None)
    summary = next((line.strip("= ") for line in reversed(lines)
                    if re.search(r"\d+ (passed|failed|errors?|skipped)", line)), "(no summary)")
    print(f"\n{check}\naarch64 (qemu, {elapsed:.0f} s): {summary}")
    report_in_summary(f"aarch64 under qemu ({', '.join(INNER_TESTS)}): {summary}")
    assert proc.returncode == 0, f"inner run exited {proc.returncode}: {summary}\n{tail}"
    assert check and "machine=aarch64" in check and "_X86_AVX2=False" in check, tail
    for name in INNER_TESTS:  # each file was collected and ran (the progress lines name it)
        assert re.search(rf"^{re.escape(name)} [.sxX]+", out, re.M), f"{name} did not run inside\n{tail}"
    assert re.search(r"[1-9]\d* passed", summary) and not re.search(r"failed|error", summary), summary
