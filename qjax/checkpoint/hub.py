"""Model names → local folders, the way the Hugging Face tools resolve them, without ever downloading.

A name is a folder path, or a repository id (``org/name``) that is already in the local Hugging Face cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``): its snapshot for ``refs/main`` (or the
only snapshot there is). So ``qjax serve Qwen/Qwen3.6-35B-A3B`` works after ``hf download Qwen/Qwen3.6-35B-A3B``,
as ``vllm serve`` does, and fails with a clear line when the model is not on this machine. With no name at all,
commands use the built-in model shipped in the package (:func:`default_model_dir`).
"""

from __future__ import annotations

import os
import re

from qjax.validation import read_regular

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# qjax/assets: package data (the built-in model's folder, the full-size configs)
ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def default_model_dir() -> str:
    """The packaged model folder that commands use when ``--model`` is left out."""
    path = os.path.join(ASSETS, "default")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no --model given and the built-in model is missing ({path})")
    return path


class ModelNotFound(FileNotFoundError):
    """The name is neither a folder nor a repository in the local cache (the message says where it looked)."""


def hub_cache() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def resolve(name: str, *, what: str = "model") -> str:
    """The local folder for ``name`` (see the module docstring); raises :class:`ModelNotFound`."""
    name = os.fspath(name)
    if os.path.isdir(name):
        return name
    if not _REPO_ID.match(name) or ".." in name.split("/"):
        raise ModelNotFound(f"{what} {name!r}: no such folder")
    repo = os.path.join(hub_cache(), "models--" + name.replace("/", "--"))
    snaps = os.path.join(repo, "snapshots")
    ref = os.path.join(repo, "refs", "main")
    if os.path.isfile(ref):
        # a regular file of a commit hash (never a FIFO that would block the read)
        rev = read_regular(ref, what="a Hugging Face cache ref", max_bytes=1024, error=ModelNotFound).decode(
            "utf-8", "replace").strip()
        if re.fullmatch(r"[0-9a-fA-F]{6,64}", rev) and os.path.isdir(os.path.join(snaps, rev)):
            return os.path.join(snaps, rev)
    found = sorted(os.listdir(snaps)) if os.path.isdir(snaps) else []
    if len(found) == 1:
        return os.path.join(snaps, found[0])
    raise ModelNotFound(f"{what} {name!r}: no such folder, and not in the Hugging Face cache {hub_cache()} "
                        f"(qjax downloads nothing: fetch it first, e.g. `hf download {name}`, or give a folder)")
