"""Frozen model configuration parsed from a Hugging Face ``config.json``.

Only ``qwen3_5_moe`` (composite: the text model lives under ``text_config``) and ``qwen3_5_moe_text`` are accepted.
Every field the math needs is read from the file; nothing is hard-coded to the 35B sizes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

from qjax.validation import MAX_TOKEN_ID, Fields, confined, read_json, show

LINEAR = "linear_attention"
FULL = "full_attention"

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")

logger = logging.getLogger("qjax")

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

        # special token ids may sit at the top of a composite config or in its text_config; each is a row of the
        # embedding (0 ≤ id < vocab_size): an id of 10^20 would only fail later, as an overflow deep in generate
        vocab = f.int("vocab_size", min=1, max=MAX_VOCAB)
        ids = dict(min=0, max=vocab - 1)
        tokens = top if top.has("eos_token_id") else f
        eos = tokens.int_list("eos_token_id", [], scalar=True, **ids)
        pad = (top if top.has("pad_token_id") else f).int("pad_token_id", None, **ids)
        tie = (top if top.has("tie_word_embeddings") else f).bool("tie_word_embeddings", False)
        f.str("hidden_act", "silu", choices=("silu",))
        if f.bool("attention_bias", False):
            raise ConfigError(f"{where}: attention_bias=true is not supported by qwen3_5_moe")
        dtype = None
        for fields in (f, top):
            for name in ("dtype", "torch_dtype"):
                dtype = dtype or fields.str(name, None)

        cfg = cls(
            vocab_size=vocab,
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
            bos_token_id=(top if top.has("bos_token_id") else f).int("bos_token_id", None, **ids),
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


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower (``vision_config`` of a composite ``qwen3_5_moe`` config.json, docs/model.md §6.4) and the
    composite config's multimodal token ids. Defaults are transformers' ``Qwen3_5MoeVisionConfig`` /
    ``Qwen3_5MoeConfig`` defaults (the 35B-A3B tower)."""

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    out_hidden_size: int = 2048
    rope_theta: float = 10_000.0
    initializer_range: float = 0.02
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch (``C · temporal · patch · patch``): a row of ``pixel_values``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per merged token (``spatial_merge_size²``)."""
        return self.spatial_merge_size ** 2

    @property
    def grid_side(self) -> int:
        """Side of the learned position-embedding grid (``√num_position_embeddings``)."""
        return math.isqrt(self.num_position_embeddings)

    def replace(self, **changes: Any) -> "VisionConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "VisionConfig | None":
        """The vision config of a composite ``qwen3_5_moe`` config.json; None for a text-only one
        (``qwen3_5_moe_text`` or no ``vision_config``). Every field is type- and range-checked."""
        if raw.get("model_type") != "qwen3_5_moe" or "vision_config" not in raw:
            return None
        top = Fields(raw, source, ConfigError)
        f = top.sub("vision_config", required=True)
        # the token ids index the text model's embedding: checked here, where the file can be named
        vocab = top.sub("text_config").int("vocab_size", None, min=1, max=MAX_VOCAB)
        token = dict(min=0, max=(vocab or MAX_VOCAB + 1) - 1)
        count = dict(min=1, max=MAX_COUNT)
        dim = dict(min=1, max=MAX_DIM)
        f.str("hidden_act", "gelu_pytorch_tanh", choices=("gelu_pytorch_tanh",))
        if f.has("deepstack_visual_indexes") and f.int_list("deepstack_visual_indexes", [], min=0):
            raise ConfigError(f"{f.where}: deepstack_visual_indexes is not supported (qwen3_5_moe has none)")
        theta = 10_000.0
        if f.has("rope_parameters") and f.obj("rope_parameters") is not None:
            rope = f.sub("rope_parameters")
            rope.str("rope_type", "axial", choices=("axial",))
            theta = rope.float("rope_theta", 10_000.0, positive=True)
        cfg = cls(
            depth=f.int("depth", 27, **count),
            hidden_size=f.int("hidden_size", 1152, **dim),
            num_heads=f.int("num_heads", 16, **count),
            intermediate_size=f.int("intermediate_size", 4304, **dim),
            in_channels=f.int("in_channels", 3, min=1, max=16),
            patch_size=f.int("patch_size", 16, min=1, max=1024),
            temporal_patch_size=f.int("temporal_patch_size", 2, min=1, max=64),
            spatial_merge_size=f.int("spatial_merge_size", 2, min=1, max=64),
            num_position_embeddings=f.int("num_position_embeddings", 2304, min=1, max=MAX_DIM),
            out_hidden_size=f.int("out_hidden_size", 3584, **dim),
            rope_theta=theta,
            initializer_range=f.float("initializer_range", 0.02, min=0.0),
            image_token_id=top.int("image_token_id", 248056, **token),
            video_token_id=top.int("video_token_id", 248057, **token),
            vision_start_token_id=top.int("vision_start_token_id", 248053, **token),
            vision_end_token_id=top.int("vision_end_token_id", 248054, **token),
        )
        cfg.validate(f.where)
        return cfg

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "VisionConfig | None":
        """``config.json`` (or a folder holding one); None when it describes a text-only model."""
        path, raw = read_config(path)
        return cls.from_dict(raw, source=path)

    def validate(self, where: str = "vision_config", text: TextConfig | None = None) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"{where}: {msg}")

        check(self.hidden_size % self.num_heads == 0,
              f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        check(self.head_dim % 4 == 0, f"head_dim {self.head_dim} must be a multiple of 4 (2-D rotary: h and w halves)")
        check(self.grid_side ** 2 == self.num_position_embeddings,
              f"num_position_embeddings={self.num_position_embeddings} is not a square")
        if text is not None:
            check(self.out_hidden_size == text.hidden_size,
                  f"out_hidden_size={self.out_hidden_size} differs from the text model's hidden_size="
                  f"{text.hidden_size}")
            for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
                check(getattr(self, name) < text.vocab_size,
                      f"{name}={getattr(self, name)} is outside the vocabulary ({text.vocab_size})")

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``vision_config`` object (the token ids live at the top of the composite config: :attr:`token_ids`)."""
        return {
            "model_type": "qwen3_5_moe_vision",
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": self.in_channels,
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "num_position_embeddings": self.num_position_embeddings,
            "out_hidden_size": self.out_hidden_size,
            "initializer_range": self.initializer_range,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        }

    @property
    def token_ids(self) -> dict[str, int]:
        return {"image_token_id": self.image_token_id, "video_token_id": self.video_token_id,
                "vision_start_token_id": self.vision_start_token_id, "vision_end_token_id": self.vision_end_token_id}


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
    def from_dict(cls, raw: dict, *, source: str = "generation_config.json",
                  vocab_size: int | None = None) -> "GenerationConfig":
        """Parse a ``generation_config.json`` object; a field of the wrong type or range is a ``ValueError`` naming
        ``source`` and the field. Token ids must be below ``vocab_size`` (the model's, when known), else below 2^31.

        ``do_sample: true`` with ``temperature: 0`` decodes greedily, as vLLM reads it (transformers refuses the
        file; sampling at temperature 1 instead, as a plain ``or 1.0`` did, is neither): the config says greedy
        (``do_sample`` false), so every consumer — :func:`qjax.generate`, the server's defaults — agrees, and a
        warning on the ``qjax`` logger (one line on stderr under the command line) says so."""
        f = Fields(raw, source, ValueError)
        ids = dict(min=0, max=(vocab_size or MAX_TOKEN_ID + 1) - 1)
        do_sample = f.bool("do_sample", False)
        temperature = f.float("temperature", 1.0, min=0.0)
        if do_sample and temperature == 0:
            logger.warning("%s: do_sample is true with temperature 0: decoding greedily, as vLLM does", source)
            do_sample = False
        return cls(
            do_sample=do_sample,
            temperature=temperature or 1.0,  # 0 with do_sample false: greedy, the temperature unused
            top_k=f.int("top_k", 0, min=0),
            top_p=f.float("top_p", 1.0, positive=True, max=1.0),
            eos_token_id=tuple(f.int_list("eos_token_id", [], scalar=True, **ids)),
            pad_token_id=f.int("pad_token_id", None, **ids),
            max_new_tokens=f.int("max_new_tokens", None, min=1),
        )

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, *, vocab_size: int | None = None) -> "GenerationConfig":
        """``folder``'s ``generation_config.json`` (the defaults when it has none); ``vocab_size``: the model's, which
        its token ids must stay below."""
        folder = os.fspath(folder)
        path = confined(folder, "generation_config.json", what=folder)
        if not os.path.lexists(path):
            return cls()
        return cls.from_dict(read_json(path), source=path, vocab_size=vocab_size)
