"""A1111's schedule types against webui's own functions over k-diffusion's discrete denoiser
(kdiffusion_reference), for SDXL's scheduler config."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from kdiffusion_reference import SCHEDULERS_MAP, CompVisModel, align_your_steps, model_wrap
from test_schedulers import SD15_SCHEDULER_CONFIG, SDXL_SCHEDULER_CONFIG

from sdxl.config import config_from_dict
from sdxl.sampling import schedule_types
from sdxl.sampling.schedulers import SchedulerConfig

SDXL = config_from_dict(SchedulerConfig, SDXL_SCHEDULER_CONFIG)
SD15 = config_from_dict(SchedulerConfig, SD15_SCHEDULER_CONFIG)
WRAP = model_wrap(CompVisModel(None))  # scaled_linear 0.00085..0.012, 1000 steps: both configs' schedule


def test_the_model_sigmas_are_k_diffusions():
    # Within an ulp: torch's float32 sqrt on this CPU is not correctly rounded (numpy's and CUDA's are).
    np.testing.assert_allclose(schedule_types.discrete_model(SDXL).sigmas, WRAP.sigmas.numpy(), rtol=1.2e-7, atol=0)
    sd15, sdxl = schedule_types.discrete_model(SD15), schedule_types.discrete_model(SDXL)
    np.testing.assert_array_equal(sd15.sigmas, sdxl.sigmas)


def test_timesteps_and_sigmas_convert_as_k_diffusion_does():
    log_sigmas = schedule_types.discrete_model(SDXL).log_sigmas
    # Every training level, levels between them, and beyond both ends.
    sigmas = np.concatenate([WRAP.sigmas.numpy(), np.geomspace(0.01, 20, 301, dtype=np.float32)])
    expected = WRAP.sigma_to_t(torch.from_numpy(sigmas)).numpy()
    # Within 2 ulps of 999: the model's log sigmas differ by an ulp where torch's sqrt does.
    np.testing.assert_allclose(schedule_types.sigma_to_t(jnp.asarray(log_sigmas), jnp.asarray(sigmas)), expected,
                               rtol=0, atol=2e-4)
    t = np.linspace(0, 999, 517, dtype=np.float32)
    np.testing.assert_allclose(schedule_types.t_to_sigma(log_sigmas, t), WRAP.t_to_sigma(torch.from_numpy(t)).numpy(),
                               rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 7, 25, 100])
def test_linspace32_is_torchs(n):
    for start, end in ((999, 0), (0, 1), (1, 0), (2.6820767, -3.5355713)):
        expected = torch.linspace(start, end, n).numpy()
        ulp = np.spacing(np.float32(max(abs(start), abs(end))))
        np.testing.assert_allclose(schedule_types.linspace32(start, end, n), expected, rtol=0, atol=ulp)


@pytest.mark.parametrize("schedule_type", list(schedule_types.SCHEDULES))
def test_schedules_are_a1111s(schedule_type):
    for steps in (1, 4, 11, 20, 30):
        ours = schedule_types.SCHEDULES[schedule_type](steps, schedule_types.discrete_model(SDXL))
        expected = SCHEDULERS_MAP[schedule_type](steps, WRAP.sigmas[0].item(), WRAP.sigmas[-1].item(), WRAP, True)
        assert ours.dtype == np.float32 and ours.shape == expected.shape, (steps, ours.shape, expected.shape)
        # Within a few float32 ulps: torch's CPU kernels (linspace, exp, sqrt) round some elements differently.
        # KL Optimal's first sigma, tan near pi/2, turns one ulp of its argument into about 22.
        rtol = 4e-6 if schedule_type == "KL Optimal" else 1e-6
        np.testing.assert_allclose(ours, expected.numpy(), rtol=rtol, err_msg=f"{steps} steps")


def test_align_your_steps_takes_sd15s_sigmas_for_other_models():
    ours = schedule_types.align_your_steps(15, schedule_types.discrete_model(SD15, is_sdxl=False))
    np.testing.assert_allclose(ours, align_your_steps(15, None, None, None, False).numpy(), rtol=1e-6)
    assert not np.allclose(ours, schedule_types.align_your_steps(15, schedule_types.discrete_model(SD15)))


def test_the_ddim_schedule_runs_the_steps_a1111_runs():
    model = schedule_types.discrete_model(SDXL)
    assert [len(schedule_types.ddim(n, model)) - 1 for n in (20, 25, 30, 35, 7)] == [20, 25, 31, 36, 8]
