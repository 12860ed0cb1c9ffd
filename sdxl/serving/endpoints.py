"""What the demo's endpoints do, for their clients: the API page, gradio_client and the MCP tools
(`python app.py --mcp`), which read each handler's docstring for the tool's description and its
parameters' (Gradio's "Args:" convention)."""

import re
from collections.abc import Sequence

from ..engine.image_prompts import SCALE_PRESETS
from ..prompts.syntax import EMPHASIS_MODES
from ..sampling.noise import NOISE_SOURCES
from .grid import AXES

_IMAGES = ("Returns the images (PNG files that carry their settings as an AUTOMATIC1111 infotext) and a status "
           "line saying how long they took.")
DESCRIPTIONS = {
    "generate": "Draws images from a text prompt with Stable Diffusion XL in JAX, one per accelerator core (more "
                "with images_per_core). " + _IMAGES,
    "image_to_image": "Redraws a picture after a text prompt: all of it (mask omitted), or only where a mask is "
                      "white (inpainting); strength says how much changes. " + _IMAGES,
    "compare": "Draws several prompts (one per line) from the same seed, or one prompt from consecutive seeds, side "
               "by side, in one device call. " + _IMAGES,
    "grid": "Draws an X/Y grid: one setting (seed, guidance scale, steps, sampler, prompt, ...) varies across, "
            "another down. Returns the grid as one picture, its cells, and a status line.",
    "upscale": "Upscales a picture with a model upscaler (ESRGAN-like, loaded at launch) or a plain resize. Returns "
               "the upscaled picture and what was done.",
}
PARAMETERS = {
    "prompt": "what to draw; AUTOMATIC1111's syntax: (word:1.2) weighs a word, BREAK starts a new 75-token chunk",
    "negative_prompt": "what to avoid (empty: nothing)",
    "style": "a style that wraps the prompt, by its name on the page ('No style': the prompt as written)",
    "seed": "the noise's seed, 0 to 2^32-1; a request's images are that seed's first, second, ... draws",
    "guidance_scale": "how closely the images follow the prompt; 1 or less: no guidance, twice as fast",
    "steps": "denoising steps, 1 to 100 (default: the model's)",
    "width": "width in pixels, one of the model's sizes (default: its first)",
    "height": "height in pixels, one of the model's sizes (default: its first)",
    "images_per_core": "images on each accelerator core (the request draws cores x this many)",
    "sampler": "the sampler by its A1111 name, e.g. 'Euler a', 'DPM++ 2M' (default: the model's own)",
    "emphasis": f"how (word:1.2) weights apply, as AUTOMATIC1111's setting: {', '.join(EMPHASIS_MODES)}",
    "refine": "finish the images with the refiner loaded at launch",
    "refine_from": "the fraction of the noise the model removes before the refiner takes over",
    "noise_source": f"where the noise comes from: {', '.join(NOISE_SOURCES)} (nv and cpu: the noise AUTOMATIC1111, "
                    "Forge and ComfyUI draw for a seed)",
    "ensd": "AUTOMATIC1111's eta noise seed delta (noise nv or cpu), often 31337",
    "variation_seed": "a second seed whose noise is mixed in (noise nv or cpu)",
    "variation_strength": "how much of the variation seed's noise, 0 to 1",
    "schedule_type": "an AUTOMATIC1111 schedule type (Karras, Exponential, ...; empty: the sampler's own)",
    "clip_skip": "AUTOMATIC1111's clip skip, 1 to 12: SD 1.x reads its text encoder this many layers from the last "
                 "(SD 2.x and SDXL ignore it)",
    "sdxl_clip_l_skip": "AUTOMATIC1111's 'Clip skip SDXL': SDXL's CLIP-L encoder skips as clip_skip says",
    "hires": "hires fix: draw, upscale, then draw again at the bigger size (as AUTOMATIC1111)",
    "hires_upscaler": "the hires fix's upscaler: Latent (resizes the latents) or a picture upscaler",
    "hires_scale": "the hires fix's upscale factor, 1 to 4",
    "hires_steps": "the hires fix's second pass's steps (0: as many as the first)",
    "hires_strength": "how much the hires fix's second pass changes, 0.05 to 1",
    "image": "the picture to redraw (a file)",
    "mask": "where to redraw: white redrawn, black kept (a file; omit it to redraw everywhere)",
    "strength": "how much changes, 0.05 to 1: low keeps the picture, 1 redraws it",
    "mode": "'One prompt per line, same seed', 'One prompt, consecutive seeds' or, where several models are loaded, "
            "'One prompt and seed, each model'",
    "prompts": "the prompts, one per line (or one prompt, for consecutive seeds)",
    "num_seeds": "how many consecutive seeds, from seed",
    "x_axis": f"the setting that varies across: {', '.join(AXES)}, lora:<name>, or model (the models' names)",
    "x_values": "its values, comma-separated or one per line; ranges like 1-4",
    "y_axis": "the setting that varies down (as x_axis)",
    "y_values": "its values (as x_values)",
    "control_image": "a picture that steers the images through the ControlNet (a file; omit it for none)",
    "control_preprocessor": "canny (the picture's edges are the control map) or none (the picture is the map)",
    "canny_low": "Canny's low threshold, 1 to 255",
    "canny_high": "Canny's high threshold, 1 to 255",
    "control_scale": "how strongly the ControlNet steers, 0 to 2",
    "control_start": "the fraction of the steps where it starts steering",
    "control_end": "the fraction of the steps where it stops",
    "control_mode": "what the control map is, for a ControlNet Union (canny, depth, openpose, ...)",
    "ip_adapter_image": "a picture whose subject or style steers the images (IP-Adapter; a file; omit it for none)",
    "ip_adapter": "the IP-Adapter that takes it, by its file's name (default: the first)",
    "ip_adapter_scale": "how much the picture counts beside the prompt, 0 to 2",
    "ip_adapter_layers": f"where it steers: {', '.join(SCALE_PRESETS)} (style: its look, not its layout)",
    "model": "the model to draw with, by its name as given at launch (--model); default: the first",
    "guidance_rescale": "CFG rescale (Lin et al.), 0 to 1, for v-prediction models with zero terminal SNR; 0.7 is "
                        "usual; default: 0 (off)",
    "picture": "the picture to upscale (a file)",
    "upscaler": "a model upscaler loaded at launch, by name, or a resize (Lanczos, ...)",
    "factor": "how many times bigger, 1 to 4",
}


def describe(parameter: str) -> str:
    """What a parameter is: `PARAMETERS`', a second ControlNet's ("control_scale_2") as the first's, a
    LoRA's scale by its name."""
    if parameter.startswith("lora_"):
        return f"the scale of the LoRA {parameter.removeprefix('lora_')} (0: off)"
    numbered = re.fullmatch(r"(.+)_(\d+)", parameter)
    if parameter not in PARAMETERS and numbered and numbered[1] in PARAMETERS:
        return f"{PARAMETERS[numbered[1]]} (ControlNet {numbered[2]})"
    return PARAMETERS[parameter]


def docstring(endpoint: str, parameters: Sequence[str]) -> str:
    """The endpoint's description, then "Args:" with a line per parameter, as Gradio reads a docstring."""
    return "\n".join([DESCRIPTIONS[endpoint], "", "Args:", *(f"    {name}: {describe(name)}" for name in parameters)])
