"""AutoRound (SignRound) weight quantization in JAX: quantize-dequantize functions (``qdq``) and the sign-SGD
optimizer (``optim``), both matching auto-round 0.16.1 (see docs/autoround.md)."""
