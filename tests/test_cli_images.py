"""Images on the command line, on the tiny VL checkpoint (tests/oracles/hf.py ``write_vl_checkpoint``):
``qjax generate --image`` (the text of ``qjax.generate`` greedy, whose tokens are transformers'), ``/image`` in
``qjax chat`` (the images stay in the conversation for later turns), every error as one ``error:`` line with status 2
(chat goes on), and ``qjax inspect`` counting the vision tower (``model.visual.*``) as loading holds it."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from oracles.hf import hf_vl_inputs, hf_vl_model, random_image, write_vl_checkpoint

PROMPT_RE = re.compile(r"--- prompt \((\d+) tokens(?:, of which (\d+) for (\d+) images?)?\) ---\n(.*?)\n"
                       r"--- end of prompt ---\n", re.S)
QUESTION = "Describe this image."
IMAGE_HW = (32, 32)  # 8×8 patches of 4 pixels → 16 merged tokens with the tiny VL processor (no resize)
IMAGE_TOKENS = 16
NEW = 8


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    return write_vl_checkpoint(tmp_path_factory.mktemp("vl-cli") / "ckpt")


@pytest.fixture(scope="module")
def image_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("images") / "photo.png"
    random_image(*IMAGE_HW, seed=3).save(path)
    return str(path)


@pytest.fixture(scope="module")
def towerless_dir(vl_dir, tmp_path_factory) -> str:
    """The VL folder (vision_config kept) with every model.visual.* tensor removed."""
    from safetensors.numpy import load_file, save_file

    dst = tmp_path_factory.mktemp("vl-no-tower")
    for name in os.listdir(vl_dir):
        if name != "model.safetensors":
            shutil.copy(os.path.join(vl_dir, name), dst)
    tensors = load_file(os.path.join(vl_dir, "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.visual.")}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def text_only_dir(vl_dir, tmp_path_factory) -> str:
    """The VL folder with config.json's vision_config removed: a text-only model (its tower is skipped)."""
    dst = tmp_path_factory.mktemp("vl-text-only") / "ckpt"
    shutil.copytree(vl_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["vision_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def _qjax(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qjax.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def _render(folder: str, messages: list[dict]) -> str:
    from qjax.tokenizer import Tokenizer

    return Tokenizer.from_folder(folder).apply_chat_template(messages, add_generation_prompt=True)


def _image_turn(text: str) -> dict:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def _greedy(model, tok, prompt_text: str, images) -> tuple[np.ndarray, int, str]:
    """qjax.generate greedy on the prompt: (all tokens, the expanded prompt length, the answer's text up to the stop
    token as the CLI prints it)."""
    import qjax
    from qjax.multimodal.prompt import prepare_images

    ids = np.array([tok.encode(prompt_text)])
    out = qjax.generate(model, ids, images=images, max_new_tokens=NEW)
    n = prepare_images(model, ids, None, images).input_ids.shape[1]
    new = [int(t) for t in out[0, n:]]
    stop = set(tok.stop_token_ids)
    cut = next((i for i, t in enumerate(new) if t in stop), len(new))
    return out, n, tok.decode(new[:cut])


def _main_error(capsys, argv: list[str], stdin: str | None = None, monkeypatch=None) -> list[str]:
    """Run the CLI in this process: status 2 and the stderr lines."""
    from qjax.cli import main

    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error line"
    return err


def _one_error(capsys, argv: list[str]) -> str:
    lines = _main_error(capsys, argv)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------------
# qjax generate --image
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.subprocess
def test_generate_image_prints_the_greedy_text_transformers_gives(vl_dir, image_file):
    import torch

    import qjax
    from qjax.tokenizer import Tokenizer

    r = _qjax("generate", "--model", vl_dir, "--image", image_file, QUESTION, "--max-new-tokens", str(NEW),
              "--show-prompt")
    assert r.returncode == 0, r.stderr
    # --image implies the chat template: the image part before the text in the one user turn
    rendered = _render(vl_dir, [_image_turn(QUESTION)])
    assert rendered.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>" + QUESTION)
    m = PROMPT_RE.search(r.stderr)
    assert m.group(4) == rendered
    tok = Tokenizer.from_folder(vl_dir)
    model = qjax.load_model(vl_dir)
    out, n, text = _greedy(model, tok, rendered, [image_file])
    # the count shown is the prompt that runs: the placeholder widened to the image's tokens
    assert (int(m.group(1)), int(m.group(2)), int(m.group(3))) == (n, IMAGE_TOKENS, 1)
    assert n == len(tok.encode(rendered)) - 1 + IMAGE_TOKENS
    assert text and r.stdout == text + "\n"
    # and those tokens are transformers' Qwen3_5MoeForConditionalGeneration greedy tokens
    hf = hf_vl_model(vl_dir)
    with torch.no_grad():
        want = hf.generate(**hf_vl_inputs(vl_dir, [random_image(*IMAGE_HW, seed=3)], out[:, :n]),
                           max_new_tokens=NEW, do_sample=False).numpy()
    np.testing.assert_array_equal(out, want)


def test_generate_image_errors_are_one_line(vl_dir, image_file, towerless_dir, text_only_dir, tmp_path, capsys):
    """Each refused before the model loads: one ``error:`` line, status 2."""
    missing = str(tmp_path / "missing.png")
    line = _one_error(capsys, ["generate", "--model", vl_dir, "--image", missing, QUESTION])
    assert line == f"error: --image: no such file: {missing}"
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 8)
    line = _one_error(capsys, ["generate", "--model", vl_dir, "--image", image_file, "--image", str(corrupt), "hi"])
    assert line.startswith(f"error: --image: cannot decode image file {corrupt}: ")
    line = _one_error(capsys, ["generate", "--model", text_only_dir, "--image", image_file, QUESTION])
    assert f"{text_only_dir} is a text-only checkpoint (its config.json has no vision_config)" in line
    line = _one_error(capsys, ["generate", "--model", towerless_dir, "--image", image_file, QUESTION])
    assert f"{towerless_dir} has no vision tower" in line and "no model.visual.* tensors" in line
    line = _one_error(capsys, ["generate", "--image", image_file, QUESTION])  # the built-in model
    assert "the built-in model is text-only" in line and "--model" in line
    line = _one_error(capsys, ["generate", "--model", vl_dir, "--image", image_file, "--ids", "1 2"])
    assert "--image" in line and "--ids" in line
    line = _one_error(capsys, ["generate", "--model", vl_dir, "--image", image_file, QUESTION, "--speculative", "mtp"])
    assert "--speculative does not take image input" in line


def test_generate_image_context_check_counts_the_image_tokens(vl_dir, image_file, capsys):
    """The prompt fits the 512-position context as rendered (11 tokens + 490), not once the image's placeholder is
    widened to its 16 tokens: the check uses the length that runs."""
    from qjax.tokenizer import Tokenizer

    n_text = len(Tokenizer.from_folder(vl_dir).encode(_render(vl_dir, [_image_turn(QUESTION)])))
    n = n_text - 1 + IMAGE_TOKENS
    new = 512 - n_text - 1
    line = _one_error(capsys, ["generate", "--model", vl_dir, "--image", image_file, QUESTION, "--max-new-tokens",
                               str(new)])
    assert f"the prompt ({n} tokens) plus --max-new-tokens {new} needs {n + new} positions" in line
    assert f"use --max-new-tokens {512 - n} or less" in line


# ---------------------------------------------------------------------------------------------------------------------
# qjax chat /image
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_chat_image_stays_in_the_conversation(vl_dir, image_file, capsys, monkeypatch):
    """/image, a question about it, a follow-up: the second turn runs the whole conversation again with its image.
    In this process (``qjax.cli.main``, stdin a pipe), so that the library's runs below reuse the chat's compiled
    prefill and decode step."""
    import qjax
    from qjax.cli import main
    from qjax.tokenizer import Tokenizer

    monkeypatch.setattr(sys, "stdin", io.StringIO(f"/image {image_file}\n{QUESTION}\nw5 w6\n"))
    assert main(["chat", "--model", vl_dir, "--max-new-tokens", str(NEW), "--show-prompt"]) == 0
    r = capsys.readouterr()
    assert f"attached {image_file} ({IMAGE_HW[1]}×{IMAGE_HW[0]}, {IMAGE_TOKENS} image tokens)\n" in r.err
    prompts = [m.groups() for m in PROMPT_RE.finditer(r.err)]
    assert len(prompts) == 2
    assert prompts[0][3] == _render(vl_dir, [_image_turn(QUESTION)])
    answers = r.out.split("\n")
    assert len(answers) == 3 and answers[2] == ""
    # the follow-up re-renders the whole conversation: the image in the first user turn, the streamed answer, then
    # the new text turn; the image runs again (its 16 tokens counted)
    assert prompts[1][3] == _render(vl_dir, [_image_turn(QUESTION), {"role": "assistant", "content": answers[0]},
                                             {"role": "user", "content": "w5 w6"}])
    assert [p[1:3] for p in prompts] == [(str(IMAGE_TOKENS), "1")] * 2
    # each answer is the library's greedy text on that prompt with the conversation's image
    tok = Tokenizer.from_folder(vl_dir)
    model = qjax.load_model(vl_dir)
    stop = set(tok.stop_token_ids)
    for (count, _, _, text), answer in zip(prompts, answers):
        ids = np.array([tok.encode(text)])
        new = []
        for step in qjax.stream(model, ids, images=[image_file], max_new_tokens=NEW):
            if int(step[0]) in stop:
                break
            new.append(int(step[0]))
        assert answer == tok.decode(new)
        assert int(count) == ids.shape[1] - 1 + IMAGE_TOKENS


def test_chat_image_errors_keep_the_chat_going(vl_dir, image_file, towerless_dir, tmp_path, capsys, monkeypatch):
    """No turn runs here (no generation): each bad /image is one line, the good one is attached, status 2."""
    corrupt = tmp_path / "corrupt.jpg"
    corrupt.write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 40)
    missing = tmp_path / "missing.png"
    lines = _main_error(capsys, ["chat", "--model", vl_dir],
                        stdin=f"/image {missing}\n/image\n/image {corrupt}\n/image \"{image_file}\"\n",
                        monkeypatch=monkeypatch)
    assert lines[0] == f"error: /image: no such file: {missing}"
    assert lines[1].startswith("error: /image: give an image file")
    assert lines[2].startswith(f"error: /image: cannot decode image file {corrupt}: ")
    assert lines[3] == f"attached {image_file} ({IMAGE_HW[1]}×{IMAGE_HW[0]}, {IMAGE_TOKENS} image tokens)"
    assert len(lines) == 4
    # models that take no images: one line each, the conversation goes on to the next line
    for argv, want in ((["chat", "--model", towerless_dir], f"{towerless_dir} has no vision tower"),
                       (["chat"], "the built-in model is text-only")):
        lines = _main_error(capsys, argv, stdin=f"/image {image_file}\n/image {image_file}\n",
                            monkeypatch=monkeypatch)
        assert len(lines) == 2 and all(x.startswith("error: /image: ") and want in x for x in lines), lines


# ---------------------------------------------------------------------------------------------------------------------
# qjax inspect
# ---------------------------------------------------------------------------------------------------------------------
def _visual_headers(folder: str) -> tuple[int, int]:
    """(tensors, bytes) of model.visual.* read straight from the safetensors header."""
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    visual = {k: v for k, v in header.items() if k.startswith("model.visual.")}
    return len(visual), sum(v["data_offsets"][1] - v["data_offsets"][0] for v in visual.values())


def test_inspect_counts_the_vision_tower(vl_dir, capsys):
    """The tower's row: its tensor count and bytes as the safetensors header has them; in the device memory, or
    skipped with --text-only (tests/test_planner.py checks those bytes against what loading allocates)."""
    from qjax.cli import main
    from qjax.convert.planner import _gib, plan_folder

    n, nbytes = _visual_headers(vl_dir)
    assert n > 0
    p = plan_folder(vl_dir)
    assert (p.vision_loaded, p.vision_tensors, p.vision_disk_bytes, p.vision_dtype) == (True, n, nbytes, "float32")
    assert p.vision_device_bytes == nbytes  # stored in float32, held in float32
    assert main(["inspect", vl_dir]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^vision tower \(model\.visual\.\*, kept in float32\) +F32 +{n} +{re.escape(_gib(nbytes))}$",
                     out, re.M), out
    assert f"weights as qjax holds them: {_gib(p.device_bytes)} (vision tower: {n} tensors, {_gib(nbytes)}" in out
    assert "skipped" not in out

    t = plan_folder(vl_dir, text_only=True)
    assert (t.vision_loaded, t.vision_tensors, t.vision_disk_bytes, t.vision_device_bytes) == (False, n, nbytes, 0)
    assert t.device_bytes == p.device_bytes - nbytes
    assert main(["inspect", vl_dir, "--text-only"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^vision tower \(model\.visual\.\*, skipped: --text-only\) +F32 +{n} +"
                     rf"{re.escape(_gib(nbytes))}$", out, re.M), out
    assert f"weights as qjax holds them: {_gib(t.device_bytes)} (vision tower not loaded" in out
    assert _one_error(capsys, ["inspect", "--config", os.path.join(vl_dir, "config.json"), "--recipe", "w4a16",
                               "--text-only"]).startswith("error: --text-only applies to a checkpoint PATH")
