"""Dequant-matmul kernels (installed as ``qjax.kernels``).

Entry points the quantized layers call: :func:`qmatmul` (dense ``x @ dequant(W)ᵀ``) and :func:`dequantize_experts`
(the MoE path). Today they are the plain-JAX references; the Pallas (Triton) implementations plug in behind the same
signatures.
"""

from .reference import QuantMeta, dequantize, dequantize_experts, qmatmul, unpack_int

__all__ = ["QuantMeta", "dequantize", "dequantize_experts", "qmatmul", "unpack_int"]
