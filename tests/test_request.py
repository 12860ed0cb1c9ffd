"""One validation for every caller: the limits and messages of `Request.validated`."""

import dataclasses

import numpy as np
import pytest

from sdxl.checkpoints import BUILTIN_CONFIGS, ModelSpec
from sdxl.engine.request import MAX_SEED, Limits, Request

SPEC = ModelSpec.from_folder(BUILTIN_CONFIGS / "sdxl-base-1.0")  # latent factor 32, 4 latent channels
LIMITS = Limits(SPEC, max_steps=50)


def _request(loras=None, **changes) -> Request:
    values = dict(prompt="a fox", negative_prompt="", num_images=2, seed=1, steps=10, height=1024, width=768)
    return dataclasses.replace(Request.from_prompt(**(values | changes)), loras=loras)


def test_values_from_json_clients_are_converted():
    request = Request(("a",), ("",), (3.0,), (0,), ("7.5",), "12", 1024.0, 768, "ddim")
    checked = request.validated(LIMITS)
    assert (checked.seeds, checked.guidance_scales, checked.steps, checked.height) == ((3,), (7.5,), 12, 1024)
    assert all(type(v) is int for v in (*checked.seeds, checked.steps, checked.height, checked.width))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(steps=0), "steps must be an integer from 1 to 50, got 0"),
        (dict(steps=51), "steps must be an integer from 1 to 50, got 51"),
        (dict(steps=2.5), "steps must be an integer from 1 to 50, got 2.5"),
        (dict(seed=-1), f"seed must be an integer from 0 to {MAX_SEED}, got -1"),
        (dict(seed=True), "seed must be an integer"),
        (dict(guidance_scale=float("nan")), "guidance scale must be a number from 0 to 20, got nan"),
        (dict(guidance_scale=21), "guidance scale must be a number from 0 to 20, got 21"),
        (dict(height=1000), "height must be a multiple of 32 from 32 to 4096, got 1000"),
        (dict(width="abc"), "width must be a multiple of 32 from 32 to 4096, got 'abc'"),
        (dict(width=8192), "width must be a multiple of 32 from 32 to 4096, got 8192"),
        (dict(sampler="unipc"), "unknown sampler 'unipc'"),
        (dict(prompt=["a fox", 3]), "prompt must be text, got int 3"),
        (dict(noise=np.zeros((2, 4, 4, 4))), "noise must have shape (2, 128, 96, 4)"),
        (dict(prompt="x" * 2001), "prompt is 2001 characters long; at most 2000 are taken"),
        (dict(negative_prompt="x" * 10**6), "negative prompt is 1000000 characters long"),
    ],
)
def test_a_bad_value_is_named_with_what_is_allowed(changes, message):
    with pytest.raises(ValueError) as error:
        _request(**changes).validated(LIMITS)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(noise_source="gpu"), "noise source must be one of jax, nv, cpu, got 'gpu'"),
        (dict(variation_strength=0.5), "a variation strength needs torch's noise: choose the noise source nv or cpu"),
        (dict(ensd=31337), "an ENSD needs torch's noise"),
        (dict(batch_noise=True), "batch noise needs torch's noise"),
        (dict(noise_source="cpu", batch_noise=True, ensd=31337), "A1111 draws noise per image, so an ENSD cannot go"),
        (dict(noise_source="nv", variation_strength=2), "variation strength must be a number from 0 to 1, got 2"),
        (dict(noise_source="nv", variation_seed=-1), "variation seed must be an integer from 0"),
        (dict(noise_source="cpu", noise=np.zeros((2, 128, 96, 4))), "give starting noise, or a noise source to draw"),
    ],
)
def test_noise_settings_are_checked_against_each_other(changes, message):
    with pytest.raises(ValueError) as error:
        dataclasses.replace(_request(), **changes).validated(LIMITS)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(clip_skip=0), "clip skip must be an integer from 1 to 12, got 0"),
        (dict(clip_skip=13), "clip skip must be an integer from 1 to 12, got 13"),
        (dict(clip_skip=1.5), "clip skip must be an integer from 1 to 12, got 1.5"),
        (dict(sdxl_clip_l_skip="false"), "sdxl_clip_l_skip must be true or false, got 'false'"),
    ],
)
def test_clip_skip_settings_are_checked(changes, message):
    with pytest.raises(ValueError) as error:
        dataclasses.replace(_request(), **changes).validated(LIMITS)
    assert str(error.value) == message


def test_clip_skip_from_json_is_an_int_and_part_of_the_batch_key():
    checked = dataclasses.replace(_request(), clip_skip="2", sdxl_clip_l_skip=True).validated(LIMITS)
    assert (checked.clip_skip, checked.sdxl_clip_l_skip) == (2, True) and type(checked.clip_skip) is int
    assert checked.call_settings != _request().validated(LIMITS).call_settings


def test_per_image_lists_must_agree():
    with pytest.raises(ValueError, match="got 2 prompts and 1 negative prompts for 2 images"):
        _request(prompt=["a", "b"], negative_prompt=["c"])
    uneven = Request(("a", "b"), ("",), (1, 2), (0, 0), (5.0, 5.0), 10, 1024, 1024)
    with pytest.raises(ValueError, match="same, non-zero, number"):
        uneven.validated(LIMITS)


def test_requests_merge_in_order_and_keep_their_call_settings():
    first, second = _request(seed=1), _request(prompt="a cat", seed=9, num_images=1, guidance_scale=7.0)
    merged = Request.merged([first, second])
    assert merged.prompts == ("a fox", "a fox", "a cat") and merged.seeds == (1, 1, 9)
    assert merged.image_index == (0, 1, 0) and merged.guidance_scales == (5.0, 5.0, 7.0)
    assert merged.call_settings == first.call_settings == second.call_settings
    drawn = [dataclasses.replace(r, noise_source="cpu", noise=np.full((len(r), 4, 4, 4), i, np.float32))
             for i, r in enumerate((first, second))]
    assert drawn[0].call_settings != first.call_settings, "drawn noise never merges with JAX's"
    assert Request.merged(drawn).noise[:, 0, 0, 0].tolist() == [0, 0, 1], "each image keeps its drawn noise"


def test_loras_are_checked_sorted_and_part_of_the_batch_key():
    request = _request(loras=(("b.safetensors", "0.5"), ("a.safetensors", -1), ("c.safetensors", 0)))
    checked = request.validated(LIMITS)
    assert checked.loras == (("a.safetensors", -1.0), ("b.safetensors", 0.5))  # scale 0 does nothing
    assert _request(loras=(("a.safetensors", 0),)).validated(LIMITS).loras == ()
    assert checked.call_settings != _request(loras=()).validated(LIMITS).call_settings
    assert _request().validated(LIMITS).loras == (), "none named: the active ones, none here"
    active = dataclasses.replace(LIMITS, active_loras=(("b.safetensors", 0.5),))
    assert _request().validated(active).loras == (("b.safetensors", 0.5),)
    with pytest.raises(ValueError, match=r"LoRA scale of a.safetensors must be a number from -4 to 4, got 9"):
        _request(loras=(("a.safetensors", 9),)).validated(LIMITS)


def test_a1111s_schedule_types_are_checked_against_the_sampler_and_the_request():
    request = _request(sampler="DPM++ 2M SDE")
    assert request.validated(LIMITS).schedule_type == "Automatic", "an A1111 sampler's own"
    assert _request(sampler="euler").validated(LIMITS).schedule_type == "diffusers"
    karras = dataclasses.replace(_request(sampler="euler"), schedule_type="karras").validated(LIMITS)
    assert karras.schedule_type == "Karras" and karras.call_settings != _request(sampler="euler").validated(
        LIMITS).call_settings
    with pytest.raises(ValueError, match="the DDIM schedule type runs 31 steps for 30, more than the 30 allowed"):
        dataclasses.replace(_request(steps=30, sampler="euler"), schedule_type="DDIM").validated(
            dataclasses.replace(LIMITS, max_steps=30))
    image = np.zeros((2, 1024, 768, 3), np.uint8)
    with pytest.raises(ValueError, match=r"A1111's schedule types \(Karras\) render from text, whole"):
        dataclasses.replace(_request(), images=image, strength=0.5, schedule_type="Karras").validated(LIMITS)


def test_what_the_pipeline_allows_is_checked_against_its_limits():
    with pytest.raises(ValueError, match="no refiner is loaded to refine with"):
        dataclasses.replace(_request(), refine_from=0.8).validated(LIMITS)
    demo = dataclasses.replace(LIMITS, sizes=((1024, 1024), (1152, 896)))
    with pytest.raises(ValueError, match="size 768x1024 is not one of this model's sizes: 1024x1024, 1152x896"):
        _request().validated(demo)
    tagged = dataclasses.replace(LIMITS, loras={"style": "loras/style.safetensors"},
                                 active_loras=(("loras/other.safetensors", 1.0),))
    checked = _request(prompt="<lora:style:0.5> a fox <lora:style:0.25>").validated(tagged)
    assert checked.loras == (("loras/other.safetensors", 1.0), ("loras/style.safetensors", 0.75)), "tags add"
    with pytest.raises(ValueError, match="names the LoRA 'ink', which is not loaded; the loaded ones: style"):
        _request(prompt="a fox <lora:ink>").validated(tagged)
    with pytest.raises(ValueError, match="no ControlNet is loaded to steer with a control image"):
        dataclasses.replace(_request(), controls=((object(),),) * 2).validated(LIMITS)
