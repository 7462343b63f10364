"""A node lost under load, through the real commands: `dllama serve` with two `dllama worker`
daemons (gather mode: any node count gives the 1-node answer) streams 8 answers at once when one
worker is killed (SIGKILL; speculating), or stopped (SIGSTOP) for longer than --timeout. Every
stream completes with the answer its request gets alone (plainly), none is lost or answered twice,
the cluster re-plans once for all of them, and the worker, once back, is used again from the next
request."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import pytest

from dllama.batching import STEP_KINDS
from dllama.engine import LocalEngine
from dllama.generate import Generator
from dllama.sampling import SamplingParams

from .cluster_helpers import WorkerProcess
from .server_helpers import RawStream, cli_server, get, metrics, post, wait_until

CTX = 256
N_TOKENS = 24
STREAMS = 8
QUESTIONS = [[{"role": "user", "content": f"Tell me one fact about the number {i + 3}."}] for i in range(STREAMS)]


@pytest.fixture(scope="module")
def alone(gguf_model, tokenizer):
    """Each question's greedy answer, asked alone of one node."""
    async def answers():
        generator = Generator(LocalEngine(gguf_model, CTX), tokenizer)
        return [(await generator.generate(tokenizer.chat_ids(q), SamplingParams(temperature=0.0), N_TOKENS)).text
                for q in QUESTIONS]

    return asyncio.run(answers())


def _stream(url: str, question, out: dict, i: int, started: threading.Event, extra: dict) -> None:
    """One streamed request: its text, finish reasons and [DONE]s go to out[i]."""
    got = out[i] = {"text": "", "finish": [], "done": 0, "chunks": 0, "error": None}
    try:
        stream = RawStream(url, "/v1/chat/completions", {"messages": question, "max_tokens": N_TOKENS,
                                                         "temperature": 0, "stream": True, **extra}, timeout=300)
        for event in stream.events():
            if event == "[DONE]":
                got["done"] += 1
                continue
            if "error" in event:
                got["error"] = event["error"]
                continue
            choice = event["choices"][0]
            got["text"] += choice["delta"].get("content") or ""
            got["chunks"] += 1
            if choice["finish_reason"]:
                got["finish"].append(choice["finish_reason"])
            if got["chunks"] >= 4:
                started.set()
    except Exception as e:  # reported by the test's assertions
        got["error"] = repr(e)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_eight_streams_survive_a_worker_lost(model_path, alone, tmp_path, synthetic_model, sig):
    """With SIGKILL the streams also speculate: a draft model (random: its drafts refused, rewound on
    every node), n-gram and auto drafts, and none, all in the steps the failure interrupts."""
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    workers = [WorkerProcess("--timeout", "3", log_file=log) for log in logs]
    victim = workers[1]
    speculating = sig == signal.SIGKILL
    speculate = ["--speculate", f"draft:{synthetic_model('Q8_0')}" if speculating else "off"]
    asks = [{}, {"speculate": "ngram"}, {"speculate": "auto"}, {"speculate": False}] if speculating else [{}]
    try:
        with cli_server("--model", model_path, "--workers", f"{workers[0].address},{victim.address}",
                        "--ctx-size", str(CTX), "--threads", "1", "--sync-mode", "gather", "--timeout", "3",
                        "--max-requests-per-client", str(STREAMS), *speculate) as (_proc, url):
            before = metrics(url)
            out: dict[int, dict] = {}
            started = [threading.Event() for _ in range(STREAMS)]
            threads = [threading.Thread(target=_stream, args=(url, q, out, i, started[i], asks[i % len(asks)]),
                                        daemon=True) for i, q in enumerate(QUESTIONS)]
            for t in threads:
                t.start()
            assert all(e.wait(120) for e in started), out  # every stream is mid-answer
            victim.kill(sig)
            t_signal = time.monotonic()
            for t in threads:
                t.join(300)
            recovered_after = time.monotonic() - t_signal
            for i in range(STREAMS):
                got = out[i]
                assert got["error"] is None and got["finish"] == ["length"] and got["done"] == 1, (i, got)
                assert got["text"] == alone[i], i
            after = metrics(url)
            ok = ("dllama_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))
            assert after[ok] - before.get(ok, 0) == STREAMS  # none lost, none answered twice
            replans = ("dllama_cluster_replans_total", ())
            assert after[replans] - before[replans] == 1  # one failure, one re-plan: for all 8
            # they ran batched, before and after the failure
            assert after[("dllama_batch_sequences_total", ())] / after[("dllama_batch_steps_total", ())] > 4
            by_kind = {k: after[("dllama_batch_kind_steps_total", (("kind", k),))] for k in STEP_KINDS}
            assert sum(by_kind.values()) == after[("dllama_batch_steps_total", ())] and by_kind["decode"] > 0
            assert json.loads(get(url, "/health")[1])["nodes"] == 2
            drafted = ("dllama_speculative_drafted_tokens_total", ())
            assert (after[drafted] > 0) == speculating
            # the worker comes back (a new one on its port, or the same one let go on): the next request uses it
            if sig == signal.SIGKILL:
                victim.stop()
                victim = workers[1] = WorkerProcess("--timeout", "3", "--port", str(victim.port), log_file=logs[1])
            else:
                victim.kill(signal.SIGCONT)
                assert wait_until(lambda: "ready for the next root" in logs[1].read_text(), 30)
            status, _h, answer = post(url, "/v1/chat/completions", {"messages": QUESTIONS[0], "temperature": 0,
                                                                     "max_tokens": N_TOKENS})
            assert status == 200 and answer["choices"][0]["message"]["content"] == alone[0]
            health = json.loads(get(url, "/health")[1])
            assert health["nodes"] == 3 and list(health["node_status"].values()) == ["up"] * 3, health
            assert metrics(url)[replans] - before[replans] == 2  # and once more to take it back
            print(f"\n{sig.name}: {STREAMS} streams finished {recovered_after:.1f} s after the signal")
    finally:
        for w in workers:
            w.stop()
