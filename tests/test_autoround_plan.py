"""The memory plan of a streamed ``qjax quantize`` run (qjax/autoround/plan.py): streams on the device when they fit,
on the host otherwise, a refusal in one line with the numbers before any work, and every number named in the
printed plan and in ``qjax quantize --help``."""

from __future__ import annotations

import argparse
import os
import types

import numpy as np
import pytest

from qjax.autoround import plan as plan_mod
from qjax.autoround import stream
from qjax.autoround.api import progress_dir_for, quantize_folder
from qjax.autoround.driver import AutoRound, AutoRoundConfig
from qjax.checkpoint.hub import default_model_dir
from qjax.cli.quantize import add_arguments

CFG = AutoRoundConfig(bits=4, group_size=64, iters=2, nsamples=4, seqlen=32, batch_size=2,
                      layer_config={".*experts.*": {"bits": 2, "group_size": 32}})
GPU = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", id=0)
NAMES = ("block weights", "packed result", "stream", "tuning step", "peak")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    source = stream.FolderBlocks(default_model_dir())
    ar = AutoRound(source, np.zeros((CFG.nsamples, CFG.seqlen), np.int32), CFG, progress=False,
                   progress_dir=str(tmp_path_factory.mktemp("p")))
    yield ar
    source.close()


def test_streams_go_where_they_fit_and_a_plan_that_cannot_fit_is_refused(run):
    roomy = plan_mod.plan_memory(run, device=GPU, device_memory=80 << 30)
    assert roomy.where == stream.DEVICE
    w, step, s = roomy.block_weights, roomy.step, roomy.stream
    assert roomy.peak == 2 * w + step + 3 * s
    assert s == CFG.nsamples * CFG.seqlen * 256 * 2
    assert w > 0 and 0 < roomy.block_packed < w and step > 0
    tight = plan_mod.plan_memory(run, device=GPU, device_memory=2 * w + step + 3 * s - 1)
    assert tight.where == stream.HOST and tight.peak == 2 * w + step + tight.chunk
    with pytest.raises(plan_mod.PlanError) as e:
        plan_mod.plan_memory(run, device=GPU, device_memory=2 * w + step)
    msg = str(e.value)
    assert "\n" not in msg and "does not fit NVIDIA H100 80GB HBM3 0" in msg and "(--device_memory)" in msg
    assert "block weights" in msg and "tuning step" in msg and "host streams" in msg
    lines = "\n".join(roomy.lines())
    assert all(n in lines for n in NAMES) and "on the device" in lines and "budget 80.00 GiB" in lines
    assert "one tuning chunk" not in lines and "per tuning chunk" in "\n".join(tight.lines())


def test_cpu_keeps_streams_as_device_arrays_and_counts_the_host(run):
    cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu", id=0)
    p = plan_mod.plan_memory(run, device=cpu, device_memory=64 << 30)
    assert p.where == stream.DEVICE and p.host > 0
    with pytest.raises(plan_mod.PlanError, match=r"does not fit the host: .* > 1\.0 MiB \(--device_memory\)"):
        plan_mod.plan_memory(run, device=cpu, device_memory=1 << 20)


def test_a_refused_plan_leaves_nothing(tmp_path):
    folder = default_model_dir()
    out = tmp_path / "out"
    with pytest.raises(plan_mod.PlanError):
        quantize_folder(folder, str(out), CFG, dataset=os.path.join(folder, "calib.txt"), progress=False,
                        device_memory=1 << 20)
    assert not out.exists() and not os.path.exists(progress_dir_for(str(out)))


def test_help_names_every_memory_number():
    p = argparse.ArgumentParser()
    add_arguments(p)
    text = " ".join(p.format_help().split())
    assert "--device_memory GIB" in text
    assert all(n in text for n in NAMES), text
