"""The one place that translates between the descriptions of a weight scheme.

Four spellings of "how a weight is stored" meet in qjax, each owned by its consumer:

- :class:`~qjax.quant.config.WeightScheme` — a compressed-tensors config group (``num_bits``, ``strategy``,
  ``group_size`` or None, ``format``);
- :class:`~qjax.kernels.QuantMeta` — what a kernel needs (adds the layer's shape and the stored scale dtype; the
  group size is always a number, K for channel/tensor strategies);
- auto-round's ``(bits, group_size, sym)`` tuple (:data:`ArScheme`; group_size -1 = one group per row), the
  ``extra_config`` / GPTQ side;
- :class:`qjax.autoround.schemes.Scheme` — AutoRound's per-layer option (``bits``, ``group_size``, ``sym``,
  ``data_type``; read here by attribute, as this room sits below AutoRound's).

Every conversion between them is here, so a new field is added in one file.
"""

from __future__ import annotations

from qjax.kernels import QuantMeta
from qjax.quant.config import MXFP8_QUANTIZED, PACK_QUANTIZED, WeightScheme

ArScheme = tuple[int, int, bool]  # auto-round's (bits, group_size (-1: one group per row), sym) of an INT layer

MXFP8_GROUP = 32  # OCP MX block: one E8M0 scale per 32 consecutive inputs
MXFP8_SCHEME = WeightScheme(format=MXFP8_QUANTIZED, num_bits=8, type="float", symmetric=True, strategy="group",
                            group_size=MXFP8_GROUP, scale_dtype="uint8")


def int_scheme(bits: int, group_size: int, sym: bool, scale_dtype: str | None = None) -> WeightScheme:
    """The pack-quantized scheme of auto-round's ``(bits, group_size, sym)`` (group_size -1: channel strategy)."""
    channel = group_size == -1
    return WeightScheme(format=PACK_QUANTIZED, num_bits=bits, type="int", symmetric=sym,
                        strategy="channel" if channel else "group", group_size=None if channel else group_size,
                        scale_dtype=scale_dtype)


def from_autoround(s, scale_dtype: str | None = None) -> WeightScheme:
    """The compressed-tensors scheme of an AutoRound :class:`~qjax.autoround.schemes.Scheme` (quantized)."""
    if s.is_mxfp8:
        return MXFP8_SCHEME
    return int_scheme(s.bits, s.group_size, s.sym, scale_dtype)


def from_meta(meta: QuantMeta) -> WeightScheme:
    """The compressed-tensors scheme that stores a packed weight described by ``meta`` (its scale dtype included)."""
    if meta.fmt == "mxfp8":
        return MXFP8_SCHEME
    return WeightScheme(format=PACK_QUANTIZED, num_bits=meta.bits, type="int", symmetric=meta.symmetric,
                        strategy=meta.strategy, group_size=meta.group_size if meta.strategy == "group" else None,
                        scale_dtype=meta.scale_dtype)


def to_meta(scheme: WeightScheme, out_features: int, in_features: int, scale_dtype: str) -> QuantMeta:
    """The kernel description of an ``[out_features, in_features]`` weight stored with ``scheme``; ``scale_dtype`` is
    the stored scales' dtype (the tensors on disk are authoritative; MXFP8's is always uint8 E8M0)."""
    if scheme.is_mxfp8:
        return QuantMeta("mxfp8", 8, MXFP8_GROUP, in_features, out_features, True, "group", "uint8")
    group = scheme.group_size if scheme.strategy == "group" else in_features
    return QuantMeta("int", scheme.num_bits, group, in_features, out_features, scheme.symmetric, scheme.strategy,
                     scale_dtype)


def to_autoround(meta: QuantMeta) -> ArScheme:
    """auto-round's ``(bits, group_size, sym)`` of an INT group/channel ``meta`` (the caller refuses the others)."""
    if meta.fmt != "int" or meta.strategy == "tensor":
        raise ValueError(f"{meta.fmt} {meta.strategy} weights have no auto-round (bits, group_size, sym) form")
    return meta.bits, (-1 if meta.strategy == "channel" else meta.group_size), meta.symmetric
