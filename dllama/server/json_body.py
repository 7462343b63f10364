"""A request's JSON body, parsed defensively: its nesting bounded before the parser sees it, no NaN
or infinity (JSON has none; Python's parser would accept them), and no string that is not text (a
lone UTF-16 surrogate, which a \\ud800 escape makes and which has no UTF-8 form)."""

from __future__ import annotations

import json
import math
import re

import numpy as np

from .api_errors import APIError, bad_request

MAX_JSON_DEPTH = 64  # a real request nests 4 deep (messages, a message, content parts, a part)

# Escapes (a backslash and the character after it) go first, so that what is left of a string
# literal is a quote, anything but a quote, and a quote; an unterminated one runs to the end.
# Neither pattern can backtrack: the scan is linear whatever the input.
_ESCAPE = re.compile(r"\\[\s\S]")
_STRING = re.compile(r'"[^"]*(?:"|\Z)')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # (also the escapes of a valid pair, which json joins)


def json_depth(text: str) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings do not
    count), in linear time and without recursion: escapes, strings and everything that is not a
    bracket are cut out by regular expressions, and the depth is a cumulative sum."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", _ESCAPE.sub("", text)))
    if not brackets:
        return 0
    codes = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


class _NonFinite:
    """Stands, in a parsed body, for a number that is not finite, until it is found and named."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH):
    """A request body as JSON, or a 400: malformed, nested deeper than `max_depth` (refused before
    parsing: Python's json module recurses, and a deep enough body would end in a RecursionError),
    or holding a number that is not finite anywhere (NaN, Infinity, -Infinity, which Python's json
    module accepts although JSON has no such literals, or a number like 1e999 that overflows to
    infinity), which would otherwise reach the sampler."""
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # as json.loads(bytes) does
    except UnicodeDecodeError as e:
        raise _invalid_json(e) from None
    depth = json_depth(text)
    if depth > max_depth:
        raise bad_request(f"The JSON body nests {depth} levels deep; this server accepts at most {max_depth}.",
                          code="invalid_json")
    found = []

    def constant(name: str):  # NaN, Infinity, -Infinity
        found.append(name)
        return _NonFinite(name)

    def number(literal: str):
        value = float(literal)
        if math.isfinite(value):
            return value
        found.append(literal)
        return _NonFinite(literal)

    try:
        body = json.loads(text, parse_constant=constant, parse_float=number)
    except ValueError as e:  # JSONDecodeError; an integer of more than 4300 digits
        raise _invalid_json(e) from None
    # (text first: a name or message built from a key that is not text could not be sent back)
    if _SURROGATE_ESCAPE.search(text) or _SURROGATE.search(text):
        lone = _find(body, lambda v: isinstance(v, str) and _SURROGATE.search(v) is not None)
        if lone is not None:
            path, value, is_key = lone
            char = _SURROGATE.search(value).group()
            where = (f"a key of '{path}'" if path else "a key") if is_key else f"'{path}'" if path else "the body"
            raise bad_request(f"{where} holds a lone UTF-16 surrogate (\\u{ord(char):04x}), which is not text; "
                              "strings must be valid Unicode.", path or None)
    if found:
        path, value, _key = _find(body, lambda v: isinstance(v, _NonFinite))
        raise bad_request(f"'{path}' is {value.text}; numbers must be finite (JSON has no NaN or Infinity, and "
                          f"this server takes no number beyond ±1.8e308).", path or None)
    return body


def _invalid_json(e: Exception) -> "APIError":
    return bad_request(f"We could not parse the JSON body of your request: {e}", code="invalid_json")


def _find(body, is_it):
    """(path, value, is_key) of the first value, or key (then path is its object's), of the body
    that is_it, None if none; the path as in `param`: messages[0].content. Iterative: the depth is
    already bounded, but no recursion is needed."""
    stack = [("", body)]
    while stack:
        path, value = stack.pop()
        if is_it(value):
            return path, value, False
        if isinstance(value, dict):
            for key in value:
                if is_it(key):
                    return path, key, True
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return None
