"""A home cluster in a box (tests/home_cluster.py): a model none of its nodes can hold runs on a root
and 3 workers, each in a memory cgroup 2.5x smaller than the model, and gives the 1-node answer; the
same model on one such node is refused before it loads, with one error line (not killed by the
kernel). And the test bed itself: each node in its own namespace, cgroup and cores, its links as slow
as asked."""

from __future__ import annotations

import json
import os
import re

import pytest

from dllama.synthetic import SyntheticSpec, write_synthetic

from .home_cluster import HomeCluster, Unavailable

MB = 1_000_000
LIMIT = 500 * MB  # each node's memory (an idle worker holds ~50 MB of it)
# F16 (written fast: no quantizing), 10 layers 2048 wide: 1.3 GB, 2.6x a node's limit; a worker's
# quarter with its largest part counted twice (while packing) and the margin fits in the rest
BIG = SyntheticSpec(dim=2048, n_layers=10, n_heads=16, n_kv_heads=4, ffn_dim=5632, qtype="F16", seed=7)
PROMPT = "The lighthouse keeper"
GREEDY = ["-p", PROMPT, "-n", "8", "--temperature", "0", "--threads", "1", "--ctx-size", "128", "--json"]


@pytest.fixture(scope="module")
def big_model(tmp_path_factory, model_path):
    path = tmp_path_factory.mktemp("home") / "big-f16.gguf"
    write_synthetic(str(path), BIG, model_path)
    assert os.path.getsize(path) >= 2.5 * LIMIT
    yield str(path)
    path.unlink()


def _cluster(*args, **kwargs) -> HomeCluster:
    try:
        return HomeCluster(*args, **kwargs).__enter__()
    except Unavailable as e:
        pytest.skip(str(e))


def test_a_model_no_node_can_hold_runs_on_four_capped_nodes(big_model):
    one_node = HomeCluster(0)  # (no limit: the reference)
    reference = one_node.run_root("inference", "--model", big_model, *GREEDY, workers=False)
    assert reference.returncode == 0, reference.stderr[-2000:]
    cluster = _cluster(3, memory=LIMIT, cores=[{0}, {1}, {0}, {1}])
    try:
        cluster.start_workers()
        capped = cluster.run_root("inference", "--model", big_model, *GREEDY, "--sync-mode", "gather")
        alive = cluster.alive()
        peaks = [cgroup.peak() for cgroup in cluster.cgroups]
        logs = [log.read_text() for log in cluster.logs]
    finally:
        cluster.close()
    assert capped.returncode == 0, (capped.stderr[-3000:], logs)
    assert alive == [True] * 3, logs
    report, expected = json.loads(capped.stdout), json.loads(reference.stdout)
    assert report["nodes"] == 4 and report["sync_mode"] == "gather"
    assert report["text"] == expected["text"] and len(report["text"]) > len(PROMPT)  # gather: the 1-node answer
    print(f"\n{os.path.getsize(big_model) / MB:.0f} MB model on root + 3 workers in {LIMIT / MB:.0f} MB cgroups; "
          f"peak use per node (page cache included) {[None if p is None else round(p / MB) for p in peaks]} MB")


def test_the_same_model_on_one_capped_node_is_one_error_line(big_model):
    node = _cluster(0, memory=LIMIT)
    try:
        alone = node.run_root("inference", "--model", big_model, *GREEDY, workers=False)
    finally:
        node.close()
    assert alone.returncode != 0 and "Traceback" not in alone.stderr, alone.stderr[-3000:]
    assert alone.stderr.count("\n") == 1 and alone.stderr.startswith("error: "), alone.stderr
    found = re.search(r"model too big for the plan: this node needs (\d+) MB for its slice and KV cache but has "
                      r"(\d+) MB available \(run it across workers", alone.stderr)
    assert found and int(found[1]) > LIMIT / MB > int(found[2]), alone.stderr


def _status(pid: int, key: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith(key + ":"))


@pytest.mark.netns
@pytest.mark.slow  # (a check of the test bed itself: the default suite tests namespaces and the relay each)
def test_the_test_bed_puts_each_node_in_its_namespace_cgroup_and_cores_behind_slow_links(model_path):
    """Root + 2 workers, each in its own network namespace (its own address), memory cgroup and
    core, the links shaped to 100 Mbit and 1 ms one way: the workers run where they were put, every
    token pays the latency at each of its 120 collectives, and the answer is the 1-node answer."""
    one_way = 0.001
    reference = HomeCluster(0).run_root("inference", *GREEDY, workers=False)
    assert reference.returncode == 0, reference.stderr[-2000:]
    cluster = _cluster(2, namespaces=True, rate="100mbit", one_way_s=one_way, memory=[None, 300 * MB, 300 * MB],
                       cores=[{0}, {1}, {0}])
    try:
        cluster.start_workers()
        for i, proc in enumerate(cluster.workers, start=1):
            assert _status(proc.pid, "Cpus_allowed_list") == str(min(cluster.cores[i]))
            with open(f"/proc/{proc.pid}/cgroup") as f:
                assert os.path.basename(cluster.cgroups[i].folder) in f.read()
            assert os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        assert [a.split(":")[0] for a in cluster.addresses] == cluster.bed.addresses[1:]
        run = cluster.run_root("inference", *GREEDY, "--sync-mode", "gather", "--sync", "mesh", "--speculate", "off")
    finally:
        cluster.close()
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["nodes"] == 3 and report["tokens"] == json.loads(reference.stdout)["tokens"]
    # each all-gather waits for the others' parts: one latency at least, 4 a layer in gather mode, 30 layers
    assert report["ms_per_token"]["total"] >= 4 * 30 * one_way * 1e3, report
    print(f"\n3 nodes in namespaces, 100 Mbit and {one_way * 1e3:g} ms one way: {report['ms_per_token']} ms a token")
