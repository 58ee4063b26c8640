"""Which scheme each linear layer gets: the global ``--bits/--group_size/--sym`` plus ``--layer_config`` regexes.

Names are transformers' text-model names (``model.layers.3.self_attn.q_proj``, experts unfused as
``model.layers.0.mlp.experts.5.gate_proj``) because that is what auto-round users write patterns against.
Matching follows auto-round 0.16.1 (docs/autoround.md §16.3): exact name first, otherwise the pattern is turned into a
standard regex and ``re.search``-ed; patterns apply in dict order, so a later one overwrites an earlier one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterable
from typing import Any

from qjax.checkpoint.auto_round import standard_regex
from qjax.quant.unquantized import check_not_named

logger = logging.getLogger("qjax.autoround")

SUPPORTED_BITS = (2, 4, 8)
SCHEME_FIELDS = ("bits", "group_size", "sym", "data_type")


class LayerConfigError(ValueError):
    """A ``layer_config`` / scheme option qjax cannot honour (the message names the pattern and the field)."""


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One layer's weight scheme. ``bits >= 16`` means "left in the model dtype"."""

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    data_type: str = "int"  # "int" | "mx_fp" (MXFP8: E4M3 values, E8M0 scales, group 32)

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    @property
    def is_mxfp8(self) -> bool:
        return self.data_type == "mx_fp"

    def describe(self) -> str:
        if not self.quantized:
            return "unquantized"
        if self.is_mxfp8:
            return "mxfp8"
        return f"int{self.bits} g{self.group_size} {'sym' if self.sym else 'asym'}"


def check_scheme(s: Scheme, where: str) -> None:
    if not s.quantized:
        return
    if s.data_type == "mx_fp":
        if s.bits != 8 or s.group_size != 32:
            raise LayerConfigError(f"{where}: MXFP is supported as MXFP8 (bits 8, group_size 32), got bits {s.bits}, "
                                   f"group_size {s.group_size}")
        return
    if s.data_type != "int":
        raise LayerConfigError(f"{where}: data_type {s.data_type!r} is not supported (int or mx_fp)")
    if s.bits not in SUPPORTED_BITS:
        raise LayerConfigError(f"{where}: bits {s.bits} is not supported (int {SUPPORTED_BITS} or 16 = unquantized); "
                               "3-bit packing has no compressed-tensors / vLLM kernel")
    if s.group_size != -1 and s.group_size <= 0:
        raise LayerConfigError(f"{where}: group_size {s.group_size} is not supported (a positive size or -1 for per "
                               "channel)")


def layer_scheme(base: Scheme, opts: dict[str, Any]) -> Scheme:
    """``base`` with a ``layer_config`` entry's fields applied."""
    return dataclasses.replace(base, **{k: v for k, v in opts.items() if k in SCHEME_FIELDS})


def check_layer_config(base: Scheme, layer_config: dict[str, dict[str, Any]]) -> None:
    """Refuse, before anything is loaded, a scheme qjax cannot store and a pattern that would quantize a part qjax
    keeps unquantized (:func:`check_kept_unquantized`)."""
    check_scheme(base, "--bits/--group_size/--data_type")
    for pat, opts in layer_config.items():
        check_scheme(layer_scheme(base, opts), f"--layer_config[{pat!r}]")
    check_kept_unquantized(base, layer_config)


def check_kept_unquantized(base: Scheme, layer_config: dict[str, dict[str, Any]]) -> None:
    """Refuse a pattern that names ``mtp`` or ``visual`` and quantizes: AutoRound's layers are the decoder's, and the
    MTP head and the vision tower go into the export as the source stores them (:mod:`qjax.quant.unquantized`)."""
    for pat, opts in layer_config.items():
        if layer_scheme(base, opts).quantized:
            check_not_named([pat], "--layer_config")


def parse_layer_config(arg: str | dict | None) -> dict[str, dict[str, Any]]:
    """``--layer_config`` text (strict JSON or auto-round's unquoted form ``{.*experts.*:{bits:2,group_size:64}}``,
    read as auto-round 0.16.1's ``parse_layer_config_arg`` reads it) → ``{pattern: {field: value}}``."""
    if arg is None or arg == "":
        return {}
    d = arg if isinstance(arg, dict) else parse_layer_config_text(arg)
    if not isinstance(d, dict):
        raise LayerConfigError(f"--layer_config must be a mapping of pattern -> options, got {arg!r}")
    out: dict[str, dict[str, Any]] = {}
    for pat, opts in d.items():
        if isinstance(opts, str):  # {"pattern": "W2A16"}-style preset names are auto-round schemes
            opts = {"scheme": opts}
        if not isinstance(opts, dict):
            raise LayerConfigError(f"--layer_config[{pat!r}]: expected a mapping of options, got {opts!r}")
        opts = dict(opts)
        if "scheme" in opts:
            opts = {**preset(opts.pop("scheme"), f"--layer_config[{pat!r}]"), **opts}
        bad = sorted(set(opts) - set(SCHEME_FIELDS) - {"scale_dtype"})
        if bad:
            raise LayerConfigError(f"--layer_config[{pat!r}]: unsupported option(s) {bad} "
                                   f"(supported: {list(SCHEME_FIELDS)})")
        out[str(pat)] = opts
    return out


def ignore_layers_config(arg: str | None, module_names=None) -> dict[str, dict[str, Any]]:
    """``--ignore_layers a,b,c`` (auto-round's ``--fp_layers``) → ``layer_config`` entries that keep those layers in
    the model dtype, matched as auto-round 0.16.1 matches them (``resolve_layer_config`` + ``get_fp_layer_names``):
    spaces are removed and the text split on ``,``; a name ending in a digit gets a trailing ``.`` when some module
    sits under it (``layers.1`` must not catch ``layers.10``); then a name catches a layer it equals, or is a substring
    of, or whose name its ``to_standard_regex`` form ``re.search``-es (a plain name: substring; so ``mlp.gate`` also
    catches ``mlp.gate_proj``, as in auto-round). ``module_names`` (every module name) decides the digit rule; without
    it a module is assumed under the name (qjax's linear layers' own names never end in a digit).
    Each entry is ``{"bits": 16}``, put after ``--layer_config``'s so that it wins."""
    if not arg:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name in arg.replace(" ", "").split(","):
        if not name:
            continue
        if name[-1].isdigit() and (module_names is None or any(name + "." in n for n in module_names)):
            name += "."
        out[name] = {"bits": 16}
    return out


def ignored_layers(arg: str | None, layer_names, module_names=None) -> list[str]:
    """The layers of ``layer_names`` that ``--ignore_layers`` keeps unquantized (the rule of
    :func:`ignore_layers_config`, as :func:`resolve` applies it)."""
    pats = [(p, re.compile(standard_regex(p))) for p in ignore_layers_config(arg, module_names)]
    return [n for n in layer_names if any(n == p or p in n or rx.search(n) for p, rx in pats)]


def preset(name: str, where: str) -> dict[str, Any]:
    presets = {"W2A16": dict(bits=2, group_size=128, sym=True), "W2A16G64": dict(bits=2, group_size=64, sym=True),
               "W2A16G32": dict(bits=2, group_size=32, sym=True), "W4A16": dict(bits=4, group_size=128, sym=True),
               "W8A16": dict(bits=8, group_size=128, sym=True), "MXFP8": dict(bits=8, group_size=32, data_type="mx_fp"),
               "BF16": dict(bits=16), "FP16": dict(bits=16)}
    if str(name).upper() not in presets:
        raise LayerConfigError(f"{where}: unknown scheme {name!r} (known: {sorted(presets)})")
    return dict(presets[str(name).upper()])


def parse_layer_config_text(s: str) -> dict:
    """auto-round 0.16.1's ``parse_layer_config_arg`` (auto_round/utils/common.py), rule for rule: strict JSON first,
    then JSON with regex backslashes (``\\d``) repaired, then the shell-friendly form: tokens ``{ } : ,`` and runs of
    anything else but whitespace, values ``int`` / ``float`` / ``true`` / ``false`` / ``null`` / ``none`` / string, one
    pair of matching quotes stripped. A malformed value raises :class:`LayerConfigError` naming ``--layer_config``."""

    def strip_matching_quotes(token: str) -> str:
        token = token.strip().replace("\u201c", '"').replace("\u201d", '"')
        if len(token) >= 2 and token[0] == token[-1] and token[0] in ("'", '"'):
            return token[1:-1]
        return token

    def normalize_scalar(value):
        if not isinstance(value, str):
            return value
        value = strip_matching_quotes(value)
        if value.lstrip("-").isdigit():
            return int(value)
        try:
            return float(value)
        except ValueError:
            pass
        low = value.lower()
        return {"true": True, "false": False, "null": None, "none": None}.get(low, value)

    def normalize_tree(value):
        if isinstance(value, dict):
            return {normalize_scalar(k): normalize_tree(v) for k, v in value.items()}
        if isinstance(value, list):
            return [normalize_tree(item) for item in value]
        return normalize_scalar(value)

    def escape_invalid_json_backslashes(text: str) -> str:
        escaped, in_string, i = [], False, 0
        while i < len(text):
            ch = text[i]
            if not in_string:
                if ch == '"':
                    in_string = True
                escaped.append(ch)
                i += 1
                continue
            if ch == "\\":
                nxt = text[i + 1] if i + 1 < len(text) else ""
                if nxt not in {'"', "\\", "/", "b", "f", "n", "r", "t", "u"}:
                    escaped.append("\\\\")
                    i += 1
                    continue
            if ch == '"':
                in_string = False
            escaped.append(ch)
            i += 1
        return "".join(escaped)

    s = strip_matching_quotes(s)
    for text in (s, escape_invalid_json_backslashes(s)):
        try:
            return normalize_tree(json.loads(text))
        except Exception:
            pass
    tokens = re.findall(r"[{}:,]|[^\s{}:,]+", s)
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def consume(expected=None):
        nonlocal pos
        tok = peek()
        if tok is None:
            raise ValueError("unexpected end of input")
        if expected and tok != expected:
            raise ValueError(f"expected '{expected}', got '{tok}'")
        pos += 1
        return tok

    def parse_value():
        if peek() == "{":
            return parse_dict()
        return normalize_scalar(consume())

    def parse_dict():
        consume("{")
        result = {}
        while True:
            if peek() == "}":
                consume("}")
                break
            key = normalize_scalar(consume())
            consume(":")
            result[key] = parse_value()
            if peek() == ",":
                consume(",")
        return result

    try:
        return parse_dict()
    except ValueError as e:
        raise LayerConfigError(f"--layer_config: cannot parse {s!r}: {e}") from None


def resolve(names: dict[str, tuple[int, int]], base: Scheme, layer_config: dict[str, dict[str, Any]], *,
            ignored: Iterable[str] = ()) -> dict[str, Scheme]:
    """Scheme per module name.

    Args:
      names: every quantizable linear → (out_features, in_features).
      base: the global scheme.
      layer_config: parsed ``--layer_config`` (dict order = precedence, later wins).
      ignored: the patterns of ``layer_config`` that ``--ignore_layers`` put there (:func:`ignore_layers_config`).
    Returns:
      module name → Scheme (``bits >= 16``: left unquantized, by request or because its shape does not fit).
    Warns for a ``--layer_config`` pattern that matches nothing; an ``--ignore_layers`` name that keeps no quantizable
    layer (the router, an untouched ``lm_head``, a typo) is an info line under its own flag's name.
    """
    check_scheme(base, "global scheme")
    check_kept_unquantized(base, layer_config)
    compiled = _compile(layer_config)
    hits = {pat: 0 for pat in layer_config}
    partial: dict[tuple[int, int], list[str]] = {}  # (in_features, group) → layers left unquantized for it
    out: dict[str, Scheme] = {}
    for name, (n_out, n_in) in names.items():
        s = base
        for pat, rx, opts in compiled:
            if _matches(name, pat, rx):
                hits[pat] += 1
                s = layer_scheme(s, opts)
        check_scheme(s, f"{name} (from --layer_config)")
        if s.quantized and not s.is_mxfp8 and (n_out % 32 or n_in % 32):
            # auto-round's rule for INT weight-only schemes: such layers stay in the model dtype
            logger.info("%s [%d, %d]: not divisible by 32, left unquantized (as auto-round does)", name, n_out, n_in)
            s = dataclasses.replace(s, bits=16)
        gs = 32 if s.is_mxfp8 else s.group_size
        if s.quantized and gs > 0 and n_in % gs:
            # auto-round pads the last group; compressed-tensors and vLLM cannot store a partial group
            partial.setdefault((n_in, gs), []).append(name)
            s = dataclasses.replace(s, bits=16)
        out[name] = s
    for (n_in, gs), which in partial.items():  # one line per shape, not one per expert
        logger.warning("%d layers with in_features %d (not a multiple of group_size %d) are left unquantized: %s",
                       len(which), n_in, gs, ", ".join(which[:3]) + (", …" if len(which) > 3 else ""))
    ignored = set(ignored)
    for pat, n in hits.items():
        if n == 0 and pat in ignored:
            logger.info("--ignore_layers %r: no quantizable layer matches (already kept in the model dtype, or "
                        "misspelled)", pat.removesuffix("."))
        elif n == 0:
            logger.warning("--layer_config pattern %r matches no quantizable layer", pat)
    if names and not any(s.quantized for s in out.values()):
        # exit 0 with a float folder would look like success; say which shapes the requested groups missed
        if partial:
            shapes = "; ".join(f"{len(w)} layer{'s' * (len(w) > 1)} with in_features {n_in} (not a multiple of "
                               f"group_size {gs})" for (n_in, gs), w in partial.items())
            raise LayerConfigError(f"nothing would be quantized: {shapes}; pick a group_size that divides them")
        raise LayerConfigError("nothing would be quantized: every layer is kept in float by the scheme, "
                               "--layer_config or --ignore_layers")
    return out


def _compile(layer_config: dict[str, dict[str, Any]]) -> list[tuple[str, re.Pattern, dict[str, Any]]]:
    compiled = []
    for pat, opts in layer_config.items():
        try:
            compiled.append((pat, re.compile(standard_regex(pat)), opts))
        except re.error as e:
            raise LayerConfigError(f"--layer_config pattern {pat!r} is not a valid regex: {e}") from None
    return compiled


def _matches(name: str, pat: str, rx: re.Pattern) -> bool:
    return name == pat or rx.search(name) is not None


def matching_patterns(name: str, layer_config: dict[str, dict[str, Any]]) -> list[str]:
    """The ``layer_config`` patterns that apply to module ``name`` (:func:`resolve`'s rule)."""
    return [pat for pat, rx, _ in _compile(layer_config) if _matches(name, pat, rx)]
