#!/bin/sh
# Build llama.cpp's llama-server (the anchor of benchmarks/bench_serve.py) from the llama.cpp sources
# vendored in the llama-cpp-python sdist of the version pyproject.toml pins, into
# benchmarks/.llama-server/ (git-ignored, built once, a few minutes): the same llama.cpp the
# correctness tests compare with, native CPU flags but no AMX (as the Makefile builds llama-cpp-python:
# llama.cpp's AMX matmul crashes on some Sapphire Rapids machines), no CURL. A build from before that
# (no .built-without-amx beside it) is redone.
set -eu
cd "$(dirname "$0")/.."
TARGET=benchmarks/.llama-server
PYTHON=${PYTHON:-.venv/bin/python}
if [ -x "$TARGET/bin/llama-server" ] && [ -f "$TARGET/.built-without-amx" ]; then exit 0; fi
VERSION=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
echo "build_llama_server: llama-server from llama-cpp-python $VERSION's sources (a few minutes, once)" >&2
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --dest "$WORK" "llama-cpp-python==$VERSION"
tar -xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
SRC=$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # where the compiler knows them (x86, GCC 11+ or clang)
cc $NO_AMX -E -x c /dev/null >/dev/null 2>&1 || NO_AMX=""
CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX" \
    cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$WORK/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$TARGET/bin"
cp "$WORK/build/bin/llama-server" "$TARGET/bin/"
touch "$TARGET/.built-without-amx"
echo "build_llama_server: $TARGET/bin/llama-server" >&2
