"""Speculative decoding (dllama/speculate.py): drafts from the text so far, verified in one step,
give exactly the tokens of plain decoding, greedy and seeded, alone, batched and across worker
processes, in fewer steps where the text repeats itself."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from dllama.cli.common import open_runtime
from dllama.draft_model import DraftModel
from dllama.errors import DllamaError
from dllama.engine import LocalEngine
from dllama.generate import Generator
from dllama.sampling import SamplingParams
from dllama.server import ServerConfig, make_app
from dllama.speculate import (AUTO_FIRST_POSITIONS, AUTO_MAX_POSITIONS, MAX_DRAFT, MAX_PAUSE, DraftLength,
                              NgramIndex, StepCost, ngram_draft)

from .cluster_helpers import in_process_cluster, run_dllama
from .server_helpers import ServerThread, post

# a text the model goes on repeating: long drafts are kept
PROMPT = ("Copy the list exactly.\nList: red apple, green pear, yellow banana, purple plum, orange peach.\n"
          "Copy: red apple, green pear, yellow banana, purple plum, orange peach.\nCopy: red apple,")
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7)
N_TOKENS = 40


def test_the_longest_latest_ngram_proposes_what_followed_it():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3]
    assert ngram_draft(tokens, 3) == [4, 5, 9]  # "1 2 3" (3 tokens) beats the later "2 3"
    assert ngram_draft(tokens, 10) == [4, 5, 9, 2, 3, 7, 1, 2, 3]  # up to the end
    assert ngram_draft([5, 2, 3, 8, 2, 3], 2) == [8, 2]  # "2 3" at its latest earlier place
    assert ngram_draft([5, 6, 1, 7, 8, 1], 4) == []  # a single token is no n-gram
    assert ngram_draft([1, 2, 3], 4) == [] and ngram_draft([1, 2, 1, 2], 0) == []


def test_the_index_drafts_what_the_scan_does():
    rng = random.Random(3)
    for alphabet in (2, 3, 8):
        index, tokens = NgramIndex(), []
        for _ in range(300):
            new = [rng.randrange(alphabet) for _ in range(rng.choice((1, 1, 3)))]
            index.extend(new)
            tokens += new
            k = rng.randrange(0, 9)
            assert index.draft(k) == ngram_draft(tokens, k), (tokens, k)


def test_the_draft_length_follows_what_is_kept():
    length = DraftLength()
    k0 = length.k
    length.update(k0, k0)
    assert length.k == k0 + 1
    for _ in range(20):
        length.update(length.k, length.k)
    assert length.k == MAX_DRAFT
    length.update(MAX_DRAFT, 3)
    assert length.k == MAX_DRAFT  # partly kept: unchanged
    for _ in range(10):
        length.update(length.k, 0)
    assert length.k == 1


def test_auto_pauses_after_refusals_and_tries_again():
    length = DraftLength(k=1, pause=True)
    waits = []
    for _ in range(8):  # refused drafts of one, in a row: pauses double up to MAX_PAUSE
        length.update(1, 0)
        assert length.k == 0
        steps = 0
        while length.k == 0:
            length.plain_step()
            steps += 1
        waits.append(steps)
        assert length.k == 1
    assert waits == [1, 2, 4, 8, 16, 32, 32, 32] and MAX_PAUSE == 32
    length.update(1, 1)  # kept: drafting grows again, and the next pause starts short
    assert length.k == 2
    length.update(2, 0)
    length.update(1, 0)
    assert length.k == 0 and length.wait == 1
    plain = DraftLength(k=1)  # ngram: never pauses
    plain.update(1, 0)
    assert plain.k == 1


def test_the_step_cost_gives_the_positions_worth_their_cost():
    cost = StepCost(window=8)
    assert cost.latency_bound_positions() == AUTO_FIRST_POSITIONS  # nothing measured
    for _ in range(3):
        cost.add(1, 0.012 + 0.004)
    assert cost.fit() is None  # one size: no slope
    for positions in (2, 5, 3):
        cost.add(positions, 0.012 + 0.004 * positions)  # fixed 12 ms, 4 ms a position
    fixed, per_position = cost.fit()
    assert abs(fixed - 0.012) < 1e-9 and abs(per_position - 0.004) < 1e-9
    assert cost.latency_bound_positions() == 3
    for positions in range(1, 9):  # a cluster's round trips: 40 ms fixed, the old samples leave the window
        cost.add(positions, 0.040 + 0.004 * positions)
    assert cost.latency_bound_positions() == 10
    for positions in range(1, 9):
        cost.add(positions, 0.05)
    assert cost.latency_bound_positions() == AUTO_MAX_POSITIONS  # positions free (noise)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.encode(PROMPT)


def _generate(gguf_model, tokenizer, prompts, params, speculate, draft_path=None):
    async def run():
        engine = LocalEngine(gguf_model, 512, slots=len(prompts))
        drafter = None
        if draft_path is not None:
            draft = DraftModel.open(draft_path, gguf_model, 512)
            drafter = await DraftModel.start(draft, draft_path, 512, len(prompts))
        try:
            generator = Generator(engine, tokenizer, drafter)
            return await asyncio.gather(*(generator.generate(p, params, N_TOKENS, speculate=speculate)
                                          for p in prompts))
        finally:
            await engine.close()
            if drafter is not None:
                await drafter.close()

    return asyncio.run(run())


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_drafts_give_the_plain_tokens_in_fewer_steps(gguf_model, tokenizer, prompt_ids, params):
    [plain] = _generate(gguf_model, tokenizer, [prompt_ids], params, "off")
    [drafted] = _generate(gguf_model, tokenizer, [prompt_ids], params, "ngram")
    [auto] = _generate(gguf_model, tokenizer, [prompt_ids], params, "auto")
    assert drafted.tokens == plain.tokens == auto.tokens and drafted.text == plain.text == auto.text
    assert plain.drafted == 0 and plain.decode_steps == plain.decode_tokens  # (one token a step)
    assert drafted.decode_tokens == plain.decode_tokens and drafted.accepted > 0
    assert drafted.decode_steps == drafted.decode_tokens - drafted.accepted < plain.decode_steps
    print(f"\n{params.temperature}: {len(plain.tokens)} tokens in {plain.decode_steps} steps plainly, "
          f"{drafted.decode_steps} with {drafted.accepted} of {drafted.drafted} drafts kept")


def test_batched_sequences_each_get_their_own_tokens(gguf_model, tokenizer, prompt_ids, monkeypatch):
    """Streams that draft and streams that do not (free text finds little to look up) share steps,
    with ngram, whose drafts stay within a step's limit of positions, and with auto, whose drafts
    stay within the positions StepCost allows a step."""
    free = tokenizer.encode("The old lighthouse keeper climbed the stairs and")
    prompts = [prompt_ids, free, prompt_ids[:-3]]
    plain = _generate(gguf_model, tokenizer, prompts, SEEDED, "off")
    decode_steps = []
    real_step = LocalEngine.step

    async def step(self, seqs, preempt=False):
        if all(len(q.tokens) == 1 or q.all_logits for q in seqs):
            decode_steps.append(sum(len(q.tokens) for q in seqs))
        return await real_step(self, seqs, preempt)

    monkeypatch.setattr(LocalEngine, "step", step)
    monkeypatch.setattr("dllama.batching.MAX_STEP_TOKENS", 6)  # (the prompts in chunks of 6, too)
    ngram = _generate(gguf_model, tokenizer, prompts, SEEDED, "ngram")
    assert [g.tokens for g in ngram] == [g.tokens for g in plain]
    assert sum(g.accepted for g in ngram) > 0 and max(decode_steps) == 6
    monkeypatch.undo()
    monkeypatch.setattr(LocalEngine, "step", step)
    monkeypatch.setattr(StepCost, "latency_bound_positions", lambda self: 5)
    decode_steps.clear()
    auto = _generate(gguf_model, tokenizer, prompts, SEEDED, "auto")
    assert [g.tokens for g in auto] == [g.tokens for g in plain]
    assert max(decode_steps) == 5  # 3 sequences and 2 drafts, at most
    assert auto[0].accepted > 0, [(g.drafted, g.accepted) for g in auto]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_draft_model_gives_the_plain_tokens(gguf_model, tokenizer, prompt_ids, synthetic_model, params):
    """The model as its own draft (the upper bound: greedy keeps every draft) and a random one of the
    same vocabulary (its drafts mostly refused): the plain tokens either way, batched."""
    other = tokenizer.encode("The old lighthouse keeper climbed the stairs and")
    prompts = [prompt_ids, other]
    plain = _generate(gguf_model, tokenizer, prompts, params, "off")
    itself = _generate(gguf_model, tokenizer, prompts, params, "draft", gguf_model.path)
    random_draft = _generate(gguf_model, tokenizer, prompts, params, "draft", synthetic_model("Q8_0"))
    for drafted in (itself, random_draft):
        assert [g.tokens for g in drafted] == [g.tokens for g in plain]
        assert [g.text for g in drafted] == [g.text for g in plain]
    if params is GREEDY:
        assert all(g.accepted == g.drafted > 0 for g in itself)
    assert sum(g.accepted for g in itself) > sum(g.accepted for g in random_draft)
    assert sum(g.drafted - g.accepted for g in random_draft) > 0
    print(f"\n{params.temperature}: drafts kept, the model itself {sum(g.accepted for g in itself)} of "
          f"{sum(g.drafted for g in itself)}, a random model {sum(g.accepted for g in random_draft)} of "
          f"{sum(g.drafted for g in random_draft)}; steps {[g.decode_steps for g in plain]} plainly, "
          f"{[g.decode_steps for g in itself]} and {[g.decode_steps for g in random_draft]}")


def test_without_the_sampler_s_check_the_answer_changes(gguf_model, tokenizer, prompt_ids, synthetic_model,
                                                        monkeypatch):
    """What the tests above rely on: keeping a draft the sampler did not pick changes the tokens."""
    plain = _generate(gguf_model, tokenizer, [prompt_ids], GREEDY, "off")
    monkeypatch.setattr("dllama.stream.verified", lambda sample, draft: True)
    unchecked = _generate(gguf_model, tokenizer, [prompt_ids], GREEDY, "draft", synthetic_model("Q8_0"))
    assert unchecked[0].tokens != plain[0].tokens


def test_a_draft_model_that_cannot_follow_is_refused(gguf_model, synthetic_model, tmp_path):
    """Another vocabulary (one token's text changed), or a context shorter than the model's: one line."""
    path = synthetic_model("Q8_0")
    data = bytearray(open(path, "rb").read())
    tokens = DraftModel.open(path, gguf_model, 512).file.metadata["tokenizer.ggml.tokens"]
    first = data.index(b"<", tokens.start)  # (the first token's text, after its length)
    data[first + 1] ^= 0x20  # a letter's case
    other = tmp_path / "other-vocabulary.gguf"
    other.write_bytes(bytes(data))
    r = run_dllama("inference", "-p", "hi", "-n", "2", "--ctx-size", "64", "--speculate", f"draft:{other}")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [
        f"error: --speculate draft:{other}: its vocabulary (49152 tokens) is not the model's (49152 tokens): "
        "a draft must give every token id the same text"]
    with pytest.raises(DllamaError, match="its context of 4096 tokens cannot follow the model's 8192"):
        DraftModel.open(path, gguf_model, 8192)


def test_every_drafter_across_a_gather_mode_cluster_gives_one_node_s_tokens(gguf_model, tokenizer, prompt_ids,
                                                                             synthetic_model):
    """Root + 2 workers in gather mode (the 1-node bits on any node count), seeded at temperature
    0.8, three requests at once: each drafter's tokens are one node's plain ones."""
    params = SamplingParams(temperature=0.8, seed=11)
    free = tokenizer.encode("The old lighthouse keeper climbed the stairs and")
    prompts = [prompt_ids, free, prompt_ids[:-3]]
    alone = _generate(gguf_model, tokenizer, prompts, params, "off")

    async def across():
        drafter = await DraftModel.start(DraftModel.open(gguf_model.path, gguf_model, 256), "itself", 256, 3)
        try:
            async with in_process_cluster(gguf_model, 2, sync_mode="gather", sync_dtype="f32", ctx=256,
                                          slots=3) as (engine, _):
                generator = Generator(engine, tokenizer, drafter)
                return {mode: await asyncio.gather(*(generator.generate(p, params, N_TOKENS, speculate=mode)
                                                     for p in prompts)) for mode in ("ngram", "auto", "draft")}
        finally:
            await drafter.close()

    for mode, drafted in asyncio.run(across()).items():
        assert [g.tokens for g in drafted] == [g.tokens for g in alone], mode
        assert sum(g.accepted for g in drafted) > 0, mode


def test_drafts_across_worker_processes_give_the_plain_tokens():
    def inference(*extra):
        r = run_dllama("inference", "-p", PROMPT, "-n", str(N_TOKENS), "--temperature", "0", "--threads", "1",
                       "--local-workers", "1", "--json", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    plain, drafted = inference("--speculate", "off"), inference("--speculate", "draft:smollm2")  # (itself: the draft)
    assert drafted["tokens"] == plain["tokens"] and drafted["nodes"] == 2
    assert drafted["speculation"]["accepted"] > 0 and drafted["decode_steps"] < plain["decode_steps"]


def test_speculation_with_a_repetition_penalty_is_refused():
    r = run_dllama("inference", "-p", "hi", "-n", "2", "--speculate", "ngram", "--repeat-penalty", "1.1")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [
        "error: --speculate needs --repeat-penalty 1: the nodes apply a repetition penalty per step, not per "
        "drafted position"]


def test_the_api_field_and_the_server_default(model_path):
    """`serve --speculate ngram` drafts for the requests that do not say; 'speculate': false turns it off
    for one request, and the text is the same either way."""
    thread = ServerThread()
    rt = thread.run(open_runtime({"model": model_path, "ctx_size": 512, "threads": 1}, quiet=True))
    try:
        app = make_app(rt, ServerConfig(speculate="ngram"))
        url, batcher = thread.serve(app), rt.engine.batcher

        def ask(**extra):
            before = batcher.steps
            status, _, body = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": N_TOKENS,
                                                            "temperature": 0, **extra})
            assert status == 200, body
            return body["choices"][0]["text"], batcher.steps - before

        (default, default_steps), (off, off_steps), (on, on_steps) = ask(), ask(speculate=False), ask(speculate="ngram")
        assert default == off == on
        assert default_steps < off_steps and on_steps < off_steps
        assert ask(repeat_penalty=1.1)[0]  # the server's default with a penalty: decoded plainly
        for body, fragment in (({"speculate": "yes"}, "must be true, false"),
                               ({"speculate": True, "repeat_penalty": 1.1}, "needs 'repeat_penalty' 1"),
                               ({"speculate": "draft"}, "needs a server started with --speculate draft:MODEL")):
            status, _, answer = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})
            assert status == 400 and answer["error"]["param"] == "speculate", answer
            assert fragment in answer["error"]["message"], answer
    finally:
        thread.close(rt.close)
