"""Samplers against a loop of diffusers' scheduler.scale_model_input / step, with a toy model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
)
from diffusers.schedulers import scheduling_euler_ancestral_discrete
from test_schedulers import SD15_SCHEDULER_CONFIG, SDXL_SCHEDULER_CONFIG

from sdxl.config import config_from_dict
from sdxl.sampling import samplers as sampling
from sdxl.sampling.samplers import SAMPLERS, denoised_from_model_output
from sdxl.sampling.schedulers import SchedulerConfig

SHAPE = (2, 8, 8, 4)  # [B, H, W, C]
MAX_STEPS = 30
PATTERN = np.random.default_rng(1).standard_normal(SHAPE[1:]).astype(np.float32)


def sample(sampler, denoiser, x, schedule, num_steps, keys=None):
    """A whole sampling loop, as the pipeline runs it: init, every model evaluation, finish."""
    evaluations = sampler.evaluations(num_steps)
    carry = sampling.run_steps(sampler, denoiser, sampler.init(x), schedule, num_steps, 0, evaluations, keys)
    return sampler.finish(carry)


def toy_model(model_input, timestep, xp):
    """A fixed stand-in for the UNet: linear in its input, smooth in the timestep."""
    return 0.9 * model_input + 0.2 * xp.asarray(PATTERN) * xp.cos(timestep / 300)


def toy_denoiser(prediction_type: str):
    """Wraps the toy model as the pipeline wraps the UNet: input scaled by c_in, output parametrised."""

    def denoiser(x, sigma, timestep, step):  # the toy model's conditioning is the same at every step
        model_output = toy_model(x / jnp.sqrt(sigma**2 + 1), timestep, jnp)
        return denoised_from_model_output(x, model_output, sigma, prediction_type)

    return denoiser


def diffusers_sample(scheduler, noise: np.ndarray) -> np.ndarray:
    """The loop a diffusers pipeline runs, with the toy model."""
    latents = torch.from_numpy(noise) * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        model_input = scheduler.scale_model_input(latents, t)
        model_output = toy_model(model_input, t.float(), torch)
        latents = scheduler.step(model_output, t, latents).prev_sample
    return latents.numpy()


@functools.cache
def compiled_sampler(name: str, prediction_type: str):
    return jax.jit(functools.partial(sample, SAMPLERS[name], toy_denoiser(prediction_type)))


def run(name, values, num_steps, noise, keys=None):
    """Our schedule and sampler, jitted with num_steps traced."""
    sampler = SAMPLERS[name]
    config = config_from_dict(SchedulerConfig, values)
    schedule = sampler.schedule(config, num_steps, MAX_STEPS)
    extra = (keys,) if sampler.stochastic else ()
    x = jnp.asarray(noise) * schedule.init_noise_sigma
    return np.asarray(compiled_sampler(name, config.prediction_type)(x, schedule, num_steps, *extra))


def check_against_diffusers(name, reference_cls, values, num_steps, keys=None):
    noise = np.random.default_rng(num_steps).standard_normal(SHAPE).astype(np.float32)
    reference = reference_cls.from_config(values)
    reference.set_timesteps(num_steps)
    expected = diffusers_sample(reference, noise)
    ours = run(name, values, num_steps, noise, keys)
    diff = np.abs(ours - expected).max()
    print(f"{name} {num_steps} steps: max abs diff {diff:.2e} (output std {expected.std():.2f})")
    assert expected.std() > 0.01  # SD 1.5 with 1 step starts at sigma 0.03: "linspace" puts it at t = 0
    assert diff <= 1e-5


@pytest.mark.parametrize("num_steps", [1, 2, 3, 4, 7, 25])
@pytest.mark.parametrize(
    "values",
    [SD15_SCHEDULER_CONFIG, {**SD15_SCHEDULER_CONFIG, "timestep_spacing": "trailing", "set_alpha_to_one": True}],
    ids=["sd15", "trailing"],
)
def test_plms_matches_diffusers_pndm(values, num_steps):
    """SD 1.x's own scheduler: the second step evaluates the model twice, then Adams-Bashforth."""
    check_against_diffusers("pndm", PNDMScheduler, values, num_steps)


@pytest.mark.parametrize(
    "config, sampler",
    [
        ({"_class_name": "EulerDiscreteScheduler"}, "euler"),
        ({"_class_name": "EulerAncestralDiscreteScheduler", "timestep_spacing": "trailing"}, "euler_ancestral"),
        ({"_class_name": "DPMSolverMultistepScheduler"}, "dpmpp_2m"),
        ({"_class_name": "DPMSolverMultistepScheduler", "use_karras_sigmas": True}, "dpmpp_2m_karras"),
        ({"_class_name": "DDIMScheduler"}, "ddim"),
        ({"_class_name": "PNDMScheduler", "skip_prk_steps": True}, "pndm"),
        ({"_class_name": "LCMScheduler"}, "lcm"),
        ({"_class_name": "TCDScheduler"}, "tcd"),
        ({"_class_name": "HeunDiscreteScheduler"}, "scheduler HeunDiscreteScheduler is not implemented"),
        ({"_class_name": "PNDMScheduler", "skip_prk_steps": False}, "only with skip_prk_steps"),
        ({"_class_name": "DPMSolverMultistepScheduler", "solver_order": 3}, "solver_order=3 is not implemented"),
    ],
)
def test_the_checkpoints_scheduler_class_picks_the_sampler_or_is_refused(config, sampler):
    if sampler in SAMPLERS:
        assert sampling.sampler_for_scheduler(config) == sampler
    else:
        with pytest.raises(ValueError, match=sampler):
            sampling.sampler_for_scheduler(config)


@pytest.mark.parametrize("num_steps", [1, 7, 25])
@pytest.mark.parametrize(
    "values",
    [
        SDXL_SCHEDULER_CONFIG,
        {**SDXL_SCHEDULER_CONFIG, "prediction_type": "v_prediction", "timestep_spacing": "trailing"},
        {**SD15_SCHEDULER_CONFIG, "use_karras_sigmas": True, "final_sigmas_type": "sigma_min"},
    ],
    ids=["sdxl", "trailing v", "sd15 karras"],
)
def test_euler_matches_diffusers(values, num_steps):
    check_against_diffusers("euler", EulerDiscreteScheduler, values, num_steps)


def test_num_steps_is_traced():
    """One compilation serves two step counts, and both match diffusers."""
    traces = 0
    config = config_from_dict(SchedulerConfig, SDXL_SCHEDULER_CONFIG)
    denoiser = toy_denoiser("epsilon")

    @jax.jit
    def euler(x, schedule, num_steps):
        nonlocal traces
        traces += 1
        return sample(SAMPLERS["euler"], denoiser, x, schedule, num_steps)

    noise = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    for num_steps in (7, 25):
        schedule = sampling.euler_schedule(config, num_steps, MAX_STEPS)
        reference = EulerDiscreteScheduler.from_config(SDXL_SCHEDULER_CONFIG)
        reference.set_timesteps(num_steps)
        ours = euler(jnp.asarray(noise) * schedule.init_noise_sigma, schedule, jnp.int32(num_steps))
        np.testing.assert_allclose(ours, diffusers_sample(reference, noise), atol=1e-5, rtol=0)
    assert traces == 1


def test_padding_is_not_read():
    config = config_from_dict(SchedulerConfig, SDXL_SCHEDULER_CONFIG)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32))
    padded = sampling.euler_schedule(config, 7, MAX_STEPS)
    exact = sampling.euler_schedule(config, 7, 7)
    sigmas, timesteps = np.array(padded.sigmas), np.array(padded.timesteps)
    sigmas[8:], timesteps[7:] = np.nan, np.nan
    garbage = padded.replace(sigmas=jnp.asarray(sigmas), timesteps=jnp.asarray(timesteps))
    denoiser = toy_denoiser("epsilon")
    results = [sample(SAMPLERS["euler"], denoiser, x, s, 7) for s in (exact, padded, garbage)]
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


@pytest.mark.compiles
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_running_the_loop_in_chunks_gives_the_same_latents(name):
    """The app runs the loop a few steps at a time to report progress; that must change nothing."""
    sampler = SAMPLERS[name]
    config = config_from_dict(SchedulerConfig, SDXL_SCHEDULER_CONFIG)
    schedule = sampler.schedule(config, 7, MAX_STEPS)
    keys = jax.random.split(jax.random.key(0), SHAPE[0])
    x = jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)) * schedule.init_noise_sigma
    denoiser = toy_denoiser("epsilon")
    whole = sample(sampler, denoiser, x, schedule, 7, keys)
    carry = sampler.init(x)
    for start, stop in ((0, 3), (3, 4), (4, sampler.evaluations(7))):
        carry = sampling.run_steps(sampler, denoiser, carry, schedule, 7, start, stop, keys)
    np.testing.assert_allclose(sampler.finish(carry), whole, rtol=1e-6, atol=1e-6)


def test_the_denoiser_hears_each_iteration_of_the_loop():
    """A ControlNet's start and end are read from the step the denoiser is called at."""
    sampler = SAMPLERS["euler"]
    schedule = sampler.schedule(config_from_dict(SchedulerConfig, SDXL_SCHEDULER_CONFIG), 7, MAX_STEPS)
    seen = jnp.full(SHAPE, -1.0)

    def step_as_denoised(x, sigma, timestep, step):
        return jnp.full_like(x, step.astype(jnp.float32))

    _, last = sampling.run_steps(sampler, step_as_denoised, jnp.zeros(SHAPE), schedule, 7, 2, 5, denoised=seen)
    np.testing.assert_array_equal(last, 4.0)  # the last of iterations 2..4


def test_denoised_from_model_output():
    x, eps, sigma = jnp.float32(3.0), jnp.float32(0.5), jnp.float32(2.0)
    assert denoised_from_model_output(x, eps, sigma, "epsilon") == 2.0
    # x = x0 + sigma * eps and v = alpha * eps - sigma_vp * x0 (variance-preserving alpha, sigma_vp).
    x0 = jnp.float32(0.7)
    alpha, sigma_vp = 1 / jnp.sqrt(sigma**2 + 1), sigma / jnp.sqrt(sigma**2 + 1)
    v = alpha * eps - sigma_vp * x0
    np.testing.assert_allclose(denoised_from_model_output(x0 + sigma * eps, v, sigma, "v_prediction"), x0, rtol=1e-6)
    assert denoised_from_model_output(x, x0, sigma, "sample") == x0  # the output is x0 itself
    with pytest.raises(ValueError, match="sample_and_noise"):
        denoised_from_model_output(x, eps, sigma, "sample_and_noise")


@pytest.mark.parametrize("num_steps", [1, 7, 20])
@pytest.mark.parametrize(
    "name, values",
    [
        ("dpmpp_2m", SDXL_SCHEDULER_CONFIG),
        ("dpmpp_2m_karras", {**SD15_SCHEDULER_CONFIG, "prediction_type": "v_prediction"}),
        ("dpmpp_2m", {**SD15_SCHEDULER_CONFIG, "final_sigmas_type": "sigma_min"}),
    ],
    ids=["sdxl", "sd15 karras v", "sd15 sigma_min"],
)
def test_dpmpp_2m_matches_diffusers(name, values, num_steps):
    if name == "dpmpp_2m_karras":
        values = {**values, "use_karras_sigmas": True}
    check_against_diffusers(name, DPMSolverMultistepScheduler, values, num_steps)


@pytest.mark.parametrize("num_steps", [1, 7, 25])
@pytest.mark.parametrize(
    "values",
    [
        SDXL_SCHEDULER_CONFIG,
        {**SD15_SCHEDULER_CONFIG, "prediction_type": "v_prediction"},
        {**SD15_SCHEDULER_CONFIG, "timestep_spacing": "linspace", "set_alpha_to_one": True},
    ],
    ids=["sdxl", "sd15 v", "sd15 linspace"],
)
def test_ddim_matches_diffusers(values, num_steps):
    check_against_diffusers("ddim", DDIMScheduler, values, num_steps)


@pytest.mark.oracle
@pytest.mark.parametrize("num_steps", [1, 7, 25])
@pytest.mark.parametrize("values", [SDXL_SCHEDULER_CONFIG, SD15_SCHEDULER_CONFIG], ids=["sdxl", "sd15"])
def test_euler_ancestral_matches_diffusers(values, num_steps, monkeypatch):
    keys = jax.random.split(jax.random.key(0), SHAPE[0])
    step_noise = jax.jit(sampling.step_noise, static_argnums=2)
    steps_taken = 0

    def same_noise(shape, **kwargs):
        nonlocal steps_taken
        noise = np.array(step_noise(keys, steps_taken, tuple(shape[1:])))
        steps_taken += 1
        return torch.from_numpy(noise)

    monkeypatch.setattr(scheduling_euler_ancestral_discrete, "randn_tensor", same_noise)
    check_against_diffusers("euler_ancestral", EulerAncestralDiscreteScheduler, values, num_steps, keys)
    assert steps_taken == num_steps


def test_euler_ancestral_noise_depends_only_on_the_image_key():
    keys = jax.random.split(jax.random.key(0), 2)
    noise = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    pair = run("euler_ancestral", SDXL_SCHEDULER_CONFIG, 7, noise, keys)
    alone = run("euler_ancestral", SDXL_SCHEDULER_CONFIG, 7, noise[1:], keys[1:])
    swapped = run("euler_ancestral", SDXL_SCHEDULER_CONFIG, 7, noise[1:], keys[:1])
    np.testing.assert_allclose(alone[0], pair[1], atol=1e-6)
    assert np.abs(swapped[0] - pair[1]).max() > 0.1
