"""The cluster through the real CLI and real worker processes: reports, errors, failures."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import threading
import time

import pytest

from .cluster_helpers import DLLAMA, WorkerProcess, run_dllama

PROMPT = "The old lighthouse keeper climbed the stairs and"
GREEDY_F64 = ["--temperature", "0", "--sync-dtype", "f64", "--threads", "1"]


def json_report(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def one_node_answer():
    """1-node greedy answer in f64 mode: what every cluster in f64 mode must reproduce."""
    return json_report(run_dllama("inference", "-p", PROMPT, "-n", "48", *GREEDY_F64, "--json"))


@pytest.fixture(scope="module")
def one_node_f32_answer():
    """1-node greedy answer in the default f32 mode (llama.cpp's numbers): what every cluster in
    gather mode must reproduce."""
    return json_report(run_dllama("inference", "-p", PROMPT, "-n", "48", "--temperature", "0", "--threads", "1",
                                  "--json"))


@pytest.fixture(scope="module")
def one_node_tokens(one_node_answer):
    return one_node_answer["tokens"]


@pytest.fixture
def workers(request):
    started: list[WorkerProcess] = []

    def start(n: int, *args: str) -> list[WorkerProcess]:
        new = [WorkerProcess("--no-cache", *args) for _ in range(n)]
        started.extend(new)
        return new

    yield start
    for w in started:
        w.stop()


def test_local_workers_report(one_node_tokens):
    r = json_report(run_dllama("inference", "-p", PROMPT, "-n", "48", *GREEDY_F64, "--local-workers", "2",
                               "--sync", "ring", "--json"))
    assert r["nodes"] == 3 and r["sync"] == "ring" and r["sync_dtype"] == "f64"
    assert r["tokens"] == one_node_tokens
    # ring all-reduce: each node sends 2(p-1)/p of the vector per all-reduce, 2 per layer
    # (30 layers, dim 576, 8-byte values), plus 16-byte frame headers and the root's step messages (5.01%
    # over once, with three test processes on 2 cores): star would send 3/2 of this, 10% still tells them apart
    payload = 2 * 30 * 2 * (3 - 1) / 3 * 576 * 8
    assert payload <= r["bytes_per_token"]["sent"] <= payload * 1.10
    assert r["ms_per_token"]["sync"] > 0 and r["ms_per_token"]["compute"] > 0


def test_gather_mode_across_worker_processes_gives_the_one_node_tokens(one_node_f32_answer):
    """--sync-mode gather needs no f64: f32 and q80 payloads both give exactly the 1-node tokens."""
    for dtype in ("f32", "q80"):
        r = json_report(run_dllama("inference", "-p", PROMPT, "-n", "48", "--temperature", "0", "--threads", "1",
                                   "--local-workers", "2", "--sync-mode", "gather", "--sync-dtype", dtype, "--json"))
        assert (r["nodes"], r["sync_mode"], r["sync_dtype"]) == (3, "gather", dtype)
        assert r["tokens"] == one_node_f32_answer["tokens"]
    one_error_line(run_dllama("inference", "-p", "hi", "-n", "2", "--local-workers", "1", "--sync-mode", "gather",
                              "--sync-dtype", "f16"), "gather carries f32 or q80")


def test_unreachable_worker_is_one_line():
    t0 = time.monotonic()
    r = run_dllama("inference", "-p", "hi", "-n", "2", "--workers", "127.0.0.1:1")
    one_error_line(r, "127.0.0.1:1", "refused")
    assert time.monotonic() - t0 < 30


def test_worker_on_another_protocol_version():
    from dllama.net.frames import CHALLENGE, HEADER, MAGIC, PROTOCOL_VERSION

    ready = threading.Event()
    port = []

    def serve():
        async def newer(reader, writer):
            await reader.readexactly(16)
            body = b"\x81\xa5proto" + bytes([PROTOCOL_VERSION + 1])  # msgpack {"proto": newer}
            writer.write(HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, CHALLENGE.code, 0, 0, len(body)) + body)
            await writer.drain()
            await asyncio.sleep(2)
            writer.close()

        async def main():
            server = await asyncio.start_server(newer, "127.0.0.1", 0)
            port.append(server.sockets[0].getsockname()[1])
            ready.set()
            await asyncio.sleep(30)

        asyncio.run(main())

    threading.Thread(target=serve, daemon=True).start()
    assert ready.wait(10)
    r = run_dllama("inference", "-p", "hi", "-n", "2", "--workers", f"127.0.0.1:{port[0]}")
    one_error_line(r, f"127.0.0.1:{port[0]}", f"version {PROTOCOL_VERSION + 1}")


def test_wrong_secret_is_refused(workers):
    (w,) = workers(1, "--secret", "right")
    r = run_dllama("inference", "-p", "hi", "-n", "2", "--workers", w.address, "--secret", "wrong")
    one_error_line(r, w.address, "authentication failed")


def test_model_too_big_for_the_plan(workers):
    (w,) = workers(1, "--max-memory", "10")
    r = run_dllama("inference", "-p", "hi", "-n", "2", "--workers", w.address)
    one_error_line(r, "model too big for the plan", w.address, "10 MB")


def _run_and_signal(workers_, extra: list[str], sig, after_text: int = 40, steps: int = 160, victim: int = 1):
    """Start an inference across the workers, send `sig` to workers_[victim] once some text has
    streamed, and return (completed process, seconds from the signal to the exit)."""
    addresses = ",".join(w.address for w in workers_)
    # unbuffered bytes: what we read before the signal must not sit in a reader's buffer that
    # communicate() would bypass
    proc = subprocess.Popen(DLLAMA + ["inference", "-p", PROMPT, "-n", str(steps), *GREEDY_F64,
                                      "--workers", addresses, "--sync", "ring", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    streamed = b""
    while len(streamed) < len(PROMPT) + after_text:  # the prompt is echoed first
        byte = proc.stdout.read(1)
        assert byte, proc.stderr.read()
        streamed += byte
    workers_[victim].kill(sig)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=120)
    return (subprocess.CompletedProcess(proc.args, proc.returncode, (streamed + out).decode(), err.decode()),
            time.monotonic() - t0)


def test_worker_killed_mid_answer_without_recovery_keeps_the_text(workers):
    ws = workers(3)
    r, seconds = _run_and_signal(ws, ["--no-recover"], signal.SIGKILL)
    line = one_error_line(r, ws[1].address)
    assert re.search(r"after \d+ generated tokens", line)
    assert r.stdout.startswith(PROMPT) and len(r.stdout) > len(PROMPT) + 40  # the text so far is kept
    assert seconds < 5
    # the survivors are ready for the next root
    again = run_dllama("inference", "-p", "hi", "-n", "4", "--temperature", "0", "--threads", "1",
                       "--workers", f"{ws[0].address},{ws[2].address}", "--json")
    assert json_report(again)["nodes"] == 3


def test_worker_killed_mid_answer_is_recovered(workers, one_node_answer):
    ws = workers(3)
    r, _ = _run_and_signal(ws, ["--timeout", "5"], signal.SIGKILL, after_text=20, steps=48)
    assert r.returncode == 0, r.stderr
    assert r.stdout == PROMPT + one_node_answer["text"] + "\n"  # the answer of a run without failure
    assert "re-planning" in r.stderr and re.search(r"recovered in [\d.]+ s: 3 node", r.stderr), r.stderr


def test_gather_mode_recovers_with_the_exact_answer(workers, one_node_f32_answer):
    ws = workers(3)
    r, _ = _run_and_signal(ws, ["--timeout", "5", "--sync-mode", "gather", "--sync-dtype", "q80"], signal.SIGKILL,
                           after_text=20, steps=48)
    assert r.returncode == 0, r.stderr
    assert r.stdout == PROMPT + one_node_f32_answer["text"] + "\n"
    assert re.search(r"recovered in [\d.]+ s: 3 node", r.stderr), r.stderr


def test_worker_stopped_mid_answer_is_recovered_after_the_timeout(workers, one_node_answer):
    ws = workers(3)
    try:
        r, seconds = _run_and_signal(ws, ["--timeout", "3"], signal.SIGSTOP, after_text=20, steps=48)
    finally:
        ws[1].kill(signal.SIGCONT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == PROMPT + one_node_answer["text"] + "\n"
    assert "sent nothing for 3 s" in r.stderr, r.stderr
    assert re.search(r"recovered in [\d.]+ s: 3 node", r.stderr), r.stderr
    assert seconds >= 3


def test_a_killed_root_frees_its_workers(workers):
    ws = workers(2)
    proc = subprocess.Popen(DLLAMA + ["inference", "-p", PROMPT, "-n", "400", "--threads", "1",
                                      "--workers", ",".join(w.address for w in ws)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
    assert proc.stdout.read(len(PROMPT) + 10)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = run_dllama("inference", "-p", "hi", "-n", "4", "--threads", "1", "--workers",
                   ",".join(w.address for w in ws), "--json")
    assert json_report(r)["nodes"] == 3


def test_uneven_and_measured_weights_give_the_same_answer(workers, one_node_tokens):
    ws = workers(2)
    addresses = ",".join(w.address for w in ws)
    for weights in ("2,1,1", "auto"):
        r = json_report(run_dllama("inference", "-p", PROMPT, "-n", "48", *GREEDY_F64, "--workers", addresses,
                                   "--weights", weights, "--json"))
        assert r["tokens"] == one_node_tokens
    one_error_line(run_dllama("inference", "-p", "hi", "-n", "2", "--workers", addresses, "--weights", "1,1"),
                   "--weights has 2 entries for 3 nodes")


def test_chat_and_perplexity_across_nodes():
    """Two turns of chat on 3 nodes in gather mode print exactly the 1-node answers (whatever
    this CPU's llama.cpp would say); perplexity on 3 nodes in f64 is the 1-node figure."""
    questions = "What is the capital of France?\nAnd of Italy?\n"
    chat = run_dllama("chat", "--local-workers", "2", "--sync-mode", "gather", "--temperature", "0",
                      "--max-tokens", "24", input=questions)
    alone = run_dllama("chat", "--temperature", "0", "--max-tokens", "24", input=questions)
    assert chat.returncode == alone.returncode == 0, chat.stderr + alone.stderr
    assert len([line for line in chat.stdout.splitlines() if line.strip()]) >= 2
    assert chat.stdout == alone.stdout
    one = json_report(run_dllama("perplexity", "-f", "tests/data/lighthouse.txt", "--max-tokens", "96",
                                 "--sync-dtype", "f64", "--json"))
    three = json_report(run_dllama("perplexity", "-f", "tests/data/lighthouse.txt", "--max-tokens", "96",
                                   "--sync-dtype", "f64", "--local-workers", "2", "--json"))
    assert three["nodes"] == 3 and three["tokens"] == one["tokens"] == 95
    assert three["perplexity"] == pytest.approx(one["perplexity"], rel=1e-9)


def test_root_carries_on_alone_when_its_only_worker_dies(workers, one_node_answer):
    ws = workers(1)
    r, _ = _run_and_signal(ws, ["--timeout", "5"], signal.SIGKILL, after_text=20, steps=48, victim=0)
    assert r.returncode == 0, r.stderr
    assert r.stdout == PROMPT + one_node_answer["text"] + "\n"
    assert re.search(r"recovered in [\d.]+ s: 1 node", r.stderr), r.stderr


IDLE_TIMEOUT = 2.5  # seconds; without heartbeats either side would give up on the other after this


def test_idle_chat_keeps_its_workers(workers):
    """A user who thinks for 4x the timeout (2.5 s on both sides) between two messages: the
    connections stay alive on heartbeats, so the worker logs nothing meanwhile, the root does not
    re-plan, and no weights are sent again (one session, set up once)."""
    (worker,) = workers(1, "--timeout", str(IDLE_TIMEOUT))
    log: list[tuple[float, str]] = []  # (time, line) of the worker's log
    log_reader = threading.Thread(target=lambda: log.extend((time.monotonic(), line) for line in worker.proc.stderr),
                                  daemon=True)
    log_reader.start()
    chat = subprocess.Popen(DLLAMA + ["chat", "--workers", worker.address, "--temperature", "0", "--max-tokens", "8",
                                      "--threads", "1", "--timeout", str(IDLE_TIMEOUT)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: chat.stdout.read(1), "")), daemon=True)
    reader.start()
    try:
        chat.stdin.write("Hi!\n")
        chat.stdin.flush()
        deadline = time.monotonic() + 120
        while "\n" not in "".join(out) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "\n" in "".join(out), "no first answer"
        time.sleep(2)  # the first answer's last log lines
        idle_from = time.monotonic()
        time.sleep(4 * IDLE_TIMEOUT)
        idle_to, answered = time.monotonic(), len("".join(out))
        chat.stdin.write("And what is 2+2?\n")
        chat.stdin.close()
        assert chat.wait(120) == 0
    finally:
        if chat.poll() is None:
            chat.kill()
    reader.join(10)
    err = chat.stderr.read()
    assert len("".join(out)) > answered, "no second answer"
    assert "re-plan" not in err and "Traceback" not in err, err
    worker.proc.terminate()
    log_reader.join(10)
    text = "".join(line for _t, line in log)
    assert not [line for t, line in log if idle_from <= t <= idle_to], text  # silent while the user thinks
    assert text.count("connected") == 1 and text.count("tensors (") == 1, text  # one session, weights sent once
    assert not re.search(r"no reply|sent nothing|failed|error", text), text  # "the root ended it" at exit is fine
