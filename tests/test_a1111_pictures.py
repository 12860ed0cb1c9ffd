"""Same seed, same picture: an infotext as AUTOMATIC1111 writes it, pasted as
`pipe.generate(**read_parameters(text), num_images=2)`, draws A1111's two images.

A1111 here is its txt2img re-implemented in torch over k-diffusion's own samplers and its own noise
(`kdiffusion_reference.txt2img`), with the conditioning webui computes (`a1111_reference`), on a
tiny random SDXL in float32 whose UNet and VAE are diffusers' modules.
"""

import numpy as np
import pytest
import torch

import a1111_reference
import kdiffusion_reference as webui
from reference import sdxl_pipeline
from sdxl import Pipeline, read_parameters

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
}
# The SDE samplers' Brownian trees round their times to 6 decimals, so a sigma one float32 ulp away (numpy's
# exp against torch's, in the Exponential schedule or DPM++ SDE's midpoints) can move a split of the tree:
# measured up to 2.8e-4 then, within 1.1e-5 otherwise.
SDE_TOLERANCE = 5e-4
# processing.py's create_infotext order, for the fields above.
ORDER = ("Steps", "Sampler", "Schedule type", "CFG scale", "Seed", "Size", "Model hash", "Model", "Variation seed",
         "Variation seed strength", "ENSD", "RNG", "Version")


def infotext(case: dict) -> str:
    """The "parameters" text A1111 writes for the first image of a batch with these settings."""
    fields = {"Steps": STEPS, "CFG scale": CFG, "Seed": SEED, "Size": f"{WIDTH}x{HEIGHT}",
              "Model hash": "0123456789", "Model": "tiny", "Version": "v1.10.1", **case}
    settings = ", ".join(f"{key}: {fields[key]:g}" if isinstance(fields[key], float) else f"{key}: {fields[key]}"
                         for key in ORDER if key in fields)
    return f"{PROMPT}\nNegative prompt: {NEGATIVE}\n{settings}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(our pipeline, the diffusers modules A1111's model is made of) for one tiny random SDXL."""
    folder = tmp_path_factory.mktemp("sdxl-a1111")
    ref = sdxl_pipeline(folder)
    return Pipeline.from_pretrained(folder, dtype="float32", max_steps=8), ref


def a1111_images(ref, case: dict, shape: tuple[int, int, int]) -> np.ndarray:
    """[2, H, W, 3] float32 in [0, 1]: A1111's txt2img of batch size 2 for the case's settings, on
    latents of `shape` [C, h, w]."""
    config = ref.scheduler.config

    def unet(x, t, cond):
        return ref.unet(x, t.flatten(), encoder_hidden_states=cond["crossattn"],
                        added_cond_kwargs={"text_embeds": cond["pooled"], "time_ids": cond["time_ids"]}).sample

    model = webui.CompVisModel(unet, config.beta_start, config.beta_end, config.num_train_timesteps)
    encoders = (ref.tokenizer, ref.tokenizer_2), (ref.text_encoder, ref.text_encoder_2)
    time_ids = torch.tensor([[HEIGHT, WIDTH, 0, 0, HEIGHT, WIDTH]] * 2, dtype=torch.float32)

    def conditioning(prompt, negative):
        z, pooled = a1111_reference.sdxl_conditioning(prompt, *encoders, negative=negative)
        return {"crossattn": z.repeat(2, 1, 1), "pooled": pooled.repeat(2, 1), "time_ids": time_ids}

    schedule_type = case.get("Schedule type", "Automatic")
    sampler = case["Sampler"]
    if sampler.endswith(" Karras"):  # a sampler's name before 1.9 held its schedule type
        sampler, schedule_type = sampler.removesuffix(" Karras"), "Karras"
    scale = ref.vae.config.scaling_factor
    with torch.no_grad():
        latents = webui.txt2img(
            webui.model_wrap(model), conditioning(PROMPT, False), conditioning(NEGATIVE, True), sampler=sampler,
            scheduler=schedule_type, steps=STEPS, cfg_scale=CFG, seed=SEED, subseed=case.get("Variation seed", 0),
            subseed_strength=case.get("Variation seed strength", 0.0), ensd=case.get("ENSD", 0),
            source=case.get("RNG", "NV"),  # no RNG field: the GPU source, on NVIDIA cards NV's numbers
            shape=shape,
        )
        images = ref.vae.decode(latents / scale).sample
    return (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


@pytest.mark.oracle
@pytest.mark.parametrize("case", CASES)
def test_a_pasted_a1111_infotext_draws_a1111s_images(reference, case):
    pipe, ref = reference
    text = infotext(CASES[case])
    with pytest.warns(UserWarning, match=r"parameters not applied: Model$"):
        parameters = read_parameters(text)
    ours = pipe.generate(**parameters, num_images=2, output_type="np")
    h, w, c = pipe.spec.latent_shape(HEIGHT, WIDTH)
    theirs = a1111_images(ref, CASES[case], (c, h, w))
    diff = np.abs(ours - theirs).max()
    print(f"{case}: max abs diff {diff:.2e}")
    assert diff <= (SDE_TOLERANCE if "SDE" in CASES[case]["Sampler"] else 1e-4)
    assert np.abs(theirs[0] - theirs[1]).max() > 1e-2, "the batch's two images differ"
