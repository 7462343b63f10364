"""Groups as the cluster will build them: ranks in separate processes, a worker daemon that owns
one port for control and peer connections, a root that only connects out; the counters the
engine reports; and the bench-sync command."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest

from dllama.net import Listener, connect
from dllama.sync import init_process_group, run_processes

from .sync_helpers import daemon_dispatch

SECRET = "cluster-secret"


def test_every_algorithm_across_processes():
    results = run_processes(3, "tests.sync_helpers:job_all_algorithms", args=(777,), algo="auto", timeout=20)
    assert len(results) == 3 and all(r == results[0] for r in results)
    assert set(results[0]) == {"star", "ring", "mesh", "rd", "rabenseifner", "auto"}


def test_counters_bytes_and_seconds():
    n = 10_000
    stats = run_processes(2, "tests.sync_helpers:job_stats", args=(n,), algo="ring")
    for s in stats:
        assert s["value"] == 2.0 and s["calls"] == 1 and s["seconds"] > 0
        # ring, p=2: half the vector each way in each phase, a 16-byte header per frame, and the
        # barrier's one or two empty frames
        assert n * 4 + 32 <= s["sent"] <= n * 4 + 64 and n * 4 + 32 <= s["recv"] <= n * 4 + 64


async def _worker_daemon(ready: asyncio.Future, results: list):
    """What `dllama worker --port P` does with one port: control connections to the daemon,
    peer connections parked in an inbox for the sync group."""
    dispatch, control, inbox = daemon_dispatch()
    async with Listener(dispatch, secret=SECRET) as listener:
        await listener.start("127.0.0.1", 0)
        ready.set_result(listener.port)
        ctl = await control.get()
        _, job = await ctl.recv_msg(timeout=10)
        group = await init_process_group(job["rank"], job["world"], job["addrs"], session=job["session"],
                                         algo=job["algo"], secret=SECRET, incoming=inbox, spin=0)
        x = np.full(6, job["rank"] + 1.0, np.float32)
        await group.all_reduce(x)
        await ctl.send_msg("message", {"rank": group.rank, "x": x.tolist(), "sent": group.stats.bytes_sent})
        results.append(group.stats)
        await group.close()
        await ctl.close()


@pytest.mark.parametrize("algo", ["ring", "auto"])
async def test_root_and_worker_daemons(algo):
    loop = asyncio.get_running_loop()
    ports = [loop.create_future() for _ in range(2)]
    stats = []
    daemons = [asyncio.ensure_future(_worker_daemon(f, stats)) for f in ports]
    workers = [("127.0.0.1", await f) for f in ports]
    addrs = [None] + workers  # the root (rank 0) does not listen: it connects to everyone
    controls = [await connect(h, p, role="control", secret=SECRET, peer_rank=i + 1) for i, (h, p) in enumerate(workers)]
    for i, ctl in enumerate(controls):
        await ctl.send_msg("message", {"rank": i + 1, "world": 3, "addrs": addrs, "session": "job-7", "algo": algo})
    group = await init_process_group(0, 3, addrs, session="job-7", algo=algo, secret=SECRET, spin=0)
    x = np.full(6, 1.0, np.float32)
    await group.all_reduce(x)
    assert x.tolist() == [6.0] * 6
    replies = [(await ctl.recv_msg(timeout=10))[1] for ctl in controls]
    assert [r["x"] for r in replies] == [[6.0] * 6] * 2 and all(r["sent"] > 0 for r in replies)
    await group.close()
    await asyncio.gather(*daemons)
    for ctl in controls:
        await ctl.close()


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
