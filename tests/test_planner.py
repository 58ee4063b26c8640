"""The memory planner (qjax.convert.planner): what it predicts is what loading allocates and what RTN writes."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
from oracles.hf import tiny_text_config
from qjax.convert import save_pretrained

import qjax


def test_planner_predicts_what_loading_allocates(ct_ckpt):
    from qjax.convert.planner import plan_folder

    _, folder = ct_ckpt
    model = qjax.load_model(folder)
    import jax
    from flax import nnx
    held = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(nnx.state(model)))
    assert plan_folder(folder).device_bytes == held


def test_planner_recipe_matches_a_real_rtn_checkpoint(tiny_hf, tmp_path):
    """`inspect --config --recipe` (shapes only) predicts the tensors an RTN checkpoint of that recipe really has."""
    from qjax.convert.planner import plan_folder, plan_recipe, recipe_to_qconfig

    from qjax.autoround.rtn import quantize_model

    recipe = "experts=int2:g32,rest=int4:g32,lm_head=int8:channel"  # tiny dims: groups must divide 32-wide inputs
    model = qjax.load_model(tiny_hf[1], dtype=jnp.bfloat16)
    real = save_pretrained(quantize_model(model, recipe_to_qconfig(recipe)), tmp_path / "w2w4")
    predicted = plan_recipe(os.path.join(tiny_hf[1], "config.json"), recipe)
    measured = plan_folder(real)
    assert predicted.headers == measured.headers
    assert predicted.device_bytes == measured.device_bytes


def test_inspect_cli(tmp_path):
    import subprocess
    import sys

    cfg = tiny_text_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "qjax.cli", "inspect", "--config", str(tmp_path / "config.json"),
                        "--recipe", "experts=int2:g64,rest=int4:g128,kv=fp8"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "int2 g64" in r.stdout and "int4 g128" in r.stdout and "KV cache" in r.stdout


def test_inspect_says_what_the_model_computes_in(tiny_hf, capsys, x64):
    """`qjax inspect` prints the dtype a load computes in (the checkpoint's, or --dtype's) and its accumulation dtype;
    float64 doubles the GDN state; a dtype the model cannot compute in is refused by name."""
    import pytest

    from qjax.cli import main

    assert main(["inspect", tiny_hf[1]]) == 0
    out = capsys.readouterr().out
    assert "computes in: float32 (the checkpoint's; " in out and "accumulate in float32" in out
    assert main(["inspect", tiny_hf[1], "--dtype", "float64"]) == 0
    out64 = capsys.readouterr().out
    assert "computes in: float64 (--dtype; " in out64 and "float64 recurrent state" in out64
    with pytest.raises(SystemExit):
        main(["inspect", tiny_hf[1], "--dtype", "int8"])
    assert "the model cannot compute in 'int8'" in capsys.readouterr().err


def test_planner_counts_the_vision_tower_as_loading_holds_it(official_dir):
    """A checkpoint with a vision tower (the official layout: model.visual.*, mtp.*, 2 shards): the tower is part of
    the predicted device memory as loading holds it — in its stored dtype, or --dtype's —, and left out (listed as
    skipped) with text_only; its tensor count and bytes on disk are the headers' own."""
    import jax
    import numpy as np
    from flax import nnx

    from qjax.convert.planner import ST_ITEMSIZE, format_plan, plan_folder

    def held(model):
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(nnx.state(model)))

    for dtype, text_only in ((None, False), ("bfloat16", False), (None, True)):
        p = plan_folder(official_dir, dtype=dtype, text_only=text_only)
        visual = {k: v for k, v in p.headers.items() if k.startswith("model.visual.")}
        disk = sum(int(np.prod(shape)) * ST_ITEMSIZE[d] for shape, d in visual.values())
        assert visual
        model = qjax.load_model(official_dir, dtype=dtype, text_only=text_only, verify=False)
        assert p.device_bytes == held(model), (dtype, text_only)
        assert (p.vision_tensors, p.vision_disk_bytes, p.vision_loaded) == (len(visual), disk, not text_only)
        tower = held(model.visual) if model.visual is not None else 0
        assert p.vision_device_bytes == tower
        report = format_plan(p, title="t")
        if text_only:
            assert p.skipped == {"model.visual.*": disk} and tower == 0
            assert "vision tower (model.visual.*, skipped: --text-only)" in report
        else:
            assert p.skipped == {} and p.vision_dtype == model.visual.patch_embed.proj.weight[...].dtype.name
            assert f"vision tower (model.visual.*, kept in {p.vision_dtype})" in report
            assert p.vision_dtype == (dtype or "float32")  # stored float32; --dtype wins
