# From a fresh clone:  make chat  (install, fetch the default model, chat across 3 local nodes)
#                      make test  (install, fetch the default model, run the test suite)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install model chat test bench bench-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# llama-cpp-python builds from source here (a few minutes, once)
	$(BIN)/python -m pip install --quiet -e '.[root,test]'
	$(BIN)/python -m dllama.kernels.warmup
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

model: install
	$(BIN)/dllama models pull --quiet

chat: model
	$(BIN)/dllama chat --local-workers 2

test: model
	$(BIN)/python -m pytest -q

# Benchmarks need Open MPI for the collective baseline (Debian: openmpi-bin libopenmpi-dev).
bench-deps: install
	$(BIN)/python -m pip install --quiet -e '.[bench]'

bench: bench-deps
	$(BIN)/python benchmarks/bench_inference.py

clean:
	rm -rf $(VENV) build dist *.egg-info
