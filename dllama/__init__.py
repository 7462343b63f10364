"""dllama: distributed LLM inference for weak devices."""

__version__ = "0.1.0"
