"""One request, one answer: through a real `dllama serve` and the official openai client, the same
chat request gives the same text and token ids whatever the server's KV cache holds (cold, the
prompt's prefix cached, after an unrelated request) and across restarts; greedy, and sampled
with a seed. This rests on the batch-invariant kernels (test_batch_invariance): a cached prefix
was computed in other forward passes than a cold prompt's, and before them the answers differed."""

from __future__ import annotations

import os

import openai
import pytest

from .test_server import cli_server

QUESTION = [{"role": "user", "content": "List five animals that live in the ocean, with one fact about each."}]
UNRELATED = [{"role": "user", "content": "Write a short poem about a lighthouse."}]
SERVE = ("--ctx-size", "512", "--threads", "1")


def _ask(client, model, messages, **sampling) -> tuple[str, list[int]]:
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=48,
                                           extra_body={"return_token_ids": True}, **sampling)
    choice = reply.choices[0]
    return choice.message.content, choice.model_extra["token_ids"]


def _answers_in_every_cache_state(model_path, **sampling) -> list[tuple[str, list[int]]]:
    """The QUESTION's answer cold, with its prefix cached, and after an unrelated request."""
    model = os.path.splitext(os.path.basename(model_path))[0]
    with cli_server("--model", model_path, *SERVE) as (_proc, url):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
            cold = _ask(client, model, QUESTION, **sampling)
            cached = _ask(client, model, QUESTION, **sampling)
            _ask(client, model, UNRELATED, **sampling)
            after_other = _ask(client, model, QUESTION, **sampling)
    return [cold, cached, after_other]


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=1234)],
                         ids=["greedy", "seeded"])
def test_one_request_one_answer(model_path, sampling):
    first = _answers_in_every_cache_state(model_path, **sampling)
    restarted = _answers_in_every_cache_state(model_path, **sampling)
    text, ids = first[0]
    assert ids and text
    for i, answer in enumerate(first + restarted):
        assert answer == (text, ids), f"answer {i} ({['cold', 'cached', 'after another'][i % 3]}" \
                                      f"{', restarted' if i >= 3 else ''}) differs: {answer[0]!r} vs {text!r}"
