"""Per-block numerics diff of qjax against transformers (research tool behind ``qjax compare``).

    report = compare_folder(folder, ids)       # reference: transformers float32 on the decompressed weights
    print(report.format(tol=1e-4))

The same ids go through both; each decoder block's output (the residual stream after the block, before the final
norm), the embeddings, the final norm's output and the logits are compared. transformers' ``output_hidden_states``
replaces its last entry with the post-final-norm state, so its hidden states are read with forward hooks on
``model.model.embed_tokens``, ``model.model.layers[i]`` and ``model.model.norm`` instead; qjax's come from
``forward(output_hidden_states=True)`` (embeddings + every block, pre-norm) and ``ForwardOutput.hidden`` (post-norm).

Errors per row: max |Δ|, mean |Δ|, and max |Δ| / max |ref| (relative to the reference tensor's scale, which grows
through the residual stream).

Ground truth (:func:`compare_truth`, ``qjax compare --dtype float64``): transformers in float64 everywhere
(:func:`qjax.evaluation.torch_reference.float64_everywhere`) is the truth; qjax in float64 is checked against it
(≈1e-14 relative: the same math), then qjax and transformers each run in float32 and bfloat16 on the same weights and
ids, and every row reports how far each is from the truth, side by side — who is closer, block by block.

The first diverging block is the first decoder block whose relative error exceeds the tolerance (default 1e-4: qjax
matches transformers in float32 to ≈1e-6 relative per block on random models; a wrong weight or op moves a block by
1e-2 or more).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import qjax
from qjax.evaluation.torch_reference import ReferenceError, build_reference
from qjax.model.config import TextConfig

DEFAULT_TOL = 1e-4
# With the FP8 KV cache emulated on both sides, an fp32-order difference of ~1e-6 can put one K/V element on the other
# side of an E4M3 rounding boundary (one E4M3 step: 6-12 % of that element). Measured on the tests' INT4 + FP8 KV
# checkpoints: 1.4e-4 relative at the first full-attention block (1e-6 to 3e-6 before it); a wrong K/V scale or a
# missing dequantization moves blocks by 1e-2 or more. From the first full-attention block on, a block diverges only
# past this.
FP8_KV_TOL = 2e-3


class CompareError(ValueError):
    """The folder cannot be compared; the message says why."""


@dataclasses.dataclass(frozen=True)
class DiffRow:
    name: str  # "embed", "block 3", "final norm", "logits"
    kind: str  # layer type for blocks, "" otherwise
    max_abs: float
    mean_abs: float
    max_rel: float  # max |Δ| / max |ref|
    block: int | None = None


def diff(got: np.ndarray, want: np.ndarray, name: str, kind: str = "", block: int | None = None) -> DiffRow:
    """Error statistics of ``got`` against the reference ``want`` (same shape), in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise CompareError(f"{name}: qjax shape {got.shape} differs from transformers' {want.shape}")
    d = np.abs(got - want)
    scale = float(np.abs(want).max()) or 1.0
    return DiffRow(name=name, kind=kind, max_abs=float(d.max()), mean_abs=float(d.mean()),
                   max_rel=float(d.max()) / scale, block=block)


@dataclasses.dataclass(frozen=True)
class CompareReport:
    rows: list[DiffRow]  # embed, blocks 0..L-1, final norm, logits
    top1_agreement: float  # fraction of positions whose logits argmax agree
    tokens: int
    qjax_dtype: str
    reference_dtype: str = "float32"
    reference: str = "transformers"  # how the reference was built (versions, decompressed modules)
    fp8_kv_from: int | None = None  # first full-attention block when FP8 KV is emulated (FP8_KV_TOL applies from it)

    @property
    def fp8_kv(self) -> str:
        """How the FP8 KV cache is handled: "emulated on both sides" (static scales in the folder) or "none"."""
        return "none" if self.fp8_kv_from is None else "emulated on both sides"

    def block_tol(self, row: DiffRow, tol: float = DEFAULT_TOL) -> float:
        """The tolerance a block row is judged by (``tol``, or FP8_KV_TOL past an FP8-emulated attention)."""
        late = self.fp8_kv_from is not None and row.block is not None and row.block >= self.fp8_kv_from
        return max(tol, FP8_KV_TOL) if late else tol

    def first_diverging(self, tol: float = DEFAULT_TOL) -> int | None:
        """Index of the first decoder block whose max relative error exceeds ``tol`` (None: none does)."""
        return next((r.block for r in self.rows if r.block is not None and r.max_rel > self.block_tol(r, tol)), None)

    def to_dict(self, tol: float = DEFAULT_TOL) -> dict:
        return {"rows": [dataclasses.asdict(r) for r in self.rows], "top1_agreement": self.top1_agreement,
                "tokens": self.tokens, "qjax_dtype": self.qjax_dtype, "reference_dtype": self.reference_dtype,
                "fp8_kv": self.fp8_kv, "fp8_kv_from": self.fp8_kv_from, "reference": self.reference, "tol": tol,
                "first_diverging_block": self.first_diverging(tol)}

    def format(self, tol: float = DEFAULT_TOL) -> str:
        lines = [f"qjax ({self.qjax_dtype}) vs transformers ({self.reference_dtype}, eager attention) on "
                 f"{self.tokens} tokens; reference: {self.reference}; FP8 KV cache: {self.fp8_kv}",
                 f"{'':12s} {'layer type':18s} {'max abs err':>12s} {'mean abs err':>12s} {'max rel err':>12s}"]
        for r in self.rows:
            lines.append(f"{r.name:12s} {r.kind:18s} {r.max_abs:12.3e} {r.mean_abs:12.3e} {r.max_rel:12.3e}")
        lines.append(f"logits top-1 agreement: {100 * self.top1_agreement:.2f} % of {self.tokens} positions")
        first = self.first_diverging(tol)
        lines.append("first diverging block: " + (
            "none" if first is None else f"{first} ({self.rows[first + 1].kind})") +
            f" (tolerance {tol:g} of the block output's max |value|"
            + ("" if self.fp8_kv_from is None else
               f"; {FP8_KV_TOL:g} from block {self.fp8_kv_from} on: FP8 KV rounding flips") + ")")
        return "\n".join(lines)


def _transformers_states(hf, ids: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """(embeddings + each block's output ``[L + 1]`` of ``[B, T, H]``, final-norm output, logits) via hooks."""
    import torch  # optional (the test extras): imported where used, so qjax runs without it

    seen: dict[str, np.ndarray] = {}

    def keep(name):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            seen[name] = out.detach().double().numpy()  # float64: exact for every dtype compared
        return hook

    inner = hf.model
    handles = [inner.embed_tokens.register_forward_hook(keep("embed")),
               inner.norm.register_forward_hook(keep("norm"))]
    handles += [layer.register_forward_hook(keep(f"layer{i}")) for i, layer in enumerate(inner.layers)]
    try:
        with torch.no_grad():
            logits = hf(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long), use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    states = [seen["embed"]] + [seen[f"layer{i}"] for i in range(len(inner.layers))]
    return states, seen["norm"], logits.double().numpy()


def _qjax_states(model, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(``[L + 1, B, T, H]`` embeddings + block outputs, final-norm output, logits) from one jitted forward."""
    graphdef, state = nnx.split(model)
    hs, h, logits = _jit_states(graphdef, state, jnp.asarray(ids, jnp.int32))
    return np.asarray(hs, np.float64), np.asarray(h, np.float64), np.asarray(logits, np.float64)


@functools.partial(jax.jit, static_argnums=0)
def _jit_states(graphdef, state, ids):
    out = nnx.merge(graphdef, state).forward(ids, output_hidden_states=True)
    return out.hidden_states, out.hidden, out.logits


def compare_blocks(model, hf, ids, *, fp8_kv: bool = False) -> CompareReport:
    """Run ``ids [B, T]`` through the qjax ``model`` and the transformers ``hf`` model and diff every block.
    ``fp8_kv``: both sides quantize K/V to E4M3 (blocks from the first full-attention one on are judged with
    FP8_KV_TOL).

    Returns:
      a :class:`CompareReport` (rows: embed, block 0..L-1, final norm, logits).
    """
    ids = _check_ids(ids, model.config.vocab_size)
    want_states, want_norm, want_logits = _transformers_states(hf, ids)
    got_states, got_norm, got_logits = _qjax_states(model, ids)
    n_layers = model.config.num_hidden_layers
    if len(want_states) != n_layers + 1:
        raise CompareError(f"transformers ran {len(want_states) - 1} decoder blocks, qjax {n_layers}")
    rows = [diff(got_states[0], want_states[0], "embed")]
    for i in range(n_layers):
        rows.append(diff(got_states[i + 1], want_states[i + 1], f"block {i}", model.config.layer_types[i], block=i))
    rows.append(diff(got_norm, want_norm, "final norm"))
    rows.append(diff(got_logits, want_logits, "logits"))
    agree = float(np.mean(np.argmax(got_logits, -1) == np.argmax(want_logits, -1)))
    kinds = model.config.layer_types
    first_full = kinds.index("full_attention") if fp8_kv and "full_attention" in kinds else None
    return CompareReport(rows=rows, top1_agreement=agree, tokens=int(ids.size), qjax_dtype=str(model.dtype),
                         fp8_kv_from=first_full)


def _check_ids(ids, vocab: int) -> np.ndarray:
    ids = np.asarray(ids, np.int64)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.size == 0 or ids.min() < 0 or ids.max() >= vocab:
        raise CompareError(f"token ids must be non-empty and in [0, {vocab})")
    return ids


@dataclasses.dataclass(frozen=True)
class TruthRow:
    name: str  # "embed", "block 3", "final norm", "logits"
    kind: str
    block: int | None
    float64: float  # max |qjax float64 − truth| / max |truth|
    errors: dict  # dtype → {"qjax": (max rel, rms rel), "transformers": (max rel, rms rel)}, relative to max |truth|

    def closer(self, dtype: str) -> str:
        """Which implementation is closer to the truth in ``dtype`` by RMS error ("qjax", "transformers" or "same";
        the RMS, not the max, which is one element's error and swings with chance)."""
        q, t = self.errors[dtype]["qjax"][1], self.errors[dtype]["transformers"][1]
        return "same" if q == t else ("qjax" if q < t else "transformers")


@dataclasses.dataclass(frozen=True)
class TruthReport:
    rows: list[TruthRow]
    tokens: int
    dtypes: tuple[str, ...]  # the dtypes compared against the truth
    top1: dict  # dtype → {"qjax": agreement of logits argmax with the truth's, "transformers": …}
    reference: str = "transformers"
    fp8_kv: bool = False

    def to_dict(self, tol: float | None = None) -> dict:
        return {"truth": "transformers float64 everywhere", "tokens": self.tokens, "dtypes": list(self.dtypes),
                "reference": self.reference, "fp8_kv": self.fp8_kv, "top1_agreement": self.top1,
                "rows": [dataclasses.asdict(r) for r in self.rows]}

    def format(self, tol: float | None = None) -> str:
        """The side-by-side table (``tol`` is accepted for the CLI's sake; nothing is judged here)."""
        worst64 = max(r.float64 for r in self.rows)
        lines = [f"float64 truth: transformers in float64 everywhere; qjax float64 agrees to {worst64:.1e} of each "
                 f"row's max |value| (every step in float64 on both sides) on {self.tokens} tokens",
                 f"reference: {self.reference}" + ("; FP8 KV cache emulated on both sides" if self.fp8_kv else ""),
                 "errors against the truth, relative to the row's max |value|: max / RMS; closer = smaller RMS", ""]
        head = f"{'':12s} {'layer type':18s}"
        for d in self.dtypes:
            head += f" | {d + ': qjax':>21s} {'transformers':>19s} {'closer':>12s}"
        lines.append(head)
        for r in self.rows:
            line = f"{r.name:12s} {r.kind:18s}"
            for d in self.dtypes:
                (qm, qr), (tm, tr) = r.errors[d]["qjax"], r.errors[d]["transformers"]
                line += f" | {qm:9.2e} / {qr:8.2e} {tm:9.2e} / {tr:8.2e} {r.closer(d):>12s}"
            lines.append(line)
        for d in self.dtypes:
            lines.append(f"logits top-1 agreement with the truth, {d}: qjax {100 * self.top1[d]['qjax']:.2f} %, "
                         f"transformers {100 * self.top1[d]['transformers']:.2f} %")
        return "\n".join(lines)


def _truth_rel(got: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    scale = float(np.abs(truth).max()) or 1.0
    d = np.abs(np.asarray(got, np.float64) - truth)
    return float(d.max()) / scale, float(np.sqrt(np.mean(d * d))) / scale


def _rows_of(states) -> list[np.ndarray]:
    """(block states, final norm, logits) → one array per report row: embed, blocks, final norm, logits."""
    blocks, norm, logits = states
    return [*blocks, norm, logits]


def compare_truth(folder: str, ids, *, dtypes=("float32", "bfloat16"), quiet: bool = False) -> TruthReport:
    """``qjax compare --dtype float64``: qjax and transformers against the float64 truth (module docstring), on any
    folder :func:`compare_folder` takes (quantized ones through the decompressed-weights reference: in every dtype
    the weights are compressed-tensors' decompression output, exact in float64). Switches JAX's x64 mode on."""
    _quiet_transformers(quiet)
    cfg = TextConfig.from_file(folder)  # a wrong --model fails here, naming its config.json
    ids = _check_ids(ids, cfg.vocab_size)
    try:
        truth_ref = build_reference(folder, "float64")
        with truth_ref.running():
            truth = _rows_of(_transformers_states(truth_ref.model, ids))
    except ReferenceError as e:
        raise CompareError(f"--model {folder}: no reference: {e}") from None
    del truth_ref
    mine = _rows_of(_qjax_states(qjax.load_model(folder, dtype="float64", text_only=True), ids))
    errors: list[dict] = [{} for _ in truth]
    top1 = {}
    for d in dtypes:
        try:
            ref = build_reference(folder, d)
        except ReferenceError as e:
            raise CompareError(f"--model {folder}: no {d} reference: {e}") from None
        sides = {"qjax": _rows_of(_qjax_states(qjax.load_model(folder, dtype=d, text_only=True), ids)),
                 "transformers": _rows_of(_transformers_states(ref.model, ids))}
        for i, t in enumerate(truth):
            errors[i][d] = {side: _truth_rel(states[i], t) for side, states in sides.items()}
        top1[d] = {side: float(np.mean(np.argmax(states[-1], -1) == np.argmax(truth[-1], -1)))
                   for side, states in sides.items()}
    n = cfg.num_hidden_layers
    names = ["embed", *(f"block {i}" for i in range(n)), "final norm", "logits"]
    kinds = ["", *cfg.layer_types, "", ""]
    rows = [TruthRow(name=names[i], kind=kinds[i], block=i - 1 if 0 < i <= n else None,
                     float64=_truth_rel(mine[i], truth[i])[0], errors=errors[i]) for i in range(len(truth))]
    return TruthReport(rows=rows, tokens=int(ids.size), dtypes=tuple(dtypes), top1=top1,
                       reference=f"{ref.versions}; {ref.decompressed} quantized modules decompressed by "
                                 "compressed-tensors", fp8_kv=ref.fp8_kv)


def _quiet_transformers(quiet: bool) -> None:
    if quiet:
        try:
            import transformers

            transformers.utils.logging.set_verbosity_error()
            transformers.utils.logging.disable_progress_bar()
        except ImportError:
            pass  # build_reference says what is missing


def compare_folder(folder: str, ids, *, dtype=None, quiet: bool = False) -> CompareReport:
    """:func:`compare_blocks` for any checkpoint folder qjax loads: qjax loads it in ``dtype`` (default float32); the
    reference is transformers in float32 with the folder's weights as compressed-tensors decompresses them
    (:func:`qjax.evaluation.torch_reference.build_reference`), FP8 KV emulated on both sides when the folder has
    static scales. ``quiet``: no notices from transformers."""
    TextConfig.from_file(folder)  # a wrong --model fails here, naming its config.json
    _quiet_transformers(quiet)
    try:
        ref = build_reference(folder)
    except ReferenceError as e:
        raise CompareError(f"--model {folder}: no reference: {e}") from None
    model = qjax.load_model(folder, dtype=jnp.dtype(dtype) if dtype else jnp.float32, text_only=True)
    if model.kv_fp8 != ref.fp8_kv:
        raise CompareError(f"--model {folder}: qjax {'runs' if model.kv_fp8 else 'does not run'} an FP8 KV cache but "
                           "the reference would not match it")
    report = compare_blocks(model, ref.model, ids, fp8_kv=ref.fp8_kv)
    what = f"{ref.versions}; {ref.decompressed} quantized modules decompressed by compressed-tensors"
    return dataclasses.replace(report, reference_dtype=ref.dtype, reference=what)
