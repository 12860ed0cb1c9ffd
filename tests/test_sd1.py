"""SD 1.x/2.x checkpoints: random diffusers StableDiffusionPipelines, saved, loaded by ours, and run on both sides."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler, StableDiffusionPipeline
from PIL import Image
from safetensors.numpy import load_file, save_file

from reference import diffusers_images, random_latents, sd_pipeline
from sdxl.checkpoints import locate, random_models
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.request import Request

ROOT = Path(__file__).parents[1]
HEIGHT, WIDTH = 96, 64  # portrait, where tests/test_pipeline.py's SDXL size is landscape
PROMPTS = ["a red cube on a table", "a blue sphere floating over grass"]
NEGATIVES = ["blurry", "low quality, watermark"]

# stable-diffusion-2-1's layout in miniature: a gelu (OpenCLIP) encoder, linear attention
# projections, a head count per level, upcast attention, and its v-prediction DDIM scheduler config.
SD2_CONFIGS = {
    **random_models.SD1_CONFIGS,
    "text_encoder/config.json": {**random_models.SD1_CONFIGS["text_encoder/config.json"], "hidden_act": "gelu"},
    "unet/config.json": {
        **random_models.SD1_CONFIGS["unet/config.json"],
        "use_linear_projection": True,
        "attention_head_dim": [2, 4],
        "upcast_attention": True,
    },
    "scheduler/scheduler_config.json": {
        "_class_name": "DDIMScheduler",
        "_diffusers_version": "0.8.0",
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "beta_start": 0.00085,
        "clip_sample": False,
        "num_train_timesteps": 1000,
        "prediction_type": "v_prediction",
        "set_alpha_to_one": False,
        "skip_prk_steps": True,
        "steps_offset": 1,
        "trained_betas": None,
    },
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd1-reference")
    return folder, sd_pipeline(folder)


@pytest.fixture(scope="module")
def pipe(reference):
    return Pipeline.from_pretrained(reference[0], dtype="float32", max_steps=8)


def _latents(n, seed=0):
    return random_latents(n, HEIGHT, WIDTH, seed)


def _diffusers(ref, scheduler, latents, steps, **kwargs):
    return diffusers_images(
        ref, scheduler, prompt=PROMPTS, latents=torch.from_numpy(latents), num_inference_steps=steps,
        guidance_scale=5.0, height=HEIGHT, width=WIDTH, **kwargs,
    )


def _ours(pipe, negatives, latents, steps, sampler="euler"):
    return pipe.generate(
        PROMPTS, negatives, steps=steps, guidance_scale=5.0, height=HEIGHT, width=WIDTH, latents=latents,
        sampler=sampler, output_type="np",
    )


def _max_diff(label, got, expected):
    assert got.shape == expected.shape == (2, HEIGHT, WIDTH, 3)
    assert expected.std() > 0.05 and np.abs(expected[0] - expected[1]).mean() > 1e-3
    diff = np.abs(got - expected).max()
    print(f"{label}: max abs diff vs diffusers {diff:.2e}")
    return diff


def test_a_saved_sd1_pipeline_is_read_as_sd1(reference, pipe):
    folder, _ = reference
    index = json.loads((folder / "model_index.json").read_text())
    assert index["safety_checker"] == [None, None] and "force_zeros_for_empty_prompt" not in index
    assert not pipe.spec.is_sdxl and pipe.spec.text_encoder_names == ("text_encoder",)
    assert not pipe.spec.force_zeros_for_empty_prompt
    assert set(pipe.params) == {"unet", "vae", "text_encoder"}
    assert pipe.spec.native_size == 128 and pipe.spec.scheduler.timestep_spacing is None


@pytest.mark.oracle
def test_images_match_diffusers_with_euler(reference, pipe):
    """The usual `EulerDiscreteScheduler.from_config(pipe.scheduler.config)` swap on SD 1.5's PNDM config."""
    _, ref = reference
    latents = _latents(2)
    euler = EulerDiscreteScheduler.from_config(ref.scheduler.config)
    # The PNDM JSON names no spacing: diffusers then takes Euler's default, not PNDM's "leading".
    assert euler.config.timestep_spacing == "linspace"
    expected = _diffusers(ref, euler, latents, 4, negative_prompt=NEGATIVES)
    assert _max_diff("SD1 euler", _ours(pipe, NEGATIVES, latents, 4), expected) <= 1e-4
    leading = EulerDiscreteScheduler.from_config(ref.scheduler.config, timestep_spacing="leading")
    with_leading = _diffusers(ref, leading, latents, 4, negative_prompt=NEGATIVES)
    assert np.abs(with_leading - expected).max() > 1e-2, "the spacing must matter for the comparison to settle it"


@pytest.mark.oracle
def test_the_default_sampler_is_the_checkpoints_pndm_and_matches_diffusers(reference, pipe):
    """SD 1.5 ships PNDMScheduler (PLMS): that is what renders when no sampler is named, as in diffusers."""
    _, ref = reference
    assert pipe.spec.default_sampler == "pndm" and type(ref.scheduler).__name__ == "PNDMScheduler"
    latents = _latents(2, seed=4)
    expected = _diffusers(ref, ref.scheduler, latents, 5, negative_prompt=NEGATIVES)
    ours = pipe.generate(
        PROMPTS, NEGATIVES, steps=5, guidance_scale=5.0, height=HEIGHT, width=WIDTH, latents=latents, output_type="np"
    )
    assert _max_diff("SD1 PNDM (PLMS)", ours, expected) <= 1e-4
    euler = _ours(pipe, NEGATIVES, latents, 5)
    assert np.abs(euler - expected).max() > 1e-2, "the sampler must matter for the comparison to settle it"


def test_empty_negative_prompt_encodes_the_empty_text_like_diffusers(reference, pipe):
    """diffusers' StableDiffusionPipeline encodes "" for a missing negative prompt (SDXL's zeroes it). With the
    checkpoint's PNDM, as the fast tier's other test here, so that the two share one compiled program."""
    _, ref = reference
    latents = _latents(2, seed=1)
    expected = _diffusers(ref, None, latents, 4, negative_prompt=None)
    assert _max_diff("SD1 empty negative prompt", _ours(pipe, "", latents, 4, sampler=None), expected) <= 1e-4
    zeroed = _diffusers(ref, None, latents, 4, negative_prompt_embeds=torch.zeros(2, 77, 32))
    assert np.abs(zeroed - expected).max() > 1e-2, "zero conditioning must differ for the test to mean something"


@pytest.mark.oracle
def test_dpmpp_2m_matches_diffusers(reference, pipe):
    _, ref = reference
    latents = _latents(2, seed=2)
    expected = _diffusers(ref, DPMSolverMultistepScheduler.from_config(ref.scheduler.config), latents, 4,
                          negative_prompt=NEGATIVES)
    assert _max_diff("SD1 dpmpp_2m", _ours(pipe, NEGATIVES, latents, 4, "dpmpp_2m"), expected) <= 1e-4


@pytest.mark.oracle
def test_sd2_layout_with_v_prediction_and_ddim_matches_diffusers(tmp_path):
    """SD 2.x ships a DDIM config; diffusers runs it as is, eta = 0."""
    ref = sd_pipeline(tmp_path, SD2_CONFIGS, seed=10)
    pipe = Pipeline.from_pretrained(tmp_path, dtype="float32", max_steps=8)
    assert pipe.spec.scheduler.prediction_type == "v_prediction" and type(ref.scheduler).__name__ == "DDIMScheduler"
    latents = _latents(2, seed=3)
    expected = _diffusers(ref, None, latents, 3, negative_prompt=NEGATIVES)
    assert _max_diff("SD2-layout v-prediction ddim", _ours(pipe, NEGATIVES, latents, 3, "ddim"), expected) <= 1e-4


def test_safety_checker_and_feature_extractor_are_ignored(reference, pipe, tmp_path):
    """A checkpoint as published (SD 1.5 names a safety checker and ships its weights) loads all the same."""
    folder = shutil.copytree(reference[0], tmp_path / "checkpoint")
    index = json.loads((folder / "model_index.json").read_text())
    index |= {
        "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
        "feature_extractor": ["transformers", "CLIPImageProcessor"],
        "requires_safety_checker": True,
    }
    (folder / "model_index.json").write_text(json.dumps(index))
    (folder / "safety_checker").mkdir()
    checker_config = {"architectures": ["StableDiffusionSafetyChecker"]}
    (folder / "safety_checker" / "config.json").write_text(json.dumps(checker_config))
    save_file({"concept_embeds": np.zeros((17, 8), np.float32)}, folder / "safety_checker" / "model.safetensors")
    (folder / "feature_extractor").mkdir()
    (folder / "feature_extractor" / "preprocessor_config.json").write_text(json.dumps({"crop_size": 224}))
    loaded = Pipeline.from_pretrained(folder, dtype="float32", max_steps=8)
    assert loaded.spec == pipe.spec
    assert set(loaded.params) == {"unet", "vae", "text_encoder"}


def test_tiny_sd1_is_an_sd1_checkpoint_that_diffusers_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = locate("tiny-sd1")
    assert folder.is_relative_to(tmp_path)
    spec = Pipeline.from_pretrained("tiny-sd1", dtype="float32").spec
    assert not spec.is_sdxl and len(spec.text_encoders) == 1 and not spec.unet.use_linear_projection
    assert spec.native_size == 128 and spec.scheduler.timestep_spacing is None
    diffusers_pipe = StableDiffusionPipeline.from_pretrained(folder)
    assert diffusers_pipe.safety_checker is None and type(diffusers_pipe.scheduler).__name__ == "PNDMScheduler"
    for name in ("unet", "vae", "text_encoder"):
        # transformers 5 names the text encoder's keys without the `text_model.` prefix we store.
        state = getattr(diffusers_pipe, name).state_dict()
        loaded = {k.removeprefix("text_model."): v.numpy() for k, v in state.items()}
        stored_file = next((folder / name).glob("*.safetensors"))
        stored = {k.removeprefix("text_model."): v for k, v in load_file(stored_file).items()}
        assert loaded.keys() == stored.keys()
        assert all(np.array_equal(loaded[k], stored[k]) for k in stored), name


@pytest.mark.cli
def test_cli_generates_with_tiny_sd1(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "sdxl", "generate", "--model", "tiny-sd1", "--prompt", "a lighthouse",
         "--negative-prompt", "fog", "--steps", "2", "--num-images", "1", "--out", str(tmp_path / "out"),
         "--cache-dir", os.environ["SDXL_CACHE_DIR"]],  # the session's compilation cache (conftest)
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr
    assert "loaded tiny-sd1" in result.stdout and "generated 1 image in" in result.stdout
    image = Image.open(tmp_path / "out" / "0-0.png")
    assert image.size == (128, 128)
    assert np.asarray(image).std() > 1


def test_an_edit_that_never_switches_draws_the_plain_prompts_images(pipe):
    """PLMS evaluates 5 times in 4 steps, so webui schedules over 5: [a cat:a dog:4] reads "a cat" at every
    call there is. Two conditionings, one read: the plain prompt's images (SD 1.x has no pooled text)."""
    kwargs = dict(steps=4, guidance_scale=5.0, height=HEIGHT, width=WIDTH, seed=0, num_images=2)
    edited = Request.from_prompt("[a cat:a dog:4]", "[blurry:noisy:4]", **kwargs)
    assert pipe.prepare(edited).program.conditionings == 2
    # Given noise, as the other tests here give it: the plain prompt's program is theirs, compiled once.
    kwargs |= dict(latents=_latents(2, seed=1), output_type="np")
    plain = pipe.generate("a cat", "blurry", **kwargs)
    # Two programs: the edit's encodes twice the texts in one batch, which XLA's CPU kernels may block otherwise
    # on some hosts (as tests/test_infotext.py's batch of one); these pictures move 1.4e-6 between XLA built for
    # AVX-512 and for SSE4.2. An edit read at the wrong step moves them by 1e-3 and more.
    np.testing.assert_allclose(pipe.generate("[a cat:a dog:4]", "[blurry:noisy:4]", **kwargs), plain, atol=1e-5)
    switched = pipe.generate("[a cat:a dog:3]", "[blurry:noisy:3]", **kwargs)
    assert np.abs(switched - plain).max() > 1e-3
