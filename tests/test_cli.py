import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdxl.checkpoints import lora, random_models, resolve

ROOT = Path(__file__).parents[1]


def _cli(*args, model="tiny", env=None):
    """`python -m sdxl generate --model MODEL ARGS` (no --model where `model` is None), with the session's
    compilation cache (conftest)."""
    return subprocess.run(
        [sys.executable, "-m", "sdxl", "generate", "--cache-dir", os.environ["SDXL_CACHE_DIR"],
         *(["--model", model] if model else []), *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


GENERATE = ("--prompt", "a lighthouse", "--negative-prompt", "fog", "--seed", "3", "--steps", "2", "--num-images", "2",
            "--sampler", "euler", "--schedule-type", "Karras")


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`generate GENERATE`'s run and its output folder: its images are also the LoRA test's without a LoRA."""
    out = tmp_path_factory.mktemp("generated")
    return _cli(*GENERATE, "--out", str(out)), out


@pytest.mark.cli
def test_generate_writes_pngs_with_parameters_and_a_grid(generated):
    result, out = generated
    assert result.returncode == 0, result.stderr
    assert "loaded tiny" in result.stdout and "compiled" in result.stdout and "generated 2 images" in result.stdout
    image = Image.open(out / "3-1.png")
    assert image.size == (128, 128)
    parameters = image.text["parameters"]
    assert parameters.startswith("a lighthouse\nNegative prompt: fog\n")
    assert "Steps: 2" in parameters and "Seed: 3" in parameters and "Image index: 1" in parameters
    assert "Sampler: Euler, Schedule type: Karras" in parameters
    assert Image.open(out / "3-grid.png").size == (256, 128)


@pytest.mark.cli
def test_a_hires_fix_renders_the_upscaled_size_and_names_itself_in_the_parameters(tmp_path):
    result = _cli("--prompt", "a lighthouse", "--steps", "2", "--num-images", "1", "--hires-scale", "1.5",
                  "--hires-steps", "1", "--hires-strength", "0.5", "--hires-upscaler", "Lanczos",
                  "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "compiled for 128x128 and 192x192 (hires fix)" in result.stdout
    image = Image.open(tmp_path / "0-0.png")
    assert image.size == (192, 192)
    assert ("Size: 128x128, Model: tiny, RNG: JAX, Denoising strength: 0.5, Hires upscale: 1.5, Hires steps: 1, "
            "Hires upscaler: Lanczos") in image.text["parameters"]
    refused = _cli("--prompt", "a lighthouse", "--hires-scale", "2", "--hires-upscaler", "4x-UltraSharp")
    assert refused.returncode == 2 and refused.stderr.startswith("error: hires upscaler must be one of Latent, ")


@pytest.mark.parametrize(
    "args, reason",
    [
        (["--steps", "0"], "error: steps must be an integer from 1 to 100, got 0"),
        (["--seed", "-1"], "error: seed must be an integer from 0 to 4294967295, got -1"),
        (["--guidance-scale", "-1"], "error: guidance scale must be a number from 0 to 20, got -1.0"),
        (["--height", "0"], "error: height must be an integer from 1 to 4096, got 0"),
        (["--strength", "2"], "error: strength must be a number from 0 to 1, got 2.0"),
        (["--num-images", "-3"], "error: --num-images must be at least 1, got -3"),
        (["--mask", "mask.png"], "error: --mask needs --image, the image to inpaint"),
        (["--canny", "100"], "error: --canny takes LOW,HIGH"),
        (["--control-mode", "sobel"], "error: a control mode is one of 0 openpose, 1 depth"),
        (["--image", "missing.png"], "error: cannot read the image"),
        (["--image", str(ROOT / "assets/shapes/README.md")], "error: cannot read the image"),
        (["--prompt", " "], "error: please enter a prompt (an empty prompt would give unguided, random images)"),
        (["--ensd", "31337"], "error: an ENSD needs torch's noise: choose the noise source nv or cpu, not jax"),
        (["--sampler", "ddim", "--schedule-type", "Karras"],
         "error: DDIM runs on diffusers' schedule only, not on the Karras schedule type"),
        (["--hires-resize", "1920"], "error: --hires-resize must be WIDTHxHEIGHT, 0 for a side kept in proportion"),
        (["--image", "missing.png", "--hires-scale", "2"], "error: a hires fix follows a text-to-image pass"),
        (["--sampler", "heun", "--schedule-type", "diffusers"],
         "error: Heun is one of A1111's samplers, not diffusers'"),
        (["--clip-skip", "13"], "error: clip skip must be an integer from 1 to 12, got 13\n"),
    ],
)
def test_bad_input_exits_before_loading_the_model_with_one_line_reason(capsys, args, reason):
    """A typo fails in seconds: the values that need no model are checked before it loads. In this process
    (`sdxl.__main__.main`, as `python -m sdxl` runs it): nothing loads, so nothing compiles; the tests below
    that start a process check that its stderr is that one line too."""
    from sdxl.__main__ import main

    assert main(["generate", "--model", "tiny", "--prompt", "a lighthouse", *args]) == 2
    out, err = capsys.readouterr()
    assert err.strip().count("\n") == 0
    assert err.startswith(reason), err
    assert "loaded" not in out


@pytest.mark.cli
def test_a_refiner_that_cannot_continue_the_model_exits_nonzero_with_one_line_reason():
    result = _cli("--prompt", "a lighthouse", "--refiner", "tiny-sd1")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("error: the refiner tiny-sd1 cannot continue tiny's latents: its latent scaling")


def test_an_empty_prompt_is_refused_with_the_demos_sentence(capsys):
    from sdxl.__main__ import main
    from sdxl.serving.demo import DemoService
    from sdxl.serving.forms import Settings

    with pytest.raises(ValueError) as refused:
        DemoService._styled(Settings(prompt=""))
    assert main(["generate", "--model", "tiny", "--prompt", ""]) == 2
    assert capsys.readouterr().err == f"error: {refused.value}\n"


@pytest.mark.cli
def test_offline_without_a_cached_model_the_error_says_to_try_the_shapes_model(tmp_path):
    """No --model: SDXL base, not in an empty cache, and the Hub switched off. The CLI does not switch
    models by itself (a script gets what it asked for), but its one line says how to draw offline."""
    result = _cli("--prompt", "a red circle", model=None,
                  env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf")})
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("error: stabilityai/stable-diffusion-xl-base-1.0: not in the local Hugging Face")
    assert result.stderr.strip().endswith("run the built-in model instead: --model shapes"), result.stderr


@pytest.mark.cli
def test_the_guidance_scale_defaults_to_the_models_recommended_one(tmp_path, capsys):
    """shapes recommends 2.5 (SDXL 5), and --help says the default is the model's."""
    from sdxl.__main__ import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "default: the model's recommended value" in " ".join(capsys.readouterr().out.split())
    result = _cli("--prompt", "a red circle on a blue background", "--steps", "2", "--num-images", "1",
                  "--out", str(tmp_path), model="shapes")
    assert result.returncode == 0, result.stderr
    assert "guidance 2.5 unless given" in result.stdout
    assert "CFG scale: 2.5," in Image.open(tmp_path / "0-0.png").text["parameters"]


@pytest.mark.cli
def test_an_image_is_edited_inpainted_and_refined(tmp_path):
    """--image with --strength (its size is the output's), --mask, and --refiner's handoff, each
    recorded in the PNGs; a mask of the wrong size is one line and exit status 2."""
    picture = np.zeros((64, 96, 3), np.uint8)
    picture[:, :48] = (200, 30, 30)
    Image.fromarray(picture).save(tmp_path / "in.png")
    mask = np.zeros((64, 96), np.uint8)
    mask[16:48, 32:80] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    common = ("--prompt", "a lighthouse", "--steps", "4", "--num-images", "2")
    edited = _cli(*common, "--image", str(tmp_path / "in.png"), "--strength", "0.5", "--out", str(tmp_path / "a"))
    assert edited.returncode == 0, edited.stderr
    image = Image.open(tmp_path / "a/0-0.png")
    assert image.size == (96, 64) and "Denoising strength: 0.5" in image.text["parameters"]
    inpainted = _cli(*common, "--image", str(tmp_path / "in.png"), "--mask", str(tmp_path / "mask.png"),
                     "--strength", "0.75", "--out", str(tmp_path / "b"))
    assert inpainted.returncode == 0, inpainted.stderr
    refined = _cli(*common, "--refiner", "tiny-refiner", "--refine-from", "0.7", "--out", str(tmp_path / "c"))
    assert refined.returncode == 0, refined.stderr
    assert "Refiner: tiny-refiner, Refiner switch at: 0.7" in Image.open(tmp_path / "c/0-1.png").text["parameters"]
    Image.fromarray(mask[:32]).save(tmp_path / "small-mask.png")
    wrong = _cli(*common, "--image", str(tmp_path / "in.png"), "--mask", str(tmp_path / "small-mask.png"))
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: masks must be") and wrong.stderr.count("\n") == 1


@pytest.mark.cli
def test_missing_checkpoint_exits_nonzero(tmp_path):
    result = _cli("--prompt", "x", model=str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "not a checkpoint folder" in result.stderr


@pytest.mark.cli
def test_loras_apply_with_their_scales_and_a_missing_one_is_refused(tmp_path, generated):
    """Against the first test's images, without a LoRA (and the same program, from the compilation cache)."""
    ink = lora.write_random(tmp_path / "ink.safetensors", resolve("tiny").spec)
    plain, plain_out = generated
    styled = _cli(*GENERATE, "--lora", f"{ink}:0.6", "--lora", f"{ink}", "--out", str(tmp_path / "styled"))
    assert plain.returncode == 0 and styled.returncode == 0, styled.stderr
    assert "applied 1 LoRA(s)" in styled.stdout  # the same file twice: the last scale wins
    parameters = Image.open(tmp_path / "styled" / "3-0.png").text["parameters"]
    expected = f'Model: tiny, RNG: JAX, LoRAs: "ink:1", Lora hashes: "ink: {lora.short_hash(ink)}"'
    assert parameters.endswith(expected), parameters
    pixels = [np.asarray(Image.open(folder / "3-0.png"), int) for folder in (plain_out, tmp_path / "styled")]
    assert np.abs(pixels[0] - pixels[1]).mean() > 5

    missing = _cli(*GENERATE, "--lora", str(tmp_path / "nope.safetensors:0.5"))
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0
    assert missing.stderr.startswith(f"error: LoRA {tmp_path / 'nope.safetensors'}: no such file"), missing.stderr


@pytest.mark.cli
def test_a_lightning_unet_brings_its_steps_guidance_and_trailing_spacing(tmp_path):
    distilled = random_models.write_checkpoint(tmp_path / "distilled", random_models.SDXL_CONFIGS, seed=3)
    unet = tmp_path / "sdxl_lightning_2step_unet.safetensors"
    (distilled / "unet/diffusion_pytorch_model.safetensors").rename(unet)
    result = _cli("--prompt", "a lighthouse", "--unet", str(unet), "--num-images", "1", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    note = "SDXL-Lightning 2-step UNet: Euler with trailing steps, without guidance: 2 step(s), guidance 0"
    assert note in result.stdout
    parameters = Image.open(tmp_path / "out" / "0-0.png").text["parameters"]
    assert "Steps: 2, Sampler: Euler, Schedule type: diffusers, CFG scale: 0," in parameters
    assert "Model: tiny + sdxl_lightning_2step_unet.safetensors" in parameters


@pytest.mark.cli
def test_a_controlnet_steers_with_a_canny_map_of_the_control_image(tmp_path):
    """--controlnet with --control-image FILE:SCALE and --canny; a control image without a ControlNet
    is one line and exit status 2."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(resolve("tiny").folder / "unet")
    ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(4, 8, 8, 16)).save_pretrained(tmp_path / "cn")
    picture = np.zeros((64, 96, 3), np.uint8)
    picture[16:48, 24:72] = 255
    Image.fromarray(picture).save(tmp_path / "in.png")
    common = ["--prompt", "a box", "--steps", "2", "--num-images", "1", "--height", "64", "--width", "96"]
    result = _cli(*common, "--controlnet", str(tmp_path / "cn"), "--control-image", f"{tmp_path / 'in.png'}:0.6",
                  "--canny", "100,200", "--control-end", "0.5", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    made = Image.open(tmp_path / "out/0-0.png")
    assert made.size == (96, 64)
    assert ('ControlNet 0: "Module: canny, Model: cn, Weight: 0.6, Threshold A: 100, Threshold B: 200, '
            'Guidance Start: 0, Guidance End: 0.5"') in made.info["parameters"], made.info["parameters"]
    refused = _cli(*common, "--control-image", str(tmp_path / "in.png"))
    assert refused.returncode == 2 and refused.stderr.startswith("error: no ControlNet is loaded")


@pytest.mark.cli
def test_ip_adapters_take_an_image_prompt_and_record_it_as_the_a1111_extension(tmp_path):
    """--ip-adapter twice with one --ip-adapter-image FILE:SCALE for both: each a unit in the PNG's parameters;
    InstantStyle's layers on a UNet without SDXL's blocks are one sentence and exit status 2."""
    from sdxl.engine.pipeline import Pipeline

    random_models.write_ip_adapter(tmp_path / "ip", Pipeline.from_pretrained("tiny", dtype="float32").spec.unet,
                                   kinds=("plain", "plus"))
    Image.fromarray(np.full((40, 60, 3), 200, np.uint8)).save(tmp_path / "in.png")
    folder = tmp_path / "ip/sdxl_models"
    common = ["--prompt", "a box", "--steps", "2", "--num-images", "1", "--ip-adapter",
              str(folder / "ip-adapter.safetensors"), "--ip-adapter", str(folder / "ip-adapter-plus.safetensors")]
    result = _cli(*common, "--ip-adapter-image", f"{tmp_path / 'in.png'}:0.8", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    parameters = Image.open(tmp_path / "out/0-0.png").info["parameters"]
    assert ('ControlNet 0: "Module: ip-adapter_clip_h, Model: ip-adapter, Weight: 0.8, Guidance Start: 0, '
            'Guidance End: 1", ControlNet 1: "Module: ip-adapter_clip_h, Model: ip-adapter-plus, Weight: 0.8, ') \
        in parameters, parameters
    refused = _cli(*common, "--ip-adapter-image", str(tmp_path / "in.png"), "--ip-adapter-layers", "style")
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: the style preset scales SDXL's blocks (InstantStyle's), which this "
                                     "model's UNet lacks"), refused.stderr
