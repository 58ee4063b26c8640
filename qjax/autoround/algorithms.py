"""The block algorithms other than AutoRound that ``qjax quantize --algorithm`` runs inside the driver's streamed
block loop (:mod:`.driver`): AWQ (:mod:`.awq`) and GPTQ (:mod:`.gptq`) as llm-compressor's modifiers apply them.

The driver owns everything around a block — reading it, the float and quantized calibration streams, progress /
resume, the memory plan, the export — and hands each block to an algorithm object as :class:`BlockInputs`; the
algorithm returns :class:`BlockOutput`: every quantized unit as a :class:`~.results.UnitResult` (compressed-tensors'
codes, packed as RTN / AutoRound results are) and the float tensors it changed (AWQ's smoothed norms, the router and
the shared-expert gate, compensated), which the progress folder keeps and the export writes over the source's.

Both quantize with compressed-tensors' min/max observer (:func:`qjax.quant.fake_quant.qparams`), the scales rounded
to ``scale_dtype`` before the codes are chosen, so the stored scale is the one the codes were made for.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.kernels import route, silu
from qjax.model.config import LINEAR
from qjax.quant import fake_quant
from qjax.quant.packing import pack_int32

from . import awq, blocks, gptq
from .results import UnitResult
from .schemes import Scheme

logger = logging.getLogger("qjax.autoround")

AUTO_ROUND, RTN, AWQ, GPTQ = "auto_round", "rtn", "awq", "gptq"
NAMES = (AUTO_ROUND, RTN, AWQ, GPTQ)

NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
ROUTER_W, SHARED_GATE_W = "mlp.gate.weight", "mlp.shared_expert_gate.weight"


class AlgorithmError(ValueError):
    """A block the algorithm cannot quantize correctly (one line, naming the layer)."""


@dataclasses.dataclass(frozen=True)
class BlockInputs:
    """What the driver gives an algorithm for block ``index``: the float layer, its quantized units with their
    schemes, its calibration input stream ``x [n, T, H]`` (the driver's choice of the float or the quantized stream)
    and ``ctx(b)`` (a ``[b, T]`` batch's step context)."""

    index: int
    kind: str
    layer: object
    units: tuple  # ((Unit, Scheme), …)
    x: jax.Array
    ctx: Callable
    batch_size: int
    mcfg: object
    scale_dtype: str


@dataclasses.dataclass
class BlockOutput:
    results: dict[str, UnitResult]
    floats: dict[str, np.ndarray]  # layer-relative ``…weight`` key → the changed float tensor, in the layer dtype


# ---------------------------------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------------------------------
def observer_qparams(w: jax.Array, s: Scheme, scale_dtype: str) -> tuple[jax.Array, jax.Array]:
    """compressed-tensors' min/max qparams with the scale rounded to ``scale_dtype`` (what the checkpoint stores)."""
    scale, zp = fake_quant.qparams(w, bits=s.bits, symmetric=s.sym, group_size=s.group_size)
    dt = jnp.dtype(scale_dtype)
    rounded = scale.astype(dt)
    # a scale below the dtype's range would store 0 (codes w / 0); its smallest subnormal instead
    rounded = jnp.where(rounded == 0, jnp.asarray(jnp.finfo(dt).smallest_subnormal, dt), rounded)
    return rounded.astype(jnp.float32), zp


def pack_result(codes, scale, zp, s: Scheme, scale_dtype: str) -> UnitResult:
    """The unit's :class:`UnitResult` from its integer ``codes [*lead, N, K]`` and qparams, packed as
    compressed-tensors' signed codes."""
    q = np.asarray(codes, np.int32)
    zp8 = None if s.sym else np.asarray(zp, np.int8)
    return UnitResult(s, pack_int32(q, s.bits), np.asarray(scale, np.float32), q.shape[-1], zp8, scale_dtype)


@functools.partial(jax.jit, static_argnames=("s", "scale_dtype"))
def rtn_codes(w, *, s: Scheme, scale_dtype: str):
    """Min/max RTN of ``w``: (codes, scale, zp) — one program per shape and scheme (op by op they were dozens)."""
    scale, zp = observer_qparams(w.astype(jnp.float32), s, scale_dtype)
    return fake_quant.quantize_codes(w, scale, zp, bits=s.bits), scale, zp


def check_schemes(units, name: str) -> None:
    for u, s in units:
        if s.is_mxfp8 or s.data_type != "int":
            raise AlgorithmError(f"--algorithm {name} quantizes INT schemes; {u.name} is {s.describe()}")


def _with_weights(graphdef, state, weights):
    flat = [(p, v.replace(weights[tuple(p)])) for p, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---------------------------------------------------------------------------------------------------------------------
# AWQ
# ---------------------------------------------------------------------------------------------------------------------
def compensate(w: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The router / shared-expert gate after ``post_attention_layernorm`` is divided by ``scales``: their columns
    multiplied by them (llm-compressor leaves the router out: seed 002's bug; a test swaps this for the identity)."""
    return awq.balance(w, scales)


def router_tolerance(dtype) -> float:
    """max |Δ| / max |before| the router check allows (:class:`awq.RouterCheck`). The compensated folds only
    re-round ``(1 + w) / s`` and ``W · s`` in the layer dtype: measured (W4 g64, 8 × 64 calibration tokens) bf16
    ≤ 1.4e-3 on the built-in model and ≤ 3.8e-3 on the tiny test model; float32 ≤ 1.3e-7 (tests/test_awq.py). The
    router left uncompensated (seed 002's bug) is off by 2.2e-2 to 2.4e-1 on the built-in model's layers."""
    return 1e-2 if jnp.dtype(dtype).itemsize < 4 else 1e-5


@functools.lru_cache(maxsize=32)
def _awq_activations(graphdef, kind: str):
    """``(state, x, ctx) → (mixer input, mixer output reference, MoE input residual, MoE input, MoE output)``."""

    def run(state, x, ctx):
        m = nnx.merge(graphdef, state)
        a = m.input_layernorm(x)
        mixer = m.linear_attn if kind == LINEAR else m.self_attn
        out = mixer(a, ctx, None)[0]
        hm = x + out
        mi = m.post_attention_layernorm(hm)
        return a, out, hm, mi, m.mlp(mi)

    return jax.jit(run)


@functools.lru_cache(maxsize=64)
def _parent_loss(graphdef, kind: str, parent: str, balance: tuple):
    """``(state, weights, s, x, ref, ctx) → Σ (parent(x) − ref)²`` f32 with every unit of ``balance = ((unit, scheme),
    …)`` replaced by ``Q(W · s) / s`` (:func:`awq.scaled_qdq`); ``parent``: "mixer" or "mlp"."""

    def loss(state, weights, s, x, ref, ctx):
        new = {u.name: awq.scaled_qdq(blocks.unit_weight(weights, u), s, sc) for u, sc in balance}
        m = _with_weights(graphdef, state, blocks.replace_units(weights, [u for u, _ in balance], new))
        if parent == "mlp":
            out = m.mlp(x)
        else:
            out = (m.linear_attn if kind == LINEAR else m.self_attn)(x, ctx, None)[0]
        d = out.astype(jnp.float32) - ref.astype(jnp.float32)
        return jnp.sum(d * d)

    return jax.jit(loss)


def _grid_losses(loss, scales: np.ndarray, numel: int, *args) -> jax.Array:
    """``[G]`` f32: ``loss(*args[:2], s, *args[2:]) / numel`` for every row ``s`` of ``scales [G, K]``, dispatched
    one after the other without waiting (the host reads them back once, for the whole grid).

    One compiled program per point, the one a single call runs: every loss is the per-point program's, bit for
    bit. A program over the whole grid (``lax.map`` / ``vmap``) runs each point's matmuls and sums inside another
    program, which XLA may compile with another float summation order — measured on a dense-JAX MoE block
    (tests' harness): ``lax.map`` moved losses by 3e-7 relative, enough to flip a near-tie."""
    return jnp.stack([loss(*args[:2], s, *args[2:]) for s in scales]) / numel


@functools.lru_cache(maxsize=16)
def _down_loss(scheme: Scheme):
    """``(inter [N, I], down [H, I], s [I], ref [N, H]) → Σ (inter · Q(down · s) / sᵀ − ref)²``."""

    def loss(inter, down, s, ref):
        d = inter @ awq.scaled_qdq(down, s, scheme).T - ref
        return jnp.sum(d * d)

    return jax.jit(loss)


@jax.jit
def _intermediate(x, gate, up):
    """SiLU(x gateᵀ) · (x upᵀ) in f32: a down projection's input (``x [N, H]``, ``gate``/``up`` ``[I, H]``)."""
    x = x.astype(jnp.float32)
    return silu(x @ gate.astype(jnp.float32).T) * (x @ up.astype(jnp.float32).T)


def _committed(x) -> jax.Array:
    """``x`` on its device, committed: the first block's stream arrives uncommitted and the later ones committed
    (the previous block's outputs), and jit compiles a program again for a changed commitment — every parent loss
    and the activations twice. On a numpy array: the default device."""
    x = jnp.asarray(x)
    return jax.device_put(x, next(iter(x.devices())))


@dataclasses.dataclass(frozen=True)
class AWQAlgorithm:
    """AWQ per block: for each of llm-compressor's mappings (:data:`awq.MAPPINGS`, in its order) the grid search on
    the block's calibration input (every parent's input and float output from one forward of the float layer, as
    llm-compressor caches them), the chosen scales folded — smooth layer divided, balance layers multiplied, and
    qjax's addition, the router and the shared-expert gate compensated, checked on the block's tokens
    (:func:`awq.router_check`) — then min/max RTN of the smoothed weights."""

    cfg: awq.AWQConfig = dataclasses.field(default_factory=awq.AWQConfig)
    name: str = AWQ

    def float_tensors(self, mcfg, kind: str, quantized) -> dict[str, tuple]:
        """The float tensors AWQ changes in a layer of ``kind`` whose quantized units are named in ``quantized``:
        ``{key: shape}`` — the norms, the router and the shared-expert gate by their ``….weight`` keys, and every
        balance or smooth unit left unquantized (``--ignore_layers``, shapes the scheme cannot group) by its unit
        name (its stacked ``[E, out, in]`` shape for experts)."""
        h, e = mcfg.hidden_size, mcfg.num_experts
        out = {NORMS[0]: (h,), NORMS[1]: (h,), ROUTER_W: (e, h), SHARED_GATE_W: (1, h)}
        for u in blocks.layer_units(mcfg, kind):
            if u.name in _touched(kind) and u.name not in quantized:
                out[u.name] = ((e, *u.shape) if u.experts else u.shape)
        return out

    def working_bytes(self, mcfg, kind: str, tokens: int, itemsize: int, activations: int, batches: int) -> int:
        """An estimate of a block's working set for the memory plan: the five cached parent inputs / outputs
        (``tokens × hidden`` each), one down projection's f32 input and output, the parent forwards on the whole
        stream (``batches`` × the plan's ``activations`` of one minibatch) and a copy of the block's weights being
        folded."""
        h = mcfg.hidden_size
        inter = max(mcfg.moe_intermediate_size, mcfg.shared_expert_intermediate_size)
        weights = sum((mcfg.num_experts if u.experts else 1) * u.shape[0] * u.shape[1]
                      for u in blocks.layer_units(mcfg, kind)) * itemsize
        return 5 * tokens * h * itemsize + tokens * (inter + h) * 4 + activations * batches + weights

    def quantize_block(self, b: BlockInputs) -> BlockOutput:
        check_schemes(b.units, AWQ)
        schemes = {u.name: s for u, s in b.units}
        units = {u.name: u for u in blocks.layer_units(b.mcfg, b.kind)}
        stem = f"model.layers.{b.index}."
        graphdef, state = nnx.split(b.layer)
        weights = blocks.weights_of(b.layer)
        dtype = weights[("post_attention_layernorm", "weight")].dtype
        n = b.x.shape[0]
        ctx = b.ctx(n)
        a, mix_ref, hm, mi, moe_ref = _awq_activations(graphdef, b.kind)(state, _committed(b.x), ctx)
        host = {k: np.asarray(v) for k, v in weights.items()}  # the folds run on the host, as llm-compressor's
        names = {"post_attention_layernorm": ("post_attention_layernorm", "weight"),
                 awq.ROUTER: ("mlp", "gate", "weight"), "mlp.shared_expert_gate": ("mlp", "shared_expert_gate", "weight")}
        orig = {k: host[p] for k, p in names.items()}

        def unit_w(name):
            return np.asarray(blocks.unit_weight(host, units[name]))

        def set_unit(name, w):
            u = units[name]
            cur = host[u.path]
            if u.rows is None:
                host[u.path] = np.asarray(w, cur.dtype)
            else:
                cur = cur.copy()
                cur[..., u.rows[0]:u.rows[1], :] = w
                host[u.path] = cur

        def quantized(names_):
            """The mapping's quantized balance layers with their schemes (the grid search's; an unquantized one is
            still balanced, as llm-compressor does, but has no weight mean and is not fake-quantized)."""
            return tuple((units[nm], schemes[nm]) for nm in names_ if nm in schemes)

        def search(x_flat, bal, losses):
            x_mean = awq.activation_mean(np.asarray(awq.abs_sum(x_flat)), int(np.prod(x_flat.shape[:-1])))
            w_mean = awq.weight_mean([unit_w(u.name) for u, _ in bal], [s for _, s in bal])
            return awq.search_scales(x_mean, w_mean, losses, self.cfg).scales

        # 1. input_layernorm → the mixer's input projections (parent: the mixer)
        mix = awq.MAPPINGS["linear_attention" if b.kind == LINEAR else "full_attention"][1]
        bal = quantized(mix)
        if bal:  # no quantized balance layer: nothing to protect, the mapping is left out
            fn = _parent_loss(graphdef, b.kind, "mixer", bal)
            numel, dev = mix_ref.size, _device(host, weights)
            s = search(a, bal, lambda s_: np.asarray(_grid_losses(fn, s_, numel, state, dev, a, mix_ref, ctx)))
            host[("input_layernorm", "weight")] = awq.smooth_zero_centred_norm(host[("input_layernorm", "weight")], s)
            for nm in mix:
                set_unit(nm, awq.balance(unit_w(nm), s))

        # 2. post_attention_layernorm → experts' gate/up, shared expert gate/up (+ qjax: router, shared-expert gate)
        bal = quantized(_MOE)
        if bal:
            fn = _parent_loss(graphdef, b.kind, "mlp", bal)
            numel, dev = moe_ref.size, _device(host, weights)
            s = search(mi, bal, lambda s_: np.asarray(_grid_losses(fn, s_, numel, state, dev, mi, moe_ref, ctx)))
            key = names["post_attention_layernorm"]
            host[key] = awq.smooth_zero_centred_norm(host[key], s)
            for nm in _MOE:
                set_unit(nm, awq.balance(unit_w(nm), s))
            for k in (names[awq.ROUTER], names["mlp.shared_expert_gate"]):
                host[k] = compensate(host[k], s)

        # 3. each up_proj → its down_proj (parent: down_proj alone; every token, llm-compressor's default
        # moe_calibrate_all_experts); the down inputs from the float weights and the unsmoothed input, as cached
        xm = mi.reshape(-1, mi.shape[-1])
        for up, gate, down in (("mlp.experts.up_proj", "mlp.experts.gate_proj", "mlp.experts.down_proj"),
                               ("mlp.shared_expert.up_proj", "mlp.shared_expert.gate_proj",
                                "mlp.shared_expert.down_proj")):
            if down not in schemes:
                continue
            stacked = units[down].experts  # the shared expert: a stack of one, so both run the same code
            g0, u0 = (blocks.unit_weight(weights, units[nm]) for nm in (gate, up))
            ups, downs = unit_w(up), unit_w(down)
            if not stacked:
                g0, u0, ups, downs = g0[None], u0[None], ups[None], downs[None]
            scales = self._search_down(xm, g0, u0, downs, schemes[down])
            ups = np.stack([awq.smooth_rows(w, s) for w, s in zip(ups, scales)])
            downs = np.stack([awq.balance(w, s) for w, s in zip(downs, scales)])
            set_unit(up, ups if stacked else ups[0])
            set_unit(down, downs if stacked else downs[0])

        # the router check, on this block's calibration tokens
        check = awq.router_check(hm.reshape(-1, hm.shape[-1]), float(b.mcfg.rms_norm_eps), orig,
                                 {k: host[p] for k, p in names.items()})
        tol = router_tolerance(dtype)
        logger.debug("AWQ router check %s%s: %s", stem, awq.ROUTER, check)
        if not check.passes(tol):
            raise AlgorithmError(
                f"AWQ: {stem}mlp.gate: after smoothing post_attention_layernorm the router logits / shared-expert "
                f"gate differ from the float model's by {check.logits_rel:.2e} / {check.shared_gate_rel:.2e} "
                f"(relative, tolerance {tol:.0e}): the router or the shared-expert gate is not compensated")

        results = {}
        for u, sch in b.units:
            results[u.name] = pack_result(*rtn_codes(jnp.asarray(unit_w(u.name), jnp.float32), s=sch,
                                                     scale_dtype=b.scale_dtype), sch, b.scale_dtype)
        floats = {}
        for key in self.float_tensors(b.mcfg, b.kind, schemes):
            floats[key] = unit_w(key) if key in units else np.asarray(host[tuple(key.split("."))])
        return BlockOutput(results, floats)

    def _search_down(self, x, gate, up, down, scheme) -> list[np.ndarray]:
        """Every expert's ``up → down`` mapping: the chosen scales ``[I]`` per expert. The experts share one program
        per step (their shapes are equal) and every grid loss of every expert is dispatched before the host reads
        any back (:func:`_grid_losses`); the host waits once per expert for its activation means, whose grid it
        computes in float64 as llm-compressor does.

        ``x [N, H]`` the MoE input (unsmoothed); ``gate``/``up`` ``[E, I, H]`` the float weights; ``down [E, H, I]``.
        """
        loss, numel = _down_loss(scheme), x.shape[0] * down.shape[1]
        cands, pending = [], []
        for e in range(down.shape[0]):
            inter = _intermediate(x, gate[e], up[e])
            ref = inter @ jnp.asarray(down[e], jnp.float32).T
            x_mean = awq.activation_mean(np.asarray(awq.abs_sum(inter)), inter.shape[0])
            cands.append(awq.candidate_scales(x_mean, awq.weight_mean([down[e]], [scheme]), self.cfg))
            stacked = np.stack(cands[-1]).astype(np.float32)
            pending.append(_grid_losses(loss, stacked, numel, inter, jnp.asarray(down[e]), ref))
        return [awq.choose(c, np.asarray(p), self.cfg).scales for c, p in zip(cands, pending)]


_MOE = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")


def _touched(kind: str) -> set[str]:
    """The units AWQ may change in a layer of ``kind``: every balance layer and every smooth ``up_proj``."""
    mix = awq.MAPPINGS["linear_attention" if kind == LINEAR else "full_attention"][1]
    return {*mix, *_MOE, "mlp.experts.down_proj", "mlp.shared_expert.down_proj"}


def _device(host: dict, like: dict) -> dict:
    """The host weights as device arrays (the parent losses' operands), in the layer's dtypes."""
    return {k: jnp.asarray(v, like[k].dtype) for k, v in host.items()}


# ---------------------------------------------------------------------------------------------------------------------
# GPTQ
# ---------------------------------------------------------------------------------------------------------------------
class _HessianLinear(nnx.Module):
    def __init__(self, inner):
        self.inner = inner

    def __call__(self, x, layer=None):
        k = x.shape[-1]
        self.sow(nnx.Intermediate, "h", gptq.accumulate_hessian(jnp.zeros((k, k), jnp.float32), x))
        self.sow(nnx.Intermediate, "n", jnp.asarray(x.size // k, jnp.float32))
        return self.inner(x, layer)


class _HessianExperts(nnx.Module):
    """Each expert's Hessians from the tokens the router sends it: its gate/up input and its down input."""

    def __init__(self, inner):
        self.inner = inner

    def routed(self, x, router_logits, top_k: int, layer=None):
        _, idx = route(router_logits, top_k)
        gu, dn = self.inner.gate_up_proj[...], self.inner.down_proj[...]
        e, h, inter = gu.shape[0], x.shape[-1], dn.shape[-1]
        h_in, count = gptq.routed_hessians(x, idx, jnp.zeros((e, h, h), jnp.float32))
        mask = jax.nn.one_hot(idx, e, dtype=jnp.float32).sum(axis=1)  # [N, E]

        def down(j):
            a = _intermediate(x, gu[j, :inter], gu[j, inter:])
            return gptq.accumulate_hessian(jnp.zeros((inter, inter), jnp.float32), a, mask[:, j])

        self.sow(nnx.Intermediate, "h_in", h_in)
        self.sow(nnx.Intermediate, "h_down", jax.lax.map(down, jnp.arange(e)))
        self.sow(nnx.Intermediate, "count", count)
        return self.inner.routed(x, router_logits, top_k, layer)


def _parent(module, path):
    for name in path:
        module = getattr(module, name)
    return module


def _first(v):
    if isinstance(v, dict):
        return v[0] if 0 in v else next(iter(v.values()))
    return v[0] if isinstance(v, (tuple, list)) else v


def hessians(layer, x: jax.Array, units, ctx, batch_size: int) -> dict[str, tuple]:
    """``{unit: (H normalised [*lead, K, K], no_tokens [*lead] or None)}`` of the float layer on stream ``x``: a dense
    unit's from every token, an expert unit's from its routed tokens only (the router's own choices)."""
    probe = nnx.merge(*nnx.split(layer))
    dense = [u for u, _ in units if not u.experts]
    for u in dense:
        parent = _parent(probe, u.path[:-2])
        if not isinstance(getattr(parent, u.path[-2]), _HessianLinear):
            setattr(parent, u.path[-2], _HessianLinear(getattr(parent, u.path[-2])))
    if any(u.experts for u, _ in units):
        probe.mlp.experts = _HessianExperts(probe.mlp.experts)
    graphdef, state = nnx.split(probe)
    run = _hessian_fn(graphdef)
    total = None
    for s in range(0, x.shape[0], batch_size):
        xb = x[s:s + batch_size]
        got = run(state, _committed(xb), ctx(xb.shape[0]))  # one program for every block (_committed)
        total = got if total is None else jax.tree.map(jnp.add, total, got)
    out = {}
    for u in dense:
        node = total
        for name in u.path[:-1]:
            node = node[name]
        out[u.name] = (gptq.normalise(_first(node["h"]), _first(node["n"])), None)
    if any(u.experts for u, _ in units):
        node = total["mlp"]["experts"]
        count = _first(node["count"])
        n = jnp.maximum(count, 1.0)[:, None, None]
        for u, _ in units:
            if u.experts:
                h = _first(node["h_down"] if u.name.endswith("down_proj") else node["h_in"])
                out[u.name] = (h / n, count == 0)
    return out


@functools.lru_cache(maxsize=16)
def _hessian_fn(graphdef):
    def run(state, x, ctx):
        m = nnx.merge(graphdef, state)
        # flax ≥ 0.12.x collects sown values with nnx.capture and deprecates sow outside it; 0.12.0 (our floor) has
        # no capture: the values are popped from the module there
        if hasattr(nnx, "capture"):
            _, sown = nnx.capture(m, nnx.Intermediate)(x, ctx, None)
            return nnx.to_pure_dict(sown)
        m(x, ctx, None)
        return nnx.to_pure_dict(nnx.pop(m, nnx.Intermediate))

    return jax.jit(run)


@dataclasses.dataclass(frozen=True)
class GPTQAlgorithm:
    """GPTQ per block: every unit's Hessian from one forward of the float layer on the block's calibration input
    (experts: routed tokens only), then :func:`gptq.quantize_weight` with the observer's qparams."""

    cfg: gptq.GPTQConfig = dataclasses.field(default_factory=gptq.GPTQConfig)
    name: str = GPTQ

    def float_tensors(self, mcfg, kind: str, quantized) -> dict[str, tuple]:
        return {}

    def working_bytes(self, mcfg, kind: str, tokens: int, itemsize: int, activations: int, batches: int) -> int:
        """An estimate for the memory plan: every unit's f32 Hessian, accumulated and normalised (``[E, K, K]`` for
        experts), one minibatch's forward (``activations``) and GPTQ's own working set, a few f32 copies of the
        largest unit."""
        units = blocks.layer_units(mcfg, kind)
        hess = sum((mcfg.num_experts if u.experts else 1) * u.shape[1] ** 2 * 4 * 2 for u in units)
        biggest = max((mcfg.num_experts if u.experts else 1) * u.shape[0] * u.shape[1] for u in units)
        return hess + 4 * biggest * 4 + activations

    def quantize_block(self, b: BlockInputs) -> BlockOutput:
        check_schemes(b.units, GPTQ)
        hs = hessians(b.layer, b.x, b.units, b.ctx, b.batch_size)
        weights = blocks.weights_of(b.layer)
        results = {}
        for u, s in b.units:
            w = blocks.unit_weight(weights, u).astype(jnp.float32)
            h, no_tokens = hs[u.name]
            results[u.name] = quantize_unit(w, h, s, self.cfg, b.scale_dtype, no_tokens)
        return BlockOutput(results, {})


def quantize_unit(w, h, s: Scheme, cfg: gptq.GPTQConfig, scale_dtype: str, no_tokens=None) -> UnitResult:
    """GPTQ of one unit's weight with its Hessian, packed: :func:`gptq.quantize_weight` on the observer's qparams
    (scale rounded to ``scale_dtype``), then :func:`pack_result`."""
    return pack_result(*_gptq_codes(w, h, no_tokens, s=s, cfg=cfg, scale_dtype=scale_dtype), s, scale_dtype)


@functools.partial(jax.jit, static_argnames=("s", "cfg", "scale_dtype"))
def _gptq_codes(w, h, no_tokens, *, s: Scheme, cfg: gptq.GPTQConfig, scale_dtype: str):
    """(codes, scale, zp) of GPTQ; the codes of the dequantized weight with the same qparams are exact (its values
    are on the grid)."""
    w = w.astype(jnp.float32)
    scale, zp = observer_qparams(w, s, scale_dtype)
    deq, scale, zp, _, _ = gptq.quantize_weight(w, h, s, cfg, scale=scale, zero_point=zp, no_tokens=no_tokens)
    return fake_quant.quantize_codes(deq, scale, zp, bits=s.bits), scale, zp


def make(name: str, *, duo_scaling=None, n_grid=None, block_size=None, dampening_frac=None, actorder="unset"):
    """The algorithm object for ``--algorithm`` ``name`` (None for auto_round / rtn: the driver's own tuning), its
    options checked (one line each); an option of another algorithm is refused."""
    awq_opts = {k: v for k, v in (("duo_scaling", duo_scaling), ("n_grid", n_grid)) if v is not None}
    gptq_opts = {k: v for k, v in (("block_size", block_size), ("dampening_frac", dampening_frac)) if v is not None}
    if actorder != "unset":  # None is a value here (no activation order)
        gptq_opts["actorder"] = actorder
    if name != AWQ and awq_opts:
        raise ValueError(f"--{next(iter(awq_opts))} is an AWQ option (--algorithm awq)")
    if name != GPTQ and gptq_opts:
        raise ValueError(f"--{next(iter(gptq_opts))} is a GPTQ option (--algorithm gptq)")
    if name == AWQ:
        return AWQAlgorithm(awq.AWQConfig(**awq_opts))
    if name == GPTQ:
        return GPTQAlgorithm(gptq.GPTQConfig(**gptq_opts))
    return None


def describe(alg) -> dict:
    """The algorithm and its options, as a run's fingerprint records them."""
    return {} if alg is None else {"algorithm": alg.name, "algorithm_options": dataclasses.asdict(alg.cfg)}
