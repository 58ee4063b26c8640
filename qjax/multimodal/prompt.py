"""A token prompt plus images → what the text model's prefill takes: expanded ids, M-RoPE positions, image features.

    images ──load_image──► PIL ──preprocess──► pixel_values, image_grid_thw ──model.visual──► image_embeds [N, H]
    ids (one placeholder per image) ──expand_image_tokens──► ids (one per merged patch) ──rope_index──► [3, B, T]

The prompt carries one ``image_token_id`` per image where the chat template put ``<|image_pad|>`` (prompts already
expanded to the merged-patch count are accepted too); images are consumed in order, row after row, as
transformers' processor does with a flat image list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from qjax.multimodal.images import ImageError, ImageProcessorConfig, load_image, preprocess
from qjax.multimodal.positions import PromptError, expand_image_tokens, rope_index


@dataclasses.dataclass(frozen=True)
class ImagePrompt:
    """A prepared multimodal prompt.

    input_ids: ``[B, T]`` int32, image placeholders expanded, left-padded; attention_mask: ``[B, T]`` int32;
    position_ids: ``[3, B, T]`` int32 M-RoPE rows; image_embeds: ``[N, H]`` the tower's merged tokens in the text
    model's dtype (N = the prompt's placeholder count); image_grid_thw: ``[n, 3]`` int64 per image.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    position_ids: np.ndarray
    image_embeds: np.ndarray  # host array: the tower output, cut and cast on the host
    image_grid_thw: np.ndarray


def image_processor(model) -> ImageProcessorConfig:
    """The preprocessing a model's images get: the folder's ``preprocessor_config.json`` when it was loaded from one
    (``model.image_processor``), else the Qwen3.5/3.6 defaults with the tower's patch sizes."""
    proc = getattr(model, "image_processor", None)
    if proc is not None:
        return proc
    v = model.vision_config
    return ImageProcessorConfig(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                                merge_size=v.spatial_merge_size)


def check_vision(model) -> None:
    """Refuse image input, with the reason, when the model cannot take it."""
    if getattr(model, "vision_config", None) is None:
        raise PromptError("this checkpoint is text-only (its config.json has no vision_config): image input needs "
                          "a qwen3_5_moe checkpoint with model.visual.* tensors")
    if model.visual is None:
        raise PromptError("the vision tower is not loaded (text-only load: --limit-mm-per-prompt '{\"image\": 0}' "
                          "or text_only=True, or the checkpoint has no model.visual.* tensors): image input is "
                          "unavailable")


def prepare_images(model, input_ids, attention_mask, images: Sequence, *, pad_token_id: int = 0,
                   processor: ImageProcessorConfig | None = None) -> ImagePrompt:
    """Expand, position and encode a batch of prompts with their images.

    Args:
      input_ids: ``[B, T]`` (or ``[T]``) left-padded ids with one ``image_token_id`` per image (or already expanded).
      attention_mask: ``[B, T]`` (0 at left pads) or None.
      images: image sources in prompt order (paths, bytes, PIL images, uint8 arrays: :func:`load_image`).
      pad_token_id: the id written at left pads after expansion.
    Raises:
      PromptError (placeholders and images disagree, no tower), ImageError (an image that cannot be read), naming
      the image.
    """
    check_vision(model)
    vc = model.vision_config
    processor = processor or image_processor(model)
    if (processor.patch_size, processor.merge_size, processor.temporal_patch_size) != (
            vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size):
        raise PromptError(f"image processor patch/merge/temporal sizes {processor.patch_size}/{processor.merge_size}/"
                          f"{processor.temporal_patch_size} differ from the vision tower's {vc.patch_size}/"
                          f"{vc.spatial_merge_size}/{vc.temporal_patch_size}")
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask, np.int32)
    if mask.shape != ids.shape:
        raise PromptError(f"attention_mask shape {mask.shape} differs from input_ids shape {ids.shape}")
    if len(images) == 0:
        raise PromptError("images= is empty: pass at least one image, or no images argument")
    pil = [load_image(src, where=f"image {i}") for i, src in enumerate(images)]
    processed = preprocess(pil, processor)
    counts = list(processed.merged_counts)

    rows, used = [], 0
    for b in range(ids.shape[0]):
        row = [int(t) for t, m in zip(ids[b], mask[b]) if m]
        runs = _runs(row, vc.image_token_id)
        if runs and runs == counts[used:used + len(runs)] and max(runs) > 1:  # already expanded
            rows.append(row)
            used += len(runs)
        else:  # one placeholder per image
            n = sum(runs)
            rows.append(expand_image_tokens(row, counts[used:used + n], vc.image_token_id) if n else row)
            used += n
    if used != len(counts):
        given = f"{len(counts)} image{'s were' if len(counts) != 1 else ' was'} given"
        raise PromptError(f"the prompt{'s have' if ids.shape[0] > 1 else ' has'} {used} image placeholder"
                          f"{'s' if used != 1 else ''} but {given}")
    width = max(len(r) for r in rows)
    out_ids = np.full((len(rows), width), pad_token_id, np.int32)
    out_mask = np.zeros((len(rows), width), np.int32)
    for b, r in enumerate(rows):
        out_ids[b, width - len(r):] = r
        out_mask[b, width - len(r):] = 1
    position_ids, _ = rope_index(out_ids, processed.image_grid_thw, image_token_id=vc.image_token_id,
                                 spatial_merge_size=vc.spatial_merge_size, attention_mask=out_mask,
                                 video_token_id=vc.video_token_id)
    embeds = np.asarray(model.visual(processed.pixel_values, processed.image_grid_thw)).astype(np.dtype(model.dtype))
    return ImagePrompt(input_ids=out_ids, attention_mask=out_mask, position_ids=np.asarray(position_ids, np.int32),
                       image_embeds=embeds, image_grid_thw=processed.image_grid_thw)


def _runs(row: list[int], token: int) -> list[int]:
    """Lengths of the runs of ``token`` in ``row``."""
    runs, n = [], 0
    for t in row + [None]:
        if t == token:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


__all__ = ["ImageError", "ImagePrompt", "PromptError", "check_vision", "image_processor", "prepare_images"]
