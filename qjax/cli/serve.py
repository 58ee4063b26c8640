"""``qjax serve MODEL [vLLM's flags]``: the OpenAI-compatible server, a drop-in for ``vllm serve`` command lines.

    qjax serve Intel/Qwen3.6-35B-A3B-int2-mixed-AutoRound-LLMC --max-model-len 8192 --served-model-name qwen
    curl http://127.0.0.1:8000/v1/chat/completions -d '{"model": "qwen", "messages": [...]}'

MODEL is a folder or a repository id already in the local Hugging Face cache (nothing is downloaded). Flags keep
vLLM's names and meanings; flags that only steer vLLM's own machinery are accepted with a one-line note that says
so; an unknown flag is an error. Before serving, the memory plan (weights, K/V and GDN state per sequence, the
pool) is printed, and a configuration that does not fit the device is refused with the numbers. Ctrl-C / SIGTERM:
stop accepting, cancel what is in flight, exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time

from qjax.cli.chat import add_verify_argument
from qjax.cli.options import add_compile_cache_argument, start_compile_cache

# the image bounds' defaults, stated here so that `qjax serve --help` does not import the serving stack (keep equal
# to qjax.multimodal.images.DEFAULT_MAX_IMAGE_PIXELS and qjax.serving.api.DEFAULT_MAX_IMAGE_BYTES; a test checks)
DEFAULT_MAX_IMAGE_PIXELS = 1 << 26
DEFAULT_MAX_IMAGE_BYTES = 20 << 20

# Flags that steer vLLM's own machinery and mean nothing to qjax: accepted, with this note.
IGNORED_FLAGS: dict[str, str] = {
    "--trust-remote-code": "qjax runs its own qwen3_5_moe code; no remote code is loaded",
    "--gdn-prefill-backend": "qjax's GDN prefill is its chunked JAX form (a Pallas decode kernel on GPU)",
    "--moe-backend": "qjax picks its MoE kernels itself (Pallas on GPU, the JAX reference elsewhere)",
    "--enforce-eager": "qjax always runs compiled programs",
    "--no-enable-prefix-caching": "qjax has no prefix cache",
    "--enable-prefix-caching": "qjax has no prefix cache; every prompt is prefilled",
    "--disable-log-requests": "qjax does not log requests",
    "--disable-log-stats": "qjax logs no periodic stats",
    "--data-parallel-size-local": "one host: every data-parallel rank is local",
    "--swap-space": "qjax does not swap K/V to the host",
    "--block-size": "qjax keeps one cache row per sequence (no paged blocks)",
    "--mamba-cache-mode": "qjax keeps one GDN state per sequence",
    "--async-scheduling": "qjax's scheduler is synchronous",
    "--compilation-config": "qjax compiles with XLA",
    "--enable-auto-tool-choice": "tool calls are returned as text (no tool-call parser)",
    "--tool-call-parser": "tool calls are returned as text (no tool-call parser)",
    "--enable-chunked-prefill": "qjax always prefills in chunks of at most --max-num-batched-tokens",
    "--distributed-executor-backend": "qjax runs one SPMD program (jax.distributed for several hosts)",
}
_VALUE_IGNORED = {"--gdn-prefill-backend", "--moe-backend", "--data-parallel-size-local", "--swap-space",
                  "--block-size", "--mamba-cache-mode", "--compilation-config", "--tool-call-parser",
                  "--distributed-executor-backend"}
# vLLM's --dtype spellings → qjax.model.dtypes.MODEL_DTYPES (float64 is qjax's own: every step in float64)
DTYPES = {"auto": None, "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16",
          "float32": "float32", "float": "float32", "float64": "float64", "double": "float64"}
KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "bfloat16", "float16", "float32", "float64")
CPU_DEFAULT_SEQS = 16  # a CPU decodes a batch no faster per sequence than this many at once
GPU_DEFAULT_SEQS = 256  # vLLM's default


def human_int(text: str) -> int:
    """``8192``, ``32k``, ``1M`` (vLLM's human-readable sizes: k = 1000, K = 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"expected an integer like 8192 or 32k, got {text!r}")
    scale = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]
    value = float(m.group(1)) * scale
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint folder or a repository id in the local Hugging Face cache (default: the "
                        "built-in model)")
    p.add_argument("--model", default=None, help="the same as MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the address is printed)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients send as 'model' (default: MODEL as given)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or cached repository id (default: MODEL)")
    p.add_argument("--max-model-len", type=human_int, default=None,
                   help="prompt + output tokens per sequence (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"sequence slots (default: as many as fit, at most {GPU_DEFAULT_SEQS} on a GPU and "
                        f"{CPU_DEFAULT_SEQS} on a CPU)")
    p.add_argument("--max-num-batched-tokens", type=human_int, default=2048,
                   help="prompt tokens prefilled per engine step")
    p.add_argument("--num-scheduler-steps", type=int, default=8,
                   help="tokens decoded per device call while no request waits (fewer host round trips; batch-1 "
                        "decode on the CPU host: 0.80× generate's speed at 4, 0.87× at 8)")
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPES))
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES,
                   help="auto: the checkpoint's (FP8 with its static scales when it has them); fp8: E4M3, with "
                        "the checkpoint's scales or 1.0")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the device memory (of the host's available memory on a CPU) the plan may use")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VLLM_API_KEY)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--enable-expert-parallel", "-ep", action="store_true")
    p.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                   help="qjax's mesh directly (data, tensor, expert), instead of the three flags above")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults: auto (the folder's generation_config.json), vllm (neutral), or a "
                        "folder holding a generation_config.json")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="return the <think> block as reasoning_content")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (default: the tokenizer's)")
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests (prompts × n) that may wait for a slot; more get HTTP 503 (default 1024)")
    p.add_argument("--seed", type=int, default=None, help="seeds the random seeds of requests that send none")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='MTP speculative decoding with the checkpoint\'s own head, as vLLM: '
                        '\'{"method": "mtp", "num_speculative_tokens": 3}\'')
    p.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='the most images per request, as vLLM: \'{"image": 4}\' (or image=4); image 0 does not load '
                        'the vision tower (text only). video and audio are accepted and always refused per request')
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let requests read file:// images under DIR (symbolic links resolved); without it file:// "
                        "URLs are refused. A security risk: only for trusted clients")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="run chat templates that requests send (chat_template, chat_template_kwargs.chat_template); "
                        "without it they are refused with 400 (vLLM's rule). Every template runs in a sandbox with "
                        "step, memory and time budgets either way")
    p.add_argument("--max-image-pixels", type=human_int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="the most pixels (width × height) an image may decode to, checked on its header before it is "
                        f"decoded (default {DEFAULT_MAX_IMAGE_PIXELS:,}, below Pillow's decompression-bomb warning)")
    p.add_argument("--max-image-bytes", type=human_int, default=DEFAULT_MAX_IMAGE_BYTES,
                   help=f"the most bytes of one encoded image (default {DEFAULT_MAX_IMAGE_BYTES:,})")
    p.add_argument("--no-warmup", action="store_true",
                   help="ready at once; the engine's programs compile on first use (each request that reaches a new "
                        "one waits for its compile)")
    add_compile_cache_argument(p)
    add_verify_argument(p)
    for flag, why in IGNORED_FLAGS.items():
        if flag in _VALUE_IGNORED:
            p.add_argument(flag, default=None, help=f"ignored: {why}")
        else:
            p.add_argument(flag, action="store_true", default=None, help=f"ignored: {why}")


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible server with continuous batching (vLLM's flags)",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run_serve)


class ServeError(ValueError):
    """A configuration qjax serve refuses (one line, the numbers in it)."""


def _mesh(a) -> dict | str | None:
    if a.mesh is not None:
        if a.tensor_parallel_size != 1 or a.data_parallel_size != 1 or a.enable_expert_parallel:
            raise ServeError("--mesh replaces --tensor-parallel-size / --data-parallel-size / "
                             "--enable-expert-parallel; give one or the other")
        return a.mesh
    tp, dp = a.tensor_parallel_size, a.data_parallel_size
    if tp < 1 or dp < 1:
        raise ServeError("--tensor-parallel-size and --data-parallel-size must be ≥ 1")
    if tp == dp == 1:
        return None
    if a.enable_expert_parallel:
        # vLLM shards the experts over all TP × DP ranks; qjax's expert axis does that beside tensor, and the data
        # ranks' requests share one batch (attention is replicated over the expert axis)
        mesh = {"tensor": tp, "expert": dp}
        note = f"data=1, tensor={tp}, expert={dp} (experts over all {tp * dp} devices, one shared batch)"
    else:
        mesh = {"data": dp, "tensor": tp}
        note = f"data={dp}, tensor={tp}"
    _note(f"--tensor-parallel-size {tp} --data-parallel-size {dp}"
          f"{' --enable-expert-parallel' if a.enable_expert_parallel else ''}: qjax mesh {note}")
    return mesh


def _note(message: str) -> None:
    print(f"qjax serve: note: {message}", file=sys.stderr, flush=True)


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def memory_limit(utilization: float) -> tuple[int, str]:
    """(bytes the plan may use on the first device, a description)."""
    import jax

    from qjax.model.memory import device_limit, host_available

    dev = jax.devices()[0]
    total = device_limit(dev)
    if total:
        return int(total * utilization), f"{utilization:.2f} × {_gib(total)} of {dev.device_kind}"
    avail = host_available() or 0
    return int(avail * utilization), f"{utilization:.2f} × {_gib(avail)} available host memory"


def plan_memory(model, *, max_num_seqs: int | None, max_model_len: int, max_num_batched_tokens: int,
                utilization: float, on_cpu: bool, num_speculative_tokens: int = 0) -> tuple[int, list[str]]:
    """The number of sequence slots and the plan's lines; raises :class:`ServeError` when it does not fit."""
    from qjax.model.sharding import device_bytes
    from qjax.serving.engine import Engine

    per_dev = device_bytes(model)
    weights = max(per_dev.values())
    devices = len(per_dev)
    per_seq = Engine.cache_bytes(model, 1, max_model_len, num_speculative_tokens)
    shards = 1 if model.mesh_plan is None else model.mesh_plan.size("data") * (
        model.mesh_plan.size("tensor") if model.mesh_plan.kv_split else 1)
    seq_bytes = (per_seq["kv"] + per_seq["state"]) / shards
    cfg = model.config
    # activations of the largest prefill chunk: the residual stream and MoE/attention intermediates (~24 hidden-wide
    # fp32 vectors per token) and one 64-position block of vocabulary logits per sequence
    act = max_num_batched_tokens * cfg.hidden_size * 4 * 24 + 64 * cfg.vocab_size * 4 * 8
    limit, where = memory_limit(utilization)
    if on_cpu and devices > 1:
        limit //= devices  # emulated devices share the host
    room = limit - weights - act
    fit = int(room // seq_bytes) if room > 0 else 0
    if max_num_seqs is None:
        cap = CPU_DEFAULT_SEQS if on_cpu else GPU_DEFAULT_SEQS
        max_num_seqs = min(cap, fit)
        if model.mesh_plan is not None:
            d = model.mesh_plan.size("data")
            max_num_seqs = max_num_seqs // d * d
    lines = [f"memory plan per device ({devices} device{'s' if devices > 1 else ''}; limit {_gib(limit)} = {where}):",
             f"  weights                {_gib(weights)}",
             f"  K/V per sequence       {_gib(per_seq['kv'] / shards)}  "
             f"({sum(k == 'full_attention' for k in cfg.layer_types)} full-attention layers × {max_model_len} slots)",
             f"  GDN state per sequence {_gib(per_seq['state'] / shards)}  "
             f"({sum(k != 'full_attention' for k in cfg.layer_types)} layers: conv window + fp32 recurrent state"
             + (f"; × {num_speculative_tokens + 2} with MTP speculation" if num_speculative_tokens else "") + ")",
             f"  {max_num_seqs} sequences           {_gib(max_num_seqs * seq_bytes)}",
             f"  activations (estimate) {_gib(act)}",
             f"  total                  {_gib(weights + act + max_num_seqs * seq_bytes)}"]
    if max_num_seqs < 1 or weights + act + max_num_seqs * seq_bytes > limit:
        n = max(max_num_seqs, 1)
        raise ServeError(f"{n} sequence(s) × {max_model_len} tokens need {_gib(n * seq_bytes)} of K/V cache + GDN "
                         f"state ({_gib(seq_bytes)} per sequence); with {_gib(weights)} of weights and "
                         f"~{_gib(act)} of activations that is {_gib(weights + act + n * seq_bytes)}, more than the "
                         f"{_gib(limit)} limit ({where}): at most {max(fit, 0)} sequence(s) fit — lower "
                         "--max-num-seqs or --max-model-len")
    return max_num_seqs, lines


# vLLM's method names for a checkpoint's own MTP head (Qwen3-Next's recipes spell it qwen3_next_mtp)
MTP_METHODS = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")


def _json_object(flag: str, text: str) -> dict:
    """A flag's JSON-object value, or a :class:`ServeError` naming the flag."""
    try:
        conf = json.loads(text)
    except json.JSONDecodeError as e:
        raise ServeError(f"{flag}: not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(conf, dict):
        raise ServeError(f"{flag}: a JSON object is expected, got {text!r}")
    return conf


def speculative_tokens(text: str | None) -> int:
    """``--speculative-config`` → drafts per verify round (0: none); a config qjax cannot serve is a
    :class:`ServeError` naming the field."""
    if text is None:
        return 0
    conf = _json_object("--speculative-config", text)
    unknown = sorted(set(conf) - {"method", "num_speculative_tokens"})
    if unknown:
        raise ServeError(f"--speculative-config: field {unknown[0]!r} is not supported (qjax drafts with the "
                         "checkpoint's own MTP head: only method and num_speculative_tokens)")
    if conf.get("method") not in MTP_METHODS:
        raise ServeError(f"--speculative-config: method must be one of {', '.join(MTP_METHODS)}, got "
                         f"{conf.get('method')!r}")
    k = conf.get("num_speculative_tokens", 1)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
        raise ServeError(f"--speculative-config: num_speculative_tokens must be an integer in [1, 16], got {k!r}")
    return k


MM_MODALITIES = ("image", "video", "audio")
# vLLM's per-modality options beside "count" (they size its memory-profiling dummy inputs; nothing in qjax)
_MM_OPTIONS = ("width", "height", "num_frames", "length")


def mm_limits(text: str | None) -> dict[str, int]:
    """``--limit-mm-per-prompt`` → items per request by modality: vLLM's JSON (``{"image": 4, "video": 0}``; a
    modality's value an integer or ``{"count": N, …}``) or its older ``image=4,video=0`` form. Anything else, an
    unknown modality or a negative count is a :class:`ServeError` naming it."""
    if text is None:
        return {}
    flag = "--limit-mm-per-prompt"
    if text.strip().startswith("{"):
        conf = _json_object(flag, text)
    else:
        conf = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep or not value.strip().isdigit():
                raise ServeError(f"{flag}: expected JSON like '{{\"image\": 4}}' or image=4,video=0, got {text!r}")
            conf[key.strip()] = int(value)
    out = {}
    for key, value in conf.items():
        if key not in MM_MODALITIES:
            raise ServeError(f"{flag}: unknown modality {key!r} (one of {', '.join(MM_MODALITIES)})")
        if isinstance(value, dict):
            extra = sorted(set(value) - {"count", *_MM_OPTIONS})
            if extra or "count" not in value:
                raise ServeError(f"{flag}: {key}: an object needs \"count\" (and may have "
                                 f"{', '.join(_MM_OPTIONS)}), got {json.dumps(value)}")
            value = value["count"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ServeError(f"{flag}: {key}: the count must be a non-negative integer, got {value!r}")
        out[key] = value
    return out


def media_path(path: str | None) -> str | None:
    """``--allowed-local-media-path``, resolved; it must be an existing folder (as vLLM requires)."""
    if path is None:
        return None
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        why = "not a folder" if os.path.exists(real) else "no such folder"
        raise ServeError(f"--allowed-local-media-path {path}: {why}")
    return real


def run_serve(a: argparse.Namespace) -> int:
    try:
        return _serve(a)
    except ServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _serve(a: argparse.Namespace) -> int:
    for flag in IGNORED_FLAGS:
        if getattr(a, flag.lstrip("-").replace("-", "_"), None) not in (None, False):
            _note(f"{flag}: ignored ({IGNORED_FLAGS[flag]})")
    spec_tokens = speculative_tokens(a.speculative_config)
    limits = mm_limits(a.limit_mm_per_prompt)
    local_media = media_path(a.allowed_local_media_path)
    if a.model_tag and a.model and a.model_tag != a.model:
        raise ServeError(f"two models given: {a.model_tag!r} and --model {a.model!r}")
    name = a.model_tag or a.model
    from qjax.checkpoint.hub import default_model_dir, resolve

    try:
        folder = resolve(name) if name else default_model_dir()
        tok_folder = resolve(a.tokenizer, what="tokenizer") if a.tokenizer else folder
    except FileNotFoundError as e:
        raise ServeError(str(e)) from None
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ServeError(f"{folder}: no config.json (a Hugging Face checkpoint folder)")
    if not 0 < a.gpu_memory_utilization <= 1:
        raise ServeError(f"--gpu-memory-utilization must be in (0, 1], got {a.gpu_memory_utilization}")
    for flag in ("max_num_seqs", "num_scheduler_steps", "max_logprobs"):
        v = getattr(a, flag)
        if v is not None and v < (0 if flag == "max_logprobs" else 1):
            raise ServeError(f"--{flag.replace('_', '-')} must be positive, got {v}")
    if not 0 <= a.port < 65536:
        raise ServeError(f"--port must be in [0, 65535], got {a.port}")
    mesh = _mesh(a)
    cache = start_compile_cache(a.compile_cache)  # before anything compiles
    print(f"qjax serve: compile cache {cache or 'off'}", file=sys.stderr, flush=True)

    import jax
    import jax.numpy as jnp

    import qjax
    from qjax.checkpoint.loading import with_fp8_kv_cache
    from qjax.model.config import GenerationConfig
    from qjax.program_cache import program_cache
    from qjax.serving.api import ServerState, create_app
    from qjax.serving.engine import Engine, EngineConfig, EngineError
    from qjax.serving.metrics import ServerMetrics
    from qjax.serving.protocol import Defaults
    from qjax.tokenizer import Tokenizer

    on_cpu = jax.default_backend() == "cpu"
    if a.gpu_memory_utilization != 0.9 and on_cpu:
        _note("--gpu-memory-utilization: no GPU here; it applies to the host's available memory")
    tokenizer = Tokenizer.from_folder(tok_folder)
    if a.chat_template is not None:
        try:
            with open(a.chat_template, encoding="utf-8") as f:
                tokenizer.chat_template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ServeError(f"--chat-template {a.chat_template}: cannot read ({e})") from None
    dtype = DTYPES[a.dtype]
    text_only = limits.get("image") == 0
    model = qjax.load_model(folder, dtype=dtype, mesh=mesh, verify=a.verify, text_only=text_only)
    if text_only:
        _note("--limit-mm-per-prompt image 0: the vision tower is not loaded (image input is refused)")
    elif model.visual is not None:
        _note("image input on (the vision tower is loaded"
              + (f"; at most {limits['image']} per request" if limits.get("image") is not None else "")
              + ("; refused with --speculative-config" if spec_tokens else "") + ")")
    if a.kv_cache_dtype in ("fp8", "fp8_e4m3"):
        if not model.kv_fp8:
            _note("--kv-cache-dtype fp8: the checkpoint has no static K/V scales; using 1.0 (as vLLM does)")
        model = with_fp8_kv_cache(model)
    elif a.kv_cache_dtype != "auto":
        if model.kv_fp8:
            raise ServeError(f"--kv-cache-dtype {a.kv_cache_dtype}: this checkpoint's attention was calibrated for "
                             "an FP8 K/V cache (kv_cache_scheme); use auto or fp8")
        if jnp.dtype(a.kv_cache_dtype) != model.dtype:
            raise ServeError(f"--kv-cache-dtype {a.kv_cache_dtype}: the cache is kept in the model dtype "
                             f"({model.dtype}) or FP8; use auto, fp8 or --dtype {a.kv_cache_dtype}")
    cfg = model.config
    max_len = a.max_model_len or cfg.max_position_embeddings
    if max_len > cfg.max_position_embeddings:
        raise ServeError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings} ({folder}/config.json)")
    seqs, lines = plan_memory(model, max_num_seqs=a.max_num_seqs, max_model_len=max_len,
                              max_num_batched_tokens=a.max_num_batched_tokens,
                              utilization=a.gpu_memory_utilization, on_cpu=on_cpu,
                              num_speculative_tokens=spec_tokens)
    print("qjax serve: " + "\n".join(lines), file=sys.stderr, flush=True)
    if spec_tokens and model.mtp is None:
        raise ServeError(f"--speculative-config: method mtp drafts with the checkpoint's MTP head, but {folder} has "
                         "no mtp.* weights")

    if a.generation_config == "vllm":
        gc = None
    elif a.generation_config == "auto":
        gc = model.generation_config
    else:
        if not os.path.isfile(os.path.join(a.generation_config, "generation_config.json")):
            raise ServeError(f"--generation-config {a.generation_config}: no generation_config.json there")
        gc = GenerationConfig.from_folder(a.generation_config)
    eos = tuple(dict.fromkeys([*cfg.eos_token_id, *(gc.eos_token_id if gc else ()), *tokenizer.stop_token_ids]))
    served = tuple(a.served_model_name or [name or "qjax-default"])
    metrics = ServerMetrics(served[0])
    try:
        engine = Engine(model, EngineConfig(max_num_seqs=seqs, max_model_len=max_len,
                                            max_num_batched_tokens=a.max_num_batched_tokens,
                                            decode_steps=a.num_scheduler_steps, max_logprobs=a.max_logprobs,
                                            num_speculative_tokens=spec_tokens),
                        eos_token_ids=eos, metrics=metrics, seed=a.seed,
                        programs=program_cache(cache))  # traced programs kept beside the compiled ones
    except EngineError as e:  # a configuration the engine refuses (the message names the setting)
        raise ServeError(str(e)) from None
    from importlib.metadata import version

    state = ServerState(engine=engine, tokenizer=tokenizer, served_names=served, root=folder, metrics=metrics,
                        defaults=Defaults.from_generation_config(gc), api_key=a.api_key,
                        reasoning_parser=a.reasoning_parser, max_waiting=a.max_waiting_requests,
                        image_limit=limits.get("image"), media_path=local_media,
                        trust_request_chat_template=a.trust_request_chat_template,
                        max_image_pixels=a.max_image_pixels, max_image_bytes=a.max_image_bytes,
                        version=version("qjax"))
    return serve_app(create_app(state), engine, a.host, a.port, a.uvicorn_log_level, warmup=not a.no_warmup)


def serve_app(app, engine, host: str, port: int, log_level: str, *, warmup: bool = True) -> int:
    """Bind and print the address at once, then compile the engine's programs on a thread (``warmup``: every
    program a request can reach, one stderr line each) while ``/health`` answers 503 with the progress and other
    routes 503; ready: ``/health`` 200 and the engine serves. Serve until SIGINT/SIGTERM, then shut down cleanly and
    return 0: new requests get 503, every request in flight ends at the engine's next step (a waiting non-streaming
    request gets a 503 error object, a stream its final chunk and ``[DONE]``: ``ServerState.begin_shutdown``),
    uvicorn lets those responses go out (5 s at most) and closes, the engine stops. A second signal does not wait; a
    signal during the warm-up does not wait for the compile in progress either."""
    import uvicorn

    state = app.state.server
    state.ready, state.started = False, time.monotonic()  # not ready until the warm-up thread below is done
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        raise ServeError(f"cannot listen on {host}:{port} ({e.strerror})") from None
    sock.listen(2048)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, access_log=False,
                            timeout_keep_alive=30)

    class Server(uvicorn.Server):
        # uvicorn re-raises a captured SIGTERM after its graceful shutdown (the process then dies of it); a server
        # asked to stop should instead finish its shutdown and exit 0, so the handlers are qjax's
        def capture_signals(self):
            return contextlib.nullcontext()

    server = Server(config)

    def stop(signum, frame):
        if server.should_exit:  # a second Ctrl-C: do not wait for in-flight requests
            server.force_exit = True
        # the handler runs on the main thread, which is the event loop's: no request code runs meanwhile
        state.begin_shutdown()
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    failed: list[BaseException] = []

    def start() -> None:
        try:
            if warmup:
                t0 = time.perf_counter()

                def progress(i, n, what, seconds, parts):
                    state.startup.update(programs=n, compiled=i, last=what)
                    print(f"qjax serve: compiled {i}/{n} {what} in {seconds:.1f} s ({describe_parts(parts)})",
                          file=sys.stderr, flush=True)
                    if state.stopping:
                        raise _Stopped

                n = engine.warmup(progress=progress)
                print(f"qjax serve: {n} programs compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                      flush=True)
            engine.start()
            state.mark_ready()
            print(f"qjax serve: ready (since the port was bound: {time.monotonic() - state.started:.1f} s)",
                  file=sys.stderr, flush=True)
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - reported below, the server stops
            failed.append(e)
            server.should_exit = True

    starter = threading.Thread(target=start, name="qjax-warmup", daemon=True)
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"qjax serve: listening on http://{shown}:{bound}", flush=True)
    starter.start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if starter.is_alive():
            # a compile cannot be interrupted: leave without waiting for it (nothing was served yet)
            print("qjax serve: stopped during the warm-up", file=sys.stderr, flush=True)
            os._exit(0)
        engine.shutdown(abort=True)
    if failed:
        raise ServeError(f"the warm-up failed: {type(failed[0]).__name__}: {failed[0]}")
    print("qjax serve: stopped", file=sys.stderr, flush=True)
    return 0


def describe_parts(parts: dict[str, float]) -> str:
    """``trace 0.9, lower 0.3, XLA 7.8 s`` or ``…, from the compile cache 0.1 s`` (:func:`qjax.serving.warmup.
    compile_times`'s parts)."""
    xla = parts.get("compile", 0.0)
    last = (f"from the compile cache {xla:.1f} s" if "cache" in parts else f"XLA {xla:.1f} s")
    return f"trace {parts.get('trace', 0.0):.1f}, lower {parts.get('lower', 0.0):.1f}, {last}"


class _Stopped(Exception):
    """The server was asked to stop during its warm-up."""
