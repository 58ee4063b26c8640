"""Next-token training of :class:`qjax.model.qwen3_5_moe.Qwen3_5MoeForCausalLM` with optax, and held-out perplexity.

    model = qjax.init_model(cfg, seed=0)
    tc = TrainConfig(steps=1000, batch=16, seqlen=256)
    model, log = train(model, batches(train_ids, tc.batch, tc.seqlen, seed=0), tc)
    ppl = perplexity(model, heldout_ids, seqlen=256, batch=8)

What the loop does:
- AdamW (decoupled weight decay on matrices only) with linear warmup then cosine decay, global-norm gradient clipping;
- loss = mean next-token cross-entropy + ``aux_loss_coef`` · the MoE load-balancing loss (Switch / Qwen-MoE style:
  ``E · Σ_e f_e · P_e`` per layer, averaged over layers, with ``f_e`` the fraction of top-k slots routed to expert e
  and ``P_e`` the mean router probability), so the router spreads tokens over the experts;
- one jitted step over the model's :class:`nnx.State` (``nnx.split`` / ``nnx.merge``); deterministic given the seeds of
  :func:`qjax.init_model` and :func:`batches` (up to floating-point reassociation across machines).

The training forward (:func:`forward_train`) is the model's own forward — same modules, same layer-group scan — that
also returns the router logits' balancing loss; a test checks its logits equal :meth:`Qwen3_5MoeForCausalLM.forward`'s.

The MTP head (``model.mtp``, the speculative drafter) trains on its own over a frozen body:

    model = add_mtp_head(qjax.load_model(path, dtype="float32"))
    model, log = train_mtp(model, batches(train_ids, tc.batch, tc.seqlen + 1, seed=0), tc)
    stats = mtp_accuracy(model, heldout_ids, seqlen=256)  # top-1 vs token t+2, agreement with the main model

Only ``mtp.*`` parameters get gradients and optimiser state; the body's hidden states come from its inference forward
under ``stop_gradient``; the tied embedding / lm_head, shared with the body, stays frozen too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from qjax.evaluation import evaluate
from qjax.model.config import LINEAR
from qjax.model.moe import route
from qjax.model.qwen3_5_moe import MTP, Qwen3_5MoeForCausalLM

HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch: int = 16
    seqlen: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr · min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    aux_loss_coef: float = 0.01
    seed: int = 0  # recorded with the run; callers pass it to init_model and batches


# ---------------------------------------------------------------------------------------------------------------------
# forward with the router loss
# ---------------------------------------------------------------------------------------------------------------------
def load_balancing_loss(router_logits: jnp.ndarray, idx: jnp.ndarray, num_experts: int) -> jnp.ndarray:
    """``E · Σ_e f_e · P_e`` for one layer (1.0 when perfectly balanced).

    Args:
      router_logits: ``[N, E]``; idx: ``[N, k]`` the selected experts.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    frac = jnp.mean(jax.nn.one_hot(idx, num_experts, dtype=jnp.float32), axis=(0, 1))  # [E], sums to 1
    return num_experts * jnp.sum(frac * jnp.mean(probs, axis=0))


def _moe_with_aux(moe, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """:class:`qjax.model.moe.SparseMoeBlock` ``__call__`` that also returns its load-balancing loss."""
    b, t, h = x.shape
    xf = x.reshape(b * t, h)
    logits = moe.gate(xf)
    weights, idx = route(logits, moe.top_k)
    routed = moe.experts(xf, idx, weights)
    shared = jax.nn.sigmoid(moe.shared_expert_gate(xf)) * moe.shared_expert(xf)
    aux = load_balancing_loss(logits, idx, logits.shape[-1])
    return (routed.astype(x.dtype) + shared).reshape(b, t, h), aux


def _layer_with_aux(layer, h, ctx):
    x = layer.input_layernorm(h)
    mixer = layer.linear_attn if layer.layer_type == LINEAR else layer.self_attn
    out = mixer(x, ctx, None)[0]
    h = h + out
    out, aux = _moe_with_aux(layer.mlp, layer.post_attention_layernorm(h))
    return h + out, aux


def forward_train(model: Qwen3_5MoeForCausalLM, input_ids: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Traceable forward without cache or padding: ``input_ids [B, T]`` → (logits ``[B, T, V]`` fp32, mean
    load-balancing loss over the layers)."""
    ctx, _ = model.step_context(input_ids, None, None, None)
    h = model.embed(input_ids)
    graphdef, state = nnx.split(model.groups)

    def body(h, group_state):
        group = nnx.merge(graphdef, group_state)
        auxes = []
        for layer in group.layers:
            h, aux = _layer_with_aux(layer, h, ctx)
            auxes.append(aux)
        return h, jnp.stack(auxes)

    h, aux = jax.lax.scan(body, h, state)
    logits = model.logits_from_hidden(model.norm(h))
    return logits, jnp.mean(aux)


def cross_entropy(logits: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """Mean next-token NLL (nats) of ``targets [B, T]`` under ``logits [B, T, V]``."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# ---------------------------------------------------------------------------------------------------------------------
# optimiser and step
# ---------------------------------------------------------------------------------------------------------------------
def learning_rate(step: int, total_steps: int, tc: TrainConfig) -> float:
    """Linear warmup over ``tc.warmup_steps`` to ``tc.lr``, then cosine decay to ``tc.lr · tc.min_lr_ratio`` at
    ``total_steps`` (``step`` counts from 0)."""
    warmup = max(1, min(tc.warmup_steps, total_steps - 1))
    if step < warmup:
        return tc.lr * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    floor = tc.lr * tc.min_lr_ratio
    return floor + (tc.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """Clip → Adam moments → decoupled weight decay on matrices (ndim ≥ 2: linears, experts, embeddings, conv; not
    norms, ``A_log``, ``dt_bias``). The learning rate multiplies the result in the step (AdamW), so it can follow a
    schedule whose length is only known after timing the first steps, without recompiling."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.scale_by_adam(b1=tc.b1, b2=tc.b2),
        optax.add_decayed_weights(tc.weight_decay, mask=decay_mask),
    )


def make_train_step(graphdef, optimizer: optax.GradientTransformation, loss: Callable) -> Callable:
    """``step(params, rest, opt_state, tokens [B, T+1], lr) → (params, opt_state, metrics)``, jitted with params
    and optimiser state donated. ``loss(model, tokens) → (scalar, {name: scalar})`` (:func:`next_token_loss`,
    :func:`mtp_loss`); ``params`` are the variables it differentiates, ``rest`` everything else of the model."""

    def loss_fn(params, rest, tokens):
        return loss(nnx.merge(graphdef, params, rest), tokens)

    @functools.partial(jax.jit, donate_argnums=(0, 2))
    def step(params, rest, opt_state, tokens, lr):
        (value, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
        return params, opt_state, {"loss": value, **metrics, "grad_norm": optax.tree.norm(grads)}

    return step


def next_token_loss(model: Qwen3_5MoeForCausalLM, tokens: jnp.ndarray, aux_loss_coef: float):
    """``tokens [B, T+1]`` → (CE of tokens 1..T + ``aux_loss_coef`` · balancing loss, {"ce", "aux"})."""
    logits, aux = forward_train(model, tokens[:, :-1])
    ce = cross_entropy(logits, tokens[:, 1:])
    return ce + aux_loss_coef * aux, {"ce": ce, "aux": aux}


def batches(ids: np.ndarray, batch: int, seqlen: int, *, seed: int = 0) -> Iterator[np.ndarray]:
    """Endless ``[batch, seqlen + 1]`` int32 windows at uniformly random offsets of ``ids`` (deterministic)."""
    ids = np.asarray(ids, np.int32)
    if ids.size < seqlen + 2:
        raise ValueError(f"need more than {seqlen + 1} tokens to cut windows, got {ids.size}")
    rng = np.random.default_rng(seed)
    span = ids.size - seqlen - 1
    while True:
        starts = rng.integers(0, span + 1, size=batch)
        yield np.stack([ids[s:s + seqlen + 1] for s in starts])


def train(model: Qwen3_5MoeForCausalLM, data: Iterator[np.ndarray], tc: TrainConfig, *,
          time_budget_s: float | None = None, probe_steps: int = 10, log_every: int = 50,
          callback: Callable[[int, dict], None] | None = None) -> tuple[Qwen3_5MoeForCausalLM, list[dict]]:
    """Train ``model`` in place and return it with the log (one dict per ``log_every`` steps, and the last).

    Runs ``tc.steps`` steps, or fewer when ``time_budget_s`` is given: after the first (compiling) step and
    ``probe_steps`` more, the step time is measured and the run is shortened to what fits the budget (counted from
    the start of the call). The cosine schedule then spans the shortened run, which is fixed before warmup ends when
    ``probe_steps < tc.warmup_steps`` (so the run equals a plain run of that many steps).
    """
    loss = functools.partial(next_token_loss, aux_loss_coef=tc.aux_loss_coef)
    return _fit(model, nnx.Param, loss, data, tc, time_budget_s=time_budget_s, probe_steps=probe_steps,
                log_every=log_every, callback=callback)


def _fit(model, trainable, loss: Callable, data: Iterator[np.ndarray], tc: TrainConfig, *,
         time_budget_s: float | None, probe_steps: int, log_every: int,
         callback: Callable[[int, dict], None] | None) -> tuple[Qwen3_5MoeForCausalLM, list[dict]]:
    """The loop behind :func:`train` and :func:`train_mtp` (its docstring): AdamW on the variables matching the nnx
    filter ``trainable``; every other variable is passed to the step unchanged and never written."""
    optimizer = make_optimizer(tc)
    graphdef, params, rest = nnx.split(model, trainable, ...)
    opt_state = optimizer.init(params)
    step_fn = make_train_step(graphdef, optimizer, loss)
    log: list[dict] = []
    acc: dict[str, float] = {}
    n_acc = 0
    total = tc.steps
    t_start = time.perf_counter()
    t_compiled = None
    i = 0
    while i < total:
        tokens = jnp.asarray(next(data), jnp.int32)
        lr = learning_rate(i, total, tc)
        params, opt_state, m = step_fn(params, rest, opt_state, tokens, jnp.float32(lr))
        m = {k: float(v) for k, v in m.items()}
        if not math.isfinite(m["loss"]):
            raise FloatingPointError(f"step {i}: loss is {m['loss']}")
        for k, v in m.items():
            acc[k] = acc.get(k, 0.0) + v
        n_acc += 1
        i += 1
        now = time.perf_counter()
        if i == 1:
            t_compiled = now
        if time_budget_s is not None and i == 1 + probe_steps and total > i:
            per_step = (now - t_compiled) / probe_steps
            fits = i + int((time_budget_s - (now - t_start)) / per_step)
            if fits < total:
                total = max(i, fits)
                if callback is not None:
                    callback(i, {"event": "shortened", "steps": total, "step_s": round(per_step, 3)})
        if i % log_every == 0 or i == total:
            entry = {"step": i, **{k: v / n_acc for k, v in acc.items()}, "lr": lr,
                     "elapsed_s": round(now - t_start, 1)}
            log.append(entry)
            if callback is not None:
                callback(i, entry)
            acc, n_acc = {}, 0
    nnx.update(model, params)
    return model, log


# ---------------------------------------------------------------------------------------------------------------------
# the MTP head
# ---------------------------------------------------------------------------------------------------------------------
# the head's trainable variables: every nnx.Param under ``model.mtp`` (the tied embedding it reads is the body's)
MTP_PARAMS = nnx.All(nnx.Param, nnx.PathContains("mtp"))
MTP_INITS = ("random", "identity", "copy")


def add_mtp_head(model: Qwen3_5MoeForCausalLM, *, init: str = "random", seed: int = 0) -> Qwen3_5MoeForCausalLM:
    """Give ``model`` (in place) a fresh one-layer MTP head, in the model's dtype, and return it.

    ``init``:
      - ``"random"``: the head's own init (normal(initializer_range) matrices, zero norm offsets);
      - ``"identity"``: as random, but ``fc``'s hidden half is the identity, so the head starts by passing
        ``pre_fc_norm_hidden(h_t)`` — a normalised copy of the residual stream the frozen lm_head reads — through a
        near-zero residual layer: its first logits are the main model's own (for t+1) instead of noise;
      - ``"copy"``: as identity, plus the decoder layer and ``mtp.norm`` copied from the body's last full-attention
        layer and final norm (trained attention + MoE weights that already read that residual stream).

    Random is the default because it trained best on the built-in model (benchmarks/train_mtp_head.py, held-out
    agreement with the main model's greedy token after 60 steps: random 0.519, identity 0.483, copy 0.492; after
    200: random 0.617, identity 0.605; the loss agreed) — presumably because the identity start predicts token t+1,
    which the head then has to unlearn.
    """
    if init not in MTP_INITS:
        raise ValueError(f"init must be one of {MTP_INITS}, got {init!r}")
    cfg = model.config
    # nnx.data: a model built without a head holds ``mtp = None`` as a static attribute
    model.mtp = nnx.data(MTP(cfg, dtype=model.dtype, rngs=nnx.Rngs(seed)))
    if init in ("identity", "copy"):
        h = cfg.hidden_size
        w = model.mtp.fc.weight  # [H, 2H]: columns [embedding | hidden] (MTP.__call__'s concatenation order)
        w[...] = w[...].at[:, h:].set(jnp.eye(h, dtype=w[...].dtype))
    if init == "copy":
        last = max(i for i, kind in enumerate(model.layer_kinds) if kind != LINEAR)  # position in the layer group
        # copies, not views: the trainer donates the head's buffers, which must not be the body's
        body = jax.tree.map(lambda x: jnp.copy(x[-1]), nnx.state(model.groups.layers[last]))  # last group: the top
        nnx.update(model.mtp.layers[0], body)
        nnx.update(model.mtp.norm, jax.tree.map(jnp.copy, nnx.state(model.norm)))
    return model


def mtp_forward_train(model: Qwen3_5MoeForCausalLM, next_ids: jnp.ndarray,
                      hidden: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Traceable MTP head without cache, with its MoE balancing loss: (logits of token t+2 ``[B, T, V]`` fp32, mean
    balancing loss over the head's layers).

    Args:
      next_ids: ``[B, T]`` the token at t+1 (position t+1); hidden: ``[B, T, H]`` the body's post-final-norm hidden
        at t. :meth:`Qwen3_5MoeForCausalLM.mtp_logits` computes the same logits (a test checks it); this copy of
        ``MTP.__call__`` exists to return the router loss, as :func:`forward_train` does for the body.
    """
    b, t = next_ids.shape
    positions = jnp.broadcast_to(jnp.arange(1, t + 1, dtype=jnp.int32), (b, t))
    ctx, _ = model.step_context(next_ids, None, positions, None)
    head = model.mtp
    y = head.fc(jnp.concatenate([head.pre_fc_norm_embedding(model.embed(next_ids)), head.pre_fc_norm_hidden(hidden)],
                                axis=-1))
    auxes = []
    for layer in head.layers:
        y, aux = _layer_with_aux(layer, y, ctx)
        auxes.append(aux)
    return model.logits_from_hidden(head.norm(y)), jnp.mean(jnp.stack(auxes))


def mtp_loss(model: Qwen3_5MoeForCausalLM, tokens: jnp.ndarray, aux_loss_coef: float):
    """``tokens [B, T+2]`` → (mean CE of the head's prediction of tokens 2..T+1 + ``aux_loss_coef`` · the head's
    balancing loss, {"ce", "aux"}). The body runs on tokens 0..T-1 (the hidden h_t of each predicting position)."""
    hidden = jax.lax.stop_gradient(model.forward(tokens[:, :-2], last_only=True).hidden)  # frozen: no backward
    logits, aux = mtp_forward_train(model, tokens[:, 1:-1], hidden)
    ce = cross_entropy(logits, tokens[:, 2:])
    return ce + aux_loss_coef * aux, {"ce": ce, "aux": aux}


def train_mtp(model: Qwen3_5MoeForCausalLM, data: Iterator[np.ndarray], tc: TrainConfig, *,
              time_budget_s: float | None = None, probe_steps: int = 10, log_every: int = 50,
              callback: Callable[[int, dict], None] | None = None) -> tuple[Qwen3_5MoeForCausalLM, list[dict]]:
    """Train ``model.mtp`` in place (the body, embedding and lm_head frozen, bit for bit) with :func:`mtp_loss` on
    ``data`` windows ``[B, T+2]`` (``batches(ids, B, T + 1)``: the body sees T tokens, the head predicts T); the rest
    as :func:`train` (time budget, schedule, log)."""
    if model.mtp is None:
        raise ValueError("the model has no MTP head: add_mtp_head(model) first")
    loss = functools.partial(mtp_loss, aux_loss_coef=tc.aux_loss_coef)
    return _fit(model, MTP_PARAMS, loss, data, tc, time_budget_s=time_budget_s, probe_steps=probe_steps,
                log_every=log_every, callback=callback)


# ---------------------------------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------------------------------
# held-out perplexity is qjax.evaluation.evaluate's (also behind ``qjax eval ppl``), so training logs and the CLI agree
mean_nll = evaluate.mean_nll
perplexity = evaluate.perplexity


@functools.partial(jax.jit, static_argnums=0)
def _mtp_window_stats(graphdef, state, tokens):
    """``tokens [B, T+2]`` → per window (NLL sum of tokens 2..T+1 under the head, head top-1 hits, agreement with the
    main model's greedy token at the same position, the main model's own top-1 hits) ``[B]`` each, and the main
    model's greedy tokens ``[B, T]``."""
    model = nnx.merge(graphdef, state)
    out = model.forward(tokens[:, :-1])  # logits [B, T+1, V]: row t+1 is the main model's guess for token t+2
    head = model.mtp_logits(tokens[:, :-1], out.hidden)  # [B, T, V]: row t predicts token t+2
    target = tokens[:, 2:]
    logp = jax.nn.log_softmax(head.astype(jnp.float32), axis=-1)
    nll = -jnp.sum(jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0], axis=1)
    draft, greedy = jnp.argmax(head, axis=-1), jnp.argmax(out.logits[:, 1:], axis=-1)
    hits = lambda a, b: jnp.sum(a == b, axis=1)
    return (nll, hits(draft, target), hits(draft, greedy), hits(greedy, target)), greedy


def mtp_accuracy(model: Qwen3_5MoeForCausalLM, ids, seqlen: int = 256, batch: int = 8) -> dict[str, float]:
    """Held-out quality of the MTP head on ``ids [N]`` in non-overlapping windows of ``seqlen + 2`` tokens (stride
    ``seqlen``; each window scores its last ``seqlen`` tokens, so every token after the first two is scored once).

    Returns:
      ``loss`` (mean NLL of token t+2, nats); ``top1``: how often the head's argmax is token t+2; ``agree``: how
      often it equals the main model's greedy token at t+2 (given the true token at t+1) — a greedy draft's
      acceptance rate; ``main_top1``: the main model's accuracy on the same targets (from every token up to t+1,
      through the whole body: the reference for ``top1``); ``agree_mode``: the agreement of always drafting the
      main model's most frequent greedy token (the chance level); ``tokens``: how many were scored.
    """
    ids = np.asarray(ids, np.int32).reshape(-1)
    n_win = (ids.size - 2) // seqlen
    if n_win < 1:
        raise ValueError(f"need at least {seqlen + 2} tokens, got {ids.size}")
    wins = np.stack([ids[i * seqlen:i * seqlen + seqlen + 2] for i in range(n_win)])
    graphdef, state = nnx.split(model)
    sums = np.zeros(4, np.float64)
    greedy = []
    for s in range(0, n_win, batch):
        chunk = wins[s:s + batch]
        n = chunk.shape[0]
        if n < batch:  # one compiled shape: pad with repeats of the first window, not counted
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch - n, axis=0)])
        stats, g = _mtp_window_stats(graphdef, state, jnp.asarray(chunk))
        sums += [float(np.sum(np.asarray(x, np.float64)[:n])) for x in stats]
        greedy.append(np.asarray(g)[:n].reshape(-1))
    n_tok = n_win * seqlen
    mode = np.bincount(np.concatenate(greedy)).max()
    return {"loss": sums[0] / n_tok, "top1": sums[1] / n_tok, "agree": sums[2] / n_tok, "main_top1": sums[3] / n_tok,
            "agree_mode": float(mode) / n_tok, "tokens": n_tok}


def unigram_nll(train_ids, eval_ids, vocab_size: int) -> float:
    """Mean NLL (nats) of ``eval_ids`` under the add-one-smoothed unigram distribution of ``train_ids`` (the
    baseline a model must beat by a wide margin)."""
    counts = np.bincount(np.asarray(train_ids).reshape(-1), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-np.mean(logp[np.asarray(eval_ids).reshape(-1)]))


def count_params(model) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
