"""Serving: a continuous-batching engine (:mod:`.engine`, usable from Python) and the OpenAI-compatible HTTP server
built on it (:mod:`.api`, :mod:`.protocol`; the command is :mod:`qjax.cli.serve`)."""

from .engine import Engine, EngineConfig, EngineError, RequestOutput, SamplingParams, TokenLogprob

__all__ = ["Engine", "EngineConfig", "EngineError", "RequestOutput", "SamplingParams", "TokenLogprob"]
