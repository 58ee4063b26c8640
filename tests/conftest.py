"""Session-wide oracle fixtures: tiny transformers models generated at test time (see oracles/hf.py)."""

from __future__ import annotations

# before JAX starts (see qjax/xla_env.py): single-threaded Eigen; YNNPACK single dots, no YNNPACK fusions (fp32
# error ~1e-2)
import os  # noqa: E402

from qjax import xla_env  # noqa: E402

xla_env.apply(single_threaded=True)
# The suite compiles ~2,000 small programs and runs most of them a few times: XLA:CPU's LLVM backend optimisation was
# most of the wall time (tests/test_generate.py: backend compile 149 of 177 s; 79 of 108 s with these flags). The
# HLO passes (fusion, layout, simplification) are unchanged, so the programs tested are the same; only LLVM's code
# generation is less optimised. Set here, so every subprocess a test starts (CLI runs, the sharding probe) inherits
# them; a flag the caller already set in XLA_FLAGS wins. The legacy (LLVM IR) elemental emitters instead of the
# MLIR fusion emitters compile a tiny model's forward in 1.4 instead of 1.8 s (tests/test_loading.py with
# tests/test_compare.py: 239 -> 193 s). They do change the optimised HLO a little (a 4-layer model: 597 instead of
# 682 fusions, scatters expanded into loops), so tests/test_xla_env.py checks once, in a child process with the
# library's flags alone, that the model computes what the suite checks.
# XLA aborts the whole process on a flag it does not know, and jaxlib 0.11 no longer has the legacy emitters'
# switch ("Unknown flag in XLA_FLAGS: --xla_cpu_use_fusion_emitters=false" at the first computation, checked with
# jaxlib 0.11.2): each flag names the first jaxlib minor version without it.
from importlib.metadata import version as _version  # noqa: E402

# XLA:CPU also splits each program's LLVM module into parts to compile them on parallel threads; the suite's processes
# compile on one thread, and splitting, cloning and setting up a target machine per part was ~10 % of a tiny model's
# compile (--xla_cpu_parallel_codegen_split_count=1: the built-in model's forward at 8 lengths, 18.1 -> 16.3 s of CPU;
# the built-in model's float32 and bfloat16 logits and generated tokens are bit-identical with and without it).
_JAXLIB = tuple(int(p) for p in _version("jaxlib").split(".")[:2])
for _flag, _value, _gone in (("xla_backend_optimization_level", "0", None),
                             ("xla_llvm_disable_expensive_passes", "true", None),
                             ("xla_cpu_parallel_codegen_split_count", "1", None),
                             ("xla_cpu_use_fusion_emitters", "false", (0, 11))):
    if _flag not in os.environ.get("XLA_FLAGS", "") and (_gone is None or _JAXLIB < _gone):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()
# JAX writes each operation's Python traceback into the program's debug locations, which XLA carries through every
# compile pass: the suite never reads them (a failing test's traceback is Python's own), and without them the same
# forward compiles in 15.5 instead of 16.3 s of CPU (same bits out). Environment variables: subprocesses inherit them.
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "false")
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
# torch's OpenMP threads spin-wait after each parallel region, taking a core from the other test worker (~3 % of the
# workers' CPU time in a profile of the suite went to libgomp's spinning): they sleep instead. Read when torch starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import atexit  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

# One persistent XLA compilation cache for the session and every subprocess it starts (env vars are inherited):
# many tests run the same programs in fresh processes (the built-in model's generate in each CLI test, the same
# quantize steps before and after a kill), and compiling is most of their time on 2 cores.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="qjax-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache, True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# Both pytest workers (and their subprocesses) share it: a size limit turns on JAX's file lock around every cache read
# and write, so no process reads an entry another is still writing (without it a write is a plain, non-atomic write).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(64 << 30))
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_compilation_cache_max_size", int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1.0")))

import pytest  # noqa: E402
import torch
from oracles.ct import RECIPES, write_ct_checkpoint
from oracles.hf import (
    float64_truth,
    make_hf_model,
    odd_text_config,
    save_hf,
    tiny_text_config,
    write_official_layout,
)

# The models are tiny: more threads only add scheduling noise and contend with parallel test workers.
torch.set_num_threads(2)


def _memory_maps() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


# Every executable XLA:CPU compiles holds ~3 memory mappings per kernel (a model forward ≈ 440, a generate ≈ 1,000),
# and jax keeps them all in its caches. A test worker that runs a few hundred model programs reaches the kernel's
# vm.max_map_count (65,530): the next compile or cache write then crashes the worker with a segfault (seen twice in
# full runs, in backend_compile_and_load and in executable.serialize), and pytest-xdist hangs on the lost worker. So a
# test that leaves more than MAX_MAPS mappings behind drops all compiled programs. (Until 2026-12-05 every module's
# programs were also dropped when it ended: the next module then traced and compiled again even the programs it
# shared with the last one, such as the eager operations' small programs, which the persistent cache does not keep.)
MAX_MAPS = 30_000

# Python's full (generation-2) collections scan every live object; with torch, transformers and jax loaded a worker
# holds ~0.5–1 million, and a full collection triggered in the middle of tracing a model took 0.3–0.5 s
# (tests/test_generate.py, test_loading.py, test_compare.py: 10–12 s of each worker's 260 s). The automatic ones are
# turned off; the young generations still collect as usual, and the fixtures below collect in full after each module
# and whenever the memory maps are dropped. What is alive once the libraries are imported (~0.56 million objects:
# modules, classes, functions) lives as long as the worker, so it is moved out of the collector's sight (gc.freeze):
# a full collection no longer walks it (0.26 s each before; the collections were ~2.5 % of the workers' CPU time in a
# profile of the suite).
gc.set_threshold(700, 10, 1_000_000)
gc.freeze()


# The two workers take whole files (`--dist loadfile`) as they free up. pytest-xdist by default hands the files out
# by test count, largest first, which puts the few-test, long files (a live server, the 8-device mesh probes) last: a
# worker then runs one of them alone while the other has finished (the longest-first order is the classic remedy).
# pyproject's addopts turns that reordering off (--no-loadscope-reorder) and this hook puts the files with the most
# measured time first (tests' seconds summed per file, RESULTS.md "Test suite time": 2026-12-05 … 12-07), the rest
# after them in their usual order. Only the order changes: each file still runs whole, in its own order, on one worker.
LONGEST_FIRST = ("test_serving_api", "test_loading", "test_bench", "test_speculative", "test_quantize_cli",
                 "test_compare", "test_autoround", "test_sharding", "test_generate", "test_serving_engine",
                 "test_algorithms", "test_autoround_stream", "test_lm_head", "test_serving_failures",
                 "test_validation_files", "test_model", "test_kernels_integration", "test_default_model",
                 "test_chat_cli", "test_lm_eval_adapter", "test_xla_env")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: files keep their own order


@pytest.fixture(scope="module", autouse=True)
def _collect_after_each_module():
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _keep_memory_maps_bounded():
    yield
    if _memory_maps() > MAX_MAPS:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, str]:
    """(model, folder) of the tiny config, seed 0, saved per-expert under `model.layers.*`."""
    model = make_hf_model(tiny_text_config(), seed=0)
    return model, save_hf(model, tmp_path_factory.mktemp("tiny-qwen"))


@pytest.fixture(scope="session")
def odd_hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, str]:
    """(model, folder) of the odd-sized config, seed 0."""
    model = make_hf_model(odd_text_config(), seed=0)
    return model, save_hf(model, tmp_path_factory.mktemp("odd-qwen"))


@pytest.fixture(scope="session")
def official_dir(tiny_hf: tuple[torch.nn.Module, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """tiny_hf's weights in the official Qwen3.6 layout (composite config, fused experts, visual + MTP, 2 shards)."""
    return write_official_layout(tiny_hf[1], tmp_path_factory.mktemp("tiny-qwen-official"))


@pytest.fixture(scope="session")
def hf128():
    """A tiny model with hidden 128 so group 128 is exact and group 64 makes two groups."""
    # initializer_range 0.05: at 0.1 this wider net is chaotic enough that fp32 summation order alone moves logits
    # by ~1.5e-4 (weights bit-identical); at 0.05 the norm noise still makes (1+w) mistakes obvious
    return make_hf_model(tiny_text_config(hidden_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                          num_experts=4, initializer_range=0.05), seed=3)


@pytest.fixture(scope="session", params=sorted(RECIPES))
def ct_ckpt(request, hf128, tmp_path_factory):
    """(recipe name, folder) of a compressed-tensors checkpoint of ``hf128`` written by compressed-tensors itself."""
    folder = tmp_path_factory.mktemp(request.param)
    calib = np.random.default_rng(0).integers(0, 512, (2, 24))
    return request.param, write_ct_checkpoint(hf128, folder / "ckpt", RECIPES[request.param], calib_ids=calib)


@pytest.fixture
def x64():
    """JAX's x64 mode as a float64 model leaves it (``load_model(dtype="float64")`` switches it on for the process),
    restored afterwards so the worker's later tests run as they would alone."""
    before = jax.config.jax_enable_x64
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.fixture(scope="session")
def tiny_truth(tiny_hf):
    """tiny_hf's model in float64 everywhere: the ground truth (oracles/hf.py, float64_truth)."""
    return float64_truth(tiny_hf[0])


@pytest.fixture(scope="session")
def odd_truth(odd_hf):
    """odd_hf's model in float64 everywhere."""
    return float64_truth(odd_hf[0])
