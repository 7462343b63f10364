"""A worker faces anyone who can reach its port. Each test runs a real worker process (no secret:
any stranger gets past the handshake) and speaks the real protocol to it over loopback: every
message after the handshake is checked before use, the slice cache stays in its folder, memory
is bounded and freed, idle roots are let go, busy refusals do not flood the log, and a worker on
the network needs a secret."""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import re
import subprocess
import time
from dataclasses import fields

import msgspec
import numpy as np
import pytest

from dllama.cluster import messages as M
from dllama.cluster import protocol as P
from dllama.node import mem_available
from dllama.cluster.slice_cache import SliceCache
from dllama.cluster.slices import TensorEntry
from dllama.config import ModelConfig
from dllama.errors import NetworkError
from dllama.gguf_model import GGUFModel
from dllama.model import shard_tensors
from dllama.plan import shard_tensor_shapes
from dllama.net import connect
from dllama.net.endpoints import MAX_CONNECT_ATTEMPTS
from dllama.plan import Plan
from dllama.quant import QType
from dllama.weights import Matrix

from .cluster_helpers import DLLAMA, HandRoot, WorkerProcess, free_port, one_node_answer, root_answer

PROMPT = [1, 17, 300, 4242, 99]
N_TOKENS = 6


@pytest.fixture(scope="module")
def model(synthetic_model):
    return GGUFModel(synthetic_model("Q4_1"))


@pytest.fixture(scope="module")
def answer(model):
    return asyncio.run(one_node_answer(model, PROMPT, N_TOKENS))


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """One worker for the tests that leave it as they found it (each checks it still serves)."""
    folder = tmp_path_factory.mktemp("worker")
    w = WorkerProcess("--cache-dir", str(folder / "cache"), "--timeout", "5", log_file=folder / "worker.log")
    yield w
    w.stop()


def _address(w: WorkerProcess) -> tuple[str, int]:
    return ("127.0.0.1", w.port)


async def _refused(root: HandRoot, setup_body: dict) -> str:
    """Send a SETUP on a fresh connection; the worker's FAILED error (anything else fails the test)."""
    try:
        kind, body = await root.send_setup(setup_body)
        assert kind == P.FAILED.name, f"the worker accepted it: {body}"
        return body["error"]
    finally:
        await root.close()


def _failures(log: str) -> list[str]:
    return [line for line in log.splitlines() if "failed:" in line]


# ------------------------------------------------------------------ SETUP


def _q_heads_backwards(s):  # the crash: a query-head count of -2 reached the attention kernel
    s["shards"][1]["q_heads"] = [4, 2]


def _kv_heads_not_read(s):
    s["shards"][1]["kv_heads"] = [0, 2]


def _plan_gap(s):
    s["shards"][1]["ffn"] = [s["shards"][1]["ffn"][0] + 32, s["shards"][1]["ffn"][1]]


def _tensor_of_other_shape(s):
    entry = next(e for e in s["manifest"] if e["name"] == "blk.0.attn_q")
    entry["rows"] += 32
    entry["nbytes"] = entry["nbytes"] // (entry["rows"] - 32) * entry["rows"]


def _unknown_tensor(s):
    s["manifest"][3]["name"] = "blk.0.evil"


def _missing_tensor(s):
    s["manifest"] = [e for e in s["manifest"] if e["name"] != "output_norm"]


def _bytes_not_of_shape(s):
    s["manifest"][1]["nbytes"] += 1


SETUP_CASES = {
    "q_heads": _q_heads_backwards,
    "kv_heads": _kv_heads_not_read,
    "shards[1].ffn": _plan_gap,
    "blk.0.attn_q": _tensor_of_other_shape,
    "blk.0.evil": _unknown_tensor,
    "output_norm": _missing_tensor,
    "bytes do not fit": _bytes_not_of_shape,
    "rank": lambda s: s.update(rank=2),
    "addrs": lambda s: s["addrs"].append(["127.0.0.1", 1]),
    "n_heads": lambda s: s["config"].update(n_heads=5),
    "head_dim": lambda s: s["config"].update(head_dim=12),
    "gather carries": lambda s: s.update(sync_dtype="f16"),
    "ctx_size": lambda s: s.update(ctx_size=-64),
    "config": lambda s: s.pop("config"),
    "spin": lambda s: s.update(spin=float("nan")),
}


def test_invalid_setups_are_refused_by_name_and_the_worker_lives_on(worker, model, answer):
    """Each SETUP is refused with an error that names the bad field, in one log line, with no
    traceback; the worker then serves a real root the 1-node answer."""

    async def probe():
        root = HandRoot(model, _address(worker))
        errors = {}
        for name, corrupt in SETUP_CASES.items():
            body = M.to_wire(root.setup())
            corrupt(body)
            errors[name] = await _refused(root, body)
        return errors, await root_answer(model, _address(worker), PROMPT, N_TOKENS)

    log_before = len(_failures(worker.log()))
    errors, tokens = asyncio.run(probe())
    for name, error in errors.items():
        assert error.startswith("invalid cluster.setup: ") and name in error, (name, error)
    assert worker.proc.poll() is None
    assert tokens == answer
    log = worker.log()
    assert len(_failures(log)) - log_before == len(SETUP_CASES), log[-3000:]
    assert "Traceback" not in log


def test_echoes_are_answered_bounded_in_size_and_number(worker, model, answer):
    """ECHO (the root timing its link for --sync-mode auto) comes back byte for byte after PROBE;
    a larger one than the protocol allows, or more of them than it allows, ends the session with
    a named error; the worker then serves a real root the 1-node answer."""
    payload = bytes(range(256)) * (P.ECHO_BYTES // 256)

    async def session(echoes: int, size: int = 8):
        root = HandRoot(model, _address(worker), timeout=10)
        try:
            await root.probe()
            conn, back = root.conn, []
            for _ in range(echoes):
                await conn.send_msg(P.ECHO, {"payload": payload[:size] if size <= len(payload) else bytes(size)})
                kind, body = await conn.recv_msg((P.ECHO, P.FAILED), timeout=10)
                if kind == P.FAILED.name:
                    return back, body["error"]
                back.append(body["payload"])
            return back, None
        finally:
            await root.close()

    async def probe():
        return (await session(2, P.ECHO_BYTES), await session(P.MAX_ECHOES + 1),
                await root_answer(model, _address(worker), PROMPT, N_TOKENS))

    whole, too_many, tokens = asyncio.run(probe())
    assert whole == ([payload, payload], None)
    assert len(too_many[0]) == P.MAX_ECHOES and f"more than {P.MAX_ECHOES} cluster.echo" in too_many[1]
    assert tokens == answer and worker.proc.poll() is None


async def _oversized_echo(model, address: tuple[str, int]) -> str:
    root = HandRoot(model, address, timeout=10)
    try:
        await root.probe()
        await root.conn.send_msg(P.ECHO, {"payload": bytes(P.ECHO_BYTES + 1)})
        kind, body = await root.reply(P.ECHO)
        return body.get("error", kind)
    finally:
        await root.close()


def test_an_echo_over_its_bound_is_refused(worker, model, answer):
    error = asyncio.run(_oversized_echo(model, _address(worker)))
    assert "cluster.echo" in error and str(P.ECHO_BYTES) in error, error
    assert asyncio.run(root_answer(model, _address(worker), PROMPT, N_TOKENS)) == answer


def test_schema_knows_every_config_field_and_every_tensor_of_a_plan(synthetic_model):
    """The wire schema and the shapes it expects follow the code that makes them: every
    ModelConfig field travels, and shard_tensor_shapes is what shard_tensors cuts, for every
    shard of an uneven plan in both modes (one KV head over 3 nodes: heads split, KV replicated)."""
    assert {f.name for f in fields(ModelConfig)} <= set(M.WireConfig.__struct_fields__)
    model = GGUFModel(synthetic_model("F16"))
    plan = Plan.split(model.config, [2.0, 1.0, 1.0])
    for mode in ("reduce", "gather"):
        for shard in plan.shards:
            cut = {name: (t.rows, t.cols) if isinstance(t, Matrix) else t.shape[0]
                   for name, t in shard_tensors(model, shard, mode)}
            assert cut == shard_tensor_shapes(model.config, shard, mode)


# ------------------------------------------------------------------ FORWARD and ACTIVATIONS


def test_invalid_steps_are_refused_and_the_worker_lives_on(worker, model, answer):
    """A negative start (silent garbage, or a numba SystemError, before), positions past the
    context, token ids past the vocabulary, and NaN or infinite activations: each is refused
    with a named error; the next session gets the 1-node answer."""
    root = HandRoot(model, _address(worker))
    nan = root.forward([5, 6])[1].copy()
    nan[1, 7] = np.nan
    inf = root.forward([5])[1].copy()
    inf[0, 0] = -np.inf
    def seq(**fields):
        return lambda b: b["seqs"][0].update(fields)

    cases = [  # (what the error names, a change to the FORWARD of 2 tokens, activations or None for theirs)
        ("$.seqs[0].start", seq(start=-1), None),
        ("outside its capacity", seq(start=root.ctx - 1), None),
        ("exceeds the context", seq(capacity=root.ctx + 32), None),
        ("$.seqs[0].capacity", seq(capacity=48), None),
        ("outside the session's 1 slots", seq(slot=1), None),
        ("$.seqs[0].n", seq(n=0), None),
        ("$.seqs[0].logits", seq(logits="every"), None),
        ("outside the vocabulary", seq(recent=[model.config.vocab_size]), None),
        ("targets", seq(targets=[1, 2]), None),
        ("$.seqs[0].params.temperature", lambda b: b["seqs"][0]["params"].update(temperature=math.nan), None),
        ("$.seqs[0].params.top_p", lambda b: b["seqs"][0]["params"].update(top_p=2.0), None),
        ("a slot appears twice", lambda b: b["seqs"].append(dict(b["seqs"][0], n=1)), None),
        ("$.seqs", lambda b: b.update(seqs=[]), None),
        ("free names a slot outside", lambda b: b.update(free=[3]), None),
        ("not two of the session's", lambda b: b.update(copies=[{"src": 0, "dst": 0, "n": 1, "capacity": 32}]), None),
        ("not two of the session's", lambda b: b.update(copies=[{"src": 0, "dst": 1, "n": 1, "capacity": 32}]), None),
        ("$.copies[0].n", lambda b: b.update(copies=[{"src": 0, "dst": 1, "n": 0, "capacity": 32}]), None),
        ("not every value is finite", lambda b: None, nan),
        ("not every value is finite", lambda b: None, inf),
    ]

    async def probe():
        errors = []
        for _name, change, activations in cases:
            await root.open_session()
            step, x = root.forward([5, 6] if activations is None else [5] * activations.shape[0])
            body = M.to_wire(step)
            change(body)
            kind, reply = await root.send_step(body, x if activations is None else activations, None)
            assert kind == P.FAILED.name, reply
            errors.append(reply["error"])
            await root.close()
        return errors, await root_answer(model, _address(worker), PROMPT, N_TOKENS)

    errors, tokens = asyncio.run(probe())
    for (name, _change, _x), error in zip(cases, errors):
        assert name in error, (name, error)
    assert worker.proc.poll() is None and tokens == answer
    assert "Traceback" not in worker.log()


# ------------------------------------------------------------------ the slice cache


def test_a_manifest_cannot_reach_files_outside_the_cache(worker, model, tmp_path):
    """The issue's file deletion: a "sha256" that is a path made the worker hash that file, find
    the digest wrong and unlink it. Now such a SETUP is refused, and the cache itself never
    touches anything but its own files."""
    root = HandRoot(model, _address(worker))
    entry = next(e for e in root.manifest if e.name == "output_norm")
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"v" * entry.nbytes)  # the size of the entry: the cache would have taken it

    async def probe():
        errors = []
        for digest in (str(tmp_path / "victim"), f"../../../../../../..{tmp_path}/victim"):
            body = M.to_wire(root.setup())
            next(e for e in body["manifest"] if e["name"] == "output_norm")["sha256"] = digest
            errors.append(await _refused(root, body))
        return errors

    for error in asyncio.run(probe()):
        assert "sha256" in error, error
    assert victim.read_bytes() == b"v" * entry.nbytes

    # the cache on its own, given such entries anyway (and a link planted under a digest's name)
    cache = SliceCache(tmp_path / "cache")
    for digest in (str(tmp_path / "victim"), "../victim"):
        forged = msgspec.structs.replace(entry, sha256=digest)
        assert not cache.has(forged) and cache.load_verified(forged) is None
        cache.store(forged, np.zeros(entry.nbytes, np.uint8))
    planted = tmp_path / "cache" / f"{entry.sha256}.bin"
    planted.symlink_to(victim)
    assert cache.load_verified(entry) is None
    cache.store(entry, np.zeros(entry.nbytes, np.uint8))  # replaces the link, never writes through it
    assert victim.read_bytes() == b"v" * entry.nbytes
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [planted.name]
    assert not planted.is_symlink() and cache.load_verified(entry) is None  # zeros: not its digest


# ------------------------------------------------------------------ memory


def _big_setup(port: int, *, dim: int, n_layers: int, vocab: int, ffn: int, heads: int) -> M.Setup:
    """A consistent SETUP of a made-up f32 model (its bytes need not exist: only declared)."""
    cfg = ModelConfig(arch="llama", dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=heads, head_dim=64,
                      ffn_dim=ffn, vocab_size=vocab, context_length=64, rope_base=10000.0, rope_dims=64,
                      rope_neox=False, norm_eps=1e-5, tied_embeddings=False)
    plan = Plan.split(cfg, [1.0, 1.0])
    manifest = []
    for name, shape in shard_tensor_shapes(cfg, plan.shards[1], "gather").items():
        rows, cols = (0, shape) if isinstance(shape, int) else shape
        nbytes = 4 * cols * max(rows, 1)
        # a digest of the name, not of the bytes: none of these tensors is ever sent whole (hashing the
        # zeros of a slice twice this machine's memory took 45 s)
        digest = hashlib.sha256(name.encode()).hexdigest()
        manifest.append(TensorEntry(name, int(QType.F32), rows, cols, nbytes, digest))
    manifest.sort(key=lambda e: e.name != "output")  # the big one first
    return M.Setup(session="big", rank=1, world=2, addrs=[None, ("127.0.0.1", port)], algo="star", sync_dtype="f32",
                   sync_mode="gather", config=M.WireConfig.of(cfg), shards=[M.WireShard.of(s) for s in plan.shards],
                   ctx_size=64, manifest=manifest)


def test_a_slice_larger_than_the_available_memory_is_refused(worker, model):
    """Without --max-memory: a SETUP declaring twice this machine's available memory (the issue
    declared 4 GiB on a smaller machine) is refused before anything is allocated."""
    available = mem_available()
    shape = dict(dim=8192, vocab=32000, ffn=28672, heads=128)
    per_layer = (_big_setup(worker.port, n_layers=2, **shape).declared_bytes()
                 - _big_setup(worker.port, n_layers=1, **shape).declared_bytes())
    setup = _big_setup(worker.port, n_layers=2 * available // per_layer + 1, **shape)
    assert setup.declared_bytes() > 2 * available
    rss = worker.rss_mb()

    error = asyncio.run(_refused(HandRoot(model, _address(worker)), M.to_wire(setup)))
    assert re.search(r"need \d+ MB, more than the \d+ MB this worker has available", error), error
    print(f"\ndeclared {setup.declared_bytes() / 2**30:.1f} GiB, available {available / 2**30:.1f} GiB: {error}")
    assert worker.rss_mb() < rss + 10 and worker.proc.poll() is None


def test_max_memory_overrides_and_refuses_a_real_slice(model, tmp_path):
    w = WorkerProcess("--no-cache", "--max-memory", "1", log_file=tmp_path / "worker.log")
    try:
        error = asyncio.run(_refused(HandRoot(model, _address(w)), M.to_wire(HandRoot(model, _address(w)).setup())))
    finally:
        log = w.stop()
    assert re.search(r"more than the 1 MB this worker has available \(--max-memory\)", error), error
    assert "Traceback" not in log


def test_a_transfer_cut_off_midway_frees_its_buffers(tmp_path):
    """A root that streams 512 MiB of a declared 1 GiB tensor and vanishes: the worker's RSS
    comes back (the failure's traceback cycle kept the buffer until another session, before)."""
    w = WorkerProcess("--no-cache", "--timeout", "5", log_file=tmp_path / "worker.log")
    setup = _big_setup(w.port, dim=2048, n_layers=1, vocab=262144, ffn=64, heads=2)
    assert setup.manifest[0].name == "output" and setup.manifest[0].nbytes == 1 << 30

    async def probe():
        conn = await connect("127.0.0.1", w.port, role="control", timeout=5, max_frame=P.MAX_SETUP)
        await conn.send_msg(P.SETUP, M.to_wire(setup))
        kind, body = await conn.recv_msg((P.NEED, P.FAILED), timeout=5)
        assert kind == P.NEED.name, body
        chunk = np.ones(P.TENSOR_CHUNK, np.uint8)  # ones: pages that are really committed
        for _ in range((512 << 20) // P.TENSOR_CHUNK):
            await conn.send_array(chunk, kind=P.TENSOR)
        await asyncio.sleep(0.5)
        during = w.rss_mb()
        conn.transport.abort()  # no END, no goodbye: the root died
        deadline = time.monotonic() + 10
        while "ready for the next root" not in w.log() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        return during, w.rss_mb()

    try:
        before = w.rss_mb()
        during, after = asyncio.run(probe())
    finally:
        log = w.stop()
    print(f"\nworker RSS {before:.0f} MB, {during:.0f} MB with 512 MiB received, {after:.0f} MB after the cut")
    assert during > before + 400, "the test did not make the worker hold the transfer"
    assert after < before + 50, log[-2000:]
    assert "Traceback" not in log


# ------------------------------------------------------------------ liveness and fairness


def test_a_root_that_only_pings_is_let_go_but_an_idle_session_is_kept(model, answer, tmp_path):
    """Heartbeats alone do not hold a worker: a client that completed the handshake and sends
    nothing else is dropped after --setup-timeout. A session after READY has no such deadline:
    with heartbeats it waits for its next step as long as it likes (here 2.5x the timeout)."""
    w = WorkerProcess("--no-cache", "--setup-timeout", "1.5", "--timeout", "2", log_file=tmp_path / "worker.log")

    async def probe():
        conn = await connect("127.0.0.1", w.port, role="control", timeout=30, heartbeat=0.2, max_frame=P.MAX_SETUP)
        t0 = time.monotonic()
        kind, body = await conn.recv_msg(P.FAILED, timeout=20)  # pings go out every 0.2 s meanwhile
        held = time.monotonic() - t0
        await conn.close()
        root = HandRoot(model, _address(w), timeout=2.0)
        await root.open_session()
        await asyncio.sleep(5.0)
        step, x = root.forward([5])
        reply, _ = await root.send_step(M.to_wire(step), x, step)
        await root.close()
        return held, body["error"], reply, await root_answer(model, _address(w), PROMPT, N_TOKENS)

    try:
        held, error, reply, tokens = asyncio.run(probe())
    finally:
        log = w.stop()
    assert "sent no PROBE or SETUP within 1.5 s" in error, error
    assert 1.2 < held < 4.0, held
    assert reply == P.RESULT.name and tokens == answer, log[-2000:]
    assert "Traceback" not in log


def test_busy_refusals_are_rate_limited_in_the_log(tmp_path):
    """A root retrying against a busy worker (10 tries a second) gets its answer every time, but
    the log gets one line per 10 s, which counts the refusals it did not print."""
    w = WorkerProcess("--no-cache", "--setup-timeout", "60", log_file=tmp_path / "worker.log")

    async def probe():
        holder = await connect("127.0.0.1", w.port, role="control", timeout=30, heartbeat=1)
        t0 = time.monotonic()
        errors = []

        async def knock():
            conn = await connect("127.0.0.1", w.port, role="control", timeout=5)
            try:
                _kind, body = await conn.recv_msg(P.FAILED, timeout=5)
                errors.append(body["error"])
                await conn.send_msg(P.END, {})
            except NetworkError:
                pass
            await conn.close()

        for _ in range(30):
            await knock()
            await asyncio.sleep(0.1)
        lines_soon = w.log().count("busy with another root")
        await asyncio.sleep(max(0.0, t0 + 10.5 - time.monotonic()))
        await knock()
        await holder.close()
        return errors, lines_soon

    try:
        errors, lines_soon = asyncio.run(probe())
    finally:
        log = w.stop()
    assert len(errors) == 31 and all("busy" in e for e in errors)
    assert lines_soon == 1, log
    lines = [line for line in log.splitlines() if "busy with another root" in line]
    assert len(lines) == 2 and "(and 29 more since the last such line)" in lines[1], log


# ------------------------------------------------------------------ the peers a worker dials

BANNER = b"SSH-2.0-OpenSSH_9.6 private-banner-1234\r\n"


def test_a_worker_dials_only_its_own_cluster_and_repeats_nothing_it_hears(worker, model, answer):
    """Whoever sends SETUP (no --secret: anyone) names the peers the worker dials. An address that
    answers otherwise than a node of this cluster (a service's banner, an idle worker serving no
    session) or refuses fails the session with an error that names the address and never what
    came back from it; a refused address gets a bounded number of attempts."""
    other = WorkerProcess("--timeout", "5")
    closed = free_port()
    errors = {}

    async def banner(reader, writer):
        writer.write(BANNER + bytes(range(256)) * 4)
        await writer.drain()
        await asyncio.sleep(1)
        writer.close()

    async def probe():
        server = await asyncio.start_server(banner, "127.0.0.1", 0)
        banner_port = server.sockets[0].getsockname()[1]
        try:
            for name, port in (("banner", banner_port), ("other cluster", other.port), ("closed", closed)):
                root = HandRoot(model, _address(worker))
                try:
                    await root.load(root.setup(addrs=[("127.0.0.1", port), _address(worker)]))
                    t0 = time.monotonic()
                    kind, body = await root.reply(P.READY, timeout=60)
                    assert kind == P.FAILED.name, (name, body)
                    errors[name] = (body["error"], time.monotonic() - t0)
                finally:
                    await root.close()
            assert await root_answer(model, _address(worker), PROMPT, N_TOKENS) == answer  # it lives on
        finally:
            server.close()

    try:
        asyncio.run(probe())
    finally:
        other_log = other.stop()
    for name, port in (("banner", None), ("other cluster", other.port), ("closed", closed)):
        error, _took = errors[name]
        assert "rank 0" in error and (port is None or f"127.0.0.1:{port}" in error), error
    assert "does not speak the dllama protocol" in errors["banner"][0]
    assert "is not a node of this cluster" in errors["other cluster"][0]
    assert "connection refused" in errors["closed"][0].lower()
    assert f"({MAX_CONNECT_ATTEMPTS} attempts)" in errors["closed"][0]
    assert errors["closed"][1] < 25  # the attempts ran out, not the 30 s connect timeout
    log = worker.log()
    for text in (log, other_log, *(e for e, _t in errors.values())):
        assert "SSH" not in text and "private-banner" not in text and "\\x" not in text


# ------------------------------------------------------------------ secure by default


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_worker_on_the_network_needs_a_secret(host):
    refused = subprocess.run(DLLAMA + ["worker", "--host", host, "--port", "0"], capture_output=True, text=True,
                             timeout=60, env={k: v for k, v in os.environ.items() if k != "DLLAMA_SECRET"})
    assert refused.returncode != 0
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --host {host} is not a loopback address"), refused.stderr
    for extra, env in ((["--insecure"], {}), ([], {"DLLAMA_SECRET": "s3cret"})):
        # not advertised: tests send nothing beyond loopback and their own namespaces
        proc = subprocess.Popen(DLLAMA + ["worker", "--host", host, "--port", "0", "--threads", "1", "--no-advertise",
                                          *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **env})
        try:
            line = proc.stdout.readline()
        finally:
            proc.terminate()
            _out, err = proc.communicate(timeout=10)
        assert line.startswith(f"listening on {host}:"), (line, err)
        assert ("without a secret (--insecure)" in err) == bool(extra), err


def test_whatever_a_user_may_ask_for_the_root_sends_a_valid_step():
    """A huge top_k (the API takes any) or a step of the most tokens the engine sends must pass
    the worker's schema: a root must never end its workers' sessions with its own message."""
    from dllama.cluster import messages as M
    from dllama.cluster import protocol as P
    from dllama.step import PREFILL_CHUNK, Step
    from dllama.wire import InvalidMessage
    from dllama.sampling import SamplingParams

    step = Step.of(0, PREFILL_CHUNK, SamplingParams(temperature=0.7, top_k=3_000_000_000))
    assert M.decode(P.FORWARD, Step, M.to_wire(step)).seqs[0].params.top_k == 256
    too_long = M.to_wire(Step.of(0, PREFILL_CHUNK, SamplingParams(temperature=0.7)))
    too_long["seqs"][0]["n"] = PREFILL_CHUNK + 1
    with pytest.raises(InvalidMessage, match=r"\$.seqs\[0\].n"):
        M.decode(P.FORWARD, Step, too_long)
