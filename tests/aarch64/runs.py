"""The emulated aarch64 runs that tests/test_aarch64.py reads: pytest on the kernel tests in the
arm64 chroot under qemu-user, in the background at the lowest priority. Standard library only, so
that `make test` can start the default suite's runs (`python3 tests/aarch64/runs.py start`) as soon
as the chroot is built, while llama-cpp-python compiles: they are the suite's longest part, nearly
all of it numba compiling kernels under emulation, and would otherwise wait for pytest to start.

A run's files (its output, exit code and process group) are in a folder named by a hash of the
sources and of the runs' definitions (.aarch64/runs/<hash>/), so whichever process comes next (the
pytest run, any of its xdist workers) adopts a run of the same tree and never one of another: a
run of an older tree is ended and its folder removed."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHROOT = ROOT / ".aarch64"
ROOTFS = CHROOT / "rootfs"
BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
# How long a run may take from its start (a hang ends there): a slower machine must not fail for time alone
# (make test-all's four runs share 2 cores with the host tests: the models' run alone took 17 min)
TIMEOUT = 3600
# The runs the default suite reads (the others are marked slow): `make test` starts them with the chroot
SUITE_RUNS = ("pi4", "pi5")


def skip_reason() -> str | None:
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
exec chroot "$R" /bin/sh -c 'cd /src && exec /usr/bin/python3 -m pytest -p no:cacheprovider \
    -p tests.aarch64.inner_plugin --color=no --durations 12 "$@"' sh "$@"
"""


def _lowest_priority() -> None:
    """In the run's new session (so its own scheduler autogroup, where the kernel groups by session):
    nice 19 for the group and the process, so the rest of the suite keeps the CPU it asks for."""
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:
        pass  # no autogroups (a kernel without them, or disabled): the process's nice value is enough
    os.nice(19)


class _InnerRun:
    """pytest on the files `tests` (with `options`) in the chroot, in the background at the lowest
    priority. Its output, its exit code (once it ends) and its process group go to files in `folder`,
    so that under pytest-xdist any worker (or the controller, which ends it) can find it."""

    def __init__(self, folder: Path, name: str):
        self.folder, self.name = folder, name
        self.tests, self.options, self.env = RUNS[name]
        self.log, self.rc, self.pid = (folder / f"{name}.{ext}" for ext in ("log", "rc", "pid"))

    def claim(self) -> bool:
        """True if this process is the one to start the run: no other started it, or the one that did
        ended without an exit code (killed from outside, a reboot)."""
        for _attempt in range(2):
            try:
                os.close(os.open(self.pid, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                return True
            except FileExistsError:
                if self.rc.exists() or self.alive():
                    return False
                time.sleep(1.0)  # (a pid file just made, not yet written, reads as a dead run)
                if self.rc.exists() or self.alive():
                    return False
                self.pid.unlink(missing_ok=True)
        return False

    def alive(self) -> bool:
        try:
            os.killpg(int(self.pid.read_text()), 0)
            return True
        except (OSError, ValueError):
            return False

    def start(self) -> None:
        (ROOTFS / "src").mkdir(exist_ok=True)
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
            "R": str(ROOTFS), "SRC": str(ROOT), "LOG": str(self.log), "RC": str(self.rc),
            "NUMBA_CACHE_DIR": "/tmp/numba", "HYPOTHESIS_STORAGE_DIRECTORY": "/tmp/hypothesis",
            "DLLAMA_MODELS_DIR": "/src/models",  # the read-only checkout's, which `make test` pulled
            "PYTHONPATH": "/opt/site",  # the dependencies (tests/aarch64/build_chroot.sh)
            "PYTHONDONTWRITEBYTECODE": "1",  # nothing written into the checkout from inside
            "NUMBA_NUM_THREADS": "1",  # one core each: emulation is slow enough without a busy machine
            **self.env,
        }
        wrapper = (f'timeout --foreground -s KILL {TIMEOUT} unshare --mount --propagation private sh -c "$INNER" sh "$@" > "$LOG" 2>&1; '
                   'echo $? > "$RC.part"; mv "$RC.part" "$RC"')
        proc = subprocess.Popen(["sh", "-c", wrapper, "sh", *self.tests, *self.options], env={**env, "INNER": _INNER},
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_lowest_priority)
        self.pid.write_text(str(proc.pid))  # (the session's leader: its group is the whole run)

    def result(self, deadline: float) -> tuple[int, str, str, str | None]:
        """(exit code, output, summary line, the plugin's check line), once it has ended (waiting
        until `deadline`, time.monotonic()'s, at most: then it is killed)."""
        seen_dead = 0
        while not self.rc.exists():
            seen_dead = 0 if self.alive() else seen_dead + 1
            if seen_dead >= 3 and not self.rc.exists():  # (three looks: a run just claimed has no pid yet)
                return -1, self._output() + "\n(ended without an exit code: killed?)", "(no exit code)", None
            if time.monotonic() > deadline:
                self.kill()
                return -1, self._output() + f"\n(killed: not done after {TIMEOUT} s)", "(timed out)", None
            time.sleep(1.0)
        out = self._output()
        lines = out.splitlines()
        check = next((line for line in lines if line.startswith("aarch64-check:")), None)
        summary = next((line.strip("= ") for line in reversed(lines)
                        if re.search(r"\d+ (passed|failed|errors?|skipped)", line)), "(no summary)")
        return int(self.rc.read_text().strip() or -1), out, summary, check

    def _output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        if self.rc.exists():
            return  # ended: its process group is gone (and its number may be another's by now)
        try:
            os.killpg(int(self.pid.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # not started, or ended already


# Only the tests of what is compiled per CPU run here (simd.py: the integer quad dots with and without
# sdot, IQ4_NL's table lookup, Q5's fifth bits), i.e. the quantized matmuls; numba compiling them under
# emulation is nearly all the cost (1-4 min for each kind of kernel: 32-value blocks, K-quants, floats;
# as stored, packed, spanned). The rest of the kernels are the same IR on every CPU (their order is fixed
# in it; LLVM does not reassociate floats without fast-math), and tests/test_plan.py is plain Python:
# both run natively with the rest of the suite.
_FIRST = "matmul_matches_reference or matmul_rows_do_not_depend"  # every format's dots, rows as stored
_MORE = ("matmul_on_column_slices or packed_rows or lane_sums or q8_ or row_kernels or vector_out")  # column
# slices, packed rows, the activations' layouts
_PI4 = {"DLLAMA_NO_DOTPROD": "1"}
_PI5 = {"NUMBA_CPU_NAME": "cortex-a76", "NUMBA_CPU_FEATURES": "+neon,+dotprod"}
# The runs compile numba's parallel loops as plain loops (the same bodies and intrinsics, the same bits;
# one thread, as every run has): compiling each such loop as a function of its own was about half of
# their time under qemu (the models' run with them did 11 of its 112 tests in 40 min beside the rest of
# make test-all). One run keeps them, on the first Q4_0 matmul, so the parallel kernels run on aarch64 too.
_SERIAL = {"DLLAMA_SERIAL_KERNELS": "1"}
RUNS = {  # name: (files, options, environment)
    # a Pi 4's Cortex-A72: NEON without the dot product, the quantized formats, Q5's fifth bits in the
    # generated code (and the quantizers, numpy on aarch64)
    "pi4": (["tests/test_kernels.py", "tests/test_quant.py"],
            ["-k", f"not test_kernels or (({_FIRST}) and not F16 and not F32) or q5_fifth_bits"], _PI4 | _SERIAL),
    # a Pi 5's Cortex-A76 (ARMv8.2 dot product: sdot, which qemu implements), every format, and sdot in the
    # generated code. (The float formats, no integer dots, are here rather than in the Pi 4's run: the two
    # runs then take about the same CPU and end together, instead of one running alone at the end.)
    "pi5": (["tests/test_kernels.py"], ["-k", f"{_FIRST} or sdot", "-rA"], _PI5 | _SERIAL),
    # the slow set (make test-all): the rest of the matmul tests on both, long rows walked span by span
    # (the same Span code, NEON either way) on the Pi 5's
    "pi4-more": (["tests/test_kernels.py"], ["-k", f"not span_by_span and ({_MORE})"], _PI4 | _SERIAL),
    "pi5-more": (["tests/test_kernels.py"], ["-k", _MORE], _PI5 | _SERIAL),
    # ... and the rest of the kernels, the split plan and whole models' batch invariance, on a Pi 4's
    "pi4-models": (["tests/test_plan.py", "tests/test_batch_invariance.py", "tests/test_kernels.py"],
                   ["-k", f"not span_by_span and not (test_kernels and ({_FIRST} or {_MORE} or q5_fifth_bits))"],
                   _PI4 | _SERIAL),
    # ... and the parallel kernels (numba's parallel loops), on the first Q4_0 matmul
    "pi4-parallel": (["tests/test_kernels.py"], ["-k", "matmul_matches_reference and Q4_0"], _PI4),
}


@functools.cache  # once per process: what a test writes later does not move its runs
def fingerprint() -> str:
    """What a run's result depends on: the sources it tests and runs, and the runs' definitions."""
    digest = hashlib.sha256(repr(sorted(RUNS.items())).encode())
    for path in sorted([*ROOT.glob("dllama/**/*.py"), *ROOT.glob("tests/**/*.py"), ROOT / "pyproject.toml"]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def runs_folder() -> Path:
    return CHROOT / "runs" / fingerprint()


def inner_run(name: str, folder: Path | None = None) -> _InnerRun:
    return _InnerRun(folder or runs_folder(), name)


def start(names) -> None:
    """Starts the runs `names` that no process has started for this tree (under pytest-xdist every
    worker asks; the first to claim a run starts it), and ends those of any other tree."""
    if skip_reason() or not names:
        return
    folder = runs_folder()
    for other in folder.parent.glob("*"):
        if other != folder:
            _end_all(other)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        run = inner_run(name, folder)
        if run.claim():
            run.start()


def stop() -> None:
    """Ends whatever still runs and removes the folder (at the end of a pytest run: the next one runs again).
    Not from the run inside the chroot, which sees the checkout's folder too (and would end itself)."""
    if not skip_reason():
        _end_all(runs_folder())


def _end_all(folder: Path) -> None:
    if folder.exists():
        for name in RUNS:
            inner_run(name, folder).kill()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    # python3 tests/aarch64/runs.py start [NAME ...]: the default suite's runs unless named
    if sys.argv[1:2] != ["start"] or not set(sys.argv[2:]) <= set(RUNS):
        sys.exit(f"usage: {sys.argv[0]} start [{'|'.join(RUNS)} ...]")
    if skip_reason():
        print(f"aarch64 runs: not started: {skip_reason()}")
    else:
        start(sys.argv[2:] or SUITE_RUNS)
        print(f"aarch64 runs: {', '.join(sys.argv[2:] or SUITE_RUNS)} started in the background ({runs_folder()})")
