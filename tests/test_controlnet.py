"""ControlNets against diffusers: the model alone, and whole generations steered by one or two, from
text, an image or a masked image, with or without a LoRA."""

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import (
    ControlNetModel,
    EulerDiscreteScheduler,
    StableDiffusionControlNetInpaintPipeline,
    StableDiffusionControlNetPipeline,
    StableDiffusionXLControlNetImg2ImgPipeline,
    StableDiffusionXLControlNetInpaintPipeline,
    StableDiffusionXLControlNetPipeline,
)
from diffusers.pipelines.controlnet import (
    pipeline_controlnet_inpaint,
    pipeline_controlnet_inpaint_sd_xl,
    pipeline_controlnet_sd_xl_img2img,
)
from PIL import Image

from safetensors.torch import save_file

from reference import diffusers_images, inpainting_mask, picture, randomize_, sd_pipeline, sdxl_pipeline
from test_lora import kohya_file
from sdxl.checkpoints import BUILTIN_CONFIGS, CheckpointError, ModelSpec, controlnets, single_file
from sdxl.checkpoints.weights import checkpoint_key, flatten
from sdxl.config import config_from_dict
from sdxl.engine.pipeline import Pipeline
from sdxl.models import controlnet as controlnet_model

HEIGHT, WIDTH = 64, 96
PROMPTS = ["a red cube on a table", "a blue sphere floating over grass"]
NEGATIVES = ["blurry", "low quality, watermark"]
STEPS = 5
# The tiny models' VAE downscales 8 times: the conditioning embedding has three stride-2 convolutions.
EMBEDDING_CHANNELS = (4, 8, 8, 16)


def _controlnet(ref, folder, seed: int) -> ControlNetModel:
    """A random ControlNet for `ref`'s UNet, its zero convolutions randomised too, saved to `folder`."""
    controlnet = ControlNetModel.from_unet(ref.unet, conditioning_embedding_out_channels=EMBEDDING_CHANNELS)
    randomize_(controlnet, seed)
    controlnet.save_pretrained(folder, safe_serialization=True)
    return controlnet


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdxl")
    ref = sdxl_pipeline(folder)
    controlnets = [_controlnet(ref, folder / f"controlnet-{i}", seed=20 + i) for i in range(2)]
    return folder, ref, controlnets


@pytest.fixture(scope="module")
def steered(sdxl):
    """Ours with the first ControlNet: one pipeline, so that the tests share its compiled programs."""
    folder, _, _ = sdxl
    return Pipeline.from_pretrained(folder, dtype="float32", max_steps=STEPS, controlnet=str(folder / "controlnet-0"))


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd1")
    ref = sd_pipeline(folder)
    return folder, ref, _controlnet(ref, folder / "controlnet", seed=30)


@pytest.fixture
def diffusers_encodes_the_posterior_mean(monkeypatch):
    """Ours encodes an image to its posterior's mean; diffusers samples it with the call's generator."""
    def mean(encoder_output, generator=None, sample_mode="sample"):
        return encoder_output.latent_dist.mode()

    for module in (pipeline_controlnet_sd_xl_img2img, pipeline_controlnet_inpaint_sd_xl, pipeline_controlnet_inpaint):
        monkeypatch.setattr(module, "retrieve_latents", mean)


def _control_image(seed: int) -> Image.Image:
    """Edges-like: thin bright lines on black."""
    pixels = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
    rng = np.random.default_rng(seed)
    for _ in range(6):
        if rng.random() < 0.5:
            pixels[rng.integers(HEIGHT), :] = 255
        else:
            pixels[:, rng.integers(WIDTH)] = 255
    return Image.fromarray(pixels)


def _picture(seed: int = 1) -> Image.Image:
    return picture(HEIGHT, WIDTH, seed)


def _mask() -> Image.Image:
    return inpainting_mask(HEIGHT, WIDTH)


def _noise(n: int = 2, seed: int = 3) -> np.ndarray:
    return torch.randn((n, 4, HEIGHT // 8, WIDTH // 8), generator=torch.Generator().manual_seed(seed)).numpy()


def _compare(label: str, got: np.ndarray, expected: np.ndarray, tolerance: float = 1e-4) -> float:
    diff = np.abs(got - expected).max()
    print(f"{label}: max abs diff vs diffusers {diff:.2e}")
    assert got.shape == expected.shape and diff <= tolerance
    return diff


def _both(ref_pipe, pipe, label, control_image, scheduler=None, sampler=None, **kwargs):
    """The same call to diffusers' ControlNet pipeline and to ours (with `scheduler` and `sampler`:
    the same sampler in both); ours returned."""
    latents = _noise()
    if "image" in kwargs:  # image-to-image, inpainting: diffusers draws the same noise first from this generator
        control_kwarg, noise = "control_image", {"generator": torch.Generator().manual_seed(3)}
    else:  # diffusers names the text-to-image pipeline's control image `image`
        control_kwarg, noise = "image", {"latents": torch.from_numpy(latents)}
    expected = diffusers_images(
        ref_pipe, scheduler, prompt=PROMPTS, negative_prompt=NEGATIVES, num_inference_steps=STEPS, guidance_scale=5.0,
        height=HEIGHT, width=WIDTH, **noise, **{control_kwarg: control_image}, **kwargs,
    )
    got = pipe.generate(
        PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=5.0, height=HEIGHT, width=WIDTH, latents=latents,
        output_type="np", control_image=control_image, sampler=sampler, **kwargs,
    )
    _compare(label, got, expected)
    return got


@pytest.mark.oracle
def test_sdxl_text_to_image_with_a_controlnet_matches_diffusers(sdxl, steered):
    _, ref, controlnets = sdxl
    pipe = steered
    ref_pipe = StableDiffusionXLControlNetPipeline(**ref.components, controlnet=controlnets[0])
    image = _control_image(0)
    steered = _both(ref_pipe, pipe, "SDXL ControlNet", image, controlnet_conditioning_scale=0.7,
                    control_guidance_end=0.6)
    other = _both(ref_pipe, pipe, "SDXL ControlNet, start 0.4", image, control_guidance_start=0.4)
    unsteered = pipe.generate(PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=5.0, height=HEIGHT, width=WIDTH,
                              latents=_noise(), output_type="np", control_image=image,
                              controlnet_conditioning_scale=0.0)
    assert np.abs(steered - unsteered).mean() > 1e-2 and np.abs(steered - other).mean() > 1e-2  # it steers


@pytest.mark.oracle
def test_two_controlnets_with_their_own_settings_match_diffusers(sdxl):
    folder, ref, controlnets = sdxl
    sources = [str(folder / f"controlnet-{i}") for i in range(2)]
    pipe = Pipeline.from_pretrained(folder, dtype="float32", max_steps=STEPS, controlnet=sources)
    ref_pipe = StableDiffusionXLControlNetPipeline(**ref.components, controlnet=controlnets)
    _both(ref_pipe, pipe, "SDXL MultiControlNet", [_control_image(0), _control_image(1)],
          controlnet_conditioning_scale=[0.5, 1.2], control_guidance_start=[0.0, 0.2],
          control_guidance_end=[0.8, 1.0])


@pytest.mark.oracle
def test_sdxl_image_to_image_with_a_controlnet_matches_diffusers(sdxl, diffusers_encodes_the_posterior_mean):
    folder, ref, controlnets = sdxl
    pipe = Pipeline.from_pretrained(folder, dtype="float32", max_steps=STEPS, controlnet=str(folder / "controlnet-1"))
    ref_pipe = StableDiffusionXLControlNetImg2ImgPipeline(**ref.components, controlnet=controlnets[1])
    start = Image.fromarray(np.random.default_rng(5).integers(0, 255, (HEIGHT, WIDTH, 3), dtype=np.uint8))
    _both(ref_pipe, pipe, "SDXL ControlNet img2img", _control_image(2), image=start, strength=0.6,
          control_guidance_end=0.5)


@pytest.mark.oracle
def test_sdxl_inpainting_with_a_controlnet_matches_diffusers(sdxl, steered, diffusers_encodes_the_posterior_mean):
    """A 4-channel UNet keeps the unmasked region after every step; the ControlNet sees the latents only.
    The scale is left to the defaults (1 for SDXL inpainting), and so is the strength (0.9999) once."""
    _, ref, controlnets = sdxl
    pipe = steered
    ref_pipe = StableDiffusionXLControlNetInpaintPipeline(**ref.components, controlnet=controlnets[0],
                                                          add_watermarker=False)
    image, mask, control = _picture(1), _mask(), _control_image(4)
    steered = _both(ref_pipe, pipe, "SDXL ControlNet inpaint strength 0.7", control, image=image, mask_image=mask,
                    strength=0.7, control_guidance_end=0.8)
    _both(ref_pipe, pipe, "SDXL ControlNet inpaint default strength", control, image=image, mask_image=mask,
          controlnet_conditioning_scale=0.6, control_guidance_start=0.2)
    unsteered = pipe.generate(PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=5.0, latents=_noise(), image=image,
                              mask_image=mask, strength=0.7, output_type="np", control_image=control,
                              controlnet_conditioning_scale=0.0)
    assert np.abs(steered - unsteered).max() > 1e-2  # it steers


@pytest.mark.oracle
def test_sd1_text_to_image_with_a_controlnet_matches_diffusers(sd1):
    folder, ref, controlnet = sd1
    pipe = Pipeline.from_pretrained(folder, dtype="float32", max_steps=STEPS, controlnet=str(folder / "controlnet"))
    ref_pipe = StableDiffusionControlNetPipeline(**ref.components, controlnet=controlnet)
    _both(ref_pipe, pipe, "SD 1.x ControlNet", _control_image(3), controlnet_conditioning_scale=0.8)


@pytest.mark.oracle
def test_sd1_inpainting_with_a_controlnet_matches_diffusers(sd1, diffusers_encodes_the_posterior_mean):
    """The scale left to the default (0.5 for SD 1.x inpainting); strength 1 (the default) starts from
    noise alone, 0.6 from the noised image, with the Euler sampler."""
    folder, ref, controlnet = sd1
    pipe = Pipeline.from_pretrained(folder, dtype="float32", max_steps=STEPS, controlnet=str(folder / "controlnet"))
    ref_pipe = StableDiffusionControlNetInpaintPipeline(**ref.components, controlnet=controlnet)
    euler = EulerDiscreteScheduler.from_config(ref.scheduler.config)
    image, mask, control = _picture(2), _mask(), _control_image(5)
    _both(ref_pipe, pipe, "SD 1.x ControlNet inpaint strength 1", control, euler, "euler", image=image,
          mask_image=mask)
    _both(ref_pipe, pipe, "SD 1.x ControlNet inpaint strength 0.6", control, euler, "euler", image=image,
          mask_image=mask, strength=0.6, control_guidance_end=0.7)


@pytest.mark.oracle
def test_sdxl_with_a_lora_and_a_controlnet_matches_diffusers(sdxl, steered, tmp_path):
    """A kohya LoRA over every UNet and text encoder layer, loaded by diffusers' `load_lora_weights`
    into its ControlNet pipeline (the ControlNet keeps its weights in both)."""
    _, ref, controlnets = sdxl
    pipe = steered
    path = kohya_file(tmp_path / "style.safetensors", ref, sgm=True, seed=12)
    ref_pipe = StableDiffusionXLControlNetPipeline(**ref.components, controlnet=controlnets[0])
    image = _control_image(6)
    ref_pipe.load_lora_weights(str(path), adapter_name="style")
    try:
        ref_pipe.set_adapters(["style"], adapter_weights=[0.8])
        pipe.set_loras({str(path): 0.8})
        styled = _both(ref_pipe, pipe, "SDXL ControlNet with a LoRA", image, controlnet_conditioning_scale=0.9)
    finally:
        ref_pipe.unload_lora_weights()  # the UNet and text encoders are the fixture's, and ours the module's
        pipe.set_loras({})
    plain = pipe.generate(PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=5.0, height=HEIGHT, width=WIDTH,
                          latents=_noise(), output_type="np", control_image=image, controlnet_conditioning_scale=0.9)
    assert np.abs(styled - plain).mean() > 1e-2  # the LoRA matters


def test_a_controlnet_of_another_family_is_refused_before_its_weights(sdxl, sd1, tmp_path):
    folder, _, _ = sdxl
    _controlnet(sd1[1], tmp_path / "sd1-controlnet", seed=1)
    (tmp_path / "sd1-controlnet" / "diffusion_pytorch_model.safetensors").unlink()  # never read
    with pytest.raises(CheckpointError, match="ControlNet; it cannot steer this SDXL model"):
        Pipeline.from_pretrained(folder, dtype="float32", controlnet=str(tmp_path / "sd1-controlnet"))
    (tmp_path / "control.pth").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="pickled"):
        Pipeline.from_pretrained(folder, dtype="float32", controlnet=str(tmp_path / "control.pth"))


@pytest.mark.oracle
@pytest.mark.parametrize("prefix", ["control_model.", ""])
def test_an_sd15_controlnet_in_the_original_layout_loads_as_diffusers_reads_it(tmp_path, prefix):
    """A single file in the ControlNet project's layout, written by inverting our key table: diffusers'
    `from_single_file` reads it back into the same weights, and ours loads what the diffusers folder holds."""
    ref = sd_pipeline(tmp_path / "sd1")
    torch_controlnet = _controlnet(ref, tmp_path / "folder", seed=31)
    values = json.loads((tmp_path / "folder/config.json").read_text())
    config = config_from_dict(controlnet_model.ControlNetConfig, values)
    state = torch_controlnet.state_dict()
    keys = [checkpoint_key(path) for path in flatten(controlnet_model.abstract_params(config))]
    original = {prefix + single_file.controlnet_original(key, config).key: state[key].contiguous() for key in keys}
    assert len(original) == len(state) == len(keys)  # one stored tensor per parameter, none left over
    (tmp_path / "single").mkdir()
    file = tmp_path / "single" / "control_tiny_sd15.safetensors"
    save_file(original, file)
    shutil.copy(tmp_path / "folder/config.json", tmp_path / "single/config.json")  # a tiny one has no built-in config
    oracle = ControlNetModel.from_single_file(file, config=str(tmp_path / "folder"))
    for key, value in oracle.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)
    spec = Pipeline.from_pretrained(tmp_path / "sd1", dtype="float32").spec
    from_file = controlnets.resolve(str(file), spec, dtype="float32")
    assert from_file.original_prefix == prefix
    from_folder = controlnets.resolve(str(tmp_path / "folder"), spec, dtype="float32")
    for path, value in flatten(from_file.load(np.float32, np.asarray)).items():
        np.testing.assert_array_equal(value, flatten(from_folder.load(np.float32, np.asarray))[path])


def test_the_published_controlnet_configs_fit_their_families_only():
    specs = {name: ModelSpec.from_folder(BUILTIN_CONFIGS / name) for name in ("sd-1.5", "sd-2.1", "sdxl-base-1.0")}
    for name, family in (("controlnet-sd-1.5", "sd-1.5"), ("controlnet-sdxl-1.0", "sdxl-base-1.0")):
        values = json.loads((BUILTIN_CONFIGS / name / "config.json").read_text())
        config = config_from_dict(controlnet_model.ControlNetConfig, values)
        controlnets.check_fits(config, specs[family], name)
        for other in sorted(set(specs) - {family}):
            refused = f"{name} .*(ControlNet; it cannot steer|does not fit this model)"
            with pytest.raises(CheckpointError, match=refused):
                controlnets.check_fits(config, specs[other], name)
