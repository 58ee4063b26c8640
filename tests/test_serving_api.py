"""``qjax serve`` as its users meet it: a live server on 127.0.0.1 (the built-in model, float32) driven by the official
``openai`` client, lm-eval's own ``local-completions`` / ``local-chat-completions`` models, 64 concurrent clients,
broken requests, a client that walks away, SIGTERM; a mesh server; the seed model cards' ``vllm serve`` lines.

Every token a request gets must equal what ``qjax.generate`` gives that request alone (greedy and seeded)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import shutil
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import pytest
import requests
from eval_tasks import austen_tasks
from hypothesis import HealthCheck, Phase, given, settings
from serve_util import Server, alone

import qjax
from qjax.checkpoint.hub import default_model_dir
from qjax.serving import SamplingParams
from qjax.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

KEY = "sk-qjax-test"
NAME = "qjax-test"
ARGS = [default_model_dir(), "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256", "--served-model-name", NAME, "--api-key", KEY, "--seed", "0"]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    s = Server(ARGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model():
    return qjax.load_model(default_model_dir(), dtype=jnp.float32)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(default_model_dir())


def eos(model):
    return tuple(model.generation_config.eos_token_id)


def _post(server, path: str, body: dict, **kw) -> requests.Response:
    return requests.post(server.url + path, json=body, headers=AUTH, timeout=300, **kw)


# ---------------------------------------------------------------------------------------------------------------------
# the openai client
# ---------------------------------------------------------------------------------------------------------------------
def test_openai_client(server, model, tok):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == [NAME]
    prompt = "It is a truth universally acknowledged"
    ids = tok.encode(prompt)

    greedy = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                       extra_body={"return_token_ids": True})
    want = alone(model, ids, SamplingParams(max_tokens=16, temperature=0))
    assert greedy.choices[0].model_extra["token_ids"] == want
    assert greedy.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert greedy.usage.prompt_tokens == len(ids) and greedy.usage.completion_tokens == len(want)

    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, top_k=20, seed=7)
    sampled = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0.8, top_p=0.95,
                                        seed=7, extra_body={"top_k": 20, "return_token_ids": True})
    assert sampled.choices[0].model_extra["token_ids"] == alone(model, ids, sp)

    messages = [{"role": "system", "content": "You are a novelist."}, {"role": "user", "content": "Who is Emma?"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"return_token_ids": True})
    chat_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    want_chat = alone(model, chat_ids, SamplingParams(max_tokens=12, temperature=0))
    assert chat.choices[0].model_extra["token_ids"] == want_chat
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == tok.decode(want_chat, skip_special_tokens=True)

    pieces = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in pieces if c.choices) == greedy.choices[0].text
    assert pieces[-1].usage.completion_tokens == len(want) and pieces[-2].choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content

    # log-probabilities: top-k alternatives in both shapes
    lp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy: the top token
    stop = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[" the"])
    full = greedy.choices[0].text
    if " the" in full:
        assert stop.choices[0].text == full[:full.index(" the")] and stop.choices[0].finish_reason == "stop"


def test_the_port_is_bound_before_the_warm_up_and_health_tells_the_progress(server):
    """vLLM's /health: 503 until the server can serve (here: while it compiles every program a request can reach,
    one stderr line each with a total), then 200."""
    first, last = server.health[0], server.health[-1]
    assert first[0] == 503 and json.loads(first[1])["status"] == "starting", server.health[:3]
    assert last == (200, "")
    err = "".join(server.stderr)
    assert err.splitlines()[0].startswith("qjax serve: compile cache ")
    lines = [x for x in err.splitlines() if x.startswith("qjax serve: compiled ")]
    n = int(lines[0].split()[3].split("/")[1])
    assert len(lines) == n and lines[-1].startswith(f"qjax serve: compiled {n}/{n} ") and " in " in lines[-1]
    assert f"qjax serve: {n} programs compiled in " in err and "qjax serve: ready" in err
    m = requests.get(server.url + "/metrics", timeout=10).text  # vLLM's names beside qjax's
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "qjax:num_requests_running"):
        assert name in m, name


def test_speculative_server_serves_the_same_tokens(model, tok):
    """``--speculative-config`` as vLLM takes it: a batch of greedy prompts (rows accepting different counts inside
    one engine), chat and streaming give exactly the tokens qjax.generate gives each prompt alone; /metrics counts
    the drafts and what was accepted, per position."""
    import openai

    conf = '{"method": "mtp", "num_speculative_tokens": 2}'
    # its own smaller limits (4 rows, 128 slots): the warm-up, which compiles every verify and prefill program a
    # request can reach, stays on and is half the size of the default server's (~80 -> ~40 s on 2 cores)
    s = Server([*ARGS, "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
                "--speculative-config", conf])
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY)
        prompts = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome, clever, and rich,",
                   "The family of Dashwood"]
        out = client.completions.create(model=NAME, prompt=prompts, max_tokens=24, temperature=0,
                                        extra_body={"return_token_ids": True})
        for choice in out.choices:
            ids = tok.encode(prompts[choice.index])
            assert choice.model_extra["token_ids"] == alone(model, ids, SamplingParams(max_tokens=24, temperature=0))
        messages = [{"role": "user", "content": "Who is Emma?"}]
        chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)
        chat_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        want = alone(model, chat_ids, SamplingParams(max_tokens=16, temperature=0))
        assert chat.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
        chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
        sampled = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=16, temperature=0.8, seed=3)
        assert sampled.choices[0].text == client.completions.create(model=NAME, prompt=prompts[0], max_tokens=16,
                                                                    temperature=0.8, seed=3).choices[0].text
        m = s.metrics()
        drafts, accepted = m["qjax:spec_decode_num_draft_tokens_total"], m["qjax:spec_decode_num_accepted_tokens_total"]
        assert m["qjax:spec_decode_num_drafts_total"] * 2 == drafts and 0 < accepted <= drafts
        assert "× 4 with MTP speculation" in "".join(s.stderr)
    finally:
        assert s.stop() == 0


# ---------------------------------------------------------------------------------------------------------------------
# lm-eval through the endpoint vs lm-eval on qjax directly
# ---------------------------------------------------------------------------------------------------------------------
def test_lm_eval_through_the_server_equals_qjax_lm_eval(server, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import qjax.evaluation.lm_eval_adapter  # noqa: F401 (registers "qjax")

    austen_tasks(tmp_path / "tasks")
    for k, v in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
                 "OPENAI_API_KEY": KEY, "TOKENIZERS_PARALLELISM": "false"}.items():
        monkeypatch.setenv(k, v)
    tm = TaskManager(include_path=str(tmp_path / "tasks"))

    def run(model, args, tasks, **kw):
        out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=tasks, task_manager=tm, limit=16,
                                      log_samples=True, **kw)
        return out["results"], out["samples"]

    direct, direct_s = run("qjax", f"pretrained={default_model_dir()},dtype=float32,batch_size=8",
                           ["qjax_austen_mc", "qjax_austen_ppl"])
    # seed 003's way: the Hugging Face tokenizer on the client, token ids on the wire, batches of requests
    served, served_s = run("local-completions", f"model={NAME},base_url={server.url}/v1/completions,"
                           f"tokenizer_backend=huggingface,tokenizer={default_model_dir()},tokenized_requests=True,"
                           "num_concurrent=1,max_retries=1,max_length=256,batch_size=8", ["qjax_austen_mc"])
    # the tokenizer found through the server's /tokenizer_info and /tokenize (lm-eval's default probe; with
    # --api-key the tokenizer routes need the key too, which lm-eval's probe sends as auth_token)
    remote, remote_s = run("local-completions", f"model={NAME},base_url={server.url}/v1/completions,"
                           f"tokenized_requests=True,num_concurrent=4,max_retries=1,max_length=256,auth_token={KEY}",
                           ["qjax_austen_ppl"])
    assert served["qjax_austen_mc"]["acc,none"] == direct["qjax_austen_mc"]["acc,none"]
    def loglikelihoods(samples, task) -> dict[int, list[float]]:
        """doc id → the log-likelihood of each of its requests ((ll, is_greedy) or a rolling ll)."""
        one = lambda r: float(r[0]) if isinstance(r, (list, tuple)) else float(r)  # noqa: E731
        return {s["doc_id"]: [one(r[0]) for r in s["resps"]] for s in samples[task]}

    for task, samples in (("qjax_austen_mc", served_s), ("qjax_austen_ppl", remote_s)):
        want, got = loglikelihoods(direct_s, task), loglikelihoods(samples, task)
        assert set(got) == set(want) and all(len(got[d]) == len(want[d]) for d in want)
        # the engine prefills in chunks what the adapter scores in one forward: float32 noise only
        diff = max(abs(g - w) for d in want for g, w in zip(got[d], want[d]))
        assert diff <= 1e-4, (task, diff)
    assert remote["qjax_austen_ppl"]["word_perplexity,none"] == pytest.approx(
        direct["qjax_austen_ppl"]["word_perplexity,none"], rel=1e-5)

    # generation through the chat endpoint with the folder's chat template
    direct_g, direct_gs = run("qjax", f"pretrained={default_model_dir()},dtype=float32,batch_size=4",
                              ["qjax_austen_gen"], apply_chat_template=True)
    chat_g, chat_gs = run("local-chat-completions", f"model={NAME},base_url={server.url}/v1/chat/completions,"
                          "num_concurrent=2,max_retries=1,max_length=256", ["qjax_austen_gen"],
                          apply_chat_template=True)
    assert chat_g["qjax_austen_gen"]["exact_match,none"] == direct_g["qjax_austen_gen"]["exact_match,none"]
    resp = lambda s: {x["doc_id"]: x["resps"][0][0] for x in s["qjax_austen_gen"]}  # noqa: E731
    assert resp(chat_gs) == resp(direct_gs)


# ---------------------------------------------------------------------------------------------------------------------
# load: 64 clients
# ---------------------------------------------------------------------------------------------------------------------
def test_64_concurrent_clients(server, model):
    """64 clients × 3 requests drawn from 48 distinct ones (mixed prompt and output lengths, greedy and seeded,
    some streamed): the same request served at the same time to several clients must give each the same tokens,
    and those of the request run alone."""
    rng = random.Random(5)
    distinct = []
    for i in range(48):
        n = (5, 23, 60)[i % 3]
        body = {"model": NAME, "prompt": [rng.randrange(4000) for _ in range(n)], "max_tokens": (4, 12)[i // 3 % 2],
                "return_token_ids": True}
        if i // 6 % 2:
            body.update(temperature=0.8, top_p=0.95, top_k=20, seed=rng.randrange(1 << 30))
        else:
            body["temperature"] = 0
        distinct.append(body)
    jobs = [(c, {**rng.choice(distinct), "stream": rng.random() < 0.3}) for c in range(64) for _ in range(3)]

    def call(body):
        r = _post(server, "/v1/completions", body, stream=body["stream"])
        assert r.status_code == 200, r.text
        if not body["stream"]:
            [choice] = r.json()["choices"]
            return choice["token_ids"], choice["finish_reason"]
        ids, reason = None, None
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    if choice["finish_reason"]:
                        ids, reason = choice["token_ids"], choice["finish_reason"]
        return ids, reason

    def client(c):
        return [(body, call(body)) for cc, body in jobs if cc == c]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = [r for rs in pool.map(client, range(64)) for r in rs]
    assert len(results) == 192
    want = {}
    for body in distinct:
        sp = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                            top_p=body.get("top_p", 1.0), top_k=body.get("top_k", 0), seed=body.get("seed"))
        want[json.dumps(body, sort_keys=True)] = alone(model, body["prompt"], sp, width=64)
    for body, (ids, reason) in results:
        key = json.dumps({k: v for k, v in body.items() if k != "stream"}, sort_keys=True)
        assert ids == want[key], body
        assert reason == ("length" if len(ids) == body["max_tokens"] else "stop")
    m = server.metrics()
    assert m["qjax:num_requests_running"] == 0 and m["qjax:num_requests_waiting"] == 0
    assert m["qjax:generation_tokens_total"] >= sum(len(ids) for _, (ids, _) in results)


# ---------------------------------------------------------------------------------------------------------------------
# faults
# ---------------------------------------------------------------------------------------------------------------------
def test_bad_requests_get_their_error_and_the_server_goes_on(server):
    url = server.url
    cases = [
        (requests.post(url + "/v1/completions", data=b"{not json", headers=AUTH), 400, "malformed JSON"),
        (requests.post(url + "/v1/completions", data=b"[1, 2]", headers=AUTH), 400, "JSON object"),
        (_post(server, "/v1/completions", {"prompt": "x", "max_tokens": "many"}), 400, "max_tokens"),
        (_post(server, "/v1/completions", {"prompt": 5}), 400, "prompt"),
        (_post(server, "/v1/completions", {"prompt": "x", "model": "gpt-9"}), 404, "gpt-9"),
        (_post(server, "/v1/completions", {"prompt": "x", "max_tokens": 300}), 400, "exceeds max_model_len 256"),
        (_post(server, "/v1/completions", {"prompt": ""}), 400, "empty"),
        (_post(server, "/v1/completions", {"prompt": [1, 99999]}), 400, "outside the vocabulary"),
        (_post(server, "/v1/completions", {"prompt": "x", "temperature": -1}), 400, "temperature"),
        (_post(server, "/v1/completions", {"prompt": "x", "repetition_penalty": 1.3}), 400, "repetition_penalty"),
        (_post(server, "/v1/chat/completions", {"messages": []}), 400, "messages"),
        (_post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}), 400, "role"),
        (_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}), 400, "only text parts"),
        (requests.post(url + "/v1/completions", json={"prompt": "x"}), 401, "API key"),
        (requests.post(url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"}), 401,
         "API key"),
        (requests.get(url + "/v1/nothing", headers=AUTH), 404, "Not Found"),
        (requests.post(url + "/v1/completions", data=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                       headers=AUTH), 400, "nested 100001 levels"),
        (requests.post(url + "/v1/completions", data=iter([b'{"prompt": "', *[b"x" * (1 << 20)] * 33, b'"}']),
                       headers=AUTH), 413, "exceeds"),  # chunked: no Content-Length to refuse it by
        (requests.post(url + "/v1/completions", data=b"x" * (33 << 20), headers=AUTH), 413, "exceeds"),
        (_post(server, "/v1/completions", {"prompt": [[1]] * 1100, "max_tokens": 1}), 503, "busy"),
    ]
    for r, status, text in cases:
        assert r.status_code == status, (r.status_code, r.text)
        err = r.json()["error"]
        assert text in err["message"] and err["code"] == status and err["type"], err
    prompt_len = len(Tokenizer.from_folder(default_model_dir()).encode("x"))
    too_long = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 300}).json()["error"]["message"]
    assert f"({prompt_len} tokens)" in too_long and "300" in too_long
    ok = _post(server, "/v1/completions", {"prompt": "Once", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert requests.get(url + "/health").status_code == 200  # open routes need no key


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    r = _post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 240, "temperature": 0,
                                          "ignore_eos": True, "stream": True}, stream=True)
    lines = r.iter_lines()
    for _ in range(3):
        next(lines)
    # the gauges are set at the end of each engine step, and the first tokens leave during the step
    deadline = time.monotonic() + 10
    while server.metrics()["qjax:num_requests_running"] != 1:
        assert time.monotonic() < deadline, "the streaming request never showed as running"
        time.sleep(0.02)
    r.close()  # the client goes away
    deadline = time.monotonic() + 10
    while server.metrics()["qjax:num_requests_running"] != 0:
        assert time.monotonic() < deadline, "the aborted request still holds its slot"
        time.sleep(0.05)
    assert server.metrics().get("qjax:request_success_total", 0) >= 1


# ---------------------------------------------------------------------------------------------------------------------
# hostile clients (tests/test_serving_security.py has the in-process ones)
# ---------------------------------------------------------------------------------------------------------------------
def _rss(server) -> int:
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_the_openai_client_gets_a_400_for_each_bad_request(server):
    import openai

    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    bad = [dict(extra_body={"top_k": 2 ** 63}), dict(extra_body={"top_k": 2 ** 32 + 5}), dict(seed=2 ** 64),
           dict(temperature=True), dict(n="2"), dict(extra_body={"chat_template_kwargs": {
               "chat_template": "{% for i in range(10) %}{% endfor %}"}}),
           dict(extra_body={"chat_template_kwargs": {"add_generation_prompt": 5}})]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, **kw)
        assert info.value.status_code == 400 and "\n" not in info.value.message
    # (the client itself cannot send an unpaired surrogate: UTF-8 cannot encode it; the raw-bytes test above does)


def test_bad_requests_inside_a_running_batch_leave_the_others_alone(server, model):
    """Six clients generate (greedy and seeded); meanwhile bad requests arrive, a 30 MB prompt among them. Each
    bad one gets its 400; the six get exactly their solo tokens; /health answers quickly throughout."""
    prompts = [[5, 6, 7 + i] for i in range(6)]
    params = [SamplingParams(max_tokens=48, temperature=0) if i % 2 else
              SamplingParams(max_tokens=48, temperature=0.8, top_k=20, seed=100 + i) for i in range(6)]

    def good(i):
        sp = params[i]
        body = {"prompt": prompts[i], "max_tokens": sp.max_tokens, "temperature": sp.temperature,
                "top_p": sp.top_p, "return_token_ids": True, "stream": True}
        if not sp.greedy:
            body.update(top_k=sp.top_k, seed=sp.seed)
        r = _post(server, "/v1/completions", body, stream=True)
        ids, gaps, last = [], [], time.monotonic()
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                gaps.append(time.monotonic() - last)
                last = time.monotonic()
                choice = json.loads(line[6:])["choices"][0]
                ids += choice.get("token_ids") or []
        return ids

    health = []

    def probe(stop):
        while not stop.is_set():
            t = time.monotonic()
            assert requests.get(server.url + "/health", timeout=30).status_code == 200
            health.append(time.monotonic() - t)
            time.sleep(0.05)

    bad = [{"prompt": "x", "top_k": 2 ** 63}, {"prompt": "x", "seed": 2 ** 64}, {"prompt": "x", "temperature": True},
           {"prompt": "z" * (30 << 20)}, {"prompt": [1, 2], "stop_token_ids": [10 ** 6]}]
    stop = threading.Event()
    prober = threading.Thread(target=probe, args=(stop,))
    prober.start()
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        running = [pool.submit(good, i) for i in range(6)]
        time.sleep(0.5)
        refused = [pool.submit(_post, server, "/v1/completions", b) for b in bad]
        assert all(f.result().status_code == 400 for f in refused), [f.result().text[:200] for f in refused]
        got = [f.result() for f in running]
    stop.set()
    prober.join()
    for i, ids in enumerate(got):
        assert ids == alone(model, prompts[i], params[i]), i
    assert max(health) < 5.0, max(health)


def test_memory_comes_back_after_a_size_attack(server):
    """30 MB bodies (refused prompts, a /tokenize, an unencodable one) raise the server's resident size while they
    are read; after them, and a few normal requests, it is back within 200 MiB of where it was (it grew by gigabytes
    and stayed there before)."""
    for _ in range(3):
        assert _post(server, "/v1/completions", {"prompt": "warm", "max_tokens": 4}).status_code == 200
    time.sleep(2.5)
    before = _rss(server)
    huge = "w " * (15 << 20)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        out = list(pool.map(lambda b: _post(server, *b), [
            ("/v1/completions", {"prompt": huge}), ("/v1/chat/completions", {"messages": [
                {"role": "user", "content": huge[: 8 << 20]}]}), ("/tokenize", {"prompt": huge[: 2 << 20]}),
            ("/v1/completions", {"prompt": [huge[:1000]] * 1000})]))
    assert [r.status_code for r in out] == [400, 400, 200, 400], [r.text[:200] for r in out]
    peak = _rss(server)
    time.sleep(2.5)  # the release runs at most every 2 s
    for _ in range(3):
        assert _post(server, "/v1/completions", {"prompt": "after", "max_tokens": 4}).status_code == 200
    after = _rss(server)
    assert after - before < 200 << 20, (before >> 20, peak >> 20, after >> 20)


def test_a_few_hundred_fuzzed_requests_get_no_5xx_and_change_nothing(server, model):
    """schemathesis against the live server's own /openapi.json: valid and invalid bodies for every route that
    takes one; no 5xx; afterwards a greedy request still gets exactly its solo tokens."""
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import negative_data_rejection, not_a_server_error

    def short(case):
        # a valid body generates up to max_model_len tokens × n choices; a few are enough to reach every program
        # (the suite's time is bounded, the fuzzer's interest is the request layer)
        if isinstance(case.body, dict):
            for field in ("max_tokens", "max_completion_tokens"):
                if isinstance(case.body.get(field), int):
                    case.body[field] = min(case.body[field], 4)
            if "messages" in case.body and case.body.get("max_tokens") is None:
                case.body.setdefault("max_completion_tokens", 4)  # else: all of max_model_len
            if isinstance(case.body.get("n"), int):
                case.body["n"] = min(case.body["n"], 2)
        return case

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    doc = requests.get(server.url + "/openapi.json", timeout=30).json()

    def body_is_valid(case) -> bool:
        """Whether the route's own body schema accepts ``case.body`` (jsonschema_rs, schemathesis's validator, with
        the document's components); a body that is not JSON at all is not valid."""
        import jsonschema_rs

        body = doc["paths"][case.operation.path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        try:
            return jsonschema_rs.Draft202012Validator({**body, "components": doc["components"]}).is_valid(case.body)
        except (ValueError, TypeError, jsonschema_rs.ReferencingError):
            return False

    @schemathesis.check
    def rejects_invalid_bodies(ctx, response, case):
        """schemathesis's negative-data check, on bodies that really break the schema: its negative mode mutates one
        branch of a union and can leave a body another branch accepts — e.g. a chat message's ``content: string |
        array | null`` with the array branch turned into null, then sent as null (seen once in a clean-clone run: a
        valid /tokenize chat body, rightly answered 200). Such a body is a positive case: not_a_server_error holds."""
        if body_is_valid(case):
            return None
        return negative_data_rejection(ctx, response, case)

    count = 0
    for op in ops:
        if op.method.upper() != "POST" or op.path == "/ping":
            continue
        for mode, n, checks in ((GenerationMode.POSITIVE, 40, [not_a_server_error]),
                                (GenerationMode.NEGATIVE, 40, [not_a_server_error, rejects_invalid_bodies])):
            strategy = op.as_strategy(generation_mode=mode)

            @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=strategy.map(short) if mode == GenerationMode.POSITIVE else strategy)
            def run(case):
                nonlocal count
                case.call_and_validate(base_url=server.url, headers=AUTH, timeout=300, checks=checks)
                count += 1

            run()
    assert count >= 300
    sp = SamplingParams(max_tokens=16, temperature=0)
    r = _post(server, "/v1/completions", {"prompt": [11, 12, 13], "max_tokens": 16, "temperature": 0,
                                          "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == alone(model, [11, 12, 13], sp)


def test_sigterm_under_load_answers_every_request(server):
    """64 requests in flight (streaming and not), then SIGTERM: each non-streaming one gets its completion or a
    503 error object, each stream ends with a final chunk and [DONE]; no 500; the process exits 0 promptly. (Last
    in this file: it stops the module's server.)"""
    def one(i):
        body = {"prompt": [5, 6, 7 + i % 50], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": i % 2 == 0}
        r = _post(server, "/v1/completions", body, stream=body["stream"])
        if not body["stream"]:
            return "whole", r.status_code, r.json()
        events = [line for line in r.iter_lines() if line]
        return "stream", r.status_code, events

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        futures = [pool.submit(one, i) for i in range(64)]
        deadline = time.monotonic() + 60
        while server.metrics()["qjax:num_requests_running"] < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.proc.send_signal(15)
        start = time.monotonic()
        results = [f.result(timeout=120) for f in futures]
    assert server.proc.wait(60) == 0
    assert time.monotonic() - start < 5  # the bound: every response out and the process gone
    for kind, status, payload in results:
        if kind == "whole":
            assert status in (200, 503), (status, payload)
            if status == 503:
                assert "shutting down" in payload["error"]["message"]
            continue
        assert status == 200
        assert payload[-1] == b"data: [DONE]", payload[-3:]
        last = json.loads(payload[-2][6:])
        assert last["choices"][0]["finish_reason"] in ("abort", "length"), last
    assert "Traceback" not in "".join(server.stderr), "".join(server.stderr)[-3000:]


# ---------------------------------------------------------------------------------------------------------------------
# a mesh, and the model cards' command lines
# ---------------------------------------------------------------------------------------------------------------------
def test_a_mesh_serves_the_same_tokens_as_one_device(model):
    env = {"XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()}
    mesh = Server([*ARGS, "--mesh", "tensor=2,expert=2", "--no-warmup"], env=env)
    try:
        assert "4 devices" in "".join(mesh.stderr)
        for body in ({"prompt": [3, 1, 4, 1, 5, 9, 2, 6], "max_tokens": 10, "temperature": 0},
                     {"prompt": [2, 7, 1, 8, 2, 8], "max_tokens": 10, "temperature": 0.8, "top_p": 0.95, "seed": 3}):
            got = _post(mesh, "/v1/completions", {**body, "return_token_ids": True}).json()["choices"][0]
            sp = SamplingParams(max_tokens=10, temperature=body["temperature"], top_p=body.get("top_p", 1.0),
                                seed=body.get("seed"))
            assert got["token_ids"] == alone(model, body["prompt"], sp)
    finally:
        assert mesh.stop() == 0


# The model cards' commands, verbatim but for `vllm` → `qjax` (the port and warm-up flags are appended)
SEED_LINES = {
    "000": "qjax serve Intel/Qwen3.6-35B-A3B-int2-mixed-AutoRound-LLMC --dtype bfloat16 --tensor-parallel-size 1 "
           "--max-model-len 8192 --gpu-memory-utilization 0.85 --trust-remote-code "
           "--served-model-name qwen-mixed-2bit --gdn-prefill-backend triton",
    "002": "qjax serve axteam/Qwen3.6-35B-A3B-AWQ-8bit --max-model-len 32768 --kv-cache-dtype fp8",
    "003": "qjax serve intel-ai/Qwen3.6-35B-A3B-MXFP8-FP8KV-CT-AutoRound --tokenizer Qwen/Qwen3.6-35B-A3B "
           "--host 127.0.0.1 --port 8000 --trust-remote-code --dtype bfloat16 --max-model-len 131072 "
           "--tensor-parallel-size 2 --data-parallel-size 2 --data-parallel-size-local 2 --enable-expert-parallel "
           "--kv-cache-dtype fp8 --max-num-seqs 32 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.90",
}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A Hugging Face cache holding the seed cards' repositories: the built-in model's files, its config stretched
    to 262144 positions like the real one's (the weights are the same)."""
    root = tmp_path_factory.mktemp("hf-hub")
    for repo in ("Intel/Qwen3.6-35B-A3B-int2-mixed-AutoRound-LLMC", "axteam/Qwen3.6-35B-A3B-AWQ-8bit",
                 "intel-ai/Qwen3.6-35B-A3B-MXFP8-FP8KV-CT-AutoRound", "Qwen/Qwen3.6-35B-A3B"):
        base = root / ("models--" + repo.replace("/", "--"))
        snap = base / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
        shutil.copytree(default_model_dir(), snap, ignore=shutil.ignore_patterns("*.txt", "training_log.json"))
        cfg = json.loads((snap / "config.json").read_text())
        cfg["max_position_embeddings"] = 262144
        (snap / "config.json").write_text(json.dumps(cfg))
        (base / "refs").mkdir()
        (base / "refs" / "main").write_text(snap.name)
    return root


@pytest.mark.parametrize("card", sorted(SEED_LINES))
def test_the_model_cards_serve_lines_start_a_server(card, hub_cache):
    argv = SEED_LINES[card].split()[2:]
    env = {"HF_HUB_CACHE": str(hub_cache), "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                                                        + " --xla_force_host_platform_device_count=4").strip()}
    s = Server([*argv, "--no-warmup"], env=env)
    try:
        names = [m["id"] for m in requests.get(s.url + "/v1/models", timeout=30).json()["data"]]
        served = "qwen-mixed-2bit" if card == "000" else argv[0]
        assert names == [served]
        log = "".join(s.stderr)
        assert "memory plan" in log
        if card != "002":
            assert "--trust-remote-code: ignored" in log
        if card == "003":
            assert "tensor=2, expert=2" in log and "4 devices" in log
        if card == "002":
            assert "no static K/V scales; using 1.0" in log
    finally:
        assert s.stop() == 0


def test_unknown_flags_and_impossible_plans_are_refused(capsys):
    """The command's exit status and message from a real process once (an unknown flag); the refusals of
    impossible plans and bad speculative configs in this process (`qjax.cli.main`, what `python -m qjax.cli` runs:
    a child process each cost ~3 s of imports for the same code path)."""
    import subprocess
    import sys

    from qjax.cli import main as cli_main

    r = subprocess.run([sys.executable, "-m", "qjax.cli", "serve", default_model_dir(), "--no-such-flag"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr

    def serve(*args):
        rc = cli_main(["serve", default_model_dir(), *args])
        return rc, capsys.readouterr().err

    rc, err = serve("--max-model-len", "4096", "--max-num-seqs", "100000")
    assert rc == 2 and "at most" in err and "--max-num-seqs" in err, err[-2000:]
    rc, err = serve("--max-model-len", "9000")
    assert rc == 2 and "max_position_embeddings 4096" in err
    for conf, says in (('{"method": "eagle"}', "method must be one of mtp"), ("mtp", "not JSON"),
                       ('{"method": "mtp", "model": "drafter"}', "field 'model' is not supported"),
                       ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens must be")):
        rc, err = serve("--speculative-config", conf)
        assert rc == 2 and says in err and "Traceback" not in err, err[-2000:]
