"""`dllama serve` against hostile clients, over real loopback sockets: bodies that would crash the
JSON parser or the sampler, clients that hold connections without finishing a request, more
connections than the server takes, requests without the API key, and the CLI refusing to serve
a network without a key. The server runs in-process on the default model (as in test_server.py)
with timeouts shortened for the tests; the CLI tests run the real command."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from dllama.cli.common import open_runtime
from dllama.server import ServerConfig, make_app
from dllama.server.app import SERVER

from .server_helpers import (ServerThread, get, metrics, post, raw_connect, read_to_close, read_until, request,
                             wait_until)

CTX = 256
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def loaded(model_path):
    """A server thread and a runtime of the default model, shared by the apps of this module."""
    thread = ServerThread()
    rt = thread.run(open_runtime({"model": model_path, "ctx_size": CTX, "threads": 1}, quiet=True))
    yield thread, rt
    thread.close(rt.close)


def serve(loaded, **config) -> tuple[str, object]:
    """An app with this ServerConfig on a free loopback port: (base URL, its ServerState)."""
    thread, rt = loaded
    app = make_app(rt, ServerConfig(**config))
    return thread.serve(app), app[SERVER]


@pytest.fixture(scope="module")
def server(loaded):
    return serve(loaded)[0]  # the limits as shipped


def assert_openai_error(body: dict, status_code: str | None, param: str | None = None) -> dict:
    """OpenAI's error shape, exactly: {"error": {"message", "type", "param", "code"}}."""
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert err["type"] == "invalid_request_error" and err["code"] == status_code and err["param"] == param, body
    assert err["message"] and "Traceback" not in err["message"]
    return err


def chat(**fields) -> dict:
    return {"model": "m", "messages": QUESTION, "max_tokens": 1, "temperature": 0, **fields}


# ------------------------------------------------------------------ JSON bodies


def test_deeply_nested_json_is_400(server):
    """Python's json module recurses: 100 000 brackets would end in a RecursionError (a 500).
    The depth is checked before parsing; the limit is 64 levels, the body's own object included."""
    status, _h, body = post(server, "/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000)
    err = assert_openai_error(body, "invalid_json")
    assert status == 400 and "64" in err["message"]

    def nested(levels: int) -> bytes:  # an ignored field, so that only the depth can refuse it
        text = json.dumps(chat())
        return (text[:-1] + ', "extra": ' + "[" * (levels - 1) + "]" * (levels - 1) + "}").encode()

    status, _h, body = post(server, "/v1/chat/completions", nested(65))
    assert status == 400 and "65 levels" in body["error"]["message"]
    status, _h, body = post(server, "/v1/chat/completions", nested(64))
    assert status == 200, body
    # brackets and quotes inside strings are text, not nesting
    status, _h, body = post(server, "/v1/chat/completions", chat(note='[{\\"' * 5000 + "[" * 5000))
    assert status == 200, body
    assert get(server, "/health")[0] == 200


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/chat/completions", b'"temperature": NaN', "temperature"),
    ("/v1/chat/completions", b'"top_p": Infinity', "top_p"),
    ("/v1/chat/completions", b'"metadata": {"weights": [1, -Infinity]}', "metadata.weights[1]"),
    ("/v1/chat/completions", b'"temperature": 1e999', "temperature"),
    ("/v1/chat/completions", b'"repeat_penalty": 1' + b"0" * 400, "repeat_penalty"),  # an integer: float() overflows
    ("/v1/completions", b'"prompt": "Hello", "max_tokens": 1, "temperature": NaN', "temperature"),
], ids=["nan-temperature", "infinity-top-p", "-infinity-nested", "1e999", "10^400", "completions-nan"])
def test_non_finite_numbers_are_400(server, path, raw, param):
    """NaN and infinities are no JSON, but Python's json module reads them; a NaN temperature
    reached the sampler ("Probabilities contain NaN", a 500). Anywhere in a request, even in a
    field the server ignores, they are a 400 naming the field."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, ' + raw + b"}"
    status, _h, err = post(server, path, body)
    assert status == 400, err
    assert "finite" in assert_openai_error(err, "invalid_value", param)["message"]
    # and the server goes on answering
    status, _h, ok = post(server, "/v1/chat/completions", chat(temperature=0.7, seed=1))
    assert status == 200, ok


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/chat/completions", rb'"messages": [{"role": "user", "content": "hi \ud800 there"}]', "messages[0].content"),
    ("/v1/chat/completions", rb'"messages": [{"role": "user", "content": "\udcff"}]', "messages[0].content"),
    ("/v1/chat/completions", b'"messages": [{"role": "user", "content": "hi \xed\xa0\x80"}]', "messages[0].content"),
    ("/v1/completions", rb'"prompt": "Hello \udfff"', "prompt"),
    ("/v1/completions", rb'"prompt": ["ok", "\ud83d"]', "prompt[1]"),
], ids=["high-escape", "low-escape", "encoded-bytes", "completions", "second-prompt"])
def test_lone_surrogates_are_400(server, path, raw, param):
    """A \\ud800 escape alone decodes to a string with no UTF-8 form: the tokenizer's encoding
    failed on it (a 500). It is a 400 naming the field."""
    body = b'{"model": "m", "max_tokens": 1, "temperature": 0, ' + raw + b"}"
    status, _h, err = post(server, path, body)
    assert status == 400, err
    assert "surrogate" in assert_openai_error(err, "invalid_value", param)["message"]


def test_a_key_that_is_not_text_is_400(server):
    """Named as a key, and found before a NaN whose field's name would hold it (no message that
    cannot be sent back)."""
    body = b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}], "x\\ud800": NaN}'
    status, _h, err = post(server, "/v1/chat/completions", body)
    assert status == 400, err
    assert "a key holds a lone UTF-16 surrogate" in assert_openai_error(err, "invalid_value")["message"]


def test_an_emoji_in_escapes_is_text(server):
    body = b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}'
    status, _h, ok = post(server, "/v1/chat/completions", body)
    assert status == 200, ok


# ------------------------------------------------------------------ every field that reaches the sampler

EDGE_VALUES = [0, -1, 5e-324, 1e-308, 1e308, 10 ** 30, "1", True, [], {}]


@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k", "repeat_penalty", "seed", "frequency_penalty",
                                   "presence_penalty", "logit_bias", "max_tokens", "n"])
def test_sampling_fields_at_their_edges_are_400_or_defined(server, field):
    """Each field at 0, negative, subnormal, huge and of the wrong type: a 400 naming the field, or an
    answer, never a 5xx (a subnormal temperature was a 503 with a traceback, and turned /health
    red). NaN and infinities: test_non_finite_numbers_are_400."""
    answers = {}
    for value in EDGE_VALUES:
        status, _h, body = post(server, "/v1/chat/completions", chat(**{field: value}, max_tokens=2)
                                if field != "max_tokens" else chat(**{field: value}))
        assert status in (200, 400), (field, value, status, body)
        if status == 400:
            assert body["error"]["param"] == field and "Traceback" not in body["error"]["message"], body
        else:
            answers[repr(value)] = body["choices"][0]["message"]["content"]
    assert get(server, "/health")[0] == 200
    if field == "temperature":  # below sampling.MIN_TEMPERATURE it is greedy: temperature 0's answer
        assert answers["5e-324"] == answers["1e-308"] == answers["0"], answers
        assert set(answers) == {"0", "5e-324", "1e-308"}, answers  # -1, 1e308 (above 2) and the wrong types: 400
    if field == "repeat_penalty":  # (0, 1e3]: 1e-308 gave garbage with divide-by-zero warnings
        assert answers == {}, answers


def test_a_failed_request_is_its_own_error_not_the_server_s_health(loaded):
    """A request whose generation fails gets its error; /health (what a load balancer probes) and
    /metrics' readiness reflect the engine and its nodes, which are fine, and the next request is
    answered. Before, the last request's failure made /health 503 until another one succeeded."""
    url, state = serve(loaded)
    engine = loaded[1].engine
    real_forward = engine._forward
    calls = []

    async def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug met by one request")
        return await real_forward(*args, **kwargs)

    engine._forward = failing_once
    try:
        status, _h, body = post(url, "/v1/chat/completions", chat(max_tokens=3))
        assert status >= 500 and body["error"]["code"] == "engine_error", body
        status, text = get(url, "/health")
        assert status == 200 and json.loads(text)["status"] == "ok", text
        assert metrics(url)[("dllama_up", ())] == 1
        status, _h, body = post(url, "/v1/chat/completions", chat(max_tokens=3))
        assert status == 200, body
    finally:
        engine._forward = real_forward


# ------------------------------------------------------------------ slow and idle clients


@pytest.fixture(scope="module")
def impatient(loaded):
    """A server with a 1 s header timeout and a 1 s body timeout."""
    return serve(loaded, header_timeout=1.0, body_timeout=1.0)


def test_half_a_request_line_is_dropped_after_the_header_timeout(impatient):
    url, state = impatient
    before = state.connections.header_timeouts
    sock = raw_connect(url)
    sock.sendall(b"GET /hea")
    t0 = time.monotonic()
    data, closed = read_to_close(sock, 10)
    elapsed = time.monotonic() - t0
    sock.close()
    assert closed and data == b"" and 0.8 < elapsed < 5, (data, elapsed)
    assert state.connections.header_timeouts == before + 1


def test_a_head_sent_byte_by_byte_is_dropped_too(impatient):
    """Bytes that arrive do not restart the clock: the whole head has the timeout."""
    url, _state = impatient
    sock = raw_connect(url)
    line = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"x" * 1000
    t0 = time.monotonic()
    dropped_after = None
    for byte in line:  # one byte every 0.1 s: 100 s for the whole head if nobody stopped it
        try:
            sock.send(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            dropped_after = time.monotonic() - t0
            break
        if select.select([sock], [], [], 0.1)[0]:
            data, closed = read_to_close(sock, 1)
            assert closed and data == b"", data
            dropped_after = time.monotonic() - t0
            break
        if time.monotonic() - t0 > 10:
            break
    sock.close()
    assert dropped_after is not None and 0.8 < dropped_after < 5, dropped_after


def test_a_prompt_client_is_served_and_an_idle_connection_closed(impatient):
    """The timer does not bite a client that sends its request: it is answered, and its kept-alive
    connection stays open for the next request until it has idled for the timeout."""
    url, _state = impatient
    sock = raw_connect(url)
    for _ in range(2):
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 200"), head
        time.sleep(0.5)  # less than the timeout between requests
    t0 = time.monotonic()
    _data, closed = read_to_close(sock, 10)
    sock.close()
    assert closed and 0.3 < time.monotonic() - t0 < 5


def test_a_stalled_body_is_408_and_dropped(impatient):
    url, state = impatient
    before = state.connections.body_timeouts
    sock = raw_connect(url)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"messages\": [")
    t0 = time.monotonic()
    data, closed = read_to_close(sock, 10)
    elapsed = time.monotonic() - t0
    sock.close()
    assert closed and 0.8 < elapsed < 5, (data, elapsed)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert_openai_error(json.loads(body), "request_timeout")
    assert state.connections.body_timeouts == before + 1


# ------------------------------------------------------------------ the connection cap


def test_connections_beyond_the_cap_are_refused_at_once(loaded):
    url, state = serve(loaded, max_connections=4, header_timeout=60.0)
    held = []
    try:
        for _ in range(4):  # four kept-alive connections, each known to the server (it answered)
            sock = raw_connect(url)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            held.append(sock)
        assert state.connections.open == 4
        extra = raw_connect(url)
        t0 = time.monotonic()
        data, closed = read_to_close(extra, 10)
        extra.close()
        assert closed and time.monotonic() - t0 < 2  # answered and closed, not held
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head, data
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert state.connections.open == 4 and state.connections.refused >= 1
        held.pop().close()  # a place frees up: the next client is served
        assert wait_until(lambda: state.connections.open == 3, 10)
        m = metrics(url)
        assert m[("dllama_http_connections_refused_total", ())] >= 1
        assert m[("dllama_http_connections", ())] == 4  # the three held and this one
    finally:
        for sock in held:
            sock.close()


# ------------------------------------------------------------------ the API key


@pytest.fixture(scope="module")
def keyed(loaded):
    return serve(loaded, api_keys=(KEY,))[0]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}],
                         ids=["missing", "wrong", "no-scheme", "basic", "longer"])
def test_requests_without_the_key_are_401(keyed, headers):
    """Every path but /health and the chat page's files: unknown ones too, so that no spelling of a path
    gets past."""
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("GET", "/metrics"), ("GET", "/status"), ("GET", "/v1/nowhere"), ("GET", "/nowhere"),
                         ("GET", "/static/nowhere.js"), ("GET", "//v1/models"), ("GET", "/v1/./models")]:
        body = json.dumps(chat()).encode() if method == "POST" else None
        status, resp_headers, text = request(keyed, method, path, body, headers)
        assert status == 401, (path, text)
        assert resp_headers.get("WWW-Authenticate", "").startswith("Bearer")
        assert_openai_error(json.loads(text), "invalid_api_key")
    assert get(keyed, "/health")[0] == 200  # open to load balancers' probes


def test_the_chat_page_opens_without_the_key(keyed):
    """The page's files hold no data, and the page asks the user for the key; what it then polls
    (/status: the workers' addresses) needs the key, as /metrics does."""
    for path in ("/", "/static/chat.js", "/static/chat.css"):
        assert request(keyed, "GET", path)[0] == 200, path
    status, _h, text = request(keyed, "GET", "/status", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and json.loads(text)["status"] == "ok"


def test_the_openai_client_needs_the_right_key(keyed, model_path):
    name = os.path.splitext(os.path.basename(model_path))[0]
    with openai.OpenAI(base_url=keyed + "/v1", api_key="sk-wrong", max_retries=0, timeout=120) as wrong:
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.chat.completions.create(model=name, messages=QUESTION, max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with openai.OpenAI(base_url=keyed + "/v1", api_key=KEY, max_retries=0, timeout=120) as right:
        assert [m.id for m in right.models.list().data] == [name]
        got = right.chat.completions.create(model=name, messages=QUESTION, max_tokens=2, temperature=0)
    assert got.choices[0].message.content and got.usage.completion_tokens == 2
    status, _h, _text = request(keyed, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200


def test_each_api_key_is_a_client_of_its_own(loaded):
    """With several keys (one per user), the per-client limits count each key, not the address
    all these requests share: the first key's second request is refused at once while its first
    runs, the other key's is taken."""
    thread, rt = loaded
    other = KEY + "-second-user"
    url, state = serve(loaded, api_keys=(KEY, other), max_running_per_client=1, max_queued_per_client=0)

    def ask(key):
        return request(url, "POST", "/v1/chat/completions", json.dumps(chat(max_tokens=2)).encode(),
                       {"Authorization": f"Bearer {key}"})

    with ThreadPoolExecutor(2) as pool:
        with thread.holding(rt.engine):
            first = pool.submit(ask, KEY)
            assert wait_until(lambda: state.pending == 1, 30)
            status, headers, text = ask(KEY)
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert json.loads(text)["error"]["code"] == "too_many_requests_per_client"
            second = pool.submit(ask, other)
            assert wait_until(lambda: state.pending == 2, 30)
        assert first.result()[0] == second.result()[0] == 200


# ------------------------------------------------------------------ the real command


def start_cli(model_path, *args, env_extra=None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("DLLAMA_API_KEY", "DLLAMA_DEBUG")}
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "dllama", "serve", "--model", model_path, "--port", "0", "--ctx-size", str(CTX),
           "--threads", "1", *args]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_cli_refuses_a_network_address_without_a_key(model_path, host):
    proc = start_cli(model_path, "--host", host)
    try:
        code = proc.wait(120)
        lines = [line for line in proc.stderr.read().splitlines() if line.strip()]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert code != 0
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    assert "--api-key" in lines[0] and "--insecure" in lines[0]


@pytest.mark.parametrize("how", ["insecure", "env-key"])
def test_cli_serves_a_network_address_with_a_key_or_insecure(model_path, how):
    """--insecure starts (with a warning); so does a key from DLLAMA_API_KEY, which /v1/ then needs."""
    args, env = (["--insecure"], None) if how == "insecure" else ([], {"DLLAMA_API_KEY": KEY})
    proc = start_cli(model_path, "--host", "0.0.0.0", *args, env_extra=env)
    try:
        m, log = read_until(proc, r"listening on http://0\.0\.0\.0:(\d+)", 120)
        assert m, log
        assert ("warning: serving on 0.0.0.0 without an API key" in log) == (how == "insecure"), log
        url = f"http://127.0.0.1:{m.group(1)}"
        assert get(url, "/health")[0] in (200, 503)  # loading or ready: listening, not refused
        status, _h, text = request(url, "GET", "/v1/models")
        assert status == (200 if how == "insecure" else 401), text
        if how == "env-key":
            assert request(url, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        _m, rest = read_until(proc, r"$^", 5)
        assert "Traceback" not in log + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
