"""Serving: a continuous-batching engine (:mod:`.engine`, usable from Python) and the OpenAI-compatible HTTP server
built on it (:mod:`.api`, :mod:`.protocol`; the command is :mod:`qjax.cli.serve`)."""

from .engine import (
    Engine,
    EngineConfig,
    EngineError,
    ImageInput,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    encode_images,
)

__all__ = ["Engine", "EngineConfig", "EngineError", "ImageInput", "RequestOutput", "SamplingParams", "TokenLogprob",
           "encode_images"]
