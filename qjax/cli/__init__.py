"""``qjax`` command line: thin wrappers that parse flags and call the library.

    qjax demo                         random tiny model → HF folder → load → generate (no download)
    qjax generate --model DIR PROMPT  generate from a checkpoint folder (text with its tokenizer.json, or --ids)
    qjax generate --model DIR --image PATH PROMPT   one chat turn about an image (repeat --image for several)
    qjax chat --model DIR             interactive chat through the checkpoint's chat template (/image PATH attaches)
    qjax inspect PATH [--text-only] | --config C --recipe R   sizes and predicted device memory
    qjax quantize --model DIR --dataset FILE --output_dir OUT [auto-round flags]   AutoRound → compressed-tensors
    qjax bench [--scale 8] [--recipe R]   prefill/decode speed of a random-weight model of a config + recipe
    qjax serve [MODEL] [vLLM's flags]   OpenAI-compatible server with continuous batching

Every command reports bad input and failed reads or writes as one ``error: …`` line naming the file, field or
tensor (exit 2); ``--debug`` (or ``QJAX_DEBUG=1``) shows the Python traceback of an unexpected error instead of its
one-line report.

The command modules import the library inside each command, not at the top: ``qjax --help`` and a flag error answer in
~0.2 s instead of the ~3 s that importing JAX, flax and the model takes (measured on the 2-core CPU host).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time

import numpy as np

from qjax.cli.options import add_dtype_argument, report_unknown_flags_with_own_usage

DEMO_CONFIG = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    "initializer_range": 0.1, "max_position_embeddings": 4096,
}


# modules that add subcommands of their own: each defines ``register(subparsers)`` (commands whose code is more than a
# thin wrapper live beside the library code they drive)
COMMAND_MODULES: tuple[str, ...] = ("qjax.cli.quantize", "qjax.cli.evaluate", "qjax.cli.chat", "qjax.cli.bench",
                                    "qjax.cli.serve")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--do-sample", action=argparse.BooleanOptionalAction, default=None,
                   help="sample instead of greedy (default: generation_config.json)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    add_dtype_argument(p)


def _sampling_kwargs(a) -> dict:
    return dict(max_new_tokens=a.max_new_tokens, do_sample=a.do_sample, temperature=a.temperature, top_k=a.top_k,
                top_p=a.top_p, seed=a.seed)


def cmd_demo(a) -> int:
    import jax.numpy as jnp

    import qjax
    from qjax.convert import save_pretrained
    from qjax.model.config import TextConfig

    cfg = TextConfig.from_dict(DEMO_CONFIG, source="qjax demo config")
    t0 = time.perf_counter()
    model = qjax.init_model(cfg, seed=a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_pretrained(model, os.path.join(tmp, "demo-qwen3_5_moe"))
        loaded = qjax.load_model(folder, dtype=jnp.dtype(a.dtype) if a.dtype else None)
    print(f"random {cfg.num_hidden_layers}-layer qwen3_5_moe (hidden {cfg.hidden_size}, {cfg.num_experts} experts "
          f"top-{cfg.num_experts_per_tok}) written as an HF folder and loaded back in {time.perf_counter() - t0:.1f} s")
    prompt = np.random.default_rng(a.seed).integers(0, cfg.vocab_size, (a.batch, a.prompt_len)).astype(np.int32)
    same = np.array_equal(np.asarray(model(prompt)), np.asarray(loaded(prompt))) if a.dtype in (None, "float32") \
        else None
    if same is not None:
        print(f"logits after the round trip identical: {same}")
    kw = _sampling_kwargs(a)
    t0 = time.perf_counter()
    qjax.generate(loaded, prompt, eos_token_id=[], **kw)
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = qjax.generate(loaded, prompt, eos_token_id=[], **kw)
    dt = time.perf_counter() - t0
    n = out.shape[1] - a.prompt_len
    print(f"generated {n} tokens × batch {a.batch}: first call (compiles) {t_first:.1f} s, then {dt * 1e3:.0f} ms "
          f"= {a.batch * n / dt:.0f} tokens/s (prefill included)")
    print("tokens:", " ".join(map(str, out[0, a.prompt_len:a.prompt_len + 24])), "…")
    return 0 if same in (None, True) else 1


def cmd_generate(a) -> int:
    from qjax.cli.chat import run_generate

    return run_generate(a)


def cmd_inspect(a) -> int:
    from qjax.convert.planner import format_plan, plan_folder, plan_recipe

    if a.recipe is not None or a.config is not None:
        if a.config is None or a.path is not None:
            print("error: use either PATH, or --config CONFIG.json with --recipe RECIPE", file=sys.stderr)
            return 2
        if a.text_only:
            print("error: --text-only applies to a checkpoint PATH (a --config/--recipe plan has no vision tower)",
                  file=sys.stderr)
            return 2
        p = plan_recipe(a.config, a.recipe or "bf16", dtype=a.dtype or "bfloat16", mesh=a.mesh)
        title = f"{a.config} with recipe {a.recipe or 'bf16'!r} (hypothetical, from shapes)"
    else:
        if a.path is None:
            print("error: give a checkpoint PATH, or --config with --recipe", file=sys.stderr)
            return 2
        p = plan_folder(a.path, dtype=a.dtype, mesh=a.mesh, verify=a.verify, text_only=a.text_only)
        title = f"{a.path}"
    print(format_plan(p, title=title))
    if a.path is not None:
        print("checked as loading checks it: config.json, generation_config.json, files inside the folder, "
              "safetensors headers, tensor names / shapes / dtypes against the model; "
              + ("tensor values: verified (no NaN or infinity, no zero scale, K/V scales positive)" if a.verify else
                 "tensor values: not read (--verify reads them)"))
    return 0


def cmd_lm_eval(a) -> int:
    try:
        from qjax.evaluation.lm_eval_adapter import main as lm_eval_main  # lm-eval is optional: imported only here
    except ImportError as e:
        print(f"error: qjax lm-eval needs lm-eval installed (pip install lm-eval==0.4.13): {e}", file=sys.stderr)
        return 2
    lm_eval_main(a.lm_eval_args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qjax", description="Run Qwen3.5/3.6-MoE checkpoints in JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="random tiny model: write, load, generate (needs no download)")
    d.add_argument("--batch", type=int, default=4)
    d.add_argument("--prompt-len", type=int, default=48)
    _sampling_args(d)
    d.set_defaults(func=cmd_demo)
    g = sub.add_parser("generate", help="generate from a HF checkpoint folder, streaming the text")
    g.add_argument("--model", default=None,
                   help="checkpoint folder (config.json + safetensors; default: the built-in model)")
    g.add_argument("--ids", default=None, help="prompt as token ids ('1 2 3') instead of text")
    g.add_argument("--chat", action="store_true", help="render PROMPT as a user message with the chat template")
    g.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image file for the model to look at (repeatable; needs a checkpoint with its vision "
                        "tower): the images, then PROMPT, make one user message through the chat template (implies "
                        "--chat)")
    from qjax.cli.chat import add_chat_prompt_arguments, add_sampling_arguments
    add_chat_prompt_arguments(g)
    g.add_argument("prompt", nargs="?", default=None)
    add_sampling_arguments(g, max_new_tokens=64)
    g.set_defaults(func=cmd_generate)
    i = sub.add_parser("inspect", help="tensor counts, bytes and predicted device memory of a checkpoint or recipe")
    i.add_argument("path", nargs="?", default=None, help="checkpoint folder")
    i.add_argument("--config", default=None, help="config.json of a hypothetical model")
    i.add_argument("--recipe", default=None,
                   help="preset (w2w4, w4a16, w8a16-g32, mxfp8-experts, bf16), 'experts=int2:g64,rest=int4:g128,"
                        "kv=fp8', a preset amended ('w2w4,lm_head=int8:channel': a later item replaces an earlier "
                        "one) or a JSON file with a quantization_config")
    add_dtype_argument(i, what="the dtype the model would compute in")
    i.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                   help="also print per-device memory on this mesh, e.g. tensor=2,expert=2 (no devices needed)")
    i.add_argument("--verify", action="store_true",
                   help="also read every tensor and check its values (NaN, infinity, zero scales)")
    i.add_argument("--text-only", action="store_true",
                   help="plan a load without the vision tower (model.visual.*): listed as skipped, left out of the "
                        "device memory")
    i.set_defaults(func=cmd_inspect)
    le = sub.add_parser("lm-eval", add_help=False,
                        help="lm-evaluation-harness with --model qjax registered (takes lm_eval's own flags)")
    le.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    le.set_defaults(func=cmd_lm_eval)
    for name in COMMAND_MODULES:  # each adds its subcommand(s): register(subparsers)
        importlib.import_module(name).register(sub)
    _own_usage(sub)
    return p


def _own_usage(sub) -> None:
    """Every subcommand (nested ones too) reports a misspelled flag with its own usage."""
    for parser in sub.choices.values():
        report_unknown_flags_with_own_usage(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                _own_usage(action)


def main(argv: list[str] | None = None) -> int:
    from qjax import xla_env

    xla_env.apply(single_threaded=True)  # before the backend starts; a user's XLA_FLAGS win (see xla_env.py)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:  # every later flag is lm-eval's (argparse's REMAINDER would still grab --help)
        return cmd_lm_eval(argparse.Namespace(lm_eval_args=argv[1:]))
    debug = "--debug" in argv or os.environ.get("QJAX_DEBUG", "") not in ("", "0")
    argv = [x for x in argv if x != "--debug"]
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        # bad input (ConfigError, LoadError, SafetensorsError, TokenizerError, ResumeError, … are ValueErrors whose
        # message names the file and the field) or a failed read or write (the OSError names the path)
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: one line, not a traceback, unless asked for
        if debug:
            raise
        text = " ".join(str(e).split())
        print(f"error: unexpected {type(e).__name__}: {text[:300]} — this is a bug in qjax; please report it with "
              "the command line (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
