"""Fuzz a worker daemon over real sockets: 10,000+ random and mutated frames before the handshake,
and 10,000+ mutated messages after it (SETUP, TENSOR, FORWARD, ACTIVATIONS, GO, END, ECHO, from a
client that got past the handshake with no secret); then check the worker still serves a root
the right answer, did not grow its memory, and never crashed or logged a traceback."""

from __future__ import annotations

import asyncio
import collections
import math
import os
import random
import time

import msgpack
import numpy as np
import pytest

from dllama.cluster import messages as M
from dllama.cluster import protocol as P
from dllama.cluster.slices import make_entry, tensor_bytes
from dllama.errors import NetworkError, PeerTimeout
from dllama.gguf_model import GGUFModel
from dllama.net.frames import HEADER, KINDS, MAGIC, PROTOCOL_VERSION, pack_msg, unpack_msg
from dllama.step import Step
from dllama.wire import InvalidMessage

from .cluster_helpers import HandRoot, WorkerProcess, one_node_answer, root_answer, run_dllama

N_FRAMES = 10_000
SECRET = "fuzz-secret"


def _frame(rng: random.Random) -> bytes:
    """One hostile frame: garbage, a valid header with a lying length or an unknown kind, a
    truncated or oversized body, or a well-formed message with nonsense inside."""
    codes = [k.code for k in KINDS]
    choice = rng.randrange(7)
    if choice == 0:  # pure noise
        return rng.randbytes(rng.randrange(0, 64))
    if choice == 1:  # valid header, any kind code, huge or wrong length, short body
        length = rng.choice([0, 1, 15, 4096, 1 << 20, (1 << 32) - 1, rng.randrange(1 << 32)])
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, rng.randrange(256), 0, rng.randrange(1 << 32), length) + \
            rng.randbytes(rng.randrange(0, 32))
    if choice == 2:  # a known kind with a random msgpack-ish body
        body = rng.randbytes(rng.randrange(0, 200))
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, rng.choice(codes), 0, 0, len(body)) + body
    if choice == 3:  # a plausible message with wrong types, extra fields, deep nesting
        body = pack_msg({"proto": rng.choice([PROTOCOL_VERSION, 0, "x", None]), "role": rng.choice(["control", "peer", 7]),
                         "rank": rng.choice([0, -1, 2 ** 40, "r"]), "session": rng.randbytes(4).hex(),
                         "nonce": rng.randbytes(rng.choice([0, 16, 100])), "n": [[[[]]]] * rng.randrange(5)})
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, rng.choice(codes), 0, 0, len(body)) + body
    if choice == 4:  # wrong magic or version
        body = msgpack.packb({"a": 1})
        return HEADER.pack(rng.randbytes(4), rng.randrange(256), rng.choice(codes), 0, 0, len(body)) + body
    if choice == 5:  # a valid frame with one flipped byte
        body = pack_msg({"proto": PROTOCOL_VERSION, "role": "control", "rank": None, "session": "s",
                         "nonce": b"n" * 16})
        raw = bytearray(HEADER.pack(MAGIC, PROTOCOL_VERSION, KINDS.get("hello").code, 0, 0, len(body)) + body)
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return bytes(raw)
    # msgpack ext types and huge declared containers inside a small body
    body = rng.choice([b"\xc7\x01\x05x", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xf0"])
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, rng.choice(codes), 0, 0, len(body)) + body


async def _fuzz(port: int, seed: int) -> int:
    rng = random.Random(seed)
    sent = 0

    async def one_connection():
        nonlocal sent
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
        except OSError:
            return
        try:
            for _ in range(rng.randrange(1, 40)):
                writer.write(_frame(rng))
                sent += 1
            await asyncio.wait_for(writer.drain(), 5)
            # read whatever the worker says (a REJECT) until it hangs up, briefly
            await asyncio.wait_for(reader.read(65536), 0.5)
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()

    while sent < N_FRAMES:
        await asyncio.gather(*(one_connection() for _ in range(8)))
    return sent


def test_worker_survives_fuzzed_frames_and_still_serves_a_root(tmp_path):
    # its log in a file: ~500 lines of rejected connections would fill a pipe and stall the worker
    worker = WorkerProcess("--no-cache", "--secret", SECRET, "--timeout", "5", log_file=tmp_path / "worker.log")
    try:
        warm = run_dllama("inference", "-p", "hi", "-n", "2", "--threads", "1", "--workers", worker.address,
                          "--secret", SECRET, "--json")
        assert warm.returncode == 0, warm.stderr
        rss_before = worker.rss_mb()
        sent = asyncio.run(_fuzz(worker.port, seed=int.from_bytes(os.urandom(2), "little")))
        assert sent >= N_FRAMES
        assert worker.proc.poll() is None, "the worker died under fuzzing"
        rss_after = worker.rss_mb()
        assert rss_after < rss_before + 64, f"RSS grew from {rss_before:.0f} to {rss_after:.0f} MB"
        r = run_dllama("inference", "-p", "The capital of France is", "-n", "8", "--temperature", "0",
                       "--threads", "1", "--workers", worker.address, "--secret", SECRET, "--json")
        assert r.returncode == 0, r.stderr
    finally:
        log = worker.stop()
    assert "Traceback" not in log, log[-3000:]
    print(f"\n{sent} fuzzed frames; worker RSS {rss_before:.0f} -> {rss_after:.0f} MB")


@pytest.mark.parametrize("payload", [b"", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 100_000])
def test_worker_rejects_non_protocol_clients(payload):
    """The worker hangs up on a client that is not one of ours, or says nothing: after its --timeout
    (3 s here, shorter than the handshake's own 10 s), and serves a root next."""
    worker = WorkerProcess("--no-cache", "--timeout", "3")
    try:
        async def poke():
            reader, writer = await asyncio.open_connection("127.0.0.1", worker.port)
            writer.write(payload)
            await writer.drain()
            try:
                await asyncio.wait_for(reader.read(), 8)  # the worker hangs up
            finally:
                writer.close()

        asyncio.run(poke())
        assert worker.proc.poll() is None
        r = run_dllama("inference", "-p", "hi", "-n", "2", "--threads", "1", "--workers", worker.address, "--json")
        assert r.returncode == 0, r.stderr
    finally:
        worker.stop()


# ------------------------------------------------------------------ after the handshake

# (messages, batches): the default suite's run, and the full count (marked slow, for make test-all)
MUTATION_RUNS = [(2_500, 5), pytest.param(10_000, 10, marks=pytest.mark.slow)]
PROMPT = [1, 17, 300, 4242, 99]
N_TOKENS = 6

# values a hostile root might put anywhere: wrong types, edges of every integer width, non-finite
# floats, paths, empty and nested containers
NASTY = (None, True, False, 0, -1, 1, -64, 2 ** 31, 2 ** 32 + 1, 2 ** 63 - 1, -2 ** 63, 2 ** 64 - 1, 0.5, -0.0, 1e308,
         -1e308, math.nan, math.inf, -math.inf, "", "x" * 1000, "../../victim", "/etc/passwd", "\x00", b"",
         b"\xff" * 64, [], {}, [None], [[[[1]]]], {"": 1}, [-1, -1])


def _paths(obj, path=()):
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, path + (i,))


def _int64(v: int) -> int:
    return v if -2 ** 63 <= v < 2 ** 64 else 2 ** 63 - 1


def _changed(rng: random.Random, value):
    """A neighbour of value, of its type or not."""
    if rng.random() < 0.3:
        return rng.choice(NASTY)
    if isinstance(value, bool) or value is None:
        return rng.choice(NASTY)
    if isinstance(value, int):
        return _int64(rng.choice([value + 1, value - 1, -value, value * 2 ** rng.randrange(1, 40),
                                  rng.randrange(-2 ** 40, 2 ** 40), value + 32, value - 32]))
    if isinstance(value, float):
        return rng.choice([math.nan, math.inf, -value, value * 1e300, value + 1, 0.0])
    if isinstance(value, str):
        return rng.choice([value[:rng.randrange(len(value) + 1)], value + rng.choice(["0", "/", "..", "\u00e9"]),
                           value.upper(), value[::-1]])
    if isinstance(value, list):
        value = list(value)
        op = rng.randrange(5)
        if op == 0 and value:
            del value[rng.randrange(len(value))]
        elif op == 1 and value:
            value.insert(rng.randrange(len(value)), value[rng.randrange(len(value))])
        elif op == 2:
            value.append(rng.choice(NASTY))
        elif op == 3:
            value = []
        else:
            value.reverse()
        return value
    if isinstance(value, dict):
        value = dict(value)
        if value and rng.random() < 0.5:
            del value[rng.choice(list(value))]
        else:
            value[rng.choice(["x", "evil", "__class__", *[k + "_" for k in value]])] = rng.choice(NASTY)
        return value
    return rng.choice(NASTY)


def mutate(rng: random.Random, body: dict) -> str:
    """Change body in one random spot (a value, a key, a length); returns where."""
    path = rng.choice(list(_paths(body)))
    if not path:  # a key more or less at the top
        if rng.random() < 0.5 and body:
            del body[rng.choice(list(body))]
        else:
            body[rng.choice(["x", "evil", "one_token"])] = rng.choice(NASTY)
        return "$"
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = _changed(rng, parent[path[-1]])
    return "$." + ".".join(map(str, path))


def _accepted(schema, body, setup=None):
    """The schema's verdict (the worker's must be the same): the decoded message, or None."""
    try:
        message = M.decode(P.SETUP, schema, body)
        return M.check_forward(message, setup) if setup is not None else message
    except InvalidMessage:
        return None


def _plain(message) -> dict:
    """A message as the worker sees it: msgpack lists and maps only."""
    return unpack_msg(pack_msg(M.to_wire(message)))


class PostHandshakeFuzzer:
    """Sends mutated messages, each in the session state where it is expected, and checks that
    the worker's verdict (answer, FAILED, or a dropped connection) is the schema's."""

    def __init__(self, rng: random.Random, root: HandRoot):
        self.rng, self.root = rng, root
        self.sent = collections.Counter()
        self.refused = 0
        self.in_session = False
        self.setup = None

    async def _end(self) -> None:
        await self.root.close()
        self.in_session = False

    async def setup_message(self) -> None:
        root, rng = self.root, self.rng
        body = _plain(root.setup())
        where = mutate(rng, body)
        valid = _accepted(M.Setup, body) is not None
        try:
            kind, reply = await root.send_setup(body)
        finally:
            await self._end()
        self.sent["SETUP"] += 1
        # a valid SETUP may still ask for more memory than this machine has
        assert (kind == P.NEED.name or "available" in reply["error"]) if valid else kind == P.FAILED.name, \
            (where, kind, reply)
        self.refused += kind == P.FAILED.name

    async def tensor_message(self) -> None:
        """A SETUP with one vector of new content, so the worker needs it, then its TENSOR frame
        as it should be or corrupted."""
        root, rng = self.root, self.rng
        name = rng.choice([e.name for e in root.manifest if e.rows == 0])
        fresh = np.asarray([rng.gauss(0, 1) for _ in range(root.config.dim)], np.float32)
        entry = make_entry(name, fresh)
        try:
            kind, reply = await root.send_setup(M.to_wire(root.setup(
                manifest=[entry if e.name == name else e for e in root.manifest])))
            assert kind == P.NEED.name and reply["names"] == [name], reply
            raw, frame_kind, op = tensor_bytes(fresh).tobytes(), P.TENSOR, rng.randrange(8)
            if op == 1:
                raw = raw[:rng.randrange(len(raw))]
            elif op == 2:
                raw += bytes(rng.randrange(1, 64))
            elif op == 3:
                flipped = bytearray(raw)
                flipped[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
                raw = bytes(flipped)
            elif op == 4:
                frame_kind = rng.choice([P.ACTIVATIONS, P.FORWARD, P.GO, P.END, P.SETUP])
                if frame_kind.body != "raw":
                    raw = pack_msg({"names": raw})
            elif op == 5:
                raw = raw + raw
            root.conn.write_frame(frame_kind, raw)
            if op == 6:  # cut off mid-transfer
                root.conn.transport.abort()
                return
            try:
                kind, reply = await root.reply(P.LOADED)
            except NetworkError:
                kind, reply = "dropped", {}
            assert (kind == P.LOADED.name) == (op in (0, 7)), (op, kind, reply)
            self.refused += kind != P.LOADED.name
        finally:
            self.sent["TENSOR"] += 1
            await self._end()

    async def step_message(self, what: str) -> None:
        """A FORWARD (mutated) with its activations, or a FORWARD with mutated activations, in a
        session that is set up; a step the schema accepts runs on the root too."""
        root, rng = self.root, self.rng
        if not self.in_session:
            await root.open_session()
            self.in_session, self.setup = True, root.current
        n = rng.randrange(1, 5)
        logits = rng.choice(["none", "last", "all"])
        step, x = root.forward([rng.randrange(root.config.vocab_size) for _ in range(n)],
                               start=rng.randrange(root.ctx - n + 1), logits=logits,
                               recent=[rng.randrange(root.config.vocab_size) for _ in range(rng.randrange(4))],
                               targets=[rng.randrange(root.config.vocab_size) for _ in range(n)]
                               if logits == "all" and rng.random() < 0.5 else None)
        body, payload, frame_kind = _plain(step), x, P.ACTIVATIONS
        if what == "FORWARD":
            where = mutate(rng, body)
        else:
            payload, frame_kind, where = self._mutated_activations(x)
        run = _accepted(Step, body, self.setup)
        if run is not None and not (frame_kind == P.ACTIVATIONS and isinstance(payload, np.ndarray)
                                    and payload.shape == (run.n, root.config.dim) and np.isfinite(payload).all()):
            run = None
        try:
            kind, reply = await root.send_step(body, payload, run, frame_kind)
        except PeerTimeout as e:  # never right: the worker answers or drops the connection at once
            raise AssertionError(f"no answer to {what} ({where}): {body}") from e
        except NetworkError:
            kind, reply = "dropped", {}
        self.sent[what] += 1
        assert (kind == P.RESULT.name) == (run is not None), (what, where, kind, reply)
        if kind != P.RESULT.name:
            self.refused += 1
            await self._end()

    def _mutated_activations(self, x: np.ndarray):
        rng = self.rng
        x = x.copy()
        op = rng.randrange(9)
        if op <= 2:  # a value that is not finite
            x.reshape(-1)[rng.randrange(x.size)] = [np.nan, np.inf, -np.inf][op]
            return x, P.ACTIVATIONS, f"non-finite {op}"
        if op == 3:  # finite extremes are valid
            x.reshape(-1)[rng.randrange(x.size)] = rng.choice([3e38, -3e38, 1e-45, 0.0])
            return x, P.ACTIVATIONS, "extreme"
        if op == 4:
            return x.tobytes()[:-rng.choice([4, 1, x.shape[1] * 4])], P.ACTIVATIONS, "short"
        if op == 5:
            return x.tobytes() + bytes(rng.choice([4, 1, x.shape[1] * 4])), P.ACTIVATIONS, "long"
        if op == 6:
            return b"", P.ACTIVATIONS, "empty"
        if op == 7:
            return x, P.TENSOR, "as a TENSOR frame"
        return pack_msg({"start": 0}), P.FORWARD, "a second FORWARD instead"

    async def go_or_end_message(self) -> None:
        """GO with fields it must not have (a valid GO would wait for a sync group), or END with
        any body: either way the session ends."""
        root, rng = self.root, self.rng
        try:
            kind, reply = await root.send_setup(M.to_wire(root.setup()))
            assert kind == P.NEED.name, reply
            await root.send_tensors(reply["names"])
            kind, reply = await root.reply(P.LOADED, timeout=30)
            assert kind == P.LOADED.name, reply
            body = {rng.choice(["x", "session", "measure"]): rng.choice(NASTY)}
            frame_kind = rng.choice([P.GO, P.END])
            await root.conn.send_msg(frame_kind, body)
            try:
                kind, reply = await root.reply(P.READY)
            except NetworkError:
                kind, reply = "dropped", {}
            assert kind in (P.FAILED.name, "dropped") and "invalid" in reply.get("error", "invalid"), reply
            self.refused += 1
            self.sent[frame_kind.name.split(".")[1].upper()] += 1
        finally:
            await self._end()

    async def echo_message(self) -> None:
        """An ECHO (the root timing its link), mutated, after PROBE where the protocol has it, or
        before PROBE or after SETUP where it has not: the worker sends back what the schema accepts
        and then still serves the SETUP, and refuses the rest."""
        root, rng = self.root, self.rng
        body = {"payload": rng.randbytes(rng.choice([0, 1, 100, 4096]))}
        where = mutate(rng, body) if rng.random() < 0.7 else "as is"
        phase = rng.choice(["after PROBE", "after PROBE", "before PROBE", "after SETUP"])
        echoed = _accepted(M.Echo, body) if phase == "after PROBE" else None
        try:
            if phase == "before PROBE":
                await root.connect()
            else:
                await root.probe()
            if phase == "after SETUP":
                await root.conn.send_msg(P.SETUP, M.to_wire(root.setup()))
                kind, reply = await root.reply(P.NEED)
                assert kind == P.NEED.name, reply
                if not reply["names"]:  # all cached: the ECHO comes where GO should
                    kind, reply = await root.reply(P.LOADED, timeout=30)
                    assert kind == P.LOADED.name, reply
            await root.conn.send_msg(P.ECHO, body)
            try:
                kind, reply = await root.reply(P.ECHO)
            except NetworkError:
                kind, reply = "dropped", {}
            assert (kind == P.ECHO.name) == (echoed is not None), (phase, where, kind, reply)
            if echoed is None:
                self.refused += 1
            else:
                assert reply["payload"] == echoed.payload, (where, reply)
                await root.conn.send_msg(P.SETUP, M.to_wire(root.setup()))
                kind, reply = await root.reply(P.NEED)
                assert kind == P.NEED.name, (where, reply)
        finally:
            self.sent["ECHO"] += 1
            await self._end()

    async def batch(self, n: int) -> None:
        goal = sum(self.sent.values()) + n
        while sum(self.sent.values()) < goal:
            r = self.rng.random()
            if r < 0.45 or r >= 0.93:
                await self._end()  # those start a session of their own: the worker serves one root at a time
            if r < 0.33:
                await self.setup_message()
            elif r < 0.45:
                await self.tensor_message()
            elif r < 0.75:
                await self.step_message("FORWARD")
            elif r < 0.93:
                await self.step_message("ACTIVATIONS")
            elif r < 0.96:
                await self.go_or_end_message()
            else:
                await self.echo_message()
        await self._end()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the root's logits of 3e38 inputs
@pytest.mark.parametrize("n_mutated, batches", MUTATION_RUNS)
def test_worker_survives_mutated_messages_after_the_handshake(synthetic_model, tmp_path, one_compute_thread,
                                                              n_mutated, batches):
    """A client with no secret gets past the handshake and sends 2,500 mutated messages (10,000 in
    the slow set), each where the protocol expects its kind, in batches. The worker refuses exactly what the
    schema refuses (one FAILED or a dropped connection, one log line, no traceback), after
    every batch a real root gets the 1-node answer from it, and its RSS does not grow with the
    messages: from the first two batches (whose sessions take the worker's memory to what any
    session takes: slices of other plans, caches, buffers) to the last it stays within 50 MB, which
    8,000 messages (of 10,000) would pass if each left 6 KB behind, 1,500 (of 2,500) 33 KB."""
    seed = int(os.environ.get("DLLAMA_FUZZ_SEED") or int.from_bytes(os.urandom(4), "little"))  # to replay a failure
    print(f"\npost-handshake fuzz seed: {seed}")
    rng = random.Random(seed)
    model = GGUFModel(synthetic_model("Q4_1"))
    worker = WorkerProcess("--cache-dir", str(tmp_path / "cache"), "--timeout", "5", log_file=tmp_path / "worker.log")
    address = ("127.0.0.1", worker.port)

    async def run():
        answer = await one_node_answer(model, PROMPT, N_TOKENS)
        assert await root_answer(model, address, PROMPT, N_TOKENS) == answer  # compiles, fills the cache
        rss = []  # after each batch
        fuzzer = PostHandshakeFuzzer(rng, HandRoot(model, address))
        t0 = time.perf_counter()
        for batch in range(batches):
            await fuzzer.batch(n_mutated // batches)
            assert worker.proc.poll() is None, f"seed {seed}: the worker died in batch {batch}"
            assert await root_answer(model, address, PROMPT, N_TOKENS) == answer, f"seed {seed}, batch {batch}"
            rss.append(worker.rss_mb())
        return fuzzer, rss, time.perf_counter() - t0

    try:
        fuzzer, rss, elapsed = asyncio.run(run())
    finally:
        log = worker.stop()
    assert "Traceback" not in log, f"seed {seed}: " + log[log.index("Traceback") - 2000:][:6000]
    total = sum(fuzzer.sent.values())
    print(f"{total} mutated messages ({dict(fuzzer.sent)}), {fuzzer.refused} refused, {batches} batches, "
          f"{elapsed:.0f} s; worker RSS after each batch {[round(mb) for mb in rss]} MB")
    assert total >= n_mutated
    assert rss[-1] < max(rss[:2]) + 50, f"seed {seed}: RSS grew, batch by batch: {[round(mb) for mb in rss]} MB"
