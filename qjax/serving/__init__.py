"""Serving: a continuous-batching engine (:mod:`.engine`, usable from Python) and the OpenAI-compatible HTTP server
built on it (``qjax serve``: :mod:`.api`, :mod:`.protocol`, :mod:`.cli`)."""

from .engine import Engine, EngineConfig, EngineError, RequestOutput, SamplingParams, TokenLogprob

__all__ = ["Engine", "EngineConfig", "EngineError", "RequestOutput", "SamplingParams", "TokenLogprob"]
