"""Sigma schedules by AUTOMATIC1111's "Schedule type" names, over k-diffusion's discrete denoiser.

A1111 (1.10) runs k-diffusion's samplers on the UNet wrapped as k-diffusion's CompVisDenoiser
(CompVisVDenoiser for v-prediction; `k_diffusion/external.py` DiscreteSchedule). The model's noise
levels are sigma_t = sqrt((1 - alphas_cumprod[t]) / alphas_cumprod[t]) for its training timesteps
t = 0..T-1; a noise level between two of them gets the fractional timestep found by interpolating
linearly in log sigma (`sigma_to_t`, and `t_to_sigma` back), and the UNet is called at that float
timestep with input x / sqrt(sigma^2 + 1). So a schedule is a list of sigmas and the sampler derives
each timestep from its sigma.

The schedules are `modules/sd_schedulers.py`'s, each taking the model's own sigma_min and sigma_max
(A1111's default; its old "0.1 to 10" option is not offered) and computed in float32 with torch's
float32 operations mirrored, where A1111 works in float32 (`linspace32` is torch.linspace's float32
formula). All but KL Optimal end in sigma 0.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from scipy import special

from .schedulers import SchedulerConfig, zero_terminal_snr

_f32 = np.float32
# A1111's (and ComfyUI's) last alphas_cumprod of a zero-terminal-SNR schedule: a largest noise level of
# about 4519 rather than infinity.
A1111_ZERO_SNR_LAST_ALPHA_CUMPROD = _f32(4.8973451890853435e-08)


@dataclasses.dataclass(frozen=True)
class DiscreteModel:
    """A model's discrete noise levels, as k-diffusion's DiscreteSchedule holds them for A1111.

    Attributes:
      sigmas: [T] float32, increasing: the noise level of each training timestep.
      is_sdxl: A1111's `sd_model.is_sdxl`, which picks Align Your Steps' published sigmas.
    """

    sigmas: np.ndarray
    is_sdxl: bool = True

    @property
    def log_sigmas(self) -> np.ndarray:
        return np.log(self.sigmas)

    @property
    def sigma_min(self) -> float:
        return float(self.sigmas[0])

    @property
    def sigma_max(self) -> float:
        return float(self.sigmas[-1])


def discrete_model(config: SchedulerConfig, is_sdxl: bool = True) -> DiscreteModel:
    """The noise levels of a checkpoint's scheduler config, as A1111's models hold them.

    A1111 takes alphas_cumprod from the latent diffusion code (ldm's `make_beta_schedule`, sgm's
    LegacyDDPMDiscretization): betas and their cumulative product in float64, stored as float32. Its
    "linear" schedule is diffusers' "scaled_linear" (linear in sqrt(beta)). For zero terminal SNR
    (a `ztsnr` key, or its "Noise schedule" setting) it rescales them (`rescale_zero_terminal_snr_abar`)
    with a last value that keeps the largest noise level finite. The sigmas are then computed from
    the float32 values in float32, as k-diffusion's wrapper does.
    """
    steps = config.num_train_timesteps
    if config.beta_schedule == "scaled_linear":
        betas = np.linspace(config.beta_start**0.5, config.beta_end**0.5, steps) ** 2
    else:
        betas = np.linspace(config.beta_start, config.beta_end, steps)
    alphas_cumprod = np.cumprod(1 - betas).astype(_f32)
    if config.rescale_betas_zero_snr:
        alphas_cumprod = zero_terminal_snr(alphas_cumprod)
        alphas_cumprod[-1] = A1111_ZERO_SNR_LAST_ALPHA_CUMPROD
    return DiscreteModel(np.sqrt((1 - alphas_cumprod) / alphas_cumprod), is_sdxl)


def sigma_to_t(log_sigmas: jax.Array, sigma: jax.Array) -> jax.Array:
    """k-diffusion's DiscreteSchedule.sigma_to_t: the fractional timestep of noise level `sigma` (any
    shape), interpolating linearly in log sigma between the two training timesteps around it, and
    clamped to [0, T - 1]. float32, as the UNet is called with it; used on the host and in the loop."""
    log_sigma = jnp.log(sigma)
    count = len(log_sigmas)
    low = jnp.clip(jnp.sum(log_sigma[..., None] >= log_sigmas, axis=-1) - 1, 0, count - 2)
    low_log, high_log = log_sigmas[low], log_sigmas[low + 1]
    w = jnp.clip((low_log - log_sigma) / (low_log - high_log), 0, 1)
    return (1 - w) * low + w * (low + 1)


def t_to_sigma(log_sigmas: np.ndarray, t: np.ndarray) -> np.ndarray:
    """k-diffusion's DiscreteSchedule.t_to_sigma: the noise level at fractional timesteps `t`, float32."""
    t = np.asarray(t, _f32)
    w = t - np.trunc(t)
    low, high = np.floor(t).astype(np.int64), np.ceil(t).astype(np.int64)
    return np.exp((1 - w) * log_sigmas[low] + w * log_sigmas[high])


def linspace32(start: float, end: float, n: int) -> np.ndarray:
    """torch.linspace(start, end, n) in float32, by its formula: the first half counted up from
    `start`, the second down from `end`, with a float32 step. (torch's vectorised CPU kernel counts
    blocks of 8 or 16 from their first element, which moves a few elements by an ulp of the largest.)"""
    start, end = _f32(start), _f32(end)
    if n == 1:
        return np.array([start])
    step = (end - start) / _f32(n - 1)
    index = np.arange(n)
    up = start + step * index.astype(_f32)
    down = end - step * (n - 1 - index).astype(_f32)
    return np.where(index < n // 2, up, down)


def _with_zero(sigmas) -> np.ndarray:
    return np.append(np.asarray(sigmas, _f32), _f32(0))


def uniform(n: int, model: DiscreteModel) -> np.ndarray:
    """k-diffusion's DiscreteSchedule.get_sigmas(n): n timesteps evenly spaced from T - 1 down to 0."""
    return _with_zero(t_to_sigma(model.log_sigmas, linspace32(len(model.sigmas) - 1, 0, n)))


def karras_sigmas(n: int, sigma_min: float, sigma_max: float, rho: float = 7.0) -> np.ndarray:
    """k-diffusion's get_sigmas_karras: evenly spaced in sigma^(1/rho) (Karras et al. 2022, eq. 5)."""
    ramp = linspace32(0, 1, n)
    min_inv_rho, max_inv_rho = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return _with_zero((_f32(max_inv_rho) + ramp * _f32(min_inv_rho - max_inv_rho)) ** _f32(rho))


def karras(n: int, model: DiscreteModel) -> np.ndarray:
    """Karras et al.'s schedule over the model's range, at A1111's rho 7."""
    return karras_sigmas(n, model.sigma_min, model.sigma_max)


def exponential(n: int, model: DiscreteModel) -> np.ndarray:
    """k-diffusion's get_sigmas_exponential: evenly spaced in log sigma."""
    return _with_zero(np.exp(linspace32(math.log(model.sigma_max), math.log(model.sigma_min), n)))


def polyexponential(n: int, model: DiscreteModel, rho: float = 1.0) -> np.ndarray:
    """k-diffusion's get_sigmas_polyexponential: log sigma a polynomial of degree rho in the step
    (A1111's default rho, 1, makes it Exponential up to rounding)."""
    ramp = linspace32(1, 0, n) ** _f32(rho)
    log_min, log_max = math.log(model.sigma_min), math.log(model.sigma_max)
    return _with_zero(np.exp(ramp * _f32(log_max - log_min) + _f32(log_min)))


def _timestep_of(model: DiscreteModel, sigma: float) -> float:
    return float(sigma_to_t(jnp.asarray(model.log_sigmas), jnp.float32(sigma)))


def sgm_uniform(n: int, model: DiscreteModel) -> np.ndarray:
    """A1111's sgm_uniform: n + 1 timesteps evenly spaced from sigma_max's to sigma_min's, the last
    dropped (Stability's generative-models spacing)."""
    start, end = _timestep_of(model, model.sigma_max), _timestep_of(model, model.sigma_min)
    return _with_zero(t_to_sigma(model.log_sigmas, linspace32(start, end, n + 1)[:-1]))


def normal(n: int, model: DiscreteModel) -> np.ndarray:
    """A1111's normal_scheduler: n timesteps evenly spaced from sigma_max's to sigma_min's, both included."""
    start, end = _timestep_of(model, model.sigma_max), _timestep_of(model, model.sigma_min)
    return _with_zero(t_to_sigma(model.log_sigmas, linspace32(start, end, n)))


def kl_optimal(n: int, model: DiscreteModel) -> np.ndarray:
    """A1111's kl_optimal (Sabour et al. 2024, "Align Your Steps", the KL-optimal schedule): evenly
    spaced in arctan(sigma). n + 1 sigmas that end at sigma_min, not 0."""
    alpha_min, alpha_max = np.arctan(_f32(model.sigma_min)), np.arctan(_f32(model.sigma_max))
    fraction = np.arange(n + 1).astype(_f32) / _f32(n)
    return np.tan(fraction * alpha_min + (1 - fraction) * alpha_max).astype(_f32)


# Align Your Steps' published 10-step sigmas (research.nvidia.com/labs/toronto-ai/AlignYourSteps/howto.html),
# as A1111 holds them: SDXL's, and SD 1.5's for every other model.
ALIGN_YOUR_STEPS_SDXL = (14.615, 6.315, 3.771, 2.181, 1.342, 0.862, 0.555, 0.380, 0.234, 0.113, 0.029)
ALIGN_YOUR_STEPS_SD15 = (14.615, 6.475, 3.861, 2.697, 1.886, 1.396, 0.963, 0.652, 0.399, 0.152, 0.029)


def align_your_steps(n: int, model: DiscreteModel) -> np.ndarray:
    """A1111's get_align_your_steps_sigmas: the published sigmas, resampled to n by interpolating
    log sigma linearly (in float64) unless n is their own count. They ignore the model's sigmas."""
    published = np.asarray(ALIGN_YOUR_STEPS_SDXL if model.is_sdxl else ALIGN_YOUR_STEPS_SD15)
    if n == len(published):
        return _with_zero(published)
    rising = np.interp(np.linspace(0, 1, n), np.linspace(0, 1, len(published)), np.log(published[::-1]))
    return _with_zero(np.exp(rising)[::-1])


def simple(n: int, model: DiscreteModel) -> np.ndarray:
    """A1111's simple_scheduler: every (T / n)-th training sigma, counted down from the largest."""
    stride = len(model.sigmas) / n
    return _with_zero([model.sigmas[-(1 + int(k * stride))] for k in range(n)])


def ddim(n: int, model: DiscreteModel) -> np.ndarray:
    """A1111's ddim_scheduler: the training sigmas at timesteps 1, 1 + s, 1 + 2s, ... below T, with
    s = max(T // n, 1), in decreasing order. Their count is ceil((T - 1) / s), which is not always n
    (31 for n = 30 with T = 1000): A1111 then runs that many steps."""
    stride = max(len(model.sigmas) // n, 1)
    return _with_zero(model.sigmas[1::stride][::-1])


BETA_ALPHA = BETA_BETA = 0.6  # A1111's "Beta scheduler - alpha" and "- beta" settings' defaults


def beta(n: int, model: DiscreteModel) -> np.ndarray:
    """A1111's beta_scheduler (Lee et al. 2024, "Beta Sampling is All You Need"): quantiles of a
    Beta(0.6, 0.6) distribution at n evenly spaced points from 1 down to 0, mapped linearly onto
    [sigma_min, sigma_max] (in sigma, not in timesteps as ComfyUI's Beta is), in float64. (A1111
    calls scipy.stats.beta.ppf, which is this inverse incomplete beta function.)"""
    quantiles = special.betaincinv(BETA_ALPHA, BETA_BETA, 1 - np.linspace(0, 1, n))
    return _with_zero(model.sigma_min + quantiles * (model.sigma_max - model.sigma_min))


# A1111's schedule types by their labels (`sd_schedulers.schedulers`), but for "Automatic", which
# stands for the sampler's own default (`kdiffusion.SAMPLERS`).
SCHEDULES: dict[str, Callable[[int, DiscreteModel], np.ndarray]] = {
    "Uniform": uniform,
    "Karras": karras,
    "Exponential": exponential,
    "Polyexponential": polyexponential,
    "SGM Uniform": sgm_uniform,
    "KL Optimal": kl_optimal,
    "Align Your Steps": align_your_steps,
    "Simple": simple,
    "Normal": normal,
    "DDIM": ddim,
    "Beta": beta,
}
