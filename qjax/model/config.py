"""Frozen model configuration parsed from a Hugging Face ``config.json``.

Only ``qwen3_5_moe`` (composite: the text model lives under ``text_config``) and ``qwen3_5_moe_text`` are accepted.
Every field the math needs is read from the file; nothing is hard-coded to the 35B sizes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from qjax.validation import Fields, confined, read_json, show

LINEAR = "linear_attention"
FULL = "full_attention"

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")

# Upper bounds that no real config approaches (the 35B: 40 layers, 256 experts, 2,048 wide, 248,320 tokens) but that
# keep a hostile one from asking for loops of a billion modules or tensors of a trillion elements.
MAX_COUNT = 1 << 16  # layers, heads, experts
MAX_DIM = 1 << 20  # widths
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 26


class ConfigError(ValueError):
    """A config.json that qjax cannot run: names the file and the field."""


@dataclasses.dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    mtp_num_hidden_layers: int = 0
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    dtype: str | None = None  # the checkpoint's declared dtype ("bfloat16", "float32", ...)

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def layer_period(self) -> tuple[str, ...]:
        """The shortest prefix of ``layer_types`` that tiles it (``[lin, lin, lin, full]`` for Qwen3.6).

        The model scans over repetitions of this group so compile time does not grow with depth.
        """
        n = len(self.layer_types)
        for p in range(1, n + 1):
            if n % p == 0 and self.layer_types == self.layer_types[:p] * (n // p):
                return self.layer_types[:p]
        return self.layer_types  # unreachable: p = n always tiles

    @property
    def num_groups(self) -> int:
        return self.num_hidden_layers // len(self.layer_period)

    def replace(self, **changes: Any) -> "TextConfig":
        return dataclasses.replace(self, **changes)

    # ---- parsing -------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "TextConfig":
        """Parse a ``config.json`` object; every field is type- and range-checked (:class:`qjax.validation.Fields`),
        so a bad value is one :class:`ConfigError` naming ``source`` and the field, never a Python exception."""
        top = Fields(raw, source, ConfigError)
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {show(model_type)} is not supported; qjax runs "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        f = top.sub("text_config", required=True) if model_type == "qwen3_5_moe" else top
        where = f.where

        count = dict(min=1, max=MAX_COUNT)
        dim = dict(min=1, max=MAX_DIM)
        n_layers = f.int("num_hidden_layers", **count)
        hidden = f.int("hidden_size", **dim)
        n_heads = f.int("num_attention_heads", **count)
        layer_types = f.str_list("layer_types", None, choices=(LINEAR, FULL))
        if layer_types is None:
            interval = f.int("full_attention_interval", None, min=1)
            if interval is None:
                raise ConfigError(f"{where}: needs 'layer_types' or 'full_attention_interval'")
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
        layer_types = tuple(layer_types)
        if len(layer_types) != n_layers:
            raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries but num_hidden_layers={n_layers}")

        rope = f.sub("rope_parameters") if f.has("rope_parameters") else f.sub("rope_scaling")
        rope_type = rope.str("rope_type", None) or rope.str("type", "default")
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"{rope.where}: rope_type {show(rope_type)} is not supported (only 'default')")
        theta = rope.float("rope_theta", None, positive=True)
        if theta is None:
            if not f.has("rope_theta"):
                raise ConfigError(f"{where}: required field 'rope_parameters.rope_theta' is missing")
            theta = f.float("rope_theta", positive=True)
        prf = rope.float("partial_rotary_factor", None, positive=True, max=1.0)
        if prf is None:
            prf = f.float("partial_rotary_factor", 1.0, positive=True, max=1.0)
        head_dim = f.int("head_dim", None, **dim)
        if head_dim is None:
            if hidden % n_heads:
                raise ConfigError(f"{where}: no head_dim, and hidden_size {hidden} is not a multiple of "
                                  f"num_attention_heads {n_heads}")
            head_dim = hidden // n_heads
        rotary_half = int(head_dim * prf) // 2
        section = tuple(rope.int_list("mrope_section", [rotary_half, 0, 0], min=0, length=3))
        if sum(section) != rotary_half:
            raise ConfigError(f"{rope.where}: mrope_section {list(section)} must sum to rotary_dim/2 = {rotary_half}")

        # special token ids may sit at the top of a composite config or in its text_config
        tokens = top if top.has("eos_token_id") else f
        eos = tokens.int_list("eos_token_id", [], min=0, scalar=True)
        pad = (top if top.has("pad_token_id") else f).int("pad_token_id", None, min=0)
        tie = (top if top.has("tie_word_embeddings") else f).bool("tie_word_embeddings", False)
        f.str("hidden_act", "silu", choices=("silu",))
        if f.bool("attention_bias", False):
            raise ConfigError(f"{where}: attention_bias=true is not supported by qwen3_5_moe")
        dtype = None
        for fields in (f, top):
            for name in ("dtype", "torch_dtype"):
                dtype = dtype or fields.str(name, None)

        cfg = cls(
            vocab_size=f.int("vocab_size", min=1, max=MAX_VOCAB),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            num_attention_heads=n_heads,
            num_key_value_heads=f.int("num_key_value_heads", **count),
            head_dim=head_dim,
            linear_num_key_heads=f.int("linear_num_key_heads", **count),
            linear_num_value_heads=f.int("linear_num_value_heads", **count),
            linear_key_head_dim=f.int("linear_key_head_dim", **dim),
            linear_value_head_dim=f.int("linear_value_head_dim", **dim),
            linear_conv_kernel_dim=f.int("linear_conv_kernel_dim", min=1, max=64),
            num_experts=f.int("num_experts", **count),
            num_experts_per_tok=f.int("num_experts_per_tok", **count),
            moe_intermediate_size=f.int("moe_intermediate_size", **dim),
            shared_expert_intermediate_size=f.int("shared_expert_intermediate_size", **dim),
            rms_norm_eps=f.float("rms_norm_eps", 1e-6, positive=True, max=1.0),
            rope_theta=theta,
            partial_rotary_factor=prf,
            mrope_section=section,  # type: ignore[arg-type]
            max_position_embeddings=f.int("max_position_embeddings", 262144, min=1, max=MAX_POSITIONS),
            tie_word_embeddings=tie,
            initializer_range=f.float("initializer_range", 0.02, min=0.0),
            mtp_num_hidden_layers=f.int("mtp_num_hidden_layers", 0, min=0, max=MAX_COUNT),
            eos_token_id=tuple(eos),
            pad_token_id=pad,
            bos_token_id=(top if top.has("bos_token_id") else f).int("bos_token_id", None, min=0),
            dtype=dtype,
        )
        cfg.validate(where)
        return cfg

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "TextConfig":
        """``config.json`` (or a folder holding one); see :func:`read_config`."""
        path, raw = read_config(path)
        return cls.from_dict(raw, source=path)

    def validate(self, where: str = "config") -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"{where}: {msg}")

        check(self.num_attention_heads % self.num_key_value_heads == 0,
              f"num_attention_heads={self.num_attention_heads} is not a multiple of "
              f"num_key_value_heads={self.num_key_value_heads}")
        check(self.linear_num_value_heads % self.linear_num_key_heads == 0,
              f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
              f"linear_num_key_heads={self.linear_num_key_heads}")
        check(0 < self.num_experts_per_tok <= self.num_experts,
              f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}")
        check(self.rotary_dim % 2 == 0 and self.rotary_dim <= self.head_dim,
              f"rotary dim {self.rotary_dim} (head_dim·partial_rotary_factor) must be even and ≤ head_dim")
        check(self.linear_conv_kernel_dim >= 1, "linear_conv_kernel_dim must be ≥ 1")

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``qwen3_5_moe_text`` config.json this config was read from (round-trips through ``from_dict``)."""
        return {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": True,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "attention_bias": False,
            "initializer_range": self.initializer_range,
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "dtype": self.dtype,
        }


def read_config(path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """``(path, object)`` of ``config.json`` (``path`` is the file or a folder holding one), read through
    :func:`qjax.validation.read_json`: confined to the folder, size- and depth-bounded, a JSON object, or a
    :class:`ConfigError` naming the file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = confined(path, "config.json", what=path, error=ConfigError)
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no config.json found")
    return path, read_json(path, error=ConfigError)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Sampling defaults, normally read from ``generation_config.json`` (HF semantics and processor order)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    max_new_tokens: int | None = None

    @classmethod
    def from_dict(cls, raw: dict, *, source: str = "generation_config.json") -> "GenerationConfig":
        """Parse a ``generation_config.json`` object; a field of the wrong type or range is a ``ValueError`` naming
        ``source`` and the field."""
        f = Fields(raw, source, ValueError)
        return cls(
            do_sample=f.bool("do_sample", False),
            temperature=f.float("temperature", 1.0, min=0.0) or 1.0,
            top_k=f.int("top_k", 0, min=0),
            top_p=f.float("top_p", 1.0, positive=True, max=1.0),
            eos_token_id=tuple(f.int_list("eos_token_id", [], min=0, scalar=True)),
            pad_token_id=f.int("pad_token_id", None, min=0),
            max_new_tokens=f.int("max_new_tokens", None, min=1),
        )

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "GenerationConfig":
        folder = os.fspath(folder)
        path = confined(folder, "generation_config.json", what=folder)
        if not os.path.lexists(path):
            return cls()
        return cls.from_dict(read_json(path), source=path)
