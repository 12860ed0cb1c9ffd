"""The demo's form, as the browser sends it: `Settings` (the fields every tab shares), `ControlForm` (a
ControlNet panel's), the names of the form's fields in the page and the API, and the uploads it
holds. `DemoService` (`sdxl.serving.demo`) makes them prepared requests. No Gradio here.
"""

import dataclasses
import re
from collections.abc import Sequence

import numpy as np
from PIL import Image

from ..checkpoints import lora
from ..engine import images
from ..engine.checks import integer
from ..engine.control_maps import DEFAULT_CANNY_THRESHOLDS
from ..engine.controls import Control
from ..engine.hires import DEFAULT_STRENGTH, DEFAULT_UPSCALER
from ..engine.image_prompts import IP_ADAPTER_SCALE
from ..engine.request import DEFAULT_GUIDANCE_SCALE, DEFAULT_REFINE_FROM, DEFAULT_STEPS, MAX_SIZE
from ..prompts.styles import NO_STYLE

# SDXL's training buckets (width, height); other models get them scaled to their native size.
SDXL_SIZES = ((1024, 1024), (1152, 896), (896, 1152), (1216, 832), (832, 1216), (1344, 768), (768, 1344))
# The Compare tab's ways, as the page names them (the last where several models are served).
COMPARE_PROMPTS, COMPARE_SEEDS = "One prompt per line, same seed", "One prompt, consecutive seeds"
COMPARE_MODELS = "One prompt and seed, each model"


@dataclasses.dataclass(frozen=True)
class ControlForm:
    """One ControlNet's part of the form: the picture that steers it, how it becomes the control map,
    and how strongly and between which fractions of the steps it steers, as the browser sent them.
    `control` makes it the request's `Control`."""

    picture: Image.Image | None = None  # None: no control image (then no ControlNet steers)
    preprocessor: str = "none"  # one of `control_maps.PREPROCESSORS`
    canny_low: int = DEFAULT_CANNY_THRESHOLDS[0]
    canny_high: int = DEFAULT_CANNY_THRESHOLDS[1]
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    mode: str | int | None = None  # a ControlNet Union's control mode (`controlnet_union.CONTROL_MODES`)

    def control(self, width, height) -> Control:
        """The request's control at the output's size: the picture centre-cropped to its aspect ratio and
        resized (A1111's "Crop and Resize"), then its map (edges drawn at the output's own resolution).

        Raises:
          ValueError: no picture, or a size, preprocessor or threshold out of range.
        """
        if self.picture is None:
            raise ValueError("no control image was given")
        width, height = (integer(value, label, 1, MAX_SIZE) for value, label in ((width, "width"), (height, "height")))
        return Control.of(self.picture, width, height, preprocessor=self.preprocessor,
                          canny_thresholds=(self.canny_low, self.canny_high), scale=self.scale, start=self.start,
                          end=self.end, mode=self.mode)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The form's fields that every tab shares, as the browser sent them."""

    prompt: str = ""
    negative_prompt: str = ""
    style: str = NO_STYLE
    model: str | None = None  # a served model's name (`--model`); None: the first
    seed: int = 0
    guidance_scale: float = DEFAULT_GUIDANCE_SCALE
    guidance_rescale: float = 0.0  # CFG rescale (`Request.guidance_rescales`)
    steps: int = DEFAULT_STEPS
    width: int | None = None  # None: the model's first size
    height: int | None = None
    images_per_core: int = 1
    sampler: str | None = None  # None: the model's own
    schedule_type: str = ""  # "": the sampler's own (`Request.schedule_type` None)
    emphasis: str = "original"  # how prompts' weights apply (`sdxl.prompts.syntax.EMPHASIS_MODES`)
    clip_skip: int = 1  # webui's "Clip skip" (`Request.clip_skip`), and its SDXL setting
    sdxl_clip_l_skip: bool = False
    refine: bool = False  # finish with the refiner, from `refine_from` of the noise
    refine_from: float = DEFAULT_REFINE_FROM
    lora_scales: tuple[float, ...] | None = None  # one per launched LoRA (`DemoService.loras`); None: their own
    controls: tuple[ControlForm, ...] = ()  # one per launched ControlNet (`Pipeline.controlnets`), or none
    # Where the noise comes from (`Request.noise_source`), and A1111's seed settings for its sources.
    noise_source: str = "jax"
    ensd: int = 0
    variation_seed: int = 0
    variation_strength: float = 0.0
    # The hires fix (`sdxl.engine.hires`), for the text-to-image tabs: on or off, and its settings.
    hires: bool = False
    hires_upscaler: str = DEFAULT_UPSCALER
    hires_scale: float = 1.5  # what SDXL's shared infotexts use most; webui's default 2 quadruples the work
    hires_steps: int = 0  # 0: the first pass's
    hires_strength: float = DEFAULT_STRENGTH
    # The image prompt (IP-Adapter), for every tab: its picture (None: none), the adapter that takes it
    # (by its label, `choices.ip_adapter_labels`; None: the first), its scale, and on which layers.
    ip_adapter_image: Image.Image | None = None
    ip_adapter: str | None = None
    ip_adapter_scale: float = IP_ADAPTER_SCALE
    ip_adapter_layers: str = "all"  # one of `image_prompts.SCALE_PRESETS`


# Each `ControlForm` field's name in the form (and the API) for the first ControlNet; the others' add "_2", ...
CONTROL_PARAMETERS = {"picture": "control_image", "preprocessor": "control_preprocessor", "canny_low": "canny_low",
                      "canny_high": "canny_high", "scale": "control_scale", "start": "control_start",
                      "end": "control_end", "mode": "control_mode"}


# The fields `DemoService.reused` fills in besides the prompts, and how its sentence names them.
REUSED = {"model": "model", "seed": "seed", "guidance_scale": "guidance", "steps": "steps", "sampler": "sampler",
          "schedule_type": "schedule type", "emphasis": "emphasis", "size": "size", "noise_source": "noise",
          "ensd": "ENSD", "variation_seed": "variation seed", "variation_strength": "variation strength",
          "clip_skip": "clip skip", "sdxl_clip_l_skip": "SDXL's CLIP-L clip skip", "hires": "hires fix",
          "guidance_rescale": "CFG rescale"}
# A hires fix's settings the form has, by its `Settings` field: its `Hires` field.
HIRES_FIELDS = {"hires_upscaler": "upscaler", "hires_scale": "scale", "hires_steps": "steps",
                "hires_strength": "strength"}
# The image prompt's fields, by their names in every form (and the API), after the others.
IP_ADAPTER_FIELDS = ("ip_adapter_image", "ip_adapter", "ip_adapter_scale", "ip_adapter_layers")


def control_parameters(count: int) -> list[dict[str, str]]:
    """For each of `count` ControlNets, its `ControlForm` fields' names in the form: {field: name}."""
    return [{field: name + (f"_{k + 1}" if k else "") for field, name in CONTROL_PARAMETERS.items()}
            for k in range(count)]


def lora_parameters(sources: Sequence[str]) -> list[str]:
    """The form's (and the API's) name of each launched LoRA's scale: `lora_<file stem>`."""
    names = ["lora_" + re.sub(r"\W", "_", lora.display_name(source)) for source in sources]
    return [name if names.count(name) == 1 else f"{name}_{i}" for i, name in enumerate(names)]


def size_presets(spec) -> list[tuple[int, int]]:
    """The native aspect-ratio presets of a model (its `ModelSpec`) as (width, height), native square first."""
    scale = spec.native_size / 1024
    f = spec.latent_factor
    presets = [(max(f, round(w * scale / f) * f), max(f, round(h * scale / f) * f)) for w, h in SDXL_SIZES]
    return list(dict.fromkeys(presets))


def nearest_size(width: int, height: int, sizes: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """Of `sizes` (width, height), the one whose aspect ratio is nearest `width` x `height`'s."""
    return min(sizes, key=lambda size: abs(np.log(size[0] / size[1]) - np.log(width / height)))


def fit_to_sizes(picture: Image.Image, sizes: Sequence[tuple[int, int]]) -> tuple[Image.Image, tuple[int, int]]:
    """`picture` at the size of `sizes` (width, height) whose aspect ratio is nearest its own:
    centre-cropped to that ratio, then resized (Lanczos). Returns it and the size chosen."""
    width, height = picture.size
    target = nearest_size(width, height, sizes)
    if (width, height) == target:
        return picture, target
    box = images.crop_box(width, height, *target)
    return picture.resize(target, Image.Resampling.LANCZOS, box=box), target


def path_of(file) -> str:
    """The server-side path of an uploaded file as a handler receives it (Gradio's FileData, a dict
    from an API client, or a path)."""
    return file if isinstance(file, str) else (file["path"] if isinstance(file, dict) else file.path)


def read_upload(upload, what: str = "image") -> Image.Image:
    """An upload (an image the editor holds, or a file), read (`images.read_image`). Raises ValueError
    naming `what` where it is not "image" (whose sentences say so already)."""
    if isinstance(upload, Image.Image):
        return upload
    try:
        return images.read_image(path_of(upload))
    except (TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"the {what} must be an uploaded image file, got {upload!r:.80}") from e
    except ValueError as e:
        if what == "image":
            raise
        raise ValueError(f"the {what}: {e}") from e


def picture_and_mask(editor) -> tuple[Image.Image | None, Image.Image | None]:
    """The picture an image editor holds and, where a layer is painted, a mask (white where painted)."""
    if not editor or editor.get("background") is None:
        return None, None
    background = editor["background"]
    painted = [np.asarray(layer.convert("RGBA"))[..., 3] > 0 for layer in editor.get("layers") or []]
    if not painted or not np.any(painted):
        return background, None
    return background, Image.fromarray(np.any(painted, axis=0).astype(np.uint8) * 255)
