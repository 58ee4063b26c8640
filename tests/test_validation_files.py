"""Hostile and broken files in a checkpoint folder, part two (the corpus and its machinery: tests/test_validation.py).

What a folder's files can still do once every field is typed: a FIFO in place of a file (an ``open`` that never
returns), a sparse file declaring terabytes, a regular expression with exponential backtracking, an E8M0 scale
whose power of two overflows the weights, token ids of 10^20, ``model.safetensors`` beside an index naming other
tensors, a ``generation_config.json`` asking to sample at temperature 0 — and what qjax writes when the disk is full.
Each case ends in one named error (or, for the sampling one, a one-line note), promptly: anything that could hang
runs under a timeout so a regression fails instead of stalling the suite.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import struct
import threading
import time
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from test_validation import (  # noqa: F401 (bases, run_cli: fixtures)
    EMBED,
    MX,
    Case,
    bases,
    case_folder,
    chain,
    check_case,
    edit_json,
    quant_config,
    run_cli,
    set_value,
    shard,
)

import qjax
from qjax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from qjax.model.config import GenerationConfig


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------
def _headers(path: Path) -> dict[str, np.ndarray]:
    with SafetensorsFile(path) as f:
        return {k: np.array(f.get(k)) for k in f.keys()}


def _single_from(shard_name: str | None, edit=None):
    """After :func:`shard`: a ``model.safetensors`` beside the index — the index's tensors (``shard_name`` None) or
    one shard's only — with ``edit`` applied to them."""
    def mutate(folder: Path):
        names = [shard_name] if shard_name else ["a.safetensors", "b.safetensors"]
        tensors = {k: v for n in names for k, v in _headers(folder / n).items()}
        if edit is not None:
            edit(tensors)
        write_safetensors(folder / "model.safetensors", tensors)
    return mutate


def _sub(tmp_path: Path, name: str) -> Path:
    """A fresh folder for one more case folder in a test (``case_folder`` fills a folder of its own)."""
    sub = tmp_path / name
    sub.mkdir()
    return sub


def _promptly(fn, *, fifos=(), timeout: float = 120.0):
    """``fn()`` in a thread, joined with a timeout: (its exception or None). A regression that blocks on a FIFO fails
    here instead of hanging the suite — the FIFOs are then opened for writing and closed, so the reader sees the end
    of the file and the thread ends."""
    out: dict = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        for p in fifos:
            try:
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(30)
        pytest.fail(f"{fn} did not return within {timeout:.0f} s (blocked on a FIFO?)")
    return out.get("error")


# ---------------------------------------------------------------------------------------------------------------------
# the corpus, continued: load_model and `qjax inspect` (tests/test_validation.py's check_case)
# ---------------------------------------------------------------------------------------------------------------------
BIG = 10 ** 20
ID_CASES = [
    Case("config-eos-huge", "builtin", edit_json("config.json", lambda d: d.update(eos_token_id=BIG)),
         ("config.json", "'eos_token_id'", "from 0 to 4095", "100000000000000000000")),
    Case("config-eos-vocab", "builtin", edit_json("config.json", lambda d: d.update(eos_token_id=[4093, 4096])),
         ("config.json", "'eos_token_id'", "from 0 to 4095")),
    Case("config-pad-huge", "builtin", edit_json("config.json", lambda d: d.update(pad_token_id=BIG)),
         ("config.json", "'pad_token_id'", "≤ 4095")),
    Case("config-bos-vocab", "builtin", edit_json("config.json", lambda d: d.update(bos_token_id=4096)),
         ("config.json", "'bos_token_id'", "≤ 4095")),
    Case("config-image-token-huge", "builtin", edit_json("config.json", lambda d: {
        "model_type": "qwen3_5_moe", "text_config": d, "vision_config": {}, "image_token_id": BIG}),
         ("config.json", "'image_token_id'", "≤ 4095")),
    Case("config-video-token-vocab", "builtin", edit_json("config.json", lambda d: {
        "model_type": "qwen3_5_moe", "text_config": d, "vision_config": {}, "video_token_id": 4096}),
         ("config.json", "'video_token_id'", "≤ 4095")),
    Case("generation-config-eos-huge", "builtin", edit_json("generation_config.json",
                                                            lambda d: d.update(eos_token_id=BIG)),
         ("generation_config.json", "'eos_token_id'", "from 0 to 4095")),
    Case("generation-config-eos-vocab", "builtin", edit_json("generation_config.json",
                                                             lambda d: d.update(eos_token_id=[4096])),
         ("generation_config.json", "'eos_token_id'", "from 0 to 4095")),
    Case("generation-config-pad-huge", "builtin", edit_json("generation_config.json",
                                                            lambda d: d.update(pad_token_id=BIG)),
         ("generation_config.json", "'pad_token_id'")),
]

BOTH_FILES = ("model.safetensors and model.safetensors.index.json", "hold different tensors")
BOTH_CASES = [
    Case("both-single-holds-one-shard", "builtin", chain(shard(), _single_from("a.safetensors")),
         (*BOTH_FILES, "is in the index's b.safetensors only")),
    Case("both-single-holds-more", "builtin", chain(shard(), _single_from(
        None, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}))),
         (*BOTH_FILES, "'model.layers.0.extra.weight' is in model.safetensors only")),
    Case("both-dtype-differs", "builtin", chain(shard(), _single_from(
        None, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.float32)}))),
         (*BOTH_FILES, "'model.norm.weight' is F32 [256] in model.safetensors but BF16 [256] in")),
    Case("both-shard-missing", "builtin", chain(shard(), _single_from(None),
                                                lambda f: (f / "b.safetensors").unlink()),
         ("model.safetensors.index.json", "do not exist", "b.safetensors")),
]

E8M0_CASES = [
    Case("q-e8m0-fe", "quant", set_value(f"{MX}.weight_scale", None, raw_byte=0xFE),
         (f"{MX}.weight_scale", "model.safetensors", "1 E8M0 scale bytes are over 0xF6", "first at index (0, 0): 0xFE",
          "overflows bfloat16"), values_only=True),
    Case("q-e8m0-f7", "quant", set_value("mlp.experts.5.down_proj.weight_scale", None, raw_byte=0xF7),
         ("experts.5.down_proj.weight_scale", "over 0xF6", "0xF7"), values_only=True),
]

REGEX_CASES = [
    Case("q-target-backreference", "quant", quant_config(lambda q: next(iter(q["config_groups"].values()))[
        "targets"].append(r"re:(.*)\1$")), ("config.json", "quantization_config.config_groups.group_",
                                           ".targets: regex", r"'(.*)\\1$'",
                                           "cannot be matched in linear time")),
    Case("q-ignore-lookahead", "quant", quant_config(lambda q: q["ignore"].append("re:(?!lm_head).*_x")),
         ("config.json", "quantization_config.ignore", "'(?!lm_head).*_x'", "linear time")),
    Case("q-ignore-huge-pattern", "quant", quant_config(lambda q: q["ignore"].append("re:" + "a?" * 3000)),
         ("config.json", "quantization_config.ignore", "6000 characters long, over the limit of 4096")),
    Case("q-ignore-posix-class", "quant", quant_config(lambda q: q["ignore"].append("re:[[:alpha:]]+_x")),
         ("config.json", "quantization_config.ignore", "POSIX bracket")),
    Case("ar-extra-config-backreference", "autoround", edit_json("config.json", lambda d: d[
        "quantization_config"].setdefault("extra_config", {}).update({r"(q_proj)\1": {"bits": 16}})),
         ("config.json", "quantization_config.extra_config", r"'(q_proj)\\1'", "linear time")),
]

FILE_CASES = ID_CASES + BOTH_CASES + E8M0_CASES + REGEX_CASES


@pytest.mark.parametrize("case", FILE_CASES, ids=lambda c: c.name)
def test_a_broken_checkpoint_file_gets_its_named_error(case, bases, tmp_path, run_cli):
    check_case(case, bases, tmp_path, run_cli)


# ---------------------------------------------------------------------------------------------------------------------
# 1. generation_config.json: do_sample with temperature 0 is greedy, with a one-line note
# ---------------------------------------------------------------------------------------------------------------------
def test_sampling_at_temperature_zero_is_greedy_with_a_note(caplog):
    from qjax.serving.protocol import Defaults

    with caplog.at_level(logging.WARNING, logger="qjax"):
        gc = GenerationConfig.from_dict({"do_sample": True, "temperature": 0, "top_p": 0.9}, source="g.json")
    assert gc.do_sample is False and gc.top_p == 0.9
    assert [r.getMessage() for r in caplog.records] == [
        "g.json: do_sample is true with temperature 0: decoding greedily, as vLLM does"]
    assert Defaults.from_generation_config(gc).temperature == 0.0  # the server's default: greedy
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qjax"):
        assert GenerationConfig.from_dict({"do_sample": True, "temperature": 0.7}).do_sample is True
        assert GenerationConfig.from_dict({"do_sample": False, "temperature": 0}).do_sample is False
    assert not caplog.records


def test_qjax_generate_prints_the_greedy_note_once(bases, tmp_path, run_cli, monkeypatch):
    folder = case_folder(Case("t0", "builtin", edit_json("generation_config.json", lambda d: d.update(
        do_sample=True, temperature=0)), ()), bases, tmp_path)
    # as on the command line: the warning reaches no handler (pytest's sit on the root logger), so Python's
    # last-resort handler writes it to stderr
    monkeypatch.setattr(logging.getLogger("qjax"), "propagate", False)
    rc, err = run_cli("generate", "--model", str(folder), "--ids", "1 2 3", "--max-new-tokens", "2")
    assert rc == 0, err
    notes = [line for line in err.splitlines() if "temperature 0" in line]
    assert notes == [f"{folder}/generation_config.json: do_sample is true with temperature 0: decoding greedily, "
                     "as vLLM does"], err
    model = qjax.load_model(folder)
    assert model.generation_config.do_sample is False  # qjax.generate's default: greedy


# ---------------------------------------------------------------------------------------------------------------------
# 2. model.safetensors beside an index: transformers' choice (model.safetensors), when the two agree
# ---------------------------------------------------------------------------------------------------------------------
def test_model_safetensors_wins_over_an_index_that_agrees(bases, tmp_path, run_cli):
    from qjax.checkpoint.layout import checkpoint_tensors

    def bump(t):
        t["model.norm.weight"] = (t["model.norm.weight"].astype(np.float32) + 1).astype(t["model.norm.weight"].dtype)

    folder = case_folder(Case("agree", "builtin", chain(shard(), _single_from(None, bump)), ()), bases, tmp_path)
    want = _headers(folder / "model.safetensors")["model.norm.weight"]
    shards = {**_headers(folder / "a.safetensors"), **_headers(folder / "b.safetensors")}
    assert not np.array_equal(want, shards["model.norm.weight"])  # vLLM would load these
    model = qjax.load_model(folder)
    got = {k: get for k, _, get in checkpoint_tensors(model)}["model.norm.weight"]()
    np.testing.assert_array_equal(np.asarray(got), want)  # the single file's values, as transformers loads them
    rc, err = run_cli("inspect", "--verify", str(folder))
    assert rc == 0, err


# ---------------------------------------------------------------------------------------------------------------------
# 3. E8M0 scale bytes against the dtype the weights dequantize to
# ---------------------------------------------------------------------------------------------------------------------
def test_e8m0_limits_follow_the_model_dtype(bases, tmp_path, run_cli):
    from qjax.quant.packing import e8m0_max_byte

    assert [e8m0_max_byte(d) for d in (None, jnp.bfloat16, jnp.float32, jnp.float16, np.float64)] == \
        [246, 246, 246, 134, 246]
    for dtype, top in (("bfloat16", 246), ("float16", 134)):  # the rule: 448·2^(e−127), rounded, is finite
        with np.errstate(over="ignore"):
            finite = [np.isfinite(np.float32(448 * 2.0 ** (e - 127)).astype(jnp.bfloat16).astype(dtype))
                      for e in (top, top + 1)]
        assert finite == [True, False], dtype
    folder = case_folder(Case("e135", "quant", set_value(f"{MX}.weight_scale", None, raw_byte=135), ()), bases,
                         tmp_path)
    qjax.load_model(folder)  # 2^8 · 448 is finite in bfloat16
    with pytest.raises(ValueError, match=r"E8M0 scale bytes are over 0x86 \(first at index \(0, 0\): 0x87\): "
                                         r"448·2\^\(e−127\) overflows float16"):
        qjax.load_model(folder, dtype="float16")
    rc, err = run_cli("inspect", "--verify", "--dtype", "float16", str(folder))
    assert rc == 2 and "overflows float16" in err and f"{MX}.weight_scale" in err, err


# ---------------------------------------------------------------------------------------------------------------------
# 4. FIFOs (and other non-files) are refused before they are opened, and a load returns promptly
# ---------------------------------------------------------------------------------------------------------------------
def _fifo(folder: Path, name: str) -> str:
    path = folder / name
    if path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return str(path)


@pytest.mark.parametrize("name,reader", [
    ("generation_config.json", "load"), ("model.safetensors", "load"), ("config.json", "load"),
    ("tokenizer_config.json", "tokenizer"), ("chat_template.jinja", "tokenizer"), ("tokenizer.json", "tokenizer"),
    ("chat_templates/tool_use.jinja", "tokenizer")])
def test_a_fifo_in_the_folder_is_refused_promptly(name, reader, bases, tmp_path, run_cli):
    from qjax.tokenizer import Tokenizer

    folder = case_folder(Case(f"fifo-{name}", "builtin", lambda f: None, ()), bases, tmp_path)
    fifo = _fifo(folder, name)
    results: dict = {}

    def go():
        if reader == "tokenizer":
            try:
                Tokenizer.from_folder(folder)
            except ValueError as e:
                results["load"] = str(e)
            return
        try:
            qjax.load_model(folder)
        except ValueError as e:
            results["load"] = str(e)
        results["inspect"] = run_cli("inspect", str(folder))

    started = time.monotonic()
    error = _promptly(go, fifos=[fifo])
    assert error is None, repr(error)
    assert time.monotonic() - started < 60
    want = "no config.json found" if name == "config.json" else f"{fifo} is not a regular file (a FIFO)"
    assert want in results.get("load", ""), results
    if reader == "load":
        rc, err = results["inspect"]
        assert rc == 2 and err.startswith("error: ") and want in err, err


def test_open_regular_refuses_what_is_not_a_file(tmp_path):
    from qjax.validation import open_regular, read_regular

    (tmp_path / "f.json").write_text('{"a": 1}')
    with open_regular(tmp_path / "f.json", what="a JSON file", max_bytes=8) as f:
        assert f.read() == b'{"a": 1}'
    fifo = _fifo(tmp_path, "p.json")
    cases = [(fifo, "is not a regular file (a FIFO); a JSON file is read only from a regular file"),
             (str(tmp_path), "is a directory, not a JSON file"),
             ("/dev/zero", "is not a regular file (a character device)"),
             (str(tmp_path / "gone.json"), "gone.json: no such file"),
             (str(tmp_path / "f.json"), "f.json is 8 bytes, over the limit of 4 bytes for a JSON file")]
    for path, text in cases:
        error = _promptly(lambda: read_regular(path, what="a JSON file", max_bytes=4), fifos=[fifo], timeout=30)
        assert isinstance(error, ValueError) and text in str(error), (path, error)
    error = _promptly(lambda: read_regular(fifo, what="x", max_bytes=4, where="--opt"), fifos=[fifo], timeout=30)
    assert str(error).startswith(f"--opt: {fifo} is not a regular file"), error


def test_a_calibration_file_that_is_a_fifo_is_refused(tmp_path):
    from qjax.autoround.data import CalibrationError, calibration_ids

    fifo = _fifo(tmp_path, "calib.jsonl")
    error = _promptly(lambda: calibration_ids(fifo, None, nsamples=1, seqlen=4), fifos=[fifo], timeout=30)
    assert isinstance(error, CalibrationError) and f"--dataset: {fifo} is not a regular file (a FIFO)" in str(error)


# ---------------------------------------------------------------------------------------------------------------------
# 5. regular expressions from files run in linear time
# ---------------------------------------------------------------------------------------------------------------------
# Python's backtracking engine tries 2^n ways for `(.|.)*X` against an n-character name without an X: ~2^40 for
# model.layers.0.mlp.shared_expert.gate_proj — the loader used to run for hours. RE2 answers in microseconds.
SLOW_FOR_PYTHON = "(.|.)*X$"


def test_a_catastrophic_pattern_does_not_hang_the_loader(bases, tmp_path, run_cli):
    from qjax.validation import compile_pattern

    t0 = time.monotonic()
    assert not re.match(SLOW_FOR_PYTHON, "model.layers.0.mlp.g")  # 20 characters already take Python a while
    python_20 = time.monotonic() - t0
    rx = compile_pattern(SLOW_FOR_PYTHON, where="w")
    t0 = time.monotonic()
    assert not rx.match("model.layers.0.mlp." * 10_000)
    assert time.monotonic() - t0 < max(1.0, python_20)
    for base, mutate in (
            ("quant", quant_config(lambda q: q["ignore"].append("re:" + SLOW_FOR_PYTHON))),
            ("quant", quant_config(lambda q: next(iter(q["config_groups"].values()))["targets"].append(
                "re:" + SLOW_FOR_PYTHON))),
            ("autoround", edit_json("config.json", lambda d: d["quantization_config"].setdefault(
                "extra_config", {}).update({SLOW_FOR_PYTHON: {"bits": 16}})))):
        folder = case_folder(Case("slow", base, mutate, ()), bases, _sub(tmp_path, str(len(os.listdir(tmp_path)))))
        out: dict = {}
        error = _promptly(lambda: out.update(rc=run_cli("inspect", str(folder)), model=qjax.load_model(folder)),
                          timeout=120)
        assert error is None, repr(error)
        assert out["rc"][0] == 0, out["rc"][1]


def test_patterns_keep_python_semantics():
    from qjax.validation import compile_pattern

    cases = [(r"re:.*self_attn\.(q|k|v|o)_proj$", "model.layers.3.self_attn.q_proj", True),
             (r".*self_attn\.(q|k|v|o)_proj$", "model.layers.3.self_attn.q_proj.x", False),
             (r"a{,2}b", "aab", True), (r"a{,2}b", "a{,2}b", False),  # Python 3.11: {,n} is {0,n}
             (r"lm_head\Z", "lm_head", True), (r"[]x]+", "]x]", True), (r"\d+", "12", True)]
    for pattern, name, want in cases:
        rx = compile_pattern(pattern.removeprefix("re:"), where="w")
        assert bool(rx.match(name)) is want is bool(re.match(pattern.removeprefix("re:"), name)), pattern
    assert compile_pattern("mlp", where="w").match("model.mlp") is None  # match anchors at the start, as re.match
    assert compile_pattern("mlp", where="w").search("model.mlp") is not None  # search does not, as re.search
    assert compile_pattern("[a-", where="w", invalid_ok=True) is None  # auto-round: not a regex → a literal name
    with pytest.raises(ValueError, match=r"^f\.json: x: invalid regex '\[a-'"):
        compile_pattern("[a-", where="f.json: x")


# ---------------------------------------------------------------------------------------------------------------------
# 6. the memory a load needs, against what the device has, before anything is read
# ---------------------------------------------------------------------------------------------------------------------
def _sparse_checkpoint(folder: Path, config_edit, tensors_edit) -> int:
    """Rewrite ``folder`` as a sparse checkpoint: config.json edited, the headers of model.safetensors edited (name →
    (dtype, shape); None drops a tensor) and the data left as a hole. Returns the file's apparent size."""
    cfg = json.loads((folder / "config.json").read_text())
    config_edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    with SafetensorsFile(folder / "model.safetensors") as f:
        entries = {k: (f.dtype(k), list(f.shape(k))) for k in f.keys()}
    tensors_edit(entries)
    size = {"BF16": 2, "F32": 4}
    header, offset = {}, 0
    for k, (dt, shape) in entries.items():
        n = int(np.prod(shape, dtype=np.int64)) * size[dt]
        header[k] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (folder / "model.safetensors").unlink()
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # a hole: nothing on disk
    return 8 + len(raw) + offset


def test_a_sparse_checkpoint_is_refused_against_available_memory(bases, tmp_path, monkeypatch):
    """The tester's case: vocab_size at its bound, the embedding 8 GiB of hole in a 10 MB file."""
    from qjax.model.config import MAX_VOCAB

    folder = case_folder(Case("sparse-vocab", "builtin", lambda f: None, ()), bases, tmp_path)
    size = _sparse_checkpoint(folder, lambda c: c.update(vocab_size=MAX_VOCAB),
                              lambda e: e.update({EMBED: ("BF16", [MAX_VOCAB, 256])}))
    assert size > 8 << 30 and os.stat(folder / "model.safetensors").st_blocks * 512 < 64 << 20
    monkeypatch.setattr("qjax.checkpoint.loading.available", lambda device=None: (4 << 30, "test memory"))
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        qjax.load_model(folder)
    assert time.monotonic() - t0 < 30
    (folder / "model.safetensors").unlink()
    message = str(info.value)
    assert message.startswith(f"{folder}: loading needs 8.0") and "GiB" in message, message
    assert "but the test memory is 4.00 GiB (4,294,967,296 bytes); refused before reading" in message, message


def test_a_checkpoint_larger_than_any_machine_is_refused(bases, tmp_path):
    """No stand-in for the machine's memory: fused experts declared 65,536 wide, a terabyte and a half of hole."""
    from qjax.model.memory import host_available

    def tensors(e: dict) -> None:
        for k in [k for k in e if ".mlp.experts." in k or k.startswith("mtp.")]:
            del e[k]
        for i in range(8):
            p = f"model.layers.{i}.mlp."
            e[p + "gate.weight"] = ("BF16", [65536, 256])
            e[p + "experts.gate_up_proj"] = ("BF16", [65536, 2 * 2048, 256])
            e[p + "experts.down_proj"] = ("BF16", [65536, 256, 2048])

    folder = case_folder(Case("sparse-experts", "builtin", lambda f: None, ()), bases, tmp_path)
    try:
        size = _sparse_checkpoint(folder, lambda c: c.update(num_experts=65536, moe_intermediate_size=2048,
                                                              mtp_num_hidden_layers=0), tensors)
    except OSError as e:  # a file system without sparse files of this size
        pytest.skip(f"cannot make a 1.5 TiB sparse file here: {e}")
    try:
        have = host_available()
        if have is not None and have > size:
            pytest.skip(f"this machine has {have:,} bytes available")
        with pytest.raises(ValueError, match=r"loading needs 1,536\.\d\d GiB .* but the available host memory "
                                             r"\(MemAvailable\) is"):
            _promptly_raise(lambda: qjax.load_model(folder))
    finally:
        (folder / "model.safetensors").unlink()  # no terabyte-sized file (even a hole) left in pytest's folders


def _promptly_raise(fn):
    error = _promptly(fn, timeout=120)
    if error is not None:
        raise error


# ---------------------------------------------------------------------------------------------------------------------
# 7. tokenizer.json is bounded before the tokenizers library parses it
# ---------------------------------------------------------------------------------------------------------------------
def test_a_huge_tokenizer_json_is_refused_unread(bases, tmp_path):
    from qjax.autoround.data import CalibrationError, load_tokenizer
    from qjax.tokenizer import Tokenizer, TokenizerError
    from qjax.validation import MAX_TOKENIZER_BYTES

    folder = case_folder(Case("big-tokenizer", "builtin", lambda f: None, ()), bases, tmp_path)
    with open(folder / "tokenizer.json", "r+b") as f:
        f.truncate(MAX_TOKENIZER_BYTES + 1)  # sparse: the size is what counts, nothing is read
    want = f"tokenizer.json is {MAX_TOKENIZER_BYTES + 1} bytes, over the limit of 67108864 bytes for tokenizer.json"
    with pytest.raises(TokenizerError, match=re.escape(want)):
        Tokenizer.from_folder(folder)
    with pytest.raises(CalibrationError, match=re.escape(want)):
        load_tokenizer(folder)


# ---------------------------------------------------------------------------------------------------------------------
# 8. token ids through `qjax generate`
# ---------------------------------------------------------------------------------------------------------------------
def test_qjax_generate_names_a_huge_eos_id(bases, tmp_path, run_cli):
    for name, fragment in (("config.json", "'eos_token_id' must be a list of integers from 0 to 4095"),
                           ("generation_config.json", "'eos_token_id' must be a list of integers from 0 to")):
        folder = case_folder(Case(f"eos-{name}", "builtin", edit_json(name, lambda d: d.update(eos_token_id=BIG)),
                                  ()), bases, _sub(tmp_path, name))
        rc, err = run_cli("generate", "--model", str(folder), "--ids", "1 2 3", "--max-new-tokens", "2")
        assert rc == 2 and err.startswith(f"error: {folder}/{name}: field ") and fragment in err, err
        assert err.count("\n") == 1, err


# ---------------------------------------------------------------------------------------------------------------------
# 9. a full disk while writing: no partial file left, the path named
# ---------------------------------------------------------------------------------------------------------------------
def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_during_a_progress_save(tmp_path, monkeypatch):
    from qjax.autoround import progress

    ar = types.SimpleNamespace(progress_dir=str(tmp_path / "p"), fingerprint={"run": 1}, reports=[], kv_scales={},
                               results={0: {}})
    progress.start(ar)

    def half_written(file, **arrays):  # np.savez writing its first bytes, then the disk is full
        if isinstance(file, str):
            file = open(file if file.endswith(".npz") else file + ".npz", "wb")  # noqa: SIM115
        file.write(b"PK\x03\x04")
        file.flush()
        _enospc()

    monkeypatch.setattr(np, "savez", half_written)
    with pytest.raises(OSError) as info:
        progress.save_block(ar, 0)
    block = os.path.join(ar.progress_dir, "block_0000.npz")
    assert str(info.value) == f"[Errno 28] cannot write {block}: No space left on device"
    assert os.listdir(ar.progress_dir) == ["state.json"]
    monkeypatch.undo()
    monkeypatch.setattr(json, "dump", _enospc)
    with pytest.raises(OSError, match=re.escape(f"cannot write {ar.progress_dir}/state.json: No space left")):
        progress.save_block(ar, 0)
    assert sorted(os.listdir(ar.progress_dir)) == ["block_0000.npz", "state.json"]  # the old state kept whole


class _FullDisk:
    """A file object whose writes fail with ENOSPC after ``budget`` bytes (what a full disk does)."""

    def __init__(self, f, budget: int):
        self.f, self.budget = f, budget

    def write(self, data):
        n = len(memoryview(data).cast("B")) if not isinstance(data, str) else len(data)
        if n > self.budget:
            self.f.write(data[:self.budget] if isinstance(data, (bytes, str)) else bytes(memoryview(data).cast("B"))
                         [:self.budget])
            self.f.flush()
            _enospc()
        self.budget -= n
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.fixture
def full_disk(monkeypatch):
    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _FullDisk(real(fd, *a, **k), 100))


def test_a_full_disk_during_a_safetensors_or_checkpoint_write(tmp_path, full_disk):
    from qjax.validation import replacing

    path = tmp_path / "x.safetensors"
    with pytest.raises(OSError, match=re.escape(f"[Errno 28] cannot write {path}: No space left on device")):
        write_safetensors(path, {"w": np.zeros((64, 64), np.float32)})
    assert os.listdir(tmp_path) == []
    with pytest.raises(OSError, match=re.escape(f"cannot write {tmp_path}/y.txt: No space")):
        with replacing(tmp_path / "y.txt", "w") as f:
            f.write("x" * 1000)
    assert os.listdir(tmp_path) == []


def test_a_full_disk_during_save_pretrained(bases, tmp_path, monkeypatch):
    from qjax.convert import save_pretrained

    model = qjax.load_model(bases["builtin"])
    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _FullDisk(real(fd, *a, **k), 1000))
    out = tmp_path / "out"
    with pytest.raises(OSError) as info:
        save_pretrained(model, out)
    assert str(info.value) == (f"[Errno 28] writing {out} failed: cannot write {out}/model.safetensors: No space "
                               "left on device"), str(info.value)
    assert os.listdir(tmp_path) == []  # no temporary folder, no partial file


# ---------------------------------------------------------------------------------------------------------------------
# 10. calibration ids beyond the vocabulary: the file, the line or record, the id and the vocabulary
# ---------------------------------------------------------------------------------------------------------------------
def test_calibration_ids_beyond_the_vocabulary_name_the_line(tmp_path):
    from qjax.autoround.data import CalibrationError, calibration_ids

    jl = tmp_path / "ids.jsonl"
    jl.write_text("\n".join(json.dumps({"input_ids": ids}) for ids in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 5000, 1, 2])))
    with pytest.raises(CalibrationError) as info:
        calibration_ids(str(jl), None, nsamples=2, seqlen=4, vocab_size=4096)
    assert str(info.value) == (f"{jl}:3: input_ids holds token id 5000 (position 1), outside the model's vocabulary "
                               "(4096 tokens)")
    js = tmp_path / "ids.json"
    js.write_text(json.dumps([{"input_ids": [1, 2, 3, 4]}, {"input_ids": [4096, 1, 2, 3]}]))
    with pytest.raises(CalibrationError, match=re.escape(f"{js}[1]: input_ids holds token id 4096 (position 0)")):
        calibration_ids(str(js), None, nsamples=2, seqlen=4, vocab_size=4096)
