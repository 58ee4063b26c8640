"""Runs under 2 CPU devices (its own process: the device count is fixed when JAX starts) and writes a JSON report for
tests/test_autoround.py: the same AutoRound run with its tuning step on one device and split over two.

    JAX_NUM_CPU_DEVICES=2 python tests/autoround_dp_probe.py OUT.json [--step-hlo-only]

It also records a hash of each two-device tuning step's lowered program and the name of the file its traced program
is kept in (the two-device run has a :class:`qjax.program_cache.ProgramCache`, so its step runs the stored program):
the persistent compilation cache and the program cache find a step only if both are the same in every process,
whatever the process's string hashing (``PYTHONHASHSEED``) makes of the order of sets and dicts of names. With
``--step-hlo-only`` it records just those (nothing is tuned) for a second process to compare.

One tuning iteration without best-iteration selection, so every code written is ``round(w / s + lr · sign(g))``: a
gradient summed wrongly across the devices (one device's half of the minibatch) flips the sign, and so the code, of a
large share of the entries; summation order alone only flips entries whose gradient is near zero.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from qjax import xla_env

xla_env.apply(single_threaded=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import qjax  # noqa: E402
from qjax.autoround import driver  # noqa: E402
from qjax.autoround.driver import AutoRound, AutoRoundConfig  # noqa: E402
from qjax.checkpoint.hub import default_model_dir  # noqa: E402
from qjax.program_cache import ProgramCache  # noqa: E402
from qjax.quant.packing import unpack_int32  # noqa: E402

# the default recipe (W4 g64, experts W2 g64) and SignRoundV2's top-0.1 % error filter (alg_ext below 4 bits)
RECIPES = {"w4-experts-w2": dict(bits=4, group_size=64, layer_config={".*experts.*": {"bits": 2, "group_size": 64}}),
           "w2-alg-ext": dict(bits=2, group_size=64, enable_alg_ext=True)}
UNIT_NAMES = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj", "mlp.experts.gate_up_proj",
              "mlp.experts.down_proj", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
              "mlp.shared_expert.down_proj")


make_step = driver._make_step  # the driver's own, restored after each recording run


class _FirstBlockDone(Exception):
    pass


def _stop(report) -> None:
    raise _FirstBlockDone


def _recording_steps(hashes: list, files: list, stop: bool):
    """``driver._make_step`` whose steps record the hash of their lowered program and their program cache file on
    each call (and, with ``stop``, end the run there instead of tuning)."""
    def wrapped(*a, **kw):
        fn = make_step(*a, **kw)
        plain = make_step(*a, **{**kw, "programs": None})

        def call(*args):
            hashes.append(hashlib.sha256(plain.lower(*args).as_text().encode()).hexdigest())
            files.append(os.path.basename(fn.path_for(*args)))
            if stop:
                raise _FirstBlockDone
            return fn(*args)
        return call
    return wrapped


def main(out_path: str, step_hlo_only: bool = False) -> None:
    assert jax.device_count() == 2, "run with JAX_NUM_CPU_DEVICES=2"
    model = qjax.load_model(default_model_dir(), dtype=jnp.float32, text_only=True)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (4, 48), dtype=np.int32)
    report = {}
    for name, recipe in RECIPES.items():
        cfg = AutoRoundConfig(**recipe, iters=1, nsamples=4, seqlen=48, batch_size=4, not_use_best_mse=True)
        runs, hashes, files = {}, [], []
        for label, devices in (("one", jax.devices()[:1]), ("two", jax.devices())):
            if step_hlo_only and label == "one":
                continue
            programs = ProgramCache(f"{out_path}.programs") if label == "two" else None
            ar = AutoRound(model, ids, cfg, progress=False, devices=devices, on_block=_stop, programs=programs)
            assert (ar.mesh is None) == (label == "one")
            driver._make_step = _recording_steps(hashes, files, step_hlo_only) if label == "two" else make_step
            try:
                ar.run()
            except _FirstBlockDone:  # later blocks start from different streams: block 0 is the comparison
                pass
            if not step_hlo_only:
                runs[label] = (ar.results[0], ar.reports[0])
        driver._make_step = make_step
        report[name] = {"step_hlo": hashes, "program_files": files}
        if step_hlo_only:
            continue
        (one, rep1), (two, rep2) = runs["one"], runs["two"]
        codes = differ = 0
        for unit, r in one.items():
            a, b = (unpack_int32(x.packed, x.scheme.bits, x.in_features) for x in (r, two[unit]))
            codes += a.size
            differ += int(np.count_nonzero(a != b))
        report[name].update({"init_loss": [rep1.init_loss, rep2.init_loss], "codes": codes, "codes_differing": differ})
    # the order this process's string hashing gives a set of unit names (the caller checks that its two processes
    # differ in it, so that their step hashes are compared where a set's order would show)
    report["set_order"] = list(frozenset(UNIT_NAMES))
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], "--step-hlo-only" in sys.argv[2:])
