"""Traced programs kept between processes: JAX's persistent compilation cache skips XLA's compile in a later run,
but every process still traces and lowers each jitted function before it can look the compiled program up. For
AutoRound's tuning step on CPU that is ~1 s of tracing and ~0.3 s of lowering per block structure in every run
(RESULTS.md, AutoRound). :class:`ProgramCache` stores a function's lowered program (``jax.export``, StableHLO) the
first time it runs with a given input signature and, in later processes, calls the stored program instead of
tracing the Python function again (the compile itself still goes through the compilation cache).

A stored program is only valid for the code that traced it, so its file name is a hash of everything that decides
the trace: the caller's ``static`` description (the function's static arguments), the input tree and every input's
shape, dtype and sharding, the versions of jax, jaxlib, flax, optax and numpy, the jax options that change tracing
(x64, matmul precision, …) and the source of qjax itself (every ``.py`` of the ``qjax``, ``qjax.kernels`` and
``qjax.convert`` packages). A description whose ``repr`` shows an object address (``0x…``, not stable across
processes) is not cached. A file that cannot be read back, or whose inputs do not match the call, is reported in
one line and replaced; when a program cannot be stored (an output type ``jax.export`` cannot serialize without
``out_structure``, or ``flatbuffers`` missing) the function runs as a plain ``jax.jit``, with one log line; so does a
stored program that XLA refuses at its first call here (one warning). Donated arguments and XLA compiler options
(``jax.jit``'s ``donate_argnums`` and ``compiler_options``) apply to every program alike: traced here, read back, or
the plain ``jax.jit``.

Only for functions whose behaviour is fully determined by qjax's code and the ``static`` description (qjax's own
jitted programs): a user function closing over changing Python state would be served a stale program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import tempfile
from functools import cache
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

logger = logging.getLogger("qjax.programs")

FORMAT = 1  # bump when the file layout or the key's recipe changes

# jax options that change what a function traces to
_TRACE_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion",
                  "jax_numpy_rank_promotion", "jax_default_prng_impl", "jax_threefry_partitionable",
                  "jax_use_shardy_partitioner")


@cache
def code_fingerprint() -> str:
    """sha256 of the versions of the libraries a qjax program is traced with and of qjax's own source files."""
    h = hashlib.sha256()
    for name in ("jax", "jaxlib", "flax", "optax", "numpy"):
        h.update(f"{name}={importlib.metadata.version(name)}\n".encode())
    for pkg in ("qjax", "qjax.kernels", "qjax.convert"):  # found, not imported (kernels/ and convert/ map in)
        root = importlib.util.find_spec(pkg).submodule_search_locations[0]
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    h.update(f"{pkg}:{os.path.relpath(path, root)}\n".encode())
                    with open(path, "rb") as fh:
                        h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def _trace_options() -> tuple:
    return tuple((n, str(getattr(jax.config, n, None))) for n in _TRACE_OPTIONS)


# Custom calls jax.export refuses by default because their targets keep no compatibility across jax releases: Pallas's
# Triton kernels (the serving programs on GPU). A stored program is only read back by the jax and jaxlib that wrote
# it (their versions are in its key), so it needs none.
_SAME_RELEASE_CUSTOM_CALLS = ("__gpu$xla.gpu.triton",)


def _reason(e: Exception) -> str:
    """An exception as one short log fragment: its type and the first line of its message."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def _signature(args: tuple) -> tuple:
    """``(leaves, tree, signature)`` of a call's arguments: the signature is what its program depends on of them."""
    leaves, tree = jax.tree.flatten(args)
    return leaves, tree, (tree, tuple(_leaf_signature(x) for x in leaves))


def _leaf_key(x) -> tuple:
    """What a traced program depends on of one input, as a cheap in-memory key (the per-call lookup): its abstract
    value and its sharding (None for host data). The same inputs as :func:`_leaf_signature`, without the reprs."""
    return jax.typeof(x), getattr(x, "sharding", None)


def _leaf_signature(x) -> tuple:
    """What a traced program depends on of one input: shape, dtype, weak type and sharding."""
    aval = jax.typeof(x)
    return (tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)),
            repr(getattr(x, "sharding", None)))


def _pinned(fn: Callable, leaves, donate: tuple[int, ...] = (), compiler_options: dict | None = None) -> Callable:
    """``jax.jit(fn, donate_argnums=donate, compiler_options=compiler_options)`` with every input's sharding fixed: a
    committed input's own, every other input's where jit would put it (beside the committed ones: replicated over
    their mesh, or on their one device).

    Without it jit compiles a signature's program once more for every pattern of committed and uncommitted inputs
    (an array a computation or ``device_put`` placed, against one made from host data): the same shapes and devices,
    a second compile — AutoRound's first block compiled its layer forward twice (2 s on CPU)."""
    options = {"donate_argnums": donate, "compiler_options": compiler_options}
    committed = [isinstance(x, jax.Array) and x.committed for x in leaves]
    placed = [x.sharding for x, c in zip(leaves, committed) if c]
    devices = {d for s in placed for d in s.device_set}
    meshes = {s.mesh for s in placed if isinstance(s, NamedSharding)}
    if len(devices) <= 1:  # one device, or none placed (jit's default device)
        rest = jax.sharding.SingleDeviceSharding(devices.pop() if devices else jax.devices()[0])
    elif len(meshes) == 1 and devices == set(next(iter(meshes)).devices.flat):
        rest = NamedSharding(meshes.pop(), P())
    else:  # committed inputs on unrelated device sets: jit's own rules decide (and report)
        return jax.jit(fn, **options)
    return jax.jit(fn, in_shardings=tuple(x.sharding if c else rest for x, c in zip(leaves, committed)), **options)


@dataclasses.dataclass(frozen=True, eq=False)
class ProgramCache:
    """Traced programs stored under ``folder`` (created on first store); ``folder`` None keeps nothing between
    runs (each program is still traced once per input signature and compiled once, :func:`_pinned`).

    ``cache.jit(fn, static)`` is ``jax.jit(fn)`` that traces ``fn`` at most once per input signature across
    processes sharing ``folder``. ``static``: anything with a stable ``repr`` that, with qjax's code, determines what
    ``fn`` computes (its static arguments). ``out_structure(args) → PyTreeDef`` of ``fn(*args)``'s result, needed when
    the result holds types ``jax.export`` cannot serialize (optax states, flax ``State``s); without it the result may
    only hold dicts, lists, tuples, None and arrays. ``donate_argnums``, ``compiler_options``: as ``jax.jit``'s (every
    leaf of a donated positional argument is donated), for the program whether traced, read back or plain.

    Equal only to itself (a handle, not a value): the jitted functions memoised per handle read the folder again
    through a new handle."""

    folder: str | None

    def jit(self, fn: Callable, static: Any, *, out_structure: Callable[[tuple], Any] | None = None,
            donate_argnums: int | tuple[int, ...] = (), compiler_options: dict[str, Any] | None = None) -> Callable:
        donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        return _Cached(self, fn, repr(static), out_structure, donate, compiler_options)

    def path(self, key: str) -> str:
        return os.path.join(self.folder, f"{key}.jaxexport")


class _Cached:
    def __init__(self, cache: ProgramCache, fn: Callable, static: str, out_structure, donate: tuple[int, ...],
                 compiler_options: dict[str, Any] | None):
        self.cache, self.fn, self.static, self.out_structure = cache, fn, static, out_structure
        self.donate, self.compiler_options = donate, compiler_options
        # jax's compile logs and events name the traced function (a functools.partial: the function it binds)
        self.name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "fn")
        self.calls: dict[tuple, Callable] = {}  # input key (_leaf_key) → the callable on the input leaves
        self.loaded = self.stored = 0  # programs read back / written by this object (tests, logs)

    def __call__(self, *args):
        leaves, tree = jax.tree.flatten(args)
        # the per-call lookup: abstract values and sharding objects, hashed (a tenth of the reprs' cost: ~0.05 ms
        # for the serving programs' ~110 inputs on the built-in model); the reprs only make a new program's file key
        key = (tree, tuple(map(_leaf_key, leaves)))
        call = self.calls.get(key)
        if call is not None:
            out = call(*leaves)
        else:
            out = self._first_call(key, args, tree, leaves)
        if self.out_structure is not None:
            return jax.tree.unflatten(self.out_structure(args), out)
        return out

    def _first_call(self, key, args, tree, leaves):
        """A new input signature: its program (read back, traced and stored, or plain) called once, then kept."""
        donate = self._donated(args)
        call, kept = self._program((tree, tuple(_leaf_signature(x) for x in leaves)), tree, leaves, donate)
        try:
            out = call(*leaves)
        except Exception as e:
            if not kept or any(isinstance(leaves[i], jax.Array) and leaves[i].is_deleted() for i in donate):
                raise
            # an exported program XLA will not compile here (its inputs are intact): the function's own trace is
            # what jax.jit would have run
            logger.warning("%s: its kept program failed here (%s); tracing the function instead", self.name,
                           _reason(e))
            call = _pinned(self._flat(tree), leaves, donate, self.compiler_options)
            out = call(*leaves)
        self.calls[key] = call
        return out

    def _donated(self, args: tuple) -> tuple[int, ...]:
        """The flat leaf positions of the donated positional arguments."""
        out, at = [], 0
        donate = {i % len(args) for i in self.donate} if args else set()
        for i, a in enumerate(args):
            n = len(jax.tree.leaves(a))
            if i in donate:
                out.extend(range(at, at + n))
            at += n
        return tuple(out)

    def path_for(self, *args) -> str | None:
        """The file that holds (or will hold) the program of a call with ``args``; None when it is not kept."""
        return self._path(_signature(args)[2])

    def _path(self, sig) -> str | None:
        if self.cache.folder is None:
            return None
        desc = repr((FORMAT, self.static, sig, _trace_options(), code_fingerprint()))
        if "0x" in desc:  # an object address: the description would differ in every process
            logger.debug("program not kept between runs (its description shows an object address): %.200s",
                         self.static)
            return None
        return self.cache.path(hashlib.sha256(desc.encode()).hexdigest())

    def lower(self, *args):
        """The program of a call with ``args``, lowered (``jax.stages.Lowered``, for inspection; nothing is stored)."""
        leaves, tree, _ = _signature(args)
        return _pinned(self._flat(tree), leaves, self._donated(args), self.compiler_options).lower(*leaves)

    def _flat(self, tree) -> Callable:
        """``fn`` on the flat input leaves of ``tree`` (and, with ``out_structure``, returning flat leaves)."""
        def flat(*xs):
            args = jax.tree.unflatten(tree, xs)
            out = self.fn(*args)
            if self.out_structure is None:
                return out
            # a wrong out_structure would otherwise hand back a result rebuilt in another shape
            if jax.tree.structure(out) != self.out_structure(args):
                raise ValueError(f"{self.name}: its result's tree differs from out_structure(args)")
            return jax.tree.leaves(out)
        flat.__name__ = flat.__qualname__ = self.name
        return flat

    def _program(self, sig, tree, leaves, donate: tuple[int, ...]) -> tuple[Callable, bool]:
        """The callable on the input leaves, and whether it runs an exported program (read back or just stored)."""
        flat = self._flat(tree)
        options = self.compiler_options
        path = self._path(sig)
        if path is None:
            return _pinned(flat, leaves, donate, options), False
        if os.path.exists(path):
            exported = self._read(path, leaves)
            if exported is not None:
                self.loaded += 1
                logger.debug("traced program loaded from %s", path)
                return _pinned(exported.call, leaves, donate, options), True
        try:
            checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in _SAME_RELEASE_CUSTOM_CALLS]
            exported = jax.export.export(jax.jit(flat), disabled_checks=checks)(*leaves)
            data = exported.serialize()
        except Exception as e:  # noqa: BLE001 - any reason not to store falls back to the plain jit
            logger.info("program not kept between runs (%s); tracing it in every run", _reason(e))
            return _pinned(flat, leaves, donate, options), False
        if self._write(path, data):
            self.stored += 1
            logger.debug("traced program stored in %s", path)
        return _pinned(exported.call, leaves, donate, options), True

    @staticmethod
    def _read(path: str, leaves):
        try:
            with open(path, "rb") as f:
                exported = jax.export.deserialize(bytearray(f.read()))
            want = [jax.typeof(x) for x in leaves]
            got = list(exported.in_avals)
            if len(got) != len(want) or any(
                    tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype for g, w in zip(got, want)):
                raise ValueError("its inputs do not match the call's")
            return exported
        except Exception as e:  # noqa: BLE001 - a bad file is replaced, not fatal
            logger.warning("%s: stored program unusable (%s); tracing again and replacing it", path, _reason(e))
            return None

    def _write(self, path: str, data: bytes) -> bool:
        """Atomically (a temporary file renamed over the name): a reader sees a whole program or none."""
        try:
            os.makedirs(self.cache.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.cache.folder, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):  # the write's own error is the one to report
                    os.unlink(tmp)
                raise
        except OSError as e:
            logger.warning("%s: could not store the traced program (%s); it is traced again next run", path, e)
            return False
        return True


# ---------------------------------------------------------------------------------------------------------------------
# the persistent compilation cache of a command (one per process: JAX's own state)
# ---------------------------------------------------------------------------------------------------------------------
def use_compile_cache(path: str | None) -> str | None:
    """Point JAX's persistent compilation cache at ``path`` (created if missing; None leaves it off) for this
    process. Every program is stored (``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` raises the threshold; JAX's own
    default, 1 s, kept the ~1,200 small programs of a run out: per-unit min/max, scale search, packing, the quantized
    layer's forward, which then recompiled in every process — on the built-in model, 10 iterations, a warm run took
    27.7 s with it and 14.0 s storing all, first block 17.5 → 5.7 s, cache 1.1 → 3.7 MB); a later run of the same
    program, jax version and machine loads them instead of compiling."""
    if path is None:
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")))
    return path


def program_cache(compile_cache: str | None) -> "ProgramCache | None":
    """The traced programs' store that goes with a compilation cache folder: its ``qjax-programs`` subfolder (JAX's
    own cache files are ``*-cache`` at the top), None when the cache is off."""
    return None if compile_cache is None else ProgramCache(os.path.join(compile_cache, "qjax-programs"))
