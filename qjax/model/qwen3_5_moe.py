"""Flax NNX model of ``qwen3_5_moe`` (Qwen3.5/3.6-MoE), read top-down like docs/model.md §2.

    h = embed_tokens[ids]
    for each layer:  h += GatedDeltaNet | GatedAttention (NormZC(h));  h += SparseMoE(NormZC(h))
    logits = lm_head(NormZC(h))

Layers repeat in a fixed group (``[GDN, GDN, GDN, full]`` for Qwen3.6); the model keeps one stacked copy of each
group position and ``lax.scan`` s over the groups, so compile time does not grow with depth. Layers see arrays only:
checkpoint names and formats live in :mod:`qjax.checkpoint.loading`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from qjax.kernels import attention as kernels_attention
from qjax.kernels import (
    accum_dtype,
    decode_attention,
    gated_delta_decode,
    gated_delta_step,
    indexing,
    matmul_accumulated,
    sigmoid,
    silu,
)
from qjax.model import gdn
from qjax.model.cache import Cache, GDNState, KVState, gather_rows, read_layer, scatter_rows, write_layer, write_tokens
from qjax.model.config import FULL, LINEAR, TextConfig, VisionConfig
from qjax.model.dtypes import check_x64, model_dtype
from qjax.model.layers import GatedRMSNorm, Linear, RMSNorm, init_normal
from qjax.model.linears import linear
from qjax.model.moe import Experts, SparseMoeBlock
from qjax.model.probe import NO_TAP, Probe, group_inputs, layer_inputs, stack_captures
from qjax.model.quant_layers import Packed, fake_quant_fp8, quantize_fp8
from qjax.model.quant_spec import ModelQuant
from qjax.model.rope import apply_rope, rope_cos_sin
from qjax.model.sharding import MeshError, cache_shardings, check_batch
from qjax.model.vision import Qwen3_5MoeVisionModel


@struct.dataclass
class StepContext:
    """What every layer of one forward call shares (built once per call, outside the layer scan)."""

    cos: jnp.ndarray  # [B, T, R]
    sin: jnp.ndarray  # [B, T, R]
    token_mask: jnp.ndarray | None  # [B, T] bool, False at padding (None: no padding)
    key_valid: jnp.ndarray  # [B, S] bool, keys attention may read (after this call's write; it reads the first kv_len)
    query_slot: jnp.ndarray  # [B or 1, T] int32, cache slot of each query (causality: key slot ≤ query slot)
    # with a cache: the cache slot each new token is written to ([B, T]; the cache length, i.e. dropped, at padding),
    # how many of the row's new tokens end at its last real one ([B]: where the GDN conv window ends), and which
    # cache rows the batch rows are (qjax.model.cache.Rows: None, a prefix length or an index array)
    write_slot: jnp.ndarray | None = None
    span: jnp.ndarray | None = None
    rows: jnp.ndarray | int | None = None
    # [] int32 layer group being run when packed weights are read inside their [G, …] stack (see run_layers)
    stack_layer: jnp.ndarray | None = None
    # [] int32 layer group being run, the index into the cache's [G, …] stacks (set inside the layer scan)
    cache_layer: jnp.ndarray | None = None
    kv_len: int = struct.field(pytree_node=False, default=0)  # cache slots attention reads: [0, kv_len)
    # a speculative verify call: GDN layers run token by token and keep every token's state (GDNState.steps)
    keep_steps: bool = struct.field(pytree_node=False, default=False)


# ---------------------------------------------------------------------------------------------------------------------
# Gated full attention (docs/model.md §2.3)
# ---------------------------------------------------------------------------------------------------------------------
class GatedAttention(nnx.Module):
    def __init__(self, cfg: TextConfig, *, dtype, rngs: nnx.Rngs | None, quant: dict | None = None,
                 kv_fp8: bool = False):
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        lin = functools.partial(linear, cfg, quant=quant or {}, dtype=dtype, rngs=rngs)  # shapes: qjax.model.linears
        self.q_proj = lin("self_attn.q_proj")  # rows head-major [h0 query | h0 gate | h1 query | h1 gate | …]
        self.k_proj = lin("self_attn.k_proj")
        self.v_proj = lin("self_attn.v_proj")
        self.o_proj = lin("self_attn.o_proj")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
        if kv_fp8:
            # static FP8 KV scales, one per kv head (a per-tensor checkpoint scale is broadcast at load)
            self.k_scale = Packed(jnp.ones((self.num_kv_heads,), jnp.float32))
            self.v_scale = Packed(jnp.ones((self.num_kv_heads,), jnp.float32))
        else:
            self.k_scale = self.v_scale = None

    def __call__(self, x: jnp.ndarray, ctx: StepContext, kv: KVState | None):
        """``x [B, T, H]`` → ``([B, T, H], updated KV slice or None)``."""
        b, t, _ = x.shape
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        layer = ctx.stack_layer  # inside the layer scan: where this layer's packed weights sit in their stacks
        p = self.q_proj(x, layer).reshape(b, t, nh, 2 * d)
        q, gate = p[..., :d], p[..., d:].reshape(b, t, nh * d)
        q = apply_rope(self.q_norm(q), ctx.cos, ctx.sin)
        k = apply_rope(self.k_norm(self.k_proj(x, layer).reshape(b, t, nkv, d)), ctx.cos, ctx.sin)
        v = self.v_proj(x, layer).reshape(b, t, nkv, d)
        fp8 = self.k_scale is not None
        if fp8:
            # K (after k_norm + RoPE) and V are what a compressed-tensors / vLLM FP8 cache stores: e4m3(x / s)
            ks, vs = self.k_scale[...][:, None], self.v_scale[...][:, None]  # [Hkv, 1] broadcasts over D
        if kv is not None:
            g, rows = ctx.cache_layer, ctx.rows
            new_k = quantize_fp8(k, ks) if fp8 else k
            new_v = quantize_fp8(v, vs) if fp8 else v
            kv = KVState(k=write_tokens(kv.k, g, rows, ctx.write_slot, new_k),
                         v=write_tokens(kv.v, g, rows, ctx.write_slot, new_v))
            if t == 1 and rows is None and not fp8:
                # decode over the whole cache: the layer's K/V read inside the cache stacks (with the Pallas
                # kernels no copy of the layer; on CPU the reference: the slice and the attention below)
                o = decode_attention(q[:, 0], kv.k, kv.v, _allowed(ctx, ctx.kv_len)[:, 0], layer=g,
                                     kv_len=ctx.kv_len)
                return self.o_proj(o.reshape(b, t, nh * d) * sigmoid(gate), layer), kv
            # the first kv_len slots of this layer's rows, [B, Hkv, kv_len, D]: what the queries may read (this
            # call's tokens included)
            keys, values = (read_layer(c, g, rows, ctx.kv_len) for c in (kv.k, kv.v))
            if fp8:
                acc = accum_dtype(x.dtype)
                keys = (keys.astype(acc) * ks[:, None].astype(acc)).astype(x.dtype)
                values = (values.astype(acc) * vs[:, None].astype(acc)).astype(x.dtype)
            else:
                keys, values = keys.astype(x.dtype), values.astype(x.dtype)
        else:
            if fp8:
                # without a cache the same rounding is applied, so prefill and decode see identical keys and values
                k, v = fake_quant_fp8(k, ks), fake_quant_fp8(v, vs)
            keys, values = k.swapaxes(1, 2), v.swapaxes(1, 2)
        o = attention(q, keys, values, ctx)
        o = o.reshape(b, t, nh * d) * sigmoid(gate)
        return self.o_proj(o, layer), kv


def _allowed(ctx: StepContext, s: int) -> jnp.ndarray:
    """``[B, T, s]`` bool: which of the first ``s`` key slots each query may read — causality (key slot ≤ query
    slot) and real tokens."""
    return (jnp.arange(s)[None, None, :] <= ctx.query_slot[..., None]) & ctx.key_valid[:, None, :s]


def attention(q, k, v, ctx: StepContext) -> jnp.ndarray:
    """Causal GQA softmax attention (:func:`qjax.kernels.attention`) of ``q [B, T, Hq, D]`` over ``k, v [B, Hkv, S,
    D]`` (S = T without a cache, the slots read with one) → ``[B, T, Hq, D]`` in q's dtype."""
    return kernels_attention(q, k, v, _allowed(ctx, k.shape[2]))


# ---------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet (docs/model.md §2.5)
# ---------------------------------------------------------------------------------------------------------------------
@jax.custom_vjp
def _causal_taps(xc: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """``y[b, t, c] = Σ_i xc[b, t + i, c] · w[c, i]`` for ``xc [B, K-1+T, C]``, ``w [C, K]`` → ``[B, T, C]``."""
    t = xc.shape[1] - w.shape[1] + 1
    return sum(xc[:, i:i + t] * w[:, i] for i in range(w.shape[1]))


def _causal_taps_fwd(xc, w):
    return _causal_taps(xc, w), (xc, w)


def _causal_taps_bwd(res, g):
    # One tap per loop iteration, so that the cotangent g is a loop operand: computed once, into memory. Autodiff's
    # backward read g at K shifts (and K more times for dw) in fusions that XLA:CPU fed by fusing in the elementwise
    # chain producing g (bf16 round trips, SiLU's backward), recomputed at every read: 10 % of a bf16 GDN layer's
    # AutoRound iteration. (An optimization barrier does not stop it: XLA:CPU drops barriers before fusing. A
    # depthwise convolution is 30× slower than the taps there.)
    xc, w = res
    t = g.shape[1]

    def tap(i, carry):
        dxc, dw = carry
        w_i = jax.lax.dynamic_index_in_dim(w, i, axis=1, keepdims=False)  # [C]
        window = jax.lax.dynamic_slice_in_dim(xc, i, t, axis=1)  # [B, T, C]
        dxc = jax.lax.dynamic_update_slice_in_dim(dxc, jax.lax.dynamic_slice_in_dim(dxc, i, t, axis=1) + g * w_i,
                                                  i, axis=1)
        dw = jax.lax.dynamic_update_index_in_dim(dw, jnp.sum(g * window, axis=(0, 1)), i, axis=1)
        return dxc, dw

    dxc, dw = jax.lax.fori_loop(0, w.shape[1], tap, (jnp.zeros(xc.shape, g.dtype), jnp.zeros(w.shape, g.dtype)))
    return dxc.astype(xc.dtype), dw.astype(w.dtype)


_causal_taps.defvjp(_causal_taps_fwd, _causal_taps_bwd)


class Conv1d(nnx.Module):
    """Causal depthwise conv, no bias; ``weight [C, 1, K]`` as HF stores it."""

    def __init__(self, channels: int, kernel: int, *, dtype, rngs: nnx.Rngs | None):
        self.weight = nnx.Param(init_normal(rngs, (channels, 1, kernel), kernel ** -0.5, dtype))

    def __call__(self, x: jnp.ndarray, window: jnp.ndarray, span: jnp.ndarray | None = None, layer=None
                 ) -> tuple[jnp.ndarray, jnp.ndarray]:
        """``x [B, T, C]``, ``window [B, K-1, C]`` (previous inputs) → (``[B, T, C]`` pre-activation, new window).

        ``span [B]``: the new window ends after the first ``span[b]`` inputs of row b (its last real token: right
        padding stays out of it, and a row with no real token keeps its window); None: after all T. ``layer``: the
        weight is the layer scan's ``[L, C, 1, K]`` stack and this is layer ``layer``."""
        kernel = self.weight.shape[-1]
        xc = jnp.concatenate([window.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
        acc = accum_dtype(x.dtype)
        w = self.weight[...] if layer is None else indexing.take(self.weight[...], layer)
        w = w[:, 0, :].astype(acc)  # [C, K]
        # converted once, then sliced: the same values as converting each tap, but the backward (AutoRound's tuning
        # step) sums the taps' cotangents in fp32 and rounds once, where per-tap converts made XLA fuse a chain of
        # bf16 round trips it recomputed for every tap (11 % of a bf16 GDN layer's tuning iteration)
        xc32 = xc.astype(acc)
        y = _causal_taps(xc32, w)
        if span is None:
            new_window = xc[:, xc.shape[1] - (kernel - 1):]
        else:
            at = span[:, None] + jnp.arange(kernel - 1, dtype=jnp.int32)[None, :]  # [B, K-1] indices into xc
            new_window = jnp.take_along_axis(xc, at[..., None], axis=1)
        return y.astype(x.dtype), new_window


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: TextConfig, *, dtype, rngs: nnx.Rngs | None, quant: dict | None = None):
        lin = functools.partial(linear, cfg, quant=quant or {}, dtype=dtype, rngs=rngs)  # shapes: qjax.model.linears
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        self.in_proj_qkv = lin("linear_attn.in_proj_qkv")
        self.in_proj_z = lin("linear_attn.in_proj_z")
        self.in_proj_b = lin("linear_attn.in_proj_b")
        self.in_proj_a = lin("linear_attn.in_proj_a")
        self.conv1d = Conv1d(cfg.conv_dim, self.conv_kernel, dtype=dtype, rngs=rngs)
        # decay parameters stay in the accumulation dtype (fp32, or float64) whatever the model dtype:
        # g = −exp(A_log)·softplus(a + dt_bias) is precision-bound
        acc = accum_dtype(dtype)
        self.dt_bias = nnx.Param(jnp.ones((self.num_v_heads,), acc))
        a_init = (jax.random.uniform(rngs.params(), (self.num_v_heads,), jnp.float32, 0.01, 16.0).astype(acc)
                  if rngs is not None else jnp.ones((self.num_v_heads,), acc))
        self.A_log = nnx.Param(jnp.log(a_init))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = lin("linear_attn.out_proj")

    def __call__(self, x: jnp.ndarray, ctx: StepContext, state: GDNState | None):
        """``x [B, T, H]`` → ``([B, T, H], new GDNState or None)``."""
        b, t, _ = x.shape
        layer = ctx.stack_layer  # inside the layer scan: where this layer's packed weights sit in their stacks
        if ctx.token_mask is not None:
            # pads are zeroed before the projections so they add nothing to the conv window or the state
            x = x * ctx.token_mask[..., None].astype(x.dtype)
        mixed = self.in_proj_qkv(x, layer)
        z = self.in_proj_z(x, layer).reshape(b, t, self.num_v_heads, self.head_v_dim)
        b_in = self.in_proj_b(x, layer)
        a = self.in_proj_a(x, layer)
        if t == 1 and state is not None and ctx.rows is None and layer is not None and not ctx.keep_steps:
            # decode over the whole cache with the weights read in their stacks: one kernel runs the conv step,
            # SiLU, the decay, β and the recurrence, and writes this layer's conv window and state in place inside
            # the cache's stacks, and reads the conv weight, A_log and dt_bias in theirs (on CPU the reference: the
            # ops below, unfused, in their order)
            keep = None if ctx.token_mask is None else ctx.token_mask[:, 0]
            o, conv, rec = gated_delta_decode(mixed[:, 0], a[:, 0], b_in[:, 0], state.conv,
                                              self.conv1d.weight[...][:, :, 0, :], self.A_log[...], self.dt_bias[...],
                                              state.recurrent, layer=ctx.cache_layer, weight_layer=layer, keep=keep)
            return self._output(o[:, None], z, layer), state.replace(conv=conv, recurrent=rec)
        beta = sigmoid(b_in)
        if state is not None:
            cg, rows = ctx.cache_layer, ctx.rows
            window = read_layer(state.conv, cg, rows)
        else:
            window = jnp.zeros((b, self.conv_kernel - 1, mixed.shape[-1]), mixed.dtype)
        pre_conv = mixed
        mixed, new_window = self.conv1d(mixed, window, None if state is None else ctx.span, layer)
        mixed = silu(mixed)
        q = mixed[..., :self.key_dim].reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = mixed[..., self.key_dim:2 * self.key_dim].reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = mixed[..., 2 * self.key_dim:].reshape(b, t, self.num_v_heads, self.head_v_dim)
        acc = accum_dtype(x.dtype)
        a_log, dt_bias = (p[...] if layer is None else indexing.take(p[...], layer) for p in (self.A_log,
                                                                                           self.dt_bias))
        g = -jnp.exp(a_log.astype(acc)) * jax.nn.softplus(a.astype(acc) + dt_bias.astype(acc))
        if ctx.token_mask is not None:
            # β = g = 0 makes a padded step an exact no-op on the state, wherever the pad sits
            keep = ctx.token_mask[..., None]
            beta = jnp.where(keep, beta, 0)
            g = jnp.where(keep, g, 0.0)
        rec = None if state is None else state.recurrent  # the whole [G, B, Hv, Dk, Dv] stack
        steps = None if state is None else state.steps
        if ctx.keep_steps:
            # a speculative verify call: the exact recurrence, keeping the state after each token and the widened
            # conv input, so Cache.accept can roll each row back to its last accepted token
            if steps is None or steps.shape[2] != t or rows is not None:
                raise ValueError(f"a verify call of {t} tokens needs a cache made with spec_tokens={t} and all rows")
            o, s, per_token = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, read_layer(rec, cg, rows),
                                                            all_states=True)
            rec = write_layer(rec, cg, rows, s)
            steps = write_layer(steps, cg, rows, per_token)
            conv_steps = write_layer(state.conv_steps, cg, rows, jnp.concatenate([window, pre_conv], axis=1))
        else:
            init = None if rec is None else read_layer(rec, cg, rows)
            if t == 1:  # some of the cache's rows, or on a mesh (heads sharded: the reference)
                if init is None:
                    init = jnp.zeros((b, self.num_v_heads, self.head_k_dim, self.head_v_dim), acc)
                o, s = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], init,
                                        impl=None if layer is not None else "reference")
                o = o[:, None]
            else:
                o, s = gdn.chunk_gated_delta_rule(q, k, v, g, beta, init)
            if rec is not None:
                rec = write_layer(rec, cg, rows, s)
        out = self._output(o.astype(x.dtype), z, layer)
        new_state = None
        if state is not None:
            new_state = state.replace(conv=write_layer(state.conv, cg, rows, new_window), recurrent=rec)
            if ctx.keep_steps:
                new_state = new_state.replace(steps=steps, conv_steps=conv_steps)
        return out, new_state

    def _output(self, o: jnp.ndarray, z: jnp.ndarray, layer) -> jnp.ndarray:
        """The gated norm and ``out_proj`` of the recurrence's output ``o [B, T, Hv, Dv]`` (z: the gate, same shape)
        → ``[B, T, H]``."""
        b, t = o.shape[:2]
        return self.out_proj(self.norm(o, z).reshape(b, t, self.value_dim), layer)


# ---------------------------------------------------------------------------------------------------------------------
# Decoder layer, layer group, model
# ---------------------------------------------------------------------------------------------------------------------
class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TextConfig, layer_type: str, *, dtype, rngs: nnx.Rngs | None, quant: dict | None = None,
                 kv_fp8: bool = False):
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs, quant=quant)
        else:
            self.self_attn = GatedAttention(cfg, dtype=dtype, rngs=rngs, quant=quant, kv_fp8=kv_fp8)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = SparseMoeBlock(cfg, dtype=dtype, rngs=rngs, quant=quant)

    def __call__(self, h: jnp.ndarray, ctx: StepContext, state, tap=NO_TAP):
        """``tap``: the layer's :class:`qjax.model.probe.Tap` (captures / patches its sites); NO_TAP changes nothing."""
        # named scopes label the ops in profiles (qjax bench --profile) with the module that issued them
        mixer = self.linear_attn if self.layer_type == LINEAR else self.self_attn
        with jax.named_scope("linear_attn" if self.layer_type == LINEAR else "self_attn"):
            out, state = mixer(tap("attn_input", self.input_layernorm(h)), ctx, state)
        h = h + tap("attn_output", out)
        with jax.named_scope("mlp"):
            x = tap("mlp_input", self.post_attention_layernorm(h))
            h = h + tap("mlp_output", tap.moe(self.mlp, x, ctx.stack_layer))
        return tap("hidden_states", h), state


class LayerGroup(nnx.Module):
    """One repetition of the layer pattern, e.g. ``[GDN, GDN, GDN, full]``."""

    def __init__(self, cfg: TextConfig, specs: tuple, *, dtype, rngs: nnx.Rngs | None, kv_fp8: bool = False):
        self.layers = nnx.List([DecoderLayer(cfg, kind, dtype=dtype, rngs=rngs, quant=dict(q), kv_fp8=kv_fp8)
                                for kind, q in specs])

    def __call__(self, h, ctx: StepContext, states, collect: bool = False, probe: Probe | None = None, inputs=None):
        """``probe``, ``inputs``: see :meth:`Qwen3_5MoeForCausalLM.run_layers`; with a probe a fourth output, the
        group's captures ``{site: [p, …]}``."""
        new_states, outs, taps = [], [], []
        for i, layer in enumerate(self.layers):
            tap = NO_TAP if probe is None else probe.tap(layer_inputs(inputs, i),
                                                          ctx.cache_layer * len(self.layers) + i)
            h, st = layer(h, ctx, None if states is None else states[i], tap)
            new_states.append(st)
            outs.append(h)
            taps.append(tap)
        new_states = None if states is None else tuple(new_states)
        if probe is None:
            return h, new_states, (jnp.stack(outs) if collect else None)
        return h, new_states, (jnp.stack(outs) if collect else None), stack_captures(taps)


class MTP(nnx.Module):
    """Multi-token-prediction head (``mtp.*``): predicts token t+2 from the hidden at t and the token at t+1.

    vLLM's convention (docs/model.md §6.3): ``h_t`` is the post-final-norm hidden; ``fc`` sees ``[embedding, hidden]``;
    one full-attention + MoE decoder layer; ``mtp.norm`` then the shared lm_head.
    """

    def __init__(self, cfg: TextConfig, *, dtype, rngs: nnx.Rngs | None):
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.fc = Linear(2 * h, h, dtype=dtype, std=cfg.initializer_range, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, FULL, dtype=dtype, rngs=rngs)
                                for _ in range(max(1, cfg.mtp_num_hidden_layers))])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, next_embeds: jnp.ndarray, hidden: jnp.ndarray, ctx: StepContext,
                 kv: KVState | None = None, probe: Probe | None = None):
        """``next_embeds``, ``hidden``: ``[B, T, H]`` → (the ``mtp.norm``-ed hidden ``[B, T, H]``, updated K/V).

        ``kv``: the head's own K/V cache, ``[L_mtp, B, Hkv, S, D]`` (layer i of the head is entry i; ``ctx`` comes
        from :meth:`Qwen3_5MoeForCausalLM.step_context` on a cache holding it), or None (no cache). ``probe``: also
        return the head's layers' captured sites ``{site: [L_mtp, B, T, …]}`` (:mod:`qjax.model.probe`)."""
        y = jnp.concatenate([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], axis=-1)
        y = self.fc(y)
        taps = []
        for i, layer in enumerate(self.layers):
            taps.append(NO_TAP if probe is None else probe.tap(None, jnp.int32(i)))
            y, kv = layer(y, ctx.replace(cache_layer=jnp.int32(i), stack_layer=None), kv, taps[-1])
        return (self.norm(y), kv) if probe is None else (self.norm(y), kv, stack_captures(taps))


@struct.dataclass
class ForwardOutput:
    logits: jnp.ndarray  # [B, T', V] (T' = T, or the kept last positions)
    hidden: jnp.ndarray  # [B, T, H] post-final-norm hidden (the MTP head's input)
    cache: Cache | None
    hidden_states: jnp.ndarray | None = None  # [L + 1, B, T, H] when asked for
    captures: dict | None = None  # {site: [L, B, T, …]} of a probe's captured sites (qjax.model.probe)


class Qwen3_5MoeForCausalLM(nnx.Module):
    """The text model with its lm_head. ``model(input_ids)`` → logits ``[B, T, V]`` (jitted)."""

    def __init__(self, cfg: TextConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None, with_mtp: bool = False,
                 quant: ModelQuant | None = None, vision: VisionConfig | None = None, vision_dtype=None,
                 with_visual: bool = True):
        self.config = cfg
        # the composite checkpoint's vision config (its token ids place image features even when the tower itself is
        # not loaded); the tower keeps its own dtype: a checkpoint's BF16 tower stays BF16 under a quantized body
        self.vision_config = vision
        if vision is not None:
            vision.validate("vision_config", cfg)
        self.visual = (Qwen3_5MoeVisionModel(vision, dtype=dtype if vision_dtype is None else vision_dtype, rngs=rngs)
                       if vision is not None and with_visual else None)
        # what it computes in (qjax.model.dtypes); x64 is switched on by the callers (load_model, init_model, --dtype):
        # inside a trace (abstract_model) it would be too late
        self.dtype = model_dtype(dtype, "Qwen3_5MoeForCausalLM(dtype=…)", switch_x64=False)
        check_x64(self.dtype)
        self.quant = quant if quant is not None and not quant.is_empty else None
        self.kv_fp8 = self.quant is not None and self.quant.kv_cache is not None
        std = cfg.initializer_range
        self.embed_tokens = nnx.Param(init_normal(rngs, (cfg.vocab_size, cfg.hidden_size), std, dtype))
        specs = layer_period(cfg, self.quant)
        self.layer_kinds = tuple(kind for kind, _ in specs)
        self.num_groups = cfg.num_hidden_layers // len(specs)
        make_group = lambda r: LayerGroup(cfg, specs, dtype=dtype, rngs=r, kv_fp8=self.kv_fp8)
        if rngs is not None:
            self.groups = nnx.vmap(make_group, in_axes=0, out_axes=0)(rngs.split(self.num_groups))
        else:
            self.groups = nnx.vmap(lambda _: make_group(None), in_axes=0, out_axes=0)(jnp.zeros(self.num_groups))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        head = self.quant.lm_head if self.quant is not None else None
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype,
                                                                    std=std, rngs=rngs, meta=head)
        self.mtp = MTP(cfg, dtype=dtype, rngs=rngs) if with_mtp else None
        self.mesh_plan = None  # a qjax.model.sharding.MeshPlan when the variables live on a mesh
        #                        (qjax.model.sharding.set_plan)

    def init_cache(self, batch: int, max_len: int, spec_tokens: int = 0) -> Cache:
        """An empty generation cache for ``batch`` rows of up to ``max_len`` positions (FP8 K/V when the checkpoint
        has static KV scales); on a mesh, created directly in its shards (rows over ``data``, heads over
        ``tensor``). ``spec_tokens`` > 0: also the GDN buffers of speculative verify calls of that many tokens
        (one device only)."""
        make = functools.partial(Cache.init, self.config, self.layer_kinds, batch, max_len, self.dtype,
                                 kv_dtype=jnp.float8_e4m3fn if self.kv_fp8 else self.dtype, spec_tokens=spec_tokens)
        if self.mesh_plan is None:
            return make()
        if spec_tokens:
            raise MeshError("speculative decoding runs on one device; load the model without a mesh")

        check_batch(self.mesh_plan, batch)
        return jax.jit(make, out_shardings=cache_shardings(jax.eval_shape(make), self.mesh_plan))()

    # -- building blocks ----------------------------------------------------------------------------------------------
    def embed(self, input_ids: jnp.ndarray, image_embeds: jnp.ndarray | None = None) -> jnp.ndarray:
        """Token embeddings ``[B, T, H]``; with ``image_embeds [N, H]`` (the vision tower's merged tokens), the n-th
        image placeholder token in row-major order takes the n-th feature row instead (transformers'
        ``masked_scatter``). The caller gives exactly as many rows as the call has placeholders."""
        h = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(self.dtype)
        if image_embeds is None:
            return h
        if self.vision_config is None:
            raise ValueError("image_embeds given to a text-only model (its config.json has no vision_config)")
        is_image = input_ids == self.vision_config.image_token_id
        row = jnp.cumsum(is_image.reshape(-1), dtype=jnp.int32).reshape(is_image.shape) - 1
        feats = jnp.take(image_embeds, jnp.clip(row, 0, image_embeds.shape[0] - 1), axis=0).astype(self.dtype)
        return jnp.where(is_image[..., None], feats, h)

    def logits_from_hidden(self, h: jnp.ndarray) -> jnp.ndarray:
        """Logits in the accumulation dtype — float32 for bf16/f16/f32 models, float64 for float64: rounding them to
        bf16 creates argmax ties and costs accuracy for nothing (the matmul accumulates in fp32 anyway)."""
        if self.lm_head is not None:
            return self.lm_head.accumulated(h)
        return matmul_accumulated(h, self.embed_tokens[...])  # tied embeddings

    def step_context(self, input_ids, attention_mask, position_ids, cache: Cache | None, rows=None,
                     kv_len: int | None = None):
        """The call's :class:`StepContext` and its token mask ``[B, T]``; with a cache, the batch's rows are the cache
        rows ``rows`` (:data:`qjax.model.cache.Rows`) and attention reads the first ``kv_len`` slots (None: all)."""
        b, t = input_ids.shape
        mask = None if attention_mask is None else attention_mask.astype(bool)
        ones = jnp.ones((b, t), bool)
        m = ones if mask is None else mask
        if cache is None:
            if position_ids is None:
                position_ids = (jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) if mask is None
                                else jnp.maximum(jnp.cumsum(m, axis=1, dtype=jnp.int32) - 1, 0))
            cos, sin = rope_cos_sin(self.config, position_ids, self.dtype)
            return StepContext(cos=cos, sin=sin, token_mask=mask, key_valid=m,
                               query_slot=jnp.arange(t, dtype=jnp.int32)[None]), m
        if position_ids is None:
            position_ids = gather_rows(cache.positions, rows)[:, None] + jnp.maximum(
                jnp.cumsum(m, axis=1, dtype=jnp.int32) - 1, 0)
        query_slot = gather_rows(cache.lengths, rows)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
        write_slot = jnp.where(m, query_slot, cache.max_len)  # padding is never written (out of range: dropped)
        span = jnp.max(jnp.where(m, jnp.arange(1, t + 1, dtype=jnp.int32), 0), axis=1)
        key_valid = gather_rows(cache.key_valid, rows).at[jnp.arange(b)[:, None], write_slot].set(True, mode="drop")
        cos, sin = rope_cos_sin(self.config, position_ids, self.dtype)
        kv_len = cache.max_len if kv_len is None else min(int(kv_len), cache.max_len)
        ctx = StepContext(cos=cos, sin=sin, token_mask=mask, key_valid=key_valid, query_slot=query_slot,
                          write_slot=write_slot, span=span, rows=rows, kv_len=kv_len)
        return ctx, m

    def run_layers(self, h: jnp.ndarray, ctx: StepContext, slots, collect: bool = False, probe: Probe | None = None,
                   probe_inputs: dict | None = None):
        """Scan the layer groups.

        Args:
          slots: the cache's per-group-position states (leading group axis) or None.
          collect: also return every layer's output hidden ``[L, B, T, H]`` (numerics diffs), else None.
          probe: sites to capture or change (:class:`qjax.model.probe.Probe`, static), or None: the plain program.
          probe_inputs: the probe's patch values, masks and deltas, ``{"values" | "masks" | "deltas": {site: [L, …]}}``.
        Returns:
          (h, new slots, per-layer hiddens), and with a probe the captures ``{site: [L, B, T, …]}``.
        """
        if probe is not None and self.mesh_plan is not None:
            raise MeshError("capture and patching run on one device; load the model without a mesh")
        # Scanning over the stacked variables slices every layer's weights out of the stack on every step, and XLA
        # materialises a slice (a copy) before a kernel reads it. Packed weights, the routed experts and the dense
        # projections — nearly all the bytes — stay whole instead: the kernels read layer g inside the [G, …] stack
        # (ctx.stack_layer; a dense projection at prefill size is sliced for XLA's dot, see kernels.matmul). On a
        # mesh, tensor and expert parallelism shard the weights per layer, so they are sliced as before.
        stacked = self.mesh_plan is None
        if stacked:
            nodes = list(nnx.iter_graph(self.groups))
            readers = frozenset(path for path, node in nodes if isinstance(node, _STACK_READERS))
            readers |= frozenset((*path, name) for path, node in nodes for kind, names in _STACK_READ_VARIABLES
                                 if isinstance(node, kind) for name in names)
            graphdef, whole, state = nnx.split(self.groups, functools.partial(_read_in_stack, readers), ...)
        else:
            graphdef, state = nnx.split(self.groups)

        # The cache rides in the carry as whole [G, B, …] stacks (the GDN recurrent states are 63 MB per layer
        # position at batch 1 of the real model; K/V grow with the context): each layer reads the rows and slots it
        # needs and writes its new entries in place (the GDN decode kernel inside the stack, one scatter per K/V),
        # where scanning them would slice a copy of every layer's cache in and write it all back out on every step.
        # The group index rides in the carry too: as a scanned [G] array XLA sliced it with an async copy per
        # iteration, which also split the iteration's CUDA graph.
        def body(carry, group_state):
            h, g, slots = carry
            layer_ctx = ctx.replace(cache_layer=g, stack_layer=g if stacked else None)
            if probe is not None:  # a probed program scans (variables, patch inputs) and returns the captures too
                group_state, inputs = group_state
                h, slots, outs, captured = nnx.merge(graphdef, whole, group_state)(h, layer_ctx, slots, collect,
                                                                                   probe, inputs)
                return (h, g + 1, slots), (outs, captured)
            if stacked:
                group = nnx.merge(graphdef, whole, group_state)
                h, slots, outs = group(h, layer_ctx, slots, collect)
            else:
                h, slots, outs = nnx.merge(graphdef, group_state)(h, layer_ctx, slots, collect)
                h = self.mesh_plan.batch(h)  # the residual stream: rows over data, whole on every tensor device
            return (h, g + 1, slots), outs

        xs = state if probe is None else (state, group_inputs(probe_inputs, self.num_groups, len(self.layer_kinds)))
        (h, _, new_slots), outs = jax.lax.scan(body, (h, jnp.zeros((), jnp.int32), slots), xs)
        flat = lambda a: a.reshape(-1, *a.shape[2:])  # [G, p, …] → layer g·p + j
        if probe is not None:
            outs, captured = outs
            return h, new_slots, (flat(outs) if collect else None), jax.tree.map(flat, captured)
        return h, new_slots, (flat(outs) if collect else None)

    # -- forward ------------------------------------------------------------------------------------------------------
    def forward(self, input_ids, *, attention_mask=None, position_ids=None, cache: Cache | None = None,
                last_only: bool = False, output_hidden_states: bool = False, cache_rows=None,
                kv_len: int | None = None, keep_steps: bool = False,
                image_embeds: jnp.ndarray | None = None, probe: Probe | None = None,
                probe_inputs: dict | None = None) -> ForwardOutput:
        """Traceable forward.

        Args:
          input_ids: ``[B, T]`` int.
          attention_mask: ``[B, T]`` (1 = token, 0 = padding) or None. Without a cache padding must be on the left;
            with one, anywhere: pads are not written, attended to or counted (a right-padded chunk continues a
            row exactly).
          position_ids: ``[B, T]`` text positions or ``[3, B, T]`` M-RoPE rows (an image prompt's:
            :func:`qjax.multimodal.positions.rope_index`); default: count of real tokens before each position (so a
            left-padded row gets the positions it would have alone), continuing from the cache's next position. With
            a cache, given positions move a row's next position to one past the largest of its real tokens (after an
            image that is not the token count: transformers' ``rope_deltas``).
          cache: a :class:`Cache` to read and update (prefill or decode), or None.
          last_only: compute logits for the last position only (generation).
          output_hidden_states: also return the embeddings and every layer's output (before the final norm) as
            ``hidden_states [L + 1, B, T, H]`` — transformers' ``output_hidden_states`` minus its final-norm entry.
          cache_rows: which cache rows the batch rows are (:data:`qjax.model.cache.Rows`): None (row i is cache row i;
            the cache has exactly B rows), an int B (the cache's first B rows) or a ``[B]`` int32 array of rows, whose
            out-of-range entries are padding rows (read clamped, never written).
          kv_len: attention reads cache slots ``[0, kv_len)`` only (static; every row's tokens must lie below it).
            None: the whole cache.
          keep_steps: a speculative verify call (static): the cache was made with ``spec_tokens = T``; GDN layers keep
            the state after each token so that :meth:`qjax.model.cache.Cache.accept` can keep any prefix.
          image_embeds: ``[N, H]`` features of this call's N image placeholder tokens (:meth:`embed`), or None.
          probe, probe_inputs: capture or change named sites inside the layers (:mod:`qjax.model.probe`; static
            probe, one device); the captures come back in ``ForwardOutput.captures``. None: the plain program.
        """
        ctx, m = self.step_context(input_ids, attention_mask, position_ids, cache, cache_rows, kv_len)
        ctx = ctx.replace(keep_steps=keep_steps)
        h = self.embed(input_ids, image_embeds)
        if self.mesh_plan is not None:
            h = self.mesh_plan.batch(h)
        h0 = h
        slots = None if cache is None else cache.slots
        captures = None
        if probe is None:
            h, new_slots, outs = self.run_layers(h, ctx, slots, output_hidden_states)
        else:
            h, new_slots, outs, captures = self.run_layers(h, ctx, slots, output_hidden_states, probe, probe_inputs)
        hidden_states = jnp.concatenate([h0[None], outs]) if output_hidden_states else None
        h = self.norm(h)
        with jax.named_scope("lm_head"):
            logits = self.logits_from_hidden(h[:, -1:] if last_only else h)
        new_cache = None if cache is None else _advanced(cache, new_slots, ctx, m, cache_rows, position_ids)
        return ForwardOutput(logits=logits, hidden=h, cache=new_cache, hidden_states=hidden_states, captures=captures)

    def __call__(self, input_ids, attention_mask=None, position_ids=None) -> jnp.ndarray:
        """Logits ``[B, T, V]`` for ``input_ids [B, T]``; runs one jitted program (compiled once per shape)."""
        graphdef, state = nnx.split(self)
        return _jit_logits(graphdef, state, jnp.asarray(input_ids, jnp.int32),
                           None if attention_mask is None else jnp.asarray(attention_mask),
                           None if position_ids is None else jnp.asarray(position_ids, jnp.int32))

    def init_mtp_cache(self, batch: int, max_len: int) -> Cache:
        """An empty K/V cache for the MTP head (one entry per MTP layer, slots aligned with the main cache's)."""
        if self.mtp is None:
            raise ValueError("this model has no MTP head (the checkpoint has no mtp.* weights)")
        cfg = self.config
        shape = (len(self.mtp.layers), batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        kv = KVState(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype))  # the head has no KV scales
        return Cache(slots=(kv,), key_valid=jnp.zeros((batch, max_len), bool), positions=jnp.zeros((batch,), jnp.int32),
                     lengths=jnp.zeros((batch,), jnp.int32))

    def mtp_forward(self, next_ids, hidden, cache: Cache, *, attention_mask=None, position_ids=None, cache_rows=None,
                    kv_len: int | None = None, logits: bool = True):
        """The MTP head on top of its cache (:meth:`init_mtp_cache`): for each position t, ``next_ids[:, t]`` is the
        token at t+1 and ``hidden[:, t]`` the main model's post-final-norm hidden at t (or, chained, the head's own
        previous output); the head's attention runs at ``position_ids`` (the positions of the tokens at t+1).
        ``cache_rows``, ``kv_len``: as :meth:`forward`'s. ``logits=False`` skips the lm_head (callers that need the
        logits of a few positions only make them from the returned hidden).

        Returns:
          (logits of the token at t+2 ``[B, T, V]`` or None, the head's output hidden ``[B, T, H]``, the updated
          cache).
        """
        if self.mtp is None:
            raise ValueError("this model has no MTP head (the checkpoint has no mtp.* weights)")
        ctx, m = self.step_context(next_ids, attention_mask, position_ids, cache, cache_rows, kv_len)
        y, kv = self.mtp(self.embed(next_ids), hidden, ctx, cache.slots[0])
        return (self.logits_from_hidden(y) if logits else None), y, _advanced(cache, (kv,), ctx, m, cache_rows)

    def mtp_logits(self, input_ids, hidden: jnp.ndarray | None = None, probe: Probe | None = None):
        """Next-next-token logits from the MTP head, ``[B, T-1, V]``: row t predicts token t+2 from (h_t, token t+1).

        ``hidden`` is the post-final-norm hidden of the main model (computed when not given). ``probe``: (logits,
        the head's output hidden ``[B, T-1, H]``, its layers' captures ``{site: [L_mtp, B, T-1, …]}``) instead.
        """
        if self.mtp is None:
            raise ValueError("this model has no MTP head (the checkpoint has no mtp.* weights)")
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if hidden is None:
            hidden = self.forward(input_ids).hidden
        b, t = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(1, t, dtype=jnp.int32), (b, t - 1))
        cos, sin = rope_cos_sin(self.config, positions, self.dtype)
        ctx = StepContext(cos=cos, sin=sin, token_mask=None, key_valid=jnp.ones((b, t - 1), bool),
                          query_slot=jnp.arange(t - 1, dtype=jnp.int32)[None])
        if probe is not None:
            y, _, captured = self.mtp(self.embed(input_ids[:, 1:]), hidden[:, :-1], ctx, probe=probe)
            return self.logits_from_hidden(y), y, captured
        y, _ = self.mtp(self.embed(input_ids[:, 1:]), hidden[:, :-1], ctx)
        return self.logits_from_hidden(y)


def _advanced(cache: Cache, slots: tuple, ctx: StepContext, mask: jnp.ndarray, rows=None,
              position_ids: jnp.ndarray | None = None) -> Cache:
    """``cache`` after a call wrote ``slots`` at ``rows``: the call's valid keys, and each row's length and next
    position moved past its tokens (``mask [B, T]``: the real ones) — past the largest given position of its real
    tokens when the call had ``position_ids`` (``[B, T]`` or ``[3, B, T]``; an image's tokens span fewer positions
    than tokens)."""
    lengths = gather_rows(cache.lengths, rows) + ctx.span
    positions = gather_rows(cache.positions, rows)
    if position_ids is None:
        positions = positions + jnp.sum(mask, axis=1, dtype=jnp.int32)
    else:
        given = position_ids if position_ids.ndim == 3 else position_ids[None]
        top = jnp.max(jnp.where(mask[None], given, -1), axis=(0, 2)).astype(jnp.int32)
        positions = jnp.where(jnp.any(mask, axis=1), top + 1, positions)
    return Cache(slots=slots, key_valid=scatter_rows(cache.key_valid, rows, ctx.key_valid),
                 positions=scatter_rows(cache.positions, rows, positions),
                 lengths=scatter_rows(cache.lengths, rows, lengths))


# modules whose __call__ takes ``layer`` and indexes every one of their variables with it (through the kernels)
_STACK_READERS = (Linear, Experts, Conv1d)
# variables of other modules indexed the same way by their module: the GDN's decay parameters (the fused decode
# kernel reads them, and the conv weight, inside their stacks; a sliced layer would be a copy before the kernel)
_STACK_READ_VARIABLES = ((GatedDeltaNet, ("A_log", "dt_bias")),)


def _read_in_stack(readers: frozenset, path, value) -> bool:
    """Variables the layer scan passes whole (``[G, …]``): those of the modules at ``readers`` (their paths, the
    :data:`_STACK_READERS` of the group) and the variables at ``readers`` (:data:`_STACK_READ_VARIABLES`), which are
    read at layer g inside the stack by the code that uses them."""
    return any(tuple(path[:i]) in readers for i in range(1, len(path) + 1))


def layer_period(cfg: TextConfig, quant: ModelQuant | None) -> tuple:
    """The shortest repeating group of (layer type, quantization) specs that tiles the decoder stack."""
    specs = [(cfg.layer_types[i], quant.layers[i] if quant is not None and i < len(quant.layers) else ())
             for i in range(cfg.num_hidden_layers)]
    n = len(specs)
    for p in range(1, n + 1):
        if n % p == 0 and all(specs[i] == specs[i % p] for i in range(n)):
            return tuple(specs[:p])
    return tuple(specs)


@functools.partial(jax.jit, static_argnums=0)
def _jit_logits(graphdef, state, input_ids, attention_mask, position_ids):
    model = nnx.merge(graphdef, state)
    return model.forward(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits


def init_model(cfg: TextConfig, *, dtype=jnp.float32, seed: int = 0, with_mtp: bool = False,
               vision: VisionConfig | None = None) -> Qwen3_5MoeForCausalLM:
    """A randomly initialised model (HF's init scheme: normal(initializer_range) matrices, zero norm offsets), with a
    vision tower when ``vision`` is given. ``dtype``: one of :data:`qjax.model.dtypes.MODEL_DTYPES` (float64
    switches x64 on)."""
    dtype = model_dtype(dtype, "init_model(dtype=…)")
    return Qwen3_5MoeForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed), with_mtp=with_mtp, vision=vision)


def abstract_model(cfg: TextConfig, *, dtype=jnp.float32, with_mtp: bool = False,
                   quant: ModelQuant | None = None, vision: VisionConfig | None = None, vision_dtype=None,
                   with_visual: bool = True) -> Qwen3_5MoeForCausalLM:
    """The model's structure with shape/dtype placeholders only (no memory): the loader fills it."""
    return nnx.eval_shape(lambda: Qwen3_5MoeForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0), with_mtp=with_mtp,
                                                        quant=quant, vision=vision, vision_dtype=vision_dtype,
                                                        with_visual=with_visual))
