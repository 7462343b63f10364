# From a fresh clone:  make chat  (install, fetch the default model, chat across 3 local nodes)
#                      make test  (install, fetch the default model, run the test suite)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile root/llama-cpp.cmake | cksum | cut -d' ' -f1)
# llama.cpp's AMX matmul crashes on some Sapphire Rapids machines (llama.cpp issue 20824: its tile
# configuration is optimized away), so it is built without AMX wherever the compiler knows the flags
# (x86 with GCC 11+ or clang: -march=native keeps the other features, AVX-512 where the CPU has it)
AMX_OFF   := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
NO_AMX    := $(shell cc $(AMX_OFF) -E -x c /dev/null >/dev/null 2>&1 && echo '$(AMX_OFF)')
# only the library the bindings load: not the multimodal one (mtmd, loaded only by llava chat handlers),
# tools, examples or tests (benchmarks/build_llama_server.sh builds llama-server), nor llama.cpp's `common`
# (root/llama-cpp.cmake, which CMake includes right after llama.cpp's project(), turns it off)
LLAMA_LIB_ONLY := -DMTMD_BUILD=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
                  -DLLAMA_BUILD_TESTS=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(abspath root/llama-cpp.cmake)
LLAMA_CPP := $(shell sed -n 's/.*"\(llama-cpp-python==[0-9.]*\)".*/\1/p' pyproject.toml)

.PHONY: install llama-cpp kernels model chat test test-all bytecode kernels-every-format aarch64 aarch64-runs reference-avx2 browser bench bench-deps clean

$(STAMP): pyproject.toml Makefile root/llama-cpp.cmake
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(MAKE) --jobs=2 --no-print-directory llama-cpp kernels
	$(BIN)/python -m pip install --quiet -e '.[root,test]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

# llama-cpp-python builds from source here (a few minutes, once); a build with AMX, or of another
# version than the pinned one, is redone (without AMX; not from pip's cache, which may hold one with it)
llama-cpp:
	$(BIN)/python -c 'import llama_cpp, sys; sys.exit("$(LLAMA_CPP)" != "llama-cpp-python==" + llama_cpp.__version__ \
	    or b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info())' 2>/dev/null \
	    || { CFLAGS="$$CFLAGS $(NO_AMX)" CXXFLAGS="$$CXXFLAGS $(NO_AMX)" CMAKE_ARGS="$$CMAKE_ARGS $(LLAMA_LIB_ONLY)" \
	    $(BIN)/python -m pip install --quiet --no-cache-dir --force-reinstall --no-deps '$(LLAMA_CPP)'; }

# meanwhile, everything else, and the kernels the default model needs (compiled once, cached)
kernels:
	$(BIN)/python -m pip install --quiet -e '.[serve,test]'
	$(BIN)/python -m dllama.kernels.warmup

install: $(STAMP)

# for the suite, the kernels of every format and operation, compiled once: else its processes compile
# what they need, a cluster's three at the same time (a suite with a cold kernel cache took 7 minutes longer)
kernels-every-format: install
	$(BIN)/python -m dllama.kernels.warmup --every-format

model: install
	$(BIN)/dllama models pull --quiet

chat: model
	$(BIN)/dllama chat --local-workers 2

# An arm64 Debian chroot in .aarch64/ (built once, needs root) in which tests/test_aarch64.py runs the
# kernel tests under qemu: the NEON path a Pi takes. Where it cannot be built it says why and the test skips.
aarch64:
	sh tests/aarch64/build_chroot.sh

# the default suite's emulated runs, started in the background as soon as the chroot is there: they are
# the suite's longest part and take the CPU the llama-cpp-python build leaves idle (pytest adopts them)
aarch64-runs: aarch64
	$(PYTHON) tests/aarch64/runs.py start

# llama.cpp built a second way, for AVX2 without AVX-512, in .reference-avx2/ (once): on a CPU with
# AVX-512 the native build sums in another order, and tests/test_fidelity_avx2.py runs the bit-for-bit
# fidelity tests against this one instead. Elsewhere it is not needed and the script says so.
reference-avx2: install
	sh tests/reference/build_avx2.sh

# Debian's chromium for the chat page's browser test (tests/test_chat_page.py, which Playwright drives);
# where it cannot be installed (not root, no apt-get) the script says why and the test skips.
browser: aarch64  # after it: two apt-get runs at once could fail on the package lists' lock
	sh tests/browser/install_chromium.sh

# The suite starts ~250 Python processes (workers, roots, servers): where PYTHONDONTWRITEBYTECODE is set
# (as on the machines this suite was measured on) each would compile dllama's sources again: ~0.3 CPU-s a start
bytecode:
	$(PYTHON) -m compileall -q dllama tests benchmarks >/dev/null

# two jobs: the chroot (mostly downloads) builds while llama-cpp-python compiles, then the emulated aarch64
# runs start. The suite runs in two processes, a test file each at a time (pytest-xdist), the longest files
# first (conftest.py's order, which --no-loadscope-reorder keeps): most tests wait on other processes
# (workers, servers, llama.cpp); the aarch64 runs take what CPU is left.
PYTEST := $(BIN)/python -m pytest -q --numprocesses 2 --dist loadfile --no-loadscope-reorder --durations 25

test: bytecode
	$(MAKE) --jobs=2 model kernels-every-format aarch64-runs reference-avx2 browser
	$(PYTEST)

# the default suite and the tests marked slow: properties the default suite tests, at bigger sizes
test-all: bytecode
	$(MAKE) --jobs=2 model kernels-every-format aarch64-runs reference-avx2 browser
	$(PYTEST) -m "slow or not slow"

# Benchmarks need Open MPI for the collective baseline (Debian: openmpi-bin libopenmpi-dev).
bench-deps: install
	$(BIN)/python -m pip install --quiet -e '.[bench]'

bench: bench-deps
	$(BIN)/python benchmarks/bench_inference.py

clean:
	rm -rf $(VENV) build dist *.egg-info
