"""Groups as the cluster builds them: ranks in separate processes; real worker daemons that own one
port for control and peer connections (their session filter, their one-root-at-a-time refusal) and
a root that only connects out; the counters the engine reports; and the bench-sync command."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from dllama.cluster import messages as M
from dllama.cluster import protocol as P
from dllama.cluster.worker import Worker
from dllama.engine import LocalEngine
from dllama.errors import PeerClosed, PeerTimeout
from dllama.gguf_model import GGUFModel
from dllama.net import connect
from dllama.net.frames import HEADER_SIZE
from dllama.sync import run_processes
from dllama.sync_config import SyncConfig

from .cluster_helpers import HandRoot, greedy_tokens, in_process_cluster

PROMPT = [1, 17, 300, 4242, 99]


def test_every_algorithm_across_processes():
    results = run_processes(3, "tests.sync_helpers:job_all_algorithms", args=(777,), algo="auto", timeout=20)
    assert len(results) == 3 and all(r == results[0] for r in results)
    assert set(results[0]) == {"star", "ring", "mesh", "rd", "rabenseifner", "auto"}


def test_counters_bytes_and_seconds():
    n = 10_000
    # heartbeats count too: a PING sent while the other rank's loop was busy (loading the job under
    # load: CI once saw two of them) arrives after its reset, so none within the test's time
    stats = run_processes(2, "tests.sync_helpers:job_stats", args=(n,), algo="ring", group_kwargs={"heartbeat": 3600})
    for s, other in zip(stats, reversed(stats)):
        assert s["value"] == 2.0 and s["calls"] == 1 and s["seconds"] > 0
        # ring, p=2: half the vector each way in each phase, a 16-byte header per frame, and the
        # barrier's one or two empty frames
        assert n * 4 + 32 <= s["sent"] <= n * 4 + 64
        # what the other rank sent, give or take one empty frame: its first barrier frame may land
        # before this rank's reset, its goodbye (it closes once its counters are read) before this
        # rank reads its own (CI saw the latter)
        assert other["sent"] - HEADER_SIZE <= s["recv"] <= other["sent"] + HEADER_SIZE


@pytest.fixture(scope="module")
def model(synthetic_model):
    return GGUFModel(synthetic_model("Q4_1"))


@pytest.mark.parametrize("algo", ["ring", "auto"])
async def test_root_and_worker_daemons(model, algo):
    """A root that only connects out and two real worker daemons, each on one port for control and
    peer connections, build a 3-rank group with `algo`: its all-reduces (reduce mode, f64) give the
    1-node answer in f64, and every worker sent and received sync bytes."""
    async with in_process_cluster(model, 2, algo=algo, sync_dtype="f64", ctx=64) as (engine, _):
        tokens = await greedy_tokens(engine, PROMPT, 6)
        figures = [w.last_stats for w in engine.workers]
    alone = LocalEngine(model, 64, SyncConfig(dtype="f64"))
    try:
        assert tokens == await greedy_tokens(alone, PROMPT, 6)
    finally:
        await alone.close()
    assert len(figures) == 2 and all(f["sent"] > 0 and f["recv"] > 0 for f in figures)


async def _closed_by_worker(conn) -> bool:
    """Whether the worker hangs up on `conn` (within 5 s) instead of keeping it."""
    try:
        await conn.recv_msg(timeout=5)
    except PeerTimeout:
        return False
    except PeerClosed:
        return True
    finally:
        await conn.close()
    raise AssertionError("the worker sent a message to a peer connection")


async def test_worker_parks_only_peers_of_its_session(model):
    """The worker's session filter: a peer connection is parked for the sync group only while it
    claims the session in progress; one claiming another session, or arriving before or after a
    session, is hung up on at once (it would otherwise wait in the inbox for ever)."""
    worker = Worker(timeout=10)
    host, port = await worker.start("127.0.0.1", 0)
    root = HandRoot(model, (host, port))
    try:
        assert await _closed_by_worker(await connect(host, port, role="peer", rank=0, session="none-yet"))
        await root.open_session()
        assert await _closed_by_worker(await connect(host, port, role="peer", rank=0, session="another"))
        parked = await connect(host, port, role="peer", rank=5, session=root.session)
        assert not await _closed_by_worker(parked) and len(worker.inbox) == 1
        session = root.session
        await root.close()
        for _ in range(100):  # the worker ends the session after END
            if worker.session_id is None:
                break
            await asyncio.sleep(0.05)
        assert await _closed_by_worker(await connect(host, port, role="peer", rank=0, session=session))
    finally:
        await root.close()
        await worker.close()


async def test_a_second_root_is_refused_while_a_session_runs(model):
    """The worker serves one root: a second control connection during a session is answered
    "busy" (a real root retries), and the first session goes on undisturbed."""
    worker = Worker(timeout=10)
    address = await worker.start("127.0.0.1", 0)
    first = HandRoot(model, address)
    try:
        await first.open_session()
        second = await connect(*address, role="control", session="other", timeout=5)
        try:
            kind, body = await second.recv_msg((P.NEED, P.FAILED), timeout=5)
        finally:
            await second.close()
        assert kind == P.FAILED.name and "busy" in body["error"]
        step, x = first.forward(PROMPT)
        kind, body = await first.send_step(M.to_wire(step), x, step)
        assert kind == P.RESULT.name, body
    finally:
        await first.close()
        await worker.close()


def test_bench_sync_command_json():
    out = subprocess.run(
        [sys.executable, "-m", "dllama", "bench-sync", "--nodes", "2", "--algo", "ring,auto", "--sizes", "1K,96K",
         "--dtype", "f32,q80", "--iters", "2", "--warmup", "1", "--json"],
        capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    rows = data["results"][0]["rows"]
    assert len(rows) == 2 * 2 * 2 and all(r["check"] == "ok" for r in rows)
    assert {r["algo"] for r in rows} == {"ring", "auto"}
    q80 = [r for r in rows if r["dtype"] == "q80"]
    assert all(0 < r["rel_err"] < 0.02 for r in q80)
    assert all(r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2) for r in rows)


def test_bench_sync_rejects_bad_options():
    out = subprocess.run([sys.executable, "-m", "dllama", "bench-sync", "--sizes", "12Q"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "bad size '12Q'" in out.stderr
