"""Image preprocessing for the Qwen3.5/3.6-MoE vision tower, in numpy + Pillow, equal to transformers.

The reference is transformers' ``Qwen2VLImageProcessorPil`` (what ``AutoImageProcessor`` gives for model_type
``qwen3_5_moe`` without torchvision) and its base ``PilBackend``; :func:`preprocess` reproduces it bit for bit:

1. RGB: an image with an alpha band (``"A"`` in ``getbands()``: RGBA, LA, PA) or a ``transparency`` entry in its
   ``info`` (a palette or L/RGB PNG with tRNS) is converted to RGBA and alpha-composited onto opaque white; any other
   mode is ``Image.convert("RGB")`` — so 16/32-bit integer and float images are *clipped* to 0..255, not scaled.
2. Resize with Pillow to :func:`smart_resize`'s size (multiples of ``patch_size · merge_size``, area within
   ``[min_pixels, max_pixels]``), in uint8 RGB, with the configured filter (bicubic).
3. Rescale (``x.astype(float64) * rescale_factor`` then float32) and normalize (``(x - mean) / std`` in float32).
   Both depend on one uint8 value and its channel only, so they are one 256-entry table per channel here (same
   IEEE operations in the same order, so the same bits; no full-size float64 temporary).
4. The still image is one temporal patch: each patch holds ``temporal_patch_size`` identical copies.
5. Patches flattened in ``(gh, gw, mh, mw)`` order — the ``merge_size²`` patches of one merged token are adjacent —
   each patch row laid out ``(C, T, ph, pw)``.

Decoding (:func:`load_image`, :func:`decode_image_url`) is separate: images come from untrusted requests, so every
failure is an :class:`ImageError` naming the request part (``where``), formats are an allowlist, pixel counts and
byte sizes are bounded before decoding, and qjax never fetches a remote URL.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import math
import os
import urllib.parse
from collections.abc import Sequence
from typing import Any

import numpy as np
try:
    from PIL import Image, ImageOps
except ImportError:  # sizes and the config work without Pillow: a machine without it still loads models
    Image = ImageOps = None

from qjax.validation import Fields, confined, open_regular, read_json, show

__all__ = ["ImageError", "ImageProcessorConfig", "ProcessedImages", "smart_resize", "num_image_tokens", "load_image",
           "decode_image_url", "preprocess", "ALLOWED_FORMATS", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_IMAGE_PIXELS",
           "PREPROCESSOR_CONFIG"]

PREPROCESSOR_CONFIG = "preprocessor_config.json"

# Formats Pillow may try on untrusted bytes. Pillow can open ~45 formats; several (EPS: runs Ghostscript, old
# scientific and game formats) are attack surface no chat client needs. These are what browsers and phones send.
ALLOWED_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF", "AVIF")

# Encoded size of one image (a data: URI's base64 text, or a file): a 64 MiB request part is not a photo.
DEFAULT_MAX_BYTES = 64 << 20
# Decoded pixels (width · height) of one image: 2**26 = 8192², a 67 MP photo (201 MB as RGB). Below Pillow's own
# decompression-bomb warning (MAX_IMAGE_PIXELS ≈ 89.5 MP), so an image we accept never warns; checked on the header,
# before any pixel is decoded.
DEFAULT_MAX_IMAGE_PIXELS = 1 << 26

# Pillow resampling filters (PIL.Image.Resampling): NEAREST 0, LANCZOS 1, BILINEAR 2, BICUBIC 3, BOX 4, HAMMING 5.
_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
_MAX_PIXELS_BOUND = 1 << 32  # a min/max_pixels no real config approaches (16 MP is the official maximum)
_MAX_JSON_BYTES = 1 << 20  # preprocessor_config.json is ~500 bytes


_NOT_NULL = {"patch_size": "a positive integer", "temporal_patch_size": "a positive integer",
             "merge_size": "a positive integer", "image_mean": "3 finite numbers", "image_std": "3 positive numbers",
             "rescale_factor": "a positive number", "do_resize": "true or false", "do_rescale": "true or false",
             "do_normalize": "true or false", "do_convert_rgb": "true or false",
             "resample": "a PIL resampling filter 0..5"}


class ImageError(ValueError):
    """An image or image-processor config qjax cannot use: one line naming the request part or file and field."""


# ---------------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """The image processor's settings. Defaults are the official Qwen3.5/3.6 ``preprocessor_config.json``
    (``size = {"shortest_edge": 65536, "longest_edge": 16777216}``, mean = std = 0.5), not transformers' class
    defaults (those are Qwen2-VL's: patch 14, 56² .. 28²·1280 pixels, CLIP mean/std)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536  # size["shortest_edge"]: the least area after resizing (256²)
    max_pixels: int = 16777216  # size["longest_edge"]: the most area after resizing (4096²)
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = 3  # PIL.Image.Resampling.BICUBIC

    def __post_init__(self) -> None:
        # Lists from callers become tuples (the dataclass is frozen and hashable); a lone number means all channels,
        # as transformers' normalize() allows.
        for name in ("image_mean", "image_std"):
            v = getattr(self, name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                v = (v, v, v)
            if isinstance(v, (list, tuple, np.ndarray)):
                v = tuple(x.item() if isinstance(x, np.generic) else x for x in v)
            object.__setattr__(self, name, v)
        self._check("ImageProcessorConfig")

    def _check(self, where: str) -> None:
        def fail(name: str, want: str) -> None:
            raise ImageError(f"{where}: field {name!r} must be {want}, got {show(getattr(self, name))}")

        def is_int(v: Any) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) \
                and math.isfinite(v)

        for name, hi in (("patch_size", 1024), ("temporal_patch_size", 64), ("merge_size", 64)):
            if not is_int(getattr(self, name)) or not 1 <= getattr(self, name) <= hi:
                fail(name, f"a positive integer ≤ {hi}")
        for name in ("min_pixels", "max_pixels"):
            if not is_int(getattr(self, name)) or not 1 <= getattr(self, name) <= _MAX_PIXELS_BOUND:
                fail(name, f"a positive integer ≤ {_MAX_PIXELS_BOUND}")
        if self.min_pixels > self.max_pixels:
            raise ImageError(f"{where}: min_pixels={self.min_pixels} (size.shortest_edge) is larger than "
                             f"max_pixels={self.max_pixels} (size.longest_edge)")
        if not (isinstance(self.image_mean, tuple) and len(self.image_mean) == 3 and all(map(is_num, self.image_mean))):
            fail("image_mean", "3 finite numbers")
        if not (isinstance(self.image_std, tuple) and len(self.image_std) == 3
                and all(is_num(x) and x > 0 for x in self.image_std)):
            fail("image_std", "3 positive numbers")
        if not is_num(self.rescale_factor) or self.rescale_factor <= 0:
            fail("rescale_factor", "a positive number")
        for name in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "true or false")
        if not is_int(self.resample) or int(self.resample) not in _RESAMPLE:
            fail("resample", "a PIL resampling filter 0..5 (" + ", ".join(f"{k} {v}" for k, v in _RESAMPLE.items())
                 + ")")

    @property
    def factor(self) -> int:
        """Side, in pixels, that resized images are a multiple of: one merged token (``patch_size · merge_size``)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per row of ``pixel_values``: ``3 · temporal_patch_size · patch_size²``."""
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    def replace(self, **changes: Any) -> "ImageProcessorConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, raw: Any, *, source: str = PREPROCESSOR_CONFIG, patch_size: int | None = None,
                  temporal_patch_size: int | None = None, merge_size: int | None = None) -> "ImageProcessorConfig":
        """A parsed ``preprocessor_config.json`` (untrusted: every field type- and range-checked; a ``null``
        ``size``, ``min_pixels`` or ``max_pixels`` means absent, as in transformers; any other ``null`` is refused).
        ``size`` and the legacy top-level ``min_pixels``/``max_pixels`` are combined
        exactly as ``Qwen2VLImageProcessorPil.__init__`` does: the legacy keys override ``size``. Fields the file
        lacks take the model's values (``patch_size`` … when given), else this class's defaults. Keys that do not
        change the image result (``image_processor_type``, ``processor_class``, ``do_center_crop``…) are ignored."""
        f = Fields(raw, source, ImageError)
        d = cls()
        # null: transformers treats a null size / min_pixels / max_pixels as absent, but sets any other field to
        # None, which then fails at the first image or silently turns a step off (do_rescale: null → no rescale).
        # Refused here, where the file can be named.
        for name, want in _NOT_NULL.items():
            if name in f.raw and f.raw[name] is None:
                f.fail(name, want, None)
        model = {"patch_size": patch_size, "temporal_patch_size": temporal_patch_size, "merge_size": merge_size}
        grid: dict[str, int] = {}
        for name, hi in (("patch_size", 1024), ("temporal_patch_size", 64), ("merge_size", 64)):
            mine = f.int(name, None, min=1, max=hi)
            theirs = model[name]
            if mine is not None and theirs is not None and mine != theirs:
                raise ImageError(f"{source}: field {name!r} is {mine} but the model's vision config has {theirs}")
            grid[name] = mine if mine is not None else theirs if theirs is not None else getattr(d, name)

        pixels = dict(min=1, max=_MAX_PIXELS_BOUND)
        size: dict[str, Any] | None = None
        if f.has("size"):
            raw_size = f.obj("size")
            size = dict(raw_size)
            s = Fields(raw_size, f"{source}: size", ImageError)
            for key in size:
                if key in ("shortest_edge", "longest_edge", "min_pixels", "max_pixels"):
                    s.int(key, None, **pixels)
        # transformers: a legacy key sets the size entry and removes its own name from the dict
        min_pixels = f.int("min_pixels", None, **pixels)
        max_pixels = f.int("max_pixels", None, **pixels)
        if size is None:
            size = {"shortest_edge": d.min_pixels, "longest_edge": d.max_pixels}
        if min_pixels is not None:
            size["shortest_edge"] = min_pixels
            size.pop("min_pixels", None)
        if max_pixels is not None:
            size["longest_edge"] = max_pixels
            size.pop("max_pixels", None)
        if set(size) != {"shortest_edge", "longest_edge"} or any(v is None for v in size.values()):
            raise ImageError(f"{source}: field 'size' must hold 'shortest_edge' and 'longest_edge' (or the file "
                             f"top-level 'min_pixels' and 'max_pixels'), got keys {show(sorted(size))}")
        if size["shortest_edge"] > size["longest_edge"]:
            # transformers accepts it (smart_resize then ignores min_pixels); it is a broken file
            raise ImageError(f"{source}: min_pixels={size['shortest_edge']} (size.shortest_edge) is larger than "
                             f"max_pixels={size['longest_edge']} (size.longest_edge)")

        def triple(name: str, default: tuple[float, ...], positive: bool) -> tuple[float, ...]:
            if not f.has(name):
                return default
            v = f.raw[name]
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                v = [v, v, v]
            ok = isinstance(v, list) and len(v) == 3 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and (x > 0 or not positive)
                for x in v)
            if not ok:
                f.fail(name, "3 positive numbers" if positive else "3 finite numbers", f.raw[name])
            return tuple(float(x) for x in v)

        resample = f.int("resample", d.resample, min=0, max=5)
        cfg = cls(
            **grid,
            min_pixels=size["shortest_edge"],
            max_pixels=size["longest_edge"],
            image_mean=triple("image_mean", d.image_mean, False),
            image_std=triple("image_std", d.image_std, True),
            rescale_factor=f.float("rescale_factor", d.rescale_factor, positive=True),
            do_resize=f.bool("do_resize", d.do_resize),
            do_rescale=f.bool("do_rescale", d.do_rescale),
            do_normalize=f.bool("do_normalize", d.do_normalize),
            do_convert_rgb=f.bool("do_convert_rgb", d.do_convert_rgb),
            resample=resample,
        )
        return cfg

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, *, patch_size: int | None = None,
                    temporal_patch_size: int | None = None,
                    merge_size: int | None = None) -> "ImageProcessorConfig":
        """The settings of checkpoint ``folder``: its ``preprocessor_config.json`` when there is one (a regular file
        directly in the folder; a symlink must resolve inside it or its Hugging Face cache ``blobs``), else the
        defaults. ``patch_size``, ``temporal_patch_size``, ``merge_size``: the model's vision config
        (``spatial_merge_size``), which a file must agree with."""
        folder = os.fspath(folder)
        path = os.path.join(folder, PREPROCESSOR_CONFIG)
        if not os.path.lexists(path):
            return cls.from_dict({}, source=path, patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                                 merge_size=merge_size)
        confined(folder, PREPROCESSOR_CONFIG, what=path, error=ImageError)
        if not os.path.isfile(path):
            raise ImageError(f"{path}: not a regular file")
        raw = read_json(path, error=ImageError, max_bytes=_MAX_JSON_BYTES)
        return cls.from_dict(raw, source=path, patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                             merge_size=merge_size)


# ---------------------------------------------------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------------------------------------------------
def smart_resize(height: int, width: int, factor: int = 32, min_pixels: int = 65536,
                 max_pixels: int = 16777216) -> tuple[int, int]:
    """(height, width) after resizing, as transformers' ``smart_resize``: each a multiple of ``factor``, the area
    within ``[min_pixels, max_pixels]``, the aspect ratio kept as closely as possible. Python's ``round`` (half to
    even) as in the reference. An aspect ratio over 200 is an :class:`ImageError`."""
    if height < 1 or width < 1:
        raise ImageError(f"image of {height}x{width} pixels (height x width) is empty")
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image of {height}x{width} pixels (height x width): absolute aspect ratio must be smaller "
                         f"than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _grid(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """(grid_h, grid_w) in patches of an image of that size, after resizing (if the config resizes)."""
    if cfg.do_resize:
        height, width = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    elif height % cfg.factor or width % cfg.factor:
        # transformers would fail in a reshape; say why instead
        raise ImageError(f"image of {height}x{width} pixels (height x width): with do_resize false, both sides must "
                         f"be multiples of patch_size·merge_size = {cfg.factor}")
    return height // cfg.patch_size, width // cfg.patch_size


def num_image_tokens(height: int, width: int, cfg: ImageProcessorConfig) -> int:
    """Placeholder tokens for an image of ``height`` x ``width`` pixels (before resizing): its patches after the
    merger, ``grid_h · grid_w / merge_size²`` (a still image is one temporal patch). What a prompt builder needs
    before the pixels are processed."""
    gh, gw = _grid(height, width, cfg)
    return gh * gw // cfg.merge_size ** 2


# ---------------------------------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------------------------------
def _reason(e: BaseException) -> str:
    """A short one-line reason from a decoder's exception (Pillow's can hold object reprs and newlines)."""
    if isinstance(e, Image.UnidentifiedImageError):
        return f"not a recognised image format (accepted: {', '.join(ALLOWED_FORMATS)})"
    if isinstance(e, Image.DecompressionBombError):
        return "too many pixels (decompression bomb guard)"
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:199] + "…"


def _check_pixels(im: Image.Image, where: str, max_image_pixels: int) -> None:
    w, h = im.size
    if w < 1 or h < 1:
        raise ImageError(f"{where}: image is empty ({w}x{h} pixels)")
    if w * h > max_image_pixels:
        raise ImageError(f"{where}: image of {w}x{h} pixels (width x height) is over the limit of "
                         f"{max_image_pixels} pixels")


def _formats() -> tuple[str, ...]:
    """The allowed formats this Pillow build has (Image.open raises KeyError for a format it lacks, e.g. AVIF)."""
    Image.init()
    return tuple(f for f in ALLOWED_FORMATS if f in Image.OPEN)


def _decode(fp: Any, where: str, what: str, max_image_pixels: int) -> Image.Image:
    """Open, bound, fully decode and detach the first frame of an encoded image; every failure an ImageError."""
    try:
        with Image.open(fp, formats=_formats()) as im:
            # the header's size, before any pixel is decoded (our bound is below Pillow's own warning threshold)
            _check_pixels(im, where, max_image_pixels)
            im.seek(0)  # animated / multi-frame: the first frame
            im.load()  # inside the try: truncated or corrupt data fails here, not later in preprocess
            # EXIF orientation applied, as transformers' load_image does and viewers show; either way a copy,
            # detached from the file, which is closed when this returns. A malformed EXIF block is ignored (the
            # pixels decoded fine) rather than failing the image.
            try:
                return ImageOps.exif_transpose(im)
            except Exception:
                return im.copy()
    except ImageError:
        raise
    except Exception as e:  # Pillow raises OSError, ValueError, SyntaxError, struct.error… for bad data
        raise ImageError(f"{where}: cannot decode image{what}: {_reason(e)}") from None


def _need_pillow(where: str) -> None:
    if Image is None:
        raise ImageError(f"{where}: image input needs Pillow (pip install 'pillow>=10'), which is not installed")


def load_image(source: Any, *, where: str, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
               max_bytes: int = DEFAULT_MAX_BYTES) -> Image.Image:
    """A decoded ``PIL.Image.Image`` from ``source``:

    - a filesystem path (``str`` / ``os.PathLike``) or raw ``bytes``: decoded by Pillow (formats in
      :data:`ALLOWED_FORMATS`), first frame, EXIF orientation applied;
    - a ``PIL.Image.Image``: returned as is, after loading it (a lazily opened file fails here);
    - a numpy ``uint8`` array ``[H, W]`` (mode L), ``[H, W, 3]`` (RGB) or ``[H, W, 4]`` (RGBA).

    The mode is kept (an alpha band is composited onto white by :func:`preprocess`, as transformers does). A path
    must be a regular file of at most ``max_bytes`` bytes (:func:`qjax.validation.open_regular`: a FIFO would block
    the read). Any failure, and an image over ``max_image_pixels`` pixels, is an :class:`ImageError` starting with
    ``where``."""
    _need_pillow(where)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(io.BytesIO(bytes(source)), where, "", max_image_pixels)
    if isinstance(source, (str, os.PathLike)):
        path = os.fsdecode(os.fspath(source))
        with open_regular(path, what="an image file", max_bytes=max_bytes, error=ImageError, where=where) as f:
            return _decode(f, where, f" file {path}", max_image_pixels)
    if isinstance(source, Image.Image):
        _check_pixels(source, where, max_image_pixels)
        try:
            source.load()
        except Exception as e:
            raise ImageError(f"{where}: cannot decode image: {_reason(e)}") from None
        return source
    if isinstance(source, np.ndarray):
        if source.dtype != np.uint8 or not (source.ndim == 2 or (source.ndim == 3 and source.shape[2] in (3, 4))):
            raise ImageError(f"{where}: a numpy image must be uint8 [H, W], [H, W, 3] or [H, W, 4], got "
                             f"{source.dtype} {list(source.shape)}")
        h, w = source.shape[:2]
        if h < 1 or w < 1 or h * w > max_image_pixels:
            raise ImageError(f"{where}: image of {w}x{h} pixels (width x height) is empty or over the limit of "
                             f"{max_image_pixels} pixels")
        return Image.fromarray(np.ascontiguousarray(source))
    raise ImageError(f"{where}: cannot use a {type(source).__name__} as an image (a path, bytes, a PIL image or a "
                     f"uint8 numpy array)")


def decode_image_url(url: str, *, where: str, allow_files: bool = True, max_bytes: int = DEFAULT_MAX_BYTES,
                     max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """The image of an OpenAI-style ``image_url`` part: ``data:image/<type>;base64,<data>`` (strict base64) or
    ``file:///absolute/path`` (unless ``allow_files`` is false). ``http(s)://`` is refused — qjax does not fetch
    remote images. ``max_bytes`` bounds the base64 text or the file's size, checked before decoding. Every failure
    is an :class:`ImageError` starting with ``where``."""
    _need_pillow(where)
    if not isinstance(url, str):
        raise ImageError(f"{where}: image url must be a string, got {type(url).__name__}")
    head = url[:16].lower()
    if head.startswith("data:"):
        return _decode_data_uri(url, where=where, max_bytes=max_bytes, max_image_pixels=max_image_pixels)
    if head.startswith("file:"):
        return _decode_file_url(url, where=where, allow_files=allow_files, max_bytes=max_bytes,
                                max_image_pixels=max_image_pixels)
    if head.startswith(("http://", "https://")):
        raise ImageError(f"{where}: qjax does not fetch remote images ({url[:url.find(':')]} URL); pass the image as a "
                         f"data: URI (data:image/png;base64,...) or a file:// path")
    scheme, sep, _ = url.partition(":")
    if not sep or not scheme or len(scheme) > 32 or not scheme.replace("+", "").replace("-", "").replace(".", "") \
            .isalnum():
        raise ImageError(f"{where}: not a URL ({show(url)}); pass a data: URI or a file:// path")
    raise ImageError(f"{where}: unsupported URL scheme {scheme!r}; pass a data: URI or a file:// path")


def _decode_data_uri(url: str, *, where: str, max_bytes: int, max_image_pixels: int) -> Image.Image:
    header, sep, data = url[5:].partition(",")
    if not sep:
        raise ImageError(f"{where}: malformed data: URI (no ',' before the data)")
    params = [p.strip() for p in header.split(";")]
    mime = params[0].lower()
    if not mime.startswith("image/") or len(mime) == len("image/"):
        raise ImageError(f"{where}: data: URI media type must be image/..., got {show(params[0] or '(none)')}")
    if "base64" not in (p.lower() for p in params[1:]):
        raise ImageError(f"{where}: data: URI must be base64-encoded (data:{mime};base64,...)")
    if len(data) > max_bytes:
        raise ImageError(f"{where}: data: URI holds {len(data)} bytes of base64, over the limit of {max_bytes}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{where}: data: URI is not valid base64 ({_reason(e)})") from None
    return _decode(io.BytesIO(raw), where, f" ({mime})", max_image_pixels)


def _decode_file_url(url: str, *, where: str, allow_files: bool, max_bytes: int,
                     max_image_pixels: int) -> Image.Image:
    if not allow_files:
        raise ImageError(f"{where}: local files are disabled here (file:// image URLs are refused); pass the image "
                         f"as a data: URI")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise ImageError(f"{where}: file URL must be file:///absolute/path (no host, query or fragment), got "
                         f"{show(url)}")
    path = urllib.parse.unquote(parts.path)
    if not path.startswith("/") or "\x00" in path:
        raise ImageError(f"{where}: file URL must name an absolute path, got {show(url)}")
    return load_image(path, where=where, max_image_pixels=max_image_pixels, max_bytes=max_bytes)


# ---------------------------------------------------------------------------------------------------------------------
# preprocessing
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class ProcessedImages:
    """The vision tower's input for ``n`` images.

    - ``pixel_values``: float32 ``[sum(t·h·w), 3 · temporal_patch_size · patch_size²]``, the images' patches one
      after another in input order; a row is laid out ``(C, T, ph, pw)``.
    - ``image_grid_thw``: int64 ``[n, 3]``, each image's ``(t, h, w)`` in patches (``t`` = 1 for a still image).
    - ``merge_size``: the spatial merge, so :attr:`merged_counts` can be derived.
    """

    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    merge_size: int = 2

    @property
    def merged_counts(self) -> tuple[int, ...]:
        """Tokens each image becomes after the merger (``t·h·w // merge_size²``): its placeholder count."""
        return tuple(int(t * h * w) // self.merge_size ** 2 for t, h, w in self.image_grid_thw)

    def __len__(self) -> int:
        return int(self.image_grid_thw.shape[0])


def _to_rgb(im: Image.Image, cfg: ImageProcessorConfig, where: str) -> Image.Image:
    """transformers' ``image_transforms.convert_to_rgb`` for a PIL image: transparency composited onto white."""
    if not cfg.do_convert_rgb:
        # transformers would then see 1, 2 or 4 channels and fail in normalize; only RGB goes through unchanged
        if im.mode != "RGB":
            raise ImageError(f"{where}: image mode {im.mode!r} needs do_convert_rgb (the config turns it off)")
        return im
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")


def _value_table(cfg: ImageProcessorConfig) -> np.ndarray:
    """float32 ``[3, 256]``: what rescale + normalize make of each uint8 value in each channel, with transformers'
    exact operations (``image_transforms.rescale``: float64 multiply, then float32; ``normalize``: float32
    ``(x - mean) / std`` with float32 mean and std)."""
    x: np.ndarray = np.arange(256, dtype=np.uint8)
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float32)
        mean = np.array(cfg.image_mean, dtype=x.dtype)
        std = np.array(cfg.image_std, dtype=x.dtype)
        table = (x[None, :] - mean[:, None]) / std[:, None]
    else:
        table = np.broadcast_to(x.astype(np.float32), (3, 256))
    return np.ascontiguousarray(table, dtype=np.float32)


_CHANNELS = np.arange(3)


def preprocess(images: Sequence[Image.Image], cfg: ImageProcessorConfig) -> ProcessedImages:
    """``pixel_values`` and ``image_grid_thw`` for ``images`` (PIL images, e.g. from :func:`load_image`), equal to
    transformers' ``Qwen2VLImageProcessorPil`` with the same settings (see the module docstring for the steps)."""
    _need_pillow("images")
    if isinstance(images, Image.Image):
        images = [images]
    p, m, T = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    prepared: list[tuple[Image.Image, int, int]] = []
    for i, im in enumerate(images):
        where = f"images[{i}]"
        if not isinstance(im, Image.Image):
            raise ImageError(f"{where}: expected a PIL.Image.Image, got {type(im).__name__} (see load_image)")
        w, h = im.size
        try:
            gh, gw = _grid(h, w, cfg)
        except ImageError as e:
            raise ImageError(f"{where}: {e}") from None
        prepared.append((im, gh, gw))

    total = sum(gh * gw for _, gh, gw in prepared)
    # one output buffer: each image's patches written in place (no per-image arrays to concatenate)
    pixel_values = np.empty((total, 3 * T * p * p), np.float32)
    grids = np.zeros((len(prepared), 3), np.int64)
    table = _value_table(cfg)
    offset = 0
    for i, (im, gh, gw) in enumerate(prepared):
        try:
            rgb = _to_rgb(im, cfg, f"images[{i}]")
            if cfg.do_resize and rgb.size != (gw * p, gh * p):
                rgb = rgb.resize((gw * p, gh * p), resample=cfg.resample, reducing_gap=None)
            arr = np.asarray(rgb, dtype=np.uint8)  # [H, W, 3]
        except ImageError:
            raise
        except Exception as e:  # a lazily opened image that fails to decode now, a mode Pillow cannot convert
            raise ImageError(f"images[{i}]: cannot convert or resize image: {_reason(e)}") from None
        values = table[_CHANNELS, arr]  # [H, W, 3] float32, rescaled and normalized
        # [H, W, C] → (gh/m, mh, ph, gw/m, mw, pw, C) → (gh/m, gw/m, mh, mw, C, ph, pw): a merged token's m² patches
        # adjacent, each patch channel-major as the vision tower's Conv3d expects
        patches = values.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
        n = gh * gw
        out = pixel_values[offset:offset + n].reshape(gh // m, gw // m, m, m, 3, T, p, p)
        out[...] = patches[:, :, :, :, :, None]  # the still image repeated over the temporal patch
        grids[i] = (1, gh, gw)
        offset += n
    return ProcessedImages(pixel_values=pixel_values, image_grid_thw=grids, merge_size=m)
