"""Image input in ``qjax serve``: the engine's image requests (in-process, batched with text and other images, their
image tokens split over prefill chunks) get exactly ``qjax.generate(images=…)``'s greedy tokens; a live server on the
tiny VL checkpoint answers the official ``openai`` client's image chats (data: URI, file:// under
--allowed-local-media-path, streaming) with those tokens and the expanded prompt length; every bad image, URL or
limit is one clear 400 naming the request part; --limit-mm-per-prompt and --allowed-local-media-path as vLLM's."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import os
import re
import threading
import time
import types

import numpy as np
import pytest
import requests
from oracles.hf import VL_SPECIALS, random_image, write_vl_checkpoint
from serve_util import Server

import qjax
from qjax.serving import Engine, EngineConfig, EngineError, SamplingParams
from qjax.serving.engine import encode_images
from qjax.tokenizer import CHATML_STOP_TOKENS, Tokenizer

I, S, E = (VL_SPECIALS[t] for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
# what `qjax serve` stops on for this folder: its eos (<|im_end|>) and the ChatML stop tokens the tokenizer adds
EOS = tuple(VL_SPECIALS[t] for t in CHATML_STOP_TOKENS)
# merged tokens: 64×64 → 8×8 = 64; 30×30 → 4×4 = 16; 64×20 → 8×3 = 24; 40×56 → 5×7 = 35
IMAGES = [random_image(64, 64, seed=1), random_image(30, 30, seed=2), random_image(64, 20, seed=3),
          random_image(40, 56, seed=4)]
# the in-process engine and the live server run the same engine configuration (their programs are the same)
CFG = EngineConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=128, decode_steps=4)
SERVE_FLAGS = ["--max-num-seqs", "4", "--max-model-len", "256", "--max-num-batched-tokens", "128",
               "--num-scheduler-steps", "4", "--no-warmup", "--seed", "0"]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return write_vl_checkpoint(tmp_path_factory.mktemp("vl") / "vl")


@pytest.fixture(scope="module")
def model(vl_dir):
    return qjax.load_model(vl_dir)


def references(model, prompts: list[list[int]], images: list | None, n: int) -> list[list[int]]:
    """qjax.generate's greedy tokens for left-padded ``prompts`` in one batch (each row's are its tokens alone,
    tests/test_vision.py), ``images`` for their placeholders in order; each cut after its first stop token."""
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], mask[r, width - len(p):] = p, 1
    out = qjax.generate(model, ids, attention_mask=mask, images=images, max_new_tokens=n, do_sample=False,
                        eos_token_id=list(EOS), pad_token_id=0)
    got = []
    for row in out[:, -n:].tolist():
        stop = next((i for i, t in enumerate(row) if t in EOS), None)
        got.append(row if stop is None else row[:stop + 1])
    return got


def chat_ids(vl_dir) -> list[int]:
    """The rendered prompt of :func:`chat_body`'s messages with one image (one placeholder)."""
    tok = Tokenizer.from_folder(vl_dir)
    rendered = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Describe this image."}, {"type": "image"}]}], add_generation_prompt=True)
    return tok.encode(rendered)


@pytest.fixture(scope="module")
def want(model, vl_dir) -> dict[str, list[int]]:
    """qjax.generate's 8 greedy tokens for every image prompt of this module, in one batch (one compile)."""
    prompts = {"text": _words(64, seed=1), "a": _image_prompt(1, seed=2), "b": _image_prompt(2, seed=4),
               "chat": chat_ids(vl_dir)}
    got = references(model, list(prompts.values()), [IMAGES[0], IMAGES[1], IMAGES[2], IMAGES[3]], 8)
    return {k: (p, g) for (k, p), g in zip(prompts.items(), got)}


def _words(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 480, n)]


def _image_prompt(n_images: int, seed: int) -> list[int]:
    ids = _words(4, seed)
    for k in range(n_images):
        ids += [S, I, E] + _words(3, seed + 100 + k)
    return ids


# ---------------------------------------------------------------------------------------------------------------------
# the engine, in-process
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # > 7 s on 2 cores (compiles the engine's image prefill variants and the references)
def test_engine_image_requests_equal_generate(model, want):
    engine = Engine(model, CFG, eos_token_ids=EOS)
    sp = SamplingParams(max_tokens=8, temperature=0)
    (text, want_text), (a, want_a), (b, want_b) = want["text"], want["a"], want["b"]
    raw = _words(3, seed=3) + [I, 11, 12]  # a raw image-token id in a text prompt: its own embedding, as alone
    # 64 text tokens take half of the first call's 128-token budget; a with its 64×64 image is 73 tokens, 64 of them
    # (59 image tokens) in the first call; b has two images of other sizes
    (a_ids, a_in), (b_ids, b_in) = encode_images(model, a, IMAGES[:1]), encode_images(model, b, IMAGES[1:3])
    assert (len(a_ids), len(b_ids)) == (len(a) - 1 + 64, len(b) - 2 + 16 + 16)  # placeholders expanded

    # calls: [text 64 | a 0:64] (the image split), [a 64:73 | raw 6] (a's last 5 image tokens beside a text row
    # holding the image id), [b 46]; all four then decode together
    outs = engine.generate([text, a_ids, raw, b_ids], sp, images=[None, a_in, None, b_in])
    assert [outs[i].new_token_ids for i in (0, 1, 3)] == [want_text, want_a, want_b]
    prefills = {k[1] for k in engine.compiled if k[0] == "prefill_images"}
    assert (2, 64) in prefills and (1, 64) in prefills, engine.compiled  # several sequences per image call
    assert not any(k[0] == "prefill" for k in engine.compiled)  # every call held an image row: no text program
    # raw alone runs the text program (calls without an image row are unchanged): the same tokens
    [raw_alone] = engine.generate([raw], sp)
    assert outs[2].new_token_ids == raw_alone.new_token_ids
    assert any(k[0] == "prefill" for k in engine.compiled)
    # a alone (the same programs): the same tokens
    [alone] = engine.generate([a_ids], sp, images=[a_in])
    assert alone.new_token_ids == want_a


def test_engine_refuses_bad_image_input(vl_dir, model):
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=32),
                    eos_token_ids=EOS)
    ids, inp = encode_images(model, _image_prompt(1, seed=5), IMAGES[1:2])
    sp = SamplingParams(max_tokens=4)
    with pytest.raises(EngineError, match="position_ids must be"):
        engine.add_request("a", ids + [5], sp, lambda o: None, images=inp)
    with pytest.raises(EngineError, match="embeds must be"):
        engine.add_request("b", ids, sp, lambda o: None,
                           images=type(inp)(position_ids=inp.position_ids, embeds=inp.embeds[1:]))
    with pytest.raises(EngineError, match=r"prompt \(\d+ tokens\) \+ max_tokens \(120\)"):
        engine.add_request("c", ids, SamplingParams(max_tokens=120), lambda o: None, images=inp)
    text_only = Engine(qjax.load_model(vl_dir, text_only=True), EngineConfig(max_num_seqs=2, max_model_len=128),
                       eos_token_ids=EOS)
    with pytest.raises(EngineError, match="vision tower is not loaded"):
        text_only.add_request("d", ids, sp, lambda o: None, images=inp)


# ---------------------------------------------------------------------------------------------------------------------
# request parsing, file access and flags (no server)
# ---------------------------------------------------------------------------------------------------------------------
def test_content_parts_become_template_parts():
    from qjax.serving.protocol import ApiError, ChatCompletionRequest, ImagePart, chat_messages

    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u1"}},
                                     {"type": "image_url", "image_url": "u2"}, {"type": "input_image",
                                                                                "image_url": "u3"},
                                     {"type": "image", "image": "u4"}, {"image_url": {"url": "u5"}}]}]})
    messages, images = chat_messages(req)
    assert messages[0]["content"] == "be brief"
    assert messages[1]["content"] == [{"type": "text", "text": "a"}] + [{"type": "image"}] * 5
    assert images == [ImagePart(f"messages[1].content[{j}].{k}", f"u{j}")
                      for j, k in ((1, "image_url"), (2, "image_url"), (3, "image_url"), (4, "image"),
                                   (5, "image_url"))]
    for part, text in [({"type": "video_url", "video_url": {"url": "v"}}, "content[0]: video input is not supported"),
                       ({"type": "input_audio", "input_audio": {}}, "audio input is not supported"),
                       ({"type": "image_url", "image_url": {"url": 3}}, "content[0].image_url: the image URL must"),
                       ({"type": "image_url"}, "needs image_url.url"),
                       ({"type": "hologram"}, "'hologram' is not supported")]:
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [part]}]})
        with pytest.raises(ApiError, match=re.escape(text)) as e:
            chat_messages(req)
        assert e.value.status == 400 and "messages[0].content[0]" in e.value.message


def test_images_with_speculation_or_without_a_tower_are_refused(model):
    from qjax.serving.api import _check_images
    from qjax.serving.protocol import ApiError, ImagePart

    one = [ImagePart("messages[0].content[1].image_url", "data:")]
    state = types.SimpleNamespace(image_limit=None, engine=types.SimpleNamespace(model=model, k=2))
    with pytest.raises(ApiError, match=r"content\[1\].image_url: image input with MTP speculative decoding"):
        _check_images(state, one)
    state.engine = types.SimpleNamespace(model=types.SimpleNamespace(vision_config=None), k=0)
    with pytest.raises(ApiError, match="image input is unavailable: this checkpoint is text-only"):
        _check_images(state, one)


def test_file_urls_only_under_the_allowed_folder(tmp_path):
    from qjax.serving.api import _decode_images
    from qjax.serving.protocol import ApiError, ImagePart

    inside, outside = tmp_path / "media", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    IMAGES[1].save(inside / "a.png")
    IMAGES[1].save(outside / "b.png")
    os.symlink(outside / "b.png", inside / "link.png")
    where = "messages[0].content[1].image_url"

    def decode(url, allowed, max_bytes=20 << 20, max_pixels=1 << 26):
        state = types.SimpleNamespace(media_path=allowed, max_image_bytes=max_bytes, max_image_pixels=max_pixels)
        return _decode_images(state, [ImagePart(where, url)])

    [im] = decode(f"file://{inside}/a.png", str(inside))
    assert np.array_equal(np.asarray(im), np.asarray(IMAGES[1]))
    decode(f"file://localhost{inside}/../media/a.png", str(inside))  # resolved, still inside
    for url, allowed, text in [
            (f"file://{inside}/a.png", None, "file:// image URLs are refused: .*--allowed-local-media-path DIR"),
            (f"file://{outside}/b.png", str(inside), "is not under --allowed-local-media-path"),
            (f"file://{inside}/link.png", str(inside), "is not under --allowed-local-media-path"),  # a link out
            (f"file://{inside}/../elsewhere/b.png", str(inside), "is not under"),
            (f"file://{inside}/missing.png", str(inside), "no such file"),
            (f"file://{inside}", str(inside), "is a directory"),
            ("file://host/x.png", str(inside), "no host")]:
        with pytest.raises(ApiError, match=text) as e:
            decode(url, allowed)
        assert e.value.status == 400 and e.value.message.startswith(where + ": "), e.value.message
    # --max-image-pixels (on the header, before decoding) and --max-image-bytes, for files and data: URIs alike
    size = (inside / "a.png").stat().st_size
    data = "data:image/png;base64," + base64.b64encode((inside / "a.png").read_bytes()).decode()
    for url in (f"file://{inside}/a.png", data):
        with pytest.raises(ApiError, match="30x30 pixels .* over the limit of 899 pixels"):
            decode(url, str(inside), max_pixels=899)
        with pytest.raises(ApiError, match="over the limit of 100"):
            decode(url, str(inside), max_bytes=100)
    assert size > 100


def test_limit_mm_per_prompt_and_media_path_flags(tmp_path, capsys):
    from qjax.cli import main
    from qjax.cli.serve import ServeError, media_path, mm_limits

    assert mm_limits(None) == {}
    assert mm_limits('{"image": 0, "video": 0}') == {"image": 0, "video": 0}
    assert mm_limits("image=3,video=1") == {"image": 3, "video": 1}
    assert mm_limits('{"image": {"count": 2, "width": 512, "height": 512}, "audio": 1}') == {"image": 2, "audio": 1}
    for text, msg in [('{"image": 1', "not JSON"), ("[1]", "expected JSON"), ('{"imag": 1}', "unknown modality 'imag'"),
                      ('{"image": -1}', "non-negative"), ('{"image": true}', "non-negative"),
                      ('{"image": {"size": 3}}', 'needs "count"'), ("image=x", "expected JSON")]:
        with pytest.raises(ServeError, match=msg):
            mm_limits(text)
    assert media_path(str(tmp_path)) == os.path.realpath(tmp_path)
    with pytest.raises(ServeError, match="no such folder"):
        media_path(str(tmp_path / "nope"))
    # the command line: one line, exit status 2, before any model is read
    for flags, msg in [(["--limit-mm-per-prompt", '{"image": 1'], "--limit-mm-per-prompt: not JSON"),
                       (["--limit-mm-per-prompt", '{"image": 1, "vidoe": 0}'], "unknown modality 'vidoe'"),
                       (["--allowed-local-media-path", str(tmp_path / "nope")], "no such folder")]:
        capsys.readouterr()
        assert main(["serve", str(tmp_path / "no-model"), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0], err


# ---------------------------------------------------------------------------------------------------------------------
# a live server and the openai client
# ---------------------------------------------------------------------------------------------------------------------
def data_uri(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def chat_body(*urls: str, **extra) -> dict:
    parts = [{"type": "text", "text": "Describe this image."}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}], **extra}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    IMAGES[3].save(folder / "photo.png")
    return folder


@pytest.fixture(scope="module")
def server(vl_dir, media):
    s = Server([vl_dir, *SERVE_FLAGS, "--allowed-local-media-path", str(media), "--limit-mm-per-prompt",
                '{"image": 2, "video": 0}'])
    yield s
    s.stop()


@pytest.mark.slow
@pytest.mark.subprocess
def test_openai_client_image_chat_equals_generate(server, vl_dir, model, media, want):
    import openai

    tok = Tokenizer.from_folder(vl_dir)
    ids, want = want["chat"]
    assert ids.count(I) == 1
    expanded, _ = encode_images(model, ids, [IMAGES[3]])

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    body = chat_body(data_uri(IMAGES[3]))
    r = client.chat.completions.create(model=vl_dir, messages=body["messages"], max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == want
    assert choice.model_extra["prompt_token_ids"] == expanded
    assert choice.message.content == tok.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(expanded) == len(ids) - 1 + 35
    assert r.usage.completion_tokens == len(want)

    # a file under --allowed-local-media-path: the same image, the same answer
    f = client.chat.completions.create(model=vl_dir, messages=chat_body(f"file://{media}/photo.png")["messages"],
                                       max_tokens=8, temperature=0)
    assert f.choices[0].message.content == choice.message.content

    # streaming
    chunks = list(client.chat.completions.create(model=vl_dir, messages=body["messages"], max_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.prompt_tokens == len(expanded)

    # /tokenize counts the expanded prompt too
    t = requests.post(server.url + "/tokenize", json=body, timeout=60).json()
    assert t["count"] == len(expanded) and t["tokens"] == expanded


@pytest.mark.slow
@pytest.mark.subprocess
def test_bad_images_are_one_clear_400_each(server, media, tmp_path):
    IMAGES[1].save(tmp_path / "outside.png")
    good = data_uri(IMAGES[1])
    at = "messages[0].content[2].image_url: "  # the second image part (after the text and a good image)
    cases = [
        (chat_body(good, "https://example.com/cat.png"), at + "qjax does not fetch remote images"),
        (chat_body(good, "data:image/png;base64,!!not base64!!"), at + "data: URI is not valid base64"),
        (chat_body(good, "data:text/plain;base64,aGVsbG8="), at + "data: URI media type must be image/"),
        (chat_body(good, "data:image/png;base64," + base64.b64encode(b"GIF89a but not really").decode()),
         at + "cannot decode image"),
        (chat_body(good, f"file://{tmp_path}/outside.png"), at + f"{tmp_path}/outside.png is not under "
                                                                  f"--allowed-local-media-path"),
        (chat_body(good, f"file://{media}/nothing.png"), at + "no such file"),
        (chat_body(good, "ftp://x/y.png"), at + "unsupported URL scheme 'ftp'"),
        (chat_body(good, good, good), "messages: 3 images in one request, more than the 2 per prompt that "
                                      "--limit-mm-per-prompt allows"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {
            "type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]},
         "messages[0].content[1]: video input is not supported"),
        (chat_body(good, max_tokens=250), "tokens with its images) + max_tokens (250)"),
    ]
    for body, text in cases:
        r = requests.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 4, **body}, timeout=60)
        assert r.status_code == 400, (r.status_code, r.text)
        err = r.json()["error"]
        assert text in err["message"] and err["type"] == "BadRequestError" and err["code"] == 400, err
        assert "\n" not in err["message"]
    ok = requests.post(server.url + "/v1/chat/completions", json=chat_body(good, max_tokens=2), timeout=120)
    assert ok.status_code == 200, ok.text


def test_image_limit_zero_skips_the_tower(vl_dir, monkeypatch, capsys):
    """``qjax serve --limit-mm-per-prompt '{"image": 0}'`` up to the point it would listen: the model is loaded
    without its tower (and says so), and image parts are refused naming the limit."""
    import qjax.cli.serve as serve
    from qjax.cli import main
    from qjax.serving.api import _check_images
    from qjax.serving.protocol import ApiError, ImagePart

    served = []
    monkeypatch.setattr(serve, "serve_app", lambda app, engine, *a, **k: served.append(app.state.server) or 0)
    for limit, tower in (('{"image": 0, "video": 0}', False), ("image=1", True)):
        capsys.readouterr()
        assert main(["serve", vl_dir, *SERVE_FLAGS, "--limit-mm-per-prompt", limit]) == 0
        state = served.pop()
        err = capsys.readouterr().err
        assert (state.engine.model.visual is not None) == tower
        assert ("--limit-mm-per-prompt image 0: the vision tower is not loaded" in err) == (not tower), err
        one, two = [ImagePart("messages[0].content[1].image_url", "data:")], [ImagePart("x", "y")] * 2
        if tower:
            _check_images(state, one)
            with pytest.raises(ApiError, match="2 images in one request, more than the 1 per prompt"):
                _check_images(state, two)
            continue
        with pytest.raises(ApiError) as e:
            _check_images(state, one)
        assert e.value.status == 400 and e.value.message == (
            "messages[0].content[1].image_url: image input is disabled on this server (--limit-mm-per-prompt "
            "image 0: the vision tower is not loaded)")


@pytest.mark.slow
@pytest.mark.subprocess
def test_large_image_uploads_take_memory_one_request_at_a_time_and_give_it_back(server):
    """Twelve concurrent uploads of an 80 KB PNG that decodes to 5,000 × 5,000 pixels (75 MB of RGB each; such
    uploads took a server to 6.7 GB): each is decoded, resized to the processor's max_pixels and answered; the server
    never holds more than one request's decoded images (the vision lock covers decoding), and afterwards its
    resident size is back within 200 MiB of where it was."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (5000, 5000), (200, 30, 60)).save(buf, "PNG", optimize=True)
    big = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    pid = server.proc.pid

    def rss() -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))

    small = chat_body(data_uri(IMAGES[1]), max_tokens=2)
    assert requests.post(server.url + "/v1/chat/completions", json=small, timeout=120).status_code == 200
    time.sleep(2.5)
    before, peak = rss(), [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda _: requests.post(server.url + "/v1/chat/completions", json=chat_body(
            big, max_tokens=2), timeout=300), range(12)))
    stop.set()
    watcher.join()
    assert all(r.status_code == 200 for r in got), [r.text[:200] for r in got]
    time.sleep(2.5)  # the memory release runs at most every 2 s
    assert requests.post(server.url + "/v1/chat/completions", json=small, timeout=120).status_code == 200
    after = rss()
    # one request's image at a time: decoded and transposed (2 × 75 MB) and its float32 patches (~250 MB) — well
    # under 1 GB over the baseline; twelve at once would be several GB
    assert peak[0] - before < 1 << 30, (before >> 20, peak[0] >> 20)
    assert after - before < 200 << 20, (before >> 20, peak[0] >> 20, after >> 20)


@pytest.mark.slow  # the warm-up compiles every program (~30 on this model): minutes on 2 cores
def test_no_request_compiles_after_the_warm_up(vl_dir, model):
    """After Engine.warmup (what `qjax serve` runs before /health says 200), a mixed stream through the HTTP app —
    plain, logprobs, echo with prompt log-probabilities, n > 1 sampled, stop strings, a prompt longer than a prefill
    chunk, streamed chat with top_logprobs, images of several sizes, requests at once — traces and lowers nothing."""
    import concurrent.futures

    import jax.monitoring
    from starlette.testclient import TestClient

    from qjax.serving.api import ServerState, create_app
    from qjax.serving.metrics import ServerMetrics

    engine = Engine(model, CFG, eos_token_ids=EOS)
    plan = [what for what, _ in engine.warmup_plan()]
    assert any("images" in w for w in plan) and any(w.startswith("vision tower") for w in plan)
    engine.warmup()
    engine.start()
    tok = Tokenizer.from_folder(vl_dir)
    app = create_app(ServerState(engine=engine, tokenizer=tok, served_names=("vl",), root=vl_dir,
                                 metrics=ServerMetrics("vl")))
    counting = threading.Event()
    seen: list[str] = []

    def listener(event, duration, **kw):
        if counting.is_set() and event in ("/jax/core/compile/jaxpr_trace_duration",
                                           "/jax/core/compile/jaxpr_to_mlir_module_duration"):
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    words = " ".join(f"w{i}" for i in range(100, 300))  # 200 tokens: more than one 128-token prefill chunk
    bodies = [
        ("/v1/completions", {"prompt": "w1 w2 w3", "max_tokens": 5, "temperature": 0}),
        ("/v1/completions", {"prompt": "w4 w5", "max_tokens": 4, "logprobs": 3}),
        ("/v1/completions", {"prompt": "w6 w7 w8 w9", "max_tokens": 0, "echo": True, "logprobs": 1}),
        ("/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 3, "prompt_logprobs": 2}),
        ("/v1/completions", {"prompt": "w10", "max_tokens": 6, "n": 3, "temperature": 0.9, "top_k": 20,
                             "top_p": 0.9, "seed": 5}),
        ("/v1/completions", {"prompt": "w11 w12", "max_tokens": 8, "stop": ["w3"], "temperature": 0}),
        ("/v1/completions", {"prompt": words, "max_tokens": 4, "temperature": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w20 w21"}], "max_tokens": 4,
                                  "logprobs": True, "top_logprobs": 2, "stream": True}),
        ("/v1/chat/completions", chat_body(data_uri(IMAGES[0]), max_tokens=3)),
        ("/v1/chat/completions", chat_body(data_uri(IMAGES[2]), data_uri(IMAGES[3]), max_tokens=3)),
        ("/v1/chat/completions", chat_body(data_uri(random_image(120, 90, seed=9)), max_tokens=3)),
    ]
    try:
        with TestClient(app) as client:
            counting.set()
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                got = list(pool.map(lambda b: client.post(b[0], json=b[1]), bodies))
            counting.clear()
        assert all(r.status_code == 200 for r in got), [r.text[:300] for r in got]
    finally:
        counting.clear()
        engine.shutdown()
    assert seen == [], f"{len(seen)} programs traced or lowered after the warm-up"
