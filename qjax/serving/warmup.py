"""What the serving engine's warm-up measures and guards, program by program
(:meth:`qjax.serving.engine.Engine.warmup`): where a program's first call spends its time (:func:`compile_times`),
and the memory mappings compiled programs hold (:class:`MapBudget`).

XLA:CPU keeps every compiled program's machine code in memory regions of its own — about 600 to 1,500 per serving
program on the built-in model (code, read-only and writable sections of each of its kernels; measured from
``/proc/self/maps``) — and the kernel refuses a process more than ``vm.max_map_count`` regions (65,530 by default).
Past it LLVM cannot map the next program and the process aborts (``LLVM ERROR: Unable to allocate section memory``);
the MTP server at the default flags on a CPU (57 programs) reached it. The warm-up stops before that with one line
that says what to change.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax

# JAX's compile-time events (public through jax.monitoring; named in jax._src.dispatch and compiler): where a
# program's first call spends its time
COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                  "/jax/core/compile/backend_compile_duration": "compile",
                  "/jax/compilation_cache/cache_retrieval_time_sec": "cache"}


@contextlib.contextmanager
def compile_times() -> Iterator[dict[str, float]]:
    """A dict filled, while the block runs, with the seconds this thread spent tracing (``trace``), lowering to MLIR
    (``lower``), in XLA's compile or the persistent cache's lookup (``compile``), and loading from that cache
    (``cache``, present only on a hit)."""
    parts: dict[str, float] = {}
    thread = threading.get_ident()

    def listener(event: str, duration: float, **_) -> None:
        name = COMPILE_EVENTS.get(event)
        if name is not None and threading.get_ident() == thread:
            parts[name] = parts.get(name, 0.0) + duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield parts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def mapped_regions() -> tuple[int, int] | None:
    """(memory regions this process maps now, the kernel's limit ``vm.max_map_count``); None where Linux's
    ``/proc`` does not tell."""
    try:
        with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f), limit
    except (OSError, ValueError):
        return None


class MapBudget:
    """Per program of the warm-up: ``with budget:`` around its compile records how many memory regions it added;
    :meth:`check` before the next one refuses to go on when twice the largest so far would pass the limit."""

    def __init__(self, regions=mapped_regions):
        self.regions, self.most, self._before = regions, 0, None

    def __enter__(self) -> "MapBudget":
        self._before = self.regions()
        return self

    def __exit__(self, *exc) -> None:
        after = self.regions()
        if self._before is not None and after is not None:
            self.most = max(self.most, after[0] - self._before[0])

    def check(self, where: str, error: type[Exception]) -> None:
        now = self.regions()
        if now is None or not self.most or now[0] + 2 * self.most <= now[1]:
            return
        raise error(f"{where}: this process maps {now[0]:,} memory regions of the {now[1]:,} the kernel allows "
                    f"(vm.max_map_count) and a compiled program here adds up to {self.most:,} (XLA:CPU keeps each "
                    "program's code in regions of its own); lower --max-num-seqs, --max-model-len or "
                    "--max-num-batched-tokens (fewer programs), or raise the limit: sysctl -w vm.max_map_count=262144")
