"""Pictures as a CLIP image encoder's input, as diffusers prepares an IP-Adapter's image.

diffusers' `load_ip_adapter` gives a pipeline without a feature extractor
`CLIPImageProcessor(size=image_size, crop_size=image_size)`, which in transformers 5 works on torch
tensors: the shortest edge resized to `image_size` (bicubic, antialiased, on the uint8 pixels, by
torch's fixed-point kernel), a centred square crop, then (x / 255 - mean) / std with OpenAI CLIP's
mean and std. `_resize_axis` reproduces torch's kernel exactly, so the encoder sees the same pixels.
"""

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# torch's antialiased bicubic uses Pillow's filter (a = -0.5), over 2 input pixels either side when upscaling.
_CUBIC_A = -0.5
_CUBIC_SUPPORT = 2.0


def clip_image_inputs(images: Sequence, image_size: int) -> np.ndarray:
    """The CLIP image processor's `pixel_values` of `images`, channels last.

    Args:
      images: PIL images (transparency composited onto white, as transformers does) or [H, W, 3]
        uint8 arrays.
      image_size: the encoder's `image_size`.

    Returns:
      [N, image_size, image_size, 3] float32.
    """
    return np.stack([_normalised(_cropped(_resized(_rgb(image), image_size), image_size)) for image in images])


def _rgb(image) -> np.ndarray:
    if isinstance(image, Image.Image):
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            image = image.convert("RGBA")
            white = Image.new("RGBA", image.size, (255, 255, 255, 255))
            image = Image.alpha_composite(white, image)
        return np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"an image array must be [height, width, 3] uint8, got {array.dtype} {array.shape}")
    return array


def _resized(pixels: np.ndarray, size: int) -> np.ndarray:
    """The shortest edge to `size`, the other in proportion (rounded down), as transformers sizes it."""
    height, width = pixels.shape[:2]
    short, long = min(height, width), max(height, width)
    new_long = int(size * long / short)
    new_height, new_width = (size, new_long) if height <= width else (new_long, size)
    # Across first, then down, each pass rounded to uint8, as torch's kernel (and Pillow's) does.
    return _resize_axis(_resize_axis(pixels, new_width, axis=1), new_height, axis=0)


def _cubic(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    a = _CUBIC_A
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _resize_axis(pixels: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """torch's antialiased bicubic resize of uint8 pixels along one axis (`upsample_bicubic2d_aa`'s
    CPU kernel): float64 weights over a support widened by the downscale factor, normalised per
    output pixel, quantised to int16 at the finest precision the largest weight allows, then an
    integer sum rounded half up and clamped to [0, 255]."""
    in_size = pixels.shape[axis]
    if in_size == out_size:
        return pixels
    scale = in_size / out_size
    support = _CUBIC_SUPPORT * scale if scale >= 1 else _CUBIC_SUPPORT
    invscale = 1 / scale if scale >= 1 else 1.0
    taps = math.ceil(support) * 2 + 1
    starts = np.zeros(out_size, np.int64)
    weights = np.zeros((out_size, taps))
    for i in range(out_size):
        center = scale * (i + 0.5)
        start = max(int(center - support + 0.5), 0)
        count = min(max(min(int(center + support + 0.5), in_size) - start, 0), taps)
        w = _cubic((np.arange(count) + start - center + 0.5) * invscale)
        if w.sum() != 0:
            w = w / w.sum()
        starts[i], weights[i, :count] = start, w
    largest = weights.max()
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    quantised = np.trunc(scaled + np.where(scaled < 0, -0.5, 0.5)).astype(np.int64)  # [out, taps]

    source = np.moveaxis(pixels, axis, 0).astype(np.int64)  # [in, ...]
    padded = np.concatenate([source, np.zeros((taps, *source.shape[1:]), np.int64)])
    gathered = padded[starts[:, None] + np.arange(taps)]  # [out, taps, ...]; zero weights past the edge
    total = np.einsum("ot,ot...->o...", quantised, gathered) + (1 << (precision - 1))
    return np.moveaxis(np.clip(total >> precision, 0, 255).astype(np.uint8), 0, axis)


def _cropped(pixels: np.ndarray, size: int) -> np.ndarray:
    height, width = pixels.shape[:2]
    top, left = int((height - size) / 2.0), int((width - size) / 2.0)
    return pixels[top : top + size, left : left + size]


def _normalised(pixels: np.ndarray) -> np.ndarray:
    # transformers folds the 1/255 into the mean and std (in float32) and normalises once.
    mean = np.float32(OPENAI_CLIP_MEAN) * np.float32(255)
    std = np.float32(OPENAI_CLIP_STD) * np.float32(255)
    return (pixels.astype(np.float32) - mean) / std
