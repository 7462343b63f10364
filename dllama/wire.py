"""What every message between nodes is built on: a typed, frozen msgspec struct with one encoder
(`to_wire`, a msgpack-ready map) and one decoder (`from_wire`, which checks types, ranges and
lengths before any field is used, and names the field that fails)."""

from __future__ import annotations

import math
from typing import TypeVar

import msgspec

from .errors import DllamaError

W = TypeVar("W", bound="WireStruct")


class InvalidMessage(DllamaError):
    """A control message with a field missing, of the wrong type, out of range or inconsistent."""


class WireStruct(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    def to_wire(self) -> dict:
        """The msgpack-ready map (bytes stay bytes: msgpack carries them as they are)."""
        return msgspec.to_builtins(self, builtin_types=(bytes,))

    @classmethod
    def from_wire(cls: type[W], body, kind: str) -> W:
        """`body` (a decoded msgpack map of a frame of kind `kind`) checked against this schema."""
        try:
            return msgspec.convert(body, cls)
        except msgspec.ValidationError as e:
            raise InvalidMessage(f"invalid {kind}: {e}") from None


def finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, not {value}")
