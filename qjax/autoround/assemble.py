"""AutoRound results → a packed qjax model, through the same in-memory checkpoint path as RTN.

Each tuned unit's integer codes and scales are laid out as compressed-tensors tensors (``weight_packed``,
``weight_scale``, ``weight_shape``, ``weight_zero_point``; MXFP8 ``weight`` + E8M0 ``weight_scale``; FP8 KV
``k_scale``/``v_scale``) and loaded by the ordinary loader, so the model in memory, the folder the writer produces and
that folder loaded back are the same bits.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np

from qjax.autoround.rtn import dense_entries, vision_of
from qjax.checkpoint.layout import packed_entries
from qjax.checkpoint.loading import load_from_view
from qjax.checkpoint.safetensors_io import dtype_name
from qjax.checkpoint.view import MemoryCheckpoint
from qjax.quant import schemes
from qjax.quant.config import KVCacheScheme, QuantizationConfig, WeightScheme
from qjax.quant.packing import e8m0_to_float32, unpack_int32

from . import blocks


def dequantize_result(r, dtype) -> jnp.ndarray:
    """What the packed model computes for a unit: ``[*lead, out, in]`` in ``dtype`` (fp32 math, rounded to the
    scale dtype first, as compressed-tensors and qjax's kernels decompress)."""
    # the casts in numpy (ml_dtypes rounds to nearest even, as XLA does): as jnp operations they were two small
    # programs per unit shape, compiled in the first block of each kind
    if r.scheme.is_mxfp8:
        v = np.asarray(r.packed).astype(np.float32)
        s = np.repeat(e8m0_to_float32(np.asarray(r.scale)), 32, axis=-1)
        return jnp.asarray((v * s).astype(jnp.bfloat16).astype(jnp.dtype(dtype)))
    k = r.in_features
    q = unpack_int32(np.asarray(r.packed), r.scheme.bits, k).astype(np.float32)
    g = k if r.scheme.group_size == -1 else r.scheme.group_size
    if r.zp is not None:
        q = q - np.repeat(np.asarray(r.zp, np.float32), g, axis=-1)
    w = q * np.repeat(np.asarray(r.scale, np.float32), g, axis=-1)
    return jnp.asarray(w.astype(jnp.dtype(r.scale_dtype)).astype(jnp.dtype(dtype)))


def _module_entries(module: str, r, scale_dtype: str) -> dict[str, tuple]:
    """compressed-tensors tensors of one 2-D module: key → (shape, safetensors dtype, get), laid out by
    :func:`qjax.checkpoint.layout.packed_entries` (the layout the loader reads)."""
    return _lazy_module_entries(module, r.scheme, (r.packed.shape[-2], r.in_features), scale_dtype, lambda: r)


def _lazy_module_entries(module: str, scheme, shape: tuple[int, int], scale_dtype: str, result,
                         expert: int | None = None) -> dict[str, tuple]:
    """:func:`_module_entries` of a result that ``result()`` gives when a tensor is first read (expert ``expert``
    of a stacked one): nothing is read before the writer asks."""

    def compute():
        r = result()
        if expert is not None:
            r = _expert_slice(r, expert)
        return np.asarray(r.packed), np.asarray(r.scale), None if r.zp is None else r.zp

    # the scales are cast to the layout's dtype (scale_dtype; E8M0 bytes for MXFP8) as they are encoded
    return packed_entries(module, schemes.from_autoround(scheme, scale_dtype), tuple(shape),
                          dtype_name(jnp.dtype(scale_dtype)), compute)


def quantized_entries(ar, result_of, prefix: str = "model.") -> tuple[QuantizationConfig, dict[str, tuple], set]:
    """What a finished :class:`~qjax.autoround.driver.AutoRound` run adds to a checkpoint: (its quantization config,
    the compressed-tensors tensors of every quantized module, FP8 K/V scales and a quantized LM head as entries —
    key → (shape, dtype, get) —, the quantized modules' names). ``result_of(i)``: block ``i``'s
    ``{unit: UnitResult}``, called only when a tensor of that block is read (the streamed export reads them from
    the progress folder, one block at a time). Keys under ``prefix`` (the text prefix of the checkpoint they join;
    module names in the config stay ``model.``-relative, as the writers read them)."""
    mcfg, cfg = ar.mcfg, ar.cfg
    entries: dict[str, tuple] = {}
    groups: dict[WeightScheme, list[str]] = {}
    quantized_modules: set[str] = set()
    for i in range(ar.num_layers):
        for u, s in ar.block_units(i):
            ws = schemes.from_autoround(s, cfg.scale_dtype)
            names = blocks.unit_names(u, i, mcfg.num_experts)
            result = (lambda i=i, u=u: result_of(i)[u.name])
            for e, module in enumerate(names):
                key_module = prefix + module[len("model."):]
                entries.update(_lazy_module_entries(key_module, s, u.shape, cfg.scale_dtype, result,
                                                    e if u.experts else None))
                groups.setdefault(ws, []).append(module)
                quantized_modules.add(module)
    if ar.head_result is not None:
        entries.update(_module_entries("lm_head", ar.head_result, cfg.scale_dtype))
        groups.setdefault(schemes.from_autoround(ar.head_result.scheme, cfg.scale_dtype), []).append("lm_head")
        quantized_modules.add("lm_head")
    # float tensors the block algorithm changed (AWQ: smoothed norms, compensated router / shared-expert gate), over
    # the source's
    float_dtype = dtype_name(jnp.dtype(ar.source.dtype))
    for i in range(ar.num_layers):
        by_name = {u.name: u for u in blocks.layer_units(mcfg, mcfg.layer_types[i])}
        for key, shape in ar.float_tensors(i).items():
            get = (lambda i=i, key=key: np.asarray(ar.block_floats(i)[key]))
            if key.endswith(".weight"):
                entries[f"{prefix}layers.{i}.{key}"] = (tuple(shape), float_dtype, get)
                continue
            u = by_name[key]  # an unquantized unit: per expert, as the export lays dense experts out
            for e, module in enumerate(blocks.unit_names(u, i, mcfg.num_experts)):
                entries[prefix + module[len("model."):] + ".weight"] = (
                    tuple(u.shape), float_dtype, (lambda get=get, e=e: get()[e]) if u.experts else get)
    kv = None
    if ar.kv_scales:
        strategy = "attn_head" if cfg.static_kv_granularity == "head" else "tensor"
        kv = KVCacheScheme(num_bits=8, type="float", strategy=strategy)
        for i, (ks, vs) in ar.kv_scales.items():
            for name, s in (("k_scale", ks), ("v_scale", vs)):
                arr = np.asarray(s, np.float32).reshape(-1)
                entries[f"{prefix}layers.{i}.self_attn.{name}"] = (arr.shape, "F32", (lambda a=arr: a))
    ignore = sorted(n for n in ar.names if n not in quantized_modules) + ([] if "lm_head" in quantized_modules
                                                                          else ["lm_head"])
    qc = QuantizationConfig(groups=tuple((f"group_{j}", tuple(v), k) for j, (k, v) in enumerate(groups.items())),
                            ignore=tuple(ignore), kv_cache=kv)
    return qc, entries, quantized_modules


def build_quantized_model(ar):
    """The packed qjax model of a finished :class:`~qjax.autoround.driver.AutoRound` run on a model in memory."""
    model, mcfg = ar.model, ar.mcfg
    if len(ar.results) < ar.num_layers:
        raise RuntimeError(f"AutoRound: {len(ar.results)} of {ar.num_layers} blocks are quantized; run() first")
    qc, entries, quantized_modules = quantized_entries(ar, lambda i: ar.results[i])
    merged: dict[str, tuple] = {}
    for key, shape, dtype, get in dense_entries(model):
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        if module in quantized_modules:
            continue
        merged[key] = (shape, dtype, get)
    merged.update(entries)
    ckpt = MemoryCheckpoint(os.path.join("<memory>", "autoround"), merged)
    qmodel = load_from_view(mcfg, qc, ckpt, model.dtype, **vision_of(model))
    qmodel.generation_config = getattr(model, "generation_config", None)
    qmodel.image_processor = getattr(model, "image_processor", None)
    return qmodel


def _expert_slice(r, e: int):
    return dataclasses.replace(r, packed=r.packed[e], scale=r.scale[e], zp=None if r.zp is None else r.zp[e])
