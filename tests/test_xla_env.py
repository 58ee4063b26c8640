"""qjax.xla_env: the XLA:CPU flags qjax adds, and where the persistent compilation cache lives."""

from __future__ import annotations

import os

import pytest

from qjax import xla_env


def test_flags_added_once_and_a_users_flag_wins():
    env = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=true"}
    got = xla_env.apply(single_threaded=True, environ=env)
    assert "--xla_cpu_multi_thread_eigen=true" in got and "multi_thread_eigen=false" not in got
    assert "--xla_cpu_experimental_ynn_fusion_type=" in got
    assert xla_env.apply(single_threaded=True, environ=env) == got  # idempotent


@pytest.mark.parametrize("flag,environ,want", [
    (None, {}, os.path.join(os.path.expanduser("~"), ".cache", "qjax", "jax")),
    (None, {"XDG_CACHE_HOME": "/x"}, "/x/qjax/jax"),
    (None, {"JAX_COMPILATION_CACHE_DIR": "/j", "XDG_CACHE_HOME": "/x"}, "/j"),
    (None, {"QJAX_COMPILE_CACHE": "/q", "JAX_COMPILATION_CACHE_DIR": "/j"}, "/q"),
    ("/f", {"QJAX_COMPILE_CACHE": "/q"}, "/f"),
    ("off", {"QJAX_COMPILE_CACHE": "/q"}, None),
    (None, {"QJAX_COMPILE_CACHE": "OFF"}, None),
])
def test_compile_cache_dir_precedence(flag, environ, want):
    """The command's flag, then qjax's variable, then JAX's own, then the XDG cache folder; 'off' turns it off."""
    assert xla_env.compile_cache_dir(flag, environ=environ) == want
