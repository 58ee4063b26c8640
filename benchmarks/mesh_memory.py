"""Per-device memory of the real Qwen3.6-35B-A3B config on several meshes and recipes (the planner: shapes only,
no devices). Prints the Markdown rows of RESULTS.md's multi-device table:

    python benchmarks/mesh_memory.py
"""

from __future__ import annotations

import logging
import os

from qjax.convert.planner import plan_recipe

import qjax

CONFIG = os.path.join(os.path.dirname(qjax.__file__), "assets", "configs", "qwen3_6_35b_a3b.json")
RECIPES = ["bf16", "w2w4", "w8a16-g32", "mxfp8-experts"]
MESHES = [{"tensor": 1}, {"tensor": 2, "expert": 2}, {"expert": 4}, {"tensor": 4, "expert": 2}, {"tensor": 8},
          {"tensor": 2, "expert": 8}]
GIB = 2 ** 30


def main() -> None:
    logging.getLogger("qjax").setLevel(logging.ERROR)  # the "kept replicated" warnings are summarised in RESULTS.md
    for recipe in RECIPES:
        for mesh in MESHES:
            p = plan_recipe(CONFIG, recipe, mesh=mesh)
            n = p.mesh["data"] * p.mesh["tensor"] * p.mesh["expert"]
            name = "×".join(f"{a[0].upper()}P{v}" for a, v in p.mesh.items() if v > 1) or "one device"
            seq = p.mesh_device_bytes + 32768 * p.mesh_kv_bytes_per_token + p.mesh_gdn_bytes_per_sequence
            print(f"| {recipe} | {name} | {n} | {p.device_bytes / GIB:.2f} | {p.mesh_device_bytes / GIB:.2f} | "
                  f"{p.device_bytes / p.mesh_device_bytes / n:.2f} | {p.mesh_kv_bytes_per_token / 1024:.1f} | "
                  f"{seq / GIB:.2f} |")


if __name__ == "__main__":
    main()
