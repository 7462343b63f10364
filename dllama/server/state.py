"""What the HTTP server knows and does besides routing: its configuration, the engine it drives
(status, health, node details), prompts checked against the context, one generation streamed or
answered whole, and the figures of the last answer."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field, replace

from aiohttp import web

from .. import __version__
from ..node import rss_mb
from ..errors import ModelError
from ..generate import Generator
from ..stream import Generation
from ..sampling import SamplingParams
from ..speculate import can_speculate
from . import metrics as prom
from .connections import ConnectionCounts
from .event_stream import compact_json, stream_events
from .api_errors import APIError, bad_request
from .api_keys import ApiKeys
from .admission import Admission, QueueTimeout, default_queued, default_running
from .json_body import MAX_JSON_DEPTH
from .openai_responses import Envelope, usage
from .openai_schema import OPENAI_SAMPLING, GenerationRequest

log = logging.getLogger("dllama.server")


@dataclass
class ServerConfig:
    model_name: str | None = None  # None: the GGUF file's stem
    max_queue: int = 16  # requests that may wait for a slot (or KV budget) while others generate
    max_tokens_limit: int = 2048  # largest max_tokens a request may ask (and the default's cap)
    max_body_bytes: int = 1 << 20
    sampling: SamplingParams = field(default_factory=lambda: replace(OPENAI_SAMPLING))  # for omitted fields
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # none: no authentication; several: one per client
    header_timeout: float = 10.0  # seconds for a request head to arrive (and a keep-alive connection to idle)
    body_timeout: float = 30.0  # seconds for a request body to arrive
    write_timeout: float = 15.0  # seconds a streamed answer may wait for its client to read
    max_connections: int = 256  # open at once; more are answered 503 and closed
    max_json_depth: int = MAX_JSON_DEPTH
    # per client (admission.py); None: below half of the engine's slots / of max_queue
    max_running_per_client: int | None = None
    max_queued_per_client: int | None = None
    queue_timeout: float = 30.0  # seconds a request may wait to start (its client's turn, a slot, KV budget)
    speculate: str = "off"  # for requests that do not say (speculate.py); a repetition penalty decodes plainly


class ServerState:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.runtime = None  # None while the model loads
        self.generator: Generator | None = None
        self.metrics = prom.Metrics()
        self.pending = 0  # generation requests taken: those generating and those waiting
        self.connections = ConnectionCounts()  # kept by the connection guard of start_server
        self.api_keys = ApiKeys(config.api_keys)
        self.admission: Admission | None = None  # once the engine's slots are known

    def attach(self, runtime) -> None:
        """The engine is ready: start answering generation requests."""
        self.runtime = runtime
        self.generator = Generator(runtime.engine, runtime.tokenizer, runtime.drafter)  # the engine knows its KV cache
        config = self.config
        running = config.max_running_per_client or default_running(runtime.engine.slots)
        queued = config.max_queued_per_client
        self.admission = Admission(running, default_queued(config.max_queue) if queued is None else queued,
                                   config.queue_timeout)
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

    @property
    def batcher(self):
        return None if self.generator is None else self.generator.batcher

    def running(self) -> int:
        return 0 if self.batcher is None else self.batcher.running

    def queue_length(self) -> int:
        """Requests waiting: for a slot or KV budget, or for their client's turn."""
        return 0 if self.batcher is None else self.batcher.queued + self.admission.waiting

    def health(self) -> tuple[int, dict]:
        if self.engine is None:
            return 503, {"status": "loading", "model": self.config.model_name}
        nodes = self.nodes()
        problem = self.problem()
        engine = self.engine
        body = {"status": "error" if problem else "ok", "model": self.config.model_name,
                "nodes": sum(n["up"] for n in nodes),
                "node_status": {n["node"]: "up" if n["up"] else "down" for n in nodes},
                "sync": engine.sync.algo, "sync_dtype": engine.sync.dtype, "sync_mode": engine.sync.mode,
                "context": engine.ctx_size, "max_batch": engine.slots,
                "kv_budget": engine.kv_budget, "kv_used": engine.kv_used,
                "queue_length": self.queue_length(), "running": self.running()}
        if problem:
            body["error"] = problem
        if engine.events:
            body["last_event"] = engine.events[-1]  # the cluster's last failure or recovery
        return (503 if problem else 200), body

    def problem(self) -> str | None:
        """Why the server cannot answer now (None: it can): the cluster's state, never one request's
        outcome (a request that fails is that request's error; anyone could send one). A worker that
        is down is no problem while the others carry on (the engine re-plans onto them)."""
        engine = self.engine
        if engine.failed:  # a cluster that could not recover (--no-recover, or no node left)
            return engine.failed
        if engine.compute.stopped:
            return "the engine's compute thread has stopped"
        return None

    def status(self) -> dict:
        """What the chat page's status panel shows, in one poll: /health's figures, every node in
        detail, and the speed of the last answer (never its text: any key holder may poll this)."""
        _code, body = self.health()
        body.pop("node_status", None)  # detailed in "nodes" instead of counted
        body["nodes"] = self.node_details()
        body["max_tokens_limit"] = self.config.max_tokens_limit
        batcher = self.generator.batcher if self.generator is not None else None
        body["speculation"] = None if batcher is None else {
            "drafted": batcher.drafted, "accepted": batcher.accepted, "verifications": batcher.verifications}
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

    def speculation(self, req: GenerationRequest) -> str:
        """The request's speculate mode: as it asks (true: the server's, else ngram), or the server's
        where its sampling allows (else the same tokens, plainly)."""
        if req.speculate is True:
            return self.config.speculate if self.config.speculate != "off" else "ngram"
        if req.speculate is None:
            return self.config.speculate if can_speculate(req.params) else "off"
        if req.speculate == "draft" and self.runtime.drafter is None:
            raise bad_request("'speculate' \"draft\" needs a server started with --speculate draft:MODEL.",
                              "speculate", "unsupported_value")
        return req.speculate

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
            ids = tokenizer.chat_ids(messages)
        except ModelError as e:  # the template refused them (roles out of order, ...)
            raise bad_request(f"{str(e)[0].upper()}{str(e)[1:]}.", "messages") from None
        return self._checked(ids, "messages")

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
        if self.pending >= self.runtime.engine.slots + config.max_queue:  # every slot taken, the queue full
            raise APIError(429, f"The server is busy: {self.queue_length()} requests are waiting (at most "
                                f"{config.max_queue}). Retry later.", type="rate_limit_exceeded", code="queue_full")
        ctx = self.runtime.engine.ctx_size
        # no max_tokens: until the context is full (the last prompt position still yields one
        # token), within the server's limit
        max_tokens = req.max_tokens or min(config.max_tokens_limit, ctx - len(ids) + 1)
        env = Envelope(req.kind, config.model_name, f"dllama-{__version__}")
        deadline = asyncio.get_running_loop().time() + config.queue_timeout  # to start generating
        self.pending += 1
        try:
            async with self.admission.turn(self.api_keys.client_of(request), deadline):
                pieces: asyncio.Queue = asyncio.Queue()
                started = asyncio.Event()
                speculate = self.speculation(req)
                task = asyncio.ensure_future(self.generator.generate(
                    ids, req.params, max_tokens, req.stop, on_text=pieces.put_nowait if req.stream else None,
                    on_start=started.set, speculate=speculate))
                task.add_done_callback(lambda _: pieces.put_nowait(None))  # after the last piece
                try:
                    await self._until_started(task, started, deadline)
                    if req.stream:
                        return await stream_events(self, request, req, ids, task, pieces, env)
                    gen = await task
                finally:
                    if not task.done():
                        task.cancel()
                        await asyncio.wait([task])  # its slot is freed at the batch's next step
            self.record(ids, gen)
            if gen.finish_reason == "error":
                raise APIError(503, f"The generation failed after {len(gen.tokens)} tokens: {gen.error}",
                               type="server_error", code="engine_error",
                               extra={"partial_text": gen.text, "completion_tokens": len(gen.tokens)})
            token_ids = (ids, gen.tokens) if req.return_token_ids else None
            return web.json_response(env.response(gen.text, gen.finish_reason, self.usage_of(ids, gen), token_ids),
                                     dumps=compact_json)
        finally:
            self.pending -= 1

    async def _until_started(self, task: asyncio.Task, started: asyncio.Event, deadline: float) -> None:
        """Wait until the engine admits the request (a slot and KV budget) by the deadline: a 503
        after it. A request refused before it started (its prompt, say) raises its error here, as an
        HTTP error rather than in a stream."""
        waiter = asyncio.ensure_future(started.wait())
        try:
            await asyncio.wait({task, waiter}, timeout=max(0.0, deadline - asyncio.get_running_loop().time()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if started.is_set():
            return
        if not task.done():
            raise QueueTimeout(self.config.queue_timeout, "for a free slot or KV cache room")
        if task.exception() is not None:
            raise task.exception()

    def record(self, ids: list[int], gen: Generation) -> None:
        engine = self.runtime.engine
        self.metrics.count_generation(len(ids), len(ids) - gen.prefill_tokens, gen, gen.report(engine))
        if gen.finish_reason == "error":
            log.error("generation failed after %d tokens: %s", len(gen.tokens), gen.error)

    @staticmethod
    def usage_of(ids: list[int], gen: Generation) -> dict:
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
            ready=engine is not None and self.problem() is None, queue_length=self.queue_length(),
            running=self.running(), nodes=nodes, info=info, events=0 if engine is None else len(engine.events),
            replans=0 if engine is None else engine.replans,
            ctx_size=0 if engine is None else engine.ctx_size,
            kv_cached=0 if engine is None else sum(len(c) for c in engine.contexts),
            kv_reserved=0 if engine is None else engine.kv_used, kv_budget=0 if engine is None else engine.kv_budget,
            kv_in_use=0 if engine is None else sum(engine.capacities[slot] for slot in engine.in_use or ()),
            batcher=self.batcher, connections=self.connections)
        return prom.render(families)
