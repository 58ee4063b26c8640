"""Multi-device layout: the mesh, and the one table of PartitionSpec rules for every parameter, cache entry and
activation.

Mesh axes (any may be 1 or absent):

- ``data``: batch rows (activations and the generation cache); parameters are replicated over it.
- ``tensor``: attention and GDN heads. Column-parallel projections split their output rows (``q_proj``, ``k_proj``,
  ``v_proj``, ``in_proj_*``, shared-expert ``gate/up_proj``, ``lm_head`` and the embedding over the vocabulary),
  row-parallel ones their input columns (``o_proj``, ``out_proj``, shared-expert ``down_proj``); per-head vectors
  (``A_log``, ``dt_bias``, KV scales) and the GDN ``conv1d`` channels follow their heads.
- ``expert``: routed experts, whole experts per device. The experts are split over ``expert`` × ``tensor``
  together (E / (expert·tensor) whole experts per device), so a TP2 × EP2 mesh holds a quarter of them.

Packed weights split with their groups: a row split cuts ``weight_packed``, ``weight_scale`` and
``weight_zero_point`` at the same rows; a column split cuts the packed words and the scale groups at the same input
column, which needs whole groups and whole int32 words on every device — a weight that cannot be cut so is
replicated (with a warning), never mis-split.

Dense layers run under ``jit`` with these shardings and XLA's SPMD partitioner inserts the collectives; the routed
experts run in :func:`expert_parallel` (``shard_map``: each device applies its own experts to every token of its
data shard, then a ``psum`` over the expert devices), which routes exactly as one device does.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qjax.kernels import accum_dtype, qmatmul
from qjax.model.cache import Cache, GDNState, KVState
from qjax.model.config import TextConfig
from qjax.model.linears import tensor_parallel_kind
from qjax.model.variables import packed_metas, variable_shapes

logger = logging.getLogger("qjax")

AXES = ("data", "tensor", "expert")


class MeshError(ValueError):
    """A mesh that does not fit the devices or the model (names the axis and the dimension)."""


# ---------------------------------------------------------------------------------------------------------------------
# the mesh
# ---------------------------------------------------------------------------------------------------------------------
def parse_mesh_spec(text: str) -> dict[str, int]:
    """``"tensor=2,expert=4"`` → ``{"tensor": 2, "expert": 4}`` (the CLI's ``--mesh``)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq or not value.strip().isdigit():
            raise MeshError(f"mesh: expected AXIS=SIZE items like 'tensor=2,expert=4', got {part!r}")
        sizes[name.strip()] = int(value)
    return sizes


def mesh_sizes(spec: Mapping[str, int] | str | Mesh) -> dict[str, int]:
    """Axis sizes ``{data, tensor, expert}`` of a mesh, a dict of sizes or a ``"tensor=2"`` string (checked)."""
    if isinstance(spec, Mesh):
        unknown = [a for a in spec.axis_names if a not in AXES]
        if unknown:
            raise MeshError(f"mesh axis {unknown[0]!r} is not one of {AXES}")
        return {a: int(spec.shape.get(a, 1)) for a in AXES}
    sizes = parse_mesh_spec(spec) if isinstance(spec, str) else dict(spec)
    for name, n in sizes.items():
        if name not in AXES:
            raise MeshError(f"mesh axis {name!r} is not one of {AXES}")
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise MeshError(f"mesh axis {name!r}: size must be a positive integer, got {n!r}")
    return {a: int(sizes.get(a, 1)) for a in AXES}


def make_mesh(spec: Mapping[str, int] | str | Mesh, devices=None) -> Mesh:
    """A mesh with axes (data, tensor, expert) from a dict of axis sizes (missing axes are 1), a ``"tensor=2"``
    string, or a ready :class:`jax.sharding.Mesh` (returned after checking its axis names).

    The mesh takes the first ``data·tensor·expert`` of ``devices`` (default: all devices, all hosts).
    """
    sizes = mesh_sizes(spec)
    if isinstance(spec, Mesh):
        return spec
    shape = tuple(sizes[a] for a in AXES)
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(shape)
    if need > len(devices):
        raise MeshError(f"mesh {sizes} needs {need} devices, only {len(devices)} are available "
                        f"(CPU: XLA_FLAGS=--xla_force_host_platform_device_count={need})")
    kwargs = {}
    if hasattr(jax.sharding, "AxisType"):  # GSPMD propagation ("auto" axes), whatever this jax's default is
        kwargs["axis_types"] = (jax.sharding.AxisType.Auto,) * len(AXES)
    return Mesh(np.array(devices[:need], dtype=object).reshape(shape), AXES, **kwargs)


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """A mesh checked against one model config: which dimensions each axis splits. Hashable (a static attribute
    of the model, so jitted programs specialise on it)."""

    mesh: Mesh
    kv_split: bool  # KV heads over ``tensor`` (else replicated: fewer KV heads than tensor devices)
    vocab_split: bool  # embedding / lm_head rows over ``tensor``

    def size(self, axis: str) -> int:
        return int(self.mesh.shape.get(axis, 1))

    def axis(self, name: str) -> str | None:
        """The axis name for a PartitionSpec, or None when the mesh lacks it or it has size 1."""
        return name if self.size(name) > 1 else None

    @property
    def expert_axes(self) -> tuple[str, ...]:
        return tuple(a for a in ("expert", "tensor") if self.size(a) > 1)

    @property
    def expert_devices(self) -> int:
        return self.size("expert") * self.size("tensor")

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def constrain(self, x: jnp.ndarray, spec: P) -> jnp.ndarray:
        return jax.lax.with_sharding_constraint(x, self.sharding(spec))

    def batch(self, x: jnp.ndarray) -> jnp.ndarray:
        """Constrain an activation ``[B, ...]`` to rows over ``data`` (replicated over the other axes)."""
        check_batch(self, x.shape[0])
        return self.constrain(x, P(self.axis("data"), *([None] * (x.ndim - 1))))

    def qmatmul(self, x: jnp.ndarray, arrays: tuple, meta, split: str) -> jnp.ndarray:
        """A packed linear split over ``tensor`` (see :func:`tensor_parallel_qmatmul`): the layer calls its plan, so
        the quantized layers need not import this module."""
        return tensor_parallel_qmatmul(x, arrays, meta, split, self)


def plan_mesh(mesh: Mapping[str, int] | str | Mesh, cfg: TextConfig, devices=None) -> MeshPlan:
    """Check that ``mesh`` divides ``cfg``'s heads, channels and experts (before any device is touched); raise
    :class:`MeshError` naming the axis and the dimension when it does not."""
    sizes = check_fits(mesh, cfg)
    return _plan(make_mesh(mesh, devices), sizes, cfg)


def abstract_plan(mesh: Mapping[str, int] | str | Mesh, cfg: TextConfig) -> MeshPlan:
    """:func:`plan_mesh` on an abstract mesh of the same axis sizes: for planning without devices."""
    sizes = check_fits(mesh, cfg)
    return _plan(jax.sharding.AbstractMesh(tuple(sizes[a] for a in AXES), AXES), sizes, cfg)


def _plan(mesh, sizes: dict[str, int], cfg: TextConfig) -> MeshPlan:
    tp = sizes["tensor"]
    return MeshPlan(mesh=mesh, kv_split=cfg.num_key_value_heads % tp == 0, vocab_split=cfg.vocab_size % tp == 0)


def check_fits(mesh: Mapping[str, int] | str | Mesh, cfg: TextConfig) -> dict[str, int]:
    """The mesh's axis sizes, after checking they divide ``cfg``'s heads, channels and experts."""
    sizes = mesh_sizes(mesh)
    tp, ep = sizes["tensor"], sizes["expert"]

    def need(dim: str, value: int, n: int, axis: str, what: str = "") -> None:
        if value % n:
            raise MeshError(f"mesh axis {axis}={n} does not divide {dim} = {value}{what}")

    need("num_attention_heads", cfg.num_attention_heads, tp, "tensor")
    nkv = cfg.num_key_value_heads
    if nkv % tp and tp % nkv:
        raise MeshError(f"mesh axis tensor={tp} does not divide num_key_value_heads = {nkv}, nor does "
                        f"num_key_value_heads divide it (KV heads are split, or replicated when fewer)")
    need("linear_num_value_heads", cfg.linear_num_value_heads, tp, "tensor")
    need("GDN conv channels (2·key_dim + value_dim)", cfg.conv_dim, tp, "tensor")
    need("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size, tp, "tensor")
    need("num_experts", cfg.num_experts, ep * tp, "expert×tensor" if tp > 1 else "expert",
         " (experts are split over expert × tensor, whole experts per device)" if tp > 1 else "")
    return sizes


def check_batch(plan: MeshPlan, batch: int) -> None:
    n = plan.size("data")
    if batch % n:
        raise MeshError(f"mesh axis data={n} does not divide the batch size {batch}")


# ---------------------------------------------------------------------------------------------------------------------
# parameter rules
# ---------------------------------------------------------------------------------------------------------------------
# (module path regex, kind): the first match wins; paths are the nnx state path joined by "." without the leaf name
# the layers' linear projections are split as qjax.model.linears declares them; these are the other variables
_RULES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)linear_attn\.conv1d$", "channels"),
    (r"(^|\.)mlp\.experts(\.(gate_up|down)_proj)?$", "experts"),
    (r"^lm_head$", "vocab"),
)
_HEAD_VECTORS = {("linear_attn", "A_log"): "heads", ("linear_attn", "dt_bias"): "heads",
                 ("self_attn", "k_scale"): "kv_heads", ("self_attn", "v_scale"): "kv_heads"}


def _kind(module: str) -> str:
    declared = tensor_parallel_kind(module)
    if declared is not None:
        return declared
    for pattern, kind in _RULES:
        if re.search(pattern, module):
            return kind
    return "replicated"


def param_spec(path: tuple, shape: tuple[int, ...], plan: MeshPlan, meta=None, warn=None) -> P:
    """The PartitionSpec of one model variable.

    Args:
      path: its nnx state path, e.g. ``('groups', 'layers', 0, 'self_attn', 'q_proj', 'weight_packed')``.
      shape: its shape (stacked layer groups first for ``groups`` paths).
      meta: the QuantMeta of a packed weight's module (None for dense variables).
      warn: called with a message when a weight has to stay replicated (default: logged).
    """
    names = [str(p) for p in path]
    lead = 1 if names[0] == "groups" else 0  # the stacked layer-group axis is never split
    module, leaf = ".".join(names[:-1]), names[-1]
    tp = plan.axis("tensor")
    spec: list = [None] * len(shape)
    if names == ["embed_tokens"]:
        spec[0] = tp if plan.vocab_split else None
        return P(*spec)
    if names[0] == "visual":  # the vision tower (0.45 B of 35 B parameters) is replicated
        return P(*spec)
    vector = _HEAD_VECTORS.get((names[-2] if len(names) > 1 else "", leaf))
    if vector is not None:
        if vector == "heads" or plan.kv_split:
            spec[-1] = tp
        return P(*spec)
    kind = _kind(module if leaf in ("weight", "weight_packed", "weight_scale", "weight_zero_point")
                 else ".".join(names))
    if kind == "experts":
        spec[lead] = plan.expert_axes or None
        return P(*spec)
    if kind == "replicated" or tp is None:
        return P(*spec)
    if kind == "vocab" and not plan.vocab_split:
        return P(*spec)
    if kind == "col_kv":
        kind = "col" if plan.kv_split else "replicated"
    if kind == "channels":  # conv1d weight [C, 1, K]
        spec[lead] = tp
    elif kind in ("col", "vocab"):
        if not (leaf == "weight_scale" and meta is not None and meta.strategy == "tensor"):
            spec[-2] = tp
    elif kind == "row":
        if _row_split_ok(shape, plan.size("tensor"), meta, module, warn or logger.warning):
            if not (leaf in ("weight_scale", "weight_zero_point") and shape[-1] == 1):
                spec[-1] = tp
    return P(*spec)


def _row_split_ok(shape, n: int, meta, module: str, warn) -> bool:
    """Whether an input-column split keeps whole groups and whole packed words on every device."""
    if meta is None:
        return shape[-1] % n == 0
    k = meta.in_features
    per = k // n if k % n == 0 else 0
    bits = 8 if meta.fmt == "mxfp8" else meta.bits
    ok = bool(per) and (per * bits) % 32 == 0 and (meta.strategy != "group" or per % meta.group_size == 0)
    if not ok:
        warn(f"{re.sub(r'^groups[.]layers[.][0-9]+[.]', '', module)}: input dim {k} split {n} ways would cut a "
             f"quantization group or packed word (group {meta.group_size}, {bits} bits): kept replicated over tensor")
    return ok


def state_shardings(model, plan: MeshPlan) -> dict[tuple, NamedSharding]:
    """NamedSharding of every variable of ``model`` (abstract or real), by nnx state path."""

    metas, out, warnings = packed_metas(model), {}, []
    for path, leaf in variable_shapes(model).items():
        out[path] = plan.sharding(param_spec(path, tuple(leaf.shape), plan, metas.get(path[:-1]), warnings.append))
    for message in dict.fromkeys(warnings):  # once per module (packed fields repeat it)
        logger.warning("%s", message)
    return out


def split_ways(spec: P, plan: MeshPlan) -> int:
    """Into how many parts a variable with PartitionSpec ``spec`` is cut (1: replicated)."""
    ways = 1
    for entry in spec:
        for axis in entry if isinstance(entry, tuple) else (entry,):
            ways *= plan.size(axis) if axis is not None else 1
    return ways


def per_device_bytes(model, plan: MeshPlan) -> tuple[int, int]:
    """(bytes one device holds, bytes replicated on every device) for ``model`` (abstract or real) on ``plan``,
    from the PartitionSpec rules alone (no devices needed)."""

    metas = packed_metas(model)
    held = replicated = 0
    for path, leaf in variable_shapes(model).items():
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        ways = split_ways(param_spec(path, tuple(leaf.shape), plan, metas.get(path[:-1]), warn=lambda _: None), plan)
        held += nbytes // ways
        replicated += nbytes if ways == 1 else 0
    return held, replicated


def cache_shardings(cache, plan: MeshPlan):
    """A pytree of NamedShardings shaped like ``cache`` (a :class:`qjax.model.cache.Cache`, abstract or real)."""

    dp, tp = plan.axis("data"), plan.axis("tensor")
    kv_tp = tp if plan.kv_split else None
    s = plan.sharding
    slots = []
    for slot in cache.slots:
        if isinstance(slot, KVState):
            spec = s(P(None, dp, kv_tp, None, None))
            slots.append(KVState(k=spec, v=spec))
        else:
            slots.append(GDNState(conv=s(P(None, dp, None, tp)), recurrent=s(P(None, dp, tp, None, None))))
    return Cache(slots=tuple(slots), key_valid=s(P(dp, None)), positions=s(P(dp)), lengths=s(P(dp)))


def set_plan(model, plan: MeshPlan | None) -> None:
    """Record ``plan`` on the model and every module that lays out its own computation: the MoE blocks (expert
    parallelism) and the packed linears the ``tensor`` axis splits (their kernels run per shard)."""


    for path, node in nnx.iter_graph(model):
        if not (isinstance(node, nnx.Module) and hasattr(node, "mesh_plan")):
            continue
        node.mesh_plan = plan
        if hasattr(node, "tp_split"):  # a packed Linear
            node.tp_split = None if plan is None else _linear_split(tuple(path), node, plan)


def _linear_split(path: tuple, layer, plan: MeshPlan) -> str | None:
    """"col" / "row" when :func:`param_spec` splits this packed linear's output rows / input columns over tensor
    (a packed lm_head: "col" when the vocabulary splits)."""
    value = layer.weight_packed.get_value() if hasattr(layer.weight_packed, "get_value") else layer.weight_packed.value
    spec = tuple(param_spec(path + ("weight_packed",), tuple(value.shape), plan, layer.meta, warn=lambda _: None))
    spec = spec + (None,) * (len(value.shape) - len(spec))
    if spec[-2] == "tensor":
        return "col"
    if spec[-1] == "tensor":
        return "row"
    return None


def tensor_parallel_qmatmul(x: jnp.ndarray, arrays: tuple, meta, split: str, plan: MeshPlan) -> jnp.ndarray:
    """``x @ dequant(W)ᵀ`` with W split over ``tensor``: each device runs the kernel on its shard.

    "col": W's rows are split; x is whole on every device and the output columns stay split.
    "row": W's input columns are split (whole groups, whole words); x arrives split the same way and the partial
    products are summed over the devices in float32 (float64 for a float64 model), then rounded to x's dtype. Each
    partial leaves the kernel in x's dtype: exact for float32, one extra bf16 rounding for bf16 models (as vLLM's
    row-parallel layers).

    Args:
      x: ``[B, ..., K]`` (rows over ``data``); arrays: ``(packed, scale, zero)`` as the layer holds them.
    """
    packed, scale, zero = arrays
    n = plan.size("tensor")
    dp, tp = plan.axis("data"), "tensor"
    rows = [dp] + [None] * (x.ndim - 2)
    if split == "col":
        local = dataclasses.replace(meta, out_features=meta.out_features // n)
        w_spec = P(tp, None)
        s_spec = P(tp, None) if scale.shape[-2] > 1 else P(None, None)
        x_spec, out_spec = P(*rows, None), P(*rows, tp)

        def f(x, p, s, z):
            return qmatmul(x, p, s, z, local)
    else:
        k = meta.in_features // n
        local = dataclasses.replace(meta, in_features=k,
                                    group_size=meta.group_size if meta.strategy == "group" else k)
        w_spec = P(None, tp)
        s_spec = P(None, tp) if scale.shape[-1] > 1 else P(None, None)
        x_spec, out_spec = P(*rows, tp), P(*rows, None)

        def f(x, p, s, z):
            y = qmatmul(x, p, s, z, local)
            return jax.lax.psum(y.astype(accum_dtype(x.dtype)), tp).astype(x.dtype)

    if zero is None:
        fn = jax.shard_map(lambda x, p, s: f(x, p, s, None), mesh=plan.mesh, in_specs=(x_spec, w_spec, s_spec),
                           out_specs=out_spec, check_vma=False)
        return fn(x, packed, scale)
    fn = jax.shard_map(f, mesh=plan.mesh, in_specs=(x_spec, w_spec, s_spec, s_spec), out_specs=out_spec,
                       check_vma=False)
    return fn(x, packed, scale, zero)


def device_bytes(model) -> dict:
    """Bytes of parameters each device holds: ``{device: bytes}`` (what the sharding tests measure)."""

    out: dict = {}
    for _, v in nnx.to_flat_state(nnx.state(model)):
        value = v.get_value() if hasattr(v, "get_value") else v.value
        for shard in value.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.size * shard.data.dtype.itemsize
    return out


# ---------------------------------------------------------------------------------------------------------------------
# expert parallelism
# ---------------------------------------------------------------------------------------------------------------------
def expert_parallel(experts, x: jnp.ndarray, idx: jnp.ndarray, weights: jnp.ndarray, plan: MeshPlan) -> jnp.ndarray:
    """Routed experts with their ``[E, …]`` stacks split over the expert devices.

    Each device sees every token-slot of its data shard; slots routed to another device's experts are passed as
    dropped (id −1: the kernels give them no block and add nothing), the device applies its own experts, and a
    ``psum`` over the expert devices adds the k contributions — the same routing as one device (no capacity limit,
    no token dropped), only the summation order of the k terms differs (float32: a few ulp).

    Args:
      experts: an :class:`qjax.model.moe.Experts` (dense or packed) whose arrays are sharded by
        :func:`param_spec`.
      x: ``[N, H]``; idx, weights: ``[N, k]``.
    Returns:
      ``[N, H]`` in the accumulation dtype (float32; float64 for float64 x).
    """

    axes = plan.expert_axes
    dp = plan.axis("data")
    graphdef, state = nnx.split(experts)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    local_e = (leaves[0].shape[0]) // plan.expert_devices
    param_specs = [P(axes or None, *([None] * (leaf.ndim - 1))) for leaf in leaves]
    row = P(dp, None)

    def local(x, idx, weights, *params):
        module = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, params))
        first = jax.lax.axis_index(axes) * local_e if axes else 0
        mine = (idx >= first) & (idx < first + local_e)
        out = module(x, jnp.where(mine, idx - first, -1), weights)  # -1: a dropped slot (qjax.kernels contract)
        return jax.lax.psum(out, axes) if axes else out

    fn = jax.shard_map(local, mesh=plan.mesh, in_specs=(row, row, row, *param_specs), out_specs=row,
                       check_vma=False)
    return fn(x, idx, weights, *leaves)
