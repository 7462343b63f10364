"""Errors a user can cause or meet. The CLI prints any of them as one line and exits non-zero."""


class DllamaError(Exception):
    """Base: a clear, one-line, user-facing error."""

    exit_code = 1


class ModelError(DllamaError):
    """A model file that is missing, malformed or unsupported."""


class ContextOverflow(DllamaError):
    """A prompt (or prompt + generation) longer than the context window."""


class NetworkError(DllamaError):
    """A peer that is unreachable, speaks another protocol, sends a bad frame, dies or hangs."""
