"""The compressed-tensors ``quantization_config`` of a checkpoint, parsed into frozen dataclasses.

Only what qjax can run exactly is accepted (docs/formats.md §1–§2): ``pack-quantized`` INT2/4/8 weights and
``mxfp8-quantized`` weights, optionally with an FP8 KV-cache scheme. Anything else is refused with a
``QuantConfigError`` that names the file and the field — a loader must never guess a format, because a wrong guess
decodes to plausible-looking garbage rather than an error.

Module matching follows ``compressed_tensors.utils.match`` + ``lifecycle.apply`` (the oracle):
  * a target/ignore entry matches a module name by exact equality, by ``re.match`` (anchored at the start only) for
    ``re:`` entries (run by RE2 in linear time: a file's pattern cannot hang the loader), or by class: ``"Linear"``
    matches every linear module (the caller says which names are linear);
  * ``ignore`` overrides targets;
  * when several groups match, compressed-tensors prefers an exact-name target, then regex targets in *alphabetical*
    order of the pattern, then class targets; a target string listed by two groups belongs to the later group (its
    ``target -> scheme`` map is a dict). For configs whose groups are disjoint — every producer's output we know of —
    this is simply "the matching group".
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from qjax.model.config import read_config
from qjax.validation import compile_pattern

__all__ = [
    "QuantConfigError",
    "WeightScheme",
    "KVCacheScheme",
    "QuantizationConfig",
    "PACK_QUANTIZED",
    "MXFP8_QUANTIZED",
    "MIXED_PRECISION",
    "SUPPORTED_FORMATS",
]

PACK_QUANTIZED = "pack-quantized"
MXFP8_QUANTIZED = "mxfp8-quantized"
MIXED_PRECISION = "mixed-precision"
SUPPORTED_FORMATS = (PACK_QUANTIZED, MXFP8_QUANTIZED)
QUANT_METHOD = "compressed-tensors"

INT_BITS = (2, 4, 8)
MX_GROUP_SIZE = 32
_REFUSED_WEIGHT_STRATEGIES = ("block", "token", "tensor_group", "attn_head")
_KV_STRATEGIES = ("tensor", "attn_head")
# Scale dtypes an INT scheme may declare (llmcompressor/auto-round write null: the tensors then carry the model dtype).
_INT_SCALE_DTYPES = ("bfloat16", "float16", "float32")
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}
# Keys of compressed-tensors' QuantizationArgs / QuantizationScheme (both pydantic models with extra="forbid").
_ARG_KEYS = frozenset({
    "num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
    "scale_dtype", "zp_dtype", "observer", "observer_kwargs",
})
_GROUP_KEYS = frozenset({"targets", "weights", "input_activations", "output_activations", "format"})


class QuantConfigError(ValueError):
    """A quantization_config qjax cannot run exactly; the message names the source file and the group/field."""


# ---------------------------------------------------------------------------------------------------------------------
# schemes
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """How one group's weights are stored.

    ``format`` is resolved (group format, else the top-level one unless "mixed-precision", else inferred), so a loader
    never has to look at the top level. ``scale_dtype`` is what the config declares ("bfloat16", "float16", "uint8",
    ...) or None; None means "the model dtype" for producers, and the tensors on disk are authoritative (auto-round
    declares null yet writes F16 scales).
    """

    format: str  # "pack-quantized" | "mxfp8-quantized"
    num_bits: int  # 2, 4, 8 for int; 8 for float (mxfp8)
    type: str  # "int" | "float"
    symmetric: bool
    strategy: str  # "tensor" | "channel" | "group"
    group_size: int | None  # group strategy only
    scale_dtype: str | None = None

    @property
    def is_mxfp8(self) -> bool:
        return self.format == MXFP8_QUANTIZED

    @property
    def pack_factor(self) -> int:
        """INT values per int32 word (pack-quantized); 1 for MXFP8 (one e4m3 byte per weight, not packed)."""
        return 32 // self.num_bits if self.format == PACK_QUANTIZED else 1

    def bits_per_weight(self, scale_itemsize: int | None = None, in_features: int | None = None) -> float:
        """Storage bits per weight including scales and (packed) zero points, for memory planners.

        ``scale_itemsize`` defaults to the declared scale dtype's size, else 2 (a bf16/fp16 model dtype). Channel and
        tensor scales are amortised over ``in_features`` when given (otherwise counted as free); padding of the last
        int32 word of a row is ignored.
        """
        if scale_itemsize is None:
            scale_itemsize = _ITEMSIZE.get(self.scale_dtype or "", 2)
        per_row_group = 8 * scale_itemsize + (0 if self.symmetric else self.num_bits)  # zp: num_bits, packed on rows
        if self.strategy == "group":
            assert self.group_size is not None
            return self.num_bits + per_row_group / self.group_size
        if self.strategy == "channel" and in_features:
            return self.num_bits + per_row_group / in_features
        return float(self.num_bits)


@dataclasses.dataclass(frozen=True)
class KVCacheScheme:
    """FP8 KV cache: ``k_scale``/``v_scale`` per tensor ([1]) or per kv head (``attn_head``, [num_kv_heads])."""

    num_bits: int  # 8
    type: str  # "float"
    strategy: str  # "tensor" | "attn_head"


# ---------------------------------------------------------------------------------------------------------------------
# the config
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """A parsed compressed-tensors ``quantization_config``.

    ``groups`` keeps config order: (group name, targets, scheme). ``format`` is the top-level format, or — when the
    file has none — the one its groups imply ("mixed-precision" for several, "dense" for none).
    """

    groups: tuple[tuple[str, tuple[str, ...], WeightScheme], ...]
    ignore: tuple[str, ...] = ()
    kv_cache: KVCacheScheme | None = None
    format: str | None = None
    # Match tables, derived from groups/ignore (not part of equality or hashing).
    _exact: dict[str, int] = dataclasses.field(init=False, repr=False, compare=False)
    _regex: tuple[tuple[str, Any, int], ...] = dataclasses.field(init=False, repr=False, compare=False)  # RE2
    _linear: int | None = dataclasses.field(init=False, repr=False, compare=False)
    _ignore_exact: frozenset[str] = dataclasses.field(init=False, repr=False, compare=False)
    _ignore_regex: tuple[Any, ...] = dataclasses.field(init=False, repr=False, compare=False)
    _ignore_linear: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        exact: dict[str, int] = {}
        regex: dict[str, int] = {}
        linear: int | None = None
        for idx, (name, targets, _scheme) in enumerate(self.groups):
            for target in targets:
                # A later group overwrites an earlier one listing the same string: compressed-tensors builds an
                # OrderedDict target -> scheme (lifecycle/apply.py), and vLLM a plain dict.
                if target.startswith("re:"):
                    regex[target] = idx
                elif target == "Linear":
                    linear = idx
                elif _is_class_name(target):
                    raise QuantConfigError(
                        f"QuantizationConfig: group {name!r}: class-name target {target!r} is not supported "
                        "(only 'Linear', explicit module names and 're:' patterns)"
                    )
                else:
                    exact[target] = idx
        # compressed-tensors' match_targets sorts regex targets alphabetically and takes the first match.
        compiled = tuple((t, _compile(t, "QuantizationConfig", "targets"), regex[t]) for t in sorted(regex))
        ignore_regex = tuple(_compile(t, "QuantizationConfig", "ignore") for t in self.ignore if t.startswith("re:"))
        # Class names other than "Linear" in `ignore` could only match non-linear module classes, which qjax never
        # quantizes anyway, so they are kept (for to_dict) but never match.
        ignore_exact = frozenset(t for t in self.ignore if not t.startswith("re:") and not _is_class_name(t))
        object.__setattr__(self, "_exact", exact)
        object.__setattr__(self, "_regex", compiled)
        object.__setattr__(self, "_linear", linear)
        object.__setattr__(self, "_ignore_exact", ignore_exact)
        object.__setattr__(self, "_ignore_regex", ignore_regex)
        object.__setattr__(self, "_ignore_linear", "Linear" in self.ignore)

    # ---- matching ---------------------------------------------------------------------------------------------------
    def is_ignored(self, module_name: str, *, is_linear: bool = True) -> bool:
        """Whether an ``ignore`` entry matches the module (same rules as targets)."""
        return (
            module_name in self._ignore_exact
            or any(rx.match(module_name) for rx in self._ignore_regex)
            or (is_linear and self._ignore_linear)
        )

    def match(self, module_name: str, *, is_linear: bool = True) -> tuple[str, WeightScheme] | None:
        """(group name, scheme) for an on-disk module name (``model.language_model.layers.0.mlp.experts.3.up_proj``),
        or None when no group targets it or ``ignore`` does."""
        if self.is_ignored(module_name, is_linear=is_linear):
            return None
        idx = self._exact.get(module_name)
        if idx is None:
            idx = next((i for _t, rx, i in self._regex if rx.match(module_name)), None)
        if idx is None and is_linear:
            idx = self._linear
        if idx is None:
            return None
        name, _targets, scheme = self.groups[idx]
        return name, scheme

    def scheme_for(self, module_name: str, *, is_linear: bool = True) -> WeightScheme | None:
        """The weight scheme of a module, or None when it is not quantized by the config.

        ``is_linear`` says whether the module is a linear layer (what the class target ``"Linear"`` covers). The config
        only says what *should* be quantized; a loader should still let the tensors present decide (docs/formats.md §2).
        """
        found = self.match(module_name, is_linear=is_linear)
        return None if found is None else found[1]

    # ---- (de)serialisation ------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "QuantizationConfig":
        """Parse a ``quantization_config`` dict; ``source`` names the file in error messages."""
        return _Parser(source).parse(d)

    @classmethod
    def from_config_json(cls, path: str | os.PathLike[str]) -> "QuantizationConfig | None":
        """Read ``config.json`` (or a checkpoint folder holding one); None when it has no ``quantization_config``."""

        path, data = read_config(path)
        qc = data.get("quantization_config")
        if qc is None:
            return None
        return cls.from_dict(qc, source=path)

    def to_dict(self) -> dict[str, Any]:
        """A compressed-tensors ``quantization_config`` (as llmcompressor writes it) describing this config.

        It validates with ``compressed_tensors.QuantizationConfig.model_validate`` and round-trips through
        ``from_dict``. The weights' ``observer`` is "memoryless_minmax" because that is what qjax's own RTN quantizer
        (``packing.quantize_int`` / ``quantize_mxfp8``) computes; runtime-only MXFP8 activation settings are not kept.
        """
        return {
            "config_groups": {
                name: {
                    "format": scheme.format,
                    "input_activations": None,
                    "output_activations": None,
                    "targets": list(targets),
                    "weights": _weights_dict(scheme),
                }
                for name, targets, scheme in self.groups
            },
            "format": self.format if self.format is not None else _implied_format(self.groups),
            "global_compression_ratio": None,
            "ignore": list(self.ignore),
            "kv_cache_scheme": None if self.kv_cache is None else _kv_dict(self.kv_cache),
            "quant_method": QUANT_METHOD,
            "quantization_status": "compressed",
            "sparsity_config": {},
            "transform_config": {},
        }


def _weights_dict(s: WeightScheme) -> dict[str, Any]:
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": s.group_size,
        "num_bits": s.num_bits,
        "observer": "memoryless_minmax",
        "observer_kwargs": {},
        "scale_dtype": None if s.scale_dtype is None else f"torch.{s.scale_dtype}",
        "strategy": s.strategy,
        "symmetric": s.symmetric,
        "type": s.type,
        # compressed-tensors serialises zp_dtype only for asymmetric schemes.
        "zp_dtype": None if s.symmetric else "torch.int8",
    }


def _kv_dict(kv: KVCacheScheme) -> dict[str, Any]:
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": None,
        "num_bits": kv.num_bits,
        "observer": None,
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": kv.strategy,
        "symmetric": True,
        "type": kv.type,
        "zp_dtype": None,
    }


def _implied_format(groups: tuple[tuple[str, tuple[str, ...], WeightScheme], ...]) -> str:
    formats = sorted({scheme.format for _n, _t, scheme in groups})
    if not formats:
        return "dense"
    return formats[0] if len(formats) == 1 else MIXED_PRECISION


def _is_class_name(target: str) -> bool:
    # Module names are dotted paths or lowercase leaves ("lm_head"); torch class names are CamelCase identifiers.
    return not target.startswith("re:") and "." not in target and target[:1].isupper() and target.isidentifier()


def _compile(target: str, source: str, where: str):
    """The ``re:`` entry's pattern, matched by RE2 (linear time; see qjax.validation.compile_pattern) with
    ``re.match``'s anchoring, as compressed-tensors matches it."""
    return compile_pattern(target[3:], where=f"{source}: quantization_config.{where}", error=QuantConfigError)


def _is_empty(v: Any) -> bool:
    """None, {} or [] — or a dict holding only such values (e.g. ``{"config_groups": {}}``)."""
    if v is None or v == {} or v == []:
        return True
    return isinstance(v, dict) and all(_is_empty(x) for x in v.values())


def _norm_dtype(v: Any) -> str | None:
    """'torch.bfloat16' / 'bfloat16' -> 'bfloat16'; None stays None."""
    if v is None:
        return None
    if not isinstance(v, str):
        raise TypeError(v)
    return v.removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Args:
    """A validated QuantizationArgs dict (weights, activations or kv cache)."""

    num_bits: int
    type: str
    symmetric: bool
    strategy: str
    group_size: int | None
    dynamic: bool | str
    scale_dtype: str | None


class _Parser:
    def __init__(self, source: str):
        self.source = source

    def error(self, field: str, msg: str) -> QuantConfigError:
        return QuantConfigError(f"{self.source}: quantization_config.{field}: {msg}")

    # ---- top level ----------------------------------------------------------------------------------------------
    def parse(self, d: Any) -> QuantizationConfig:
        if not isinstance(d, dict):
            raise QuantConfigError(f"{self.source}: quantization_config: expected an object, got {type(d).__name__}")
        method = d.get("quant_method")
        if method != QUANT_METHOD:
            raise self.error("quant_method", f"{method!r} is not supported (only {QUANT_METHOD!r})")
        status = d.get("quantization_status")
        if status is not None and status != "compressed":
            # "frozen"/"decompressed" checkpoints hold dense weights with fake-quant params: not a packed format.
            raise self.error("quantization_status", f"{status!r} is not supported (only 'compressed')")
        sparsity = d.get("sparsity_config")
        if not _is_empty(sparsity):
            sfmt = sparsity.get("format") if isinstance(sparsity, dict) else sparsity
            if sfmt not in (None, "dense"):
                raise self.error("sparsity_config.format", f"sparsity format {sfmt!r} is not supported")
        if not _is_empty(d.get("transform_config")):
            raise self.error("transform_config", "transforms (e.g. Hadamard/SpinQuant rotations) are not supported")
        if not _is_empty(d.get("moe_sparsity_config")):
            raise self.error("moe_sparsity_config", "MoE expert sparsity (pruned/novice experts) is not supported")

        top = d.get("format")
        if top is not None and not isinstance(top, str):
            raise self.error("format", f"expected a string, got {top!r}")
        raw_groups = d.get("config_groups")
        if raw_groups is None:
            raw_groups = {}
        if not isinstance(raw_groups, dict):
            raise self.error("config_groups", f"expected an object, got {type(raw_groups).__name__}")
        kv_only = top == "dense" and not raw_groups  # e.g. an FP8-KV-only recipe
        if top is not None and top not in (*SUPPORTED_FORMATS, MIXED_PRECISION) and not kv_only:
            raise self.error("format", _format_refusal(top))

        groups = tuple(self.group(str(name), g, top) for name, g in raw_groups.items())
        ignore = self.ignore(d.get("ignore"))
        kv = self.kv_cache(d.get("kv_cache_scheme"))
        fmt = top if top is not None else _implied_format(groups)
        try:
            return QuantizationConfig(groups=groups, ignore=ignore, kv_cache=kv, format=fmt)
        except QuantConfigError as e:  # re-label errors raised while building the match tables
            raise QuantConfigError(str(e).replace("QuantizationConfig", self.source, 1)) from e

    def ignore(self, v: Any) -> tuple[str, ...]:
        if v is None:
            return ()
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self.error("ignore", "expected a list of strings")
        for t in v:
            if t.startswith("re:"):
                _compile(t, self.source, "ignore")
        return tuple(v)

    # ---- one config group ---------------------------------------------------------------------------------------
    def group(self, name: str, g: Any, top: str | None) -> tuple[str, tuple[str, ...], WeightScheme]:
        where = f"config_groups.{name}"
        if isinstance(g, list):
            raise self.error(where, "preset-name groups (a list of targets) are not supported; expected a scheme")
        if not isinstance(g, dict):
            raise self.error(where, f"expected an object, got {type(g).__name__}")
        extra = sorted(k for k in g if k not in _GROUP_KEYS and g[k] is not None)
        if extra:
            raise self.error(where, f"unknown keys {extra}")
        targets = g.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise self.error(f"{where}.targets", "expected a non-empty list of strings")
        for t in targets:
            if t.startswith("re:"):
                _compile(t, self.source, f"{where}.targets")
            elif t != "Linear" and _is_class_name(t):
                raise self.error(f"{where}.targets", f"class-name target {t!r} is not supported (only 'Linear')")

        if g.get("weights") is None:
            raise self.error(f"{where}.weights", "a group without weight quantization is not supported")
        w = self.args(g["weights"], f"{where}.weights")
        if w.dynamic is not False:
            raise self.error(f"{where}.weights.dynamic", f"dynamic={w.dynamic!r} weights are not supported")
        if w.strategy in _REFUSED_WEIGHT_STRATEGIES:
            raise self.error(f"{where}.weights.strategy", f"strategy {w.strategy!r} is not supported for weights "
                             "(only 'group', 'channel', 'tensor')")
        self.check_weight_type(w, f"{where}.weights")

        if g.get("output_activations") is not None:
            raise self.error(f"{where}.output_activations", "output activation quantization is not supported")
        inputs = g.get("input_activations")
        if inputs is not None:
            a = self.args(inputs, f"{where}.input_activations")
            if not (w.type == "float" and _is_mx_dynamic_activation(a)):
                raise self.error(
                    f"{where}.input_activations",
                    f"{a.type} {a.num_bits}-bit {a.strategy} activation quantization (dynamic={a.dynamic}) is not "
                    "supported: qjax runs activations unquantized; only MXFP8 weights' runtime MX activations are "
                    "accepted",
                )
            # MXFP8 dynamic MX activations (the MXFP8 preset) are computed at run time from the activations
            # themselves: no tensors are stored and the weights decode identically, so nothing is recorded.

        fmt = g.get("format")
        if fmt is None and top not in (None, MIXED_PRECISION):
            fmt = top
        if fmt is None:
            fmt = self.infer_format(w, where)
        if fmt not in SUPPORTED_FORMATS:
            raise self.error(f"{where}.format", _format_refusal(fmt))
        expected = PACK_QUANTIZED if w.type == "int" else MXFP8_QUANTIZED
        if fmt != expected:
            raise self.error(f"{where}.format", f"format {fmt!r} does not fit {w.type} {w.num_bits}-bit weights "
                             f"(expected {expected!r})")
        scheme = WeightScheme(
            format=fmt,
            num_bits=w.num_bits,
            type=w.type,
            symmetric=w.symmetric,
            strategy=w.strategy,
            group_size=w.group_size if w.strategy == "group" else None,
            scale_dtype="uint8" if fmt == MXFP8_QUANTIZED else w.scale_dtype,
        )
        return name, tuple(targets), scheme

    def check_weight_type(self, w: _Args, where: str) -> None:
        if w.type == "int":
            if w.num_bits not in INT_BITS:
                raise self.error(f"{where}.num_bits", f"{w.num_bits}-bit int weights are not supported "
                                 f"(only {', '.join(map(str, INT_BITS))})")
            if w.scale_dtype is not None and w.scale_dtype not in _INT_SCALE_DTYPES:
                raise self.error(f"{where}.scale_dtype", f"scale_dtype {w.scale_dtype!r} is not supported for int "
                                 f"weights (only null, {', '.join(_INT_SCALE_DTYPES)})")
            return
        # float: MXFP8 only — say what else it is, so the user knows which format was refused.
        mx = "only MXFP8 (float 8-bit, strategy group, group_size 32, scale_dtype uint8) is supported"
        if w.num_bits != 8:
            kind = {4: " (NVFP4/MXFP4)", 6: " (MXFP6)"}.get(w.num_bits, "")
            raise self.error(f"{where}.num_bits", f"float {w.num_bits}-bit weights{kind} are not supported; {mx}")
        if w.strategy != "group":
            raise self.error(f"{where}.strategy", f"FP8 weights with strategy {w.strategy!r} (float-quantized) are "
                             f"not supported; {mx}")
        if w.group_size != MX_GROUP_SIZE:
            raise self.error(f"{where}.group_size", f"float 8-bit group_size {w.group_size} is not MXFP8; {mx}")
        # compressed-tensors >= 0.20 omits a null scale_dtype when serialising; its MXFP8 compressor then uses uint8
        # (E8M0). The loader still checks that the stored scales really are U8.
        if w.scale_dtype not in ("uint8", None):
            raise self.error(f"{where}.scale_dtype", f"float 8-bit group 32 with scale_dtype {w.scale_dtype!r} is "
                             f"not MXFP8 (E8M0 scales need uint8); {mx}")
        if not w.symmetric:
            raise self.error(f"{where}.symmetric", f"asymmetric MXFP8 is not supported; {mx}")

    def infer_format(self, w: _Args, where: str) -> str:
        # docs/formats.md §2 / compressed_tensors.compressors.format: INT 1..8 bits -> pack-quantized (float activations
        # were refused above); float 8-bit, group 32, uint8 scales -> mxfp8-quantized (checked by check_weight_type).
        if w.type == "int":
            return PACK_QUANTIZED
        if w.type == "float":
            return MXFP8_QUANTIZED
        raise self.error(f"{where}.format", "null format and no usable top-level format; cannot infer it")

    # ---- QuantizationArgs ---------------------------------------------------------------------------------------
    def args(self, a: Any, where: str) -> _Args:
        if not isinstance(a, dict):
            raise self.error(where, f"expected an object, got {type(a).__name__}")
        extra = sorted(k for k in a if k not in _ARG_KEYS and not _is_empty(a[k]))
        if extra:
            raise self.error(where, f"unknown keys {extra}")

        num_bits = a.get("num_bits", 8)
        if not isinstance(num_bits, int) or isinstance(num_bits, bool):
            raise self.error(f"{where}.num_bits", f"expected an integer, got {num_bits!r}")
        qtype = a.get("type", "int")
        if not isinstance(qtype, str) or qtype.lower() not in ("int", "float"):
            raise self.error(f"{where}.type", f"{qtype!r} is not a quantization type ('int' or 'float')")
        qtype = qtype.lower()
        symmetric = a.get("symmetric", True)
        if not isinstance(symmetric, bool):
            raise self.error(f"{where}.symmetric", f"expected a boolean, got {symmetric!r}")

        if a.get("block_structure") is not None:
            raise self.error(f"{where}.block_structure", "block quantization is not supported")
        actorder = a.get("actorder")
        if actorder not in (None, False):
            # "group"/"dynamic" mean a g_idx permutation tensor (compressed-tensors <= 0.17); "weight"/"static"
            # are calibration-only orderings — refused too rather than trusting the producer got that right.
            raise self.error(f"{where}.actorder", f"activation ordering {actorder!r} is not supported (only null)")
        dynamic = a.get("dynamic", False)
        if isinstance(dynamic, str):
            dynamic = dynamic.lower()
        elif dynamic is None:
            dynamic = False
        elif not isinstance(dynamic, bool):
            raise self.error(f"{where}.dynamic", f"expected a boolean or 'local', got {dynamic!r}")

        group_size = a.get("group_size")
        if group_size is not None and (not isinstance(group_size, int) or isinstance(group_size, bool)):
            raise self.error(f"{where}.group_size", f"expected an integer or null, got {group_size!r}")
        strategy = a.get("strategy")
        if strategy is None:
            # compressed-tensors' QuantizationArgs inference.
            if group_size is None:
                strategy = "tensor"
            elif group_size > 0:
                strategy = "group"
            elif group_size == -1:
                strategy = "channel"
            else:
                raise self.error(f"{where}.group_size", f"invalid group_size {group_size}")
        if not isinstance(strategy, str):
            raise self.error(f"{where}.strategy", f"expected a string, got {strategy!r}")
        strategy = strategy.lower()
        if strategy not in ("tensor", "channel", "group", *_REFUSED_WEIGHT_STRATEGIES):
            raise self.error(f"{where}.strategy", f"unknown strategy {strategy!r}")
        if strategy == "group" and (group_size is None or group_size <= 0):
            raise self.error(f"{where}.group_size", f"strategy 'group' needs a positive group_size, got {group_size}")
        if strategy not in ("group", "tensor_group") and group_size is not None and group_size > 0:
            raise self.error(f"{where}.group_size", f"group_size {group_size} needs strategy 'group', not {strategy!r}")

        try:
            scale_dtype = _norm_dtype(a.get("scale_dtype"))
            zp_dtype = _norm_dtype(a.get("zp_dtype"))
        except TypeError as e:
            raise self.error(f"{where}.scale_dtype", f"expected a dtype string, got {e.args[0]!r}") from None
        if zp_dtype not in (None, "int8"):
            raise self.error(f"{where}.zp_dtype", f"zero-point dtype {zp_dtype!r} is not supported (only int8)")
        return _Args(num_bits, qtype, symmetric, strategy, group_size, dynamic, scale_dtype)

    # ---- kv cache -------------------------------------------------------------------------------------------------
    def kv_cache(self, v: Any) -> KVCacheScheme | None:
        if v is None:
            return None
        where = "kv_cache_scheme"
        a = self.args(v, where)
        if a.type != "float" or a.num_bits != 8:
            raise self.error(where, f"{a.type} {a.num_bits}-bit KV cache is not supported (only float 8-bit)")
        if a.strategy not in _KV_STRATEGIES:
            raise self.error(f"{where}.strategy", f"KV cache strategy {a.strategy!r} is not supported "
                             f"(only {', '.join(_KV_STRATEGIES)})")
        if not a.symmetric:
            raise self.error(f"{where}.symmetric", "asymmetric KV cache quantization is not supported")
        if a.dynamic is not False:
            raise self.error(f"{where}.dynamic", f"dynamic={a.dynamic!r} KV cache scales are not supported")
        return KVCacheScheme(num_bits=8, type="float", strategy=a.strategy)


def _is_mx_dynamic_activation(a: _Args) -> bool:
    """The MXFP8 preset's input activations: float 8-bit, group 32, dynamic, E8M0 (uint8) scales."""
    return (
        a.type == "float"
        and a.num_bits == 8
        and a.strategy == "group"
        and a.group_size == MX_GROUP_SIZE
        and a.dynamic is True
        and a.symmetric
        and a.scale_dtype in (None, "uint8")
    )


def _format_refusal(fmt: Any) -> str:
    why = {
        "int-quantized": "plain int8 weights with quantized activations (W8A8)",
        "float-quantized": "FP8 weights with quantized activations",
        "naive-quantized": "unpacked quantized weights",
        "nvfp4-pack-quantized": "NVFP4",
        "mxfp4-pack-quantized": "MXFP4",
        "mxfp6-pack-quantized": "MXFP6",
        "marlin-24": "2:4-sparse Marlin",
        "sparse-24-bitmask": "2:4 sparsity",
        "sparse-bitmask": "bitmask sparsity",
        "dense": "dense (unquantized) weights in a quantized group",
    }.get(fmt)
    detail = f" ({why})" if why else ""
    return f"format {fmt!r}{detail} is not supported (only {', '.join(map(repr, SUPPORTED_FORMATS))})"
