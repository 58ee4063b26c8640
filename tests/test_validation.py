"""Hostile and broken input (qjax/validation.py and every reader that goes through it).

A corpus of broken checkpoint folders is built here at test time from the built-in model and from small quantized
checkpoints qjax writes itself (INT4 groups, MXFP8 experts, FP8 K/V scales; the auto_round format): each case is
loaded with ``qjax.load_model`` and inspected with ``qjax inspect`` (in-process), and must get a ``ValueError`` (or
``error: …`` and exit 2) whose message names the file and the field or tensor — never a traceback, never a silent
load — while an audit hook on ``open`` checks that nothing outside the case's folder was opened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qjax
from qjax import validation
from qjax.checkpoint.hub import default_model_dir
from qjax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from qjax.validation import Fields, confined, json_depth, parse_json, read_json


# ---------------------------------------------------------------------------------------------------------------------
# the open() audit: which files a call opened
# ---------------------------------------------------------------------------------------------------------------------
class _Audit:
    def __init__(self):
        self.opened: list[str] | None = None

    def hook(self, event, args):
        if self.opened is not None and event in ("open", "os.open") and args and isinstance(args[0], (str, bytes)):
            path = args[0].decode() if isinstance(args[0], bytes) else args[0]
            self.opened.append(os.path.realpath(path))

    @contextlib.contextmanager
    def watch(self):
        self.opened = []
        try:
            yield self.opened
        finally:
            self.opened = None


_AUDIT = _Audit()
sys.addaudithook(_AUDIT.hook)  # audit hooks cannot be removed; this one records only inside watch()


# ---------------------------------------------------------------------------------------------------------------------
# base folders and corruption helpers
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """The folders cases start from: the built-in model, a small quantized checkpoint (MXFP8 experts, INT4 g32
    asymmetric attention, INT4 g32 rest, FP8 K/V per tensor) and the same INT model in the auto_round format; and the
    bait a hostile folder points at (a valid safetensors file outside every case folder)."""
    from qjax.convert import save_autoround, save_pretrained

    from qjax.cli import DEMO_CONFIG
    from qjax.model.config import TextConfig
    from qjax.runtime.random_model import random_model

    root = tmp_path_factory.mktemp("hostile-bases")
    out = {"builtin": root / "builtin"}
    shutil.copytree(default_model_dir(), out["builtin"], ignore=shutil.ignore_patterns("*.txt", "training_log.json",
                                                                                        "README.md"))
    cfg = TextConfig.from_dict(DEMO_CONFIG)
    q = random_model(cfg, "experts=mxfp8,attn=int4:g32:asym,rest=int4:g32,kv=fp8", dtype=jnp.bfloat16, seed=1)
    out["quant"] = Path(save_pretrained(q, root / "quant"))
    a = random_model(cfg, "attn=int4:g32,shared=int4:g32", dtype=jnp.bfloat16, seed=2)
    out["autoround"] = Path(save_autoround(a, root / "autoround"))
    bait = root / "outside"
    bait.mkdir()
    shutil.copy(out["builtin"] / "model.safetensors", bait / "evil.safetensors")
    (bait / "secret.json").write_text('{"model_type": "qwen3_5_moe_text"}')
    out["bait"] = bait
    for name in ("builtin", "quant", "autoround"):  # each base itself loads and inspects cleanly
        qjax.load_model(out[name])
    return out


def _tensors(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    with SafetensorsFile(path) as f:
        return {k: np.array(f.get(k)) for k in f.keys()}, dict(f.metadata)


def _rewrite(path: Path, mutate: Callable[[dict[str, np.ndarray]], None]) -> None:
    tensors, meta = _tensors(path)
    mutate(tensors)
    path.unlink()
    write_safetensors(path, tensors, meta or None)


def _shard_of(folder: Path, key: str) -> Path:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return folder / json.loads(index.read_text())["weight_map"][key]
    return folder / "model.safetensors"


def _key(folder: Path, suffix: str, contains: str = "") -> str:
    keys = []
    for f in folder.glob("*.safetensors"):
        with SafetensorsFile(f) as st:
            keys += st.keys()
    return sorted(k for k in keys if k.endswith(suffix) and contains in k)[0]


def set_value(suffix: str, value, *, contains: str = "", raw_byte: int | None = None):
    """Put ``value`` (or, for byte-level dtypes, the byte ``raw_byte``) at index 0 of the first tensor whose name
    ends with ``suffix``."""
    def mutate(folder: Path):
        key = _key(folder, suffix, contains)

        def go(t):
            a = t[key].copy()
            if raw_byte is not None:
                a.reshape(-1).view(np.uint8)[0] = raw_byte
            else:
                a.reshape(-1)[0] = value
            t[key] = a
        _rewrite(_shard_of(folder, key), go)
    return mutate


def edit_json(name: str, edit: Callable[[dict], object]):
    def mutate(folder: Path):
        d = json.loads((folder / name).read_text())
        new = edit(d)
        (folder / name).write_text(json.dumps(d if new is None else new))
    return mutate


def write_file(name: str, data: bytes | str):
    def mutate(folder: Path):
        p = folder / name
        if p.exists() or p.is_symlink():
            p.unlink()
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return mutate


def raw_safetensors(header: bytes | dict, data: bytes = b"", *, length: int | None = None):
    """Replace model.safetensors with a file of this raw header (and header length) and data."""
    def mutate(folder: Path):
        h = header if isinstance(header, bytes) else json.dumps(header).encode()
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + data)
    return mutate


def header_edit(edit: Callable[[dict, bytes], tuple[dict, bytes]]):
    """Edit model.safetensors' header and data buffer as JSON + bytes."""
    def mutate(folder: Path):
        p = folder / "model.safetensors"
        raw = p.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header, data = edit(json.loads(raw[8:8 + n]), raw[8 + n:])
        h = json.dumps(header).encode()
        p.unlink()
        p.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return mutate


def shard(bait: bool = False):
    """Split model.safetensors into two shards with an index (the case then edits the index)."""
    def mutate(folder: Path):
        tensors, _ = _tensors(folder / "model.safetensors")
        keys = sorted(tensors)
        half = len(keys) // 2
        (folder / "model.safetensors").unlink()
        write_safetensors(folder / "a.safetensors", {k: tensors[k] for k in keys[:half]})
        write_safetensors(folder / "b.safetensors", {k: tensors[k] for k in keys[half:]})
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: "a.safetensors" if i < half else "b.safetensors"
                                            for i, k in enumerate(keys)}}))
    return mutate


def index_edit(edit: Callable[[dict, Path], None]):
    def mutate(folder: Path):
        shard()(folder)
        p = folder / "model.safetensors.index.json"
        d = json.loads(p.read_text())
        edit(d["weight_map"], folder)
        p.write_text(json.dumps(d))
    return mutate


def chain(*steps):
    def mutate(folder: Path):
        for s in steps:
            s(folder)
    return mutate


def quant_config(edit: Callable[[dict], None]):
    return edit_json("config.json", lambda d: edit(d["quantization_config"]))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    base: str  # builtin | quant | autoround
    mutate: Callable[[Path], None]
    fragments: tuple[str, ...]  # each must be in the error message
    values_only: bool = False  # found only by reading tensor data: `qjax inspect` passes, `inspect --verify` refuses

    def __repr__(self) -> str:
        return self.name


# ---------------------------------------------------------------------------------------------------------------------
# the corpus
# ---------------------------------------------------------------------------------------------------------------------
INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "shared_expert_intermediate_size", "max_position_embeddings")
BAD_INTS = {"string": "sixty-four", "list": [64], "negative": -1, "zero": 0, "fraction": 1.5, "bool": True,
            "huge": 10 ** 12}
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size")


def _set(field, value):
    return edit_json("config.json", lambda d: d.__setitem__(field, value))


def _pop(*fields):
    return edit_json("config.json", lambda d: [d.pop(f, None) for f in fields] and None)


def _rope(**kv):
    return edit_json("config.json", lambda d: d["rope_parameters"].update(kv))


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


CONFIG_CASES = [
    *[Case(f"config-{f}-{kind}", "builtin", _set(f, v), ("config.json", f"'{f}'", "must be"))
      for f in INT_FIELDS for kind, v in BAD_INTS.items()
      if not (f == "max_position_embeddings" and kind == "huge")],
    Case("config-max_position_embeddings-huge", "builtin", _set("max_position_embeddings", 10 ** 12),
         ("'max_position_embeddings'", "≤")),
    *[Case(f"config-missing-{f}", "builtin", _pop(f), ("config.json", f"required field '{f}' is missing"))
      for f in REQUIRED],
    Case("config-tie-string", "builtin", _set("tie_word_embeddings", "false"), ("'tie_word_embeddings'",
                                                                                 "true or false")),
    Case("config-tie-int", "builtin", _set("tie_word_embeddings", 0), ("'tie_word_embeddings'",)),
    Case("config-eps-negative", "builtin", _set("rms_norm_eps", -1e-6), ("'rms_norm_eps'", "positive")),
    Case("config-eps-zero", "builtin", _set("rms_norm_eps", 0), ("'rms_norm_eps'",)),
    Case("config-eps-string", "builtin", _set("rms_norm_eps", "1e-6"), ("'rms_norm_eps'",)),
    Case("config-eps-nan", "builtin", write_file("config.json", (Path(default_model_dir()) / "config.json")
                                                  .read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN')),
         ("'rms_norm_eps'", "nan")),
    Case("config-rope-string", "builtin", _set("rope_parameters", "default"), ("'rope_parameters'", "object")),
    Case("config-rope-theta-zero", "builtin", _rope(rope_theta=0), ("'rope_theta'", "positive")),
    Case("config-rope-theta-string", "builtin", _rope(rope_theta="1e7"), ("'rope_theta'",)),
    Case("config-rope-type", "builtin", _rope(rope_type="yarn"), ("rope_type", "'yarn'")),
    Case("config-rotary-factor", "builtin", _rope(partial_rotary_factor=2), ("'partial_rotary_factor'",)),
    Case("config-mrope-length", "builtin", _rope(mrope_section=[3, 3]), ("'mrope_section'", "3 integers")),
    Case("config-mrope-sum", "builtin", _rope(mrope_section=[3, 3, 3]), ("mrope_section", "sum")),
    Case("config-layer-types-names", "builtin", _set("layer_types", ["mamba"] * 8), ("'layer_types'", "'mamba'")),
    Case("config-layer-types-length", "builtin", _set("layer_types", ["linear_attention"] * 3),
         ("layer_types has 3 entries",)),
    Case("config-layer-types-string", "builtin", _set("layer_types", "linear_attention"), ("'layer_types'",)),
    Case("config-interval-zero", "builtin", chain(_pop("layer_types"), _set("full_attention_interval", 0)),
         ("'full_attention_interval'",)),
    Case("config-no-layer-pattern", "builtin", _pop("layer_types"), ("'layer_types' or 'full_attention_interval'",)),
    Case("config-model-type", "builtin", _set("model_type", "llama"), ("model_type 'llama'",)),
    Case("config-composite-no-text", "builtin", _set("model_type", "qwen3_5_moe"), ("'text_config'",)),
    Case("config-composite-text-string", "builtin", chain(_set("model_type", "qwen3_5_moe"),
                                                          _set("text_config", "x")), ("'text_config'", "object")),
    Case("config-hidden-act", "builtin", _set("hidden_act", "gelu"), ("'hidden_act'", "'gelu'")),
    Case("config-attention-bias", "builtin", _set("attention_bias", True), ("attention_bias",)),
    Case("config-attention-bias-string", "builtin", _set("attention_bias", "no"), ("'attention_bias'",)),
    Case("config-topk-over-experts", "builtin", _set("num_experts_per_tok", 5), ("num_experts_per_tok=5",)),
    Case("config-kv-heads", "builtin", _set("num_key_value_heads", 3), ("num_key_value_heads=3",)),
    Case("config-gdn-heads", "builtin", _set("linear_num_value_heads", 3), ("linear_num_value_heads=3",)),
    Case("config-eos-string", "builtin", _set("eos_token_id", "eos"), ("'eos_token_id'",)),
    Case("config-eos-negative", "builtin", _set("eos_token_id", [-1]), ("'eos_token_id'",)),
    Case("config-pad-list", "builtin", _set("pad_token_id", [1]), ("'pad_token_id'",)),
    Case("config-dtype-number", "builtin", _set("dtype", 16), ("'dtype'",)),
    Case("config-mtp-negative", "builtin", _set("mtp_num_hidden_layers", -2), ("'mtp_num_hidden_layers'",)),
    Case("config-array", "builtin", write_file("config.json", "[1, 2, 3]"), ("config.json", "JSON object")),
    Case("config-string", "builtin", write_file("config.json", '"qwen"'), ("config.json", "JSON object")),
    Case("config-not-json", "builtin", write_file("config.json", "{model_type: qwen"), ("config.json",
                                                                                       "not valid JSON")),
    Case("config-empty", "builtin", write_file("config.json", ""), ("config.json", "not valid JSON")),
    Case("config-not-utf8", "builtin", write_file("config.json", b'{"model_type": "\xff\xfe"}'),
         ("config.json", "not UTF-8")),
    Case("config-deep", "builtin", write_file("config.json", '{"a": ' + _nested(100_000) + "}"),
         ("config.json", "nested 100001 levels")),
    Case("config-huge", "builtin", write_file("config.json", '{"pad": "' + "x" * (65 << 20) + '"}'),
         ("config.json", "over the limit of 67108864 bytes for a JSON file")),
    Case("config-missing", "builtin", lambda f: (f / "config.json").unlink(), ("no config.json",)),
    Case("config-is-a-folder", "builtin", lambda f: ((f / "config.json").unlink(), (f / "config.json").mkdir()),
         ("no config.json",)),
    Case("config-symlink-outside", "builtin", lambda f: ((f / "config.json").unlink(), (f / "config.json").symlink_to(
        f.parent.parent / "outside" / "secret.json")), ("config.json", "outside the checkpoint folder")),
    Case("config-symlink-passwd", "builtin", lambda f: ((f / "config.json").unlink(),
                                                         (f / "config.json").symlink_to("/etc/passwd")),
         ("config.json", "outside the checkpoint folder")),
    Case("generation-config-temperature", "builtin", edit_json("generation_config.json",
                                                               lambda d: d.update(temperature="hot")),
         ("generation_config.json", "'temperature'")),
    Case("generation-config-top-k", "builtin", edit_json("generation_config.json", lambda d: d.update(top_k=-1)),
         ("generation_config.json", "'top_k'")),
    Case("generation-config-eos", "builtin", edit_json("generation_config.json",
                                                       lambda d: d.update(eos_token_id=["x"])),
         ("generation_config.json", "'eos_token_id'")),
    Case("generation-config-sample", "builtin", edit_json("generation_config.json",
                                                          lambda d: d.update(do_sample="yes")),
         ("generation_config.json", "'do_sample'")),
    Case("generation-config-not-json", "builtin", write_file("generation_config.json", "{"),
         ("generation_config.json", "not valid JSON")),
    Case("generation-config-array", "builtin", write_file("generation_config.json", "[]"),
         ("generation_config.json", "JSON object")),
]

def _shift_all(header: dict, n: int) -> dict:
    for k, v in header.items():
        if k != "__metadata__":
            v["data_offsets"] = [v["data_offsets"][0] + n, v["data_offsets"][1] + n]
    return header


def _overlap(header: dict, data: bytes):
    spans = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    (b0, e0), _ = spans[0]
    (b1, e1), k1 = spans[1]
    header[k1]["data_offsets"] = [b1 - 2, e1 - 2]  # starts inside the first tensor, leaves 2 bytes at the end free
    return header, data



EMBED = "model.embed_tokens.weight"
SAFETENSORS_CASES = [
    Case("st-empty", "builtin", write_file("model.safetensors", b""), ("model.safetensors", "shorter than the 8-byte")),
    Case("st-truncated", "builtin", lambda f: (f / "model.safetensors").write_bytes(
        (f / "model.safetensors").read_bytes()[:-100]), ("model.safetensors", "truncated")),
    Case("st-header-length-huge", "builtin", raw_safetensors(b"{}", length=1 << 60), ("model.safetensors",
                                                                                      "header length")),
    Case("st-header-over-limit", "builtin", raw_safetensors(b"{" + b" " * 100_000_001 + b"}"),
         ("model.safetensors", "exceeds the 100000000-byte limit")),
    Case("st-header-not-json", "builtin", raw_safetensors(b"{not json}"), ("model.safetensors", "not valid JSON")),
    Case("st-header-not-object", "builtin", raw_safetensors(b"[1, 2]"), ("model.safetensors", "start with '{'")),
    Case("st-header-not-utf8", "builtin", raw_safetensors(b'{"\xff": 1}'), ("model.safetensors", "not UTF-8")),
    Case("st-header-deep", "builtin", raw_safetensors(('{"a": ' + _nested(100_000) + "}").encode()),
         ("model.safetensors", "nested")),
    Case("st-dtype", "builtin", header_edit(lambda h, d: (h[EMBED].update(dtype="Q4") or h, d)),
         ("model.safetensors", EMBED, "'Q4'")),
    Case("st-shape-string", "builtin", header_edit(lambda h, d: (h[EMBED].update(shape="big") or h, d)),
         ("model.safetensors", EMBED, "shape")),
    Case("st-shape-negative", "builtin", header_edit(lambda h, d: (h[EMBED].update(shape=[-4096, -256]) or h, d)),
         ("model.safetensors", EMBED, "negative")),
    Case("st-size-mismatch", "builtin", header_edit(lambda h, d: (h[EMBED].update(shape=[4096, 255]) or h, d)),
         ("model.safetensors", EMBED, "does not match shape")),
    Case("st-offsets-string", "builtin", header_edit(lambda h, d: (h[EMBED].update(data_offsets="0") or h, d)),
         ("model.safetensors", EMBED, "data_offsets")),
    Case("st-missing-dtype", "builtin", header_edit(lambda h, d: (h[EMBED].pop("dtype") and h, d)),
         ("model.safetensors", EMBED, "missing 'dtype'")),
    Case("st-metadata-not-strings", "builtin", header_edit(lambda h, d: (h.update(__metadata__={"a": 1}) or h, d)),
         ("model.safetensors", "__metadata__")),
    Case("st-duplicate-key", "builtin", lambda f: raw_safetensors(
        (lambda raw: raw[8:8 + struct.unpack("<Q", raw[:8])[0]])((f / "model.safetensors").read_bytes())
        .replace(b"{", b'{"' + EMBED.encode() + b'": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, ', 1),
        (lambda raw: raw[8 + struct.unpack("<Q", raw[:8])[0]:])((f / "model.safetensors").read_bytes()))(f),
        ("model.safetensors", "duplicate key", EMBED)),
    Case("st-gap", "builtin", header_edit(lambda h, d: (_shift_all(h, 16), b"\0" * 16 + d)),
         ("model.safetensors", "gap of 16 unused bytes")),
    Case("st-trailing", "builtin", header_edit(lambda h, d: (h, d + b"\0" * 24)),
         ("model.safetensors", "24 trailing bytes")),
    Case("st-overlap", "builtin", header_edit(_overlap), ("model.safetensors", "overlaps tensor")),
    Case("st-nan-bf16", "builtin", set_value("linear_attn.in_proj_qkv.weight", np.nan),
         ("in_proj_qkv.weight", "model.safetensors", "NaN or infinite"), values_only=True),
    Case("st-inf-bf16", "builtin", set_value("mlp.shared_expert.down_proj.weight", np.inf),
         ("shared_expert.down_proj.weight", "NaN or infinite"), values_only=True),
    Case("st-nan-norm", "builtin", set_value("input_layernorm.weight", np.nan), ("input_layernorm.weight", "NaN"),
         values_only=True),
    Case("st-nan-A_log", "builtin", set_value("linear_attn.A_log", np.nan), ("A_log", "NaN"), values_only=True),
    Case("st-nan-embed", "builtin", set_value(EMBED, -np.inf), (EMBED, "NaN or infinite"), values_only=True),
    Case("st-missing-tensor", "builtin", lambda f: _rewrite(f / "model.safetensors", lambda t: t.pop(
        "model.norm.weight")), ("missing (1)", "model.norm.weight")),
    Case("st-unexpected-tensor", "builtin", lambda f: _rewrite(f / "model.safetensors", lambda t: t.update(
        {"model.layers.0.extra.weight": np.zeros(3, np.float32)})), ("unexpected (1)", "model.layers.0.extra.weight")),
    Case("st-wrong-shape", "builtin", lambda f: _rewrite(f / "model.safetensors", lambda t: t.update(
        {"model.norm.weight": np.zeros(255, ml_dtypes.bfloat16)})), ("wrong shape", "model.norm.weight", "[255]")),
    Case("st-wrong-dtype", "builtin", lambda f: _rewrite(f / "model.safetensors", lambda t: t.update(
        {"model.norm.weight": np.zeros(256, np.int16)})), ("wrong dtype", "model.norm.weight", "I16")),
    Case("st-symlink-outside", "builtin", lambda f: ((f / "model.safetensors").unlink(),
                                                      (f / "model.safetensors").symlink_to(
                                                          f.parent.parent / "outside" / "evil.safetensors")),
         ("model.safetensors", "outside the checkpoint folder")),
    Case("st-no-files", "builtin", lambda f: (f / "model.safetensors").unlink(), ("no *.safetensors",)),
]


def _outside(folder: Path) -> str:
    return str(folder.parent.parent / "outside" / "evil.safetensors")


INDEX_CASES = [
    Case("index-absolute-outside", "builtin", index_edit(lambda m, f: m.update({EMBED: _outside(f)})),
         ("model.safetensors.index.json", "absolute path")),
    Case("index-dotdot", "builtin", index_edit(lambda m, f: m.update({EMBED: "../../outside/evil.safetensors"})),
         ("model.safetensors.index.json", "outside the checkpoint folder")),
    Case("index-passwd", "builtin", index_edit(lambda m, f: m.update({EMBED: "/etc/passwd"})),
         ("model.safetensors.index.json", "absolute path")),
    Case("index-symlinked-shard", "builtin", chain(shard(), lambda f: ((f / "a.safetensors").unlink(),
                                                                       (f / "a.safetensors").symlink_to(_outside(f)))),
         ("model.safetensors.index.json", "a.safetensors", "outside the checkpoint folder")),
    Case("index-missing-shard", "builtin", index_edit(lambda m, f: m.update({EMBED: "c.safetensors"})),
         ("do not exist", "c.safetensors")),
    Case("index-not-a-name", "builtin", index_edit(lambda m, f: m.update({EMBED: 7})),
         ("model.safetensors.index.json", "is not a file name")),
    Case("index-wrong-shard", "builtin", index_edit(lambda m, f: m.update(
        {k: ("b.safetensors" if v == "a.safetensors" else "a.safetensors") for k, v in list(m.items())[:1]})),
        ("model.safetensors.index.json", "maps tensor")),
    Case("index-unlisted", "builtin", index_edit(lambda m, f: m.pop(sorted(m)[0])),
         ("not in model.safetensors.index.json",)),
    Case("index-stored-twice", "builtin", chain(shard(), lambda f: _rewrite(f / "b.safetensors", lambda t: t.update(
        {sorted(_tensors(f / "a.safetensors")[0])[0]: _tensors(f / "a.safetensors")[0][
            sorted(_tensors(f / "a.safetensors")[0])[0]]}))), ("stored twice", "a.safetensors", "b.safetensors")),
    Case("index-weight-map-list", "builtin", chain(shard(), edit_json("model.safetensors.index.json",
                                                                      lambda d: d.update(weight_map=[]))),
         ("model.safetensors.index.json", "'weight_map' object")),
    Case("index-not-json", "builtin", chain(shard(), write_file("model.safetensors.index.json", "{")),
         ("model.safetensors.index.json", "not valid JSON")),
    Case("index-deep", "builtin", chain(shard(), write_file("model.safetensors.index.json",
                                                            '{"weight_map": ' + _nested(5000) + "}")),
         ("model.safetensors.index.json", "nested")),
    Case("index-symlink-outside", "builtin", chain(shard(), lambda f: (
        (f / "model.safetensors.index.json").unlink(),
        (f / "model.safetensors.index.json").symlink_to(f.parent.parent / "outside" / "secret.json"))),
        ("model.safetensors.index.json", "outside the checkpoint folder")),
]

MX = "mlp.experts.0.gate_proj"
QUANT_CASES = [
    Case("q-scale-nan", "quant", set_value("self_attn.q_proj.weight_scale", np.nan), ("q_proj.weight_scale", "NaN"),
         values_only=True),
    Case("q-scale-inf", "quant", set_value("linear_attn.out_proj.weight_scale", np.inf),
         ("out_proj.weight_scale", "NaN or infinite"), values_only=True),
    Case("q-scale-zero", "quant", set_value("linear_attn.in_proj_z.weight_scale", 0.0),
         ("in_proj_z.weight_scale", "scales are zero"), values_only=True),
    Case("q-scale-zero-shared", "quant", set_value("mlp.shared_expert.up_proj.weight_scale", -0.0),
         ("up_proj.weight_scale", "scales are zero"), values_only=True),
    Case("q-e8m0-nan", "quant", set_value(f"{MX}.weight_scale", None, raw_byte=0xFF),
         (f"{MX}.weight_scale", "0xFF"), values_only=True),
    Case("q-e8m0-nan-last-expert", "quant", set_value("mlp.experts.7.down_proj.weight_scale", None, raw_byte=0xFF),
         ("experts.7.down_proj.weight_scale", "0xFF"), values_only=True),
    Case("q-mxfp8-nan", "quant", set_value(f"{MX}.weight", None, raw_byte=0x7F), (f"{MX}.weight", "NaN codes"),
         values_only=True),
    Case("q-mxfp8-negative-nan", "quant", set_value("mlp.experts.3.up_proj.weight", None, raw_byte=0xFF),
         ("experts.3.up_proj.weight", "NaN codes"), values_only=True),
    Case("q-k-scale-nan", "quant", set_value("self_attn.k_scale", np.nan), ("k_scale", "NaN"), values_only=True),
    Case("q-k-scale-zero", "quant", set_value("self_attn.k_scale", 0.0), ("k_scale", "K/V scales are zero"),
         values_only=True),
    Case("q-v-scale-negative", "quant", set_value("self_attn.v_scale", -1.0), ("v_scale", "zero or negative"),
         values_only=True),
    Case("q-missing-scale", "quant", lambda f: _rewrite(
        _shard_of(f, _key(f, "self_attn.o_proj.weight_scale")),
        lambda t: t.pop(_key(f, "self_attn.o_proj.weight_scale"))), ("config.json", "o_proj.weight_scale is missing")),
    Case("q-missing-k-scale", "quant", lambda f: _rewrite(
        _shard_of(f, _key(f, "self_attn.k_scale")), lambda t: t.pop(_key(f, "self_attn.k_scale"))),
        ("KV scales are missing", "k_scale")),
    Case("q-missing-mx-scale", "quant", lambda f: _rewrite(
        _shard_of(f, _key(f, f"{MX}.weight_scale")), lambda t: t.pop(_key(f, f"{MX}.weight_scale"))),
        (f"{MX}.weight is float8", "weight_scale is missing")),
    Case("q-weight-shape", "quant", lambda f: _rewrite(
        _shard_of(f, _key(f, "self_attn.q_proj.weight_shape")), lambda t: t.update(
            {_key(f, "self_attn.q_proj.weight_shape"): np.array([1, 2], np.int64)})),
        ("q_proj.weight_shape", "says [1, 2]")),
    Case("q-group-48", "quant", quant_config(lambda q: [g["weights"].update(group_size=48) for g in
                                                        q["config_groups"].values()
                                                        if g["weights"]["type"] == "int"] and None),
         ("group_size 48", "does not divide")),
    Case("q-bits-3", "quant", quant_config(lambda q: [g["weights"].update(num_bits=3) for g in
                                                      q["config_groups"].values() if g["weights"]["type"] == "int"]
                                           and None), ("quantization_config", "num_bits")),
    Case("q-bits-string", "quant", quant_config(lambda q: [g["weights"].update(num_bits="four") for g in
                                                           q["config_groups"].values()] and None),
         ("num_bits",)),
    Case("q-format", "quant", quant_config(lambda q: q.update(format="nvfp4-pack-quantized")),
         ("nvfp4-pack-quantized",)),
    Case("q-strategy", "quant", quant_config(lambda q: [g["weights"].update(strategy="block") for g in
                                                        q["config_groups"].values()] and None), ("block",)),
    Case("q-groups-list", "quant", quant_config(lambda q: q.update(config_groups=[])), ("config_groups",)),
    Case("q-no-config", "quant", edit_json("config.json", lambda d: d.pop("quantization_config") and None),
         ("no quantization_config",)),
    Case("q-kv-no-scheme", "quant", quant_config(lambda q: q.update(kv_cache_scheme=None)),
         ("k_scale/v_scale tensors but no kv_cache_scheme",)),
    Case("ar-scales-nan", "autoround", set_value(".scales", np.nan, contains="q_proj"), ("q_proj", "NaN"),
         values_only=True),
    Case("ar-scales-zero", "autoround", set_value(".scales", 0.0, contains="down_proj"),
         ("down_proj", "scales are zero"), values_only=True),
    Case("ar-bits-string", "autoround", edit_json("config.json", lambda d: d["quantization_config"].update(
        bits="four")), ("bits",)),
]

ALL_CASES = CONFIG_CASES + SAFETENSORS_CASES + INDEX_CASES + QUANT_CASES


def test_the_corpus_is_large():
    assert len(ALL_CASES) >= 150 and len({c.name for c in ALL_CASES}) == len(ALL_CASES)


@pytest.fixture
def run_cli(capsys):
    from qjax import cli

    def run(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        rc = cli.main(list(argv))
        return rc, capsys.readouterr().err
    return run


def _case_folder(case: Case, bases: dict[str, Path], tmp_path: Path) -> Path:
    root = tmp_path / "cases"  # the bait sits at tmp_path/../outside-like paths: see _outside
    folder = root / case.name
    root.mkdir()
    shutil.copytree(bases[case.base], folder)
    (tmp_path / "outside").symlink_to(bases["bait"])
    case.mutate(folder)
    return folder


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_a_broken_checkpoint_gets_its_named_error(case, bases, tmp_path, run_cli):
    check_case(case, bases, tmp_path, run_cli)


def case_folder(case: Case, bases: dict[str, Path], tmp_path: Path) -> Path:
    """The folder of ``case`` (tests/test_validation_files.py builds its cases with it too)."""
    return _case_folder(case, bases, tmp_path)


def check_case(case: Case, bases: dict[str, Path], tmp_path: Path, run_cli) -> None:
    """``case``'s folder gets its named error from ``qjax.load_model`` and from ``qjax inspect`` (``--verify`` for
    a ``values_only`` case), opening nothing outside it (tests/test_validation_files.py runs its cases through this
    too)."""
    folder = _case_folder(case, bases, tmp_path)
    with _AUDIT.watch() as opened:
        with pytest.raises(ValueError) as info:
            qjax.load_model(folder)
    message = str(info.value)
    for fragment in case.fragments:
        assert fragment in message, (fragment, message)
    assert "Traceback" not in message and len(message) < 4000
    bait = os.path.realpath(bases["bait"])
    assert not [p for p in opened if p.startswith(bait) or p == "/etc/passwd"], opened

    with _AUDIT.watch() as opened:
        rc, err = run_cli("inspect", str(folder))
        rc_verify, err_verify = run_cli("inspect", "--verify", str(folder))
    assert not [p for p in opened if p.startswith(bait) or p == "/etc/passwd"], opened
    if case.values_only:
        assert rc == 0, err
        rc, err = rc_verify, err_verify
    assert rc == 2 and err.startswith("error: ") and "Traceback" not in err, err
    for fragment in case.fragments:
        assert fragment in err, (fragment, err)


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_the_cli_names_the_error_and_hides_the_traceback(bases, tmp_path, run_cli):
    case = next(c for c in ALL_CASES if c.name == "st-nan-bf16")
    folder = _case_folder(case, bases, tmp_path)
    rc, err = run_cli("generate", "--model", str(folder), "--ids", "1 2 3", "--max-new-tokens", "2")
    assert rc == 2 and "NaN or infinite" in err and "Traceback" not in err
    rc, err = run_cli("generate", "--no-verify", "--model", str(folder), "--ids", "1 2 3", "--max-new-tokens", "2")
    assert rc == 0, err  # the opt-out loads it (the NaN sits in one weight of one row)


def test_an_unexpected_error_is_one_line_and_debug_shows_it(monkeypatch, run_cli):
    import qjax.cli as cli

    def boom(a):
        raise RuntimeError("a bug\nwith two lines")

    monkeypatch.setattr(cli, "cmd_inspect", boom)
    rc, err = run_cli("inspect", default_model_dir())
    assert rc == 1 and err.count("\n") == 1 and "unexpected RuntimeError: a bug with two lines" in err
    assert "report" in err and "--debug" in err
    with pytest.raises(RuntimeError):
        cli.main(["--debug", "inspect", default_model_dir()])


# ---------------------------------------------------------------------------------------------------------------------
# tokenizer files and chat templates
# ---------------------------------------------------------------------------------------------------------------------
def _tok_config(edit: Callable[[dict], None]):
    return edit_json("tokenizer_config.json", lambda d: edit(d))


TOKENIZER_CASES = [
    ("template-range", _tok_config(lambda d: d.update(chat_template="{% for i in range(10**9) %}x{% endfor %}")),
     "range of 1,000,000,000 items"),
    ("template-nested-loops", _tok_config(lambda d: d.update(
        chat_template="{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")),
     "more than 1,000,000 steps"),
    ("template-include", _tok_config(lambda d: d.update(chat_template="{% include 'x.jinja' %}")), "no loader"),
    ("template-import", _tok_config(lambda d: d.update(chat_template="{% import 'x' as y %}")), "no loader"),
    ("template-repeat", _tok_config(lambda d: d.update(chat_template="{{ 'x' * 10**9 }}")), "too big"),
    ("template-format-width", _tok_config(lambda d: d.update(chat_template="{{ '%999999999s' % 'x' }}")),
     "width is too big"),
    ("template-ljust", _tok_config(lambda d: d.update(chat_template="{{ 'x'.ljust(10**9) }}")), "str.ljust"),
    ("template-big-output", _tok_config(lambda d: d.update(
        chat_template="{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}")), "more than 16,777,216"),
    ("template-recursion", _tok_config(lambda d: d.update(
        chat_template="{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}")), "RecursionError"),
    ("template-dunder", _tok_config(lambda d: d.update(chat_template="{{ ''.__class__.__mro__ }}")), "unsafe"),
    ("template-syntax", _tok_config(lambda d: d.update(chat_template="{% if %}")), "does not parse"),
    ("template-list-garbage", _tok_config(lambda d: d.update(chat_template=[1, 2])), "chat_template[0]"),
    ("template-list-no-name", _tok_config(lambda d: d.update(chat_template=[{"template": "x"}])),
     "required field 'name'"),
    ("template-number", _tok_config(lambda d: d.update(chat_template=5)), "chat_template must be"),
    ("template-file-not-utf8", write_file("chat_template.jinja", b"\xff{{ x }}"), "not UTF-8"),
    ("template-file-outside", lambda f: (f / "chat_template.jinja").symlink_to("/etc/passwd"),
     "outside the checkpoint folder"),
    ("added-tokens-list", _tok_config(lambda d: d.update(added_tokens_decoder=[1])), "added_tokens_decoder"),
    ("added-tokens-key", _tok_config(lambda d: d.update(added_tokens_decoder={"x": {"content": "a"}})),
     "is not a token id"),
    ("added-tokens-content", _tok_config(lambda d: d.update(added_tokens_decoder={"5000": {"special": True}})),
     "required field 'content'"),
    ("added-tokens-flag", _tok_config(lambda d: d.update(added_tokens_decoder={"5000": {"content": "a",
                                                                                         "special": "yes"}})),
     "'special'"),
    ("tokenizer-config-array", write_file("tokenizer_config.json", "[]"), "JSON object"),
    ("tokenizer-config-deep", write_file("tokenizer_config.json", '{"a": ' + _nested(10_000) + "}"), "nested"),
    ("tokenizer-json-garbage", write_file("tokenizer.json", "{"), "cannot load"),
    ("tokenizer-json-outside", lambda f: ((f / "tokenizer.json").unlink(),
                                          (f / "tokenizer.json").symlink_to("/etc/passwd")),
     "outside the checkpoint folder"),
]


@pytest.mark.parametrize("name,mutate,fragment", TOKENIZER_CASES, ids=[c[0] for c in TOKENIZER_CASES])
def test_a_broken_tokenizer_or_template_gets_its_named_error(name, mutate, fragment, bases, tmp_path, run_cli):
    from qjax.tokenizer import Tokenizer, TokenizerError

    folder = _case_folder(Case(name, "builtin", mutate, ()), bases, tmp_path)
    with _AUDIT.watch() as opened:
        with pytest.raises(TokenizerError) as info:
            Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "Hello"}])
    assert fragment in str(info.value), str(info.value)
    assert str(folder) in str(info.value)
    assert "/etc/passwd" not in opened
    rc, err = run_cli("generate", "--model", str(folder), "--chat", "--no-verify", "--max-new-tokens", "1", "Hi")
    assert rc == 2 and err.startswith("error: ") and fragment in err and "Traceback" not in err, err


# ---------------------------------------------------------------------------------------------------------------------
# the validation helpers themselves
# ---------------------------------------------------------------------------------------------------------------------
def test_confined_accepts_inside_and_hub_blobs_and_refuses_the_rest(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.json").write_text("{}")
    (tmp_path / "m" / "sub").mkdir()
    assert confined(tmp_path / "m", "a.json", what="x") == str(tmp_path / "m" / "a.json")
    assert confined(tmp_path / "m", "sub/../a.json", what="x")
    for bad in ("/etc/passwd", "../m2/a.json", "", "a\x00b", 5):
        with pytest.raises(ValueError, match="x: "):
            confined(tmp_path / "m", bad, what="x")
    (tmp_path / "other.json").write_text("{}")
    (tmp_path / "m" / "link").symlink_to(tmp_path)
    assert confined(tmp_path / "m", "link/m/a.json", what="x")  # a detour that ends inside
    with pytest.raises(ValueError, match="outside"):
        confined(tmp_path / "m", "link/other.json", what="x")
    # a Hugging Face cache snapshot links its files into the repository's blobs folder: inside
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "config.json").symlink_to("../../blobs/abc")
    assert confined(snap, "config.json", what="x") == str(snap / "config.json")
    (snap / "evil.json").symlink_to(tmp_path / "m" / "a.json")
    with pytest.raises(ValueError, match="outside"):
        confined(snap, "evil.json", what="x")


def test_json_depth_and_parse_bounds():
    assert json_depth(b'{"a": [1, {"b": "[[[["}]}') == 3
    assert json_depth(b'"just a string with { and ["') == 0
    assert json_depth(b'{"esc\\"aped": [[]]}') == 3
    with pytest.raises(ValueError, match="nested 70 levels"):
        parse_json(_nested(70).encode(), "f.json")
    with pytest.raises(ValueError, match="duplicate key 'a'"):
        parse_json(b'{"a": 1, "a": 2}', "f.json", duplicate_keys=False)
    assert parse_json(b'{"a": 1, "a": 2}', "f.json") == {"a": 2}  # what json (and transformers) do by default
    with pytest.raises(ValueError, match=r"f.json: not UTF-8 text \(byte 1"):
        parse_json(b'"\xff"', "f.json")


def test_read_json_bounds(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"a": 1}')
    assert read_json(p) == {"a": 1}
    with pytest.raises(ValueError, match="is 8 bytes, over the limit of 4 bytes for a JSON file"):
        read_json(p, max_bytes=4)
    with pytest.raises(ValueError, match="must be a JSON array, got an object"):
        read_json(p, expect=list)
    with pytest.raises(ValueError, match="missing.json: no such file"):
        read_json(tmp_path / "missing.json")


def test_fields_read_by_type_and_range():
    f = Fields({"n": 3, "b": True, "x": 1.5, "s": "a", "l": [1, 2], "o": {"k": 1}, "z": None}, "c.json")
    assert f.int("n", min=1) == 3 and f.bool("b") is True and f.float("x", positive=True) == 1.5
    assert f.str("s", choices=("a",)) == "a" and f.int_list("l", length=2) == [1, 2] and f.sub("o").int("k") == 1
    assert f.int("z", 7) == 7 and f.int("missing", None) is None  # null and absent take the default
    assert f.int_list("n", scalar=True) == [3]
    for call, text in [(lambda: f.int("b"), "'b' must be an integer, got True"),
                       (lambda: f.int("x"), "'x' must be an integer, got 1.5"),
                       (lambda: f.int("n", max=2), "'n' must be an integer ≤ 2, got 3"),
                       (lambda: f.bool("s"), "'s' must be true or false, got 'a'"),
                       (lambda: f.float("s"), "'s' must be a finite number"),
                       (lambda: f.str("s", choices=("b", "c")), "one of 'b', 'c'"),
                       (lambda: f.int_list("l", length=3), "a list of 3 integers"),
                       (lambda: f.sub("s"), "'s' must be a JSON object"),
                       (lambda: f.int("missing"), "required field 'missing' is missing")]:
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value).startswith("c.json: ") and text in str(info.value), str(info.value)
    assert len(validation.show("x" * 1000)) == 60
