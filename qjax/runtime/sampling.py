"""Token sampling, one definition for every generation path: temperature → top-k → top-p as transformers' warpers do
them, then a seeded categorical draw (or argmax when greedy).

Settings are per row and live on the device (:class:`SamplingArrays`), so one compiled program serves any mix of
requests: ``qjax.generate`` broadcasts its one setting to every row, the serving engine gives each sequence its own.
A row's draw depends only on its own logits and key, so a sequence samples the same tokens alone or in any batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qjax.kernels import accum_dtype

# Temperatures above this sample as this one does. At 1e30 the draw is already uniform over the kept tokens for any
# logit below ~1e22 (x / T vanishes beside the Gumbel noise in float32) and x / T still orders the logits, so top-k
# and top-p keep what they should; larger ones flush x / T to zero (ties: top_k=20 kept 901 of 1000 tokens at 1e38)
# and past float32's largest number T becomes inf. So the clamp changes no draw a larger temperature was meant to give.
MAX_TEMPERATURE = 1e30
INT32_MAX = (1 << 31) - 1


@struct.dataclass
class SamplingArrays:
    """Per-row sampling settings ``[B]`` (on the device)."""

    do_sample: jnp.ndarray  # bool: False = greedy (argmax of the raw logits)
    temperature: jnp.ndarray  # float32 (> 0 when sampling)
    top_k: jnp.ndarray  # int32, 0 = off
    top_p_cut: jnp.ndarray  # float32 ``1 − top_p`` computed in float64 on the host (0 = off), see below

    @classmethod
    def make(cls, do_sample, temperature, top_k, top_p) -> "SamplingArrays":
        """From per-row host values (sequences or scalars broadcast by numpy). ``1 − top_p`` is formed in float64
        and rounded once, as Python does for a float threshold, so a row filters exactly like the scalar path.
        Temperatures above :data:`MAX_TEMPERATURE` and top-k above int32's largest (k ≥ the vocabulary: off either
        way) are clamped, never wrapped; a top-k beyond int64 raises OverflowError."""
        do_sample, temperature, top_k, top_p = np.broadcast_arrays(
            np.asarray(do_sample, bool), np.minimum(np.asarray(temperature, np.float64), MAX_TEMPERATURE),
            np.minimum(np.asarray(top_k, np.int64), INT32_MAX), np.asarray(top_p, np.float64))
        # converted on the host and copied: ``jnp.asarray`` of a host array would trace a small conversion program
        # for every new shape (a server's first request of each batch size would compile)
        put = jax.device_put
        return cls(do_sample=put(do_sample), temperature=put(temperature.astype(np.float32)),
                   top_k=put(top_k.astype(np.int32)), top_p_cut=put((1.0 - top_p).astype(np.float32)))

    @classmethod
    def zeros(cls, batch: int) -> "SamplingArrays":
        return cls.make(np.zeros(batch, bool), 1.0, 0, 1.0)


def filter_logits(logits: jnp.ndarray, params: SamplingArrays) -> jnp.ndarray:
    """Temperature → top-k → top-p per row (transformers' processor order); removed entries become -inf.

    ``logits [B, V]`` → ``[B, V]`` in the logits' accumulation dtype (float32; a float64 model's logits stay
    float64). A setting that is off leaves the row bit for bit unchanged (dividing by a temperature of 1 is exact;
    top-k with k = 0 or k ≥ V and top-p with p = 1 select nothing).
    """
    acc = accum_dtype(logits.dtype)
    x = logits.astype(acc) / params.temperature[:, None].astype(acc)
    v = x.shape[-1]
    k = params.top_k
    kth = jnp.take_along_axis(jnp.sort(x, axis=-1), jnp.clip(v - k, 0, v - 1)[:, None], axis=-1)
    x = jnp.where(((k > 0) & (k < v))[:, None] & (x < kth), -jnp.inf, x)
    # top-p as transformers: ascending sort, cumulative softmax, drop the mass ≤ 1 − p, always keep the top token
    order = jnp.argsort(x, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(jnp.take_along_axis(x, order, axis=-1), axis=-1), axis=-1)
    cut = params.top_p_cut[:, None]
    remove = (cum <= cut).at[:, -1].set(False)
    remove = jnp.zeros_like(remove).at[jnp.arange(x.shape[0])[:, None], order].set(remove)
    return jnp.where((cut > 0) & remove, -jnp.inf, x)


def sample(logits: jnp.ndarray, keys: jax.Array, params: SamplingArrays) -> jnp.ndarray:
    """One token per row: argmax of the raw logits (greedy rows; first index on ties, like torch) or a draw from
    the filtered distribution with the row's own key. ``logits [B, V]``, ``keys [B]`` → ``[B]`` int32.

    The filter runs only when some row samples (a runtime branch, not another compiled program)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        x = filter_logits(logits, params)
        drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, x).astype(jnp.int32)
        return jnp.where(params.do_sample, drawn, greedy)

    return jax.lax.cond(jnp.any(params.do_sample), draw, lambda _: greedy, None)


def split_keys(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``keys [B]`` → (the keys to keep, the subkeys to draw with): ``jax.random.split`` per row."""
    both = jax.vmap(jax.random.split)(keys)
    return both[:, 0], both[:, 1]


# seeds: the int64 range (an HTTP request's, as vLLM's) widened to uint64's top, so that a server's ``seed + j`` for a
# request's n choices stays in range from any int64 seed
SEED_MIN, SEED_END = -(1 << 63), 1 << 64


def seed_key_data(seed: int) -> np.ndarray:
    """A seed's threefry key data ``[2]`` uint32, made on the host: the seed's 64 bits (two's complement, i.e. the
    seed modulo 2⁶⁴), high word first. That is ``jax.random.key(seed)`` for seeds in [0, 2³²), and for every int64
    seed under jax_enable_x64 (without it jax keeps only the low 32 bits, so 5 and 2³² + 5 would draw alike); −1 and
    2⁶⁴ − 1 are one seed. The same in either mode, and no device call. A seed outside [−2⁶³, 2⁶⁴) is a ValueError."""
    if not SEED_MIN <= int(seed) < SEED_END:
        raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_END}), got {seed}")
    u = int(seed) % (1 << 64)
    return np.array([u >> 32, u & 0xFFFFFFFF], np.uint32)


def seed_key(seed: int) -> jax.Array:
    """The PRNG key of a seed (:func:`seed_key_data`): what ``qjax.generate`` and the serving engine both draw from."""
    return jax.random.wrap_key_data(seed_key_data(seed))


@jax.jit
def _kept_key(key_data, n):
    return jax.random.key_data(jax.lax.fori_loop(0, n, lambda i, k: split_keys(k)[0], jax.random.wrap_key_data(
        key_data)))


def kept_key_data(key_data: np.ndarray, n: int) -> np.ndarray:
    """``key_data [2]`` uint32 after ``n`` draws: the key :func:`split_keys` keeps, ``n`` times over (what a row
    holds after drawing n times from that key)."""
    return np.asarray(_kept_key(np.asarray(key_data, np.uint32)[None], np.int32(n)))[0]


def token_logprobs(logits: jnp.ndarray, tokens: jnp.ndarray, k: int) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Log-probabilities from the raw logits (before any sampling setting, as vLLM reports them).

    ``logits [..., V]``, ``tokens [...]`` → (``[...]`` log p(token), top-``k`` ids ``[..., k]`` int32, their log
    p ``[..., k]``); ``k = 0`` gives empty top arrays."""
    logp = jax.nn.log_softmax(logits.astype(accum_dtype(logits.dtype)), axis=-1)
    lp = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if k == 0:
        empty = jnp.zeros((*lp.shape, 0), logp.dtype)
        return lp, empty.astype(jnp.int32), empty
    top_lp, top_ids = jax.lax.top_k(logp, k)
    return lp, top_ids.astype(jnp.int32), top_lp
