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


# --- network errors: each names the peer (rank, host:port) it concerns -------------------------


class PeerError(NetworkError):
    """A network error about one peer. `peer` is a `dllama.net.PeerRef` (rank, host, port) or None."""

    def __init__(self, message: str, peer=None):
        self.peer = peer
        self.reason = message
        super().__init__(f"{peer}: {message}" if peer is not None else message)

    @property
    def peer_rank(self):
        return getattr(self.peer, "rank", None)


class PeerUnreachable(PeerError):
    """Connection refused, host unreachable, or no answer to the connect in time."""


class VersionMismatch(PeerError):
    """The peer speaks another wire-protocol version."""


class AuthError(PeerError):
    """The shared-secret challenge failed (wrong or missing secret on one side)."""


class ProtocolError(PeerError):
    """A well-formed frame that is not what the protocol allows here (wrong kind, session, rank,
    or ranks that disagree on which collective they are running)."""


class MalformedFrame(ProtocolError):
    """Bytes that are not a valid frame: bad magic, unknown kind, oversized length, bad body."""


class PeerClosed(PeerError):
    """The peer closed the connection or died (EOF / reset) while we still needed it.
    `orderly`: it said goodbye first (a clean shutdown, not a crash)."""

    def __init__(self, message: str, peer=None, orderly: bool = False):
        super().__init__(message, peer)
        self.orderly = orderly


class PeerTimeout(PeerError):
    """The peer sent nothing for longer than the configured timeout (stopped, hung, or cut off)."""


class PeerAborted(PeerError):
    """The peer gave up on a collective because of a failure elsewhere; the message says where."""
