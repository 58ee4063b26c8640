"""The serving engine's device side (:mod:`qjax.serving.engine` has the scheduler and the design): the slot pool
(:class:`Pool`, every per-slot array on the device) and the jitted programs that read and write it (:class:`Programs`:
prefill, decode, verify, the row swap), each closed over the model's graph and compiled for a few bucketed shapes."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from qjax.kernels import resolve as kernel_impl
from qjax.model.cache import Cache, gather_rows, scatter_rows
from qjax.program_cache import ProgramCache
from qjax.runtime.sampling import SamplingArrays, sample, split_keys, token_logprobs
from qjax.runtime.speculative import accept, propose
from qjax.runtime.xla_options import decode_compiler_options


@struct.dataclass
class Pool:
    """Everything the device keeps per slot."""

    cache: Cache
    tokens: jnp.ndarray  # [B] int32: the row's last token (the next decode input)
    keys: jnp.ndarray  # [B, 2] uint32: the row's PRNG key data (split once per drawn token, or per verify round)
    sampling: SamplingArrays  # [B]
    mtp_cache: Cache | None = None  # with speculation: the MTP head's K/V, slots aligned with ``cache``'s
    drafts: jnp.ndarray | None = None  # with speculation: [B, k] int32, the row's drafts for its next verify round

    def prefix(self, n: int) -> "Pool":
        """The first ``n`` rows (a copy the decode steps run on as a whole batch)."""
        return Pool(cache=self.cache.prefix(n), tokens=self.tokens[:n], keys=self.keys[:n],
                    sampling=_row_fields(self.sampling, n),
                    mtp_cache=None if self.mtp_cache is None else self.mtp_cache.prefix(n),
                    drafts=None if self.drafts is None else self.drafts[:n])

    def with_prefix(self, part: "Pool") -> "Pool":
        """This pool with its first rows replaced by ``part`` (sampling settings do not change in a decode)."""
        put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, 0, 0)  # noqa: E731
        return Pool(cache=self.cache.with_prefix(part.cache), tokens=put(self.tokens, part.tokens),
                    keys=put(self.keys, part.keys), sampling=self.sampling,
                    mtp_cache=None if self.mtp_cache is None else self.mtp_cache.with_prefix(part.mtp_cache),
                    drafts=None if self.drafts is None else put(self.drafts, part.drafts))


def _row_fields(x: SamplingArrays, rows) -> SamplingArrays:
    return jax.tree.map(lambda a: gather_rows(a, rows), x)


class Programs:
    """The engine's jitted programs, closed over the model's graph (only arrays are passed per call)."""

    def __init__(self, model, compiled: Callable[[tuple], None], k: int = 0, programs: ProgramCache | None = None):
        """``k``: MTP drafts per verify round (0: plain decoding). ``programs``: where the traced programs are kept
        between processes (a warm start then neither traces nor lowers them); None: plain ``jax.jit``."""
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        self.leaves = leaves
        self.k = k
        self._note = compiled

        def merged(leaves):
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

        def prefill(leaves, pool: Pool, rows, ids, n, reset, final, key_data, sampling: SamplingArrays, targets,
                    want_prompt, position_ids=None, image_embeds=None, *, kv_len: int, top_k: int):
            model = merged(leaves)
            new_rows = jnp.where(reset, rows, pool.cache.batch_size)
            cache = pool.cache.reset_rows(new_rows)
            mask = jnp.arange(ids.shape[1])[None, :] < n[:, None]
            start = gather_rows(cache.positions, rows)  # [P] the chunk's first position
            # an image call (the second variant): M-RoPE rows and the features of the call's image tokens
            out = model.forward(ids, attention_mask=mask, cache=cache, cache_rows=rows, kv_len=kv_len, last_only=True,
                                position_ids=position_ids, image_embeds=image_embeds)
            last = jnp.take_along_axis(out.hidden, jnp.maximum(n - 1, 0)[:, None, None], axis=1)  # [P, 1, H]
            logits = model.logits_from_hidden(last)[:, 0]
            keys = jnp.where(reset[:, None], key_data, gather_rows(pool.keys, rows))
            keep, sub = split_keys(jax.random.wrap_key_data(keys))
            tok = sample(logits, sub, sampling)
            # the drawn token's log-probabilities, always (P rows × the vocabulary once per call: no second
            # program for requests that ask for them)
            lp = token_logprobs(logits, tok, top_k)
            keep = jnp.where(final[:, None], jax.random.key_data(keep), keys)
            old = gather_rows(pool.tokens, rows)
            mtp_cache, drafts = pool.mtp_cache, pool.drafts
            if k:
                # the head over the chunk: position t reads the token after it — the next prompt token, or the first
                # drawn one at a prompt's last position — so its cache covers the whole prompt; drafts after that
                last = jnp.maximum(n - 1, 0)
                at_last = jnp.arange(ids.shape[1])[None, :] == last[:, None]
                nxt = jnp.where(at_last & final[:, None], tok[:, None], targets)
                positions = start[:, None] + jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :] + 1
                new, mtp_cache = propose(model, nxt, out.hidden, mtp_cache.reset_rows(new_rows), mask, positions,
                                         last, k, rows=rows, kv_len=kv_len)
                drafts = scatter_rows(drafts, rows, jnp.where(final[:, None], new, gather_rows(drafts, rows)))
            pool = Pool(cache=out.cache, tokens=scatter_rows(pool.tokens, rows, jnp.where(final, tok, old)),
                        keys=scatter_rows(pool.keys, rows, keep),
                        sampling=jax.tree.map(lambda a, v: scatter_rows(a, rows, v), pool.sampling, sampling),
                        mtp_cache=mtp_cache, drafts=drafts)
            # the prompt's log-probabilities (P × T positions × the vocabulary) only when a row asks: the data decides
            # (one program either way; a prefill call is long enough that the branch's cost does not show)
            p, t = targets.shape
            zeros = (jnp.zeros((p, t), jnp.float32), jnp.zeros((p, t, top_k), jnp.int32),
                     jnp.zeros((p, t, top_k), jnp.float32))
            prompt = jax.lax.cond(want_prompt, lambda: tuple(x.astype(z.dtype) for x, z in zip(_prompt_logprobs(
                model, out.hidden, targets, top_k), zeros)), lambda: zeros)
            return pool, tok, lp, prompt

        def decode(leaves, pool: Pool, active, steps, *, rows: int | None, kv_len: int, max_steps: int,
                   top_k: int | None):
            model = merged(leaves)
            whole = pool
            if rows is not None:
                # the running sequences are the first `rows` slots: they are copied out once per call and back once
                # at its end, and the steps run on that small pool as a whole batch. Reading and writing a prefix of
                # the big pool inside every step made XLA copy each GDN state stack per layer per step (one
                # sequence in a 32-slot pool decoded at 0.56× the speed of a 1-slot pool)
                pool = pool.prefix(rows)
            sampling = pool.sampling

            def body(i, carry):
                pool, out = carry
                tok, keys = pool.tokens, pool.keys
                fwd = model.forward(tok[:, None], attention_mask=active[:, None], cache=pool.cache, kv_len=kv_len)
                logits = fwd.logits[:, 0]
                keep, sub = split_keys(jax.random.wrap_key_data(keys))
                new = sample(logits, sub, sampling)
                lp = token_logprobs(logits, new, top_k) if top_k is not None else _no_logprobs(new)
                pool = pool.replace(cache=fwd.cache, tokens=jnp.where(active, new, tok),
                                    keys=jnp.where(active[:, None], jax.random.key_data(keep), keys))
                # log-probabilities are kept in float32 whatever the model computes in (a float64 model's are
                # rounded here once: they leave as JSON numbers of float32 precision either way)
                out = jax.tree.map(lambda buf, v: buf.at[i].set(v.astype(buf.dtype)), out, (new, *lp))
                return pool, out

            b, k = active.shape[0], top_k or 0
            out = (jnp.zeros((max_steps, b), jnp.int32), jnp.zeros((max_steps, b), jnp.float32),
                   jnp.zeros((max_steps, b, k), jnp.int32), jnp.zeros((max_steps, b, k), jnp.float32))
            pool, out = jax.lax.fori_loop(0, steps, body, (pool, out))
            if rows is not None:
                pool = whole.with_prefix(pool)
            return pool, out

        def verify(leaves, pool: Pool, active, *, rows: int | None, kv_len: int, top_k: int | None):
            """One verify round for the running rows (``active [b]``, the first ``b`` or all rows): (pool, tokens
            ``[b, k + 1]`` of which row i emitted the first ``consumed[i]``, consumed ``[b]``, their logprobs)."""
            model = merged(leaves)
            whole = pool
            if rows is not None:
                pool = pool.prefix(rows)  # as in decode
            last, drafts = pool.tokens, pool.drafts
            start = pool.cache.positions  # [b] each row's position of `last`
            ids = jnp.concatenate([last[:, None], drafts], axis=1)
            mask = jnp.broadcast_to(active[:, None], ids.shape)
            out = model.forward(ids, attention_mask=mask, cache=pool.cache, kv_len=kv_len, keep_steps=True)
            keep, sub = split_keys(jax.random.wrap_key_data(pool.keys))
            tokens, consumed = accept(out.logits, drafts, sub, pool.sampling)
            cache = out.cache.accept(consumed, active)
            lp = token_logprobs(out.logits, tokens, top_k) if top_k is not None else _no_logprobs(tokens)
            steps = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
            new, mtp_cache = propose(model, tokens, out.hidden, pool.mtp_cache, mask & (steps < consumed[:, None]),
                                     start[:, None] + steps + 1, consumed - 1, k, kv_len=kv_len)
            emitted = jnp.take_along_axis(tokens, (consumed - 1)[:, None], axis=1)[:, 0]
            pool = Pool(cache=cache, tokens=jnp.where(active, emitted, last),
                        keys=jnp.where(active[:, None], jax.random.key_data(keep), pool.keys), sampling=pool.sampling,
                        mtp_cache=mtp_cache, drafts=jnp.where(active[:, None], new, drafts))
            if rows is not None:
                pool = whole.with_prefix(pool)
            lp = tuple(x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in lp)
            return pool, tokens, consumed, lp

        def swap(pool: Pool, a, b):
            """Exchange rows a and b of every per-row array of the pool (its cache rows included)."""
            def one(x, axis):
                ra, rb = (jax.lax.dynamic_index_in_dim(x, r, axis) for r in (a, b))
                x = jax.lax.dynamic_update_index_in_dim(x, rb, a, axis)
                return jax.lax.dynamic_update_index_in_dim(x, ra, b, axis)

            def cache_rows(cache):
                if cache is None:
                    return None
                slots = jax.tree.map(lambda x: one(x, 1), cache.slots)  # [G, B, …]
                key_valid, positions, lengths = (one(x, 0) for x in (cache.key_valid, cache.positions, cache.lengths))
                return Cache(slots=slots, key_valid=key_valid, positions=positions, lengths=lengths)

            tokens, keys, sampling, drafts = jax.tree.map(lambda x: one(x, 0), (pool.tokens, pool.keys, pool.sampling,
                                                                                 pool.drafts))
            return Pool(cache=cache_rows(pool.cache), tokens=tokens, keys=keys, sampling=sampling,
                        mtp_cache=cache_rows(pool.mtp_cache), drafts=drafts)

        # the decode programs' XLA options (CUDA graphs of the decode loop): qjax.runtime.xla_options, one place
        graphs = decode_compiler_options()
        if programs is not None:
            model_key = _model_key(model, graphdef, treedef, k)
            kept = functools.partial(_Kept, programs, model_key)
            # results: the pool (its tree is the input pool's) and tuples of arrays (token_logprobs' three)
            self._prefill = kept(prefill, 1, None, lambda a: jax.tree.structure((a[1], 0, (0,) * 3, (0,) * 3)))
            self._decode = kept(decode, 1, graphs, lambda a: jax.tree.structure((a[1], (0,) * 4)))
            self._verify = kept(verify, 1, graphs, lambda a: jax.tree.structure((a[1], 0, 0, (0,) * 3)))
            self._swap = kept(swap, 0, None, lambda a: jax.tree.structure(a[0]))
            return
        self._prefill = jax.jit(prefill, donate_argnums=(1,), static_argnames=("kv_len", "top_k"))
        self._decode = jax.jit(decode, donate_argnums=(1,), static_argnames=("rows", "kv_len", "max_steps", "top_k"),
                               compiler_options=graphs)
        self._verify = jax.jit(verify, donate_argnums=(1,), static_argnames=("rows", "kv_len", "top_k"),
                               compiler_options=graphs)
        self._swap = jax.jit(swap, donate_argnums=(0,))

    def prefill(self, pool, *args, kv_len, top_k, position_ids=None, image_embeds=None):
        """``args``: rows, ids, n, reset, final, key_data, sampling, targets, want_prompt (a bool scalar: compute
        the prompt's log-probabilities); ``top_k``: the log-probability alternatives (the server's max_logprobs)."""
        kind = "prefill" if image_embeds is None else "prefill_images"
        self._note((kind, args[1].shape, kv_len, top_k))
        return self._prefill(self.leaves, pool, *args, position_ids, image_embeds, kv_len=kv_len, top_k=top_k)

    def decode(self, pool, active, steps, *, rows, kv_len, max_steps, top_k):
        self._note(("decode", rows, kv_len, max_steps, top_k))
        return self._decode(self.leaves, pool, active, steps, rows=rows, kv_len=kv_len, max_steps=max_steps,
                            top_k=top_k)

    def verify(self, pool, active, *, rows, kv_len, top_k):
        self._note(("verify", rows, kv_len, top_k))
        return self._verify(self.leaves, pool, active, rows=rows, kv_len=kv_len, top_k=top_k)

    def swap(self, pool, a: int, b: int):
        self._note(("swap",))
        return self._swap(pool, np.int32(a), np.int32(b))  # host scalars: no eager conversion program per call


def _model_key(model, graphdef, treedef, k: int) -> tuple:
    """What of the model decides the engine's traced programs, as a value with a stable ``repr``: its config, packed
    weights' layout, dtype, MTP head and vision tower, mesh plan, and (catch-all) a digest of its graph and of its
    state's tree — the functions close over both. A graph whose ``repr`` shows an object address is kept as it is, so
    that :class:`ProgramCache` sees the address and does not store the programs."""
    graph = repr(graphdef) + repr(treedef)
    if "0x" not in graph:
        graph = hashlib.sha256(graph.encode()).hexdigest()
    return (model.config, model.quant, str(jnp.dtype(model.dtype)), getattr(model, "mtp", None) is not None,
            getattr(model, "visual", None) is not None, model.mesh_plan, k, graph)


class _Kept:
    """One engine program through a :class:`ProgramCache`: ``jax.jit(fn, donate_argnums=(donate,),
    static_argnames=…, compiler_options=…)``'s calls, each static keyword combination (and kernel implementation)
    its own kept function with the keywords bound."""

    def __init__(self, programs: ProgramCache, model_key: tuple, fn: Callable, donate: int,
                 compiler_options: dict | None, out_structure: Callable[[tuple], object]):
        self.programs, self.model_key, self.fn, self.donate = programs, model_key, fn, donate
        self.compiler_options, self.out_structure = compiler_options, out_structure
        self.jitted: dict[tuple, Callable] = {}

    def __call__(self, *args, **static):
        # the kernels (reference / Pallas / interpret) are chosen when a program is traced (qjax.kernels.dispatch),
        # so the choice in force now decides which kept program this call runs
        key = (tuple(sorted((n, None if v is None else int(v)) for n, v in static.items())), kernel_impl())
        jitted = self.jitted.get(key)
        if jitted is None:
            desc = (f"qjax.serving.programs.{self.fn.__name__}", *key, self.model_key, self.compiler_options)
            jitted = self.jitted[key] = self.programs.jit(
                functools.partial(self.fn, **dict(key[0])), desc, out_structure=self.out_structure,
                donate_argnums=(self.donate,), compiler_options=self.compiler_options)
        return jitted(*args)


def _no_logprobs(tokens):
    empty = jnp.zeros((*tokens.shape, 0), jnp.float32)  # float32 named: a bare zeros is float64 under x64
    return jnp.zeros(tokens.shape, jnp.float32), empty.astype(jnp.int32), empty


PROMPT_CHUNK = 64  # prompt positions whose [P, chunk, vocab] logits exist at once


def _prompt_logprobs(model, hidden, targets, k: int):
    """log p(targets[t]) given the prefix through t, and the top-k, for every position: ``hidden [P, T, H]``
    (post-norm), ``targets [P, T]`` → ``[P, T]``, ``[P, T, k]`` ids, ``[P, T, k]`` log p. Logits are made
    :data:`PROMPT_CHUNK` positions at a time."""
    p, t, h = hidden.shape
    pad = (-t) % PROMPT_CHUNK
    hs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    ts = jnp.pad(targets, ((0, 0), (0, pad)))
    n = (t + pad) // PROMPT_CHUNK
    hs = hs.reshape(p, n, PROMPT_CHUNK, h).swapaxes(0, 1)
    ts = ts.reshape(p, n, PROMPT_CHUNK).swapaxes(0, 1)

    def one(args):
        hc, tc = args
        return token_logprobs(model.logits_from_hidden(hc), tc, k)

    lp, ids, top = jax.lax.map(one, (hs, ts))
    undo = lambda a: a.swapaxes(0, 1).reshape(p, n * PROMPT_CHUNK, *a.shape[3:])[:, :t]  # noqa: E731
    return undo(lp), undo(ids), undo(top)
