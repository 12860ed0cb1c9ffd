"""v-prediction models trained with zero terminal SNR (NoobAI-XL V-Pred and its merges), and CFG rescale,
against diffusers: a tiny random SDXL saved as a diffusers folder whose scheduler config says
`prediction_type: v_prediction`, `rescale_betas_zero_snr: true`, `timestep_spacing: trailing`,
sampled with `guidance_rescale`, as diffusers' StableDiffusionXLPipeline samples it."""

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler
from reference import diffusers_images, random_latents, sdxl_pipeline

from sdxl.checkpoints import random_models
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.program import rescaled_guidance

HEIGHT, WIDTH = 64, 96
PROMPTS = ["a red cube on a table", "a blue sphere floating over grass"]
NEGATIVES = ["blurry", "low quality, watermark"]
STEPS, GUIDANCE, RESCALE = 5, 6.0, 0.7
SCHEDULER_JSON = "scheduler/scheduler_config.json"
ZERO_SNR_V = {"prediction_type": "v_prediction", "rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}


@pytest.fixture(scope="module")
def zero_snr(tmp_path_factory):
    """(our pipeline, diffusers') for one tiny random v-prediction, zero-terminal-SNR SDXL folder."""
    folder = tmp_path_factory.mktemp("sdxl-zero-snr")
    configs = {**random_models.SDXL_CONFIGS,
               SCHEDULER_JSON: {**random_models.SDXL_CONFIGS[SCHEDULER_JSON], **ZERO_SNR_V}}
    ref = sdxl_pipeline(folder, configs)
    return Pipeline.from_pretrained(folder, dtype="float32", max_steps=8), ref


def test_cfg_rescale_is_diffusers_rescale_noise_cfg():
    from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import rescale_noise_cfg

    rng = np.random.default_rng(0)
    guided, positive = rng.standard_normal((2, 3, 8, 12, 4)).astype(np.float32) * [[[[[1.0]]]], [[[[0.5]]]]]
    rescale = np.array([0.0, 0.7, 1.0], np.float32)[:, None, None, None]
    ours = np.asarray(rescaled_guidance(guided, positive, rescale))
    for i, phi in enumerate((0.0, 0.7, 1.0)):
        theirs = rescale_noise_cfg(*(torch.from_numpy(a[i:i + 1]).permute(0, 3, 1, 2) for a in (guided, positive)),
                                   guidance_rescale=phi).permute(0, 2, 3, 1).numpy()
        np.testing.assert_allclose(ours[i:i + 1], theirs, rtol=1e-6, atol=1e-6)
    assert np.array_equal(ours[0], guided[0])  # 0 leaves the guided prediction exactly as it is


@pytest.mark.oracle
@pytest.mark.parametrize("scheduler", [EulerDiscreteScheduler, DPMSolverMultistepScheduler])
def test_a_zero_snr_v_prediction_folder_with_cfg_rescale_draws_diffusers_picture(zero_snr, scheduler):
    pipe, ref = zero_snr
    assert pipe.spec.sampling == "v-prediction, zero terminal SNR"
    latents = random_latents(2, HEIGHT, WIDTH, seed=3)
    theirs = diffusers_images(
        ref, scheduler.from_config(ref.scheduler.config), prompt=PROMPTS, negative_prompt=NEGATIVES, height=HEIGHT,
        width=WIDTH, num_inference_steps=STEPS, guidance_scale=GUIDANCE, guidance_rescale=RESCALE,
        latents=torch.from_numpy(latents))
    sampler = "euler" if scheduler is EulerDiscreteScheduler else "dpmpp_2m"
    ours = pipe.generate(PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=GUIDANCE, guidance_rescale=RESCALE,
                         height=HEIGHT, width=WIDTH, latents=latents, sampler=sampler, output_type="np")
    unrescaled = pipe.generate(PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=GUIDANCE, height=HEIGHT, width=WIDTH,
                               latents=latents, sampler=sampler, output_type="np")
    diff, moved = np.abs(ours - theirs).max(), np.abs(ours - unrescaled).max()
    print(f"{sampler}: max abs diff vs diffusers {diff:.2e}; CFG rescale moves it {moved:.2e}")
    assert theirs.std() > 0.05 and moved > 1e-2
    assert diff <= 1e-4
