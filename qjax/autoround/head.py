"""The LM head under ``qjax quantize --quant_lm_head``: auto-round 0.16.1's rules for a layer outside the blocks.

Whether (``apply_layer_config_special_cases``): ``--quant_lm_head`` gives the head the global scheme, and a
``--layer_config`` pattern that matches ``lm_head`` turns it on by itself, with that entry's fields
(``--ignore_layers lm_head`` keeps it in the model dtype). A head tied to the embedding stays unquantized, with
auto-round's warning. The shape rules of :func:`.schemes.resolve` apply to it as to every layer.

How (``quantize_layer_outside_block``), after the last block: with ``--iters`` > 0 its rounding V and α/β are tuned
by the blocks' sign-SGD on the token-masked MSE between the quantized head on the quantized stream (the final norm
of the last block's quantized output; the float stream under ``--disable_quanted_input``) and the float head on the
float stream — iteration 0 is RTN, the best iteration is kept. auto-round runs it one sample at a time with gradient
accumulation (``batch_size = 1  # Force to low gpu``); here a rematerialised ``lax.scan`` over the minibatch's samples
does the same, so one sample's ``[seqlen, vocab]`` logits are alive at a time (the 35B head's ``[8, 2048, 248320]``
float32 minibatch would be 16 GB). With ``--iters 0`` it is RTN — optimized RTN by the blocks' rule, without an
imatrix (auto-round's hooks collect those inside the blocks only).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from qjax.kernels import matmul_accumulated

from .blocks import Unit
from .optim import clamp_minmax, make_optimizer
from .qdq import qdq_unit
from .schemes import Scheme, layer_scheme, matching_patterns

logger = logging.getLogger("qjax.autoround")

NAME = "lm_head"


class HeadBlock(nnx.Module):
    """The head as a one-unit block: its variables are ``{("lm_head", "weight"): W}``, as :class:`.blocks.Unit`
    paths read them."""

    def __init__(self, lm_head):
        self.lm_head = lm_head


def unit(cfg) -> Unit:
    return Unit(NAME, (NAME, "weight"), None, False, (cfg.vocab_size, cfg.hidden_size))


def wanted(base: Scheme, quant_lm_head: bool, layer_config: dict, tied: bool) -> Scheme | None:
    """The head's scheme by auto-round's rule (above), before the shape rules; None when the run leaves it in the
    model dtype: not asked for, kept float by its entries (``--ignore_layers lm_head``), or tied (with auto-round's
    warning)."""
    patterns = matching_patterns(NAME, layer_config)
    if not (quant_lm_head or patterns):
        return None
    s = base
    for pat in patterns:
        s = layer_scheme(s, layer_config[pat])
    if not s.quantized:
        return None
    if tied:
        logger.warning("reset `quant_lm_head` to false as quantizing lm_head with tied weights has not been "
                       "supported currently (auto-round's rule: tie_word_embeddings)")
        return None
    return s


def head_loss(params, w, consts, x_q, x_f, mask, *, scheme: Scheme, scale_dtype: str):
    """``mean(((x_q @ qdq(W)ᵀ − x_f @ Wᵀ) · mask)²)`` over every logit of the minibatch ``x_q, x_f [B, T, H]``
    (``mask [T, 1]``), float32 — the blocks' loss with the head as the block, one sample at a time; ``params``
    already clamped."""
    wq = qdq_unit(w, params, consts, scheme, jnp.dtype(scale_dtype))[0].astype(w.dtype)

    @jax.checkpoint  # the backward recomputes each sample's logits instead of keeping B of them
    def one(total, xs):
        xq, xf = xs
        d = (matmul_accumulated(xq, wq) - jax.lax.stop_gradient(matmul_accumulated(xf, w))) * mask
        return total + jnp.sum(d * d), None

    total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32), (x_q, x_f))
    return total / (x_q.shape[0] * x_q.shape[1] * w.shape[0])


@functools.lru_cache(maxsize=8)
def tuning_step(scheme: Scheme, scale_dtype: str, alpha_max: float, lrs: tuple[float, float], iters: int):
    """The jitted tuning step of the head: ``(carry, idxs [k, B], w, consts, x_q, x_f, mask) → (carry, losses [k])``,
    carry and bookkeeping as the blocks' step (:func:`qjax.autoround.driver._make_step`: iteration 0 is RTN, the
    best iteration's parameters kept)."""
    opt = make_optimizer({NAME: {"v": 0, "alpha": 0, "beta": 0}}, iters=iters, lr_v=lrs[0], lr_minmax=lrs[1])
    loss_fn = functools.partial(head_loss, scheme=scheme, scale_dtype=scale_dtype)

    def one(carry, idx, w, consts, x_q, x_f, mask):
        params, opt_state, best, best_params, it, best_it = carry
        params = {NAME: clamp_minmax(params[NAME], alpha_max)}
        val, g = jax.value_and_grad(lambda p: loss_fn(p[NAME], w, consts, x_q[idx], x_f[idx], mask))(params)
        better = val < best
        best_params = jax.tree.map(lambda a, b: jnp.where(better, a, b), params, best_params)
        best_it = jnp.where(better, it, best_it)
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state, jnp.minimum(val, best), best_params, it + 1, best_it), val

    @jax.jit
    def step(carry, idxs, w, consts, x_q, x_f, mask):
        return jax.lax.scan(lambda c, ix: one(c, ix, w, consts, x_q, x_f, mask), carry, idxs)

    return opt, step

