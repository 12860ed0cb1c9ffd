"""The hires fix's sizes, steps, checks and image upscaling (`sdxl.engine.hires`), against webui's
rules as its processing.py, sd_samplers_common.py and images.py state them, and the tiled VAE that
decodes its big pictures. Its pictures against A1111's: tests/test_a1111_pictures.py."""

import dataclasses

import jax
import numpy as np
import pytest
from PIL import Image

from sdxl.checkpoints.random_models import BUILTIN_CONFIGS
from sdxl.checkpoints.spec import ModelSpec
from sdxl.engine.hires import Hires, upscaled_pictures
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.latents import unscaled_latents
from sdxl.engine.request import Request
from sdxl.models import vae

SDXL = ModelSpec.from_folder(BUILTIN_CONFIGS / "sdxl-base-1.0")
FIRST_PASS = dict(height=1024, width=1024, steps=20, sampler="dpmpp_2m", schedule_type="Karras")


@pytest.mark.parametrize("hires, size, upscaled, crop", [
    (Hires(scale=1.5), (832, 1216), (1248, 1824), (0, 0)),
    (Hires(scale=2), (1024, 1024), (2048, 2048), (0, 0)),
    # webui's target of 1.3x: 1331 pixels, latents of 166; this UNet takes multiples of 4 latents.
    (Hires(scale=1.3), (1024, 1024), (1331, 1331), (0, 0)),
    (Hires(resize_width=1920), (576, 1024), (1080, 1920), (0, 0)),
    (Hires(resize_height=1536), (1024, 768), (1536, 1152), (0, 0)),
    # Both sides in other proportions: the picture covers them, the rest is cropped (webui's truncate).
    (Hires(resize_width=2048, resize_height=1024), (1024, 1024), (2048, 2048), (128, 0)),
    (Hires(resize_width=1024, resize_height=2048), (1024, 1024), (2048, 2048), (0, 128)),
])
def test_target_sizes_are_webuis(hires, size, upscaled, crop):
    assert hires.upscaled_size(*size) == upscaled
    assert hires.crop(*size, SDXL) == crop
    # The latents' size (webui's size // 8) less the crop, rounded down to the UNet's multiple of 4.
    assert hires.size(*size, SDXL) == tuple((u // 8 - c) // 4 * 32 for u, c in zip(upscaled, crop))


@pytest.mark.parametrize("steps, strength, first_pass, expected", [
    (10, 0.5, 20, (20, 10)),  # webui: int(10 / 0.5) steps, the last 10 run
    (0, 0.4, 25, (62, 37)),  # no hires steps: the first pass's 25 of int(25 / 0.4)
    (4, 1.0, 20, (4, 0)),  # strength 1 counts as 0.999: int(4 / 0.999) = 4, all run
    (7, 0.3, 20, (23, 16)),
])
def test_second_pass_steps_are_webuis_img2img_step_setup(steps, strength, first_pass, expected):
    assert Hires(steps=steps, strength=strength).second_pass_steps(first_pass) == expected


def test_validation_resolves_the_first_passs_choices_and_refuses_in_one_sentence():
    checked = Hires(scale=1.5, sampler="Euler a").validated(FIRST_PASS, SDXL, 100, ())
    assert (checked.sampler, checked.schedule_type) == ("euler_ancestral", "Karras"), "the first pass's schedule type"
    on_diffusers = dict(FIRST_PASS, sampler="euler", schedule_type="diffusers")
    assert Hires(sampler="heun").validated(on_diffusers, SDXL, 100, ()).schedule_type == "Automatic", (
        "a sampler that does not run on the first pass's type gets its own")
    assert Hires(upscaler="4x-UltraSharp").validated(FIRST_PASS, SDXL, 100, ("4x-UltraSharp",)).upscaler
    refusals = {
        "hires upscaler must be one of": Hires(upscaler="4x-UltraSharp"),
        "hires scale must be a number from 1 to 4": Hires(scale=8),
        "strength of 0 runs no step": Hires(strength=0),
        "the hires target is the first pass's size": Hires(scale=1.01),
        "make a schedule of 100 steps, more than the 50 allowed": Hires(steps=30, strength=0.3),
    }
    for message, hires in refusals.items():
        with pytest.raises(ValueError, match=message):
            hires.validated(FIRST_PASS, SDXL, 50, ())


def test_lanczos_and_nearest_upscale_as_webuis_resize_image():
    """Lanczos by 1.5: one resize by the factor, then the rounding to 8 and the target's exact size;
    "None": one Lanczos resize to the target; Nearest: PIL's nearest."""
    rng = np.random.default_rng(0)
    pictures = rng.integers(0, 256, (2, 40, 52, 3), dtype=np.uint8)
    height, width = 60, 78

    def pil(picture, *sizes, resample=Image.LANCZOS):
        image = Image.fromarray(picture)
        for size in sizes:
            image = image.resize(size, resample=resample)
        return np.asarray(image)

    lanczos = upscaled_pictures(pictures, height, width, "Lanczos", {})
    # webui: int(52 * 1.5) x int(40 * 1.5) = 78 x 60, then to (78 // 8 * 8) x (60 // 8 * 8), then to the target.
    np.testing.assert_array_equal(lanczos[1], pil(pictures[1], (78, 60), (72, 56), (78, 60)))
    np.testing.assert_array_equal(upscaled_pictures(pictures, height, width, "None", {})[0], pil(pictures[0], (78, 60)))
    nearest = upscaled_pictures(pictures, 80, 104, "Nearest", {})
    np.testing.assert_array_equal(nearest[0], pil(pictures[0], (104, 80), resample=Image.NEAREST))


def test_a_model_upscaler_runs_until_the_picture_covers_the_target():
    """A 2x model for a 3x target: two passes (webui applies a model up to 3 times), then Lanczos down."""

    @dataclasses.dataclass
    class Doubling:
        scale: int = 2
        calls: int = 0

        def upscale(self, picture, output_type="np"):
            self.calls += 1
            return np.repeat(np.repeat(picture, 2, axis=0), 2, axis=1).astype(np.float32) / 255

    model = Doubling()
    pictures = np.full((1, 16, 24, 3), 200, np.uint8)
    out = upscaled_pictures(pictures, 48, 72, "double", {"double": model})
    assert model.calls == 2
    assert out.shape == (1, 48, 72, 3) and (out == 200).all()


@pytest.mark.compiles
def test_with_vae_tiling_pictures_larger_than_a_tile_decode_in_tiles():
    """`vae_tiling`: a picture of more pixels than the VAE's tile (tiny's: 128x128) decodes as
    `tiled_decode` decodes its latents; a picture of a tile's size whole."""
    pipe = Pipeline.from_pretrained("tiny", max_steps=4, vae_tiling=True, devices=jax.devices()[:1])
    one_tile = Request.from_prompt("a fox", num_images=1, steps=2, height=128, width=128)
    assert not pipe.prepare(one_tile).program.vae_tiling
    request = Request.from_prompt("a fox", num_images=1, steps=2, height=192, width=160)
    prepared = pipe.prepare(request, output_type="np")
    assert prepared.program.vae_tiling
    pictures = pipe.render(prepared).images
    latents = pipe.render(request, output_type="latent").images
    model = vae.AutoencoderKL(pipe.spec.vae)
    decoded = vae.tiled_decode(model, pipe.params["vae"], unscaled_latents(pipe.spec, latents))
    np.testing.assert_allclose(pictures, np.clip(np.asarray(decoded) / 2 + 0.5, 0, 1), atol=1e-5)
    whole = model.apply({"params": pipe.params["vae"]}, unscaled_latents(pipe.spec, latents), method=model.decode)
    assert np.abs(np.asarray(decoded) - np.asarray(whole)).max() > 1e-3, "the tiles' blending shows"
