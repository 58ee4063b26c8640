"""Size and memory planner: what a checkpoint holds, and what qjax will hold on the device for it.

Works from tensor headers and shapes alone (no tensor data is read), so it answers for a real folder
(``qjax inspect PATH``) and for a hypothetical recipe on any config (``qjax inspect --config C --recipe R``), the
35B model included. Device memory is measured on the abstract model the loader would build: the same code path,
so the prediction is what loading allocates.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from qjax.checkpoint.layout import (
    VISUAL_PREFIX,
    expected_tensors,
    is_linear,
    packed_tensors,
    per_expert_layout,
    text_prefix,
)
from qjax.checkpoint.loading import check_folder, checkpoint_dtype, verify_folder
from qjax.checkpoint.quant_plan import plan_quantization
from qjax.checkpoint.safetensors_io import dtype_name
from qjax.model.config import FULL, LINEAR, TextConfig, VisionConfig
from qjax.model.dtypes import accum_dtype
from qjax.model.qwen3_5_moe import abstract_model
from qjax.model.sharding import abstract_plan, per_device_bytes
from qjax.model.variables import variable_shapes
from qjax.quant.config import QuantizationConfig

# the float dtypes a stored vision tower keeps when no --dtype is given (as the loader picks it: its patch embedding's)
_ST_FLOAT = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float32"}

ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8}

# compact recipe grammar: SELECTOR=SCHEME,... ; the presets are the three seed checkpoints' recipes and friends. A
# preset is also an item, and a later item replaces an earlier one of the same selector, so a preset is amended in place:
# "w2w4,lm_head=int8:channel" is the seed-000 recipe with a quantized LM head (every preset keeps the head BF16).
PRESETS = {
    "w2w4": "experts=int2:g64,rest=int4:g128",  # seed 000: INT2 g64 experts + INT4 g128 attention/GDN/shared
    "w4a16": "rest=int4:g128",
    "w8a16-g32": "rest=int8:g32",  # seed 002 (AWQ W8A16 g32)
    "mxfp8-experts": "experts=mxfp8,kv=fp8",  # seed 003 (MXFP8 experts + FP8 KV)
    "bf16": "",
}
SELECTORS = {
    "experts": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
    "shared": [r"re:.*mlp\.shared_expert\.(gate|up|down)_proj$"],
    "attn": [r"re:.*self_attn\.(q|k|v|o)_proj$"],
    "linear_attn": [r"re:.*linear_attn\.(in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj)$"],
    "lm_head": ["lm_head"],
}


class RecipeError(ValueError):
    pass


def _scheme_dict(spec: str, where: str) -> dict:
    """``int4:g128[:asym]`` | ``int8:channel`` | ``mxfp8`` → compressed-tensors weight args + format."""
    parts = spec.split(":")
    if parts[0] == "mxfp8":
        if parts[1:]:
            raise RecipeError(f"{where}: mxfp8 takes no options (its group is 32), got {spec!r}")
        return {"format": "mxfp8-quantized", "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                        "strategy": "group", "group_size": 32,
                                                        "scale_dtype": "torch.uint8"}}
    if not parts[0].startswith("int") or not parts[0][3:].isdigit():
        raise RecipeError(f"{where}: unknown scheme {spec!r} (use bf16, int2/int4/int8:gN|channel[:asym], mxfp8)")
    w = {"num_bits": int(parts[0][3:]), "type": "int", "symmetric": "asym" not in parts[1:], "strategy": "channel",
         "group_size": None}
    grouping = [p for p in parts[1:] if p == "channel" or (p.startswith("g") and p[1:].isdigit())]
    if len(grouping) > 1:
        raise RecipeError(f"{where}: {' and '.join(grouping)} both given in {spec!r} (one of gN, channel)")
    if "asym" in parts[1:] and "sym" in parts[1:]:
        raise RecipeError(f"{where}: asym and sym both given in {spec!r}")
    for p in parts[1:]:
        if p.startswith("g") and p[1:].isdigit():
            w.update(strategy="group", group_size=int(p[1:]))
        elif p not in ("channel", "asym", "sym"):
            raise RecipeError(f"{where}: unknown scheme option {p!r} in {spec!r}")
    return {"format": "pack-quantized", "weights": w}


def recipe_items(recipe: str) -> dict[str, str]:
    """A compact recipe → ``{selector: scheme}`` in order, presets expanded, a later item replacing an earlier one
    of the same selector (``"w2w4,lm_head=int4:g128"`` → experts, rest, lm_head)."""
    items: dict[str, str] = {}
    for raw in recipe.split(","):
        for item in filter(None, (s.strip() for s in PRESETS.get(raw.strip(), raw).split(","))):
            if "=" not in item:
                raise RecipeError(f"recipe item {item!r} is not SELECTOR=SCHEME (presets: {', '.join(PRESETS)})")
            sel, scheme = (s.strip() for s in item.split("=", 1))
            if sel not in (*SELECTORS, "rest", "kv"):
                raise RecipeError(f"recipe selector {sel!r} unknown; use {', '.join([*SELECTORS, 'rest', 'kv'])}")
            items.pop(sel, None)  # the later item wins, and takes the later place
            items[sel] = scheme
    return items


def recipe_to_qconfig(recipe: str) -> dict | None:
    """A recipe (preset name, compact ``SELECTOR=SCHEME,...`` string, or a JSON file holding a
    ``quantization_config``) → a compressed-tensors ``quantization_config`` dict (None: nothing quantized)."""
    if os.path.exists(recipe):
        with open(recipe, encoding="utf-8") as f:
            raw = json.load(f)
        return raw.get("quantization_config", raw)
    groups, kv, ignore = {}, None, ["lm_head"]
    rest = None
    for sel, scheme in recipe_items(recipe).items():
        item = f"{sel}={scheme}"
        if sel == "kv":
            if scheme in ("bf16", "none"):
                kv = None
                continue
            if scheme not in ("fp8", "fp8:head"):
                raise RecipeError(f"kv={scheme!r}: use kv=fp8 (per tensor), kv=fp8:head or kv=bf16 (none)")
            kv = {"num_bits": 8, "type": "float", "symmetric": True,
                  "strategy": "attn_head" if scheme == "fp8:head" else "tensor", "dynamic": False}
            continue
        if scheme == "bf16":
            continue
        if sel == "rest":
            rest = _scheme_dict(scheme, item)
            continue
        if sel == "lm_head":
            ignore = []  # its own config group (a name target: it wins over rest's "Linear")
        groups[f"group_{len(groups)}"] = {**_scheme_dict(scheme, item), "targets": SELECTORS[sel]}
    if rest is not None:
        groups[f"group_{len(groups)}"] = {**rest, "targets": ["Linear"]}
    if not groups and kv is None:
        return None
    return {"quant_method": "compressed-tensors", "quantization_status": "compressed", "format": None,
            "config_groups": groups, "ignore": ignore + [r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$"],
            "kv_cache_scheme": kv}


@dataclasses.dataclass
class Plan:
    cfg: TextConfig
    headers: dict[str, tuple[tuple[int, ...], str]]  # checkpoint key → (shape, safetensors dtype)
    scheme_of: dict[str, str]  # key → scheme label
    device_bytes: int  # parameters as qjax holds them
    kv_bytes_per_token: int  # per sequence, all full-attention layers
    gdn_bytes_per_sequence: int  # conv window + fp32 state, all GDN layers
    skipped: dict[str, int]  # prefix → bytes on disk that qjax does not load (the vision tower when not loaded)
    mesh: dict[str, int] | None = None  # axis sizes when planned for a mesh
    mesh_device_bytes: int = 0  # parameters each device holds on that mesh
    mesh_replicated_bytes: int = 0  # of which replicated on every device
    mesh_kv_bytes_per_token: int = 0  # per sequence, per device
    mesh_gdn_bytes_per_sequence: int = 0  # per device
    dtype: str = "bfloat16"  # what the model computes in (``model.dtype``: the checkpoint's, or --dtype)
    dtype_source: str = "the checkpoint's"  # why: "the checkpoint's" or "--dtype"
    # the vision tower (``model.visual.*``): loaded with the model unless text-only or config.json has no
    # vision_config; its tensors and bytes on disk, and the bytes qjax holds for it (part of ``device_bytes``)
    vision_loaded: bool = False
    vision_skip_reason: str = ""  # why it is not loaded (when the checkpoint has it): "--text-only", "no vision_config"
    vision_tensors: int = 0
    vision_disk_bytes: int = 0
    vision_device_bytes: int = 0
    vision_dtype: str | None = None  # what the loaded tower holds its weights and computes in
    # bytes one decode step at batch 1 reads (:func:`decode_bytes` with no context: its KV is kv_bytes_per_token
    # per context token); what bounds decode speed on a GPU: bytes ÷ memory bandwidth
    decode: dict[str, float] = dataclasses.field(default_factory=dict)
    lm_head_bytes: int = 0  # of decode["weights"]: the LM head's (an untied head; 0 when tied to the embedding)


def _label(key: str, dtype: str, quant_modules: dict[str, str]) -> str:
    for suffix in (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight"):
        if key.endswith(suffix) and key[: -len(suffix)] in quant_modules:
            return quant_modules[key[: -len(suffix)]]
    if key.endswith((".k_scale", ".v_scale")):
        return "fp8 kv scales"
    return f"dense {dtype.lower()}"


def plan(cfg: TextConfig, headers: dict[str, tuple[tuple[int, ...], str]], qc: QuantizationConfig | None,
         *, dtype=None, mesh=None, vision: VisionConfig | None = None, text_only: bool = False) -> Plan:
    """Everything from headers: the loader's own plan + abstract model, so device bytes are what loading allocates.

    ``vision``: the checkpoint's vision config (None: text-only config.json); the tower (``model.visual.*``) is part
    of the model, as loading makes it, when the headers hold it and not ``text_only``."""
    keys = set(headers)
    prefix = text_prefix(keys)
    dtype_of = lambda k: headers[k][1]  # noqa: E731
    quant = plan_quantization(cfg, qc, keys, dtype_of, text_prefix=prefix, source="config.json")
    dt = jnp.dtype(dtype if dtype is not None else
                   checkpoint_dtype(headers.get(prefix + "embed_tokens.weight", (None, None))[1], cfg))
    visual = [k for k in keys if k.startswith(VISUAL_PREFIX)]
    with_visual = bool(visual) and vision is not None and not text_only
    # the loader's choice (qjax.checkpoint.loading._structure): --dtype when given, else the stored float dtype
    vision_dt = dt if dtype is not None or not with_visual else jnp.dtype(
        _ST_FLOAT.get(headers.get(VISUAL_PREFIX + "patch_embed.proj.weight", (None, None))[1], dt.name))
    model = abstract_model(cfg, dtype=dt, with_mtp=any(k.startswith("mtp.") for k in keys), quant=quant,
                           vision=vision, vision_dtype=vision_dt, with_visual=with_visual)
    shapes = variable_shapes(model)
    nbytes = lambda v: int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize  # noqa: E731
    device = sum(nbytes(v) for v in shapes.values())
    vision_device = sum(nbytes(v) for p, v in shapes.items() if p[:1] == ("visual",)) if with_visual else 0
    quant_modules = {}
    for k in keys:
        for suffix in (".weight_packed", ".weight_scale"):
            if k.endswith(suffix):
                m = k[: -len(suffix)]
                sch = qc.scheme_for(m) if qc is not None else None
                if sch is not None:
                    quant_modules[m] = ("mxfp8 g32" if sch.is_mxfp8 else
                                        f"int{sch.num_bits} "
                                        f"{'g' + str(sch.group_size) if sch.strategy == 'group' else sch.strategy}"
                                        f"{'' if sch.symmetric else ' asym'}")
    kv_item = 1 if quant is not None and quant.kv_cache else np.dtype(dt).itemsize
    n_full = sum(t == FULL for t in cfg.layer_types)
    n_lin = sum(t == LINEAR for t in cfg.layer_types)
    kv = n_full * 2 * cfg.num_key_value_heads * cfg.head_dim * kv_item
    gdn = n_lin * ((cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * np.dtype(dt).itemsize
                   + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
                   * accum_dtype(dt).itemsize)
    vision_disk = sum(int(np.prod(headers[k][0])) * ST_ITEMSIZE[headers[k][1]] for k in visual)
    skipped = {VISUAL_PREFIX + "*": vision_disk} if visual and not with_visual else {}
    out = Plan(cfg, headers, {k: _label(k, d, quant_modules) for k, (_, d) in headers.items()}, int(device), kv, gdn,
               skipped, dtype=dt.name, dtype_source="the checkpoint's" if dtype is None else "--dtype",
               vision_loaded=with_visual,
               vision_skip_reason="" if with_visual or not visual else
               ("--text-only" if vision is not None else "config.json has no vision_config"),
               vision_tensors=len(visual), vision_disk_bytes=vision_disk, vision_device_bytes=vision_device,
               vision_dtype=vision_dt.name if with_visual else None)
    out.decode = decode_bytes(model, 1, 0)
    out.lm_head_bytes = weight_bytes_by_role(model).get("lm_head", 0)
    if mesh is not None:
        _plan_mesh(out, model, mesh)
    return out


def expected_active_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts ``batch`` tokens route to when each picks ``top_k`` of ``num_experts`` uniformly."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def weight_bytes_by_role(model) -> dict[str, int]:
    """Parameter bytes of ``model`` (real or abstract) by role: ``embed`` (the table), ``lm_head``, ``experts``
    (routed, all), ``mtp``, ``visual`` and ``other``."""
    out: dict[str, int] = defaultdict(int)
    for path, v in variable_shapes(model).items():
        names = [str(p) for p in path]
        kind = ("embed" if "embed_tokens" in names else "mtp" if "mtp" in names else "visual" if names[0] == "visual"
                else "lm_head" if names[0] == "lm_head" else "experts" if "experts" in names else "other")
        out[kind] += int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
    return dict(out)


def decode_bytes(model, batch: int, context: int) -> dict[str, float]:
    """Bytes one decode step at ``batch`` must move with ``context`` tokens in the cache: ``weights`` (every weight
    outside the routed experts once — the LM head among them — and of the embedding only its ``batch`` rows; no MTP
    head, no vision tower), ``experts`` (the routed experts' bytes × E_act/E, E_act =
    :func:`expected_active_experts`), ``state`` (the GDN conv window and recurrent state, read and written back),
    ``kv`` (the context's K/V, read once) and their ``total`` (see :mod:`qjax.runtime.bench`)."""
    cfg = model.config
    w = weight_bytes_by_role(model)
    frac = expected_active_experts(cfg.num_experts, cfg.num_experts_per_tok, batch) / cfg.num_experts
    cache = jax.eval_shape(lambda: model.init_cache(batch, max(context, 1)))
    state = kv = 0.0
    for slot in cache.slots:
        nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(slot))
        if hasattr(slot, "recurrent"):
            state += 2 * nbytes  # read and written back
        elif context:
            kv += nbytes  # the whole context is read once (the new position's write is negligible)
    embed_row = cfg.hidden_size * jnp.dtype(model.dtype).itemsize
    out = {"weights": float(w.get("other", 0) + w.get("lm_head", 0)) + batch * embed_row,
           "experts": w.get("experts", 0) * frac, "state": state, "kv": kv}
    out["total"] = sum(out.values())
    return out


def _plan_mesh(p: Plan, model, mesh) -> None:
    """Per-device bytes on ``mesh`` from the loader's own PartitionSpec rules (no devices needed)."""

    rules = abstract_plan(mesh, p.cfg)
    tp = rules.size("tensor")
    p.mesh = {a: rules.size(a) for a in ("data", "tensor", "expert")}
    p.mesh_device_bytes, p.mesh_replicated_bytes = per_device_bytes(model, rules)
    p.mesh_kv_bytes_per_token = p.kv_bytes_per_token // (tp if rules.kv_split else 1)
    p.mesh_gdn_bytes_per_sequence = p.gdn_bytes_per_sequence // tp


def plan_folder(path: str, *, dtype=None, mesh=None, verify: bool = False, text_only: bool = False) -> Plan:
    """The plan of a checkpoint folder, after every check loading makes short of reading tensor data
    (:func:`qjax.checkpoint.loading.check_folder`; with ``verify`` the values too): a folder qjax cannot load is an
    error here too. The vision tower counts as loading holds it (``load_model(path, text_only=text_only)``)."""

    cfg, qc, headers = (verify_folder if verify else check_folder)(path, dtype=dtype)  # E8M0 bounds: per dtype
    return plan(cfg, headers, qc, dtype=dtype, mesh=mesh, vision=VisionConfig.from_file(path), text_only=text_only)


def plan_recipe(config_path: str, recipe: str, *, dtype="bfloat16", mesh=None) -> Plan:
    """A hypothetical checkpoint of ``config_path``'s model quantized with ``recipe`` (shapes only)."""
    return plan_recipe_cfg(TextConfig.from_file(config_path), recipe, dtype=dtype, mesh=mesh)


def plan_recipe_cfg(cfg: TextConfig, recipe: str, *, dtype="bfloat16", mesh=None) -> Plan:
    """:func:`plan_recipe` for a parsed config."""

    headers, qc = recipe_headers(cfg, recipe, dtype=dtype)
    return plan(cfg, headers, qc, dtype=jnp.dtype(dtype), mesh=mesh)


def recipe_headers(cfg: TextConfig, recipe: str, *, dtype="bfloat16"
                   ) -> tuple[dict[str, tuple[tuple[int, ...], str]], QuantizationConfig | None]:
    """The tensor names, shapes and safetensors dtypes an RTN checkpoint of ``cfg`` with ``recipe`` would hold,
    and the parsed quantization config (None for bf16)."""
    raw = recipe_to_qconfig(recipe)
    qc = None if raw is None else QuantizationConfig.from_dict(raw, source=f"recipe {recipe!r}")
    if qc is not None and cfg.tie_word_embeddings and qc.scheme_for("lm_head") is not None:
        # (auto-round leaves a tied head unquantized with a warning; a recipe that asks for it is a mistake here)
        raise RecipeError(f"recipe {recipe!r}: lm_head: this config ties it to the embedding (tie_word_embeddings), "
                          "so it has no weight of its own to quantize; drop lm_head from the recipe")
    dense = abstract_model(cfg, dtype=jnp.dtype(dtype))
    targets = expected_tensors(dense, variable_shapes(dense), fused_experts=per_expert_layout(cfg),
                               text_prefix="model.")
    st = dtype_name(jnp.dtype(dtype))
    headers: dict[str, tuple[tuple[int, ...], str]] = {}
    for key, t in targets.items():
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        sch = None
        if qc is not None and module is not None and len(t.shape) == 2:
            sch = qc.scheme_for(module, is_linear=is_linear(module))
        if sch is None:
            headers[key] = (tuple(t.shape), st)
        else:
            for k, (_, shape, d) in packed_tensors(module, sch, tuple(t.shape), st).items():
                headers[k] = (shape, d)
    if qc is not None and qc.kv_cache is not None:
        for i, kind in enumerate(cfg.layer_types):
            if kind == FULL:
                n = 1 if qc.kv_cache.strategy == "tensor" else cfg.num_key_value_heads
                headers[f"model.layers.{i}.self_attn.k_scale"] = ((n,), "F32")
                headers[f"model.layers.{i}.self_attn.v_scale"] = ((n,), "F32")
    return headers, qc


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**28 else f"{n / 2**20:,.2f} MiB"


def vision_label(p: Plan) -> str:
    """The ``qjax inspect`` row of the vision tower's tensors: loaded (and in which dtype), or skipped and why."""
    if p.vision_loaded:
        return f"vision tower ({VISUAL_PREFIX}*, kept in {p.vision_dtype})"
    return f"vision tower ({VISUAL_PREFIX}*, skipped: {p.vision_skip_reason})"


def format_plan(p: Plan, *, title: str) -> str:
    """The report ``qjax inspect`` prints."""
    by_scheme: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for k, (shape, d) in p.headers.items():
        label = vision_label(p) if k.startswith(VISUAL_PREFIX) else p.scheme_of[k]
        cell = by_scheme[label][d]
        cell[0] += 1
        cell[1] += int(np.prod(shape)) * ST_ITEMSIZE[d]
    width = max([22, *map(len, by_scheme)])
    lines = [title, "", f"{'scheme':<{width}} {'dtype':<8} {'tensors':>8} {'bytes':>14}"]
    total = 0
    for label in sorted(by_scheme):
        for d, (n, b) in sorted(by_scheme[label].items()):
            lines.append(f"{label:<{width}} {d:<8} {n:>8,} {_gib(b):>14}")
            total += b
    held = f"device memory, weights as qjax holds them: {_gib(p.device_bytes)}"
    if p.vision_loaded:
        held += (f" (vision tower: {p.vision_tensors:,} tensors, {_gib(p.vision_device_bytes)} in {p.vision_dtype}; "
                 "inspect --text-only leaves it out)")
    elif p.vision_tensors:
        held += (f" (vision tower not loaded — {p.vision_skip_reason}: its {p.vision_tensors:,} tensors, "
                 f"{_gib(p.vision_disk_bytes)} on disk, are left out)")
    lines += ["", f"on disk: {_gib(total)} in {len(p.headers):,} tensors",
              f"computes in: {p.dtype} ({p.dtype_source}; matmuls, norms, softmaxes and the GDN state accumulate in "
              f"{accum_dtype(p.dtype).name})",
              held,
              f"KV cache: {p.kv_bytes_per_token / 1024:,.2f} KiB per token per sequence "
              f"({sum(t == FULL for t in p.cfg.layer_types)} full-attention layers)",
              f"GDN state: {_gib(p.gdn_bytes_per_sequence)} per sequence "
              f"({sum(t == LINEAR for t in p.cfg.layer_types)} layers: conv window + {accum_dtype(p.dtype).name} "
              f"recurrent state)"]
    for ctx in (4096, 32768, 262144):
        lines.append(f"  batch 1 at {ctx:>7,} tokens: weights + KV + state = "
                     f"{_gib(p.device_bytes + ctx * p.kv_bytes_per_token + p.gdn_bytes_per_sequence)}")
    if p.decode:
        d, cfg = p.decode, p.cfg
        head = f"lm_head {p.lm_head_bytes / 1e6:,.1f} MB" if p.lm_head_bytes else "lm_head tied to the embedding"
        lines.append(f"decode step at batch 1 reads {d['total'] / 1e6:,.1f} MB + KV {p.kv_bytes_per_token / 1e3:,.2f} "
                     f"kB per context token (bytes ÷ memory bandwidth bounds its speed): weights "
                     f"{d['weights'] / 1e6:,.1f} MB ({head}), routed experts {d['experts'] / 1e6:,.1f} MB "
                     f"({cfg.num_experts_per_tok} of {cfg.num_experts}), GDN state {d['state'] / 1e6:,.1f} MB "
                     "(read and written)")
    if p.mesh is not None:
        n = int(np.prod(list(p.mesh.values())))
        lines += ["", f"on a mesh of {n} devices ({', '.join(f'{a}={v}' for a, v in p.mesh.items())}), per device:",
                  f"  weights: {_gib(p.mesh_device_bytes)} ({_gib(p.mesh_replicated_bytes)} replicated on every "
                  f"device, the rest split)",
                  f"  KV cache: {p.mesh_kv_bytes_per_token / 1024:,.2f} KiB per token per sequence; GDN state: "
                  f"{_gib(p.mesh_gdn_bytes_per_sequence)} per sequence"]
        for ctx in (4096, 32768, 262144):
            total = p.mesh_device_bytes + ctx * p.mesh_kv_bytes_per_token + p.mesh_gdn_bytes_per_sequence
            lines.append(f"  batch {p.mesh['data']} at {ctx:>7,} tokens (1 sequence per device): weights + KV + "
                         f"state = {_gib(total)}")
    return "\n".join(lines)
