"""The test oracle for sdxl.sampling.kdiffusion: k-diffusion's own sampling and external modules, and
AUTOMATIC1111's webui (1.10) around them, in torch.

k-diffusion 0.1.1.post1 is installed without its dependencies (requirements-dev.txt): its package
`__init__` imports its training and evaluation code (clip, clean-fid, wandb, kornia, ...). `kdiffusion()`
loads `k_diffusion.sampling` and `k_diffusion.external` alone, with their own `k_diffusion.utils`,
whose top-level torchvision import (for image helpers neither module calls) is answered by an empty
stand-in while it loads.

A transcription in spirit of webui's steps, written apart from sdxl.sampling (which it must not
import) so that the two can be held against each other:

- modules/sd_models_xl.py and ldm's DDPM: alphas_cumprod from float64 betas, held as float32, wrapped
  as k-diffusion's CompVisDenoiser (CompVisVDenoiser for v-prediction);
- modules/sd_schedulers.py: the schedule types, with the model's sigma_min and sigma_max;
- modules/sd_samplers_kdiffusion.py: the sampler table and `KDiffusionSampler.get_sigmas` (Automatic,
  discard_next_to_last_sigma), the starting latents noise * sigmas[0];
- modules/sd_samplers_common.py `TorchHijack`: k-diffusion's `torch.randn_like` answered by the
  per-image generators' next draw;
- modules/sd_samplers_extra.py: the Restart sampler;
- modules/rng.py and rng_philox.py: `ImageRNG`, one generator per image, torch's CPU generator or the
  "NV" Philox generator (numpy), variation seeds by `slerp`, ENSD;
- modules/processing.py and sd_samplers_cfg_denoiser.py: `txt2img`, a batch's seeds, its latents
  sampled with classifier-free guidance on the model's predictions, decoded; `hires_pass`, the hires
  fix's second pass (`sample_hr_pass`, sd_samplers_common.setup_img2img_steps, `sample_img2img`).
"""

import importlib
import itertools
import importlib.util
import math
import sys
import types
import warnings
from unittest import mock

import numpy as np
import torch
from scipy import stats
# Imported here, before `kdiffusion()` loads k_diffusion.sampling (which imports torchsde) under a
# patched sys.modules: what is first imported there is dropped from sys.modules afterwards, and a later
# import would patch another copy of the module than the one k-diffusion's trees call.
from torchsde._brownian import brownian_interval


def kdiffusion() -> tuple[types.ModuleType, types.ModuleType]:
    """(k_diffusion.sampling, k_diffusion.external), loaded without the package's other modules."""
    if "k_diffusion.sampling" in sys.modules:
        return sys.modules["k_diffusion.sampling"], sys.modules["k_diffusion.external"]
    package = types.ModuleType("k_diffusion")
    package.__path__ = list(importlib.util.find_spec("k_diffusion").submodule_search_locations)
    stand_ins = {name: types.ModuleType(name) for name in ("torchvision", "torchvision.transforms")}
    stand_ins["torchvision.transforms"].functional = types.ModuleType("torchvision.transforms.functional")
    with mock.patch.dict(sys.modules, {"k_diffusion": package, **stand_ins}):
        loaded = {name: importlib.import_module(name) for name in ("k_diffusion.utils", "k_diffusion.sampling",
                                                                    "k_diffusion.external")}
    sys.modules.update({"k_diffusion": package, **loaded})
    return loaded["k_diffusion.sampling"], loaded["k_diffusion.external"]


class CompVisModel(torch.nn.Module):
    """A CompVis model as k-diffusion's wrappers call it: `apply_model(x_in, t, cond)`, and its
    alphas_cumprod as A1111's models hold them (ldm's make_beta_schedule in float64, stored float32).
    `model(x_in, t)` gets [B, 1, 1, 1] timesteps, one per image, or with a conditioning
    `model(x_in, t, cond)`. With `zero_terminal_snr` (a `ztsnr` key, or the "Noise schedule" setting),
    alphas_cumprod as modules/sd_models.py's `apply_alpha_schedule_override` rescales them."""

    def __init__(self, model, beta_start=0.00085, beta_end=0.012, steps=1000, scaled_linear=True,
                 zero_terminal_snr=False):
        super().__init__()
        if scaled_linear:  # ldm's "linear"
            betas = torch.linspace(beta_start**0.5, beta_end**0.5, steps, dtype=torch.float64) ** 2
        else:
            betas = torch.linspace(beta_start, beta_end, steps, dtype=torch.float64)
        self.alphas_cumprod = torch.asarray(np.cumprod(1 - betas.numpy(), axis=0), dtype=torch.float32)
        if zero_terminal_snr:
            self.alphas_cumprod = rescale_zero_terminal_snr_abar(self.alphas_cumprod)
        self.model = model

    def apply_model(self, x, t, cond=None):
        t = t.reshape(-1, *[1] * (x.ndim - 1))
        return self.model(x, t) if cond is None else self.model(x, t, cond)


def rescale_zero_terminal_snr_abar(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """modules/sd_models.py's: sqrt(alphas_cumprod) shifted to end at 0 and scaled to keep its first value,
    in float32, its last value then set to a small positive one."""
    root = alphas_cumprod.sqrt()
    first, last = root[0].clone(), root[-1].clone()
    root -= last
    root *= first / (first - last)
    bar = root**2
    bar[-1] = 4.8973451890853435e-08
    return bar


def model_wrap(unet: CompVisModel, prediction_type: str = "epsilon"):
    """A1111's KDiffusionSampler.model_wrap: k-diffusion's denoiser for the model's parametrisation."""
    _, external = kdiffusion()
    wrapper = external.CompVisVDenoiser if prediction_type == "v_prediction" else external.CompVisDenoiser
    return wrapper(unet, quantize=False)


# modules/sd_schedulers.py: (n, sigma_min, sigma_max, inner_model, is_sdxl) -> sigmas.


def uniform(n, sigma_min, sigma_max, inner_model, is_sdxl):
    return inner_model.get_sigmas(n)


def karras(n, sigma_min, sigma_max, inner_model, is_sdxl):
    return kdiffusion()[0].get_sigmas_karras(n=n, sigma_min=sigma_min, sigma_max=sigma_max)


def exponential(n, sigma_min, sigma_max, inner_model, is_sdxl):
    return kdiffusion()[0].get_sigmas_exponential(n=n, sigma_min=sigma_min, sigma_max=sigma_max)


def polyexponential(n, sigma_min, sigma_max, inner_model, is_sdxl):
    return kdiffusion()[0].get_sigmas_polyexponential(n=n, sigma_min=sigma_min, sigma_max=sigma_max, rho=1.0)


def sgm_uniform(n, sigma_min, sigma_max, inner_model, is_sdxl):
    start = inner_model.sigma_to_t(torch.tensor(sigma_max))
    end = inner_model.sigma_to_t(torch.tensor(sigma_min))
    sigs = [inner_model.t_to_sigma(ts) for ts in torch.linspace(start, end, n + 1)[:-1]]
    return torch.FloatTensor(sigs + [0.0])


def align_your_steps(n, sigma_min, sigma_max, inner_model, is_sdxl):
    def loglinear_interp(t_steps, num_steps):
        xs = np.linspace(0, 1, len(t_steps))
        ys = np.log(t_steps[::-1])
        new_ys = np.interp(np.linspace(0, 1, num_steps), xs, ys)
        return np.exp(new_ys)[::-1].copy()

    if is_sdxl:
        sigmas = [14.615, 6.315, 3.771, 2.181, 1.342, 0.862, 0.555, 0.380, 0.234, 0.113, 0.029]
    else:
        sigmas = [14.615, 6.475, 3.861, 2.697, 1.886, 1.396, 0.963, 0.652, 0.399, 0.152, 0.029]
    if n != len(sigmas):
        sigmas = np.append(loglinear_interp(sigmas, n), [0.0])
    else:
        sigmas.append(0.0)
    return torch.FloatTensor(sigmas)


def kl_optimal(n, sigma_min, sigma_max, inner_model, is_sdxl):
    alpha_min = torch.arctan(torch.tensor(sigma_min))
    alpha_max = torch.arctan(torch.tensor(sigma_max))
    step_indices = torch.arange(n + 1)
    return torch.tan(step_indices / n * alpha_min + (1.0 - step_indices / n) * alpha_max)


def simple(n, sigma_min, sigma_max, inner_model, is_sdxl):
    ss = len(inner_model.sigmas) / n
    sigs = [float(inner_model.sigmas[-(1 + int(x * ss))]) for x in range(n)]
    return torch.FloatTensor(sigs + [0.0])


def normal(n, sigma_min, sigma_max, inner_model, is_sdxl):
    start = inner_model.sigma_to_t(torch.tensor(sigma_max))
    end = inner_model.sigma_to_t(torch.tensor(sigma_min))
    sigs = [inner_model.t_to_sigma(ts) for ts in torch.linspace(start, end, n)]
    return torch.FloatTensor(sigs + [0.0])


def ddim(n, sigma_min, sigma_max, inner_model, is_sdxl):
    sigs = []
    ss = max(len(inner_model.sigmas) // n, 1)
    x = 1
    while x < len(inner_model.sigmas):
        sigs += [float(inner_model.sigmas[x])]
        x += ss
    return torch.FloatTensor(sigs[::-1] + [0.0])


def beta(n, sigma_min, sigma_max, inner_model, is_sdxl):
    alpha, beta = 0.6, 0.6  # shared_options: beta_dist_alpha, beta_dist_beta
    timesteps = [stats.beta.ppf(x, alpha, beta) for x in 1 - np.linspace(0, 1, n)]
    return torch.FloatTensor([sigma_min + x * (sigma_max - sigma_min) for x in timesteps] + [0.0])


SCHEDULERS = {  # sd_schedulers.schedulers: name -> (label, function)
    "uniform": ("Uniform", uniform),
    "karras": ("Karras", karras),
    "exponential": ("Exponential", exponential),
    "polyexponential": ("Polyexponential", polyexponential),
    "sgm_uniform": ("SGM Uniform", sgm_uniform),
    "kl_optimal": ("KL Optimal", kl_optimal),
    "align_your_steps": ("Align Your Steps", align_your_steps),
    "simple": ("Simple", simple),
    "normal": ("Normal", normal),
    "ddim": ("DDIM", ddim),
    "beta": ("Beta", beta),
}
SCHEDULERS_MAP = {**{name: f for name, (_, f) in SCHEDULERS.items()}, **{label: f for label, f in SCHEDULERS.values()}}


def restart_sampler(model, x, sigmas, extra_args=None, callback=None, disable=None, s_noise=1.0, restart_list=None):
    """sd_samplers_extra.restart_sampler (Xu et al. 2023), its noise from k-diffusion's `torch.randn_like`."""
    sampling, _ = kdiffusion()
    extra_args = {} if extra_args is None else extra_args
    s_in = x.new_ones([x.shape[0]])

    def heun_step(x, old_sigma, new_sigma):
        denoised = model(x, old_sigma * s_in, **extra_args)
        d = sampling.to_d(x, old_sigma, denoised)
        dt = new_sigma - old_sigma
        if new_sigma == 0:
            return x + d * dt
        x_2 = x + d * dt
        denoised_2 = model(x_2, new_sigma * s_in, **extra_args)
        d_2 = sampling.to_d(x_2, new_sigma, denoised_2)
        return x + (d + d_2) / 2 * dt

    steps = sigmas.shape[0] - 1
    if restart_list is None:
        if steps >= 20:
            restart_steps, restart_times = 9, 1
            if steps >= 36:
                restart_steps, restart_times = steps // 4, 2
            sigmas = sampling.get_sigmas_karras(
                steps - restart_steps * restart_times, sigmas[-2].item(), sigmas[0].item()
            )
            restart_list = {0.1: [restart_steps + 1, restart_times, 2]}
        else:
            restart_list = {}
    restart_list = {int(torch.argmin(abs(sigmas - key), dim=0)): value for key, value in restart_list.items()}

    step_list = []
    for i in range(len(sigmas) - 1):
        step_list.append((sigmas[i], sigmas[i + 1]))
        if i + 1 in restart_list:
            restart_steps, restart_times, restart_max = restart_list[i + 1]
            min_idx = i + 1
            max_idx = int(torch.argmin(abs(sigmas - restart_max), dim=0))
            if max_idx < min_idx:
                sigma_restart = sampling.get_sigmas_karras(
                    restart_steps, sigmas[min_idx].item(), sigmas[max_idx].item()
                )[:-1]
                while restart_times > 0:
                    restart_times -= 1
                    step_list.extend(zip(sigma_restart[:-1], sigma_restart[1:]))

    last_sigma = None
    for old_sigma, new_sigma in step_list:
        if last_sigma is None:
            last_sigma = old_sigma
        elif last_sigma < old_sigma:
            x = x + sampling.torch.randn_like(x) * s_noise * (old_sigma**2 - last_sigma**2) ** 0.5
        x = heun_step(x, old_sigma, new_sigma)
        last_sigma = new_sigma
    return x


SAMPLERS = {  # sd_samplers_kdiffusion.samplers_k_diffusion (1.10): label -> (function, options)
    "DPM++ 2M": ("sample_dpmpp_2m", {"scheduler": "karras"}),
    "DPM++ SDE": ("sample_dpmpp_sde", {"scheduler": "karras", "second_order": True, "brownian_noise": True}),
    "DPM++ 2M SDE": ("sample_dpmpp_2m_sde", {"scheduler": "exponential", "brownian_noise": True}),
    "DPM++ 2M SDE Heun": (
        "sample_dpmpp_2m_sde", {"scheduler": "exponential", "brownian_noise": True, "solver_type": "heun"},
    ),
    "DPM++ 2S a": ("sample_dpmpp_2s_ancestral", {"scheduler": "karras", "uses_ensd": True, "second_order": True}),
    "DPM++ 3M SDE": (
        "sample_dpmpp_3m_sde", {"scheduler": "exponential", "discard_next_to_last_sigma": True, "brownian_noise": True},
    ),
    "Euler a": ("sample_euler_ancestral", {"uses_ensd": True}),
    "Euler": ("sample_euler", {}),
    "LMS": ("sample_lms", {}),
    "Heun": ("sample_heun", {"second_order": True}),
    "DPM2": ("sample_dpm_2", {"scheduler": "karras", "discard_next_to_last_sigma": True, "second_order": True}),
    "DPM2 a": (
        "sample_dpm_2_ancestral",
        {"scheduler": "karras", "discard_next_to_last_sigma": True, "uses_ensd": True, "second_order": True},
    ),
    "Restart": (restart_sampler, {"scheduler": "karras", "second_order": True}),
}


def get_sigmas(model_wrap, sampler_name: str, scheduler_name: str, steps: int, is_sdxl: bool = True):
    """KDiffusionSampler.get_sigmas with A1111's default settings."""
    options = SAMPLERS[sampler_name][1]
    discard_next_to_last_sigma = options.get("discard_next_to_last_sigma", False)
    steps += 1 if discard_next_to_last_sigma else 0
    if scheduler_name == "Automatic":
        scheduler_name = options.get("scheduler", None)
    scheduler = SCHEDULERS_MAP.get(scheduler_name)
    sigma_min, sigma_max = model_wrap.sigmas[0].item(), model_wrap.sigmas[-1].item()
    if scheduler is None:
        sigmas = model_wrap.get_sigmas(steps)
    else:
        sigmas = scheduler(steps, sigma_min, sigma_max, model_wrap, is_sdxl)
    if discard_next_to_last_sigma:
        sigmas = torch.cat([sigmas[:-2], sigmas[-1:]])
    return sigmas


class TorchHijack:
    """sd_samplers_common.TorchHijack: k-diffusion's `torch`, its `randn_like` the next given draw."""

    def __init__(self, draws):
        self.draws = iter(draws)

    def __getattr__(self, item):
        if item == "randn_like":
            return lambda x: next(self.draws)
        return getattr(torch, item)


def sample(sampler_name, model_wrap, x, sigmas, draws, noise_sampler=None):
    """KDiffusionSampler.sample and sample_img2img: the sampler's function run from latents x (noise *
    sigmas[0] from text; an image's latents noised to sigmas[0] for image to image, sigmas then the
    schedule's last ones).

    Args:
      draws: the later draws, in order: what `torch.randn_like` returns (the ancestral samplers,
        Restart), or the noise sampler's answers (the SDE samplers, given no `noise_sampler`).
      noise_sampler: the SDE samplers' `noise_sampler(sigma, sigma_next)`, as A1111 makes it
        (`brownian_noise_sampler`).
    """
    sampling, _ = kdiffusion()
    function, options = SAMPLERS[sampler_name]
    function = getattr(sampling, function) if isinstance(function, str) else function
    kwargs = {}
    if options.get("brownian_noise"):
        given = iter(draws)
        kwargs["noise_sampler"] = noise_sampler or (lambda sigma, sigma_next: next(given))
    if "solver_type" in options:
        kwargs["solver_type"] = options["solver_type"]
    with mock.patch.object(sampling, "torch", TorchHijack(draws)):
        return function(model_wrap, x, sigmas, extra_args={"cond": None}, disable=True, **kwargs)


def toy_model(x_in, t, xp):
    """A fixed stand-in for the UNet, the same in torch and JAX: nonlinear in its input and in the
    (fractional) timestep, near the noise a unit-variance image's noisy latents hold."""
    return x_in * xp.sin((t + 20) / 1020 * (math.pi / 2)) + 0.05 * xp.tanh(x_in) * xp.cos(t / 150)


# --- modules/rng_philox.py: the "NV" source, Philox-4x32-10 with a float64 Box-Muller, in numpy ------

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
TWO_POW32_INV = np.array([2.3283064e-10], dtype=np.float32)
TWO_POW32_INV_2PI = np.array([2.3283064e-10 * 6.2831855], dtype=np.float32)


def _words(x: np.ndarray) -> np.ndarray:
    """uint64 values as [2, n] uint32: low words, then high words."""
    return x.view(np.uint32).reshape(-1, 2).transpose(1, 0)


def _philox_round(counter, key):
    low_high_0 = _words(counter[0].astype(np.uint64) * PHILOX_M[0])
    low_high_2 = _words(counter[2].astype(np.uint64) * PHILOX_M[1])
    counter[0] = low_high_2[1] ^ counter[1] ^ key[0]
    counter[1] = low_high_2[0]
    counter[2] = low_high_0[1] ^ counter[3] ^ key[1]
    counter[3] = low_high_0[0]


class PhiloxGenerator:
    """rng_philox.Generator: draw k of `randn` is element i's Philox output at counter (k, 0, i, 0)."""

    def __init__(self, seed: int):
        self.seed, self.offset = seed, 0

    def randn(self, shape) -> np.ndarray:
        n = int(np.prod(shape))
        counter = np.zeros((4, n), dtype=np.uint32)
        counter[0] = self.offset
        counter[2] = np.arange(n, dtype=np.uint32)
        self.offset += 1
        key = _words(np.full(n, self.seed, dtype=np.uint64))
        for _ in range(9):
            _philox_round(counter, key)
            key[0] += PHILOX_W[0]
            key[1] += PHILOX_W[1]
        _philox_round(counter, key)
        u = counter[0] * TWO_POW32_INV + TWO_POW32_INV / 2
        v = counter[1] * TWO_POW32_INV_2PI + TWO_POW32_INV_2PI / 2
        return (np.sqrt(-2.0 * np.log(u)) * np.sin(v)).astype(np.float32).reshape(shape)


# --- modules/rng.py ---------------------------------------------------------------------------------


def create_generator(source: str, seed: int):
    return PhiloxGenerator(seed) if source == "NV" else torch.Generator().manual_seed(seed)


def randn_local(source: str, seed: int, shape) -> torch.Tensor:
    """devices.randn_local: a fresh generator's first draw."""
    return randn(source, create_generator(source, int(seed)), tuple(shape))


def randn(source: str, generator, shape) -> torch.Tensor:
    if source == "NV":
        return torch.asarray(generator.randn(shape))
    return torch.randn(shape, generator=generator)


def slerp(strength, low, high):
    """rng.slerp on one image's [C, H, W]: an angle per (channel, column), along H."""
    low_unit, high_unit = low / low.norm(dim=1, keepdim=True), high / high.norm(dim=1, keepdim=True)
    cosine = (low_unit * high_unit).sum(1)
    if cosine.mean() > 0.9995:
        return low * strength + high * (1 - strength)
    angle = torch.acos(cosine)
    low_weight = torch.sin((1.0 - strength) * angle) / torch.sin(angle)
    high_weight = torch.sin(strength * angle) / torch.sin(angle)
    return low_weight.unsqueeze(1) * low + high_weight.unsqueeze(1) * high


class ImageRNG:
    """rng.ImageRNG: one generator per image; `next()` is the starting noise first, then the later draws."""

    def __init__(self, shape, seeds, subseeds=None, subseed_strength=0.0, ensd=0, seed_resize_from=(0, 0),
                 source="CPU"):
        self.shape, self.seeds, self.subseeds, self.strength, self.ensd = shape, seeds, subseeds, subseed_strength, ensd
        self.source = source
        height, width = seed_resize_from
        self.noise_shape = shape if height <= 0 or width <= 0 else (shape[0], height // 8, width // 8)
        self.generators = [create_generator(source, s) for s in seeds]
        self.drawn_first = False

    def _fresh(self, seed, shape):
        return randn(self.source, create_generator(self.source, seed), shape)

    def next(self):
        if not self.drawn_first:
            self.drawn_first = True
            return self.first()
        return torch.stack([randn(self.source, g, self.shape) for g in self.generators])

    def first(self):
        images = []
        for i, (seed, g) in enumerate(zip(self.seeds, self.generators)):
            resized = self.noise_shape != self.shape
            x = self._fresh(seed, self.noise_shape) if resized else randn(self.source, g, self.shape)
            if self.subseeds is not None and self.strength != 0:
                subseed = self.subseeds[i] if i < len(self.subseeds) else 0
                x = slerp(self.strength, x, self._fresh(subseed, self.noise_shape))
            if resized:  # the paste: centred, cropped, its row and column counts as A1111 computes them
                canvas = randn(self.source, g, self.shape)
                dx, dy = (self.shape[2] - self.noise_shape[2]) // 2, (self.shape[1] - self.noise_shape[1]) // 2
                w = self.noise_shape[2] if dx >= 0 else self.noise_shape[2] + 2 * dx
                h = self.noise_shape[1] if dy >= 0 else self.noise_shape[1] + 2 * dy
                tx, ty, sx, sy = max(dx, 0), max(dy, 0), max(-dx, 0), max(-dy, 0)
                canvas[:, ty:ty + h, tx:tx + w] = x[:, sy:sy + h, sx:sx + w]
                x = canvas
            images.append(x)
        if self.ensd:
            self.generators = [create_generator(self.source, s + self.ensd) for s in self.seeds]
        return torch.stack(images)


# --- modules/processing.py txt2img, for a model given as a CompVis-style `apply_model` ---------------


class CFGDenoiser:
    """sd_samplers_cfg_denoiser.CFGDenoiser for one prompt per image: the model's denoised predictions
    of the prompts and the negative prompts, mixed as uncond + (cond - uncond) * cfg_scale.

    A conditioning is a dict, or a prompt schedule [(end_at_step, dict), ...] (prompt editing), of which
    each call reads what `prompt_parser.reconstruct_cond_batch` picks at `self.step`: the calls so far."""

    def __init__(self, model_wrap, cond, uncond, cfg_scale: float):
        self.model_wrap, self.cond, self.uncond, self.cfg_scale = model_wrap, cond, uncond, cfg_scale
        self.step = 0

    def __call__(self, x, sigma, **extra_args):
        cond, uncond = scheduled(self.cond, self.step), scheduled(self.uncond, self.step)
        both = {key: torch.cat([cond[key], uncond[key]]) for key in cond}
        out = self.model_wrap(torch.cat([x, x]), torch.cat([sigma, sigma]), cond=both)
        denoised, denoised_uncond = out.chunk(2)
        self.step += 1
        return denoised_uncond + (denoised - denoised_uncond) * self.cfg_scale


def scheduled(conditioning, current_step: int) -> dict:
    """A conditioning dict as it is, or a schedule's entry at `current_step`: the first whose end_at_step is
    at least it, else the first (`reconstruct_cond_batch`)."""
    if isinstance(conditioning, dict):
        return conditioning
    return next((cond for end, cond in conditioning if current_step <= end), conditioning[0][1])


def txt2img(model_wrap, cond: dict, uncond: dict, *, sampler: str, scheduler: str, steps: int, cfg_scale: float,
            seed: int, subseed: int, subseed_strength: float, ensd: int, source: str, shape) -> torch.Tensor:
    """[B, C, h, w] the latents A1111 samples for a batch of B images (B = the conditioning's), from
    its first seed: processing.py's seeds (seed + i; with a variation strength the seed stays and the
    variation seeds advance), ImageRNG's starting noise times sigmas[0], then the sampler's function
    with the later draws from the same ImageRNG (`sample`), or for the SDE samplers from Brownian trees
    seeded with the images' seeds."""
    n = len(next(iter(scheduled(cond, 0).values())))
    seeds = [seed + (i if subseed_strength == 0 else 0) for i in range(n)]
    rng = ImageRNG(shape, seeds, [subseed + i for i in range(n)], subseed_strength, ensd, source=source)
    sigmas = get_sigmas(model_wrap, sampler, scheduler, steps)
    x = rng.next() * sigmas[0]
    return _sampled(sampler, CFGDenoiser(model_wrap, cond, uncond, cfg_scale), x, sigmas, sigmas, rng, seeds, source)


def setup_img2img_steps(steps: int, strength: float) -> tuple[int, int]:
    """sd_samplers_common.setup_img2img_steps with the steps given, as the hires pass always gives
    them: (the schedule's steps, t_enc)."""
    return (int(steps / min(strength, 0.999)) if strength > 0 else 0), steps - 1


def hires_pass(model_wrap, cond: dict, uncond: dict, x, *, sampler: str, scheduler: str, steps: int, strength: float,
               cfg_scale: float, seed: int, subseed: int, subseed_strength: float, ensd: int,
               source: str) -> torch.Tensor:
    """[B, C, h, w] processing.py's `sample_hr_pass` from upscaled latents x [B, C, h, w]: a fresh
    ImageRNG of the batch's seeds at x's shape, and `KDiffusionSampler.sample_img2img`: the schedule
    of `setup_img2img_steps`, its last t_enc + 1 steps run from x + noise * their first sigma, the SDE
    samplers' Brownian trees spanning the whole schedule."""
    n = len(x)
    seeds = [seed + (i if subseed_strength == 0 else 0) for i in range(n)]
    rng = ImageRNG(tuple(x.shape[1:]), seeds, [subseed + i for i in range(n)], subseed_strength, ensd, source=source)
    noise = rng.next()
    total, t_enc = setup_img2img_steps(steps, strength)
    sigmas = get_sigmas(model_wrap, sampler, scheduler, total)
    sigma_sched = sigmas[total - t_enc - 1:]
    denoiser = CFGDenoiser(model_wrap, cond, uncond, cfg_scale)
    return _sampled(sampler, denoiser, x + noise * sigma_sched[0], sigma_sched, sigmas, rng, seeds, source)


def _sampled(sampler, denoiser, x, sigmas, tree_sigmas, rng: ImageRNG, seeds, source) -> torch.Tensor:
    """The sampler run from x over `sigmas`, its later draws the ImageRNG's, or for the SDE samplers
    those of Brownian trees over `tree_sigmas` seeded with the images' seeds."""
    draws = (rng.next() for _ in itertools.count())
    if not SAMPLERS[sampler][1].get("brownian_noise"):
        return sample(sampler, denoiser, x, sigmas, draws)
    # sd_samplers_common.create_noise_sampler, over torchsde with A1111's generator (replace_torchsde_browinan).
    sampling, _ = kdiffusion()
    with mock.patch.object(brownian_interval, "_randn",
                           lambda size, dtype, device, seed: randn_local(source, seed, size).to(device, dtype)), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchsde's, for the float32 ends just outside the tree's rounded ones
        # Built within: a tree draws its root's increment when it is made.
        low, high = tree_sigmas[tree_sigmas > 0].min(), tree_sigmas.max()
        noise_sampler = sampling.BrownianTreeNoiseSampler(x, low, high, seed=seeds)
        return sample(sampler, denoiser, x, sigmas, draws, noise_sampler)
