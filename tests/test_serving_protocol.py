"""qjax.serving.protocol without a server: stop strings cut exactly (also across tokens and while streaming), the
Qwen3 reasoning split (whole and streamed), prompts in every accepted shape, refused sampling fields."""

from __future__ import annotations

import pytest

from qjax.checkpoint.hub import default_model_dir
from qjax.serving import RequestOutput, TokenLogprob
from qjax.serving.protocol import (
    ApiError,
    CompletionRequest,
    Defaults,
    ReasoningStream,
    TextAssembler,
    completion_logprobs,
    completion_prompts,
    sampling_params,
    split_reasoning,
)
from qjax.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(default_model_dir())


def feed(asm: TextAssembler, ids: list[int], *, finish: str = "length", stream: bool = False):
    """Push ids one engine output at a time; returns (stopped early, streamed pieces)."""
    pieces = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        if asm.add(RequestOutput("r", [t], finished=last, finish_reason=finish if last else None)):
            pieces.append(asm.delta())
            return True, pieces
        pieces.append(asm.delta())
    return False, pieces


def test_stop_strings_cut_before_the_match_even_across_tokens(tok):
    text = "It was the best of times, it was the worst of times"
    ids = tok.encode(text)
    asm = TextAssembler(tok, stops=["of times, it"])
    stopped, pieces = feed(asm, ids, stream=True)
    assert stopped and asm.text == "It was the best " and asm.finish_reason == "stop"
    assert asm.stop_reason == "of times, it"
    assert "".join(pieces) == asm.text  # nothing streamed that the stop string later removed
    keep = TextAssembler(tok, stops=["worst"], include_stop=True)
    feed(keep, ids)
    assert keep.text == "It was the best of times, it was the worst"
    free = TextAssembler(tok, stops=["zebra"])
    stopped, pieces = feed(free, ids)
    assert not stopped and free.text == text and "".join(pieces) == text and free.finish_reason == "length"


def test_echo_logprobs_layout(tok):
    ids = tok.encode("Once upon")
    asm = TextAssembler(tok, stops=[])
    asm.add(RequestOutput("r", [11], [TokenLogprob(11, -0.5, ((11, -0.5), (12, -1.0)))],
                          prompt_logprobs=[None] + [TokenLogprob(t, -2.0, ((t, -2.0),)) for t in ids[1:]],
                          finished=True, finish_reason="length"))
    lp = completion_logprobs(asm, ids, tok.decode(ids), 1)
    assert len(lp["tokens"]) == len(ids) + 1  # lm-eval's off-by-one: prompt tokens, then the generated one
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][-1] == -0.5 and lp["top_logprobs"][-1] == {tok.decode([11]): -0.5}
    assert lp["text_offset"][1] == len(tok.decode(ids[:1]))


@pytest.mark.parametrize("text,thinking,want", [
    ("plan it</think>\n\nThe answer", True, ("plan it", "\n\nThe answer")),
    ("<think>plan</think>done", True, ("plan", "done")),
    ("cut short", True, ("cut short", None)),
    ("just an answer", False, (None, "just an answer")),
    ("</think>only content", True, (None, "only content")),
])
def test_reasoning_split(text, thinking, want):
    assert split_reasoning(text, thinking=thinking) == want
    stream = ReasoningStream(thinking=thinking)
    parts = [stream.push(text[i:i + 3]) for i in range(0, len(text), 3)] + [stream.push("", final=True)]
    reasoning, content = ("".join(p[k] for p in parts) or None for k in (0, 1))
    assert (reasoning, content) == want


def test_prompt_shapes_and_refusals(tok):
    where = []

    def enc(text, at=None):
        where.append(at)
        return tok.encode(text)
    assert completion_prompts(CompletionRequest(prompt="Hi there"), enc) == [enc("Hi there")]
    assert completion_prompts(CompletionRequest(prompt=["a", "b"]), enc) == [enc("a"), enc("b")]
    assert where[:4] == ["prompt", None, "prompt[0]", "prompt[1]"]  # each text is tokenized knowing its part
    assert completion_prompts(CompletionRequest(prompt=[1, 2, 3]), enc) == [[1, 2, 3]]
    assert completion_prompts(CompletionRequest(prompt=[[1], [2, 3]]), enc) == [[1], [2, 3]]
    for bad in ("", [], [[1], []]):
        with pytest.raises(ApiError, match="empty"):
            completion_prompts(CompletionRequest(prompt=bad), enc)
    d = Defaults(temperature=0.7, top_p=0.9, top_k=20)
    sp = sampling_params(CompletionRequest(prompt="x"), d, max_tokens=5, logprobs=None, prompt_logprobs=None,
                         seed=None)
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.7, 0.9, 20)  # unset fields take the server's defaults
    sp = sampling_params(CompletionRequest(prompt="x", top_k=-1, temperature=0), d, max_tokens=5, logprobs=None,
                         prompt_logprobs=None, seed=None)
    assert sp.top_k == 0 and sp.greedy
    for field, value in (("repetition_penalty", 1.2), ("presence_penalty", 0.5), ("min_p", 0.1)):
        with pytest.raises(ApiError, match=field):
            sampling_params(CompletionRequest(prompt="x", **{field: value}), d, max_tokens=5, logprobs=None,
                            prompt_logprobs=None, seed=None)
    neutral = CompletionRequest(prompt="x", repetition_penalty=1.0, presence_penalty=0.0)
    sampling_params(neutral, d, max_tokens=5, logprobs=None, prompt_logprobs=None, seed=None)
    gc_greedy = Defaults.from_generation_config(type("GC", (), dict(do_sample=False, temperature=0.6, top_p=0.9,
                                                                    top_k=5))())
    assert gc_greedy.temperature == 0.0
