"""The demo's requests: what a visitor chose in the form (`Settings`), made into device-queue requests
for each tab by `DemoService`. No Gradio here: `app.py` builds the page around a service.

Values arrive as the browser sent them; every one is checked where the request is made
(`sdxl.engine.request`), so a bad one gets a sentence that names it.
"""

import dataclasses
import re
from collections.abc import Mapping, Sequence

import numpy as np
from PIL import Image

from ..checkpoints import lora
from ..engine import images
from ..engine.control_maps import DEFAULT_CANNY_THRESHOLDS, Preprocessor
from ..engine.pipeline import Pipeline
from ..engine.request import (
    DEFAULT_GUIDANCE_SCALE, DEFAULT_REFINE_FROM, DEFAULT_STEPS, MAX_SEED, MAX_SIZE, Request, integer, number,
    required_prompt,
)
from ..prompts.styles import NO_STYLE, STYLES
from ..prompts.syntax import EMPHASIS_MODES
from . import grid
from .grid import GridPlan
from .known import Recommended
from .queue import DeviceQueue

# SDXL's training buckets (width, height); other models get them scaled to their native size.
SDXL_SIZES = ((1024, 1024), (1152, 896), (896, 1152), (1216, 832), (832, 1216), (1344, 768), (768, 1344))


@dataclasses.dataclass(frozen=True)
class Control:
    """One ControlNet's part of the form: the picture that steers it, how it becomes the control map,
    and how strongly and between which fractions of the steps it steers."""

    picture: Image.Image | None = None  # None: no control image (then no ControlNet steers)
    preprocessor: str = "none"  # one of `control_maps.PREPROCESSORS`
    canny_low: int = DEFAULT_CANNY_THRESHOLDS[0]
    canny_high: int = DEFAULT_CANNY_THRESHOLDS[1]
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    mode: str | int | None = None  # a ControlNet Union's control mode (`controlnet_union.CONTROL_MODES`)

    @property
    def made_by(self) -> Preprocessor:
        return Preprocessor(self.preprocessor, (self.canny_low, self.canny_high))

    def fitted(self, width: int, height: int) -> "Control":
        """This control with its picture cropped and resized to `width` x `height` (as `control_map`
        does), so that maps made at that size from it again skip the resize."""
        return self if self.picture is None else dataclasses.replace(
            self, picture=fit_to_sizes(self.picture, [(width, height)])[0])

    def control_map(self, width: int, height: int) -> np.ndarray:
        """[height, width, 3] uint8: the picture cropped to the size's aspect ratio and resized, as
        A1111's "Crop and Resize", then its map (edges drawn at the output's own resolution).

        Raises:
          ValueError: no picture, or a preprocessor or threshold out of range.
        """
        if self.picture is None:
            raise ValueError("no control image was given")
        picture, _ = fit_to_sizes(self.picture, [(width, height)])
        return self.made_by(images.pixels(picture))


@dataclasses.dataclass(frozen=True)
class Settings:
    """The form's fields that every tab shares, as the browser sent them."""

    prompt: str = ""
    negative_prompt: str = ""
    style: str = NO_STYLE
    seed: int = 0
    guidance_scale: float = DEFAULT_GUIDANCE_SCALE
    steps: int = DEFAULT_STEPS
    width: int | None = None  # None: the model's first size
    height: int | None = None
    images_per_core: int = 1
    sampler: str | None = None  # None: the model's own
    emphasis: str = "original"  # how prompts' weights apply (`sdxl.prompts.syntax.EMPHASIS_MODES`)
    refine: bool = False  # finish with the refiner, from `refine_from` of the noise
    refine_from: float = DEFAULT_REFINE_FROM
    lora_scales: tuple[float, ...] | None = None  # one per launched LoRA (`DemoService.loras`); None: their own
    controls: tuple[Control, ...] = ()  # one per launched ControlNet (`Pipeline.controlnets`), or none


# Each `Control` field's name in the form (and the API) for the first ControlNet; the others' add "_2", "_3", ...
CONTROL_PARAMETERS = {"picture": "control_image", "preprocessor": "control_preprocessor", "canny_low": "canny_low",
                      "canny_high": "canny_high", "scale": "control_scale", "start": "control_start",
                      "end": "control_end", "mode": "control_mode"}


def control_parameters(count: int) -> list[dict[str, str]]:
    """For each of `count` ControlNets, its `Control` fields' names in the form: {field: name}."""
    return [{field: name + (f"_{k + 1}" if k else "") for field, name in CONTROL_PARAMETERS.items()}
            for k in range(count)]


def lora_parameters(sources: Sequence[str]) -> list[str]:
    """The form's (and the API's) name of each launched LoRA's scale: `lora_<file stem>`."""
    names = ["lora_" + re.sub(r"\W", "_", lora.display_name(source)) for source in sources]
    return [name if names.count(name) == 1 else f"{name}_{i}" for i, name in enumerate(names)]


def size_presets(pipe: Pipeline) -> list[tuple[int, int]]:
    """The model's native aspect-ratio presets as (width, height), native square first."""
    scale = pipe.spec.native_size / 1024
    f = pipe.spec.latent_factor
    presets = [(max(f, round(w * scale / f) * f), max(f, round(h * scale / f) * f)) for w, h in SDXL_SIZES]
    return list(dict.fromkeys(presets))


def fit_to_sizes(picture: Image.Image, sizes: Sequence[tuple[int, int]]) -> tuple[Image.Image, tuple[int, int]]:
    """`picture` at the size of `sizes` (width, height) whose aspect ratio is nearest its own:
    centre-cropped to that ratio, then resized (Lanczos). Returns it and the size chosen."""
    width, height = picture.size
    target = min(sizes, key=lambda size: abs(np.log(size[0] / size[1]) - np.log(width / height)))
    if (width, height) == target:
        return picture, target
    scale = min(width / target[0], height / target[1])
    crop_w, crop_h = target[0] * scale, target[1] * scale
    box = ((width - crop_w) / 2, (height - crop_h) / 2, (width + crop_w) / 2, (height + crop_h) / 2)
    return picture.resize(target, Image.Resampling.LANCZOS, box=box), target


class DemoService:
    """A pipeline served to the demo's visitors: their settings as requests, and the device queue."""

    def __init__(
        self, pipe: Pipeline, *, model_label: str, max_images_per_core: int = 4, max_queued: int = 32,
        max_per_owner: int = 4, notice: str | None = None, loras: Mapping[str, float] | None = None,
        recommended: Recommended = Recommended(), emphasis: str = "original",
    ):
        """`model_label`: how results name the model. `notice`: why another model than the one asked
        for is served. `loras`: the LoRAs a request may use, {source: default scale}, in the order the
        page lists them. `recommended`: the model's default steps and guidance (`checkpoints.known`).
        `emphasis`: the form's default for how prompts' weights apply."""
        self.pipe = pipe
        self.emphasis = emphasis
        self.model_label = model_label
        self.notice = notice
        self.recommended = recommended
        self.loras = dict(loras or {})
        self.lora_parameters = lora_parameters(list(self.loras))
        self.control_parameters = control_parameters(len(pipe.controlnets))
        self.max_images_per_core = max_images_per_core
        self.sizes = list(recommended.sizes) if recommended.sizes else size_presets(pipe)
        self.queue = DeviceQueue(pipe, max_batch_images=self.max_images, max_queued=max_queued,
                                 max_per_owner=max_per_owner)

    @property
    def max_images(self) -> int:
        return self.pipe.num_devices * self.max_images_per_core

    def settings(self, form: Mapping) -> Settings:
        """The settings of a form's fields by name, LoRA scales by their `lora_parameters`."""
        fields = {f.name for f in dataclasses.fields(Settings)}
        scales = tuple(form[name] for name in self.lora_parameters if name in form)
        controls = tuple(Control(**{field: form[name] for field, name in names.items() if name in form})
                         for names in self.control_parameters)
        return Settings(**{k: v for k, v in form.items() if k in fields}, lora_scales=scales or None,
                        controls=controls)

    def images(self, settings: Settings) -> Request:
        """One prompt, `images_per_core` images on every core: images (seed, 0), (seed, 1), ..."""
        n = self.pipe.num_devices * integer(settings.images_per_core, "images per core", 1, self.max_images_per_core)
        return self._request(settings, self._styled(settings), (settings.seed,) * n, tuple(range(n)))

    def image_edit(self, settings: Settings, image: Image.Image | None, mask: Image.Image | None,
                   strength) -> tuple[Request, str | None]:
        """Image-to-image of `image`, inpainting where `mask` (None for none) is white: both fitted to
        the demo's size of the nearest aspect ratio (`fit_to_sizes`). Returns the request and a note
        when the image was resized."""
        if image is None:
            raise ValueError("upload an image to start from")
        original = image.size
        picture, (width, height) = fit_to_sizes(image, self.sizes)
        masks = None
        if mask is not None:
            if mask.size != original:
                raise ValueError(f"the mask is {mask.size[0]}x{mask.size[1]}, the image {original[0]}x{original[1]}")
            masks = images.mask(fit_to_sizes(mask.convert("L"), [(width, height)])[0])[None]
        request = self.images(dataclasses.replace(settings, width=width, height=height))
        n = len(request)
        request = dataclasses.replace(
            request, images=np.repeat(images.pixels(picture)[None], n, axis=0),
            masks=None if masks is None else masks.repeat(n, 0), strength=number(strength, "strength", 0.0, 1.0),
        )
        note = None if original == (width, height) else (
            f"the image was {original[0]}x{original[1]}; cropped and resized to {width}x{height}, this model's "
            "nearest size"
        )
        return self._checked(request), note

    def prompt_comparison(self, settings: Settings, prompts: Sequence[str]) -> Request:
        """Several prompts from the same starting noise (seed, image 0), side by side."""
        prompts = [p for p in prompts if p.strip()]
        if not 1 <= len(prompts) <= self.max_images:
            raise ValueError(f"enter from 1 to {self.max_images} prompts, one per line (got {len(prompts)})")
        styled = [self._styled(dataclasses.replace(settings, prompt=p)) for p in prompts]
        n = len(styled)
        request = self._request(settings, styled[0], (settings.seed,) * n, (0,) * n)
        return self._checked(dataclasses.replace(
            request, prompts=tuple(p for p, _ in styled), negative_prompts=tuple(q for _, q in styled)))

    def seed_comparison(self, settings: Settings, num_seeds) -> Request:
        """One prompt from `num_seeds` consecutive seeds, side by side."""
        first = integer(settings.seed, "seed", 0, MAX_SEED)
        n = integer(num_seeds, "number of seeds", 1, self.max_images)
        if first + n - 1 > MAX_SEED:
            raise ValueError(f"seeds {first}..{first + n - 1} go past {MAX_SEED}")
        return self._request(settings, self._styled(settings), tuple(range(first, first + n)), (0,) * n)

    def grid(self, settings: Settings, x_axis: str | None, x_values: str, y_axis: str | None,
             y_values: str) -> GridPlan:
        """A prompt x seed x ... grid (`sdxl.serving.grid`): each cell image 0 of its own settings, the cells
        that can share a device call in as few calls as fit."""
        names = [lora.display_name(source) for source in self.loras]
        axes = [
            None if not name else grid.parse_axis(
                name, values, prompt=settings.prompt if isinstance(settings.prompt, str) else "",
                max_steps=self.pipe.max_steps, loras=names,
            )
            for name, values in ((x_axis, x_values), (y_axis, y_values))
        ]
        x, y = axes
        if x is not None and y is not None and x.name == y.name:
            raise ValueError(f"the x and y axes are both {x.name}: choose two different settings")
        steered = any(control.picture is not None for control in settings.controls)
        for axis in axes:
            if axis is not None and axis.name in grid.CONTROL_AXES and not steered:
                raise ValueError(f"the {axis.name.replace('_', ' ')} axis needs a control image (ControlNet panel)"
                                 if self.pipe.controlnets else "no ControlNet is loaded (start with --controlnet)")
        if steered:  # every cell's maps are made from the pictures resized once, not once a cell
            width, height = _pixel_size(*self._size(settings))
            settings = dataclasses.replace(settings, controls=tuple(c.fitted(width, height) for c in settings.controls))

        def with_value(cell: Settings, name: str, value) -> Settings:
            if name.startswith(grid.LORA_AXIS):
                scales = list(self._lora_scales(cell))
                scales[names.index(name[len(grid.LORA_AXIS):])] = value
                return dataclasses.replace(cell, lora_scales=tuple(scales))
            if name in grid.CONTROL_AXES:  # every ControlNet's
                field = name.removeprefix("control_")
                return dataclasses.replace(
                    cell, controls=tuple(dataclasses.replace(c, **{field: value}) for c in cell.controls))
            return dataclasses.replace(cell, **{name: value})

        cells = [dataclasses.replace(cell, images_per_core=1, refine=False)
                 for cell in grid.cells(settings, x, y, with_value)]
        singles = [self._request(cell, self._styled(cell), (cell.seed,), (0,)) for cell in cells]
        return grid.plan(x, y, singles, self.max_images)

    def prompt_length(self, text, emphasis: str = "original", *, negative: bool = False) -> str:
        """A prompt box's length as the page shows it under the box, "84 tokens, 2 chunks"; or why it
        cannot be read."""
        if not isinstance(text, str) or emphasis not in EMPHASIS_MODES:
            return ""
        try:
            return self.pipe.prompts.length_text(text, emphasis, negative=negative)
        except ValueError as e:
            return str(e)

    def png_parameters(self, request: Request, i: int) -> str:
        return images.png_parameters(self.pipe, request, i, self.model_label)

    def _request(self, settings: Settings, styled: tuple[str, str], seeds: tuple, image_index: tuple) -> Request:
        """The validated request for images of `seeds` and `image_index`, with the settings' size,
        sampler, guidance, LoRAs and refiner."""
        n = len(seeds)
        width, height = self._size(settings)
        request = Request(
            (styled[0],) * n, (styled[1],) * n, seeds, image_index, (settings.guidance_scale,) * n, settings.steps,
            height, width, settings.sampler, loras=tuple(zip(self.loras, self._lora_scales(settings))),
            refine_from=float(settings.refine_from) if settings.refine else None, emphasis=settings.emphasis,
            **self._controls(settings.controls, n, width, height),
        )
        return self._checked(request)

    def _controls(self, controls: Sequence[Control], n: int, width, height) -> dict:
        """The request's control maps and settings: none without control images; with them, one image
        for each launched ControlNet."""
        given = [control.picture is not None for control in controls]
        if not any(given):
            return {}
        if not all(given) or len(controls) != len(self.pipe.controlnets):
            names = ", ".join(c.name for c in self.pipe.controlnets)
            raise ValueError(f"{len(self.pipe.controlnets)} ControlNets are loaded ({names}): give a control image "
                             f"for each, or none (got {sum(given)})")
        width, height = _pixel_size(width, height)
        return dict(
            control_images=tuple(np.repeat(c.control_map(width, height)[None], n, axis=0) for c in controls),
            control_scales=(tuple(c.scale for c in controls),) * n,
            control_starts=(tuple(c.start for c in controls),) * n,
            control_ends=(tuple(c.end for c in controls),) * n,
            control_modes=(tuple(c.mode for c in controls),) * n,
            control_preprocessors=tuple(c.made_by for c in controls),
        )

    def _size(self, settings: Settings) -> tuple:
        """The settings' (width, height) as sent (`Request.validated` checks them), or the model's first size."""
        return (settings.width, settings.height) if settings.width is not None else self.sizes[0]

    def _checked(self, request: Request) -> Request:
        """The request validated by the pipeline, at one of the demo's sizes."""
        request = self.pipe.validated(request)
        if (request.width, request.height) not in self.sizes:
            presets = ", ".join(f"{w}x{h}" for w, h in self.sizes)
            raise ValueError(f"size {request.width}x{request.height} is not one of this model's sizes: {presets}")
        return request

    def _lora_scales(self, settings: Settings) -> tuple:
        """One scale per launched LoRA (their launch scales unless the settings give them; 0 leaves one out)."""
        scales = tuple(self.loras.values()) if settings.lora_scales is None else tuple(settings.lora_scales)
        if len(scales) != len(self.loras):
            names = ", ".join(self.loras) or "none are loaded"
            raise ValueError(f"give one LoRA scale per LoRA ({names}), got {len(scales)}")
        return scales

    @staticmethod
    def _styled(settings: Settings) -> tuple[str, str]:
        """The prompt and negative prompt with the settings' style applied."""
        prompt, negative_prompt, style = settings.prompt, settings.negative_prompt, settings.style
        if style not in STYLES:
            raise ValueError(f"unknown style {style!r}; choose one of: {', '.join(STYLES)}")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be text, got {type(prompt).__name__} {prompt!r:.80}")
        required_prompt(prompt)
        if not isinstance(negative_prompt, (str, type(None))):
            raise ValueError(f"negative prompt must be text, got {negative_prompt!r:.80}")
        return STYLES[style].apply(prompt, negative_prompt or "")


def _pixel_size(width, height) -> tuple[int, int]:
    """A size as sent, as integers a picture can be resized to. Raises ValueError naming the bad one."""
    return integer(width, "width", 1, MAX_SIZE), integer(height, "height", 1, MAX_SIZE)
