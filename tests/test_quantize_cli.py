"""``qjax quantize`` through the real entry point: both export formats, a SIGKILL mid-run then ``--resume``, and the
refusals (existing output, unsupported bits, data shorter than seqlen)."""

from __future__ import annotations

import json
import os
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

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

RECIPE = ["--bits", "4", "--group_size", "32", "--layer_config", "{.*experts.*:{bits:2,group_size:32}}",
          "--nsamples", str(NSAMPLES), "--seqlen", str(SEQLEN), "--batch_size", "4", "--dtype", "float32"]


def _cmd(*args):
    return [sys.executable, "-m", "qjax.cli", "quantize", *args]


def _run(*args, check=True):
    p = subprocess.run(_cmd(*args), capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli-base")
    return write_base(tmp / "base"), write_calibration(tmp / "calib.json")


def test_kill_then_resume_equals_uninterrupted(base, tmp_path):
    """SIGKILL once block 1 is saved; ``--resume`` finishes from block 2; the folder equals an uninterrupted
    in-process run of the same options, tensor for tensor."""
    folder, calib = base
    out = str(tmp_path / "out")
    args = ["--model", folder, "--dataset", calib, "--output_dir", out, "--iters", "6", "--quiet", *RECIPE]
    proc = subprocess.Popen(_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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
    p = _run(*args, "--resume")
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


def _quantize(folder, calib, out, **kw):
    from qjax.autoround.api import quantize_folder
    from qjax.autoround.driver import AutoRoundConfig

    cfg = AutoRoundConfig(bits=4, group_size=32, iters=0, nsamples=2, seqlen=SEQLEN, batch_size=2,
                          disable_opt_rtn=True)
    return quantize_folder(folder, str(out), cfg, dataset=calib, progress=False, **kw)


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
