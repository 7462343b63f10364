"""`dllama serve`: an OpenAI-compatible HTTP API (chat completions, completions, models, health,
Prometheus metrics) and a chat page (static/) in front of an Engine."""

from .app import attach, bound_port, make_app, start_server
from .state import ServerConfig

__all__ = ["ServerConfig", "attach", "bound_port", "make_app", "start_server"]
