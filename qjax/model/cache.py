"""Generation cache: pre-allocated K/V for full-attention layers, conv window + fp32 delta-rule state for GDN layers.

Layers are stored the way the model scans them: one entry per position in the repeating layer group, each with a
leading ``groups`` axis. Every row keeps its own length (the next slot it writes), so rows may sit at different
positions: left-padded batches (``qjax.generate``: every row ends at the same slot, pads hold no valid key) and the
serving engine's slot pool (each row one sequence, prefilled in right-padded chunks) use the same cache.
``key_valid`` remembers which slots hold real tokens and ``positions`` the next RoPE position of each row.

The model addresses the cache by (layer group, row, slot): a forward may read and write any subset of rows in
place (``rows``; out-of-range entries are padding, read clamped and never written), which is how the engine decodes
its running sequences and prefills new ones inside one pool. The helpers below are the only code that indexes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from qjax.kernels import accum_dtype, indexing
from qjax.model.config import FULL, TextConfig


# Compiled programs are keyed by the cache's shape. Sized exactly T + max_new_tokens, every prompt length and every
# max_new_tokens had its own prefill and decode loop (seconds of compile each on CPU; the test suite compiled ~70
# decode loops). Whole blocks of 128 positions let them share programs; the extra slots are masked keys (< 128 per
# row: ≤ 2.6 MB of bf16 K/V in the real model's 10 attention layers) that every decode step's attention reads too:
# a mid-config CPU generate of 64 tokens after 32 took 1–3 % longer than with an exactly sized cache (3.3 % with
# 256-slot blocks; a tiny model +8–10 % with 256, within noise with 128).
CACHE_GRANULE = 128


def cache_length(prompt_len: int, new_tokens: int) -> int:
    """The cache length generation allocates for ``prompt_len`` tokens plus ``new_tokens`` more: the next multiple
    of :data:`CACHE_GRANULE` (``qjax.generate``, speculative decoding, the bench and its AOT programs)."""
    need = int(prompt_len) + int(new_tokens)
    return -(-need // CACHE_GRANULE) * CACHE_GRANULE


@struct.dataclass
class GDNState:
    conv: jnp.ndarray  # [G, B, K-1, conv_dim] last pre-conv inputs (only K-1 influence the next output), model dtype
    recurrent: jnp.ndarray  # [G, B, Hv, Dk, Dv] float32 (float64 model: float64) — bf16 corrupts long decodes
    # speculative decoding (a cache made with spec_tokens = n): a verify call of n tokens (forward(keep_steps=True))
    # leaves here the state after each of its tokens and its widened conv input, so that :meth:`Cache.accept` can
    # roll every row back to its last accepted token without running the layer again (vLLM keeps per-position
    # state slots the same way)
    steps: jnp.ndarray | None = None  # [G, B, n, Hv, Dk, Dv]: the recurrent state after verify token i
    conv_steps: jnp.ndarray | None = None  # [G, B, K-1+n, conv_dim]: the window before the call, then its n inputs


@struct.dataclass
class KVState:
    k: jnp.ndarray  # [G, B, Hkv, S, D] keys after k_norm and RoPE (heads before slots: attention's matmul layout)
    v: jnp.ndarray  # [G, B, Hkv, S, D]


@struct.dataclass
class Cache:
    slots: tuple  # one GDNState or KVState per position of the layer period
    key_valid: jnp.ndarray  # [B, S] bool: slot s holds a real (non-pad) token
    positions: jnp.ndarray  # [B] int32: RoPE position of the next real token of each row
    lengths: jnp.ndarray  # [B] int32: slots used by each row; its next token is written at slot lengths[b]

    @property
    def max_len(self) -> int:
        return self.key_valid.shape[1]

    @property
    def batch_size(self) -> int:
        return self.key_valid.shape[0]

    @classmethod
    def init(cls, cfg: TextConfig, layer_kinds: tuple[str, ...], batch: int, max_len: int, dtype,
             kv_dtype=None, spec_tokens: int = 0) -> "Cache":
        """Empty cache for a model whose repeating layer group is ``layer_kinds`` (use ``model.init_cache``);
        ``spec_tokens`` > 0: with the per-token GDN buffers of verify calls of that many tokens (``GDNState.steps``)."""
        g = cfg.num_hidden_layers // len(layer_kinds)
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        slots = []
        for kind in layer_kinds:
            if kind == FULL:
                shape = (g, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
                slots.append(KVState(k=jnp.zeros(shape, kv_dtype), v=jnp.zeros(shape, kv_dtype)))
            else:
                conv = jnp.zeros((g, batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype)
                rec = jnp.zeros((g, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                 cfg.linear_value_head_dim), accum_dtype(dtype))
                steps = conv_steps = None
                if spec_tokens:
                    steps = jnp.zeros((g, batch, spec_tokens, *rec.shape[2:]), rec.dtype)
                    conv_steps = jnp.zeros((g, batch, cfg.linear_conv_kernel_dim - 1 + spec_tokens, cfg.conv_dim),
                                           dtype)
                slots.append(GDNState(conv=conv, recurrent=rec, steps=steps, conv_steps=conv_steps))
        return cls(slots=tuple(slots), key_valid=jnp.zeros((batch, max_len), bool),
                   positions=jnp.zeros((batch,), jnp.int32), lengths=jnp.zeros((batch,), jnp.int32))

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))

    def prefix(self, n: int) -> "Cache":
        """A copy of the first ``n`` rows (``n`` static)."""
        return Cache(slots=jax.tree.map(lambda x: x[:, :n], self.slots), key_valid=self.key_valid[:n],
                     positions=self.positions[:n], lengths=self.lengths[:n])

    def with_prefix(self, part: "Cache") -> "Cache":
        """This cache with its first rows replaced by ``part`` (from :meth:`prefix`; in place under jit)."""
        put = lambda x, y, axis: jax.lax.dynamic_update_slice_in_dim(x, y, 0, axis)  # noqa: E731
        return Cache(slots=jax.tree.map(lambda x, y: put(x, y, 1), self.slots, part.slots),
                     key_valid=put(self.key_valid, part.key_valid, 0), positions=put(self.positions, part.positions, 0),
                     lengths=put(self.lengths, part.lengths, 0))

    def accept(self, consumed: jnp.ndarray, active: jnp.ndarray | None = None) -> "Cache":
        """After a verify call of n tokens (``forward(keep_steps=True)``): keep only the first ``consumed[b]`` (1..n)
        of them in row b — its GDN conv window and recurrent state become those after its last kept token (read
        from ``GDNState.steps``), its length and position step back, and the K/V slots of the dropped tokens stop
        being valid keys (the next call overwrites them anyway).

        ``consumed``: ``[B]`` int32. ``active``: ``[B]`` bool, the rows that took the whole call (None: all); the
        others were masked out of it entirely and keep the cache as the call left it (unchanged)."""
        slots, n = [], None
        for s in self.slots:
            if isinstance(s, KVState):
                slots.append(s)
                continue
            if s.steps is None:
                raise ValueError("Cache.accept needs a cache made with spec_tokens (GDNState.steps)")
            n = s.steps.shape[2]
            b = jnp.arange(s.steps.shape[1])
            recurrent = s.steps[:, b, consumed - 1]  # [G, B, Hv, Dk, Dv]
            k1 = s.conv.shape[2]
            at = consumed[:, None] + jnp.arange(k1)[None, :]  # [B, K-1]: the window ends after the last kept input
            conv = jnp.take_along_axis(s.conv_steps, at[None, :, :, None], axis=2)
            if active is not None:
                recurrent = jnp.where(active[None, :, None, None, None], recurrent, s.recurrent)
                conv = jnp.where(active[None, :, None, None], conv, s.conv)
            slots.append(s.replace(conv=conv, recurrent=recurrent))
        dropped = n - consumed if active is None else jnp.where(active, n - consumed, 0)
        lengths = self.lengths - dropped
        key_valid = self.key_valid & (jnp.arange(self.max_len)[None, :] < lengths[:, None])
        return Cache(slots=tuple(slots), key_valid=key_valid, positions=self.positions - dropped, lengths=lengths)

    def reset_rows(self, rows: jnp.ndarray) -> "Cache":
        """The cache with rows ``rows [n]`` emptied (no valid key, length and position 0, zero GDN states): a new
        sequence starts there. Out-of-range entries are ignored. K/V slots are not cleared: ``key_valid`` hides them."""
        slots = tuple(s if isinstance(s, KVState) else s.replace(conv=s.conv.at[:, rows].set(0, mode="drop"),
                                                                  recurrent=s.recurrent.at[:, rows].set(0, mode="drop"))
                      for s in self.slots)
        return Cache(slots=slots, key_valid=self.key_valid.at[rows].set(False, mode="drop"),
                     positions=self.positions.at[rows].set(0, mode="drop"),
                     lengths=self.lengths.at[rows].set(0, mode="drop"))


# ---------------------------------------------------------------------------------------------------------------------
# row-addressed access (the model's layers read and write their cache entries only through these)
# ---------------------------------------------------------------------------------------------------------------------
# ``rows`` says which cache rows a batch's rows are: None (all rows, in order), an int ``b`` (the first b rows: read
# by slicing and written by dynamic-update-slice, in place) or an int32 array ``[b]`` of row indices (any rows, any
# order; out-of-range entries are padding rows: read clamped, never written). Arrays cost a gather and a scatter
# per layer; the serving engine decodes a prefix of rows (its running sequences kept in the lowest slots) and
# prefills with index arrays.
Rows = jnp.ndarray | int | None


def gather_rows(x: jnp.ndarray, rows: Rows) -> jnp.ndarray:
    """``x [B, …]`` at ``rows`` → ``[b, …]``."""
    if rows is None:
        return x
    if isinstance(rows, int):
        return x[:rows]
    return x.at[rows].get(mode="clip")


def scatter_rows(x: jnp.ndarray, rows: Rows, value: jnp.ndarray) -> jnp.ndarray:
    """``x [B, …]`` with ``value [b, …]`` written at ``rows``."""
    if rows is None:
        return value
    if isinstance(rows, int):
        return jax.lax.dynamic_update_slice_in_dim(x, value.astype(x.dtype), 0, 0)
    return x.at[rows].set(value, mode="drop")


def read_layer(stack: jnp.ndarray, group, rows: Rows, slots: int | None = None) -> jnp.ndarray:
    """Layer ``group`` of a ``[G, B, …]`` cache stack at ``rows`` → ``[b, …]``; ``slots``: of a K/V stack
    ``[G, B, H, S, D]`` only the first ``slots`` slots. An index array is one gather of just those rows (slicing the
    layer out first would copy all B rows of it)."""
    if rows is None or isinstance(rows, int):
        size = list(stack.shape)
        size[0] = 1
        if rows is not None:
            size[1] = rows
        if slots is not None:
            size[3] = slots
        return jax.lax.dynamic_slice(stack, indexing.start(group, stack.ndim), size, allow_negative_indices=False)[0]
    if slots is None:
        return stack.at[group, rows].get(mode="clip")
    return stack.at[group, rows, :, :slots].get(mode="clip")


def write_layer(stack: jnp.ndarray, group, rows: Rows, value: jnp.ndarray) -> jnp.ndarray:
    """``stack [G, B, …]`` with layer ``group``'s ``rows`` replaced by ``value [b, …]`` (in place under jit)."""
    value = value.astype(stack.dtype)
    if rows is None or isinstance(rows, int):
        return indexing.put(stack, group, value)
    return stack.at[group, rows].set(value, mode="drop")


def write_tokens(stack: jnp.ndarray, group, rows: Rows, slots: jnp.ndarray, value: jnp.ndarray) -> jnp.ndarray:
    """A K/V stack ``[G, B, H, S, D]`` with ``value [b, T, H, D]`` written at layer ``group``, row ``rows[i]``, slot
    ``slots[i, t]``; slots ≥ S (padding tokens) and out-of-range rows are dropped."""
    b, t = slots.shape
    r = jnp.arange(b, dtype=jnp.int32) if rows is None or isinstance(rows, int) else rows
    r = jnp.broadcast_to(r[:, None], (b, t))
    # advanced indices split by a slice put their [b, T] dims first: the update is [b, T, H, D]
    return stack.at[group, r, :, slots].set(value.astype(stack.dtype), mode="drop")
