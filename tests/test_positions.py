"""qjax.multimodal.positions against transformers: M-RoPE position ids and deltas equal to a tiny
``Qwen3_5MoeModel.get_rope_index`` (text only, 1-3 images of different grids, images at either end, left-padded
batches), placeholder expansion equal to ``Qwen3VLProcessor``'s (a processor built offline on a word-level tokenizer and
the Pillow image processor), each PromptError, and the ChatML fallback template's image and video parts."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from qjax.multimodal.positions import PromptError, expand_image_tokens, image_token_counts, rope_index

# ids in the tiny model's 512-token vocabulary (Qwen's real ids are 248053-248057; the arithmetic does not care)
IMAGE, VIDEO, VSTART, VEND, PAD = 500, 501, 502, 503, 0
MERGE = 2


# ---------------------------------------------------------------------------------------------------------------------
# the transformers reference, built once per module
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_model():
    """A tiny ``Qwen3_5MoeModel`` (one layer, a one-block vision tower): only its real ``get_rope_index`` is used."""
    torch = pytest.importorskip("torch")
    from oracles.hf import tiny_text_config
    from transformers import Qwen3_5MoeConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel

    text = tiny_text_config(num_hidden_layers=1)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text["hidden_size"],
                  num_position_embeddings=16, spatial_merge_size=MERGE)
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                              vision_start_token_id=VSTART, vision_end_token_id=VEND)
    torch.manual_seed(0)
    return Qwen3_5MoeModel(config).eval()


def _hf_rope(model, ids, grids, mask=None):
    import torch

    ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    with torch.no_grad():
        pos, deltas = model.get_rope_index(
            ids, mm_token_type_ids=(ids == IMAGE).int(),
            image_grid_thw=None if grids is None else torch.as_tensor(np.asarray(grids), dtype=torch.long),
            attention_mask=None if mask is None else torch.as_tensor(np.asarray(mask), dtype=torch.long))
    return pos.numpy(), deltas.numpy().reshape(-1)


def _count(grid) -> int:
    t, h, w = grid
    return t * h * w // MERGE**2


def _prompt(*parts, seed: int = 0) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Token ids and grids: an int is that many text tokens, ``"<img>"``/``"</img>"`` the vision start/end tokens,
    a ``(t, h, w)`` tuple that image's run of ``<|image_pad|>`` tokens."""
    rng = np.random.default_rng(seed)
    ids, grids = [], []
    for part in parts:
        if isinstance(part, tuple):
            ids += [IMAGE] * _count(part)
            grids.append(part)
        elif part == "<img>":
            ids.append(VSTART)
        elif part == "</img>":
            ids.append(VEND)
        else:
            ids += rng.integers(1, 400, part).tolist()
    return ids, grids


def _check(model, ids, grids, mask=None):
    """qjax's positions and deltas equal transformers' (dtype int32, shapes [3, B, T] and [B])."""
    want_pos, want_deltas = _hf_rope(model, ids, grids or None, mask)
    pos, deltas = rope_index(ids, grids or None, image_token_id=IMAGE, spatial_merge_size=MERGE, attention_mask=mask,
                             video_token_id=VIDEO)
    assert pos.dtype == np.int32 and deltas.dtype == np.int32
    assert pos.shape == (3, *np.shape(ids)) and deltas.shape == (np.shape(ids)[0],)
    assert np.array_equal(pos, want_pos)
    assert np.array_equal(deltas, want_deltas)
    return pos, deltas


# ---------------------------------------------------------------------------------------------------------------------
# rope_index against get_rope_index
# ---------------------------------------------------------------------------------------------------------------------
def test_text_only_is_three_aranges(hf_model):
    ids, _ = _prompt(13)
    pos, deltas = _check(hf_model, [ids], None)
    assert np.array_equal(pos, np.broadcast_to(np.arange(13), (3, 1, 13))) and deltas.tolist() == [0]
    # an empty grid list is the same as None
    pos2, _ = rope_index([ids], np.zeros((0, 3), np.int64), image_token_id=IMAGE, spatial_merge_size=MERGE)
    assert np.array_equal(pos, pos2)


PROMPTS = {
    "one image": (5, "<img>", (1, 4, 6), "</img>", 7),
    "two images": (3, "<img>", (1, 8, 8), "</img>", 4, "<img>", (1, 2, 2), "</img>", 2),
    "three images": ("<img>", (1, 4, 6), "</img>", 1, "<img>", (1, 8, 8), "</img>", "<img>", (1, 6, 4), "</img>", 9),
    "image first": ((1, 6, 4), 3),
    "image last": (3, (1, 4, 6)),
    "image only": ((1, 8, 8),),
    "tall then wide": (2, (1, 8, 2), 1, (1, 2, 8), 1),
    # t > 1 is transformers' arithmetic for a grid images never have (their t is 1): the temporal row outruns the text
    "t > 1": (2, (3, 2, 2), 2),
}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_images_match_transformers(hf_model, name):
    ids, grids = _prompt(*PROMPTS[name])
    pos, deltas = _check(hf_model, [ids], grids)
    if name == "one image":
        # text 0..5, the 2x3 merged image at 6 + (0, hi, wi), then text on from 6 + max(2, 3) = 9
        img = slice(6, 12)
        assert pos[:, 0, img].tolist() == [[6] * 6, [6, 6, 6, 7, 7, 7], [6, 7, 8, 6, 7, 8]]
        assert pos[:, 0, 12].tolist() == [9, 9, 9] and deltas.tolist() == [pos.max() + 1 - len(ids)] == [-3]


def test_left_padded_batch_with_different_image_counts(hf_model):
    rows = [_prompt(4, "<img>", (1, 4, 6), "</img>", 3, seed=1),
            _prompt("<img>", (1, 8, 8), "</img>", 2, "<img>", (1, 2, 2), "</img>", (1, 6, 4), seed=2),
            _prompt(6, seed=3)]
    length = max(len(ids) for ids, _ in rows) + 2
    ids = np.full((len(rows), length), PAD)
    mask = np.zeros((len(rows), length), np.int64)
    for b, (row, _) in enumerate(rows):
        ids[b, length - len(row):] = row
        mask[b, length - len(row):] = 1
    grids = [g for _, gs in rows for g in gs]  # row 0's images first, as transformers' one iterator consumes them
    pos, deltas = _check(hf_model, ids, grids, mask)
    assert (pos[:, mask == 0] == 0).all()
    # decoding continues at (number of real tokens + delta) = max prompt position + 1, in every row
    assert np.array_equal(mask.sum(1) + deltas, pos.max(axis=(0, 2)) + 1)


def test_padding_anywhere_and_image_ids_under_padding(hf_model):
    """Masked tokens are dropped before runs are found: holes in the text, and image ids under padding, are ignored."""
    ids, grids = _prompt(5, (1, 4, 6), 6, seed=4)
    ids = np.array([ids])
    mask = np.ones_like(ids)
    mask[0, [1, 2, 14]] = 0
    ids[0, 14] = IMAGE  # a masked image id does not start a run
    _check(hf_model, ids, grids, mask)


def test_rope_index_is_numpy_only():
    # no torch and no transformers behind rope_index (it runs host-side in the server)
    import qjax.multimodal.positions as positions

    with open(positions.__file__, encoding="utf-8") as f:
        imports = [line for line in f if line.startswith(("import ", "from "))]
    assert not any("torch" in line or "transformers" in line for line in imports), imports


# ---------------------------------------------------------------------------------------------------------------------
# expand_image_tokens against Qwen3VLProcessor
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def processor():
    """A ``Qwen3VLProcessor`` built offline: a word-level tokenizer with the vision tokens, and the Pillow Qwen2-VL
    image processor (patch 16, merge 2). transformers requires a video processor (torchvision) that this test never
    uses; the subclass lets it be None."""
    pytest.importorskip("PIL")
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class ImageOnlyProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    words = ["[PAD]", "[UNK]", "Describe", "this", "image", "and", "that", "one", "."]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", padding_side="left")
    images = Qwen2VLImageProcessorPil(patch_size=16, merge_size=MERGE, temporal_patch_size=2,
                                      min_pixels=32 * 32, max_pixels=1024 * 1024)
    return ImageOnlyProcessor(image_processor=images, tokenizer=tok, video_processor=None)


PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def test_expansion_matches_the_processor(processor, hf_model):
    texts = [f"Describe {PLACEHOLDER} and {PLACEHOLDER} .", f"{PLACEHOLDER} this one {PLACEHOLDER} that {PLACEHOLDER}"]
    # (height, width) in pixels -> (h, w) patches of 16, multiples of the 32-pixel merged patch: no resizing
    sizes = [(64, 96), (128, 128), (192, 128), (32, 32), (64, 96)]
    images = [np.full((h, w, 3), 7 * i, np.uint8) for i, (h, w) in enumerate(sizes)]
    out = processor(text=texts, images=images, padding=True, return_tensors="np")
    grids = out["image_grid_thw"]
    assert grids.tolist() == [[1, 4, 6], [1, 8, 8], [1, 12, 8], [1, 2, 2], [1, 4, 6]]
    counts = image_token_counts(grids, MERGE)
    assert counts == [6, 16, 24, 1, 6]

    image_id = processor.image_token_id
    per_row, start = [], 0
    for b, text in enumerate(texts):
        raw = processor.tokenizer(text)["input_ids"]
        n = text.count(PLACEHOLDER)
        got = expand_image_tokens(raw, counts[start:start + n], image_id)
        start += n
        real = out["attention_mask"][b].astype(bool)
        assert got == out["input_ids"][b, real].tolist()
        per_row.append(got)
    # the processor's mm_token_type_ids is exactly the image-token mask qjax derives
    assert np.array_equal(out["mm_token_type_ids"], (out["input_ids"] == image_id).astype(np.int64))

    # and the processor's own batch (left padding) through both rope indexes, with its mm_token_type_ids
    import torch

    with torch.no_grad():
        want_pos, want_deltas = hf_model.get_rope_index(
            torch.as_tensor(out["input_ids"]), mm_token_type_ids=torch.as_tensor(out["mm_token_type_ids"]),
            image_grid_thw=torch.as_tensor(grids), attention_mask=torch.as_tensor(out["attention_mask"]))
    pos, deltas = rope_index(out["input_ids"], grids, image_token_id=image_id, spatial_merge_size=MERGE,
                             attention_mask=out["attention_mask"])
    assert np.array_equal(pos, want_pos.numpy()) and np.array_equal(deltas, want_deltas.numpy().reshape(-1))


def test_expand_rule():
    assert expand_image_tokens([1, 9, 2, 9, 3], [2, 3], 9) == [1, 9, 9, 2, 9, 9, 9, 3]
    assert expand_image_tokens([9], [4], 9) == [9, 9, 9, 9]
    assert expand_image_tokens((1, 2), (), 9) == [1, 2]
    assert expand_image_tokens(np.array([9, 1]), np.array([1]), 9) == [9, 1]
    assert image_token_counts(None, MERGE) == [] and image_token_counts([[1, 4, 6], [2, 2, 2]], MERGE) == [6, 2]


# ---------------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------------
def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and isinstance(excinfo.value, ValueError)
    return msg


def test_expand_errors():
    with pytest.raises(PromptError) as e:
        expand_image_tokens([1, 9, 2, 9], [4, 4, 4], 9)
    assert _one_line(e) == "the prompt has 2 image placeholders but 3 images were given"
    with pytest.raises(PromptError) as e:
        expand_image_tokens([1, 9], [], 9)
    assert _one_line(e) == "the prompt has 1 image placeholder but 0 images were given"
    with pytest.raises(PromptError, match="at least one token"):
        expand_image_tokens([9], [0], 9)


def _rope(ids, grids, **kw):
    return rope_index([ids] if np.ndim(ids) == 1 else ids, grids, image_token_id=IMAGE, spatial_merge_size=MERGE,
                      video_token_id=VIDEO, **kw)


def test_rope_index_errors(hf_model):
    # a run whose length is not the next grid's token count
    with pytest.raises(PromptError) as e:
        _rope([1, 2] + [IMAGE] * 5 + [3], [(1, 4, 6)])
    assert "a run of 5 image tokens at column 2" in _one_line(e) and "takes 6" in str(e.value)
    # two images with nothing between them: one run (transformers' groupby merges them too)
    ids, grids = _prompt(2, (1, 2, 2), (1, 4, 6), 2)
    with pytest.raises(PromptError) as e:
        _rope(ids, grids)
    assert "a run of 7 image tokens" in _one_line(e) and "merge into one run" in str(e.value)
    # more runs than grids
    ids, grids = _prompt(2, (1, 2, 2), 1, (1, 2, 2))
    with pytest.raises(PromptError) as e:
        _rope(ids, grids[:1])
    assert _one_line(e) == "row 0: a run of 1 image tokens at column 4 but only 1 image grid was given"
    with pytest.raises(PromptError, match="but only 0 image grids were given"):
        _rope(ids, None)
    # grids left over, across a batch
    with pytest.raises(PromptError) as e:
        _rope(np.array([ids, ids]), grids * 2 + [(1, 2, 2)])
    assert _one_line(e) == "5 image grids were given but the prompts have 4 images"
    # video
    with pytest.raises(PromptError) as e:
        _rope([1, VSTART, VIDEO, VIDEO, VEND], None)
    assert "video input is not supported" in _one_line(e) and "column 2" in str(e.value)
    # a grid the merge cannot divide, and bad shapes
    with pytest.raises(PromptError, match="multiples of the merge size 2"):
        _rope([IMAGE] * 3, [(1, 3, 4)])
    with pytest.raises(PromptError, match=r"\[batch, tokens\]"):
        rope_index([1, 2], None, image_token_id=IMAGE, spatial_merge_size=MERGE)
    with pytest.raises(PromptError, match="attention_mask has shape"):
        _rope([1, 2], None, attention_mask=[[1, 1, 1]])
    with pytest.raises(PromptError, match=r"\[n_images, 3\]"):
        _rope([IMAGE], [1, 2, 2])


def test_padding_only_row():
    # transformers cannot index an all-padding row (max of nothing); qjax leaves it at position 0, delta 0
    ids, grids = _prompt(3, (1, 2, 2))
    pos, deltas = _rope(np.array([ids, [PAD] * len(ids)]), grids, attention_mask=[[1] * len(ids), [0] * len(ids)])
    assert (pos[:, 1] == 0).all() and deltas[1] == 0


# ---------------------------------------------------------------------------------------------------------------------
# the ChatML fallback template's image and video parts
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fallback(tmp_path_factory):
    """The built-in model's tokenizer with its chat template removed: qjax renders the ChatML fallback."""
    from qjax.checkpoint.hub import default_model_dir
    from qjax.tokenizer import CHATML_FALLBACK_TEMPLATE, Tokenizer

    folder = tmp_path_factory.mktemp("no-template")
    shutil.copy(os.path.join(default_model_dir(), "tokenizer.json"), folder)
    with open(os.path.join(default_model_dir(), "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    del cfg["chat_template"]
    with open(folder / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    tok = Tokenizer.from_folder(folder)
    assert tok.get_chat_template() == CHATML_FALLBACK_TEMPLATE
    return tok, str(folder)


IMAGE_PAD = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PAD = "<|vision_start|><|video_pad|><|vision_end|>"
MULTIMODAL = [
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "text", "text": "Describe this image."}]}],
    [{"role": "system", "content": "S"},
     {"role": "user", "content": [{"type": "text", "text": "A "}, {"type": "image"}, {"type": "text", "text": " B "},
                                  {"image": "file:///x.png"}, {"image_url": "http://x/y.png"},
                                  {"type": "video", "video": "v.mp4"}, {"video": ["f1.png", "f2.png"]},
                                  {"type": "video_url", "video_url": {"url": "v.mp4"}}, {"type": "text", "text": "?"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}],
]


def test_fallback_renders_image_parts(fallback):
    tok, _ = fallback
    text = tok.apply_chat_template(MULTIMODAL[0])
    assert text == f"<|im_start|>user\n{IMAGE_PAD}Describe this image.<|im_end|>\n<|im_start|>assistant\n"
    text = tok.apply_chat_template(MULTIMODAL[1], add_generation_prompt=False)
    assert text == ("<|im_start|>system\nS<|im_end|>\n"
                    f"<|im_start|>user\nA {IMAGE_PAD} B {IMAGE_PAD}{IMAGE_PAD}{VIDEO_PAD}{VIDEO_PAD}{VIDEO_PAD}?"
                    "<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n")
    # parts that are neither text nor a medium still render nothing (a plain string part included)
    odd = [{"role": "user", "content": ["an image", {"type": "audio"}, {"type": "text", "text": "t"}]}]
    assert tok.apply_chat_template(odd, add_generation_prompt=False) == "<|im_start|>user\nt<|im_end|>\n"


def test_fallback_renders_as_transformers_does(fallback):
    transformers = pytest.importorskip("transformers")
    from qjax.tokenizer import CHATML_FALLBACK_TEMPLATE

    tok, folder = fallback
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    for messages in MULTIMODAL:
        for gen in (False, True):
            # this vocabulary has no <think>: qjax sets qjax_think_tags False, so transformers gets the same
            want = hf.apply_chat_template(messages, chat_template=CHATML_FALLBACK_TEMPLATE, tokenize=False,
                                          add_generation_prompt=gen, qjax_think_tags=False)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == want
            assert IMAGE_PAD in want
