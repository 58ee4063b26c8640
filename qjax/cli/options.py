"""Command-line options shared by several ``qjax`` commands, declared once."""

from __future__ import annotations

import argparse

from qjax.model.dtypes import MODEL_DTYPES, DtypeError, model_dtype


def dtype(value: str) -> str:
    """``--dtype`` values: a name from :data:`qjax.model.dtypes.MODEL_DTYPES`; float64 switches JAX's x64 mode on
    before anything is traced."""
    try:
        return model_dtype(value, "--dtype").name
    except DtypeError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--dtype: ")) from None


def add_dtype_argument(p: argparse.ArgumentParser, *, default: str | None = None, what: str = "") -> None:
    """``--dtype``: the dtype the model computes in (``model.dtype``); None = the checkpoint's."""
    p.add_argument("--dtype", type=dtype, default=default, metavar="{" + ",".join(MODEL_DTYPES) + "}",
                   help=(what or "parameter/activation dtype") + " (default: "
                        + (default or "the checkpoint's") + "); float64 computes every step in float64")
