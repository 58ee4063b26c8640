"""auto-round's SignSGD with its LinearLR(1 -> 0) schedule, as Optax transformations (docs/autoround.md §4).

The update at 0-based step t is ``-lr * (1 - t / iters) * sign(g)`` (``sign(0) = 0``: a parameter whose gradient
is exactly zero does not move). V and (alpha, beta) have separate learning rates, and each module may have its own
(mixed-bit blocks give 2-bit layers ``2 / iters`` under the "best" recipe), hence :func:`make_optimizer`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def sign_sgd(lr: float, iters: int, momentum: float = 0.0) -> optax.GradientTransformation:
    """auto-round ``SignSGD`` stepped with ``LinearLR(start_factor=1, end_factor=0, total_iters=iters)``.

    With ``momentum > 0`` the sign is taken of the buffer ``b = momentum * b + g`` (first step ``b = g``), as in
    auto-round's torch.optim.SGD copy with dampening 0. One difference: auto-round skips a parameter whose
    gradient is None (its buffer is left alone), whereas here a zero gradient still decays the buffer.
    """
    if iters <= 0:
        raise ValueError(f"sign_sgd needs iters > 0, got {iters}")
    schedule = optax.linear_schedule(init_value=lr, end_value=0.0, transition_steps=iters)
    parts = [optax.trace(decay=momentum, nesterov=False)] if momentum else []
    return optax.chain(*parts, optax.scale_by_sign(), optax.scale_by_learning_rate(schedule))


def default_lr(iters: int, bits: int) -> float:
    """auto-round's automatic lr (``SignRoundConfig._lr_for_bits``): ``1/iters``; ``2/iters`` if ``iters >= 1000``
    and ``bits <= 3``. Used for V and, unless set separately, for alpha/beta."""
    if iters <= 0:
        raise ValueError(f"default_lr needs iters > 0, got {iters}")
    return 2.0 / iters if iters >= 1000 and bits <= 3 else 1.0 / iters


def _lr_of(lr: dict[str, float] | float, module: str) -> float:
    """The learning rate of ``module`` from one float or a per-module dict (KeyError names the module)."""
    if isinstance(lr, dict):
        if module not in lr:
            raise KeyError(f"no learning rate given for module {module!r}")
        return float(lr[module])
    return float(lr)


def make_optimizer(
    params: dict[str, dict[str, jax.Array]],
    *,
    iters: int,
    lr_v: dict[str, float] | float,
    lr_minmax: dict[str, float] | float,
) -> optax.GradientTransformation:
    """Sign-SGD over ``{module: {"v", "alpha", "beta"}}`` with per-module learning rates.

    ``v`` uses ``lr_v``, every other leaf of a module (``alpha``, ``beta``) ``lr_minmax``; each is one float or a
    ``{module: float}`` dict. Leaves sharing a learning rate share one :func:`sign_sgd` (``optax.multi_transform``
    keyed by the distinct rates), so a block with hundreds of experts builds only a few transformations. The
    returned transformation must be initialised with a tree of the same structure as ``params``.
    """
    rates: dict[float, str] = {}

    def label(lr: float) -> str:
        return rates.setdefault(lr, f"lr{len(rates)}")

    labels = {
        module: {name: label(_lr_of(lr_v if name == "v" else lr_minmax, module)) for name in leaves}
        for module, leaves in params.items()
    }
    transforms = {tag: sign_sgd(lr, iters) for lr, tag in rates.items()}
    return optax.multi_transform(transforms, labels)


def clamp_minmax(params: dict, alpha_max: float = 1.0) -> dict:
    """Clamp every ``alpha`` to ``[0, alpha_max]`` and every ``beta`` to ``[0, 1]``; ``v`` is never clamped.

    auto-round clamps ``max_scale`` / ``min_scale`` in place before every quantize-dequantize
    (``minmax_scale_bound``: (0, 1), or (0, 2) for alpha under alg_ext). Works on ``{module: {...}}`` or on one
    module's ``{"v", "alpha", "beta"}``.
    """

    def clamp(path, x):
        name = path[-1].key if path and isinstance(path[-1], jax.tree_util.DictKey) else None
        if name == "alpha":
            return jnp.clip(x, 0.0, alpha_max)
        if name == "beta":
            return jnp.clip(x, 0.0, 1.0)
        return x

    return jax.tree_util.tree_map_with_path(clamp, params)
