"""The parts of a Qwen3.5/3.6 checkpoint that stay in their own dtype unless a recipe names them, declared once.

Every seed checkpoint keeps the MTP head (``mtp.*``) and the vision tower with its projector (``model.visual.*``) in
BF16 under INT2/INT4, INT8 and MXFP8 bodies (docs/formats.md §9), and no producer tool quantizes them: they sit
outside transformers' text model. qjax does the same, and everything that decides it reads this table — RTN
(:mod:`qjax.autoround.rtn`), AutoRound's ``layer_config`` check, and both writers, whose ``ignore`` (compressed-tensors)
and ``extra_config`` (auto-round) entries are derived here, and the quantize command, which copies these tensors
from its source as stored.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class KeptPart:
    """One part kept unquantized: the checkpoint keys under ``prefix``."""

    prefix: str  # checkpoint key prefix, e.g. "mtp."
    what: str  # how messages name it

    @property
    def word(self) -> str:
        """The part's own name (``mtp``, ``visual``). Consumers rename the parents of a part (vLLM loads
        ``model.visual.*`` as ``visual.*``) but not the part itself, so patterns and recipes are keyed on it."""
        return self.prefix.rstrip(".").rpartition(".")[2]

    @property
    def regex(self) -> str:
        """A regex for the part's module names wherever a consumer nests them: ``.*mtp\\..*`` — also what
        auto-round's ``to_standard_regex`` makes of the plain name ``mtp.``, so it serves as an ``extra_config``
        key as it is."""
        return f".*{re.escape(self.word + '.')}.*"

    @property
    def ignore_entry(self) -> str:
        """The compressed-tensors ``ignore`` entry (compressed-tensors and vLLM ``re.match`` it)."""
        return "re:" + self.regex

    def holds(self, name: str) -> bool:
        """Whether the checkpoint key or module name ``name`` belongs to the part."""
        return name.startswith(self.prefix)

    def named_by(self, pattern: str) -> bool:
        """Whether a recipe target or ``layer_config`` pattern names the part explicitly (``re:.*mtp.*``,
        ``mtp.fc``); a generic one (``Linear``, ``re:.*self_attn\\.q_proj$``) that merely matches its modules does
        not."""
        return self.word in pattern


KEPT_UNQUANTIZED: tuple[KeptPart, ...] = (
    KeptPart("mtp.", "the MTP head"),
    KeptPart("model.visual.", "the vision tower"),
)


def kept_part(name: str) -> KeptPart | None:
    """The kept part ``name`` (a checkpoint key or module name) belongs to, or None."""
    return next((p for p in KEPT_UNQUANTIZED if p.holds(name)), None)


def parts_held(keys) -> tuple[KeptPart, ...]:
    """The kept parts that have tensors among ``keys``, in declaration order (what an export lists)."""
    keys = list(keys)
    return tuple(p for p in KEPT_UNQUANTIZED if any(p.holds(k) for k in keys))


def check_not_named(patterns, where: str) -> None:
    """Refuse a recipe that quantizes a kept part by naming it (``patterns``: the targets or ``layer_config``
    patterns that quantize). qjax holds the MTP head dense and does not load the vision tower, so it cannot produce
    such a checkpoint; a silent skip would leave the user believing the part was quantized."""
    for pattern in patterns:
        for part in KEPT_UNQUANTIZED:
            if part.named_by(pattern):
                raise ValueError(f"{where}: {pattern!r} names {part.prefix}* ({part.what}), which qjax keeps "
                                 "unquantized, as the seeds do: it holds the MTP head dense and does not load the "
                                 "vision tower, so it cannot write them quantized; drop the pattern")
