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
    n, k = r.packed.shape[-2], r.in_features
    scheme = schemes.from_autoround(r.scheme, scale_dtype)
    # the scales are cast to the layout's dtype (scale_dtype; E8M0 bytes for MXFP8) as they are encoded
    return packed_entries(module, scheme, (n, k), dtype_name(jnp.dtype(scale_dtype)),
                          lambda: (np.asarray(r.packed), np.asarray(r.scale), None if r.zp is None else r.zp))


def build_quantized_model(ar):
    """The packed qjax model of a finished :class:`~qjax.autoround.driver.AutoRound` run."""
    model, mcfg, cfg = ar.model, ar.model.config, ar.cfg
    if len(ar.results) < len(ar.layers):
        raise RuntimeError(f"AutoRound: {len(ar.results)} of {len(ar.layers)} blocks are quantized; run() first")
    entries: dict[str, tuple] = {}
    groups: dict[WeightScheme, list[str]] = {}
    quantized_modules: set[str] = set()
    for i, res in sorted(ar.results.items()):
        for u in blocks.layer_units(mcfg, mcfg.layer_types[i]):
            if u.name not in res:
                continue
            r = res[u.name]
            ws = schemes.from_autoround(r.scheme, cfg.scale_dtype)
            names = blocks.unit_names(u, i, mcfg.num_experts)
            for e, module in enumerate(names):
                re_ = r if not u.experts else _expert_slice(r, e)
                entries.update(_module_entries(module, re_, cfg.scale_dtype))
                groups.setdefault(ws, []).append(module)
                quantized_modules.add(module)
    if ar.head_result is not None:
        entries.update(_module_entries("lm_head", ar.head_result, cfg.scale_dtype))
        groups.setdefault(schemes.from_autoround(ar.head_result.scheme, cfg.scale_dtype), []).append("lm_head")
        quantized_modules.add("lm_head")
    kv = None
    if ar.kv_scales:
        strategy = "attn_head" if cfg.static_kv_granularity == "head" else "tensor"
        kv = KVCacheScheme(num_bits=8, type="float", strategy=strategy)
        for i, (ks, vs) in ar.kv_scales.items():
            for name, s in (("k_scale", ks), ("v_scale", vs)):
                arr = np.asarray(s, np.float32).reshape(-1)
                entries[f"model.layers.{i}.self_attn.{name}"] = (arr.shape, "F32", (lambda a=arr: a))
    ignore = sorted(n for n in ar.names if n not in quantized_modules) + ([] if "lm_head" in quantized_modules
                                                                          else ["lm_head"])
    qc = QuantizationConfig(groups=tuple((f"group_{j}", tuple(v), k) for j, (k, v) in enumerate(groups.items())),
                            ignore=tuple(ignore), kv_cache=kv)
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
