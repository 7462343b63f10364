"""Plugin (-p tests.aarch64.inner_plugin) of the pytest run inside the arm64 chroot (tests/test_aarch64.py).

- Checks that this run is the one it is meant to be, the non-x86 kernels on aarch64, and prints
  the line the outer test looks for.
- Imports the kernels with RuntimeWarnings as errors: numpy warnings at import time showed up on
  aarch64 only (the F16_TO_F32 table), where nothing else would notice them.
- Skips the tests that need llama-cpp-python (through the tokenizer or llama_ref fixtures): the
  chroot does not have it (building it under emulation would take far too long).
"""

from __future__ import annotations

import importlib.util
import platform
import warnings

import pytest

NEEDS_LLAMA_CPP = {"tokenizer", "llama_ref"}
CHECK_PREFIX = "aarch64-check:"


# at the plugin's import, before conftest.py or a test module can import them with warnings allowed
with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    for module in ("matmul", "ops", "attention"):
        importlib.import_module(f"dllama.kernels.{module}")


def pytest_configure(config):
    from llvmlite import binding as llvm_binding

    from dllama.kernels import PARALLEL, simd

    machine, triple = platform.machine(), llvm_binding.get_process_triple()
    if machine != "aarch64" or not triple.startswith("aarch64") or simd._X86_AVX2:
        pytest.exit(f"not the aarch64 path: machine={machine} triple={triple} _X86_AVX2={simd._X86_AVX2}",
                    returncode=3)
    from numba.core import config as numba_config

    cpu = numba_config.CPU_NAME or llvm_binding.get_host_cpu_name()  # what numba compiles for
    config._aarch64_check = (f"{CHECK_PREFIX} machine={machine} triple={triple} _X86_AVX2={simd._X86_AVX2} "
                             f"cpu={cpu} dotprod={simd.AARCH64_DOTPROD} parallel={PARALLEL}")


def pytest_report_header(config):
    return config._aarch64_check


def pytest_collection_modifyitems(items):
    if importlib.util.find_spec("llama_cpp") is not None:
        return
    skip = pytest.mark.skip(reason="needs llama-cpp-python, which the aarch64 chroot does not have")
    for item in items:
        if NEEDS_LLAMA_CPP & set(getattr(item, "fixturenames", ())):
            item.add_marker(skip)
