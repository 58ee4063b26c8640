"""The vision tower (qjax/model/vision.py) and image prompts end to end, against transformers 5.24.

Tower: ``Qwen3_5MoeVisionModel`` on random tiny configs (several images of different grids in one call), float32
and float64 (the truth); the host-side layout (interpolation taps, rotary positions) against transformers'
``vision_utils``. End to end on a tiny VL checkpoint (tests/oracles/hf.py ``write_vl_checkpoint``): logits of
``Qwen3_5MoeForConditionalGeneration`` with images, greedy tokens after an image, prefill + decode = full forward;
loading (stored dtype, text-only, a quantized tower refused); a w2w4 RTN export answering image prompts with the tower
kept in BF16.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from oracles.hf import (
    FLOAT32_PARITY_TOL,
    NORM_NOISE_STD,
    RANDOM_STD,
    VL_SPECIALS,
    hf_vl_inputs,
    hf_vl_model,
    qjax_tower_from_torch,
    random_image,
    tiny_vision_config,
    write_vl_checkpoint,
)
from transformers import Qwen3_5MoeVisionConfig, Qwen3_5MoeVisionModel

import qjax
from qjax.evaluation.torch_reference import float64_everywhere
from qjax.model.config import VisionConfig
from qjax.model.vision import Qwen3_5MoeVisionModel as JaxVision
from qjax.model.vision import _jit_vision, patch_bucket, patch_buckets, segment_attention, vision_layout
from qjax.multimodal.positions import PromptError
from qjax.multimodal.prompt import prepare_images

# float32 tower vs transformers' float32 tower, max |Δ| over the merged features (|features| ≲ 5): measured 1.3e-6 on
# the tiny tower and 2.4e-6 on the odd one; the bound
TOWER_TOL = 1e-5
# float64 qjax vs transformers in float64 everywhere, relative to max |feature|: both compute the same sums
F64_REL = 1e-12
# logits with images vs transformers' float32 ConditionalGeneration: the text path's parity tolerance; measured 1.3e-5
TEXT_TOL = FLOAT32_PARITY_TOL
# a cached decode step vs the full forward (tests/test_generate.py TOL: transformers' own gap is up to 8.3e-5)
CACHE_TOL = 1e-4

GRIDS = np.array([[1, 4, 6], [1, 8, 8], [1, 2, 2]])  # three images of different grids in one call


def odd_vision_config(out_hidden_size: int = 20) -> Qwen3_5MoeVisionConfig:
    """Odd sizes: 3 heads of 12, 3-pixel patches, a 5×5 position grid, 3 blocks."""
    return Qwen3_5MoeVisionConfig(depth=3, hidden_size=36, intermediate_size=40, num_heads=3, patch_size=3,
                                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                                  out_hidden_size=out_hidden_size, num_position_embeddings=25)


def _torch_tower(hc: Qwen3_5MoeVisionConfig, seed: int) -> Qwen3_5MoeVisionModel:
    hc._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tower = Qwen3_5MoeVisionModel(hc).float().eval()
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in tower.named_parameters():  # LayerNorms around 1, everything else N(0, RANDOM_STD)
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1.0 + NORM_NOISE_STD * noise if "norm" in name and name.endswith("weight")
                        else RANDOM_STD * noise)
    return tower


def _pixels(grids: np.ndarray, patch_dim: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(int(grids.prod(1).sum()), patch_dim)).astype(np.float32)


@pytest.mark.parametrize("make", [tiny_vision_config, odd_vision_config], ids=["tiny", "odd"])
def test_tower_equals_transformers_with_several_images(make):
    tower = _torch_tower(make(out_hidden_size=48) if make is tiny_vision_config else make(), seed=3)
    ours = qjax_tower_from_torch(tower, jnp.float32)
    px = _pixels(GRIDS, ours.config.patch_dim)
    with torch.no_grad():
        want = tower(torch.from_numpy(px), grid_thw=torch.from_numpy(GRIDS)).pooler_output.numpy()
    got = np.asarray(ours(px, GRIDS))
    assert got.shape == (int(GRIDS.prod(1).sum()) // 4, ours.config.out_hidden_size)
    assert np.abs(got - want).max() <= TOWER_TOL
    # each image alone gives its own rows of the batched call (attention stays inside an image)
    start = 0
    for g in GRIDS:
        n = int(g.prod())
        alone = np.asarray(ours(px[start:start + n], g[None]))
        np.testing.assert_allclose(alone, got[start // 4:(start + n) // 4], atol=TOWER_TOL, rtol=0)
        start += n


def test_tower_float64_equals_transformers_float64(x64):
    jax.config.update("jax_enable_x64", True)  # (the x64 fixture restores it)
    tower = _torch_tower(odd_vision_config(), seed=5)
    ours = qjax_tower_from_torch(tower, jnp.float64)
    px = _pixels(GRIDS, ours.config.patch_dim).astype(np.float64)
    with float64_everywhere(strict=False):
        truth = _torch_tower(odd_vision_config(), seed=5).double()
        rope = truth.rotary_pos_emb  # its inverse frequencies were formed in float32 at construction
        half = truth.config.hidden_size // truth.config.num_heads // 2
        rope.inv_freq = 1.0 / (10_000.0 ** (torch.arange(0, half, 2, dtype=torch.float64) / half))
        with torch.no_grad():
            want = truth(torch.from_numpy(px), grid_thw=torch.from_numpy(GRIDS)).pooler_output.numpy()
    got = np.asarray(ours(px, GRIDS))
    assert got.dtype == np.float64
    assert np.abs(got - want).max() <= F64_REL * np.abs(want).max()


def test_layout_is_transformers_vision_utils():
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    vc = VisionConfig(num_position_embeddings=25, spatial_merge_size=2)
    grids = np.array([[1, 4, 6], [2, 8, 2], [1, 2, 2], [1, 12, 4]])
    lay = vision_layout(grids, vc)
    tg = torch.from_numpy(grids)
    idx, w = get_vision_interpolation_indices_and_weights(tg, num_grid_per_side=5, mode="bilinear",
                                                          align_corners=True, spatial_merge_size=2)
    pos = get_vision_position_ids(tg, 2)
    n = lay.patches
    np.testing.assert_array_equal(lay.interp_index[:n], idx.numpy())
    np.testing.assert_array_equal(lay.interp_weight[:n], w.numpy())
    np.testing.assert_array_equal(lay.rope_position[:n], pos.numpy())
    # attention segments: one per frame (transformers' cu_seqlens), padding its own
    assert np.array_equal(np.unique(lay.segment[:n]), np.arange(5)) and np.all(lay.segment[n:] == -1)


def test_blocked_attention_equals_whole_attention():
    """Past 2048 patches queries run in blocks; each image's softmax still sees exactly its own patches."""
    n = patch_bucket(2100)  # 2304 = 9 blocks of 256
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(n, 2, 8)).astype(np.float32) for _ in range(3))
    segment = np.repeat(np.arange(4, dtype=np.int32), [700, 900, 500, 0]).tolist() + [-1] * (n - 2100)
    segment = np.asarray(segment, np.int32)
    got = np.asarray(segment_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(segment)))
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(8)
    s = np.where(segment[:, None] == segment[None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    assert np.abs(got - want).max() < 1e-5


def test_patch_buckets_bound_padding_and_compiles():
    for n in [1, 63, 64, 65, 100, 513, 784, 1000, 4097, 65536, 70000]:
        b = patch_bucket(n)
        assert b >= n and b % 4 == 0 and b <= max(64, n * 1.5)  # ≤ 50 % padding
        assert b <= 2048 or b % 256 == 0  # past the whole-attention size, 256- to 512-query blocks divide it
    assert patch_bucket(784) == 1024  # a 448×448 image
    assert patch_buckets(1024) == [64, 96, 128, 192, 256, 384, 512, 768, 1024]  # what a server compiles up front
    # every image mix that falls in one bucket runs one compiled program
    vc = VisionConfig(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, patch_size=2,
                      num_position_embeddings=16, out_hidden_size=8)
    tower = JaxVision(vc, rngs=nnx.Rngs(0))
    before = _jit_vision._cache_size()
    for grids in ([[1, 8, 8]], [[1, 4, 4], [1, 6, 4], [1, 2, 2]], [[1, 2, 16], [1, 4, 4]]):
        grids = np.array(grids)
        assert patch_bucket(int(grids.prod(1).sum())) == 64
        tower(_pixels(grids, vc.patch_dim), grids)
    assert _jit_vision._cache_size() == before + 1


# ---------------------------------------------------------------------------------------------------------------------
# end to end on a tiny VL checkpoint
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return write_vl_checkpoint(tmp_path_factory.mktemp("vl") / "vl")


@pytest.fixture(scope="module")
def vl(vl_dir):
    return qjax.load_model(vl_dir), hf_vl_model(vl_dir)


I, V, S, E = (VL_SPECIALS[t] for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"))
IMAGES = [random_image(40, 56, seed=1), random_image(30, 30, seed=2), random_image(64, 20, seed=3)]


def _prompt(n_images: int, seed: int = 0) -> list[int]:
    """Words, then each image wrapped in vision start/end, words between and after."""
    rng = np.random.default_rng(seed)
    ids = list(rng.integers(0, 480, 5))
    for _ in range(n_images):
        ids += [S, I, E] + list(rng.integers(0, 480, 3))
    return [int(t) for t in ids]


@pytest.mark.parametrize("n_images", [1, 3])
def test_logits_with_images_equal_transformers(vl, vl_dir, n_images):
    model, hf = vl
    p = prepare_images(model, np.array([_prompt(n_images)]), None, IMAGES[:n_images])
    inputs = hf_vl_inputs(vl_dir, IMAGES[:n_images], p.input_ids)
    with torch.no_grad():
        want = hf(**inputs).logits.numpy()
    got = np.asarray(model.forward(jnp.asarray(p.input_ids), position_ids=jnp.asarray(p.position_ids),
                                   image_embeds=p.image_embeds).logits)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TEXT_TOL


def test_greedy_after_an_image_equals_transformers(vl, vl_dir):
    model, hf = vl
    prompt = np.array([_prompt(2, seed=4)])
    out = qjax.generate(model, prompt, images=IMAGES[1:3], max_new_tokens=12)
    expanded = prepare_images(model, prompt, None, IMAGES[1:3]).input_ids
    inputs = hf_vl_inputs(vl_dir, IMAGES[1:3], expanded)
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=12, do_sample=False).numpy()
    np.testing.assert_array_equal(out, want)
    # stream gives the same tokens
    streamed = np.stack(list(qjax.stream(model, prompt, images=IMAGES[1:3], max_new_tokens=12)), axis=1)
    np.testing.assert_array_equal(streamed, out[:, expanded.shape[1]:])


def test_prefill_and_decode_equal_the_full_forward(vl):
    """Cached generation after images: each decode step's logits equal the full forward over the whole sequence,
    whose positions after the prompt continue at its largest position + 1 (transformers' rope_deltas)."""
    from qjax.runtime.generate import prefill

    model, _ = vl
    p = prepare_images(model, np.array([_prompt(2, seed=6)]), None, IMAGES[:2])
    t = p.input_ids.shape[1]
    cache = model.init_cache(1, t + 6)
    graphdef, state = nnx.split(model)
    logits, cache = prefill(graphdef, state, cache, jnp.asarray(p.input_ids), jnp.asarray(p.attention_mask),
                            position_ids=jnp.asarray(p.position_ids), image_embeds=p.image_embeds)
    assert int(cache.positions[0]) == int(p.position_ids.max()) + 1 < t  # an image spans fewer positions than tokens
    toks, steps = [], [np.asarray(logits)[:, None]]
    for _ in range(5):
        tok = jnp.argmax(steps[-1][:, -1], axis=-1).astype(jnp.int32)
        toks.append(int(tok[0]))
        out = model.forward(tok[:, None], cache=cache)
        cache = out.cache
        steps.append(np.asarray(out.logits))
    ids = np.concatenate([p.input_ids, np.array([toks], np.int32)], axis=1)
    after = p.position_ids.max() + 1 + np.arange(len(toks))
    pos = np.concatenate([p.position_ids, np.broadcast_to(after, (3, 1, len(toks)))], axis=2)
    full = np.asarray(model.forward(jnp.asarray(ids), position_ids=jnp.asarray(pos),
                                    image_embeds=p.image_embeds).logits)
    assert np.abs(np.concatenate(steps, axis=1) - full[:, t - 1:]).max() <= CACHE_TOL


def test_batched_image_prompts_equal_each_alone(vl):
    """Left-padded rows with different image counts and sizes: each row's tokens are its own generation's."""
    model, _ = vl
    a, b = _prompt(1, seed=7), _prompt(2, seed=8)
    width = max(len(a), len(b))
    ids = np.zeros((2, width), np.int32)
    mask = np.zeros((2, width), np.int32)
    for r, row in enumerate((a, b)):
        ids[r, width - len(row):], mask[r, width - len(row):] = row, 1
    both = qjax.generate(model, ids, attention_mask=mask, images=[IMAGES[2], IMAGES[0], IMAGES[1]],
                         max_new_tokens=6)
    alone_a = qjax.generate(model, np.array([a]), images=[IMAGES[2]], max_new_tokens=6)
    alone_b = qjax.generate(model, np.array([b]), images=IMAGES[:2], max_new_tokens=6)
    np.testing.assert_array_equal(both[0, -6:], alone_a[0, -6:])
    np.testing.assert_array_equal(both[1, -6:], alone_b[0, -6:])


def test_prompt_and_image_mismatches_are_one_clear_error(vl):
    model, _ = vl
    with pytest.raises(PromptError, match="2 image placeholders but 1 image was given"):
        qjax.generate(model, np.array([_prompt(2)]), images=IMAGES[:1], max_new_tokens=2)
    with pytest.raises(PromptError, match="video"):
        qjax.generate(model, np.array([_prompt(1) + [S, V, E]]), images=IMAGES[:1], max_new_tokens=2)
    with pytest.raises(ValueError, match="speculative decoding with image input"):
        qjax.generate(model, np.array([_prompt(1)]), images=IMAGES[:1], max_new_tokens=2, speculative="mtp")
    with pytest.raises(qjax.ImageError, match="image 0: cannot decode"):
        qjax.generate(model, np.array([_prompt(1)]), images=[b"not an image"], max_new_tokens=2)


# ---------------------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vl_bf16(tmp_path_factory):
    return write_vl_checkpoint(tmp_path_factory.mktemp("vl-bf16") / "vl", dtype=torch.bfloat16, seed=2,
                               with_mtp=True)


def test_tower_loads_in_its_stored_dtype_and_text_only_skips_it(vl_bf16):
    model = qjax.load_model(vl_bf16)
    assert model.dtype == jnp.bfloat16 and model.visual.dtype == jnp.bfloat16
    wide = qjax.load_model(vl_bf16, dtype="float32")  # an explicit dtype is the tower's too (numerics comparisons)
    assert wide.visual.dtype == jnp.float32
    text = qjax.load_model(vl_bf16, text_only=True)
    assert text.visual is None
    leaves = jax.tree.leaves(nnx.state(text))
    assert sum(x.size for x in leaves) < sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    with pytest.raises(PromptError, match="vision tower is not loaded"):
        qjax.generate(text, np.array([_prompt(1)]), images=IMAGES[:1], max_new_tokens=2)


def test_text_only_checkpoint_refuses_images(tiny_hf):
    model = qjax.load_model(tiny_hf[1])
    with pytest.raises(PromptError, match="text-only"):
        qjax.generate(model, np.array([[1, 2, 3]]), images=IMAGES[:1], max_new_tokens=2)


def _rewrite(folder, edit):
    from safetensors.numpy import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = dict(load_file(path))
    edit(tensors)
    save_file(tensors, path)


def test_a_broken_tower_is_a_load_error_naming_the_tensor(vl_dir, tmp_path):
    import shutil

    missing = str(shutil.copytree(vl_dir, tmp_path / "missing"))
    _rewrite(missing, lambda t: t.pop("model.visual.blocks.1.attn.qkv.bias"))
    with pytest.raises(qjax.LoadError, match=r"missing \(1\): model\.visual\.blocks\.1\.attn\.qkv\.bias"):
        qjax.load_model(missing)
    packed = str(shutil.copytree(vl_dir, tmp_path / "packed"))

    def quantize(t):
        w = t.pop("model.visual.merger.linear_fc1.weight")
        t["model.visual.merger.linear_fc1.weight_packed"] = np.zeros((w.shape[0], w.shape[1] // 8), np.int32)

    _rewrite(packed, quantize)
    with pytest.raises(qjax.LoadError, match="vision tower is stored quantized"):
        qjax.load_model(packed)
    assert qjax.load_model(packed, text_only=True).visual is None  # the text model still loads


def test_export_without_source_is_composite_and_reloads_the_tower(vl_bf16, tmp_path):
    from qjax.convert import save_pretrained

    model = qjax.load_model(vl_bf16)
    out = save_pretrained(model, tmp_path / "copy")
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["image_token_id"] == I
    back = qjax.load_model(out)
    assert back.visual.dtype == jnp.bfloat16
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model.visual)), nnx.to_flat_state(nnx.state(back.visual))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(p))


@pytest.mark.slow  # transformers loading a compressed-tensors export: ~10 s
def test_w2w4_export_answers_image_prompts_with_the_tower_in_bf16(vl_bf16, tmp_path):
    """RTN w2w4 (2-bit experts, 4-bit rest) of the BF16 VL checkpoint, exported with its source: the tower is
    copied byte for byte and loads in BF16 next to the packed body; image logits equal transformers' on the same
    export (compressed-tensors' decompression), both in float32."""
    from oracles.ct import ct_vl_reference_logits
    from test_rtn import RECIPE, assert_kept_as_stored

    from qjax.autoround.rtn import quantize_model
    from qjax.convert import save_pretrained

    dense = qjax.load_model(vl_bf16)
    qm = quantize_model(dense, RECIPE)
    assert qm.visual.dtype == jnp.bfloat16
    out = save_pretrained(qm, tmp_path / "w2w4", source=vl_bf16,
                          extra_files=[os.path.join(vl_bf16, f) for f in ("preprocessor_config.json",
                                                                          "tokenizer.json", "tokenizer_config.json")])
    assert_kept_as_stored(vl_bf16, out)
    back = qjax.load_model(out)
    assert back.quant is not None and back.visual.dtype == jnp.bfloat16
    prompt = np.array([_prompt(1, seed=9)])
    tokens = qjax.generate(back, prompt, images=IMAGES[:1], max_new_tokens=4)
    assert tokens.shape[1] > prompt.shape[1] + 3
    # the features the quantized model sees are the BF16 tower's, unchanged by quantizing the body
    feats = prepare_images(back, prompt, None, IMAGES[:1]).image_embeds
    np.testing.assert_array_equal(np.asarray(feats), np.asarray(prepare_images(dense, prompt, None,
                                                                                IMAGES[:1]).image_embeds))
    wide = qjax.load_model(out, dtype="float32")
    p = prepare_images(wide, prompt, None, IMAGES[:1])
    got = np.asarray(wide.forward(jnp.asarray(p.input_ids), position_ids=jnp.asarray(p.position_ids),
                                  image_embeds=p.image_embeds).logits)
    inputs = hf_vl_inputs(out, IMAGES[:1], p.input_ids)
    want = ct_vl_reference_logits(out, p.input_ids, inputs["pixel_values"], inputs["image_grid_thw"])
    assert np.abs(got - want).max() <= TEXT_TOL
