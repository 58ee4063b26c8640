"""Level-A GPU check shared by the kernel tests: lower a function for CUDA under an abstract H200 (no GPU needed)."""

from __future__ import annotations

import warnings

import jax
import jax.experimental.pallas.triton as plgpu
import pytest

# the custom call a Pallas-Triton kernel lowers to
TRITON_TARGET = getattr(plgpu, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")


def lower_for_h200(fn, specs) -> str:
    """StableHLO text of ``jax.jit(fn)`` traced on ``specs`` and lowered for CUDA on an abstract H200 (skips on a
    jax without abstract devices)."""
    if not all(hasattr(jax.sharding, a) for a in ("AbstractDevice", "AbstractMesh", "use_abstract_mesh")):
        pytest.skip("this jax has no abstract-device lowering")
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def pallas_grids(fn, *args) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, grid)`` of every ``pallas_call`` in ``jax.make_jaxpr(fn)(*args)`` (nested jaxprs included: custom_vjp,
    jit, scan bodies), in program order: the programs each kernel launches, from the traced program alone (``args``
    may be ``jax.ShapeDtypeStruct``s, so real model shapes cost nothing)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                info = eqn.params.get("name_and_src_info") or eqn.params.get("name")
                found.append((str(getattr(info, "name", info)), tuple(eqn.params["grid_mapping"].grid)))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr → Jaxpr
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found
