"""Importance matrices: Σ x² per input channel of every projection, over the calibration stream (auto-round's
imatrix hooks, collected during the float reference forward of a block).

The layer copy gets capture wrappers around its projections (Flax NNX ``sow``), so the model code stays untouched.
An expert that receives no token gets all ones, as auto-round does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.kernels import route, silu


class _CaptureLinear(nnx.Module):
    def __init__(self, inner):
        self.inner = inner

    def __call__(self, x, layer=None):
        x2 = jnp.square(x.astype(jnp.float32)).reshape(-1, x.shape[-1])
        self.sow(nnx.Intermediate, "sq", jnp.sum(x2, axis=0))
        return self.inner(x, layer)


class _CaptureExperts(nnx.Module):
    """Σx² of each expert's gate/up input (its routed tokens) and of its down input (SiLU(gate)·up of those)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, x, idx, weights):
        self._capture(x, idx)
        return self.inner(x, idx, weights)

    def routed(self, x, router_logits, top_k: int, layer=None):
        """The model's routed call (router logits → experts in one kernel call): the same routing, captured."""
        _, idx = route(router_logits, top_k)
        self._capture(x, idx)
        return self.inner.routed(x, router_logits, top_k, layer)

    def _capture(self, x, idx) -> None:
        gu, dn = self.inner.gate_up_proj[...], self.inner.down_proj[...]
        e, inter = gu.shape[0], dn.shape[-1]
        routed = jax.nn.one_hot(idx, e, dtype=jnp.float32).sum(axis=1)  # [N, E]
        xf = x.astype(jnp.float32)
        self.sow(nnx.Intermediate, "sq_in", routed.T @ jnp.square(xf))  # [E, H]

        def down_input(j):
            h = xf @ gu[j].astype(jnp.float32).T  # [N, 2I]
            a = silu(h[:, :inter]) * h[:, inter:]
            return routed[:, j] @ jnp.square(a)  # [I]

        self.sow(nnx.Intermediate, "sq_down", jax.lax.map(down_input, jnp.arange(e)))  # [E, I]
        self.sow(nnx.Intermediate, "count", routed.sum(axis=0))


def _parent(module, path):
    for name in path:
        module = getattr(module, name)
    return module


def collect(layer, h: jnp.ndarray, units, ctx_fn, batch_size: int) -> dict[str, jnp.ndarray]:
    """``{unit name: imatrix}``: ``[in]`` for a dense unit, ``[E, in]`` for an expert unit.

    Args:
      layer: the float decoder layer (left unchanged; a copy is instrumented).
      h: its input stream ``[n, T, H]``.
      units: the units to collect for.
      ctx_fn: ``batch → StepContext``.
    """
    graphdef0, state0 = nnx.split(layer)
    probe = nnx.merge(graphdef0, state0)  # an independent copy
    dense = [u for u in units if not u.experts]
    for u in dense:
        parent = _parent(probe, u.path[:-2])
        setattr(parent, u.path[-2], _CaptureLinear(getattr(parent, u.path[-2])))
    has_experts = any(u.experts for u in units)
    if has_experts:
        probe.mlp.experts = _CaptureExperts(probe.mlp.experts)
    graphdef, state = nnx.split(probe)

    @jax.jit
    def run(state, x, ctx):
        m = nnx.merge(graphdef, state)
        m(x, ctx, None)
        return nnx.to_pure_dict(nnx.pop(m, nnx.Intermediate))

    total = None
    for s in range(0, h.shape[0], batch_size):
        x = h[s:s + batch_size]
        got = run(state, x, ctx_fn(x.shape[0]))
        total = got if total is None else jax.tree.map(jnp.add, total, got)

    out: dict[str, jnp.ndarray] = {}
    for u in dense:
        node = _parent_dict(total, u.path[:-1])
        out[u.name] = _first(node["sq"])
    if has_experts:
        node = total["mlp"]["experts"]
        count = _first(node["count"])[:, None]
        sq_in = jnp.where(count > 0, _first(node["sq_in"]), 1.0)
        sq_down = jnp.where(count > 0, _first(node["sq_down"]), 1.0)
        for u in units:
            if u.experts:
                out[u.name] = sq_down if u.name.endswith("down_proj") else sq_in
    return out


def _first(v):
    # sow keeps a tuple of the values of each call; each projection is called once per forward
    if isinstance(v, dict):
        v = v[0] if 0 in v else v["0"] if "0" in v else next(iter(v.values()))
    elif isinstance(v, (tuple, list)):
        v = v[0]
    return v


def _parent_dict(d, path):
    for name in path:
        d = d[name]
    return d
