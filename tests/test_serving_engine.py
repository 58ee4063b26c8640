"""qjax.serving.engine: requests that join and leave a running batch get, token for token, what qjax.generate gives
each of them alone (float32, greedy and seeded sampling), through chunked prefill, slot reuse and aborts; the
engine compiles a bounded set of programs and nothing new for a second workload; FP8 K/V keeps its scales."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serve_util import alone

import qjax
from qjax.checkpoint.hub import default_model_dir
from qjax.serving import Engine, EngineConfig, EngineError, SamplingParams

_TRACES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **k: _TRACES.append(name) if name == "/jax/core/compile/jaxpr_trace_duration" else None)

CFG = EngineConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64, decode_steps=4)


@pytest.fixture(scope="module")
def model():
    return qjax.load_model(default_model_dir(), dtype=jnp.float32)


@pytest.fixture(scope="module")
def engine(model):
    """One engine for the tests of this module (its programs compile once); each test leaves it idle."""
    return Engine(model, CFG, eos_token_ids=eos_of(model))


def eos_of(model) -> tuple[int, ...]:
    return tuple(model.generation_config.eos_token_id)


GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=20)


def _requests(seed: int):
    rng = np.random.default_rng(seed)
    lengths = (5, 40, 100, 12, 40, 5, 70)  # 100 and 70 exceed the 64-token prefill budget: two chunks each
    prompts = [rng.integers(0, 4000, n).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=m, seed=int(rng.integers(1 << 30)) if i % 2 else None,
                             **(SAMPLED if i % 2 else GREEDY))
              for i, m in enumerate((24, 8, 24, 8, 24, 8, 24))]
    return prompts, params


def _run_in_waves(engine: Engine, prompts, params) -> dict[int, list]:
    """Submit the first four, step a few times, then the rest while those decode; collect every output."""
    got: dict[int, list] = {i: [] for i in range(len(prompts))}
    done = {}

    def cb(i):
        def f(out):
            got[i].extend(out.new_token_ids)
            if out.finished:
                done[i] = out.finish_reason
        return f

    for i in range(4):
        engine.add_request(f"r{i}", prompts[i], params[i], cb(i))
    for _ in range(3):
        engine.step()
    for i in range(4, len(prompts)):
        engine.add_request(f"r{i}", prompts[i], params[i], cb(i))
    while engine.has_work():
        engine.step()
    assert set(done) == set(got) and all(r in ("stop", "length") for r in done.values()), done
    return got


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_joining_and_leaving_requests_equal_generate_alone(model, engine):
    prompts, params = _requests(0)
    got = _run_in_waves(engine, prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert got[i] == alone(model, p, sp), (i, len(p), sp)
    # bounded programs: decode per row bucket (1, 2, 4 of 4 slots), prefill per (rows, chunk) bucket, and the row
    # swap that keeps running sequences in the lowest slots (requests here finish out of order: it ran)
    kinds = [k[0] for k in engine.compiled]
    assert kinds.count("decode") <= 3 and kinds.count("prefill") <= 4 and kinds.count("swap") == 1, engine.compiled
    # a second workload, other prompts and seeds of the same sizes: no program is traced again
    before = len(_TRACES)
    prompts, params = _requests(1)
    got = _run_in_waves(engine, prompts, params)
    assert len(_TRACES) == before
    for i in (0, 1):
        assert got[i] == alone(model, prompts[i], params[i])


def test_abort_frees_the_slot_for_the_next_request(model, engine):
    events = []
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for i in range(CFG.max_num_seqs):  # every slot busy
        engine.add_request(f"long{i}", list(range(10 + i, 40)), long, lambda o, i=i: events.append((f"long{i}", o)))
    for _ in range(3):
        engine.step()
    second = [7, 8, 9, 10, 11]
    engine.add_request("next", second, SamplingParams(max_tokens=10, temperature=0),
                       lambda o: events.append(("next", o)))
    engine.step()
    assert engine.num_waiting == 1
    engine.abort("long2")
    engine.step()  # the abort frees slot 2; the waiting request is admitted there in the same step
    assert [o.finish_reason for n, o in events if n == "long2" and o.finished] == ["abort"]
    assert engine.num_running == CFG.max_num_seqs and engine.num_waiting == 0
    for i in (0, 1, 3):
        engine.abort(f"long{i}")
    while engine.has_work():
        engine.step()
    tokens = [t for n, o in events if n == "next" for t in o.new_token_ids]
    assert tokens == alone(model, second, SamplingParams(max_tokens=10, temperature=0))  # the reused row was reset
    assert engine.num_running == 0


def test_prompt_logprobs_equal_the_full_forward(model, engine):
    ids = np.random.default_rng(3).integers(0, 4000, 90).tolist()  # two prefill chunks
    [out] = engine.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=5))
    assert out.new_token_ids == [] and out.finish_reason == "length"
    logits = np.asarray(model(np.asarray([ids])), np.float64)[0]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    lps = out.prompt_logprobs
    assert lps[0] is None and len(lps) == len(ids)
    # chunked prefill vs one forward: within the cached-vs-full tolerance of tests/test_generate.py
    got = np.array([lp.logprob for lp in lps[1:]])
    np.testing.assert_allclose(got, logp[np.arange(89), ids[1:]], atol=1e-4)
    assert [lp.token_id for lp in lps[1:]] == ids[1:]
    top = [[i for i, _ in lp.top] for lp in lps[1:]]
    assert sum(t[0] == int(a) for t, a in zip(top, logits[:-1].argmax(-1))) >= 88  # near-ties may swap


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_fp8_kv_cache_keeps_its_scales(model):
    from flax import nnx

    from qjax.checkpoint.loading import with_fp8_kv_cache

    fp8 = with_fp8_kv_cache(model)
    # stored per-head scales (what a calibrated checkpoint carries), not the unit default
    state = nnx.state(fp8)
    for path, v in nnx.to_flat_state(state):
        if path[-1] in ("k_scale", "v_scale"):
            v.set_value(jnp.full(v.shape, 0.02 if path[-1] == "k_scale" else 0.01, jnp.float32))
    nnx.update(fp8, state)
    engine = Engine(fp8, CFG, eos_token_ids=eos_of(model))
    assert engine.pool.cache.slots[3].k.dtype == jnp.float8_e4m3fn
    prompts = [list(range(100, 130)), list(range(5, 12))]
    params = [SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=8, temperature=0)]
    outs = engine.generate(prompts, params)
    for p, sp, o in zip(prompts, params, outs):
        assert o.new_token_ids == alone(fp8, p, sp)


def test_requests_it_cannot_serve(model, engine):
    cases = [([], SamplingParams(), "prompt: empty"),
             ([1, 99999], SamplingParams(), "outside the vocabulary"),
             ([1] * 250, SamplingParams(max_tokens=10), "250 tokens.*exceeds max_model_len 256"),
             ([1], SamplingParams(logprobs=21), "logprobs"),
             ([1], SamplingParams(top_p=0.0), "top_p"),
             ([1], SamplingParams(temperature=-1.0), "temperature")]
    for prompt, sp, msg in cases:
        with pytest.raises(EngineError, match=msg):
            engine.add_request("x", prompt, sp, lambda o: None)
    with pytest.raises(EngineError, match="max_model_len 9999 exceeds"):
        Engine(model, EngineConfig(max_model_len=9999))


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_engine_equals_generate_alone(model, k):
    """MTP speculation inside continuous batching (``num_speculative_tokens`` = k; the built-in model's trained head,
    so drafts are accepted — the rollback runs — and rows accept different counts; a random head's drafts are right
    ~1/vocab of the time): requests joining and leaving, prompts over several prefill chunks. Greedy rows get exactly
    what qjax.generate gives each alone; seeded sampled rows get the same tokens when the workload runs again; the
    engine's counters add up."""
    assert model.mtp is not None
    eng = Engine(model, dataclasses.replace(CFG, num_speculative_tokens=k), eos_token_ids=())
    prompts, params = _requests(0)
    prompts = [[t % model.config.vocab_size for t in p] for p in prompts]
    params = [dataclasses.replace(sp, ignore_eos=True) for sp in params]
    got = _run_in_waves(eng, prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert len(got[i]) == sp.max_tokens
        if sp.greedy:
            assert got[i] == alone(model, p, sp), (i, len(p))
    stats = eng.speculation
    assert stats.num_speculative_tokens == k and stats.rounds > 0
    assert 1.0 <= stats.mean_accepted_length <= k + 1
    assert sum(stats.acceptance_per_position) > 0  # some drafts were accepted: the rollback ran
    kinds = [c[0] for c in eng.compiled]
    assert "decode" not in kinds and kinds.count("verify") <= 3, eng.compiled
    again = _run_in_waves(eng, prompts, params)
    assert again == got


def test_speculation_needs_an_mtp_head(model):
    with pytest.raises(EngineError, match="no mtp"):
        Engine(model if model.mtp is None else _without_head(model), dataclasses.replace(CFG, num_speculative_tokens=2))
    with pytest.raises(EngineError, match="num_speculative_tokens"):
        Engine(model, dataclasses.replace(CFG, num_speculative_tokens=-1))


def _without_head(model):
    from flax import nnx

    graphdef, state = nnx.split(model)
    clone = nnx.merge(graphdef, state)
    clone.mtp = None
    return clone
