"""Single-file checkpoints (the original SGM / A1111 layout) against diffusers' `from_single_file`.

Each test writes a random diffusers pipeline as one file with our writer, checks the writer by
loading its output with diffusers' own converter (so a wrong mapping cannot hide in both
directions), then loads it with ours and compares images with the original pipeline's.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from reference import diffusers_images, random_latents, sd_pipeline, sdxl_pipeline
from test_sd1 import SD2_CONFIGS

from sdxl.checkpoints import BUILTIN_CONFIGS, CheckpointError, ModelSpec, random_models, resolve
from sdxl.checkpoints.folder import stored_weights
from sdxl.checkpoints.single_file import key_map, write_single_file
from sdxl.checkpoints.weights import SafetensorsFile
from sdxl.engine.pipeline import Pipeline

ROOT = Path(__file__).parents[1]
HEIGHT, WIDTH = 64, 64
PROMPTS = ["a red cube on a table", "a blue sphere floating over grass"]
NEGATIVES = ["blurry", "low quality, watermark"]

# The tiny SDXL with a wider second text encoder: diffusers tells SDXL's two encoders apart by
# their widths (768 and 1280 in the real model), which the tiny model's 32 and 32 would confuse.
_WIDER = {**random_models.SDXL_CONFIGS["text_encoder_2/config.json"], "hidden_size": 48, "intermediate_size": 96}
SDXL_CONFIGS = {
    **random_models.SDXL_CONFIGS,
    "text_encoder_2/config.json": _WIDER,
    "unet/config.json": {**random_models.SDXL_CONFIGS["unet/config.json"], "cross_attention_dim": 32 + 48},
}
FAMILIES = {  # family: (reference pipeline, its configs, diffusers' class)
    "sdxl": (sdxl_pipeline, SDXL_CONFIGS, StableDiffusionXLPipeline),
    "sd1": (sd_pipeline, random_models.SD1_CONFIGS, StableDiffusionPipeline),
    "sd2": (sd_pipeline, SD2_CONFIGS, StableDiffusionPipeline),
}


def _single_file(folder, family, path, dtype="float32"):
    """The diffusers folder's weights as one original-layout file, written with our table."""
    spec = ModelSpec.from_folder(folder)
    sources = {component: stored_weights(folder, component, dtype) for component in spec.abstract_params()}
    return write_single_file(path, family, spec, lambda component, key: sources[component][key].read(), dtype)


def _images(pipe_or_ref, latents, **kwargs):
    if isinstance(pipe_or_ref, Pipeline):
        return pipe_or_ref.generate(
            PROMPTS, NEGATIVES, steps=3, guidance_scale=5.0, height=HEIGHT, width=WIDTH, latents=latents,
            sampler="euler" if pipe_or_ref.spec.scheduler.prediction_type == "epsilon" else "ddim",
            output_type="np", **kwargs,
        )
    return diffusers_images(
        pipe_or_ref, None, prompt=PROMPTS, negative_prompt=NEGATIVES, num_inference_steps=3, guidance_scale=5.0,
        height=HEIGHT, width=WIDTH, latents=torch.from_numpy(latents),
    )


@pytest.mark.oracle
@pytest.mark.parametrize("family", ["sdxl", "sd1", "sd2"])
def test_a_single_file_loads_as_diffusers_loads_it(family, tmp_path):
    build, configs, diffusers_class = FAMILIES[family]
    if family != "sd2":  # the SD 1.x/SDXL references' own schedulers (PNDM, Euler); ours picks the same
        configs = {**configs, "scheduler/scheduler_config.json": {
            **configs["scheduler/scheduler_config.json"], "_class_name": "EulerDiscreteScheduler"}}
    folder = tmp_path / "diffusers"
    ref = build(folder, configs)
    file = _single_file(folder, family, tmp_path / "model.safetensors")
    keys = set(SafetensorsFile(file).keys())
    assert any(k.startswith("model.diffusion_model.input_blocks.") for k in keys)
    assert any(k.startswith("first_stage_model.decoder.up.") for k in keys)

    latents = random_latents(2, HEIGHT, WIDTH, seed=1)
    expected = _images(ref, latents)
    # The writer, checked by diffusers' own converter: the same pipeline comes back.
    converted = diffusers_class.from_single_file(str(file), config=str(folder), local_files_only=True)
    np.testing.assert_allclose(_images(converted, latents), expected, atol=1e-5)

    pipe = Pipeline.from_pretrained(str(file), config=str(folder), dtype="float32", max_steps=8)
    diff = np.abs(_images(pipe, latents) - expected).max()
    print(f"{family} single file: max abs diff vs diffusers {diff:.2e}")
    assert expected.std() > 0.05 and diff <= 1e-4


def test_every_key_of_a_single_file_is_mapped_and_checked(tmp_path):
    folder = tmp_path / "diffusers"
    sdxl_pipeline(folder, SDXL_CONFIGS)
    file = _single_file(folder, "sdxl", tmp_path / "model.safetensors")
    spec = ModelSpec.from_folder(folder)
    table = key_map("sdxl", spec)
    # OpenCLIP's fused q/k/v: three of our keys read one stored tensor, each a third of its rows.
    q = table["text_encoder_2"]["text_model.encoder.layers.0.self_attn.q_proj.weight"]
    assert q.key == "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight" and q.rows == (0, 3)
    assert table["unet"]["up_blocks.0.upsamplers.0.conv.weight"].key.startswith("model.diffusion_model.output_blocks.")
    assert table["vae"]["decoder.up_blocks.0.resnets.0.conv1.weight"].key == (
        "first_stage_model.decoder.up.3.block.0.conv1.weight"
    )

    # A stray tensor (a LoRA merged under its own name, say) is named, not skipped.
    tensors = safetensors.numpy.load_file(file)
    tensors["lora_unet_down_blocks_0.alpha"] = np.ones((), np.float32)
    safetensors.numpy.save_file(tensors, tmp_path / "extra.safetensors")
    with pytest.raises(CheckpointError, match="belong to no component of the model: lora_unet_down_blocks_0.alpha"):
        Pipeline.from_pretrained(str(tmp_path / "extra.safetensors"), config=str(folder), dtype="float32")
    # Non-parameters of real files are ignored: the training schedule, EMA, position ids.
    tensors.pop("lora_unet_down_blocks_0.alpha")
    tensors |= {"alphas_cumprod": np.ones(1000, np.float32), "model_ema.decay": np.ones((), np.float32)}
    del tensors[table["unet"]["conv_out.weight"].key]
    safetensors.numpy.save_file(tensors, tmp_path / "missing.safetensors")
    with pytest.raises(CheckpointError, match=r"unet: 1 tensors missing \(model.diffusion_model.out.2.weight\)"):
        Pipeline.from_pretrained(str(tmp_path / "missing.safetensors"), config=str(folder), dtype="float32")


@pytest.mark.parametrize(("family", "config"), [("sdxl", "sdxl-base-1.0"), ("sd1", "sd-1.5"), ("sd2", "sd-2.1")])
def test_without_a_config_the_familys_published_one_is_chosen(family, config, tmp_path):
    build, configs, _ = FAMILIES[family]
    build(tmp_path / "diffusers", configs)
    file = _single_file(tmp_path / "diffusers", family, tmp_path / "model.safetensors")
    checkpoint = resolve(str(file))
    assert checkpoint.family == family and checkpoint.folder == BUILTIN_CONFIGS / config
    if family == "sd2":  # stable-diffusion-2-1 is v-prediction, as diffusers assumes; -base is not
        assert checkpoint.spec.scheduler.prediction_type == "v_prediction"
        assert resolve(str(file), config="sd-2.1-base").spec.scheduler.prediction_type == "epsilon"
        epsilon = resolve(str(file), scheduler={"prediction_type": "epsilon"}).spec.scheduler.prediction_type
        assert epsilon == "epsilon"
    with pytest.raises(CheckpointError, match="describes another family"):
        resolve(str(file), config="sd-1.5" if family == "sdxl" else "sdxl-base-1.0")


def test_a_single_files_keys_and_model_spec_say_how_it_samples(tmp_path):
    sdxl_pipeline(tmp_path / "diffusers", SDXL_CONFIGS)
    tensors = safetensors.numpy.load_file(_single_file(tmp_path / "diffusers", "sdxl", tmp_path / "plain.safetensors"))

    def written(name, keys=(), metadata=None):
        path = tmp_path / f"{name}.safetensors"
        safetensors.numpy.save_file(tensors | {key: np.zeros((0,), np.float32) for key in keys}, path, metadata)
        return str(path)

    def sampling(path, **kwargs):
        scheduler = resolve(path, **kwargs).spec.scheduler
        return scheduler.prediction_type, scheduler.rescale_betas_zero_snr, scheduler.timestep_spacing

    # ComfyUI's and A1111's markers (NoobAI-XL V-Pred carries both), and kohya's model spec metadata.
    assert sampling(written("plain")) == ("epsilon", False, "leading")
    assert sampling(written("v", ["v_pred"])) == ("v_prediction", False, "leading")
    assert sampling(written("vz", ["v_pred", "ztsnr"])) == ("v_prediction", True, "trailing")
    assert sampling(written("spec", metadata={"modelspec.prediction_type": "v"}))[0] == "v_prediction"
    # What the caller says wins over what the file says.
    assert sampling(written("vz", ["v_pred", "ztsnr"]), scheduler={"prediction_type": "epsilon"})[0] == "epsilon"
    with pytest.raises(CheckpointError, match="model spec's prediction type 'flow' is not supported"):
        resolve(written("flow", metadata={"modelspec.prediction_type": "flow"}))
    with pytest.raises(CheckpointError, match="CosXL"):
        resolve(written("cosxl", ["edm_vpred.sigma_max", "edm_vpred.sigma_min"]))


@pytest.mark.cli
def test_the_cli_renders_a_single_file(tmp_path):
    sd_pipeline(tmp_path / "diffusers")
    file = _single_file(tmp_path / "diffusers", "sd1", tmp_path / "fine-tune.safetensors")
    result = subprocess.run(
        [sys.executable, "-m", "sdxl", "generate", "--model", str(file), "--config", str(tmp_path / "diffusers"),
         "--prompt", "a lighthouse", "--steps", "2", "--num-images", "1", "--out", str(tmp_path / "out"),
         "--cache-dir", os.environ["SDXL_CACHE_DIR"]],  # the session's compilation cache (conftest)
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "0-0.png").is_file()
    refused = subprocess.run(
        [sys.executable, "-m", "sdxl", "generate", "--model", str(tmp_path / "diffusers" / "unet" / "config.json"),
         "--prompt", "x"], capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert refused.returncode == 2 and refused.stderr.startswith("error: ") and refused.stderr.count("\n") == 1


@pytest.mark.compiles
def test_the_benchmarks_random_single_file_loads(tmp_path):
    """`write-checkpoint --single-file` streams random weights into the original layout."""
    path = random_models.write_single_file(tmp_path / "tiny.safetensors", random_models.configs_of("tiny"))
    assert SafetensorsFile(path).dtype("model.diffusion_model.out.2.weight") == np.float16
    pipe = Pipeline.from_pretrained(str(path), config=str(random_models.ensure_checkpoint("tiny")), dtype="float32")
    assert np.isfinite(pipe.generate("a cat", steps=1, output_type="np")).all()
