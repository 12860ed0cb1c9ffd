"""Samplers: small pure functions that run a denoiser over a padded schedule.

The contract is k-diffusion's: `denoiser(x, sigma, timestep) -> denoised`, the float32 prediction of
the clean latents from x = x0 + sigma * noise. Classifier-free guidance and the model's eps/v
parametrisation live in the caller that builds the denoiser (see `denoised_from_model_output`), so
the samplers know nothing of them.

Every sampler loops `lax.fori_loop(0, num_steps, ...)` with a traced `num_steps`, so one compiled
program serves every step count up to the schedule's padded length. Each reproduces one diffusers
scheduler's `step`: it starts from standard normal noise times `schedule.init_noise_sigma` and
returns what diffusers hands to the VAE. All arithmetic is float32.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .schedulers import (
    DDIMSchedule,
    Schedule,
    SchedulerConfig,
    ddim_schedule,
    dpmpp_2m_karras_schedule,
    dpmpp_2m_schedule,
    euler_ancestral_schedule,
    euler_schedule,
)

Denoiser = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
# Called inside the loop with each step's index, e.g. to report progress with jax.debug.callback.
StepCallback = Callable[[jax.Array], None] | None


def _loop(num_steps: jax.Array, step, init, callback: StepCallback):
    """`lax.fori_loop` over the steps, calling `callback(i)` in step i when one is given."""

    def body(i, carry):
        if callback is not None:
            callback(i)
        return step(i, carry)

    return jax.lax.fori_loop(0, num_steps, body, init)


def denoised_from_model_output(
    x: jax.Array, model_output: jax.Array, sigma: jax.Array, prediction_type: str
) -> jax.Array:
    """The clean-latent prediction implied by a diffusers UNet's output, as EulerDiscreteScheduler.step.

    The UNet is trained on variance-preserving samples: its input is c_in * x with
    c_in = 1 / sqrt(sigma^2 + 1), and its output is read back here.

    Args:
      x: [B, ...] the noisy latents at noise level sigma (diffusers' Euler `sample`, not scaled by c_in).
      model_output: [B, ...] the UNet's output for c_in * x.
      sigma: scalar noise level.
      prediction_type: "epsilon" (the output is the noise) or "v_prediction" (the output is
        v = alpha * noise - sigma_vp * x0 in variance-preserving terms).

    Returns:
      [B, ...] float32 denoised latents.
    """
    model_output = model_output.astype(jnp.float32)
    if prediction_type == "epsilon":
        return x - sigma * model_output
    if prediction_type == "v_prediction":
        # c_out * v + c_skip * x, with c_out = -sigma / sqrt(sigma^2 + 1), c_skip = 1 / (sigma^2 + 1).
        return model_output * (-sigma / jnp.sqrt(sigma**2 + 1)) + x / (sigma**2 + 1)
    raise ValueError(f"prediction_type {prediction_type!r} is not supported")


def step_noise(keys: jax.Array, step: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """[B, *shape] standard normal noise for one step, image b's drawn from keys[b] and the step alone."""
    return jax.vmap(lambda key: jax.random.normal(jax.random.fold_in(key, step), shape, jnp.float32))(keys)


def _euler_step(x: jax.Array, denoised: jax.Array, sigma: jax.Array, sigma_next: jax.Array) -> jax.Array:
    """One Euler step of the probability flow ODE dx/dsigma = (x - denoised) / sigma."""
    return x + (x - denoised) / sigma * (sigma_next - sigma)


def sample_euler(
    denoiser: Denoiser, x: jax.Array, schedule: Schedule, num_steps: jax.Array, *, callback: StepCallback = None
) -> jax.Array:
    """Euler's method: Karras et al. 2022 Algorithm 2 with Euler steps only and S_churn = 0.

    Args:
      denoiser: `denoiser(x, sigma, timestep) -> denoised`.
      x: [B, ...] initial noise times schedule.init_noise_sigma.
      schedule: from `euler_schedule`.
      num_steps: scalar int, possibly traced, at most the schedule's padded length.
      callback: called with each step's index from inside the loop (progress reporting).

    Returns:
      [B, ...] float32 latents at the final sigma.
    """

    def step(i, x):
        sigma = schedule.sigmas[i]
        denoised = denoiser(x, sigma, schedule.timesteps[i])
        return _euler_step(x, denoised, sigma, schedule.sigmas[i + 1])

    return _loop(num_steps, step, x.astype(jnp.float32), callback)


def sample_euler_ancestral(
    denoiser: Denoiser,
    x: jax.Array,
    schedule: Schedule,
    num_steps: jax.Array,
    keys: jax.Array,
    *,
    callback: StepCallback = None,
) -> jax.Array:
    """Euler ancestral sampling (k-diffusion's sample_euler_ancestral, eta = 1), as EulerAncestralDiscreteScheduler.

    Each step takes an Euler step down to sigma_down, then adds fresh noise of scale sigma_up, where
    sigma_down^2 + sigma_up^2 = sigma_next^2 and the whole step is a DDPM ancestral step.

    Args:
      denoiser: `denoiser(x, sigma, timestep) -> denoised`.
      x: [B, ...] initial noise times schedule.init_noise_sigma.
      schedule: from `euler_ancestral_schedule`.
      num_steps: scalar int, possibly traced.
      callback: called with each step's index from inside the loop (progress reporting).
      keys: [B] PRNG keys; step i adds `step_noise(keys, i, x.shape[1:])`, so each image depends only on
        its own key.

    Returns:
      [B, ...] float32 latents at sigma 0.
    """

    def step(i, x):
        sigma, sigma_next = schedule.sigmas[i], schedule.sigmas[i + 1]
        denoised = denoiser(x, sigma, schedule.timesteps[i])
        sigma_up = jnp.sqrt(sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2)
        sigma_down = jnp.sqrt(sigma_next**2 - sigma_up**2)
        x = _euler_step(x, denoised, sigma, sigma_down)
        return x + step_noise(keys, i, x.shape[1:]) * sigma_up

    return _loop(num_steps, step, x.astype(jnp.float32), callback)


def _vp_scale(sigma: jax.Array) -> jax.Array:
    """alpha = 1 / sqrt(sigma^2 + 1): the variance-preserving sample is alpha * x."""
    return jax.lax.rsqrt(sigma**2 + 1)


def sample_dpmpp_2m(
    denoiser: Denoiser, x: jax.Array, schedule: Schedule, num_steps: jax.Array, *, callback: StepCallback = None
) -> jax.Array:
    """DPM-Solver++(2M), Lu et al. 2022 Algorithm 2, as DPMSolverMultistepScheduler with its defaults.

    That is algorithm_type "dpmsolver++", solver_order 2, solver_type "midpoint", and
    lower_order_final: the first step, and the last one when there are fewer than 15 steps or it ends
    at sigma 0, are first order (DDIM) steps.

    Args:
      denoiser: `denoiser(x, sigma, timestep) -> denoised`.
      x: [B, ...] initial noise; diffusers' sample here is variance preserving (init_noise_sigma 1).
      schedule: from `dpmpp_2m_schedule`.
      num_steps: scalar int, possibly traced.
      callback: called with each step's index from inside the loop (progress reporting).

    Returns:
      [B, ...] float32 variance-preserving latents at the final sigma.
    """
    sigmas = schedule.sigmas
    last_first_order = (num_steps < 15) | (sigmas[num_steps] == 0)

    def log_snr(sigma):  # lambda = log(alpha / sigma_vp) = -log(sigma)
        return -jnp.log(sigma)

    def step(i, carry):
        x, denoised_prev = carry
        sigma_prev, sigma, sigma_next = sigmas[jnp.maximum(i - 1, 0)], sigmas[i], sigmas[i + 1]
        alpha, alpha_next = _vp_scale(sigma), _vp_scale(sigma_next)
        denoised = denoiser(x / alpha, sigma, schedule.timesteps[i])
        h = log_snr(sigma_next) - log_snr(sigma)
        first_order = (i == 0) | ((i == num_steps - 1) & last_first_order)
        # Second order: extrapolate the denoised prediction linearly in lambda to the step's midpoint.
        r = (log_snr(sigma) - log_snr(sigma_prev)) / h
        extrapolation = jnp.where(first_order, 0.0, 0.5 / r)
        denoised_mid = denoised + extrapolation * (denoised - denoised_prev)
        # sigma_vp_next / sigma_vp = exp(-h) * alpha_next / alpha.
        x = (sigma_next * alpha_next) / (sigma * alpha) * x - alpha_next * jnp.expm1(-h) * denoised_mid
        return x, denoised

    x = x.astype(jnp.float32)
    x, _ = _loop(num_steps, step, (x, jnp.zeros_like(x)), callback)
    return x


def sample_ddim(
    denoiser: Denoiser, x: jax.Array, schedule: DDIMSchedule, num_steps: jax.Array, *, callback: StepCallback = None
) -> jax.Array:
    """DDIM with eta = 0, Song et al. 2021 eq. 12, as DDIMScheduler.

    In terms of x = x_vp / alpha it is Euler's method (Karras et al. 2022, sec. 4), stepping to
    `schedule.target_sigmas[i]`.

    Args:
      denoiser: `denoiser(x, sigma, timestep) -> denoised`.
      x: [B, ...] initial noise; diffusers' sample here is variance preserving (init_noise_sigma 1).
      schedule: from `ddim_schedule`.
      num_steps: scalar int, possibly traced.
      callback: called with each step's index from inside the loop (progress reporting).

    Returns:
      [B, ...] float32 variance-preserving latents at the final sigma.
    """

    def step(i, x_vp):
        sigma, sigma_next = schedule.sigmas[i], schedule.target_sigmas[i]
        x = x_vp / _vp_scale(sigma)
        denoised = denoiser(x, sigma, schedule.timesteps[i])
        return _euler_step(x, denoised, sigma, sigma_next) * _vp_scale(sigma_next)

    return _loop(num_steps, step, x.astype(jnp.float32), callback)


class Sampler(NamedTuple):
    """A sampler and the schedule it runs on."""

    schedule: Callable[[SchedulerConfig, int, int], Schedule]
    sample: Callable[..., jax.Array]
    # Whether `sample` injects noise and so takes a last argument `keys`: [B] per-image PRNG keys.
    stochastic: bool


SAMPLERS = {
    "euler": Sampler(euler_schedule, sample_euler, stochastic=False),
    "euler_ancestral": Sampler(euler_ancestral_schedule, sample_euler_ancestral, stochastic=True),
    "dpmpp_2m": Sampler(dpmpp_2m_schedule, sample_dpmpp_2m, stochastic=False),
    "dpmpp_2m_karras": Sampler(dpmpp_2m_karras_schedule, sample_dpmpp_2m, stochastic=False),
    "ddim": Sampler(ddim_schedule, sample_ddim, stochastic=False),
}
