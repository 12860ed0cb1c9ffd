"""k-diffusion's samplers as AUTOMATIC1111's webui (1.10) runs them, by A1111's names, on A1111's schedules.

A request names a sampler ("DPM++ 2M SDE") and a "Schedule type" ("Karras", or "Automatic" for the
sampler's own default); `kdiffusion_schedule` builds the padded schedule as A1111's
`KDiffusionSampler.get_sigmas` does (`modules/sd_samplers_kdiffusion.py`) and `SAMPLERS` holds each
sampler as the pieces of a `samplers.Sampler` loop. The arithmetic is k-diffusion's
(`sdxl.sampling.kdiffusion_steps`: `k_diffusion/sampling.py`, A1111's `restart_sampler` for Restart) in float32, with
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

from .kdiffusion_steps import (
    KSchedule, LMSSchedule, RestartSchedule, dpm_2_ancestral_step, dpm_2_step, dpmpp_2m_sde_step, dpmpp_2m_step,
    dpmpp_2s_ancestral_step, dpmpp_3m_sde_step, dpmpp_sde_step, euler_ancestral_step, euler_step, heun_step,
    lms_step, restart_step,
)
from .samplers import Carry, Sampler
from .schedule_types import SCHEDULES, discrete_model, karras_sigmas, sigma_to_t
from .schedulers import SchedulerConfig


def _padded(values, length: int, dtype=np.float32, fill: str = "edge") -> jax.Array:
    values = np.asarray(values, dtype)
    widths = [(0, length - len(values))] + [(0, 0)] * (values.ndim - 1)
    return jnp.asarray(np.pad(values, widths, mode=fill))


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
