"""auto-round (PyTorch) as the oracle for qjax.autoround: a tiny bf16 qwen3_5_moe folder with a word-level tokenizer,
calibration text, and auto-round runs on it (used by the tests and by tests/fixtures/make_autoround_rtn.py)."""

from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from oracles.hf import make_hf_model, save_hf, tiny_text_config

WORDS = [f"w{i}" for i in range(500)]
# auto-round's recipe for the RTN comparison: W4A16 g32 with 2-bit g32 experts (group 32 divides every tiny dim)
RTN_RECIPE = dict(bits=4, group_size=32, layer_config={".*experts.*": {"bits": 2, "group_size": 32}})
NSAMPLES, SEQLEN, BATCH = 8, 64, 4


def write_tokenizer(folder: str | Path) -> None:
    """A word-level tokenizer over ``WORDS`` (ids 0..499) saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab["[UNK]"], vocab["<|endoftext|>"] = 500, 501
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", unk_token="[UNK]").save_pretrained(
        str(folder))


def write_base(folder: str | Path, seed: int = 0) -> str:
    """The tiny config, seeded, in bf16 (auto-round's working dtype), with its tokenizer."""
    model = make_hf_model(tiny_text_config(), seed=seed).to(torch.bfloat16)
    save_hf(model, folder)
    write_tokenizer(folder)
    return str(folder)


def write_calibration(path: str | Path, n: int = NSAMPLES, words: int = SEQLEN + 16, seed: int = 0) -> str:
    """A JSON list of ``n`` random-word documents, each longer than SEQLEN tokens (auto-round's local-file form:
    in-memory lists crash auto-round on the hybrid model, docs/autoround.md)."""
    r = random.Random(seed)
    docs = [" ".join(r.choice(WORDS) for _ in range(words)) for _ in range(n)]
    Path(path).write_text(json.dumps(docs))
    return str(path)


def isolated(func: str, **kwargs):
    """``oracles.autoround.<func>(**kwargs)`` in a fresh interpreter, its JSON result returned.

    Running auto-round (quantizing, or loading an auto-round checkpoint through transformers) patches transformers
    for the rest of the process — afterwards ``save_pretrained`` writes fused experts and other models compute
    different logits — so every such call is kept out of the test process.
    """
    # gc.freeze() after the imports: auto-round calls gc.collect() again and again while it quantizes and saves, and
    # each full collection walked the ~0.6 million objects torch and transformers leave behind (a third of these
    # processes' CPU time in a profile of the suite; two export tests 37 -> 26 s)
    code = ("import gc, json, sys; sys.path.insert(0, sys.argv[1]); from oracles import autoround; "
            "import auto_round, transformers; gc.freeze(); "
            "print('RESULT ' + json.dumps(getattr(autoround, sys.argv[2])(**json.loads(sys.argv[3]))))")
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code, tests_dir, func,
                        json.dumps(kwargs)], capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{func} failed in a subprocess:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.rsplit("RESULT ", 1)[1])


def run_auto_round(base: str, calib: str, out: str, **kw) -> str:
    """Run auto-round 0.16.1 itself (in a subprocess, see :func:`isolated`); returns the folder it wrote."""
    return isolated("run_auto_round_here", base=base, calib=calib, out=out, **kw)


def run_auto_round_here(base: str, calib: str, out: str, *, bits: int, group_size: int, layer_config: dict,
                        iters: int = 0, fmt: str = "llm_compressor", **kw) -> str:
    from auto_round import AutoRound

    torch.manual_seed(0)
    ar = AutoRound(base, scheme=f"W{bits}A16", bits=bits, group_size=group_size, iters=iters, nsamples=NSAMPLES,
                   seqlen=SEQLEN, batch_size=BATCH, dataset=calib, layer_config=layer_config, **kw)
    ar.quantize_and_save(out, format=fmt)
    found = sorted({os.path.dirname(p) for p in glob.glob(os.path.join(out, "**", "config.json"), recursive=True)})
    assert found, f"auto-round wrote no config.json under {out}"
    return found[0]


def read_tensors(folder: str) -> dict[str, np.ndarray]:
    from qjax.checkpoint.safetensors_io import SafetensorsFile

    out: dict[str, np.ndarray] = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with SafetensorsFile(f) as st:
            out.update({k: np.array(st.get(k)) for k in st.keys()})
    return out


def autoround_export_here(source: str, out: str, sym: bool, layer_config: dict | None) -> str:
    """auto-round's own ``--format auto_round`` RTN export of ``source`` (iters=0, no optimized RTN, no calibration
    data; the model-free route would spawn worker processes); returns the folder it wrote."""
    import auto_round
    from auto_round.utils import device as ar_device

    # auto-round keeps bf16 (amp) only where the CPU has bf16 instructions (AVX512-BF16 / AMX); elsewhere it turns
    # amp off and writes its unquantized tensors in F32 and "amp": false. Pin the bf16 path (torch emulates bf16 on
    # any CPU) so the reference export is the same on every host
    ar_device.CpuInfo.bf16 = property(lambda self: True)
    ar = auto_round.AutoRound(source, scheme="W4A16", group_size=32, sym=sym, iters=0, disable_opt_rtn=True,
                              layer_config=layer_config or None, disable_model_free=True)
    ar.quantize_and_save(out, format="auto_round")
    (config,) = glob.glob(os.path.join(out, "**", "config.json"), recursive=True)  # it adds a model-name folder
    return os.path.dirname(config)


def transformers_autoround_logits_here(folder: str, ids: list, out: str) -> int:
    """Logits of an auto_round folder loaded by transformers + auto-round (CPU torch kernels), saved to ``out``
    (.npy); returns the number of quantized modules.

    auto-round's CPU kernels compute in fp16/bf16 only, so the model is loaded in bf16 and cast to float32 except
    the scales, kept in float16 so its kernel dequantizes ``scales · (q − zp)`` rounded once to float16.
    """
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    hf = torch.nn.Module.float(hf).eval()  # PreTrainedModel.float() refuses quantized models
    quantized = [m for m in hf.modules() if hasattr(m, "qweight")]
    for m in quantized:
        m.scales = m.scales.half()
    with torch.no_grad():
        logits = hf(torch.as_tensor(np.asarray(ids), dtype=torch.long), use_cache=False).logits.numpy()
    np.save(out, logits)
    return len(quantized)
