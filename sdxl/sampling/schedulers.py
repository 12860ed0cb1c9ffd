"""Noise schedules, computed on the host exactly as diffusers' schedulers compute them.

Each `*_schedule(config, num_steps, max_steps)` reproduces one diffusers scheduler's
`set_timesteps(num_steps)` in numpy (float64 where diffusers works in float64, float32 where it works
in float32) and pads the result to `max_steps`, so that one compiled sampling loop serves every step
count: the step count is a traced loop bound and the padding is never read.

Noise levels are k-diffusion sigmas: the noisy latent is x = x0 + sigma * noise, and the
variance-preserving sample a diffusers UNet is trained on is x / sqrt(sigma^2 + 1).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

TIMESTEP_SPACINGS = ("linspace", "leading", "trailing")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
# The scheduler config of a model trained with zero terminal SNR (a single file's `ztsnr` key, or
# asked for): Lin et al. 2023's rescaled betas, with steps that start at the last timestep, where the
# rescaled noise is pure noise ("trailing" spacing, which they and diffusers' docs pair with it).
ZERO_TERMINAL_SNR = {"rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """`scheduler/scheduler_config.json`, in the vocabulary shared by diffusers' scheduler classes.

    Defaults are EulerDiscreteScheduler's, except where noted. Checkpoints ship the config of one
    scheduler class (`_class_name`: PNDMScheduler for SD 1.5, EulerDiscreteScheduler for SDXL); like
    diffusers' `SomeScheduler.from_config`, every schedule below reads the fields it knows from it.
    """

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: tuple[float, ...] | None = None
    prediction_type: str = "epsilon"
    # None when the JSON does not say: each schedule then applies its own diffusers class's default
    # ("leading" for DDIM, "linspace" for the others), as `from_config` would.
    timestep_spacing: str | None = None
    steps_offset: int = 0
    interpolation_type: str = "linear"
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    sigma_min: float | None = None
    sigma_max: float | None = None
    final_sigmas_type: str = "zero"
    timestep_type: str = "discrete"
    rescale_betas_zero_snr: bool = False
    # DDIM (and PNDM) fields, with DDIMScheduler's defaults.
    set_alpha_to_one: bool = True
    clip_sample: bool = True
    thresholding: bool = False
    # PNDM's: whether it starts with Runge-Kutta steps (False, its class default) or not (SD 1.x's).
    skip_prk_steps: bool = False
    # LCMScheduler's: the distillation schedule's step count, and its boundary condition's time scale.
    original_inference_steps: int = 50
    timestep_scaling: float = 10.0

    def __post_init__(self):
        supported = {
            "beta_schedule": ("linear", "scaled_linear"),
            "trained_betas": (None,),
            "prediction_type": PREDICTION_TYPES,
            "timestep_spacing": (None, *TIMESTEP_SPACINGS),
            "interpolation_type": ("linear",),
            "use_exponential_sigmas": (False, None),
            "use_beta_sigmas": (False, None),
            "sigma_min": (None,),
            "sigma_max": (None,),
            "final_sigmas_type": ("zero", "sigma_min"),
            "timestep_type": ("discrete",),
        }
        for name, values in supported.items():
            if getattr(self, name) not in values:
                raise ValueError(f"scheduler config: {name}={getattr(self, name)!r} is not supported (only {values})")


@struct.dataclass
class Schedule:
    """A padded noise schedule; entries past the step count are copies of the last real one.

    Attributes:
      sigmas: [max_steps + 1] float32, the noise level the denoiser sees at each step, then the
        level the last step ends at (0, or sigma_min for final_sigmas_type="sigma_min").
      timesteps: [max_steps] float32, the UNet's timestep at each step, as diffusers passes it.
      init_noise_sigma: [] float32, diffusers' `scheduler.init_noise_sigma`: the sampler starts from
        standard normal noise times this.
      num_steps: [] int32, the steps it holds: the sampler's loop runs `Sampler.evaluations` of it
        (a traced input, so that another step count never recompiles; `int()` on the host).
    """

    sigmas: jax.Array
    timesteps: jax.Array
    init_noise_sigma: jax.Array
    num_steps: jax.Array


@struct.dataclass
class DDIMSchedule(Schedule):
    """A DDIM schedule, whose step i goes to `target_sigmas[i]` rather than to `sigmas[i + 1]`.

    Attributes:
      target_sigmas: [max_steps] float32. diffusers' DDIM steps from timestep t to
        t - num_train_timesteps // num_steps, which is the next timestep only for "leading" spacing.
    """

    target_sigmas: jax.Array


@struct.dataclass
class PNDMSchedule(Schedule):
    """PNDM's pseudo linear multistep (PLMS) schedule: `num_steps + 1` model evaluations (1 for one
    step), whose timesteps are `timesteps`; evaluation i turns the variance-preserving sample x into
    `sample_coeffs[i] * x - eps_coeffs[i] * eps`, diffusers' `PNDMScheduler._get_prev_sample`.

    Attributes ([max_steps + 1] each, padded):
      sample_coeffs, eps_coeffs: the step's coefficients.
      eps_weights: [max_steps + 1, 4] the weights of the new noise prediction and the last three
        kept ones in the prediction the step uses (Adams-Bashforth of growing order).
      keep: 1 where the new prediction joins the history (all but the second evaluation, which
        averages with the first and re-steps from the first one's sample: `restart`).
      restart: 1 at the second evaluation only.
    """

    sample_coeffs: jax.Array
    eps_coeffs: jax.Array
    eps_weights: jax.Array
    keep: jax.Array
    restart: jax.Array


@struct.dataclass
class LCMSchedule(Schedule):
    """A latent consistency model's schedule: the boundary condition's scalings at each step.

    Attributes:
      c_skip, c_out: [max_steps] float32; step i's denoised latents are c_out * the model's clean
        prediction + c_skip * the variance-preserving sample.
    """

    c_skip: jax.Array
    c_out: jax.Array


@struct.dataclass
class TCDSchedule(Schedule):
    """A trajectory consistency distillation schedule.

    Attributes:
      gamma_sigmas: [max_steps] float32; step i jumps to the noise level of timestep
        floor((1 - gamma) * the next timestep), before noising back up to the next one's.
    """

    gamma_sigmas: jax.Array


def _cumprod(alphas: np.ndarray) -> np.ndarray:
    """torch.cumprod of float32 values, which on CPU accumulates in float64."""
    return np.cumprod(alphas.astype(np.float64)).astype(np.float32)


def zero_terminal_snr(alphas_cumprod: np.ndarray) -> np.ndarray:
    """[T] float32 alphas_cumprod rescaled so that the last timestep is pure noise (Lin et al. 2023,
    Algorithm 1): sqrt(alphas_cumprod) shifted to end at 0 and scaled to keep its first value, in
    float32 as diffusers and A1111 compute it."""
    root = np.sqrt(alphas_cumprod.astype(np.float32))
    first, last = root[0], root[-1]
    return ((root - last) * (first / (first - last))) ** 2


def _zero_terminal_snr_betas(betas: np.ndarray) -> np.ndarray:
    """diffusers' `rescale_zero_terminal_snr`: [T] float32 betas whose cumulative product is
    `zero_terminal_snr`'s."""
    bar = zero_terminal_snr(_cumprod(1 - betas))
    return 1 - np.concatenate([bar[:1], bar[1:] / bar[:-1]])


def alphas_cumprod(config: SchedulerConfig) -> np.ndarray:
    """[num_train_timesteps] float32 cumulative products of (1 - beta), bit-compatible with diffusers.

    diffusers builds float32 betas with torch.linspace and takes torch.cumprod, which on CPU
    accumulates in float64. The betas here are the correctly rounded float32 values; torch's float32
    linspace can differ from them in the last bit, which moves these by at most about 4e-7 relative.
    With `rescale_betas_zero_snr` the last value is 0: pure noise.
    """
    steps = config.num_train_timesteps
    if config.beta_schedule == "linear":
        betas = np.linspace(config.beta_start, config.beta_end, steps).astype(np.float32)
    else:  # "scaled_linear": linear in sqrt(beta), the latent diffusion schedule.
        betas = np.linspace(config.beta_start**0.5, config.beta_end**0.5, steps).astype(np.float32) ** 2
    if config.rescale_betas_zero_snr:
        betas = _zero_terminal_snr_betas(betas)
    return _cumprod(1 - betas)


def _sigmas_from_alphas_cumprod(alphas_cumprod: np.ndarray) -> np.ndarray:
    return np.sqrt((1 - alphas_cumprod) / alphas_cumprod)


# The last alphas_cumprod of a zero-terminal-SNR schedule for diffusers' Euler, Euler ancestral and
# DPM-Solver++ schedulers: "close to 0 without being 0 so first sigma is not inf" (float16's smallest
# subnormal), a noise level of about 4096.
_ZERO_SNR_LAST_ALPHA_CUMPROD = np.float32(2**-24)


def train_sigmas(config: SchedulerConfig) -> np.ndarray:
    """[num_train_timesteps] float32 noise level of each training timestep, increasing (for zero terminal
    SNR, the last one finite, as diffusers' sigma-based schedulers hold it)."""
    cumprod = alphas_cumprod(config)
    if config.rescale_betas_zero_snr:
        cumprod[-1] = _ZERO_SNR_LAST_ALPHA_CUMPROD
    return _sigmas_from_alphas_cumprod(cumprod)


def _refuse_zero_snr(config: SchedulerConfig, scheduler: str) -> None:
    """Zero terminal SNR runs on the sigma-based schedulers only (Euler, Euler ancestral, DPM-Solver++):
    the others step from the infinite noise level of its last timestep."""
    if config.rescale_betas_zero_snr:
        raise ValueError(f"scheduler config: {scheduler} with rescale_betas_zero_snr is not implemented; choose "
                         "Euler, Euler a or DPM++ 2M")


def _spaced_timesteps(config: SchedulerConfig, spacing: str, num_steps: int, round_linspace: bool) -> np.ndarray:
    """[num_steps] float64 decreasing timesteps, spaced as in the table 2 of Lin et al. 2023.

    "leading" and "trailing" give integers, "linspace" fractions unless `round_linspace`.
    """
    steps = config.num_train_timesteps
    if spacing == "linspace":
        timesteps = np.linspace(0, steps - 1, num_steps)[::-1]
        return timesteps.round() if round_linspace else timesteps
    if spacing == "leading":
        return (np.arange(num_steps) * (steps // num_steps)).round()[::-1] + config.steps_offset
    timesteps = np.arange(steps, 0, -steps / num_steps).round() - 1
    if len(timesteps) != num_steps:
        # np.arange's float step overshoots for some counts (61, 103, ...): diffusers then runs an
        # extra step at timestep -1.
        raise ValueError(f"'trailing' spacing gives {len(timesteps)} timesteps for {num_steps} steps in diffusers")
    return timesteps


def _karras_sigmas(sigma_min: float, sigma_max: float, num_steps: int, rho: float = 7.0) -> np.ndarray:
    """[num_steps] float64 decreasing sigmas, evenly spaced in sigma^(1/rho) (Karras et al. 2022, eq. 5)."""
    ramp = np.linspace(0, 1, num_steps)
    max_inv_rho, min_inv_rho = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho


def _sigma_to_t(sigmas: np.ndarray, log_train_sigmas: np.ndarray) -> np.ndarray:
    """Fractional timesteps whose noise levels are `sigmas`, interpolating linearly in log sigma."""
    log_sigmas = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigmas - log_train_sigmas[:, None]  # [T, N]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=len(log_train_sigmas) - 2)
    w = (log_train_sigmas[low] - log_sigmas) / (log_train_sigmas[low] - log_train_sigmas[low + 1])
    w = np.clip(w, 0, 1)
    return (1 - w) * low + w * (low + 1)


def _final_sigma(config: SchedulerConfig, sigmas_of_train: np.ndarray) -> np.float32:
    return sigmas_of_train[0] if config.final_sigmas_type == "sigma_min" else np.float32(0)


def _padded(values: np.ndarray, length: int) -> jax.Array:
    values = np.asarray(values, np.float32)
    return jnp.asarray(np.pad(values, (0, length - len(values)), mode="edge"))


def _check_steps(num_steps: int, max_steps: int) -> None:
    if not 1 <= num_steps <= max_steps:
        raise ValueError(f"num_steps={num_steps} must be between 1 and max_steps={max_steps}")


def _schedule_fields(sigmas, timesteps, init_noise_sigma, max_steps: int, num_steps: int) -> dict:
    return {
        "sigmas": _padded(sigmas, max_steps + 1),
        "timesteps": _padded(timesteps, max_steps),
        "init_noise_sigma": jnp.float32(init_noise_sigma),
        "num_steps": np.int32(num_steps),
    }


def euler_schedule(config: SchedulerConfig, num_steps: int, max_steps: int) -> Schedule:
    """EulerDiscreteScheduler.set_timesteps(num_steps), padded to max_steps.

    Args:
      config: the checkpoint's scheduler config.
      num_steps: the number of denoising steps, 1 <= num_steps <= max_steps.
      max_steps: the padded length (static in the compiled sampler).

    Returns:
      The schedule: timesteps spaced per config.timestep_spacing, sigmas interpolated linearly in
      the timestep (or Karras sigmas), ending in the final sigma.
    """
    _check_steps(num_steps, max_steps)
    spacing = config.timestep_spacing or "linspace"
    # diffusers interpolates at float32 timesteps.
    timesteps = _spaced_timesteps(config, spacing, num_steps, round_linspace=False).astype(np.float32)
    sigmas_of_train = train_sigmas(config)
    sigmas = np.interp(timesteps, np.arange(len(sigmas_of_train)), sigmas_of_train)  # float64
    if config.use_karras_sigmas:
        sigmas = _karras_sigmas(sigmas[-1], sigmas[0], num_steps)
        timesteps = _sigma_to_t(sigmas, np.log(sigmas_of_train))
    sigmas = np.append(sigmas, _final_sigma(config, sigmas_of_train)).astype(np.float32)
    # For "leading" spacing the first sigma is below the largest training one, and diffusers starts
    # from the variance-preserving noise level instead.
    init_noise_sigma = sigmas.max() if spacing in ("linspace", "trailing") else np.sqrt(sigmas.max() ** 2 + 1)
    return Schedule(**_schedule_fields(sigmas, timesteps, init_noise_sigma, max_steps, num_steps))


def euler_ancestral_schedule(config: SchedulerConfig, num_steps: int, max_steps: int) -> Schedule:
    """EulerAncestralDiscreteScheduler.set_timesteps(num_steps), padded to max_steps.

    That scheduler has no Karras or final-sigma options: it is Euler's schedule with interpolated
    sigmas ending in 0, whatever the config says about those.
    """
    plain = dataclasses.replace(config, use_karras_sigmas=False, final_sigmas_type="zero")
    return euler_schedule(plain, num_steps, max_steps)


def dpmpp_2m_schedule(config: SchedulerConfig, num_steps: int, max_steps: int) -> Schedule:
    """DPMSolverMultistepScheduler.set_timesteps(num_steps), padded to max_steps.

    Integer timesteps; with use_karras_sigmas, Karras sigmas over the whole training range and their
    timesteps rounded. The sampler's x is diffusers' variance-preserving sample, so it starts at
    unit variance.
    """
    _check_steps(num_steps, max_steps)
    if config.thresholding:
        raise ValueError("scheduler config: thresholding is not supported")
    spacing = config.timestep_spacing or "linspace"
    if spacing == "trailing":
        timesteps = _spaced_timesteps(config, spacing, num_steps, round_linspace=True)
    else:
        # diffusers spaces num_steps + 1 points and drops the lowest one.
        timesteps = _spaced_timesteps(config, spacing, num_steps + 1, round_linspace=True)[:-1]
    sigmas_of_train = train_sigmas(config)
    if config.use_karras_sigmas:
        sigmas = _karras_sigmas(sigmas_of_train[0].item(), sigmas_of_train[-1].item(), num_steps)
        timesteps = _sigma_to_t(sigmas, np.log(sigmas_of_train)).round()
    else:
        sigmas = np.interp(timesteps, np.arange(len(sigmas_of_train)), sigmas_of_train)
    sigmas = np.append(sigmas, _final_sigma(config, sigmas_of_train))
    return Schedule(**_schedule_fields(sigmas, timesteps, 1.0, max_steps, num_steps))


def dpmpp_2m_karras_schedule(config: SchedulerConfig, num_steps: int, max_steps: int) -> Schedule:
    """`dpmpp_2m_schedule` with Karras sigmas, as diffusers with use_karras_sigmas=True."""
    return dpmpp_2m_schedule(dataclasses.replace(config, use_karras_sigmas=True), num_steps, max_steps)


def ddim_schedule(config: SchedulerConfig, num_steps: int, max_steps: int) -> DDIMSchedule:
    """DDIMScheduler.set_timesteps(num_steps), padded to max_steps.

    The last step goes to alphas_cumprod = 1 (sigma 0) with set_alpha_to_one, else to the first
    training timestep's. The sampler's x is diffusers' variance-preserving sample, so it starts at
    unit variance.
    """
    _check_steps(num_steps, max_steps)
    if config.clip_sample or config.thresholding:
        raise ValueError("scheduler config: DDIM's clip_sample and thresholding are not supported")
    _refuse_zero_snr(config, "DDIM")
    spacing = config.timestep_spacing or "leading"
    timesteps = _spaced_timesteps(config, spacing, num_steps, round_linspace=True).astype(np.int64)
    cumprod = alphas_cumprod(config)
    final_cumprod = np.float32(1) if config.set_alpha_to_one else cumprod[0]
    targets = timesteps - config.num_train_timesteps // num_steps
    target_cumprod = np.where(targets >= 0, cumprod[targets.clip(min=0)], final_cumprod)
    sigmas = _sigmas_from_alphas_cumprod(cumprod[timesteps])
    target_sigmas = _sigmas_from_alphas_cumprod(target_cumprod)
    return DDIMSchedule(
        **_schedule_fields(np.append(sigmas, target_sigmas[-1]), timesteps, 1.0, max_steps, num_steps),
        target_sigmas=_padded(target_sigmas, max_steps),
    )


# PLMS's weights of (the new noise prediction, the three kept before it), by how many are kept.
_PLMS_WEIGHTS = {
    1: (1, 0, 0, 0),
    2: (3 / 2, -1 / 2, 0, 0),
    3: (23 / 12, -16 / 12, 5 / 12, 0),
    4: (55 / 24, -59 / 24, 37 / 24, -9 / 24),
}


def pndm_schedule(config: SchedulerConfig, num_steps: int, max_steps: int) -> PNDMSchedule:
    """PNDMScheduler.set_timesteps(num_steps) with skip_prk_steps (the PLMS sampler SD 1.x ships
    with), padded to max_steps + 1 evaluations."""
    _check_steps(num_steps, max_steps)
    if config.prediction_type != "epsilon":
        raise ValueError("scheduler config: PNDM with prediction_type 'v_prediction' is not implemented")
    _refuse_zero_snr(config, "PLMS")
    if not config.skip_prk_steps:
        raise ValueError("scheduler config: PNDM's Runge-Kutta steps (skip_prk_steps=false) are not implemented")
    ascending = _spaced_timesteps(config, config.timestep_spacing or "leading", num_steps, True)[::-1]
    ascending = ascending.astype(np.int64)
    timesteps = np.concatenate([ascending[:-1], ascending[-2:-1], ascending[-1:]])[::-1]
    ratio = config.num_train_timesteps // num_steps
    cumprod = alphas_cumprod(config).astype(np.float64)
    final_cumprod = 1.0 if config.set_alpha_to_one else cumprod[0]
    fields = {name: [] for name in ("sample_coeffs", "eps_coeffs", "eps_weights", "keep", "restart")}
    for i, t in enumerate(timesteps):
        # The second evaluation steps again from the first's sample and timestep (diffusers' counter == 1).
        t_from, t_to = (t + ratio, t) if i == 1 else (t, t - ratio)
        a, a_next = cumprod[t_from], (cumprod[t_to] if t_to >= 0 else final_cumprod)
        fields["sample_coeffs"].append(np.sqrt(a_next / a))
        fields["eps_coeffs"].append((a_next - a) / (a * np.sqrt(1 - a_next) + np.sqrt(a * (1 - a) * a_next)))
        fields["eps_weights"].append((0.5, 0.5, 0, 0) if i == 1 else _PLMS_WEIGHTS[min(max(i, 1), 4)])
        fields["keep"].append(float(i != 1))
        fields["restart"].append(float(i == 1))
    length = max_steps + 1
    sigmas = _sigmas_from_alphas_cumprod(cumprod[timesteps])
    weights = np.asarray(fields.pop("eps_weights"), np.float32)
    return PNDMSchedule(
        **_schedule_fields(np.append(sigmas, 0), timesteps, 1.0, length, num_steps),
        **{name: _padded(values, length) for name, values in fields.items()},
        eps_weights=jnp.asarray(np.pad(weights, ((0, length - len(weights)), (0, 0)), mode="edge")),
    )


def _distilled_timesteps(config: SchedulerConfig, num_steps: int) -> np.ndarray:
    """[num_steps] int64: `num_steps` evenly spaced (by index) of the distillation schedule's
    `original_inference_steps` timesteps 999, 979, ..., 19, as LCMScheduler and TCDScheduler take them."""
    original = config.original_inference_steps
    if num_steps > original:
        raise ValueError(f"at most original_inference_steps={original} steps, got {num_steps}")
    k = config.num_train_timesteps // original
    distilled = (np.arange(1, original + 1) * k - 1)[::-1]
    return distilled[np.floor(np.linspace(0, original, num_steps, endpoint=False)).astype(np.int64)]


def lcm_schedule(config: SchedulerConfig, num_steps: int, max_steps: int) -> LCMSchedule:
    """LCMScheduler.set_timesteps(num_steps), padded to max_steps: `num_steps` evenly spaced (by index)
    of the distillation schedule's `original_inference_steps` timesteps 999, 979, ..., 19."""
    _check_steps(num_steps, max_steps)
    if config.clip_sample or config.thresholding:
        raise ValueError("scheduler config: LCM's clip_sample and thresholding are not supported")
    _refuse_zero_snr(config, "LCM")
    timesteps = _distilled_timesteps(config, num_steps)
    sigmas = _sigmas_from_alphas_cumprod(alphas_cumprod(config)[timesteps])
    scaled = timesteps * np.float32(config.timestep_scaling)
    sigma_data = 0.5  # the consistency models' data standard deviation, as diffusers fixes it
    c_skip = sigma_data**2 / (scaled**2 + sigma_data**2)
    c_out = scaled / np.sqrt(scaled**2 + sigma_data**2)
    return LCMSchedule(
        **_schedule_fields(np.append(sigmas, 0), timesteps, 1.0, max_steps, num_steps),
        c_skip=_padded(c_skip, max_steps), c_out=_padded(c_out, max_steps),
    )


TCD_GAMMA = 0.3  # TCD's stochasticity ("eta" in diffusers' TCDScheduler.step), as its authors recommend


def tcd_schedule(config: SchedulerConfig, num_steps: int, max_steps: int) -> TCDSchedule:
    """TCDScheduler.set_timesteps(num_steps) with gamma `TCD_GAMMA`, padded to max_steps."""
    _check_steps(num_steps, max_steps)
    _refuse_zero_snr(config, "TCD")
    timesteps = _distilled_timesteps(config, num_steps)
    cumprod = alphas_cumprod(config)
    following = np.append(timesteps[1:], 0)  # diffusers' prev_timestep: 0 after the last step
    gamma_timesteps = np.floor((1 - np.float32(TCD_GAMMA)) * following).astype(np.int64)
    sigmas = _sigmas_from_alphas_cumprod(cumprod[timesteps])
    return TCDSchedule(
        **_schedule_fields(np.append(sigmas, 0), timesteps, 1.0, max_steps, num_steps),
        gamma_sigmas=_padded(_sigmas_from_alphas_cumprod(cumprod[gamma_timesteps]), max_steps),
    )
