"""Multi-device runs (issue: tensor and expert parallel): the same checkpoints on one device and on meshes of 8
emulated CPU devices must give the same logits and greedy tokens, hold 1/N of every split parameter per device,
and refuse meshes that do not divide the model.

The 8-device runs happen in subprocesses (tests/sharding_probe.py): the device count is fixed when JAX starts.

Tolerance: float32 logits within 1e-5 + 1e-5·|logit| of one device. Splitting a reduction over devices (row-parallel
projections, the psum of the expert devices' partial sums) only reassociates float32 additions; measured ≤ 3e-6
absolute on logits up to ~3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from oracles.hf import tiny_text_config

from qjax.model.config import TextConfig
from qjax.model.sharding import MeshError, check_fits, param_spec, parse_mesh_spec, plan_mesh

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
from sharding_probe import CHECKPOINTS, MESHES  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    work = tmp_path_factory.mktemp("sharding")
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                      " --xla_force_host_platform_device_count=8").strip())
    procs = {}
    for name in CHECKPOINTS:  # one process per checkpoint, side by side: each is mostly single-threaded compiling
        out = work / f"{name}.json"
        (work / name).mkdir()
        procs[name] = (out, subprocess.Popen([sys.executable, os.path.join(HERE, "sharding_probe.py"), name,
                                              str(out), str(work / name)], env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True))
    merged = {"checkpoints": {}, "errors": {}}
    for name, (out, proc) in procs.items():
        log, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name}:\n{log[-4000:]}"
        r = json.loads(out.read_text())
        merged["checkpoints"].update(r["checkpoints"])
        merged["errors"][name] = r["errors"]
        merged.update({k: v for k, v in r.items() if k not in ("checkpoints", "errors")})
    return merged


CASES = [(c, m) for c in CHECKPOINTS for m in MESHES]


@pytest.mark.parametrize("ckpt,mesh", CASES)
def test_mesh_matches_one_device(report, ckpt, mesh):
    r = report["checkpoints"][ckpt]["meshes"][mesh]
    assert r["devices"] == 8
    assert r["worst_over_tol"] <= 1.0, r
    assert r["tokens_equal"], r


@pytest.mark.parametrize("ckpt,mesh", CASES)
def test_each_device_holds_its_share(report, ckpt, mesh):
    """Every split variable is held 1/N per device (N = product of its spec's axes), measured on the arrays."""
    single = report["checkpoints"][ckpt]["single_bytes"]
    r = report["checkpoints"][ckpt]["meshes"][mesh]
    assert set(r["device_bytes"]) == {r["expected_device_bytes"]}
    # loading sent each device exactly its own shards: no device ever received a whole split tensor
    assert r["bytes_sent"] == r["device_bytes"]
    assert r["planned_device_bytes"] == r["expected_device_bytes"]  # qjax inspect --mesh predicts it
    sharded = single - r["replicated_bytes"]
    sizes = MESHES[mesh]
    # the split part shrinks at least by the smallest split count (tensor for dense layers, expert·tensor for experts)
    smallest = min(n for n in (sizes["tensor"], sizes["expert"] * sizes["tensor"]) if n > 1)
    assert r["expected_device_bytes"] <= r["replicated_bytes"] + sharded / smallest
    assert any("experts" in s for s in r["split"])
    if sizes["tensor"] > 1:
        assert any("q_proj" in s for s in r["split"]) and any("o_proj" in s for s in r["split"])
        assert any("in_proj_qkv" in s for s in r["split"]) and any("embed_tokens" in s for s in r["split"])


def test_experts_split_over_expert_and_tensor(report):
    r = report["checkpoints"]["bf16"]["meshes"]["1x2x4"]
    # cache: KV heads (2) split over tensor=2, GDN heads too; nothing over data=1
    assert r["cache_shards"]["per_device_fraction"][:4] == [0.5] * 4


def test_pallas_kernels_run_per_shard(report):
    """The Pallas kernels (interpret mode) inside the tensor-parallel and expert-parallel shard_maps equal the
    reference on one device (float32 accumulation: relative 1e-5)."""
    assert set(report["pallas"]) == {"qmatmul_col", "qmatmul_row", "moe_expert_parallel"}
    assert max(report["pallas"].values()) <= 1e-5, report["pallas"]


def test_random_model_made_in_shards(report):
    """qjax.runtime.random_model(mesh=...) creates each shard on its device and computes what the one-device model
    does."""
    r = report["random_model"]
    assert r["worst_over_tol"] <= 1.0 and set(r["device_bytes"]) == {r["expected_device_bytes"]}


def test_batch_not_divisible_by_data(report):
    assert report["errors"]["bf16"]["odd_batch"] == "mesh axis data=2 does not divide the batch size 1"


# ---------------------------------------------------------------------------------------------------------------------
# no devices needed
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh,message", [
    ({"tensor": 8}, "mesh axis tensor=8 does not divide num_attention_heads = 4"),
    ({"tensor": 3}, "mesh axis tensor=3 does not divide num_attention_heads"),
    ({"expert": 3}, "mesh axis expert=3 does not divide num_experts = 8"),
    ({"tensor": 2, "expert": 8}, "mesh axis expert×tensor=16 does not divide num_experts = 8"),
    ({"pipeline": 2}, "mesh axis 'pipeline' is not one of"),
    ({"data": 0}, "mesh axis 'data': size must be a positive integer"),
    ("tensor=two", "mesh: expected AXIS=SIZE"),
])
def test_bad_mesh_names_axis_and_dimension(mesh, message):
    cfg = TextConfig.from_dict(tiny_text_config())
    with pytest.raises(MeshError, match=message.replace("(", r"\(").replace("×", "×")):
        plan_mesh(mesh, cfg)


def test_mesh_needs_enough_devices():
    cfg = TextConfig.from_dict(tiny_text_config())
    with pytest.raises(MeshError, match="needs 4 devices, only 1 are available"):
        plan_mesh({"tensor": 2, "expert": 2}, cfg)


def test_gdn_value_heads_must_divide():
    cfg = TextConfig.from_dict(tiny_text_config(num_attention_heads=8, linear_num_value_heads=4,
                                                linear_num_key_heads=2))
    with pytest.raises(MeshError, match="tensor=8 does not divide linear_num_value_heads = 4"):
        check_fits({"tensor": 8}, cfg)


def test_parse_mesh_spec():
    assert parse_mesh_spec("tensor=2, expert=4") == {"tensor": 2, "expert": 4}


def test_packed_row_split_keeps_groups(caplog):
    """A row-parallel packed weight splits its words and scale groups at the same column, or stays replicated."""
    import jax
    from qjax.kernels import QuantMeta

    from qjax.model.sharding import AXES, MeshPlan

    plan = MeshPlan(mesh=jax.sharding.AbstractMesh((1, 2, 1), AXES), kv_split=True, vocab_split=True)
    meta = QuantMeta(fmt="int", bits=4, group_size=128, strategy="group", symmetric=True, out_features=2048,
                     in_features=4096, scale_dtype="bfloat16")
    path = ("groups", "layers", 3, "self_attn", "o_proj")
    assert param_spec(path + ("weight_packed",), (10, 2048, 512), plan, meta) == jax.sharding.PartitionSpec(
        None, None, "tensor")
    assert param_spec(path + ("weight_scale",), (10, 2048, 32), plan, meta) == jax.sharding.PartitionSpec(
        None, None, "tensor")
    col = ("groups", "layers", 3, "self_attn", "q_proj", "weight_scale")
    assert param_spec(col, (10, 8192, 16), plan, meta) == jax.sharding.PartitionSpec(None, "tensor", None)
    small = QuantMeta(fmt="int", bits=4, group_size=128, strategy="group", symmetric=True, out_features=2048,
                      in_features=128, scale_dtype="bfloat16")
    warned = []
    spec = param_spec(path + ("weight_packed",), (10, 2048, 16), plan, small, warned.append)
    assert spec == jax.sharding.PartitionSpec(None, None, None)
    assert warned and "self_attn.o_proj: input dim 128 split 2 ways would cut a quantization group" in warned[0]
    experts = ("groups", "layers", 0, "mlp", "experts", "gate_up_proj", "weight_packed")
    assert param_spec(experts, (10, 256, 1024, 256), plan, meta) == jax.sharding.PartitionSpec(
        None, ("tensor",), None, None)


def test_inspect_mesh_cli(tmp_path):
    """`qjax inspect --config … --recipe … --mesh` prints per-device memory (the real 35B config ships with qjax)."""
    from qjax.convert.planner import plan_recipe

    config = os.path.join(os.path.dirname(__import__("qjax").__file__), "assets", "configs", "qwen3_6_35b_a3b.json")
    r = subprocess.run([sys.executable, "-m", "qjax.cli", "inspect", "--config", config, "--recipe", "mxfp8-experts",
                        "--mesh", "tensor=2,expert=2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "on a mesh of 4 devices (data=1, tensor=2, expert=2), per device:" in r.stdout
    p = plan_recipe(config, "mxfp8-experts", mesh={"tensor": 2, "expert": 2})
    assert p.mesh_device_bytes < p.device_bytes / 3.4  # experts (most bytes) split 4 ways, the rest 2 ways
    bad = subprocess.run([sys.executable, "-m", "qjax.cli", "inspect", "--config", config, "--recipe", "w2w4",
                          "--mesh", "tensor=3"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "tensor=3 does not divide num_attention_heads = 16" in bad.stderr


def test_generate_cli_with_mesh_matches_one_device():
    """`qjax generate --mesh tensor=2,expert=2` on the built-in model prints the tokens one device prints."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                      " --xla_force_host_platform_device_count=4").strip())
    base = [sys.executable, "-m", "qjax.cli", "generate", "--ids", "11 12 13 14 15", "--max-new-tokens", "6",
            "--dtype", "float32"]
    procs = [subprocess.Popen(base + extra, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for extra in ([], ["--mesh", "tensor=2,expert=2"], ["--mesh", "tensor=4"])]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs[:2], outs[:2]):
        assert p.returncode == 0, err
    assert outs[0][0].split() == outs[1][0].split() and len(outs[0][0].split()) == 6
    # the built-in model has 4 experts: expert × tensor = 4 works, tensor=4 does too; an error names the dimension
    assert procs[2].returncode == 0, outs[2][1]
    bad = subprocess.run(base + ["--mesh", "tensor=3"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert "error: mesh axis tensor=3 does not divide num_attention_heads = 4" in bad.stderr
