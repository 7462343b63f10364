"""The bit-for-bit fidelity tests on a CPU with AVX-512, against llama.cpp built a second way: for
AVX2 without AVX-512 (`make reference-avx2`, into .reference-avx2/). There the native build sums in
another order than our kernels and those tests skip; this build takes the path our kernels
follow, so they run, in a subprocess that imports it instead of the native one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .engine_helpers import bit_exact_expected
from .test_fidelity import REQUANTIZED

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / ".reference-avx2"
# every test that asserts bit-exactness where llama.cpp takes our path (and greedy, which must then
# not diverge at all), and the perplexity
BIT_EXACT_TESTS = ["tests/test_fidelity.py::test_teacher_forced_logits_are_bit_identical",
                   "tests/test_fidelity.py::test_greedy_decode_equals_llama_cpp",
                   "tests/test_fidelity.py::test_synthetic_models",
                   "tests/test_fidelity.py::test_synthetic_architectures_greedy",
                   *(f"tests/test_fidelity.py::test_requantized_by_llama_cpp_runs_native[{ftype}-{source or 'smollm2'}]"
                     for ftype, source in REQUANTIZED),
                   # Q4_0, which llama.cpp repacks: in its repacked kernels' order
                   "tests/test_fidelity.py::test_synthetic_other_formats_close[Q4_0]",
                   "tests/test_fidelity.py::test_synthetic_big_shapes",
                   "tests/test_cli.py::test_perplexity_within_llama_cpp_s_own_spread",
                   # greedy through the CLI and the generator: exact where llama.cpp takes our path
                   "tests/test_cli.py::test_inference_temperature_0_is_llama_cpp_greedy",
                   "tests/test_cli.py::test_chat_answers_each_piped_line",
                   "tests/test_generate.py::test_prefill_longer_than_one_chunk",
                   "tests/test_generate.py::test_end_of_generation_token_stops_like_llama_cpp"]


def test_bit_exact_against_an_avx2_build_of_llama_cpp(report_in_summary):
    if bit_exact_expected():
        pytest.skip("the native llama.cpp build takes the AVX2 path: test_fidelity checks bit-exactness itself")
    if not (REFERENCE / ".built").exists():
        pytest.skip("no AVX2 build of llama.cpp in .reference-avx2 (make reference-avx2; needs an AVX2 CPU)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REFERENCE), os.environ.get("PYTHONPATH", "")])}
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.__file__); "
                            "print(llama_cpp.llama_print_system_info().decode())"],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert probe.returncode == 0 and str(REFERENCE) in probe.stdout, probe.stdout + probe.stderr
    assert "AVX2 = 1" in probe.stdout and "AVX512 = 1" not in probe.stdout, probe.stdout
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *BIT_EXACT_TESTS],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    print(f"\nagainst llama.cpp built for AVX2: {summary}")
    report_in_summary(f"bit-exact tests against llama.cpp built for AVX2: {summary}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, result.stdout[-4000:]
