"""A request's sampling method: samplers by name and label, the schedule types each runs on
(`sdxl.sampling.methods`)."""

import re

import pytest

from sdxl.checkpoints import BUILTIN_CONFIGS, ModelSpec
from sdxl.sampling import kdiffusion, methods, samplers


def test_a_sampler_is_taken_by_its_name_or_its_label_and_refused_with_both():
    assert methods.sampler_name("DPM++ 2M") == methods.sampler_name("dpmpp_2m") == "dpmpp_2m"
    assert methods.sampler_name("euler A") == "euler_ancestral"
    assert methods.sampler_name("DPM++ 2M SDE") == "dpmpp_2m_sde"
    with pytest.raises(ValueError, match=r"choose one of: euler \(Euler\), euler_ancestral \(Euler a\)"):
        methods.sampler_name("unipc")


def test_every_sampler_has_a_family_and_the_labels_are_a1111s():
    assert set(methods.ON_DIFFUSERS_SCHEDULE) == set(samplers.SAMPLERS)
    assert {methods.SAMPLER_NAMES[name] for name in methods.ON_A1111_SCHEDULES} == set(kdiffusion.SAMPLERS)
    assert set(methods.ON_DIFFUSERS_SCHEDULE) | set(methods.ON_A1111_SCHEDULES) == set(methods.SAMPLER_NAMES)


@pytest.mark.parametrize("sampler, asked, runs_on", [
    ("euler", None, "diffusers"),  # diffusers' samplers stay diffusers' unless a schedule type is named
    ("dpmpp_2m_sde", None, "Automatic"),
    ("euler_ancestral", "sgm uniform", "SGM Uniform"),
    ("restart", "Karras", "Karras"),
    ("lcm", "DIFFUSERS", "diffusers"),
])
def test_a_schedule_type_is_the_samplers_own_or_one_it_runs_on(sampler, asked, runs_on):
    assert methods.schedule_type_for(sampler, asked) == runs_on


@pytest.mark.parametrize("sampler, asked, message", [
    ("heun", "diffusers", "Heun is one of A1111's samplers, not diffusers': give it one of A1111's schedule types"),
    ("ddim", "Karras", "DDIM runs on diffusers' schedule only, not on the Karras schedule type"),
    ("dpmpp_2m_karras", "Exponential", "for A1111's, choose DPM++ 2M with the Karras schedule type"),
    ("euler", "Turbo", "unknown schedule type 'Turbo'; choose one of: diffusers, Automatic, Uniform"),
])
def test_a_schedule_type_a_sampler_does_not_run_on_is_refused(sampler, asked, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        methods.schedule_type_for(sampler, asked)


def test_the_schedules_of_both_families():
    config = ModelSpec.from_folder(BUILTIN_CONFIGS / "sdxl-base-1.0").scheduler
    diffusers = methods.schedule(config, "euler", "diffusers", 10, 12, is_sdxl=True)
    a1111 = methods.schedule(config, "euler", "Automatic", 10, 12, is_sdxl=True)
    assert diffusers.sigmas.shape == a1111.sigmas.shape == (13,)
    assert abs(float(diffusers.sigmas[0]) - float(a1111.sigmas[0])) > 1e-3, "diffusers' leading spacing differs"
    assert methods.steps_run(config, "euler", "DDIM", 30, is_sdxl=True) == 31  # A1111's stride leaves one more
    assert methods.steps_run(config, "euler", "diffusers", 10, is_sdxl=True) == 10
    assert methods.loop("euler", a1111=True).step is kdiffusion.euler_step
    assert methods.loop("euler", a1111=False) is samplers.SAMPLERS["euler"]
    assert methods.loop("dpmpp_sde", a1111=True).draws(5) == 10
