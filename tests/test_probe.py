"""qjax.model.probe: capture off leaves the plain forward's and the decode step's programs as they were, and a probe
names its sites strictly.

"As they were": the decoder layer and layer group as they read before the probe existed (their bodies, restated
below without taps) lower to the same StableHLO text as today's code with ``probe=None`` — and as a probe that
captures nothing. (Checked once more by hand against the commit before the feature: the same text hashes, forward
and decode, on the demo config.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import qjax
from qjax.model import qwen3_5_moe as qm
from qjax.model.config import LINEAR, TextConfig
from qjax.model.probe import Probe, ProbeError


def _layer_before(self, h, ctx, state, tap=None):  # DecoderLayer.__call__ before issue 50
    mixer = self.linear_attn if self.layer_type == LINEAR else self.self_attn
    with jax.named_scope("linear_attn" if self.layer_type == LINEAR else "self_attn"):
        out, state = mixer(self.input_layernorm(h), ctx, state)
    h = h + out
    with jax.named_scope("mlp"):
        h = h + self.mlp(self.post_attention_layernorm(h), layer=ctx.stack_layer)
    return h, state


def _group_before(self, h, ctx, states, collect=False):  # LayerGroup.__call__ before issue 50
    new_states, outs = [], []
    for i, layer in enumerate(self.layers):
        h, st = layer(h, ctx, None if states is None else states[i])
        new_states.append(st)
        outs.append(h)
    new_states = None if states is None else tuple(new_states)
    return h, new_states, (jnp.stack(outs) if collect else None)


@pytest.fixture(scope="module")
def tiny():
    from qjax.cli import DEMO_CONFIG

    cfg = TextConfig.from_dict(dict(DEMO_CONFIG, num_hidden_layers=4, layer_types=DEMO_CONFIG["layer_types"][:4]),
                               source="test")
    return qjax.init_model(cfg)


def _programs(model, **kw) -> tuple[str, str]:
    """StableHLO text of the forward (no cache, [2, 8]) and of one decode step (cache, [2, 1])."""
    graphdef, state = nnx.split(model)
    ids = jnp.ones((2, 8), jnp.int32)
    cache = model.init_cache(2, 16)

    def fwd(s, ids):
        return nnx.merge(graphdef, s).forward(ids, **kw).logits

    def step(s, cache, ids):
        out = nnx.merge(graphdef, s).forward(ids, cache=cache, **kw)
        return out.logits, out.cache

    return (jax.jit(fwd).lower(state, ids).as_text(debug_info=False),
            jax.jit(step).lower(state, cache, ids[:, :1]).as_text(debug_info=False))


def test_capture_off_leaves_forward_and_decode_programs_unchanged(tiny, monkeypatch):
    now = _programs(tiny)
    assert _programs(tiny, probe=Probe()) == now  # the feature present, nothing asked
    with monkeypatch.context() as m:
        m.setattr(qm.DecoderLayer, "__call__", _layer_before)
        m.setattr(qm.LayerGroup, "__call__", _group_before)
        before = _programs(tiny)
    assert before == now
    # and a capture does change it (the comparison can fail)
    assert _programs(tiny, probe=Probe(capture=("router_logits",)))[0] != now[0]


def test_probe_names_sites_strictly():
    with pytest.raises(ProbeError, match="unknown site.*'router_logit'.*router_logits"):
        Probe(capture=("router_logit",))
    with pytest.raises(ProbeError, match="integers"):
        Probe(add=("expert_indices",))
    assert Probe(capture=("hidden_states",)).touches_moe is False
    assert Probe(edit=(("expert_weights", lambda w, layer, seen: w),)).touches_moe is True


def test_probe_needs_one_device(tiny, monkeypatch):
    monkeypatch.setattr(tiny, "mesh_plan", object())
    with pytest.raises(ValueError, match="one device"):
        tiny.run_layers(None, None, None, probe=Probe(capture=("hidden_states",)))  # refused before it runs
