"""k-diffusion's samplers as AUTOMATIC1111's webui (1.10) runs them, by A1111's names, on A1111's schedules.

A request names a sampler ("DPM++ 2M SDE") and a "Schedule type" ("Karras", or "Automatic" for the
sampler's own default); `kdiffusion_schedule` builds the padded schedule as A1111's
`KDiffusionSampler.get_sigmas` does (`modules/sd_samplers_kdiffusion.py`) and `SAMPLERS` holds each
sampler as the pieces of a `samplers.Sampler` loop. The arithmetic is k-diffusion's
(`k_diffusion/sampling.py`, A1111's `sd_samplers_extra.restart_sampler` for Restart) in float32, with
A1111's defaults: eta 1, s_noise 1, no churn. The denoiser contract is `samplers.Denoiser`'s, with the
timestep of each noise level from `schedule_types.sigma_to_t` (k-diffusion's CompVisDenoiser).

Loop iterations count model evaluations. A second-order sampler (Heun, DPM2, DPM2 a, DPM++ 2S a,
DPM++ SDE, Restart) spends two on each step, so step k starts at iteration 2k whatever the step
count: on a step that ends at sigma 0, where k-diffusion takes a plain Euler step, the second
evaluation is made at sigma 0 and its prediction (the finished latents) is only a preview. That is one
model evaluation more than A1111 makes in a whole run.

Noise. `num_steps` is the schedule's step count (`schedule_steps`). The stochastic samplers read their
noise through `samplers.step_noise(noise, k, ...)`, draw k being the k-th noise k-diffusion asks for:

- Euler a, DPM2 a, DPM++ 2S a: draw i at step i (none after a step that ends at sigma 0). A1111 takes
  these from `torch.randn_like`, which it routes to its per-image generators: they are the draws that
  follow the starting noise, `sdxl.sampling.noise.ImageNoise.next()` after `first()`, in order.
- Restart: draw k for its k-th restart (at most 2), also `ImageNoise.next()`'s.
- DPM++ 2M SDE and DPM++ 3M SDE: draw i at step i; DPM++ SDE: draws 2i and 2i + 1 at step i, for its
  half step and its whole step.

The SDE samplers' draws are those of k-diffusion's `noise_sampler(sigma, sigma_next)`. A1111 passes
them a `BrownianTreeNoiseSampler` (`sd_samplers_common.Sampler.create_noise_sampler`: one Brownian
tree per image seeded with the image's seed, its normals drawn by A1111's own generator): each draw
is the tree's increment over the step's sigma interval divided by the root of its length.
`brownian_draws` asks a noise sampler for them in k-diffusion's order, and with
`sdxl.sampling.brownian.BrownianNoise` the host makes A1111's. JAX's noise (and diffusers' batch
convention) give these samplers independent standard normal draws instead: for DPM++ 2M SDE and
DPM++ 3M SDE the same in distribution (increments over disjoint intervals are independent); within
a DPM++ SDE step not, as its two draws cover [sigma_mid, sigma_i] and [sigma_next, sigma_i], which
overlap: A1111's are correlated, by 1 / sqrt(1 + sqrt(sigma_next / sigma_i)), 0.72 to 0.79 on SDXL's
Karras schedules of 10 to 30 steps.
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .samplers import Carry, Denoiser, Sampler, step_noise
from .schedule_types import SCHEDULES, discrete_model, karras_sigmas, sigma_to_t
from .schedulers import Schedule, SchedulerConfig


@struct.dataclass
class KSchedule(Schedule):
    """A schedule in k-diffusion's terms: x = x0 + sigma * noise, starting at sigmas[0] * noise.

    Attributes:
      log_sigmas: [T] float32 the model's log noise levels, for the timesteps of sigmas between the
        schedule's (`schedule_types.sigma_to_t`).
    """

    log_sigmas: jax.Array


@struct.dataclass
class LMSSchedule(KSchedule):
    """A schedule for LMS, with its linear multistep coefficients.

    Attributes:
      lms_coefficients: [max_steps, 4, 4] float32; [i, order - 1, j] weighs the derivative of j steps
        before step i in step i's update at that order (k-diffusion's `linear_multistep_coeff`: the
        integral over [sigma_i, sigma_next] of the Lagrange polynomial through the last `order` sigmas).
    """

    lms_coefficients: jax.Array


@struct.dataclass
class RestartSchedule(KSchedule):
    """Restart's Heun steps (A1111's `restart_sampler`), step k going from sigmas[k] to target_sigmas[k].

    Attributes:
      target_sigmas: [max_steps] float32.
      restart_sigmas: [max_steps] float32, the noise added before step k, sqrt(sigmas[k]^2 - the level
        the last step reached^2): nonzero where a restart jumps back up.
      restart_draws: [max_steps] int32, which noise draw that is.
    """

    target_sigmas: jax.Array
    restart_sigmas: jax.Array
    restart_draws: jax.Array


def _padded(values, length: int, dtype=np.float32, fill: str = "edge") -> jax.Array:
    values = np.asarray(values, dtype)
    widths = [(0, length - len(values))] + [(0, 0)] * (values.ndim - 1)
    return jnp.asarray(np.pad(values, widths, mode=fill))


def _per_image(flag: jax.Array, x: jax.Array) -> jax.Array:
    """[B] values shaped to broadcast against [B, ...] latents."""
    return flag.reshape((-1,) + (1,) * (x.ndim - 1))


def _ancestral(sigma: jax.Array, sigma_next: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k-diffusion's get_ancestral_step at eta 1: (sigma_down, sigma_up), sigma_down^2 + sigma_up^2 =
    sigma_next^2, the noise of a DDPM step from sigma to sigma_next."""
    sigma_up = jnp.minimum(sigma_next, (sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2) ** 0.5)
    return (sigma_next**2 - sigma_up**2) ** 0.5, sigma_up


def _to_d(x: jax.Array, sigma: jax.Array, denoised: jax.Array) -> jax.Array:
    """The probability flow ODE's derivative dx/dsigma = (x - denoised) / sigma."""
    return (x - denoised) / sigma


def _t(sigma: jax.Array) -> jax.Array:
    """DPM-Solver's time, -log sigma."""
    return -jnp.log(sigma)


def _sigma(t: jax.Array) -> jax.Array:
    return jnp.exp(-t)


def _log_midpoint(sigma: jax.Array, sigma_to: jax.Array) -> jax.Array:
    """exp(lerp(log sigma, log sigma_to, 1/2)), with torch.lerp's formula for weights >= 1/2."""
    log_to = jnp.log(sigma_to)
    return jnp.exp(log_to - (log_to - jnp.log(sigma)) * 0.5)


# ---------------------------------------------------------------------------------------------------
# First-order samplers: one model evaluation per step, the loop index i being the step.


def euler_step(denoiser: Denoiser, schedule: KSchedule, num_steps, i, x: jax.Array, noise) -> jax.Array:
    """k-diffusion's sample_euler: Karras et al. 2022 Algorithm 2 with Euler steps and no churn."""
    sigma = schedule.sigmas[i]
    denoised = denoiser(x, sigma, schedule.timesteps[i])
    return x + _to_d(x, sigma, denoised) * (schedule.sigmas[i + 1] - sigma)


def euler_ancestral_step(denoiser: Denoiser, schedule: KSchedule, num_steps, i, x: jax.Array, noise) -> jax.Array:
    """k-diffusion's sample_euler_ancestral: an Euler step down to sigma_down, then draw i times sigma_up."""
    sigma, sigma_next = schedule.sigmas[i], schedule.sigmas[i + 1]
    denoised = denoiser(x, sigma, schedule.timesteps[i])
    sigma_down, sigma_up = _ancestral(sigma, sigma_next)
    x = x + _to_d(x, sigma, denoised) * (sigma_down - sigma)
    return jnp.where(sigma_next > 0, x + step_noise(noise, i, x.shape[1:]) * sigma_up, x)


def lms_step(denoiser: Denoiser, schedule: LMSSchedule, num_steps, i, carry: Carry, noise) -> Carry:
    """k-diffusion's sample_lms (order 4): a linear multistep method over the derivatives of the last
    steps of this run, of order 1 at its first step and one higher at each next, up to 4.

    The state is (x, [B, 3, ...] the last three derivatives, newest first, [B] the steps run before).
    """
    x, history, seen = carry
    sigma = schedule.sigmas[i]
    d = _to_d(x, sigma, denoiser(x, sigma, schedule.timesteps[i]))
    derivatives = [d, *(history[:, k] for k in range(3))]
    coefficients = schedule.lms_coefficients[i][jnp.minimum(seen, 3)]  # [B, 4]
    update = sum(_per_image(coefficients[:, j], x) * derivatives[j] for j in range(4))
    return x + update, jnp.concatenate([d[:, None], history[:, :2]], axis=1), seen + 1


def _around(schedule: KSchedule, i) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sigmas of step i's neighbourhood: the previous step's (step 0's own at step 0), its own, the next."""
    return schedule.sigmas[jnp.maximum(i - 1, 0)], schedule.sigmas[i], schedule.sigmas[i + 1]


def dpmpp_2m_step(denoiser: Denoiser, schedule: KSchedule, num_steps, i, carry: Carry, noise) -> Carry:
    """k-diffusion's sample_dpmpp_2m: DPM-Solver++(2M), Lu et al. 2022 Algorithm 2; first order at the
    run's first step and at a step that ends at sigma 0.

    The state is (x, the previous step's denoised prediction, [B] the steps run before).
    """
    x, denoised_prev, seen = carry
    sigma_prev, sigma, sigma_next = _around(schedule, i)
    denoised = denoiser(x, sigma, schedule.timesteps[i])
    t, t_next = _t(sigma), _t(sigma_next)
    h = t_next - t
    second_order = _per_image(seen > 0, x) & (sigma_next > 0)
    r = (t - _t(sigma_prev)) / h
    weight = jnp.where(second_order, 1 / (2 * r), 0.0)
    denoised_d = (1 + weight) * denoised - weight * denoised_prev
    return (_sigma(t_next) / _sigma(t)) * x - jnp.expm1(-h) * denoised_d, denoised, seen + 1


def dpmpp_2m_sde_step(
    denoiser: Denoiser, schedule: KSchedule, num_steps, i, carry: Carry, noise, *, heun: bool = False
) -> Carry:
    """k-diffusion's sample_dpmpp_2m_sde (eta 1, its midpoint solver, or with `heun` its Heun one):
    DPM-Solver++(2M) for the SDE, with draw i scaled to the step's noise; the denoised prediction
    itself at a step that ends at sigma 0.

    The state is (x, the previous step's denoised prediction, [B] the steps run before).
    """
    x, denoised_prev, seen = carry
    sigma_prev, sigma, sigma_next = _around(schedule, i)
    denoised = denoiser(x, sigma, schedule.timesteps[i])
    t, t_next = _t(sigma), _t(sigma_next)
    h = t_next - t
    eta_h = h  # eta 1
    decay = -jnp.expm1(-h - eta_h)
    stepped = sigma_next / sigma * jnp.exp(-eta_h) * x + decay * denoised
    weight = decay / (-h - eta_h) + 1 if heun else 0.5 * decay
    correction = weight * (1 / ((t - _t(sigma_prev)) / h)) * (denoised - denoised_prev)
    stepped = jnp.where(_per_image(seen > 0, x), stepped + correction, stepped)
    stepped = stepped + step_noise(noise, i, x.shape[1:]) * sigma_next * jnp.sqrt(-jnp.expm1(-2 * eta_h))
    return jnp.where(sigma_next > 0, stepped, denoised), denoised, seen + 1


def dpmpp_3m_sde_step(denoiser: Denoiser, schedule: KSchedule, num_steps, i, carry: Carry, noise) -> Carry:
    """k-diffusion's sample_dpmpp_3m_sde (eta 1): DPM-Solver++(3M) for the SDE, of order 1, 2, then 3
    as the run's earlier predictions allow, with draw i scaled to the step's noise; the denoised
    prediction itself at a step that ends at sigma 0.

    The state is (x, the previous two steps' denoised predictions, [B] the steps run before).
    """
    x, denoised_1, denoised_2, seen = carry
    sigmas = schedule.sigmas
    sigma, sigma_next = sigmas[i], sigmas[i + 1]
    denoised = denoiser(x, sigma, schedule.timesteps[i])
    t, t_1, t_2 = _t(sigma), _t(sigmas[jnp.maximum(i - 1, 0)]), _t(sigmas[jnp.maximum(i - 2, 0)])
    h, h_1, h_2 = _t(sigma_next) - t, t - t_1, t_1 - t_2
    h_eta = h * 2  # h * (eta + 1)
    stepped = jnp.exp(-h_eta) * x + -jnp.expm1(-h_eta) * denoised
    phi_2 = jnp.expm1(-h_eta) / h_eta + 1
    r0, r1 = h_1 / h, h_2 / h
    second = stepped + phi_2 * ((denoised - denoised_1) / r0)  # with one earlier prediction
    d1_0, d1_1 = (denoised - denoised_1) / r0, (denoised_1 - denoised_2) / r1
    d1 = d1_0 + (d1_0 - d1_1) * r0 / (r0 + r1)
    d2 = (d1_0 - d1_1) / (r0 + r1)
    third = stepped + phi_2 * d1 - (phi_2 / h_eta - 0.5) * d2  # with two
    earlier = _per_image(seen, x)
    stepped = jnp.where(earlier >= 2, third, jnp.where(earlier == 1, second, stepped))
    stepped = stepped + step_noise(noise, i, x.shape[1:]) * sigma_next * jnp.sqrt(-jnp.expm1(-2 * h))
    return jnp.where(sigma_next > 0, stepped, denoised), denoised, denoised_1, seen + 1


# ---------------------------------------------------------------------------------------------------
# Second-order samplers: two model evaluations per step, loop iteration j being step j // 2's first
# (j even) or second. The state is (x at the step's start, the second evaluation's input), and for
# Heun's kind the first evaluation's derivative.


def _halves(j: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the step, whether this is its second evaluation) of loop iteration j."""
    return j // 2, j % 2 == 1


def _evaluate(denoiser, schedule: KSchedule, i, second, x, probe, probe_sigma) -> jax.Array:
    """The iteration's one model evaluation: at (x, sigmas[i]) first, at (probe, probe_sigma) second."""
    sigma = jnp.where(second, probe_sigma, schedule.sigmas[i])
    timestep = jnp.where(second, sigma_to_t(schedule.log_sigmas, probe_sigma), schedule.timesteps[i])
    return denoiser(jnp.where(second, probe, x), sigma, timestep)


def _select(second: jax.Array, first_half: Carry, second_half: Carry) -> Carry:
    return jax.tree.map(lambda a, b: jnp.where(second, b, a), first_half, second_half)


def _heun_halves(x, probe, d, denoised, sigma, sigma_next, second) -> Carry:
    """Heun's method from sigma to sigma_next (an Euler step where sigma_next is 0)."""
    dt = sigma_next - sigma
    first_d = _to_d(x, sigma, denoised)
    euler = x + first_d * dt
    first = (jnp.where(sigma_next > 0, x, euler), euler, first_d)
    d_prime = (d + _to_d(probe, sigma_next, denoised)) / 2
    return _select(second, first, (jnp.where(sigma_next > 0, x + d_prime * dt, x), probe, d))


def heun_step(denoiser: Denoiser, schedule: KSchedule, num_steps, j, carry: Carry, noise) -> Carry:
    """k-diffusion's sample_heun: Karras et al. 2022 Algorithm 2 with Heun steps and no churn."""
    i, second = _halves(j)
    x, probe, d = carry
    sigma, sigma_next = schedule.sigmas[i], schedule.sigmas[i + 1]
    denoised = _evaluate(denoiser, schedule, i, second, x, probe, sigma_next)
    return _heun_halves(x, probe, d, denoised, sigma, sigma_next, second)


def _midpoint_halves(x, probe, d, denoised, sigma, sigma_mid, sigma_to, second) -> Carry:
    """DPM-Solver-2 in k-diffusion's derivative form, from sigma to sigma_to through sigma_mid (an
    Euler step where sigma_to is 0)."""
    first_d = _to_d(x, sigma, denoised)
    euler = x + first_d * (sigma_to - sigma)
    midpoint = x + first_d * (sigma_mid - sigma)
    first = (jnp.where(sigma_to > 0, x, euler), jnp.where(sigma_to > 0, midpoint, euler), first_d)
    stepped = x + _to_d(probe, sigma_mid, denoised) * (sigma_to - sigma)
    return _select(second, first, (jnp.where(sigma_to > 0, stepped, x), probe, d))


def _probe_sigma(sigma_to: jax.Array, sigma_mid: jax.Array) -> jax.Array:
    """The second evaluation's noise level: sigma_mid, or 0 where the step is an Euler step to 0."""
    return jnp.where(sigma_to > 0, sigma_mid, 0.0)


def dpm_2_step(denoiser: Denoiser, schedule: KSchedule, num_steps, j, carry: Carry, noise) -> Carry:
    """k-diffusion's sample_dpm_2: DPM-Solver-2 steps (Lu et al. 2022) in Karras et al.'s Algorithm 2,
    the second evaluation at the log-midpoint sigma, no churn."""
    i, second = _halves(j)
    x, probe, d = carry
    sigma, sigma_next = schedule.sigmas[i], schedule.sigmas[i + 1]
    sigma_mid = _log_midpoint(sigma, sigma_next)
    denoised = _evaluate(denoiser, schedule, i, second, x, probe, _probe_sigma(sigma_next, sigma_mid))
    return _midpoint_halves(x, probe, d, denoised, sigma, sigma_mid, sigma_next, second)


def dpm_2_ancestral_step(denoiser: Denoiser, schedule: KSchedule, num_steps, j, carry: Carry, noise) -> Carry:
    """k-diffusion's sample_dpm_2_ancestral: a DPM-Solver-2 step down to sigma_down, then draw i times
    sigma_up (none on an Euler step to 0)."""
    i, second = _halves(j)
    x, probe, d = carry
    sigma, sigma_next = schedule.sigmas[i], schedule.sigmas[i + 1]
    sigma_down, sigma_up = _ancestral(sigma, sigma_next)
    sigma_mid = _log_midpoint(sigma, sigma_down)
    denoised = _evaluate(denoiser, schedule, i, second, x, probe, _probe_sigma(sigma_down, sigma_mid))
    x, probe, d = _midpoint_halves(x, probe, d, denoised, sigma, sigma_mid, sigma_down, second)
    noised = x + step_noise(noise, i, x.shape[1:]) * sigma_up
    return jnp.where(second & (sigma_down > 0), noised, x), probe, d


def dpmpp_2s_ancestral_step(denoiser: Denoiser, schedule: KSchedule, num_steps, j, carry: Carry, noise) -> Carry:
    """k-diffusion's sample_dpmpp_2s_ancestral: a DPM-Solver++(2S) step down to sigma_down, its
    midpoint half way in log sigma, then draw i times sigma_up (an Euler step to 0, without noise, at
    the end). The state is (x, the second evaluation's input)."""
    i, second = _halves(j)
    x, probe = carry
    sigma, sigma_next = schedule.sigmas[i], schedule.sigmas[i + 1]
    sigma_down, sigma_up = _ancestral(sigma, sigma_next)
    t, t_next = _t(sigma), _t(sigma_down)
    h = t_next - t
    s = t + 0.5 * h
    denoised = _evaluate(denoiser, schedule, i, second, x, probe, _probe_sigma(sigma_down, _sigma(s)))
    euler = x + _to_d(x, sigma, denoised) * (sigma_down - sigma)
    midpoint = (_sigma(s) / _sigma(t)) * x - jnp.expm1(-h * 0.5) * denoised
    first = (jnp.where(sigma_down > 0, x, euler), jnp.where(sigma_down > 0, midpoint, euler))
    stepped = (_sigma(t_next) / _sigma(t)) * x - jnp.expm1(-h) * denoised
    noised = stepped + step_noise(noise, i, x.shape[1:]) * sigma_up
    return _select(second, first, (jnp.where(sigma_next > 0, noised, x), probe))


def dpmpp_sde_step(denoiser: Denoiser, schedule: KSchedule, num_steps, j, carry: Carry, noise) -> Carry:
    """k-diffusion's sample_dpmpp_sde (eta 1, r 1/2): DPM-Solver++ for the SDE, an ancestral half step
    to the log-midpoint (draw 2i) then an ancestral whole step (draw 2i + 1) with the midpoint's
    prediction (at r 1/2 k-diffusion weighs the step's first prediction 0); an Euler step to 0 at the
    end. The state is (x, the second evaluation's input)."""
    i, second = _halves(j)
    x, probe = carry
    sigma, sigma_next = schedule.sigmas[i], schedule.sigmas[i + 1]
    t, t_next = _t(sigma), _t(sigma_next)
    h = t_next - t
    s = t + h * 0.5
    denoised = _evaluate(denoiser, schedule, i, second, x, probe, _probe_sigma(sigma_next, _sigma(s)))
    euler = x + _to_d(x, sigma, denoised) * (sigma_next - sigma)
    sigma_down, sigma_up = _ancestral(_sigma(t), _sigma(s))
    s_down = _t(sigma_down)
    half = (_sigma(s_down) / _sigma(t)) * x - jnp.expm1(t - s_down) * denoised
    half = half + step_noise(noise, 2 * i, x.shape[1:]) * sigma_up
    first = (jnp.where(sigma_next > 0, x, euler), jnp.where(sigma_next > 0, half, euler))
    sigma_down, sigma_up = _ancestral(_sigma(t), _sigma(t_next))
    t_down = _t(sigma_down)
    stepped = (_sigma(t_down) / _sigma(t)) * x - jnp.expm1(t - t_down) * denoised
    stepped = stepped + step_noise(noise, 2 * i + 1, x.shape[1:]) * sigma_up
    return _select(second, first, (jnp.where(sigma_next > 0, stepped, x), probe))


def restart_step(denoiser: Denoiser, schedule: RestartSchedule, num_steps, j, carry: Carry, noise) -> Carry:
    """A1111's restart_sampler (Xu et al. 2023, "Restart Sampling for Improving Generative Processes"):
    Heun steps, step k from sigmas[k] to target_sigmas[k], a restart first noised back up with its draw."""
    i, second = _halves(j)
    x, probe, d = carry
    sigma, sigma_next, jump = schedule.sigmas[i], schedule.target_sigmas[i], schedule.restart_sigmas[i]
    restarted = x + step_noise(noise, schedule.restart_draws[i], x.shape[1:]) * jump
    x = jnp.where(second | (jump == 0), x, restarted)
    denoised = _evaluate(denoiser, schedule, i, second, x, probe, sigma_next)
    return _heun_halves(x, probe, d, denoised, sigma, sigma_next, second)


# ---------------------------------------------------------------------------------------------------
# A1111's sampler table.


def _with_history(count: int) -> Callable[[jax.Array], Carry]:
    """The initial state of a multistep sampler: x, `count` zero predictions, and [B] no steps seen."""

    def init(x: jax.Array) -> Carry:
        x = x.astype(jnp.float32)
        return x, *(jnp.zeros_like(x) for _ in range(count)), jnp.zeros(x.shape[0], jnp.int32)

    return init


def _lms_init(x: jax.Array) -> Carry:
    x = x.astype(jnp.float32)
    return x, jnp.zeros((x.shape[0], 3, *x.shape[1:]), jnp.float32), jnp.zeros(x.shape[0], jnp.int32)


def _probe_init(x: jax.Array) -> Carry:
    x = x.astype(jnp.float32)
    return x, x


def _heun_init(x: jax.Array) -> Carry:
    x = x.astype(jnp.float32)
    return x, x, jnp.zeros_like(x)


def _first(carry: Carry) -> jax.Array:
    return carry[0]


def _with_first(carry: Carry, x: jax.Array) -> Carry:
    return (x, *carry[1:])


def _one_per_step(num_steps):
    return num_steps


def _two_per_step(num_steps):
    return 2 * num_steps


def restart_times(steps: int) -> int:
    """How often A1111's Restart restarts in a run of `steps`: not below 20 steps, once up to 35, then twice."""
    return (steps >= 20) + (steps >= 36)


class KSampler(NamedTuple):
    """A sampler of A1111's k-diffusion table (`sd_samplers_kdiffusion.samplers_k_diffusion`) and its loop.

    Attributes:
      function: the k-diffusion function it runs (A1111's own, for Restart).
      step: the loop's step (`samplers.Sampler.step`).
      default_schedule: what "Automatic" stands for: the table's 'scheduler' option, else Uniform
        (A1111 then takes k-diffusion's DiscreteSchedule.get_sigmas, which is Uniform).
      discard_next_to_last_sigma: A1111 builds the schedule for one step more and drops its next to
        last sigma.
      evaluations: the loop iterations (model evaluations) of a run of `num_steps` (an int or a
        traced one): two per step for second-order samplers.
      draws: the noise draws of a run of n steps (see the module's docstring; an upper bound: none
        after a step that ends at sigma 0), or None for a deterministic sampler.
      brownian: A1111 draws its noise from a Brownian tree (`brownian_draws`).
      init, finish, with_latents: as `samplers.Sampler`'s.
    """

    function: str
    step: Callable[..., Carry]
    default_schedule: str = "Uniform"
    discard_next_to_last_sigma: bool = False
    evaluations: Callable = _one_per_step
    draws: Callable[[int], int] | None = None
    brownian: bool = False
    init: Callable[[jax.Array], Carry] = lambda x: x.astype(jnp.float32)
    finish: Callable[[Carry], jax.Array] = lambda carry: carry
    with_latents: Callable[[Carry, jax.Array], Carry] = lambda carry, x: x


_MULTISTEP = dict(finish=_first, with_latents=_with_first)
_PROBING = dict(evaluations=_two_per_step, init=_probe_init, **_MULTISTEP)
_HEUN_LIKE = dict(evaluations=_two_per_step, init=_heun_init, **_MULTISTEP)

SAMPLERS = {  # by A1111's names, in A1111's order
    "DPM++ 2M": KSampler("sample_dpmpp_2m", dpmpp_2m_step, "Karras", init=_with_history(1), **_MULTISTEP),
    "DPM++ SDE": KSampler("sample_dpmpp_sde", dpmpp_sde_step, "Karras", draws=_two_per_step, brownian=True, **_PROBING),
    "DPM++ 2M SDE": KSampler(
        "sample_dpmpp_2m_sde", dpmpp_2m_sde_step, "Exponential", draws=_one_per_step, brownian=True,
        init=_with_history(1), **_MULTISTEP,
    ),
    "DPM++ 2M SDE Heun": KSampler(
        "sample_dpmpp_2m_sde", functools.partial(dpmpp_2m_sde_step, heun=True), "Exponential", draws=_one_per_step,
        brownian=True, init=_with_history(1), **_MULTISTEP,
    ),
    "DPM++ 2S a": KSampler(
        "sample_dpmpp_2s_ancestral", dpmpp_2s_ancestral_step, "Karras", draws=_one_per_step, **_PROBING,
    ),
    "DPM++ 3M SDE": KSampler(
        "sample_dpmpp_3m_sde", dpmpp_3m_sde_step, "Exponential", discard_next_to_last_sigma=True,
        draws=_one_per_step, brownian=True, init=_with_history(2), **_MULTISTEP,
    ),
    "Euler a": KSampler("sample_euler_ancestral", euler_ancestral_step, draws=_one_per_step),
    "Euler": KSampler("sample_euler", euler_step),
    "LMS": KSampler("sample_lms", lms_step, init=_lms_init, **_MULTISTEP),
    "Heun": KSampler("sample_heun", heun_step, **_HEUN_LIKE),
    "DPM2": KSampler("sample_dpm_2", dpm_2_step, "Karras", discard_next_to_last_sigma=True, **_HEUN_LIKE),
    "DPM2 a": KSampler(
        "sample_dpm_2_ancestral", dpm_2_ancestral_step, "Karras", discard_next_to_last_sigma=True,
        draws=_one_per_step, **_HEUN_LIKE,
    ),
    "Restart": KSampler("restart_sampler", restart_step, "Karras", draws=restart_times, **_HEUN_LIKE),
}
# Samplers whose run cannot start part-way through its schedule: Restart plans its restarts from the
# whole schedule it is given (A1111's image-to-image hands it the remaining sigmas, a plan of its own).
WHOLE_SCHEDULE_ONLY = ("Restart",)
SCHEDULE_TYPES = ("Automatic", *SCHEDULES)


def _sampler(name: str) -> KSampler:
    if name not in SAMPLERS:
        raise ValueError(f"sampler {name!r} is not one of A1111's k-diffusion samplers here: {', '.join(SAMPLERS)}")
    return SAMPLERS[name]


def _check_schedule_type(schedule_type: str) -> None:
    if schedule_type not in SCHEDULE_TYPES:
        raise ValueError(f"schedule type {schedule_type!r} is not one of A1111's: {', '.join(SCHEDULE_TYPES)}")


def kdiffusion_sigmas(
    config: SchedulerConfig, schedule_type: str, sampler_name: str, steps: int, *, is_sdxl: bool = True
) -> np.ndarray:
    """A1111's sigmas for a sampler, a schedule type and a step count (`KDiffusionSampler.get_sigmas`).

    "Automatic" is the sampler's default schedule; samplers that discard the next to last sigma get
    a schedule of steps + 1 with it dropped. Restart's own rebuilding of the schedule is
    `restart_plan`'s.

    Raises:
      ValueError: an unknown sampler or schedule type (A1111 runs a schedule type it does not know
        as Uniform; here it is refused), or steps below 1.
    """
    sampler = _sampler(sampler_name)
    _check_schedule_type(schedule_type)
    if steps < 1:
        raise ValueError(f"steps={steps}: a schedule needs at least 1 step")
    if schedule_type == "Automatic":
        schedule_type = sampler.default_schedule
    discard = sampler.discard_next_to_last_sigma
    sigmas = SCHEDULES[schedule_type](steps + discard, discrete_model(config, is_sdxl))
    return np.concatenate([sigmas[:-2], sigmas[-1:]]) if discard else sigmas


def restart_plan(sigmas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A1111's restart_sampler's Heun steps over `sigmas`: (from, to) of each, as many as `sigmas` has steps.

    Below 20 steps it is plain Heun over `sigmas`. From 20 on it restarts `restart_times` times with
    m = 9 steps each (m = steps // 4 from 36 on): it replaces the schedule by a Karras one from the
    first sigma to the next to last with m fewer steps per restart, and after the step that reaches
    its sigma nearest 0.1 goes back up to its sigma nearest 2 and down again to the first along a
    Karras schedule of m steps, each time. Whatever the schedule type, so, Restart's steps from 20 on
    are Karras steps over the schedule's range.

    Raises:
      ValueError: the sigma nearest 2 does not come before the one nearest 0.1, so that A1111 would
        not restart and would run fewer steps than asked.
    """
    steps = len(sigmas) - 1
    times = restart_times(steps)
    if not times:
        return sigmas[:-1], sigmas[1:]
    restart_steps = 9 if steps < 36 else steps // 4
    main = karras_sigmas(steps - restart_steps * times, float(sigmas[-2]), float(sigmas[0]))
    low, high = int(np.argmin(np.abs(main - 0.1))), int(np.argmin(np.abs(main - 2)))
    if not high < low:
        raise ValueError("Restart finds no restart here: the sigma nearest 2 does not come before the one nearest 0.1")
    restart = karras_sigmas(restart_steps + 1, float(main[low]), float(main[high]))[:-1]
    starts = [main[:low], *[restart[:-1]] * times, main[low:-1]]
    ends = [main[1 : low + 1], *[restart[1:]] * times, main[low + 1 :]]
    return np.concatenate(starts), np.concatenate(ends)


def _lms_coefficients(sigmas: np.ndarray) -> np.ndarray:
    """[steps, 4, 4]: k-diffusion's linear_multistep_coeff(order, sigmas, i, j), computed exactly (its
    quadrature is exact for these polynomials) in float64, zero where step i has no j-th predecessor."""
    sigmas = sigmas.astype(np.float64)
    steps = len(sigmas) - 1
    coefficients = np.zeros((steps, 4, 4))
    for i in range(steps):
        for order in range(1, min(i + 1, 4) + 1):
            for j in range(order):
                basis = np.polynomial.Polynomial([1.0])
                for k in range(order):
                    if k != j:
                        basis *= np.polynomial.Polynomial([-sigmas[i - k], 1]) / (sigmas[i - j] - sigmas[i - k])
                integral = basis.integ()
                coefficients[i, order - 1, j] = integral(sigmas[i + 1]) - integral(sigmas[i])
    return coefficients


def schedule_steps(config: SchedulerConfig, schedule_type: str, sampler_name: str, steps: int, **kwargs) -> int:
    """The steps A1111 runs for `steps` asked: `steps` itself but for the DDIM schedule type (see
    `schedule_types.ddim`). The `num_steps` the loop and `KSampler.evaluations` take."""
    return len(kdiffusion_sigmas(config, schedule_type, sampler_name, steps, **kwargs)) - 1


def kdiffusion_schedule(
    config: SchedulerConfig, schedule_type: str, sampler_name: str, steps: int, max_steps: int, *,
    is_sdxl: bool = True,
) -> KSchedule:
    """A1111's schedule for `steps` of a sampler on a schedule type, padded to max_steps: the
    sigmas, their float timesteps, and what the sampler needs besides (LMS's coefficients, Restart's
    plan), and the steps it runs (`Schedule.num_steps`: `schedule_steps(...)`).

    Raises:
      ValueError: as `kdiffusion_sigmas`, or the schedule has more than max_steps steps.
    """
    sigmas = kdiffusion_sigmas(config, schedule_type, sampler_name, steps, is_sdxl=is_sdxl)
    if len(sigmas) - 1 > max_steps:
        raise ValueError(f"the {schedule_type} schedule runs {len(sigmas) - 1} steps, more than max_steps={max_steps}")
    log_sigmas = discrete_model(config, is_sdxl).log_sigmas
    fields = {"log_sigmas": jnp.asarray(log_sigmas), "init_noise_sigma": jnp.float32(sigmas[0]),
              "num_steps": np.int32(len(sigmas) - 1)}
    if sampler_name == "Restart":
        starts, ends = restart_plan(sigmas)
        reached = np.append(starts[0], ends[:-1])  # the level each step starts from, before any restart
        # A1111 noises by sqrt(from^2 - reached^2) where the level goes up, in float32.
        jumps = np.where(starts > reached, np.sqrt(np.maximum(starts**2 - reached**2, 0)), 0).astype(np.float32)
        sigmas = np.append(starts, ends[-1])
        fields.update(
            target_sigmas=_padded(ends, max_steps),
            restart_sigmas=_padded(jumps, max_steps, fill="constant"),
            restart_draws=_padded(np.maximum(np.cumsum(jumps > 0) - 1, 0), max_steps, np.int32, fill="constant"),
        )
    if sampler_name == "LMS":
        fields["lms_coefficients"] = _padded(_lms_coefficients(sigmas), max_steps, fill="constant")
    fields.update(
        sigmas=_padded(sigmas, max_steps + 1),
        timesteps=_padded(sigma_to_t(jnp.asarray(log_sigmas), jnp.asarray(sigmas[:-1])), max_steps),
    )
    kind = {"Restart": RestartSchedule, "LMS": LMSSchedule}.get(sampler_name, KSchedule)
    return kind(**fields)


def brownian_draws(name: str, sigmas: np.ndarray, noise_sampler: Callable[[float, float], np.ndarray]) -> np.ndarray:
    """[B, draws, ...] the noise an SDE sampler (`KSampler.brownian`) reads on its run over `sigmas` (the
    schedule's, down to 0), from k-diffusion's `noise_sampler(sigma, sigma_next)`: called with the
    float32 sigmas k-diffusion's function passes, in its order, each answer at the draw the step reads
    (see the module's docstring; zeros where a step draws none)."""
    sampler = _sampler(name)
    sigmas = np.asarray(sigmas, np.float32)
    steps = len(sigmas) - 1
    draws: list[np.ndarray | None] = [None] * sampler.draws(steps)
    for i in range(steps):
        if sigmas[i + 1] == 0:
            continue
        if name == "DPM++ SDE":  # a half step to the log-midpoint, then the whole step, in k-diffusion's times
            t, t_next = -np.log(sigmas[i]), -np.log(sigmas[i + 1])
            s = t + (t_next - t) * np.float32(0.5)
            draws[2 * i] = noise_sampler(np.exp(-t), np.exp(-s))
            draws[2 * i + 1] = noise_sampler(np.exp(-t), np.exp(-t_next))
        else:
            draws[i] = noise_sampler(sigmas[i], sigmas[i + 1])
    made = next(draw for draw in draws if draw is not None)
    return np.stack([np.zeros_like(made) if draw is None else draw for draw in draws], axis=1)


def sampler(name: str) -> Sampler:
    """A1111's sampler `name` as a `samplers.Sampler`, its `schedule` the sampler's own ("Automatic";
    other schedule types: `kdiffusion_schedule`, as `sampling.methods.schedule` builds them).

    Raises:
      ValueError: an unknown sampler.
    """
    k = _sampler(name)

    def schedule(config: SchedulerConfig, steps: int, max_steps: int) -> KSchedule:
        return kdiffusion_schedule(config, "Automatic", name, steps, max_steps)

    return Sampler(
        schedule=schedule, step=k.step, draws=k.draws, init=k.init, finish=k.finish,
        with_latents=k.with_latents, evaluations=k.evaluations,
    )
