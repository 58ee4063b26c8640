"""One decode step of the gated delta rule as a single Pallas (Triton backend) kernel, beside its plain-JAX reference.

At batch-1 decode a Gated DeltaNet layer's recurrence is tiny (32 heads × a 128×128 fp32 state) but XLA splits it
into five kernels (the q/k l2-norms, the decay, ``Sᵀk``, the update, ``Sᵀq``) that each read the 2 MB state; the
step is launch-bound (docs/kernels.md: "batch 1 is latency-bound"). Here one program per (row, value head, block of
``BV`` value columns) does it all on a ``[Dk, BV]`` tile of the state held in registers — the columns of the state
are independent in the delta rule:

    q̂ = q / ‖q‖ · Dk^−½,  k̂ = k / ‖k‖     (ε = 1e-6 inside the root, FLA's and transformers' l2norm)
    S ← e^g · S;   S ← S + k̂ ⊗ β (v − Sᵀk̂);   o = Sᵀq̂

Value head ``h`` reads q/k head ``h // (Hv / Hk)`` (repeat-interleave, docs/model.md §8.11). Everything is fp32; ``o``
is returned in q's dtype, the new state in fp32. The reference is :func:`.gdn_reference.gated_delta_step_reference` (the
recurrence for one token (same contract, same op order; the fp32 sums differ in order only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .gdn_reference import gated_delta_step_reference

__all__ = ["gated_delta_step_pallas", "gated_delta_step_reference", "lowering_cases", "supported"]

_BV = 32  # value columns per program: a [128, 32] fp32 tile is 16 KB of registers for 4 warps


def supported(q_shape, v_shape) -> bool:
    """Power-of-two head dims (Triton tensors) with at least 16 elements, and value heads a multiple of qk heads."""
    dk, hk, hv, dv = q_shape[-1], q_shape[-2], v_shape[-2], v_shape[-1]
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    return pow2(dk) and pow2(dv) and hv % hk == 0


def _kernel(layer_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, eps: float, bv: int):
    """Program (b, h, j): value head h of row b, value columns ``[j·BV, (j+1)·BV)``; the state is the whole
    ``[L, B, Hv, Dk, Dv]`` stack (aliased to ``s_out_ref``), indexed at the asked layer: read and written in place."""
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lyr = layer_ref[0]
    q = q_ref[0, 0, :].astype(jnp.float32)  # [Dk]
    k = k_ref[0, 0, :].astype(jnp.float32)
    v = v_ref[0, 0, :].astype(jnp.float32)  # [BV]
    g = g_ref[0, 0].astype(jnp.float32)
    beta = beta_ref[0, 0].astype(jnp.float32)
    q = q * lax.rsqrt(jnp.sum(q * q) + eps)
    q = q * (q.shape[0] ** -0.5)
    k = k * lax.rsqrt(jnp.sum(k * k) + eps)
    rows = lax.iota(jnp.int32, q.shape[0])[:, None]
    cols = (j * bv + lax.iota(jnp.int32, bv))[None, :]
    s = plgpu.load(s_ref.at[lyr, b, h, rows, cols]) * jnp.exp(g)  # [Dk, BV]
    kv_mem = jnp.sum(s * k[:, None], axis=0)
    delta = (v - kv_mem) * beta
    s = s + k[:, None] * delta[None, :]
    o_ref[0, 0, :] = jnp.sum(s * q[:, None], axis=0).astype(o_ref.dtype)
    plgpu.store(s_out_ref.at[lyr, b, h, rows, cols], s)


def _forward(q, k, v, g, beta, state, layer, interpret: bool):
    b, hk, dk = q.shape
    hv, dv = v.shape[1:]
    rep = hv // hk
    bv = min(_BV, dv)
    qk_spec = pl.BlockSpec((1, 1, dk), lambda i, h, j: (i, h // rep, 0))
    whole = pl.BlockSpec(state.shape, lambda i, h, j: (0,) * state.ndim)
    o, s = pl.pallas_call(
        functools.partial(_kernel, eps=1e-6, bv=bv),
        out_shape=(jax.ShapeDtypeStruct((b, hv, dv), q.dtype), jax.ShapeDtypeStruct(state.shape, jnp.float32)),
        grid=(b, hv, dv // bv),
        in_specs=[pl.BlockSpec((1,), lambda i, h, j: (0,)), qk_spec, qk_spec,
                  pl.BlockSpec((1, 1, bv), lambda i, h, j: (i, h, j)),
                  pl.BlockSpec((1, 1), lambda i, h, j: (i, h)),
                  pl.BlockSpec((1, 1), lambda i, h, j: (i, h)),
                  whole],
        out_specs=(pl.BlockSpec((1, 1, bv), lambda i, h, j: (i, h, j)), whole),
        input_output_aliases={6: 1},  # the state stack is updated in place: only this layer's tiles are written
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="qjax_gdn_decode",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), q, k, v, g, beta, state)
    return o, s


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _step(q, k, v, g, beta, state, layer, interpret):
    return _forward(q, k, v, g, beta, state, layer, interpret)


def _step_fwd(q, k, v, g, beta, state, layer, interpret):
    return _forward(q, k, v, g, beta, state, layer, interpret), (q, k, v, g, beta, state, layer)


def _step_bwd(interpret, res, cts):
    del interpret
    *args, layer = res
    _, vjp = jax.vjp(lambda *a: gated_delta_step_reference(*a, layer=layer), *args)
    return (*vjp(cts), None)


_step.defvjp(_step_fwd, _step_bwd)


def gated_delta_step_pallas(q, k, v, g, beta, state, *, layer=None, interpret: bool = False):
    """:func:`gated_delta_step_reference`'s contract through one Pallas kernel (``interpret=True``: on CPU).

    ``layer``: ``state`` is a ``[L, B, Hv, Dk, Dv]`` stack and this is layer ``layer`` (an int32 scalar, may be
    traced): its state is read and written inside the stack (aliased: no copy of the layer out or back in) and the
    stack is returned. Differentiable (backward through the reference). Shapes the kernel cannot take (see
    :func:`supported`) raise.
    """
    b, hk, dk = q.shape
    lead = () if layer is None else state.shape[:1]
    if k.shape != q.shape or v.shape[0] != b or g.shape != v.shape[:2] or beta.shape != g.shape \
            or state.shape != (*lead, b, v.shape[1], dk, v.shape[2]) or state.dtype != jnp.float32:
        raise ValueError(f"gated delta step: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}, "
                         f"state {state.shape} {state.dtype} do not fit q/k [B, Hk, Dk], v [B, Hv, Dv], g/beta "
                         "[B, Hv], float32 state [(L,) B, Hv, Dk, Dv]")
    if not supported(q.shape, v.shape):
        raise ValueError(f"gated delta step kernel: head dims {dk}/{v.shape[2]} must be powers of two ≥ 16 and "
                         f"{v.shape[1]} value heads a multiple of {hk} qk heads")
    if layer is None:
        o, s = _step(q, k, v, g, beta, state[None], jnp.zeros((), jnp.int32), bool(interpret))
        return o, s[0]
    return _step(q, k, v, g, beta, state, jnp.asarray(layer, jnp.int32), bool(interpret))


def lowering_cases() -> list[tuple[str, Callable, tuple[jax.ShapeDtypeStruct, ...]]]:
    """Qwen3.6-35B-A3B's GDN decode step (16 qk heads, 32 value heads, Dk = Dv = 128, bf16; the state read inside a
    10-layer stack) at batch 1, 8, 64."""
    sds = jax.ShapeDtypeStruct
    cases = []
    for b in (1, 8, 64):
        specs = (sds((b, 16, 128), jnp.bfloat16), sds((b, 16, 128), jnp.bfloat16), sds((b, 32, 128), jnp.bfloat16),
                 sds((b, 32), jnp.float32), sds((b, 32), jnp.bfloat16), sds((10, b, 32, 128, 128), jnp.float32),
                 sds((), jnp.int32))

        def fn(q, k, v, g, beta, state, layer):
            return gated_delta_step_pallas(q, k, v, g, beta, state, layer=layer, interpret=False)
        cases.append((f"gdn_decode_b{b}", fn, specs))
    return cases
