"""Change sites inside a forward pass: replace them (values + mask), shift them (deltas), edit them (JAX functions).

    out = patch(model, ids, values={"mlp_output": v}, masks={"mlp_output": np.arange(L) == 3})  # layer 3 only
    logits = swap_blocks(quantized, float_model, ids, layers=[5])     # block 5 of the float model, in the quantized
    logits = run(model, ids, Probe(edit=ablate_experts({2: [0, 3]}))).logits   # zero experts 0 and 3 of layer 2
    loss, grads = site_gradients(model, ids, ("hidden_states",), loss_fn)      # d loss / d site, [L, B, T, H]

Values and masks are explicit arrays entering the jitted program (``jnp.where``), never Python hooks at run time. A
block's output is what it adds to the residual stream: ``attn_output`` + ``mlp_output`` (:data:`BLOCK_SITES`);
swapping both from another model's run on the same tokens puts that model's block into this one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.model.probe import INT_SITES, Probe, ProbeError
from qjax.research.capture import Capture, capture, probed_forward, run

BLOCK_SITES = ("attn_output", "mlp_output")  # what a decoder block adds to the residual stream


def patch_inputs(values: dict | None = None, masks: dict | None = None, deltas: dict | None = None,
                 num_layers: int | None = None) -> dict:
    """``probe_inputs`` for :func:`qjax.research.capture.run`: ``values {site: [L, …]}`` with ``masks`` (``[L]``,
    ``[L, B]``, ``[L, B, T]`` or the values' shape; default all True) and ``deltas {site: [L, …]}``."""
    values, deltas, masks = dict(values or {}), dict(deltas or {}), dict(masks or {})
    bad = sorted(set(masks) - set(values))
    if bad:
        raise ProbeError(f"masks given for {bad} without values")
    out_masks = {}
    for site, v in values.items():
        if num_layers is not None and np.shape(v)[0] != num_layers:
            raise ProbeError(f"values[{site!r}]: leading axis {np.shape(v)[0]} is not the {num_layers} layers")
        m = jnp.ones((np.shape(v)[0],), bool) if site not in masks else jnp.asarray(masks[site], bool)
        if m.shape != np.shape(v)[:m.ndim]:
            raise ProbeError(f"masks[{site!r}]: shape {m.shape} is not a leading part of the values' {np.shape(v)}")
        out_masks[site] = m
    return {"values": {k: jnp.asarray(v) for k, v in values.items()}, "masks": out_masks,
            "deltas": {k: jnp.asarray(v) for k, v in deltas.items()}}


def patch(model, input_ids, values: dict | None = None, masks: dict | None = None, deltas: dict | None = None,
          edit: tuple = (), capture_sites: tuple = (), attention_mask=None) -> Capture:
    """One forward pass of ``input_ids [B, T]`` with sites replaced (``values`` where ``masks``), shifted (``deltas``)
    and edited (``edit``: ``(site, fn)`` pairs, see :class:`qjax.model.probe.Probe`), capturing ``capture_sites``."""
    values, deltas = values or {}, deltas or {}
    probe = Probe(capture=tuple(capture_sites), patch=tuple(values), add=tuple(deltas), edit=tuple(edit))
    inputs = patch_inputs(values, masks, deltas, model.config.num_hidden_layers)
    return run(model, input_ids, probe, inputs, attention_mask=attention_mask)


def layer_mask(layers, num_layers: int) -> np.ndarray:
    """``[L]`` bool, True at ``layers``."""
    m = np.zeros(num_layers, bool)
    m[list(layers)] = True
    return m


def swap_blocks(model, source, input_ids, layers, sites=BLOCK_SITES, attention_mask=None) -> Capture:
    """``model`` on ``input_ids`` with the blocks at ``layers`` contributing what ``source``'s blocks contribute on
    the same tokens (``sites``' values captured from ``source``'s own run). Every block swapped makes the residual
    stream ``source``'s exactly, so with the same final norm and lm_head the logits are ``source``'s bit for bit."""
    src = capture(source, input_ids, tuple(sites), attention_mask=attention_mask).sites
    n = model.config.num_hidden_layers
    mask = layer_mask(layers, n)
    return patch(model, input_ids, values=src, masks={s: mask for s in sites}, attention_mask=attention_mask)


def ablate_experts(experts: dict, mode: str = "zero", means=None) -> tuple:
    """``edit`` entries that knock experts out: ``experts {layer: [expert, …]}``.

    ``mode="zero"``: the expert's routing weight becomes 0 wherever it was selected (the other selected experts keep
    their weights, as pruning an expert out of a trained model does). ``mode="mean"``: its output is replaced by
    ``means [L, E, H]`` — its mean output (:func:`expert_means`) — wherever it was selected (needs the per-expert
    outputs: k extra expert passes per probed layer)."""
    table = np.zeros((max(experts) + 1 if experts else 1, 1 + max((max(v) for v in experts.values() if v),
                                                                  default=0)), bool)
    for layer, ids in experts.items():
        table[layer, list(ids)] = True
    table = jnp.asarray(table)

    def knocked(layer, idx):  # [B, T, k] bool: the selected expert is ablated at this layer
        rows = jnp.where(layer < table.shape[0], table[jnp.minimum(layer, table.shape[0] - 1)], False)
        return rows[jnp.minimum(idx, table.shape[1] - 1)] & (idx < table.shape[1])

    if mode == "zero":
        def zero(w, layer, seen):
            return jnp.where(knocked(layer, seen["expert_indices"]), 0, w)
        return (("expert_weights", zero),)
    if mode == "mean":
        if means is None:
            raise ProbeError("mean ablation needs means [L, E, H] (expert_means)")
        means = jnp.asarray(means)

        def mean(out, layer, seen):
            idx = seen["expert_indices"]
            return jnp.where(knocked(layer, idx)[..., None], means[layer][idx].astype(out.dtype), out)
        return (("expert_outputs", mean),)
    raise ProbeError(f"ablation mode {mode!r}: 'zero' or 'mean'")


def expert_means(model, input_ids, attention_mask=None) -> np.ndarray:
    """Each expert's mean output over the tokens that selected it, ``[L, E, H]`` (zeros for an unused expert)."""
    sites = capture(model, input_ids, ("expert_indices", "expert_outputs"), attention_mask=attention_mask).sites
    idx = np.asarray(sites["expert_indices"])  # [L, B, T, k]
    out = np.asarray(sites["expert_outputs"], np.float64)  # [L, B, T, k, H]
    n_layers, e = idx.shape[0], model.config.num_experts
    means = np.zeros((n_layers, e, out.shape[-1]))
    for layer in range(n_layers):
        flat_idx, flat_out = idx[layer].reshape(-1), out[layer].reshape(-1, out.shape[-1])
        counts = np.bincount(flat_idx, minlength=e)
        np.add.at(means[layer], flat_idx, flat_out)
        means[layer] /= np.maximum(counts, 1)[:, None]
    return means.astype(np.float32)


def site_gradients(model, input_ids, sites, loss_fn, attention_mask=None):
    """``loss_fn(logits [B, T, V]) → scalar`` and its gradient with respect to each of ``sites``, ``{site: [L, B, T,
    …]}``: the gradient of a zero delta added at the site (Flax's ``perturb`` recipe, as explicit inputs).
    Attribution patching estimates the effect of patching a site to ``v`` as ``Σ grad · (v − value)``."""
    sites = tuple(sites)
    bad = sorted(set(sites) & INT_SITES)
    if bad:
        raise ProbeError(f"{bad} hold integers: no gradient")
    shapes = capture(model, input_ids, sites, attention_mask=attention_mask).sites
    graphdef, state = nnx.split(model)
    probe = Probe(add=sites)
    ids = jnp.asarray(input_ids, jnp.int32)
    mask = None if attention_mask is None else jnp.asarray(attention_mask)
    return _value_and_grad(graphdef, probe, loss_fn, state, ids, mask,
                           {s: jnp.zeros(a.shape, a.dtype) for s, a in shapes.items()})


def _loss_of_deltas(deltas, graphdef, probe, loss_fn, state, ids, mask):
    inputs = {"values": {}, "masks": {}, "deltas": deltas}
    return loss_fn(probed_forward(nnx.merge(graphdef, state), ids, probe, inputs, mask).logits)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _value_and_grad(graphdef, probe, loss_fn, state, ids, mask, deltas):
    return jax.value_and_grad(_loss_of_deltas)(deltas, graphdef, probe, loss_fn, state, ids, mask)
