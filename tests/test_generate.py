"""Generation on the single-node engine: stop strings and streaming, KV-cache reuse between
requests, context limits, end of generation, UTF-8-safe streaming, chat templates."""

from __future__ import annotations

import threading

import jinja2
import pytest

from dllama.engine import LocalEngine
from dllama.errors import ContextOverflow, DllamaError
from dllama.generate import Generator
from dllama.stream import _StopEmitter
from dllama.sampling import SamplingParams
from dllama.tokenizer import StreamDecoder

from .engine_helpers import greedy_divergence, llama_greedy_run, text

GREEDY = SamplingParams(temperature=0.0)
pytestmark = pytest.mark.usefixtures("one_compute_thread")


@pytest.fixture
def new_generator(gguf_model, tokenizer):
    def make(ctx: int = 512) -> Generator:
        return Generator(LocalEngine(gguf_model, ctx), tokenizer)

    return make


# ------------------------------------------------------------------ stop strings and streaming


async def test_stop_string_cuts_the_text_and_is_never_streamed(new_generator, tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    full = await new_generator().generate(prompt, GREEDY, 24)
    assert full.finish_reason == "length" and len(full.tokens) == 24
    assert full.text == tokenizer.decode(full.tokens)
    # stop strings taken from the middle of the greedy text, so they are sure to appear
    mid = len(full.text) // 2
    for stop in (full.text[mid:mid + 4], full.text[mid - 1:mid + 1]):
        streamed: list[str] = []
        gen = await new_generator().generate(prompt, GREEDY, 24, stop=[stop, "never appears"], on_text=streamed.append)
        cut = full.text.find(stop)
        assert gen.finish_reason == "stop"
        assert gen.text == full.text[:cut]
        assert "".join(streamed) == gen.text  # nothing of the stop string (or after it) went out
        assert all(streamed)
        # generation stopped at the token that completed the stop string
        assert gen.tokens == full.tokens[:len(gen.tokens)]
        assert stop in tokenizer.decode(gen.tokens) and stop not in tokenizer.decode(gen.tokens[:-1])


async def test_text_that_only_looks_like_a_stop_string_is_released(new_generator, tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    full = await new_generator().generate(prompt, GREEDY, 16)
    decoy = full.text[3:6] + "\x00"  # its start appears in the text, the whole never does
    streamed: list[str] = []
    gen = await new_generator().generate(prompt, GREEDY, 16, stop=[decoy], on_text=streamed.append)
    assert gen.finish_reason == "length"
    assert gen.text == full.text == "".join(streamed)


def test_stop_emitter_holds_back_a_possible_stop_string():
    out: list[str] = []
    e = _StopEmitter(["</s>"], out.append)
    assert not e.push("Hello <")
    assert out == ["Hello "]  # "<" may start "</s>"
    assert not e.push("/")
    assert out == ["Hello "]
    assert e.push("s> world")
    e.close()
    assert e.text == "Hello " and "".join(out) == "Hello "
    out.clear()
    e = _StopEmitter(["</s>"], out.append)
    e.push("a </")
    e.push("b")  # not a stop after all: the held text goes out
    e.close()
    assert "".join(out) == e.text == "a </b"


def test_stop_emitter_cuts_at_the_earliest_stop_string():
    """Two stop strings completed by the same piece: the text ends before the first one in the text
    (OpenAI / llama.cpp server semantics), whatever their order in the list."""
    out: list[str] = []
    e = _StopEmitter(["\n\n", "."], out.append)
    assert e.push("Paris.\n\nThe")
    e.close()
    assert e.text == "Paris"
    assert "".join(out) == "Paris"


# ------------------------------------------------------------------ KV cache reuse


async def test_follow_up_request_reuses_the_kv_cache(new_generator, gguf_model, tokenizer):
    """A conversation goes on: the next prompt is the first prompt + the answer + new text."""
    gen = new_generator()
    first_prompt = tokenizer.encode("Once upon a time, in a small village by the sea,")
    first = await gen.generate(first_prompt, GREEDY, 12)
    assert first.prefill_tokens == len(first_prompt)
    follow_up = first_prompt + first.tokens + tokenizer.encode(" Then one morning,")
    second = await gen.generate(follow_up, GREEDY, 12)
    # the cache holds the first prompt and all generated tokens but the last (never fed back)
    cached = len(first_prompt) + len(first.tokens) - 1
    assert second.prefill_tokens == len(follow_up) - cached
    assert second.prompt_tokens == len(follow_up)
    # a fresh engine given the same forward passes (the prompt, then the answer one token at a
    # time, then the rest) continues the same way: the reused cache is what those passes leave,
    # and the engine knows which tokens it holds
    engine = LocalEngine(gguf_model, 512)
    await engine.feed(first_prompt, GREEDY)
    for token in first.tokens[:-1]:
        await engine.feed([token], GREEDY)
    replay = Generator(engine, tokenizer)
    again = await replay.generate(follow_up, GREEDY, 12)
    assert again.prefill_tokens == second.prefill_tokens
    assert second.tokens == again.tokens and second.text == again.text


async def test_extended_prompt_equals_a_fresh_engine(new_generator, tokenizer):
    """Only new prompt tokens are computed, and the answer is a fresh engine's."""
    gen = new_generator()
    first_prompt = tokenizer.encode("The museum of natural history opened its new hall")
    first = await gen.generate(first_prompt, GREEDY, 8)
    extra = tokenizer.encode(" of fossils last week, and the first visitors")
    assert extra[0] != first.tokens[0] and len(extra) >= 2
    second = await gen.generate(first_prompt + extra, GREEDY, 12)
    assert second.prefill_tokens == len(extra)
    fresh = await new_generator().generate(first_prompt + extra, GREEDY, 12)
    assert fresh.prefill_tokens == len(first_prompt + extra)
    assert second.tokens == fresh.tokens and second.text == fresh.text


async def test_compute_here_runs_steps_on_the_callers_thread(gguf_model, tokenizer):
    """The CLI's engine computes where it is asked (no hop to a thread of its own and back); the
    API server's keeps its own thread. Same tokens either way."""
    prompt = tokenizer.encode("The capital of France is")
    answers = {}
    for here in (True, False):
        engine = LocalEngine(gguf_model, 128, compute_here=here)
        threads = set()
        forward = engine._forward

        async def recorded(*args):
            threads.add(threading.get_ident())
            return await forward(*args)

        engine._forward = recorded
        try:
            answers[here] = (await Generator(engine, tokenizer).generate(prompt, GREEDY, 6)).tokens
        finally:
            await engine.close()
        assert (threads == {threading.get_ident()}) == here, (here, threads)
    assert answers[True] == answers[False]


async def test_diverging_request_rewinds_the_cache(new_generator, gguf_model, tokenizer):
    gen = new_generator()
    a = tokenizer.encode("The weather today is sunny and warm, so we will go to the beach")
    b = a[:8] + tokenizer.encode(" cold and rainy, so we will stay at home and read")
    await gen.generate(a, GREEDY, 6)
    again = await gen.generate(b, GREEDY, 10)
    assert again.prefill_tokens == len(b) - 8
    fresh = await new_generator().generate(b, GREEDY, 10)
    assert again.tokens == fresh.tokens
    # the same prompt again: only its last token runs (its logits are needed); the answer is what
    # a fresh engine gives with the same passes (the prompt but its last token, then that token)
    repeat = await gen.generate(b, GREEDY, 10)
    assert repeat.prefill_tokens == 1
    engine = LocalEngine(gguf_model, 512)
    await engine.feed(b[:-1], GREEDY)
    replay = Generator(engine, tokenizer)
    assert (await replay.generate(b, GREEDY, 10)).tokens == repeat.tokens


async def test_prefill_longer_than_one_chunk(new_generator, tokenizer, model_path, llama_ref):
    """A 300-token prompt runs in two prefill chunks (256 + 44); the continuation is llama.cpp's."""
    prompt = tokenizer.encode(text())[:300]
    gen = await new_generator(512).generate(prompt, GREEDY, 8)
    assert gen.prefill_tokens == 300
    why = greedy_divergence(gen.tokens, llama_greedy_run(llama_ref(model_path, 1024), prompt, 8, tokenizer.is_eog))
    assert why is None, why


# ------------------------------------------------------------------ context limits


async def test_prompt_longer_than_the_context(new_generator, tokenizer):
    gen = new_generator(32)
    assert gen.engine.ctx_size == 32
    long_prompt = tokenizer.encode(text())[:40]
    with pytest.raises(ContextOverflow, match="40 tokens"):
        await gen.generate(long_prompt, GREEDY, 4)
    # a prompt that fills the cache still yields one token (it needs no cache slot of its own)
    full = await gen.generate(long_prompt[:32], GREEDY, 4)
    assert len(full.tokens) == 1 and full.finish_reason == "length" and full.decode_steps == 0
    # a prompt one short of the cache: two tokens, the first fed back into the last slot
    almost = await gen.generate(long_prompt[:31], GREEDY, 4)
    assert len(almost.tokens) == 2 and almost.finish_reason == "length" and almost.decode_steps == 1
    with pytest.raises(ContextOverflow):
        await gen.engine.feed(long_prompt, GREEDY)
    with pytest.raises(DllamaError, match="empty"):
        await gen.generate([], GREEDY, 4)
    # the generator is still usable afterwards
    ok = await gen.generate(long_prompt[:10], GREEDY, 4)
    assert ok.finish_reason == "length" and len(ok.tokens) == 4


async def test_generation_stops_at_the_end_of_the_context(new_generator, tokenizer):
    gen = new_generator(32)
    prompt = tokenizer.encode(text())[:25]
    out = await gen.generate(prompt, GREEDY, 100)
    assert out.finish_reason == "length" and out.error is None
    # every generated token but the last went into the cache, which never overflows
    assert len(prompt) + len(out.tokens) - 1 <= gen.engine.ctx_size
    assert len(out.tokens) >= gen.engine.ctx_size - len(prompt)
    fresh = await new_generator(64).generate(prompt, GREEDY, len(out.tokens))
    assert out.tokens == fresh.tokens


async def test_context_is_what_was_asked_and_the_cache_is_padded(gguf_model):
    engine = LocalEngine(gguf_model, 30)
    assert engine.ctx_size == 30 and engine.kv_budget == 32
    await engine.feed([1, 2, 3], GREEDY)
    k, v = engine.model.kv.layer(0, 0)
    assert k.shape[1] == 32 and v.shape[1:] == (1, k.shape[2], 32)


# ------------------------------------------------------------------ end of generation


async def test_end_of_generation_token_stops_like_llama_cpp(new_generator, tokenizer, model_path, llama_ref):
    """A chat prompt: greedy decoding ends with <|im_end|> (not part of the answer), as llama.cpp's."""
    prompt = tokenizer.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
                              add_bos=False, special=True)
    expected = llama_greedy_run(llama_ref(model_path, 1024), prompt, 64, tokenizer.is_eog)
    gen = await new_generator().generate(prompt, GREEDY, 64)
    why = greedy_divergence(gen.tokens, expected)
    assert why is None, why
    assert len(expected.tokens) < 64, "llama.cpp's greedy answer was expected to end before 64 tokens"
    assert gen.finish_reason == "stop" and len(gen.tokens) < 64
    assert not any(tokenizer.is_eog(t) for t in gen.tokens)
    assert "<|im_end|>" not in gen.text and gen.text == tokenizer.decode(gen.tokens)


def test_eog_tokens(tokenizer):
    im_end = tokenizer.encode("<|im_end|>", add_bos=False, special=True)
    assert len(im_end) == 1 and tokenizer.is_eog(im_end[0])
    assert tokenizer.is_eog(tokenizer.eos_id)
    assert not any(tokenizer.is_eog(t) for t in tokenizer.encode("Hello world"))


def test_pieces_and_eog_flags_are_libllama_s_every_time_asked(tokenizer):
    """piece_bytes and is_eog keep what libllama answered per token: asked again (the cached
    answer), every token of the vocabulary gets libllama's own bytes and end-of-generation flag."""
    from llama_cpp import llama_cpp as lib

    llama = tokenizer._llama
    vocab = llama._model.vocab
    for _ in range(2):
        for token in range(tokenizer.vocab_size):
            assert tokenizer.piece_bytes(token) == llama.detokenize([token], special=True), token
            assert tokenizer.is_eog(token) == (token == tokenizer.eos_id or bool(lib.llama_vocab_is_eog(vocab, token)))


# ------------------------------------------------------------------ sampling through the engine


async def test_seeded_sampling_reproduces(new_generator, tokenizer):
    prompt = tokenizer.encode("My favourite animal is")
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=1234)
    a = await new_generator().generate(prompt, params, 16)
    b = await new_generator().generate(prompt, params, 16)
    assert a.tokens == b.tokens
    others = [await new_generator().generate(prompt, SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=s), 16)
              for s in (1, 2)]
    assert any(o.tokens != a.tokens for o in others)


async def test_report_figures(new_generator, tokenizer):
    gen = new_generator()
    out = await gen.generate(tokenizer.encode("Hello, my name is"), GREEDY, 8)
    r = out.report(gen.engine)
    assert r["tokens"] == out.tokens and r["text"] == out.text and r["nodes"] == 1
    # the first token comes from the prompt's pass; each later one costs one decode step
    assert out.decode_steps == len(out.tokens) - (out.finish_reason == "length")
    assert r["tokens_per_s"] == pytest.approx(out.decode_steps / out.decode_s)
    assert r["ms_per_token"]["total"] == pytest.approx(out.decode_s / out.decode_steps * 1e3)
    assert 0 < r["ms_per_token"]["compute"] <= r["ms_per_token"]["total"]
    assert r["bytes_per_token"] == {"sent": 0.0, "recv": 0.0} and r["peak_rss_mb"] > 0


# ------------------------------------------------------------------ UTF-8 streaming


@pytest.mark.parametrize("sample", ["日本語のテキストを少し書きます。", "Party time 🎉😀👍🏽 done", "naïve café – 東京 🚀"])
def test_stream_decoder_never_splits_a_character(tokenizer, sample):
    tokens = tokenizer.encode(sample, add_bos=False)
    pieces = [tokenizer.piece_bytes(t) for t in tokens]
    assert b"".join(pieces) == sample.encode("utf-8")

    def valid(b: bytes) -> bool:
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    assert not all(valid(p) for p in pieces), "the sample should have a character split across tokens"
    decoder = StreamDecoder(tokenizer)
    out = [decoder.feed(t) for t in tokens]
    assert all("\ufffd" not in piece for piece in out)
    assert "".join(out) + decoder.flush() == sample


def test_stream_decoder_flushes_an_unfinished_character(tokenizer):
    tokens = tokenizer.encode("🎉", add_bos=False)
    assert len(tokens) > 1
    decoder = StreamDecoder(tokenizer)
    assert decoder.feed(tokens[0]) == ""
    assert decoder.flush() == "\ufffd"


# ------------------------------------------------------------------ chat template


def test_chat_template_matches_jinja(tokenizer, gguf_model):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "What is 2+2?"}]
    expected = jinja2.Environment().from_string(gguf_model.chat_template).render(
        messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
    assert expected.endswith("<|im_start|>assistant\n") and "<|im_start|>system" in expected
    assert tokenizer.apply_chat_template(messages) == expected
