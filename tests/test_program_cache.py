"""qjax.program_cache: traced programs stored once, read back without tracing, keyed on all that decides them."""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qjax import program_cache
from qjax.program_cache import ProgramCache


def _counting(fn):
    """``fn`` that counts how often it is traced (its Python body runs once per trace)."""
    traced = []

    def wrapper(*args):
        traced.append(1)
        return fn(*args)
    return wrapper, traced


def _body(x, w):
    return {"y": jnp.tanh(x @ w["a"]) * w["b"], "n": (jnp.sum(x), None)}


def _args(rows=5, dtype=jnp.float32):
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((rows, 7)), dtype)
    return x, {"a": jnp.asarray(r.standard_normal((7, 3)), dtype), "b": jnp.asarray(r.standard_normal(3), dtype)}


def _files(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder)) if os.path.isdir(folder) else []


def _same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_stored_program_is_read_back_without_tracing(tmp_path):
    fn, traced = _counting(_body)
    args = _args()
    want = jax.jit(_body)(*args)
    first = ProgramCache(str(tmp_path)).jit(fn, ("body", 1))
    _same(first(*args), want)
    _same(first(*args), want)  # the same signature: no second program
    assert len(traced) == 1 and first.stored == 1 and len(_files(tmp_path)) == 1
    # a new handle on the folder (as a new process has): the stored program runs, the function is not traced
    again = ProgramCache(str(tmp_path)).jit(fn, ("body", 1))
    _same(again(*args), want)
    assert len(traced) == 1 and again.loaded == 1 and again.stored == 0
    assert again.path_for(*args) == first.path_for(*args) == os.path.join(tmp_path, _files(tmp_path)[0])


@pytest.mark.parametrize("kept", ["nothing", "stored", "loaded"])
def test_one_program_whatever_the_inputs_committedness(tmp_path, kept):
    # jax.jit lowers and compiles again when the same shapes come placed (device_put, a computation's output) in one
    # call and made from host data in another; the cache's programs must not (AutoRound compiled a forward twice)
    folder = None if kept == "nothing" else str(tmp_path)
    if kept == "loaded":
        ProgramCache(folder).jit(_body, "body")(*_args())
    fn = ProgramCache(folder).jit(_body, "body")
    x, w = _args()
    dev = jax.devices()[0]
    want = jax.jit(_body)(x, w)
    assert not x.committed
    _same(fn(x, w), want)
    lowered = []

    def listen(event, secs, **kw):
        if event.endswith("jaxpr_to_mlir_module_duration"):
            lowered.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for args in ((jax.device_put(x, dev), w), (x, jax.device_put(w, dev)), jax.device_put((x, w), dev)):
            _same(fn(*args), want)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert lowered == []
    assert (fn.stored, fn.loaded) == {"nothing": (0, 0), "stored": (1, 0), "loaded": (0, 1)}[kept]


@pytest.mark.parametrize("change", ["static", "shape", "dtype", "tree", "code", "x64"])
def test_everything_that_decides_the_program_is_in_its_key(tmp_path, change, monkeypatch):
    fn, traced = _counting(_body)
    cache = ProgramCache(str(tmp_path))
    args = _args()
    cache.jit(fn, "body")(*args)
    static, other = "body", args
    if change == "static":
        static = "body, other static arguments"
    elif change == "shape":
        other = _args(rows=6)
    elif change == "dtype":
        other = _args(dtype=jnp.bfloat16)
    elif change == "tree":
        other = (args[0], {**args[1], "c": jnp.zeros(2)})
    elif change == "code":  # an edit of any qjax source file changes the fingerprint
        monkeypatch.setattr(program_cache, "code_fingerprint", lambda: "another qjax")
    else:
        monkeypatch.setattr(program_cache, "_trace_options", lambda: (("jax_enable_x64", "True"),))
    fresh = ProgramCache(str(tmp_path)).jit(fn, static)
    fresh(*other)
    assert fresh.loaded == 0 and fresh.stored == 1 and len(_files(tmp_path)) == 2 and len(traced) == 2


def test_code_fingerprint_follows_every_source_file(tmp_path, monkeypatch):
    """An edit, a new module or a renamed one in any of the three packages changes the fingerprint; bytecode caches
    and other files do not."""
    import types

    roots = {pkg: tmp_path / pkg for pkg in ("qjax", "qjax.kernels", "qjax.convert")}
    for root in roots.values():
        (root / "sub").mkdir(parents=True)
        (root / "a.py").write_text("x = 1\n")
        (root / "sub" / "b.py").write_text("y = 2\n")
    monkeypatch.setattr(program_cache.importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(submodule_search_locations=[str(roots[name])]))

    def fingerprint():
        program_cache.code_fingerprint.cache_clear()
        return program_cache.code_fingerprint()

    seen = [fingerprint()]
    assert fingerprint() == seen[0]
    (roots["qjax"] / "__pycache__").mkdir()
    (roots["qjax"] / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (roots["qjax.kernels"] / "notes.txt").write_text("not code")
    assert fingerprint() == seen[0]
    for change in (lambda: (roots["qjax.kernels"] / "sub" / "b.py").write_text("y = 3\n"),
                   lambda: (roots["qjax.convert"] / "c.py").write_text(""),
                   lambda: (roots["qjax"] / "a.py").rename(roots["qjax"] / "a2.py")):
        change()
        seen.append(fingerprint())
        assert len(set(seen)) == len(seen), "a source change left the fingerprint as it was"
    monkeypatch.undo()
    program_cache.code_fingerprint.cache_clear()


def test_a_damaged_file_is_named_and_replaced(tmp_path, caplog):
    fn, traced = _counting(_body)
    args = _args()
    first = ProgramCache(str(tmp_path)).jit(fn, "body")
    want = first(*args)
    path = first.path_for(*args)
    for damage in (b"", b"not a program", open(path, "rb").read()[:100]):
        with open(path, "wb") as f:
            f.write(damage)
        caplog.clear()
        again = ProgramCache(str(tmp_path)).jit(fn, "body")
        with caplog.at_level(logging.WARNING, "qjax.programs"):
            _same(again(*args), want)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and lines[0].startswith(f"{path}: stored program unusable"), lines
        assert again.loaded == 0 and again.stored == 1
    assert ProgramCache(str(tmp_path)).jit(fn, "body").path_for(*args) == path
    reread = ProgramCache(str(tmp_path)).jit(fn, "body")
    _same(reread(*args), want)
    assert reread.loaded == 1


def test_a_file_for_other_inputs_is_not_used(tmp_path, caplog):
    """A file whose program takes other inputs than the call (a stale or swapped file) is refused, not run."""
    fn, _ = _counting(_body)
    args, other = _args(), _args(rows=9)
    cache = ProgramCache(str(tmp_path))
    a, b = cache.jit(fn, "body"), cache.jit(fn, "body")
    a(*args)
    b(*other)
    os.replace(b.path_for(*other), a.path_for(*args))
    again = ProgramCache(str(tmp_path)).jit(fn, "body")
    with caplog.at_level(logging.WARNING, "qjax.programs"):
        _same(again(*args), jax.jit(_body)(*args))
    assert "inputs do not match" in caplog.text and again.loaded == 0


def test_unserializable_results_need_their_structure(tmp_path, caplog):
    """optax's states cannot be written by jax.export: with ``out_structure`` the program is kept, without it the
    function still runs (plain jit), with one log line saying why it is not kept."""
    opt = optax.sgd(0.1)

    def update(g, state):
        return opt.update(g, state)

    g = {"w": jnp.ones(4)}
    state = opt.init(g)
    want = jax.jit(update)(g, state)
    plain = ProgramCache(str(tmp_path)).jit(update, "sgd")
    with caplog.at_level(logging.INFO, "qjax.programs"):
        _same(plain(g, state), want)
    assert plain.stored == 0 and "not kept between runs" in caplog.text and _files(tmp_path) == []
    kept = ProgramCache(str(tmp_path)).jit(update, "sgd", out_structure=lambda args: jax.tree.structure(want))
    _same(kept(g, state), want)
    again = ProgramCache(str(tmp_path)).jit(update, "sgd", out_structure=lambda args: jax.tree.structure(want))
    _same(again(g, state), want)
    assert kept.stored == 1 and again.loaded == 1


def test_a_description_with_an_address_is_not_kept(tmp_path):
    fn, traced = _counting(_body)
    args = _args()
    c = ProgramCache(str(tmp_path)).jit(fn, ("body", object()))
    _same(c(*args), jax.jit(_body)(*args))
    assert c.path_for(*args) is None and _files(tmp_path) == [] and c.stored == 0


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch, caplog):
    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(program_cache.os, "replace", refuse)
    fn, _ = _counting(_body)
    args = _args()
    c = ProgramCache(str(tmp_path / "programs")).jit(fn, "body")
    with caplog.at_level(logging.WARNING, "qjax.programs"):
        _same(c(*args), jax.jit(_body)(*args))
    assert "could not store the traced program" in caplog.text and "No space left" in caplog.text
    assert c.stored == 0 and _files(tmp_path / "programs") == []


class _Step(NamedTuple):  # a result type jax.export cannot serialize: without out_structure, the plain-jit fallback
    x: jax.Array


@pytest.mark.parametrize("kept", ["nothing", "stored", "loaded", "not exportable"])
def test_donation_and_compiler_options_reach_every_program(tmp_path, kept, caplog):
    """``donate_argnums`` (every leaf of a donated argument) and ``compiler_options`` apply alike to a program traced
    and stored here, one read back, the plain jit of an unkept description, and the fallback when jax.export refuses
    the result: the donated input is consumed, the other not; an unknown XLA option is refused when it compiles."""
    def step(state, w):
        return {"a": state["a"] * 2 + w["b"].sum(), "b": state["b"] - 1}

    def wrapped(state, w):
        return _Step(step(state, w)) if kept == "not exportable" else step(state, w)

    def state():
        return {"a": jnp.arange(3.0), "b": jnp.ones((2, 2))}

    folder = None if kept == "nothing" else str(tmp_path)
    w = _args()[1]
    want = jax.jit(step)(state(), w)
    for options, ok in (({"xla_cpu_enable_fast_math": False}, True), ({"xla_no_such_option": True}, False)):
        if kept == "loaded":
            ProgramCache(folder).jit(wrapped, ("step", ok))(state(), w)
        fn = ProgramCache(folder).jit(wrapped, ("step", ok), donate_argnums=0, compiler_options=options)
        s = state()
        caplog.clear()
        with caplog.at_level(logging.INFO, "qjax.programs"):
            if not ok:
                with pytest.raises(Exception, match="xla_no_such_option"):
                    fn(s, w)
                # a kept program met the option first (then the function's own trace, which fails alike)
                assert ("kept program failed here" in caplog.text) == (kept in ("stored", "loaded")), caplog.text
                continue
            out = fn(s, w)
        _same(out.x if kept == "not exportable" else out, want)
        assert all(x.is_deleted() for x in jax.tree.leaves(s)) and not any(x.is_deleted() for x in jax.tree.leaves(w))
        assert (fn.stored, fn.loaded) == {"nothing": (0, 0), "stored": (1, 0), "loaded": (0, 1),
                                          "not exportable": (0, 0)}[kept]

