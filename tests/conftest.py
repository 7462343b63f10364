"""General fixtures: the default model, its tokenizer, a llama.cpp reference factory, and
synthetic GGUF models (written on first use, once per session)."""

from __future__ import annotations

import os

import pytest

from .aarch64 import runs
from .engine_helpers import SYNTHETIC_SPECS, write_synthetic_model


@pytest.fixture(scope="session")
def model_path() -> str:
    """The default model (pulled on first use)."""
    from dllama.registry import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def gguf_model(model_path):
    from dllama.gguf_model import GGUFModel

    return GGUFModel(model_path)


@pytest.fixture(scope="session")
def tokenizer(gguf_model):
    from dllama.tokenizer import Tokenizer

    cfg = gguf_model.config
    return Tokenizer(gguf_model.path, gguf_model.chat_template, cfg.bos_id, cfg.eos_id)


@pytest.fixture(scope="session")
def llama_ref():
    """llama_ref(path, n_ctx=1024) -> a llama-cpp-python Llama set up to match our numerics (no
    flash attention, logits for every position). Instances are shared.

    One thread: llama.cpp's logits do not depend on its thread count (each row's dot product is
    computed whole by one thread), and with 2 threads on a 2-core machine that is busy with
    something else, OpenMP's spinning barriers make token-by-token evaluation 10-30x slower."""
    from llama_cpp import Llama

    cache = {}

    def make(path: str, n_ctx: int = 1024):
        key = (os.fspath(path), n_ctx)
        if key not in cache:
            cache[key] = Llama(model_path=key[0], n_ctx=n_ctx, n_batch=512, logits_all=True, n_threads=1,
                               n_threads_batch=1, flash_attn=False, verbose=False)
        return cache[key]

    yield make
    for llama in cache.values():
        llama.close()


@pytest.fixture(scope="module")
def one_compute_thread():
    """Run our kernels on one thread for a module (results do not depend on the thread count;
    see llama_ref on why a busy 2-core machine is faster that way)."""
    import numba

    from dllama.kernels import set_threads

    before = numba.get_num_threads()
    set_threads(1)
    yield
    set_threads(before)


@pytest.fixture(scope="session")
def synthetic_model(tmp_path_factory, model_path):
    """synthetic_model(name) -> path of a synthetic GGUF of SYNTHETIC_SPECS[name], written with
    dllama.synthetic.write_synthetic (the default model's tokenizer) on first use."""
    folder = tmp_path_factory.mktemp("synthetic")
    paths: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in paths:
            path = str(folder / f"synthetic-{name}.gguf")
            write_synthetic_model(path, SYNTHETIC_SPECS[name], model_path)
            paths[name] = path
        return paths[name]

    return get


@pytest.fixture(scope="session")
def requantized_model(tmp_path_factory, model_path, synthetic_model):
    """requantized_model(ftype, pure=False, source=None) -> the default model (or the synthetic
    model `source`) re-quantized by llama.cpp's own quantizer (llama_model_quantize) to
    llama_cpp.LLAMA_FTYPE_MOSTLY_<ftype>, on first use. pure: every tensor in that type
    (llama-quantize --pure), not its usual mix (which gives some tensors more bits, in K-quants)."""
    import llama_cpp

    folder = tmp_path_factory.mktemp("requantized")
    paths: dict[tuple, str] = {}

    def get(ftype: str, pure: bool = False, source: str | None = None) -> str:
        if (ftype, pure, source) not in paths:
            path = str(folder / f"{source or 'smollm2'}-{ftype}{'-pure' if pure else ''}.gguf")
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
            params.allow_requantize = True
            params.pure = pure
            params.nthread = 1
            origin = synthetic_model(source) if source else model_path
            rc = llama_cpp.llama_model_quantize(origin.encode(), path.encode(), params)
            assert rc == 0, f"llama_model_quantize to {ftype} failed ({rc})"
            paths[ftype, pure, source] = path
        return paths[ftype, pure, source]

    return get


_SUITE_REPORT: list[str] = []


@pytest.fixture
def report_in_summary(request):
    """report_in_summary(line): a line for the end of the run's summary (the runs inside a test:
    aarch64 under qemu, the AVX2 build of llama.cpp), so a passing run says what it covered. It
    travels with the test's report (under xdist, from the worker to the controller, which prints it)."""
    return lambda line: request.node.user_properties.append(("inner-run", line))


def pytest_runtest_logreport(report):
    if report.when == "call":
        _SUITE_REPORT.extend(value for key, value in report.user_properties if key == "inner-run")


def pytest_terminal_summary(terminalreporter):
    if _SUITE_REPORT:
        terminalreporter.section("inner runs")
        for line in _SUITE_REPORT:
            terminalreporter.write_line(line)


def _is_aarch64_test(item) -> bool:
    return item.nodeid.startswith("tests/test_aarch64.py::")


def _aarch64_module(session):
    """tests/test_aarch64.py's module if its tests are in this session, else None."""
    return next((item.module for item in getattr(session, "items", []) if _is_aarch64_test(item)), None)


# The files that take longest (wall time, `make test` on a 2-core x86), first: pytest-xdist hands out
# whole files, in collection order with --no-loadscope-reorder (as `make test` runs it; by default the
# files with the most tests first), and a long file handed out last ran alone at the end of the suite
# while the other process had nothing left to do. Only the order: files not listed follow, as collected.
LONGEST_FIRST = ("test_cluster_cli", "test_fidelity", "test_cluster_equivalence", "test_cli", "test_worker_fuzz",
                 "test_architectures", "test_discovery", "test_netns_cluster", "test_batch_invariance",
                 "test_batching", "test_determinism", "test_worker_hardening", "test_node_lost", "test_home_cluster",
                 "test_speculate", "test_server", "test_fairness", "test_chat_page", "test_generate", "test_soak")


def _file_order(item) -> int:
    name = item.nodeid.split("::")[0].removeprefix("tests/").removesuffix(".py")
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items):
    """The longest files first; tests/test_aarch64.py's tests last: they only wait for runs started
    in the background."""
    items.sort(key=lambda item: (_is_aarch64_test(item), _file_order(item)))  # stable: a file's tests keep their order


_READS_RUNS = []  # (set when this session's tests read the emulated runs: then it ends them at its end)


def pytest_collection_finish(session):
    """Starts the emulated aarch64 runs the session's tests read, now, so that they use the CPU the
    rest of the suite leaves idle (at the lowest priority) instead of running alone at the end."""
    module = None if session.config.option.collectonly else _aarch64_module(session)
    if module is not None:
        _READS_RUNS.append(True)
        runs.start(sorted({module.RUN_OF_TEST[item.name] for item in session.items if _is_aarch64_test(item)}))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """(pytest-xdist's controller, which collects nothing itself: what its workers selected)"""
    if any(nodeid.startswith("tests/test_aarch64.py::") for nodeid in ids):
        _READS_RUNS.append(True)


def pytest_sessionfinish(session):
    """The run's controller (or the one process without xdist) ends the inner runs, whoever started
    them, if its tests read them: a session of other tests leaves them to the one that does (a
    `pytest tests/test_cli.py` beside `make test` in the same checkout ended its runs)."""
    if not hasattr(session.config, "workerinput") and _READS_RUNS:
        runs.stop()
