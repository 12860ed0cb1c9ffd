"""k-diffusion's sampler steps in JAX (`k_diffusion/sampling.py`, and A1111's `restart_sampler` for
Restart), each a pure function of one loop iteration with `samplers.Sampler`'s signature, and the
schedules they read (`KSchedule` and its kinds). `sdxl.sampling.kdiffusion` names them as A1111 does and
builds their schedules.
"""

import jax
import jax.numpy as jnp
from flax import struct

from .samplers import Carry, Denoiser, step_noise
from .schedule_types import sigma_to_t
from .schedulers import Schedule


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
