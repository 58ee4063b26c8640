"""Frozen model configuration parsed from a Hugging Face ``config.json``.

Only ``qwen3_5_moe`` (composite: the text model lives under ``text_config``) and ``qwen3_5_moe_text`` are accepted.
Every field the math needs is read from the file; nothing is hard-coded to the 35B sizes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

LINEAR = "linear_attention"
FULL = "full_attention"

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


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
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; qjax runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        top = raw
        if model_type == "qwen3_5_moe":
            if not isinstance(raw.get("text_config"), dict):
                raise ConfigError(f"{source}: model_type 'qwen3_5_moe' needs a 'text_config' object")
            text = dict(raw["text_config"])
            where = f"{source}: text_config"
        else:
            text = raw
            where = source

        def req(name: str) -> Any:
            if text.get(name) is None:
                raise ConfigError(f"{where}: required field {name!r} is missing")
            return text[name]

        n_layers = int(req("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval")
            if interval is None:
                raise ConfigError(f"{where}: needs 'layer_types' or 'full_attention_interval'")
            layer_types = [FULL if (i + 1) % int(interval) == 0 else LINEAR for i in range(n_layers)]
        layer_types = tuple(layer_types)
        if len(layer_types) != n_layers:
            raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries but num_hidden_layers={n_layers}")
        bad = sorted({t for t in layer_types if t not in (LINEAR, FULL)})
        if bad:
            raise ConfigError(f"{where}: unknown layer_types {bad}; expected {LINEAR!r} or {FULL!r}")

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"{where}: rope_parameters.rope_type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", text.get("rope_theta"))
        if theta is None:
            raise ConfigError(f"{where}: required field 'rope_parameters.rope_theta' is missing")
        prf = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
        head_dim = int(text.get("head_dim") or int(req("hidden_size")) // int(req("num_attention_heads")))
        rotary_half = int(head_dim * prf) // 2
        section = rope.get("mrope_section")
        if section is None:
            section = [rotary_half, 0, 0]
        section = tuple(int(s) for s in section)
        if len(section) != 3 or sum(section) != rotary_half:
            raise ConfigError(
                f"{where}: rope_parameters.mrope_section {list(section)} must have 3 parts summing to "
                f"rotary_dim/2 = {rotary_half}"
            )

        eos = top.get("eos_token_id", text.get("eos_token_id"))
        if eos is None:
            eos = text.get("eos_token_id")
        eos_t = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        pad = top.get("pad_token_id", text.get("pad_token_id"))

        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act {text.get('hidden_act')!r} is not supported (only 'silu')")
        if text.get("attention_bias", False):
            raise ConfigError(f"{where}: attention_bias=true is not supported by qwen3_5_moe")

        cfg = cls(
            vocab_size=int(req("vocab_size")),
            hidden_size=int(req("hidden_size")),
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            num_attention_heads=int(req("num_attention_heads")),
            num_key_value_heads=int(req("num_key_value_heads")),
            head_dim=head_dim,
            linear_num_key_heads=int(req("linear_num_key_heads")),
            linear_num_value_heads=int(req("linear_num_value_heads")),
            linear_key_head_dim=int(req("linear_key_head_dim")),
            linear_value_head_dim=int(req("linear_value_head_dim")),
            linear_conv_kernel_dim=int(req("linear_conv_kernel_dim")),
            num_experts=int(req("num_experts")),
            num_experts_per_tok=int(req("num_experts_per_tok")),
            moe_intermediate_size=int(req("moe_intermediate_size")),
            shared_expert_intermediate_size=int(req("shared_expert_intermediate_size")),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            partial_rotary_factor=prf,
            mrope_section=section,  # type: ignore[arg-type]
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            tie_word_embeddings=bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            initializer_range=float(text.get("initializer_range", 0.02)),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
            eos_token_id=eos_t,
            pad_token_id=None if pad is None else int(pad),
            bos_token_id=text.get("bos_token_id"),
            dtype=text.get("dtype") or text.get("torch_dtype") or top.get("dtype") or top.get("torch_dtype"),
        )
        cfg.validate(where)
        return cfg

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "TextConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
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
