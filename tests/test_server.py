"""`dllama serve`: the OpenAI-compatible API driven by the official `openai` client (and raw HTTP
where the client would not send what a test needs), on a real loopback socket. The server runs
in-process on a LocalEngine of the default model (loaded once); two tests run the real CLI with a
local worker (the cluster path, a worker that dies). Greedy answers are checked against a
Generator on a separate engine."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import openai
import pytest

from dllama.cli.common import open_runtime
from dllama.engine import LocalEngine
from dllama.generate import Generator
from dllama.stream import _common_prefix
from dllama.sampling import SamplingParams
from dllama.server import ServerConfig, make_app
from dllama.server.app import SERVER
from dllama.sync_config import SyncConfig

from .server_helpers import (RawStream, ServerThread, children, cli_server, get, metrics, post, request,
                             wait_until)

CTX = 1024
GREEDY = SamplingParams(temperature=0.0)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def model_name(model_path) -> str:
    return os.path.splitext(os.path.basename(model_path))[0]


@pytest.fixture(scope="module")
def server(model_path):
    """The API on a free loopback port, its runtime, and its state (for white-box checks)."""
    thread = ServerThread()
    rt = thread.run(open_runtime({"model": model_path, "ctx_size": CTX, "threads": 1}, quiet=True))
    app = make_app(rt, ServerConfig(max_queued_per_client=16))  # (all its clients come from one address)
    url = thread.serve(app)
    yield SimpleNamespace(thread=thread, url=url, runtime=rt, state=app[SERVER])
    thread.close(rt.close)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(gguf_model, tokenizer, one_compute_thread):
    """reference(ids, max_tokens, params=GREEDY, fresh=True) -> the Generation of a Generator on
    an engine of its own: from an empty cache, or (fresh=False) after the previous call's."""
    loop = asyncio.new_event_loop()
    engine = LocalEngine(gguf_model, CTX)
    generator = Generator(engine, tokenizer)

    def generate(ids, max_tokens, params=GREEDY, fresh=True):
        if fresh:
            engine.rewind(0)
        return loop.run_until_complete(generator.generate(list(ids), params, max_tokens))

    yield generate
    loop.close()


@pytest.fixture(scope="module")
def forget(client, model_name, tokenizer):
    """Make the server's next request start from an empty KV cache (a one-token prompt that no
    other prompt begins with), so that its answer can be compared with `reference`: a cache that
    holds generated tokens (computed one at a time) or a prompt's last token recomputed alone give
    logits that differ in the last bits from one batched prefill, which can flip a greedy pick."""
    token = tokenizer.encode("Zebra", add_bos=False)[:1]

    def run():
        client.completions.create(model=model_name, prompt=token, max_tokens=1, temperature=0)

    return run


def chat_ids(tokenizer, messages) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_bos=False, special=True)


# ------------------------------------------------------------------ models, health


def test_models_and_health(server, client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    status, text = get(server.url, "/health")
    assert status == 200
    health = json.loads(text)
    assert health["status"] == "ok" and health["nodes"] == 1 and health["node_status"] == {"root": "up"}
    assert health["model"] == model_name and health["context"] == CTX


def test_status_for_the_chat_page(server, client, model_name):
    """/status, which the chat page polls: /health's figures, each node in detail (one process:
    the root holds the whole model) and the speed of the last answer, never its text."""
    client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=8, temperature=0)
    status, text = get(server.url, "/status")
    assert status == 200
    body = json.loads(text)
    assert body["status"] == "ok" and body["model"] == model_name and body["context"] == CTX
    assert body["queue_length"] == 0 and body["running"] == 0 and body["sync_mode"] == "reduce"
    [root] = body["nodes"]
    assert root["node"] == "root" and root["address"] is None and root["up"] is True and root["share"] == 1.0
    assert root["rss_mb"] > 50 and root["ms_per_token"] > 0
    last = body["last_answer"]
    assert 1 < last["tokens"] <= 8 and last["tokens_per_s"] > 0 and last["finish_reason"] in ("stop", "length")
    assert set(last["ms_per_token"]) == {"total", "compute", "sync"}
    assert "Paris" not in text and "text" not in last  # anyone with the key may poll it


@pytest.mark.parametrize("path,content_type", [("/", "text/html"), ("/static/chat.js", "text/javascript"),
                                               ("/static/chat.css", "text/css")])
def test_chat_page_files(server, path, content_type):
    """The chat page comes from the package itself, needs nothing from another host (it works
    offline), and its Content-Security-Policy lets only its own script run."""
    status, headers, body = request(server.url, "GET", path)
    assert status == 200 and headers["Content-Type"].startswith(content_type)
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert "http://" not in body and "https://" not in body and "//cdn" not in body
    if path == "/":
        assert 'src="/static/chat.js"' in body and 'href="/static/chat.css"' in body
        assert 'name="viewport"' in body  # phone screens get the page at their width


def test_only_the_page_files_are_served(server):
    """A fixed list of files, not a directory: no other file of the package can be reached."""
    for path in ("/static/app.py", "/static/", "/static/../app.py", "/index.html"):
        assert request(server.url, "GET", path)[0] == 404, path


def test_loading_server_answers_503(server, client, model_name):
    """Before the engine is attached (the CLI listens while the weights go out), health and
    generation say 503; the model list already answers."""
    url = server.thread.serve(make_app(None, ServerConfig(model_name=model_name)))
    status, text = get(url, "/health")
    assert status == 503 and json.loads(text)["status"] == "loading"
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as loading:
        assert [m.id for m in loading.models.list().data] == [model_name]
        with pytest.raises(openai.InternalServerError) as e:
            loading.chat.completions.create(model=model_name, messages=QUESTION)
    assert e.value.status_code == 503 and e.value.code == "model_loading"


# ------------------------------------------------------------------ chat


def test_chat_greedy_is_the_generators_answer(client, tokenizer, reference, forget, model_name):
    ids = chat_ids(tokenizer, QUESTION)
    want = reference(ids, 24)
    forget()
    got = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24)
    assert got.object == "chat.completion" and got.model == model_name and got.id.startswith("chatcmpl-")
    choice = got.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want.text and want.text
    assert choice.finish_reason == want.finish_reason == "length"
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == len(want.tokens) == 24
    assert got.usage.total_tokens == len(ids) + 24


def test_content_as_text_parts(client, tokenizer, reference, forget, model_name):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    want = reference(chat_ids(tokenizer, [{"role": "user", "content": "What is the capital\nof France?"}]), 8)
    forget()
    got = client.chat.completions.create(model=model_name, messages=parts, temperature=0, max_tokens=8)
    assert got.choices[0].message.content == want.text


def test_streaming_chat(client, tokenizer, reference, forget, model_name):
    ids = chat_ids(tokenizer, QUESTION)
    want = reference(ids, 24)
    forget()
    chunks = list(client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == want.text
    assert [c.choices[0].finish_reason for c in with_choices][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == []  # the usage chunk comes last
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 24


def test_kv_cache_reused_when_the_conversation_goes_on(server, client, tokenizer, reference, forget, model_name):
    forget()
    first = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=12)
    cached_now = list(server.runtime.engine.context)  # what the KV cache holds after the answer
    conversation = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                               {"role": "user", "content": "And the capital of Germany?"}]
    ids = chat_ids(tokenizer, conversation)
    second = client.chat.completions.create(model=model_name, messages=conversation, temperature=0, max_tokens=12)
    reused = min(_common_prefix(cached_now, ids), len(ids) - 1)
    assert reused > len(chat_ids(tokenizer, QUESTION))  # the first prompt and (part of) its answer
    assert second.usage.prompt_tokens == len(ids)
    assert second.usage.prompt_tokens_details.cached_tokens == reused
    # and the answer is what a Generator on its own engine gives after the same first request
    assert first.choices[0].message.content == reference(chat_ids(tokenizer, QUESTION), 12).text
    assert second.choices[0].message.content == reference(ids, 12, fresh=False).text


def test_seed_makes_sampling_reproducible(client, tokenizer, reference, forget, model_name):
    """Temperature 1 with a seed: the same answer every time, and the answer of OpenAI's defaults
    (top_p 1, no top-k cut) sampled with that seed."""
    ids = chat_ids(tokenizer, QUESTION)

    def ask(seed):
        forget()
        return client.chat.completions.create(model=model_name, messages=QUESTION, temperature=1.0, max_tokens=16,
                                              seed=seed).choices[0].message.content

    a, b = ask(1234), ask(1234)
    assert a == b
    assert a == reference(ids, 16, SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=1234)).text
    assert len({ask(1), ask(2), ask(3), a}) > 1  # the seed is what fixes it


# ------------------------------------------------------------------ completions and stop


def test_completions(server, client, tokenizer, reference, forget, model_name):
    ids = tokenizer.encode(STORY)
    want = reference(ids, 16)
    forget()
    got = client.completions.create(model=model_name, prompt=STORY, temperature=0, max_tokens=16)
    assert got.object == "text_completion" and got.id.startswith("cmpl-")
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 16)
    # token ids as the prompt give the same
    forget()
    by_ids = client.completions.create(model=model_name, prompt=ids, temperature=0, max_tokens=16)
    assert by_ids.choices[0].text == want.text
    # the wire format of a stream: data: {json} events, finish_reason last, then [DONE]
    forget()
    stream = RawStream(server.url, "/v1/completions", {"model": model_name, "prompt": STORY, "temperature": 0,
                                                      "max_tokens": 16, "stream": True})
    assert stream.resp.status == 200 and stream.resp.getheader("Content-Type").startswith("text/event-stream")
    events = list(stream.events())
    stream.hang_up()
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stop_sequences(client, tokenizer, reference, forget, model_name):
    full = reference(tokenizer.encode(STORY), 32).text
    mid = len(full) // 2
    stop = full[mid:mid + 4]
    cut = full.find(stop)
    forget()
    got = client.completions.create(model=model_name, prompt=STORY, temperature=0, max_tokens=32,
                                    stop=[stop, "never appears"])
    assert got.choices[0].text == full[:cut] and got.choices[0].finish_reason == "stop"
    forget()
    streamed = client.completions.create(model=model_name, prompt=STORY, temperature=0, max_tokens=32, stop=stop,
                                         stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]  # the stop string never goes out
    assert chunks[-1].choices[0].finish_reason == "stop"
    # chat too
    text = reference(chat_ids(tokenizer, QUESTION), 24).text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    forget()
    cut_chat = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24,
                                              stop=stop)
    assert cut_chat.choices[0].message.content == text[:text.find(stop)]
    assert cut_chat.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------ bad requests and limits


@pytest.mark.parametrize("extra, param, fragment", [
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "robot"),
    ({"messages": []}, "messages", "empty"),
    ({"n": 2}, "n", "n=1"),
    ({"max_tokens": 5000}, "max_tokens", "at most 2048"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"top_p": 1.5}, "top_p", "at most 1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", "only text"),
    ({"stream": True, "return_token_ids": True}, "return_token_ids", "not supported with 'stream'"),
])
def test_bad_request(client, model_name, extra, param, fragment):
    args = {"messages": QUESTION, "max_tokens": 4, **extra}
    messages = args.pop("messages")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=messages, extra_body=args)
    err = e.value
    assert err.status_code == 400 and err.type == "invalid_request_error" and err.param == param
    assert fragment in err.body["message"]


def test_malformed_json_and_long_prompt(server, tokenizer):
    status, _headers, body = post(server.url, "/v1/chat/completions", b'{"messages": [')
    assert status == 400 and body["error"]["code"] == "invalid_json" and body["error"]["type"]
    status, _headers, body = post(server.url, "/v1/completions", b'["not", "an", "object"]')
    assert status == 400 and "JSON object" in body["error"]["message"]
    long_prompt = "word " * (CTX + 10)
    status, _headers, body = post(server.url, "/v1/completions", {"prompt": long_prompt, "max_tokens": 4})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert str(CTX) in body["error"]["message"]
    status, _headers, body = post(server.url, "/v1/embeddings", {"input": "x"})
    assert status == 404 and body["error"]["code"] == "unknown_url"


def test_oversized_body_is_413(server, client, model_name):
    huge = [{"role": "user", "content": "x" * (server.state.config.max_body_bytes + 10)}]
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=model_name, messages=huge, max_tokens=4)
    assert e.value.status_code == 413 and e.value.code == "request_too_large"
    assert str(server.state.config.max_body_bytes) in e.value.body["message"]
    assert get(server.url, "/health")[0] == 200  # and the server goes on


def test_full_queue_is_429(server, model_name):
    """With max_queue=1, one request may wait behind the running one; the next gets a 429 (and
    the two admitted ones are answered once the engine is free)."""
    app = make_app(server.runtime, ServerConfig(max_queue=1, max_queued_per_client=1))
    url = server.thread.serve(app)
    body = {"model": model_name, "messages": QUESTION, "max_tokens": 2, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        with server.thread.holding(server.runtime.engine):  # a generation is running
            admitted = [pool.submit(post, url, "/v1/chat/completions", body) for _ in range(2)]
            assert wait_until(lambda: app[SERVER].pending == 2, 30)
            m = metrics(url)
            assert m[("dllama_queue_length", ())] + m[("dllama_requests_running", ())] == 2
            status, headers, err = post(url, "/v1/chat/completions", body)
            assert status == 429 and err["error"]["code"] == "queue_full" and "at most 1" in err["error"]["message"]
            assert headers.get("Retry-After")
            with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
                with pytest.raises(openai.RateLimitError):
                    c.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=2)
        assert [f.result()[0] for f in admitted] == [200, 200]


def test_client_that_leaves_the_queue_frees_its_place(server, model_name):
    with server.thread.holding(server.runtime.engine):
        conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"model": model_name, "messages": QUESTION, "max_tokens": 4}).encode())
        assert wait_until(lambda: server.state.pending == 1, 30)
        conn.sock.close()
        conn.close()
        assert wait_until(lambda: server.state.pending == 0, 30)  # while the engine is still busy


def test_sixteen_concurrent_clients(server, client, tokenizer, reference, model_name):
    questions = [[{"role": "user", "content": f"Say the number {i} in words."}] for i in range(16)]

    def ask(messages):
        return client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=8)

    before = metrics(server.url)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, questions))
    assert all(a.choices[0].finish_reason in ("stop", "length") and a.usage.completion_tokens <= 8 for a in answers)
    # nobody got someone else's answer
    for i in (0, 7, 15):
        assert answers[i].choices[0].message.content == reference(chat_ids(tokenizer, questions[i]), 8).text
    after = metrics(server.url)
    key = ("dllama_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))
    assert after[key] - before.get(key, 0) == 16
    assert after[("dllama_queue_length", ())] == 0


def test_client_disconnect_cancels_its_generation(server, client, tokenizer, reference, forget, model_name):
    """A client that hangs up mid-stream stops its generation (not 1000 tokens later), the request
    counts as 499, and the next request is answered at once and correctly."""
    prompt_len = len(tokenizer.encode(STORY))
    key = ("dllama_requests_total", (("endpoint", "/v1/completions"), ("status", "499")))
    cancelled_before = metrics(server.url).get(key, 0)
    stream = RawStream(server.url, "/v1/completions", {"model": model_name, "prompt": STORY, "temperature": 0,
                                                      "max_tokens": 1000, "stream": True})
    events = stream.events()
    for _ in range(3):
        assert next(events)["choices"][0]["finish_reason"] is None
    stream.hang_up()
    t0 = time.monotonic()
    assert wait_until(lambda: server.state.pending == 0, 30)
    # what the KV cache holds: the prompt and the few tokens fed before the generation stopped
    fed = len(server.runtime.engine.context) - prompt_len
    assert 2 <= fed < 100
    answer = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=4)
    assert time.monotonic() - t0 < 10  # STORY and QUESTION share no prefix: the cache starts empty
    assert answer.choices[0].message.content == reference(chat_ids(tokenizer, QUESTION), 4).text
    assert metrics(server.url)[key] == cancelled_before + 1


def test_client_disconnect_cancels_a_non_streamed_generation(server, tokenizer, model_name):
    """A client that gives up on a non-streamed request (its timeout) stops the generation too."""
    prompt_len = len(tokenizer.encode(STORY))
    key = ("dllama_requests_total", (("endpoint", "/v1/completions"), ("status", "499")))
    cancelled_before = metrics(server.url).get(key, 0)
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": model_name, "prompt": STORY, "temperature": 0, "max_tokens": 1000}).encode())
    engine = server.runtime.engine
    assert wait_until(lambda: engine.context[:prompt_len] == tokenizer.encode(STORY)
                      and len(engine.context) > prompt_len + 2, 30)
    conn.sock.close()
    conn.close()
    assert wait_until(lambda: server.state.pending == 0, 30)
    assert len(engine.context) - prompt_len < 100
    assert metrics(server.url)[key] == cancelled_before + 1


def test_metrics(server, client, model_name):
    before = metrics(server.url)
    got = client.completions.create(model=model_name, prompt=STORY, temperature=0, max_tokens=6)
    m = metrics(server.url)
    key = ("dllama_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert m[key] - before.get(key, 0) == 1
    assert m[("dllama_generated_tokens_total", ())] - before[("dllama_generated_tokens_total", ())] == 6
    assert m[("dllama_prompt_tokens_total", ())] - before[("dllama_prompt_tokens_total", ())] == \
        got.usage.prompt_tokens
    assert m[("dllama_tokens_per_second", ())] > 0
    parts = {p: m[("dllama_ms_per_token", (("part", p),))] for p in ("total", "compute", "sync")}
    assert parts["total"] >= parts["compute"] > 0 and parts["sync"] == 0  # one node: no all-reduce
    assert m[("dllama_bytes_per_token", (("direction", "sent"),))] == 0
    assert m[("dllama_node_up", (("node", "root"),))] == 1
    assert m[("dllama_nodes", ())] == 1 and m[("dllama_up", ())] == 1
    assert m[("dllama_context_tokens", ())] == CTX
    info = [labels for (name, labels) in m if name == "dllama_info"]
    assert dict(info[0])["model"] == model_name


# ------------------------------------------------------------------ the real command


@pytest.fixture(scope="module")
def f64_answer(gguf_model, tokenizer):
    """answer(messages, n) -> the greedy chat answer of one node in f64 (what a cluster in f64
    sync gives, whatever its node count)."""
    def answer(messages, n):
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(Generator(LocalEngine(gguf_model, 256, SyncConfig(dtype="f64")), tokenizer).generate(
                chat_ids(tokenizer, messages), GREEDY, n)).text
        finally:
            loop.close()

    return answer


SERVE_ONE_WORKER = ("--local-workers", "1", "--ctx-size", "256", "--threads", "1", "--sync-dtype", "f64",
                    "--timeout", "10")


def test_cli_serve_with_a_local_worker(model_path, model_name, f64_answer):
    """`dllama serve --local-workers 1`: listens at once, is ready after the weights went out,
    answers a chat as one node would (f64 sync), reports both nodes; without recovery a killed
    worker gives a 503 with a JSON error (streamed: an error event); SIGTERM stops it cleanly."""
    messages = [{"role": "user", "content": "Hi!"}]
    with cli_server("--model", model_path, *SERVE_ONE_WORKER, "--no-recover") as (proc, url):
        health = json.loads(get(url, "/health")[1])
        assert health["nodes"] == 2 and list(health["node_status"].values()) == ["up", "up"]
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            got = c.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=6)
            assert got.choices[0].message.content == f64_answer(messages, 6)
            m = metrics(url)
            assert m[("dllama_nodes", ())] == 2
            assert [v for (name, _labels), v in m.items() if name == "dllama_node_up"] == [1, 1]
            assert m[("dllama_bytes_per_token", (("direction", "sent"),))] > 0
            assert m[("dllama_ms_per_token", (("part", "sync"),))] > 0

            workers = children(proc.pid)
            assert len(workers) == 1
            os.kill(workers[0], signal.SIGKILL)
            with pytest.raises(openai.InternalServerError) as e:
                c.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=6)
            assert e.value.status_code == 503 and e.value.code == "engine_error", e.value.body
            assert "partial_text" in e.value.body and "failed" in e.value.body["message"]
            status, text = get(url, "/health")
            assert status == 503 and json.loads(text)["status"] == "error"
            with pytest.raises(openai.APIError) as e:
                list(c.chat.completions.create(model=model_name, messages=messages, max_tokens=6, stream=True))
            assert "failed" in e.value.message


def test_cli_serve_reports_a_worker_it_lost(model_path, model_name, f64_answer):
    """With recovery (the default) a killed worker costs no request: the answer is the same,
    /health stays 200 and shows the worker down, /metrics too."""
    first = [{"role": "user", "content": "Hi!"}]
    second = [{"role": "user", "content": "Name a color."}]  # no cached token is single-token-built
    with cli_server("--model", model_path, *SERVE_ONE_WORKER) as (proc, url):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            c.chat.completions.create(model=model_name, messages=first, temperature=0, max_tokens=4)
            os.kill(children(proc.pid)[0], signal.SIGKILL)
            got = c.chat.completions.create(model=model_name, messages=second, temperature=0, max_tokens=6)
            assert got.choices[0].message.content == f64_answer(second, 6)
        status, text = get(url, "/health")
        health = json.loads(text)
        assert status == 200 and health["status"] == "ok" and health["nodes"] == 1
        assert list(health["node_status"].values()) == ["up", "down"]
        assert "last_event" in health
        m = metrics(url)
        assert sorted(v for (name, _labels), v in m.items() if name == "dllama_node_up") == [0, 1]
        assert m[("dllama_nodes", ())] == 1 and m[("dllama_cluster_events_total", ())] >= 2
