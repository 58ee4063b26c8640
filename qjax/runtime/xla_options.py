"""The decode programs' XLA options, in one place: ``qjax.generate``'s decode loop, the serving engine's decode and
verify programs and ``qjax bench``'s decode all compile with :func:`decode_compiler_options`.

What the modes do to a decode step on XLA:GPU (jax 0.11.2; docs/kernels.md §6 "One graph per decode step"):

- ``xla`` — XLA's defaults: CUDA graphs (command buffers) of straight-line kernels, Pallas kernels included; every
  while loop stays on the host (a loop without a known trip count, like the decode loop, copies its predicate to the
  host every iteration), and the layer loop launches several graphs per layer.
- ``off`` — no CUDA graphs at all: every kernel launched by the host (the baseline of the graph modes).
- ``graphs`` — while loops inside graphs too (``WHILE``, a CUDA conditional node evaluating the predicate on the
  device), loops of known trip count unrolled inside the graph (needed while the layer loop slices a layer out of a
  stack: XLA refuses a loop-dependent dynamic slice in a graph loop it does not unroll), and no minimum graph size
  (XLA counts a while loop as one command: with the default minimum of 5 a loop alone is never captured).
- ``unrolled`` — ``graphs``, plus XLA unrolls every loop of known trip count (the layer loop) in the HLO itself:
  the layers run as straight-line code over their slices of the stacks.

The default is :data:`DEFAULT_MODE`; ``QJAX_DECODE_GRAPHS=<mode>`` sets another for the process (read when a program
is built: ``qjax.runtime.generate`` at import, the serving engine when it starts), and
``qjax.runtime.generate.decode_loop_for(mode)`` gives one program per mode, so one process can time them side by
side (``benchmarks/gpu/decode_graphs.py``). The choice between ``graphs`` and ``unrolled`` (and whether either
beats ``xla``) is a device measurement; until one is in benchmarks/RESULTS.md the default stays ``xla``.

These are ``compiler_options`` (XLA ``DebugOptions`` fields). ``compiler_options`` takes whole values — a list of
command kinds, not ``XLA_FLAGS``' ``+WHILE`` syntax (``'+WHILE' is not a valid enum value``) — and an unknown name is
an error (``No such compile option``); the GPU fields below are accepted and ignored by XLA:CPU (jax 0.10.2 and
0.11.2), so a CPU process may pass them.
"""

from __future__ import annotations

import dataclasses
import os

ENV = "QJAX_DECODE_GRAPHS"
DEFAULT_MODE = "xla"
# XLA:GPU's default command kinds on jax 0.11.2 (its dumped module config): compiler_options replaces the list whole
DEFAULT_COMMANDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "CONDITIONAL", "DYNAMIC_SLICE_FUSION")


@dataclasses.dataclass(frozen=True)
class DecodeXlaOptions:
    """One mode's XLA options (None: XLA's default)."""

    mode: str
    commands: tuple[str, ...] | None = None  # xla_gpu_enable_command_buffer: thunk kinds captured in CUDA graphs
    min_graph_size: int | None = None  # xla_gpu_graph_min_graph_size: fewer consecutive commands stay ungraphed
    unroll_graph_loops: bool | None = None  # xla_gpu_command_buffer_unroll_loops: known-trip-count loops in a graph
    while_loop_unrolling: str | None = None  # xla_gpu_enable_while_loop_unrolling (HLO level)

    def compiler_options(self) -> dict[str, object]:
        """The ``compiler_options`` of ``jax.jit`` / ``Lowered.compile`` for this mode (empty for ``xla``)."""
        opts: dict[str, object] = {}
        if self.commands is not None:
            opts["xla_gpu_enable_command_buffer"] = ",".join(self.commands)
        if self.min_graph_size is not None:
            opts["xla_gpu_graph_min_graph_size"] = self.min_graph_size
        if self.unroll_graph_loops is not None:
            opts["xla_gpu_command_buffer_unroll_loops"] = self.unroll_graph_loops
        if self.while_loop_unrolling is not None:
            opts["xla_gpu_enable_while_loop_unrolling"] = self.while_loop_unrolling
        return opts


_GRAPHS = {"commands": DEFAULT_COMMANDS + ("WHILE",), "min_graph_size": 1, "unroll_graph_loops": True}
MODES: dict[str, DecodeXlaOptions] = {
    "xla": DecodeXlaOptions("xla"),
    "off": DecodeXlaOptions("off", commands=()),
    "graphs": DecodeXlaOptions("graphs", **_GRAPHS),
    "unrolled": DecodeXlaOptions("unrolled", **_GRAPHS, while_loop_unrolling="WHILE_LOOP_UNROLLING_FULL_UNROLL"),
}


def decode_mode(mode: str | None = None) -> str:
    """``mode``, else ``$QJAX_DECODE_GRAPHS``, else :data:`DEFAULT_MODE`; checked against :data:`MODES`."""
    mode = mode or os.environ.get(ENV) or DEFAULT_MODE
    if mode not in MODES:
        raise ValueError(f"decode XLA mode {mode!r} (from the argument or ${ENV}) is not one of {sorted(MODES)}")
    return mode


def decode_xla_options(mode: str | None = None) -> DecodeXlaOptions:
    """The options of :func:`decode_mode` ``(mode)``."""
    return MODES[decode_mode(mode)]


def decode_compiler_options(mode: str | None = None) -> dict[str, object] | None:
    """``compiler_options`` for a decode program (None where the mode sets nothing, so ``jax.jit`` is unchanged)."""
    return decode_xla_options(mode).compiler_options() or None
