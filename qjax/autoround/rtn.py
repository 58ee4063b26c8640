"""Round-to-nearest quantization of a dense qjax model into a packed one, with compressed-tensors' own arithmetic.

The quantized model is produced the way a checkpoint would be read: each module's weight is quantized on the host
(bit-exact with compressed-tensors / llmcompressor RTN), presented in compressed-tensors' on-disk layout through an
in-memory checkpoint, and loaded by the ordinary loader — so an RTN model in memory, its written folder, and that
folder loaded back are the same bits.
"""

from __future__ import annotations

import os

import numpy as np

from qjax.checkpoint.layout import (
    VISUAL_PREFIX,
    checkpoint_tensors,
    expected_tensors,
    is_linear,
    mtp_layers,
    packed_entries,
    per_expert_layout,
)
from qjax.checkpoint.loading import load_from_view
from qjax.checkpoint.safetensors_io import dtype_name
from qjax.checkpoint.view import MemoryCheckpoint
from qjax.model.variables import variable_shapes
from qjax.quant.config import QuantizationConfig
from qjax.quant.packing import pack_int32, quantize_int, quantize_mxfp8
from qjax.quant.unquantized import check_not_named, kept_part


def quantize_model(model, qconfig: QuantizationConfig | dict):
    """RTN-quantize ``model`` (dense) according to a compressed-tensors ``quantization_config``.

    Module names are matched in the text-only on-disk naming (``model.layers.3.self_attn.q_proj``,
    ``model.layers.0.mlp.experts.5.down_proj``, ``lm_head``); the router (``mlp.gate``) is not a linear layer in
    transformers and is never matched by the ``Linear`` class target. The MTP head stays as it is even where a
    target matches its modules (``Linear``, ``re:.*self_attn\\.q_proj$``), as every seed keeps it
    (:mod:`qjax.quant.unquantized`); a target that names it is refused. KV-cache schemes need calibration data and
    are not produced here.

    Returns:
      A new model holding packed weights (the dense input is left untouched).
    """
    qc = qconfig if isinstance(qconfig, QuantizationConfig) else QuantizationConfig.from_dict(qconfig,
                                                                                              source="qconfig")
    if qc.kv_cache is not None:
        raise ValueError("quantize_model: kv_cache_scheme needs calibration (static FP8 scales); use qjax quantize")
    if getattr(model, "quant", None) is not None:
        raise ValueError("quantize_model: the model is already quantized")
    check_not_named((t for _, targets, _ in qc.groups for t in targets), "quantize_model: config_groups target")
    weight_dtype = np.dtype(model.dtype)
    st_dtype = dtype_name(weight_dtype)
    entries: dict[str, tuple] = {}
    for key, shape, dtype, get in dense_entries(model):
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        scheme = None
        if module is not None and len(shape) == 2 and kept_part(module) is None:
            scheme = qc.scheme_for(module, is_linear=is_linear(module))
        if scheme is None:
            entries[key] = (shape, dtype, get)
        else:
            entries.update(quantized_entries(module, scheme, shape, get, weight_dtype, st_dtype))
    ckpt = MemoryCheckpoint(os.path.join("<memory>", "rtn"), entries)
    quantized = load_from_view(model.config, qc, ckpt, model.dtype, **vision_of(model))
    quantized.generation_config = getattr(model, "generation_config", None)
    quantized.image_processor = getattr(model, "image_processor", None)
    return quantized


def vision_of(model) -> dict:
    """``load_from_view`` 's arguments that rebuild ``model`` 's vision tower as it is (config, dtype)."""
    visual = getattr(model, "visual", None)
    return {"vision": getattr(model, "vision_config", None), "text_only": visual is None,
            "vision_dtype": None if visual is None else visual.dtype}


def dense_entries(model):
    """(key, disk shape, safetensors dtype, get) of every tensor of the dense model in the per-expert layout."""
    targets = expected_tensors(model, variable_shapes(model),
                               fused_experts=per_expert_layout(model.config, mtp_layers=mtp_layers(model)),
                               text_prefix="model.")
    dtype = dtype_name(model.dtype)
    tower = dtype_name(model.visual.dtype) if getattr(model, "visual", None) is not None else dtype
    for key, _, get in checkpoint_tensors(model):
        yield key, tuple(targets[key].shape), tower if key.startswith(VISUAL_PREFIX) else dtype, get


def quantized_entries(module: str, scheme, shape, get, weight_dtype, st_dtype) -> dict[str, tuple]:
    """compressed-tensors tensors of one module (:func:`qjax.checkpoint.layout.packed_entries`): key → (shape,
    dtype, get); the weight is quantized on the first access and released after the last."""
    def compute():
        w = np.asarray(get()).astype(weight_dtype)
        if scheme.is_mxfp8:
            values, scale = quantize_mxfp8(w)
            return values, scale, None
        try:
            q, scale, zp = quantize_int(w, scheme.num_bits, symmetric=scheme.symmetric, strategy=scheme.strategy,
                                        group_size=scheme.group_size, scale_dtype=scheme.scale_dtype)
        except ValueError as e:
            raise ValueError(f"{module} {list(w.shape)}: {e}") from None
        return pack_int32(q, scheme.num_bits), scale, zp

    return packed_entries(module, scheme, tuple(shape), st_dtype, compute)
