"""qjax.serving.engine's failures, beyond tests/test_serving_engine.py's: an image request rewound onto a new pool
replays its image prompt and its emitted tokens (text positions after the image's) and goes on with the tokens it
gets without the failure; so does a greedy request of a speculative engine whose verify round failed; a failure
outside every request's work (the engine thread's last resort) ends each request
with "error" and the engine serves the next ones."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles.hf import VL_SPECIALS, random_image, write_vl_checkpoint
from serve_util import alone

import qjax
from qjax.serving import Engine, EngineConfig, SamplingParams
from qjax.serving.engine import encode_images

I, S, E = (VL_SPECIALS[t] for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
CFG = EngineConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=128, decode_steps=4)


def _words(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 480, n)]


@pytest.mark.slow  # > 7 s on 2 cores (a VL checkpoint, its engine's text and image prefill programs)
def test_an_image_request_rewound_onto_a_new_pool_goes_on_as_before(tmp_path, monkeypatch):
    model = qjax.load_model(write_vl_checkpoint(tmp_path / "vl"))
    engine = Engine(model, CFG, eos_token_ids=())
    ids, images = encode_images(model, _words(4, 1) + [S, I, E] + _words(3, 2), [random_image(30, 30, seed=2)])
    text = _words(20, 3)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [o.new_token_ids for o in engine.generate([ids, text], sp, images=[images, None])]

    got = {"image": [], "text": []}
    engine.add_request("image", ids, sp, lambda o: got["image"].extend(o.new_token_ids), images=images)
    engine.add_request("text", text, sp, lambda o: got["text"].extend(o.new_token_ids))
    while min(len(v) for v in got.values()) < 3:
        engine.step()
    real, failed = engine._programs.decode, []

    def decode(pool, *args, **kw):  # fails once, taking the pool: both running requests are rewound
        if not failed:
            failed.append(1)
            jax.tree.map(lambda x: x.delete(), pool)
            raise RuntimeError("simulated decode failure")
        return real(pool, *args, **kw)

    monkeypatch.setattr(engine._programs, "decode", decode)
    while engine.has_work():
        engine.step()
    assert failed and got == {"image": want[0], "text": want[1]}
    assert engine.num_running == 0


def test_a_failure_outside_every_request_ends_each_with_error_and_the_engine_goes_on(monkeypatch):
    from qjax.checkpoint.hub import default_model_dir

    model = qjax.load_model(default_model_dir())
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64, decode_steps=2))
    real, broken = engine._admit, [True]

    def admit():  # the scheduler itself fails, once
        if broken:
            broken.pop()
            raise RuntimeError("a scheduler bug")
        real()

    monkeypatch.setattr(engine, "_admit", admit)
    outs = {}
    engine.start()
    try:
        for name in ("a", "b"):
            engine.add_request(name, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0),
                               lambda o, name=name: outs.setdefault(name, []).append(o))
        deadline = time.monotonic() + 60
        while len([n for n, o in outs.items() if o[-1].finished]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        finished = {n: o[-1] for n, o in outs.items()}
        errors = {n for n, o in finished.items() if o.finish_reason == "error"}
        assert errors and all(finished[n].error == "the engine failed (RuntimeError: a scheduler bug); every request "
                                                   "in it was ended" for n in errors)
        done = []
        engine.add_request("c", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0), done.append)
        deadline = time.monotonic() + 60
        while not (done and done[-1].finished) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in done) == 4
    finally:
        engine.shutdown()


@pytest.mark.slow  # > 7 s on 2 cores (the speculative engine's programs)
def test_a_failed_verify_round_rewinds_the_speculative_rows():
    """With MTP speculation a verify call that fails (taking the pool) rewinds its rows: the greedy one replays its
    last token and goes on with the tokens qjax.generate gives it alone; the sampled one (a verify round draws
    otherwise than prefill) goes on from its emitted tokens to its full length."""
    from qjax.checkpoint.hub import default_model_dir

    model = qjax.load_model(default_model_dir(), dtype=jnp.float32)
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64, decode_steps=4,
                                        num_speculative_tokens=1), eos_token_ids=())
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 4000, 20).tolist(), rng.integers(0, 4000, 9).tolist()]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=5, ignore_eos=True)]
    got = {0: [], 1: []}
    for i in (0, 1):
        engine.add_request(f"r{i}", prompts[i], params[i], lambda o, i=i: got[i].extend(o.new_token_ids))
    while min(len(v) for v in got.values()) < 3:
        engine.step()
    real, failed = engine._programs.verify, []

    def verify(pool, *args, **kw):
        if not failed:
            failed.append(1)
            jax.tree.map(lambda x: x.delete(), pool)
            raise RuntimeError("simulated verify failure")
        return real(pool, *args, **kw)

    engine._programs.verify = verify
    while engine.has_work():
        engine.step()
    assert failed and len(got[1]) == 24
    assert got[0] == alone(model, prompts[0], params[0])
