"""Generation cache: pre-allocated K/V for full-attention layers, conv window + fp32 delta-rule state for GDN layers.

Layers are stored the way the model scans them: one entry per position in the repeating layer group, each with a
leading ``groups`` axis. All rows of a batch share one write index (prompts are left-padded so they end together);
``key_valid`` remembers which slots hold real tokens and ``positions`` the next RoPE position of each row.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from .config import FULL, TextConfig


@struct.dataclass
class GDNState:
    conv: jnp.ndarray  # [G, B, K-1, conv_dim] last pre-conv inputs (only K-1 influence the next output), model dtype
    recurrent: jnp.ndarray  # [G, B, Hv, Dk, Dv] float32 — bf16 corrupts long decodes


@struct.dataclass
class KVState:
    k: jnp.ndarray  # [G, B, S, Hkv, D] keys after k_norm and RoPE
    v: jnp.ndarray  # [G, B, S, Hkv, D]


@struct.dataclass
class Cache:
    slots: tuple  # one GDNState or KVState per position of the layer period
    key_valid: jnp.ndarray  # [B, S] bool: slot s holds a real (non-pad) token
    positions: jnp.ndarray  # [B] int32: RoPE position of the next real token of each row
    index: jnp.ndarray  # [] int32: next slot to write (shared by all rows)

    @property
    def max_len(self) -> int:
        return self.key_valid.shape[1]

    @property
    def batch_size(self) -> int:
        return self.key_valid.shape[0]

    @classmethod
    def init(cls, cfg: TextConfig, layer_kinds: tuple[str, ...], batch: int, max_len: int, dtype,
             kv_dtype=None) -> "Cache":
        """Empty cache for a model whose repeating layer group is ``layer_kinds`` (use ``model.init_cache``)."""
        g = cfg.num_hidden_layers // len(layer_kinds)
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        slots = []
        for kind in layer_kinds:
            if kind == FULL:
                shape = (g, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
                slots.append(KVState(k=jnp.zeros(shape, kv_dtype), v=jnp.zeros(shape, kv_dtype)))
            else:
                conv = jnp.zeros((g, batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype)
                rec = jnp.zeros((g, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                 cfg.linear_value_head_dim), jnp.float32)
                slots.append(GDNState(conv=conv, recurrent=rec))
        return cls(slots=tuple(slots), key_valid=jnp.zeros((batch, max_len), bool),
                   positions=jnp.zeros((batch,), jnp.int32), index=jnp.zeros((), jnp.int32))

    def nbytes(self) -> int:
        import jax
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))
