import jax
import numpy as np
import pytest

from sdxl.checkpoints import resolve, shapes
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.program import GenerateProgram
from sdxl.engine.request import Request
from sdxl.models import previews


@pytest.fixture(scope="module")
def shapes_pipe():
    return Pipeline.from_pretrained("shapes", devices=jax.devices()[:1])


def _patch_means(images: np.ndarray, factor: int) -> np.ndarray:
    n, height, width, _ = images.shape
    return images.reshape(n, height // factor, factor, width // factor, factor, 3).mean(axis=(2, 4))


@pytest.mark.compiles
def test_the_shapes_projection_is_the_least_squares_fit_of_its_vae(shapes_pipe):
    """Refitted on other images of the data set, the shipped factors come back within 0.05 (the
    bias, which follows the sample's mix of colours, within 0.1); and projected latents miss each
    latent pixel's colour by less than half as much as the images' mean colour would."""
    pixels, _ = shapes.training_batch(seed=777, step=3, batch=128)
    images = pixels.astype(np.float32) / 127.5 - 1
    program = GenerateProgram(shapes_pipe.spec, "euler", 64, 64, len(images), shapes_pipe.dtype, 1)
    latents = np.asarray(jax.jit(program.encode)(shapes_pipe.params, images))
    matrix, bias = previews.fit(latents, images)
    np.testing.assert_allclose(matrix, previews.SHAPES_FACTORS[0], atol=0.05)
    np.testing.assert_allclose(bias, previews.SHAPES_FACTORS[1], atol=0.1)
    assert shapes_pipe.preview_factors == previews.SHAPES_FACTORS
    projected = np.asarray(previews.project(latents, previews.SHAPES_FACTORS), np.float32)
    colours = _patch_means(pixels.astype(np.float32), 4)
    error, spread = np.abs(projected - colours).mean(), np.abs(colours - colours.mean(axis=(0, 1, 2))).mean()
    print(f"preview error {error:.1f}, the mean colour's {spread:.1f} (of 255)")
    assert error < spread / 2


@pytest.mark.compiles
def test_previews_follow_the_picture_as_it_forms(shapes_pipe):
    """One preview per step but the last (whose images are the result), at the latents' size; the
    last is close to the final image, the first far from it, and the images are the same as
    without previews."""
    request = Request.from_prompt("a large red circle on a blue background", num_images=2, seed=1, steps=10,
                                  guidance_scale=3, height=64, width=64)
    seen = []
    result = shapes_pipe.render(request, on_step=lambda done: None, on_preview=lambda done, p: seen.append((done, p)))
    assert [done for done, _ in seen] == list(range(1, 10))
    assert all(p.shape == (2, 16, 16, 3) and p.dtype == np.uint8 for _, p in seen)
    final = _patch_means(result.images.astype(np.float32), 4)
    distance = [np.abs(p.astype(np.float32) - final).mean() for _, p in seen]
    assert distance[-1] < 25 and distance[0] > distance[-1] + 10, distance
    np.testing.assert_array_equal(result.images, shapes_pipe.render(request).images)


def test_each_family_has_its_projection():
    assert previews.factors_for(resolve("tiny").spec) == previews.SDXL_FACTORS
    assert previews.factors_for(resolve("tiny-sd1").spec) == previews.SD_FACTORS
