"""The OpenAI-compatible HTTP API on aiohttp: routes, the request queue, SSE streaming, errors.

One generation runs at a time (the engine's lock serializes them, in FIFO order); up to
`max_queue` more wait for it and any beyond get a 429. A client that disconnects cancels its
request: the server runs with aiohttp's handler cancellation, so the handler (waiting in the
queue or generating) is cancelled and the Generator stops between two steps.

Against hostile clients: a request head must arrive within `header_timeout` and a body within
`body_timeout`, at most `max_connections` are open at once (connections.py), a JSON body may nest
`max_json_depth` deep and hold no NaN or infinity (openai_schema.parse_json), and with an
`api_key` every request but /health and the chat page's files must carry it as a bearer token.

The chat page (static/, served at /) talks to the same API as any client: it streams from
/v1/chat/completions and polls /status for its panel.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
from dataclasses import dataclass, field, replace
from importlib import resources

from aiohttp import web

from .. import __version__
from ..cluster.node import rss_mb
from ..errors import ContextOverflow, DllamaError, ModelError
from ..generate import Generation, Generator
from ..sampling import SamplingParams
from . import metrics as prom
from .connections import ConnectionCounts, ConnectionGuard, GuardedProtocol
from .openai_schema import (MAX_JSON_DEPTH, OPENAI_SAMPLING, APIError, Envelope, GenerationRequest, bad_request,
                            parse_chat, parse_completion, parse_json, usage)

log = logging.getLogger("dllama.server")

SHUTDOWN_TIMEOUT = 3.0  # seconds running requests get to finish when the server stops


@dataclass
class ServerConfig:
    model_name: str | None = None  # None: the GGUF file's stem
    max_queue: int = 16  # requests that may wait while one generates
    max_tokens_limit: int = 2048  # largest max_tokens a request may ask (and the default's cap)
    max_body_bytes: int = 1 << 20
    sampling: SamplingParams = field(default_factory=lambda: replace(OPENAI_SAMPLING))  # for omitted fields
    api_key: str | None = field(default=None, repr=False)  # None: no authentication
    header_timeout: float = 10.0  # seconds for a request head to arrive (and a keep-alive connection to idle)
    body_timeout: float = 30.0  # seconds for a request body to arrive
    max_connections: int = 256  # open at once; more are answered 503 and closed
    max_json_depth: int = MAX_JSON_DEPTH


class ServerState:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.runtime = None  # None while the model loads
        self.generator: Generator | None = None
        self.metrics = prom.Metrics()
        self.pending = 0  # admitted generation requests: the running one and those waiting
        self.last_error: str | None = None  # of the last generation, cleared by the next success
        self.connections = ConnectionCounts()  # kept by the connection guard of start_server
        # the key's digest: compared with the digest of what a request sends, so the comparison
        # takes the same time whatever the lengths (hmac.compare_digest only hides the content)
        self.key_digest = None if not config.api_key else hashlib.sha256(config.api_key.encode()).digest()

    def attach(self, runtime) -> None:
        """The engine is ready: start answering generation requests."""
        self.runtime = runtime
        self.generator = Generator(runtime.engine, runtime.tokenizer)  # the engine knows its KV cache
        if self.config.model_name is None:
            self.config.model_name = os.path.splitext(os.path.basename(runtime.model_path))[0]

    # ------------------------------------------------------------------ status

    @property
    def engine(self):
        return None if self.runtime is None else self.runtime.engine

    def nodes(self) -> list[dict]:
        """The engine's account of its nodes: {"node": name, "up": bool, "stats": last step's or None}."""
        if self.engine is None:
            return []
        return [{**n, "up": bool(n.get("up"))} for n in self.engine.node_status()]

    def running(self) -> int:
        return int(self.pending > 0 and self.engine is not None and self.engine.lock.locked())

    def queue_length(self) -> int:
        return self.pending - self.running()

    def health(self) -> tuple[int, dict]:
        if self.engine is None:
            return 503, {"status": "loading", "model": self.config.model_name}
        nodes = self.nodes()
        # a worker that is down is no failure while the others carry on (the engine re-plans);
        # a generation that failed is, until one succeeds (each request first tries to re-admit
        # missing workers, so requests are still taken)
        problem = self.last_error
        engine = self.engine
        body = {"status": "error" if problem else "ok", "model": self.config.model_name,
                "nodes": sum(n["up"] for n in nodes),
                "node_status": {n["node"]: "up" if n["up"] else "down" for n in nodes},
                "sync": engine.sync.algo, "sync_dtype": engine.sync.dtype, "sync_mode": engine.sync.mode,
                "context": engine.ctx_size,
                "queue_length": self.queue_length(), "running": self.running()}
        if problem:
            body["error"] = problem
        if engine.events:
            body["last_event"] = engine.events[-1]  # the cluster's last failure or recovery
        return (503 if problem else 200), body

    def status(self) -> dict:
        """What the chat page's status panel shows, in one poll: /health's figures, every node in
        detail, and the speed of the last answer (never its text: any key holder may poll this)."""
        _code, body = self.health()
        body.pop("node_status", None)  # detailed in "nodes" instead of counted
        body["nodes"] = self.node_details()
        body["max_tokens_limit"] = self.config.max_tokens_limit
        last = self.metrics.last
        body["last_answer"] = None if last is None else {
            "tokens": len(last["tokens"]), "finish_reason": last["finish_reason"],
            "tokens_per_s": last["tokens_per_s"], "prefill_tokens_per_s": last["prefill_tokens_per_s"],
            "ms_per_token": last["ms_per_token"], "bytes_per_token": last["bytes_per_token"]}
        return body

    def node_details(self) -> list[dict]:
        """Each node: name, address (None for the root: this server), share of the FFN rows (the
        unit that --weights divides), up, ms of its last step and RSS. The root has no step figures
        of its own: it gets the last answer's wall time per token and this process's RSS."""
        last = self.metrics.last or {}
        details = []
        for i, node in enumerate(self.nodes()):
            stats = node.get("stats") or {}
            if i == 0:
                ms = last.get("ms_per_token", {}).get("total")
                rss = rss_mb()
            else:
                ms = stats["step_s"] * 1e3 if "step_s" in stats else None
                rss = stats.get("rss_mb")
            details.append({"node": node["node"], "address": node.get("address"), "up": node["up"],
                            "share": node["share"] if node["up"] else 0.0,
                            "ms_per_token": ms, "rss_mb": rss})
        return details

    def require_ready(self):
        if self.runtime is None:
            raise APIError(503, "The model is still loading; retry shortly.", type="server_error", code="model_loading")
        return self.runtime

    # ------------------------------------------------------------------ prompts

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        tokenizer = self.runtime.tokenizer
        if not tokenizer.has_chat_template:
            raise bad_request("This model has no chat template; use /v1/completions.", "messages", "no_chat_template")
        try:
            text = tokenizer.apply_chat_template(messages)
        except ModelError as e:  # the template refused them (roles out of order, ...)
            raise bad_request(f"{str(e)[0].upper()}{str(e)[1:]}.", "messages") from None
        return self._checked(tokenizer.encode(text, add_bos=False, special=True), "messages")

    def completion_prompt(self, prompt) -> list[int]:
        ids = list(prompt) if isinstance(prompt, list) else self.runtime.tokenizer.encode(prompt)
        return self._checked(ids, "prompt")

    def _checked(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad_request("The prompt is empty.", param)
        ctx = self.runtime.engine.ctx_size
        if len(ids) > ctx:
            raise bad_request(f"This model's context holds {ctx} tokens; the prompt has {len(ids)}.", param,
                              "context_length_exceeded")
        return ids

    # ------------------------------------------------------------------ generation

    async def generate(self, request: web.Request, req: GenerationRequest, ids: list[int]) -> web.StreamResponse:
        config = self.config
        if self.pending > config.max_queue:  # the running request + max_queue waiting ones
            raise APIError(429, f"The server is busy: {self.queue_length()} requests are waiting (at most "
                                f"{config.max_queue}). Retry later.", type="rate_limit_exceeded", code="queue_full")
        ctx = self.runtime.engine.ctx_size
        # no max_tokens: until the context is full (the last prompt position still yields one
        # token), within the server's limit
        max_tokens = req.max_tokens or min(config.max_tokens_limit, ctx - len(ids) + 1)
        env = Envelope(req.kind, config.model_name, f"dllama-{__version__}")
        self.pending += 1
        try:
            if req.stream:
                return await self._stream(request, req, ids, max_tokens, env)
            gen = await self.generator.generate(ids, req.params, max_tokens, req.stop)
            self._record(ids, gen)
            if gen.finish_reason == "error":
                raise APIError(503, f"The generation failed after {len(gen.tokens)} tokens: {gen.error}",
                               type="server_error", code="engine_error",
                               extra={"partial_text": gen.text, "completion_tokens": len(gen.tokens)})
            token_ids = (ids, gen.tokens) if req.return_token_ids else None
            return web.json_response(env.response(gen.text, gen.finish_reason, self._usage(ids, gen), token_ids),
                                     dumps=_dumps)
        finally:
            self.pending -= 1

    async def _stream(self, request, req, ids, max_tokens, env: Envelope) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        pieces: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(
            self.generator.generate(ids, req.params, max_tokens, req.stop, on_text=pieces.put_nowait))
        task.add_done_callback(lambda _: pieces.put_nowait(None))  # after the last piece
        usage_field = req.include_usage

        async def send(obj) -> None:
            await resp.write(b"data: " + _dumps(obj).encode() + b"\n\n")

        try:
            if req.kind == "chat":
                await send(env.chunk("", role=True, with_usage_field=usage_field))
            while (piece := await pieces.get()) is not None:
                await send(env.chunk(piece, with_usage_field=usage_field))
            try:
                gen = task.result()
            except Exception as e:
                if not isinstance(e, DllamaError):
                    log.exception("streamed generation failed")
                await send(_error_event(e))
                return resp
            self._record(ids, gen)
            if gen.finish_reason == "error":
                await send(APIError(503, f"The generation failed after {len(gen.tokens)} tokens: {gen.error}",
                                    type="server_error", code="engine_error",
                                    extra={"completion_tokens": len(gen.tokens)}).body())
                return resp  # no [DONE]: the client sees an error, not a short answer
            await send(env.chunk(None, gen.finish_reason, with_usage_field=usage_field))
            if req.include_usage:
                await send(env.usage_chunk(self._usage(ids, gen)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            # the client went away and a write noticed it before aiohttp cancelled this handler
            log.info("%s %s: client disconnected; generation cancelled", request.method, request.path)
            raise _ClientGone(resp) from None
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait([task])  # the step in flight completes, then the engine is free
        return resp

    def _record(self, ids: list[int], gen: Generation) -> None:
        engine = self.runtime.engine
        self.metrics.count_generation(len(ids), len(ids) - gen.prefill_tokens, gen, gen.report(engine))
        if gen.finish_reason == "error":
            self.last_error = gen.error
            log.error("generation failed after %d tokens: %s", len(gen.tokens), gen.error)
        else:
            self.last_error = None

    @staticmethod
    def _usage(ids: list[int], gen: Generation) -> dict:
        return usage(len(ids), len(gen.tokens), len(ids) - gen.prefill_tokens)

    # ------------------------------------------------------------------ metrics

    def metrics_text(self) -> str:
        engine = self.engine
        nodes = self.nodes()
        sync = None if engine is None else engine.sync
        info = {"model": self.config.model_name or "", "version": __version__,
                "sync": sync.algo if sync else "", "sync_dtype": sync.dtype if sync else "",
                "sync_mode": sync.mode if sync else ""}
        families = self.metrics.families(
            ready=engine is not None and self.last_error is None, queue_length=self.queue_length(),
            running=self.running(), nodes=nodes, info=info, events=0 if engine is None else len(engine.events),
            ctx_size=0 if engine is None else engine.ctx_size, kv_cached=0 if engine is None else engine.n_cached,
            connections=self.connections)
        return prom.render(families)

    # ------------------------------------------------------------------ authentication

    def check_key(self, request: web.Request) -> None:
        """With an API key: the request must send `Authorization: Bearer KEY` (as OpenAI's clients do)."""
        if self.key_digest is None:
            return
        scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "You didn't provide an API key. Send it in an Authorization header using Bearer "
                                "auth (Authorization: Bearer YOUR_KEY).", code="invalid_api_key")
        given = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        if not hmac.compare_digest(given, self.key_digest):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


SERVER = web.AppKey("dllama_server", ServerState)


class _ClientGone(Exception):
    """A streaming client disconnected: nothing more to send, count it as 499."""

    def __init__(self, response: web.StreamResponse):
        super().__init__("client disconnected")
        self.response = response


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _error_event(e: Exception) -> dict:
    if isinstance(e, ContextOverflow):
        return bad_request(str(e), code="context_length_exceeded").body()
    if isinstance(e, DllamaError):
        return APIError(500, str(e), type="server_error", code="engine_error").body()
    return APIError(500, "Internal server error (see the server's log).", type="server_error").body()


def _json_error(err: APIError) -> web.Response:
    headers = None
    if err.status in (429, 503):
        headers = {"Retry-After": "1"}
    elif err.status == 401:
        headers = {"WWW-Authenticate": 'Bearer realm="dllama"'}  # RFC 6750
    return web.json_response(err.body(), status=err.status, headers=headers, dumps=_dumps)


class _BodyTimeout(APIError):
    """The body did not arrive in time: answered 408, then the connection is closed."""


async def _read_json(request: web.Request, config: ServerConfig):
    limit = config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request.content_length, limit)
    try:
        # aiohttp stops at client_max_size (a chunked body has no length), but waits for the bytes
        # as long as the client takes: a client that stalls mid-body would hold the request forever
        raw = await asyncio.wait_for(request.read(), config.body_timeout)
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(None, limit) from None
    except asyncio.TimeoutError:
        request.app[SERVER].connections.body_timeouts += 1
        raise _BodyTimeout(408, f"The request body did not arrive within {config.body_timeout:g} s.",
                           code="request_timeout") from None
    return parse_json(raw, config.max_json_depth)


def _too_large(size: int | None, limit: int) -> APIError:
    what = f" ({size} bytes)" if size is not None else ""
    return APIError(413, f"The request body is too large{what}; this server accepts at most {limit} bytes.",
                    code="request_too_large")


# ------------------------------------------------------------------ routes


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[SERVER]
    body = await _read_json(request, state.config)
    state.require_ready()
    req = parse_chat(body, state.config.sampling, state.config.max_tokens_limit)
    return await state.generate(request, req, state.chat_prompt(req.messages))


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[SERVER]
    body = await _read_json(request, state.config)
    rt = state.require_ready()
    req = parse_completion(body, state.config.sampling, state.config.max_tokens_limit, rt.tokenizer.vocab_size)
    return await state.generate(request, req, state.completion_prompt(req.prompt))


def _model_card(state: ServerState) -> dict:
    created = 0
    if state.runtime is not None:
        try:
            created = int(os.path.getmtime(state.runtime.model_path))
        except OSError:
            pass
    return {"id": state.config.model_name, "object": "model", "created": created, "owned_by": "dllama"}


async def list_models(request: web.Request) -> web.Response:
    state = request.app[SERVER]
    return web.json_response({"object": "list", "data": [_model_card(state)]}, dumps=_dumps)


async def get_model(request: web.Request) -> web.Response:
    state = request.app[SERVER]
    name = request.match_info["model"]
    if name != state.config.model_name:
        raise APIError(404, f"The model '{name}' does not exist; this server runs '{state.config.model_name}'.",
                       param="model", code="model_not_found")
    return web.json_response(_model_card(state), dumps=_dumps)


async def health(request: web.Request) -> web.Response:
    status, body = request.app[SERVER].health()
    return web.json_response(body, status=status, dumps=_dumps)


async def metrics(request: web.Request) -> web.Response:
    text = request.app[SERVER].metrics_text()
    return web.Response(body=text.encode(), headers={"Content-Type": prom.CONTENT_TYPE})


async def cluster_status(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVER].status(), dumps=_dumps)


# The chat page: a fixed set of files shipped in the package (no directory is served, so no path
# can reach another file). The page asks for the API key itself, so its files need none.
STATIC_FILES = {"/": ("index.html", "text/html"), "/static/chat.js": ("chat.js", "text/javascript"),
                "/static/chat.css": ("chat.css", "text/css")}
# Defence in depth behind the page's own escaping: only its own script and style ever run.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                                           "img-src 'self' data:; connect-src 'self'; object-src 'none'; "
                                           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                "Cache-Control": "no-cache"}  # revalidate: a new version's page, not a stale one


async def static_file(request: web.Request) -> web.Response:
    name, content_type = STATIC_FILES[request.match_info.route.resource.canonical]
    body = resources.files(__package__).joinpath("static", name).read_bytes()
    return web.Response(body=body, content_type=content_type, charset="utf-8", headers=PAGE_HEADERS)


def _needs_key(request: web.Request) -> bool:
    """Every request but GET /health, which load balancers' probes call, and the chat page's
    files (they hold no data): the API, the metrics and /status (they name the workers'
    addresses) and unknown URLs, so that no spelling of a path (//v1/models, /v1/./models) can
    slip past a list of protected prefixes."""
    return request.match_info.handler not in (health, static_file)


@web.middleware
async def _errors_and_counts(request: web.Request, handler):
    """Every error becomes OpenAI's JSON error body (never a traceback); every request is counted.
    The connection guard learns when a request is in the application (its header timer is off)."""
    state = request.app[SERVER]
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "other"
    status: int | str = 500
    transport = request.transport
    guarded = transport.get_protocol() if transport is not None else None
    if not isinstance(guarded, GuardedProtocol):
        guarded = None  # served some other way (an aiohttp test client, a runner of one's own)
    if guarded is not None:
        guarded.request_started()
    try:
        if _needs_key(request):
            state.check_key(request)
        resp = await handler(request)
        status = resp.status
        return resp
    except _ClientGone as e:
        status = 499
        return e.response
    except _BodyTimeout as e:
        status = e.status
        log.info("%s %s: %s", request.method, request.path, e.message)
        resp = _json_error(e)
        resp.force_close()
        await resp.prepare(request)
        await resp.write_eof()
        # close now: aiohttp would otherwise wait up to its lingering time for the rest of the body
        request.protocol.force_close()
        return resp
    except APIError as e:
        status = e.status
        if e.status >= 500:
            log.warning("%s %s: %d %s", request.method, request.path, e.status, e.message)
        return _json_error(e)
    except web.HTTPException as e:  # aiohttp's own: unknown URL, wrong method, oversized body
        status = e.status
        if e.status == 404:
            message, code = f"Unknown request URL: {request.method} {request.path}.", "unknown_url"
        elif e.status == 405:
            message, code = f"Method {request.method} is not allowed on {request.path}.", "method_not_allowed"
        elif e.status == 413:
            return _json_error(_too_large(None, state.config.max_body_bytes))
        else:
            message, code = e.reason, None
        if e.status < 400:
            raise
        return _json_error(APIError(e.status, message, code=code))
    except asyncio.CancelledError:
        status = 499  # the client went away (aiohttp cancels its handler), or the server stops
        log.info("%s %s: cancelled (client disconnected)", request.method, request.path)
        raise
    except ContextOverflow as e:
        status = 400
        return _json_error(bad_request(str(e), code="context_length_exceeded"))
    except DllamaError as e:
        log.error("%s %s: %s", request.method, request.path, e)
        return _json_error(APIError(500, str(e), type="server_error", code="engine_error"))
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return _json_error(APIError(500, "Internal server error (see the server's log).", type="server_error"))
    finally:
        state.metrics.count_request(endpoint, status)
        if guarded is not None:
            guarded.request_finished()


def make_app(runtime, config: ServerConfig | None = None) -> web.Application:
    """The API as an aiohttp application. `runtime` (a cli.common.Runtime) may be None: the server
    then answers 503 until `attach(app, runtime)`. Serve it with `start_server`, which applies the
    connection limits (another aiohttp runner lacks them, and needs handler_cancellation=True so
    that a client that disconnects cancels its request)."""
    config = config or ServerConfig()
    state = ServerState(config)
    if runtime is not None:
        state.attach(runtime)
    # the limit is enforced again in _read_json with an OpenAI-style 413
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_errors_and_counts])
    app[SERVER] = state
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", cluster_status)
    for path in STATIC_FILES:
        app.router.add_get(path, static_file)
    return app


def attach(app: web.Application, runtime) -> None:
    app[SERVER].attach(runtime)


class HTTPServer:
    """A listening API server: aiohttp's runner (the application and its request handlers) behind
    a socket of our own whose protocol factory is the connection guard. Stop with `cleanup()`."""

    def __init__(self, runner: web.AppRunner, listener: asyncio.AbstractServer, guard: ConnectionGuard):
        self.runner, self.listener, self.guard = runner, listener, guard

    @property
    def addresses(self) -> list:
        return [sock.getsockname() for sock in self.listener.sockets]

    async def cleanup(self) -> None:
        self.listener.close()  # no new connections
        await self.runner.cleanup()  # running requests get SHUTDOWN_TIMEOUT, then are cancelled


async def start_server(app: web.Application, host: str, port: int, *, access_log: bool = True) -> HTTPServer:
    """Listen on host:port (0: a free port; see `bound_port`) with the limits of the app's
    ServerConfig. Stop with `await server.cleanup()`.

    Not a web.TCPSite: its protocol factory is aiohttp's bare one, and the guard must wrap it."""
    config = app[SERVER].config
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT,
                           access_log=logging.getLogger("aiohttp.access") if access_log else None)
    await runner.setup()
    guard = ConnectionGuard(runner.server, header_timeout=config.header_timeout,
                            max_connections=config.max_connections, counts=app[SERVER].connections)
    try:
        listener = await asyncio.get_running_loop().create_server(guard, host, port, backlog=128)
    except BaseException:
        await runner.cleanup()
        raise
    return HTTPServer(runner, listener, guard)


def bound_port(server: HTTPServer) -> int:
    return server.addresses[0][1]
