"""Samplers: small pure functions that run a denoiser over a padded schedule.

The contract is k-diffusion's: `denoiser(x, sigma, timestep) -> denoised`, the float32 prediction of
the clean latents from x = x0 + sigma * noise. Classifier-free guidance and the model's eps/v
parametrisation live in the caller that builds the denoiser (see `denoised_from_model_output`), so
the samplers know nothing of them. `run_steps` takes the denoiser with one more argument, `step`,
the loop's iteration (one model evaluation each), for conditioning that changes along the run (a
ControlNet's start and end), and hands the samplers the denoiser of each iteration.

A sampler is its loop's pieces: `init` turns the starting latents into the loop state, `step(i)`
advances it by one step, `finish` reads the latents out (and `with_latents` puts them back).
`run_steps` runs steps start..stop-1 of the loop (a `lax.fori_loop` whose bounds and `num_steps`
may be traced, so one compiled program serves every step count up to the schedule's padded
length): all of it, or a stretch at a time, so a caller can report progress between stretches
without host callbacks inside the loop, or start part-way for image-to-image.

Each sampler reproduces one diffusers scheduler's `step`: from text it starts from standard normal
noise times `schedule.init_noise_sigma`, from an image at `add_noise`'s level, and finishes with
what diffusers hands to the VAE. All arithmetic is float32.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .schedulers import (
    DDIMSchedule, LCMSchedule, PNDMSchedule, Schedule, SchedulerConfig, TCDSchedule, ddim_schedule,
    dpmpp_2m_karras_schedule, dpmpp_2m_schedule, euler_ancestral_schedule, euler_schedule, lcm_schedule, pndm_schedule,
    tcd_schedule,
)

Denoiser = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
# denoiser(x, sigma, timestep, step): what `run_steps` takes (see the module's docstring).
SteppedDenoiser = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
Carry = Any  # a sampler's loop state: the latents, plus whatever else it keeps between steps


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
      prediction_type: "epsilon" (the output is the noise), "v_prediction" (the output is
        v = alpha * noise - sigma_vp * x0 in variance-preserving terms) or "sample" (the output is x0
        itself, as SDXL-Lightning's 1-step UNet predicts).

    Returns:
      [B, ...] float32 denoised latents.
    """
    model_output = model_output.astype(jnp.float32)
    if prediction_type == "epsilon":
        return x - sigma * model_output
    if prediction_type == "v_prediction":
        # c_out * v + c_skip * x, with c_out = -sigma / sqrt(sigma^2 + 1), c_skip = 1 / (sigma^2 + 1).
        return model_output * (-sigma / jnp.sqrt(sigma**2 + 1)) + x / (sigma**2 + 1)
    if prediction_type == "sample":
        return model_output
    raise ValueError(f"prediction_type {prediction_type!r} is not supported")


def step_noise(noise: jax.Array, draw: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """[B, *shape] standard normal noise, a stochastic sampler's draw `draw` (for diffusers' samplers,
    the step's), from what it is given: [B] PRNG keys, image b's noise drawn from keys[b] and the draw
    alone; or [B, draws, *shape] noise drawn on the host (`sdxl.sampling.noise`), draw k at [:, k]."""
    if jax.dtypes.issubdtype(noise.dtype, jax.dtypes.prng_key):
        return jax.vmap(lambda key: jax.random.normal(jax.random.fold_in(key, draw), shape, jnp.float32))(noise)
    return jax.lax.dynamic_index_in_dim(noise, draw, axis=1, keepdims=False).astype(jnp.float32)


def _euler_step(x: jax.Array, denoised: jax.Array, sigma: jax.Array, sigma_next: jax.Array) -> jax.Array:
    """One Euler step of the probability flow ODE dx/dsigma = (x - denoised) / sigma."""
    return x + (x - denoised) / sigma * (sigma_next - sigma)


def _vp_scale(sigma: jax.Array) -> jax.Array:
    """alpha = 1 / sqrt(sigma^2 + 1): the variance-preserving sample is alpha * x."""
    return jax.lax.rsqrt(sigma**2 + 1)


def euler_step(denoiser: Denoiser, schedule: Schedule, num_steps, i, x: jax.Array, noise) -> jax.Array:
    """Euler's method: Karras et al. 2022 Algorithm 2 with Euler steps only and S_churn = 0.

    The state is the latents x at schedule.sigmas[i]; they start as noise * init_noise_sigma.
    """
    sigma = schedule.sigmas[i]
    denoised = denoiser(x, sigma, schedule.timesteps[i])
    return _euler_step(x, denoised, sigma, schedule.sigmas[i + 1])


def euler_ancestral_step(denoiser: Denoiser, schedule: Schedule, num_steps, i, x: jax.Array, noise) -> jax.Array:
    """Euler ancestral sampling (k-diffusion's sample_euler_ancestral, eta = 1), as EulerAncestralDiscreteScheduler.

    An Euler step down to sigma_down, then fresh noise of scale sigma_up, where
    sigma_down^2 + sigma_up^2 = sigma_next^2: together a DDPM ancestral step. The noise of step i is
    `step_noise(noise, i, ...)`, so each image depends only on its own key, or its own drawn noise.
    """
    sigma, sigma_next = schedule.sigmas[i], schedule.sigmas[i + 1]
    denoised = denoiser(x, sigma, schedule.timesteps[i])
    sigma_up = jnp.sqrt(sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2)
    sigma_down = jnp.sqrt(sigma_next**2 - sigma_up**2)
    x = _euler_step(x, denoised, sigma, sigma_down)
    return x + step_noise(noise, i, x.shape[1:]) * sigma_up


def dpmpp_2m_step(denoiser: Denoiser, schedule: Schedule, num_steps, i, carry: Carry, noise) -> Carry:
    """DPM-Solver++(2M), Lu et al. 2022 Algorithm 2, as DPMSolverMultistepScheduler with its defaults.

    That is algorithm_type "dpmsolver++", solver_order 2, solver_type "midpoint", and
    lower_order_final: the first step that runs (diffusers counts from it, also when image-to-image
    starts part-way), and the last one when there are fewer than 15 steps or it ends at sigma 0, are
    first order (DDIM) steps. The state is (variance-preserving latents, the previous step's denoised
    prediction, [B] whether there is one); diffusers' sample here is variance preserving
    (init_noise_sigma 1).
    """
    x, denoised_prev, has_previous = carry
    sigmas = schedule.sigmas
    last_first_order = (num_steps < 15) | (sigmas[num_steps] == 0)
    sigma_prev, sigma, sigma_next = sigmas[jnp.maximum(i - 1, 0)], sigmas[i], sigmas[i + 1]
    alpha, alpha_next = _vp_scale(sigma), _vp_scale(sigma_next)
    denoised = denoiser(x / alpha, sigma, schedule.timesteps[i])
    h = jnp.log(sigma) - jnp.log(sigma_next)  # the step in log-SNR, lambda = -log(sigma)
    first_order = ~has_previous[:, None, None, None] | ((i == num_steps - 1) & last_first_order)
    # Second order: extrapolate the denoised prediction linearly in lambda to the step's midpoint.
    r = (jnp.log(sigma_prev) - jnp.log(sigma)) / h
    extrapolation = jnp.where(first_order, 0.0, 0.5 / r)
    denoised_mid = denoised + extrapolation * (denoised - denoised_prev)
    # sigma_vp_next / sigma_vp = exp(-h) * alpha_next / alpha.
    x = (sigma_next * alpha_next) / (sigma * alpha) * x - alpha_next * jnp.expm1(-h) * denoised_mid
    return x, denoised, jnp.ones_like(has_previous)


def ddim_step(denoiser: Denoiser, schedule: DDIMSchedule, num_steps, i, x_vp: jax.Array, noise) -> jax.Array:
    """DDIM with eta = 0, Song et al. 2021 eq. 12, as DDIMScheduler.

    In terms of x = x_vp / alpha it is Euler's method (Karras et al. 2022, sec. 4), stepping to
    `schedule.target_sigmas[i]`. The state is diffusers' variance-preserving sample
    (init_noise_sigma 1).
    """
    sigma, sigma_next = schedule.sigmas[i], schedule.target_sigmas[i]
    x = x_vp / _vp_scale(sigma)
    denoised = denoiser(x, sigma, schedule.timesteps[i])
    return _euler_step(x, denoised, sigma, sigma_next) * _vp_scale(sigma_next)


def pndm_step(denoiser: Denoiser, schedule: PNDMSchedule, num_steps, i, carry: Carry, noise) -> Carry:
    """PLMS (Liu et al. 2022, "Pseudo Numerical Methods for Diffusion Models", eq. 9 with the linear
    multistep noise estimate), as PNDMScheduler with skip_prk_steps: a trapezoidal start, then
    Adams-Bashforth of growing order over the kept noise predictions.

    The state is (diffusers' variance-preserving sample, [B, 3, ...] the last three kept noise
    predictions, the first evaluation's sample, which the second re-steps from).
    """
    x_vp, history, first_sample = carry
    sigma = schedule.sigmas[i]
    x = x_vp / _vp_scale(sigma)
    eps = (x - denoiser(x, sigma, schedule.timesteps[i])) / sigma
    weights = schedule.eps_weights[i]
    eps_used = weights[0] * eps + jnp.einsum("k,bk...->b...", weights[1:], history)
    restart = schedule.restart[i] > 0
    sample = jnp.where(restart, first_sample, x_vp)
    x_next = schedule.sample_coeffs[i] * sample - schedule.eps_coeffs[i] * eps_used
    kept = jnp.where(schedule.keep[i] > 0, jnp.concatenate([eps[:, None], history[:, :2]], axis=1), history)
    return x_next, kept, jnp.where(i == 0, x_vp, first_sample)


def lcm_step(denoiser: Denoiser, schedule: LCMSchedule, num_steps, i, x_vp: jax.Array, noise) -> jax.Array:
    """Multistep latent consistency sampling (Luo et al. 2023, Algorithm 1), as LCMScheduler.

    Each step maps the sample to the consistency function's clean estimate (the model's clean
    prediction, blended with the sample by the boundary condition's c_out and c_skip), then, but for
    the last step, noises it afresh to the next timestep's level with `step_noise(noise, i, ...)`.
    The state is diffusers' variance-preserving sample (init_noise_sigma 1).
    """
    sigma, sigma_next = schedule.sigmas[i], schedule.sigmas[i + 1]
    clean = denoiser(x_vp / _vp_scale(sigma), sigma, schedule.timesteps[i])
    denoised = schedule.c_out[i] * clean + schedule.c_skip[i] * x_vp
    alpha_next = _vp_scale(sigma_next)
    renoised = alpha_next * denoised + sigma_next * alpha_next * step_noise(noise, i, x_vp.shape[1:])
    return jnp.where(i == num_steps - 1, denoised, renoised)


def tcd_step(denoiser: Denoiser, schedule: TCDSchedule, num_steps, i, x_vp: jax.Array, noise) -> jax.Array:
    """Trajectory consistency distillation's strategic stochastic sampling (Zheng et al. 2024), as
    TCDScheduler with gamma `schedules.TCD_GAMMA`.

    A DDIM jump from the sample's level to the lower level `gamma_sigmas[i]`, then, but for the last
    step, fresh noise (`step_noise(noise, i, ...)`) up to the next step's level. The state is
    diffusers' variance-preserving sample (init_noise_sigma 1).
    """
    sigma, sigma_s, sigma_next = schedule.sigmas[i], schedule.gamma_sigmas[i], schedule.sigmas[i + 1]
    x = x_vp / _vp_scale(sigma)
    clean = denoiser(x, sigma, schedule.timesteps[i])
    jumped = _euler_step(x, clean, sigma, sigma_s) * _vp_scale(sigma_s)  # DDIM's step to sigma_s (`ddim_step`)
    # (alpha_next / alpha_s) * jumped + sqrt(1 - alpha_next^2 / alpha_s^2) * noise
    ratio = _vp_scale(sigma_next) / _vp_scale(sigma_s)
    renoised = ratio * jumped + jnp.sqrt(jnp.maximum(1 - ratio**2, 0)) * step_noise(noise, i, x_vp.shape[1:])
    return jnp.where(i == num_steps - 1, jumped, renoised)


def _pndm_init(x: jax.Array) -> Carry:
    x = x.astype(jnp.float32)
    return x, jnp.zeros((x.shape[0], 3, *x.shape[1:]), jnp.float32), x  # batch first, as the mesh splits it


def _dpmpp_2m_init(x: jax.Array) -> Carry:
    return x.astype(jnp.float32), jnp.zeros(x.shape, jnp.float32), jnp.zeros(x.shape[0], bool)


def _first(carry: Carry) -> jax.Array:
    return carry[0]


def _with_first(carry: Carry, x: jax.Array) -> Carry:
    return (x, *carry[1:])


class Sampler(NamedTuple):
    """A sampler as the pieces of its loop, and the schedule it runs on."""

    schedule: Callable[[SchedulerConfig, int, int], Schedule]
    # step(denoiser, schedule, num_steps, i, carry, noise) -> carry
    step: Callable[..., Carry]
    # For a sampler whose `step` adds noise, the noise draws of a `num_steps`-step run: it reads them
    # from `noise`, [B] per-image PRNG keys or [B, draws, ...] drawn noise (`step_noise`); None: it adds none.
    draws: Callable[[int], int] | None = None
    # Whether its latents are diffusers' variance-preserving sample x / sqrt(sigma^2 + 1), not x.
    variance_preserving: bool = False
    init: Callable[[jax.Array], Carry] = lambda x: x.astype(jnp.float32)
    finish: Callable[[Carry], jax.Array] = lambda carry: carry
    with_latents: Callable[[Carry, jax.Array], Carry] = lambda carry, x: x
    # The model evaluations, so loop iterations, of a `num_steps`-step run (an int or a traced one).
    evaluations: Callable = lambda num_steps: num_steps

    @property
    def stochastic(self) -> bool:
        return self.draws is not None


def _one_per_step(num_steps: int) -> int:
    return num_steps


def add_noise(sampler: Sampler, latents: jax.Array, noise: jax.Array, sigma: jax.Array) -> jax.Array:
    """Clean latents noised to level sigma, as the sampler's state holds them: diffusers'
    `scheduler.add_noise` (x0 + sigma * noise, variance-preserving where the sampler's state is)."""
    x = latents + sigma * noise
    return x * _vp_scale(sigma) if sampler.variance_preserving else x


def run_steps(
    sampler: Sampler, denoiser: SteppedDenoiser, carry: Carry, schedule: Schedule, num_steps, start, stop,
    noise=None, *, denoised: jax.Array | None = None,
) -> Carry:
    """Runs steps start..stop-1 (each possibly traced) of a `num_steps`-step loop.

    Given `denoised` (an array like the latents, returned as it is if no step runs), returns
    (carry, the last step's denoised prediction), for previews.
    """
    if denoised is None:
        return jax.lax.fori_loop(
            start, stop,
            lambda i, c: sampler.step(functools.partial(denoiser, step=i), schedule, num_steps, i, c, noise), carry,
        )

    def step(i, state):
        seen = []  # what the step's denoiser returned, within this trace of the loop's body

        def recording(x, sigma, timestep):
            seen.append(denoiser(x, sigma, timestep, step=i))
            return seen[-1]

        carry = sampler.step(recording, schedule, num_steps, i, state[0], noise)
        return carry, seen[-1]

    return jax.lax.fori_loop(start, stop, step, (carry, denoised))


SAMPLERS = {
    "euler": Sampler(euler_schedule, euler_step),
    "euler_ancestral": Sampler(euler_ancestral_schedule, euler_ancestral_step, draws=_one_per_step),
    "dpmpp_2m": Sampler(
        dpmpp_2m_schedule, dpmpp_2m_step, variance_preserving=True, init=_dpmpp_2m_init, finish=_first,
        with_latents=_with_first,
    ),
    "dpmpp_2m_karras": Sampler(
        dpmpp_2m_karras_schedule, dpmpp_2m_step, variance_preserving=True, init=_dpmpp_2m_init, finish=_first,
        with_latents=_with_first,
    ),
    "ddim": Sampler(ddim_schedule, ddim_step, variance_preserving=True),
    "pndm": Sampler(
        pndm_schedule, pndm_step, variance_preserving=True, init=_pndm_init, finish=_first, with_latents=_with_first,
        evaluations=lambda num_steps: num_steps + (num_steps > 1),  # the second step evaluates twice
    ),
    "lcm": Sampler(lcm_schedule, lcm_step, draws=_one_per_step, variance_preserving=True),
    "tcd": Sampler(tcd_schedule, tcd_step, draws=_one_per_step, variance_preserving=True),
}
# Samplers whose loop cannot start or stop part-way through its schedule as diffusers' would: PLMS
# counts its model evaluations from the first, and its second step re-evaluates.
WHOLE_SCHEDULE_ONLY = ("pndm",)

# diffusers' scheduler classes, and the sampler that reproduces each.
SCHEDULER_SAMPLERS = {
    "EulerDiscreteScheduler": "euler",
    "EulerAncestralDiscreteScheduler": "euler_ancestral",
    "DPMSolverMultistepScheduler": "dpmpp_2m",
    "DDIMScheduler": "ddim",
    "PNDMScheduler": "pndm",
    "LCMScheduler": "lcm",
    "TCDScheduler": "tcd",
}
# The schedulers whose samplers here step from zero terminal SNR's last noise level (`schedulers.train_sigmas`).
_ZERO_SNR_SCHEDULERS = ("EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler")
# DPMSolverMultistepScheduler's settings that `dpmpp_2m_step` implements (its defaults).
_DPMPP_2M_SETTINGS = {
    "algorithm_type": "dpmsolver++",
    "solver_order": 2,
    "solver_type": "midpoint",
    "lower_order_final": True,
    "euler_at_final": False,
    "variance_type": None,
    "use_lu_lambdas": False,
}


def sampler_for_scheduler(config: dict) -> str:
    """The sampler that reproduces a checkpoint's scheduler (`scheduler_config.json`, by its
    `_class_name` and settings): the checkpoint's default sampler.

    Raises:
      ValueError: no sampler here reproduces that class with those settings; it is never replaced
        by another silently.
    """
    name = config.get("_class_name", "EulerDiscreteScheduler")
    if name not in SCHEDULER_SAMPLERS:
        known = ", ".join(SCHEDULER_SAMPLERS)
        raise ValueError(f"scheduler {name} is not implemented (the samplers here reproduce {known})")
    if name == "DPMSolverMultistepScheduler":
        for key, value in _DPMPP_2M_SETTINGS.items():
            if config.get(key, value) != value:
                raise ValueError(f"scheduler {name} with {key}={config[key]!r} is not implemented (only {value!r})")
        return "dpmpp_2m_karras" if config.get("use_karras_sigmas") else "dpmpp_2m"
    if config.get("rescale_betas_zero_snr") and name not in _ZERO_SNR_SCHEDULERS:
        raise ValueError(f"scheduler {name} with rescale_betas_zero_snr is not implemented (only "
                         f"{', '.join(_ZERO_SNR_SCHEDULERS)}: give one as the scheduler's _class_name)")
    plms = config.get("skip_prk_steps") and config.get("prediction_type", "epsilon") == "epsilon"
    if name == "PNDMScheduler" and not plms:
        raise ValueError(f"scheduler {name} is implemented only with skip_prk_steps and epsilon prediction (PLMS)")
    return SCHEDULER_SAMPLERS[name]
