"""Dequant-matmul kernels (installed as ``qjax.kernels``).

Entry points the quantized layers call — each dispatches (see :mod:`.dispatch`) between a plain-JAX reference and
a Pallas (Triton) kernel with the same signature:
- :func:`qmatmul`: dense ``x @ dequant(W)ᵀ``;
- :func:`matmul`: ``x @ Wᵀ`` for an unquantized weight, read in place inside a layer stack;
- :func:`moe_experts`: routed SwiGLU experts with packed (or dense) ``[E, …]`` weights and the routing-weight
  combine; :func:`moe_routed`: the routing (:func:`route`) and the experts in one call (one decode token is routed
  inside the Pallas kernels);
- :func:`decode_attention`: one decode query per row against a layer of the K/V cache stacks, read in place
  (:func:`attention`: the plain-JAX softmax attention it matches);
- :func:`gated_delta_step`: one decode token of the Gated DeltaNet recurrence;
- :func:`gated_delta_decode`: one decode token of a Gated DeltaNet layer from its input projections (conv
  step, SiLU, decay, β and the recurrence; the conv window and state updated in their stacks).

:mod:`.precision` states what every kernel and layer accumulates in (:func:`accum_dtype`: float32, float64 for
float64 inputs, which only the references take) and the shared SiLU.
"""

from .attention_reference import attention
from .dispatch import IMPLS, resolve, use
from .moe_reference import route, routed_experts
from .ops import decode_attention, gated_delta_decode, gated_delta_step, matmul, moe_experts, moe_routed, qmatmul
from .precision import accum_dtype, dot_precision, sigmoid, silu
from .qmatmul_reference import dequantize, dequantize_experts, matmul_accumulated, unpack_int
from .quant_meta import QuantMeta, dense_meta

__all__ = ["IMPLS", "QuantMeta", "accum_dtype", "attention", "decode_attention", "dense_meta", "dequantize",
           "dequantize_experts", "dot_precision",
           "gated_delta_decode", "gated_delta_step", "matmul", "matmul_accumulated", "moe_experts", "moe_routed",
           "qmatmul", "resolve", "route", "routed_experts", "sigmoid", "silu", "unpack_int", "use"]
