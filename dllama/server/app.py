"""The OpenAI-compatible HTTP API on aiohttp: routes, the request queue, SSE streaming, errors.

Up to the engine's slots generate at once (continuous batching); up to `max_queue` more wait and
any beyond get a 429. Each client (its address, or its API key where there are several) has its
share of both (admission.py), and a request waits at most `queue_timeout` to start (then 503). A
client that disconnects cancels its request: the server runs with aiohttp's handler cancellation,
so the handler (waiting in the queue or generating) is cancelled and the Generator stops between
two steps; one that stops reading a stream is dropped after `write_timeout`.

Against hostile clients: a request head must arrive within `header_timeout` and a body within
`body_timeout`, at most `max_connections` are open at once (connections.py), a JSON body may nest
`max_json_depth` deep and hold no NaN or infinity (json_body.py), and with `api_keys` every
request but /health and the chat page's files must carry one as a bearer token.

The chat page (static/, served at /) talks to the same API as any client: it streams from
/v1/chat/completions and polls /status for its panel.
"""

from __future__ import annotations

import asyncio
import logging
import os
from importlib import resources

from aiohttp import web

from ..errors import ContextOverflow, DllamaError
from . import metrics as prom
from .connections import ConnectionGuard, GuardedProtocol
from .api_errors import APIError, bad_request
from .json_body import parse_json
from .openai_schema import parse_chat, parse_completion
from .event_stream import ClientGone, compact_json
from .state import ServerConfig, ServerState

log = logging.getLogger("dllama.server")

SHUTDOWN_TIMEOUT = 3.0  # seconds running requests get to finish when the server stops


SERVER = web.AppKey("dllama_server", ServerState)


def _json_error(err: APIError) -> web.Response:
    headers = None
    if err.retry_after is not None:
        headers = {"Retry-After": str(err.retry_after)}
    elif err.status == 401:
        headers = {"WWW-Authenticate": 'Bearer realm="dllama"'}  # RFC 6750
    return web.json_response(err.body(), status=err.status, headers=headers, dumps=compact_json)


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
    return web.json_response({"object": "list", "data": [_model_card(state)]}, dumps=compact_json)


async def get_model(request: web.Request) -> web.Response:
    state = request.app[SERVER]
    name = request.match_info["model"]
    if name != state.config.model_name:
        raise APIError(404, f"The model '{name}' does not exist; this server runs '{state.config.model_name}'.",
                       param="model", code="model_not_found")
    return web.json_response(_model_card(state), dumps=compact_json)


async def health(request: web.Request) -> web.Response:
    status, body = request.app[SERVER].health()
    return web.json_response(body, status=status, dumps=compact_json)


async def metrics(request: web.Request) -> web.Response:
    text = request.app[SERVER].metrics_text()
    return web.Response(body=text.encode(), headers={"Content-Type": prom.CONTENT_TYPE})


async def cluster_status(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVER].status(), dumps=compact_json)


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
            state.api_keys.check(request)
        resp = await handler(request)
        status = resp.status
        return resp
    except ClientGone as e:
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
    except ConnectionResetError:  # the client went away while its body was being read
        status = 499
        log.info("%s %s: client disconnected mid-request", request.method, request.path)
        resp = web.Response(status=499)
        resp.force_close()
        return resp
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
