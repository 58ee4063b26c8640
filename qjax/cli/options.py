"""Command-line options shared by several ``qjax`` commands, declared once.

Nothing here imports JAX: ``qjax --help`` and a flag error must answer before the library loads (a child-process test
checks ``sys.modules``). A ``--dtype`` value is checked by :func:`qjax.model.dtypes.model_dtype` when it is parsed.
"""

from __future__ import annotations

import argparse

# qjax.model.dtypes.MODEL_DTYPES' names, in its order (written here so that building the parser imports no JAX;
# tests/test_cli.py checks the two agree)
DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")


def dtype(value: str) -> str:
    """``--dtype`` values: a name from :data:`qjax.model.dtypes.MODEL_DTYPES`; float64 switches JAX's x64 mode on
    before anything is traced."""
    from qjax.model.dtypes import DtypeError, model_dtype

    try:
        return model_dtype(value, "--dtype").name
    except DtypeError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--dtype: ")) from None


def add_dtype_argument(p: argparse.ArgumentParser, *, default: str | None = None, what: str = "") -> None:
    """``--dtype``: the dtype the model computes in (``model.dtype``); None = the checkpoint's."""
    p.add_argument("--dtype", type=dtype, default=default, metavar="{" + ",".join(DTYPE_NAMES) + "}",
                   help=(what or "parameter/activation dtype") + " (default: "
                        + (default or "the checkpoint's") + "); float64 computes every step in float64")


def add_compile_cache_argument(p: argparse.ArgumentParser) -> None:
    """``--compile-cache DIR|off``: where compiled programs are kept between runs (qjax.xla_env.compile_cache_dir)."""
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="folder of compiled programs reused between runs (a second start skips XLA's compile); "
                        "'off' to disable (default: $QJAX_COMPILE_CACHE, else ~/.cache/qjax/jax)")


def start_compile_cache(flag: str | None) -> str | None:
    """Turn the persistent compilation cache on for this process (before anything compiles): the folder, or None
    when it is off."""
    from qjax import xla_env
    from qjax.program_cache import use_compile_cache

    return use_compile_cache(xla_env.compile_cache_dir(flag))


def add_tokenizer_argument(p: argparse.ArgumentParser) -> None:
    """``--tokenizer DIR``: tokenizer files from another folder (a checkpoint folder without tokenizer.json)."""
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="folder with tokenizer.json (and tokenizer_config.json, chat template) to use instead of the "
                        "model folder's (default: the model folder)")


def report_unknown_flags_with_own_usage(p: argparse.ArgumentParser) -> None:
    """Make ``p`` (a subcommand's parser) refuse a flag it does not know with its own usage line, not the top-level
    one: argparse leaves unknown arguments of a subparser to the main parser, whose usage lists only the commands."""
    parse_known = p.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, extras = parse_known(args, namespace)
        if extras:
            p.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    p.parse_known_args = parse_known_args
