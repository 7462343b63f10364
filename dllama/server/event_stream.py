"""One generation streamed as server-sent events: OpenAI's chunks as the text comes, the finish
and usage chunks, `[DONE]`; an error event (after the text so far) where it fails; a client that
stops reading or goes away ends it (its slot is freed at the batch's next step)."""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from ..errors import ContextOverflow, DllamaError
from .api_errors import APIError, bad_request
from .openai_responses import Envelope
from .openai_schema import GenerationRequest

log = logging.getLogger("dllama.server")


class ClientGone(Exception):
    """A streaming client disconnected: nothing more to send, count it as 499."""

    def __init__(self, response: web.StreamResponse):
        super().__init__("client disconnected")
        self.response = response


def compact_json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _error_event(e: Exception) -> dict:
    if isinstance(e, ContextOverflow):
        return bad_request(str(e), code="context_length_exceeded").body()
    if isinstance(e, DllamaError):
        return APIError(500, str(e), type="server_error", code="engine_error").body()
    return APIError(500, "Internal server error (see the server's log).", type="server_error").body()


async def stream_events(state, request: web.Request, req: GenerationRequest, ids: list[int], task: asyncio.Task,
                        pieces: asyncio.Queue, env: Envelope) -> web.StreamResponse:
    """The answer of `task` (a generation of `state`, the ServerState) as OpenAI's chunks, each piece of
    text as `pieces` has it; what it produced is recorded, and a failure mid-answer ends the stream
    with an error event after the text so far."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    usage_field = req.include_usage
    write_timeout = state.config.write_timeout

    async def write(data: bytes) -> None:
        # a client that stops reading fills the socket's buffers, and then a write waits: for
        # write_timeout at most, not for the rest of the answer with its slot held
        await asyncio.wait_for(resp.write(data), write_timeout)

    async def send(obj) -> None:
        await write(b"data: " + compact_json(obj).encode() + b"\n\n")

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
        state.record(ids, gen)
        if gen.finish_reason == "error":
            await send(APIError(503, f"The generation failed after {len(gen.tokens)} tokens: {gen.error}",
                                type="server_error", code="engine_error",
                                extra={"completion_tokens": len(gen.tokens)}).body())
            return resp  # no [DONE]: the client sees an error, not a short answer
        await send(env.chunk(None, gen.finish_reason, with_usage_field=usage_field))
        if req.include_usage:
            await send(env.usage_chunk(state.usage_of(ids, gen)))
        await write(b"data: [DONE]\n\n")
        await asyncio.wait_for(resp.write_eof(), write_timeout)
    except asyncio.TimeoutError:
        state.connections.write_timeouts += 1
        log.info("%s %s: the client read nothing for %g s; generation cancelled", request.method, request.path,
                 write_timeout)
        if request.transport is not None:
            request.transport.abort()  # what it has not read is dropped with the connection
        raise ClientGone(resp) from None
    except ConnectionResetError:
        # the client went away and a write noticed it before aiohttp cancelled this handler
        log.info("%s %s: client disconnected; generation cancelled", request.method, request.path)
        raise ClientGone(resp) from None
    return resp
