"""The memory plan of a streamed ``qjax quantize`` run, made and printed before any work: what one block needs on the
device, where the cached calibration streams go, and a refusal in one line when it cannot fit.

Every number is named as ``qjax quantize --help`` and the printed plan name it:

* **block weights** — the largest decoder block's weights in the model dtype (from the checkpoint's headers); the
  device holds the block and, while it is tuned, one more copy of its quantizable weights (the tuning step's
  fixed weights; after tuning, the fake-quantized layer that carries the quantized stream);
* **packed result** — that block's codes and scales as the run keeps them (int32 words, float32 scales);
* **stream** — one cached calibration stream, ``nsamples × seqlen × hidden`` in the model dtype. A run keeps three
  (the float input, the quantized input, the float output): on the device when they fit the budget, else on the
  host, the device then holding one tuning chunk of minibatches of the two the step reads
  (``2 × chunk × batch_size × seqlen × hidden``);
* **tuning step** — the step's working set besides the block's weights, an estimate per tunable weight
  (:data:`STEP_BYTES_PER_WEIGHT`: the rounding offsets, their best copy, gradient and update in float32, and the
  quantize-dequantize temporaries) plus the minibatch's activations (:data:`ACTIVATION_BYTES_PER_TOKEN`, per hidden
  and expert width). ``benchmarks/autoround_blocks_gpu.py`` measures the real peak at the real shapes;
* **peak** — block weights × 2 + tuning step + the streams the device holds, against the **budget**:
  ``--device_memory`` or the device's own limit (on CPU, where the device is the host, its available memory).

The host holds, besides: the host streams when they are there, one block's packed result, the loader's staging
buffer and one output shard while the export is written.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from qjax.checkpoint.loading import HOST_STAGING_BYTES
from qjax.convert.hf_writer import DEFAULT_SHARD_BYTES
from qjax.model.memory import available

from . import blocks
from .stream import DEVICE, HOST

GiB = 1 << 30
STREAMS = 3  # float input, quantized input, float output
# the tuning step's bytes per tunable weight besides the weight itself: v, its best-so-far copy, its gradient and its
# sign-SGD update (4 × float32), and the quantize-dequantize's float32 temporaries kept for the backward pass (~4)
STEP_BYTES_PER_WEIGHT = 32
# float32 activations the step keeps per token for the backward pass, per unit of width: hidden-size intermediates
# (norms, residuals, attention/GDN projections) and routed-expert intermediates (top-k × expert width, gate/up/act)
ACTIVATION_BYTES_PER_TOKEN = {"hidden": 4 * 32, "experts": 4 * 8, "shared": 4 * 8}


class PlanError(ValueError):
    """The run cannot fit its budget: one line with the numbers."""


def gib(n: float) -> str:
    """Bytes in words: GiB, or MiB below one GiB (a small model's plan still shows its numbers)."""
    return f"{n / GiB:,.2f} GiB" if n >= GiB else f"{n / 2**20:,.1f} MiB"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    block_weights: int  # the largest block's weights in the model dtype
    block_kind: str  # its layer type
    block_packed: int  # its packed result
    stream: int  # one cached calibration stream
    stream_shape: tuple[int, int, int, str]  # (nsamples, seqlen, hidden, dtype name)
    chunk: int  # one tuning chunk of the two streams the step reads, when the streams are on the host
    step: int  # the tuning step's working set besides the block's weights (estimate)
    budget: int | None  # bytes the device may use (None: unknown, not checked)
    budget_what: str  # where the budget comes from
    device: str  # the device, in words
    where: str  # DEVICE or HOST: where the three streams live
    shard: int = DEFAULT_SHARD_BYTES  # the largest output shard the export holds (the output's size when smaller)

    @property
    def device_streams(self) -> int:
        return STREAMS * self.stream if self.where == DEVICE else self.chunk

    @property
    def peak(self) -> int:
        """The device's peak: the block, one more copy of its weights, the tuning step and the streams it holds."""
        return 2 * self.block_weights + self.step + self.device_streams

    @property
    def host(self) -> int:
        """The host's own share besides the device's (on CPU the two add up): the host streams when they are there,
        one block's packed result, the loader's staging buffer and one output shard."""
        streams = STREAMS * self.stream if self.where == HOST else 0
        return streams + self.block_packed + HOST_STAGING_BYTES + self.shard

    def lines(self) -> list[str]:
        n, t, h, dt = self.stream_shape
        budget = "not known (not checked)" if self.budget is None else f"{gib(self.budget)} ({self.budget_what})"
        return [
            f"memory plan on {self.device}, budget {budget}:",
            f"  block weights: {gib(self.block_weights)} (the largest block, {self.block_kind}, {dt}; held with one "
            f"more copy while tuned)",
            f"  packed result: {gib(self.block_packed)} per block (to the progress folder, then freed)",
            f"  stream: {gib(self.stream)} each ({n} × {t} × {h} {dt}); {STREAMS} cached on the {self.where}"
            + ("" if self.where == DEVICE else f", {gib(self.chunk)} of minibatches on the device per tuning chunk"),
            f"  tuning step: {gib(self.step)} (estimate)",
            f"  peak: {gib(self.peak)} on the device = 2 × block weights + tuning step + "
            f"{'streams' if self.where == DEVICE else 'one chunk'}; host besides: {gib(self.host)}",
        ]


def block_numbers(ar, i: int, itemsize: int) -> tuple[int, int, int]:
    """(weights in the model dtype, tunable weights, packed result bytes) of block ``i`` of AutoRound run ``ar``."""
    mcfg = ar.mcfg
    units = blocks.layer_units(mcfg, mcfg.layer_types[i])
    per_unit = {u.name: u.shape[0] * u.shape[1] * (mcfg.num_experts if u.experts else 1) for u in units}
    weights = sum(per_unit.values())
    tunable = packed = 0
    for u, s in ar.block_units(i):
        n = per_unit[u.name]
        tunable += n
        bits = 8 if s.is_mxfp8 else s.bits
        group = u.shape[1] if not s.group_size or s.group_size < 0 else s.group_size
        packed += n * bits // 8 + 4 * (n // group) * (1 if s.sym or s.is_mxfp8 else 2)
    # the rest of the block (norms, router, GDN's small tensors) is a small share: counted as weights
    return weights * itemsize, tunable, packed


def plan_memory(ar, *, device_memory: int | None = None, device=None, output_bytes: int | None = None) -> MemoryPlan:
    """The plan of run ``ar`` (an :class:`~qjax.autoround.driver.AutoRound` before :meth:`run`), for ``device``
    (default: the first) and a budget of ``device_memory`` bytes (default: the device's own: its free memory, on CPU
    the host's available memory). Streams go on the device when the peak fits the budget, else on the host.
    ``output_bytes``: the export's size, when known (its shards are no larger).

    Raises:
      PlanError: one line with the numbers when even host streams do not fit.
    """
    device = device if device is not None else jax.local_devices()[0]
    mcfg, cfg = ar.mcfg, ar.cfg
    itemsize = np.dtype(ar.source.dtype).itemsize
    dt = np.dtype(ar.source.dtype).name
    best = None
    for kind in dict.fromkeys(mcfg.layer_types):  # one block of each kind: the others are the same shapes
        i = mcfg.layer_types.index(kind)
        w, tunable, packed = block_numbers(ar, i, itemsize)
        if best is None or w + tunable * STEP_BYTES_PER_WEIGHT > best[0] + best[1] * STEP_BYTES_PER_WEIGHT:
            best = (w, tunable, packed, kind)
    w, tunable, packed, kind = best
    n, t = ar.ids.shape
    h = mcfg.hidden_size
    tokens = min(cfg.batch_size, n) * t
    act = tokens * (ACTIVATION_BYTES_PER_TOKEN["hidden"] * h
                    + ACTIVATION_BYTES_PER_TOKEN["experts"] * mcfg.num_experts_per_tok * mcfg.moe_intermediate_size
                    + ACTIVATION_BYTES_PER_TOKEN["shared"] * mcfg.shared_expert_intermediate_size)
    step = (tunable * STEP_BYTES_PER_WEIGHT + act) if cfg.iters > 0 else tunable * 4  # RTN: the codes only
    if ar.algorithm is not None:  # AWQ / GPTQ: their own working set on the whole stream (qjax.autoround.algorithms)
        batches = -(-n // max(1, min(cfg.batch_size, n)))
        step = max(ar.algorithm.working_bytes(mcfg, k, n * t, itemsize, act, batches)
                   for k in dict.fromkeys(mcfg.layer_types))
    stream = n * t * h * itemsize
    chunk = 2 * min(cfg.chunk, max(cfg.iters, 1)) * min(cfg.batch_size, n) * t * h * itemsize
    if device_memory is not None:
        budget, what = int(device_memory), "--device_memory"
    else:
        budget, what = available(device)
    where_words = f"{device.device_kind} {device.id}" if device.platform != "cpu" else "cpu (the host)"
    shard = DEFAULT_SHARD_BYTES if output_bytes is None else min(DEFAULT_SHARD_BYTES, output_bytes)
    plan = MemoryPlan(w, kind, packed, stream, (n, t, h, dt), chunk, step, budget, what, where_words, DEVICE, shard)
    if device.platform == "cpu":
        # the device is the host: streams "on the host" would sit in the same memory, so they stay device arrays,
        # and the budget must hold the host's share as well
        if budget is None or plan.peak + plan.host <= budget:
            return plan
        raise PlanError(f"the memory plan does not fit the host: block weights {gib(w)} × 2 + tuning step "
                        f"{gib(step)} + {STREAMS} streams {gib(STREAMS * stream)} + the host's share {gib(plan.host)} "
                        f"= {gib(plan.peak + plan.host)} > {gib(budget)} ({what}); lower --nsamples, --seqlen or "
                        "--batch_size, or free memory")
    if budget is None or plan.peak <= budget:
        return plan
    plan = dataclasses.replace(plan, where=HOST)
    if plan.peak <= budget:
        return plan
    raise PlanError(f"the memory plan does not fit {where_words}: block weights {gib(w)} × 2 + tuning step "
                    f"{gib(step)} + one chunk of host streams {gib(chunk)} = {gib(plan.peak)} > {gib(budget)} "
                    f"({what}), and the {STREAMS} streams ({gib(STREAMS * stream)}) would not fit on the device "
                    "either; lower --batch_size or --seqlen, or use a device with more memory")
