#!/bin/sh
# Build llama.cpp (llama-cpp-python, the version pyproject.toml pins) a second way, for AVX2 without
# AVX-512, into .reference-avx2/ (git-ignored, built once). On a CPU with AVX-512 the native build
# sums in another order than our kernels, so the bit-for-bit fidelity tests skip there; against this
# build (tests/test_fidelity_avx2.py) they run on such a CPU too. Where it is not needed (no
# AVX-512: the native build is the AVX2 one) or cannot be built, say why and succeed.
set -eu
cd "$(dirname "$0")/../.."
TARGET=.reference-avx2
PYTHON=${PYTHON:-.venv/bin/python}
if [ -f "$TARGET/.built" ]; then exit 0; fi
if ! grep -q ' avx2' /proc/cpuinfo 2>/dev/null; then
    echo "reference-avx2: this CPU has no AVX2; the AVX2 cross-check is skipped"; exit 0
fi
if ! grep -q ' avx512f' /proc/cpuinfo 2>/dev/null; then
    echo "reference-avx2: no AVX-512 here, the native llama.cpp build already takes the AVX2 path"; exit 0
fi
VERSION=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
echo "reference-avx2: building llama-cpp-python $VERSION for AVX2 without AVX-512 (a few minutes, once)"
rm -rf "$TARGET"
# only the library the bindings load, built as the Makefile builds the native one (root/llama-cpp.cmake)
if CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
      -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DMTMD_BUILD=OFF -DLLAVA_BUILD=OFF \
      -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(pwd)/root/llama-cpp.cmake" \
   "$PYTHON" -m pip install --quiet --no-cache-dir --no-deps --target "$TARGET" "llama-cpp-python==$VERSION"; then
    touch "$TARGET/.built"
else
    rm -rf "$TARGET"
    echo "reference-avx2: the build failed; the AVX2 cross-check is skipped"
fi
