"""A checkpoint whose recipe quantized the MTP head, read as one whose head is dense.

qjax holds the MTP head (``mtp.*``) dense (:mod:`qjax.quant.unquantized`), as every seed checkpoint stores it. A
checkpoint whose ``Linear`` target was not kept off ``mtp.*`` stores its head quantized instead; it still loads:
each quantized ``mtp.*`` linear is decoded on the host to the values compressed-tensors' decompression gives (fp32
math, rounded once to the scale dtype) and handed to the loader as a float32 ``.weight``, which it casts to the
model dtype like any dense tensor. The head then computes what a dense copy of the decompressed weights computes;
speculation stays exact either way (the main model verifies every draft).

The stored tensors are checked as the loader checks a packed body module — names, shapes and dtypes from
:func:`qjax.checkpoint.layout.module_targets`, the ``weight_shape`` values, the config group from
:func:`qjax.checkpoint.quant_plan.module_meta` — and their values go through the loader's value check as they are
decoded, so a bad tensor is reported under its own name and file, never under the decoded ``.weight``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import numpy as np

from qjax.checkpoint.layout import LoadError, module_targets
from qjax.checkpoint.quant_plan import QuantLoadError, module_meta, stored_format
from qjax.checkpoint.safetensors_io import numpy_dtype
from qjax.checkpoint.view import CheckpointView, MemoryCheckpoint
from qjax.model.config import FULL, TextConfig
from qjax.model.linears import layer_linears
from qjax.quant.config import QuantizationConfig
from qjax.quant.packing import dequantize

logger = logging.getLogger("qjax")

_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def mtp_linears(cfg: TextConfig, keys) -> dict[str, tuple[int, int]]:
    """Every linear module of the MTP head a checkpoint with ``keys`` has, by name → (out, in): ``mtp.fc`` and,
    for each ``mtp.layers.{i}`` present, the full-attention layer's linears and every routed expert's projections."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    out = {"mtp.fc": (h, 2 * h)}
    for i in sorted({int(m.group(1)) for m in map(_MTP_LAYER.match, keys) if m}):
        stem = f"mtp.layers.{i}."
        out.update({stem + rel: shape for rel, shape in layer_linears(cfg, FULL).items()})
        for e in range(cfg.num_experts):
            out.update({f"{stem}mlp.experts.{e}.gate_proj": (inter, h), f"{stem}mlp.experts.{e}.up_proj": (inter, h),
                        f"{stem}mlp.experts.{e}.down_proj": (h, inter)})
    return out


Check = Callable[[CheckpointView, str, np.ndarray], None]  # the loader's value check (loading.verify_values)


class DenseMTPView(MemoryCheckpoint):
    """``view`` with each quantized MTP linear in ``modules`` (name → (out, in)) replaced by a float32
    ``{name}.weight`` decoded on demand; every other tensor read through."""

    def __init__(self, view: CheckpointView, qc: QuantizationConfig | None, modules: dict[str, tuple[int, int]], *,
                 check: Check, source: str):
        self._view = view
        self._keys = keys = set(view.keys())
        if qc is None:
            raise QuantLoadError(f"{source}: the checkpoint holds quantized tensors ({next(iter(modules))}) but "
                                 "config.json has no quantization_config")
        stored: dict[str, str] = {}  # stored key → its module
        decoded: dict[str, tuple] = {}
        problems: list[str] = []
        for name, out_in in modules.items():
            fmt = stored_format(name, keys, view.dtype)
            scale_key = f"{name}.weight_scale"
            if scale_key not in keys:
                raise QuantLoadError(f"{name} is stored quantized but {scale_key} is missing (checkpoint of "
                                     f"{source})")
            scheme = qc.scheme_for(name, is_linear=True)
            meta = module_meta(name, scheme, fmt, out_in, numpy_dtype(view.dtype(scale_key)).name, source)
            for key, t in module_targets(name, meta).items():
                stored[key] = name
                if key not in keys:
                    problems.append(f"  missing: {key}")
                elif tuple(view.shape(key)) != tuple(t.shape):
                    problems.append(f"  wrong shape: {key} [{view.file_of(key)}] is {list(view.shape(key))}, "
                                    f"expected {list(t.shape)}")
                elif view.dtype(key) not in t.dtypes:
                    problems.append(f"  wrong dtype: {key} [{view.file_of(key)}] is {view.dtype(key)}, expected "
                                    f"{' or '.join(t.dtypes)}")
                elif t.transform == "weight_shape":  # two integers: checked now, as the loader checks the body's
                    got = [int(v) for v in np.asarray(view.get(key)).reshape(-1)]
                    if got != list(out_in):
                        problems.append(f"  {key} [{view.file_of(key)}] says {got}, but the model needs "
                                        f"{list(out_in)}")
            decoded[f"{name}.weight"] = (tuple(out_in), "F32", self._decoder(name, scheme, out_in, check))
        if problems:
            raise LoadError("\n".join([f"checkpoint {view.folder}: the quantized MTP head does not match the model "
                                       "its config.json describes:", *problems]))
        self._source_of = {k: f"{n}.weight" if f"{n}.weight" in keys else f"{n}.weight_packed"
                           for k, n in ((d, d.rpartition(".")[0]) for d in decoded)}
        entries = {k: (tuple(view.shape(k)), view.dtype(k), (lambda k=k: view.get(k))) for k in view.keys()
                   if k not in stored}
        entries.update(decoded)
        super().__init__(view.folder, entries)
        logger.warning("%s: the MTP head is stored quantized (%d modules); qjax runs it dense, decoded to float",
                       view.folder, len(modules))

    def _decoder(self, name: str, scheme, out_in: tuple[int, int], check: Check) -> Callable[[], np.ndarray]:
        view, keys = self._view, self._keys

        def read(key: str) -> np.ndarray | None:
            if key not in keys:
                return None
            arr = view.get(key)
            check(view, key, arr)  # the stored tensor, under its own name and file
            return arr

        def get() -> np.ndarray:
            scale = read(f"{name}.weight_scale")
            if scheme.is_mxfp8:
                return dequantize(scheme, weight=read(f"{name}.weight"), scale=scale, shape=out_in)
            w = dequantize(scheme, packed=read(f"{name}.weight_packed"), scale=scale,
                           zero_point=read(f"{name}.weight_zero_point"), shape=out_in)
            # rounded once to the scale dtype: compressed-tensors' decompression, and what the body's kernels compute
            return w.astype(np.asarray(scale).dtype).astype(np.float32)

        return get

    def file_of(self, key: str) -> str:
        return self._view.file_of(self._source_of.get(key, key))


def dense_mtp_view(cfg: TextConfig, qc: QuantizationConfig | None, view: CheckpointView, *, check: Check,
                   source: str) -> CheckpointView:
    """``view`` itself when its MTP head is dense (every seed's), else a :class:`DenseMTPView` of it."""
    keys = set(view.keys())
    if not any(k.startswith("mtp.") for k in keys):
        return view
    quantized = {name: out_in for name, out_in in mtp_linears(cfg, keys).items()
                 if stored_format(name, keys, view.dtype) is not None}
    return DenseMTPView(view, qc, quantized, check=check, source=source) if quantized else view
