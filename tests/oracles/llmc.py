"""The llm-compressor oracle fixtures (``tests/fixtures/llmc_oracle/``, written by ``benchmarks/llmc_oracle.py``):
llmcompressor 0.14.0.1's AWQ and GPTQ on a tiny float32 ``qwen3_5_moe``, what they saw and chose."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from safetensors.numpy import load_file

from qjax.autoround.schemes import Scheme

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "llmc_oracle"


@functools.cache
def run(name: str) -> tuple[dict, dict]:
    """(metadata, tensors) of one recorded run."""
    return json.loads((FIXTURES / f"{name}.json").read_text()), load_file(FIXTURES / f"{name}.safetensors")


@functools.cache
def source() -> tuple[dict, dict]:
    """(config.json, float32 tensors by transformers name) of the model every run started from; the fused experts
    (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) split into the per-expert Linear names
    llm-compressor's linearized experts carry (``mlp.experts.{e}.gate_proj.weight`` …)."""
    cfg = json.loads((FIXTURES / "config.json").read_text())
    out = {}
    for k, v in load_file(FIXTURES / "model.safetensors").items():
        if k.endswith("mlp.experts.gate_up_proj"):
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{k[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = v[e, :inter]
                out[f"{k[:-len('gate_up_proj')]}{e}.up_proj.weight"] = v[e, inter:]
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{k[:-len('down_proj')]}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return cfg, out


def scheme(meta: dict) -> Scheme:
    w = meta["weights"]
    return Scheme(bits=w["num_bits"], group_size=w.get("group_size") or -1, sym=w["symmetric"])
