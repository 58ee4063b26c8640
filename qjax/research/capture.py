"""Capture named sites of a forward pass, stacked over layers.

    cap = capture(model, ids, ("hidden_states", "router_logits"))
    cap.sites["router_logits"]        # [L, B, T, E]
    cap.logits                        # [B, T, V]

Works the same for a float model and a packed quantized one (the sites are the model's, not the checkpoint's), inside
``jax.jit`` (:func:`probed_forward` is traceable), batched (left padding through ``attention_mask``), without host
callbacks: the captures are outputs of the layer scan. Site names and shapes: :data:`qjax.model.probe.SITES`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from qjax.model.probe import SITES, Probe


@struct.dataclass
class Capture:
    """A probed forward's outputs (a pytree: it can leave a ``jax.jit``)."""

    logits: jnp.ndarray  # [B, T, V] (accumulation dtype)
    hidden: jnp.ndarray  # [B, T, H] the final norm's output
    sites: dict  # {site: [L, B, T, …]}


def probed_forward(model, input_ids, probe: Probe, probe_inputs: dict | None = None, attention_mask=None) -> Capture:
    """The model's forward with ``probe`` (traceable: call it inside your own ``jax.jit`` or ``jax.grad``).

    Args:
      input_ids: ``[B, T]`` int.
      probe: what to capture and change (:class:`qjax.model.probe.Probe`).
      probe_inputs: ``{"values": {site: [L, …]}, "masks": {site: [L, …] bool}, "deltas": {site: [L, …]}}`` for the
        probe's patched and shifted sites (:func:`qjax.research.patch.patch_inputs` builds it).
      attention_mask: ``[B, T]`` (1 = token; padding on the left) or None.
    """
    out = model.forward(input_ids, attention_mask=attention_mask, probe=probe, probe_inputs=probe_inputs)
    return Capture(logits=out.logits, hidden=out.hidden, sites=out.captures)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jit_probed(graphdef, probe, state, input_ids, attention_mask, probe_inputs):
    cap = probed_forward(nnx.merge(graphdef, state), input_ids, probe, probe_inputs, attention_mask)
    return cap.logits, cap.hidden, cap.sites


def run(model, input_ids, probe: Probe, probe_inputs: dict | None = None, attention_mask=None) -> Capture:
    """:func:`probed_forward` as one jitted program (compiled once per model structure, probe and shapes)."""
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(input_ids, jnp.int32)
    if ids.ndim == 1:
        ids = ids[None]
    mask = None if attention_mask is None else jnp.asarray(attention_mask)
    logits, hidden, sites = _jit_probed(graphdef, probe, state, ids, mask, probe_inputs)
    return Capture(logits=logits, hidden=hidden, sites=sites)


def capture(model, input_ids, sites=("hidden_states", "router_logits"), attention_mask=None) -> Capture:
    """Capture ``sites`` (names from :data:`qjax.model.probe.SITES`) of one forward pass of ``input_ids [B, T]``:
    ``Capture.sites[site]`` is ``[L, B, T, …]`` (layer l's value at ``[l]``)."""
    if isinstance(sites, str):
        sites = (sites,)
    return run(model, input_ids, Probe(capture=tuple(sites)), attention_mask=attention_mask)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jit_mtp(graphdef, probe, state, input_ids):
    model = nnx.merge(graphdef, state)
    hidden = model.forward(input_ids).hidden
    return model.mtp_logits(input_ids, hidden, probe=probe)


def capture_mtp(model, input_ids, sites=("hidden_states", "router_logits")) -> Capture:
    """The MTP head's states on ``input_ids [B, T]`` (teacher-forced, as :meth:`mtp_logits` runs it): ``logits``
    ``[B, T-1, V]`` (row t predicts token t+2), ``hidden`` the head's output after ``mtp.norm`` ``[B, T-1, H]``, and
    ``sites`` of its decoder layer(s) ``[L_mtp, B, T-1, …]`` (capture only: the head takes no patches)."""
    if model.mtp is None:
        raise ValueError("this model has no MTP head (the checkpoint has no mtp.* weights)")
    if isinstance(sites, str):
        sites = (sites,)
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(input_ids, jnp.int32)
    logits, hidden, captured = _jit_mtp(graphdef, Probe(capture=tuple(sites)), state, ids if ids.ndim == 2 else ids[None])
    return Capture(logits=logits, hidden=hidden, sites=captured)


__all__ = ["SITES", "Capture", "Probe", "capture", "capture_mtp", "probed_forward", "run"]
