"""What known models need and expect, told by their names: scheduler fields, steps and guidance as
their model cards give them, and for the built-in `shapes` model what the demo offers.

A checkpoint's own scheduler config says which sampler it wants (`ModelSpec.default_sampler`), but
not how many steps or how much guidance it was distilled for, and an SDXL-Lightning UNet comes as a
lone weights file over SDXL base's configs, whose Euler scheduler must then space its steps
"trailing". `recommended` is the one place that knows.
"""

import dataclasses
import re
from pathlib import PurePosixPath

from ..checkpoints import shapes
from ..engine.request import DEFAULT_GUIDANCE_SCALE, DEFAULT_STEPS


@dataclasses.dataclass(frozen=True)
class Recommended:
    """Settings for a model: the demo's and the CLI's defaults, and scheduler fields to load it with."""

    steps: int = DEFAULT_STEPS
    guidance_scale: float = DEFAULT_GUIDANCE_SCALE
    scheduler: dict | None = None  # fields replacing the checkpoint's scheduler config
    note: str = ""  # where the numbers come from, for people
    # For the demo: the sizes the model draws (None: its native aspect-ratio presets), prompts to try,
    # and the prompt box's placeholder.
    sizes: tuple[tuple[int, int], ...] | None = None
    examples: tuple[str, ...] = ()
    placeholder: str = "Describe an image"


# Hub repo ids (and the folders people name after them) of few-step models.
_MODELS = {
    "stabilityai/sdxl-turbo": Recommended(1, 0.0, note="SDXL-Turbo: 1-4 steps without guidance"),
    "stabilityai/sd-turbo": Recommended(1, 0.0, note="SD-Turbo: 1-4 steps without guidance"),
    "latent-consistency/lcm-sdxl": Recommended(4, 1.0, note="LCM: 2-8 steps, guidance 1-2"),
    # An LCM UNet that takes the guidance scale as an embedding (time_cond_proj_dim): no second pass.
    "SimianLuo/LCM_Dreamshaper_v7": Recommended(4, 8.0, note="LCM Dreamshaper v7: 4 steps, guidance 8 (embedded)"),
    "shapes": Recommended(  # its model card: guidance 2.5 scores best (assets/shapes/README.md)
        guidance_scale=2.5,
        note="The built-in shapes model draws one circle, square or triangle, in red, green, blue, yellow, "
        "orange, purple, white or black, small or large, in the center, at the top or bottom or on the left or "
        "right, on a background of another of those colours, at 64x64",
        sizes=((shapes.NATIVE_SIZE, shapes.NATIVE_SIZE),),
        examples=(
            "a red circle on a blue background",
            "a large yellow triangle at the top on a purple background",
            "a small white square on the left on a black background",
            "an orange circle at the bottom on a green background",
        ),
        placeholder="a red circle on a blue background",
    ),
}
# SDXL-Lightning's UNet files: "sdxl_lightning_4step_unet.safetensors" (1, 2, 4 and 8 steps).
_LIGHTNING_UNET = re.compile(r"sdxl_lightning_(\d+)step_unet")
# Hyper-SD's N-step LoRAs: "Hyper-SDXL-8steps-lora.safetensors", "Hyper-SD15-4steps-lora.safetensors"
# (DDIM with trailing steps, without guidance; the "CFG" variants keep guidance, and the 1-step
# LoRA asks for TCD with eta 1, which the "tcd" sampler's fixed gamma 0.3 is not).
_HYPER_SD_LORA = re.compile(r"Hyper-SD(?:XL|15)-(\d+)steps?-lora", re.IGNORECASE)


def recommended(
    model: str, unet: str | None = None, default_sampler: str | None = None, loras: tuple[str, ...] = ()
) -> Recommended:
    """The settings a model's card gives, by its Hub id, its UNet file's name, a few-step LoRA's
    name, or its scheduler (an LCMScheduler, whose sampler is "lcm": 4 steps, guidance 1); the
    package's defaults for any other."""
    for source in loras:
        match = _HYPER_SD_LORA.search(PurePosixPath(str(source)).name)
        if match and int(match.group(1)) > 1:
            steps = int(match.group(1))
            scheduler = {"_class_name": "DDIMScheduler", "timestep_spacing": "trailing"}
            return Recommended(steps, 0.0, scheduler, f"Hyper-SD {steps}-step LoRA: DDIM with trailing steps")
    if unet is not None:
        match = _LIGHTNING_UNET.search(PurePosixPath(str(unet)).name)
        if match:
            steps = int(match.group(1))
            scheduler = {"timestep_spacing": "trailing"}
            if steps == 1:  # the 1-step UNet predicts the clean latents
                scheduler["prediction_type"] = "sample"
            note = f"SDXL-Lightning {steps}-step UNet: Euler with trailing steps, without guidance"
            return Recommended(steps, 0.0, scheduler, note)
    name = str(model).rstrip("/")
    for repo_id, settings in _MODELS.items():
        if name == repo_id or name.endswith("/" + repo_id.split("/")[-1]):  # or a folder named after it
            return settings
    if default_sampler == "lcm":
        return _MODELS["latent-consistency/lcm-sdxl"]
    return Recommended()
