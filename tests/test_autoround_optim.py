"""qjax.autoround.optim: sign-SGD with LinearLR decay, per-module learning rates, alpha/beta clamping.

Torch comparisons use auto-round's own ``SignSGD`` stepped with ``torch.optim.lr_scheduler.LinearLR(1 -> 0)``;
tolerance 1e-7 absolute because torch's LinearLR updates the lr multiplicatively in float64 while optax evaluates
``lr * (1 - t / iters)`` in float32 (a few float32 ulps of lr per step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from qjax.autoround import optim

ar_sgd = pytest.importorskip("auto_round.algorithms.quantization.sign_round.sign_sgd")


def _run(tx: optax.GradientTransformation, params, grads: list):
    """Apply ``tx`` for each gradient tree in ``grads`` (jitted step); returns the final params."""
    state = tx.init(params)

    @jax.jit
    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for g in grads:
        params, state = step(params, state, g)
    return params


def test_total_travel_after_iters_minus_one_steps():
    """auto-round evaluates params after at most T-1 updates: sum_{t<T-1} (1/T)(1 - t/T) = 0.502475 at T = 200."""
    iters = 200
    tx = optim.sign_sgd(optim.default_lr(iters, 4), iters)
    grads = [jnp.full((3,), 0.37, jnp.float32)] * (iters - 1)
    out = _run(tx, jnp.zeros((3,), jnp.float32), grads)
    np.testing.assert_allclose(np.asarray(out), -0.50248, atol=1e-5)
    exact = sum((1 / iters) * (1 - t / iters) for t in range(iters - 1))
    np.testing.assert_allclose(np.asarray(out), -exact, atol=1e-6)


def test_zero_gradient_leaves_params_unchanged():
    rng = np.random.default_rng(0)
    p0 = jnp.asarray(rng.normal(size=(4, 6)).astype(np.float32))
    g = rng.normal(size=(4, 6)).astype(np.float32)
    g[:, :3] = 0.0
    for momentum in (0.0, 0.9):
        out = np.asarray(_run(optim.sign_sgd(0.01, 50, momentum), p0, [jnp.asarray(g)] * 5))
        np.testing.assert_array_equal(out[:, :3], np.asarray(p0)[:, :3])  # sign(0) = 0
        assert np.all(out[:, 3:] != np.asarray(p0)[:, 3:])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sign_sgd_matches_torch_signsgd_linearlr(momentum: float):
    rng = np.random.default_rng(1)
    iters, lr, steps = 8, 0.05, 5
    p0 = rng.normal(size=(7, 5)).astype(np.float32)
    grads = [rng.normal(size=(7, 5)).astype(np.float32) for _ in range(steps)]
    grads[2][0] = 0.0  # a row with no gradient in one step

    out = _run(optim.sign_sgd(lr, iters, momentum), jnp.asarray(p0), [jnp.asarray(g) for g in grads])

    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = ar_sgd.SignSGD([p], lr=lr, momentum=momentum)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=iters)
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        sched.step()
    np.testing.assert_allclose(np.asarray(out), p.detach().numpy(), rtol=0, atol=1e-7)
    assert not np.allclose(np.asarray(out), p0)


def test_default_lr():
    assert optim.default_lr(200, 4) == 1 / 200
    assert optim.default_lr(200, 2) == 1 / 200  # 2/iters only for the long "best" recipe
    assert optim.default_lr(999, 2) == 1 / 999
    assert optim.default_lr(1000, 2) == 2 / 1000
    assert optim.default_lr(1000, 3) == 2 / 1000
    assert optim.default_lr(1000, 4) == 1 / 1000
    with pytest.raises(ValueError):
        optim.default_lr(0, 4)


def _module(rng: np.random.Generator, n: int, g: int, gs: int) -> dict[str, jax.Array]:
    return {
        "v": jnp.asarray(rng.uniform(-0.2, 0.2, (n, g, gs)).astype(np.float32)),
        "alpha": jnp.asarray(rng.uniform(0.8, 1.0, (n, g)).astype(np.float32)),
        "beta": jnp.asarray(rng.uniform(0.8, 1.0, (n, g)).astype(np.float32)),
    }


def test_make_optimizer_per_module_learning_rates():
    """Mixed-bit block: 2-bit experts at 2/iters, the 4-bit attention projection at 1/iters."""
    rng = np.random.default_rng(2)
    iters = 1000
    params = {"self_attn.q_proj": _module(rng, 5, 2, 32), "mlp.experts": _module(rng, 6, 4, 16)}
    lr_v = {"self_attn.q_proj": optim.default_lr(iters, 4), "mlp.experts": optim.default_lr(iters, 2)}
    grads = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), params)

    for lr_minmax in (lr_v, 0.003):
        tx = optim.make_optimizer(params, iters=iters, lr_v=lr_v, lr_minmax=lr_minmax)
        out = _run(tx, params, [grads, grads])
        for module, leaves in params.items():
            for name, x in leaves.items():
                lr = lr_v[module] if name == "v" or isinstance(lr_minmax, dict) else lr_minmax
                travel = lr + lr * (1 - 1 / iters)  # two steps of the linear decay
                want = np.asarray(x) - travel * np.sign(np.asarray(grads[module][name]))
                np.testing.assert_allclose(np.asarray(out[module][name]), want, rtol=0, atol=1e-7)

    with pytest.raises(KeyError, match="mlp.experts"):
        optim.make_optimizer(params, iters=iters, lr_v={"self_attn.q_proj": 0.001}, lr_minmax=0.001)


def test_make_optimizer_matches_torch_param_groups():
    """Same as auto-round's SignSGD with one param group per (module, V | min-max) and a shared LinearLR."""
    rng = np.random.default_rng(3)
    iters, steps = 10, 4
    params = {"a": _module(rng, 3, 2, 8), "b": _module(rng, 2, 1, 8)}
    lr_v, lr_mm = {"a": 0.1, "b": 0.2}, {"a": 0.05, "b": 0.07}
    grads = [
        jax.tree_util.tree_map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), params)
        for _ in range(steps)
    ]
    out = _run(optim.make_optimizer(params, iters=iters, lr_v=lr_v, lr_minmax=lr_mm), params, grads)

    tp = {
        m: {k: torch.nn.Parameter(torch.from_numpy(np.asarray(x).copy())) for k, x in d.items()}
        for m, d in params.items()
    }
    groups = [{"params": [tp[m]["v"]], "lr": lr_v[m]} for m in tp]
    groups += [{"params": [tp[m]["alpha"], tp[m]["beta"]], "lr": lr_mm[m]} for m in tp]
    opt = ar_sgd.SignSGD(groups, lr=0.1)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=iters)
    for g in grads:
        for m in tp:
            for k in tp[m]:
                tp[m][k].grad = torch.from_numpy(np.asarray(g[m][k]).copy())
        opt.step()
        sched.step()
    for m in tp:
        for k in tp[m]:
            np.testing.assert_allclose(np.asarray(out[m][k]), tp[m][k].detach().numpy(), rtol=0, atol=1e-7)


def test_clamp_minmax():
    rng = np.random.default_rng(4)
    mod = {
        "v": jnp.asarray(rng.uniform(-3, 3, (4, 2, 8)).astype(np.float32)),
        "alpha": jnp.asarray(rng.uniform(-1, 3, (4, 2)).astype(np.float32)),
        "beta": jnp.asarray(rng.uniform(-1, 3, (4, 2)).astype(np.float32)),
    }
    out = optim.clamp_minmax({"m": mod})["m"]
    np.testing.assert_array_equal(np.asarray(out["v"]), np.asarray(mod["v"]))  # V is never clamped
    np.testing.assert_array_equal(np.asarray(out["alpha"]), np.clip(np.asarray(mod["alpha"]), 0, 1))
    np.testing.assert_array_equal(np.asarray(out["beta"]), np.clip(np.asarray(mod["beta"]), 0, 1))

    ext = jax.jit(lambda p: optim.clamp_minmax(p, alpha_max=2.0))(mod)  # alg_ext: alpha in [0, 2], flat module
    np.testing.assert_array_equal(np.asarray(ext["alpha"]), np.clip(np.asarray(mod["alpha"]), 0, 2))
    np.testing.assert_array_equal(np.asarray(ext["beta"]), np.clip(np.asarray(mod["beta"]), 0, 1))
    np.testing.assert_array_equal(np.asarray(ext["v"]), np.asarray(mod["v"]))
    assert all(x.dtype == jnp.float32 for x in ext.values())
