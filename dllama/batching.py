"""Continuous batching: every request in flight shares the engine's forward steps.

On a CPU a decode step is bound by reading the weights, and on a cluster each layer's two syncs
cost about the same for one token as for many: B sequences in one step cost little more than one.
The `Batcher` keeps up to `engine.slots` sequences in flight, each in a KV cache slot of its own:

- A request is admitted when a slot is idle and the KV budget can hold it, into the slot whose cache
  holds the longest start of its prompt; a longer start held or about to be computed elsewhere is
  copied, not computed (placement.py).
- Each step carries the next token of every decoding sequence, then prompt tokens of the
  sequences still reading theirs, in order of arrival: while D sequences decode, at most
  max(`prefill_chunk` (64 by default), 256 / D) of them, so a long prompt delays the running
  streams by one short chunk per step instead of freezing them, and requests that arrive while
  few others decode get their first token soon; with nothing decoding, up to a step's limit (256).
- Prefill first: once a request's prompt is to begin, the next step carries prompt tokens alone,
  without the decoding sequences. Its first token then waits for its own prompt, not also for the
  others' next tokens: on a CPU a step costs about its tokens' compute, so those would add ~D
  tokens' worth. Where the engine preempts (one node), "the next step" is now: a step of the
  decoders in flight pauses at its next sync point while the prompt's step runs (`_preempt`), so
  the first token does not wait for most of a step either, and the decoders' next token comes a
  prompt step later, as it would after it. Elsewhere (a cluster) it waits for the step in flight.
  Prompts that arrive during such a step get the next one too, whole, as long as the prompt tokens
  run since the decoders' last step began (a preempted step's own chunk among them) stay within the
  same max(`prefill_chunk`, 256 / D) a mixed step may carry: the decoding streams wait no longer
  than beside a chunk, and pay one step's fixed cost per arrival. (A longer one goes beside them.)
  Measured against merging them (benchmarks/bench_serve.py, sustained load, SmolLM2, 2 threads,
  three runs, 8 users): time to first token p50 18-30% lower, p95 5-20%; the aggregate -8% to +8%,
  within this machine's run-to-run noise. Before a second such step was allowed, the slowest
  first tokens were those of prompts that arrived during another's: they went beside the decoders
  (same benchmark, 8 users, two interleaved pairs of runs: p95 131-132 ms with it, 144-150 without).
- A request leaves when done; one whose caller went away leaves at the next step (the step in
  flight completes: every node stays in step). Its slot stays idle with its tokens for reuse.

Every kernel sums a token's values in one order whatever else the step holds, so each request
gets exactly the tokens it gets alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from .placement import place, take_shared_start
from .engine import Engine, SeqInput
from .errors import DllamaError
from .stream import Generation, Stream
from .speculate import StepCost
from .step import MAX_STEP_TOKENS

log = logging.getLogger("dllama.batching")

PREFILL_CHUNK_WHILE_DECODING = 64  # prompt tokens per step while other sequences decode, at least
PREFILL_DELAY_BUDGET = 256  # ... and up to this many over the number of decoding sequences
# what a step carried, for /metrics: every sequence's next token, prompt tokens alone, or both
STEP_KINDS = ("decode", "prompt", "mixed")


def _internal_error(e: BaseException) -> str:
    return f"internal error: {type(e).__name__}: {e}"


def _error_text(e: Exception) -> str:
    """What a request that failed with e is told: our errors as they are, anything else as a bug."""
    return str(e) if isinstance(e, DllamaError) else _internal_error(e)


class Batcher:
    def __init__(self, engine: Engine, prefill_chunk: int = PREFILL_CHUNK_WHILE_DECODING):
        self.engine = engine
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Stream] = deque()
        self.active: list[Stream] = []  # admitted, in order of arrival
        self.last_used = [0.0] * engine.slots  # when each slot's sequence last ran (eviction order)
        engine.in_use = set()  # a recovery replays only these slots' caches
        self._task: asyncio.Task | None = None
        # figures for /metrics
        self.steps = 0
        self.step_sequences = 0  # summed over steps: sequences per step = step_sequences / steps
        self.step_tokens = 0
        self.last_batch = 0  # sequences in the last step
        # by STEP_KINDS: the steps, their tokens and their seconds (a step paused while another's
        # prompt ran, on one node, without the pause: the two add up to the wall time they took)
        self.kind_steps = dict.fromkeys(STEP_KINDS, 0)
        self.kind_tokens = dict.fromkeys(STEP_KINDS, 0)
        self.kind_seconds = dict.fromkeys(STEP_KINDS, 0.0)
        # speculation: steps' sequences that carried drafts, the tokens drafted and those kept
        self.verifications = self.drafted = self.accepted = 0
        self.drafter = None  # a draft_model.DraftModel, for the requests that speculate with "draft"
        self.step_cost = StepCost()  # of the decoding steps: how many positions auto's steps may carry
        self._alone_tokens = 0  # prompt tokens of the steps without the decoders since they last ran
        self._in_flight: set[Stream] | None = None  # the streams of a step that prompts may preempt
        self._in_flight_prompt = 0  # ... and the prompt tokens it carries beside the decoders
        self._preempting: asyncio.Task | None = None  # what runs such prompts while it is in flight

    @property
    def queued(self) -> int:
        return sum(not s.cancelled for s in self.waiting)

    @property
    def running(self) -> int:
        return len(self.active)

    async def submit(self, stream: Stream) -> Generation:
        """Queue a request; its Generation once done. Cancelling the caller drops it at the next step."""
        self.waiting.append(stream)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        else:
            self._preempt_if_due()
        try:
            return await asyncio.shield(stream.done)
        except asyncio.CancelledError:
            stream.cancelled = True
            raise

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        try:
            await self._loop()
        except BaseException as e:  # a bug of ours (or the loop closing): no request may wait for ever
            if not isinstance(e, asyncio.CancelledError):
                log.exception("the batching loop failed")
            if self._preempting is not None:
                self._preempting.cancel()
            for s in self.active + list(self.waiting):
                s.finish(self.engine.stats, "error", _internal_error(e))
            self.active.clear()
            self.waiting.clear()
            self.engine.in_use.clear()
            raise

    async def _loop(self) -> None:
        while self.waiting or self.active:
            await self._admit()
            for s in [s for s in self.active if s.cancelled]:
                self._leave(s)
            if not self.active:
                await asyncio.sleep(0)  # (only what _admit failed or dropped: the loop ends or admits next)
                continue
            await self._draft_with_model()
            streams, seqs, fed = self._plan()
            if not seqs:  # (every one waits for another's prompt start: cannot last, that one runs)
                await asyncio.sleep(0)
                continue
            # a step of the decoders may be preempted by prompts that arrive meanwhile (one node)
            if self.engine.preempts and any(s.decoding for s in streams):
                self._in_flight = set(streams)
                self._in_flight_prompt = sum(n for s, n in zip(streams, fed) if not s.decoding)
            try:
                await self._run_step(streams, seqs, fed)
            finally:
                self._in_flight = None
            if self._preempting is not None:  # (a preempting step still in flight: it finishes first)
                await self._preempting
                self._preempting = None
            # the loop's turn between steps, which need not suspend (an engine computing on this loop):
            # a Ctrl-C's cancellation, a caller gone, a new request are seen before the next one
            await asyncio.sleep(0)

    def _preempt_if_due(self) -> None:
        """A request arrived: while a step of the decoders is in flight, its prompt may go now."""
        if self._in_flight is not None and (self._preempting is None or self._preempting.done()):
            self._preempting = asyncio.ensure_future(self._preempt())

    async def _preempt(self) -> None:
        """Prompts that arrive during a step of the decoders run in steps of their own that
        preempt it (the engine pauses it at its next sync point), as long as it is in flight and
        the decoders' wait stays within the delay a step beside them may carry (see _plan). A bug
        here reaches the loop, which awaits this before its next step."""
        while self._in_flight is not None:
            await self._admit()
            streams, seqs, fed = self._plan(self._in_flight)
            if not seqs:
                break
            await self._run_step(streams, seqs, fed, preempt=True)

    async def _run_step(self, streams: list[Stream], seqs: list[SeqInput], fed: list[int],
                        preempt: bool = False) -> None:
        """One step of the engine, and what it gives each stream."""
        engine = self.engine
        decoding = sum(s.decoding for s in streams)
        kind = "decode" if decoding == len(streams) else "mixed" if decoding else "prompt"
        started, paused = time.perf_counter(), engine.paused_s
        try:
            results = await engine.step(seqs, preempt=preempt)
        except Exception as e:  # the step failed for all of them: each keeps what it produced
            if not isinstance(e, DllamaError):
                log.exception("a batched step failed")
            sources = engine.copy_sources
            for s in streams:
                s.finish(engine.stats, "error", _error_text(e))
                self._leave(s)
                if s.slot not in sources:  # (a pending copy still reads it)
                    engine.release(s.slot)  # its cache's state is unknown after a failure
            return
        self.steps += 1
        self.step_sequences += len(seqs)
        self.step_tokens += sum(len(q.tokens) for q in seqs)
        self.last_batch = len(seqs)
        self.kind_steps[kind] += 1
        self.kind_tokens[kind] += sum(len(q.tokens) for q in seqs)
        # (a preempting step's own time is not a pause of its own: only the step it preempted waited)
        seconds = time.perf_counter() - started - (0.0 if preempt else engine.paused_s - paused)
        self.kind_seconds[kind] += seconds
        if kind == "decode":
            self.step_cost.add(sum(len(q.tokens) for q in seqs), seconds)
        for s, q, n, summaries in zip(streams, seqs, fed, results):
            del s.pending[:n]
            self.last_used[s.slot] = time.monotonic()
            drafts = q.tokens[n:]  # (a decoding stream's, verified after its pending token)
            try:
                held = len(engine.contexts[s.slot])
                if drafts:
                    done, kept = s.take_drafted(summaries, drafts, held, engine.ctx_size, engine.stats)
                    engine.rewind(held - len(drafts) + kept, s.slot)  # the refused drafts are no part of it
                    self.verifications += 1
                    self.drafted += len(drafts)
                    self.accepted += kept
                else:
                    done = q.want_logits and s.take(summaries[-1], held >= engine.ctx_size, engine.stats)
            except Exception as e:  # its sampler or its caller's callback: that request alone fails
                log.exception("a request failed after a step")
                done = s.finish(engine.stats, "error", _internal_error(e))
            if done:
                self._leave(s)

    def _leave(self, s: Stream) -> None:
        self.active.remove(s)
        self.engine.in_use.discard(s.slot)
        self.last_used[s.slot] = time.monotonic()

    def _plan(self, in_flight: set[Stream] | None = None) -> tuple[list[Stream], list[SeqInput], list[int]]:
        """This step's sequences: every decoding one's next token, then prompt chunks; or, when a
        prompt is about to begin (prefill first), prompt tokens alone, within the decoders' delay.
        in_flight: the streams of a step of the decoders that this one would preempt: then prompts
        about to begin alone, within what the decoders may still wait, or nothing."""
        contexts = self.engine.contexts
        decoding = [s for s in self.active if s.decoding]
        streams, seqs, fed = [], [], []
        # prompt tokens delay every decoding stream's next token: a few streams can wait for more
        delay = max(self.prefill_chunk, PREFILL_DELAY_BUDGET // len(decoding)) if decoding else 0
        # prefill first: a prompt about to begin (nothing of it computed yet) goes without the decoders;
        # so do prompts that arrive meanwhile, whole, while the decoders' wait stays within that delay
        busy = in_flight or set()
        starting = [s for s in self.active if not s.decoding and s.share_from is None and not s.cancelled
                    and s.out.prefill_tokens == len(s.pending) and s not in busy]
        # prompt tokens the decoders wait for since their last step began (a preempted one's own too)
        waited = self._alone_tokens + (self._in_flight_prompt if in_flight is not None else 0)
        left = delay - waited
        shortest = min((len(s.pending) for s in starting), default=0)
        alone = bool(starting) and left > 0 and (not waited or shortest <= left)
        later = alone and waited > 0  # (only whole starting prompts: each gets its first token)
        if in_flight is not None and not alone:
            return streams, seqs, fed
        if not alone:
            self._alone_tokens = 0
        # what drafts may add to the step: within its limit (every decoder's pending token first), and
        # auto's within the positions worth their cost
        room_left = MAX_STEP_TOKENS - len(decoding)
        spare = self.step_cost.latency_bound_positions() - len(decoding)
        for s in [] if alone else decoding:
            auto = s.speculate == "auto"
            drafts = s.draft(min(self._draft_room(s), room_left, max(spare, 0) if auto else room_left))
            room_left -= len(drafts)
            spare -= len(drafts) if auto else 0
            streams.append(s)
            seqs.append(SeqInput(s.slot, s.pending + drafts, s.params, s.recent(contexts[s.slot], 1),
                                 all_logits=bool(drafts)))
            fed.append(1)
        room = MAX_STEP_TOKENS - sum(len(q.tokens) for q in seqs)
        prefill = min(room, left if alone else delay) if decoding else room  # (all of it, beside the decoders)
        planned = {}  # the prompt tokens each stream computes in this step
        for s in self.active:
            if s.decoding or prefill <= 0 or s in busy:
                continue
            if (later or in_flight is not None) and s not in starting:  # only prompts about to begin,
                continue
            if later and len(s.pending) > prefill:  # ... and after a step without the decoders, whole
                continue
            if s.share_from is not None and not take_shared_start(self.engine, self.active, s, planned):
                continue
            n = min(len(s.pending), prefill)
            last = n == len(s.pending)
            streams.append(s)
            seqs.append(SeqInput(s.slot, s.pending[:n], s.params, s.recent(contexts[s.slot], n) if last else [],
                                 want_logits=last))
            fed.append(n)
            planned[s] = s.pending[:n]
            prefill -= n
        if alone:
            self._alone_tokens += sum(fed)
        return streams, seqs, fed

    def _draft_room(self, s: Stream) -> int:
        """Positions a decoding stream's cache and the context hold past its pending token."""
        return min(self.engine.capacities[s.slot], self.engine.ctx_size) - len(self.engine.contexts[s.slot]) - 1

    async def _draft_with_model(self) -> None:
        """draft:MODEL's drafts for the decoding streams that use it and have none for their answer
        as it is (they stay valid through steps that do not carry them: prompts alone)."""
        wanting = [(s, k) for s in self.active if s.decoding and s.speculate == "draft" and not s.cancelled
                   and s.model_drafts_at != len(s.out.tokens) and (k := s.drafts_wanted(self._draft_room(s)))]
        if not wanting:
            return
        try:
            drafts = await self.drafter.draft([(s.slot, s.prompt + s.out.tokens, k) for s, k in wanting])
        except Exception as e:  # a bug of ours: those requests fail, as after a step
            log.exception("drafting failed")
            for s, _ in wanting:
                s.finish(self.engine.stats, "error", _error_text(e))
                self._leave(s)
            return
        for (s, _), tokens in zip(wanting, drafts):
            s.model_drafts, s.model_drafts_at = tokens, len(s.out.tokens)

    # ------------------------------------------------------------------ admission

    async def _admit(self) -> None:
        admitted = []
        while self.waiting and len(self.active) < self.engine.slots:
            s = self.waiting[0]
            if s.cancelled:
                self.waiting.popleft()
                continue
            if not place(self.engine, self.active, self.last_used, s):
                break  # the KV budget is held by running sequences: wait for one to finish
            self.waiting.popleft()
            self.active.append(s)
            self.engine.in_use.add(s.slot)
            admitted.append(s)
        if admitted:
            try:  # a cluster may re-admit workers that came back (between steps, never during one)
                await self.engine.on_request()
            except Exception as e:
                if not isinstance(e, DllamaError):
                    log.exception("re-admitting workers failed")
                for s in admitted:
                    s.finish(self.engine.stats, "error", _error_text(e))
                    self._leave(s)
