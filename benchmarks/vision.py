"""Vision tower and image prompts: qjax vs transformers on CPU (same random weights, same run), and a GPU mode.

CPU (default), qjax vs transformers timed interleaved in the same run (cpu_speed.py's ``bench`` scheme: one untimed
warm-up call each, then rounds a, b, a, b, …; median). A full-size tower call takes seconds (448²) to a minute or
more (1024²) on 2 cores, so the bf16, other-size and TTFT rows can be given fewer runs (``--bf16-repeats``,
``--big-repeats``, ``--ttft-repeats``; default ``--repeats``). Order: preprocessing, first size fp32, first size
bf16, TTFT, then the other sizes; each finished row rewrites the section (marked partial until the run ends), so a
run cut short still leaves what it measured.

a. Per image at ``--sizes`` (448×448, 1024×1024; the source JPEG-decoded photo-like image is a little larger and is
   resized to that size by both processors, as a real photo would be):
   - preprocessing, a decoded PIL image → ``pixel_values``: qjax ``multimodal.images.preprocess`` (numpy + Pillow)
     vs transformers ``Qwen2VLImageProcessorPil`` with the official Qwen3.5/3.6 settings (their outputs must be
     equal);
   - the FULL-size tower forward (``VisionConfig()``: depth 27, hidden 1152, 16 heads, out_hidden 2048; a seeded
     random transformers ``Qwen3_5MoeVisionModel`` whose weights are copied into qjax's tower), float32 and
     bfloat16 (``--bf16-sizes``): qjax ``tower(pixel_values, grid_thw)`` forced to numpy (host layout, padding to
     the patch bucket and the jitted program included) vs transformers ``tower(pixel_values, grid_thw)
     .pooler_output`` under ``torch.no_grad``. qjax's compile time = first call − steady median.
   - correctness, a hard check: qjax vs transformers merged features on the first size in float32, max |Δ| ≤ 1e-3 ·
     max |feature|, else the run stops.
b. Time to first token of an image prompt: ~30 text tokens around one ``<|image_pad|>`` and one JPEG-encoded image
   at the first size, through the whole pipeline (decode, preprocess, tower, placeholder expansion and M-RoPE
   positions, prefill of the expanded prompt, first greedy token), on cpu_speed.py's ``mid`` text config with the
   full-size tower attached (out_hidden_size = 512, the text hidden size): a seeded random
   ``Qwen3_5MoeForConditionalGeneration`` saved with ``save_pretrained``, loaded by both (``qjax.load_model``,
   ``from_pretrained``), so the weights are identical. qjax ``qjax.generate(ids, images=[jpeg], max_new_tokens=1)``
   vs transformers (PIL decode, ``Qwen2VLImageProcessorPil``, placeholder expansion, ``generate(...,
   max_new_tokens=1)``). The first tokens must agree in float32 (else exit status 1). ``--ttft-dtypes fp32,bf16``
   adds a bf16 row (transformers' bf16 on a CPU without AVX-512 BF16 / AMX is slow).

    python -P benchmarks/vision.py [--repeats N] [--sizes 448,1024] [--bf16-sizes 448] [--no-write] [--quick]

Writes (replaces) the section ``## Vision tower and image prompts (issue 23)`` of ``benchmarks/RESULTS.md``
(not with ``--quick``: a tiny tower and text model, one repeat, a smoke test).

GPU (``--gpu``, for benchmarks/gpu/run.sh ``vision``): the full-size tower in bfloat16 with random weights
(``init_vision``), no torch, transformers or Pillow: pixel values drawn with numpy for one 448² image, one 1024²
image and a batch of four 448² images; first call (compile) and the median of ``--repeats`` steady calls; a table
written to ``<--out>/vision.md``.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
import types
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# tests/oracles: the transformers tower → qjax tower weight copy (one builder for the tests and this benchmark)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from cpu_speed import RESULTS, Timing, bench, config_dict, cpu_steal, git_state, write_section  # noqa: E402

SECTION = "## Vision tower and image prompts (issue 23)"
FEATURE_REL_TOL = 1e-3  # qjax vs transformers float32 features, relative to max |feature|
# special tokens of the benchmark's composite config: inside the mid config's 8192-token vocabulary
IMAGE, VIDEO, VSTART, VEND = 8100, 8101, 8102, 8103
OFFICIAL_PREPROCESSOR = dict(size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16,
                             temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                             image_std=[0.5, 0.5, 0.5])


# ---------------------------------------------------------------------------------------------------------------------
# shared
# ---------------------------------------------------------------------------------------------------------------------
def tower_kwargs(quick: bool, out_hidden: int) -> dict:
    """transformers ``Qwen3_5MoeVisionConfig`` kwargs: its defaults (the 35B tower) or a tiny one (``--quick``)."""
    if quick:
        return dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=96, out_hidden_size=out_hidden)
    return dict(out_hidden_size=out_hidden)


def vision_flops(vc, grids) -> float:
    """Useful forward FLOPs of the tower for images of ``grids`` (real patches; attention within each image)."""
    d, i, w = vc.hidden_size, vc.intermediate_size, vc.hidden_size * vc.merge_unit
    total = 0.0
    for t, h, ww in np.asarray(grids).reshape(-1, 3).tolist():
        n = t * h * ww
        per_layer = 2 * n * (3 * d * d + d * d + 2 * d * i) + 4 * (h * ww) * n * d
        total += 2 * n * vc.patch_dim * d + vc.depth * per_layer + 2 * (n // vc.merge_unit) * (w * w + w *
                                                                                              vc.out_hidden_size)
    return total


def smooth_image(height: int, width: int, seed: int = 0):
    """A seeded photo-like RGB image: coarse random colours upsampled (bicubic) plus a little noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 24), max(2, width // 24), 3), dtype=np.uint8)
    big = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), np.int16)
    noisy = np.clip(big + rng.integers(-12, 13, big.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(noisy, "RGB")


def jpeg_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def source_side(target: int, patch_factor: int = 32) -> int:
    """A source side a little off ``target`` that smart_resize rounds back to ``target`` (a real resize happens)."""
    side = target + patch_factor // 4 + 1
    assert round(side / patch_factor) * patch_factor == target
    return side


@dataclass
class Row:
    part: str  # preprocess | tower | TTFT
    image: str
    dtype: str
    qjax: Timing
    hf: Timing | None
    extra: dict = field(default_factory=dict)
    load: float | None = None

    @property
    def ratio(self) -> float | None:
        return None if self.hf is None else self.qjax.median / self.hf.median


# ---------------------------------------------------------------------------------------------------------------------
# CPU: qjax vs transformers
# ---------------------------------------------------------------------------------------------------------------------
class Towers:
    """The seeded transformers tower (float32, and a bfloat16 copy on demand), qjax's copies, and each size's
    preprocessed input."""

    def __init__(self, args, rows: list[Row], log):
        import torch
        from PIL import Image
        from transformers import Qwen3_5MoeVisionConfig, Qwen3_5MoeVisionModel
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from qjax.multimodal.images import ImageProcessorConfig, preprocess

        self.args, self.rows, self.log = args, rows, log
        hc = Qwen3_5MoeVisionConfig(**tower_kwargs(args.quick, 2048))
        args.tower_cfg = hc
        args.tower_desc = ", ".join(f"{k}={v}" for k, v in tower_kwargs(args.quick, 2048).items())
        # ---- preprocessing (all sizes first: cheap) ---------------------------------------------------------------
        qcfg, hproc = ImageProcessorConfig(), Qwen2VLImageProcessorPil(**OFFICIAL_PREPROCESSOR)
        self.inputs = {}
        for size in args.sizes:
            src = source_side(size)
            img = Image.open(io.BytesIO(jpeg_bytes(smooth_image(src, src, seed=size))))
            img.load()
            got = preprocess([img], qcfg)
            want = hproc([img], return_tensors="pt")
            if not (np.array_equal(got.pixel_values, want["pixel_values"].numpy())
                    and np.array_equal(got.image_grid_thw, want["image_grid_thw"].numpy())):
                raise SystemExit(f"{size}: qjax preprocess differs from transformers' Qwen2VLImageProcessorPil")
            self.inputs[size] = (got.pixel_values, got.image_grid_thw, want["pixel_values"], want["image_grid_thw"])
            tm = bench({"qjax": lambda: preprocess([img], qcfg), "hf": lambda: hproc([img], return_tensors="pt")},
                       args.pre_repeats)
            self.add(Row("preprocess", f"{size}² (from {src}²)", "fp32", tm["qjax"], tm["hf"],
                         {"pixel_values": "identical"}))
        # ---- the float32 towers -----------------------------------------------------------------------------------
        torch.manual_seed(0)
        self.hf = {"fp32": Qwen3_5MoeVisionModel(hc).float().eval()}
        n_params = sum(p.numel() for p in self.hf["fp32"].parameters())
        args.tower_params = n_params
        args.hf_attn = self.hf["fp32"].config._attn_implementation
        log(f"\n=== tower: {n_params / 1e6:.1f}M parameters, depth {hc.depth}, hidden {hc.hidden_size}, "
            f"out {hc.out_hidden_size}; transformers attn {args.hf_attn} ===")
        self.ours = {}

    def add(self, row: Row) -> None:
        row.load = os.getloadavg()[0]
        self.rows.append(row)
        self.log(fmt_row(row))
        if self.args.on_row:
            self.args.on_row()

    def get(self, dtype_name: str):
        import jax.numpy as jnp
        import torch
        from oracles.hf import qjax_tower_from_torch

        if dtype_name not in self.hf:  # bf16: cast from the float32 weights (both sides round the same values)
            import copy
            self.hf[dtype_name] = copy.deepcopy(self.hf["fp32"]).to(torch.bfloat16).eval()
        if dtype_name not in self.ours:
            t0 = time.perf_counter()
            self.ours[dtype_name] = qjax_tower_from_torch(self.hf[dtype_name],
                                                          {"fp32": jnp.float32, "bf16": jnp.bfloat16}[dtype_name])
            self.log(f"--- {dtype_name}: qjax tower built in {time.perf_counter() - t0:.1f}s")
        return self.hf[dtype_name], self.ours[dtype_name]

    def drop(self, dtype_name: str) -> None:
        import jax
        if dtype_name != "fp32":
            self.hf.pop(dtype_name, None)
        self.ours.pop(dtype_name, None)
        jax.clear_caches()

    def measure(self, size: int, dtype_name: str, repeats: int) -> None:
        """One tower row: qjax vs transformers at ``size`` in ``dtype_name``, ``repeats`` timed runs each after a
        warm-up (cpu_speed.py's ``bench``)."""
        import jax
        import torch

        from qjax.model.vision import patch_bucket

        args = self.args
        hf, ours = self.get(dtype_name)
        px, grid, px_t, grid_t = self.inputs[size]
        n = int(np.prod(grid, axis=1).sum())
        out = {}

        def q():
            out["qjax"] = np.asarray(jax.block_until_ready(ours(px, grid)))

        def h():
            with torch.no_grad():
                out["hf"] = hf(px_t, grid_thw=grid_t).pooler_output

        tm = bench({"qjax": q, "hf": h}, repeats)
        want = out["hf"].float().numpy()
        got = out["qjax"].astype(np.float32)
        assert got.shape == want.shape, (got.shape, want.shape)
        delta, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
        if dtype_name == "fp32" and size == args.sizes[0]:
            self.log(f"CORRECTNESS {size}² float32: max |qjax − transformers| = {delta:.3e}, max |feature| = "
                     f"{scale:.3f}, relative {delta / scale:.2e} (bound {FEATURE_REL_TOL:g})")
            if not delta <= FEATURE_REL_TOL * scale:
                raise SystemExit(f"FAIL: qjax tower features differ from transformers' by {delta:.3e} > "
                                 f"{FEATURE_REL_TOL:g} × {scale:.3f}")
            args.correctness = (size, delta, scale)
        self.add(Row("tower", f"{size}²", dtype_name, tm["qjax"], tm["hf"],
                     {"patches→bucket": f"{n}→{patch_bucket(n)}", "max|Δ|": f"{delta:.1e} (max|f| {scale:.2f})"}))


def run_ttft(args, add, log) -> None:
    import tempfile

    import jax
    import jax.numpy as jnp
    import torch
    from PIL import Image
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    import qjax

    text = config_dict("tiny" if args.quick else "mid")
    special = (500, 501, 502, 503) if args.quick else (IMAGE, VIDEO, VSTART, VEND)  # the tiny vocabulary is 512
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=tower_kwargs(args.quick, text["hidden_size"]),
                           image_token_id=special[0], video_token_id=special[1], vision_start_token_id=special[2],
                           vision_end_token_id=special[3])
    image_id, vs, ve = cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id
    size = args.sizes[0]
    src = source_side(size)
    data = jpeg_bytes(smooth_image(src, src, seed=7))
    rng = np.random.default_rng(0)
    words = lambda n: [int(t) for t in rng.integers(0, 400 if args.quick else 8000, n)]
    before, after = words(8), words(19)  # + vision start/end: 29 text tokens around the image
    prompt = np.array([before + [vs, image_id, ve] + after], np.int32)
    hproc = Qwen2VLImageProcessorPil(**OFFICIAL_PREPROCESSOR)

    torch.manual_seed(0)
    hf = Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    n_params = sum(p.numel() for p in hf.parameters())
    log(f"\n=== TTFT: {'tiny' if args.quick else 'mid'} text + tower, {n_params / 1e6:.1f}M parameters; prompt "
        f"{prompt.shape[1] - 1} text tokens + one {size}² image (JPEG {len(data) // 1024} KiB, {src}² source) ===")
    with tempfile.TemporaryDirectory(prefix="qjax-bench-vision-") as folder:
        hf.save_pretrained(folder)
        del hf
        for dtype_name in args.ttft_dtypes:
            tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
            jdtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[dtype_name]
            hf = Qwen3_5MoeForConditionalGeneration.from_pretrained(folder, dtype=tdtype).eval()
            t0 = time.perf_counter()
            model = qjax.load_model(folder, dtype=jdtype)
            impls = (f"attn {hf.config.text_config._attn_implementation}, experts "
                     f"{getattr(hf.config.text_config, '_experts_implementation', '?')}")
            log(f"--- TTFT {dtype_name}: transformers {impls}; qjax load {time.perf_counter() - t0:.1f}s")
            out = {}

            def q():
                toks = qjax.generate(model, prompt, images=[data], max_new_tokens=1, do_sample=False,
                                     eos_token_id=[])
                out["qjax"] = (int(toks[0, -1]), toks.shape[1] - 1)

            def h():
                im = Image.open(io.BytesIO(data))
                pr = hproc([im], return_tensors="pt")
                n = int(pr["image_grid_thw"].prod()) // 4
                ids = before + [vs] + [image_id] * n + [ve] + after
                ids_t = torch.tensor([ids])
                with torch.no_grad():
                    gen = hf.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                                      pixel_values=pr["pixel_values"], image_grid_thw=pr["image_grid_thw"],
                                      mm_token_type_ids=(ids_t == image_id).int(), max_new_tokens=1,
                                      do_sample=False, pad_token_id=0)
                out["hf"] = (int(gen[0, -1]), len(ids))

            r = args.ttft_repeats
            tm = bench({"qjax": q, "hf": h}, r)
            (tq, lq), (th, lh) = out["qjax"], out["hf"]
            assert lq == lh, f"expanded prompt lengths differ: qjax {lq}, transformers {lh}"
            same = tq == th
            extra = {"prompt": f"{lq} tokens", "first token": "MATCH" if same else f"differ ({tq} vs {th})"}
            if dtype_name == "fp32":
                args.ttft_match = same
            add(Row("TTFT", f"{size}² + {prompt.shape[1] - 1} tok", dtype_name, tm["qjax"], tm["hf"], extra))
            del hf, model
            jax.clear_caches()


# ---------------------------------------------------------------------------------------------------------------------
# GPU: the full-size tower alone, qjax only
# ---------------------------------------------------------------------------------------------------------------------
def run_gpu(args, log) -> str:
    import jax
    import jax.numpy as jnp

    from qjax.model.config import VisionConfig
    from qjax.model.vision import init_vision, patch_bucket

    vc = VisionConfig(**tower_kwargs(args.quick, 2048))
    t0 = time.perf_counter()
    tower = init_vision(vc, dtype=jnp.bfloat16, seed=0)
    jax.block_until_ready(nnx_state(tower))
    init_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    cases = [("448²", [[1, 28, 28]]), ("1024²", [[1, 64, 64]]), ("4 × 448²", [[1, 28, 28]] * 4)]
    lines = []
    for name, grids in cases:
        grids = np.array(grids, np.int64)
        n = int(grids.prod(1).sum())
        px = rng.uniform(-1, 1, (n, vc.patch_dim)).astype(np.float32)
        call = lambda: np.asarray(jax.block_until_ready(tower(px, grids)))
        t0 = time.perf_counter()
        feats = call()
        first = time.perf_counter() - t0
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            call()
            runs.append(time.perf_counter() - t0)
        med = statistics.median(runs)
        flops = vision_flops(vc, grids)
        finite = bool(np.isfinite(feats.astype(np.float32)).all())
        lines.append(f"| {name} | {n}→{patch_bucket(n)} | {1e3 * med:.1f} | {1e3 * min(runs):.1f} | {len(runs)} | "
                     f"{len(grids) / med:.1f} | {flops / med / 1e12:.3g} | {max(first - med, 0):.1f} | "
                     f"{feats.shape[0]}×{feats.shape[1]}{'' if finite else ' NON-FINITE'} |")
        log(lines[-1])
    head = ("| images | patches→bucket | median (ms) | min (ms) | runs | images/s | useful TFLOP/s | "
            "compile (s) | features |")
    return "\n".join([
        f"### Vision tower on {jax.devices()[0].device_kind} (bfloat16, random weights)", "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; qjax {git_state()}; jax {jax.__version__} on "
        f"{jax.default_backend()}",
        f"- command: `python3 {' '.join(sys.argv)}`",
        f"- tower: depth {vc.depth}, hidden {vc.hidden_size}, {vc.num_heads} heads, intermediate "
        f"{vc.intermediate_size}, out {vc.out_hidden_size}; built in {init_s:.1f}s",
        f"- method: `tower(pixel_values, grid_thw)` forced to numpy (host layout + padding to the patch bucket + "
        f"jitted program + copy back); compile = first call − median of {args.repeats} steady calls; useful "
        f"TFLOP/s counts real patches only (attention within each image)", "",
        head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|",
        *lines, ""])


def nnx_state(model):
    from flax import nnx
    return nnx.state(model)


# ---------------------------------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------------------------------
def _t(t: Timing | None) -> str:
    return "–" if t is None else f"{t.median:.3f}"


def fmt_row(r: Row) -> str:
    s = (f"{r.part:10s} {r.image:18s} {r.dtype}  qjax {_t(r.qjax)}s [n={len(r.qjax.runs)}] | transformers "
         f"{_t(r.hf)}s [n={len(r.hf.runs) if r.hf else 0}] | qjax/transformers "
         f"{'–' if r.ratio is None else f'{r.ratio:.2f}×'} | qjax compile {r.qjax.compile_s:.1f}s")
    for k, v in r.extra.items():
        s += f" | {k}: {v}"
    return s + f" | load {r.load:.1f}"


def markdown(rows: list[Row], meta: dict) -> str:
    lines = [SECTION, "",
             f"- date: {meta['date']}",
             f"- machine: {meta['cpu']}, {meta['cores']} cores (`nproc` {meta['nproc']}); torch threads "
             f"{meta['torch_threads']}",
             f"- command: `{meta['command']}`",
             f"- qjax: commit {meta['git']}",
             f"- versions: jax {meta['jax']} (jaxlib {meta['jaxlib']}, backend {meta['backend']}), "
             f"flax {meta['flax']}, torch {meta['torch']}, transformers {meta['transformers']}, "
             f"Pillow {meta['pillow']}, python {meta['python']}",
             f"- load average (1 min) at start {meta['load0']:.2f}, at end {meta['load1']:.2f}; CPU steal "
             f"{meta['steal']}",
             *[f"- {m}" for m in meta["method"]],
             ""]
    head = ["part", "image", "dtype", "qjax median (s)", "transformers median (s)", "qjax / transformers (time)",
            "runs (qjax / tf)", "qjax compile (s)", "check"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        comp = "–" if r.part == "preprocess" else "< noise" if r.qjax.first <= r.qjax.median else \
            f"{r.qjax.compile_s:.1f}"
        check = "; ".join(f"{k} {v}" for k, v in r.extra.items())
        lines.append("| " + " | ".join([
            r.part, r.image, r.dtype, _t(r.qjax), _t(r.hf), "–" if r.ratio is None else f"{r.ratio:.2f}×",
            f"{len(r.qjax.runs)} / {len(r.hf.runs) if r.hf else 0}", comp, check]) + " |")
    lines += ["", "Raw timings in seconds — median [min] (first call) over n runs; load = 1-min load average when "
              "the row finished:", "", "```"]
    for r in rows:
        lines.append(f"{r.part} {r.image} {r.dtype} (load {r.load:.1f}):")
        for name, t in (("qjax", r.qjax), ("transformers", r.hf)):
            if t is not None:
                lines.append(f"    {name:12s} {t.median:.4f} [{min(t.runs):.4f}] (first {t.first:.4f}) n={len(t.runs)}")
    lines.append("```")
    if meta.get("notes"):
        lines += ["", *meta["notes"]]
    return "\n".join(lines) + "\n"


def machine_meta(args, load0, steal0) -> dict:
    import PIL

    import cpu_speed
    meta = cpu_speed.machine_meta(types.SimpleNamespace(repeats=args.repeats, slow_s=0.0, prompt=0))
    meta["pillow"] = PIL.__version__
    meta["load0"], meta["load1"] = load0[0], os.getloadavg()[0]
    steal1 = cpu_steal()
    meta["steal"] = (f"{100 * (steal1[0] - steal0[0]) / (steal1[1] - steal0[1]):.1f}%"
                     if steal0 and steal1 and steal1[1] > steal0[1] else "n/a")
    meta["method"] = [
        f"method: cpu_speed.py's `bench`: one untimed warm-up call per contender, then interleaved rounds "
        f"(qjax, transformers, … in turn), median of the timed runs; runs: {args.repeats} (first size float32 "
        f"tower), {args.bf16_repeats} (bf16), {args.big_repeats} (other sizes), {args.ttft_repeats} (TTFT), "
        + f"{args.pre_repeats} (preprocessing); qjax compile = first call − steady median (the tower compiles once "
        f"per patch bucket, the TTFT row also the prefill and decode programs; \"< noise\" where the first call "
        f"was no slower than the median: a few seconds of compile vanish in the spread of minute-long calls)",
        f"tower: transformers `Qwen3_5MoeVisionModel(Qwen3_5MoeVisionConfig({args.tower_desc}))` "
        f"({args.tower_params / 1e6:.0f}M parameters: depth {args.tower_cfg.depth}, hidden "
        f"{args.tower_cfg.hidden_size}, {args.tower_cfg.num_heads} heads, intermediate "
        f"{args.tower_cfg.intermediate_size}; "
        f"torch.manual_seed(0) init; attention `{args.hf_attn}`), its float32 weights copied into qjax's tower; "
        f"bf16 = both cast from those; timed call = `tower(pixel_values, grid_thw)` → merged features, qjax's "
        f"forced to numpy (host-side layout and padding to the patch bucket included)",
        "preprocess: a decoded JPEG (PIL) image → pixel_values, qjax `preprocess` vs transformers "
        "`Qwen2VLImageProcessorPil` (official Qwen3.5/3.6 settings: patch 16, merge 2, mean = std = 0.5, "
        "65536..16777216 pixels); the source image is slightly larger than the row's size, so both resize "
        "(bicubic); their pixel_values are checked identical",
        "TTFT: JPEG bytes + ~30 token ids (one `<|image_pad|>` between vision start/end) → first greedy token: "
        "qjax `qjax.generate(ids, images=[jpeg], max_new_tokens=1)` vs transformers (PIL decode, image processor, "
        "placeholder expansion, `generate(..., max_new_tokens=1)`), on " + (
            "cpu_speed.py's `tiny` text model with the tiny tower (--quick)" if args.quick else
            "cpu_speed.py's `mid` text model (hidden 512, 8 layers, 32 experts top-4) with the full-size tower "
            "(out_hidden_size 512)") + ", one seeded random "
        "`Qwen3_5MoeForConditionalGeneration` saved with `save_pretrained` and loaded by both; transformers with "
        "its defaults (sdpa, grouped_mm experts)",
        "ratio = qjax time / transformers time (< 1: qjax faster)",
    ]
    return meta


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs of the first size's float32 tower (median reported; preprocessing: 3×)")
    ap.add_argument("--big-repeats", type=int, default=0,
                    help="timed runs of the other sizes' towers (0: --repeats; a 1024² full-size tower call takes "
                         "about a minute on 2 cores)")
    ap.add_argument("--bf16-repeats", type=int, default=0, help="timed runs of the bfloat16 towers (0: --repeats)")
    ap.add_argument("--ttft-repeats", type=int, default=0, help="timed runs of the time to first token (0: --repeats)")
    ap.add_argument("--sizes", default="448,1024", help="square image sides; the first is also the TTFT image")
    ap.add_argument("--bf16-sizes", default="448", help="sizes timed in bfloat16 too ('' for none; transformers' "
                    "bf16 on a CPU without AVX-512 BF16 / AMX is slow)")
    ap.add_argument("--ttft-dtypes", default="fp32", help="TTFT dtypes, of fp32,bf16 ('' skips TTFT)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/RESULTS.md alone")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny tower and text model, 1 repeat, no write")
    ap.add_argument("--gpu", action="store_true", help="the full-size bf16 tower alone on the default JAX device "
                    "(no torch / transformers / Pillow); writes <--out>/vision.md")
    ap.add_argument("--out", default=None, help="--gpu: folder for vision.md (default: print only)")
    a = ap.parse_args(argv)
    a.sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    a.bf16_sizes = [int(s) for s in a.bf16_sizes.split(",") if s.strip()]
    a.ttft_dtypes = [d for d in a.ttft_dtypes.split(",") if d.strip()]
    if not a.sizes:
        ap.error("--sizes is empty")
    if a.quick:
        a.repeats = a.big_repeats = a.bf16_repeats = a.ttft_repeats = 1
        a.no_write = True
    a.big_repeats = a.big_repeats or a.repeats
    a.bf16_repeats = a.bf16_repeats or a.repeats
    a.ttft_repeats = a.ttft_repeats or a.repeats
    a.pre_repeats = 3 * a.repeats
    return a


def main(argv=None) -> int:
    args = parse(argv)
    log = lambda s: print(s, flush=True)
    if args.gpu:
        md = run_gpu(args, log)
        print("\n" + md)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "vision.md"), "w", encoding="utf-8") as f:
                f.write(md)
            print(f"wrote {os.path.join(args.out, 'vision.md')}")
        return 0

    import torch
    torch.set_num_threads(2)
    import transformers
    transformers.logging.set_verbosity_error()

    t_start, load0, steal0 = time.perf_counter(), os.getloadavg(), cpu_steal()
    log(f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} on {os.cpu_count()} CPUs")
    rows: list[Row] = []
    args.correctness, args.ttft_match, args.tower_params, args.hf_attn = None, None, 0, "?"

    def report(final: bool) -> str:
        meta = machine_meta(args, load0, steal0)
        notes = [f"Total benchmark wall time: {time.perf_counter() - t_start:.0f}s"
                 + ("." if final else " so far (**partial: the run had not finished when this was written**).")]
        if args.correctness:
            size, delta, scale = args.correctness
            notes.append(f"Correctness (hard check): {size}² float32 merged features, max |qjax − transformers| = "
                         f"{delta:.2e} with max |feature| {scale:.2f} (relative {delta / scale:.1e}; bound "
                         f"{FEATURE_REL_TOL:g}). TTFT float32 first token: "
                         f"{'MATCH' if args.ttft_match else 'n/a' if args.ttft_match is None else 'DIFFER'}.")
        busiest = max([meta["load0"], meta["load1"]] + [r.load for r in rows if r.load is not None])
        if busiest > (os.cpu_count() or 1) + 0.5:
            notes.append(f"**Warning: the machine was shared** (1-min load average up to {busiest:.1f} on "
                         f"{os.cpu_count()} CPUs while this ran): absolute times are inflated and noisy; the "
                         "interleaved qjax/transformers ratios are the more trustworthy numbers.")
        meta["notes"] = notes
        return markdown(rows, meta)

    # each finished row rewrites the section, so a run cut short still leaves what it measured
    args.on_row = None if args.no_write else (lambda: write_section(report(False), RESULTS, SECTION))
    towers = Towers(args, rows, log)
    first = args.sizes[0]
    towers.measure(first, "fp32", args.repeats)
    if first in args.bf16_sizes:
        towers.measure(first, "bf16", args.bf16_repeats)
        towers.drop("bf16")
    if args.ttft_dtypes:
        run_ttft(args, towers.add, log)
    for size in args.sizes[1:]:
        towers.measure(size, "fp32", args.big_repeats)
    for size in args.sizes[1:]:
        if size in args.bf16_sizes:
            towers.measure(size, "bf16", min(args.big_repeats, args.bf16_repeats))
    md = report(True)
    print("\n" + md)
    if args.ttft_match is False:
        print("FAIL: the float32 first tokens of qjax and transformers differ")
        if not args.no_write:
            write_section(md, RESULTS, SECTION)
        return 1
    if not args.no_write:
        write_section(md, RESULTS, SECTION)
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
