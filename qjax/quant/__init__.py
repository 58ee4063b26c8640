"""Compressed-tensors quantization support: config parsing (``config``) and bit-exact codecs (``packing``); what
stays unquantized unless a recipe names it (``unquantized``: the MTP head, the vision tower).

Formats handled (see docs/formats.md): ``pack-quantized`` INT2/INT4/INT8 weights (symmetric or with packed zero
points; group, channel or tensor scales) and ``mxfp8-quantized`` weights (E4M3 values, E8M0 scales per 32 columns),
plus the FP8 KV-cache scheme. Everything else is refused with a ``QuantConfigError`` that names the file and field.
"""

from .config import KVCacheScheme, QuantConfigError, QuantizationConfig, WeightScheme
from .packing import (
    dequantize,
    e4m3_to_float32,
    e8m0_to_float32,
    float32_to_e4m3,
    pack_int32,
    pack_zero_point,
    quantize_int,
    quantize_mxfp8,
    unpack_int32,
    unpack_zero_point,
)

__all__ = [
    "KVCacheScheme",
    "QuantConfigError",
    "QuantizationConfig",
    "WeightScheme",
    "dequantize",
    "e4m3_to_float32",
    "e8m0_to_float32",
    "float32_to_e4m3",
    "pack_int32",
    "pack_zero_point",
    "quantize_int",
    "quantize_mxfp8",
    "unpack_int32",
    "unpack_zero_point",
]
