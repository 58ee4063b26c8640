"""``qjax generate`` and ``qjax chat`` run like a user runs them: the real entry point in a subprocess, the built-in
model, text streamed to stdout, bad input as one ``error:`` line with status 2, Ctrl-C as status 130."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from qjax.checkpoint.hub import default_model_dir
from qjax.cli.chat import render_conversation
from qjax.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

PROMPT_RE = re.compile(r"--- prompt \((\d+) tokens\) ---\n(.*?)\n--- end of prompt ---\n", re.S)


def _qjax(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qjax.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_generate_streams_text():
    r = _qjax("generate", "It is a truth universally acknowledged", "--max-new-tokens", "12", "--show-prompt")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 10 and "\ufffd" not in r.stdout
    n = int(PROMPT_RE.search(r.stderr).group(1))
    assert n == len(Tokenizer.from_folder(default_model_dir()).encode("It is a truth universally acknowledged"))


def test_chat_keeps_history_and_resets():
    stdin = "Who is Emma?\nAnd her friend Harriet?\n/reset\nGood morning.\n\nnever read: the empty line ended it\n"
    r = _qjax("chat", "--max-new-tokens", "8", "--system", "You are Jane Austen.", "--show-prompt", stdin=stdin)
    assert r.returncode == 0, r.stderr
    prompts = [m.group(2) for m in PROMPT_RE.finditer(r.stderr)]
    assert len(prompts) == 3 and ">>>" not in r.stdout  # no prompt marker when stdin is a pipe
    system = "<|im_start|>system\nYou are Jane Austen.<|im_end|>\n"
    assert prompts[0] == system + "<|im_start|>user\nWho is Emma?<|im_end|>\n<|im_start|>assistant\n"
    # the second prompt holds the first exchange, with the answer that was streamed to stdout
    first = re.fullmatch(re.escape(prompts[0]) + r"(.*)<\|im_end\|>\n<\|im_start\|>user\nAnd her friend Harriet\?"
                         r"<\|im_end\|>\n<\|im_start\|>assistant\n", prompts[1], re.S)
    assert first is not None, prompts[1]
    assert r.stdout.startswith(first.group(1) + "\n")
    # /reset: the third turn starts over
    assert prompts[2] == system + "<|im_start|>user\nGood morning.<|im_end|>\n<|im_start|>assistant\n"


def test_render_conversation_uses_the_template():
    tok = Tokenizer.from_folder(default_model_dir())
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
               {"role": "user", "content": "c"}]
    assert render_conversation(tok, history, system="s") == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
        "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n")


def test_folder_without_tokenizer_is_a_clear_error(tmp_path):
    shutil.copy(os.path.join(default_model_dir(), "config.json"), tmp_path)
    for cmd in (["generate", "--model", str(tmp_path), "hello"], ["chat", "--model", str(tmp_path)]):
        line = _one_error_line(_qjax(*cmd, stdin=""))
        assert str(tmp_path) in line and "tokenizer.json" in line


def test_tokenizer_from_another_folder(tmp_path):
    """A checkpoint folder without tokenizer files runs with --tokenizer pointing at one that has them: the same
    greedy text as the complete folder (generate; and perplexity through `qjax eval ppl`)."""
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(default_model_dir(), name), tmp_path)
    args = ["--max-new-tokens", "6", "--no-do-sample", "It was"]
    whole = _qjax("generate", *args)
    split = _qjax("generate", "--model", str(tmp_path), "--tokenizer", default_model_dir(), *args)
    assert whole.returncode == split.returncode == 0, split.stderr
    assert split.stdout == whole.stdout and split.stdout.strip()
    data = os.path.join(default_model_dir(), "heldout.txt")
    ppl = [_qjax("eval", "ppl", *m, "--data", data, "--seqlen", "64", "--max-tokens", "130", "--json", "--quiet")
           for m in (["--model", default_model_dir()], ["--model", str(tmp_path), "--tokenizer", default_model_dir()])]
    assert all(r.returncode == 0 for r in ppl), ppl[1].stderr
    import json
    assert json.loads(ppl[0].stdout)["ppl"] == json.loads(ppl[1].stdout)["ppl"]


def test_prompt_longer_than_the_context_is_a_clear_error():
    tok = Tokenizer.from_folder(default_model_dir())
    long = "word " * 5000
    line = _one_error_line(_qjax("generate", long))
    assert f"the prompt is {len(tok.encode(long))} tokens" in line
    assert "context is 4096" in line and "max_position_embeddings" in line
    # fits alone, not with the answer: the error names what would fit
    fits = "word " * 4000
    line = _one_error_line(_qjax("generate", fits, "--max-new-tokens", "200"))
    n = len(tok.encode(fits))
    assert f"({n} tokens) plus --max-new-tokens 200 needs {n + 200} positions" in line
    assert f"use --max-new-tokens {4096 - n} or less" in line


def test_max_new_tokens_must_be_positive():
    line = _one_error_line(_qjax("generate", "hello", "--max-new-tokens", "0"))
    assert "--max-new-tokens must be at least 1, got 0" in line
    line = _one_error_line(_qjax("chat", "--max-new-tokens", "-3", stdin="hi\n"))
    assert "--max-new-tokens must be at least 1, got -3" in line


def test_ctrl_c_during_generation_exits_130_without_traceback():
    # a job started in the background by a non-interactive shell (CI runners, nohup) inherits SIGINT ignored, and
    # Python keeps it ignored; a terminal user's process has the default action, which is what is tested here
    p = subprocess.Popen([sys.executable, "-m", "qjax.cli", "generate", "It is a truth", "--no-do-sample",
                          "--max-new-tokens", "4000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = p.stdout.read1(64)  # blocks until generated text arrives
        assert first, p.stderr.read()
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err.decode()
    assert b"Traceback" not in err and err.strip() == b""
    assert out.endswith(b"\n")
