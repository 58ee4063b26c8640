"""Where the built-in default model lives (``qjax/assets/default``, shipped as package data)."""

from __future__ import annotations

import os


def default_model_dir() -> str:
    """The packaged model folder that commands use when ``--model`` is left out."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "default")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no --model given and the built-in model is missing ({path})")
    return path
