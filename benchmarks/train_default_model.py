"""Reproduce qjax's built-in default model (``qjax/assets/default``) end to end on a CPU.

    python benchmarks/train_default_model.py --out qjax/assets/default [--minutes 25] [--steps N]

corpus → tokenizer → training → BF16 checkpoint → held-out perplexity, sample text and ``training_log.json``.

Corpus
------
Jane Austen's six completed novels (Sense and Sensibility, Pride and Prejudice, Mansfield Park, Emma, Northanger
Abbey, Persuasion; ~4.0 MB of English narrative prose), as shipped by the Debian package

    r-cran-janeaustenr 1.0.0-1 (Architecture: all; .deb SHA256 df6bddf2…c95 — the full hash is DEB_SHA256 below)
    files /usr/lib/R/site-library/janeaustenr/data/Rdata.rdx + Rdata.rdb (R lazy-load database, one character
    vector of lines per novel: emma, mansfieldpark, northangerabbey, persuasion, prideprejudice, sensesensibility)

License: the texts are Project Gutenberg transcriptions of works in the public domain (Austen died in 1817); the R
package (Julia Silge, 2016–2017) and its Debian packaging (Andreas Tille, 2021) are MIT-licensed
(/usr/share/doc/r-cran-janeaustenr/copyright). Redistributing excerpts (heldout.txt, calib.txt) is therefore free.

The script finds the corpus in this order: ``--corpus PATH`` (the .deb, or the installed ``janeaustenr`` R package
folder); ``/usr/lib/R/site-library/janeaustenr`` (``apt-get install r-cran-janeaustenr``); otherwise it runs
``apt-get download r-cran-janeaustenr=1.0.0-1`` into ``~/.cache/qjax/corpus`` and checks the SHA256. The .deb and the
R data files are read with the Python standard library (no R, no dpkg).

Splits (deterministic, by paragraph): in each novel, the paragraphs starting at 80 % of its characters form the
held-out block (≥ 20,000 characters), the paragraphs right after it the calibration block (≥ 40,000 characters);
everything else is training text. The tokenizer and the model see only training text; ``heldout.txt`` and
``calib.txt`` (the six blocks each, in the order of NOVELS, separated by a blank line) are disjoint from it.

Time: the whole script is sized to ``--minutes`` (default 25) on 2 CPU cores: the training loop times its first
steps and shortens the run to what fits (``--steps`` caps it; the step count reached is written to the log, and
passing it as ``--steps`` with a larger ``--minutes`` repeats the run).
"""

from __future__ import annotations

import os

# one single-threaded XLA:CPU program: as fast as Eigen's thread pool for this model size on 2 cores, and immune to
# the thread pool's occasional wedge (a run hanging with every thread idle). Must be set before jax starts.
from qjax import xla_env  # noqa: E402

xla_env.apply(single_threaded=True)

import argparse
import dataclasses
import gzip
import hashlib
import io
import json
import lzma
import platform
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib

import numpy as np

DEB_NAME = "r-cran-janeaustenr"
DEB_VERSION = "1.0.0-1"
DEB_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
R_DATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"
INSTALLED = "/usr/lib/R/site-library/janeaustenr"
NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")

HELDOUT_AT, HELDOUT_CHARS, CALIB_CHARS = 0.80, 20_000, 40_000

MODEL_CONFIG = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}


# ---------------------------------------------------------------------------------------------------------------------
# corpus
# ---------------------------------------------------------------------------------------------------------------------
def _deb_member(deb: bytes, want: tuple[str, ...]) -> dict[str, bytes]:
    """Files ``want`` (paths inside the package, no leading ./) from a .deb (ar archive holding data.tar.*)."""
    if deb[:8] != b"!<arch>\n":
        raise ValueError("not a .deb (ar) archive")
    pos = 8
    while pos < len(deb):
        name = deb[pos:pos + 16].decode().strip().rstrip("/")
        size = int(deb[pos + 48:pos + 58].decode().strip())
        body = deb[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
        if name.startswith("data.tar"):
            raw = {"xz": lzma.decompress, "gz": gzip.decompress, "tar": lambda b: b}[name.rsplit(".", 1)[-1]](body)
            out = {}
            with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
                for m in tf.getmembers():
                    path = m.name[2:] if m.name.startswith("./") else m.name
                    if path in want:
                        out[path] = tf.extractfile(m).read()
            return out
    raise ValueError("no data.tar member in the .deb")


def _download_deb(cache: str) -> str:
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, f"{DEB_NAME}_{DEB_VERSION}_all.deb")
    if not os.path.exists(path):
        print(f"downloading {DEB_NAME}={DEB_VERSION} with apt-get into {cache}", flush=True)
        subprocess.run(["apt-get", "download", f"{DEB_NAME}={DEB_VERSION}"], cwd=cache, check=True)
    return path


def load_corpus_files(corpus: str | None) -> tuple[bytes, bytes, str]:
    """(Rdata.rdx, Rdata.rdb, description of the source)."""
    if corpus is None and os.path.isdir(INSTALLED):
        corpus = INSTALLED
    if corpus is None:
        corpus = _download_deb(os.path.join(os.path.expanduser("~"), ".cache", "qjax", "corpus"))
    if os.path.isdir(corpus):
        base = os.path.join(corpus, "data", "Rdata")
        with open(base + ".rdx", "rb") as f, open(base + ".rdb", "rb") as g:
            return f.read(), g.read(), f"installed R package {corpus}"
    with open(corpus, "rb") as f:
        deb = f.read()
    digest = hashlib.sha256(deb).hexdigest()
    if digest != DEB_SHA256:
        raise SystemExit(f"{corpus}: SHA256 {digest} is not that of {DEB_NAME} {DEB_VERSION} ({DEB_SHA256})")
    files = _deb_member(deb, (R_DATA + ".rdx", R_DATA + ".rdb"))
    return files[R_DATA + ".rdx"], files[R_DATA + ".rdb"], f"{os.path.basename(corpus)} (sha256 verified)"


class _RReader:
    """Just enough of R's XDR serialisation (format 2/3) to read character vectors and named lists."""

    def __init__(self, b: bytes):
        if b[:2] != b"X\n":
            raise ValueError("not an XDR R serialisation")
        self.b, self.p, self.refs = b, 2, []
        version = self._int()
        self._int(), self._int()
        if version == 3:
            n = self._int()  # length of the native encoding name, then the name
            self.p += n

    def _int(self) -> int:
        v = struct.unpack_from(">i", self.b, self.p)[0]
        self.p += 4
        return v

    def item(self):
        flags = self._int()
        t, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if t in (254, 253, 252, 251, 250, 242, 241):  # NULL and the special environments
            return None
        if t == 255:  # reference to an earlier symbol
            idx = flags >> 8 or self._int()
            return self.refs[idx - 1]
        if t == 1:  # symbol
            sym = ("sym", self.item())
            self.refs.append(sym)
            return sym
        if t in (2, 6):  # pairlist / language: attr, tag, car, cdr
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            car, cdr = self.item(), self.item()
            return [(tag[1] if tag else None, car)] + (cdr if isinstance(cdr, list) else [])
        if t == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            s = self.b[self.p:self.p + n]
            self.p += n
            return s.decode("utf-8" if flags & ((1 << 15) | (1 << 3)) else "latin-1")
        n = self._int()
        if t in (10, 13):
            v = list(struct.unpack_from(f">{n}i", self.b, self.p))
            self.p += 4 * n
        elif t == 14:
            v = list(struct.unpack_from(f">{n}d", self.b, self.p))
            self.p += 8 * n
        elif t in (16, 19):
            v = [self.item() for _ in range(n)]
        else:
            raise ValueError(f"R SEXP type {t} is not supported")
        if has_attr:
            names = dict(self.item()).get("names")
            if t == 19 and names is not None:
                return dict(zip(names, v))
        return v


def read_novels(rdx: bytes, rdb: bytes) -> dict[str, list[str]]:
    """Lines of each novel from the lazy-load database (index: gzip'd serialisation; objects: 4-byte length +
    zlib'd serialisation at the indexed offsets)."""
    index = _RReader(gzip.decompress(rdx)).item()
    out = {}
    for name, (off, length) in index["variables"].items():
        chunk = rdb[int(off):int(off) + int(length)]
        out[name] = _RReader(zlib.decompress(chunk[4:])).item()
    return out


def paragraphs(lines: list[str]) -> list[str]:
    """Gutenberg hard-wrapped lines → one string per paragraph (blank-line separated), ``_italics_`` marks removed,
    whitespace collapsed."""
    paras, cur = [], []
    for line in lines + [""]:
        line = (line or "").strip()
        if line:
            cur.append(line)
        elif cur:
            p = re.sub(r"\s+", " ", " ".join(cur)).replace("_", "")
            paras.append(p)
            cur = []
    return paras


def split_novel(paras: list[str]) -> tuple[list[str], list[str], list[str], list[str]]:
    """(train before, held-out block, calibration block, train after)."""
    starts = np.cumsum([0] + [len(p) + 2 for p in paras])
    total = starts[-1]
    h0 = int(np.searchsorted(starts, HELDOUT_AT * total))

    def take(i0, chars):
        i = i0
        while i < len(paras) and starts[i] - starts[i0] < chars:
            i += 1
        return i

    h1 = take(h0, HELDOUT_CHARS)
    c1 = take(h1, CALIB_CHARS)
    return paras[:h0], paras[h0:h1], paras[h1:c1], paras[c1:]


def corpus_splits(novels: dict[str, list[str]]) -> tuple[list[tuple[str, str]], str, str]:
    """(per novel in NOVELS order: its training text before and after the held-out blocks, held-out text,
    calibration text): the splits of the module docstring."""
    train_parts, held, calib = [], [], []
    for name in NOVELS:
        before, h, c, after = split_novel(paragraphs(novels[name]))
        train_parts.append(("\n\n".join(before), "\n\n".join(after)))
        held.append("\n\n".join(h))
        calib.append("\n\n".join(c))
    return train_parts, "\n\n".join(held) + "\n", "\n\n".join(calib) + "\n"


def training_stream(tok, train_parts: list[tuple[str, str]], eot: int) -> np.ndarray:
    """The training token stream ``[N]`` int32: each part followed by a paragraph break, a novel's last break
    replaced by ``eot`` (<|endoftext|>)."""
    stream = []
    for before, after in train_parts:
        for part in (before, after):
            stream.extend(tok.encode(part).ids)
            stream.extend(tok.encode("\n\n").ids)
        stream[-len(tok.encode("\n\n").ids):] = [eot]  # a novel ends with <|endoftext|>
    return np.asarray(stream, np.int32)


# ---------------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="qjax/assets/default", help="output model folder (replaced)")
    ap.add_argument("--corpus", default=None, help="r-cran-janeaustenr .deb or installed janeaustenr folder")
    ap.add_argument("--minutes", type=float, default=25.0, help="wall-clock budget of the whole script")
    ap.add_argument("--steps", type=int, default=640, help="training steps (fewer if --minutes runs out)")
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reserve-s", type=float, default=150.0,
                    help="seconds kept for saving, evaluation and sampling after training")
    ap.add_argument("--readme-only", action="store_true",
                    help="only rewrite <out>/README.md from <out>/training_log.json")
    a = ap.parse_args(argv)
    if a.readme_only:
        from qjax.model.config import TextConfig

        with open(os.path.join(a.out, "training_log.json"), encoding="utf-8") as f:
            record = json.load(f)
        with open(os.path.join(a.out, "README.md"), "w", encoding="utf-8") as f:
            f.write(render_readme(record, TextConfig.from_file(a.out)))
        return 0
    t0 = time.perf_counter()

    import jax
    import jax.numpy as jnp
    from qjax.convert import save_pretrained

    import qjax
    from qjax.builtin import train as T
    from qjax.builtin.train_tokenizer import ENDOFTEXT, save_tokenizer, train_tokenizer
    from qjax.model.config import GenerationConfig, TextConfig

    def say(msg):
        print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)

    # corpus and splits
    rdx, rdb, source = load_corpus_files(a.corpus)
    novels = read_novels(rdx, rdb)
    missing = set(NOVELS) - set(novels)
    if missing:
        raise SystemExit(f"corpus lacks {sorted(missing)}")
    train_parts, heldout_text, calib_text = corpus_splits(novels)
    n_train_chars = sum(len(x) + len(y) for x, y in train_parts)
    say(f"corpus: {source}; train {n_train_chars:,} chars, held-out {len(heldout_text):,}, "
        f"calibration {len(calib_text):,}")

    # tokenizer (training text only)
    work = tempfile.mkdtemp(prefix="qjax-default-")
    tok = train_tokenizer((p for pair in train_parts for part in pair for p in part.split("\n\n")),
                          vocab_size=MODEL_CONFIG["vocab_size"])
    tok_files = save_tokenizer(tok, work)
    eot = tok.token_to_id(ENDOFTEXT)
    train_ids = training_stream(tok, train_parts, eot)
    held_ids = np.asarray(tok.encode(heldout_text).ids, np.int32)
    say(f"tokenizer: vocab {tok.get_vocab_size()}, train {train_ids.size:,} tokens "
        f"({n_train_chars / train_ids.size:.2f} chars/token), held-out {held_ids.size:,} tokens")

    # model and training
    cfg = TextConfig.from_dict({**MODEL_CONFIG, "eos_token_id": eot, "pad_token_id": eot},
                               source="train_default_model.MODEL_CONFIG")
    model = qjax.init_model(cfg, seed=a.seed)
    n_params = T.count_params(model)
    tc = T.TrainConfig(steps=a.steps, batch=a.batch, seqlen=a.seqlen, lr=a.lr, warmup_steps=a.warmup, seed=a.seed)
    budget = a.minutes * 60 - (time.perf_counter() - t0) - a.reserve_s
    say(f"model: {n_params:,} parameters ({2 * n_params / 1e6:.2f} MB in BF16); training for ≤ {a.steps} steps of "
        f"{a.batch}×{a.seqlen} tokens within {budget:.0f} s")

    def show(step, e):
        if "event" in e:
            say(f"step {step}: {e['step_s']:.3f} s/step → run shortened to {e['steps']} steps")
        else:
            say(f"step {step}: loss {e['loss']:.4f} ce {e['ce']:.4f} aux {e['aux']:.3f} |g| {e['grad_norm']:.2f} "
                f"lr {e['lr']:.2e}")

    t_train = time.perf_counter()
    model, log = T.train(model, T.batches(train_ids, a.batch, a.seqlen, seed=a.seed), tc, time_budget_s=budget,
                         log_every=50, callback=show)
    train_s = time.perf_counter() - t_train
    steps = log[-1]["step"]
    say(f"trained {steps} steps ({steps * a.batch * a.seqlen:,} tokens, "
        f"{steps * a.batch * a.seqlen / train_ids.size:.2f} epochs) in {train_s:.0f} s")

    fp32_nll, n_scored = T.mean_nll(model, held_ids, seqlen=a.seqlen, batch=8)

    # save (BF16) with the tokenizer and the text samples, then reload what was written
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.8, top_p=0.95, eos_token_id=(eot,),
                                               pad_token_id=eot)
    for name, text in (("heldout.txt", heldout_text), ("calib.txt", calib_text)):
        with open(os.path.join(work, name), "w", encoding="utf-8") as f:
            f.write(text)
    out = save_pretrained(model, a.out, dtype=jnp.bfloat16, overwrite=True,
                          extra_files=tok_files + [os.path.join(work, n) for n in ("heldout.txt", "calib.txt")])
    os.chmod(out, 0o755)  # save_pretrained builds the folder with mkdtemp (0700)
    loaded = qjax.load_model(out)
    bf16_nll, _ = T.mean_nll(loaded, held_ids, seqlen=a.seqlen, batch=8)
    uni_nll = T.unigram_nll(train_ids, held_ids, cfg.vocab_size)
    say(f"held-out ({n_scored:,} tokens): fp32 ppl {np.exp(fp32_nll):.2f}, BF16 checkpoint ppl {np.exp(bf16_nll):.2f};"
        f" unigram baseline ppl {np.exp(uni_nll):.1f}")

    prompt = "Once upon a time"
    ids = np.asarray([tok.encode(prompt).ids], np.int32)
    greedy = tok.decode(qjax.generate(loaded, ids, max_new_tokens=80, do_sample=False)[0, ids.shape[1]:].tolist())
    sampled = tok.decode(qjax.generate(loaded, ids, max_new_tokens=80, seed=0)[0, ids.shape[1]:].tolist())
    say(f"greedy : {prompt + greedy!r}")
    say(f"sampled: {prompt + sampled!r}")

    record = {
        "corpus": {"package": f"{DEB_NAME} {DEB_VERSION} (Debian)", "deb_sha256": DEB_SHA256, "source": source,
                   "files": [R_DATA + ".rdx", R_DATA + ".rdb"], "novels": list(NOVELS),
                   "license": "texts public domain (Project Gutenberg); R package and Debian packaging MIT",
                   "train_chars": n_train_chars, "heldout_chars": len(heldout_text), "calib_chars": len(calib_text)},
        "tokenizer": {"kind": "byte-level BPE (Qwen pre-tokenizer)", "vocab_size": tok.get_vocab_size(),
                      "train_tokens": int(train_ids.size), "heldout_tokens": int(held_ids.size)},
        "model": {"parameters": n_params, "config": MODEL_CONFIG},
        "training": {**dataclasses.asdict(tc), "steps_run": steps, "train_seconds": round(train_s, 1),
                     "tokens_seen": steps * a.batch * a.seqlen, "log": log},
        "eval": {"heldout_scored_tokens": n_scored, "seqlen": a.seqlen,
                 "ppl_fp32": round(float(np.exp(fp32_nll)), 3), "ppl_bf16": round(float(np.exp(bf16_nll)), 3),
                 "nll_bf16": round(bf16_nll, 5), "ppl_unigram": round(float(np.exp(uni_nll)), 3)},
        "samples": {"prompt": prompt, "greedy": greedy, "sampled_seed0": sampled},
        "environment": {"python": platform.python_version(), "jax": jax.__version__, "cpu_count": os.cpu_count(),
                        "machine": platform.processor() or platform.machine(),
                        "xla_flags": os.environ.get("XLA_FLAGS", ""),
                        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])},
        "total_seconds": None,
    }
    record["total_seconds"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(out, "training_log.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(render_readme(record, cfg))
    shutil.rmtree(work, ignore_errors=True)
    sizes = {n: os.path.getsize(os.path.join(out, n)) for n in sorted(os.listdir(out))}
    say(f"wrote {out}: {sum(sizes.values()) / 1e6:.2f} MB — " + ", ".join(f"{n} {s / 1e3:.0f} kB"
                                                                        for n, s in sizes.items()))
    return 0


def render_readme(r: dict, cfg) -> str:
    e, t, m = r["eval"], r["training"], r["model"]
    attn = (f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads × {cfg.head_dim}, output gate, "
            f"partial RoPE {cfg.partial_rotary_factor}")
    gdn = (f"{cfg.linear_num_key_heads} key heads × {cfg.linear_key_head_dim}, {cfg.linear_num_value_heads} value "
           f"heads × {cfg.linear_value_head_dim}, conv {cfg.linear_conv_kernel_dim}")
    moe = (f"{cfg.num_experts} experts (top-{cfg.num_experts_per_tok}) × {cfg.moe_intermediate_size} + shared "
           f"expert {cfg.shared_expert_intermediate_size}")
    return f"""# qjax default model

A {m['parameters'] / 1e6:.2f} M-parameter model of the `qwen3_5_moe` architecture (Qwen3.5/3.6-MoE: Gated DeltaNet
linear attention + gated full attention + sparse MoE with a shared expert), trained from scratch by
`benchmarks/train_default_model.py` on Jane Austen's novels, with its own byte-level BPE tokenizer. It ships inside
the package (`qjax/assets/default`) as the model to try qjax with and the small real model the quantization tests
measure (BF16 vs INT4/INT2, RTN vs AutoRound: `heldout.txt` to score, `calib.txt` to calibrate).

It writes English-looking Regency prose and knows nothing else: a demo and a test bed, not an assistant.

## Corpus and license

- Debian package **{r['corpus']['package']}** (Architecture all, .deb SHA256 `{r['corpus']['deb_sha256']}`),
  files `{r['corpus']['files'][0]}` and `.rdb` (R lazy-load database, read by the training script without R).
- The six novels: Sense and Sensibility, Pride and Prejudice, Mansfield Park, Emma, Northanger Abbey, Persuasion.
- License: the texts are Project Gutenberg transcriptions of public-domain works; the R package (Julia Silge) and
  its Debian packaging are MIT. The model weights and the text samples here are redistributed on that basis.
- Split by paragraphs, per novel: the block starting at 80 % of the text (≥ 20 kB) is held out
  (`heldout.txt`, {r['corpus']['heldout_chars']:,} characters), the block right after it (≥ 40 kB) is the
  calibration sample (`calib.txt`, {r['corpus']['calib_chars']:,} characters); both are disjoint from the
  {r['corpus']['train_chars']:,} training characters, which alone trained the tokenizer and the model.

## Model

| | |
|---|---|
| layers | {cfg.num_hidden_layers}: `[linear, linear, linear, full] × {cfg.num_groups}` |
| hidden | {cfg.hidden_size}, vocab {cfg.vocab_size}, tied embeddings |
| full attention | {attn} |
| Gated DeltaNet | {gdn} |
| MoE | {moe} |
| weights | BF16 `model.safetensors` |

Tokenizer: byte-level BPE ({r['tokenizer']['vocab_size']} tokens, Qwen's pre-tokenizer regex), special tokens
`<|endoftext|>` (end of text, the EOS), `<|im_start|>`, `<|im_end|>`, and a ChatML `chat_template`.
`generation_config.json` samples with temperature 0.8, top-p 0.95.

## Training

AdamW (β = {t['b1']}, {t['b2']}; weight decay {t['weight_decay']} on matrices), peak LR {t['lr']} with
{t['warmup_steps']} warmup steps then cosine decay to {t['lr'] * t['min_lr_ratio']:.0e}, gradient clipping
{t['clip_norm']}, MoE load-balancing loss × {t['aux_loss_coef']}; batch {t['batch']} × {t['seqlen']} tokens,
{t['steps_run']} steps ({t['tokens_seen']:,} tokens) in {t['train_seconds']:.0f} s; whole script
{r['total_seconds']:.0f} s on {r['environment']['cpu_count']} CPU cores (XLA flags `{r['environment']['xla_flags']}`).
Reproduce with

    python benchmarks/train_default_model.py --out qjax/assets/default --steps {t['steps_run']} --minutes 40

(`--minutes 25` alone sizes the run to the machine; `training_log.json` has the loss curve and every setting).

## Quality

Held-out perplexity ({e['heldout_scored_tokens']:,} tokens of `heldout.txt`, {e['seqlen']}-token windows):
**{e['ppl_bf16']:.2f}** for this BF16 checkpoint ({e['ppl_fp32']:.2f} in FP32 before saving); an add-one unigram
model of the training tokens scores {e['ppl_unigram']:.1f}.

Continuation of "{r['samples']['prompt']}" sampled with `generation_config.json` (seed 0, 80 tokens):

> {r['samples']['prompt']}{r['samples']['sampled_seed0'].replace(chr(10), ' ')}

Greedy decoding soon loops, as small models do:

> {r['samples']['prompt']}{r['samples']['greedy'].replace(chr(10), ' ')}
"""


if __name__ == "__main__":
    sys.exit(main())
