"""``qjax quantize`` through the real entry point: both export formats, a SIGKILL mid-run then ``--resume``, and the
refusals (existing output, unsupported bits, data shorter than seqlen)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
from oracles.autoround import NSAMPLES, SEQLEN, read_tensors, write_base, write_calibration

import qjax
from qjax.autoround.api import progress_dir_for
from qjax.autoround.data import calibration_ids, load_tokenizer

pytestmark = [pytest.mark.subprocess]

RECIPE = ["--bits", "4", "--group_size", "32", "--layer_config", "{.*experts.*:{bits:2,group_size:32}}",
          "--nsamples", str(NSAMPLES), "--seqlen", str(SEQLEN), "--batch_size", "4", "--dtype", "float32"]


def _cmd(*args):
    return [sys.executable, "-m", "qjax.cli", "quantize", *args]


def _run(*args, check=True, env=None):
    p = subprocess.run(_cmd(*args), capture_output=True, text=True, timeout=600, env=env)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli-base")
    return write_base(tmp / "base"), write_calibration(tmp / "calib.json")


@pytest.mark.slow
def test_kill_then_resume_equals_uninterrupted(base, tmp_path):
    """SIGKILL once block 1 is saved; ``--resume`` finishes from block 2; the folder equals an uninterrupted
    in-process run of the same options, tensor for tensor. One CPU device in the command, as in this process (with
    one per core the step splits its minibatch: equal up to summation order, tests/test_autoround.py)."""
    folder, calib = base
    out = str(tmp_path / "out")
    args = ["--model", folder, "--dataset", calib, "--output_dir", out, "--iters", "6", "--quiet", *RECIPE]
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1"}
    proc = subprocess.Popen(_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    state = os.path.join(progress_dir_for(out), "state.json")
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.load(open(state))["done"] >= 2:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not os.path.exists(out)
    p = _run(*[x for x in args if x != "--quiet"], "--resume", env=env)
    assert re.search(r"--resume: [2-4] of 4 blocks reused from ", p.stderr), p.stderr[-3000:]
    assert os.path.isdir(out) and not os.path.exists(progress_dir_for(out))
    report = json.load(open(os.path.join(out, "qjax_autoround.json")))
    assert [r["index"] for r in report] == [0, 1, 2, 3]

    from qjax.convert import save_pretrained

    from qjax.autoround.driver import AutoRound, AutoRoundConfig

    model = qjax.load_model(folder, dtype=jnp.float32)
    ids = calibration_ids(calib, load_tokenizer(folder), nsamples=NSAMPLES, seqlen=SEQLEN)
    ar = AutoRound(model, ids, AutoRoundConfig(bits=4, group_size=32, iters=6, nsamples=NSAMPLES, seqlen=SEQLEN,
                                               batch_size=4,
                                               layer_config={".*experts.*": {"bits": 2, "group_size": 32}}),
                   progress=False)
    ar.run()
    ref = read_tensors(save_pretrained(ar.quantized_model(), tmp_path / "ref"))
    got = read_tensors(out)
    assert sorted(got) == sorted(ref)
    assert all(np.array_equal(got[k], ref[k]) for k in ref), p.stdout


@pytest.mark.slow
def test_auto_round_format_and_refusals(base, tmp_path):
    folder, calib = base
    out = str(tmp_path / "ar")
    _run("--model", folder, "--dataset", calib, "--output_dir", out, "--iters", "0", "--format", "auto_round",
         "--quiet", *RECIPE)
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert qc["quant_method"] == "auto-round" and qc["packing_format"] == "auto_round:auto_gptq"
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    model = qjax.load_model(out)
    ids = calibration_ids(calib, load_tokenizer(folder), nsamples=2, seqlen=SEQLEN)
    ref = np.asarray(qjax.load_model(folder)(ids), np.float32)
    got = np.asarray(model(ids), np.float32)
    assert np.isfinite(got).all() and np.abs(got - ref).mean() < np.abs(ref).mean()

    p = _run("--model", folder, "--dataset", calib, "--output_dir", out, "--iters", "0", *RECIPE, check=False)
    assert p.returncode == 2 and "already exists (pass --overwrite" in p.stderr
    p = _run("--model", folder, "--dataset", calib, "--output_dir", str(tmp_path / "b3"), "--iters", "0",
             "--bits", "3", check=False)
    assert p.returncode == 2 and "bits 3 is not supported" in p.stderr
    short = tmp_path / "short.txt"
    short.write_text("w1 w2 w3")
    p = _run("--model", folder, "--dataset", str(short), "--output_dir", str(tmp_path / "s"), "--iters", "0",
             *RECIPE, check=False)
    assert p.returncode == 2 and "fewer than one sample of seqlen 64" in p.stderr
    assert not os.path.exists(tmp_path / "s") and not os.path.exists(tmp_path / "b3")


@pytest.mark.slow
def test_each_block_reported_once_and_nothing_to_quantize_is_an_error(base, tmp_path):
    """Without --quiet every finished block is one line, numbered as auto-round numbers them (1/4 … 4/4), and the
    compilation cache is named and filled; a run whose group size divides no layer is an error naming the shapes,
    not an exit-0 float folder."""
    folder, calib = base
    out, cache = tmp_path / "once", tmp_path / "compiled"
    p = _run("--model", folder, "--dataset", calib, "--output_dir", str(out), "--iters", "2", "--compile_cache",
             str(cache), *RECIPE)
    assert f"compilation cache: {cache} " in p.stderr and any(cache.iterdir())
    # one CPU device per core (up to the batch of 4): the tuning step says how it splits its minibatch
    ways = max(d for d in range(1, min(len(os.sched_getaffinity(0)), 4) + 1) if 4 % d == 0)
    assert (f"tuning data parallel over {ways} devices" in p.stderr) == (ways > 1), p.stderr
    # the progress bar's frames ("block 1/4:  50%|…") are not reports; a finished block's line names its kind
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if re.match(r"block \d+/\d+ \(", ln)]
    assert [ln.split(" ", 2)[1] for ln in lines] == ["1/4", "2/4", "3/4", "4/4"], p.stdout + p.stderr
    assert all("loss iter 0" in ln for ln in lines)
    bad = tmp_path / "g48"
    p = _run("--model", folder, "--dataset", calib, "--output_dir", str(bad), "--iters", "0", "--group_size", "48",
             "--nsamples", "2", "--seqlen", str(SEQLEN), "--compile_cache", "off", check=False)
    assert "compilation cache: off" in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith("error: nothing would be quantized: "), p.stderr
    assert "layers with in_features 64 (not a multiple of group_size 48)" in last and "in_features 32 " in last
    assert not bad.exists()


def _quantize(folder, calib, out, **kw):
    from qjax.autoround.api import quantize_folder
    from qjax.autoround.driver import AutoRoundConfig

    cfg = AutoRoundConfig(bits=4, group_size=32, iters=0, nsamples=2, seqlen=SEQLEN, batch_size=2,
                          disable_opt_rtn=True)
    return quantize_folder(folder, str(out), cfg, dataset=calib, progress=False, **kw)


@pytest.mark.slow
def test_writes_fail_before_any_work_and_leave_nothing(base, tmp_path, monkeypatch):
    """A place that cannot be written, or a disk without room, is refused before the model is loaded; a write that
    fails at the end (full disk) names the folder and leaves no temporary folder; a temporary folder left by a run
    killed during its final write is removed by the next run."""
    import errno
    import shutil as sh

    import qjax.convert.hf_writer as writer

    folder, calib = base
    loads = []
    real_load = qjax.load_model
    monkeypatch.setattr(qjax, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))

    blocker = tmp_path / "a-file"  # (permission bits do not stop root: a file where a folder must go does)
    blocker.write_text("")
    with pytest.raises(OSError) as info:
        _quantize(folder, calib, blocker / "out")
    assert f"cannot write next to {blocker / 'out'}" in str(info.value) and not loads

    with monkeypatch.context() as m:
        m.setattr(sh, "disk_usage", lambda p: sh._ntuple_diskusage(10 << 30, 10 << 30, 1 << 10))
        with pytest.raises(OSError, match=r"has 0.00 GiB free, but writing .*full needs about") as info:
            _quantize(folder, calib, tmp_path / "full")
    assert info.value.errno == errno.ENOSPC and not loads

    def full_disk(out, *a, **k):
        with open(os.path.join(out, "model.safetensors"), "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(writer, "write_weights", full_disk)
        with pytest.raises(OSError) as info:
            _quantize(folder, calib, tmp_path / "late")
    assert f"writing {tmp_path / 'late'} failed: No space left on device" in str(info.value)
    # no output and no temporary folder; the progress folder stays, so that --resume can finish the run
    assert not [n for n in os.listdir(tmp_path) if n.startswith((".late.tmp", "late"))], os.listdir(tmp_path)
    assert os.path.isdir(progress_dir_for(str(tmp_path / "late")))

    stale = tmp_path / ".ok.tmp-killed"
    (stale / "half").mkdir(parents=True)
    out = _quantize(folder, calib, tmp_path / "ok")
    assert os.path.isdir(out) and not stale.exists()
    real_load(out)


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """The tiny bf16 model in the official Qwen3.6 layout (composite config, BF16 vision tower, BF16 MTP head with
    fused experts) with its tokenizer, and calibration text."""
    import torch
    from oracles.autoround import write_tokenizer
    from oracles.hf import make_hf_model, save_hf, tiny_text_config, write_official_layout

    tmp = tmp_path_factory.mktemp("cli-official")
    hf = make_hf_model(tiny_text_config(), seed=0).to(torch.bfloat16)
    folder = write_official_layout(save_hf(hf, tmp / "src"), tmp / "official", shards=1, mtp_fused=True)
    write_tokenizer(folder)
    return folder, write_calibration(tmp / "calib.json")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["llm_compressor", "auto_round"])
def test_autoround_export_keeps_mtp_head_and_vision_as_stored(official, fmt, tmp_path):
    """AutoRound (2 tuning iterations, float32 blocks) tunes the decoder only: both formats carry the source's BF16
    MTP head and vision tower byte for byte, listed unquantized, in the source's composite layout; the folder
    reloads with a head computing the source model's MTP logits exactly."""
    from test_rtn import assert_kept_as_stored

    from qjax.autoround.api import quantize_folder
    from qjax.autoround.driver import AutoRoundConfig

    folder, calib = official
    cfg = AutoRoundConfig(bits=4, group_size=32, iters=2, nsamples=4, seqlen=32, batch_size=2,
                          layer_config={".*experts.*": {"bits": 2, "group_size": 32},
                                        ".*in_proj_[ab].*": {"bits": 16}})  # 4 rows: auto_round cannot pack them
    out = quantize_folder(folder, str(tmp_path / fmt), cfg, dataset=calib, fmt=fmt, dtype="float32", progress=False)
    assert_kept_as_stored(folder, out)
    report = json.load(open(os.path.join(out, "qjax_autoround.json")))
    assert [r["index"] for r in report] == [0, 1, 2, 3]  # the decoder's blocks, and no other
    src, back = qjax.load_model(folder, dtype=jnp.float32), qjax.load_model(out)
    assert back.quant is not None and back.dtype == jnp.float32
    ids = np.random.default_rng(10).integers(0, 500, (2, 10)).astype(np.int32)
    hidden = src.forward(jnp.asarray(ids)).hidden
    np.testing.assert_array_equal(np.asarray(back.mtp_logits(ids, hidden)), np.asarray(src.mtp_logits(ids, hidden)))


# ---- the model cards' auto-round command lines, verbatim but for paths and run length ----

SEED1 = ["--bits", "4", "--group_size", "128", "--layer_config", "{.*experts.*:{bits:2,group_size:64}}",
         "--enable_alg_ext", "--enable_torch_compile", "--iters", "1000", "--nsamples", "512",
         "--format", "auto_round,llm_compressor"]
SEED2 = ["--scheme", "MXFP8", "--algorithm", "rtn", "--iters", "0", "--static_kv_dtype", "fp8", "--ignore_layers",
         "lm_head,embed_tokens,visual,linear_attn,shared_expert,self_attn,mtp,mlp.gate", "--device_map", "0,1,2",
         "--format", "llm_compressor", "--disable_low_cpu_mem_usage"]


def _replace(args, **kw):
    """``args`` with the values of the flags in ``kw`` replaced (the flags stay where the command line has them)."""
    args = list(args)
    for k, v in kw.items():
        args[args.index("--" + k) + 1] = v
    return args


@pytest.mark.slow
@pytest.mark.parametrize("alg_ext", [True, False])
def test_seed_line_1_writes_both_formats_with_the_same_logits(base, tmp_path, alg_ext):
    """``--format auto_round,llm_compressor``: one tuning run, OUTPUT_DIR/auto-round and OUTPUT_DIR/llm-compressor
    (auto-round's folder names); both reload to the same logits."""
    folder, calib = base
    out = tmp_path / "mix"
    # the tiny model's widths (32, 64) are below group 128: groups the tiny model divides, every flag still present
    # (with --enable_alg_ext the experts' [E, in] imatrices weight each expert's scale search)
    args = _replace(SEED1, iters="2", nsamples=str(NSAMPLES), group_size="32",
                    layer_config="{.*experts.*:{bits:2,group_size:32}}")
    if not alg_ext:
        args.remove("--enable_alg_ext")
    p = _run("--model", folder, "--dataset", calib, "--output_dir", str(out), "--seqlen", str(SEQLEN),
             "--batch_size", "4", "--dtype", "float32", "--quiet", *args)
    assert "note: --enable_torch_compile" in p.stderr
    assert sorted(os.listdir(out)) == ["auto-round", "llm-compressor"]
    qc = json.load(open(out / "auto-round" / "config.json"))["quantization_config"]
    assert qc["quant_method"] == "auto-round" and qc["iters"] == 2
    qc = json.load(open(out / "llm-compressor" / "config.json"))["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    ids = np.random.default_rng(3).integers(0, 200, (1, 12)).astype(np.int32)
    a = np.asarray(qjax.load_model(str(out / "auto-round"), dtype=jnp.float32)(ids), np.float32)
    b = np.asarray(qjax.load_model(str(out / "llm-compressor"), dtype=jnp.float32)(ids), np.float32)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_seed_line_2_mxfp8_rtn_ignore_layers(base, tmp_path):
    """``--model_name``, ``--algorithm rtn``, ``--ignore_layers``, and the no-effect flags noted one line each; the
    calibration source named; an RTN run asking for more samples than the file holds is not warned about it, and
    ignored names that match no quantizable layer (``lm_head``, ``mlp.gate``, …) are not called layer_config
    patterns."""
    folder, calib = base
    out = tmp_path / "mxfp8"
    p = _run("--model_name", folder, "--dataset", calib, "--output_dir", str(out), "--nsamples", "100000",
             "--seqlen", str(SEQLEN), *SEED2)
    notes = [ln for ln in p.stderr.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 2 and "--device_map" in notes[0] and "--disable_low_cpu_mem_usage" in notes[1], p.stderr
    assert f"calibration data: {calib} (--dataset)" in p.stderr, p.stderr
    assert re.search(r"calibration: \d+ samples of \d+ tokens from ", p.stderr), p.stderr
    assert "--layer_config pattern" not in p.stderr and "--ignore_layers 'mlp.gate': no quantizable layer" in p.stderr
    q = _run("--model_name", folder, "--dataset", calib, "--output_dir", str(tmp_path / "quiet"), "--nsamples",
             "100000", "--seqlen", str(SEQLEN), "--quiet", *SEED2)
    assert "calibration" not in q.stderr and "--ignore_layers" not in q.stderr, q.stderr  # no warning left
    qc = json.load(open(out / "config.json"))["quantization_config"]
    ignored = set(qc["ignore"])
    tensors = read_tensors(str(out))
    for name in {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight") and ".layers." in k
                 and tensors[k].ndim == 2 and "embed" not in k and "mlp.gate." not in k}:
        if any(t in name for t in ("linear_attn", "shared_expert", "self_attn", "mlp.gate")):
            assert name in ignored or any(i.startswith("re:") and re.match(i[3:], name) for i in ignored), name
    assert any(".experts." in k and k.endswith("weight_scale") for k in tensors)  # the routed experts: MXFP8


def _cli(*args):
    return subprocess.run(_cmd(*args), capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_cli_refusals_name_the_flag(tmp_path):
    """A malformed ``--layer_config``, an algorithm qjax lacks, a misspelled flag: one error line, exit 2 (a
    misspelled flag with the subcommand's usage); ``--help`` shows the defaults."""
    out = str(tmp_path / "o")
    p = _cli("--output_dir", out, "--layer_config", "{.*experts.*:{bits:2")
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("error: --layer_config")
    p = _cli("--output_dir", out, "--algorithm", "hadamard")  # auto-round's; awq and gptq are qjax's since issue 51
    assert p.returncode == 2 and "error: --algorithm hadamard is not supported" in p.stderr
    p = _cli("--output_dir", out, "--iterz", "3")
    assert p.returncode == 2 and "usage: qjax quantize" in p.stderr and "--iterz" in p.stderr
    h = _cli("--help").stdout
    for d in ("(default: 200)", "(default: 128)", "(default: 2048)", "(default: 8)", "(default: llm_compressor)",
              "llm-compressor"):
        assert d in h, d
    assert not os.path.exists(out)


@pytest.mark.parametrize("text", [
    "{.*experts.*:{bits:2,group_size:64}}", '{".*experts.*": {"bits": 2, "group_size": 64}}',
    "'{mlp.gate:{bits:16}, .*layers\\.1\\..*:W8A16}'", '{"layers\\.\\d+\\.self_attn": {"bits": 8}}',
    "{a:{bits:8,sym:false,scale_dtype:fp32}}", "{x: {bits: 4}}"])
def test_layer_config_text_parses_as_auto_round_does(text):
    common = pytest.importorskip("auto_round.utils.common")
    from qjax.autoround.schemes import parse_layer_config_text

    assert parse_layer_config_text(text) == common.parse_layer_config_arg(text)


def test_algorithm_as_auto_round_reads_it():
    import argparse

    from qjax.autoround.api import algorithm_from_args

    def alg(v, iters=200):
        return algorithm_from_args(argparse.Namespace(algorithm=v, iters=iters))

    assert alg("rtn") == alg("RTN") == alg(None, 0) == alg("auto_round", 0) == "rtn"
    assert alg(None) == alg("signround") == alg("AutoRound") == "auto_round"


QJAX_NAMES = [f"model.layers.{i}.{m}" for i in (0, 1, 10) for m in (
    "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
    "linear_attn.out_proj", "mlp.gate", "mlp.shared_expert_gate", "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj", *(f"mlp.experts.{e}.{p}" for e in (0, 1, 12)
                                                                 for p in ("gate_proj", "up_proj", "down_proj")))] + \
    [f"model.layers.3.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + ["lm_head"]


@pytest.mark.parametrize("arg", [
    "lm_head,embed_tokens,visual,linear_attn,shared_expert,self_attn,mtp,mlp.gate", "mlp.gate", "layers.1",
    "experts.1, layers.10.mlp.gate_proj", "model.layers.3.self_attn.q_proj", ".*experts\\.1.*,down_proj$",
    "mlp.gate$"])
def test_ignore_layers_match_auto_rounds_rule(arg):
    """``--ignore_layers`` keeps unquantized exactly the layers auto-round's ``resolve_layer_config`` would (its
    digit rule, ``get_fp_layer_names``' exact/substring match, then the regex expansion): ``mlp.gate`` is a
    substring, so it would catch a dense ``mlp.gate_proj`` too, as in auto-round."""
    torch = pytest.importorskip("torch")
    resolver = pytest.importorskip("auto_round.compressors.layer_config_resolver")
    from auto_round.utils.common import to_standard_regex

    from qjax.autoround.schemes import Scheme, ignore_layers_config, ignored_layers, resolve

    root = torch.nn.Module()
    for n in QJAX_NAMES:
        m, *path, leaf = [root, *n.split(".")]
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.add_module(leaf, torch.nn.Linear(2, 2, bias=False))
    module_names = [n for n, _ in root.named_modules()]
    # auto-round 0.16.1 resolve_layer_config, step 0-1 and 6
    names = arg.replace(" ", "").split(",")
    names = [n + "." if n[-1].isdigit() and any(n + "." in m for m in module_names) else n for n in names]
    fp = resolver.get_fp_layer_names(root, names)
    want = {n for n in fp if n in QJAX_NAMES}
    for pat in fp:
        if pat not in QJAX_NAMES:
            want |= {n for n in QJAX_NAMES if re.search(to_standard_regex(pat), n)}
    got = resolve({n: (128, 128) for n in QJAX_NAMES}, Scheme(), ignore_layers_config(arg, module_names))
    assert {n for n, s in got.items() if not s.quantized} == want
    assert got == resolve({n: (128, 128) for n in QJAX_NAMES}, Scheme(), ignore_layers_config(arg))
    if arg == "mlp.gate":  # a substring: the routers, and a dense MLP's gate_proj would be caught too
        assert want == {f"model.layers.{i}.mlp.gate" for i in (0, 1, 10)}
        assert resolver.get_fp_layer_names(torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict(
            {"gate_proj": torch.nn.Linear(2, 2)})}), ["mlp.gate"])[0] == "mlp.gate_proj"
        assert ignored_layers("mlp.gate", ["mlp.gate_proj"]) == ["mlp.gate_proj"]
