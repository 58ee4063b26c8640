"""Image preprocessing (qjax/multimodal/images.py) against transformers' ``Qwen2VLImageProcessorPil``.

Every image is built here at test time with numpy/Pillow. The reference is the processor ``AutoImageProcessor`` gives
for model_type ``qwen3_5_moe`` without torchvision (checked below); ``pixel_values`` must agree within 1e-6 (they
agree bit for bit) and ``image_grid_thw`` exactly. Bad input — corrupt or truncated files, bad data: URIs, remote
URLs, hostile ``preprocessor_config.json`` files — must be one ``ImageError`` line naming the part, never another
exception type.
"""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from qjax.multimodal.images import (
    ImageError,
    ImageProcessorConfig,
    ProcessedImages,
    decode_image_url,
    load_image,
    num_image_tokens,
    preprocess,
    smart_resize,
)

TOL = 1e-6


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------
def _hf(cfg: ImageProcessorConfig) -> Qwen2VLImageProcessorPil:
    """transformers' processor with ``cfg``'s settings."""
    return Qwen2VLImageProcessorPil(
        patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size, merge_size=cfg.merge_size,
        size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels},
        image_mean=list(cfg.image_mean), image_std=list(cfg.image_std), rescale_factor=cfg.rescale_factor,
        do_resize=cfg.do_resize, do_rescale=cfg.do_rescale, do_normalize=cfg.do_normalize,
        do_convert_rgb=cfg.do_convert_rgb, resample=cfg.resample)


def _compare(images: list[Image.Image], cfg: ImageProcessorConfig) -> ProcessedImages:
    ref = _hf(cfg)(images=images, return_tensors="np")
    out = preprocess(images, cfg)
    assert out.pixel_values.dtype == np.float32 and out.image_grid_thw.dtype == np.int64
    assert out.pixel_values.shape == ref["pixel_values"].shape
    np.testing.assert_array_equal(out.image_grid_thw, ref["image_grid_thw"])
    diff = float(np.abs(out.pixel_values - ref["pixel_values"].astype(np.float32)).max(initial=0.0))
    assert diff <= TOL, diff
    assert out.merged_counts == tuple(int(t * h * w) // cfg.merge_size ** 2 for t, h, w in ref["image_grid_thw"])
    return out


def _rgb(h: int, w: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    """A photo-like uint8 image: smooth gradients plus noise (so every resampling tap matters)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 / max(w - 1, 1)), (y * 255 / max(h - 1, 1)), ((x + y) * 7) % 256] +
                    [((x * y) % 256)] * (channels - 3), axis=-1)
    noisy = base + rng.normal(0, 25, base.shape)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def _png(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG", **kw)
    return buf.getvalue()


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG signature + IHDR claiming ``width`` x ``height`` and no pixel data (a decompression-bomb header)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    idat = chunk(b"IDAT", zlib.compress(b"\0" * 64))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + idat + chunk(b"IEND", b"")


DEFAULT = ImageProcessorConfig()


# ---------------------------------------------------------------------------------------------------------------------
# pixel_values / image_grid_thw against transformers
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hw", [(224, 224), (300, 97), (97, 300), (480, 640), (33, 1000), (1000, 33), (517, 389)])
def test_sizes_match_transformers(hw):
    _compare([Image.fromarray(_rgb(*hw))], DEFAULT)


@pytest.mark.parametrize("hw", [(20, 20), (1, 1), (2, 300), (7, 13)])
def test_tiny_images_upscaled_to_min_pixels(hw):
    out = _compare([Image.fromarray(_rgb(*hw, seed=1))], DEFAULT)
    t, h, w = out.image_grid_thw[0]
    assert h * w * 16 * 16 >= DEFAULT.min_pixels


@pytest.mark.parametrize("hw", [(800, 600), (333, 1000), (1200, 1200), (4000, 20)])
def test_max_pixels_bound(hw):
    cfg = ImageProcessorConfig(max_pixels=256 * 256, min_pixels=32 * 32)
    out = _compare([Image.fromarray(_rgb(*hw, seed=2))], cfg)
    t, h, w = out.image_grid_thw[0]
    # transformers' smart_resize keeps each side ≥ one factor (32 px), so a thin image can exceed max_pixels
    # (4000x20 → 7232x64 = 462,848 > 65,536): matched, not "fixed"
    assert h * w * 16 * 16 <= cfg.max_pixels or min(h, w) == cfg.merge_size


def _modes() -> dict[str, Image.Image]:
    rng = np.random.default_rng(5)
    rgb = _rgb(61, 83, seed=3)
    rgba = _rgb(61, 83, seed=4, channels=4)
    rgba[..., 3] = np.where(rng.random((61, 83)) < 0.3, 0, rng.integers(0, 256, (61, 83)))  # partial transparency
    pal = Image.fromarray(rgb).quantize(32)
    pal_t = pal.copy()
    pal_t.info["transparency"] = 5  # a GIF/PNG palette entry marked transparent
    rgb_t = Image.fromarray(rgb)
    rgb_t.info["transparency"] = tuple(int(v) for v in rgb[0, 0])  # PNG tRNS for an RGB image
    la = Image.fromarray(np.stack([rgb[..., 0], rgba[..., 3]], -1), "LA")
    i16 = Image.fromarray((rng.integers(0, 400, (61, 83))).astype(np.uint16))  # values past 255 (clipped)
    return {
        "RGB": Image.fromarray(rgb), "RGBA": Image.fromarray(rgba), "L": Image.fromarray(rgb[..., 1]), "LA": la,
        "P": pal, "P+transparency": pal_t, "RGB+transparency": rgb_t, "PA": pal.convert("PA"),
        "1": Image.fromarray(rgb[..., 0]).convert("1"), "CMYK": Image.fromarray(rgb).convert("CMYK"),
        "I;16": i16, "I": i16.convert("I"), "F": Image.fromarray(rng.normal(128, 80, (61, 83)).astype(np.float32)),
        "YCbCr": Image.fromarray(rgb).convert("YCbCr"),
    }


@pytest.mark.parametrize("mode", list(_modes()))
def test_modes_match_transformers(mode):
    im = _modes()[mode]
    _compare([im], DEFAULT)


def test_rgba_composited_on_white():
    """transformers' convert_to_rgb blends alpha onto white (not a dropped alpha band): a fully transparent black
    image is all white."""
    im = Image.fromarray(np.zeros((64, 64, 4), np.uint8))
    out = _compare([im], ImageProcessorConfig(min_pixels=64 * 64))
    np.testing.assert_array_equal(out.pixel_values, 1.0)  # (1 - 0.5) / 0.5


def test_several_images_in_one_call():
    modes = _modes()
    images = [Image.fromarray(_rgb(300, 97)), modes["RGBA"], Image.fromarray(_rgb(33, 1000, seed=9)), modes["P"]]
    out = _compare(images, DEFAULT)
    # concatenation order: each image's rows are its own preprocessing, in input order
    offset = 0
    for im, (t, h, w) in zip(images, out.image_grid_thw):
        alone = preprocess([im], DEFAULT)
        np.testing.assert_array_equal(out.pixel_values[offset:offset + t * h * w], alone.pixel_values)
        offset += t * h * w
    assert offset == out.pixel_values.shape[0] and len(out) == 4


@pytest.mark.parametrize("changes", [
    dict(resample=2),
    dict(resample=1, image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711)),
    dict(patch_size=14, temporal_patch_size=3, merge_size=2, min_pixels=56 * 56, max_pixels=28 * 28 * 300),
    dict(merge_size=1, rescale_factor=1 / 127.5),
    dict(do_rescale=False),
    dict(do_normalize=False),
    dict(do_rescale=False, do_normalize=False),
])
def test_other_settings_match_transformers(changes):
    cfg = DEFAULT.replace(**changes)
    _compare([Image.fromarray(_rgb(150, 211, seed=11)), _modes()["LA"]], cfg)


def test_no_resize_matches_transformers():
    cfg = DEFAULT.replace(do_resize=False)
    _compare([Image.fromarray(_rgb(64, 96, seed=12)), Image.fromarray(_rgb(32, 32, seed=13))], cfg)
    with pytest.raises(ImageError, match=r"images\[0\]: image of 50x96 .* multiples of .* 32"):
        preprocess([Image.fromarray(_rgb(50, 96))], cfg)


def test_patch_layout():
    """Rows are patches in (gh, gw, mh, mw) order; each row (C, T, ph, pw) with T identical copies."""
    cfg = ImageProcessorConfig(min_pixels=64 * 64, max_pixels=64 * 64, do_normalize=False, do_rescale=False)
    arr = _rgb(64, 64, seed=14)
    out = preprocess([Image.fromarray(arr)], cfg)
    assert out.image_grid_thw.tolist() == [[1, 4, 4]]
    rows = out.pixel_values.reshape(2, 2, 2, 2, 3, 2, 16, 16)  # gh/m, gw/m, mh, mw, C, T, ph, pw
    for a in range(2):
        for b in range(2):
            for mh in range(2):
                for mw in range(2):
                    y, x = (2 * a + mh) * 16, (2 * b + mw) * 16
                    want = arr[y:y + 16, x:x + 16].transpose(2, 0, 1).astype(np.float32)
                    for t in range(2):
                        np.testing.assert_array_equal(rows[a, b, mh, mw, :, t], want)
    assert out.merged_counts == (4,)


def test_empty_batch():
    out = preprocess([], DEFAULT)
    assert out.pixel_values.shape == (0, DEFAULT.patch_dim) and out.image_grid_thw.shape == (0, 3)


# ---------------------------------------------------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------------------------------------------------
_SIZES = [(h, w) for h in (1, 15, 16, 31, 32, 33, 97, 224, 255, 256, 257, 480, 1080, 4095, 4096, 9000, 20000)
          for w in (1, 3, 17, 32, 48, 300, 640, 1920, 4096, 5000, 12345)]


def test_smart_resize_and_token_counts_match_transformers():
    hf = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                  size={"shortest_edge": 65536, "longest_edge": 16777216})
    small = DEFAULT.replace(max_pixels=256 * 256, min_pixels=32 * 32)
    checked = 0
    for h, w in _SIZES:
        if max(h, w) / min(h, w) > 200:
            with pytest.raises(ValueError) as ref_err:
                hf_smart_resize(h, w, 32, 65536, 16777216)
            with pytest.raises(ImageError, match=rf"image of {h}x{w} pixels .*aspect ratio must be smaller than 200"):
                smart_resize(h, w, 32, 65536, 16777216)
            with pytest.raises(ImageError, match="aspect ratio"):
                num_image_tokens(h, w, DEFAULT)
            assert "aspect ratio" in str(ref_err.value)
            continue
        for cfg in (DEFAULT, small):
            want = hf_smart_resize(h, w, 32, cfg.min_pixels, cfg.max_pixels)
            assert smart_resize(h, w, 32, cfg.min_pixels, cfg.max_pixels) == want
        assert num_image_tokens(h, w, DEFAULT) == hf.get_number_of_image_patches(h, w) // 4
        checked += 1
    assert checked > 100


# ---------------------------------------------------------------------------------------------------------------------
# preprocessor_config.json
# ---------------------------------------------------------------------------------------------------------------------
OFFICIAL = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}
LEGACY = {
    "min_pixels": 3136, "max_pixels": 200704, "size": {"min_pixels": 1, "max_pixels": 2},
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_rescale": True, "rescale_factor": 0.00392156862745098, "do_normalize": True, "do_convert_rgb": True,
    "resample": 2, "image_processor_type": "Qwen2VLImageProcessor",
}


def _write(folder: Path, raw) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = raw if isinstance(raw, str) else json.dumps(raw)
    (folder / "preprocessor_config.json").write_text(text)
    return folder


@pytest.mark.parametrize("raw", [OFFICIAL, LEGACY,
                                 {"max_pixels": 100000, "image_std": 0.25, "min_pixels": None, "size": None}],
                         ids=["size", "legacy-min-max", "partial"])
def test_config_file_matches_transformers(tmp_path, raw):
    cfg = ImageProcessorConfig.from_folder(_write(tmp_path, raw))
    hf_raw = dict(raw)
    for k, v in _qjax_defaults_for(raw).items():
        hf_raw[k] = v  # the fields the file lacks: qjax's defaults (transformers' are Qwen2-VL's)
    hf = Qwen2VLImageProcessorPil(**hf_raw)
    assert (cfg.min_pixels, cfg.max_pixels) == (hf.size.shortest_edge, hf.size.longest_edge)
    assert (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) == (hf.patch_size, hf.temporal_patch_size,
                                                                         hf.merge_size)
    assert cfg.image_mean == tuple(np.broadcast_to(hf.image_mean, 3)) and cfg.image_std == tuple(
        np.broadcast_to(hf.image_std, 3))
    assert (cfg.rescale_factor, cfg.resample, cfg.do_rescale, cfg.do_normalize, cfg.do_convert_rgb) == (
        hf.rescale_factor, int(hf.resample), hf.do_rescale, hf.do_normalize, hf.do_convert_rgb)
    images = [Image.fromarray(_rgb(211, 150, seed=21)), _modes()["RGBA"]]
    ref = hf(images=images, return_tensors="np")
    out = preprocess(images, cfg)
    np.testing.assert_array_equal(out.image_grid_thw, ref["image_grid_thw"])
    assert float(np.abs(out.pixel_values - ref["pixel_values"]).max()) <= TOL


def _qjax_defaults_for(raw: dict) -> dict:
    """qjax's defaults for the fields ``raw`` does not set (size only when neither form of it is present)."""
    d = ImageProcessorConfig()
    out = {k: getattr(d, k) for k in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor",
                                     "resample")}
    out.update(image_mean=list(d.image_mean), image_std=list(d.image_std))
    if raw.get("size") is None:
        out["size"] = {"shortest_edge": d.min_pixels, "longest_edge": d.max_pixels}
    return {k: v for k, v in out.items() if raw.get(k) is None}


def test_auto_image_processor_is_the_pil_one(tmp_path):
    """The reference really is what transformers picks for a qwen3_5_moe folder here."""
    from transformers import AutoImageProcessor

    folder = _write(tmp_path, OFFICIAL)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    hf = AutoImageProcessor.from_pretrained(str(folder))
    assert type(hf).__name__ == "Qwen2VLImageProcessorPil"
    images = [Image.fromarray(_rgb(97, 300, seed=22))]
    ref = hf(images=images, return_tensors="np")
    out = preprocess(images, ImageProcessorConfig.from_folder(folder))
    assert float(np.abs(out.pixel_values - ref["pixel_values"]).max()) <= TOL


def test_config_defaults_and_model_sizes(tmp_path):
    assert ImageProcessorConfig.from_folder(tmp_path) == ImageProcessorConfig()
    cfg = ImageProcessorConfig.from_folder(tmp_path, patch_size=14, merge_size=3, temporal_patch_size=1)
    assert (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size) == (14, 3, 1)
    _write(tmp_path, {"image_mean": [0.1, 0.2, 0.3]})  # the file lacks the grid sizes: the model's are used
    cfg = ImageProcessorConfig.from_folder(tmp_path, patch_size=14, merge_size=2)
    assert cfg.patch_size == 14 and cfg.image_mean == (0.1, 0.2, 0.3)
    _write(tmp_path, OFFICIAL)
    assert ImageProcessorConfig.from_folder(tmp_path, patch_size=16, merge_size=2, temporal_patch_size=2) == \
        ImageProcessorConfig()


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and type(e.value) is ImageError
    return msg


@pytest.mark.parametrize("raw, pattern", [
    ({"image_std": [0.5, 0.5]}, r"field 'image_std' must be 3 positive numbers"),
    ({"image_std": [0.5, 0, 0.5]}, r"field 'image_std' must be 3 positive numbers"),
    ({"image_mean": "gray"}, r"field 'image_mean' must be 3 finite numbers"),
    ({"image_mean": [0.5, True, 0.5]}, r"field 'image_mean' must be 3 finite numbers"),
    ({"patch_size": "16"}, r"field 'patch_size' must be a positive integer"),
    ({"patch_size": True}, r"field 'patch_size' must be a positive integer"),
    ({"merge_size": 0}, r"field 'merge_size' must be a positive integer"),
    ({"temporal_patch_size": 2.5}, r"field 'temporal_patch_size' must be a positive integer"),
    ({"size": [256, 256]}, r"field 'size' must be a JSON object"),
    ({"size": {"shortest_edge": 65536}}, r"field 'size' must hold 'shortest_edge' and 'longest_edge'"),
    ({"size": {"height": 224, "width": 224}}, r"field 'size' must hold 'shortest_edge' and 'longest_edge'"),
    ({"size": {"min_pixels": 10, "max_pixels": 1000}}, r"field 'size' must hold"),
    ({"size": {"shortest_edge": "a", "longest_edge": 5}}, r"size: field 'shortest_edge' must be a positive integer"),
    ({"min_pixels": -1}, r"field 'min_pixels' must be a positive integer"),
    ({"max_pixels": 1e30}, r"field 'max_pixels' must be a positive integer"),
    ({"min_pixels": 5000, "max_pixels": 100}, r"min_pixels=5000 .* larger than max_pixels=100"),
    ({"do_resize": "yes"}, r"field 'do_resize' must be true or false"),
    ({"do_convert_rgb": 1}, r"field 'do_convert_rgb' must be true or false"),
    ({"resample": 9}, r"field 'resample' must be"),
    ({"rescale_factor": 0}, r"field 'rescale_factor' must be a positive number"),
    ({"resample": None}, r"field 'resample' must be a PIL resampling filter 0..5, got None"),
    ({"do_rescale": None}, r"field 'do_rescale' must be true or false, got None"),
    ({"image_std": None}, r"field 'image_std' must be 3 positive numbers, got None"),
    ({"rescale_factor": "1/255"}, r"field 'rescale_factor' must be a positive number"),
    ({"patch_size": 14}, r"field 'patch_size' is 14 but the model's vision config has 16"),
    ({"merge_size": 3}, r"field 'merge_size' is 3 but the model's vision config has 2"),
    ("[1, 2, 3]", r"must be a JSON object"),
    ("{\"patch_size\": 16,", r"not valid JSON"),
    ("{\"image_mean\": [NaN, 0.5, 0.5]}", r"field 'image_mean' must be 3 finite numbers"),
])
def test_bad_config_files(tmp_path, raw, pattern):
    folder = _write(tmp_path / "model", raw)
    with pytest.raises(ImageError) as e:
        ImageProcessorConfig.from_folder(folder, patch_size=16, merge_size=2, temporal_patch_size=2)
    msg = _one_line(e)
    assert "preprocessor_config.json" in msg
    assert e.match(pattern), msg


def test_config_symlink_escaping_the_folder(tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps(OFFICIAL))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "preprocessor_config.json").symlink_to(outside)
    with pytest.raises(ImageError, match=r"preprocessor_config.json.* resolves outside the checkpoint folder") as e:
        ImageProcessorConfig.from_folder(folder)
    _one_line(e)
    # a symlink that stays inside is fine
    (folder / "real.json").write_text(json.dumps(OFFICIAL))
    (folder / "preprocessor_config.json").unlink()
    (folder / "preprocessor_config.json").symlink_to("real.json")
    assert ImageProcessorConfig.from_folder(folder) == ImageProcessorConfig()
    # a directory (or dangling link) in its place
    (folder / "preprocessor_config.json").unlink()
    (folder / "preprocessor_config.json").mkdir()
    with pytest.raises(ImageError, match=r"preprocessor_config.json: not a regular file"):
        ImageProcessorConfig.from_folder(folder)


def test_config_constructor_checks():
    with pytest.raises(ImageError, match=r"ImageProcessorConfig: field 'image_std' must be 3 positive numbers"):
        ImageProcessorConfig(image_std=(0.5, 0.5))
    with pytest.raises(ImageError, match=r"field 'resample'"):
        ImageProcessorConfig(resample=7)
    assert ImageProcessorConfig(image_mean=[0.5, 0.5, 0.5]).image_mean == (0.5, 0.5, 0.5)


# ---------------------------------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------------------------------
def test_load_image_sources(tmp_path):
    arr = _rgb(40, 50, seed=30)
    png = _png(Image.fromarray(arr))
    path = tmp_path / "a b.png"
    path.write_bytes(png)
    for src in (png, bytearray(png), str(path), path, Image.fromarray(arr), arr):
        im = load_image(src, where="src")
        assert im.mode == "RGB" and np.array_equal(np.asarray(im), arr)
    assert load_image(arr[..., 0], where="x").mode == "L"
    rgba = load_image(_rgb(8, 9, channels=4), where="x")
    assert rgba.mode == "RGBA" and rgba.size == (9, 8)
    # data: and file:// URLs give the same image
    for url in (_data_uri(png), _data_uri(png, "image/jpeg"), "file://" + str(path).replace(" ", "%20"),
                "FILE://localhost" + str(path).replace(" ", "%20"), "DATA:image/PNG;BASE64," + base64.b64encode(
                    png).decode()):
        assert np.array_equal(np.asarray(decode_image_url(url, where="u")), arr), url
    # alpha kept for preprocess to composite, as transformers does for a PIL image
    rgba_png = _png(_modes()["RGBA"])
    im = decode_image_url(_data_uri(rgba_png), where="u")
    assert im.mode == "RGBA"
    _compare([im], DEFAULT)


def test_animated_gif_first_frame_and_exif(tmp_path):
    frames = [Image.fromarray(_rgb(30, 40, seed=s)).quantize(64) for s in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    im = load_image(buf.getvalue(), where="gif")
    ref = Image.open(io.BytesIO(buf.getvalue()))
    assert getattr(ref, "n_frames", 1) == 3
    _compare([im], DEFAULT)
    np.testing.assert_array_equal(preprocess([im], DEFAULT).pixel_values, _hf(DEFAULT)(
        images=[ref], return_tensors="np")["pixel_values"])
    # EXIF orientation 6 (rotate 90° clockwise to view): applied, as transformers' load_image does
    jpg = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(_rgb(30, 40)).save(jpg, format="JPEG", exif=exif)
    assert load_image(jpg.getvalue(), where="jpg").size == (30, 40)


@pytest.mark.parametrize("call, pattern", [
    (lambda: load_image(b"definitely not an image", where="messages[0].content[1]"),
     r"^messages\[0\]\.content\[1\]: cannot decode image: not a recognised image format"),
    (lambda: load_image(_png(Image.fromarray(_rgb(64, 64)))[:300], where="part"),
     r"^part: cannot decode image: .*(truncated|broken|buffer)"),
    (lambda: load_image(_png(Image.fromarray(_rgb(64, 64)))[:40], where="part"), r"^part: cannot decode image: "),
    (lambda: load_image(_ppm(), where="part"), r"^part: cannot decode image: not a recognised image format"),
    (lambda: load_image(_png_header_only(30000, 30000), where="bomb"), r"^bomb: cannot decode image: too many pixels"),
    (lambda: load_image(_png_header_only(10000, 10000), where="big"),
     r"^big: image of 10000x10000 pixels .* over the limit of 67108864 pixels"),
    (lambda: load_image(_png(Image.fromarray(_rgb(64, 64))), where="p", max_image_pixels=1000),
     r"^p: image of 64x64 pixels .* over the limit of 1000 pixels"),
    (lambda: load_image(np.zeros((4, 4), np.float32), where="arr"), r"^arr: a numpy image must be uint8"),
    (lambda: load_image(np.zeros((4, 4, 2), np.uint8), where="arr"), r"^arr: a numpy image must be uint8"),
    (lambda: load_image(42, where="x"), r"^x: cannot use a int as an image"),
    (lambda: load_image("/nonexistent/qjax/cat.png", where="x"), r"^x: no such file: /nonexistent/qjax/cat.png"),
    (lambda: load_image(_truncated_lazy(), where="lazy"), r"^lazy: cannot decode image: "),
    (lambda: decode_image_url("data:image/png;base64,@@not*base64@@", where="u"),
     r"^u: data: URI is not valid base64"),
    (lambda: decode_image_url("data:image/png;base64,iVBORw0KGgo", where="u"), r"^u: data: URI is not valid base64"),
    (lambda: decode_image_url("data:text/plain;base64,aGVsbG8=", where="u"),
     r"^u: data: URI media type must be image/"),
    (lambda: decode_image_url("data:image/png,rawbytes", where="u"), r"^u: data: URI must be base64-encoded"),
    (lambda: decode_image_url("data:image/png;base64", where="u"), r"^u: malformed data: URI"),
    (lambda: decode_image_url(_data_uri(b"GIF89a-not-really"), where="u"), r"^u: cannot decode image \(image/png\): "),
    (lambda: decode_image_url(_data_uri(b"x" * 3000), where="u", max_bytes=1000),
     r"^u: data: URI holds 4000 bytes of base64, over the limit of 1000"),
    (lambda: decode_image_url("http://example.com/cat.png", where="u"),
     r"^u: qjax does not fetch remote images \(http URL\); pass the image as a data: URI .* or a file:// path"),
    (lambda: decode_image_url("https://example.com/cat.png", where="u"), r"^u: qjax does not fetch remote images"),
    (lambda: decode_image_url("ftp://example.com/cat.png", where="u"), r"^u: unsupported URL scheme 'ftp'"),
    (lambda: decode_image_url("s3://bucket/cat.png", where="u"), r"^u: unsupported URL scheme 's3'"),
    (lambda: decode_image_url("just some text", where="u"), r"^u: not a URL"),
    (lambda: decode_image_url(None, where="u"), r"^u: image url must be a string"),
    (lambda: decode_image_url("file:///nonexistent/qjax/cat.png", where="u"),
     r"^u: no such file: /nonexistent/qjax/cat.png"),
    (lambda: decode_image_url("file:///tmp", where="u"), r"^u: /tmp is a directory"),
    (lambda: decode_image_url("file://example.com/etc/passwd", where="u"), r"^u: file URL must be file:///absolute"),
    (lambda: decode_image_url("file:cat.png", where="u"), r"^u: file URL must name an absolute path"),
    (lambda: decode_image_url("file:///tmp/cat.png", where="u", allow_files=False), r"^u: local files are disabled"),
])
def test_bad_images(call, pattern):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(ImageError) as e:
            call()
    msg = _one_line(e)
    assert e.match(pattern), msg


def _ppm() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(_rgb(8, 8)).save(buf, format="PPM")  # decodable by Pillow, but not an allowed format
    return buf.getvalue()


def _truncated_lazy() -> Image.Image:
    return Image.open(io.BytesIO(_png(Image.fromarray(_rgb(64, 64)))[:400]))  # header fine, pixels missing


def test_bad_files(tmp_path):
    d = tmp_path / "dir.png"
    d.mkdir()
    with pytest.raises(ImageError, match=r"^x: .*dir.png is a directory") as e:
        load_image(d, where="x")
    _one_line(e)
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    with pytest.raises(ImageError, match=r"^u: .*fifo.png is not a regular file"):
        decode_image_url(f"file://{fifo}", where="u")
    with pytest.raises(ImageError, match=r"^x: .*fifo.png is not a regular file"):
        load_image(fifo, where="x")
    big = tmp_path / "big.png"
    big.write_bytes(_png(Image.fromarray(_rgb(64, 64))))
    with pytest.raises(ImageError, match=r"^u: .*big.png is \d+ bytes, over the limit of 100"):
        decode_image_url(f"file://{big}", where="u", max_bytes=100)
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(big.read_bytes()[:200])
    with pytest.raises(ImageError, match=r"^u: cannot decode image file .*corrupt.png: "):
        decode_image_url(f"file://{corrupt}", where="u")
    if os.geteuid() != 0:  # root reads anything
        big.chmod(0)
        with pytest.raises(ImageError, match=r"^u: cannot read .*big.png: Permission denied"):
            decode_image_url(f"file://{big}", where="u")


def test_bad_images_in_preprocess():
    with pytest.raises(ImageError, match=r"^images\[1\]: image of 1x300 pixels .*aspect ratio must be smaller than "):
        preprocess([Image.fromarray(_rgb(10, 10)), Image.fromarray(_rgb(1, 300))], DEFAULT)
    with pytest.raises(ImageError, match=r"^images\[0\]: expected a PIL.Image.Image, got ndarray"):
        preprocess([_rgb(10, 10)], DEFAULT)
    with pytest.raises(ImageError, match=r"^images\[0\]: cannot convert or resize image: "):
        preprocess([_truncated_lazy()], DEFAULT)
    with pytest.raises(ImageError, match=r"^images\[0\]: image mode 'L' needs do_convert_rgb"):
        preprocess([_modes()["L"]], DEFAULT.replace(do_convert_rgb=False))
