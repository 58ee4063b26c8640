"""What an AutoRound run produces per block: each unit's packed result and the block's loss report (shared by the
driver, which makes them, and the progress folder, which stores them between sessions)."""

from __future__ import annotations

import dataclasses

import numpy as np

from .schemes import Scheme


@dataclasses.dataclass
class UnitResult:
    """The exported form of one unit, already in compressed-tensors' layout (kept packed: a 35B run holds every
    finished layer on the host)."""

    scheme: Scheme
    packed: np.ndarray  # int32 [*lead, out, ceil(in·b/32)] signed codes packed along in; mxfp8: float8 [*lead, out, in]
    scale: np.ndarray  # float32 [*lead, out, G] (values of scale_dtype, may be negative); mxfp8: uint8 E8M0
    in_features: int
    zp: np.ndarray | None = None  # asymmetric: int8 [*lead, out, G], signed (compressed-tensors' convention)
    scale_dtype: str = "float16"


@dataclasses.dataclass
class BlockReport:
    index: int
    kind: str
    units: int
    init_loss: float | None = None  # iteration 0 = RTN
    best_loss: float | None = None
    best_iter: int | None = None
    seconds: float = 0.0
    # tuning only: the steady time of one iteration (median over the chunks after the first, compiled ones) and
    # what the first chunk took beyond that many iterations (compiling the step, or loading it from the cache)
    iter_seconds: float | None = None
    compile_seconds: float | None = None
    method: str | None = None  # the block algorithm (awq, gptq) when not AutoRound's tuning or RTN

    def line(self, num_blocks: int) -> str:
        """The one line a run reports when this block is finished (1-based, as auto-round counts blocks)."""
        head = (f"block {self.index + 1}/{num_blocks} ({self.kind}): {self.units} units" if self.index < num_blocks
                else self.kind)  # the LM head, after the blocks
        if self.best_loss is None:
            return f"{head}, {(self.method or 'rtn').upper()}, {self.seconds:.1f} s"
        speed = "" if self.iter_seconds is None else f" ({self.iter_seconds * 1e3:.0f} ms/iter)"
        return (f"{head}, loss iter 0 {self.init_loss:.3e} -> best {self.best_loss:.3e} (iter {self.best_iter}), "
                f"{self.seconds:.1f} s{speed}")
