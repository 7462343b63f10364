"""Memory limits as a container or systemd sets them (issue: a worker in a 250 MB cgroup accepted a
302 MB slice and was killed mid-transfer): what a node says it can take is the tightest of the
kernel's MemAvailable, its memory cgroups' limits (v2 or v1) and --max-memory, so a slice that does
not fit is refused before any byte is sent, naming the node, and the worker lives on."""

from __future__ import annotations

import contextlib
import os
import re

import pytest

from dllama.node import cgroup_headroom, mem_available

from .cluster_helpers import WorkerProcess, run_dllama
from .home_cluster import MemoryCgroup, Unavailable

MB = 1_000_000


def _write(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (folder / name.replace("_", ".", 1)).write_text(f"{value}\n")


def test_the_tightest_cgroup_limit_counts_v1(tmp_path):
    memory = tmp_path / "memory"
    _write(memory, memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=5_000 * MB)  # the root: none
    _write(memory / "system.slice", memory_limit_in_bytes=800 * MB, memory_usage_in_bytes=300 * MB)
    _write(memory / "system.slice" / "worker", memory_limit_in_bytes=1_000 * MB, memory_usage_in_bytes=250 * MB)
    text = "5:cpu:/\n4:memory:/system.slice/worker\n0::/\n"
    assert cgroup_headroom(text, str(tmp_path)) == 500 * MB  # the parent's 800 - 300, not the worker's 750
    # the path of the host, in a container whose mount's top is its own cgroup (no cgroup namespace)
    _write(memory, memory_limit_in_bytes=250 * MB, memory_usage_in_bytes=100 * MB)
    assert cgroup_headroom("4:memory:/docker/0123abcd\n", str(tmp_path)) == 150 * MB
    assert cgroup_headroom("4:cpu,cpuacct:/x\n", str(tmp_path)) is None  # no memory controller: no limit known
    (memory / "memory.stat").write_text("cache 60000000\ntotal_inactive_file 40000000\n")
    assert cgroup_headroom("4:memory:/docker/0123abcd\n", str(tmp_path)) == 190 * MB  # page cache it can drop


def test_the_tightest_cgroup_limit_counts_v2_and_hybrid(tmp_path):
    v2 = tmp_path / "v2"
    _write(v2, cgroup_controllers="cpu memory")
    _write(v2 / "user.slice", memory_max=2_000 * MB, memory_current=1_900 * MB)
    _write(v2 / "user.slice" / "dllama.service", memory_max="max", memory_current=120 * MB)
    assert cgroup_headroom("0::/user.slice/dllama.service\n", str(v2)) == 100 * MB
    (v2 / "user.slice" / "memory.stat").write_text("anon 1000\ninactive_file 50000000\n")
    assert cgroup_headroom("0::/user.slice/dllama.service\n", str(v2)) == 150 * MB
    _write(v2 / "user.slice", memory_max="max", memory_current=1_900 * MB)
    assert cgroup_headroom("0::/user.slice/dllama.service\n", str(v2)) is None
    hybrid = tmp_path / "hybrid"  # v1 controllers, and the unified hierarchy at unified/
    _write(hybrid / "unified" / "a", memory_max=300 * MB, memory_current=400 * MB)
    assert cgroup_headroom("0::/a\n", str(hybrid)) == 0  # over its limit (reclaim pending): nothing left


@contextlib.contextmanager
def memory_cgroup(limit: int):
    """A memory cgroup limited to `limit` bytes (tests/home_cluster.py), or a skip saying why none can be made."""
    try:
        cgroup = MemoryCgroup(limit, f"dllama-test-{os.getpid()}")
    except Unavailable as e:
        pytest.skip(str(e))
    try:
        yield cgroup
    finally:
        cgroup.remove()


def test_a_worker_in_a_memory_cgroup_refuses_what_does_not_fit_and_lives_on():
    limit = 200 * MB  # (an idle worker holds ~50 MB of it: a 256-token context fits, an 8192-token one not)
    assert mem_available() > limit  # (else the kernel's figure alone would refuse it)
    with memory_cgroup(limit) as cgroup:
        worker = WorkerProcess(preexec_fn=cgroup.join)
        try:
            # the KV cache of a whole 8192-token context is more than the cgroup leaves it
            big = run_dllama("inference", "-p", "hi", "-n", "2", "--threads", "1", "--ctx-size", "8192",
                             "--workers", worker.address)
            assert big.returncode != 0 and big.stderr.count("\n") == 1, big.stderr
            found = re.search(rf"model too big for the plan: worker 1 \(127\.0\.0\.1:{worker.port}\) needs (\d+) MB "
                              r"for its slice and KV cache but has (\d+) MB available", big.stderr)
            assert found, big.stderr
            needs, has = int(found[1]), int(found[2])
            assert needs > has and has < limit // MB  # the cgroup's room, not the machine's
            print(f"\na worker in a {limit // MB} MB cgroup: needs {needs} MB for an 8192-token context, has {has} MB")
            assert worker.proc.poll() is None  # refused before any byte: it lives on
            small = run_dllama("inference", "-p", "hi", "-n", "2", "--threads", "1", "--ctx-size", "256",
                               "--workers", worker.address, "--json")
            assert small.returncode == 0, small.stderr[-2000:]
        finally:
            log = worker.stop()
    assert "Traceback" not in log, log
