"""`dllama serve` shared between clients, through the real command on loopback (each address of
127/8 is another client): one client's requests beyond its share are refused at once (429 with
Retry-After) while another client is served; a request waits at most --queue-timeout to start
(503 with Retry-After), whether behind its own client's requests or for a slot; and a stream
whose client reads nothing ends after --write-timeout, freeing its slot and KV cache."""

from __future__ import annotations

import asyncio
import json
import socket
import time

from dllama.server.admission import Admission, QueueTimeout
from dllama.server.api_errors import APIError

from .server_helpers import cli_server, metrics, post, wait_until

COUNTING = [{"role": "user", "content": "Count from 1 to 2000, separated by commas."}]  # a long answer
ANOTHER_CLIENT = "127.0.0.2"
SERVE = ("--ctx-size", "1600", "--threads", "1")


def unread_stream(url: str, max_tokens: int) -> socket.socket:
    """A streamed request from a client that never reads its answer (a small receive buffer, so
    that the server's buffers fill rather than this one's)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps({"messages": COUNTING, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: dllama\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def head(sock: socket.socket, timeout: float) -> tuple[int | None, dict, bytes]:
    """The response's status and headers, if they come within timeout: (None, {}, b"") if not."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        pass
    if b"\r\n\r\n" not in data:
        return None, {}, data
    lines, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = lines.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
    return int(status_line.split()[1]), headers, rest


def gauges(url: str) -> tuple[int, int]:
    m = metrics(url)
    return m[("dllama_requests_running", ())], m[("dllama_queue_length", ())]


def test_one_client_gets_its_share_and_no_more(model_path):
    """12 streams from one client that reads nothing (the default 8 slots and 16 queue places):
    3 generate, 7 wait their turn, 2 are refused at once; another client is answered meanwhile;
    the 7 get a 503 once they have waited --queue-timeout, the 3 go on."""
    with cli_server("--model", model_path, *SERVE, "--queue-timeout", "4") as (_proc, url):
        socks = []
        t_sent = time.monotonic()
        try:
            for _ in range(12):
                socks.append(unread_stream(url, 1500))
            assert wait_until(lambda: gauges(url) == (3, 7), 30), gauges(url)
            first = [head(s, 0.3) for s in socks]
            assert sorted(str(status) for status, _h, _r in first) == ["200"] * 3 + ["429"] * 2 + ["None"] * 7
            refused = [(status, headers, rest) for status, headers, rest in first if status == 429]
            for status, headers, rest in refused:
                assert status == 429 and int(headers["retry-after"]) >= 1
                assert json.loads(rest)["error"]["code"] == "too_many_requests_per_client"
            # another client gets a slot at once, beside the first one's three
            status, _h, answer = post(url, "/v1/chat/completions", {"messages": COUNTING, "max_tokens": 4,
                                                                     "temperature": 0}, timeout=60,
                                      source=ANOTHER_CLIENT)
            assert status == 200 and answer["usage"]["completion_tokens"] == 4
            assert gauges(url)[0] == 3  # (the first client's streams still run)
            # the waiting ones give up after the queue timeout: 503 with Retry-After; the running go on
            assert wait_until(lambda: gauges(url) == (3, 0), 30), gauges(url)
            assert time.monotonic() - t_sent >= 3.9
            waited = [head(s, 5) for s, (status, _h, _r) in zip(socks, first) if status is None]
            timed_out = [(h, rest) for status, h, rest in waited if status == 503]
            assert len(timed_out) == 7
            for h, rest in timed_out:
                assert int(h["retry-after"]) >= 1 and json.loads(rest)["error"]["code"] == "queue_timeout"
        finally:
            for s in socks:
                s.close()


def test_a_stream_nobody_reads_ends_after_the_write_timeout(model_path):
    """One slot, held by a stream whose client reads nothing: another client's request gives up
    after --queue-timeout (503); once the server's buffers are full the stream ends after
    --write-timeout (its slot and KV cache free), and the other client is answered."""
    with cli_server("--model", model_path, *SERVE, "--max-batch", "1", "--queue-timeout", "2",
                    "--write-timeout", "2", "--speculate", "off") as (_proc, url):  # (a step a token: counted below)
        sock = unread_stream(url, 1500)
        try:
            assert wait_until(lambda: gauges(url)[0] == 1, 30)
            status, headers, err = post(url, "/v1/chat/completions", {"messages": COUNTING, "max_tokens": 4},
                                        timeout=30, source=ANOTHER_CLIENT)
            assert status == 503 and err["error"]["code"] == "queue_timeout" and int(headers["Retry-After"]) >= 1
            write_timeouts = ("dllama_http_timeouts_total", (("phase", "write"),))
            assert wait_until(lambda: metrics(url)[write_timeouts] == 1, 120)
            # its slot is freed at the next step (the one in flight completes on every node)
            freed = lambda m: m[("dllama_requests_running", ())] == 0 and m[("dllama_kv_cache_in_use_tokens", ())] == 0  # noqa: E731
            assert wait_until(lambda: freed(metrics(url)), 30)
            m = metrics(url)
            assert m[("dllama_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "499")))] == 1
            generated = m[("dllama_batch_steps_total", ())]
            assert 100 < generated < 1500  # ended by the timeout, not by max_tokens
        finally:
            sock.close()
        status, _h, answer = post(url, "/v1/chat/completions", {"messages": COUNTING, "max_tokens": 4},
                                  timeout=60, source=ANOTHER_CLIENT)
        assert status == 200 and answer["usage"]["completion_tokens"] == 4


async def test_turns_go_in_order_and_places_are_never_lost():
    """One place, three waiting: one that leaves the queue (its client went away) and one that times
    out pass their turn on; the others get theirs in order of arrival; the client is forgotten at
    the end (no state grows with the clients served)."""
    admission = Admission(running=1, queued=3, queue_timeout=60)
    loop = asyncio.get_running_loop()
    order, release = [], asyncio.Event()

    async def request(name, deadline=loop.time() + 60):
        async with admission.turn("10.0.0.1", deadline):
            order.append(name)
            assert admission.clients["10.0.0.1"].running == 1
            await release.wait()

    first = asyncio.ensure_future(request("first"))
    await asyncio.sleep(0)
    leaving = asyncio.ensure_future(request("leaving"))
    impatient = asyncio.ensure_future(request("impatient", loop.time() + 0.05))
    last = asyncio.ensure_future(request("last"))
    await asyncio.sleep(0)
    assert admission.waiting == 3
    try:
        async with admission.turn("10.0.0.1", loop.time() + 60):
            raise AssertionError("a fifth request was taken")
    except APIError as e:
        assert e.status == 429 and e.retry_after == 1
    async with admission.turn("10.0.0.2", loop.time() + 60):  # another client is not held up
        pass
    leaving.cancel()
    try:
        await impatient
        raise AssertionError("no queue timeout")
    except QueueTimeout as e:
        assert e.status == 503 and e.retry_after >= 1
    release.set()
    await asyncio.wait_for(asyncio.gather(first, last), 10)
    assert leaving.cancelled() and order == ["first", "last"]
    assert admission.clients == {} and admission.waiting == 0
