"""The OpenAI API's requests: validation into a GenerationRequest, with OpenAI-style errors (the JSON
body itself is parsed by json_body.py; responses are shaped by openai_responses.py). Pure functions
of JSON-like data: no model, no I/O.

Unknown fields are ignored, as OpenAI does. Fields for features this server does not have
(logprobs, tools, logit_bias, penalties other than repeat_penalty, n > 1) are rejected with a 400
rather than silently ignored, because ignoring them would change what the client gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..sampling import REPEAT_PENALTY_RANGE, SamplingParams
from ..speculate import MODES, NEEDS_NO_PENALTY, can_speculate
from .api_errors import bad_request

MAX_STOP = 4  # OpenAI: "up to 4 sequences"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# What a request that omits a sampling field gets: OpenAI's documented defaults (temperature 1,
# top_p 1), no top-k cut (up to the per-node candidate cap), no repetition penalty.
OPENAI_SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, repeat_penalty=1.0, seed=None)


# ------------------------------------------------------------------ requests


@dataclass
class GenerationRequest:
    """A validated /v1/chat/completions or /v1/completions request."""

    kind: str  # "chat" or "completion"
    params: SamplingParams
    max_tokens: int | None  # None: up to the context (and the server's limit)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # vLLM's extension: the prompt's and the answer's token ids
    messages: list[dict] | None = None  # chat: [{"role", "content": str}]
    prompt: str | list[int] | None = None  # completion: text, or token ids
    speculate: str | bool | None = None  # our extension (speculate.MODES, or true/false): None, the server's choice


def parse_chat(body, defaults: SamplingParams, max_tokens_limit: int) -> GenerationRequest:
    body = _object(body)
    _reject_unsupported(body, chat=True)
    req = _common(body, "chat", defaults, max_tokens_limit)
    req.messages = _messages(body.get("messages"))
    return req


def parse_completion(body, defaults: SamplingParams, max_tokens_limit: int, vocab_size: int) -> GenerationRequest:
    body = _object(body)
    _reject_unsupported(body, chat=False)
    req = _common(body, "completion", defaults, max_tokens_limit)
    req.prompt = _prompt(body.get("prompt"), vocab_size)
    return req


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_type")
    return body


def _common(body: dict, kind: str, defaults: SamplingParams, max_tokens_limit: int) -> GenerationRequest:
    _string(body, "model")  # any name is accepted: this server runs one model
    n = _integer(body, "n", 1)
    if n != 1:
        raise bad_request(f"'n' is {n}; this server generates one choice per request (n=1).", "n", "unsupported_value")
    # max_completion_tokens is the newer name of max_tokens; it wins when both are given
    max_tokens, name = _integer(body, "max_completion_tokens", None), "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = _integer(body, "max_tokens", None), "max_tokens"
    if max_tokens is not None:
        if max_tokens < 1:
            raise bad_request(f"'{name}' must be at least 1 (got {max_tokens}).", name)
        if max_tokens > max_tokens_limit:
            raise bad_request(f"'{name}' is {max_tokens}; this server allows at most {max_tokens_limit}.", name)
    seed = _integer(body, "seed", None)
    params = replace(
        defaults,
        temperature=_number(body, "temperature", defaults.temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", defaults.top_p, 0.0, 1.0),
        top_k=_integer(body, "top_k", defaults.top_k, lo=0),  # llama.cpp's extension
        repeat_penalty=_number(body, "repeat_penalty", defaults.repeat_penalty, *REPEAT_PENALTY_RANGE),
        seed=defaults.seed if seed is None else seed % (1 << 64),  # numpy's generator takes non-negative seeds
    )
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", "stream_options", "invalid_type")
    include_usage = _bool(options or {}, "include_usage", False, param="stream_options.include_usage")
    return_token_ids = _bool(body, "return_token_ids", False)
    if return_token_ids and stream:
        raise bad_request("'return_token_ids' is not supported with 'stream'.", "return_token_ids",
                          "unsupported_parameter")
    return GenerationRequest(kind, params, max_tokens, _stop(body.get("stop")), stream, stream and include_usage,
                             return_token_ids, speculate=_speculate(body, params))


def _speculate(body: dict, params: SamplingParams) -> str | bool | None:
    """The 'speculate' extension: true (the server's drafter, else ngram), false, or a mode by name."""
    value = body.get("speculate")
    if value is None or value is False:
        return None if value is None else "off"
    if value is not True and value not in MODES:
        raise bad_request(f"'speculate' must be true, false or one of {', '.join(map(repr, MODES))}.", "speculate",
                          "invalid_value")
    if value != "off" and not can_speculate(params):
        raise bad_request(f"'speculate' needs 'repeat_penalty' 1: {NEEDS_NO_PENALTY}.", "speculate",
                          "unsupported_value")
    return value


def _reject_unsupported(body: dict, chat: bool) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        value = _number(body, name, 0.0, -2.0, 2.0)
        if value != 0.0:
            raise bad_request(f"'{name}' is not supported by this server (use 'repeat_penalty').", name,
                              "unsupported_parameter")
    if body.get("logit_bias"):
        raise bad_request("'logit_bias' is not supported by this server.", "logit_bias", "unsupported_parameter")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad_request("'logprobs' is not supported by this server.", "logprobs", "unsupported_parameter")
    if chat:
        for name in ("tools", "functions"):
            if body.get(name):
                raise bad_request(f"'{name}' (function calling) is not supported by this server.", name,
                                  "unsupported_parameter")
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
            raise bad_request("only the 'text' response_format is supported by this server.", "response_format",
                              "unsupported_parameter")
    else:
        if body.get("echo"):
            raise bad_request("'echo' is not supported by this server.", "echo", "unsupported_parameter")
        if body.get("suffix"):
            raise bad_request("'suffix' is not supported by this server.", "suffix", "unsupported_parameter")
        best_of = _integer(body, "best_of", 1)
        if best_of != 1:
            raise bad_request("'best_of' must be 1 on this server.", "best_of", "unsupported_value")


def _messages(value) -> list[dict]:
    if value is None:
        raise bad_request("'messages' is required.", "messages", "missing_required_parameter")
    if not isinstance(value, list):
        raise bad_request("'messages' must be an array.", "messages", "invalid_type")
    if not value:
        raise bad_request("'messages' must not be empty.", "messages", "empty_array")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object.", where, "invalid_type")
        role = message.get("role")
        if not isinstance(role, str):
            raise bad_request(f"'{where}.role' is required and must be a string.", f"{where}.role", "invalid_type")
        if role not in ROLES:
            raise bad_request(f"'{where}.role' is {role!r}; supported roles: {', '.join(ROLES)}.", f"{where}.role",
                              "invalid_value")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""  # an assistant turn that only called tools
        out.append({"role": ROLES[role], "content": _content(content, f"{where}.content")})
    return out


def _content(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"'{where}[{i}]' must be an object with a 'type'.", f"{where}[{i}]", "invalid_type")
            if part["type"] != "text":
                raise bad_request(f"'{where}[{i}]' is of type {part['type']!r}; only text is supported.",
                                  f"{where}[{i}].type", "unsupported_value")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}[{i}].text' must be a string.", f"{where}[{i}].text", "invalid_type")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"'{where}' must be a string or an array of text parts.", where, "invalid_type")


def _prompt(value, vocab_size: int) -> str | list[int]:
    """A string, or token ids; OpenAI's batch forms are accepted with exactly one prompt."""
    if value is None:
        raise bad_request("'prompt' is required.", "prompt", "missing_required_parameter")
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) != 1:
            raise bad_request(f"'prompt' holds {len(value)} prompts; this server takes one per request.", "prompt",
                              "unsupported_value")
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if not value:
            raise bad_request("'prompt' must not be empty.", "prompt")
        bad = [t for t in value if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"'prompt' holds token id {bad[0]}, outside the vocabulary (0..{vocab_size - 1}).",
                              "prompt")
        return value
    raise bad_request("'prompt' must be a string or an array of token ids.", "prompt", "invalid_type")


def _stop(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("'stop' must be a string or an array of strings.", "stop", "invalid_type")
    if len(value) > MAX_STOP:
        raise bad_request(f"'stop' holds {len(value)} sequences; at most {MAX_STOP} are allowed.", "stop")
    return [s for s in value if s]


def _number(body: dict, name: str, default, lo: float | None, hi: float | None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{name}' must be a number (got {_type_name(value)}).", name, "invalid_type")
    try:
        value = float(value)  # an integer beyond ±1.8e308 overflows
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):  # parse_json refuses NaN and infinities already; a direct caller may not
        raise bad_request(f"'{name}' must be a finite number.", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"at least {lo:g}" + (f" and at most {hi:g}" if hi is not None else "")
        raise bad_request(f"'{name}' is {value:g}; it must be {bounds}.", name)
    return float(value)


def _integer(body: dict, name: str, default, lo: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has one number type; 8.0 means 8
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer (got {_type_name(value)}).", name, "invalid_type")
    if lo is not None and value < lo:
        raise bad_request(f"'{name}' must be at least {lo} (got {value}).", name)
    return value


def _bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{param or name}' must be a boolean (got {_type_name(value)}).", param or name,
                          "invalid_type")
    return value


def _string(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string (got {_type_name(value)}).", name, "invalid_type")
    return value


def _type_name(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)
