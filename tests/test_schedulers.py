"""Schedules against diffusers' schedulers' set_timesteps, for the SDXL and SD 1.5 scheduler configs."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
)

from sdxl.checkpoints import random_models
from sdxl.config import config_from_dict, config_from_file, read_json
from sdxl.sampling import schedulers
from sdxl.sampling.schedulers import SchedulerConfig

SDXL_SCHEDULER_JSON = Path(__file__).parent.parent / "sdxl/configs/sdxl-base-1.0/scheduler/scheduler_config.json"
SDXL_SCHEDULER_CONFIG = read_json(SDXL_SCHEDULER_JSON)
# stable-diffusion-v1-5's scheduler/scheduler_config.json: a PNDM config without timestep_spacing.
SD15_SCHEDULER_CONFIG = random_models.SD1_CONFIGS["scheduler/scheduler_config.json"]
VARIANTS = {
    "as shipped": {},
    "leading": {"timestep_spacing": "leading"},
    "trailing": {"timestep_spacing": "trailing"},
    "linspace": {"timestep_spacing": "linspace"},
    "karras": {"use_karras_sigmas": True},
    "sigma_min": {"final_sigmas_type": "sigma_min", "timestep_spacing": "trailing"},
    "linear v": {"beta_schedule": "linear", "beta_start": 0.0001, "beta_end": 0.02, "prediction_type": "v_prediction"},
    # Zero terminal SNR: its first noise level the finite one diffusers sets for the last timestep.
    "zero snr": {"rescale_betas_zero_snr": True, "timestep_spacing": "trailing", "prediction_type": "v_prediction"},
    "zero snr, leading": {"rescale_betas_zero_snr": True, "timestep_spacing": "leading"},
    "zero snr, karras": {"rescale_betas_zero_snr": True, "use_karras_sigmas": True},
}
STEP_COUNTS = (1, 2, 7, 14, 25, 50)
MAX_STEPS = 60

# (our schedule, the diffusers scheduler it reproduces)
SCHEDULES = {
    "euler": (schedulers.euler_schedule, EulerDiscreteScheduler),
    "euler_ancestral": (schedulers.euler_ancestral_schedule, EulerAncestralDiscreteScheduler),
    "dpmpp_2m": (schedulers.dpmpp_2m_schedule, DPMSolverMultistepScheduler),
    "ddim": (schedulers.ddim_schedule, DDIMScheduler),
}


def relative_error(ours, reference) -> float:
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    return float((np.abs(ours - reference) / np.maximum(np.abs(reference), 1e-30)).max())


def same_schedule(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def reference_sigmas(scheduler) -> np.ndarray:
    """The sigmas a diffusers scheduler steps through: DDIM keeps alphas_cumprod instead."""
    if isinstance(scheduler, DDIMScheduler):
        cumprod = scheduler.alphas_cumprod.double().numpy()
        return np.sqrt((1 - cumprod) / cumprod)[scheduler.timesteps.numpy()]
    return scheduler.sigmas.numpy()


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("base", ["sdxl", "sd15"])
def test_schedule_matches_diffusers(name, variant, base):
    schedule_fn, reference_cls = SCHEDULES[name]
    values = {**(SDXL_SCHEDULER_CONFIG if base == "sdxl" else SD15_SCHEDULER_CONFIG), **VARIANTS[variant]}
    config = config_from_dict(SchedulerConfig, values)
    if name == "ddim" and config.rescale_betas_zero_snr:  # its last timestep's noise level is infinite
        with pytest.raises(ValueError, match="DDIM with rescale_betas_zero_snr is not implemented"):
            schedule_fn(config, 7, MAX_STEPS)
        return
    worst = 0.0
    for num_steps in STEP_COUNTS:
        reference = reference_cls.from_config(values)
        reference.set_timesteps(num_steps)
        schedule = schedule_fn(config, num_steps, MAX_STEPS)

        ref_timesteps = reference.timesteps.numpy()
        assert ref_timesteps.shape == (num_steps,)
        # Integer timesteps match exactly; Euler's Karras timesteps are fractional, within float32 rounding.
        assert relative_error(schedule.timesteps[:num_steps], ref_timesteps) <= 1e-6, num_steps
        ref_sigmas = reference_sigmas(reference)
        sigmas = schedule.sigmas[: len(ref_sigmas)]
        assert relative_error(sigmas, ref_sigmas) <= 1e-6, num_steps
        assert relative_error(schedule.init_noise_sigma, float(reference.init_noise_sigma)) <= 1e-6, num_steps
        worst = max(worst, relative_error(sigmas, ref_sigmas))
    print(f"{name} {base} {variant}: max relative sigma error {worst:.2e}")


def test_ddim_steps_to_t_minus_ratio():
    # For "linspace" spacing diffusers' DDIM steps from t to t - 1000 // n, not to the next timestep.
    config = config_from_dict(SchedulerConfig, {**SD15_SCHEDULER_CONFIG, "timestep_spacing": "linspace"})
    schedule = schedulers.ddim_schedule(config, 7, MAX_STEPS)
    cumprod = schedulers.alphas_cumprod(config)
    expected = [np.sqrt((1 - cumprod[t]) / cumprod[t]) for t in (999 - 142, 832 - 142)]
    assert schedule.timesteps[:2].tolist() == [999, 832]
    np.testing.assert_allclose(schedule.target_sigmas[:2], expected, rtol=1e-6)
    # set_alpha_to_one is false: the last step goes to the first training timestep's noise level.
    assert schedule.target_sigmas[6] == schedule.sigmas[7] == schedulers.train_sigmas(config)[0]


def test_alphas_cumprod_matches_diffusers():
    for values in (SDXL_SCHEDULER_CONFIG, {"beta_schedule": "linear"},
                   {**SDXL_SCHEDULER_CONFIG, "rescale_betas_zero_snr": True}):
        reference = DDIMScheduler.from_config(values).alphas_cumprod.numpy()  # whose last is 0 with zero SNR
        ours = schedulers.alphas_cumprod(config_from_dict(SchedulerConfig, values))
        assert ours.dtype == np.float32
        # torch's float32 linspace differs from the correctly rounded betas in the last bit (5e-7 relative);
        # zero terminal SNR's shift to 0 magnifies that where alphas_cumprod nears 0: 3.6e-5 at t = 998.
        assert relative_error(ours, reference) <= (5e-5 if values.get("rescale_betas_zero_snr") else 5e-7)
    assert ours[-1] == 0


def test_config_reads_shipped_files(tmp_path):
    sdxl = config_from_file(SchedulerConfig, SDXL_SCHEDULER_JSON)
    assert (sdxl.beta_schedule, sdxl.timestep_spacing, sdxl.steps_offset) == ("scaled_linear", "leading", 1)
    (tmp_path / "scheduler_config.json").write_text(json.dumps(SD15_SCHEDULER_CONFIG))
    sd15 = config_from_file(SchedulerConfig, tmp_path / "scheduler_config.json")
    assert (sd15.set_alpha_to_one, sd15.clip_sample, sd15.timestep_spacing) == (False, False, None)
    # Without timestep_spacing each scheduler uses its class default, as diffusers' from_config does.
    linspace = dataclasses.replace(sd15, timestep_spacing="linspace")
    leading = dataclasses.replace(sd15, timestep_spacing="leading")
    assert same_schedule(schedulers.euler_schedule(sd15, 7, 7), schedulers.euler_schedule(linspace, 7, 7))
    assert same_schedule(schedulers.ddim_schedule(sd15, 7, 7), schedulers.ddim_schedule(leading, 7, 7))


@pytest.mark.parametrize("name", SCHEDULES)
def test_padding_repeats_the_last_entry(name):
    config = config_from_dict(SchedulerConfig, SDXL_SCHEDULER_CONFIG)
    schedule = SCHEDULES[name][0](config, 7, 10)
    assert schedule.sigmas.shape == (11,) and schedule.timesteps.shape == (10,)
    assert schedule.sigmas.dtype == schedule.timesteps.dtype == np.float32
    assert np.all(schedule.sigmas[7:] == schedule.sigmas[7])
    assert np.all(schedule.timesteps[6:] == schedule.timesteps[6])
    assert np.all(np.diff(schedule.sigmas[:8]) < 0)


@pytest.mark.parametrize(
    "values",
    [
        {"beta_schedule": "squaredcos_cap_v2"},
        {"trained_betas": [0.1] * 1000},
        {"prediction_type": "flow"},
        {"timestep_spacing": "middle"},
        {"interpolation_type": "log_linear"},
        {"use_beta_sigmas": True},
        {"sigma_max": 10.0},
        {"final_sigmas_type": "one"},
        {"timestep_type": "continuous"},
    ],
)
def test_unsupported_config_raises(values):
    with pytest.raises(ValueError, match=next(iter(values))):
        config_from_dict(SchedulerConfig, values)


def test_unsupported_requests_raise():
    config = config_from_dict(SchedulerConfig, SDXL_SCHEDULER_CONFIG)
    with pytest.raises(ValueError, match="max_steps"):
        schedulers.euler_schedule(config, 51, 50)
    with pytest.raises(ValueError, match="max_steps"):
        schedulers.euler_schedule(config, 0, 50)
    # diffusers' float arange yields 62 "trailing" timesteps for 61 steps (the last one -1).
    with pytest.raises(ValueError, match="trailing"):
        schedulers.euler_schedule(dataclasses.replace(config, timestep_spacing="trailing"), 61, 100)
    # DDIMScheduler clips x0 by default; a config that does not turn it off is refused.
    with pytest.raises(ValueError, match="clip_sample"):
        schedulers.ddim_schedule(SchedulerConfig(), 10, 10)
