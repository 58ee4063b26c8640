"""float32 accuracy and the float64 mode (issue 21): qjax float32 and transformers float32 against a float64 truth.

1. Model logits. For the tiny and odd test configs (``tests/oracles/hf.py``: ``make_hf_model(cfg, seed=0)``, float32
   weights, eager attention, transformers' default experts implementation) and six inputs each — ``two_chunks``
   (ids ``[2, 90]``, two GDN chunks), ``left_padded`` (ids ``[3, 70]``, row 0's first 9 and row 2's first 40
   positions masked, explicit positions ``arange(70)``), ``mrope_3d`` (ids ``[2, 77]``, position ids ``[3, 2, 77]``:
   sorted random ints in [0, 120) per row), two seeds per kind — the truth is transformers in float64 everywhere
   (``float64_truth`` run under ``float64_everywhere(strict=True)``). Reported on the real (unmasked) positions: the
   max and RMS error of transformers float32 and of qjax float32 (``qjax.load_model(folder)``), their ratios
   (qjax / transformers), and qjax float64's (``load_model(folder, dtype="float64")``) max error relative to
   max |truth logit|; one pooled row per config (all its cases' real positions together).
2. The chunked gated delta rule alone, on random float32 inputs (q, k, v normal, v·0.5, g = −A·softplus(normal + 1)·0.1
   with A ~ U(0.01, 16) per head, β = sigmoid(normal)); truth: qjax's chunked form in float64 on the same
   float32-rounded inputs. Errors of qjax's float32 chunked form (two-float cumulative log-decays), of the
   single-cumsum form it replaced (re-implemented here as the baseline), of qjax's float32 token-by-token recurrence
   and of transformers' float32 ``torch_chunk_gated_delta_rule`` (``use_qk_l2norm_in_kernel=True``).
3. Cost: jitted wall time (median of ``--repeats`` interleaved runs after one warm-up each, ``block_until_ready``) of
   the chunked GDN, current vs single-cumsum, at B=1, Hk 16, Hv 32, Dk = Dv = 128, T = 512 (and T = 2048 when that
   pair is estimated to take < 10 s); and the tiny model's forward ``[4, 256]`` in float32 vs float64.

    python benchmarks/precision.py [--repeats 5] [--no-write]

About 3 minutes on 2 quiet cores, most of it XLA:CPU compiling the 14 qjax model programs (~9 s each: 3 input shapes ×
2 configs × float32/float64, and the timed forward in both dtypes).

Writes (replaces) the section ``## float32 accuracy and the float64 mode (issue 21)`` of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import os

from qjax import xla_env  # noqa: E402

xla_env.apply(single_threaded=True)  # before JAX starts its CPU backend

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # tests/oracles: the transformers models and truth
from cpu_speed import RESULTS, bench, git_state, write_section  # noqa: E402

SECTION = "## float32 accuracy and the float64 mode (issue 21)"
SEEDS = {"two_chunks": (100, 101), "left_padded": (102, 103), "mrope_3d": (104, 105)}
GDN_SHAPES = {"small": dict(b=2, t=90, hk=3, hv=6, dk=12, dv=20),
              "large": dict(b=1, t=512, hk=16, hv=32, dk=128, dv=128)}
RMS_RATIO_BOUND = 1.1  # tests/test_model.py's bound on qjax f32 RMS error / transformers f32 RMS error


# ---------------------------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------------------------
def gdn_inputs(b, t, hk, hv, dk, dv, seed=0):
    """float32 numpy (q, k, v, g, beta) in the layouts of ``chunk_gated_delta_rule``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, hk, dk))
    k = rng.standard_normal((b, t, hk, dk))
    v = rng.standard_normal((b, t, hv, dv)) * 0.5
    a = rng.uniform(0.01, 16, (hv,))
    g = -a * np.logaddexp(0.0, rng.standard_normal((b, t, hv)) + 1.0) * 0.1
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, hv))))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta))


# ---------------------------------------------------------------------------------------------------------------------
# the baseline: the chunked form before issue 21 (one rounded cumulative sum of the log decays)
# ---------------------------------------------------------------------------------------------------------------------
def chunk_gated_delta_rule_single_cumsum(q, k, v, g, beta, initial_state=None, chunk_size: int = 64):
    """``qjax.model.gdn.chunk_gated_delta_rule`` with its two-float cumulative sum replaced by the old single
    ``jnp.cumsum(g)``, decays ``exp(gc_i − gc_j)`` and ``exp(gc_last − gc)`` formed from it (the formula before
    issue 21); everything else identical."""
    import jax
    import jax.numpy as jnp

    from qjax.model.gdn import HIGHEST, prepare, unit_lower_inverse, zero_state

    out_dtype = q.dtype
    q, k, v, g, beta = prepare(q, k, v, g, beta)
    s0 = zero_state(q, v) if initial_state is None else initial_state.astype(q.dtype)
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (-t) % c
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    n = (t + pad) // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(b, h, n, c) for x in (g, beta))

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    gc = jnp.cumsum(g, axis=-1)  # [B, H, N, C] log decay from chunk start
    lower = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.exp(jnp.where(lower, gc[..., :, None] - gc[..., None, :], -jnp.inf))
    a = jnp.einsum("bhnid,bhnjd->bhnij", k_beta, k, precision=HIGHEST) * decay
    attn = jnp.einsum("bhnid,bhnjd->bhnij", q, k, precision=HIGHEST) * decay
    unit_lower = jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), a, 0.0) + jnp.eye(c, dtype=q.dtype)
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(gc)[..., None]], axis=-1)
    sol = jnp.matmul(unit_lower_inverse(unit_lower), rhs, precision=HIGHEST)
    u, w = sol[..., :dv], sol[..., dv:]

    q_dec = q * jnp.exp(gc)[..., None]
    k_dec = k * jnp.exp(gc[..., -1:] - gc)[..., None]
    chunk_decay = jnp.exp(gc[..., -1])[..., None, None]

    def step(s, xs):
        u_i, w_i, q_i, k_i, attn_i, d_i = xs
        v_new = u_i - jnp.einsum("bhck,bhkv->bhcv", w_i, s, precision=HIGHEST)
        o_i = jnp.einsum("bhck,bhkv->bhcv", q_i, s, precision=HIGHEST) + jnp.einsum(
            "bhcj,bhjv->bhcv", attn_i, v_new, precision=HIGHEST)
        s = s * d_i + jnp.einsum("bhck,bhcv->bhkv", k_i, v_new, precision=HIGHEST)
        return s, o_i

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, q_dec, k_dec, attn, chunk_decay))
    s, o = jax.lax.scan(step, s0, xs)
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * c, dv)[:, :, :t]
    return jnp.moveaxis(o, 1, 2).astype(out_dtype), s


# ---------------------------------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------------------------------
def err_stats(got, want) -> tuple[float, float]:
    """(max, RMS) of |got − want| in float64."""
    e = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    return float(e.max()), float(np.sqrt(np.mean(e ** 2)))


@dataclass
class ModelRow:
    config: str
    case: str  # kind, or "pooled …"
    seed: int | None
    shape: str
    hf_max: float
    hf_rms: float
    q_max: float
    q_rms: float
    f64_rel: float  # qjax float64 max error / max |truth|
    scale: float  # max |truth logit| on real positions
    between: float  # max |qjax f32 − transformers f32|
    flips: int = 0  # (layer, real token) pairs whose router top-k set differs, transformers f32 vs the truth
    first_flip: str = ""  # where the first one is, and the truth's gap between its k-th and (k+1)-th router logit


class RouterTap:
    """Forward hooks on every layer's router (``mlp.gate``, transformers' ``Qwen3_5MoeTopKRouter``) of a model:
    the router logits ``[N, E]`` and chosen experts ``[N, k]`` of the last forward, per layer."""

    def __init__(self, model):
        self.out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for i, layer in enumerate(model.model.layers):
            layer.mlp.gate.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def f(_module, _inputs, out):
            self.out[i] = (out[0].detach().double().numpy(), out[2].detach().numpy())
        return f


def router_flips(tap32: RouterTap, tap64: RouterTap, real: np.ndarray) -> tuple[int, str]:
    """How many (layer, real token) pairs route to a different expert set in float32 than in the truth, and the
    first such pair (lowest layer, then token) with the truth's gap between its k-th and (k+1)-th router logit."""
    n, first = 0, ""
    flat_real = real.reshape(-1)
    for i in sorted(tap64.out):
        lg64, idx64 = tap64.out[i]
        _, idx32 = tap32.out[i]
        differ = (np.sort(idx32, -1) != np.sort(idx64, -1)).any(-1) & flat_real
        n += int(differ.sum())
        if differ.any() and not first:
            tok = int(np.argmax(differ))
            k = idx64.shape[-1]
            srt = np.sort(lg64[tok])[::-1]
            b, t = divmod(tok, real.shape[1])
            first = f"layer {i}, row {b} pos {t}: truth's k-th − (k+1)-th router logit {srt[k - 1] - srt[k]:.1e}"
    return n, first


def load_models(log) -> dict:
    """Per config: the seed-0 transformers model (float32), its float64 truth and qjax float32 / float64 models."""
    from oracles.hf import float64_truth, make_hf_model, odd_text_config, save_hf, tiny_text_config

    import qjax

    models = {}
    for name, cfg in (("tiny", tiny_text_config()), ("odd", odd_text_config())):
        hf = make_hf_model(cfg, seed=0)
        truth = float64_truth(hf)
        with tempfile.TemporaryDirectory(prefix=f"qjax-precision-{name}-") as folder:
            save_hf(hf, folder)
            m32 = qjax.load_model(folder)
            m64 = qjax.load_model(folder, dtype="float64")
        log(f"--- {name}: transformers attn={hf.config._attn_implementation}, "
            f"experts={hf.config._experts_implementation}; truth experts={truth.config._experts_implementation}")
        models[name] = dict(cfg=cfg, hf=hf, truth=truth, m32=m32, m64=m64)
    return models


def model_accuracy(models: dict, log) -> list[ModelRow]:
    from oracles.hf import INPUT_KINDS, hf_logits, input_case

    rows: list[ModelRow] = []
    rms = lambda e: float(np.sqrt(np.mean(e ** 2)))  # noqa: E731
    for name, m in models.items():
        hf, truth, m32, m64 = m["hf"], m["truth"], m["m32"], m["m64"]
        tap32, tap64 = RouterTap(hf), RouterTap(truth)
        errs = []
        for kind in INPUT_KINDS:
            for seed in SEEDS[kind]:
                ids, mask, pos = input_case(kind, m["cfg"]["vocab_size"], seed)
                real = np.ones(ids.shape, bool) if mask is None else mask.astype(bool)
                want = hf_logits(truth, ids, mask, pos)
                assert want.dtype == np.float64
                want = want[real]
                got_hf = hf_logits(hf, ids, mask, pos).astype(np.float64)[real]
                flips, first = router_flips(tap32, tap64, real)
                got_q = np.asarray(m32(ids, attention_mask=mask, position_ids=pos), np.float64)[real]
                out64 = np.asarray(m64(ids, attention_mask=mask, position_ids=pos))
                assert out64.dtype == np.float64
                got_64 = out64[real]
                hf_max, hf_rms = err_stats(got_hf, want)
                q_max, q_rms = err_stats(got_q, want)
                scale = float(np.abs(want).max())
                row = ModelRow(name, kind, seed, "×".join(map(str, ids.shape)), hf_max, hf_rms, q_max, q_rms,
                               float(np.abs(got_64 - want).max()) / scale, scale,
                               float(np.abs(got_q - got_hf).max()), flips, first)
                rows.append(row)
                errs.append((row, got_hf - want, got_q - want, got_64 - want, want, got_q - got_hf))
                log(f"{name:4s} {kind:11s} seed {seed}: transformers f32 max {hf_max:.2e} rms {hf_rms:.2e} | "
                    f"qjax f32 max {q_max:.2e} rms {q_rms:.2e} | ratios max {q_max / hf_max:.2f} "
                    f"rms {q_rms / hf_rms:.2f} | qjax f64 rel {row.f64_rel:.1e} | router flips {flips} {first}")
        groups = [("pooled", errs)]
        if any(e[0].flips for e in errs):
            groups.append(("pooled, cases without a router flip", [e for e in errs if not e[0].flips]))
        for label, group in groups:
            cat = [np.concatenate([e[j].ravel() for e in group]) for j in range(1, 6)]
            scale = float(np.abs(cat[3]).max())
            rows.append(ModelRow(name, label, None, f"{len(cat[3])} logits", float(np.abs(cat[0]).max()),
                                 rms(cat[0]), float(np.abs(cat[1]).max()), rms(cat[1]),
                                 float(np.abs(cat[2]).max()) / scale, scale, float(np.abs(cat[4]).max()),
                                 sum(e[0].flips for e in group)))
    return rows


@dataclass
class GdnRow:
    shape: str
    impl: str
    o_max: float
    o_rms: float
    s_max: float  # final state max error
    o_scale: float  # max |truth output|


def gdn_accuracy(log) -> list[GdnRow]:
    import jax
    import jax.numpy as jnp
    import torch
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule

    from qjax.model.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule

    rows: list[GdnRow] = []
    for label, sh in GDN_SHAPES.items():
        x32 = gdn_inputs(**sh)
        desc = (f"B={sh['b']} T={sh['t']} Hk={sh['hk']} Hv={sh['hv']} Dk={sh['dk']} Dv={sh['dv']}")
        o_t, s_t = jax.jit(chunk_gated_delta_rule)(*(jnp.asarray(x, jnp.float64) for x in x32))
        o_t, s_t = np.asarray(o_t), np.asarray(s_t)
        assert o_t.dtype == np.float64 and s_t.dtype == np.float64
        xj = tuple(jnp.asarray(x, jnp.float32) for x in x32)
        impls = {
            "qjax chunked (two-float cumsum)": jax.jit(chunk_gated_delta_rule),
            "chunked, single cumsum (before)": jax.jit(chunk_gated_delta_rule_single_cumsum),
            "qjax recurrent (token by token)": jax.jit(recurrent_gated_delta_rule),
        }
        outs = {}
        for impl, fn in impls.items():
            o, s = fn(*xj)
            assert o.dtype == jnp.float32 and s.dtype == jnp.float32
            outs[impl] = (np.asarray(o), np.asarray(s))
        with torch.no_grad():
            o, s = torch_chunk_gated_delta_rule(*(torch.from_numpy(x) for x in x32), output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
        assert o.dtype == torch.float32
        outs["transformers torch_chunk_gated_delta_rule"] = (o.numpy(), s.numpy())
        scale = float(np.abs(o_t).max())
        for impl, (o, s) in outs.items():
            o_max, o_rms = err_stats(o, o_t)
            s_max, _ = err_stats(s, s_t)
            rows.append(GdnRow(desc, impl, o_max, o_rms, s_max, scale))
            log(f"GDN {label} {impl:42s} out max {o_max:.2e} rms {o_rms:.2e} | state max {s_max:.2e}")
    return rows


def forward_ids() -> np.ndarray:
    """The ids of the timed model forward: ``[4, 256]`` in the tiny config's vocabulary."""
    return np.random.default_rng(7).integers(0, 512, (4, 256)).astype(np.int32)


@dataclass
class CostRow:
    what: str
    a_name: str
    a: float
    b_name: str
    b: float
    n: int
    a_min: float = float("nan")
    b_min: float = float("nan")

    @property
    def ratio(self) -> float:
        return self.a / self.b


def cost(models: dict, repeats: int, log) -> list[CostRow]:
    import jax
    import jax.numpy as jnp

    from qjax.model.gdn import chunk_gated_delta_rule

    rows: list[CostRow] = []
    cur, old = jax.jit(chunk_gated_delta_rule), jax.jit(chunk_gated_delta_rule_single_cumsum)
    sh = dict(GDN_SHAPES["large"])
    for t in (512, 2048):
        if t == 2048:
            # the pair's estimated time at 2048: 4× the 512 medians per run, (repeats + 1) runs each
            est = 4 * (rows[-1].a + rows[-1].b) * (repeats + 1)
            if est >= 10.0:
                log(f"GDN T=2048 skipped: estimated {est:.1f}s ≥ 10 s")
                break
        sh["t"] = t
        xj = tuple(jnp.asarray(x) for x in gdn_inputs(**sh))
        tm = bench({"cur": lambda xj=xj: jax.block_until_ready(cur(*xj)),
                    "old": lambda xj=xj: jax.block_until_ready(old(*xj))}, repeats)
        desc = f"chunked GDN, float32, B=1 T={t} Hk=16 Hv=32 Dk=Dv=128"
        rows.append(CostRow(desc, "two-float cumsum (current)", tm["cur"].median, "single cumsum (before)",
                            tm["old"].median, repeats, min(tm["cur"].runs), min(tm["old"].runs)))
        log(f"{desc}: current {tm['cur'].median * 1e3:.1f} ms, before {tm['old'].median * 1e3:.1f} ms, "
            f"ratio {tm['cur'].median / tm['old'].median:.3f}")

    m32, m64 = models["tiny"]["m32"], models["tiny"]["m64"]
    ids = forward_ids()
    tm = bench({"f64": lambda: jax.block_until_ready(m64(ids)), "f32": lambda: jax.block_until_ready(m32(ids))},
               repeats)
    desc = "tiny model forward `model(ids)`, ids [4, 256]"
    rows.append(CostRow(desc, "float64 mode", tm["f64"].median, "float32", tm["f32"].median, repeats,
                        min(tm["f64"].runs), min(tm["f32"].runs)))
    log(f"{desc}: float64 {tm['f64'].median * 1e3:.1f} ms, float32 {tm['f32'].median * 1e3:.1f} ms, "
        f"ratio {tm['f64'].median / tm['f32'].median:.2f}")
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------------------------------
def machine() -> str:
    cpu, cores = platform.processor() or "?", str(os.cpu_count())
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)}
        cpu, cores = info.get("Model name", cpu), info.get("CPU(s)", cores)
    except (OSError, subprocess.CalledProcessError):
        pass
    return f"{cpu}, {cores} cores"


def versions() -> str:
    import jax
    import jaxlib
    import torch
    import transformers
    return (f"jax {jax.__version__} (jaxlib {jaxlib.__version__}, backend {jax.default_backend()}), "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
            f"numpy {np.__version__}, python {platform.python_version()}")


def _rng(xs) -> str:
    return f"{min(xs):.2f}–{max(xs):.2f}×"


def markdown(model_rows: list[ModelRow], gdn_rows: list[GdnRow], cost_rows: list[CostRow], wall: float,
             load: tuple[float, float]) -> str:
    date = (subprocess.run(["date", "-u"], capture_output=True, text=True).stdout.strip()
            or datetime.datetime.now(datetime.timezone.utc).isoformat())
    out = [SECTION, "",
           f"- date: {date}",
           f"- machine: {machine()}; 1-min load average {load[0]:.1f} at start, {load[1]:.1f} at end",
           f"- command: `python {' '.join(shlex.quote(a) for a in sys.argv)}` (total {wall:.0f} s)",
           f"- qjax: commit {git_state()}",
           f"- versions: {versions()}",
           f"- XLA_FLAGS: `{os.environ.get('XLA_FLAGS', '')}`",
           "- method: the docstring of `benchmarks/precision.py`. Errors are against the float64 truth, on real "
           "(unmasked) positions; ratio = qjax / transformers (< 1: qjax closer to the truth).",
           "",
           "### Model logits: float32 error against the float64 truth",
           "",
           "transformers float32 = the seed-0 model itself (eager attention, default experts implementation); truth = "
           "the same weights in float64 everywhere; router flips = (layer, real token) pairs whose top-k expert set "
           "in transformers float32 differs from the truth's.",
           "",
           "| config | case (seed) | shape | transformers f32 max | qjax f32 max | max ratio | transformers f32 RMS "
           "| qjax f32 RMS | RMS ratio | max \\|qjax f32 − transformers f32\\| | router flips | "
           "qjax f64 max / max\\|truth\\| | max\\|truth\\| |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in model_rows:
        case = f"**{r.case}**" if r.seed is None else f"{r.case} ({r.seed})"
        out.append(f"| {r.config} | {case} | {r.shape} | {r.hf_max:.2e} | {r.q_max:.2e} | {r.q_max / r.hf_max:.2f} | "
                   f"{r.hf_rms:.2e} | {r.q_rms:.2e} | {r.q_rms / r.hf_rms:.2f} | {r.between:.1e} | {r.flips} | "
                   f"{r.f64_rel:.1e} | {r.scale:.2f} |")
    flipped = [r for r in model_rows if r.seed is not None and r.flips]
    if flipped:
        out += [""] + [f"First router flip in {r.config} {r.case} ({r.seed}): {r.first_flip}." for r in flipped]
    out += ["", "### Chunked gated delta rule alone: float32 error against qjax's chunked form in float64", "",
            "Inputs rounded to float32 first (the truth runs on the same values); output `o [B, T, Hv, Dv]` and the "
            "final state `[B, Hv, Dk, Dv]`.", "",
            "| shape | implementation (float32) | output max | output RMS | output RMS / qjax chunked | "
            "final state max | max\\|truth o\\| |",
            "|---|---|---|---|---|---|---|"]
    for r in gdn_rows:
        ref = next(x for x in gdn_rows if x.shape == r.shape and x.impl.startswith("qjax chunked"))
        out.append(f"| {r.shape} | {r.impl} | {r.o_max:.2e} | {r.o_rms:.2e} | {r.o_rms / ref.o_rms:.2f} | "
                   f"{r.s_max:.2e} | {r.o_scale:.2f} |")
    out += ["", "### Cost", "",
            "Jitted, `block_until_ready`; median [min] of n interleaved runs after one warm-up call each.", "",
            "| what | A | A (ms) | B | B (ms) | A / B (medians) | n |",
            "|---|---|---|---|---|---|---|"]
    for r in cost_rows:
        out.append(f"| {r.what} | {r.a_name} | {r.a * 1e3:.1f} [{r.a_min * 1e3:.1f}] | {r.b_name} | "
                   f"{r.b * 1e3:.1f} [{r.b_min * 1e3:.1f}] | {r.ratio:.2f} | {r.n} |")

    # what this shows: the measured numbers, nothing else
    cases = [r for r in model_rows if r.seed is not None]
    pooled = [r for r in model_rows if r.seed is None]
    over = [r for r in cases if r.q_rms > RMS_RATIO_BOUND * r.hf_rms]
    gd = {(r.shape, r.impl): r for r in gdn_rows}
    shapes = list(dict.fromkeys(r.shape for r in gdn_rows))
    text = [
        f"Over the {len(cases)} cases, qjax float32's RMS logit error is {_rng([r.q_rms / r.hf_rms for r in cases])} "
        f"transformers float32's and its max error {_rng([r.q_max / r.hf_max for r in cases])} ("
        + "; ".join(f"{p.config} {p.case}: RMS {p.q_rms / p.hf_rms:.2f}×, max {p.q_max / p.hf_max:.2f}×"
                    for p in pooled) + "); "
        + (f"{len(over)} case(s) exceed {RMS_RATIO_BOUND}× in RMS ("
           + ", ".join(f"{r.config} {r.case} {r.seed}: {r.q_rms / r.hf_rms:.2f}×" for r in over) + ")."
           if over else f"no case exceeds {RMS_RATIO_BOUND}× in RMS."),
    ]
    for r in flipped:
        text.append(
            f"In {r.config} {r.case} ({r.seed}) float32 routes {r.flips} (layer, token) pairs to a different expert "
            f"set than the truth ({r.first_flip}): both float32 implementations are {r.hf_max:.2e} (transformers) and "
            f"{r.q_max:.2e} (qjax) off at max there, while they differ from each other by at most {r.between:.1e}.")
    text.append(f"qjax float64's largest error is {max(r.f64_rel for r in cases):.1e} of max |truth logit| "
                f"(all {len(cases)} cases).")
    for sh in shapes:
        cur, old = gd[(sh, "qjax chunked (two-float cumsum)")], gd[(sh, "chunked, single cumsum (before)")]
        rec, hft = gd[(sh, "qjax recurrent (token by token)")], gd[(sh, "transformers torch_chunk_gated_delta_rule")]
        text.append(
            f"Chunked GDN at {sh}: output RMS error {cur.o_rms:.2e} with the two-float cumulative sum vs "
            f"{old.o_rms:.2e} with the single cumsum ({old.o_rms / cur.o_rms:.1f}×), max {cur.o_max:.2e} vs "
            f"{old.o_max:.2e}, final state max {cur.s_max:.2e} vs {old.s_max:.2e}; the float32 recurrence "
            f"{rec.o_rms:.2e} RMS, transformers' float32 chunked form {hft.o_rms:.2e} RMS.")
    for r in cost_rows:
        text.append(f"{r.what}: {r.a_name} {r.a * 1e3:.1f} ms vs {r.b_name} {r.b * 1e3:.1f} ms "
                    f"({r.ratio:.2f}×, medians; fastest runs {r.a_min * 1e3:.1f} vs {r.b_min * 1e3:.1f} ms).")
    out += ["", "What this shows (measured in this run):", ""] + [f"- {t}" for t in text]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per cost measurement (median reported)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/RESULTS.md alone")
    args = ap.parse_args(argv)

    import jax
    jax.config.update("jax_enable_x64", True)  # for the float64 parts; float32 computations are unchanged by it
    import torch
    torch.set_num_threads(2)
    import transformers
    transformers.logging.set_verbosity_error()

    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    log = lambda s: print(s, flush=True)  # noqa: E731
    models = load_models(log)
    model_rows = model_accuracy(models, log)
    log(f"[model accuracy {time.perf_counter() - t0:.0f}s]")
    gdn_rows = gdn_accuracy(log)
    log(f"[gdn accuracy {time.perf_counter() - t0:.0f}s]")
    cost_rows = cost(models, args.repeats, log)
    md = markdown(model_rows, gdn_rows, cost_rows, time.perf_counter() - t0, (load0, os.getloadavg()[0]))
    print("\n" + md)
    if not args.no_write:
        write_section(md, RESULTS, SECTION)
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
