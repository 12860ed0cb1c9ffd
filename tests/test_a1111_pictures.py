"""Same seed, same picture: an infotext as AUTOMATIC1111 writes it, pasted as
`pipe.generate(**read_parameters(text), num_images=2)`, draws A1111's two images, a hires fix's too.

A1111 here is its txt2img re-implemented in torch over k-diffusion's own samplers and its own noise
(`kdiffusion_reference.txt2img`, and for the hires fix `hires_pass` after torch's interpolate or
PIL's Lanczos), with the conditioning webui computes (`a1111_reference`), on a tiny random SDXL (and
for clip skip a tiny random SD 1.x) in float32 whose UNet and VAE are diffusers' modules.
"""

import functools

import numpy as np
import pytest
import torch
from PIL import Image

import a1111_reference
import kdiffusion_reference as webui
import safetensors.numpy
from reference import sd_pipeline, sdxl_pipeline
from test_single_file import _single_file
from sdxl import Pipeline, read_parameters
from sdxl.engine.infotext import infotext_quote

HEIGHT, WIDTH = 64, 96
PROMPT, NEGATIVE = "a red cube on a table, (soft light:1.2)", "blurry"
SEED, STEPS, CFG = 11, 6, 5.0

# Each case: the fields of A1111's settings line that differ from one text to the next.
CASES = {
    "Euler a, Automatic, NV, ENSD": {"Sampler": "Euler a", "Schedule type": "Automatic", "ENSD": 31337, "RNG": "NV"},
    "Euler a, Karras, CPU, variation seed": {
        "Sampler": "Euler a", "Schedule type": "Karras", "Variation seed": 7, "Variation seed strength": 0.3,
        "RNG": "CPU",
    },
    "Euler a, Exponential, GPU (NV), variation seed, ENSD": {
        "Sampler": "Euler a", "Schedule type": "Exponential", "Variation seed": 1234, "Variation seed strength": 0.6,
        "ENSD": 1,
    },
    "Euler, Automatic, CPU": {"Sampler": "Euler", "Schedule type": "Automatic", "RNG": "CPU"},
    "Euler, Karras, NV": {"Sampler": "Euler", "Schedule type": "Karras", "RNG": "NV"},
    "Euler, Exponential, CPU, variation seed": {
        "Sampler": "Euler", "Schedule type": "Exponential", "Variation seed": 3, "Variation seed strength": 0.5,
        "RNG": "CPU",
    },
    "DPM++ 2M, Automatic, NV": {"Sampler": "DPM++ 2M", "Schedule type": "Automatic", "RNG": "NV"},
    "DPM++ 2M Karras (before 1.9), CPU": {"Sampler": "DPM++ 2M Karras", "RNG": "CPU"},
    "DPM++ 2M, Exponential, NV, variation seed": {
        "Sampler": "DPM++ 2M", "Schedule type": "Exponential", "Variation seed": 99, "Variation seed strength": 0.2,
    },
    # Beyond the three most used: the other deterministic and ancestral samplers, and other schedule types.
    "Heun, Beta, CPU": {"Sampler": "Heun", "Schedule type": "Beta", "RNG": "CPU"},
    "DPM2 a, Automatic, NV, ENSD": {"Sampler": "DPM2 a", "Schedule type": "Automatic", "ENSD": 31337, "RNG": "NV"},
    "DPM++ 2S a, SGM Uniform, CPU": {"Sampler": "DPM++ 2S a", "Schedule type": "SGM Uniform", "RNG": "CPU"},
    "LMS, KL Optimal, NV": {"Sampler": "LMS", "Schedule type": "KL Optimal", "RNG": "NV"},
    "Euler a, DDIM (one step more), CPU": {"Sampler": "Euler a", "Schedule type": "DDIM", "RNG": "CPU"},
    "DPM2, Align Your Steps, NV": {"Sampler": "DPM2", "Schedule type": "Align Your Steps", "RNG": "NV"},
    # The SDE samplers, their noise from A1111's Brownian trees.
    "DPM++ 2M SDE, Karras, NV": {"Sampler": "DPM++ 2M SDE", "Schedule type": "Karras", "RNG": "NV"},
    "DPM++ 2M SDE, Automatic, CPU, variation seed": {
        "Sampler": "DPM++ 2M SDE", "Schedule type": "Automatic", "Variation seed": 5, "Variation seed strength": 0.4,
        "RNG": "CPU",
    },
    "DPM++ SDE, Karras, CPU": {"Sampler": "DPM++ SDE", "Schedule type": "Karras", "RNG": "CPU"},
    "DPM++ 3M SDE, Exponential, NV": {"Sampler": "DPM++ 3M SDE", "Schedule type": "Exponential", "RNG": "NV"},
    "DPM++ 2M SDE Heun, Karras, CPU": {"Sampler": "DPM++ 2M SDE Heun", "Schedule type": "Karras", "RNG": "CPU"},
    # webui writes an SDXL picture's clip skip but ignores it (its setting sdxl_clip_l_skip is off by default).
    "Euler, Karras, Clip skip 2 ignored, NV": {"Sampler": "Euler", "Schedule type": "Karras", "Clip skip": 2},
}
# SD 1.x, where clip skip reads an earlier layer of the text encoder. One sampler (the SDXL cases cover
# the others), so that both cases run one compiled program: the clip skip is its input.
SD1_CASES = {
    "Euler a, Karras, Clip skip 2, NV": {"Sampler": "Euler a", "Schedule type": "Karras", "Clip skip": 2, "RNG": "NV"},
    "Euler a, Automatic, Clip skip 3, CPU": {"Sampler": "Euler a", "Schedule type": "Automatic", "Clip skip": 3,
                                             "RNG": "CPU"},
}
# The SDE samplers' Brownian trees round their times to 6 decimals, so a sigma one float32 ulp away (numpy's
# exp against torch's, in the Exponential schedule or DPM++ SDE's midpoints) can move a split of the tree:
# measured up to 2.8e-4 then, within 1.1e-5 otherwise.
SDE_TOLERANCE = 5e-4
# An image upscaler's pass makes the first pass's pictures uint8 by truncation: a pixel within float error of
# a step may land on the other one (1/255 apart), which the second pass carries on: measured 9.8e-5.
IMAGE_UPSCALER_TOLERANCE = 5e-4
# Zero terminal SNR's noise levels reach 4519, where one float32 ulp of a Karras sigma (numpy's power against
# torch's: 1.2e-4 at its second sigma, 1124) is past the trees' 6 decimals: measured 1.1e-3.
ZERO_SNR_SDE_TOLERANCE = 2e-3
# Hires fixes: the first pass's fields, then the hires pass's (2x, from 64x96 to 128x192).
HIRES_CASES = {
    "Euler a, Latent, NV": {
        "Sampler": "Euler a", "Schedule type": "Automatic", "RNG": "NV", "Denoising strength": 0.5,
        "Hires upscale": 2, "Hires steps": 4, "Hires upscaler": "Latent",
    },
    "DPM++ 2M SDE, Karras, Latent (bicubic antialiased), CPU, ENSD": {
        "Sampler": "DPM++ 2M SDE", "Schedule type": "Karras", "RNG": "CPU", "ENSD": 31337, "Denoising strength": 0.6,
        "Hires upscale": 2, "Hires steps": 3, "Hires upscaler": "Latent (bicubic antialiased)",
    },
    "DPM++ 2M, Lanczos, hires sampler Euler a, hires CFG and prompt, NV": {
        "Sampler": "DPM++ 2M", "Schedule type": "Karras", "Denoising strength": 0.45, "Hires upscale": 2,
        "Hires upscaler": "Lanczos", "Hires sampler": "Euler a", "Hires CFG Scale": 3.5, "Hires prompt": "a blue cube",
    },
    "Euler, Latent (nearest-exact), the first pass's steps, variation seed, CPU": {
        "Sampler": "Euler", "Schedule type": "Exponential", "RNG": "CPU", "Variation seed": 8,
        "Variation seed strength": 0.3, "Denoising strength": 0.7, "Hires resize": "192x128",
        "Hires upscaler": "Latent (nearest-exact)",
    },
}
# processing.py's create_infotext order, for the fields above.
ORDER = ("Steps", "Sampler", "Schedule type", "CFG scale", "Seed", "Size", "Model hash", "Model", "Variation seed",
         "Variation seed strength", "Denoising strength", "Clip skip", "ENSD", "RNG", "Noise Schedule", "Hires upscale",
         "Hires resize", "Hires steps", "Hires upscaler", "Hires sampler", "Hires CFG Scale", "Hires prompt", "Version")
# A v-prediction model with zero terminal SNR (a single file with `v_pred` and `ztsnr` keys, as NoobAI-XL
# V-Pred): webui's v denoiser over its rescaled schedule. webui writes its "Noise schedule" setting,
# "Default" for such a model, "Zero Terminal SNR" where the setting asks for it.
ZERO_SNR_CASES = {
    "Euler a, Automatic, NV": {"Sampler": "Euler a", "Schedule type": "Automatic", "Noise Schedule": "Default"},
    "DPM++ 2M Karras, CPU": {"Sampler": "DPM++ 2M", "Schedule type": "Karras", "RNG": "CPU",
                             "Noise Schedule": "Zero Terminal SNR"},
    "Euler, Exponential, NV": {"Sampler": "Euler", "Schedule type": "Exponential", "Noise Schedule": "Default"},
    "DPM++ 2M SDE, Karras, CPU": {"Sampler": "DPM++ 2M SDE", "Schedule type": "Karras", "RNG": "CPU",
                                  "Noise Schedule": "Default"},
}


# Prompt editing and alternation (the prompts' own fields, beside the settings'), with a one- and a
# two-evaluation-per-step sampler: webui's denoiser counts its calls. The first two share a sampler and so
# a compiled program (two conditionings; the prompts' are its input).
EDIT_CASES = {
    "[cat:dog:0.5], Euler a": {"prompt": "[cat:dog:0.5]", "Sampler": "Euler a", "Schedule type": "Automatic"},
    "[red|blue], Euler a": {"prompt": "[red|blue]", "Sampler": "Euler a", "Schedule type": "Automatic", "RNG": "CPU"},
    "edits in both prompts, Heun": {
        "prompt": "a [red|blue|] cube, [(soft light:1.2)::4]", "negative": "[blurry:noisy:0.25]", "Sampler": "Heun",
        "Schedule type": "Karras",
    },
    # CFG 1: our program runs the prompts alone (no negative pass); webui mixes both with weight 1.
    "[red|blue], CFG 1": {"prompt": "a [red|blue] cube", "Sampler": "Euler", "Schedule type": "Automatic",
                          "CFG scale": 1.0},
    "nested, DPM++ 2M": {"prompt": "[a [red|blue]:a green cube:0.6] on a table", "Sampler": "DPM++ 2M",
                         "Schedule type": "Automatic"},
    # The hires pass counts its own steps: 1.5 is half-way through it, 9 its third step after the first
    # pass's 6 (webui's hires scheduling, not its "old" option).
    "hires fix, Euler a": {
        "prompt": "[[red:blue:1.5] cube:a sphere:9]", "negative": "[blurry|noisy]", "Sampler": "Euler a",
        "Schedule type": "Automatic", "Denoising strength": 0.5, "Hires upscale": 2, "Hires steps": 4,
        "Hires upscaler": "Latent",
    },
}


def infotext(case: dict) -> str:
    """The "parameters" text A1111 writes for the first image of a batch with these settings."""
    fields = {"Steps": STEPS, "CFG scale": CFG, "Seed": SEED, "Size": f"{WIDTH}x{HEIGHT}",
              "Model hash": "0123456789", "Model": "tiny", "Version": "v1.10.1", **case}
    settings = ", ".join(f"{key}: {fields[key]:g}" if isinstance(fields[key], float) else
                         f"{key}: {infotext_quote(fields[key])}" for key in ORDER if key in fields)
    return f"{case.get('prompt', PROMPT)}\nNegative prompt: {case.get('negative', NEGATIVE)}\n{settings}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(our pipeline, the diffusers modules A1111's model is made of) for one tiny random SDXL."""
    folder = tmp_path_factory.mktemp("sdxl-a1111")
    ref = sdxl_pipeline(folder)
    return Pipeline.from_pretrained(folder, dtype="float32", max_steps=16), ref


@pytest.fixture(scope="module")
def zero_snr_reference(tmp_path_factory):
    """As `reference`, the model written as a single file with `v_pred` and `ztsnr` keys and loaded from it."""
    folder = tmp_path_factory.mktemp("sdxl-zero-snr-a1111")
    ref = sdxl_pipeline(folder / "diffusers")
    file = _single_file(folder / "diffusers", "sdxl", folder / "tiny.safetensors")  # "Model: tiny", as loaded
    tensors = safetensors.numpy.load_file(file) | {key: np.zeros((0,), np.float32) for key in ("v_pred", "ztsnr")}
    safetensors.numpy.save_file(tensors, file)
    return Pipeline.from_pretrained(str(file), config=str(folder / "diffusers"), dtype="float32", max_steps=16), ref


@pytest.fixture(scope="module")
def sd1_reference(tmp_path_factory):
    """As `reference`, for one tiny random SD 1.x."""
    folder = tmp_path_factory.mktemp("sd1-a1111")
    ref = sd_pipeline(folder)
    return Pipeline.from_pretrained(folder, dtype="float32", max_steps=16), ref


def a1111_images(ref, case: dict, shape: tuple[int, int, int], zero_snr_v: bool = False) -> np.ndarray:
    """[2, H, W, 3] float32 in [0, 1]: A1111's txt2img of batch size 2 for the case's settings, on
    latents of `shape` [C, h, w]; with a hires fix, its second pass's images. `ref` is an SDXL or an
    SD 1.x pipeline; with `zero_snr_v`, its UNet a v-prediction one trained with zero terminal SNR."""
    config = ref.scheduler.config
    sdxl = hasattr(ref, "text_encoder_2")

    def unet(x, t, cond):
        added = {"added_cond_kwargs": {"text_embeds": cond["pooled"], "time_ids": cond["time_ids"]}} if sdxl else {}
        return ref.unet(x, t.flatten(), encoder_hidden_states=cond["crossattn"], **added).sample

    model = webui.model_wrap(webui.CompVisModel(unet, config.beta_start, config.beta_end, config.num_train_timesteps,
                                                zero_terminal_snr=zero_snr_v),
                             "v_prediction" if zero_snr_v else "epsilon")
    clip_skip = case.get("Clip skip", 1)
    schedule_type = case.get("Schedule type", "Automatic")
    sampler = case["Sampler"]
    if sampler.endswith(" Karras"):  # a sampler's name before 1.9 held its schedule type
        sampler, schedule_type = sampler.removesuffix(" Karras"), "Karras"
    # processing.py's setup_conds: prompts are scheduled over the sampler's total_steps; calculate_hr_conds:
    # a hires pass's over the first pass's and its own (its sampler's, of its steps).
    def total_steps(sampler_name, steps):
        return steps * (2 if webui.SAMPLERS[sampler_name][1].get("second_order") else 1)

    def encoded(prompt, negative, height, width):
        if not sdxl:
            z = a1111_reference.sd1_conditioning(prompt, ref.tokenizer, ref.text_encoder, clip_skip=clip_skip)
            return {"crossattn": z.repeat(2, 1, 1)}
        encoders = (ref.tokenizer, ref.tokenizer_2), (ref.text_encoder, ref.text_encoder_2)
        z, pooled = a1111_reference.sdxl_conditioning(prompt, *encoders, negative=negative, clip_skip=clip_skip)
        time_ids = torch.tensor([[height, width, 0, 0, height, width]] * 2, dtype=torch.float32)
        return {"crossattn": z.repeat(2, 1, 1), "pooled": pooled.repeat(2, 1), "time_ids": time_ids}

    def conditioning(prompt, negative, height=HEIGHT, width=WIDTH, hires_steps=None):
        """The prompt's schedule [(end_at_step, conditioning)], webui's `get_learned_conditioning`."""
        schedule = a1111_reference.prompt_schedule(prompt, total_steps(sampler, STEPS), hires_steps)
        return [(end, encoded(text, negative, height, width)) for end, text in schedule]
    scale = ref.vae.config.scaling_factor
    seeds = dict(seed=SEED, subseed=case.get("Variation seed", 0), ensd=case.get("ENSD", 0),
                 subseed_strength=case.get("Variation seed strength", 0.0),
                 source=case.get("RNG", "NV"))  # no RNG field: the GPU source, on NVIDIA cards NV's numbers
    with torch.no_grad():
        prompt, negative = case.get("prompt", PROMPT), case.get("negative", NEGATIVE)
        latents = webui.txt2img(model, conditioning(prompt, False), conditioning(negative, True), sampler=sampler,
                                scheduler=schedule_type, steps=STEPS, cfg_scale=case.get("CFG scale", CFG), shape=shape,
                                **seeds)
        if "Hires upscaler" in case:
            hires_steps = total_steps(case.get("Hires sampler", sampler), case.get("Hires steps", STEPS))
            hires_conditioning = functools.partial(conditioning, hires_steps=hires_steps)
            latents = a1111_hires_pass(ref, model, hires_conditioning, latents, case, sampler, schedule_type, seeds)
        images = ref.vae.decode(latents / scale).sample
    return (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def a1111_hires_pass(ref, model, conditioning, latents, case: dict, sampler, schedule_type, seeds) -> torch.Tensor:
    """processing.py's sample_hr_pass for a case: the latents interpolated to the target (a latent
    upscaler), or decoded, made uint8 by truncation, resized by PIL's Lanczos (webui's Lanczos
    upscaler from 64x96 to twice that: one resize) and encoded (the posterior's mean: webui samples
    it with an unrecorded generator); then `hires_pass` with SDXL's conditioning at the new size."""
    height, width = 2 * HEIGHT, 2 * WIDTH
    modes = {"Latent": ("bilinear", False), "Latent (bicubic antialiased)": ("bicubic", True),
             "Latent (nearest-exact)": ("nearest-exact", False)}
    scale = ref.vae.config.scaling_factor
    if case["Hires upscaler"] in modes:
        mode, antialias = modes[case["Hires upscaler"]]
        upscaled = torch.nn.functional.interpolate(latents, size=(height // 8, width // 8), mode=mode,
                                                   antialias=antialias)
    else:
        decoded = ((ref.vae.decode(latents / scale).sample + 1) / 2).clamp(0, 1)
        pictures = (255.0 * decoded.permute(0, 2, 3, 1).numpy()).astype(np.uint8)
        resized = [np.asarray(Image.fromarray(p).resize((width, height), resample=Image.LANCZOS)) for p in pictures]
        images = torch.from_numpy(np.stack(resized).astype(np.float32) / 255.0).permute(0, 3, 1, 2)
        upscaled = ref.vae.encode(images * 2 - 1).latent_dist.mean * scale
    hires_sampler = case.get("Hires sampler", sampler)
    return webui.hires_pass(
        model, conditioning(case.get("Hires prompt", case.get("prompt", PROMPT)), False, height, width),
        conditioning(case.get("negative", NEGATIVE), True, height, width), upscaled, sampler=hires_sampler,
        scheduler=schedule_type,
        steps=case.get("Hires steps", STEPS), strength=case["Denoising strength"],
        cfg_scale=case.get("Hires CFG Scale", CFG), **seeds,
    )


def pasted_and_a1111s(pipe, ref, case: dict) -> tuple[np.ndarray, np.ndarray, dict]:
    """Our two images of the case's infotext pasted into `generate`, A1111's, and the parameters read."""
    with pytest.warns(UserWarning, match=r"parameters not applied: Model$"):
        parameters = read_parameters(infotext(case))
    ours = pipe.generate(**parameters, num_images=2, output_type="np")
    h, w, c = pipe.spec.latent_shape(HEIGHT, WIDTH)
    theirs = a1111_images(ref, case, (c, h, w))
    print(f"max abs diff {np.abs(ours - theirs).max():.2e}")
    return ours, theirs, parameters


@pytest.mark.oracle
@pytest.mark.parametrize("case", CASES)
def test_a_pasted_a1111_infotext_draws_a1111s_images(reference, case):
    ours, theirs, _ = pasted_and_a1111s(*reference, CASES[case])
    diff = np.abs(ours - theirs).max()
    assert diff <= (SDE_TOLERANCE if "SDE" in CASES[case]["Sampler"] else 1e-4)
    assert np.abs(theirs[0] - theirs[1]).max() > 1e-2, "the batch's two images differ"


@pytest.mark.oracle
@pytest.mark.parametrize("case", ZERO_SNR_CASES)
def test_a_pasted_infotext_of_a_zero_snr_v_prediction_file_draws_a1111s_images(zero_snr_reference, case):
    pipe, ref = zero_snr_reference
    assert pipe.spec.sampling == "v-prediction, zero terminal SNR"
    parameters = read_parameters(infotext(ZERO_SNR_CASES[case]), pipe)  # no warning: it is the model loaded
    ours = pipe.generate(**parameters, num_images=2, output_type="np")
    h, w, c = pipe.spec.latent_shape(HEIGHT, WIDTH)
    theirs = a1111_images(ref, ZERO_SNR_CASES[case], (c, h, w), zero_snr_v=True)
    diff = np.abs(ours - theirs).max()
    print(f"max abs diff {diff:.2e}")
    assert theirs.std() > 0.05 and diff <= (ZERO_SNR_SDE_TOLERANCE if "SDE" in case else 1e-4)


@pytest.mark.oracle
@pytest.mark.parametrize("case", SD1_CASES)
def test_a_pasted_sd1_infotext_with_clip_skip_draws_a1111s_images(sd1_reference, case):
    pipe, ref = sd1_reference
    ours, theirs, parameters = pasted_and_a1111s(pipe, ref, SD1_CASES[case])
    assert parameters["clip_skip"] == SD1_CASES[case]["Clip skip"]
    assert np.abs(ours - theirs).max() <= 1e-4
    h, w, c = pipe.spec.latent_shape(HEIGHT, WIDTH)
    unskipped = a1111_images(ref, {**SD1_CASES[case], "Clip skip": 1}, (c, h, w))
    assert np.abs(unskipped - theirs).max() > 1e-2, "the clip skip changes the pictures"


@pytest.mark.oracle
@pytest.mark.parametrize("case", HIRES_CASES)
def test_a_pasted_hires_fix_draws_a1111s_upscaled_images(reference, case):
    ours, theirs, _ = pasted_and_a1111s(*reference, HIRES_CASES[case])
    assert ours.shape == (2, 2 * HEIGHT, 2 * WIDTH, 3)
    diff = np.abs(ours - theirs).max()
    in_latents = HIRES_CASES[case]["Hires upscaler"].startswith("Latent")
    assert diff <= (SDE_TOLERANCE if "SDE" in HIRES_CASES[case]["Sampler"] else 1e-4 if in_latents
                    else IMAGE_UPSCALER_TOLERANCE)


@pytest.mark.oracle
@pytest.mark.parametrize("case", EDIT_CASES)
def test_a_pasted_prompt_edit_draws_a1111s_images(reference, case):
    ours, theirs, parameters = pasted_and_a1111s(*reference, EDIT_CASES[case])
    assert parameters["prompt"] == EDIT_CASES[case]["prompt"]
    assert ours.shape[1] == (2 if "Hires upscale" in EDIT_CASES[case] else 1) * HEIGHT
    assert np.abs(ours - theirs).max() <= 1e-4


@pytest.mark.oracle
def test_a_prompt_edit_changes_the_images_by_far_more_than_the_tolerance(reference):
    """[cat:dog:0.5] switches late, where steps change little: still 10 times the tolerance from "cat"."""
    pipe, _ = reference
    with pytest.warns(UserWarning, match=r"parameters not applied: Model$"):
        parameters = read_parameters(infotext(EDIT_CASES["[cat:dog:0.5], Euler a"]))
    edited = pipe.generate(**parameters, num_images=2, output_type="np")
    plain = pipe.generate(**{**parameters, "prompt": "cat"}, num_images=2, output_type="np")
    assert np.abs(edited - plain).max() > 1e-3
