"""Workers that find their root: mDNS / DNS-SD advertising (`_dllama._tcp`) and `--workers auto`.

The network part runs in Linux network namespaces (each host its own namespace on one bridge, so
the multicast never leaves this machine): root, 3 advertising workers, a worker protected by a
secret, and an advertisement of another protocol version for a real worker, with the real CLI.
Skips cleanly where namespaces cannot be made. The advertisement parsing is tested without a network.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
from zeroconf import ServiceInfo

from dllama.net.discovery import SERVICE_TYPE, WorkerAd, parse_ad, pick_address
from dllama.net.frames import PROTOCOL_VERSION
from dllama.sync.netns import NetnsTestbed, NetnsUnavailable

DLLAMA = [sys.executable, "-m", "dllama"]
PORT = 9998
SECRET = "discovery-test-secret"
PLAIN, LOCKED, OTHER_PROTO, LATE = (1, 2, 3), 4, 5, 6  # host indices; the root is host 0
GATHER = ["--threads", "1", "--sync-mode", "gather", "--sync-dtype", "q80"]  # any node count: the 1-node answer
INFERENCE = ["inference", "-p", "The lighthouse keeper", "-n", "12", "--temperature", "0", "--json", *GATHER]


# ------------------------------------------------------------------ what an advertisement says


def _info(properties, addresses=("10.1.2.3",), port=PORT, name="pi-9998"):
    return ServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", port=port, parsed_addresses=list(addresses),
                       properties=properties, server="pi.local.")


def test_an_advertisement_is_read_field_by_field():
    ad = parse_ad(_info({"proto": str(PROTOCOL_VERSION), "secret": "1", "threads": "4", "mem_mb": "3500",
                         "name": "kitchen-pi", "version": "0.1.0"}), [])
    assert ad == WorkerAd(name="kitchen-pi", host="10.1.2.3", port=PORT, protocol=PROTOCOL_VERSION, secret=True,
                          threads=4, mem_available=3_500_000_000, version="0.1.0")
    assert ad.unusable_reason(None) == "is protected by a secret (give --secret)"
    assert ad.unusable_reason("s") is None


def test_whatever_else_is_advertised_is_bounded_and_never_trusted():
    ad = parse_ad(_info({"proto": "3x", "threads": "-1", "mem_mb": "9" * 40, "name": "n" * 200, "secret": "yes"}), [])
    assert (ad.protocol, ad.threads, ad.mem_available, ad.secret) == (None, None, None, False)
    assert len(ad.name) == 64 and ad.unusable_reason(None).startswith("speaks protocol version None")
    assert parse_ad(_info({}), []).name == "pi-9998"  # no name field: the instance name
    assert parse_ad(_info({"proto": str(PROTOCOL_VERSION)}, addresses=()), []) is None  # nowhere to dial
    other = parse_ad(_info({"proto": str(PROTOCOL_VERSION + 1)}), [])
    assert other.unusable_reason(None) == (f"speaks protocol version {PROTOCOL_VERSION + 1}, "
                                           f"this node speaks {PROTOCOL_VERSION}")
    assert parse_ad(_info({"proto": str(PROTOCOL_VERSION)}), []).unusable_reason("s") == \
        "has no secret, and this node has one"


def test_the_address_on_a_shared_network_is_dialled():
    import ipaddress

    lan = [ipaddress.ip_network("192.168.1.0/24")]
    assert pick_address(["172.17.0.1", "192.168.1.7"], lan) == "192.168.1.7"  # not the Pi's docker bridge
    assert pick_address(["172.17.0.1", "10.0.0.2"], lan) == "172.17.0.1"  # none shared: the first
    assert pick_address([], lan) is None


@pytest.mark.parametrize("args, message", [
    (["inference", "-p", "x", "--workers", "10.0.0.1:9998", "--discover-timeout", "3"],
     "--discover-timeout applies to --workers auto"),
    (["inference", "-p", "x", "--workers", "auto", "--weights", "1,2"],
     "--weights with numbers needs a fixed --workers list"),
    (["worker", "--host", "127.0.0.1", "--advertise"], "--advertise: a worker on 127.0.0.1 cannot be reached"),
    (["worker", "--host", "127.0.0.1", "--name", "pi"], "--name is the name this worker advertises"),
    (["worker", "--host", "0.0.0.0", "--insecure", "--no-advertise", "--name", "pi"],
     "--name is the name this worker advertises"),
])
def test_discovery_options_that_cannot_apply_are_refused(args, message):
    r = subprocess.run(DLLAMA + args, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), r.stderr


# ------------------------------------------------------------------ on a LAN of namespaces

ADVERTISE_OTHER_PROTOCOL = textwrap.dedent("""
    import asyncio, signal, sys
    from dllama.net import run
    from dllama.net.discovery import Advertiser
    from dllama.net.frames import PROTOCOL_VERSION

    async def main():
        ad = Advertiser("future", "0.0.0.0", int(sys.argv[1]), threads=1, secret=False, memory=lambda: 10**9,
                        version="9.9", protocol=PROTOCOL_VERSION + 1)
        await ad.start()
        print("advertising", flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await ad.close()

    run(main())
""")


def _start_worker(bed, i, *args):
    proc = subprocess.Popen([*bed.prefix(i), *DLLAMA, "worker", "--host", "0.0.0.0", "--port", str(PORT),
                             "--threads", "1", "--no-cache", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith(f"listening on 0.0.0.0:{PORT}"), (line, proc.stderr.read() if proc.poll() else "")
    return proc


def _listed(bed, *args, timeout=3.0):
    r = bed.run(0, *DLLAMA, "workers", "--json", "--discover-timeout", str(timeout), *args)
    assert r.returncode == 0, r.stderr
    return {ad["name"]: ad for ad in json.loads(r.stdout)}


def _wait_listed(bed, names, deadline_s=30.0):
    deadline = time.monotonic() + deadline_s
    while True:
        listed = _listed(bed, timeout=1.5)
        if set(names) <= set(listed) or time.monotonic() > deadline:
            return listed


def _stop(procs) -> list[str]:
    """Terminate, and what each wrote on stderr."""
    for proc in procs:
        proc.terminate()
    errs = []
    for proc in procs:
        try:
            errs.append(proc.communicate(timeout=10)[1])
        except subprocess.TimeoutExpired:
            proc.kill()
            errs.append(proc.communicate()[1])
    return errs


@pytest.fixture(scope="module")
def lan():
    bed = NetnsTestbed(LATE + 1)
    try:
        bed.setup()
    except NetnsUnavailable as e:
        pytest.skip(f"cannot build network namespaces here: {e}")
    procs = []
    try:
        for i in PLAIN:
            procs.append(_start_worker(bed, i, "--insecure", "--name", f"w{i}"))
        procs.append(_start_worker(bed, LOCKED, "--secret", SECRET, "--name", "locked"))
        # a real worker that would answer, behind an advertisement of another protocol version
        procs.append(_start_worker(bed, OTHER_PROTO, "--insecure", "--no-advertise"))
        adv = subprocess.Popen([*bed.prefix(OTHER_PROTO), sys.executable, "-c", ADVERTISE_OTHER_PROTOCOL, str(PORT)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(adv)
        assert adv.stdout.readline().strip() == "advertising", adv.stderr.read() if adv.poll() else ""
        listed = _wait_listed(bed, ["w1", "w2", "w3", "locked", "future"])
        yield bed, listed
    finally:
        _stop(procs)
        bed.teardown()


@pytest.mark.netns
def test_workers_lists_every_advertised_worker_and_whether_it_would_be_used(lan):
    bed, listed = lan
    assert sorted(listed) == ["future", "locked", "w1", "w2", "w3"]
    for i in PLAIN:
        ad = listed[f"w{i}"]
        assert (ad["host"], ad["port"], ad["protocol"], ad["secret"], ad["threads"]) == \
            (bed.addresses[i], PORT, PROTOCOL_VERSION, False, 1)
        assert ad["mem_available"] > 100_000_000 and ad["version"] and ad["usable"], ad
    assert listed["locked"]["secret"] and not listed["locked"]["usable"]
    assert "secret" in listed["locked"]["why_not"]
    assert listed["future"]["protocol"] == PROTOCOL_VERSION + 1 and not listed["future"]["usable"]
    with_secret = _listed(bed, "--secret", SECRET)
    assert [name for name, ad in sorted(with_secret.items()) if ad["usable"]] == ["locked"]
    table = bed.run(0, *DLLAMA, "workers", "--discover-timeout", "2")
    assert table.returncode == 0, table.stderr
    assert "w1" in table.stdout and f"{bed.addresses[1]}:{PORT}" in table.stdout, table.stdout
    assert "no: is protected by a secret" in table.stdout, table.stdout


def _root(bed, *args):
    t0 = time.monotonic()
    r = bed.run(0, *DLLAMA, *args, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout), r.stderr, time.monotonic() - t0


@pytest.mark.netns
def test_auto_uses_the_compatible_workers_and_answers_as_the_fixed_list(lan):
    bed, _listed_ = lan
    fixed, _err, _t = _root(bed, *INFERENCE, "--workers", ",".join(f"{bed.addresses[i]}:{PORT}" for i in PLAIN))
    auto, err, elapsed = _root(bed, *INFERENCE, "--workers", "auto", "--discover-timeout", "4")
    assert fixed["nodes"] == auto["nodes"] == 4, err
    assert sorted(w["address"] for w in auto["workers"]) == [f"{bed.addresses[i]}:{PORT}" for i in PLAIN]
    assert auto["text"] == fixed["text"] and auto["tokens"] == fixed["tokens"] and len(auto["tokens"]) >= 4
    assert "3 worker(s) found in 4 s" in err and elapsed >= 4.0, err  # it listened as long as it was told
    assert "locked" in err and "future" in err, err  # listed as not used, with why


@pytest.mark.netns
def test_a_configured_worker_that_does_not_answer_is_still_an_error_with_auto(lan):
    bed, _listed_ = lan
    r = bed.run(0, *DLLAMA, *INFERENCE, "--workers", f"auto,{bed.addresses[LATE]}:{PORT}", "--timeout", "2",
                timeout=300)  # nothing listens there yet
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].startswith("error: "), r.stderr[-2000:]
    assert f"{bed.addresses[LATE]}:{PORT}" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


@pytest.mark.netns
def test_a_worker_behind_a_secret_is_used_only_with_that_secret(lan):
    bed, _listed_ = lan
    right, err, _t = _root(bed, *INFERENCE, "--workers", "auto", "--secret", SECRET)
    assert right["nodes"] == 2 and right["workers"][0]["address"] == f"{bed.addresses[LOCKED]}:{PORT}", err
    wrong, err, _t = _root(bed, *INFERENCE, "--workers", "auto", "--secret", "not-the-secret")
    assert wrong["nodes"] == 1 and wrong["workers"] == [], err  # the handshake refused it: left out, no failure
    assert "is left out" in err and "auth" in err.lower(), err
    assert wrong["tokens"] == right["tokens"]


HTTP_CLIENT = textwrap.dedent("""
    import json, sys, time, urllib.request
    base = sys.argv[1]
    deadline = time.monotonic() + 240
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Name a colour."}],
                       "max_tokens": 12, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=240) as r:
        answer = json.load(r)["choices"][0]["message"]["content"]
    with urllib.request.urlopen(base + "/health", timeout=5) as r:
        print(json.dumps({"answer": answer, "nodes": json.load(r)["nodes"]}))
""")


@pytest.mark.netns
def test_a_worker_that_appears_later_is_used_from_the_next_request(lan):
    bed, _listed_ = lan
    serve = subprocess.Popen([*bed.prefix(0), *DLLAMA, "serve", "--port", str(PORT), "--workers", "auto", *GATHER],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    late = None
    try:
        def ask():
            r = bed.run(0, sys.executable, "-c", HTTP_CLIENT, f"http://127.0.0.1:{PORT}", timeout=300)
            assert r.returncode == 0, r.stderr[-2000:]
            return json.loads(r.stdout)

        before = ask()
        assert before["nodes"] == 4, before
        late = _start_worker(bed, LATE, "--insecure", "--name", "late")
        assert "late" in _wait_listed(bed, ["late"]), "the late worker was never advertised"
        after = ask()
        assert after["nodes"] == 5, after  # found and used at this request
        late.kill()  # gone without a goodbye: the next request re-plans without it...
        late.communicate()
        without = ask()
        late = _start_worker(bed, LATE, "--insecure", "--name", "late")
        back = ask()  # ...and the one after takes it back, as any worker that returns
    finally:
        serve_err = _stop([p for p in (serve, late) if p is not None])[0]
    assert (without["nodes"], back["nodes"]) == (4, 5), (without, back, serve_err[-3000:])
    assert before["answer"] and before["answer"] == after["answer"] == without["answer"] == back["answer"]
    assert f"found worker late at {bed.addresses[LATE]}:{PORT}" in serve_err, serve_err[-3000:]
