"""``qjax quantize``'s flags, named as auto-round's CLI names them, declared apart from the tuning code.

Building this parser imports no JAX (``qjax --help`` and a flag error answer in well under a second; a child-process
test checks ``sys.modules``): :func:`cmd_quantize` imports :mod:`qjax.autoround.api` only when the command runs.
"""

from __future__ import annotations

import argparse

from qjax import xla_env


def register(sub) -> None:
    q = sub.add_parser("quantize", help="AutoRound (SignRound) quantization with auto-round's flags and defaults; "
                                         "also RTN, AWQ and GPTQ (--algorithm)")
    add_arguments(q)
    q.set_defaults(func=cmd_quantize)


def cmd_quantize(a) -> int:
    from qjax.autoround.api import cli

    return cli(a)


def _duo(text: str):
    v = text.strip().lower()
    if v not in ("true", "false", "both"):
        raise argparse.ArgumentTypeError(f"use true, false or both, not {text!r}")
    return {"true": True, "false": False}.get(v, v)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``qjax quantize`` flags, named as auto-round's CLI names them."""
    p.add_argument("model_pos", nargs="?", default=None, metavar="model",
                   help="checkpoint folder, as auto-round's positional model (same as --model)")
    p.add_argument("--model", "--model_name", "--model_name_or_path", dest="model", default=None,
                   help="BF16/FP32 checkpoint folder (default: the built-in model)")
    p.add_argument("--dataset", default=None,
                   help="local calibration file: .txt (blank-line separated documents), .jsonl ('text' or "
                        "'input_ids' per line) or .json list (default: the built-in model's calib.txt)")
    p.add_argument("--output_dir", required=True, help="the quantized checkpoint folder")
    p.add_argument("--format", "--formats", default="llm_compressor",
                   help="llm_compressor, auto_round, or several separated by ',' (one tuning run; as auto-round, "
                        "several formats go to OUTPUT_DIR/llm-compressor and OUTPUT_DIR/auto-round)")
    p.add_argument("--algorithm", "--algorithms", "--alg", "--algs", default=None,
                   help="auto_round (SignRound tuning), rtn (round to nearest: same as --iters 0), awq "
                        "(llm-compressor's AWQ: per-mapping scale search, scales folded into the norms and the "
                        "balance layers, router and shared-expert gate compensated, then min/max RTN) or gptq "
                        "(llm-compressor's GPTQ: per-linear Hessians, experts from their routed tokens); by default "
                        "auto_round, or rtn with --iters 0")
    a = p.add_argument_group("AWQ / GPTQ options (llm-compressor's names; --algorithm awq / gptq only)")
    a.add_argument("--duo_scaling", default=None, type=_duo, metavar="{true,false,both}",
                   help="AWQ: scales from activations and weights (true), activations only (false) or both grids "
                        "(default: true)")
    a.add_argument("--n_grid", type=int, default=None, help="AWQ: grid points of the scale search (default: 20)")
    a.add_argument("--block_size", type=int, default=None, help="GPTQ: columns per block (default: 128)")
    a.add_argument("--dampening_frac", type=float, default=None,
                   help="GPTQ: dampening, a fraction of the Hessian's mean diagonal (default: 0.01)")
    a.add_argument("--actorder", default=None, choices=["static", "weight", "none"],
                   help="GPTQ: activation order with static groups (static = weight) or none (default: static)")
    p.add_argument("--ignore_layers", "--fp_layers", default="",
                   help="comma-separated layer names kept in the model dtype, matched as auto-round does (a name "
                        "catches every layer it is a substring of or whose name its regex form matches; "
                        "'layers.1' becomes 'layers.1.')")
    p.add_argument("--quant_lm_head", action=argparse.BooleanOptionalAction, default=False,
                   help="quantize the lm_head too: the global scheme, or a --layer_config entry matching lm_head "
                        "(which alone turns this on, as in auto-round); tuned after the last block like a block "
                        "(RTN with --iters 0); a head tied to the embedding stays in the model dtype with a warning. "
                        "Written in both formats (auto-round's CLI allows it with auto_round only)")
    p.add_argument("--scheme", default=None, help="preset: W4A16, W2A16, W2A16G64, W2A16G32, W8A16, MXFP8")
    p.add_argument("--bits", type=int, default=None, help="weight bits (default: 4, or the --scheme's)")
    p.add_argument("--group_size", type=int, default=None, help="default: 128, or the --scheme's; -1 = per channel")
    p.add_argument("--asym", action="store_true", help="asymmetric INT (default symmetric, full range)")
    p.add_argument("--data_type", default=None, choices=["int", "mx_fp"], help="default: int, or the --scheme's")
    p.add_argument("--layer_config", default=None,
                   help="per-layer overrides, e.g. '{\".*experts.*\": {\"bits\": 2, \"group_size\": 64}}'")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--nsamples", "--nsample", type=int, default=128)
    p.add_argument("--seqlen", "--seq_len", type=int, default=2048)
    p.add_argument("--batch_size", "--train_bs", "--bs", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="default: 1/iters (auto-round's)")
    p.add_argument("--minmax_lr", type=float, default=None, help="default: --lr")
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
    p.add_argument("--device_memory", "--device-memory", type=float, default=None, metavar="GIB",
                   help="device memory the run may use, in GiB (default: the device's free memory; on CPU the "
                        "host's available memory). The run reads the checkpoint one decoder block at a time and "
                        "prints its memory plan first: block weights (the largest block in the model dtype, held "
                        "with one more copy while tuned), packed result (one block's codes and scales, written to the "
                        "progress folder then freed), stream (one cached calibration stream, nsamples x seqlen x "
                        "hidden; three are kept: on the device when they fit, else on the host with one tuning "
                        "chunk of minibatches on the device), tuning step (its working set, an estimate) and peak "
                        "(2 x block weights + tuning step + the streams on the device) against this budget; a plan "
                        "that cannot fit is refused before any work")
    p.add_argument("--resume", action="store_true", help="continue a killed run from its last finished block")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output_dir")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--compile_cache", default=None, metavar="DIR",
                   help="folder of compiled tuning steps, reused across blocks and runs; 'off' to disable (default: "
                        f"${xla_env.COMPILE_CACHE_ENV}, else ~/.cache/qjax/jax)")
    g = p.add_argument_group("auto-round flags accepted with no effect in qjax (a note on stderr each)")
    g.add_argument("--device_map", "--device", "--devices", default=None)
    tc = g.add_mutually_exclusive_group()
    tc.add_argument("--enable_torch_compile", dest="enable_torch_compile", action="store_true", default=None)
    tc.add_argument("--disable_torch_compile", dest="enable_torch_compile", action="store_false", default=None)
    g.add_argument("--disable_low_cpu_mem_usage", action="store_true")
    g.add_argument("--low_cpu_mem_usage", action="store_true")
    for act in p._actions:  # --help shows every default
        if act.help == argparse.SUPPRESS or act.dest in ("help", "model_pos") or act.default in (None, False, "") \
                or "default" in (act.help or ""):
            continue
        act.help = (act.help + " " if act.help else "") + "(default: %(default)s)"
