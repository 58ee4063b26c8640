"""``qjax quantize``: a checkpoint folder + calibration file → a quantized checkpoint folder, resumable.

    quantize_folder("Qwen3.6-35B-A3B", "out-w2w4", AutoRoundConfig(bits=4, group_size=128,
                    layer_config={".*experts.*": {"bits": 2, "group_size": 64}}), dataset="calib.jsonl")
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import jax.numpy as jnp
import numpy as np

import qjax
from qjax.checkpoint.hub import default_model_dir
from qjax.checkpoint.view import Checkpoint
from qjax.convert.autoround_writer import save_autoround
from qjax.convert.hf_writer import preflight, save_pretrained
from qjax.quant.unquantized import kept_part

from . import progress as prog
from .data import calibration_ids, load_tokenizer, read_documents
from .driver import AutoRound, AutoRoundConfig, report_json
from .schemes import check_layer_config, layer_scheme, parse_layer_config, preset

logger = logging.getLogger("qjax.autoround")

FORMATS = ("llm_compressor", "auto_round")
# the source's files an export copies as they are: the tokenizer, the chat template and the image/video processors'
# settings (the vision tower is copied too, so image prompts keep working on the export)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "preprocessor_config.json", "video_preprocessor_config.json")
REPORT_FILE = "qjax_autoround.json"


def progress_dir_for(output_dir: str) -> str:
    """Where a run keeps its resumable progress: beside the output folder, which is only written at the end."""
    out = os.path.abspath(output_dir)
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.qjax-progress")


def quantize_folder(model_dir: str, output_dir: str, cfg: AutoRoundConfig, *, dataset: str, fmt: str = "llm_compressor",
                    dtype=None, overwrite: bool = False, resume: bool = False, progress: bool = True,
                    on_block=None) -> str:
    """Quantize the checkpoint in ``model_dir`` with AutoRound and write it to ``output_dir``.

    AutoRound tunes the decoder layers. The MTP head (``mtp.*``) and the vision tower (``model.visual.*``) are left
    as the seeds leave them (:mod:`qjax.quant.unquantized`): copied into the export as ``model_dir`` stores them and
    listed as unquantized; a ``layer_config`` pattern that would quantize them is refused. A composite source stays
    composite.

    Args:
      cfg: the AutoRound options.
      dataset: local calibration file (.txt, .jsonl, .json; see :mod:`qjax.autoround.data`).
      fmt: ``llm_compressor`` (compressed-tensors pack-quantized, vLLM/transformers) or ``auto_round``
        (GPTQ-style ``qweight``/``qzeros``/``scales``).
      dtype: the dtype the blocks run in (default: the checkpoint's; auto-round runs in bf16).
      resume: continue a killed run from its last finished block (same options and data).
    Returns:
      ``output_dir``.
    """
    # options are checked before anything is loaded or computed
    check_layer_config(cfg.base_scheme, cfg.layer_config)
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is not supported (choose from {', '.join(FORMATS)})")
    if os.path.exists(output_dir) and not overwrite:
        raise FileExistsError(f"--output_dir {output_dir} already exists (pass --overwrite to replace it)")
    if fmt == "auto_round" and (cfg.data_type != "int" or _any_mx(cfg)):
        raise ValueError("--format auto_round: qjax writes INT schemes in the auto_round (GPTQ) layout; use "
                         "--format llm_compressor for MXFP8")
    read_documents(dataset)  # a broken calibration file is reported now, not after loading the model
    if not resume:
        preflight(output_dir, 2 * _output_bytes(model_dir, cfg))  # the output + the progress blocks, at the end
    # text only: AutoRound tunes the decoder; the export copies the tower from the source as stored
    model = qjax.load_model(model_dir, dtype=jnp.dtype(dtype) if dtype else None, text_only=True)
    tokenizer = None
    try:
        tokenizer = load_tokenizer(model_dir)
    except ValueError:
        pass  # only needed for text data; calibration_ids says so when it is
    ids = calibration_ids(dataset, tokenizer, nsamples=cfg.nsamples, seqlen=cfg.seqlen, seed=cfg.seed,
                          vocab_size=model.config.vocab_size)
    fingerprint = {"model": os.path.abspath(model_dir), "dtype": str(model.dtype), "format": fmt,
                   "calibration_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
                   **{k: v for k, v in cfg.to_dict().items() if k != "chunk"}}
    fingerprint = json.loads(json.dumps(fingerprint))  # what state.json holds after a round trip
    pdir = progress_dir_for(output_dir)
    ar = AutoRound(model, ids, cfg, progress=progress, progress_dir=pdir, resume=resume, fingerprint=fingerprint,
                   on_block=on_block)
    ar.run()
    qmodel = ar.quantized_model()
    extra = [os.path.join(model_dir, f) for f in TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, f))]
    report = os.path.join(pdir, REPORT_FILE)
    with open(report, "w", encoding="utf-8") as f:
        f.write(report_json(ar.reports))
    extra.append(report)
    # the source's MTP head and vision tower go into the export as stored (qjax.quant.unquantized)
    if fmt == "llm_compressor":
        save_pretrained(qmodel, output_dir, overwrite=overwrite, extra_files=extra, source=model_dir)
    else:
        save_autoround(qmodel, output_dir, overwrite=overwrite, extra_files=extra, tuning=_tuning_keys(cfg, ids),
                       layer_config=cfg.layer_config or None, source=model_dir)
    prog.finish(pdir)
    return output_dir


def _output_bytes(model_dir: str, cfg: AutoRoundConfig) -> int:
    """An upper estimate of the quantized checkpoint's size, from the source's headers: every 2-D ``.weight`` of the
    text model at the widest bits the options use (plus its scales), everything else (the MTP head and the vision
    tower, copied as stored, included) as it is."""

    schemes = [cfg.base_scheme] + [layer_scheme(cfg.base_scheme, o) for o in cfg.layer_config.values()]
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
    """The tuning options auto-round records in its quantization_config when they differ from its defaults."""
    d = AutoRoundConfig()
    out = {}
    for k in ("iters", "nsamples", "seqlen", "batch_size", "lr", "minmax_lr", "enable_minmax_tuning",
              "enable_quanted_input", "enable_alg_ext"):
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
    return AutoRoundConfig(
        **fields, layer_config=parse_layer_config(a.layer_config), iters=a.iters, nsamples=a.nsamples,
        seqlen=a.seqlen, batch_size=a.batch_size, lr=a.lr, minmax_lr=a.minmax_lr,
        enable_minmax_tuning=not a.disable_minmax_tuning, enable_quanted_input=not a.disable_quanted_input,
        enable_alg_ext=a.enable_alg_ext, disable_opt_rtn=True if a.disable_opt_rtn else None,
        not_use_best_mse=a.not_use_best_mse, scale_dtype=a.scale_dtype, static_kv_dtype=a.static_kv_dtype,
        static_kv_granularity=a.static_kv_granularity, seed=a.seed)


def add_arguments(p) -> None:
    """``qjax quantize`` flags, named as auto-round's CLI names them."""
    p.add_argument("--model", default=None, help="BF16/FP32 checkpoint folder (default: the built-in model)")
    p.add_argument("--dataset", default=None,
                   help="local calibration file: .txt (blank-line separated documents), .jsonl ('text' or "
                        "'input_ids' per line) or .json list (default: the built-in model's calib.txt)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--format", default="llm_compressor", choices=FORMATS)
    p.add_argument("--scheme", default=None, help="preset: W4A16, W2A16, W2A16G64, W2A16G32, W8A16, MXFP8")
    p.add_argument("--bits", type=int, default=None)
    p.add_argument("--group_size", type=int, default=None)
    p.add_argument("--asym", action="store_true", help="asymmetric INT (default symmetric, full range)")
    p.add_argument("--data_type", default=None, choices=["int", "mx_fp"])
    p.add_argument("--layer_config", default=None,
                   help="per-layer overrides, e.g. '{\".*experts.*\": {\"bits\": 2, \"group_size\": 64}}'")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--minmax_lr", type=float, default=None)
    p.add_argument("--disable_minmax_tuning", action="store_true")
    p.add_argument("--disable_quanted_input", action="store_true")
    p.add_argument("--enable_alg_ext", action="store_true")
    p.add_argument("--disable_opt_rtn", action="store_true")
    p.add_argument("--not_use_best_mse", action="store_true")
    p.add_argument("--scale_dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--static_kv_dtype", default=None, choices=["fp8"])
    p.add_argument("--static_kv_granularity", default="tensor", choices=["tensor", "head"])
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="dtype the blocks run in (default: the checkpoint's)")
    p.add_argument("--resume", action="store_true", help="continue a killed run from its last finished block")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output_dir")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def cli(a) -> int:
    cfg = config_from_args(a)
    model_dir = a.model or default_model_dir()
    dataset = a.dataset or os.path.join(model_dir, "calib.txt")
    if not a.quiet:
        logging.getLogger("qjax.autoround").setLevel(logging.INFO)
        if not logging.getLogger().handlers:
            logging.basicConfig(format="%(message)s")

    def on_block(r):
        if a.quiet:
            return
        if r.best_loss is None:
            print(f"block {r.index}: {r.units} units, RTN, {r.seconds:.1f} s", flush=True)
        else:
            print(f"block {r.index} ({r.kind}): {r.units} units, loss iter 0 {r.init_loss:.4e} -> best "
                  f"{r.best_loss:.4e} (iter {r.best_iter}), {r.seconds:.1f} s", flush=True)

    out = quantize_folder(model_dir, a.output_dir, cfg, dataset=dataset, fmt=a.format, dtype=a.dtype,
                          overwrite=a.overwrite, resume=a.resume, progress=not a.quiet, on_block=on_block)
    print(f"wrote {out} ({a.format})")
    return 0
