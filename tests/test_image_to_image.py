"""Image-to-image, inpainting and the SDXL refiner, against diffusers' pipelines in float32.

diffusers draws its noise from the call's generator; ours takes the same noise through `latents=`
(here the noise added to the image's latents). diffusers also samples the VAE's posterior with that
generator, where ours takes its mean (`GenerateProgram.encode`): the comparisons make diffusers take
the mean too.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
)
from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_img2img, pipeline_stable_diffusion_inpaint
from diffusers.pipelines.stable_diffusion_xl import (
    pipeline_stable_diffusion_xl_img2img,
    pipeline_stable_diffusion_xl_inpaint,
)
from PIL import Image

from reference import diffusers_images, inpainting_mask, picture, sd_pipeline, sdxl_pipeline
from sdxl.checkpoints import CheckpointError, random_models
from sdxl.engine.compilation import CompileCounter
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.prepared import PreparedRequest
from sdxl.engine.request import Request

HEIGHT, WIDTH = 64, 96
PROMPTS = ["a red cube on a table", "a blue sphere floating over grass"]
NEGATIVES = ["blurry", "low quality, watermark"]  # an empty one is zero conditioning here, not in diffusers
STEPS = 6


@pytest.fixture(autouse=True)
def diffusers_encodes_the_posterior_mean(monkeypatch):
    def mean(encoder_output, generator=None, sample_mode="sample"):
        return encoder_output.latent_dist.mode()

    for module in (
        pipeline_stable_diffusion_xl_img2img, pipeline_stable_diffusion_xl_inpaint,
        pipeline_stable_diffusion_img2img, pipeline_stable_diffusion_inpaint,
    ):
        monkeypatch.setattr(module, "retrieve_latents", mean)


def _loaded(folder, **kwargs) -> Pipeline:
    return Pipeline.from_pretrained(folder, dtype="float32", max_steps=STEPS, **kwargs)


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdxl")
    ref = sdxl_pipeline(folder)
    return ref, _loaded(folder)


@pytest.fixture(scope="module")
def refiner(tmp_path_factory):
    folder = tmp_path_factory.mktemp("refiner")
    ref = sdxl_pipeline(folder, random_models.REFINER_CONFIGS, seed=10)
    return ref, _loaded(folder)


def _picture(seed: int = 1) -> Image.Image:
    return picture(HEIGHT, WIDTH, seed)


def _mask() -> Image.Image:
    return inpainting_mask(HEIGHT, WIDTH)


def _noise(n: int, seed: int) -> tuple[np.ndarray, torch.Generator]:
    """The noise diffusers' pipeline draws first from `generator`, and that generator, fresh."""
    noise = torch.randn((n, 4, HEIGHT // 8, WIDTH // 8), generator=torch.Generator().manual_seed(seed))
    return noise.numpy(), torch.Generator().manual_seed(seed)


def _compare(label: str, got: np.ndarray, expected: np.ndarray, tolerance: float = 1e-4) -> None:
    diff = np.abs(got - expected).max()
    print(f"{label}: max abs diff vs diffusers {diff:.2e}")
    assert got.shape == expected.shape and diff <= tolerance


def _both(ref_cls, ref, pipe, label, scheduler=None, sampler=None, **kwargs):
    """The same call to diffusers' `ref_cls` built from `ref`'s components and to ours."""
    noise, generator = _noise(len(PROMPTS), seed=3)
    common = dict(prompt=PROMPTS, negative_prompt=NEGATIVES, num_inference_steps=STEPS, guidance_scale=5.0)
    ref = ref if type(ref) is ref_cls else ref_cls(**ref.components)
    expected = diffusers_images(ref, scheduler, **common, generator=generator, **kwargs)
    got = pipe.generate(
        PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=5.0, sampler=sampler, latents=noise, output_type="np",
        **{k: v for k, v in kwargs.items() if k not in ("height", "width")},
    )
    _compare(label, got, expected)
    return got


@pytest.mark.oracle
@pytest.mark.parametrize("strength", [0.3, 0.55, 1.0])
def test_image_to_image_matches_diffusers(sdxl, strength):
    ref, pipe = sdxl
    got = _both(StableDiffusionXLImg2ImgPipeline, ref, pipe, f"img2img strength {strength}", image=_picture(),
                strength=strength)
    # The picture's negative under the same noise (the same program, compiled once): at strength 1 the picture
    # is a small part of the start, and a picture farther from it shows that part.
    negative = Image.fromarray(255 - np.asarray(_picture()))
    other = pipe.generate(PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=5.0, latents=_noise(len(PROMPTS), seed=3)[0],
                          image=negative, strength=strength, output_type="np")
    assert np.abs(got - other).max() > 1e-2, "the image must matter"


@pytest.mark.oracle
@pytest.mark.parametrize(
    "sampler, scheduler_cls", [("ddim", DDIMScheduler), ("dpmpp_2m", DPMSolverMultistepScheduler)]
)
def test_samplers_start_part_way_like_diffusers(sdxl, sampler, scheduler_cls):
    """DDIM works in variance-preserving terms; DPM++ 2M's first step that runs is first order."""
    ref, pipe = sdxl
    scheduler = scheduler_cls.from_config(ref.scheduler.config)
    _both(StableDiffusionXLImg2ImgPipeline, ref, pipe, f"img2img {sampler}", scheduler, sampler, image=_picture(),
          strength=0.55)


@pytest.mark.oracle
@pytest.mark.parametrize("strength", [0.75, 1.0])
def test_inpainting_with_a_text_to_image_unet_matches_diffusers(sdxl, strength):
    """A 4-channel UNet: the kept region is the image's latents, noised to each step's level."""
    ref, pipe = sdxl
    got = _both(StableDiffusionXLInpaintPipeline, ref, pipe, f"inpaint (4 channels) strength {strength}",
                image=_picture(), mask_image=_mask(), strength=strength, height=HEIGHT, width=WIDTH)
    img2img = pipe.generate(PROMPTS, NEGATIVES, steps=STEPS, image=_picture(), strength=strength, output_type="np")
    assert np.abs(got - img2img).max() > 1e-2, "the mask must matter"


@pytest.fixture(scope="module")
def inpainting(tmp_path_factory):
    """A 9-channel UNet (the SDXL inpainting model's layout): one pipeline, so that the strengths share its program."""
    folder = tmp_path_factory.mktemp("inpainting")
    ref = sdxl_pipeline(folder, random_models.INPAINT_CONFIGS, seed=20)
    return ref, _loaded(folder)


@pytest.mark.oracle
@pytest.mark.parametrize("strength", [0.6, 1.0])
def test_inpainting_with_an_inpainting_unet_matches_diffusers(inpainting, strength):
    """A 9-channel UNet (the SDXL inpainting model's layout) sees the mask and the masked image."""
    ref, pipe = inpainting
    assert pipe.spec.is_inpainting and type(ref).__name__ == "StableDiffusionXLInpaintPipeline"
    _both(StableDiffusionXLInpaintPipeline, ref, pipe, f"inpaint (9 channels) strength {strength}",
          image=_picture(), mask_image=_mask(), strength=strength, height=HEIGHT, width=WIDTH)
    with pytest.raises(ValueError, match="inpainting model: give it an image and a mask"):
        pipe.generate("a cat", steps=2, height=HEIGHT, width=WIDTH)


@pytest.mark.oracle
def test_sd1_image_to_image_and_inpainting_match_diffusers(tmp_path):
    ref = sd_pipeline(tmp_path, seed=30)
    pipe = _loaded(tmp_path)
    euler = EulerDiscreteScheduler.from_config(ref.scheduler.config)
    _both(StableDiffusionImg2ImgPipeline, ref, pipe, "SD1 img2img", euler, "euler", image=_picture(), strength=0.55)
    _both(StableDiffusionInpaintPipeline, ref, pipe, "SD1 inpaint", euler, "euler", image=_picture(),
          mask_image=_mask(), strength=0.8, height=HEIGHT, width=WIDTH)
    with pytest.raises(ValueError, match="pndm sampler runs whole schedules only"):
        pipe.generate("a cat", steps=4, image=_picture(), strength=0.5)


@pytest.mark.oracle
def test_the_refiner_loads_and_refines_an_image_like_diffusers(refiner):
    ref, pipe = refiner
    assert pipe.spec.text_encoder_names == ("text_encoder_2",) and pipe.spec.requires_aesthetics_score
    assert not pipe.spec.force_zeros_for_empty_prompt
    got = _both(StableDiffusionXLImg2ImgPipeline, ref, pipe, "refiner img2img", image=_picture(), strength=0.55)
    scored = _both(StableDiffusionXLImg2ImgPipeline, ref, pipe, "refiner img2img, aesthetic scores 8 and 1",
                   image=_picture(), strength=0.55, aesthetic_score=8.0, negative_aesthetic_score=1.0)
    assert np.abs(got - scored).max() > 1e-3, "the aesthetic scores must matter"


@pytest.mark.oracle
def test_base_hands_its_latents_to_the_refiner_like_diffusers(sdxl, refiner):
    """diffusers' "ensemble of expert denoisers": the base runs to denoising_end and returns latents,
    the refiner continues them from denoising_start. Ours stay on the devices in between."""
    (base_ref, base), (refiner_ref, refiner_pipe) = sdxl, refiner
    noise, generator = _noise(len(PROMPTS), seed=4)
    common = dict(prompt=PROMPTS, negative_prompt=NEGATIVES, num_inference_steps=STEPS, guidance_scale=5.0)
    with torch.no_grad():
        expected_latents = base_ref(**common, height=HEIGHT, width=WIDTH, latents=torch.from_numpy(noise),
                                    denoising_end=0.7, output_type="latent").images
    expected = diffusers_images(refiner_ref, **common, image=expected_latents, denoising_start=0.7,
                                generator=generator)
    ours = dict(steps=STEPS, guidance_scale=5.0)
    latents = base.generate(PROMPTS, NEGATIVES, **ours, height=HEIGHT, width=WIDTH, latents=noise,
                            denoising_end=0.7, output_type="latent")
    assert isinstance(latents, jax.Array)
    _compare("base latents at denoising_end", np.asarray(latents).transpose(0, 3, 1, 2), expected_latents.numpy())
    got = refiner_pipe.generate(PROMPTS, NEGATIVES, **ours, image=latents, denoising_start=0.7, output_type="np")
    _compare("refiner from denoising_start", got, expected)
    # The same in one call, with the refiner set on the base; a refiner that cannot continue is refused.
    base.set_refiner(refiner_pipe)
    try:
        reports = []
        one_call = base.generate(PROMPTS, NEGATIVES, **ours, height=HEIGHT, width=WIDTH, latents=noise,
                                 refine_from=0.7, output_type="np")
        np.testing.assert_allclose(one_call, got, atol=1e-6)
        request = Request.from_prompt("a cat", num_images=4, steps=STEPS, height=HEIGHT, width=WIDTH)
        base.render(dataclasses.replace(request, refine_from=0.7), on_step=reports.append)
        assert reports == list(range(1, STEPS + 1)), "the two runs' steps count as one"
        with pytest.raises(CheckpointError, match="latent scaling differ"):
            base.set_refiner(Pipeline.from_pretrained("tiny-sd1"))
    finally:
        base.set_refiner(None)
    with pytest.raises(ValueError, match="no refiner is loaded"):
        base.generate("a cat", steps=STEPS, height=HEIGHT, width=WIDTH, refine_from=0.7)


@pytest.mark.compiles
def test_strength_and_the_handoff_never_recompile(sdxl):
    """`programs_for` names what an image request runs, compiled once; strengths and steps reuse it."""
    _, pipe = sdxl
    request = Request.from_prompt("a cat", num_images=4, steps=4, height=HEIGHT, width=WIDTH)
    pictures = np.stack([np.asarray(_picture())] * 4)
    for edit in (dict(images=pictures, strength=0.5), dict(images=pictures, masks=pictures[..., 0] > 128)):
        programs = pipe.programs_for(dataclasses.replace(request, **edit))
        pipe.compile(programs)
        assert pipe.is_compiled(programs) and not pipe.is_compiled(programs, progress=True)
    with CompileCounter() as compiles:
        for strength, steps in ((0.3, 6), (0.8, 5), (1.0, 3)):
            pipe.generate("a dog", steps=steps, image=_picture(2), strength=strength, num_images=4)
            pipe.generate("a dog", steps=steps, image=_picture(2), mask_image=_mask(), strength=strength, num_images=4)
    assert compiles.count == 0


@pytest.mark.compiles
def test_one_image_or_one_per_image(sdxl):
    _, pipe = sdxl
    pictures = [_picture(1), _picture(2)]
    each = pipe.generate("a cat", steps=4, image=pictures, strength=0.5, output_type="np")
    assert len(each) == 2
    np.testing.assert_allclose(pipe.generate("a cat", steps=4, image=pictures[1], strength=0.5, num_images=2,
                                             output_type="np")[1], each[1], atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(image=np.zeros((60, 96, 3), np.uint8)), "image is 96x60 .* multiples of 16: crop or resize it, to 96x48"),
        (dict(image=_picture(), mask_image=np.zeros((HEIGHT, WIDTH))), "the mask is empty"),
        (dict(image=_picture(), mask_image=np.ones((32, 32))), "masks must be"),
        (dict(image=_picture(), strength=0.0), "leaves no step to run"),
        (dict(image=_picture(), strength=1.5), "strength must be a number from 0 to 1"),
        (dict(image=Image.new("I;16", (WIDTH, HEIGHT))), "mode I;16"),
        (dict(image=np.zeros((HEIGHT, WIDTH, 2), np.uint8)), "must be \\[height, width, 3\\]"),
        (dict(mask_image=_mask()), "a mask needs an image"),
        (dict(height=HEIGHT, width=WIDTH, denoising_start=0.5), "denoising_start continues a base model's latents"),
        (dict(height=HEIGHT, width=WIDTH, denoising_end=1.5), "denoising_end must be a fraction"),
        (dict(image=_picture(), mask_image=_mask(), padding_mask_crop=8), "padding_mask_crop is not implemented"),
    ],
)
def test_bad_images_and_settings_are_named(sdxl, kwargs, message):
    _, pipe = sdxl
    with pytest.raises(ValueError, match=message):
        pipe.generate("a cat", steps=4, **kwargs)


def test_a_refiner_layout_that_does_not_fit_its_unet_is_refused_from_its_configs(tmp_path):
    configs = dict(random_models.REFINER_CONFIGS)
    configs["model_index.json"] = {**configs["model_index.json"], "requires_aesthetics_score": False}
    for name, config in configs.items():  # configs alone: refused before any weights are read
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="6 time ids .* requires_aesthetics_score fit this UNet"):
        Pipeline.from_pretrained(tmp_path)


def test_merged_requests_keep_their_own_images(sdxl):
    _, pipe = sdxl
    one = Request.from_prompt("a cat", num_images=2, seed=1, steps=4, height=HEIGHT, width=WIDTH)
    first = dataclasses.replace(one, images=np.stack([np.asarray(_picture(1))] * 2), strength=0.5)
    second = dataclasses.replace(first, images=np.stack([np.asarray(_picture(2))] * 2), seeds=(2, 2))
    parts = [pipe.prepare(request, output_type="np") for request in (first, second)]
    assert parts[0].batch_key == parts[1].batch_key
    merged = pipe.render(PreparedRequest.merged(parts, batch=4)).images
    np.testing.assert_allclose(merged[2:], pipe.render(second, output_type="np").images, atol=1e-4)
