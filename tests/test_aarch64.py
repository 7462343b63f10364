"""The kernels on the workers' real CPU: the tests of what dllama/kernels/simd.py compiles per CPU run
on aarch64, where it takes its NEON path (no x86 machine runs it otherwise), in an arm64 Debian
chroot under qemu-user (tests/aarch64/runs.py: as on a Pi 4, no dot product; and as on a Pi 5, sdot).

`make aarch64` (tests/aarch64/build_chroot.sh, part of `make test`) builds the chroot once in
.aarch64/. The run happens in a private mount namespace: the checkout is bind-mounted read-only
at /src, /proc and a fresh tmpfs /tmp (numba's cache, pytest's tmp_path) are mounted, and all of
it goes away with the process, whatever happens to it. Tests that need llama-cpp-python are
skipped inside (tests/aarch64/inner_plugin.py).

The emulated runs are single threaded CPU work, most of it numba compiling the kernels. They run at
the lowest priority, using what CPU the rest leaves idle: `make test` starts the default suite's
as soon as the chroot is built (while llama-cpp-python compiles), and pytest adopts them or starts
what it needs at the end of collection (tests/conftest.py); this module's tests, moved to the end
of the run, only collect their results."""

from __future__ import annotations

import re
import time

import pytest

from .aarch64 import runs

# which run each test of this module reads
RUN_OF_TEST = {"test_kernels_on_aarch64_under_qemu": "pi4", "test_dot_product_kernels_on_aarch64_under_qemu": "pi5",
               "test_more_kernels_on_aarch64_under_qemu": "pi4-more",
               "test_more_dot_product_kernels_on_aarch64_under_qemu": "pi5-more",
               "test_models_on_aarch64_under_qemu": "pi4-models",
               "test_parallel_kernels_on_aarch64_under_qemu": "pi4-parallel"}


@pytest.fixture
def inner_result(request):
    """The result of the run this test reads: (exit code, output, summary, check line, the run)."""
    reason = runs.skip_reason()
    if reason:
        pytest.skip(reason)
    name = RUN_OF_TEST[request.node.name]
    runs.start([name])  # a no-op once `make test` or conftest.py started it (not loaded with --noconftest)
    run = runs.inner_run(name)
    started = run.pid.stat().st_mtime if run.pid.exists() else time.time()
    try:
        yield (*run.result(time.monotonic() + runs.TIMEOUT - (time.time() - started)), run)
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
    assert f"parallel={'DLLAMA_SERIAL_KERNELS' not in run.env}" in check, check  # (the kernels runs.py asked for)
    assert not dotprod or "cpu=cortex-a76" in check, check
    return out


def test_kernels_on_aarch64_under_qemu(inner_result, report_in_summary):
    """The quantized formats' matmuls (and the quantizers) on a plain ARMv8 CPU (a Pi 4's Cortex-A72: NEON,
    no dot product)."""
    _check(inner_result, report_in_summary, "aarch64 under qemu (the quantized matmuls, the quantizers)", False)


def test_dot_product_kernels_on_aarch64_under_qemu(inner_result, report_in_summary):
    """Every format's matmuls as compiled for a Pi 5 (Cortex-A76, ARMv8.2 dot product: sdot) and run
    by qemu, which implements sdot: the quantized ones as on the Pi 4, the float ones, and the
    instruction in the generated code."""
    out = _check(inner_result, report_in_summary, "aarch64 with the dot product under qemu (every format's matmuls)", True)
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


@pytest.mark.slow
def test_parallel_kernels_on_aarch64_under_qemu(inner_result, report_in_summary):
    """The other runs compile numba's parallel loops as plain ones: here they are parallel loops, on
    the first Q4_0 matmuls of a Pi 4's CPU."""
    _check(inner_result, report_in_summary, "aarch64 under qemu (parallel kernels: the Q4_0 matmuls)", False)
