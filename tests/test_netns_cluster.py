"""Multi-host cluster: the root and 3 workers each in their own network namespace (own address
10.77.0.1-4 on a bridge), started with the real CLI; a chat answer across the 4 hosts, once on
plain veth links and once with every link shaped to 100 Mbit (tc tbf), in gather mode with Q8
gathers, which must give exactly the 1-node answer; and --sync-mode auto choosing by the link.
Skips cleanly where namespaces cannot be made."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dllama.sync.netns import NetnsTestbed, NetnsUnavailable

pytestmark = pytest.mark.netns

PORT = 9998
SECRET = "netns-test-secret"  # workers on a non-loopback address refuse to start without one


@pytest.fixture(scope="module", params=[None, "100mbit"], ids=["veth", "100mbit"])
def hosts(request):
    bed = NetnsTestbed(4, rate=request.param)
    try:
        bed.setup()
    except NetnsUnavailable as e:
        pytest.skip(f"cannot build network namespaces here: {e}")
    workers = []
    try:
        for i in (1, 2, 3):
            proc = subprocess.Popen([*bed.prefix(i), sys.executable, "-m", "dllama", "worker", "--host",
                                     bed.addresses[i], "--port", str(PORT), "--threads", "1", "--no-cache",
                                     "--secret", SECRET],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            workers.append(proc)
            line = proc.stdout.readline()
            assert line.startswith(f"listening on {bed.addresses[i]}:{PORT}"), (line, proc.stderr.read())
        yield bed, request.param
    finally:
        for proc in workers:
            proc.terminate()
        for proc in workers:
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        bed.teardown()


def _root(bed, *args, input=None, timeout=600):
    workers = ",".join(f"{bed.addresses[i]}:{PORT}" for i in (1, 2, 3))
    return subprocess.run([*bed.prefix(0), sys.executable, "-m", "dllama", *args, "--workers", workers,
                           "--threads", "1", "--secret", SECRET], capture_output=True, text=True, input=input,
                          timeout=timeout)


QUESTION = "Write one sentence about lighthouses.\n"
CHAT = ["chat", "--temperature", "0", "--max-tokens", "24"]


@pytest.fixture(scope="module")
def one_node_chat():
    r = subprocess.run([sys.executable, "-m", "dllama", *CHAT, "--threads", "1"], capture_output=True, text=True,
                       input=QUESTION, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_chat_across_four_hosts(hosts, one_node_chat):
    bed, rate = hosts
    r = _root(bed, *CHAT, "--sync", "ring", "--sync-mode", "gather", "--sync-dtype", "q80", input=QUESTION)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 node(s) (ring sync, gather, q80)" in r.stderr
    assert r.stdout == one_node_chat and len(r.stdout.split()) >= 5  # gather mode: exactly the 1-node answer


def test_inference_report_across_four_hosts(hosts):
    bed, rate = hosts
    r = _root(bed, "inference", "-p", "The capital of France is", "-n", "16", "--temperature", "0",
              "--sync", "star", "--sync-mode", "reduce", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["nodes"] == 4 and report["sync"] == "star"
    # star: the root sends and receives 3 vectors of 576 floats per all-reduce, 60 per token
    assert report["bytes_per_token"]["sent"] >= 60 * 3 * 576 * 4
    assert [w["up"] for w in report["workers"]] == [True, True, True]
    print(f"\n4 hosts ({rate or 'veth'}): {report['tokens_per_s']:.1f} tok/s, ms/token {report['ms_per_token']}")


def test_sync_mode_auto_follows_the_link(hosts):
    """--sync-mode auto (the default) times the links: veth, where a message costs more than its
    bytes, gets reduce (fewer collectives); 100 Mbit, where the bytes dominate, gets gather with
    Q8 blocks (fewer bytes)."""
    bed, rate = hosts
    r = _root(bed, "inference", "-p", "The capital of France is", "-n", "4", "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    expected = ("gather", "q80") if rate else ("reduce", "f32")
    assert (report["sync_mode"], report["sync_dtype"]) == expected, report["sync_choice"]
    assert report["sync_choice"]["chosen"] == f"{expected[0]} ({expected[1]})"
    print(f"\n4 hosts ({rate or 'veth'}): auto chose {report['sync_choice']}")
