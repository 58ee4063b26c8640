"""qjax.serving.engine: requests that join and leave a running batch get, token for token, what qjax.generate gives
each of them alone (float32, greedy and seeded sampling), through chunked prefill, slot reuse and aborts; the
engine compiles a bounded set of programs and nothing new for a second workload; FP8 K/V keeps its scales. Every
per-request value is range- and type-checked at admission; a request whose step fails (host side, or its device
call) ends alone with "error" while the others get their tokens alone (more in tests/test_serving_failures.py)."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serve_util import alone

import qjax
from qjax.checkpoint.hub import default_model_dir
from qjax.program_cache import ProgramCache
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
    top, seeds = 2**31 - 1, "-9223372036854775808, 18446744073709551616"
    cases = [([], SamplingParams(), "prompt: empty"),
             ([1, 99999], SamplingParams(), "outside the vocabulary"),
             ([1] * 250, SamplingParams(max_tokens=10), "250 tokens.*exceeds max_model_len 256"),
             ([1], SamplingParams(logprobs=21), "logprobs"),
             ([1], SamplingParams(top_p=0.0), "top_p"),
             ([1], SamplingParams(temperature=-1.0), "temperature"),
             # every value that reaches the device, in its range and of its type (each passed the old checks, or
             # raised something other than EngineError)
             ([1], SamplingParams(top_k=2**63), rf"top_k: must be in \[-1, {top}\].*got 9223372036854775808"),
             ([1], SamplingParams(top_k=2**32 + 5), rf"top_k: must be in \[-1, {top}\]"),  # the old one wrapped to 5
             ([1], SamplingParams(top_k=-2), "top_k"),
             ([1], SamplingParams(top_k=5.0), "top_k: must be an integer"),
             ([1], SamplingParams(top_k=True), "top_k: must be an integer"),
             ([1], SamplingParams(seed=2**64), rf"seed: must be in \[{seeds}\), got 18446744073709551616"),
             ([1], SamplingParams(seed=-2**63 - 1), "seed: must be in"),
             ([1], SamplingParams(seed=1.5), "seed: must be an integer"),
             ([1], SamplingParams(seed=True), "seed: must be an integer"),
             ([1], SamplingParams(stop_token_ids=(4096,)), r"stop_token_ids: token id 4096 is outside the vocabulary "
                                                          r"\[0, 4096\)"),
             ([1], SamplingParams(stop_token_ids=(-1,)), "stop_token_ids: token id -1"),
             ([1], SamplingParams(stop_token_ids=(3.0,)), "stop_token_ids: token ids must be integers"),
             ([1], SamplingParams(stop_token_ids=5), "stop_token_ids: must be a sequence"),
             ([1], SamplingParams(max_tokens=True), "max_tokens: must be a non-negative integer, got True"),
             ([1], SamplingParams(max_tokens=4.0), "max_tokens"),
             ([1], SamplingParams(logprobs=True), "logprobs: must be an integer"),
             ([1], SamplingParams(prompt_logprobs=2.5), "prompt_logprobs: must be an integer"),
             ([1], SamplingParams(prompt_logprobs=21), "prompt_logprobs: must be between 0 and 20, got 21"),
             ([1], SamplingParams(temperature=True), "temperature: must be a finite number"),
             ([1], SamplingParams(temperature="0.5"), "temperature: must be a finite number"),
             ([1], SamplingParams(temperature=float("inf")), "temperature"),
             ([1], SamplingParams(top_p=True), "top_p: must be a number in"),
             ([1], SamplingParams(top_p=float("nan")), "top_p"),
             ([1], SamplingParams(ignore_eos="yes"), "ignore_eos: must be a bool"),
             ([1.0, 2.0], SamplingParams(), "prompt: token ids must be integers, got 1.0"),
             ([1, True], SamplingParams(), "prompt: token ids must be integers, got True"),
             ("abc", SamplingParams(), "prompt: token ids must be integers, got 'a'"),
             (np.array([1.0, 2.0]), SamplingParams(), "prompt: must be one row of integer token ids")]
    for prompt, sp, msg in cases:
        with pytest.raises(EngineError, match=msg):
            engine.add_request("x", prompt, sp, lambda o: None)
    with pytest.raises(EngineError, match="params: must be a SamplingParams"):
        engine.add_request("x", [1], dict(max_tokens=3), lambda o: None)
    with pytest.raises(EngineError, match="callback: must be callable"):
        engine.add_request("x", [1], SamplingParams(), None)
    assert not engine.has_work()
    # the edges of each range are served
    for sp in (SamplingParams(top_k=2**31 - 1), SamplingParams(top_k=-1), SamplingParams(seed=-2**63),
               SamplingParams(seed=2**64 - 1), SamplingParams(seed=np.int64(7), max_tokens=np.int64(2)),
               SamplingParams(temperature=1e300, top_p=1e-300), SamplingParams(stop_token_ids=(0, 4095))):
        engine.validate([0, 4095], sp)
    with pytest.raises(EngineError, match="max_model_len 9999 exceeds"):
        Engine(model, EngineConfig(max_model_len=9999))
    with pytest.raises(EngineError, match="max_num_seqs must be a positive integer, got True"):
        Engine(model, EngineConfig(max_num_seqs=True))


def test_seed_keys_cover_64_bits():
    """A seed's key is its 64 bits: jax.random.key's for small seeds, distinct for seeds jax's 32-bit mode folds
    together, negative seeds as their two's complement (−1 ≡ 2⁶⁴ − 1); the key after n draws is the kept half of
    split_keys, n times."""
    from qjax.runtime.sampling import kept_key_data, seed_key_data, split_keys

    for s in (0, 5, 2**31 - 1, 2**32 - 1):
        np.testing.assert_array_equal(seed_key_data(s), jax.random.key_data(jax.random.key(s)))
    assert seed_key_data(2**32 + 5).tolist() == [1, 5] != seed_key_data(5).tolist()
    assert seed_key_data(-1).tolist() == [2**32 - 1, 2**32 - 1] == seed_key_data(2**64 - 1).tolist()
    assert seed_key_data(-2**63).tolist() == [2**31, 0] == seed_key_data(2**63).tolist()
    key = jax.random.wrap_key_data(jnp.asarray(seed_key_data(9))[None])
    for _ in range(3):
        key, _ = split_keys(key)
    np.testing.assert_array_equal(kept_key_data(seed_key_data(9), 3), jax.random.key_data(key)[0])


def test_values_past_a_range_edge_sample_as_its_edge():
    """top-k ≥ the vocabulary keeps every token and never wraps in int32 (2³² + 5 is not 5); a temperature past
    MAX_TEMPERATURE samples as MAX_TEMPERATURE does: top-k keeps k tokens (at 1e38 x / T flushed to zero and top_k=20
    kept 901 of 1000) and nothing is NaN."""
    from qjax.runtime.sampling import MAX_TEMPERATURE, SamplingArrays, filter_logits

    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 1000)) * 30, jnp.float32)
    for k in (2**31 - 1, 2**32 + 5, 2**62):
        kept = filter_logits(logits, SamplingArrays.make(np.ones(1, bool), 1.0, k, 1.0))
        assert bool(jnp.all(jnp.isfinite(kept))), k
    for t in (1e30, 1e38, 1e300):
        kept = np.asarray(filter_logits(logits, SamplingArrays.make(np.ones(1, bool), t, 20, 1.0)))
        assert np.isfinite(kept).sum() == 20 and not np.isnan(kept).any(), t
        top20 = np.argsort(np.asarray(logits[0]))[-20:]
        assert set(np.flatnonzero(np.isfinite(kept[0]))) == set(top20)
        clamped = SamplingArrays.make(np.ones(1, bool), t, 0, 1.0).temperature[0]
        assert float(clamped) == np.float32(min(t, MAX_TEMPERATURE))


def test_seeds_and_top_k_at_the_range_edges_in_the_engine(engine, monkeypatch):
    """Seeds past int64 (the HTTP layer's seed + j for n choices) are served, s and s − 2⁶⁴ alike; negative seeds are
    deterministic; a top-k past int32 that skipped validate (a caller writing the engine's queue) samples as top-k
    off instead of wrapping or failing the step."""
    prompt = [5, 6, 7, 8]
    sp = SamplingParams(max_tokens=6, temperature=0.9)
    run = lambda **kw: engine.generate([prompt], dataclasses.replace(sp, **kw))[0].new_token_ids  # noqa: E731
    assert run(seed=2**64 - 3) == run(seed=-3) == run(seed=-3)
    assert run(seed=2**63) == run(seed=-2**63)
    off = run(seed=4, top_k=0)
    assert run(seed=4, top_k=2**31 - 1) == off
    assert run(seed=4, top_k=5) != off  # so the wrapped value would show
    monkeypatch.setattr(engine, "validate", lambda *a, **k: None)
    assert run(seed=4, top_k=2**32 + 5) == off  # the old engine wrapped this to top-k 5
    assert run(seed=4, top_k=2**63) == off  # the old engine's step overflowed and aborted every request


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


# ---------------------------------------------------------------------------------------------------------------------
# a failure ends only its own request
# ---------------------------------------------------------------------------------------------------------------------
def _good_requests():
    """Greedy and seeded sampled requests, one over two prefill chunks, each still running after five steps."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 4000, n).tolist() for n in (30, 12, 70)]
    params = [SamplingParams(max_tokens=24, **GREEDY), SamplingParams(max_tokens=24, seed=11, **SAMPLED),
              SamplingParams(max_tokens=24, seed=12, **SAMPLED)]
    return prompts, params


class _Outputs:
    def __init__(self):
        self.tokens, self.finished = {}, {}

    def __call__(self, name):
        self.tokens[name] = []

        def cb(out):
            assert name not in self.finished, "output after the finished one"
            self.tokens[name] += out.new_token_ids
            if out.finished:
                self.finished[name] = out
        return cb


def _start(engine, outs: _Outputs, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"ok{i}", p, sp, outs(f"ok{i}"))
    for _ in range(5):
        engine.step()
    assert all(outs.tokens[f"ok{i}"] for i in range(len(prompts))) and not outs.finished  # all decoding


def _finish(engine, model, outs: _Outputs, prompts, params):
    while engine.has_work():
        engine.step()
    assert engine.num_running == 0 and engine.num_waiting == 0
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert outs.finished[f"ok{i}"].finish_reason in ("stop", "length"), i
        assert outs.tokens[f"ok{i}"] == alone(model, p, sp), i  # every token once, as alone


def test_a_request_whose_host_side_work_fails_ends_alone(model, engine, monkeypatch):
    """Requests that skipped validation (a caller writing past it) and break the step's host-side work — building
    their prefill row (a temperature that is a string, a token id past int32), reading their results (max_tokens a
    string) — end with finish_reason "error" and a one-line message; the requests beside them in
    the same calls finish with the tokens they get alone. (The old engine aborted every request.)"""
    prompts, params = _good_requests()
    outs = _Outputs()
    _start(engine, outs, prompts, params)
    monkeypatch.setattr(engine, "validate", lambda *a, **k: None)
    bad = {"bad_temperature": ([1, 2, 3], SamplingParams(temperature="hot")),
           "bad_token": ([1, 2**40, 3], SamplingParams()),
           "bad_max_tokens": ([1, 2, 3], SamplingParams(max_tokens="24", **GREEDY))}
    for name, (p, sp) in bad.items():
        engine.add_request(name, p, sp, outs(name))
    late = [9, 10, 11, 12]  # joins with them, in the same prefill call
    engine.add_request("late", late, SamplingParams(max_tokens=8, **GREEDY), outs("late"))
    _finish(engine, model, outs, prompts, params)
    for name in bad:
        out = outs.finished[name]
        assert out.finish_reason == "error" and outs.tokens[name] == [], name
        assert out.error.startswith("the engine could not run this request: its prefill failed (") and \
            "\n" not in out.error, out.error
    assert "TypeError" in outs.finished["bad_temperature"].error
    assert "OverflowError" in outs.finished["bad_token"].error
    assert "TypeError" in outs.finished["bad_max_tokens"].error
    assert outs.tokens["late"] == alone(model, late, SamplingParams(max_tokens=8, **GREEDY))


def _count_rewinds(engine, monkeypatch, wrong_replay: str | None = None) -> list[str]:
    """The request ids ``engine._rewind`` started over; ``wrong_replay``: that request's first replay is told to
    expect another token than it emitted (as a replay whose arithmetic drew otherwise), so it must go on from its
    emitted tokens instead."""
    real, names = engine._rewind, []

    def rewind(seq, *args, **kw):
        real(seq, *args, **kw)
        names.append(seq.request_id)
        if seq.request_id == wrong_replay and seq.expect is not None and names.count(wrong_replay) == 1:
            seq.expect = (seq.expect + 1) % engine.vocab_size

    monkeypatch.setattr(engine, "_rewind", rewind)
    return names


def _fail_for(engine, monkeypatch, kind: str, when, *, take_pool: bool):
    """Make the engine's ``kind`` program raise whenever ``when(its first array after the pool)`` holds, as a device
    failure does: with ``take_pool``, after deleting the pool (a donated argument of a call that failed on the
    device)."""
    real = getattr(engine._programs, kind)
    failed = []

    def program(pool, first, *args, **kw):  # first: prefill's rows [P], decode's active [b]
        if when(np.asarray(first)):
            failed.append(np.asarray(first))
            if take_pool:
                jax.tree.map(lambda x: x.delete(), pool)
            raise RuntimeError(f"simulated {kind} failure\nsecond line")
        return real(pool, first, *args, **kw)

    monkeypatch.setattr(engine._programs, kind, program)
    return failed


@pytest.mark.parametrize("take_pool", [True, False], ids=["pool-taken", "pool-kept"])
def test_a_request_whose_prefill_fails_on_the_device_ends_alone(model, engine, monkeypatch, caplog, take_pool):
    """A prefill call that fails for one request (alone in it: one 64-token chunk per call here) ends that request
    with "error"; the running requests and one that waits behind it finish with the tokens they get alone. When the
    failed call took the pool, the running requests are rewound — prefilled again over their prompt and emitted
    tokens, the last one drawn again and checked — and emit no token twice."""
    prompts, params = _good_requests()
    outs = _Outputs()
    _start(engine, outs, prompts, params)

    def holds_bad(rows):
        seq = engine._seqs.get("bad")
        return seq is not None and seq.slot in rows.tolist()

    failed = _fail_for(engine, monkeypatch, "prefill", holds_bad, take_pool=take_pool)
    rewound = _count_rewinds(engine, monkeypatch)
    late = [9, 10, 11, 12]
    engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=8, **GREEDY), outs("bad"))
    engine.add_request("late", late, SamplingParams(max_tokens=8, seed=3, **SAMPLED), outs("late"))
    _finish(engine, model, outs, prompts, params)
    assert len(failed) == 1
    assert sorted(rewound) == (["ok0", "ok1", "ok2"] if take_pool else [])  # a kept pool keeps every row
    assert not [r for r in caplog.records if "replay drew" in r.getMessage()]  # each replay drew its last token again
    out = outs.finished["bad"]
    assert out.finish_reason == "error" and outs.tokens["bad"] == []
    assert out.error == ("the engine could not run this request: its prefill call failed (RuntimeError: simulated "
                         "prefill failure)")
    assert outs.tokens["late"] == alone(model, late, SamplingParams(max_tokens=8, seed=3, **SAMPLED))


def test_a_request_whose_decode_fails_on_the_device_ends_alone(model, engine, monkeypatch, caplog):
    """A request whose decoding fails on the device after it emitted tokens: the call's requests are rewound onto a
    new pool and each decodes alone until it passes; the failing one, alone, ends with "error" keeping what it sent;
    the others finish with the tokens they get alone."""
    prompts, params = _good_requests()
    outs = _Outputs()
    _start(engine, outs, prompts, params)
    bad_prompt, bad_sp = [21, 22, 23, 24, 25], SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY)

    def bad_running(active):
        seq = engine._seqs.get("bad")
        return seq is not None and len(seq.output) >= 2 and seq.slot < len(active) and bool(active[seq.slot])

    failed = _fail_for(engine, monkeypatch, "decode", bad_running, take_pool=True)
    rewound = _count_rewinds(engine, monkeypatch, wrong_replay="ok1")
    engine.add_request("bad", bad_prompt, bad_sp, outs("bad"))
    _finish(engine, model, outs, prompts, params)
    assert {"ok0", "ok1", "ok2", "bad"} <= set(rewound)
    # ok1's replay "drew" another token: it went on from the tokens it had emitted, drawing the next as before
    assert [r.getMessage().split(":")[0] for r in caplog.records if "replay drew" in r.getMessage()] == ["request ok1"]
    assert len(failed) == 2 and failed[0].sum() > 1 and failed[1].sum() == 1  # with the others, then alone
    out = outs.finished["bad"]
    assert out.finish_reason == "error" and "its decode call failed (RuntimeError: simulated" in out.error
    assert 2 <= len(outs.tokens["bad"]) < 24
    assert outs.tokens["bad"] == alone(model, bad_prompt, bad_sp)[:len(outs.tokens["bad"])]


def test_kept_programs_give_the_same_outputs_and_are_not_traced_again(model, engine, tmp_path, caplog):
    """With a ProgramCache the engine's programs are traced once and stored; a second engine on the folder (a new
    handle, as a new process has) reads every one back and traces none; both give exactly the outputs of an engine
    without it: greedy and seeded sampled tokens, their top log-probabilities, prompt log-probabilities."""
    prompts = [[5, 6, 7, 8, 9], list(range(100, 130))]
    params = [SamplingParams(max_tokens=6, logprobs=2, prompt_logprobs=1, **GREEDY),
              SamplingParams(max_tokens=6, seed=7, logprobs=2, **SAMPLED)]

    def outputs(eng):
        return [(o.new_token_ids, o.new_logprobs, o.prompt_logprobs, o.finish_reason)
                for o in eng.generate(prompts, params)]

    want = outputs(engine)
    names = ("prefill", "decode", "verify", "swap")  # the engine's functions (a kept program traces as its own)
    traced = []

    def listen(event, secs, fun_name=None, **_):
        if event == "/jax/core/compile/jaxpr_trace_duration" and fun_name in names:
            traced.append(fun_name)

    runs = []
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for _ in range(2):
            traced.clear()
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="qjax.programs"):
                eng = Engine(model, CFG, eos_token_ids=eos_of(model), programs=ProgramCache(str(tmp_path)))
                got = outputs(eng)
            runs.append((got, list(traced), [r.getMessage().split(" ")[2] for r in caplog.records], eng.compiled))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    (got1, traced1, log1, compiled1), (got2, traced2, log2, compiled2) = runs
    assert got1 == want and got2 == want
    n = len(compiled1)
    assert n >= 2 and compiled2 == compiled1 and len(traced1) == n, (compiled1, traced1)
    assert log1 == ["stored"] * n and log2 == ["loaded"] * n, (log1, log2)
    assert traced2 == [] and len(list(tmp_path.iterdir())) == n
