"""The kernels on the workers' real CPU: the tests of what dllama/kernels/simd.py compiles per CPU run
on aarch64, where it takes its NEON path (no x86 machine runs it otherwise), in an arm64 Debian
chroot under qemu-user (_RUNS: as on a Pi 4, no dot product; and as on a Pi 5, sdot).

`make aarch64` (tests/aarch64/build_chroot.sh, part of `make test`) builds the chroot once in
.aarch64/. The run happens in a private mount namespace: the checkout is bind-mounted read-only
at /src, /proc and a fresh tmpfs /tmp (numba's cache, pytest's tmp_path) are mounted, and all of
it goes away with the process, whatever happens to it. Tests that need llama-cpp-python are
skipped inside (tests/aarch64/inner_plugin.py).

The emulated runs are single threaded CPU work, most of it LLVM compiling the kernels: started at
the end of collection (tests/conftest.py) at the lowest priority, they use what CPU the rest of
the suite leaves idle, and this module's tests, moved to the end of the run, only collect them."""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROOT = ROOT / ".aarch64"
ROOTFS = CHROOT / "rootfs"
BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
# How long a run may take from its start (a hang ends there): a slower machine must not fail for time alone
TIMEOUT = 2400


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
exec chroot "$R" /bin/sh -c 'cd /src && exec /usr/bin/python3 -m pytest -p no:cacheprovider \
    -p tests.aarch64.inner_plugin --color=no "$@"' sh "$@"
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

    def __init__(self, folder: Path, name: str, tests: list[str], options: list[str]):
        self.folder, self.name, self.tests, self.options = folder, name, tests, options
        self.log, self.rc, self.pid = (folder / f"{name}.{ext}" for ext in ("log", "rc", "pid"))

    def start(self, extra_env: dict[str, str]) -> None:
        (ROOTFS / "src").mkdir(exist_ok=True)
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
            "R": str(ROOTFS), "SRC": str(ROOT), "LOG": str(self.log), "RC": str(self.rc),
            "NUMBA_CACHE_DIR": "/tmp/numba", "HYPOTHESIS_STORAGE_DIRECTORY": "/tmp/hypothesis",
            "DLLAMA_MODELS_DIR": "/src/models",  # the read-only checkout's, which `make test` pulled
            "PYTHONPATH": "/opt/site",  # the dependencies (tests/aarch64/build_chroot.sh)
            "PYTHONDONTWRITEBYTECODE": "1",  # nothing written into the checkout from inside
            "NUMBA_NUM_THREADS": "1",  # one core each: emulation is slow enough without a busy machine
            **extra_env,
        }
        wrapper = ('unshare --mount --propagation private sh -c "$INNER" sh "$@" > "$LOG" 2>&1; '
                   'echo $? > "$RC.part"; mv "$RC.part" "$RC"')
        proc = subprocess.Popen(["sh", "-c", wrapper, "sh", *self.tests, *self.options], env={**env, "INNER": _INNER},
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_lowest_priority)
        self.pid.write_text(str(proc.pid))  # (the session's leader: its group is the whole run)

    def result(self, deadline: float) -> tuple[int, str, str, str | None]:
        """(exit code, output, summary line, the plugin's check line), once it has ended (waiting
        until `deadline`, time.monotonic()'s, at most: then it is killed)."""
        while not self.rc.exists():
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
_RUNS = {  # name: (files, options, environment)
    # a Pi 4's Cortex-A72: NEON without the dot product, Q5's fifth bits in the generated code (and the
    # quantizers, numpy on aarch64)
    "pi4": (["tests/test_kernels.py", "tests/test_quant.py"], ["-k", f"not test_kernels or {_FIRST} or q5_fifth_bits"],
            _PI4),
    # a Pi 5's Cortex-A76 (ARMv8.2 dot product: sdot, which qemu implements), and sdot in the generated code
    # (the float formats' dots are no integer dots: the Pi 4's run has them)
    "pi5": (["tests/test_kernels.py"], ["-k", f"({_FIRST} or sdot) and not F16 and not F32", "-rA"], _PI5),
    # the slow set (make test-all): the rest of the matmul tests on both, long rows walked span by span
    # (the same Span code, NEON either way) on the Pi 5's
    "pi4-more": (["tests/test_kernels.py"], ["-k", f"not span_by_span and ({_MORE})"], _PI4),
    "pi5-more": (["tests/test_kernels.py"], ["-k", _MORE], _PI5),
    # ... and the rest of the kernels, the split plan and whole models' batch invariance, on a Pi 4's
    "pi4-models": (["tests/test_plan.py", "tests/test_batch_invariance.py", "tests/test_kernels.py"],
                   ["-k", f"not span_by_span and not (test_kernels and ({_FIRST} or {_MORE} or q5_fifth_bits))"],
                   _PI4),
}
# which run each test of this module reads
RUN_OF_TEST = {"test_kernels_on_aarch64_under_qemu": "pi4", "test_dot_product_kernels_on_aarch64_under_qemu": "pi5",
               "test_more_kernels_on_aarch64_under_qemu": "pi4-more",
               "test_more_dot_product_kernels_on_aarch64_under_qemu": "pi5-more",
               "test_models_on_aarch64_under_qemu": "pi4-models"}


def runs_folder(config) -> Path:
    """Where this pytest run keeps its inner runs' files: one folder per run, its xdist workers
    included (they are the controller's children)."""
    owner = os.getppid() if hasattr(config, "workerinput") else os.getpid()
    return Path(tempfile.gettempdir()) / f"dllama-aarch64-{owner}"


def inner_run(folder: Path, name: str) -> _InnerRun:
    tests, options, _env = _RUNS[name]
    return _InnerRun(folder, name, tests, options)


def start_inner_runs(config, names) -> None:
    """Starts the runs `names`, together, once per pytest run (conftest.py calls it once the
    session's tests are collected, with the runs they read; under xdist every worker collects the
    same tests, and the first to make the folder starts them)."""
    if _skip_reason() or not names:
        return
    folder = runs_folder(config)
    try:
        folder.mkdir()
    except FileExistsError:
        return  # started by another worker of this run
    for name in names:
        inner_run(folder, name).start(_RUNS[name][2])


def stop_inner_runs(config) -> None:
    """Ends whatever still runs and removes the folder (at the end of the run, by its controller)."""
    if hasattr(config, "workerinput"):
        return
    folder = runs_folder(config)
    if folder.exists():
        for name in _RUNS:
            inner_run(folder, name).kill()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def inner_result(request):
    """The result of the run this test reads: (exit code, output, summary, check line, the run)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    name = RUN_OF_TEST[request.node.name]
    start_inner_runs(request.config, [name])  # a no-op once conftest.py started them (not loaded with --noconftest)
    run = inner_run(runs_folder(request.config), name)
    started = run.pid.stat().st_mtime if run.pid.exists() else time.time()
    try:
        yield (*run.result(time.monotonic() + TIMEOUT - (time.time() - started)), run)
    finally:
        run.kill()


def _assert_ran(returncode: int, out: str, summary: str, check: str | None, tests: list[str]) -> None:
    tail = "\n".join(out.splitlines()[-60:])
    assert returncode == 0, f"inner run exited {returncode}: {summary}\n{tail}"
    assert check and "machine=aarch64" in check and "_X86_AVX2=False" in check, tail
    for name in tests:  # each file was collected and ran (the progress lines name it)
        assert re.search(rf"^{re.escape(name)} [.sxX]+", out, re.M), f"{name} did not run inside\n{tail}"
    assert re.search(r"[1-9]\d* passed", summary) and not re.search(r"failed|error", summary), summary


def _check(inner_result, report_in_summary, what: str, dotprod: bool) -> str:
    """The run this test reads passed, on the CPU it is meant for; its output."""
    returncode, out, summary, check, run = inner_result
    print(f"\n{check}\n{what}: {summary}")
    report_in_summary(f"{what}: {summary}")
    _assert_ran(returncode, out, summary, check, run.tests)
    assert f"dotprod={dotprod}" in check, check
    assert not dotprod or "cpu=cortex-a76" in check, check
    return out


def test_kernels_on_aarch64_under_qemu(inner_result, report_in_summary):
    """Every format's matmuls (and the quantizers) on a plain ARMv8 CPU (a Pi 4's Cortex-A72: NEON,
    no dot product)."""
    _check(inner_result, report_in_summary, "aarch64 under qemu (every format's matmuls, the quantizers)", False)


def test_dot_product_kernels_on_aarch64_under_qemu(inner_result, report_in_summary):
    """The quantized matmuls as compiled for a Pi 5 (Cortex-A76, ARMv8.2 dot product: sdot) and run
    by qemu, which implements sdot: the same tests, and the instruction in the generated code."""
    out = _check(inner_result, report_in_summary, "aarch64 with the dot product under qemu (the matmuls)", True)
    assert "PASSED tests/test_kernels.py::test_quantized_dots_use_sdot_on_aarch64" in out, out[-3000:]


@pytest.mark.slow
def test_more_kernels_on_aarch64_under_qemu(inner_result, report_in_summary):
    """The other matmul tests (column slices, packed rows, the activations' layouts), on a Pi 4's CPU."""
    _check(inner_result, report_in_summary, "aarch64 under qemu (the other matmul tests)", False)


@pytest.mark.slow
def test_more_dot_product_kernels_on_aarch64_under_qemu(inner_result, report_in_summary):
    """The same, long rows walked span by span among them, compiled for a Pi 5."""
    _check(inner_result, report_in_summary, "aarch64 with the dot product under qemu (the other matmul tests)", True)


@pytest.mark.slow
def test_models_on_aarch64_under_qemu(inner_result, report_in_summary):
    """The other kernels (norms, RoPE, attention, activations), the split plan, and whole models'
    logits independent of the chunking, on a Pi 4's CPU."""
    _check(inner_result, report_in_summary, "aarch64 under qemu (other kernels, plan, models)", False)
