"""Continuous batching (dllama.batching): many requests share each forward step, and every answer
is exactly the answer the request gets alone, in the engine and through the real server, on one
node and on a cluster that loses a worker mid-batch; a client that goes away frees its slot; the
KV budget makes requests wait."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dllama.batching import PREFILL_CHUNK_WHILE_DECODING, PREFILL_DELAY_BUDGET, STEP_KINDS
from dllama.cli.common import open_runtime
from dllama.engine import LocalEngine, SeqInput
from dllama.generate import Generator
from dllama.stream import _common_prefix
from dllama.kv_cache import bytes_per_position
from dllama.plan import default_kv_budget
from dllama.sampling import SamplingParams
from dllama.server import ServerConfig, make_app

from .server_helpers import RawStream, ServerThread, metrics, post, wait_until

GREEDY = SamplingParams(temperature=0.0)
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count from one to five.",
             "What do bees make?", "Say hello in Spanish.", "What is two plus two?", "Name a planet.",
             "What is the opposite of hot?"]
LONG_ANSWER = "Write a long story about a dragon who learns to fly."


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return tokenizer.encode(text, add_bos=False, special=True)


def wire(summaries) -> list:
    return [[s.to_wire() for s in per_node] for per_node in summaries]


class RecordedSteps(list):
    """engine.step wrapped: each step's entries, (slot, tokens, whether the slot had its logits in an
    earlier step: it decodes), appended as the step starts; `reached(n)` returns once n have started."""

    def __init__(self, engine):
        super().__init__()
        answered = set()
        self._started = asyncio.Event()
        self.preempting = []  # indices of the steps asked to preempt the one in flight
        step = engine.step

        async def recording(seqs, preempt=False):
            if preempt:
                self.preempting.append(len(self))
            self.append([(s.slot, len(s.tokens), s.slot in answered) for s in seqs])
            answered.update(s.slot for s in seqs if s.want_logits)
            self._started.set()
            return await step(seqs, preempt=preempt)

        engine.step = recording

    async def reached(self, n_steps: int) -> None:
        while len(self) < n_steps:
            self._started.clear()
            await self._started.wait()


# ------------------------------------------------------------------ the engine


async def test_a_step_of_several_sequences_gives_each_its_alone_logits(gguf_model, tokenizer):
    """Engine.step with sequences in several slots, prefill chunks beside decode tokens: every
    summary (top logits and their values) is the one the sequence gets fed alone."""
    a, b, c = (chat_ids(tokenizer, q) for q in QUESTIONS[:3])
    alone = LocalEngine(gguf_model, 256)
    expected = []
    for prompt in (a, b, c):
        alone.release(0)
        expected.append(wire(await alone.feed(prompt, GREEDY, targets=prompt[1:] + [0])))
    engine = LocalEngine(gguf_model, 256, slots=3)
    for slot, prompt in enumerate((a, b, c)):
        engine.reserve(slot, len(prompt))
    got = [[], [], []]
    # a: 5 tokens then one at a time; b: 2 chunks; c: joins on the third step, all at once
    plan = [[(0, 5), (1, 11)], [(0, 1), (1, len(b) - 11)], [(0, 1), (2, len(c))]]
    at = [0, 0, 0]
    steps = plan + [[(0, 1)]] * (len(a) - 7)
    for step in steps:
        seqs = []
        for slot, n in step:
            prompt = (a, b, c)[slot]
            chunk, targets = prompt[at[slot]:at[slot] + n], (prompt[1:] + [0])[at[slot]:at[slot] + n]
            seqs.append(SeqInput(slot, chunk, GREEDY, targets=targets))
            at[slot] += n
        for (slot, _n), summaries in zip(step, await engine.step(seqs)):
            got[slot] += wire(summaries)
    assert at == [len(a), len(b), len(c)]
    assert got == expected


async def test_batched_requests_get_exactly_their_alone_answers(gguf_model, tokenizer):
    """Eight requests (greedy, sampled with a seed, with a repetition penalty, a stop string),
    arriving together and while others decode: each gets the tokens it gets alone."""
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0.0, repeat_penalty=1.3),
              GREEDY, SamplingParams(temperature=1.0, top_k=5, seed=11), GREEDY, GREEDY, GREEDY]
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    prompts[5] = chat_ids(tokenizer, "Tell me a story. " * 30)  # a long prompt: read in chunks beside the others
    stops = [[], [], [], ["."], [], [], [], []]
    alone_engine = LocalEngine(gguf_model, 512)
    alone = []
    for p, prm, stop in zip(prompts, params, stops):
        alone_engine.release(0)
        alone.append(await Generator(alone_engine, tokenizer).generate(p, prm, 20, stop))

    engine = LocalEngine(gguf_model, 512, slots=8)
    steps = RecordedSteps(engine)
    generator = Generator(engine, tokenizer)

    async def after(i, n_steps):  # joins once the batch has run n_steps
        await steps.reached(n_steps)
        return await generator.generate(prompts[i], params[i], 20, stops[i])

    batched = await asyncio.gather(*(after(i, n) for i, n in enumerate([0, 0, 0, 0, 2, 3, 5, 8])))
    for one, many in zip(alone, batched):
        assert (many.tokens, many.text, many.finish_reason) == (one.tokens, one.text, one.finish_reason)
    # all but the first took the shared system prompt's keys and values from another slot, those
    # that came with it in the step that computed it: the four started together
    system = _common_prefix(prompts[0], prompts[1])
    assert all(g.prefill_tokens <= len(p) - system for g, p in zip(batched[1:], prompts[1:]))
    first = {slot: n for slot, n, _decoding in steps[0]}
    assert sorted(first) == [0, 1, 2, 3] and first[0] == len(prompts[0]), steps[0]
    assert all(first[i] <= len(prompts[i]) - system for i in (1, 2, 3)), steps[0]
    assert max(len(s) for s in steps) >= 5, steps  # they did share steps
    chunked = 0
    for s in steps:  # while D sequences decode, prompts come in chunks of max(64, 256 / D) tokens in all
        decoding = sum(n == 1 for _slot, n, _decoding in s)
        if decoding:
            prompt_tokens = sum(n for _slot, n, _decoding in s if n > 1)
            assert prompt_tokens <= max(PREFILL_CHUNK_WHILE_DECODING, PREFILL_DELAY_BUDGET // decoding), s
            chunked += prompt_tokens == PREFILL_CHUNK_WHILE_DECODING
    assert chunked >= 2, steps  # the long prompt's, read beside 4 or more decoding sequences


async def test_a_prompt_that_arrives_while_others_decode_runs_first(gguf_model, tokenizer):
    """Prefill first: a request that arrives while others decode gets a step of prompt tokens
    without their next tokens; so does one that arrives during such a step, while the prompt tokens
    run since the decoding ones' last step stay within what a step beside them may carry
    (max(64, 256 / D)): their wait is bounded however the arrivals follow each other. Every answer
    is the one it gets alone."""
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS[:4]]
    alone_engine = LocalEngine(gguf_model, 256)
    alone = []
    for p in prompts:
        alone_engine.release(0)
        alone.append((await Generator(alone_engine, tokenizer).generate(p, GREEDY, 12)).tokens)

    engine = LocalEngine(gguf_model, 256, slots=4)
    steps = RecordedSteps(engine)
    generator = Generator(engine, tokenizer)

    async def after(i, n_steps):
        await steps.reached(n_steps)
        return await generator.generate(prompts[i], GREEDY, 12)

    batched = await asyncio.gather(*(after(i, n) for i, n in enumerate([0, 3, 4, 5])))  # arrivals step after step
    assert [g.tokens for g in batched] == alone
    first_steps = {}  # slot -> index of the first step that carries it
    for k, entries in enumerate(steps):
        for slot, _n, _decoding in entries:
            first_steps.setdefault(slot, k)
    last_step = {slot: max(k for k, e in enumerate(steps) if any(x[0] == slot for x in e)) for slot in first_steps}

    def decodes(k: int) -> bool:
        return any(decoding for _slot, _n, decoding in steps[k])

    def someone_decodes_across(k: int) -> bool:  # a slot that has its logits before step k and runs after it
        return any(first_steps[slot] < k < last_step[slot] and any(x[0] == slot and x[2] for e in steps[:k] for x in e)
                   for slot in first_steps)

    alone_steps = [k for k in sorted(first_steps.values()) if k > 0 and not decodes(k)]
    assert alone_steps, steps  # some arrival ran its prompt without the decoding sequences
    for k in sorted(first_steps.values())[1:]:
        assert not decodes(k) or not decodes(k - 1), (k, steps)  # alone, or right after a step that was
    waits = []  # runs of steps without the decoding sequences, while some wait across them
    for k in range(1, len(steps)):
        if someone_decodes_across(k) and not decodes(k):
            if not waits or waits[-1][-1] != k - 1:
                waits.append([])
            waits[-1].append(k)
    for run in waits:
        decoding = len({slot for slot in first_steps if any(x[0] == slot and x[2] for e in steps[:run[0]] for x in e)
                        and last_step[slot] > run[-1]})
        prompt_tokens = sum(n for k in run for _slot, n, _decoding in steps[k])
        assert prompt_tokens <= max(PREFILL_CHUNK_WHILE_DECODING, PREFILL_DELAY_BUDGET // decoding), (run, steps)
        for k in run[1:]:  # a later one for prompts that arrived meanwhile, whole: they decode after the run
            for slot, _n, _decoding in steps[k]:
                assert first_steps[slot] == k and any(x[0] == slot and x[2] for x in steps[run[-1] + 1]), (k, steps)
    assert max(map(len, waits)) >= 2, steps  # arrivals during a prompt's step went next, not beside the decoders
    # on one node an arrival's step preempts the decoders' step in flight (the engine's own test
    # checks that it runs inside it): only prompts about to begin, without the decoders
    assert steps.preempting, steps
    for k in steps.preempting:
        assert not decodes(k) and all(first_steps[slot] == k for slot, _n, _decoding in steps[k]), (k, steps)


async def test_the_steps_are_counted_by_what_they_carried(gguf_model, tokenizer):
    """/metrics' steps by kind (decode, prompt, mixed): arrivals while others decode give each
    kind; the batcher counts every step and token under the kind the step carried, and their
    seconds add up to the wall time they took, a step preempted by another's prompt without its
    pause (the preempting step counts that time)."""
    engine = LocalEngine(gguf_model, 512, slots=4)
    steps = RecordedSteps(engine)
    generator = Generator(engine, tokenizer)
    long_prompt = tokenizer.encode(" ".join(["the quick brown fox jumps over the lazy dog"] * 12))
    assert len(long_prompt) > PREFILL_CHUNK_WHILE_DECODING  # (goes beside the decoders: a mixed step)

    async def after(prompt, n_steps, max_tokens):
        await steps.reached(n_steps)
        return await generator.generate(prompt, GREEDY, max_tokens)

    started = time.perf_counter()
    await asyncio.gather(after(chat_ids(tokenizer, QUESTIONS[0]), 0, 16), after(chat_ids(tokenizer, QUESTIONS[1]), 3, 12),
                         after(chat_ids(tokenizer, QUESTIONS[2]), 4, 12), after(long_prompt, 6, 4))
    wall = time.perf_counter() - started
    expected_steps, expected_tokens = dict.fromkeys(STEP_KINDS, 0), dict.fromkeys(STEP_KINDS, 0)
    for entries in steps:
        decoding = sum(d for _slot, _n, d in entries)
        kind = "decode" if decoding == len(entries) else "mixed" if decoding else "prompt"
        expected_steps[kind] += 1
        expected_tokens[kind] += sum(n for _slot, n, _d in entries)
    batcher = engine.batcher
    assert batcher.kind_steps == expected_steps and batcher.kind_tokens == expected_tokens, steps
    assert all(expected_steps.values()), steps  # each kind ran
    assert all(batcher.kind_seconds[k] > 0 for k in STEP_KINDS), batcher.kind_seconds
    assert steps.preempting and engine.paused_s > 0, steps  # a step waited for a preempting one...
    # ... and counts without that wait: the kinds' seconds are the wall time the steps took (busy back
    # to back here), give or take a preempting step's own wait for the next sync point, not its pause
    # twice (the pause is ~20% of the wall time here)
    assert sum(batcher.kind_seconds.values()) < wall + engine.paused_s / 2, (batcher.kind_seconds, wall)
    await engine.close()


async def test_a_later_prompt_step_takes_only_whole_prompts(gguf_model, tokenizer):
    """While a prompt runs without the decoding sequences, a long prompt and then a short one
    arrive: the next step without them carries the short one whole (its first token), and the long
    one goes beside them in chunks; it does not take that step's room and leave both unanswered."""
    engine = LocalEngine(gguf_model, 512, slots=7)
    steps = RecordedSteps(engine)
    generator = Generator(engine, tokenizer)
    texts = ["One two three", "Red green blue", "North south east", "Spring summer autumn", "Cats and dogs"]
    short = [tokenizer.encode(t) for t in texts]
    long_prompt = tokenizer.encode(" ".join(["the quick brown fox jumps over the lazy dog"] * 12))
    assert len(long_prompt) > PREFILL_CHUNK_WHILE_DECODING

    async def after(prompt, n_steps, max_tokens):
        await steps.reached(n_steps)
        return await generator.generate(prompt, GREEDY, max_tokens)

    last = tokenizer.encode("Blue sky")
    await asyncio.gather(*(after(p, 0, 24) for p in short[:4]),  # four decode
                         after(short[4], 3, 4),  # its prompt goes alone in step 3
                         after(long_prompt, 4, 2), after(last, 4, 2))  # both during step 3, the long one first
    long_slot, last_slot = (next(i for i, c in enumerate(engine.contexts) if c[:len(p)] == p)
                            for p in (long_prompt, last))
    first = {}  # slot -> index of its first step
    for k, entries in enumerate(steps):
        for slot, _n, _decoding in entries:
            first.setdefault(slot, k)
    assert not any(decoding for _slot, _n, decoding in steps[3]), steps[:6]
    assert [slot for slot, _n, _decoding in steps[4]] == [last_slot], steps[:6]  # whole, still without them
    assert any(decoding for _slot, _n, decoding in steps[5]) and first[long_slot] == 5, steps[:6]  # beside them


async def test_a_conversation_continues_in_its_slot(gguf_model, tokenizer):
    """A request that extends an earlier one (its next turn) takes the slot that holds it and
    computes only its new tokens, while another conversation holds the other slot."""
    engine = LocalEngine(gguf_model, 512, slots=2)
    generator = Generator(engine, tokenizer)
    first = chat_ids(tokenizer, QUESTIONS[0])
    other = chat_ids(tokenizer, QUESTIONS[1])
    a, b = await asyncio.gather(generator.generate(first, GREEDY, 8), generator.generate(other, GREEDY, 8))
    follow_up = first + a.tokens + tokenizer.encode(" And of Spain?", add_bos=False)
    again = await generator.generate(follow_up, GREEDY, 8)
    assert again.prefill_tokens <= len(follow_up) - len(first) - len(a.tokens) + 1
    alone = LocalEngine(gguf_model, 512)
    assert again.tokens == (await Generator(alone, tokenizer).generate(follow_up, GREEDY, 8)).tokens


# ------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def batch_server(model_path):
    """The API over a 1-node engine of 4 slots and a KV budget of 2 x 256 tokens."""
    thread = ServerThread()
    rt = thread.run(open_runtime({"model": model_path, "ctx_size": 256, "threads": 1, "max_batch": 4,
                                  "kv_budget": 512}, quiet=True))
    url = thread.serve(make_app(rt, ServerConfig(max_queue=4, max_running_per_client=4)))
    yield thread, rt, url
    thread.close(rt.close)


def _body(question: str, max_tokens: int, **more) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **more}


def test_the_kv_budget_makes_a_request_wait_its_turn(batch_server):
    """Requests reserve prompt + max_tokens: two of ~220 positions fill the budget of 512, so a
    third waits in the queue, and a small one behind it too (first come, first served), until
    one finishes; then every answer is its alone answer."""
    thread, rt, url = batch_server
    asks = [(QUESTIONS[0], 200), (QUESTIONS[1], 200), (QUESTIONS[2], 200), (QUESTIONS[3], 4)]
    alone = [post(url, "/v1/chat/completions", _body(q, n))[2] for q, n in asks]

    def counts():
        m = metrics(url)
        return m[("dllama_requests_running", ())], m[("dllama_queue_length", ())]

    with ThreadPoolExecutor(4) as pool:
        with thread.holding(rt.engine) as gate:
            sent = []
            for i, (q, n) in enumerate(asks):
                sent.append(pool.submit(post, url, "/v1/chat/completions", _body(q, n)))
                if i:  # it waits (for the step in flight, then for budget); a step boundary: admission looks again
                    queued = 1 if i == 1 else i - 1
                    assert wait_until(lambda: counts()[1] == queued, 30), (i, counts())
                    gate.allow(1)
                expected = [(1, 0), (2, 0), (2, 1), (2, 2)][i]
                assert wait_until(lambda: counts() == expected and gate.passed == i, 30), (i, counts())
            m = metrics(url)
            assert m[("dllama_kv_cache_reserved_tokens", ())] == m[("dllama_kv_cache_budget_tokens", ())] == 512
        results = [f.result() for f in sent]
    for (status, _h, body), expected in zip(results, alone):
        assert status == 200
        assert body["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]


def test_a_client_that_goes_away_frees_its_slot(batch_server):
    """A streaming client that hangs up mid-answer leaves the batch at the next step (the step in
    flight completes), long before its max_tokens; the request beside it is unchanged."""
    thread, rt, url = batch_server
    expected = post(url, "/v1/chat/completions", _body(QUESTIONS[4], 24))[2]["choices"][0]["token_ids"]
    with ThreadPoolExecutor(1) as pool:
        with thread.holding(rt.engine) as gate:
            leaving = RawStream(url, "/v1/chat/completions", {**_body(LONG_ANSWER, 200), "return_token_ids": False,
                                                              "stream": True})
            staying = pool.submit(post, url, "/v1/chat/completions", _body(QUESTIONS[4], 24))
            gate.allow(12)
            events = leaving.events()
            for _ in range(3):
                next(events)
            assert wait_until(lambda: gate.passed == 12, 30)
            assert metrics(url)[("dllama_requests_running", ())] == 2
            leaving.hang_up()
            time.sleep(0.5)  # the server notices
            gate.allow(1)
            assert wait_until(lambda: metrics(url)[("dllama_requests_running", ())] == 1, 30)
        assert staying.result()[2]["choices"][0]["token_ids"] == expected
    assert wait_until(lambda: metrics(url)[("dllama_requests_running", ())] == 0, 30)


async def test_a_copied_prompt_start_gives_the_computed_bits(gguf_model, tokenizer):
    """A prompt that starts as another sequence's (the chat template's system prompt) takes that
    start's keys and values by a copy between slots: its logits are those computed alone."""
    a, b = chat_ids(tokenizer, QUESTIONS[0]), chat_ids(tokenizer, QUESTIONS[1])
    n = _common_prefix(a, b)
    assert n > 10
    engine = LocalEngine(gguf_model, 256, slots=2)
    engine.reserve(0, len(a))
    await engine.step([SeqInput(0, a, GREEDY)])
    engine.reserve(1, len(b))
    engine.share_prefix(0, 1, n)
    [got] = await engine.step([SeqInput(1, b[n:], GREEDY, targets=b[n + 1:] + [0])])
    expected = await LocalEngine(gguf_model, 256).feed(b, GREEDY, targets=b[1:] + [0])
    assert wire(got) == wire(expected[n:])
    assert engine.contexts[1] == b


async def test_a_prompt_start_copied_in_the_step_that_computes_it(gguf_model, tokenizer):
    """Two requests that arrive together: the second takes the first's system prompt in the same
    step, layer by layer once the first has computed it; both get the logits computed alone."""
    a, b = chat_ids(tokenizer, QUESTIONS[0]), chat_ids(tokenizer, QUESTIONS[1])
    n = _common_prefix(a, b)
    engine = LocalEngine(gguf_model, 256, slots=2)
    engine.reserve(0, len(a))
    engine.reserve(1, len(b))
    engine.share_prefix(0, 1, n, upcoming=a)
    got_a, got_b = await engine.step([SeqInput(0, a, GREEDY, targets=a[1:] + [0]),
                                      SeqInput(1, b[n:], GREEDY, targets=b[n + 1:] + [0])])
    alone = LocalEngine(gguf_model, 256)
    assert wire(got_a) == wire(await alone.feed(a, GREEDY, targets=a[1:] + [0]))
    alone.release(0)
    assert wire(got_b) == wire((await alone.feed(b, GREEDY, targets=b[1:] + [0]))[n:])
    assert engine.contexts == [a, b]


async def test_a_longer_start_supersedes_a_copy_not_yet_made(gguf_model, tokenizer):
    """A request admitted with an idle slot's start of its prompt (the system prompt), then given a
    leader's longer start (the leader's whole prompt, computed in the same step) before any step
    ran: the step copies into its slot once, the longer start (a worker refuses a step that copies
    into a slot twice: the soak found it, eight clients on a cluster), and it gets the logits
    computed alone."""
    a, c = chat_ids(tokenizer, QUESTIONS[0]), chat_ids(tokenizer, QUESTIONS[1])
    b = c + tokenizer.encode(" And why?", add_bos=False)
    short = _common_prefix(a, b)
    assert 10 < short < len(c)
    engine = LocalEngine(gguf_model, 256, slots=3)
    engine.reserve(0, len(a))
    await engine.step([SeqInput(0, a, GREEDY)])  # slot 0: idle, holding a
    engine.reserve(1, len(c))
    engine.reserve(2, len(b))
    engine.share_prefix(0, 2, short)  # admitted: the system prompt from the idle slot
    engine.share_prefix(1, 2, len(c), upcoming=c)  # then the leader's whole prompt, computed in this step
    sent = []
    run = engine._run

    async def checked_run(tokens, step, preempt):
        sent.append(step.check(256, 3, gguf_model.config.dim, gguf_model.config.vocab_size, 1 << 30, "FORWARD"))
        return await run(tokens, step, preempt)

    engine._run = checked_run
    got_c, got_b = await engine.step([SeqInput(1, c, GREEDY, targets=c[1:] + [0]),
                                      SeqInput(2, b[len(c):], GREEDY, targets=b[len(c) + 1:] + [0])])
    assert [(k.src, k.dst, k.n) for k in sent[0].copies] == [(1, 2, len(c))]
    alone = LocalEngine(gguf_model, 256)
    assert wire(got_c) == wire(await alone.feed(c, GREEDY, targets=c[1:] + [0]))
    alone.release(0)
    assert wire(got_b) == wire((await alone.feed(b, GREEDY, targets=b[1:] + [0]))[len(c):])


async def test_a_preempting_step_runs_inside_the_step_in_flight(gguf_model, tokenizer):
    """On one node a step asked with preempt=True runs while the step in flight waits at its next
    sync point: it starts after that one and ends before it, carries only the frees and copies
    asked since that one was sent, and both give the logits each gets alone (as does a sequence
    whose start the preempted step copied). An engine on its caller's loop refuses to preempt."""
    a, b = chat_ids(tokenizer, QUESTIONS[0]), chat_ids(tokenizer, QUESTIONS[1])
    n = _common_prefix(a, b)
    long_prompt = tokenizer.encode(" ".join(["the quick brown fox jumps over the lazy dog"] * 20))[:200]
    engine = LocalEngine(gguf_model, 512, slots=4)
    engine.reserve(0, len(a))
    await engine.step([SeqInput(0, a, GREEDY)])
    engine.reserve(3, 32)
    await engine.step([SeqInput(3, [1, 2, 3], GREEDY)])
    engine.release(3)  # the step in flight frees slot 3, copies a's start into slot 2, and reads slot 1's prompt
    engine.reserve(2, len(b))
    engine.share_prefix(0, 2, n)
    engine.reserve(1, len(long_prompt))
    events = []
    forward = engine._forward

    async def logged(tokens, step, node=None):
        kind = "preempting" if node is not None else "in flight"
        events.append(("start", kind, step.free, [(c.src, c.dst) for c in step.copies]))
        try:
            return await forward(tokens, step, node)
        finally:
            events.append(("end", kind))

    engine._forward = logged
    in_flight = asyncio.ensure_future(engine.step([SeqInput(1, long_prompt, GREEDY, targets=long_prompt[1:] + [0])]))
    while not events:
        await asyncio.sleep(0.001)
    with pytest.raises(ValueError, match=r"slots \[1\] are in a step in flight"):
        await engine.step([SeqInput(1, [5], GREEDY)], preempt=True)
    engine.reserve(3, len(b))  # slot 3 again (the step in flight has freed it), with a's start copied
    engine.share_prefix(0, 3, n)
    [preempting] = await engine.step([SeqInput(3, b[n:], GREEDY, targets=b[n + 1:] + [0])], preempt=True)
    [preempted] = await in_flight
    assert events == [("start", "in flight", [3], [(0, 2)]), ("start", "preempting", [], [(0, 3)]),
                      ("end", "preempting"), ("end", "in flight")]
    assert not engine._to_free and not engine._copies
    [copied] = await engine.step([SeqInput(2, b[n:], GREEDY, targets=b[n + 1:] + [0])])
    alone = LocalEngine(gguf_model, 512)
    expected_b = wire((await alone.feed(b, GREEDY, targets=b[1:] + [0]))[n:])
    assert wire(preempting) == wire(copied) == expected_b
    alone.release(0)
    assert wire(preempted) == wire(await alone.feed(long_prompt, GREEDY, targets=long_prompt[1:] + [0]))
    on_the_caller_s_loop = LocalEngine(gguf_model, 64, compute_here=True)
    on_the_caller_s_loop.reserve(0, 4)
    with pytest.raises(ValueError, match="one step at a time"):
        await on_the_caller_s_loop.step([SeqInput(0, [1], GREEDY)], preempt=True)


def test_the_default_kv_budget_fits_every_node_s_memory(gguf_model):
    """Without --kv-budget: a whole context per slot where memory allows, else half of what the
    tightest node has left after its weights, and never less than one context."""
    cfg = gguf_model.config
    per_position = bytes_per_position(cfg, cfg.n_kv_heads)
    assert default_kv_budget(cfg, 1000, 8, [(None, 0, cfg.n_kv_heads)]) == 8 * 1024
    roomy = (10 ** 12, 10 ** 9, cfg.n_kv_heads)
    tight = (10 ** 9 + 2 * 3000 * per_position, 10 ** 9, cfg.n_kv_heads)  # 3000 positions in half its room
    assert default_kv_budget(cfg, 1000, 8, [roomy, tight]) == 3000 // 32 * 32
    assert default_kv_budget(cfg, 1000, 8, [roomy, (10 ** 9, 10 ** 9, cfg.n_kv_heads)]) == 1024


@pytest.mark.parametrize("free, copies, error", [
    ([1], [(1, 2, 32)], "freed or copied into"),
    ([], [(0, 1, 32), (1, 2, 32)], "freed or copied into"),
    ([], [(0, 2, 32), (1, 2, 32)], "copied into twice"),
    ([], [(1, 0, 64)], "sized 64 here"),
    ([], [(1, 0, 32)], "computes positions below"),
])
def test_a_step_s_copies_cannot_chain_or_outgrow_the_budget(free, copies, error):
    """What a worker refuses before touching its caches: a copy from a slot the same step frees or
    copies into, two copies into one slot, a slot sized two ways (each could hold more than the
    budget for a moment, or read a cache that is gone), a copy over positions the step computes."""
    from dllama.step import Copy, Seq, Step
    from dllama.wire import InvalidMessage

    seq = Seq.of(0, 0, 4, 32, GREEDY)
    step = Step([seq], free, [Copy(src=a, dst=b, n=n, capacity=n) for a, b, n in copies])
    with pytest.raises(InvalidMessage, match=error):
        step.check(256, 4, 64, 1000, 1 << 20, "FORWARD")
