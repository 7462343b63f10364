"""The OpenAI API's responses: the envelope every response and stream chunk of one request
repeats, and the usage figures."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

@dataclass
class Envelope:
    """What every response and chunk of one request repeats."""

    kind: str  # "chat" or "completion"
    model: str
    fingerprint: str
    id: str = ""
    created: int = 0

    def __post_init__(self):
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = self.created or int(time.time())

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def response(self, text: str, finish_reason: str, usage: dict,
                 token_ids: tuple[list[int], list[int]] | None = None) -> dict:
        """token_ids: (prompt ids, answer ids), returned as vLLM does when asked (return_token_ids)."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            out = {**self._head("chat.completion"), "choices": [choice], "usage": usage}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice], "usage": usage}
        if token_ids is not None:
            out["prompt_token_ids"], choice["token_ids"] = list(token_ids[0]), list(token_ids[1])
        return out

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              with_usage_field: bool = False) -> dict:
        """One stream chunk: a piece of text, the opening role (chat), or the closing finish_reason.
        With stream_options.include_usage every chunk carries "usage": null, as OpenAI's do."""
        if self.kind == "chat":
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            out = {**self._head("chat.completion.chunk"),
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        else:
            out = {**self._head("text_completion"),
                   "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]}
        if with_usage_field:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(name), "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
