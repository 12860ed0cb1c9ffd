"""sdxl.engine.clip_inputs against transformers' CLIPImageProcessor as diffusers' load_ip_adapter makes it."""

import numpy as np
import pytest
from PIL import Image
from transformers import CLIPImageProcessor

from sdxl.engine.clip_inputs import clip_image_inputs


def _picture(rng, height, width, mode="RGB") -> Image.Image:
    """Gradients with noise: smooth regions and edges, so every resampling weight matters."""
    y, x = np.mgrid[:height, :width]
    channels = [x * 255 / width, y * 255 / height, (x + y) % 256, 255 * (x > width // 2)][: len(mode)]
    pixels = np.stack(channels, axis=-1) + rng.integers(0, 60, (height, width, len(mode)))
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8), mode)


def _theirs(images, image_size) -> np.ndarray:
    processor = CLIPImageProcessor(size=image_size, crop_size=image_size)
    return processor(images, return_tensors="np").pixel_values.transpose(0, 2, 3, 1)


@pytest.mark.parametrize(
    "height, width, image_size",
    [
        (37, 53, 28),  # downscaled, landscape
        (101, 67, 28),  # portrait
        (20, 13, 28),  # upscaled
        (28, 28, 28),  # as it is
        (513, 389, 224),  # the encoders' size, from an odd-sized picture
        (150, 999, 224),
    ],
)
def test_matches_the_clip_image_processor(rng, height, width, image_size):
    image = _picture(rng, height, width)
    ours = clip_image_inputs([image, np.asarray(image)], image_size)
    theirs = _theirs([image], image_size)
    assert ours.shape == (2, image_size, image_size, 3) and ours.dtype == np.float32
    diff = np.abs(ours - theirs).max()
    print(f"{height}x{width} -> {image_size}: max abs diff {diff:.1e}")
    assert diff <= 1e-6
    assert ours.std() > 0.3


def test_transparency_is_composited_onto_white(rng):
    image = _picture(rng, 40, 30, "RGBA")
    assert np.abs(clip_image_inputs([image], 28) - _theirs([image], 28)).max() <= 1e-6
    assert not np.allclose(clip_image_inputs([image], 28), clip_image_inputs([image.convert("RGB")], 28))


def test_refuses_arrays_that_are_not_rgb_bytes():
    with pytest.raises(ValueError, match="uint8"):
        clip_image_inputs([np.zeros((8, 8, 3), np.float32)], 28)
