"""The per-block AutoRound (SignRound) loop: docs/autoround.md §19 in JAX.

    fp_in = q_in = embed(calibration ids)
    for each decoder layer:
        fp_out = layer(fp_in)                                   # target: float layer on the float stream
        tune V, α, β of every quantizable projection so that layer_q(q_in) ≈ fp_out   (sign-SGD, best iteration kept)
        q_in, fp_in = layer_q(q_in), fp_out                    # two streams continue

Every tuning iteration (clamp α/β → qdq every weight → layer forward → token-masked MSE → sign-SGD step, best-so-far
bookkeeping) is one jitted step; ``chunk`` of them run in one ``lax.scan`` between progress-bar updates. Device
memory holds one layer plus the three cached streams.

With several devices (GPUs, or CPU devices: ``qjax quantize`` makes one per core) the minibatch is split over them
(data parallel): each device runs the step on its share of the samples, the loss and the gradients are summed
across devices, and the rest of the step — the sign-SGD update, the best-iteration bookkeeping — runs the same on
every device. The result is the single-device step's up to float summation order.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from qjax.model.config import FULL
from qjax.program_cache import ProgramCache
from qjax.quant.packing import pack_int32

from . import blocks, head
from .algorithms import BlockInputs
from . import progress as prog
from . import stream
from .assemble import build_quantized_model, dequantize_result
from .data import IndexSampler
from .imatrix import collect
from .optim import clamp_minmax, default_lr, make_optimizer
from .qdq import (
    fp8_kv_scale,
    init_params,
    opt_rtn_int_sym,
    qdq_unit,
    quantize_mxfp8,
    search_scales,
    weight_minmax,
)
from .results import BlockReport, UnitResult
from .schemes import Scheme, resolve

logger = logging.getLogger("qjax.autoround")

DATA = "data"  # the mesh axis the tuning step's minibatch is split over


def data_parallel_mesh(batch_size: int, devices=None) -> Mesh | None:
    """The mesh the tuning step splits its minibatch over: the most devices (of ``devices``, default all of the
    default backend) that divide ``batch_size`` evenly; None when that is one (the plain single-device step)."""
    devices = list(jax.devices() if devices is None else devices)
    n = max(d for d in range(1, min(len(devices), batch_size) + 1) if batch_size % d == 0)
    return None if n == 1 else Mesh(np.asarray(devices[:n]), (DATA,))


@dataclasses.dataclass(frozen=True)
class AutoRoundConfig:
    """auto-round 0.16.1's options and defaults (docs/autoround.md §5), by the same names."""

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    data_type: str = "int"
    layer_config: dict = dataclasses.field(default_factory=dict)  # parsed: {pattern: {bits, group_size, sym, …}}
    ignore_layers: tuple[str, ...] = ()  # the layer_config patterns that --ignore_layers added (reported as its own)
    iters: int = 200
    nsamples: int = 128
    seqlen: int = 2048
    batch_size: int = 8
    lr: float | None = None
    minmax_lr: float | None = None
    enable_minmax_tuning: bool = True
    enable_quanted_input: bool = True
    enable_alg_ext: bool = False
    disable_opt_rtn: bool | None = None  # None: auto-round's default (True for W8, else False)
    not_use_best_mse: bool = False
    scale_dtype: str = "float16"
    static_kv_dtype: str | None = None  # "fp8"
    static_kv_granularity: str = "tensor"  # "tensor" | "head"
    quant_lm_head: bool = False  # the LM head too (qjax.autoround.head: auto-round's rules)
    seed: int = 42
    chunk: int = 10  # iterations per jitted scan between progress updates (no effect on the result)

    def __post_init__(self):
        if self.iters < 0:
            raise ValueError(f"iters must be ≥ 0, got {self.iters}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {self.batch_size}")
        if self.static_kv_dtype not in (None, "fp8"):
            raise ValueError(f"static_kv_dtype {self.static_kv_dtype!r} is not supported (fp8 or none)")
        if self.static_kv_granularity not in ("tensor", "head"):
            raise ValueError(f"static_kv_granularity {self.static_kv_granularity!r}: use tensor or head")
        if self.scale_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"scale_dtype {self.scale_dtype!r}: use float16, bfloat16 or float32")

    @property
    def base_scheme(self) -> Scheme:
        return Scheme(bits=self.bits, group_size=self.group_size, sym=self.sym, data_type=self.data_type)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------------------------
# quantize-dequantize of one unit
# ---------------------------------------------------------------------------------------------------------------------
def _scale_dtype(cfg: AutoRoundConfig):
    return jnp.dtype(cfg.scale_dtype)


def _qdq(w, p, c, s: Scheme, cfg: AutoRoundConfig):
    """→ (dequantized w, scale, zp or None, q) for tunable params ``p`` and constants ``c``."""
    return qdq_unit(w, p, c, s, _scale_dtype(cfg))


def _is_tunable(s: Scheme) -> bool:
    return s.quantized and not s.is_mxfp8


# ---------------------------------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------------------------------
class AutoRound:
    """Quantize a dense qjax model with AutoRound.

    Usage::

        ar = AutoRound(model, calib_ids, AutoRoundConfig(bits=4, group_size=128, iters=200))
        results = ar.run()                   # {layer index: {unit name: UnitResult}}
        qmodel = ar.quantized_model()        # packed qjax model (what the writers export)

    ``model``: a loaded model, or a :class:`qjax.autoround.stream.FolderBlocks` — a checkpoint folder read one
    block at a time, each finished block's results kept only in ``progress_dir`` (required then), exported by
    :mod:`qjax.autoround.export` without the model ever being held (``qjax quantize``). ``streams``: where the
    cached calibration streams live, ``"device"`` or ``"host"`` (:mod:`.stream`; :mod:`.plan` chooses for
    ``qjax quantize``).

    ``devices``: what the tuning step may split its minibatch over (:func:`data_parallel_mesh`; default all devices
    of the default backend, ``jax.devices()[:1]`` for one).

    ``programs``: where the block programs (layer forward, tuning step, start and end of a block) are kept traced
    between runs (:class:`qjax.program_cache.ProgramCache`; ``qjax quantize`` keeps them beside its compilation
    cache). None: each run traces them again.
    """

    def __init__(self, model, calib_ids: np.ndarray, cfg: AutoRoundConfig, *, progress: bool = True,
                 progress_dir: str | None = None, resume: bool = False, fingerprint: dict | None = None,
                 on_block: Callable[[BlockReport], None] | None = None, devices=None,
                 programs: ProgramCache | None = None, streams: str = stream.DEVICE, algorithm=None):
        self.source = stream.blocks_of(model)
        ids = np.asarray(calib_ids, np.int32)
        if ids.ndim != 2 or ids.shape[0] < 1:
            raise ValueError(f"calibration ids must be [nsamples, seqlen], got {ids.shape}")
        if self.source.streamed and not progress_dir:
            raise ValueError("AutoRound: a folder run keeps its finished blocks in progress_dir; give one")
        if streams not in (stream.DEVICE, stream.HOST):
            raise ValueError(f"streams must be {stream.DEVICE!r} or {stream.HOST!r}, got {streams!r}")
        self.cfg, self.ids, self.streams = cfg, ids, streams
        # None: AutoRound's own tuning (or RTN); else an object of qjax.autoround.algorithms quantizes each block
        self.algorithm = algorithm
        self.floats: dict[int, dict[str, np.ndarray]] = {}  # block → float tensors the algorithm changed
        self.mcfg = self.source.config
        self.num_layers = self.mcfg.num_hidden_layers
        self.progress, self.on_block = progress, on_block
        self.names = self._all_linear_names()
        self.head_unit = head.unit(self.mcfg)
        with_head = head.wanted(cfg.base_scheme, cfg.quant_lm_head, cfg.layer_config, self.source.tied_head)
        self.schemes = resolve({**self.names, **({head.NAME: self.head_unit.shape} if with_head else {})},
                               cfg.base_scheme, cfg.layer_config, ignored=cfg.ignore_layers)
        head_scheme = self.schemes.pop(head.NAME, None)
        self.head_scheme = head_scheme if head_scheme is not None and head_scheme.quantized else None
        if algorithm is not None and self.head_scheme is not None:
            raise ValueError(f"--quant_lm_head is not supported with --algorithm {algorithm.name} (auto_round or rtn)")
        self.head_result: UnitResult | None = None
        self.results: dict[int, dict[str, UnitResult]] = {}
        self.kv_scales: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.reports: list[BlockReport] = []
        self.progress_dir, self.resume = progress_dir, resume
        self.fingerprint = fingerprint or {}
        self._ctxs: dict[int, object] = {}
        self.programs = programs
        self.mesh = data_parallel_mesh(cfg.batch_size, devices)
        if self.mesh is not None:
            logger.info("tuning data parallel over %d devices (%d of each minibatch's %d samples on each)",
                        self.mesh.size, cfg.batch_size // self.mesh.size, cfg.batch_size)

    @property
    def model(self):
        """The model in memory (a run on a loaded model)."""
        return self.source.model

    @property
    def layers(self) -> list:
        """Every decoder layer as its own module (a run on a loaded model)."""
        return self.source.layers

    # -- schemes ------------------------------------------------------------------------------------------------------
    def _all_linear_names(self) -> dict[str, tuple[int, int]]:
        out = {}
        for i, kind in enumerate(self.mcfg.layer_types):
            for u in blocks.layer_units(self.mcfg, kind):
                for n in blocks.unit_names(u, i, self.mcfg.num_experts):
                    out[n] = u.shape
        return out

    def unit_scheme(self, i: int, u: blocks.Unit) -> Scheme:
        """The unit's scheme; a stacked expert projection needs one scheme for all its experts (one packed tensor)."""
        names = blocks.unit_names(u, i, self.mcfg.num_experts)
        found = {self.schemes[n] for n in names}
        if len(found) > 1:
            detail = ", ".join(sorted({f"{n}: {self.schemes[n].describe()}" for n in names[:4]}))
            raise ValueError(f"--layer_config gives the experts of model.layers.{i}.mlp.experts different schemes "
                             f"({detail}, …); qjax stores each expert projection of a layer as one packed tensor, as "
                             "vLLM's fused MoE does, so all experts of a layer must share a scheme")
        return found.pop()

    # -- streams ------------------------------------------------------------------------------------------------------
    def _ctx(self, b: int):
        """The step context (RoPE tables, masks) of a ``[b, seqlen]`` batch, built once per batch size."""
        if b not in self._ctxs:
            t = self.ids.shape[1]
            # one program: built op by op it was ~25 small ones per batch size, each traced, lowered and compiled
            # (or loaded from the persistent cache) in the first block
            build = jax.jit(self.source.step_context)
            self._ctxs[b] = build(jnp.zeros((b, t), jnp.int32))
        return self._ctxs[b]

    def _forward(self, layer, h: jnp.ndarray) -> jnp.ndarray:
        """``layer(h)`` over the whole stream, ``batch_size`` samples at a time (where ``h`` lives: :mod:`.stream`)."""
        graphdef, state = nnx.split(layer)
        fn = _forward_fn(graphdef, self.programs)
        return stream.map_batches(lambda x: fn(state, x, self._ctx(x.shape[0])), h, self.cfg.batch_size)

    # -- main loop ----------------------------------------------------------------------------------------------------
    def run(self) -> dict[int, dict[str, UnitResult]]:
        if not self.source.streamed:
            return self._run()
        with stream.trim_after_compiles():  # a streamed run's peak is one block's: no compiler leftovers under it
            return self._run()

    def _run(self) -> dict[int, dict[str, UnitResult]]:
        n = self.num_layers
        done = prog.load(self, keep_results=not self.source.streamed) if self.resume else 0
        if self.resume:
            logger.info("--resume: %d of %d blocks reused from %s%s", done, n, self.progress_dir,
                        "" if done < n else " (all of them: only the export is left)")
        if not self.resume and self.progress_dir:
            prog.start(self)
        # plain RTN (iters 0, no imatrix, no KV scales) needs no calibration forward at all, as in auto-round
        streams = self._needs_streams()
        h = stream.place(self.source.embed(self.ids), self.streams) if streams else None
        fp_in = q_in = h
        del h
        for i in range(n):
            t0 = time.perf_counter()
            if not streams:
                if i >= done:
                    self._rtn_block(i, self.source.layer(i), t0)
                    self.source.release(i)
                    if self.source.streamed:
                        del self.results[i]
                continue
            layer = self.source.layer(i)
            fp_out = self._forward(layer, fp_in)
            if i < done:
                qlayer = self._apply_results(layer, i)
                q_in = self._forward(qlayer, q_in) if self.cfg.enable_quanted_input else fp_out
                fp_in = fp_out
                del qlayer, layer
                self.source.release(i)
                continue
            kind = self.mcfg.layer_types[i]
            units = self.block_units(i)
            report = BlockReport(index=i, kind=kind, units=len(units))
            x_in = q_in if self.cfg.enable_quanted_input else fp_in
            if self.algorithm is not None:
                out = self.algorithm.quantize_block(BlockInputs(i, kind, layer, tuple(units), x_in, self._ctx,
                                                                self.cfg.batch_size, self.mcfg, self.cfg.scale_dtype))
                res, stats, self.floats[i] = out.results, (None,) * 5, out.floats
                report.method = self.algorithm.name
            else:
                imatrix = self._imatrix(layer, fp_in, units) if self._needs_imatrix(units) else {}
                res, stats = self._quantize_block(i, layer, units, x_in, fp_out, imatrix)
                del imatrix
            del x_in
            fp_in = None  # the float input is not needed past tuning: one stream less while q_out is computed
            self.results[i] = res
            report.init_loss, report.best_loss, report.best_iter, report.iter_seconds, report.compile_seconds = stats
            qlayer = self._apply_results(layer, i)
            q_out = self._forward(qlayer, q_in) if self.cfg.enable_quanted_input else fp_out
            if self.cfg.static_kv_dtype and kind == FULL:
                self.kv_scales[i] = self._kv_scales(qlayer, q_in)
            fp_in, q_in = fp_out, q_out
            del qlayer, layer, fp_out, q_out
            self._finish_block(report, t0)
            self.source.release(i)
            if self.source.streamed:  # saved in the progress folder: the export reads it from there
                del self.results[i]
                self.floats.pop(i, None)
                stream.trim_host_memory()
        if self.head_scheme is not None:
            self._quantize_head(fp_in, q_in)
        return self.results

    def _needs_streams(self) -> bool:
        if self.algorithm is not None or self.cfg.iters > 0 or self.cfg.static_kv_dtype:
            return True
        return any(self._needs_imatrix(self.block_units(i)) for i in range(self.num_layers))

    def float_tensors(self, i: int) -> dict[str, tuple]:
        """The float tensors of block ``i`` the algorithm changes (``{key: shape}``, a key a layer-relative
        ``….weight`` or an unquantized unit's name; the export writes them over the source's)."""
        if self.algorithm is None:
            return {}
        return self.algorithm.float_tensors(self.mcfg, self.mcfg.layer_types[i], {u.name for u, _ in self.block_units(i)})

    def block_floats(self, i: int) -> dict[str, np.ndarray]:
        """Block ``i``'s changed float tensors: in memory, or a streamed run's finished block's progress file."""
        if not self.float_tensors(i):
            return {}
        return self.floats[i] if i in self.floats else prog.read_floats(self.progress_dir, i)

    def block_units(self, i: int) -> list[tuple[blocks.Unit, Scheme]]:
        """The units of block ``i`` the run quantizes, with their schemes (in the layer's unit order)."""
        units = [(u, self.unit_scheme(i, u)) for u in blocks.layer_units(self.mcfg, self.mcfg.layer_types[i])]
        return [(u, s) for u, s in units if s.quantized]

    def _rtn_block(self, i: int, layer, t0: float) -> None:
        units = self.block_units(i)
        report = BlockReport(index=i, kind=self.mcfg.layer_types[i], units=len(units))
        self.results[i], _ = self._quantize_block(i, layer, units, None, None, {})
        self._finish_block(report, t0)

    def _quantize_head(self, fp_h, q_h) -> None:
        """The LM head after the last block (:mod:`.head`): tuned on the final-norm streams when ``iters`` > 0, else
        RTN. Not saved to the progress folder: a resumed run recomputes the streams through every block anyway."""
        t0 = time.perf_counter()
        u, s = self.head_unit, self.head_scheme
        report = BlockReport(index=self.num_layers, kind=head.NAME, units=1)
        final_norm, lm_head = self.source.head()
        x = {}
        if fp_h is not None and self.cfg.iters > 0:
            norm = jax.jit(lambda h: final_norm(h))
            if stream.is_host(fp_h):  # one minibatch at a time, as the streams' forwards
                norm = functools.partial(stream.map_batches, norm, batch_size=self.cfg.batch_size)
            x["fp"] = norm(fp_h)
            x["q"] = norm(q_h) if self.cfg.enable_quanted_input else x["fp"]
        tuner = functools.partial(self._tune_head, x_q=x.get("q"), x_f=x.get("fp"))
        res, stats = self._quantize_block(report.index, head.HeadBlock(lm_head), [(u, s)], None, None, {},
                                          tuner=tuner)
        self.head_result = res[u.name]
        report.init_loss, report.best_loss, report.best_iter, report.iter_seconds, report.compile_seconds = stats
        report.seconds = time.perf_counter() - t0
        self.reports.append(report)
        logger.info("%s", report.line(self.num_layers))

    def _tune_head(self, i, layer, units, weights, consts, params, x_in, fp_out, *, x_q, x_f):
        """:meth:`_tune` for the head (one device; the minibatch's samples one at a time, :mod:`.head`)."""
        cfg = self.cfg
        [(u, s)] = units
        opt, step = head.tuning_step(s, cfg.scale_dtype, self._alpha_max(s), self._lr(s), cfg.iters)
        n, t = x_q.shape[:2]
        sampler = IndexSampler(n, cfg.batch_size, cfg.seed)
        mask = np.ones((t, 1), np.float32)
        mask[-1] = 0.0  # each sample's last position, as the blocks
        mask = jnp.asarray(mask)
        w, c = weights[u.path], consts[u.name]
        params = {u.name: params[u.name]}
        carry = (params, opt.init(params), jnp.asarray(jnp.inf, jnp.float32), params, jnp.asarray(0, jnp.int32),
                 jnp.asarray(-1, jnp.int32))
        return self._run_tuning(step, carry, (w, c, x_q, x_f, mask), sampler, head.NAME, None)

    def _finish_block(self, report: BlockReport, t0: float) -> None:

        report.seconds = time.perf_counter() - t0
        self.reports.append(report)
        if self.progress_dir:
            prog.save_block(self, report.index)
        if self.on_block:
            self.on_block(report)
        logger.info("%s", report.line(self.num_layers))

    # -- one block ----------------------------------------------------------------------------------------------------
    def _quantize_block(self, i, layer, units, x_in, fp_out, imatrix, tuner=None):
        cfg = self.cfg
        weights = blocks.weights_of(layer)
        # one program per block structure for the start and the end of a block (not op by op: on the first block of
        # each kind that was ~700 small programs traced, lowered and compiled or loaded one by one)
        tunable = tuple((u, s, self._alg_ext_scale(s)) for u, s in units if _is_tunable(s))
        consts, params = _start_fn(tunable, self.programs)(weights, imatrix)
        tune = cfg.iters > 0 and bool(params)
        stats = (None, None, None, None, None)
        if tune:
            if self.source.streamed:  # what the forwards and the start freed, before the step's buffers come
                stream.trim_host_memory()
            params, stats = (tuner or self._tune)(i, layer, units, weights, consts, params, x_in, fp_out)
        plan = tuple((u, s, self._opt_rtn(s, u), self._alpha_max(s)) for u, s in units)
        codes = jax.device_get(_end_fn(plan, cfg.scale_dtype, self.programs)(weights, params, consts, imatrix))
        out: dict[str, UnitResult] = {}
        for u, s in units:
            k = u.shape[1]
            if s.is_mxfp8:
                values, scale = codes[u.name]
                out[u.name] = UnitResult(s, np.asarray(values), np.asarray(scale), k)
                continue
            q, scale, zp = codes[u.name]
            q = np.asarray(q, np.int32)
            if zp is not None:  # auto-round's unsigned codes → compressed-tensors' signed ones (same q − zp)
                q = q - (1 << (s.bits - 1))
                zp = (np.asarray(zp, np.int32) - (1 << (s.bits - 1))).astype(np.int8)
            out[u.name] = UnitResult(s, pack_int32(q, s.bits), np.asarray(scale, np.float32), k, zp, cfg.scale_dtype)
        return out, stats

    def _alpha_max(self, s: Scheme) -> float:
        return 2.0 if self._alg_ext_scale(s) else 1.0

    def _alg_ext_scale(self, s: Scheme) -> bool:
        return self.cfg.enable_alg_ext and self.cfg.iters > 0 and s.sym and _is_tunable(s)

    def _opt_rtn(self, s: Scheme, u: blocks.Unit) -> bool:
        """auto-round's optimized RTN (imatrix scale search) at iters = 0: on by default except for W8 int; off for
        MoE experts unless asked (docs/autoround.md §12) and for asymmetric int (min-max)."""
        if self.cfg.iters != 0:
            return False
        disable = self.cfg.disable_opt_rtn
        if disable is None:
            disable = self.cfg.bits == 8 and self.cfg.data_type == "int"
        if disable or u.experts:
            return False
        return s.is_mxfp8 or s.sym

    def _needs_imatrix(self, units) -> bool:
        return any(self._alg_ext_scale(s) or self._opt_rtn(s, u) for u, s in units)

    def _imatrix(self, layer, fp_in, units) -> dict[str, jnp.ndarray]:

        return collect(layer, fp_in, [u for u, _ in units], self._ctx, self.cfg.batch_size)

    def _lr(self, s: Scheme) -> tuple[float, float]:
        cfg = self.cfg
        lr = cfg.lr if cfg.lr is not None else default_lr(cfg.iters, s.bits)
        mlr = cfg.minmax_lr if cfg.minmax_lr is not None else lr
        return lr, (mlr if cfg.enable_minmax_tuning else 0.0)

    def _tune(self, i, layer, units, weights, consts, params, x_in, fp_out):
        cfg = self.cfg
        tun = [(u, s) for u, s in units if u.name in params]
        fixed = _unit_weights_fn(tuple(u for u, _ in units))(weights)
        lrs = {u.name: self._lr(s) for u, s in tun}
        opt_state = _optimizer(tuple(sorted(lrs.items())), cfg.iters).init(params)
        n, t = x_in.shape[:2]
        sampler = IndexSampler(n, cfg.batch_size, cfg.seed)
        mesh = self.mesh
        local = sampler.batch // (1 if mesh is None else mesh.size)  # samples per device
        ctx = self._ctx(local)
        mask = np.ones((local, t, 1), np.float32)
        mask[:, -1] = 0.0  # auto-round masks each sample's last position
        mask = jnp.asarray(mask)  # (built in numpy: a transfer, not three small programs)
        n_valid = float(sampler.batch * (t - 1))
        filter_top = cfg.enable_alg_ext and cfg.bits < 4
        graphdef, state = nnx.split(layer)
        # stacked experts split over the devices: each quantize-dequantizes and updates only its slice (their qdq,
        # gradients and rounding parameters grow with E; replicated, every device would repeat all of it)
        # (a sorted tuple, not a set: the step's program follows its order, and a set of strings iterates in an order
        # that changes with each process's string hashing — the same step then missed the persistent compilation
        # cache in about every other run)
        sharded = () if mesh is None else tuple(sorted(
            u.name for u, _ in tun if u.experts and self.mcfg.num_experts % mesh.size == 0))
        step = _make_step(graphdef, tuple(tun), tuple(units), filter_top, n_valid, cfg.scale_dtype,
                          tuple(sorted((u.name, self._alpha_max(s)) for u, s in tun)), tuple(sorted(lrs.items())),
                          cfg.iters, mesh, sharded, programs=self.programs)
        args = (state, weights, consts, fixed, x_in, fp_out, ctx, mask)
        best = jnp.asarray(jnp.inf, jnp.float32)
        carry = (params, opt_state, best, params, jnp.asarray(0, jnp.int32), jnp.asarray(-1, jnp.int32))
        chunk_sharding = None
        if mesh is not None:
            # every operand placed as the step's specs say (the minibatch indices are split per call); the carry as
            # the step returns it, so the second call finds the first call's program instead of compiling another.
            # Host streams stay on the host: each chunk's minibatches are sent, replicated, per call
            carry_specs, arg_specs = _step_specs(params, fixed, sharded)
            host = [j for j, a in enumerate(args) if stream.is_host(a)]
            carry, placed = jax.device_put((carry, tuple(None if j in host else a for j, a in enumerate(args))),
                                           jax.tree.map(lambda sp: NamedSharding(mesh, sp), (carry_specs, arg_specs),
                                                        is_leaf=lambda x: isinstance(x, P)))
            args = tuple(args[j] if j in host else a for j, a in enumerate(placed))
            args = (args[0], blocks.state_weights(args[0]), *args[2:])  # the placed state's buffers, not a 2nd copy
            chunk_sharding = NamedSharding(mesh, P())
        return self._run_tuning(step, carry, args, sampler, f"block {i + 1}/{self.num_layers}", chunk_sharding)

    def _run_tuning(self, step, carry, args: tuple, sampler: IndexSampler, label: str, chunk_sharding):
        """The tuning loop of a block or the head: ``iters`` iterations in jitted chunks of ``chunk``
        (``step(carry, idx [k, B], *args) → (carry, losses [k])``), a progress bar labelled ``label``. Returns (the
        parameters kept — the best iteration's unless ``not_use_best_mse`` —, (first loss, best loss, best iteration,
        seconds per steady iteration, compile seconds)). Streams among ``args`` that live on the host are replaced,
        per chunk, by the chunk's minibatches (:func:`.stream.gather_chunk`, placed with ``chunk_sharding``)."""
        cfg = self.cfg
        bar = _bar(self.progress, cfg.iters, label)
        losses, chunks = [], []  # chunks: (iterations, seconds) of each jitted call
        host = [j for j, a in enumerate(args) if stream.is_host(a)]
        it = 0
        while it < cfg.iters:
            k = min(cfg.chunk, cfg.iters - it)
            idx = np.asarray([sampler.next_batch() for _ in range(k)], np.int32)
            t0 = time.perf_counter()
            call = args
            if host:
                idx, chunks_ = stream.gather_chunk(idx, tuple(args[j] for j in host), chunk_sharding)
                call = list(args)
                for j, c in zip(host, chunks_):
                    call[j] = c
            else:
                idx = jnp.asarray(idx)
            carry, chunk_losses = step(carry, idx, *call)
            # waits for the chunk on every device: with several, XLA:CPU could deadlock in a collective when two
            # multi-device programs were in flight at once (seen in a two-device probe, jax 0.10.2)
            jax.block_until_ready(carry)
            chunk_losses = np.asarray(chunk_losses)
            chunks.append((k, time.perf_counter() - t0))
            losses.extend(chunk_losses.tolist())
            it += k
            if bar is not None:
                bar.update(k)
                bar.set_postfix(loss=f"{chunk_losses[-1]:.3e}", best=f"{float(carry[2]):.3e}")
        if bar is not None:
            bar.close()
        params, _, best, best_params, _, best_iter = carry
        final = params if cfg.not_use_best_mse else best_params
        if self.mesh is not None:  # back to the default device, where the end of the block runs
            final = jax.device_put(final, jax.devices()[0])
        per_iter = [sec / k for k, sec in chunks[1:] if k == cfg.chunk] or [chunks[0][1] / chunks[0][0]]
        iter_s = float(np.median(per_iter))
        return final, (float(losses[0]), float(best), int(best_iter), iter_s,
                       max(0.0, chunks[0][1] - chunks[0][0] * iter_s))

    # -- results ------------------------------------------------------------------------------------------------------
    def _apply_results(self, layer, i: int):
        """A copy of ``layer`` whose quantized units hold their fake-quantized (dequantized) weights."""

        res = self.results.get(i)
        if res is None:  # a finished block of a streamed run: in the progress folder
            res = prog.read_results(self.progress_dir, i)
        units = blocks.layer_units(self.mcfg, self.mcfg.layer_types[i])
        weights = blocks.weights_of(layer)
        new = {u.name: dequantize_result(res[u.name], blocks.unit_weight(weights, u).dtype)
               for u in units if u.name in res}
        floats = self.block_floats(i)  # AWQ's smoothed norms, compensated router, balanced unquantized units
        new.update({u.name: jnp.asarray(floats[u.name]) for u in units if u.name in floats})
        weights = blocks.replace_units(weights, units, new)
        for key, v in floats.items():
            if key.endswith(".weight"):
                path = tuple(key.split("."))
                weights[path] = jnp.asarray(v, weights[path].dtype)
        graphdef, state = nnx.split(layer)
        flat = [(p, v.replace(weights[tuple(p)])) for p, v in nnx.to_flat_state(state)]
        return nnx.merge(graphdef, nnx.from_flat_state(flat))

    def _kv_scales(self, qlayer, h: jnp.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Static FP8 K/V scales: amax over the whole calibration stream / 448 (per tensor or per kv head)."""
        per_head = self.cfg.static_kv_granularity == "head"
        bs = self.cfg.batch_size
        ks, vs = [], []
        fn = jax.jit(lambda x, ctx: blocks.attention_kv(qlayer, x, ctx))
        for s in range(0, h.shape[0], bs):
            k, v = fn(h[s:s + bs], self._ctx(min(bs, h.shape[0] - s)))
            ks.append(fp8_kv_scale(k, per_head=per_head))
            vs.append(fp8_kv_scale(v, per_head=per_head))
        # the largest per-batch scale = amax over all batches / 448
        return np.asarray(jnp.max(jnp.stack(ks), 0)), np.asarray(jnp.max(jnp.stack(vs), 0))

    def quantized_model(self):
        """The packed model of a run on a model in memory (a folder run is exported from its progress folder by
        :mod:`qjax.autoround.export`, never held whole)."""
        if self.source.streamed:
            raise RuntimeError("AutoRound: a folder run is written by qjax.autoround.export.save_streamed; it never "
                               "holds the quantized model")
        return build_quantized_model(self)


@functools.lru_cache(maxsize=64)
def _unit_weights_fn(units: tuple):
    """``weights → {unit: [*lead, out, in]}`` in one program per block structure (gate and up cut out of the fused
    experts' weight; op by op these were small programs of their own in the first block of each kind)."""
    return jax.jit(lambda weights: {u.name: blocks.unit_weight(weights, u) for u in units})


def _jit(fn, programs: ProgramCache | None, static, out_structure=None):
    """``jax.jit(fn)``, kept traced between runs in ``programs`` when given (``static``: what besides the inputs
    decides ``fn``'s program); either way compiled once per input signature (:class:`ProgramCache`)."""
    return (programs or ProgramCache(None)).jit(fn, static, out_structure=out_structure)


def _graph_static(graphdef) -> tuple:
    """A layer's graph as a program description: its nodes and static attributes (e.g. ``eps``, head counts)."""
    return repr(graphdef.nodes), repr(graphdef.attributes)


@functools.lru_cache(maxsize=64)
def _start_fn(tunable: tuple, programs: ProgramCache | None = None):
    """The jitted start of a block (cached per block structure): ``(weights, imatrix) → (consts, params)`` for each
    tunable unit of ``tunable = ((unit, scheme, alg_ext scale search), …)`` — its frozen per-group range (and, with
    alg_ext, the searched initial scale) and its rounding parameters at auto-round's start."""

    def start(weights, imatrix):
        consts, params = {}, {}
        for u, s, search in tunable:
            w = blocks.unit_weight(weights, u)
            wmin, wmax = weight_minmax(w, s.group_size)
            consts[u.name] = {"wmin": wmin, "wmax": wmax}
            if search:
                consts[u.name]["init_scale"] = search_scales(w, imatrix.get(u.name), bits=s.bits,
                                                             group_size=s.group_size)
            params[u.name] = init_params(w, s.group_size)
        return consts, params

    return _jit(start, programs, ("qjax.autoround.start", tunable))


@functools.lru_cache(maxsize=64)
def _end_fn(plan: tuple, scale_dtype: str, programs: ProgramCache | None = None):
    """The jitted end of a block (cached per block structure): ``(weights, params, consts, imatrix) → {unit: codes}``
    for ``plan = ((unit, scheme, opt-RTN, alpha_max), …)``: ``(values, scale)`` of an MXFP8 unit (imatrix-weighted
    under opt-RTN); ``(q, scale, None)`` of auto-round's optimized RTN (imatrix-weighted scale search, one-shot
    rounding); else ``(q, scale, zp or None)`` of the clamped parameters' quantize-dequantize."""
    qcfg = AutoRoundConfig(scale_dtype=scale_dtype)

    def end(weights, params, consts, imatrix):
        out = {}
        for u, s, opt_rtn, alpha_max in plan:
            w = blocks.unit_weight(weights, u)
            if s.is_mxfp8:
                out[u.name] = quantize_mxfp8(w, imatrix.get(u.name) if opt_rtn else None)[:2]
            elif opt_rtn:
                _, scale, q = opt_rtn_int_sym(w, imatrix.get(u.name), bits=s.bits, group_size=s.group_size)
                out[u.name] = (q, scale, None)
            else:
                _, scale, zp, q = _qdq(w, clamp_minmax(params[u.name], alpha_max), consts[u.name], s, qcfg)
                out[u.name] = (q, scale, zp)
        return out

    return _jit(end, programs, ("qjax.autoround.end", plan, scale_dtype))


@functools.lru_cache(maxsize=16)
def _forward_fn(graphdef, programs: ProgramCache | None = None):
    """``(state, x, ctx) → layer(x)`` for a layer's ``graphdef`` (the streams' forwards)."""
    def forward(st, x, ctx):
        return nnx.merge(graphdef, st)(x, ctx, None)[0]

    return _jit(forward, programs, ("qjax.autoround.forward", _graph_static(graphdef)))


def _optimizer(lrs: tuple, iters: int) -> optax.GradientTransformation:
    """Sign-SGD over ``{unit: {v, alpha, beta}}``; ``lrs`` = ((unit, (lr_v, lr_minmax)), …)."""
    skeleton = {name: {"v": 0, "alpha": 0, "beta": 0} for name, _ in lrs}
    return make_optimizer(skeleton, iters=iters, lr_v={k: v[0] for k, v in lrs},
                          lr_minmax={k: v[1] for k, v in lrs})


def block_loss(graphdef, tun_schemes: dict[str, Scheme], units: tuple, *, filter_top: bool, scale_dtype: str,
               axis: str | None = None, sharded: tuple[str, ...] = ()):
    """The tuning loss of one block as a function of its rounding parameters.

    ``loss(params, state, weights, consts, fixed, x, ref, ctx, mask)``: every tunable unit's weight is replaced by
    its fake-quantized ``qdq(fixed[name], params[name], consts[name])`` (MXFP8 units by their RTN), the layer
    ``graphdef``/``state`` runs on ``x [B, T, H]``, and the result is ``mean((out·mask − ref·mask)²)`` in fp32
    (auto-round's token-masked MSE; with ``filter_top`` the 0.1 % largest errors are dropped).

    ``axis``: inside ``shard_map`` over that mesh axis, ``x`` is this device's share of the minibatch and the result
    is its part of the whole minibatch's loss (the parts sum to it); the 0.1 % are chosen over the whole minibatch.
    The units named in ``sharded`` (stacked experts) come as this device's slice of their experts (``fixed``,
    ``params``, ``consts``): each device quantize-dequantizes its slice and the slices are gathered into the whole
    stack (whose gradient transposes to a sum over the devices, scattered back to each slice).
    """
    qcfg = AutoRoundConfig(scale_dtype=scale_dtype)

    def loss_fn(params, state, weights, consts, fixed, x, ref, ctx, mask):
        new = {name: _qdq(fixed[name], params[name], consts[name], s, qcfg)[0] for name, s in tun_schemes.items()}
        for name in sharded:
            new[name] = jax.lax.all_gather(new[name], axis, tiled=True)
        for u, s in units:  # MXFP8 units are RTN: their fake-quantized weight is part of the block
            if u.name not in new:
                new[u.name] = quantize_mxfp8(fixed[u.name])[2]
        w = blocks.replace_units(weights, [u for u, _ in units], new)
        out = blocks.layer_apply(graphdef, state, w, x, ctx)
        d = out.astype(jnp.float32) * mask - ref.astype(jnp.float32) * mask
        parts = 1 if axis is None else jax.lax.axis_size(axis)
        if filter_top:
            # SignRoundV2: the 0.1 % largest |errors| of the batch are left out of the sum (not of the mean). Over
            # devices: the whole batch's k largest are among the union of each device's k largest.
            a = jnp.abs(d).reshape(-1)
            k = max(1, a.size * parts // 1000)
            top = jax.lax.top_k(a, k)[0]
            if axis is not None:
                top = jax.lax.top_k(jax.lax.all_gather(top, axis, tiled=True), k)[0]
            d = jnp.where(jnp.abs(d) >= top[-1], 0.0, d)
        return jnp.mean(d * d) / parts

    return loss_fn


@functools.lru_cache(maxsize=64)
def _make_step(graphdef, tun, units, filter_top, n_valid, scale_dtype, alpha_max, lrs, iters, mesh=None,
               sharded: tuple[str, ...] = (), programs: ProgramCache | None = None):
    """The jitted ``chunk``-iteration tuning step of one block structure (cached: identical layers share it).

    Carry: (params, opt_state, best loss, best params, iteration, best iteration); ``idxs [k, B]`` are the
    minibatches. Each iteration clamps α/β, evaluates the loss on the clamped params (iteration 0 is RTN), keeps
    them if best so far, and takes one sign-SGD step. With a ``mesh`` (:func:`data_parallel_mesh`) each device
    takes its columns of ``idxs`` and ``ctx``/``mask`` are one device's share; the units in ``sharded`` hold their
    experts split over the devices (:func:`_step_specs`: ``params``, ``consts``, ``fixed`` and the carry's
    parameters), every other operand is replicated. With ``programs`` the traced step is kept between runs.
    """
    static = ("qjax.autoround.step", _graph_static(graphdef), tun, units, filter_top, n_valid, scale_dtype, alpha_max,
              lrs, iters, None if mesh is None else (mesh.axis_names, mesh.devices.shape), sharded)
    alpha_max = dict(alpha_max)
    opt = _optimizer(lrs, iters)
    axis = None if mesh is None else DATA
    loss_fn = block_loss(graphdef, {u.name: s for u, s in tun}, units, filter_top=filter_top,
                         scale_dtype=scale_dtype, axis=axis, sharded=sharded)

    def one(carry, idx, state, weights, consts, fixed, x_in, fp_out, ctx, mask):
        params, opt_state, best, best_params, it, best_it = carry
        params = {k: _clamp(v, alpha_max[k]) for k, v in params.items()}
        x, ref = x_in[idx], fp_out[idx]
        # ×1000 before the gradient as auto-round does (keeps low-precision gradients off 0; sign is unchanged)
        loss, g = jax.value_and_grad(
            lambda p: 1000.0 * loss_fn(p, state, weights, consts, fixed, x, ref, ctx, mask))(params)
        if axis is not None:
            # each device's part of the loss and of the replicated units' gradients → the whole minibatch's; a sharded
            # unit's gradient is already summed over the devices (the transpose of its gather)
            loss = jax.lax.psum(loss, axis)
            g = {k: v if k in sharded else jax.lax.psum(v, axis) for k, v in g.items()}
        val = loss / 1000.0 / n_valid  # auto-round's logged value: MSE / number of valid tokens
        better = val < best
        best_params = jax.tree.map(lambda a, b: jnp.where(better, a, b), params, best_params)
        best_it = jnp.where(better, it, best_it)
        best = jnp.minimum(val, best)
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state, best, best_params, it + 1, best_it), val

    def step(carry, idxs, state, weights, consts, fixed, x_in, fp_out, ctx, mask):
        return jax.lax.scan(lambda c, ix: one(c, ix, state, weights, consts, fixed, x_in, fp_out, ctx, mask),
                            carry, idxs)

    def out_structure(args):  # (carry, losses): the carry comes back as it went in (optax states: not serializable)
        return jax.tree.structure((args[0], 0))

    if mesh is not None:
        carry, args = _step_specs([u.name for u, _ in tun], [u.name for u, _ in units], sharded)
        # check_vma off: the layer's own scans (GDN chunks, expert blocks) start from zeros that are the same on every
        # device and carry per-device values; the body's psum is what makes the outputs replicated
        step = jax.shard_map(step, mesh=mesh, out_specs=(carry, P()), check_vma=False,
                             in_specs=(carry, P(None, DATA), *args))
    return _jit(step, programs, static, out_structure)


def _step_specs(tunable, units, sharded: tuple[str, ...]) -> tuple[tuple, tuple]:
    """The data-parallel step's partition specs, ``(carry, operands after the indices)``, for the step's ``shard_map``
    and for placing its operands: a unit in ``sharded`` has its ``params`` / ``consts`` / ``fixed`` split over
    :data:`DATA` along the leading expert axis, everything else is replicated. ``tunable``, ``units``: unit names."""
    ps = {n: P(DATA) if n in sharded else P() for n in tunable}
    fs = {n: P(DATA) if n in sharded else P() for n in units}
    rep = P()
    return (ps, rep, rep, ps, rep, rep), (rep, rep, ps, fs, rep, rep, rep, rep)


def _clamp(p: dict, alpha_max: float) -> dict:
    return {**p, "alpha": jnp.clip(p["alpha"], 0.0, alpha_max), "beta": jnp.clip(p["beta"], 0.0, 1.0)}


def _bar(enabled: bool, total: int, desc: str):
    if not enabled or total == 0:
        return None
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def report_json(reports: list[BlockReport]) -> str:
    return json.dumps([dataclasses.asdict(r) for r in reports], indent=2)
