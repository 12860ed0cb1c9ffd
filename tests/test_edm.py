"""Models trained in Karras et al. 2022's (EDM) formulation, against diffusers: Playground v2.5 (EDM,
sigma_data 0.5, its latents' per-channel mean and std) and CosXL (EDM v-prediction, sigma_data 1), as
diffusers' StableDiffusionXLPipeline samples them with its EDM schedulers; and the same models as single
files, whose keys say what they are (`edm_mean`/`edm_std`, `edm_vpred.sigma_max`/`sigma_min`)."""

import numpy as np
import pytest
import safetensors.numpy
import torch
from diffusers import EDMDPMSolverMultistepScheduler, EDMEulerScheduler
from reference import SCHEDULER_JSON, diffusers_images, random_latents, sdxl_pipeline

from sdxl.checkpoints import ModelSpec, random_models
from sdxl.checkpoints.folder import stored_weights
from sdxl.checkpoints.single_file import write_single_file
from sdxl.engine.pipeline import Pipeline
from sdxl.sampling.schedulers import scheduler_config

HEIGHT, WIDTH = 64, 96
PROMPTS = ["a red cube on a table", "a blue sphere floating over grass"]
NEGATIVES = ["blurry", "low quality, watermark"]
STEPS, GUIDANCE = 6, 3.0
VAE_JSON = "vae/config.json"
# playgroundai/playground-v2.5-1024px-aesthetic's scheduler and VAE statistics.
PLAYGROUND_SCHEDULER = {
    "_class_name": "EDMDPMSolverMultistepScheduler", "algorithm_type": "dpmsolver++", "euler_at_final": False,
    "final_sigmas_type": "zero", "lower_order_final": True, "num_train_timesteps": 1000, "prediction_type": "epsilon",
    "rho": 7.0, "sigma_data": 0.5, "sigma_max": 80.0, "sigma_min": 0.002, "solver_order": 2, "solver_type": "midpoint",
    "thresholding": False,
}
PLAYGROUND_LATENTS = {"latents_mean": [-1.6574, 1.886, -1.383, 2.5155], "latents_std": [8.4927, 5.9022, 6.5498, 5.2299],
                      "scaling_factor": 0.5}
# CosXL as diffusers' EDMEulerScheduler renders it: v-prediction, sigma_data 1 (ComfyUI's
# ModelSamplingContinuousEDM), its file's sigma range, exponential sigmas.
COSXL_SCHEDULER = {"_class_name": "EDMEulerScheduler", "prediction_type": "v_prediction", "sigma_data": 1.0,
                   "sigma_min": 0.002, "sigma_max": 120.0, "sigma_schedule": "exponential"}


def _configs(scheduler: dict, vae: dict | None = None) -> dict:
    configs = random_models.SDXL_CONFIGS
    return {**configs, SCHEDULER_JSON: scheduler, VAE_JSON: {**configs[VAE_JSON], **(vae or {})}}


@pytest.fixture(scope="module")
def playground(tmp_path_factory):
    """(our pipeline, diffusers', the folder) for a tiny random SDXL in Playground v2.5's layout."""
    folder = tmp_path_factory.mktemp("playground")
    ref = sdxl_pipeline(folder, _configs(PLAYGROUND_SCHEDULER, PLAYGROUND_LATENTS))
    return Pipeline.from_pretrained(folder, dtype="float32", max_steps=8), ref, folder


@pytest.fixture(scope="module")
def cosxl(tmp_path_factory):
    """(diffusers' pipeline, the folder) for a tiny random SDXL sampled as CosXL."""
    folder = tmp_path_factory.mktemp("cosxl")
    return sdxl_pipeline(folder, _configs(COSXL_SCHEDULER)), folder


def _ours(pipe, latents, sampler=None):
    return pipe.generate(PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=GUIDANCE, height=HEIGHT, width=WIDTH,
                         latents=latents, sampler=sampler, output_type="np")


def _theirs(ref, latents, scheduler=None):
    return diffusers_images(ref, scheduler, prompt=PROMPTS, negative_prompt=NEGATIVES, height=HEIGHT, width=WIDTH,
                            num_inference_steps=STEPS, guidance_scale=GUIDANCE, latents=torch.from_numpy(latents))


def edm_fields(config) -> tuple:
    """What an EDM schedule reads of a scheduler config (a single file's configs keep the published
    config's betas beside them, unread)."""
    return (config.prediction_type, config.sigma_data, config.sigma_min, config.sigma_max, config.sigma_schedule,
            config.rho, config.final_sigmas_type, config.use_karras_sigmas)


def _single_file(folder, path, extra: dict) -> str:
    """The folder's weights as one original-layout SDXL file, with `extra` tensors beside them."""
    spec = ModelSpec.from_folder(folder)
    sources = {component: stored_weights(folder, component, "float32") for component in spec.abstract_params()}
    write_single_file(path, "sdxl", spec, lambda component, key: sources[component][key].read(), "float32")
    safetensors.numpy.save_file(safetensors.numpy.load_file(path) | extra, path)
    return str(path)


@pytest.mark.parametrize(("schedule", "steps"), [("karras", 6), ("karras", 20), ("exponential", 7)])
def test_edm_schedules_are_diffusers(schedule, steps):
    from sdxl.sampling.samplers import SAMPLERS

    for cls, sampler in ((EDMEulerScheduler, "euler"), (EDMDPMSolverMultistepScheduler, "dpmpp_2m")):
        fields = {**PLAYGROUND_SCHEDULER, "_class_name": cls.__name__, "sigma_schedule": schedule}
        theirs = cls.from_config(fields)
        theirs.set_timesteps(steps)
        ours = SAMPLERS[sampler].schedule(scheduler_config(fields), steps, 24)
        np.testing.assert_allclose(np.asarray(ours.sigmas)[: steps + 1], theirs.sigmas.numpy(), rtol=2e-6)
        np.testing.assert_allclose(np.asarray(ours.timesteps)[:steps], theirs.timesteps.numpy(), rtol=1e-6, atol=1e-6)


def test_an_edm_model_refuses_the_samplers_diffusers_has_no_edm_scheduler_of(playground):
    pipe, _, _ = playground
    assert pipe.spec.default_sampler == "dpmpp_2m"
    assert pipe.spec.sampling == "EDM, epsilon prediction, sigma_data 0.5"
    latents = random_latents(2, HEIGHT, WIDTH)
    for sampler in ("ddim", "euler_ancestral"):
        with pytest.raises(ValueError, match="does not sample an EDM model"):
            _ours(pipe, latents, sampler)
    with pytest.raises(ValueError, match="does not sample an EDM model"):
        pipe.generate(PROMPTS, steps=STEPS, height=HEIGHT, width=WIDTH, sampler="euler", schedule_type="Karras")


@pytest.mark.oracle
@pytest.mark.parametrize("scheduler", [EDMDPMSolverMultistepScheduler, EDMEulerScheduler])
def test_a_playground_layout_folder_draws_diffusers_picture(playground, scheduler):
    pipe, ref, _ = playground
    latents = random_latents(2, HEIGHT, WIDTH, seed=3)
    theirs = _theirs(ref, latents, scheduler.from_config(ref.scheduler.config))
    sampler = "euler" if scheduler is EDMEulerScheduler else None  # None: the model's own, EDM DPM++ 2M
    diff = np.abs(_ours(pipe, latents, sampler) - theirs).max()
    print(f"Playground layout, {scheduler.__name__}: max abs diff vs diffusers {diff:.2e}")
    assert theirs.std() > 0.05 and diff <= 1e-4


@pytest.mark.oracle
def test_a_playground_single_file_draws_the_folders_picture(playground, tmp_path):
    """The file's `edm_mean` and `edm_std` ([1, 4, 1, 1], as Playground's) bring the EDM scheduler and the
    latents' statistics (scaling factor 0.5) to a plain SDXL config."""
    pipe, ref, folder = playground
    plain = tmp_path / "plain"
    sdxl_pipeline(plain, random_models.SDXL_CONFIGS)  # the configs only are read
    stats = {f"edm_{name}": np.asarray(PLAYGROUND_LATENTS[f"latents_{name}"], np.float32).reshape(1, 4, 1, 1)
             for name in ("mean", "std")}
    file = _single_file(folder, tmp_path / "playground.safetensors", stats)
    single = Pipeline.from_pretrained(file, config=str(plain), dtype="float32", max_steps=8)
    assert single.spec.vae.scaling_factor == 0.5 and single.spec.default_sampler == "dpmpp_2m"
    np.testing.assert_allclose([single.spec.vae.latents_mean, single.spec.vae.latents_std],
                               [pipe.spec.vae.latents_mean, pipe.spec.vae.latents_std], rtol=1e-7)
    assert edm_fields(single.spec.scheduler) == edm_fields(pipe.spec.scheduler)
    latents = random_latents(2, HEIGHT, WIDTH, seed=4)
    diff = np.abs(_ours(single, latents) - _theirs(ref, latents)).max()
    print(f"Playground single file: max abs diff vs diffusers {diff:.2e}")
    assert diff <= 1e-4


@pytest.mark.oracle
def test_a_cosxl_single_file_draws_diffusers_edm_v_prediction_picture(cosxl, tmp_path):
    """A file with `edm_vpred.sigma_max` and `edm_vpred.sigma_min` (CosXL's 120 and 0.002) samples as
    EDMEulerScheduler with v-prediction, sigma_data 1 and exponential sigmas."""
    ref, folder = cosxl
    plain = tmp_path / "plain"
    sdxl_pipeline(plain, random_models.SDXL_CONFIGS)
    sigmas = {"edm_vpred.sigma_max": np.array(120.0, np.float32), "edm_vpred.sigma_min": np.array(0.002, np.float32)}
    file = _single_file(folder, tmp_path / "cosxl.safetensors", sigmas)
    pipe = Pipeline.from_pretrained(file, config=str(plain), dtype="float32", max_steps=8)
    assert pipe.spec.default_sampler == "euler" and pipe.spec.sampling == "EDM, v-prediction, sigma_data 1"
    latents = random_latents(2, HEIGHT, WIDTH, seed=5)
    theirs = _theirs(ref, latents)
    diff = np.abs(_ours(pipe, latents) - theirs).max()
    print(f"CosXL single file: max abs diff vs diffusers {diff:.2e}")
    assert theirs.std() > 0.05 and diff <= 1e-4
