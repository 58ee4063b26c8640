"""The static description of a packed (or dense) weight that every kernel takes: its format, bit width, grouping and
shapes. Hashable, so it is part of a module's graph (not of its state) and a jit static argument."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class QuantMeta:
    """Static description of a packed weight (hashable: part of the module graph, not of its state)."""

    fmt: str  # "int" | "mxfp8" | "dense" (unquantized: bits = the float's width, no scales)
    bits: int  # 2, 4, 8
    group_size: int  # columns per scale (K for channel / tensor strategies)
    in_features: int  # K (the packed rows may carry padding past it)
    out_features: int  # N
    symmetric: bool = True
    strategy: str = "group"  # "group" | "channel" (group_size = K) | "tensor" (one scale, stored [1, 1])
    scale_dtype: str = "bfloat16"  # dtype of the stored scales ("uint8" E8M0 for MXFP8)

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    @property
    def packed_cols(self) -> int:
        return -(-self.in_features * self.bits // 32) if self.fmt == "int" else self.in_features

    @property
    def num_groups(self) -> int:
        return -(-self.in_features // self.group_size)

    @property
    def scale_shape(self) -> tuple[int, int]:
        return (1, 1) if self.strategy == "tensor" else (self.out_features, self.num_groups)


def dense_meta(n: int, k: int, dtype) -> QuantMeta:
    """The static description of an unquantized ``[N, K]`` weight of ``dtype`` (``fmt="dense"``: the weight array
    itself, no scales), so that dense weights go through the same kernels as packed ones."""
    return QuantMeta("dense", 8 * jnp.dtype(dtype).itemsize, k, k, n, strategy="channel",
                     scale_dtype=jnp.dtype(dtype).name)
