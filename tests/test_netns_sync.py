"""Multi-host: 4 ranks in 4 network namespaces (own addresses 10.77.0.1-4, a bridge in its own
namespace, every link shaped to 100 Mbit with tc tbf). All algorithms must be correct; the
star-vs-ring timings are printed (run with -s to see the crossover), not asserted."""

from __future__ import annotations

import pytest

from dllama.sync.netns import NetnsTestbed, NetnsUnavailable
from dllama.sync.bench import format_table

pytestmark = pytest.mark.netns

SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10]


@pytest.fixture(scope="module")
def testbed():
    bed = NetnsTestbed(4, rate="100mbit")
    try:
        bed.setup()
    except NetnsUnavailable as e:
        pytest.skip(f"cannot build network namespaces here: {e}")
    yield bed
    bed.teardown()


def test_all_algorithms_correct_across_hosts(testbed):
    with testbed.cluster("tests.sync_helpers:job_all_algorithms", args=(1000,), algo="auto", timeout=20) as cl:
        results = cl.results(timeout=300)
        assert [a[0] for a in cl.addrs] == testbed.addresses  # each rank on its own host address
    assert all(r == results[0] for r in results), "ranks disagree"


def test_star_vs_ring_crossover_at_100mbit(testbed):
    config = {"algos": ["star", "ring", "auto"], "sizes": SIZES, "dtypes": ["f32"], "iters": 5, "warmup": 1}
    with testbed.cluster("dllama.sync.bench:bench_rank", args=(config,), algo="auto", timeout=30) as cl:
        res = cl.results(timeout=600)[0]
    rows = res["rows"]
    assert len(rows) == 3 * len(SIZES) and all(r["check"] == "ok" for r in rows)
    auto = res["auto"]
    assert auto["bandwidth_bytes_per_s"] < 25e6, "links should be shaped to ~100 Mbit (12.5 MB/s)"
    star = {r["size"]: r["time_us"] for r in rows if r["algo"] == "star"}
    ring = {r["size"]: r["time_us"] for r in rows if r["algo"] == "ring"}
    crossover = next((s for s in SIZES if ring[s] < star[s]), None)
    print(f"\n4 hosts, 100 Mbit links; auto measured alpha {auto['alpha_s'] * 1e6:.0f} us, "
          f"{auto['bandwidth_bytes_per_s'] / 1e6:.1f} MB/s")
    print(format_table(rows))
    print(f"ring beats star from {crossover} bytes" if crossover else "ring never beat star here")
