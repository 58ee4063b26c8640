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

import qjax
from ar_util import NSAMPLES, SEQLEN, read_tensors, write_base, write_calibration
from qjax.autoround.api import progress_dir_for
from qjax.autoround.data import calibration_ids, load_tokenizer

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

    from qjax.autoround.driver import AutoRound, AutoRoundConfig
    from qjax.convert import save_pretrained

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
