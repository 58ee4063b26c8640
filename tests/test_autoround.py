"""qjax.autoround against auto-round 0.16.1 itself, and the driver's own guarantees (losses, resume, bad input)."""

from __future__ import annotations

import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest
from oracles.autoround import NSAMPLES, RTN_RECIPE, SEQLEN, read_tensors, run_auto_round, write_base, write_calibration
from qjax.convert import save_pretrained

import qjax
from qjax.autoround import blocks
from qjax.autoround.data import CalibrationError, calibration_ids, load_tokenizer
from qjax.autoround.driver import AutoRound, AutoRoundConfig
from qjax.autoround.progress import ResumeError
from qjax.autoround.schemes import LayerConfigError, parse_layer_config
from qjax.program_cache import ProgramCache

pytestmark = pytest.mark.slow

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "autoround_rtn")
QUANT_FIELDS = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ar-base")
    return write_base(tmp / "base"), write_calibration(tmp / "calib.json")


@pytest.fixture(scope="module")
def calib(base):
    folder, path = base
    return calibration_ids(path, load_tokenizer(folder), nsamples=NSAMPLES, seqlen=SEQLEN)


def _config(**kw) -> AutoRoundConfig:
    d = dict(RTN_RECIPE, nsamples=NSAMPLES, seqlen=SEQLEN, batch_size=4)
    d.update(kw)
    return AutoRoundConfig(**d)


def _auto_round_rtn(base, tmp_path):
    """auto-round's own RTN output: run live when auto-round is installed, else the committed fixture."""
    try:
        import auto_round  # noqa: F401
    except ImportError:
        from qjax.checkpoint.safetensors_io import SafetensorsFile

        with SafetensorsFile(os.path.join(FIXTURE, "quantized.safetensors")) as st:
            tensors = {k: np.array(st.get(k)) for k in st.keys()}
        qc = json.load(open(os.path.join(FIXTURE, "quantization_config.json")))
        return tensors, qc, "fixture"
    folder = run_auto_round(base[0], base[1], str(tmp_path / "ar"), disable_opt_rtn=True, **RTN_RECIPE)
    tensors = {k: v for k, v in read_tensors(folder).items() if k.endswith(QUANT_FIELDS)}
    qc = json.load(open(os.path.join(folder, "config.json")))["quantization_config"]
    return tensors, qc, "live"


def _targets(qc, folder) -> dict[tuple, set]:
    """(bits, group_size, symmetric) → the modules of ``folder`` that ``qc`` quantizes that way, resolved with
    compressed-tensors' own name matching (exact names and ``re:`` patterns; ignore wins)."""
    from compressed_tensors.utils.match import match_name

    modules = {k.rsplit(".", 1)[0] for k in read_tensors(folder) if k.endswith((".weight", ".weight_packed"))}
    out: dict[tuple, set] = {}
    for m in modules:
        if any(match_name(m, t) for t in qc.get("ignore") or ()):
            continue
        for g in qc["config_groups"].values():
            if any(match_name(m, t) for t in g["targets"]):
                w = g["weights"]
                out.setdefault((w["num_bits"], w["group_size"], w["symmetric"]), set()).add(m)
                break
    return out


def test_rtn_matches_auto_round_bit_for_bit(base, calib, tmp_path):
    """iters = 0, optimized RTN off: every packed word, scale and shape equals auto-round's llm_compressor export,
    and the same modules are quantized with the same bits and groups."""
    ref, ref_qc, source = _auto_round_rtn(base, tmp_path)
    model = qjax.load_model(base[0])
    ar = AutoRound(model, calib, _config(iters=0, disable_opt_rtn=True), progress=False)
    ar.run()
    out = save_pretrained(ar.quantized_model(), tmp_path / "qjax")
    got = {k: v for k, v in read_tensors(out).items() if k.endswith(QUANT_FIELDS)}
    assert sorted(got) == sorted(ref), source
    bad = [k for k in ref if got[k].dtype != ref[k].dtype or not np.array_equal(got[k], ref[k])]
    assert not bad, f"{len(bad)} of {len(ref)} tensors differ from auto-round ({source}): {bad[:5]}"
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert _targets(qc, out) == _targets(ref_qc, out)


def test_committed_fixture_is_current(base, tmp_path):
    """The fallback fixture is what auto-round writes today (regenerate with tests/fixtures/make_autoround_rtn.py)."""
    pytest.importorskip("auto_round")
    from qjax.checkpoint.safetensors_io import SafetensorsFile

    live, _, _ = _auto_round_rtn(base, tmp_path)
    with SafetensorsFile(os.path.join(FIXTURE, "quantized.safetensors")) as st:
        committed = {k: np.array(st.get(k)) for k in st.keys()}
    assert sorted(live) == sorted(committed)
    assert all(np.array_equal(live[k], committed[k]) for k in live)


@pytest.fixture(scope="module")
def tuned(base, calib):
    model = qjax.load_model(base[0], dtype=jnp.float32)
    ar = AutoRound(model, calib, _config(iters=24, seed=7), progress=False)
    ar.run()
    return model, ar


def test_tuning_never_worse_than_rtn(tuned):
    """Best-so-far includes iteration 0 (RTN), so it is never above it; sign-SGD must actually improve every block."""
    _, ar = tuned
    assert len(ar.reports) == 4
    for r in ar.reports:
        assert r.best_loss <= r.init_loss, r
        assert r.best_loss < 0.95 * r.init_loss, f"block {r.index}: tuning did not lower the loss: {r}"


def test_packed_model_equals_fake_quant(tuned, calib):
    """The packed model computes what the tuner's fake-quantized layers compute (fp32; the only difference is the
    fp16 rounding of s·q that compressed-tensors' decompression also applies: 1e-4)."""
    model, ar = tuned
    qmodel = ar.quantized_model()
    ids = jnp.asarray(calib[:2])
    h = model.embed(ids)
    ctx = ar._ctx(2)
    for i, layer in enumerate(ar.layers):
        h = blocks.layer_apply(*_split(ar._apply_results(layer, i)), blocks.weights_of(ar._apply_results(layer, i)),
                               h, ctx)
    fake = model.logits_from_hidden(model.norm(h))
    np.testing.assert_allclose(np.asarray(qmodel(ids)), np.asarray(fake), atol=1e-4, rtol=0)


def test_experts_half_quantized_when_group_does_not_divide(base, calib, tmp_path, caplog):
    """W4G64 on a model with moe_intermediate_size 32: gate/up (input 64) are quantized, every down_proj (input 32)
    stays dense, as auto-round leaves it. The mixed expert stack computes the fake-quant model, is written with
    only gate/up as targets, and loads back to the same logits."""
    model = qjax.load_model(base[0], dtype=jnp.float32)
    with caplog.at_level(logging.WARNING, logger="qjax.autoround"):
        ar = AutoRound(model, calib, _config(bits=4, group_size=64, layer_config={}, iters=0, disable_opt_rtn=True),
                       progress=False)
    partial = [r.message for r in caplog.records if "not a multiple of group_size" in r.message]
    assert len(partial) == 1 and partial[0].startswith("36 layers with in_features 32"), partial  # (8 + 1) × 4
    ar.run()
    assert all("mlp.experts.up_proj" in r and "mlp.experts.down_proj" not in r for r in ar.results.values())
    qmodel = ar.quantized_model()
    ids = jnp.asarray(calib[:2])
    h, ctx = model.embed(ids), ar._ctx(2)
    for i, layer in enumerate(ar.layers):
        fq = ar._apply_results(layer, i)
        h = blocks.layer_apply(*_split(fq), blocks.weights_of(fq), h, ctx)
    fake = np.asarray(model.logits_from_hidden(model.norm(h)))
    got = np.asarray(qmodel(ids))
    np.testing.assert_allclose(got, fake, atol=1e-4, rtol=0)
    out = save_pretrained(qmodel, tmp_path / "mixed")
    targets = set().union(*_targets(json.load(open(os.path.join(out, "config.json")))["quantization_config"],
                                    out).values())
    assert "model.layers.0.mlp.experts.3.up_proj" in targets
    assert not any(t.endswith("down_proj") for t in targets)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in read_tensors(out)
    np.testing.assert_array_equal(np.asarray(qjax.load_model(out, dtype=jnp.float32)(ids)), got)
    from qjax.convert.planner import format_plan, plan_folder

    plan = plan_folder(out)  # `qjax inspect` reads it too
    assert plan.device_bytes > 0 and "weights" in format_plan(plan, title=out)


def _split(layer):
    from flax import nnx

    return nnx.split(layer)


@pytest.fixture(scope="module")
def six_iters(base, calib):
    """An uninterrupted 6-iteration run on the float32 model: what resumed and program-cached runs must equal."""
    ar = AutoRound(qjax.load_model(base[0], dtype=jnp.float32), calib, _config(iters=6), progress=False)
    ar.run()
    return ar


def _same_codes(a, b) -> None:
    for i in range(4):
        for name, r in a.results[i].items():
            assert np.array_equal(r.packed, b.results[i][name].packed), (i, name)
            assert np.array_equal(r.scale, b.results[i][name].scale), (i, name)


def test_resume_after_kill_gives_the_same_result(base, calib, tmp_path, six_iters):
    """A run killed after block 1 resumes from block 2 and ends with exactly the uninterrupted result."""
    cfg = _config(iters=6)
    pdir = str(tmp_path / "progress")
    model = qjax.load_model(base[0], dtype=jnp.float32)

    def kill(report):
        if report.index == 1:
            raise KeyboardInterrupt

    fp = {"run": "a"}
    with pytest.raises(KeyboardInterrupt):
        AutoRound(model, calib, cfg, progress=False, progress_dir=pdir, fingerprint=fp, on_block=kill).run()
    assert json.load(open(os.path.join(pdir, "state.json")))["done"] == 2
    seen = []
    resumed = AutoRound(model, calib, cfg, progress=False, progress_dir=pdir, fingerprint=fp, resume=True,
                        on_block=lambda r: seen.append(r.index))
    resumed.run()
    assert seen == [2, 3]
    _same_codes(six_iters, resumed)
    with pytest.raises(ResumeError, match="different run"):
        AutoRound(model, calib, cfg, progress=False, progress_dir=pdir, fingerprint={"run": "b"}, resume=True).run()


def test_kept_programs_give_the_same_result(base, calib, tmp_path, caplog, six_iters):
    """With a program cache the first run stores each block program (forward, tuning step, start, end of each block
    kind);
    a second run (a new handle on the folder, as a new process has) reads them all back instead of tracing, and both
    end with exactly the result of a run without the cache."""
    cfg = _config(iters=6)
    model = qjax.load_model(base[0], dtype=jnp.float32)
    folder = str(tmp_path / "programs")
    runs = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="qjax.programs"):
            ar = AutoRound(model, calib, cfg, progress=False, programs=ProgramCache(folder))
            ar.run()
        runs.append((ar, [r.getMessage().split(" ")[2] for r in caplog.records
                     if r.name == "qjax.programs"]))
    (first, log1), (second, log2) = runs
    files = sorted(os.listdir(folder))
    assert len(files) == 8  # 2 block kinds × (forward, step, start, end)
    assert log1 == ["stored"] * 8 and log2 == ["loaded"] * 8, (log1, log2)
    for ar in (first, second):
        assert [(r.init_loss, r.best_loss, r.best_iter) for r in ar.reports] == \
            [(r.init_loss, r.best_loss, r.best_iter) for r in six_iters.reports]
        _same_codes(six_iters, ar)


def test_layer_config_parsing_and_bad_input(base, calib, caplog):
    assert parse_layer_config("{.*experts.*:{bits:2,group_size:64}}") == {".*experts.*": {"bits": 2, "group_size": 64}}
    assert parse_layer_config('{"mlp.shared_expert": {"bits": 8}}') == {"mlp.shared_expert": {"bits": 8}}
    model = qjax.load_model(base[0])
    with caplog.at_level(logging.WARNING, logger="qjax.autoround"):
        AutoRound(model, calib, _config(iters=0, layer_config={"nothing_like_this": {"bits": 2}}), progress=False)
    assert "matches no quantizable layer" in caplog.text
    with pytest.raises(LayerConfigError, match="bits 3"):
        AutoRound(model, calib, _config(iters=0, bits=3), progress=False)
    with pytest.raises(LayerConfigError, match="unsupported option"):
        parse_layer_config('{"q_proj": {"bitz": 2}}')
    with pytest.raises(ValueError, match="experts of model.layers.0.mlp.experts different schemes"):
        AutoRound(model, calib, _config(iters=0, layer_config={"layers.0.mlp.experts.3.": {"bits": 8}}),
                  progress=False).run()


def test_calibration_data(base, tmp_path, caplog):
    folder, _ = base
    tok = load_tokenizer(folder)
    short = tmp_path / "short.txt"
    short.write_text("w1 w2 w3\n\nw4 w5")
    with pytest.raises(CalibrationError, match="7 tokens in all, fewer than one sample of seqlen 64"):
        calibration_ids(str(short), tok, nsamples=4, seqlen=64)
    # documents shorter than seqlen are packed (auto-round's concat mode) rather than dropped
    with caplog.at_level("INFO", logger="qjax.autoround"):
        packed = calibration_ids(str(short), tok, nsamples=4, seqlen=3)
        assert packed.shape == (2, 3)
        # fewer samples than asked: a warning when they are tuned on, an info line for an RTN run
        assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
        caplog.clear()
        assert calibration_ids(str(short), tok, nsamples=4, seqlen=3, tuned=False).shape == (2, 3)
        assert [r.levelname for r in caplog.records] == ["INFO", "INFO"]
    jl = tmp_path / "ids.jsonl"
    jl.write_text("\n".join(json.dumps({"input_ids": list(range(i, i + 10))}) for i in range(5)))
    ids = calibration_ids(str(jl), None, nsamples=3, seqlen=8)
    assert ids.shape == (3, 8)
    with pytest.raises(CalibrationError, match="outside the model's vocabulary"):
        calibration_ids(str(jl), None, nsamples=3, seqlen=8, vocab_size=5)
    with pytest.raises(CalibrationError, match="no such file"):
        calibration_ids(str(tmp_path / "missing.txt"), tok, nsamples=1, seqlen=8)


def test_damaged_progress_is_named_and_refused(base, calib, tmp_path):
    """Every progress file carries a checksum: an altered block, a truncated or edited state.json, a block that is
    not an npz at all — each is refused with its path, never resumed into a different result."""
    import hashlib
    import shutil

    from qjax.autoround import progress as prog

    cfg = _config(iters=0)
    model = qjax.load_model(base[0], dtype=jnp.float32)
    pdir = tmp_path / "progress"

    def stop(report):
        if report.index == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        AutoRound(model, calib, cfg, progress=False, progress_dir=str(pdir), fingerprint={"r": 1}, on_block=stop).run()
    good = tmp_path / "good"
    shutil.copytree(pdir, good)

    def resume():
        AutoRound(model, calib, cfg, progress=False, progress_dir=str(pdir), fingerprint={"r": 1}, resume=True).run()

    def damage(name, edit):
        shutil.rmtree(pdir)
        shutil.copytree(good, pdir)
        path = pdir / name
        path.write_bytes(edit(path.read_bytes()))
        return str(path)

    block = "block_0001.npz"
    cases = [
        (block, lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], "altered"),
        (block, lambda b: b[: len(b) // 2], "altered"),
        ("state.json", lambda b: b[: len(b) // 2], "not valid JSON"),
        ("state.json", lambda b: b"\xff\xfe garbage", "not UTF-8"),
        ("state.json", lambda b: b.replace(b'"done": 2', b'"done": 1'), "damaged"),
        ("state.json", lambda b: b"[]", "JSON object"),
    ]
    for name, edit, text in cases:
        path = damage(name, edit)
        with pytest.raises(ResumeError) as info:
            resume()
        assert text in str(info.value) and path in str(info.value), str(info.value)
    # a block file rewritten with its checksum made to match is still read safely (no pickle) and named on error
    path = damage(block, lambda b: b"PK\x03\x04 not a zip")
    state = json.loads((pdir / "state.json").read_text())
    state["blocks"][1] = hashlib.sha256((pdir / block).read_bytes()).hexdigest()
    body = {k: v for k, v in state.items() if k != "checksum"}
    (pdir / "state.json").write_text(json.dumps({**body, "checksum": prog.state_checksum(body)}))
    with pytest.raises(ResumeError, match="cannot be read") as info:
        resume()
    assert path in str(info.value)
    shutil.rmtree(pdir)
    shutil.copytree(good, pdir)
    resume()  # the intact copy resumes


def test_calibration_files_that_are_not_what_they_claim(base, tmp_path):
    tok = load_tokenizer(base[0])
    cases = [("big.jsonl", json.dumps({"input_ids": [1, 2 ** 40]}), "input_ids holds 1099511627776"),
             ("neg.jsonl", json.dumps({"input_ids": [-3]}), "input_ids holds -3"),
             ("bool.jsonl", json.dumps({"input_ids": [True]}), "list of integers"),
             ("bin.txt", b"caf\xe9 au lait", "not UTF-8 text (byte 3"),
             ("deep.json", "[" * 50_000 + "]" * 50_000, "nested 50000 levels"),
             ("broken.jsonl", '{"text": "a"}\n{"text": ', "broken.jsonl:2: not valid JSON"),
             ("obj.json", '{"text": "a"}', "expected a JSON list")]
    for name, data, text in cases:
        p = tmp_path / name
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        with pytest.raises(CalibrationError) as info:
            calibration_ids(str(p), tok, nsamples=2, seqlen=4)
        assert text in str(info.value) and str(p) in str(info.value), str(info.value)


def test_data_parallel_mesh_takes_the_most_devices_that_divide_the_batch():
    from qjax.autoround.driver import data_parallel_mesh

    devs = [object() for _ in range(6)]  # Mesh only stores them
    assert data_parallel_mesh(8, devs[:1]) is None
    assert data_parallel_mesh(7, devs) is None  # 7 is prime: nothing above one device divides it
    assert data_parallel_mesh(8, devs).size == 4
    assert data_parallel_mesh(8, devs[:2]).size == 2
    assert data_parallel_mesh(3, devs).size == 3
    assert data_parallel_mesh(1, devs) is None


@pytest.mark.subprocess
def test_tuning_split_over_two_devices_equals_one(tmp_path):
    """tests/autoround_dp_probe.py in a process with two CPU devices: the first block's tuning on one device and split
    over two (the experts' rounding parameters split between them), one iteration, for the default recipe and for
    SignRoundV2's top-0.1 % error filter (alg_ext); the two-device run's step is the program stored in and read
    from a program cache; the two-device step's program and its program cache file the same in a second process
    with other string hashing. Measured (2026-12-05): iteration-0 loss equal to 2.2e-7
    relative, 0.03 % / 0.015 % of the codes differ (gradients near zero whose sign the summation order decides); with
    the gradients not summed across the devices 28 % / 21 % differed."""
    import subprocess
    import sys

    probe = os.path.join(os.path.dirname(__file__), "autoround_dp_probe.py")
    reports = []
    # the second process only lowers the two-device steps, under another string hashing: the same programs, so a
    # later `qjax quantize` finds them in the persistent compilation cache (a set's order once changed them)
    for seed, extra in (("1", []), ("2", ["--step-hlo-only"])):
        out = tmp_path / f"dp{seed}.json"
        env = {**os.environ, "JAX_NUM_CPU_DEVICES": "2", "JAX_PLATFORMS": "cpu", "PYTHONHASHSEED": seed}
        r = subprocess.run([sys.executable, "-P", probe, str(out), *extra], env=env, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        reports.append(json.loads(out.read_text()))
    report, hlo_only = reports
    assert report.pop("set_order") != hlo_only.pop("set_order")  # the two processes order sets of names differently
    assert set(report) == set(hlo_only) == {"w4-experts-w2", "w2-alg-ext"}
    for name, rep in report.items():
        assert len(rep["step_hlo"]) == 1 and rep["step_hlo"] == hlo_only[name]["step_hlo"], name
        assert len(rep["program_files"]) == 1 and rep["program_files"] == hlo_only[name]["program_files"], name
        assert rep["program_files"][0] in os.listdir(tmp_path / "dp1.json.programs"), name  # stored, then run
        one, two = rep["init_loss"]
        assert abs(one - two) <= 1e-6 * abs(one), (name, one, two)
        assert rep["codes_differing"] <= 0.003 * rep["codes"], (name, rep)
