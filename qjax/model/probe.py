"""Named sites inside a decoder layer, and the taps that capture or patch them (research instruments, issue 50).

A :class:`Probe` is a static description — which sites to capture, which to replace by given values, which to shift
by given deltas, which to edit with a JAX function — passed to ``forward(probe=…)``. The model calls one
:class:`Tap` per layer at each site (``value = tap(site, value)``); without a probe it is :data:`NO_TAP`, which
returns every value untouched, so the plain forward traces to the same program as before (no captured output, no
extra operand, no branch). Captures leave the layer scan as its outputs, stacked ``[L, B, T, …]``; patch values and
deltas enter it as scanned inputs ``[L, B, T, …]``: everything stays inside one jitted program, with no host callback.

The routed experts run fused with the routing (:func:`qjax.kernels.moe_routed`: at one decode token the GPU kernel
routes inside); a probed layer runs :func:`moe_block` instead — router, :func:`qjax.kernels.route`, the experts,
the shared expert — the same operations in the same order (on the reference path the same bits: the fused entry
point is route then :func:`qjax.kernels.moe_experts`), with the routing decisions exposed as sites that can be read
and changed.

Sites (``L`` decoder layers, ``E`` experts, ``k`` experts per token; transformers' names where it has one):
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from qjax.kernels import accum_dtype, route, sigmoid

# site → what it is and its per-layer shape (each is captured stacked over layers: [L, *shape])
SITES: dict[str, str] = {
    "attn_input": "[B, T, H] input_layernorm's output, the token mixer's input",
    "attn_output": "[B, T, H] the token mixer's output (self_attn or linear_attn), before the residual add",
    "mlp_input": "[B, T, H] post_attention_layernorm's output, the sparse MoE block's input",
    "mlp_output": "[B, T, H] the sparse MoE block's output (routed + gated shared expert), before the residual add",
    "hidden_states": "[B, T, H] the residual stream after the layer (transformers' hidden_states[i + 1])",
    "router_logits": "[B, T, E] mlp.gate's output (transformers' output_router_logits, reshaped)",
    "expert_indices": "[B, T, k] int32 the selected experts (top-k of the softmax), best first",
    "expert_weights": "[B, T, k] their renormalised routing weights",
    "expert_outputs": "[B, T, k, H] each selected expert's output before weighting (k extra expert passes)",
    "routed_output": "[B, T, H] the weighted sum of the selected experts' outputs",
    "shared_expert_output": "[B, T, H] mlp.shared_expert's output (before its gate)",
    "shared_expert_gate": "[B, T, 1] mlp.shared_expert_gate's output (a logit: the gate is its sigmoid)",
}
__doc__ += "\n".join(f"  - ``{k}``: {v}" for k, v in SITES.items())
# the sites only the decomposed MoE path (moe_block) has
MOE_SITES = frozenset(("router_logits", "expert_indices", "expert_weights", "expert_outputs", "routed_output",
                       "shared_expert_output", "shared_expert_gate"))
# integer sites: capture and replace, never shift (no gradient either)
INT_SITES = frozenset(("expert_indices",))


class ProbeError(ValueError):
    """A probe names an unknown site or asks for something a site cannot do."""


def _sites(what: str, names) -> tuple[str, ...]:
    names = tuple(names)
    bad = [n for n in names if n not in SITES]
    if bad:
        raise ProbeError(f"{what}: unknown site(s) {bad}; sites: {', '.join(SITES)}")
    return names


@dataclasses.dataclass(frozen=True)
class Probe:
    """What a forward call captures and changes (static: part of the compiled program's key).

    capture: sites returned in ``ForwardOutput.captures`` (``{site: [L, B, T, …]}``), as they are after any change.
    patch: sites replaced where a mask is True: ``where(mask[l], values[l], value)`` with ``values [L, B, T, …]`` and
      ``mask`` ``[L]``, ``[L, B]``, ``[L, B, T]`` or the values' full shape (bool), given in ``forward(probe_inputs=…)``.
    add: sites shifted by ``deltas [L, B, T, …]`` (zeros change nothing: differentiate at zero for the gradient with
      respect to the site — attribution patching).
    edit: ``(site, fn)`` pairs: ``fn(value, layer, seen) → value``, with ``layer`` the traced int32 layer index and
      ``seen`` the layer's sites reached before this one (``{site: value}``: an expert ablation reads
      ``seen["expert_indices"]``); a JAX function run inside the program (ablations, steering). Functions compare by
      identity: keep one object per edit, or the program is traced again.
    """

    capture: tuple[str, ...] = ()
    patch: tuple[str, ...] = ()
    add: tuple[str, ...] = ()
    edit: tuple[tuple[str, Callable], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "capture", _sites("capture", self.capture))
        object.__setattr__(self, "patch", _sites("patch", self.patch))
        object.__setattr__(self, "add", _sites("add", self.add))
        _sites("edit", (s for s, _ in self.edit))
        if INT_SITES & set(self.add):
            raise ProbeError(f"add: {sorted(INT_SITES & set(self.add))} hold integers; patch or edit them instead")

    @property
    def sites(self) -> frozenset:
        """Every site the probe touches."""
        return frozenset((*self.capture, *self.patch, *self.add, *(s for s, _ in self.edit)))

    @property
    def touches_moe(self) -> bool:
        return bool(self.sites & MOE_SITES)

    def tap(self, inputs: dict | None, layer) -> Tap:
        """The tap of one layer: ``inputs`` holds this layer's slices of the patch values, masks and deltas."""
        return Tap(self, inputs or {}, layer)


class Tap:
    """One layer's view of a :class:`Probe`: ``tap(site, value)`` applies the edit, the patch and the delta, in that
    order, keeps the result when the site is captured, and returns it. ``captured`` holds what was kept."""

    def __init__(self, probe: Probe, inputs: dict, layer):
        self.probe, self.inputs, self.layer = probe, inputs, layer
        self.captured: dict[str, jnp.ndarray] = {}
        self.seen: dict[str, jnp.ndarray] = {}  # every site reached so far, as changed (what edits may read)

    def __call__(self, site: str, value: jnp.ndarray) -> jnp.ndarray:
        p = self.probe
        for s, fn in p.edit:
            if s == site:
                value = jnp.asarray(fn(value, self.layer, dict(self.seen))).astype(value.dtype)
        if site in p.patch:
            new, mask = self.inputs["values"][site], self.inputs["masks"][site]
            mask = mask.reshape(mask.shape + (1,) * (value.ndim - mask.ndim))
            value = jnp.where(mask, new.astype(value.dtype), value)
        if site in p.add:
            value = value + self.inputs["deltas"][site].astype(value.dtype)
        if site in p.capture:
            self.captured[site] = value
        self.seen[site] = value
        return value

    def wants(self, site: str) -> bool:
        return site in self.probe.sites

    def moe(self, mlp, x: jnp.ndarray, layer) -> jnp.ndarray:
        """The sparse MoE block ``mlp`` (a :class:`qjax.model.moe.SparseMoeBlock`) on ``x [B, T, H]``."""
        if not self.probe.touches_moe:
            return mlp(x, layer=layer)
        return moe_block(mlp, x, layer, self)


class _NoTap:
    """The plain forward's tap: every value passes untouched, the MoE block runs as it always does."""

    @property
    def captured(self) -> dict:
        return {}

    def __call__(self, site: str, value):
        return value

    def wants(self, site: str) -> bool:
        return False

    def moe(self, mlp, x, layer):
        return mlp(x, layer=layer)


NO_TAP = _NoTap()


def moe_block(mlp, x: jnp.ndarray, layer, tap: Tap) -> jnp.ndarray:
    """:class:`qjax.model.moe.SparseMoeBlock` 's computation with its routing exposed: ``x [B, T, H]`` → ``[B, T, H]``.

    The experts run through their module (``mlp.experts``: dense or packed, the same kernels); with ``expert_outputs``
    touched each of the k selected experts runs alone (weight 1) and the weighted sum is formed here in the
    accumulation dtype."""
    b, t, h = x.shape
    xf = x.reshape(b * t, h)
    k = mlp.top_k
    logits = tap("router_logits", mlp.gate(xf, layer).reshape(b, t, -1)).reshape(b * t, -1)
    weights, idx = route(logits, k)
    idx = tap("expert_indices", idx.reshape(b, t, k)).reshape(b * t, k).astype(jnp.int32)
    weights = tap("expert_weights", weights.reshape(b, t, k)).reshape(b * t, k)
    if tap.wants("expert_outputs"):
        ones = jnp.ones((b * t, 1), weights.dtype)
        outs = jnp.stack([mlp.experts(xf, idx[:, j:j + 1], ones, layer) for j in range(k)], axis=1)  # [N, k, H]
        outs = tap("expert_outputs", outs.astype(x.dtype).reshape(b, t, k, h)).reshape(b * t, k, h)
        acc = accum_dtype(x.dtype)
        routed = jnp.einsum("nk,nkh->nh", weights.astype(acc), outs.astype(acc))
    else:
        routed = mlp.experts(xf, idx, weights, layer)
    routed = tap("routed_output", routed.astype(x.dtype).reshape(b, t, h)).reshape(b * t, h)
    gate = tap("shared_expert_gate", mlp.shared_expert_gate(xf, layer).reshape(b, t, 1)).reshape(b * t, 1)
    shared = tap("shared_expert_output", mlp.shared_expert(xf, layer).reshape(b, t, h)).reshape(b * t, h)
    return (routed + sigmoid(gate) * shared).reshape(b, t, h)


def group_inputs(inputs: dict | None, groups: int, period: int):
    """Patch inputs ``{kind: {site: [L, …]}}`` → ``[G, p, …]`` leaves, the layer scan's per-group slices."""
    if not inputs:
        return None
    return jax.tree.map(lambda a: a.reshape(groups, period, *a.shape[1:]), inputs)


def layer_inputs(inputs, j: int):
    """Position ``j`` of a group's ``[p, …]`` inputs."""
    return None if inputs is None else jax.tree.map(lambda a: a[j], inputs)


def stack_captures(taps: list[Tap]) -> dict[str, jnp.ndarray]:
    """Each layer of a group's captures → ``{site: [p, …]}``."""
    return {s: jnp.stack([tp.captured[s] for tp in taps]) for s in taps[0].captured} if taps else {}
