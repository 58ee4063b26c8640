"""The auto-round checkpoint format (``quant_method: "auto-round"``): codecs and the loader's view of such a folder.

auto-round 0.16.1 (``export/export_to_autoround``) stores INT weight-only layers GPTQ-style; qjax keeps quantized
weights in compressed-tensors' layout in memory (:class:`qjax.model.quant_layers.PackedWeight`). This module converts
between the two, bit for bit, and presents an auto-round folder to the ordinary loader as a compressed-tensors one.

Per quantized ``nn.Linear`` ``[N, K]`` (``b`` bits, ``G = K / group_size`` groups; ``u ∈ [0, 2^b)`` the unsigned
level, ``zp_u`` the unsigned zero point, ``W = (u - zp_u) · scale``):

=========================  =====================  ==========================================================
``packing_format``          tensor                 layout
=========================  =====================  ==========================================================
``auto_round:auto_gptq``    ``qweight`` I32        ``[K·b/32, N]``: 32/b consecutive *inputs* per word, LSB first
(sym; GPTQ v1)              ``qzeros`` I32         ``[G, N·b/32]``: **zp_u − 1**, 32/b consecutive outputs per word
                            ``scales`` F16         ``[G, N]``
``auto_round``              as above               ``qzeros`` holds zp_u itself (no −1)
``auto_round:auto_awq``     ``qweight`` I32        ``[K, N·b/32]``: packed along *outputs*, value i of 8 in nibble
(asym, all 4-bit)                                  ``(0, 4, 1, 5, 2, 6, 3, 7)[i]``
                            ``qzeros`` I32         ``[G, N·b/32]``: zp_u, AWQ order;  ``scales`` F16 ``[G, N]``
=========================  =====================  ==========================================================

compressed-tensors packs ``u = q + 2^(b-1)`` along K too (``weight_packed [N, K·b/32]``), so GPTQ's ``qweight`` is
exactly its transpose when ``K % 32 == 0`` — auto-round's own condition for quantizing a layer. Symmetric layers
have ``zp_u = 2^(b-1)`` everywhere; asymmetric ones have ``zp_u = zp + 2^(b-1)`` with compressed-tensors' signed zp.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping

import numpy as np

from qjax.checkpoint.layout import Entry, packed_entries
from qjax.checkpoint.view import MemoryCheckpoint
from qjax.model.config import read_config
from qjax.quant.config import QuantConfigError, QuantizationConfig
from qjax.quant.packing import pack_int32, pack_words, unpack_int32, unpack_words
from qjax.quant.schemes import ArScheme, int_scheme
from qjax.validation import Fields, compile_pattern

__all__ = [
    "AUTOROUND_METHOD",
    "GPTQ",
    "NATIVE",
    "AWQ",
    "PACKING_FORMATS",
    "AutoRoundError",
    "AutoRoundCheckpoint",
    "autoround_to_ct",
    "autoround_to_ct_tensors",
    "check_layer_dims",
    "ct_to_autoround",
    "is_autoround_config",
    "open_autoround",
    "resolve_schemes",
]

AUTOROUND_METHOD = "auto-round"
GPTQ = "auto_round:auto_gptq"
NATIVE = "auto_round"
AWQ = "auto_round:auto_awq"
PACKING_FORMATS = (GPTQ, NATIVE, AWQ)
# AutoAWQ's GEMM layout: value i of 8 consecutive output channels sits in nibble _AWQ_ORDER[i] of its word.
_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_AR_FIELDS = ("qweight", "qzeros", "scales")

logger = logging.getLogger("qjax")


class AutoRoundError(ValueError):
    """An auto-round checkpoint (or a model to export as one) that qjax cannot convert exactly."""


# ---------------------------------------------------------------------------------------------------------------------
# schemes
# ---------------------------------------------------------------------------------------------------------------------


def check_layer_dims(name: str, n: int, k: int, bits: int, group_size: int) -> None:
    """Refuse a layer the format cannot hold. auto-round quantizes a layer only when both dims are multiples of 32
    (``_check_divisible_by_32``); its QuantLinear buffers (``K // 32 * b`` rows, ``N // 32 * b`` zero-point words)
    assume it, and its forward needs whole groups."""
    if bits not in (2, 4, 8):
        raise AutoRoundError(f"{name}: {bits}-bit weights are not supported (2, 4 or 8)")
    if n % 32 or k % 32:
        raise AutoRoundError(f"{name}: the auto_round format needs in/out features that are multiples of 32, got "
                             f"[{n}, {k}] (auto-round itself leaves such layers unquantized)")
    if group_size != -1 and (group_size <= 0 or k % group_size):
        raise AutoRoundError(f"{name}: group_size {group_size} does not divide in_features {k}")


# ---------------------------------------------------------------------------------------------------------------------
# codecs
# ---------------------------------------------------------------------------------------------------------------------
def ct_to_autoround(packed: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, *, bits: int,
                    packing_format: str, name: str = "layer") -> dict[str, np.ndarray]:
    """One compressed-tensors layer → auto-round ``{"qweight", "qzeros", "scales"}`` (``packing_format`` layout).

    Args:
      packed: int32 ``[N, K·b/32]`` (``weight_packed``); K is inferred (``K % 32 == 0`` is required).
      scale: ``[N, G]`` float (``weight_scale``; G = 1 for channel strategy). Written as float16, as auto-round does.
      zero_point: signed int8 ``[N, G]`` (unpacked), or None when symmetric.
    """
    packed = np.asarray(packed)
    scale = np.asarray(scale)
    n, words = packed.shape
    k = words * 32 // bits
    g = scale.shape[-1]
    if scale.shape != (n, g) or k % g:
        raise AutoRoundError(f"{name}: scale shape {scale.shape} does not fit weight [{n}, {k}]")
    check_layer_dims(name, n, k, bits, k // g)
    half = 1 << (bits - 1)
    zp_u = np.full((n, g), half, np.int16) if zero_point is None else np.asarray(zero_point).astype(np.int16) + half
    scales = _to_float16(scale, name).T  # [G, N]
    if packing_format == AWQ:
        if bits != 4:
            raise AutoRoundError(f"{name}: {AWQ} packs 4-bit weights only, got {bits} bits")

        u = unpack_int32(packed, bits, k).astype(np.int16) + half  # [N, K]
        return {"qweight": pack_words(np.ascontiguousarray(u.T), bits, _AWQ_ORDER),
                "qzeros": pack_words(np.ascontiguousarray(zp_u.T), bits, _AWQ_ORDER),
                "scales": np.ascontiguousarray(scales)}
    if packing_format == GPTQ:
        if zero_point is not None:
            # GPTQ v1's zp − 1 cannot hold zp_u = 0 (auto-round clamps it and silently shifts that group); its
            # CPU/GPU torch_zp kernels are symmetric-only anyway.
            raise AutoRoundError(f"{name}: {GPTQ} stores symmetric layers only; use packing_format {NATIVE!r}")
        zp_u = zp_u - 1
    elif packing_format != NATIVE:
        raise AutoRoundError(f"unknown packing_format {packing_format!r} (one of {', '.join(PACKING_FORMATS)})")
    # Both CT and GPTQ pack the unsigned level along K, LSB first: with K % 32 == 0 there is no padding word.
    return {"qweight": np.ascontiguousarray(packed.T), "qzeros": pack_words(np.ascontiguousarray(zp_u.T), bits),
            "scales": np.ascontiguousarray(scales)}


def autoround_to_ct(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, *, bits: int, sym: bool,
                    packing_format: str, name: str = "layer") -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Inverse of :func:`ct_to_autoround`: ``(weight_packed int32 [N, K·b/32], weight_scale [N, G] (dtype kept),
    weight_zero_point int8 [N, G] signed or None)``.

    A layer declared symmetric must carry the constant zero point ``2^(b-1)``; anything else is an error rather
    than a silently different model.
    """
    qweight, qzeros, scales = np.asarray(qweight), np.asarray(qzeros), np.asarray(scales)
    g, n = scales.shape
    if packing_format == AWQ:
        k = qweight.shape[0]
        u = unpack_words(qweight, bits, _AWQ_ORDER).T  # [N, K]
        zp_u = unpack_words(qzeros, bits, _AWQ_ORDER)
    elif packing_format in (GPTQ, NATIVE):
        k = qweight.shape[0] * 32 // bits
        u = None
        zp_u = unpack_words(qzeros, bits) + (1 if packing_format == GPTQ else 0)
    else:
        raise AutoRoundError(f"{name}: unknown packing_format {packing_format!r}")
    if zp_u.shape != (g, n) or (u is not None and u.shape != (n, k)) or (u is None and qweight.shape[1] != n):
        raise AutoRoundError(f"{name}: qweight {qweight.shape}, qzeros {qzeros.shape} and scales {scales.shape} "
                             f"do not describe one {bits}-bit {packing_format} layer")
    check_layer_dims(name, n, k, bits, k // g if k % g == 0 else 0)
    half = 1 << (bits - 1)
    if u is None:
        packed = np.ascontiguousarray(qweight.T)  # the unsigned levels, already in compressed-tensors' layout
    else:

        packed = pack_int32((u - half).astype(np.int8), bits)
    if sym:
        if np.any(zp_u != half):
            raise AutoRoundError(f"{name}: declared symmetric but its qzeros are not the constant {half}")
        zp = None
    else:
        if np.any(zp_u > (1 << bits) - 1):  # GPTQ's zp − 1 can encode zp_u = 2^b, which no b-bit zero point holds
            raise AutoRoundError(f"{name}: zero point {int(zp_u.max())} does not fit {bits} bits")
        zp = np.ascontiguousarray((zp_u - half).T).astype(np.int8)
    return packed, np.ascontiguousarray(scales.T), zp


def _to_float16(scale: np.ndarray, name: str) -> np.ndarray:
    """Scales as float16 (auto-round's ``scales.half()``). Overflow is an error (inf decodes to garbage); rounding
    (bf16/fp32 scales below fp16's normal range, or fp32 scales with more than 11 significant bits) is logged."""
    scale = np.asarray(scale)
    with np.errstate(over="ignore"):
        out = scale.astype(np.float16)
    if not np.all(np.isfinite(out)):
        raise AutoRoundError(f"{name}: scales overflow float16 (max |scale| {float(np.abs(scale).max()):g})")
    changed = out.astype(np.float32) != scale.astype(np.float32)
    if changed.any():
        logger.warning("%s: %d of %d scales are not exact in float16 and were rounded", name, int(changed.sum()),
                       changed.size)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# quantization_config
# ---------------------------------------------------------------------------------------------------------------------
def is_autoround_config(quantization_config: Mapping | None) -> bool:
    return isinstance(quantization_config, Mapping) and quantization_config.get("quant_method") == AUTOROUND_METHOD


# what makes a layer_config / extra_config key a pattern rather than a literal module name
_META = (".*", "^", "$", "|", "(", ")", "[", "]", "?", "+")


def standard_regex(pattern: str) -> str:
    """auto-round's ``to_standard_regex``: literal names match as substrings, bare dots are escaped."""
    if not any(tok in pattern for tok in _META):
        return f".*{re.escape(pattern)}.*"
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith(".*", i):
            out.append(".*")
            i += 2
            continue
        out.append("\\." if pattern[i] == "." else pattern[i])
        i += 1
    regex = "".join(out)
    if not regex.startswith(("^", ".*")):
        regex = ".*" + regex
    if not regex.endswith(("$", ".*")):
        regex += ".*"
    return regex


def _regex_keys(extra: Mapping[str, dict], names: set[str], source: str) -> list[tuple[str, object]]:
    """(key, its RE2 program) for the extra_config keys that are patterns (auto-round: every key that is not a layer
    name and compiles as a Python regex); matched in linear time (qjax.validation.compile_pattern), so a hostile key
    such as ``(a+)+$`` cannot hang the loader."""
    keys = []
    for key in extra:
        if key in names:
            continue
        rx = compile_pattern(key, where=f"{source}: quantization_config.extra_config", error=AutoRoundError,
                             invalid_ok=True)
        if rx is not None:
            keys.append((key, rx))
    return keys


def resolve_schemes(quantization_config: Mapping, names: list[str], *, source: str) -> dict[str, ArScheme | None]:
    """Each module's (bits, group_size, sym) as auto-round's loader resolves it, or None when it stays 16-bit.

    Precedence (``auto_round.inference.convert_model.get_layer_config``): an exact ``extra_config`` name, else the
    first ``extra_config`` pattern that ``re.search``-matches, else the top-level scheme; missing fields come from the
    top level.
    """
    top = {k: quantization_config.get(k) for k in ("bits", "group_size", "sym", "data_type", "act_bits")}
    extra = quantization_config.get("extra_config") or {}
    if not isinstance(extra, Mapping):
        raise AutoRoundError(f"{source}: quantization_config.extra_config must be an object")
    patterns = _regex_keys(extra, set(names), source)
    out: dict[str, ArScheme | None] = {}
    for name in names:
        entry = extra.get(name)
        if entry is None:
            entry = next((extra[k] for k, rx in patterns if rx.search(name)), {})
        if not isinstance(entry, Mapping):
            raise AutoRoundError(f"{source}: quantization_config.extra_config[{name!r}] must be an object")
        merged = Fields({**top, **{k: v for k, v in entry.items() if v is not None}},
                        f"{source}: quantization_config ({name})", AutoRoundError)
        bits = merged.int("bits", None, min=1)
        if bits is None or bits >= 16:
            out[name] = None
            continue
        if merged.str("data_type", "int") != "int":
            raise AutoRoundError(f"{source}: {name}: data_type {merged.raw.get('data_type')!r} is not supported "
                                 "(INT weight-only only)")
        act_bits = merged.int("act_bits", None, min=0)
        if act_bits is not None and act_bits < 16:
            raise AutoRoundError(f"{source}: {name}: activation quantization (act_bits {act_bits}) is not supported")
        gs = merged.int("group_size", None, min=-1)
        if gs == 0:
            raise AutoRoundError(f"{source}: {name}: per-tensor int quantization (group_size 0) is not supported")
        out[name] = (bits, -1 if gs in (None, -1) else gs, merged.bool("sym", True))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# auto-round tensors → compressed-tensors tensors
# ---------------------------------------------------------------------------------------------------------------------
def autoround_to_ct_tensors(entries: Mapping[str, Entry], quantization_config: Mapping, *,
                            source: str = "config.json") -> tuple[QuantizationConfig, dict[str, Entry]]:
    """Present an auto-round checkpoint as a compressed-tensors one.

    Args:
      entries: every checkpoint key → ``(shape, safetensors dtype, get)``.
      quantization_config: config.json's ``quantization_config`` (``quant_method: "auto-round"``).
    Returns:
      A compressed-tensors :class:`QuantizationConfig` (one group per scheme, explicit module names as targets) and
      the entries with every quantized module's ``qweight``/``qzeros``/``scales`` replaced by ``weight_packed``,
      ``weight_scale``, ``weight_shape`` and (asymmetric) ``weight_zero_point`` — computed on demand.
    """
    fmt = quantization_config.get("packing_format") or GPTQ
    if fmt not in PACKING_FORMATS:
        raise AutoRoundError(f"{source}: packing_format {fmt!r} is not supported (one of {', '.join(PACKING_FORMATS)})")
    modules = [k[: -len(".qweight")] for k in entries if k.endswith(".qweight")]
    schemes = resolve_schemes(quantization_config, modules, source=source)
    out = {k: v for k, v in entries.items() if not _is_ar_field(k, schemes)}
    groups: dict[ArScheme, list[str]] = {}
    for name in modules:
        scheme = schemes[name]
        if scheme is None:
            raise AutoRoundError(f"{source}: {name} has packed weights but its quantization_config entry says 16 bits")
        missing = [f"{name}.{f}" for f in _AR_FIELDS if f"{name}.{f}" not in entries]
        if missing:
            raise AutoRoundError(f"{source}: missing {', '.join(missing)}")
        g_idx = entries.get(f"{name}.g_idx")
        out.update(_module_entries(name, scheme, fmt, entries, g_idx))
        groups.setdefault(scheme, []).append(name)
    qc = QuantizationConfig(groups=tuple((f"group_{i}", tuple(names), int_scheme(*s))
                                         for i, (s, names) in enumerate(groups.items())))
    return qc, out


def _is_ar_field(key: str, schemes: Mapping[str, ArScheme | None]) -> bool:
    module, _, field = key.rpartition(".")
    return module in schemes and field in (*_AR_FIELDS, "g_idx")


def _module_entries(name: str, scheme: ArScheme, fmt: str, entries: Mapping[str, Entry],
                    g_idx: Entry | None) -> dict[str, Entry]:
    """The compressed-tensors entries of one module (:func:`qjax.checkpoint.layout.packed_entries`), decoded together
    on first access and released after use."""
    bits, gs, sym = scheme
    qw_shape, _, _ = entries[f"{name}.qweight"]
    sc_shape, sc_dtype, _ = entries[f"{name}.scales"]
    groups, n = sc_shape
    k = qw_shape[0] if fmt == AWQ else qw_shape[0] * 32 // bits
    if gs != -1 and groups != math.ceil(k / gs) or gs == -1 and groups != 1:
        raise AutoRoundError(f"{name}: scales {list(sc_shape)} do not match group_size {gs} for in_features {k}")

    def compute():
        if g_idx is not None:
            _check_g_idx(name, np.asarray(g_idx[2]()), k, gs)
        return autoround_to_ct(*(entries[f"{name}.{f}"][2]() for f in _AR_FIELDS), bits=bits, sym=sym,
                               packing_format=fmt, name=name)

    # scales keep the dtype auto-round stored them in (float16)
    return packed_entries(name, int_scheme(bits, gs, sym), (n, k), sc_dtype, compute)


def _check_g_idx(name: str, g_idx: np.ndarray, k: int, gs: int) -> None:
    """Only the trivial act-order-free ``g_idx`` (``i // group_size``) maps onto contiguous groups."""
    want = np.arange(k) // (k if gs == -1 else gs)
    if g_idx.shape != (k,) or np.any(g_idx != want):
        raise AutoRoundError(f"{name}: a permuted g_idx (act-order) is not supported")


# ---------------------------------------------------------------------------------------------------------------------
# the loader's view of a folder
# ---------------------------------------------------------------------------------------------------------------------
class AutoRoundCheckpoint(MemoryCheckpoint):
    """A :class:`~qjax.checkpoint.view.MemoryCheckpoint` over an auto-round folder's :class:`Checkpoint`, in
    compressed-tensors' layout: converted tensors are computed on demand, the rest read through."""

    def __init__(self, ckpt, quantization_config: Mapping, source: str):
        self._ckpt = ckpt
        self._disk_keys = set(ckpt.keys())
        raw = {k: (tuple(ckpt.shape(k)), ckpt.dtype(k), (lambda k=k: ckpt.get(k))) for k in ckpt.keys()}
        self.quantization_config, entries = autoround_to_ct_tensors(raw, quantization_config, source=source)
        super().__init__(ckpt.folder, entries)

    def file_of(self, key: str) -> str:
        # a converted tensor (weight_packed, weight_scale, ...) lives where its module's qweight does
        src = key if key in self._disk_keys else f"{key.rpartition('.')[0]}.qweight"
        return self._ckpt.file_of(src)

    def close(self) -> None:
        self._ckpt.close()


def open_autoround(folder: str | os.PathLike, ckpt) -> tuple[QuantizationConfig, AutoRoundCheckpoint] | None:
    """``(quantization config, checkpoint view)`` when ``folder/config.json`` declares ``quant_method
    "auto-round"``, else None (the caller then reads a compressed-tensors config as usual)."""
    path, raw = read_config(folder)
    qcfg = raw.get("quantization_config")
    if not is_autoround_config(qcfg):
        return None
    try:
        view = AutoRoundCheckpoint(ckpt, qcfg, path)
    except AutoRoundError as e:
        raise QuantConfigError(str(e)) from e
    return view.quantization_config, view
