"""ninfer: a single-GPU LLM inference engine and server."""

__version__ = "0.1.0"
