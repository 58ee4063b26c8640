"""Runs under 8 emulated CPU devices (its own process: the device count is fixed when JAX starts) and writes a JSON
report for tests/test_sharding.py: single-device vs mesh logits and greedy tokens, per-device parameter bytes, and
the errors a bad batch or mesh gives.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_probe.py CHECKPOINT OUT.json WORKDIR

CHECKPOINT is a key of CHECKPOINTS; the test runs one process per checkpoint, side by side (compiling dominates).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from qjax import xla_env  # noqa: E402

xla_env.apply(single_threaded=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from oracles.hf import tiny_text_config  # noqa: E402
from qjax.convert.hf_writer import save_pretrained  # noqa: E402
from qjax.convert.planner import plan_folder, recipe_to_qconfig  # noqa: E402

import qjax  # noqa: E402
from qjax.autoround.rtn import quantize_model  # noqa: E402
from qjax.model.config import TextConfig  # noqa: E402
from qjax.model.qwen3_5_moe import init_model  # noqa: E402
from qjax.model.sharding import MeshError, device_bytes, per_device_bytes, split_ways, state_shardings  # noqa: E402

MESHES = {"1x8x1": {"data": 1, "tensor": 8, "expert": 1},
          "1x2x4": {"data": 1, "tensor": 2, "expert": 4},
          "2x1x4": {"data": 2, "tensor": 1, "expert": 4}}
# one quantized checkpoint mixing the formats (asymmetric INT2 experts, MXFP8 attention, INT4 elsewhere, INT8
# lm_head). int4 g16 on the GDN out_proj (input 64) and the shared down_proj (input 32) cannot split 8 ways by whole
# groups: those two stay replicated on the 1x8x1 mesh
CHECKPOINTS = {"bf16": None,
               "quantized": "experts=int2:g32:asym,attn=mxfp8,rest=int4:g16,lm_head=int8:g32"}


def probe_config() -> dict:
    """Two layers (GDN + full attention), every split dimension divisible by 8: 8 query heads (2 KV heads: they are
    replicated when tensor > 2), 8 GDN value heads, 8 experts (top-2)."""
    return tiny_text_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                            num_attention_heads=8, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                            linear_num_value_heads=8, linear_value_head_dim=8, num_experts=8)


def main(name: str, out_path: str, work: str) -> None:
    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    cfg = TextConfig.from_dict(probe_config())
    dense = init_model(cfg, dtype=jnp.float32, seed=0)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (2, 9))
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    report: dict = {"checkpoints": {}, "errors": {}}
    for name, recipe in [(name, CHECKPOINTS[name])]:
        model = dense if recipe is None else quantize_model(dense, recipe_to_qconfig(recipe))
        folder = save_pretrained(model, os.path.join(work, name), dtype=jnp.bfloat16)
        one = qjax.load_model(folder, dtype=jnp.float32)
        base = np.asarray(one(ids, mask))
        tokens = qjax.generate(one, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[])
        single_bytes = sum(device_bytes(one).values())
        entry = report["checkpoints"][name] = {"single_bytes": single_bytes, "meshes": {}}
        for mesh_name, mesh in MESHES.items():
            m, sent = _load_counting_transfers(folder, mesh)
            out = np.asarray(m(ids, mask))
            got = qjax.generate(m, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[])
            diff = np.abs(out - base)
            per_device = device_bytes(m)
            expected, replicated, split_names = _expected_bytes(m)
            entry["meshes"][mesh_name] = {
                "max_abs": float(diff.max()),
                "max_abs_logit": float(np.abs(base).max()),
                "worst_over_tol": float((diff / (1e-5 + 1e-5 * np.abs(base))).max()),
                "tokens_equal": bool(np.array_equal(tokens, got)),
                "new_tokens": got[:, ids.shape[1]:].tolist(),
                "devices": len(per_device),
                "device_bytes": sorted(per_device.values()),
                "bytes_sent": sorted(sent.values()),
                "expected_device_bytes": expected,
                "replicated_bytes": replicated,
                "split": split_names,
                "planned_device_bytes": plan_folder(folder, dtype=jnp.float32, mesh=mesh).mesh_device_bytes,
                "cache_shards": _cache_shards(m),
            }
    if name == "quantized":
        report["pallas"] = _pallas_under_mesh()
    else:
        report["random_model"] = _random_model_on_mesh(cfg, ids)
    # bad batch: the data axis must divide it
    m = qjax.load_model(folder, dtype=jnp.float32, mesh=MESHES["2x1x4"])
    try:
        qjax.generate(m, ids[:1], max_new_tokens=2)
        report["errors"]["odd_batch"] = None
    except MeshError as e:
        report["errors"]["odd_batch"] = str(e)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


def _random_model_on_mesh(cfg, ids) -> dict:
    """qjax.runtime.random_model made directly in its shards equals the one-device model (same seed)."""
    from qjax.runtime.random_model import random_model

    recipe = "experts=int2:g32,rest=int4:g16"
    one = np.asarray(random_model(cfg, recipe, dtype=jnp.float32, seed=1)(ids))
    m = random_model(cfg, recipe, dtype=jnp.float32, seed=1, mesh=MESHES["1x2x4"])
    got = np.asarray(m(ids))
    expected, _, _ = _expected_bytes(m)
    return {"worst_over_tol": float((np.abs(got - one) / (1e-5 + 1e-5 * np.abs(one))).max()),
            "device_bytes": sorted(device_bytes(m).values()), "expected_device_bytes": expected}


def _load_counting_transfers(folder: str, mesh: dict):
    """load_model on ``mesh``, counting the bytes each device receives from the host while loading."""
    import qjax.checkpoint.loading as loading

    sent: dict = {}
    real = jax.device_put

    def counting(x, device=None, *args, **kwargs):
        if device is not None and hasattr(x, "nbytes"):
            sent[device] = sent.get(device, 0) + int(x.nbytes)
        return real(x, device, *args, **kwargs)

    loading.jax.device_put = counting
    try:
        model = qjax.load_model(folder, dtype=jnp.float32, mesh=mesh)
    finally:
        loading.jax.device_put = real
    return model, sent


def _pallas_under_mesh() -> dict:
    """The Pallas kernels (interpret mode) inside the tensor- and expert-parallel shard_maps vs the reference on one
    device: what a GPU mesh runs."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from qjax.kernels import QuantMeta, qmatmul

    from qjax.model.moe import Experts
    from qjax.model.sharding import expert_parallel, plan_mesh, tensor_parallel_qmatmul

    rng = np.random.default_rng(1)
    plan = plan_mesh({"tensor": 2, "expert": 4}, TextConfig.from_dict(probe_config()))
    out = {}
    meta = QuantMeta(fmt="int", bits=4, group_size=32, in_features=128, out_features=96, symmetric=False,
                     scale_dtype="bfloat16")
    packed = jnp.asarray(rng.integers(-2**31, 2**31, (96, 16), dtype=np.int64).astype(np.int32))
    scale = jnp.asarray(rng.uniform(0.01, 0.02, (96, 4)), jnp.bfloat16)
    zero = jnp.asarray(rng.integers(-8, 8, (96, 4)), jnp.int8)
    x = jnp.asarray(rng.standard_normal((2, 5, 128)), jnp.float32)
    want = np.asarray(qmatmul(x, packed, scale, zero, meta, impl="reference"))
    os.environ["QJAX_KERNELS"] = "interpret"
    try:
        for split, spec in (("col", P("tensor", None)), ("row", P(None, "tensor"))):
            put = lambda a: jax.device_put(a, NamedSharding(plan.mesh, spec))  # noqa: E731
            got = jax.jit(lambda x, p, s, z: tensor_parallel_qmatmul(x, (p, s, z), meta, split, plan))(
                x, put(packed), put(scale), put(zero))
            out[f"qmatmul_{split}"] = float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())
        gm = QuantMeta(fmt="int", bits=2, group_size=32, in_features=64, out_features=64, scale_dtype="float16")
        dm = QuantMeta(fmt="int", bits=2, group_size=32, in_features=32, out_features=64, scale_dtype="float16")
        experts = Experts(8, 64, 32, dtype=jnp.float32, std=0.02, rngs=None, gate_up=gm, down=dm)
        for w, m in ((experts.gate_up_proj, gm), (experts.down_proj, dm)):
            w.weight_packed.set_value(jnp.asarray(rng.integers(-2**31, 2**31, (8, m.out_features, m.packed_cols),
                                                               dtype=np.int64).astype(np.int32)))
            w.weight_scale.set_value(jnp.asarray(rng.uniform(0.02, 0.04, (8, *m.scale_shape)), jnp.float16))
        xs = jnp.asarray(rng.standard_normal((12, 64)), jnp.float32)
        idx = jnp.asarray(np.argsort(rng.standard_normal((12, 8)), axis=1)[:, :2].astype(np.int32))
        wts = jnp.asarray(rng.uniform(0.2, 0.8, (12, 2)), jnp.float32)
        os.environ["QJAX_KERNELS"] = "reference"
        ref = np.asarray(experts(xs, idx, wts))
        os.environ["QJAX_KERNELS"] = "interpret"
        from flax import nnx

        gd, st = nnx.split(experts)
        flat = nnx.to_flat_state(st)
        ep_spec = NamedSharding(plan.mesh, P(("expert", "tensor")))
        for _, v in flat:
            v.set_value(jax.device_put(v.get_value(), ep_spec))
        sharded = nnx.merge(gd, nnx.from_flat_state(flat))
        got = jax.jit(lambda a, b, c: expert_parallel(sharded, a, b, c, plan))(xs, idx, wts)
        out["moe_expert_parallel"] = float(np.abs(np.asarray(got) - ref).max() / np.abs(ref).max())
    finally:
        os.environ.pop("QJAX_KERNELS", None)
    return out


def _expected_bytes(model) -> tuple[int, int, list[str]]:
    """Bytes one device should hold if every variable is cut into exactly as many parts as its spec names."""
    plan = model.mesh_plan
    held, replicated = per_device_bytes(model, plan)
    split = [".".join(map(str, p)) for p, s in state_shardings(model, plan).items() if split_ways(s.spec, plan) > 1]
    return held, replicated, split


def _cache_shards(model) -> dict:
    cache = model.init_cache(2, 16)
    leaves = jax.tree_util.tree_leaves(cache)
    return {"leaves": len(leaves),
            "per_device_fraction": [float(x.addressable_shards[0].data.size / x.size) for x in leaves if x.size]}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
