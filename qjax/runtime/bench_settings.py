"""What ``qjax bench`` times, declared without JAX: the flags of ``qjax bench`` take their defaults from here while
``qjax --help`` stays free of the library (:mod:`.bench` runs them)."""

from __future__ import annotations

import dataclasses

# the recipes ``--recipe all`` runs
RECIPES = ("bf16", "w2w4", "w8a16-g32", "mxfp8-experts")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What to time. Prefill shapes are ``(batch, tokens)``; decode runs ``new_tokens`` steps after a ``context``-token
    prompt at each batch; TTFT is batch 1 at the first prefill length."""

    prefill: tuple[tuple[int, int], ...] = ((1, 2048), (8, 512))
    decode_batches: tuple[int, ...] = (1, 8, 64)
    context: int = 512
    new_tokens: int = 64
    repeats: int = 5
    baseline: bool = True
    seed: int = 0

    def __post_init__(self):
        for b, t in self.prefill:
            if b < 1 or t < 1:
                raise ValueError(f"prefill shape {b}x{t}: batch and tokens must be ≥ 1")
        if not self.prefill and not self.decode_batches:
            raise ValueError("nothing to time: give prefill shapes or decode batches")
        if any(b < 1 for b in self.decode_batches):
            raise ValueError(f"decode batches must be ≥ 1, got {self.decode_batches}")
        if self.context < 1 or self.new_tokens < 1 or self.repeats < 1:
            raise ValueError(f"context ({self.context}), new_tokens ({self.new_tokens}) and repeats "
                             f"({self.repeats}) must be ≥ 1")
