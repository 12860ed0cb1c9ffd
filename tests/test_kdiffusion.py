"""A1111's k-diffusion samplers against k-diffusion's own functions as webui runs them (kdiffusion_reference),
on a toy model written in both torch and JAX, from the same starting noise and the same later draws."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from kdiffusion_reference import SAMPLERS, SCHEDULERS, CompVisModel, get_sigmas, model_wrap, sample, toy_model
from test_schedulers import SDXL_SCHEDULER_CONFIG

from sdxl.config import config_from_dict
from sdxl.sampling import kdiffusion
from sdxl.sampling.samplers import denoised_from_model_output, run_steps
from sdxl.sampling.schedulers import SchedulerConfig

SDXL = config_from_dict(SchedulerConfig, SDXL_SCHEDULER_CONFIG)
WRAP = model_wrap(CompVisModel(None))
SHAPE = (2, 4, 4, 4)  # [B, H, W, C]
MAX_STEPS = 48

# Each sampler on its Automatic schedule and two others, one of them KL Optimal (which ends at
# sigma_min, not 0) where the last step matters; DDIM's runs 31 steps for 30.
CASES = [
    ("Euler", "Automatic", 10), ("Euler", "Karras", 10), ("Euler", "KL Optimal", 10),
    ("Euler a", "Automatic", 10), ("Euler a", "Exponential", 10), ("Euler a", "KL Optimal", 10),
    ("DPM++ 2M", "Automatic", 12), ("DPM++ 2M", "Uniform", 12), ("DPM++ 2M", "DDIM", 30),
    ("DPM++ 2M SDE", "Automatic", 12), ("DPM++ 2M SDE", "Karras", 12), ("DPM++ 2M SDE", "Beta", 12),
    ("DPM++ 2M SDE Heun", "Automatic", 12), ("DPM++ 2M SDE Heun", "Karras", 12),
    ("DPM++ SDE", "Automatic", 8), ("DPM++ SDE", "Normal", 8), ("DPM++ SDE", "KL Optimal", 8),
    ("Heun", "Automatic", 8), ("Heun", "Karras", 8), ("Heun", "KL Optimal", 8),
    ("DPM2", "Automatic", 8), ("DPM2", "SGM Uniform", 8), ("DPM2", "KL Optimal", 8),
    ("DPM2 a", "Automatic", 8), ("DPM2 a", "Align Your Steps", 8), ("DPM2 a", "KL Optimal", 8),
    ("LMS", "Automatic", 12), ("LMS", "Karras", 12), ("LMS", "Simple", 12),
    ("DPM++ 2S a", "Automatic", 8), ("DPM++ 2S a", "Exponential", 8), ("DPM++ 2S a", "KL Optimal", 8),
    ("DPM++ 3M SDE", "Automatic", 12), ("DPM++ 3M SDE", "Karras", 12), ("DPM++ 3M SDE", "Polyexponential", 12),
    ("Restart", "Automatic", 12), ("Restart", "Automatic", 24), ("Restart", "Automatic", 40),
    ("Restart", "Exponential", 24), ("Restart", "KL Optimal", 24),
]


def denoiser(prediction_type: str):
    """The toy model wrapped as the pipeline wraps the UNet: input x / sqrt(sigma^2 + 1), output parametrised."""

    def denoise(x, sigma, timestep, step):
        model_output = toy_model(x / jnp.sqrt(sigma**2 + 1), timestep, jnp)
        return denoised_from_model_output(x, model_output, sigma, prediction_type)

    return denoise


@functools.cache
def compiled(name: str, prediction_type: str = "epsilon"):
    """One program per sampler: the whole loop, its schedule and step count traced."""
    sampler = kdiffusion.sampler(name)

    def run(x, schedule, num_steps, noise, first_step=0):
        start, stop = sampler.evaluations(first_step), sampler.evaluations(num_steps)
        carry = run_steps(sampler, denoiser(prediction_type), sampler.init(x), schedule, num_steps, start, stop, noise)
        return sampler.finish(carry)

    return jax.jit(run)


def inputs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The starting noise [B, ...] and the later draws [B, S, ...], enough for any sampler here."""
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal(SHAPE, dtype=np.float32)
    return noise, rng.standard_normal((SHAPE[0], 2 * MAX_STEPS + 2, *SHAPE[1:]), dtype=np.float32)


def ours(name, schedule_type, steps, noise, draws, prediction_type="epsilon", max_steps=MAX_STEPS):
    schedule = kdiffusion.kdiffusion_schedule(SDXL, schedule_type, name, steps, max_steps)
    num_steps = kdiffusion.schedule_steps(SDXL, schedule_type, name, steps)
    x = jnp.asarray(noise) * schedule.init_noise_sigma
    return np.asarray(compiled(name, prediction_type)(x, schedule, num_steps, jnp.asarray(draws)))


class Counting:
    """The toy UNet, counting its evaluations."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, t):
        self.calls += 1
        return toy_model(x, t, torch)


def reference(name, schedule_type, steps, noise, draws, prediction_type="epsilon"):
    """(k-diffusion's result as A1111 runs it, the model evaluations it made, the sigmas A1111 gave it)."""
    model = Counting()
    wrap = model_wrap(CompVisModel(model), prediction_type)
    sigmas = get_sigmas(wrap, name, schedule_type, steps)
    later = [torch.from_numpy(draws[:, k]) for k in range(draws.shape[1])]
    return sample(name, wrap, torch.from_numpy(noise) * sigmas[0], sigmas, later).numpy(), model.calls, sigmas


@pytest.mark.parametrize(("name", "schedule_type", "steps"), CASES)
def test_samplers_are_k_diffusions(name, schedule_type, steps):
    noise, draws = inputs(steps)
    expected, calls, sigmas = reference(name, schedule_type, steps, noise, draws)
    np.testing.assert_allclose(ours(name, schedule_type, steps, noise, draws), expected, rtol=1e-5, atol=1e-5)
    # The loop's iterations: k-diffusion's evaluations, and one unused one for a second-order step to 0.
    num_steps = len(sigmas) - 1
    second_order = kdiffusion.SAMPLERS[name].evaluations(1) == 2
    ends_at_zero = kdiffusion.kdiffusion_schedule(SDXL, schedule_type, name, steps, MAX_STEPS).sigmas[num_steps] == 0
    assert kdiffusion.SAMPLERS[name].evaluations(num_steps) == calls + (second_order and ends_at_zero)


@pytest.mark.parametrize("name", ["Euler a", "DPM++ 2M SDE"])
def test_v_prediction(name):
    noise, draws = inputs(3)
    expected, _, _ = reference(name, "Automatic", 9, noise, draws, "v_prediction")
    np.testing.assert_allclose(ours(name, "Automatic", 9, noise, draws, "v_prediction"), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "steps", "first_step"), [
    ("Euler a", 10, 4), ("DPM++ 2M", 12, 5), ("LMS", 12, 3), ("DPM++ 3M SDE", 12, 4), ("DPM2 a", 8, 3),
    ("DPM++ SDE", 8, 3),
])
def test_image_to_image_starts_part_way(name, steps, first_step):
    """A1111's sample_img2img: the sampler run afresh (no earlier predictions) on the schedule's last
    sigmas, from an image's latents noised to the first of them; its draws are ours from `first_step`'s on."""
    image, noise = inputs(first_step)[0], inputs(steps)[0]
    draws = inputs(steps)[1]
    wrap = model_wrap(CompVisModel(lambda x, t: toy_model(x, t, torch)))
    sigmas = get_sigmas(wrap, name, "Automatic", steps)[first_step:]
    x = torch.from_numpy(image) + torch.from_numpy(noise) * sigmas[0]
    later = [torch.from_numpy(draws[:, k]) for k in range(draws.shape[1])]
    expected = sample(name, wrap, x, sigmas, later).numpy()
    draws_of = kdiffusion.SAMPLERS[name].draws
    before = draws_of(first_step) if draws_of else 0
    ours_draws = np.concatenate([np.zeros_like(draws[:, :before]), draws], axis=1)
    schedule = kdiffusion.kdiffusion_schedule(SDXL, "Automatic", name, steps, MAX_STEPS)
    start = jnp.asarray(image) + jnp.asarray(noise) * schedule.sigmas[first_step]
    ran = compiled(name)(start, schedule, steps, jnp.asarray(ours_draws), first_step)
    np.testing.assert_allclose(np.asarray(ran), expected, rtol=1e-5, atol=1e-5)


def test_one_program_serves_every_step_count():
    """The cases above run through one program per sampler, padded to MAX_STEPS; here a padded run
    against the run of a program made for its step count alone."""
    noise, draws = inputs(5)
    for steps in (3, 21):
        alone = ours("DPM++ SDE", "Automatic", steps, noise, draws, max_steps=steps)
        np.testing.assert_allclose(ours("DPM++ SDE", "Automatic", steps, noise, draws), alone, rtol=1e-6, atol=1e-6)


# KL Optimal's first sigma is tan(atan(sigma_max)), near pi/2 where tan turns one float32 ulp of its argument into
# about 22 of its result: torch's CPU kernels round it 1.8e-6 apart on some hosts (its scalar or vector lanes).
KL_OPTIMAL_RTOL = 4e-6


@pytest.mark.parametrize("name", ["Euler", "DPM++ 2M", "DPM2", "DPM++ 3M SDE"])  # Uniform, Karras, discarding ones
def test_sigmas_are_a1111s(name):
    """Automatic as each sampler's default, and the next to last sigma discarded where A1111 does."""
    for schedule_type in ("Automatic", "Exponential", "KL Optimal", "DDIM"):
        for steps in (1, 4, 30):
            expected = get_sigmas(WRAP, name, schedule_type, steps).numpy()
            np.testing.assert_allclose(kdiffusion.kdiffusion_sigmas(SDXL, schedule_type, name, steps), expected,
                                       rtol=KL_OPTIMAL_RTOL if schedule_type == "KL Optimal" else 1e-6,
                                       err_msg=f"{schedule_type}, {steps} steps")
            assert kdiffusion.schedule_steps(SDXL, schedule_type, name, steps) == len(expected) - 1


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="schedule type 'karras'"):
        kdiffusion.kdiffusion_sigmas(SDXL, "karras", "Euler", 10)
    with pytest.raises(ValueError, match="sampler 'DPM\\+\\+ 2M Karras'"):
        kdiffusion.sampler("DPM++ 2M Karras")


def test_schedules_know_the_steps_they_run():
    with pytest.raises(ValueError, match="runs 31 steps, more than max_steps=30"):
        kdiffusion.kdiffusion_schedule(SDXL, "DDIM", "Euler", 30, 30)
    schedule = kdiffusion.kdiffusion_schedule(SDXL, "Karras", "DPM2", 10, MAX_STEPS)
    sigmas = kdiffusion.kdiffusion_sigmas(SDXL, "Karras", "DPM2", 10)
    assert len(sigmas) == 11 and np.all(schedule.sigmas[10:] == 0) and schedule.init_noise_sigma == sigmas[0]


def test_the_table_is_a1111s():
    """Each sampler's function, default schedule, discarded sigma, order and noise, as A1111's table says."""
    assert list(kdiffusion.SAMPLERS) == list(SAMPLERS)
    for name, (function, options) in SAMPLERS.items():
        ours = kdiffusion.SAMPLERS[name]
        assert ours.function == (function if isinstance(function, str) else function.__name__)
        assert ours.default_schedule == SCHEDULERS[options.get("scheduler", "uniform")][0]
        assert ours.discard_next_to_last_sigma == options.get("discard_next_to_last_sigma", False)
        assert (ours.evaluations(1) == 2) == options.get("second_order", False), name
        assert ours.brownian == options.get("brownian_noise", False)
        noisy = options.get("uses_ensd", False) or ours.brownian or name == "Restart"
        assert (ours.draws is not None) == noisy, name
