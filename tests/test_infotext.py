"""Generation parameters as webui writes and reads them, and ours read back (`sdxl.engine.infotext`)."""

import dataclasses
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from sdxl.engine import infotext
from sdxl.engine.hires import Hires
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.request import Request
from sdxl.sampling.schedulers import SchedulerConfig


@pytest.mark.parametrize("sampler, schedule, ours", [
    ("DPM++ 2M", "Karras", ("dpmpp_2m", "Karras")),  # webui 1.9 and later, and Forge
    ("DPM++ 2M", "Automatic", ("dpmpp_2m", "Automatic")),
    ("DPM++ 2M", None, ("dpmpp_2m", "Automatic")),
    ("DPM++ 2M Karras", None, ("dpmpp_2m", "Karras")),  # before 1.9: one field
    ("DPM++ 2M SDE Exponential", "Automatic", ("dpmpp_2m_sde", "Exponential")),  # the name's overrides the field
    ("Euler a", "sgm_uniform", ("euler_ancestral", "SGM Uniform")),  # webui's own names for schedule types
    ("DPM2 a", "Turbo", ("dpm_2_ancestral", "Automatic")),  # a schedule type webui does not know: Automatic
    ("heun", "Karras", ("heun", "Karras")),
    ("DDIM", None, ("ddim", "diffusers")),  # webui's own DDIM: diffusers' is the nearest here
    ("Euler", "diffusers", ("euler", "diffusers")),  # ours
    ("DPM++ 2M Karras", "diffusers", ("dpmpp_2m_karras", "diffusers")),
])
def test_webui_samplers_and_schedule_types_read_as_ours(sampler, schedule, ours):
    fields = f"Steps: 20, Sampler: {sampler}, " + (f"Schedule type: {schedule}, " if schedule else "") + "CFG scale: 7"
    found, unused = infotext.read_infotext(f"a fox\n{fields}")
    assert (found["sampler"], found["schedule_type"]) == ours
    assert unused == (("Schedule type",) if schedule == "Turbo" else ())


def test_our_texts_from_before_the_rng_field_name_diffusers_samplers():
    found, _ = infotext.read_infotext("a fox\nSteps: 20, Sampler: DPM++ 2M, Schedule type: Karras, Image index: 1")
    assert (found["sampler"], found["schedule_type"]) == ("dpmpp_2m_karras", "diffusers")
    found, _ = infotext.read_infotext("a fox\nSteps: 20, Sampler: Euler a, Image index: 0")
    assert (found["sampler"], found["schedule_type"]) == ("euler_ancestral", "diffusers")


def test_a_sampler_we_lack_is_named_as_not_applied():
    with pytest.warns(UserWarning, match="^parameters not applied: Sampler$"):
        assert "sampler" not in infotext.read_parameters("a fox\nSteps: 20, Sampler: UniPC, CFG scale: 7")


def test_written_parameters_read_back_with_quoted_values_and_emphasis():
    text = infotext.parameters_text("a (red:1.2) fox, <lora:ink:0.5>", "blur, (watermark)", {
        "Steps": 30, "Sampler": "DPM++ 2M", "Schedule type": "Karras", "CFG scale": 6.5, "Seed": 7,
        "Size": "1152x896", "Model": None, "Emphasis": "No norm", "Lora hashes": "ink: 0123456789ab, glow: ba98",
    })
    assert text.splitlines()[-1] == ('Steps: 30, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 6.5, Seed: 7, '
                                     'Size: 1152x896, Emphasis: No norm, Lora hashes: "ink: 0123456789ab, glow: ba98"')
    found = infotext.read_parameters(text)
    # No RNG: webui's GPU source, on NVIDIA cards its NV.
    assert found == dict(prompt="a (red:1.2) fox, <lora:ink:0.5>", negative_prompt="blur, (watermark)", steps=30,
                         guidance_scale=6.5, seed=7, width=1152, height=896, sampler="dpmpp_2m",
                         schedule_type="Karras", emphasis="no-norm", noise_source="nv")
    assert infotext.read_parameters("a fox\nSteps: 20")["emphasis"] == "original"


def test_lora_hashes_text_and_its_infotext_quoting():
    value = infotext.hashes_text(
        [("foxy:v2, final", "0123456789ab"), ("owl", "ba9876543210"), ("foxyv2 final", "c" * 12)])
    assert value == "foxyv2 final: cccccccccccc, owl: ba9876543210"
    assert infotext.infotext_quote(value) == '"foxyv2 final: cccccccccccc, owl: ba9876543210"'
    assert infotext.infotext_quote("No norm") == "No norm"


def test_emphasis_infotext():
    assert infotext.emphasis_infotext("original", ["(a:1.2)"]) is None
    assert infotext.emphasis_infotext("no-norm", ["(a:1.2)", ""]) == "No norm"
    assert infotext.emphasis_infotext("no-norm", ["a", "b"]) is None
    assert infotext.emphasis_infotext("none", ["a", "[b]"]) == "None"


A1111_TEXT = """a lighthouse at dusk, (storm:1.2)
Negative prompt: blurry
Steps: 30, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 6.5, Seed: 1234, Size: 1152x896, \
Model hash: 31e35c80fc, Model: sd_xl_base_1.0, Variation seed: 99, Variation seed strength: 0.25, Clip skip: 2, \
ENSD: 31337, RNG: CPU, Hires upscale: 1.5, Version: v1.10.1"""


def test_an_a1111_text_gives_generates_arguments_and_names_what_it_cannot_apply():
    with pytest.warns(UserWarning, match=r"^parameters not applied: Model$"):
        found = infotext.read_parameters(A1111_TEXT)
    assert found == dict(
        prompt="a lighthouse at dusk, (storm:1.2)", negative_prompt="blurry", steps=30, guidance_scale=6.5, seed=1234,
        width=1152, height=896, sampler="dpmpp_2m", schedule_type="Karras", emphasis="original", noise_source="cpu",
        variation_seed=99, variation_strength=0.25, ensd=31337, clip_skip=2,  # which SDXL ignores, as webui
        hires=Hires(scale=1.5),  # webui's defaults otherwise
    )
    for rng, source in (("NV", "nv"), ("GPU", "nv"), ("JAX", "jax")):
        assert infotext.read_infotext(f"a fox\nSteps: 20, RNG: {rng}")[0]["noise_source"] == source
    assert infotext.read_infotext("a fox\nSteps: 20, Seed: 3, Image index: 2")[0]["noise_source"] == "jax", (
        "our texts from before RNG was written")


@pytest.mark.parametrize("fields, hires", [
    ("Denoising strength: 0.4, Hires upscale: 2, Hires steps: 10, Hires upscaler: 4x-UltraSharp",
     Hires(scale=2, steps=10, upscaler="4x-UltraSharp", strength=0.4)),
    # webui's "Hires resize" names both sides, 0 for one left to the picture's proportions.
    ("Denoising strength: 0.5, Hires resize: 1920x0, Hires upscaler: Latent (bicubic)",
     Hires(resize_width=1920, upscaler="Latent (bicubic)", strength=0.5)),
    # Its own sampler: its schedule type is the first pass's, unless given; Forge's hires CFG; prompts.
    ('Denoising strength: 0.3, Hires upscale: 1.5, Hires upscaler: Lanczos, Hires sampler: Euler a, '
     'Hires CFG Scale: 4, Hires prompt: "a fox, detailed", Hires negative prompt: blur',
     Hires(scale=1.5, upscaler="Lanczos", strength=0.3, sampler="euler_ancestral", schedule_type="Karras",
           guidance_scale=4.0, prompt="a fox, detailed", negative_prompt="blur")),
    ("Hires upscale: 2, Hires upscaler: None, Hires sampler: DPM++ 2M SDE Exponential",
     Hires(upscaler="None", sampler="dpmpp_2m_sde", schedule_type="Exponential")),
    ("Hires upscale: 2, Hires schedule type: Align Your Steps", Hires(schedule_type="Align Your Steps")),
])
def test_webui_hires_fields_read_as_a_hires_fix(fields, hires):
    found, unused = infotext.read_infotext(f"a fox\nSteps: 20, Sampler: DPM++ 2M, Schedule type: Karras, {fields}")
    assert found["hires"] == hires
    assert unused == ()
    assert "hires" not in infotext.read_infotext("a fox\nSteps: 20, Denoising strength: 0.5")[0], "image-to-image's"


def test_a_model_or_vae_other_than_the_loaded_ones_is_named_with_what_is_loaded():
    pipe = dataclasses.make_dataclass("Loaded", ["name", "vae_name", "ip_adapters", "spec"])(
        "/models/juggernautXL.safetensors", None, (), SimpleNamespace(scheduler=SchedulerConfig()))
    text = "a fox\nSteps: 20, Model: juggernautXL, VAE: sdxl_vae.safetensors"
    assert infotext.read_infotext(text, pipe)[1] == ("VAE sdxl_vae.safetensors (loaded: the model's own)",)
    pipe.vae_name = "madebyollin/sdxl_vae"
    assert infotext.read_infotext(text, pipe)[1] == ()
    other = "a fox\nSteps: 20, Model: sd_xl_base_1.0"
    with pytest.warns(UserWarning, match=r"^parameters not applied: Model sd_xl_base_1.0 \(loaded: juggernautXL\), "
                      r"VAE the model's own \(loaded: sdxl_vae\)$"):
        infotext.read_parameters(other, pipe)
    # webui's Noise schedule setting ("Default" for a model with a ztsnr key) against the loaded model's.
    zero_snr = "a fox\nSteps: 20, Model: juggernautXL, VAE: sdxl_vae.safetensors, Noise Schedule: Default"
    assert infotext.read_infotext(zero_snr, pipe)[1] == ("Noise Schedule Default (loaded: without zero terminal SNR)",)
    pipe.spec = SimpleNamespace(scheduler=SchedulerConfig(rescale_betas_zero_snr=True))
    assert infotext.read_infotext(zero_snr, pipe)[1] == ()
    assert infotext.read_infotext(zero_snr.replace("Default", "Zero Terminal SNR"), pipe)[1] == ()


@pytest.fixture(scope="module")
def tiny():
    return Pipeline.from_pretrained("tiny", max_steps=4, devices=jax.devices()[:1])


@pytest.mark.compiles
@pytest.mark.parametrize("noise", [
    dict(noise_source="nv", ensd=31337),
    dict(noise_source="cpu", variation_seed=7, variation_strength=0.3),
    # One generator per batch: a stochastic sampler's later draws depend on the batch's size (diffusers'
    # convention), so the text redraws a picture of Euler's, whose noise is the starting noise alone.
    dict(noise_source="cpu", batch_noise=True, sampler="euler"),
    dict(),  # JAX's
    dict(guidance_rescales=(0.7, 0.7)),  # written as webui's CFG Rescale extension writes it
])
def test_our_texts_draw_their_picture_again(tiny, noise):
    """An image's text, read back, renders it as the first image: A1111's sources write the image's own
    seed (and variation seed), so the second image of a request comes back from its text alone."""
    request = Request.from_prompt("a fox", num_images=2, seed=5, steps=2, height=128, width=128,
                                  sampler="euler_ancestral")
    prepared = tiny.prepare(dataclasses.replace(request, **noise), output_type="np")
    rendered = tiny.render(prepared).images
    i = 1 if noise.get("noise_source", "jax") != "jax" and not noise.get("batch_noise") else 0
    text = infotext.png_parameters(tiny, prepared.request, i, "tiny")
    with pytest.warns(UserWarning, match="^parameters not applied: Model$"):  # the pipeline's own
        again = tiny.generate(**infotext.read_parameters(text), num_images=1, output_type="np")
    # One image a call against two: XLA's CPU kernels may block a batch of one otherwise (2.6e-6 apart on
    # some hosts); other noise would be whole units apart.
    np.testing.assert_allclose(again[0], rendered[i], atol=1e-5)


def test_a_hires_fix_is_written_as_webui_writes_it_and_read_back(tiny):
    """The hires fields (the first pass's size in "Size", the second pass's settings where they differ)
    read back as the validated hires fix."""
    request = Request.from_prompt("a fox", num_images=1, seed=5, steps=4, height=128, width=128, sampler="euler")
    hires = Hires(scale=1.5, upscaler="Latent (antialiased)", steps=2, strength=0.45, sampler="dpmpp_2m",
                  schedule_type="Karras", guidance_scale=3.0, negative_prompt="blur")
    validated = tiny.prepare(dataclasses.replace(request, hires=hires)).request
    text = infotext.png_parameters(tiny, validated, 0, "tiny")
    assert ("Size: 128x128, Model: tiny, RNG: JAX, Denoising strength: 0.45, Hires upscale: 1.5, Hires steps: 2, "
            "Hires upscaler: Latent (antialiased), Hires sampler: DPM++ 2M, Hires schedule type: Karras, "
            "Hires CFG Scale: 3, Hires negative prompt: blur") in text
    with pytest.warns(UserWarning, match="^parameters not applied: Model$"):
        found = infotext.read_parameters(text)
    assert found["hires"] == validated.hires


@pytest.mark.parametrize("settings, written", [
    (dict(), None),  # webui's default, 1, is not written
    (dict(clip_skip=2), "Clip skip: 2"),
    (dict(clip_skip=3, sdxl_clip_l_skip=True), "Clip skip: 3, Clip skip SDXL: True"),
])
def test_clip_skip_is_written_as_webui_writes_it_and_read_back(tiny, settings, written):
    request = Request.from_prompt("a fox", num_images=1, seed=5, steps=2, height=128, width=128, sampler="euler")
    validated = tiny.prepare(dataclasses.replace(request, **settings)).request
    text = infotext.png_parameters(tiny, validated, 0, "tiny")
    settings_line = text.splitlines()[-1]
    assert settings_line.endswith(f"RNG: JAX, {written}") if written else "Clip skip" not in settings_line
    with pytest.warns(UserWarning, match="^parameters not applied: Model$"):
        found = infotext.read_parameters(text)
    assert {name: found[name] for name in settings} == settings


def test_a_picture_of_8_bit_weights_says_so_in_a_field_webui_reads_past():
    pipe = Pipeline.from_pretrained("tiny", weights_dtype="int8")
    request = Request.from_prompt("a fox", num_images=1, seed=5, steps=2, height=128, width=128, sampler="euler")
    text = infotext.png_parameters(pipe, pipe.prepare(request).request, 0, "tiny")
    assert "Size: 128x128, Model: tiny, Weights dtype: int8, RNG: JAX" in text
    with pytest.warns(UserWarning, match="^parameters not applied: Model$"):  # metadata, as the hashes
        infotext.read_parameters(text)
