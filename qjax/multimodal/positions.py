"""The prompt side of image input: placeholder expansion and the 3-row M-RoPE position ids, as transformers builds them.

Host-side numpy only (no torch, no transformers): this runs once per request, before anything reaches the device.

**Placeholders.** A chat template writes each image as ``<|vision_start|><|image_pad|><|vision_end|>``. The processor
(transformers' ``Qwen3VLProcessor``) replaces that single ``<|image_pad|>`` by one copy per *merged* patch of the image,
``t*h*w // merge²`` copies for a ``(t, h, w)`` grid of patches (:func:`image_token_counts`), and the vision tower's
outputs later take those tokens' places in the embeddings. :func:`expand_image_tokens` does the same to token ids.

**Positions.** Qwen3.5/3.6 rotate queries and keys with M-RoPE: three position rows (temporal, height, width), each
driving its own section of the rotary frequencies. :func:`rope_index` is ``Qwen3_5MoeModel.get_rope_index`` with
``mm_token_type_ids = (input_ids == image_token_id)``:

* text tokens get the same position in all three rows, counting on from the previous token
  (``p, p+1, …``): a text-only prompt is ``arange(T)`` three times;
* an image of ``(t, h, w)`` patches (``H = h // merge``, ``W = w // merge`` merged patches) starting at position
  ``p`` gives its ``t*H*W`` tokens, in row-major ``(t, H, W)`` order, the positions ``(p + ti, p + hi, p + wi)``;
  the text after it starts at ``p + max(H, W)``, not at ``p + t*H*W`` — an image costs far fewer positions than
  tokens;
* padding (``attention_mask == 0``) is dropped before the runs are found and gets position 0 in every row.

Per row, ``delta = max position + 1 - (number of real tokens)`` (transformers' ``mrope_position_deltas``; 0 for text,
negative once an image takes more tokens than positions, as all but the smallest do).

**Decoding continues** from there: transformers' ``compute_3d_position_ids`` gives a cached-generation token with
``i`` real tokens before it (left padding not counted) the position ``i + delta`` in all three rows. So the first
generated token sits at ``n_real + delta = max prompt position + 1``, and the k-th (0-based) at
``max prompt position + 1 + k``, the same in the three rows: text after the prompt is plain 1-D RoPE shifted by
``delta``.

Video input (``<|video_pad|>``, timestamps between frames) is not supported: :func:`rope_index` refuses a video
token when given ``video_token_id``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["PromptError", "expand_image_tokens", "image_token_counts", "rope_index"]


class PromptError(ValueError):
    """Token ids and images that do not fit together; the message says how, in one line."""


def _n(count: int, noun: str) -> str:
    """``"1 image"``, ``"3 images"``: counts in error messages."""
    return f"{count} {noun}{'s' * (count != 1)}"


def _grids(image_grid_thw, spatial_merge_size: int) -> np.ndarray:
    """``image_grid_thw`` as an int64 ``[n_images, 3]`` array (``None`` → no images), each ``(t, h, w)`` checked."""
    if spatial_merge_size < 1:
        raise PromptError(f"spatial_merge_size must be at least 1, got {spatial_merge_size}")
    if image_grid_thw is None:
        return np.zeros((0, 3), np.int64)
    grids = np.asarray(image_grid_thw)
    if grids.size == 0:
        return np.zeros((0, 3), np.int64)
    if grids.ndim != 2 or grids.shape[1] != 3 or not np.issubdtype(grids.dtype, np.integer):
        raise PromptError(f"image_grid_thw must be integers of shape [n_images, 3], got {grids.dtype} {grids.shape}")
    grids = grids.astype(np.int64)
    for i, (t, h, w) in enumerate(grids.tolist()):
        # the vision tower merges merge×merge patches into one token: a grid it cannot merge has no token count
        if t < 1 or h < 1 or w < 1 or h % spatial_merge_size or w % spatial_merge_size:
            raise PromptError(f"image {i}: grid (t, h, w) = ({t}, {h}, {w}) patches is not positive with h and w "
                              f"multiples of the merge size {spatial_merge_size}")
    return grids


def image_token_counts(image_grid_thw, spatial_merge_size: int) -> list[int]:
    """How many ``<|image_pad|>`` tokens each image takes: ``t*h*w // merge²`` for its ``(t, h, w)`` patch grid.

    ``image_grid_thw``: ``[n_images, 3]`` ints (or ``None``: no images). Returns ``n_images`` ints — what the processor
    writes in place of each placeholder, and what :func:`expand_image_tokens` takes as ``counts``.
    """
    grids = _grids(image_grid_thw, spatial_merge_size)
    return [int(n) for n in grids.prod(axis=1) // spatial_merge_size**2]


def expand_image_tokens(ids: Sequence[int], counts: Sequence[int], image_token_id: int) -> list[int]:
    """Replace the i-th ``image_token_id`` in ``ids`` by ``counts[i]`` copies of it, as the processor does to the text.

    ``ids``: ``[T]`` token ids of one prompt as the chat template wrote it (one placeholder per image).
    ``counts``: ``[n_images]`` copies per image, in prompt order (:func:`image_token_counts`).
    Returns the ``[T - n_images + sum(counts)]`` ids the model sees. Raises :class:`PromptError` when the number of
    placeholders is not ``len(counts)``, or a count is below 1.
    """
    ids = [int(i) for i in ids]
    counts = [int(c) for c in counts]
    n_placeholders = sum(1 for i in ids if i == image_token_id)
    if n_placeholders != len(counts):
        raise PromptError(f"the prompt has {_n(n_placeholders, 'image placeholder')} but {_n(len(counts), 'image')} "
                          f"{'was' if len(counts) == 1 else 'were'} given")
    if any(c < 1 for c in counts):
        raise PromptError(f"every image takes at least one token, got counts {counts}")
    out: list[int] = []
    pending = iter(counts)
    for i in ids:
        if i == image_token_id:
            out.extend([i] * next(pending))
        else:
            out.append(i)
    return out


def _runs(is_image: np.ndarray) -> list[tuple[bool, int, int]]:
    """``(is_image, start, end)`` of each maximal run of equal values (``itertools.groupby`` of the token types)."""
    if is_image.size == 0:
        return []
    cuts = np.flatnonzero(is_image[1:] != is_image[:-1]) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [is_image.size]])
    return [(bool(is_image[s]), int(s), int(e)) for s, e in zip(starts, ends)]


def rope_index(input_ids, image_grid_thw, *, image_token_id: int, spatial_merge_size: int, attention_mask=None,
               video_token_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """M-RoPE position ids of a batch of prompts: ``Qwen3_5MoeModel.get_rope_index`` for image (and text) tokens.

    Args:
      input_ids: ``[B, T]`` ids, images already expanded (:func:`expand_image_tokens`).
      image_grid_thw: ``[n_images, 3]`` patch grids ``(t, h, w)``, or ``None``; consumed in order across the whole
        batch (row 0's images, then row 1's, …), as transformers' one shared iterator does.
      image_token_id: the ``<|image_pad|>`` id (``config.image_token_id``).
      spatial_merge_size: ``vision_config.spatial_merge_size`` (2 for Qwen3.5/3.6).
      attention_mask: ``[B, T]`` 1 for real tokens, 0 for padding (anywhere; left padding in practice); ``None``:
        all real.
      video_token_id: the ``<|video_pad|>`` id; when given, a real video token is refused (video is not supported).

    Returns:
      ``position_ids`` int32 ``[3, B, T]`` (rows: temporal, height, width; padding 0) and ``deltas`` int32 ``[B]``
      (max position + 1 - number of real tokens; the module docstring says how decoding uses it).

    Raises :class:`PromptError` (one line) when a run of image tokens is not the next image's ``t*h*w // merge²``
    tokens (two images with nothing between them form one run, as in transformers' groupby), when there are more runs
    than grids or grids left over, or on a video token.
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise PromptError(f"input_ids must be [batch, tokens], got shape {ids.shape}")
    if attention_mask is None:
        real = np.ones(ids.shape, bool)
    else:
        mask = np.asarray(attention_mask)
        if mask.shape != ids.shape:
            raise PromptError(f"attention_mask has shape {mask.shape}, input_ids {ids.shape}")
        real = mask.astype(bool)
    grids = _grids(image_grid_thw, spatial_merge_size)
    m = spatial_merge_size

    batch, length = ids.shape
    # int64 while building (as transformers' LongTensor); the positions of a 2^31-token prompt do not exist
    positions = np.zeros((3, batch, length), np.int64)
    deltas = np.zeros((batch,), np.int64)
    next_grid = 0
    for b in range(batch):
        columns = np.flatnonzero(real[b])  # padding is dropped before the runs are found, as transformers does
        row = ids[b, columns]
        if video_token_id is not None and np.any(row == video_token_id):
            col = int(columns[np.argmax(row == video_token_id)])
            raise PromptError(f"row {b} has a video token (id {video_token_id}) at column {col}: video input is not "
                              "supported, only images")
        pieces, cur = [], 0
        for is_image, start, end in _runs(row == image_token_id):
            n = end - start
            if not is_image:
                pieces.append(np.broadcast_to(np.arange(cur, cur + n), (3, n)))
                cur += n
                continue
            if next_grid >= len(grids):
                raise PromptError(f"row {b}: a run of {n} image tokens at column {int(columns[start])} but only "
                                  f"{_n(len(grids), 'image grid')} {'was' if len(grids) == 1 else 'were'} given")
            t, h, w = (int(x) for x in grids[next_grid])
            hm, wm = h // m, w // m
            if n != t * hm * wm:
                raise PromptError(
                    f"row {b}: a run of {n} image tokens at column {int(columns[start])} but image {next_grid} "
                    f"(grid {t}x{h}x{w}, merge {m}) takes {t * hm * wm}; images with no token between them merge "
                    "into one run")
            next_grid += 1
            # get_vision_position_ids: (t, H, W) meshgrid, row-major, every row offset by the image's start
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(hm), np.arange(wm), indexing="ij")
            pieces.append(np.stack([tt, hh, ww]).reshape(3, -1) + cur)
            # the next text starts after the image's larger spatial side (transformers: max(h, w) // merge)
            cur += max(h, w) // m
        if not pieces:
            # a row of padding only: transformers fails here (max of nothing); qjax leaves it at 0, delta 0
            continue
        row_positions = np.concatenate(pieces, axis=1)
        positions[:, b, columns] = row_positions
        deltas[b] = row_positions.max() + 1 - len(columns)
    if next_grid != len(grids):
        raise PromptError(f"{_n(len(grids), 'image grid')} {'was' if len(grids) == 1 else 'were'} given but the "
                          f"prompt{'s' * (batch != 1)} {'have' if batch != 1 else 'has'} {_n(next_grid, 'image')}")
    return positions.astype(np.int32), deltas.astype(np.int32)
