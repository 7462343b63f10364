"""The kernels on the workers' real CPU: INNER_TESTS run on aarch64, where dllama/kernels/simd.py
takes its NEON path (no x86 machine runs it otherwise), in an arm64 Debian chroot under qemu-user.

`make aarch64` (tests/aarch64/build_chroot.sh, part of `make test`) builds the chroot once in
.aarch64/. The run happens in a private mount namespace: the checkout is bind-mounted read-only
at /src, /proc and a fresh tmpfs /tmp (numba's cache, pytest's tmp_path) are mounted, and all of
it goes away with the process, whatever happens to it. Tests that need llama-cpp-python are
skipped inside (tests/aarch64/inner_plugin.py). Runs side by side: every inner test as on a Pi 4
(no dot product, in two halves), and the matmul tests compiled for a Pi 5's Cortex-A76 (sdot).

The emulated runs are single threaded CPU work, most of it LLVM compiling the kernels: started at
the end of collection (tests/conftest.py) at the lowest priority, they use what CPU the rest of
the suite leaves idle, and this module's tests, moved to the end of the run, only collect them."""

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

# The test files run inside (as on a Pi 4, split over two runs: _PI4_RUNS). Add files here: tests that
# need llama.cpp skip inside by themselves; keep the total reasonable under emulation (~10x slower).
INNER_TESTS = ["tests/test_kernels.py", "tests/test_quant.py", "tests/test_plan.py", "tests/test_batch_invariance.py"]

ROOT = Path(__file__).resolve().parent.parent
CHROOT = ROOT / ".aarch64"
ROOTFS = CHROOT / "rootfs"
BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
# How long the outer test waits for a run once the rest of the suite is done (a hang ends there). On a
# 2-core Zen 3 with AVX2 only (2026-11-27) the suite waited 912 s for the longest (the three runs alone
# took 1737 s when they ran before the rest): a slower machine must not fail for time alone
TIMEOUT = 2400

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


def _lowest_priority() -> None:
    """In the run's new session (so its own scheduler autogroup, where the kernel groups by session):
    nice 19 for the group and the process, so the rest of the suite keeps the CPU it asks for."""
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:
        pass  # no autogroups (a kernel without them, or disabled): the process's nice value is enough
    os.nice(19)


class _InnerRun:
    """pytest on the files `tests` (with `options`) in the chroot, started at once in the background
    at the lowest priority."""

    def __init__(self, tests: list[str], options: list[str], extra_env: dict[str, str]):
        self.tests = tests  # the files it runs
        (ROOTFS / "src").mkdir(exist_ok=True)
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
            "R": str(ROOTFS), "SRC": str(ROOT),
            "NUMBA_CACHE_DIR": "/tmp/numba", "HYPOTHESIS_STORAGE_DIRECTORY": "/tmp/hypothesis",
            "DLLAMA_MODELS_DIR": "/src/models",  # the read-only checkout's, which `make test` pulled
            "PYTHONDONTWRITEBYTECODE": "1",  # nothing written into the checkout from inside
            "NUMBA_NUM_THREADS": "1",  # one core each: emulation is slow enough without a busy machine
            **extra_env,
        }
        self.start = time.monotonic()
        self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", _INNER, "sh",
                                      *tests, *options], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True, preexec_fn=_lowest_priority)
        self._result = None

    def result(self) -> tuple[int, str, str, str | None, float]:
        """(exit code, output, summary line, the plugin's check line, seconds since its start), once it
        has ended (waiting at most TIMEOUT)."""
        if self._result is None:
            try:
                out, _ = self.proc.communicate(timeout=TIMEOUT)
            finally:
                self.kill()
            lines = out.splitlines()
            check = next((line for line in lines if line.startswith("aarch64-check:")), None)
            summary = next((line.strip("= ") for line in reversed(lines)
                            if re.search(r"\d+ (passed|failed|errors?|skipped)", line)), "(no summary)")
            self._result = (self.proc.returncode, out, summary, check, time.monotonic() - self.start)
        return self._result

    def kill(self) -> None:
        if self.proc.poll() is None:  # timed out, or the run was interrupted: end the whole inner run
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# The Pi 4 tests in two runs, so that they and the Pi 5 run share both cores. The second runs the
# models (test_plan, test_batch_invariance), which compile the transformer ops' kernels anyway, so it
# also takes test_kernels' tests of those ops; the first, the matmuls, had run alone for the last
# ~6 min of the suite. Compiling the long rows' spanned kernels under emulation takes minutes; the
# Pi 5 run covers them (the same Span code, NEON either way), and the Pi 4 runs skip them.
_OPS = "rmsnorm or rope or expf or exp_of or silu or gelu or softcap or attention or softmax"
_MATMUL_RUN = ["tests/test_kernels.py", "tests/test_quant.py"]
_PI4_RUNS = ((_MATMUL_RUN, ["-k", f"not span_by_span and not ({_OPS})"]),
             ([*(name for name in INNER_TESTS if name not in _MATMUL_RUN), "tests/test_kernels.py"],
              ["-k", f"not span_by_span and (not test_kernels or {_OPS})"]))
# the Pi 5 run: the quantized matmul tests (rows as stored and packed), and that the generated code holds sdot
_PI5_OPTIONS = ["-k", "matmul_matches_reference or matmul_rows_do_not_depend or packed_rows or sdot", "-rA"]


_STARTED: dict[str, list[_InnerRun]] = {}


def start_inner_runs() -> None:
    """Starts the runs, together (conftest.py calls it once the session's tests are collected, when
    they include this module's): the Pi 4 ones (every inner test, no dot product) and the Pi 5 one."""
    if _STARTED or _skip_reason():
        return
    _STARTED["pi4"] = [_InnerRun(tests, options, {"DLLAMA_NO_DOTPROD": "1"}) for tests, options in _PI4_RUNS]
    _STARTED["pi5"] = [_InnerRun(["tests/test_kernels.py"], _PI5_OPTIONS,
                                 {"NUMBA_CPU_NAME": "cortex-a76", "NUMBA_CPU_FEATURES": "+neon,+dotprod"})]


def stop_inner_runs() -> None:
    """Ends whatever still runs (at the session's end, however it ends)."""
    for run in _STARTED.get("pi4", []) + _STARTED.get("pi5", []):
        run.kill()


@pytest.fixture(scope="module")
def inner_runs():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    start_inner_runs()  # a no-op once conftest.py started them (it is not loaded with --noconftest)
    try:
        yield _STARTED
    finally:
        stop_inner_runs()


def _assert_ran(returncode: int, out: str, summary: str, check: str | None, tests: list[str]) -> None:
    tail = "\n".join(out.splitlines()[-60:])
    assert returncode == 0, f"inner run exited {returncode}: {summary}\n{tail}"
    assert check and "machine=aarch64" in check and "_X86_AVX2=False" in check, tail
    for name in tests:  # each file was collected and ran (the progress lines name it)
        assert re.search(rf"^{re.escape(name)} [.sxX]+", out, re.M), f"{name} did not run inside\n{tail}"
    assert re.search(r"[1-9]\d* passed", summary) and not re.search(r"failed|error", summary), summary


def test_kernels_on_aarch64_under_qemu(inner_runs, report_in_summary):
    """Every inner test on a plain ARMv8 CPU (a Pi 4's Cortex-A72: NEON, no dot product)."""
    for run in inner_runs["pi4"]:
        returncode, out, summary, check, seconds = run.result()
        print(f"\n{check}\naarch64 (qemu, {seconds:.0f} s): {summary}")
        report_in_summary(f"aarch64 under qemu ({', '.join(run.tests)}): {summary}")
        _assert_ran(returncode, out, summary, check, run.tests)
        assert "dotprod=False" in check, check


def test_dot_product_kernels_on_aarch64_under_qemu(inner_runs, report_in_summary):
    """The quantized matmuls as compiled for a Pi 5 (Cortex-A76, ARMv8.2 dot product: sdot) and run
    by qemu, which implements sdot: the same tests, and the instruction in the generated code."""
    run = inner_runs["pi5"][0]
    returncode, out, summary, check, seconds = run.result()
    print(f"\n{check}\naarch64 with sdot (qemu, {seconds:.0f} s): {summary}")
    report_in_summary(f"aarch64 with the dot product under qemu (the matmul tests of tests/test_kernels.py): {summary}")
    _assert_ran(returncode, out, summary, check, run.tests)
    assert "dotprod=True" in check and "cpu=cortex-a76" in check, check
    assert "PASSED tests/test_kernels.py::test_quantized_dots_use_sdot_on_aarch64" in out, out[-3000:]
