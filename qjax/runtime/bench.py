"""End-to-end speed of a model built from a config and a quantization recipe, with random weights made on the device:
prefill and decode throughput, time to first token and device memory, each beside its bound and a baseline.

A weight-only quantized model runs at the same speed whatever its weight values, so the real model's speed is
measured without its weights (:func:`qjax.runtime.random_model.random_model`: no checkpoint, no host copy). The programs
timed are the ones :func:`qjax.generate` runs — its jitted prefill and its ``while_loop`` decode, routing and sampling
on device — so the bench's tokens are :func:`qjax.generate`'s tokens.

Decode bound (tokens/s) = B ÷ (bytes one decode step must move ÷ copy bandwidth measured in the same run), with
bytes = every non-expert weight once (the embedding: only its B rows) + the routed-expert weights × E_act/E, where
``E_act = E·(1 − (1 − k/E)^B)`` is the expected number of distinct experts B tokens route to (uniform routing), + the
GDN conv window and float32 recurrent state, read and written, + the K/V of the context, read.

Baseline (``impl="xla"``, see :mod:`qjax.kernels.dispatch`): the same programs traced with a plain-XLA
dequantize-then-matmul path (whole weights — every expert — dequantized on each call, then dot / ``ragged_dot``),
timed interleaved with the default path so both see the same machine load.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import glob
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.checkpoint.hub import ASSETS
from qjax.convert.planner import (  # the decode step's bytes: the planner's, which qjax inspect prints deviceless
    decode_bytes,
    expected_active_experts,  # noqa: F401 - bench.expected_active_experts, as before
    plan_recipe_cfg,
    weight_bytes_by_role,
)
from qjax.model.memory import device_limit, host_available
from qjax.model.cache import Cache, cache_length
from qjax.model.config import FULL, TextConfig
from qjax.model.qwen3_5_moe import Qwen3_5MoeForCausalLM
from qjax.runtime.generate import DecodeSettings, decode_loop, decode_loop_for, prefill
from qjax.runtime.bench_settings import RECIPES, Settings  # noqa: F401  (RECIPES: re-exported for callers)
from qjax.runtime.random_model import abstract_recipe_model, random_model

BUILTIN_CONFIG = os.path.join(ASSETS, "configs", "qwen3_6_35b_a3b.json")
# dense BF16 tensor-core peaks (datasheet) for the prefill compute bound, by a substring of device_kind
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


# ---------------------------------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------------------------------
def scaled_config(raw: dict, *, width: int = 8, layers: int = 8) -> dict:
    """``raw`` (a config.json dict) at ``1/width`` of every width (hidden, head dims, expert widths, vocabulary) and
    ``layers`` layers of the same pattern; head counts, expert count and top-k stay, so head ratios, routing sparsity
    and the kernels' code paths are the real model's."""
    r = dict(raw)

    def div(name):
        v = int(r[name])
        if v % width:
            raise ValueError(f"scaled config: {name} = {v} is not divisible by width {width}")
        r[name] = v // width

    for name in ("hidden_size", "head_dim", "linear_key_head_dim", "linear_value_head_dim", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "vocab_size"):
        div(name)
    pattern = list(raw.get("layer_types") or [])
    if pattern:
        if layers > len(pattern):
            raise ValueError(f"scaled config: {layers} layers asked, the config has {len(pattern)}")
        r["layer_types"] = pattern[:layers]
    r["num_hidden_layers"] = layers
    rope = dict(r.get("rope_parameters") or {})
    if rope.get("mrope_section"):
        # the sections must still add up to the rotary frequencies: rotary_dim / 2
        freqs = int(r["head_dim"] * rope.get("partial_rotary_factor", 1.0)) // 2
        sec = [int(s) for s in rope["mrope_section"]]
        new = [max(1, s * freqs // sum(sec)) for s in sec]
        new[0] += freqs - sum(new)
        if min(new) < 1:
            raise ValueError(f"scaled config: M-RoPE sections {sec} cannot be scaled to {freqs} frequencies")
        rope["mrope_section"] = new
        r["rope_parameters"] = rope
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if isinstance(r.get(key), int) and r[key] >= r["vocab_size"]:
            r[key] = r["vocab_size"] - 1
    return r


def load_config(path: str | None = None, *, scale: int = 1, layers: int | None = None) -> TextConfig:
    """A config.json (file or folder; default: the built-in Qwen3.6-35B-A3B shapes), optionally scaled down."""
    path = BUILTIN_CONFIG if path is None else os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    cfg = TextConfig.from_file(path)
    if scale == 1 and layers is None:
        return cfg
    raw = cfg.to_hf_dict()
    scaled = scaled_config(raw, width=scale, layers=layers or cfg.num_hidden_layers)
    return TextConfig.from_dict(scaled, source=f"{path} scaled 1/{scale}, {scaled['num_hidden_layers']} layers")


# ---------------------------------------------------------------------------------------------------------------------
# settings and results
# ---------------------------------------------------------------------------------------------------------------------
def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"1x2048,8x512"`` → ``((1, 2048), (8, 512))`` (empty: none)."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            b, t = item.lower().split("x")
            out.append((int(b), int(t)))
        except ValueError:
            raise ValueError(f"prefill shape {item!r}: use BATCHxTOKENS, e.g. 1x2048") from None
    return tuple(out)


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a comma-separated list of integers") from None


# ---------------------------------------------------------------------------------------------------------------------
# bytes and FLOPs
# ---------------------------------------------------------------------------------------------------------------------
def prefill_flops(cfg: TextConfig, batch: int, tokens: int) -> float:
    """Matmul FLOPs of one prefill (weights: 2 per weight per token, routed experts k/E of them; attention scores and
    values over the causal half; the LM head on the last position only, as generation runs it)."""
    counts = _matmul_params(cfg)
    n = batch * tokens
    flops = 2.0 * n * (counts["other"] + counts["experts"] * cfg.num_experts_per_tok / cfg.num_experts)
    flops += 2.0 * batch * counts["lm_head"]
    n_full = sum(1 for t in cfg.layer_types if t == FULL)
    flops += n_full * batch * 2 * 2 * cfg.num_attention_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    return flops


@functools.lru_cache(maxsize=8)
def _matmul_params(cfg: TextConfig) -> dict[str, int]:
    """Weights of the dense model by role (``lm_head``, ``experts`` (all routed), ``other``; no embedding, no MTP)."""

    counts: dict[str, int] = defaultdict(int)
    dense = jax.eval_shape(lambda: nnx.state(Qwen3_5MoeForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    for path, v in nnx.to_flat_state(dense):
        names = [str(p) for p in path]
        shape = (v.get_value() if hasattr(v, "get_value") else v.value).shape
        if len(shape) < 2 or (names[-1] != "weight" and names[-1] not in ("gate_up_proj", "down_proj")):
            continue
        if "embed_tokens" in names or "mtp" in names:
            continue
        counts["lm_head" if "lm_head" in names else "experts" if "experts" in names else "other"] += math.prod(shape)
    return dict(counts)


# ---------------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------------
def _block(x):
    jax.block_until_ready(x)
    return x


def time_interleaved(contenders: dict[str, tuple[Callable[[], object], Callable[[object], object]]],
                     repeats: int) -> dict[str, dict]:
    """Median wall time of each ``run(prepare())``, contenders interleaved (a, b, a, b, …) so machine load hits all
    alike; ``prepare`` is untimed. The first (compiling) call is timed apart: ``compile_s`` is its excess over the
    median. Returns ``{name: {"s": median, "compile_s": …, "out": first call's output}}``."""
    out: dict[str, dict] = {}
    for name, (prepare, run) in contenders.items():
        args = _block(prepare())
        t0 = time.perf_counter()
        first = _block(run(args))
        out[name] = {"first_s": time.perf_counter() - t0, "out": first, "times": []}
    for _ in range(repeats):
        for name, (prepare, run) in contenders.items():
            args = _block(prepare())
            t0 = time.perf_counter()
            _block(run(args))
            out[name]["times"].append(time.perf_counter() - t0)
    for r in out.values():
        r["s"] = statistics.median(r["times"])
        r["compile_s"] = max(0.0, r.pop("first_s") - r["s"])
    return out


def copy_bandwidth(nbytes: int, repeats: int = 10) -> float:
    """Device copy bandwidth in bytes/s: ``y = x + 1`` over ``nbytes`` of float32 reads and writes 2·nbytes."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    _block(f(x))
    times = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        _block(f(x))
        times.append(time.perf_counter() - t0)
    return 2 * x.size * 4 / statistics.median(times)


def device_memory() -> dict[str, int] | None:
    """``memory_stats()`` of the first device (None where the backend keeps none, e.g. CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without allocator stats raise various errors
        return None
    return dict(stats) if stats else None


# ---------------------------------------------------------------------------------------------------------------------
# the bench
# ---------------------------------------------------------------------------------------------------------------------
def _greedy():

    # exactly what qjax.generate(..., eos_token_id=[]) resolves greedy decoding to, so the programs are shared
    return DecodeSettings(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, eos=(), pad=0)


def prompt_ids(cfg: TextConfig, batch: int, tokens: int, seed: int) -> np.ndarray:
    """The bench's prompts: uniformly random token ids ``[batch, tokens]`` (int32), fixed by ``seed``."""
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, tokens)).astype(np.int32)


@jax.jit
def _copy_tree(tree):
    return jax.tree_util.tree_map(jnp.copy, tree)


def run_bench(model, settings: Settings = Settings(), *, log: Callable[[str], None] = lambda s: None) -> dict:
    """Time ``model`` (any :class:`~qjax.model.qwen3_5_moe.Qwen3_5MoeForCausalLM`); returns a JSON-able dict of rows
    plus ``tokens`` (``{batch: [B, new_tokens + 1] int32}``, the greedy tokens of the default path, not serialised)."""

    cfg = model.config
    graphdef, state = nnx.split(model)
    impls = {"qjax": None, **({"baseline": "xla"} if settings.baseline and model.quant is not None else {})}
    rows: list[dict] = []
    tokens: dict[int, np.ndarray] = {}

    def prefill_contenders(b, t, max_len):
        ids = jnp.asarray(prompt_ids(cfg, b, t, settings.seed))
        mask = jnp.ones((b, t), jnp.int32)

        def make(impl):
            return (lambda: model.init_cache(b, max_len),
                    lambda cache: prefill(graphdef, state, cache, ids, mask, impl=impl))
        return {name: make(impl) for name, impl in impls.items()}

    for b, t in settings.prefill:
        log(f"prefill {b}x{t}")
        # TTFT and the decode warm-up reuse this program
        res = time_interleaved(prefill_contenders(b, t, _cache_len(t, settings)), settings.repeats)
        rows.append(_row("prefill", b, t, b * t, res, flops=prefill_flops(cfg, b, t)))
    if settings.prefill:
        b, t = 1, settings.prefill[0][1]
        log(f"time to first token, 1x{t}")
        ids_host = prompt_ids(cfg, b, t, settings.seed)

        def ttft(impl):
            def run(cache):
                logits, _ = prefill(graphdef, state, cache, jnp.asarray(ids_host), jnp.ones((b, t), jnp.int32),
                                     impl=impl)
                return np.asarray(jnp.argmax(logits, axis=-1))  # on the host: the user has the token
            return (lambda: model.init_cache(b, _cache_len(t, settings)), run)
        res = time_interleaved({name: ttft(impl) for name, impl in impls.items()}, settings.repeats)
        rows.append(_row("ttft", b, t, 1, res))

    n = settings.new_tokens
    for b in settings.decode_batches:
        log(f"decode batch {b}, {n} steps after {settings.context} tokens")
        warm = _warm_cache(model, settings, b)

        def decode(impl, logits, cache):
            # every call starts from a copy of the same warm cache (the loop donates it)
            return (lambda: (logits, _copy_tree(cache)),
                    lambda a: _decode(graphdef, state, *a, n, impl))
        res = time_interleaved({name: decode(impl, *warm) for name, impl in impls.items()}, settings.repeats)
        out = {name: np.asarray(r["out"])[:, :n + 1] for name, r in res.items()}  # the loop's buffer is cache-wide
        tokens[b] = out["qjax"]
        row = _row("decode", b, settings.context, b * n, res)
        if "baseline" in out:
            row["baseline_token_match"] = float(np.mean(out["baseline"] == tokens[b]))
        row["bytes_per_step"] = decode_bytes(model, b, settings.context + n // 2)
        rows.append(row)
    return {"rows": rows, "tokens": tokens}


def _cache_len(t: int, settings: Settings) -> int:
    """The cache qjax.generate allocates for a ``t``-token prompt and the bench's ``new_tokens + 1`` decoded tokens."""
    return cache_length(t, settings.new_tokens + 1)


def _decode(graphdef, state, logits, cache, n: int, impl: str | None = None, graphs: str | None = None):
    """qjax.generate's greedy decode loop from a warm cache: n + 1 tokens (the first from the prefill's logits, then n
    forward steps) → ``[B, cache.max_len]``, of which the first n + 1 columns are those tokens. ``graphs``: the decode
    programs' XLA mode (:mod:`qjax.runtime.xla_options`; None: the process's)."""

    loop = decode_loop_for(graphs)
    return loop(graphdef, state, cache, logits, jax.random.key(0), _greedy(), n + 1, impl=impl)[0]


WARM_ROWS = 8  # decode prompts are prefilled 8 rows at a time: one prefill program serves every decode batch


def decode_prompt(cfg: TextConfig, batch: int, context: int, seed: int) -> np.ndarray:
    """The prompts decode at ``batch`` starts from: ``[batch, context]``, chunk i of 8 rows seeded ``seed + i``."""
    chunks = [prompt_ids(cfg, WARM_ROWS, context, seed + i) for i in range(-(-batch // WARM_ROWS))]
    return np.concatenate(chunks)[:batch]


def _warm_cache(model, settings: Settings, batch: int):
    """(last logits, cache) after prefilling :func:`decode_prompt` with room for ``new_tokens + 1`` more tokens — what
    :func:`qjax.generate` holds before its decode loop. Rows are independent, so the cache is assembled from 8-row
    prefills (the ``8×context`` prefill program, shared with a timed prefill of that shape): one compile instead of
    one per decode batch."""

    graphdef, state = nnx.split(model)
    ids = decode_prompt(model.config, batch, settings.context, settings.seed)
    parts = []
    for i in range(0, batch, WARM_ROWS):
        chunk = np.asarray(prompt_ids(model.config, WARM_ROWS, settings.context, settings.seed + i // WARM_ROWS))
        assert np.array_equal(chunk[: batch - i], ids[i:i + WARM_ROWS])
        cache = model.init_cache(WARM_ROWS, _cache_len(settings.context, settings))
        parts.append(prefill(graphdef, state, cache, jnp.asarray(chunk), jnp.ones(chunk.shape, jnp.int32)))
    logits, cache = _concat_rows(parts, batch)
    return logits, _block(cache)


@functools.partial(jax.jit, static_argnums=(1,))
def _concat_rows(parts, batch: int):
    """Stack the rows of several (logits, cache) prefill results and keep the first ``batch``."""

    logits = jnp.concatenate([lg for lg, _ in parts])[:batch]
    caches = [c for _, c in parts]
    # cache slot leaves are [groups, B, …]; key_valid, positions and lengths are [B, …]
    slots = jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=1)[:, :batch], *[c.slots for c in caches])
    return logits, Cache(slots=slots, key_valid=jnp.concatenate([c.key_valid for c in caches])[:batch],
                         positions=jnp.concatenate([c.positions for c in caches])[:batch],
                         lengths=jnp.concatenate([c.lengths for c in caches])[:batch])


def _row(kind: str, batch: int, tokens: int, work: int, res: dict, *, flops: float | None = None) -> dict:
    """One result row: ``work`` tokens per timed call → tok/s (TTFT: seconds)."""
    q = res["qjax"]
    row = {"kind": kind, "batch": batch, "tokens": tokens, "s": q["s"], "tok_s": work / q["s"],
           "compile_s": q["compile_s"], "times": q["times"]}
    if flops is not None:
        row["flops"] = flops
    if "baseline" in res:
        row["baseline_s"] = res["baseline"]["s"]
        row["baseline_tok_s"] = work / res["baseline"]["s"]
        row["speedup"] = res["baseline"]["s"] / q["s"]
    return row


def bench(cfg: TextConfig, recipe: str, settings: Settings = Settings(), *, dtype=jnp.bfloat16, mesh=None,
          profile: bool = False, log: Callable[[str], None] = lambda s: None) -> dict:
    """Build the random model of ``cfg`` + ``recipe`` on the device(s) and time it (:func:`run_bench`).

    Adds the bounds (decode: bytes ÷ copy bandwidth measured here; prefill: model FLOPs ÷ the device's dense BF16
    peak where known), device memory, and with ``profile`` a per-op breakdown of the batch-1 decode step."""

    check_memory(cfg, recipe, dtype, mesh)
    t0 = time.perf_counter()
    model = random_model(cfg, recipe, dtype=dtype, seed=settings.seed, mesh=mesh)
    _block(nnx.state(model))
    build_s = time.perf_counter() - t0
    mem_after_build = device_memory()
    log(f"model built in {build_s:.1f} s")
    dev = jax.local_devices()[0]
    bw_bytes = (1 << 30) if dev.platform == "gpu" else (1 << 27)
    bandwidth = copy_bandwidth(bw_bytes)
    log(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    result = run_bench(model, settings, log=log)
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in dev.device_kind), None)
    for row in result["rows"]:
        if row["kind"] == "decode":
            step_s = row["bytes_per_step"]["total"] / bandwidth
            row["bound_tok_s"] = row["batch"] / step_s
            row["of_bound"] = row["tok_s"] / row["bound_tok_s"]
        if row["kind"] == "prefill":
            row["tflops"] = row["flops"] / row["s"] / 1e12
            if peak:
                row["bound_tok_s"] = row["batch"] * row["tokens"] / (row["flops"] / peak)
                row["of_bound"] = row["tok_s"] / row["bound_tok_s"]
    mem = device_memory()
    w = weight_bytes_by_role(model)
    result.update(
        recipe=recipe, dtype=jnp.dtype(dtype).name, config=_config_summary(cfg), settings=dataclasses.asdict(settings),
        device=f"{dev.platform}: {dev.device_kind}", devices=jax.device_count(), jax=jax.__version__,
        host=platform.node(), date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        build_s=build_s, copy_bandwidth=bandwidth, weight_bytes=sum(w.values()), weight_groups=w,
        bytes_in_use_after_build=(mem_after_build or {}).get("bytes_in_use"),
        peak_bytes_in_use=(mem or {}).get("peak_bytes_in_use"), bytes_limit=(mem or {}).get("bytes_limit"))
    if profile and settings.decode_batches:
        log("profiling decode at batch 1")
        result["profile"] = profile_decode(model, settings)
    return result


def _config_summary(cfg: TextConfig) -> dict:
    return {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "num_key_value_heads", "head_dim", "linear_num_key_heads",
                                         "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                                         "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                         "shared_expert_intermediate_size", "vocab_size")}


def check_memory(cfg: TextConfig, recipe: str, dtype, mesh) -> None:
    """Refuse early, naming the numbers, when the weights alone cannot fit the device (or this host, on CPU)."""

    p = plan_recipe_cfg(cfg, recipe, dtype=jnp.dtype(dtype).name, mesh=mesh)
    need = p.mesh_device_bytes if mesh is not None else p.device_bytes
    dev = jax.local_devices()[0]
    limit = device_limit(dev)
    have, where = (limit, f"{dev.device_kind} memory") if limit else (host_available(), "available host memory")
    if have and need > 0.9 * have:
        raise MemoryError(f"recipe {recipe!r}: the weights need {need / 2**30:.1f} GiB per device, {where} is "
                          f"{have / 2**30:.1f} GiB; use a smaller config (--scale 8) or a mesh")


# ---------------------------------------------------------------------------------------------------------------------
# profile
# ---------------------------------------------------------------------------------------------------------------------
# bookkeeping events of XLA:CPU's thread pools, and control-flow ops whose time is their body's (counted already)
_SKIP_EVENTS = ("ThreadpoolListener", "end: ", "SlinkyThreadPool", "Thunk", "TfrtCpu", "while", "conditional",
                "cond", "call", "command_buffer")
_SCOPES = ("linear_attn", "self_attn", "router", "experts", "shared_expert", "lm_head")


def profile_decode(model, settings: Settings, *, top: int = 12) -> dict:
    """Per-op device time of the batch-1 decode loop from a ``jax.profiler`` trace (parsed with
    ``jax.profiler.ProfileData``, no TensorBoard needed): ops by total time per step, time per model scope (from
    the named scopes layers set; GPU traces carry them) and the device-busy share of the wall time — the rest is
    launch and host overhead."""
    graphdef, state = nnx.split(model)
    steps = settings.new_tokens

    def once():
        warm = _warm_cache(model, settings, 1)
        t0 = time.perf_counter()
        _block(_decode(graphdef, state, *warm, steps))
        return time.perf_counter() - t0

    once()  # compiled already when batch 1 was timed; otherwise compile outside the trace
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            wall = once()
        files = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return {"error": "the profiler wrote no trace"}
        data = jax.profiler.ProfileData.from_file(files[0])
    ops, scopes = summarise_trace(data)
    busy = sum(ops.values())
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])[:top]
    on_device = any(p.name.startswith("/device:") for p in data.planes)
    return {"steps": steps, "wall_us_per_step": wall / steps * 1e6, "busy_us_per_step": busy / steps / 1e3,
            "source": "device" if on_device else "host threads",
            "ops": [{"name": k, "us_per_step": v / steps / 1e3, "share": v / busy if busy else 0.0}
                    for k, v in ranked],
            "scopes": {k: v / steps / 1e3 for k, v in sorted(scopes.items(), key=lambda kv: -kv[1])}}


def summarise_trace(data) -> tuple[dict[str, float], dict[str, float]]:
    """``ProfileData`` → (ns per op name, ns per model scope). Device planes (``/device:*``) when the trace has
    them — a GPU's kernels — else the XLA:CPU worker threads of ``/host:CPU``."""
    device = [p for p in data.planes if p.name.startswith("/device:")]
    ops: dict[str, float] = defaultdict(float)
    scopes: dict[str, float] = defaultdict(float)
    for plane in device or [p for p in data.planes if p.name == "/host:CPU"]:
        lines = list(plane.lines)
        if device:
            # a post-processed trace has one derived "XLA Ops" line; a raw one has the CUDA streams' kernels
            lines = [ln for ln in lines if ln.name == "XLA Ops"] or [
                ln for ln in lines if ln.name not in ("XLA Modules", "Steps", "Source", "XLA TraceMe", "Framework Ops",
                                                      "Launch Stats", "Memcpy")]
        else:
            lines = [ln for ln in lines if ln.name.startswith("tf_XLA")]
        for line in lines:
            for ev in line.events:
                if ev.duration_ns <= 0 or ev.name.startswith(_SKIP_EVENTS):
                    continue
                ops[ev.name] += ev.duration_ns
                label = " ".join(str(v) for k, v in ev.stats if k in ("tf_op", "long_name", "hlo_op", "name"))
                scope = next((s for s in _SCOPES if f"/{s}/" in label or label.startswith(s + "/")), None)
                if scope:
                    scopes[scope] += ev.duration_ns
    return dict(ops), dict(scopes)


# ---------------------------------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------------------------------
def _fmt(v, spec=".0f", none="—"):
    return none if v is None else format(v, spec)


def format_table(results: Sequence[dict]) -> str:
    """Markdown: one row per (recipe, measurement)."""
    lines = ["| recipe | measurement | tok/s | ms / call | baseline tok/s | × baseline | bound tok/s | of bound | "
             "compile s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for row in r["rows"]:
            if row["kind"] == "ttft":
                what, tok = f"TTFT 1×{row['tokens']} (ms)", _fmt(row["s"] * 1e3, ".1f")
                base = _fmt(row.get("baseline_s") and row["baseline_s"] * 1e3, ".1f")
            else:
                what = (f"prefill {row['batch']}×{row['tokens']}" if row["kind"] == "prefill"
                        else f"decode B={row['batch']} (ctx {row['tokens']})")
                tok, base = _fmt(row["tok_s"], ".1f"), _fmt(row.get("baseline_tok_s"), ".1f")
            lines.append(f"| {r['recipe']} | {what} | {tok} | {row['s'] * 1e3:.1f} | {base} | "
                         f"{_fmt(row.get('speedup'), '.2f')} | {_fmt(row.get('bound_tok_s'), '.0f')} | "
                         f"{_fmt(row.get('of_bound') and 100 * row['of_bound'], '.1f')}"
                         f"{'%' if row.get('of_bound') else ''}"
                         f" | {row['compile_s']:.1f} |")
    return "\n".join(lines)


def format_memory(results: Sequence[dict]) -> str:
    gib = lambda v: _fmt(v and v / 2**30, ".2f")  # noqa: E731
    lines = ["| recipe | weights GiB | in use after build GiB | peak GiB | decode bytes/step B=1 (MB) | copy GB/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        b1 = next((row["bytes_per_step"]["total"] for row in r["rows"]
                   if row["kind"] == "decode" and row["batch"] == 1), None)
        lines.append(f"| {r['recipe']} | {gib(r['weight_bytes'])} | {gib(r['bytes_in_use_after_build'])} | "
                     f"{gib(r['peak_bytes_in_use'])} | {_fmt(b1 and b1 / 1e6, '.1f')} | "
                     f"{r['copy_bandwidth'] / 1e9:.1f} |")
    return "\n".join(lines)


def format_profile(result: dict) -> str:
    p = result.get("profile")
    if not p or "error" in p:
        return f"(no profile: {p.get('error') if p else 'not asked'})"
    if p["source"] == "device":  # one stream: the gap between wall and busy is launch and host overhead
        busy = (f"{p['busy_us_per_step']:.0f} µs/step in kernels "
                f"({100 * p['busy_us_per_step'] / p['wall_us_per_step']:.0f}% of wall)")
    else:  # XLA:CPU runs ops on several threads at once: the sum can exceed the wall time
        busy = f"{p['busy_us_per_step']:.0f} µs/step of op time summed over threads"
    lines = [f"{result['recipe']}: decode B=1, {p['wall_us_per_step']:.0f} µs/step wall, {busy}",
             "", "| op | µs / step | share |", "|---|---:|---:|"]
    lines += [f"| `{o['name'][:60]}` | {o['us_per_step']:.1f} | {100 * o['share']:.1f}% |" for o in p["ops"]]
    if p["scopes"]:
        lines += ["", "| scope | µs / step |", "|---|---:|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in p["scopes"].items()]
    return "\n".join(lines)


def to_json(result: dict) -> str:
    return json.dumps({k: v for k, v in result.items() if k != "tokens"}, indent=1, default=float)


# ---------------------------------------------------------------------------------------------------------------------
# deviceless H200 compile of the full-size programs (qjax.kernels.aot_h200 and benchmarks/e2e_aot.py)
# ---------------------------------------------------------------------------------------------------------------------
def decode_program(model, batch: int = 1, context: int = 512, new_tokens: int = 64):
    """``(fn, arg_specs)``: the decode ``while_loop`` of ``qjax.generate`` for ``model`` (an abstract one, e.g.
    :func:`qjax.runtime.random_model.abstract_recipe_model`), as a function of abstract state, cache, logits, key and
    step count — for compiling without weights or device. The step count is an argument, as in ``qjax.generate`` and
    the bench (a constant would let XLA give the decode loop a known trip count that the real program does not have).
    Inside this ``fn`` the decode loop's own ``compiler_options`` do not apply: compile it with
    :func:`qjax.runtime.xla_options.decode_compiler_options`."""

    cfg = model.config
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: model.init_cache(batch, cache_length(context, new_tokens + 1)))
    logits = jax.ShapeDtypeStruct((batch, cfg.vocab_size), jnp.float32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    steps = jax.ShapeDtypeStruct((), jnp.int32)

    def fn(state, cache, logits, key, steps):
        return decode_loop(graphdef, state, cache, logits, key, _greedy(), steps)[0][:, :new_tokens + 1]

    return fn, (state, cache, logits, key, steps)


def lowering_cases():
    """The full-size Qwen3.6-35B-A3B decode loop (w2w4, batch 1), for ``qjax.kernels.aot_h200``: every Pallas kernel
    at its real shapes inside the real program."""

    fn, specs = decode_program(abstract_recipe_model(load_config(), "w2w4"))
    return [("e2e_decode_w2w4_b1", fn, specs)]
