"""The vision tower of ``qwen3_5_moe`` (transformers' ``Qwen3_5MoeVisionModel``, docs/model.md §6.4), in Flax NNX.

    x   = Conv3d(patches) + bilinear(pos_embed grid → image grid)          # [N, D], N patches of every image
    for each block:  x += proj(attn_within_image(rope2d(qkv(LN1(x)))));  x += fc2(gelu_tanh(fc1(LN2(x))))
    out = fc2(gelu(fc1(group4(LN(x)))))                                     # [N / 4, text hidden]

Patches arrive as the image processor flattens them (:mod:`qjax.multimodal.images`): each image's patches in 2×2
merge-block order, images one after another. Everything that depends on the images' grids — the position-embedding
interpolation taps, the 2-D rotary positions, which image each patch belongs to — is computed on the host in numpy
(:func:`vision_layout`), as transformers' ``vision_utils`` does, so one compiled program serves every mix of image
sizes whose total patch count falls in the same bucket (:func:`patch_bucket`: two per doubling).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.kernels import accum_dtype
from qjax.model.config import VisionConfig
from qjax.model.layers import init_normal

# Above this many patches attention runs query block by query block (scores [heads, block, N] instead of
# [heads, N, N]: 1 GiB of float32 scores for one 1024×1024 image at the 35B's 16 heads); blocks of up to 512 queries.
ATTENTION_WHOLE = 2048
ATTENTION_BLOCK = 512


# ---------------------------------------------------------------------------------------------------------------------
# host-side layout of a batch of images
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class VisionLayout:
    """Per-patch arrays for one call, padded to ``bucket`` patches (pads: segment -1, weights 0).

    interp_index: ``[N, 4]`` int32 rows of ``pos_embed`` each patch interpolates from (bilinear taps);
    interp_weight: ``[N, 4]`` float32 their weights; rope_position: ``[N, 2]`` int32 (row, column) of each patch;
    segment: ``[N]`` int32 the image each patch belongs to (attention stays within an image).
    """

    interp_index: np.ndarray
    interp_weight: np.ndarray
    rope_position: np.ndarray
    segment: np.ndarray
    patches: int  # real patches (the rest is padding)

    @property
    def bucket(self) -> int:
        return int(self.segment.shape[0])


def patch_bucket(n: int, merge_unit: int = 4) -> int:
    """The padded patch count a call of ``n`` patches compiles for: the smallest ``m·2^e ≥ n`` with m in {2, 3}
    (64, 96, 128, 192, 256, …: at most 50 % padding, two compiled programs per doubling of the image area — few
    enough that a server compiles every size it can meet before it is ready), at least 64, rounded up to a multiple
    of the merge unit (a no-op for the 2×2 merge)."""
    n = max(int(n), 64)
    e = max(n.bit_length() - 2, 0)
    size = -(-n // (1 << e)) << e
    return -(-size // merge_unit) * merge_unit


def patch_buckets(most: int, merge_unit: int = 4) -> list[int]:
    """Every :func:`patch_bucket` a call of at most ``most`` patches can land in, smallest first."""
    out = [patch_bucket(1, merge_unit)]
    while out[-1] < most:
        out.append(patch_bucket(out[-1] + 1, merge_unit))
    return out


def _query_block(n: int) -> int:
    """Queries per attention block for ``n`` patches: all of them up to :data:`ATTENTION_WHOLE`, else the largest
    power of two ≤ :data:`ATTENTION_BLOCK` that divides n (a :func:`patch_bucket` size past 2048 is a multiple of
    256)."""
    if n <= ATTENTION_WHOLE:
        return n
    block = ATTENTION_BLOCK
    while n % block:
        block //= 2
    return block if block >= 64 else n


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (``align_corners=True``) of target ``index`` on an axis of ``size`` into a ``side`` table, in
    ``dtype``: float32 as transformers' ``_interpolation_axis_taps_weights`` forms them (float64 for a float64
    tower)."""
    src = index.astype(dtype) * dtype(side - 1) / np.maximum(size - 1, 1).astype(dtype)
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weights = np.maximum(dtype(1) - np.abs(src[:, None] - floor[:, None] - offsets.astype(dtype)), dtype(0))
    return taps, weights.astype(dtype)


def vision_layout(grid_thw, cfg: VisionConfig, bucket: int | None = None, dtype=np.float32) -> VisionLayout:
    """The :class:`VisionLayout` of images with grids ``grid_thw [n, 3]`` (temporal, height, width in patches);
    interpolation weights in ``dtype``."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    merge, side = cfg.spatial_merge_size, cfg.grid_side
    index, weight, rope, segment = [], [], [], []
    for i, (t, h, w) in enumerate(grid.tolist()):
        if h % merge or w % merge or min(t, h, w) < 1:
            raise ValueError(f"image {i}: grid {[t, h, w]} is not a positive multiple of the merge size {merge}")
        # patch order within a frame: (block row, block column, row in block, column in block)
        rows = np.arange(h).reshape(h // merge, 1, merge, 1)
        cols = np.arange(w).reshape(1, w // merge, 1, merge)
        row = np.broadcast_to(rows, (h // merge, w // merge, merge, merge)).reshape(-1)
        col = np.broadcast_to(cols, (h // merge, w // merge, merge, merge)).reshape(-1)
        ht, hw = _axis_taps(row, np.int64(h), side, dtype)
        wt, ww = _axis_taps(col, np.int64(w), side, dtype)
        idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
        wgt = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
        # every frame of a clip repeats the still image's layout; frames attend separately (one segment each)
        for f in range(t):
            index.append(idx)
            weight.append(wgt)
            rope.append(np.stack([row, col], axis=-1))
            segment.append(np.full(h * w, len(segment), np.int32))
    n = int(sum(len(s) for s in segment))
    bucket = patch_bucket(n, cfg.merge_unit) if bucket is None else int(bucket)
    if bucket < n or bucket % cfg.merge_unit:
        raise ValueError(f"bucket {bucket} cannot hold {n} patches in merge units of {cfg.merge_unit}")
    pad = bucket - n

    def cat(parts, fill, shape, dtype):
        return np.concatenate(parts + [np.full((pad, *shape), fill, dtype)]).astype(dtype)

    return VisionLayout(interp_index=cat(index, 0, (4,), np.int32), interp_weight=cat(weight, 0, (4,), dtype),
                        rope_position=cat(rope, 0, (2,), np.int32), segment=cat(segment, -1, (), np.int32),
                        patches=n)


def rope_inv_freq(cfg: VisionConfig, dtype=np.float32) -> np.ndarray:
    """``[head_dim / 4]`` inverse frequencies of the axial rotary embedding (the same ones for rows and columns),
    formed in float64 and rounded once to ``dtype``."""
    half = cfg.head_dim // 2
    return (1.0 / (cfg.rope_theta ** (np.arange(0, half, 2, dtype=np.float64) / half))).astype(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------------------------------
class BiasLinear(nnx.Module):
    """``nn.Linear`` with bias: ``weight [out, in]``, ``bias [out]``; fp32 accumulation, output in x's dtype."""

    def __init__(self, d_in: int, d_out: int, *, dtype, std: float, rngs: nnx.Rngs | None):
        self.weight = nnx.Param(init_normal(rngs, (d_out, d_in), std, dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype))

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        acc = accum_dtype(x.dtype)
        y = jnp.einsum("...i,oi->...o", x, self.weight[...].astype(x.dtype), preferred_element_type=acc,
                       precision=jax.lax.Precision.HIGHEST)
        return (y + self.bias[...].astype(acc)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """``nn.LayerNorm(eps=1e-6)``: statistics and the affine map in fp32, output in x's dtype."""

    def __init__(self, dim: int, *, dtype, eps: float = 1e-6):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        acc = accum_dtype(x.dtype)
        xf = x.astype(acc)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(acc) + self.bias[...].astype(acc)).astype(x.dtype)


class Weights(nnx.Module):
    """A holder of named parameters (``nn.Conv3d`` 's weight and bias, ``nn.Embedding`` 's weight)."""

    def __init__(self, **params: jnp.ndarray):
        for name, value in params.items():
            setattr(self, name, nnx.Param(value))


class PatchEmbed(nnx.Module):
    """Conv3d with kernel = stride = (temporal, patch, patch): on flattened patches, one matmul."""

    def __init__(self, cfg: VisionConfig, *, dtype, rngs: nnx.Rngs | None):
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = Weights(weight=init_normal(rngs, (cfg.hidden_size, cfg.in_channels, *kernel),
                                               cfg.initializer_range, dtype),
                            bias=jnp.zeros((cfg.hidden_size,), dtype))

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x [N, C·T·P·P]`` (the processor's order: channel, frame, row, column) → ``[N, D]``."""
        w = self.proj.weight[...]
        w = w.reshape(w.shape[0], -1).astype(x.dtype)
        acc = accum_dtype(x.dtype)
        y = jnp.einsum("ni,oi->no", x, w, preferred_element_type=acc, precision=jax.lax.Precision.HIGHEST)
        return (y + self.proj.bias[...].astype(acc)).astype(x.dtype)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, rngs: nnx.Rngs | None):
        std = cfg.initializer_range
        self.qkv = BiasLinear(cfg.hidden_size, 3 * cfg.hidden_size, dtype=dtype, std=std, rngs=rngs)
        self.proj = BiasLinear(cfg.hidden_size, cfg.hidden_size, dtype=dtype, std=std, rngs=rngs)
        self.num_heads = cfg.num_heads

    def __call__(self, x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, segment: jnp.ndarray) -> jnp.ndarray:
        n, d = x.shape
        q, k, v = jnp.moveaxis(self.qkv(x).reshape(n, 3, self.num_heads, d // self.num_heads), 1, 0)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.proj(segment_attention(q, k, v, segment).reshape(n, d))


def _rotate(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate-half RoPE over the whole head in fp32 (transformers upcasts here even for a bf16 tower), back to x's
    dtype. ``x [N, heads, hd]``, ``cos``/``sin`` ``[N, hd]`` fp32."""
    xf = x.astype(cos.dtype)
    half = xf.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None] + rot * sin[:, None]).astype(x.dtype)


def segment_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, segment: jnp.ndarray) -> jnp.ndarray:
    """Non-causal softmax attention of each patch over the patches of its own image.

    Args:
      q, k, v: ``[N, heads, hd]``.
      segment: ``[N]`` int32 image of each patch (padding: -1, a segment of its own).
    Returns:
      ``[N, heads, hd]`` in q's dtype; scores and softmax in fp32 (as torch's SDPA math path accumulates).
    """
    n, heads, hd = q.shape
    acc = accum_dtype(q.dtype)
    scale = hd ** -0.5

    def block(qb, sb):
        s = jnp.einsum("qhd,khd->hqk", qb, k, preferred_element_type=acc, precision=jax.lax.Precision.HIGHEST)
        s = jnp.where((sb[:, None] == segment[None, :])[None], s * scale, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
        return jnp.einsum("hqk,khd->qhd", p, v, preferred_element_type=acc,
                          precision=jax.lax.Precision.HIGHEST).astype(q.dtype)

    size = _query_block(n)
    if size == n:
        return block(q, segment)
    out = jax.lax.map(lambda a: block(*a), (q.reshape(n // size, size, heads, hd), segment.reshape(n // size, size)))
    return out.reshape(n, heads, hd)


class VisionMLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, rngs: nnx.Rngs | None):
        std = cfg.initializer_range
        self.linear_fc1 = BiasLinear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, std=std, rngs=rngs)
        self.linear_fc2 = BiasLinear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype, std=std, rngs=rngs)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        h = self.linear_fc1(x)
        # gelu_pytorch_tanh, evaluated in fp32 as torch's opmath does for bf16
        return self.linear_fc2(jax.nn.gelu(h.astype(accum_dtype(h.dtype)), approximate=True).astype(h.dtype))


class VisionBlock(nnx.Module):
    """Pre-LN transformer block: ``x + attn(LN1(x))``, then ``x + mlp(LN2(x))``."""

    def __init__(self, cfg: VisionConfig, *, dtype, rngs: nnx.Rngs | None):
        self.norm1 = LayerNorm(cfg.hidden_size, dtype=dtype)
        self.norm2 = LayerNorm(cfg.hidden_size, dtype=dtype)
        self.attn = VisionAttention(cfg, dtype=dtype, rngs=rngs)
        self.mlp = VisionMLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, segment):
        x = x + self.attn(self.norm1(x), cos, sin, segment)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """LayerNorm per patch, then each 2×2 block of patches (``merge_unit`` consecutive rows) → one text-width
    token: ``fc2(gelu(fc1(·)))`` with the exact (erf) GELU."""

    def __init__(self, cfg: VisionConfig, *, dtype, rngs: nnx.Rngs | None):
        wide = cfg.hidden_size * cfg.merge_unit
        std = cfg.initializer_range
        self.norm = LayerNorm(cfg.hidden_size, dtype=dtype)
        self.linear_fc1 = BiasLinear(wide, wide, dtype=dtype, std=std, rngs=rngs)
        self.linear_fc2 = BiasLinear(wide, cfg.out_hidden_size, dtype=dtype, std=std, rngs=rngs)
        self.wide = wide

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        h = self.linear_fc1(self.norm(x).reshape(-1, self.wide))
        return self.linear_fc2(jax.nn.gelu(h.astype(accum_dtype(h.dtype)), approximate=False).astype(h.dtype))


class Qwen3_5MoeVisionModel(nnx.Module):
    """The tower: flattened patches ``[N, C·T·P·P]`` → merged tokens ``[N / merge_unit, out_hidden_size]``.

    Variables keep transformers' names under ``model.visual.`` (``patch_embed.proj.weight [D, C, T, P, P]``,
    ``pos_embed.weight``, ``blocks.{i}.…``, ``merger.…``); the blocks are one stacked ``[depth, …]`` copy scanned
    over, so compile time does not grow with depth.
    """

    def __init__(self, cfg: VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.patch_embed = PatchEmbed(cfg, dtype=dtype, rngs=rngs)
        self.pos_embed = Weights(weight=init_normal(rngs, (cfg.num_position_embeddings, cfg.hidden_size),
                                                    cfg.initializer_range, dtype))
        make = lambda r: VisionBlock(cfg, dtype=dtype, rngs=r)
        if rngs is not None:
            self.blocks = nnx.vmap(make, in_axes=0, out_axes=0)(rngs.split(cfg.depth))
        else:
            self.blocks = nnx.vmap(lambda _: make(None), in_axes=0, out_axes=0)(jnp.zeros(cfg.depth))
        self.merger = PatchMerger(cfg, dtype=dtype, rngs=rngs)

    def forward(self, pixel_values: jnp.ndarray, interp_index: jnp.ndarray, interp_weight: jnp.ndarray,
                rope_position: jnp.ndarray, segment: jnp.ndarray) -> jnp.ndarray:
        """Traceable forward over a :class:`VisionLayout` 's arrays (``pixel_values [N, patch_dim]`` padded to the
        layout's bucket). Returns ``[N / merge_unit, out_hidden_size]`` in the tower's dtype (pad rows: garbage)."""
        dt = self.dtype
        acc = accum_dtype(dt)
        x = self.patch_embed(pixel_values.astype(dt))
        table = self.pos_embed.weight[...]
        # the taps' weights are fp32: transformers' weighted sum promotes to fp32 before the cast to the tower dtype
        pos = jnp.sum(jnp.take(table, interp_index, axis=0).astype(acc) * interp_weight[..., None].astype(acc),
                      axis=1)
        x = x + pos.astype(dt)
        # rotary angles and the rotation in fp32 whatever the tower's dtype (float64 for a float64 model)
        freqs = rope_position.astype(acc)[..., None] * jnp.asarray(rope_inv_freq(self.config, acc))  # [N, 2, hd/4]
        emb = jnp.concatenate([freqs[:, 0], freqs[:, 1]], axis=-1)
        emb = jnp.concatenate([emb, emb], axis=-1)  # [N, hd]
        cos, sin = jnp.cos(emb), jnp.sin(emb)

        graphdef, state = nnx.split(self.blocks)

        def body(h, block_state):
            return nnx.merge(graphdef, block_state)(h, cos, sin, segment), None

        x, _ = jax.lax.scan(body, x, state)
        return self.merger(x)

    def __call__(self, pixel_values, grid_thw) -> np.ndarray:
        """Host entry: ``pixel_values [N, patch_dim]`` (numpy or array) of images with grids ``grid_thw [n, 3]`` →
        their merged tokens ``[N / merge_unit, out_hidden_size]``, image after image. One jitted program per patch
        bucket (:func:`patch_bucket`)."""
        cfg = self.config
        pixels = np.asarray(pixel_values)
        wide = self.dtype == jnp.float64
        layout = vision_layout(grid_thw, cfg, dtype=np.float64 if wide else np.float32)
        if pixels.ndim != 2 or pixels.shape != (layout.patches, cfg.patch_dim):
            raise ValueError(f"pixel_values must be [{layout.patches}, {cfg.patch_dim}] for grids "
                             f"{np.asarray(grid_thw).tolist()}, got {list(pixels.shape)}")
        padded = np.zeros((layout.bucket, cfg.patch_dim), np.float64 if wide else np.float32)
        padded[:layout.patches] = pixels
        graphdef, state = nnx.split(self)
        out = _jit_vision(graphdef, state, padded, layout.interp_index, layout.interp_weight,
                          layout.rope_position, layout.segment)
        # cut on the host: slicing the device array to each call's own count would compile a program per count
        return np.asarray(out)[:layout.patches // cfg.merge_unit]

    def compile_bucket(self, bucket: int) -> None:
        """Compile (and run once, on padding only) the program of one patch bucket: what a server does for every
        bucket a request can reach before it says it is ready."""
        wide = self.dtype == jnp.float64
        f = np.float64 if wide else np.float32
        graphdef, state = nnx.split(self)
        jax.block_until_ready(_jit_vision(
            graphdef, state, np.zeros((bucket, self.config.patch_dim), f), np.zeros((bucket, 4), np.int32),
            np.zeros((bucket, 4), f), np.zeros((bucket, 2), np.int32), np.full(bucket, -1, np.int32)))


@functools.partial(jax.jit, static_argnums=0)
def _jit_vision(graphdef, state, pixel_values, interp_index, interp_weight, rope_position, segment):
    return nnx.merge(graphdef, state).forward(pixel_values, interp_index, interp_weight, rope_position, segment)


def init_vision(cfg: VisionConfig, *, dtype=jnp.float32, seed: int = 0) -> Qwen3_5MoeVisionModel:
    """A randomly initialised tower (normal(initializer_range) matrices, unit/zero LayerNorms, zero biases)."""
    return Qwen3_5MoeVisionModel(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
