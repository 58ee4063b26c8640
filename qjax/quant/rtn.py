"""Round-to-nearest quantization of a dense qjax model into a packed one, with compressed-tensors' own arithmetic.

The quantized model is produced the way a checkpoint would be read: each module's weight is quantized on the host
(bit-exact with compressed-tensors / llmcompressor RTN), presented in compressed-tensors' on-disk layout through an
in-memory checkpoint, and loaded by the ordinary loader — so an RTN model in memory, its written folder, and that
folder loaded back are the same bits.
"""

from __future__ import annotations

import os

import numpy as np

from qjax.quant.config import QuantizationConfig
from qjax.quant.packing import pack_int32, pack_zero_point, quantize_int, quantize_mxfp8

_NP_TO_ST = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32", "int64": "I64", "uint8": "U8",
             "int8": "I8", "float8_e4m3fn": "F8_E4M3"}


class _MemoryCheckpoint:
    """Duck-typed :class:`qjax.loading.Checkpoint` whose tensors are computed on demand."""

    def __init__(self, folder: str, entries: dict[str, tuple[tuple[int, ...], str, callable]]):
        self.folder = folder
        self.entries = entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, key):
        return self.entries[key][0]

    def dtype(self, key):
        return self.entries[key][1]

    def get(self, key):
        return self.entries[key][2]()

    def file_of(self, key):
        return "<memory>"

    def close(self):
        pass


def quantize_model(model, qconfig: QuantizationConfig | dict):
    """RTN-quantize ``model`` (dense) according to a compressed-tensors ``quantization_config``.

    Module names are matched in the text-only on-disk naming (``model.layers.3.self_attn.q_proj``,
    ``model.layers.0.mlp.experts.5.down_proj``, ``lm_head``); the router (``mlp.gate``) is not a linear layer in
    transformers and is never matched by the ``Linear`` class target. KV-cache schemes need calibration data and
    are not produced here.

    Returns:
      A new model holding packed weights (the dense input is left untouched).
    """
    from qjax.convert.hf_writer import checkpoint_tensors as dense_tensors
    from qjax.loading import _load

    qc = qconfig if isinstance(qconfig, QuantizationConfig) else QuantizationConfig.from_dict(qconfig,
                                                                                              source="qconfig")
    if qc.kv_cache is not None:
        raise ValueError("quantize_model: kv_cache_scheme needs calibration (static FP8 scales); use qjax quantize")
    if getattr(model, "quant", None) is not None:
        raise ValueError("quantize_model: the model is already quantized")
    weight_dtype = np.dtype(model.dtype)
    st_dtype = _NP_TO_ST[weight_dtype.name]
    entries: dict[str, tuple] = {}
    for key, shape, dtype, get in _dense_entries(model, dense_tensors):
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        scheme = None if module is None or len(shape) != 2 else qc.scheme_for(module, is_linear=_is_linear(module))
        if scheme is None:
            entries[key] = (shape, dtype, get)
        else:
            entries.update(_quantized_entries(module, scheme, shape, get, weight_dtype, st_dtype))
    ckpt = _MemoryCheckpoint(os.path.join("<memory>", "rtn"), entries)
    quantized = _load(model.config, qc, ckpt, model.dtype)
    quantized.generation_config = getattr(model, "generation_config", None)
    return quantized


def _dense_entries(model, dense_tensors):
    """(key, disk shape, safetensors dtype, get) of every tensor of the dense model in the per-expert layout."""
    from qjax.convert.hf_writer import _all_per_expert
    from qjax.loading import _leaf_shapes, expected_tensors

    targets = expected_tensors(model, _leaf_shapes(model), fused_experts=_all_per_expert(model.config, model),
                               text_prefix="model.")
    dtype = _NP_TO_ST[np.dtype(model.dtype).name]
    for key, _, get in dense_tensors(model):
        yield key, tuple(targets[key].shape), dtype, get


def _is_linear(module: str) -> bool:
    return not module.endswith(".mlp.gate") and "embed_tokens" not in module


def _quantized_entries(module: str, scheme, shape, get, weight_dtype, st_dtype) -> dict[str, tuple]:
    """compressed-tensors tensors of one module; quantized on first access, released after the last."""
    out_f, in_f = shape
    cache: dict[str, np.ndarray] = {}

    def field(name):
        def get_field():
            if not cache:
                w = np.asarray(get()).astype(weight_dtype)
                if scheme.is_mxfp8:
                    values, scale = quantize_mxfp8(w)
                    cache.update(weight=values, weight_scale=scale)
                else:
                    try:
                        q, scale, zp = quantize_int(w, scheme.num_bits, symmetric=scheme.symmetric,
                                                    strategy=scheme.strategy, group_size=scheme.group_size,
                                                    scale_dtype=scheme.scale_dtype)
                    except ValueError as e:
                        raise ValueError(f"{module} {list(w.shape)}: {e}") from None
                    cache.update(weight_packed=pack_int32(q, scheme.num_bits), weight_scale=scale,
                                 weight_shape=np.asarray(w.shape, np.int64))
                    if zp is not None:
                        cache["weight_zero_point"] = pack_zero_point(zp, scheme.num_bits)
            return cache.pop(name)
        return get_field

    if scheme.is_mxfp8:
        return {f"{module}.weight": ((out_f, in_f), "F8_E4M3", field("weight")),
                f"{module}.weight_scale": ((out_f, in_f // 32), "U8", field("weight_scale"))}
    b = scheme.num_bits
    groups = {"group": -(-in_f // (scheme.group_size or in_f)), "channel": 1, "tensor": 1}[scheme.strategy]
    scale_shape = (1,) if scheme.strategy == "tensor" else (out_f, groups)
    scale_dt = _NP_TO_ST.get(scheme.scale_dtype or "", st_dtype)
    out = {f"{module}.weight_packed": ((out_f, -(-in_f * b // 32)), "I32", field("weight_packed")),
           f"{module}.weight_scale": (scale_shape, scale_dt, field("weight_scale")),
           f"{module}.weight_shape": ((2,), "I64", field("weight_shape"))}
    if not scheme.symmetric:
        out[f"{module}.weight_zero_point"] = ((-(-out_f * b // 32), groups), "I32", field("weight_zero_point"))
    return out
