"""``qjax quantize``: a checkpoint folder + calibration file → a quantized checkpoint folder, resumable.

    quantize_folder("Qwen3.6-35B-A3B", "out-w2w4", AutoRoundConfig(bits=4, group_size=128,
                    layer_config={".*experts.*": {"bits": 2, "group_size": 64}}), dataset="calib.jsonl")
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from qjax import xla_env
from qjax.checkpoint.hub import default_model_dir
from qjax.checkpoint.view import Checkpoint
from qjax.convert.hf_writer import preflight
from qjax.program_cache import ProgramCache, program_cache, use_compile_cache
from qjax.quant.unquantized import kept_part

from . import algorithms
from . import progress as prog
from .data import calibration_ids, load_tokenizer, read_documents
from .driver import AutoRound, AutoRoundConfig, report_json
from .export import save_streamed
from .plan import plan_memory
from .stream import FolderBlocks
from .schemes import check_layer_config, ignore_layers_config, layer_scheme, parse_layer_config, preset

logger = logging.getLogger("qjax.autoround")

FORMATS = ("llm_compressor", "auto_round")
# auto-round's --algorithm names (auto_round/algorithms/registry.py) → canonical; qjax runs auto_round and rtn
ALGORITHM_ALIASES = {"auto_round": "auto_round", "autoround": "auto_round", "sign_round": "auto_round",
                     "signround": "auto_round", "rtn": "rtn", "hadamard": "hadamard", "random_hadamard": "hadamard",
                     "quarot_hadamard": "hadamard", "awq": "awq", "gptq": "gptq", "quarot": "quarot", "spinquant": "spinquant",
                     "svdquant": "svdquant"}
# the source's files an export copies as they are: the tokenizer, the chat template and the image/video processors'
# settings (the vision tower is copied too, so image prompts keep working on the export)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "preprocessor_config.json", "video_preprocessor_config.json")
REPORT_FILE = "qjax_autoround.json"


def progress_dir_for(output_dir: str) -> str:
    """Where a run keeps its resumable progress: beside the output folder, which is only written at the end."""
    out = os.path.abspath(output_dir)
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.qjax-progress")


def parse_formats(fmt) -> list[str]:
    """``--format`` text → format names, as auto-round splits it (lower-cased, spaces removed, split on ``,``)."""
    names = fmt if isinstance(fmt, (list, tuple)) else str(fmt).lower().replace(" ", "").split(",")
    out = []
    for f in names:
        if f not in FORMATS:
            raise ValueError(f"--format {f!r} is not supported (choose from {', '.join(FORMATS)}, or several "
                             "separated by ',')")
        if f not in out:
            out.append(f)
    if not out:
        raise ValueError("--format: no format given")
    return out


def format_dirs(output_dir: str, fmt) -> dict[str, str]:
    """Where each format goes: ``output_dir`` itself for one format; for several, auto-round 0.16.1's
    ``_get_save_folder_name``: ``output_dir/<format with '_' → '-'>`` (``auto-round``, ``llm-compressor``)."""
    formats = parse_formats(fmt)
    if len(formats) == 1:
        return {formats[0]: output_dir}
    return {f: os.path.join(output_dir, f.replace(":", "-").replace("_", "-")) for f in formats}


def quantize_folder(model_dir: str, output_dir: str, cfg: AutoRoundConfig, *, dataset: str, fmt: str = "llm_compressor",
                    dtype=None, overwrite: bool = False, resume: bool = False, progress: bool = True,
                    on_block=None, programs: ProgramCache | None = None, device_memory: int | None = None,
                    on_plan=None, algorithm=None) -> str:
    """Quantize the checkpoint in ``model_dir`` with AutoRound and write it to ``output_dir``.

    AutoRound tunes the decoder layers, read from ``model_dir`` one block at a time (:mod:`qjax.autoround.stream`):
    each finished block goes to the progress folder and is freed, and the export is assembled from there shard by
    shard (:mod:`qjax.autoround.export`), so neither the model nor the quantized model is ever held whole. The
    memory plan (:mod:`qjax.autoround.plan`) is logged before any work, and a run that cannot fit is refused. The MTP
    head (``mtp.*``) and the vision tower (``model.visual.*``) are left
    as the seeds leave them (:mod:`qjax.quant.unquantized`): copied into the export as ``model_dir`` stores them and
    listed as unquantized; a ``layer_config`` pattern that would quantize them is refused. A composite source stays
    composite.

    Args:
      cfg: the AutoRound options.
      dataset: local calibration file (.txt, .jsonl, .json; see :mod:`qjax.autoround.data`).
      fmt: ``llm_compressor`` (compressed-tensors pack-quantized, vLLM/transformers) or ``auto_round``
        (GPTQ-style ``qweight``/``qzeros``/``scales``), or several separated by ``,``: one tuning run, each format
        written to its own folder (:func:`format_dirs`).
      dtype: the dtype the blocks run in (default: the checkpoint's; auto-round runs in bf16).
      resume: continue a killed run from its last finished block (same options and data).
      programs: where the tuning programs are kept traced between runs (:func:`program_cache`).
      device_memory: the device memory the run may use, in bytes (default: the device's own; on CPU the host's
        available memory); decides where the calibration streams live.
      on_plan: called with the :class:`~qjax.autoround.plan.MemoryPlan` before any work.
      algorithm: None for AutoRound (RTN with ``iters`` 0), or an object of :mod:`qjax.autoround.algorithms`
        (:func:`~qjax.autoround.algorithms.make`: AWQ, GPTQ) that quantizes each block in the same streamed loop.
    Returns:
      ``output_dir``.
    """
    # options are checked before anything is loaded or computed
    check_layer_config(cfg.base_scheme, cfg.layer_config)
    dirs = format_dirs(output_dir, fmt)
    fmt = ",".join(dirs)
    if os.path.exists(output_dir) and not overwrite:
        raise FileExistsError(f"--output_dir {output_dir} already exists (pass --overwrite to replace it)")
    if "auto_round" in dirs and (cfg.data_type != "int" or _any_mx(cfg)):
        raise ValueError("--format auto_round: qjax writes INT schemes in the auto_round (GPTQ) layout; use "
                         "--format llm_compressor for MXFP8")
    read_documents(dataset)  # a broken calibration file is reported now, not after loading the model
    out_bytes = _output_bytes(model_dir, cfg)
    if not resume:
        # the output + the progress blocks, at the end
        preflight(output_dir, (len(dirs) + 1) * out_bytes)
    # one block at a time: AutoRound tunes the decoder; the export copies the rest from the source as stored
    source = FolderBlocks(model_dir, dtype=jnp.dtype(dtype) if dtype else None)
    try:
        tokenizer = None
        try:
            tokenizer = load_tokenizer(model_dir)
        except ValueError:
            pass  # only needed for text data; calibration_ids says so when it is
        ids = calibration_ids(dataset, tokenizer, nsamples=cfg.nsamples, seqlen=cfg.seqlen, seed=cfg.seed,
                              vocab_size=source.config.vocab_size, tuned=cfg.iters > 0 or algorithm is not None)
        logger.info("calibration: %d samples of %d tokens from %s", ids.shape[0], ids.shape[1], dataset)
        fingerprint = {"model": os.path.abspath(model_dir), "dtype": str(source.dtype), "format": fmt,
                       "calibration_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
                       **{k: v for k, v in cfg.to_dict().items() if k != "chunk"}, **algorithms.describe(algorithm)}
        fingerprint = json.loads(json.dumps(fingerprint))  # what state.json holds after a round trip
        pdir = progress_dir_for(output_dir)
        ar = AutoRound(source, ids, cfg, progress=progress, progress_dir=pdir, resume=resume,
                       fingerprint=fingerprint, on_block=on_block, programs=programs, algorithm=algorithm)
        plan = plan_memory(ar, device_memory=device_memory, output_bytes=out_bytes)  # refused here, before any work, when it cannot fit
        ar.streams = plan.where
        for line in plan.lines():
            logger.info("%s", line)
        if on_plan:
            on_plan(plan)
        ar.run()
        extra = [os.path.join(model_dir, f) for f in TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, f))]
        report = os.path.join(pdir, REPORT_FILE)
        with open(report, "w", encoding="utf-8") as f:
            f.write(report_json(ar.reports))
        extra.append(report)
        # the source's MTP head and vision tower go into the export as stored (qjax.quant.unquantized)
        if len(dirs) > 1:
            os.makedirs(output_dir, exist_ok=True)
        save_streamed(ar, model_dir, dirs, overwrite=overwrite, extra_files=extra, tuning=_tuning_keys(cfg, ids),
                      layer_config=cfg.layer_config or None)
    finally:
        source.close()
    prog.finish(pdir)
    return output_dir


def _output_bytes(model_dir: str, cfg: AutoRoundConfig) -> int:
    """An upper estimate of the quantized checkpoint's size, from the source's headers: every 2-D ``.weight`` of the
    text model at the widest bits the options use (plus its scales), everything else (the MTP head and the vision
    tower, copied as stored, included) as it is."""

    schemes = [cfg.base_scheme] + [layer_scheme(cfg.base_scheme, o) for o in cfg.layer_config.values()]
    schemes = [s for s in schemes if s.quantized] or [cfg.base_scheme]  # a layer kept in bf16 is counted as stored
    if not cfg.base_scheme.quantized:
        schemes = [cfg.base_scheme]
    bits = max(8 if s.data_type == "mx_fp" else s.bits for s in schemes)
    group = min((s.group_size for s in schemes if s.group_size and s.group_size > 0), default=128)
    ckpt = Checkpoint(model_dir)
    try:
        total = 0
        for k in ckpt.keys():
            n, itemsize = ckpt.where[k].nbytes(k), ckpt.get(k).itemsize  # (a view: no data is read)
            quantizable = k.endswith(".weight") and len(ckpt.shape(k)) >= 2 and "embed_tokens" not in k \
                and kept_part(k) is None
            total += int(n * (bits + 32 / group) / (8 * itemsize)) if quantizable else n
        return total
    finally:
        ckpt.close()


def _any_mx(cfg: AutoRoundConfig) -> bool:
    return any(o.get("data_type") == "mx_fp" for o in cfg.layer_config.values())


def _tuning_keys(cfg: AutoRoundConfig, ids: np.ndarray) -> dict:
    """The tuning options auto-round records in its quantization_config when they differ from its defaults (its
    ``SerializedCompressorConfig``: ``enable_alg_ext`` is not among them)."""
    d = AutoRoundConfig()
    out = {}
    for k in ("iters", "nsamples", "seqlen", "batch_size", "lr", "minmax_lr", "enable_minmax_tuning",
              "enable_quanted_input"):
        if getattr(cfg, k) != getattr(d, k):
            out[k] = getattr(cfg, k)
    if ids.shape[0] != cfg.nsamples:
        out["nsamples"] = int(ids.shape[0])
    return out


def config_from_args(a) -> AutoRoundConfig:
    """An :class:`AutoRoundConfig` from ``qjax quantize`` flags (auto-round's names)."""

    base = {}
    if a.scheme:
        base = preset(a.scheme, "--scheme")
    fields = dict(bits=base.get("bits", 4), group_size=base.get("group_size", 128), sym=base.get("sym", True),
                  data_type=base.get("data_type", "int"))
    for k in ("bits", "group_size", "data_type"):
        if getattr(a, k) is not None:
            fields[k] = getattr(a, k)
    if a.asym:
        fields["sym"] = False
    ignore = ignore_layers_config(a.ignore_layers)
    layer_config = {**parse_layer_config(a.layer_config), **ignore}
    iters = 0 if algorithm_from_args(a) == "rtn" else a.iters
    return AutoRoundConfig(
        **fields, layer_config=layer_config, ignore_layers=tuple(ignore), iters=iters, nsamples=a.nsamples,
        seqlen=a.seqlen, batch_size=a.batch_size, lr=a.lr, minmax_lr=a.minmax_lr,
        enable_minmax_tuning=not a.disable_minmax_tuning, enable_quanted_input=not a.disable_quanted_input,
        enable_alg_ext=a.enable_alg_ext, disable_opt_rtn=True if a.disable_opt_rtn else None,
        not_use_best_mse=a.not_use_best_mse, scale_dtype=a.scale_dtype, static_kv_dtype=a.static_kv_dtype,
        static_kv_granularity=a.static_kv_granularity, quant_lm_head=a.quant_lm_head, seed=a.seed)


def algorithm_from_args(a) -> str:
    """``--algorithm`` as auto-round 0.16.1 reads it (cli/algorithms.py ``build_configs``): comma-separated names,
    lower-cased, aliases resolved, unknown names ignored; ``rtn`` among them, or ``--iters 0``, means RTN, otherwise
    AutoRound. auto-round's other algorithms (awq, hadamard, …) are refused: qjax does not implement them."""
    raw = getattr(a, "algorithm", None) or ""
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    canonical = [ALGORITHM_ALIASES[n] for n in names if n in ALGORITHM_ALIASES]
    for n in names:
        if n not in ALGORITHM_ALIASES:
            print(f"note: --algorithm {n!r} is not an auto-round algorithm; ignored (as auto-round does)",
                  file=sys.stderr)
    other = sorted({c for c in canonical if c not in algorithms.NAMES})
    if other:
        raise ValueError(f"--algorithm {','.join(other)} is not supported by qjax (auto_round, rtn, awq or gptq)")
    if len(set(canonical)) > 1:
        raise ValueError(f"--algorithm: choose one of {', '.join(sorted(set(canonical)))}")
    if canonical and canonical[0] in (algorithms.AWQ, algorithms.GPTQ):
        return canonical[0]
    return "rtn" if "rtn" in canonical or a.iters == 0 else "auto_round"


def algorithm_object(a):
    """The block algorithm of ``qjax quantize`` flags (:func:`qjax.autoround.algorithms.make`; None: AutoRound/RTN)."""
    actorder = getattr(a, "actorder", None)
    actorder = "unset" if actorder is None else (None if actorder == "none" else actorder)
    return algorithms.make(algorithm_from_args(a), duo_scaling=getattr(a, "duo_scaling", None),
                           n_grid=getattr(a, "n_grid", None), block_size=getattr(a, "block_size", None),
                           dampening_frac=getattr(a, "dampening_frac", None), actorder=actorder)


# flags auto-round takes that change nothing in qjax: (flag dest, note when given)
NO_EFFECT = {
    "device_map": "--device_map has no effect in qjax (the tuning step splits its minibatch over JAX's devices: on "
                  "CPU one per core; set $JAX_NUM_CPU_DEVICES to choose)",
    "enable_torch_compile": "--enable_torch_compile/--disable_torch_compile have no effect in qjax (XLA compiles "
                            "every step)",
    "disable_low_cpu_mem_usage": "--disable_low_cpu_mem_usage has no effect in qjax (the checkpoint is read lazily "
                                 "from its safetensors)",
    "low_cpu_mem_usage": "--low_cpu_mem_usage has no effect in qjax (the checkpoint is read lazily from its "
                         "safetensors)",
}


def use_cpu_devices(batch_size: int, environ=os.environ) -> int | None:
    """Before JAX's backend starts: one XLA:CPU device per core, up to ``batch_size``, so that a CPU run's tuning step
    splits its minibatch over the cores (:func:`qjax.autoround.driver.data_parallel_mesh`; each device runs
    single-threaded, which was faster than one multi-threaded device: RESULTS.md). Returns the count set, or None when
    ``$JAX_NUM_CPU_DEVICES`` already chose one or the backend has started. On a GPU the CPU devices stay idle."""
    if "JAX_NUM_CPU_DEVICES" in environ:
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    n = max(1, min(cores, batch_size))
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend is already running (a caller that computed something first)
        return None
    return n


def cli(a) -> int:
    if a.model_pos is not None:
        if a.model is not None and a.model != a.model_pos:
            raise ValueError(f"model given twice: {a.model_pos!r} and --model {a.model!r}")
        a.model = a.model_pos
    for dest, note in NO_EFFECT.items():
        if getattr(a, dest, None) not in (None, False):
            print(f"note: {note}", file=sys.stderr)
        elif dest == "enable_torch_compile" and a.enable_torch_compile is False:
            print(f"note: {note}", file=sys.stderr)
    cfg = config_from_args(a)
    alg = algorithm_object(a)
    use_cpu_devices(cfg.batch_size)
    model_dir = a.model or default_model_dir()
    dataset = a.dataset or os.path.join(model_dir, "calib.txt")
    if not a.quiet:
        source = "--dataset" if a.dataset else "no --dataset: the model folder's calib.txt"
        print(f"calibration data: {dataset} ({source})", file=sys.stderr)
    if not a.quiet:
        logging.getLogger("qjax.autoround").setLevel(logging.INFO)
        if not logging.getLogger().handlers:
            logging.basicConfig(format="%(message)s")
    cache = use_compile_cache(xla_env.compile_cache_dir(a.compile_cache))
    if not a.quiet:
        print(f"compilation cache: {cache} (tuning steps, traced and compiled, are reused across blocks and runs)"
              if cache else "compilation cache: off (every block structure traces and compiles its tuning step in "
              "this run)", file=sys.stderr)

    budget = None if a.device_memory is None else int(a.device_memory * 2**30)
    out = quantize_folder(model_dir, a.output_dir, cfg, dataset=dataset, fmt=a.format, dtype=a.dtype,
                          overwrite=a.overwrite, resume=a.resume, progress=not a.quiet, programs=program_cache(cache),
                          device_memory=budget, algorithm=alg)
    for f, d in format_dirs(out, a.format).items():
        print(f"wrote {d} ({f})")
    return 0
