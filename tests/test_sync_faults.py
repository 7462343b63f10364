"""Faults with real processes and real signals: a rank SIGKILLed mid-collective makes the others
fail fast, naming it; a SIGSTOPped rank is declared dead after the configured timeout."""

from __future__ import annotations

import signal

import pytest

from dllama.sync import ProcessCluster

N = 20_000  # floats per all-reduce: a few hundred microseconds per call


def _wait_looping(cluster):
    for r in range(cluster.p):
        cluster.wait_event(r, "looping", 60)


def _failures(cluster, ranks, timeout):
    """The 'failed' event of each rank (type, message, parent-side arrival time)."""
    return {r: cluster.wait_event(r, "failed", timeout) for r in ranks}


@pytest.mark.parametrize("algo", ["ring", "mesh", "star"])
def test_sigkill_mid_collective_fails_everyone_fast(algo):
    with ProcessCluster(4, "tests.sync_helpers:job_loop", args=(N, 60.0), algo=algo, timeout=30.0) as cluster:
        _wait_looping(cluster)
        victim = 2
        host, port = cluster.addrs[victim]
        t_kill = cluster.kill(victim, signal.SIGKILL)
        failed = _failures(cluster, [0, 1, 3], timeout=10)
        for r, ev in failed.items():
            assert ev["t"] - t_kill < 2.0, f"rank {r} took {ev['t'] - t_kill:.2f} s to notice"
            assert ev["type"] in ("PeerClosed", "PeerAborted"), ev
            assert f"rank {victim} ({host}:{port})" in ev["message"], ev["message"]
        # a rank that saw the EOF itself says the peer died
        assert any(ev["type"] == "PeerClosed" and "connection lost" in ev["message"] for ev in failed.values())


@pytest.mark.parametrize("algo", ["ring", "rd"])
def test_sigstop_is_a_timeout(algo):
    timeout = 1.0
    with ProcessCluster(3, "tests.sync_helpers:job_loop", args=(N, 60.0), algo=algo, timeout=timeout) as cluster:
        _wait_looping(cluster)
        victim = 1
        host, port = cluster.addrs[victim]
        t_stop = cluster.kill(victim, signal.SIGSTOP)
        failed = _failures(cluster, [0, 2], timeout=10)
        first = min(ev["t"] for ev in failed.values()) - t_stop
        assert 0.8 * timeout <= first <= timeout + 0.75, f"first failure after {first:.2f} s"
        for r, ev in failed.items():
            assert ev["t"] - t_stop <= timeout + 1.5, f"rank {r} took {ev['t'] - t_stop:.2f} s"
            assert f"rank {victim} ({host}:{port})" in ev["message"], ev["message"]
        assert any(ev["type"] == "PeerTimeout" and "sent nothing for 1 s" in ev["message"] for ev in failed.values())
