"""The demo's requests: what a visitor chose in the form (`sdxl.serving.forms.Settings`), made into prepared requests
for each tab by `DemoService`. No Gradio here: `app.py` builds the page around a service.

Values arrive as the browser sent them; every one is checked where the request is prepared
(`Request.validated`, with the demo's limits: its sizes), so a bad one gets a sentence that names it.
"""

import collections
import dataclasses
import re
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np
from PIL import Image

from ..checkpoints import lora
from ..engine import conditionings, hires as hires_fix, images, infotext
from ..engine.checks import choice, integer, number
from ..engine.controls import CONTROLS, Control
from ..engine.hires import IMAGE_UPSCALERS, Hires
from ..engine.latent_upscale import LATENT_UPSCALERS
from ..engine.image_prompts import IMAGE_PROMPTS, ImagePrompt, preset_named, preset_scale
from ..engine.prepared import PreparedRequest
from ..engine.request import (
    MAX_SEED,
    Limits, Request, required_prompt,
)
from ..prompts.styles import STYLES
from ..prompts import syntax as prompt_syntax
from ..prompts.syntax import EMPHASIS_MODES
from . import grid
from .choices import choices_of, ip_adapter_labels
from .forms import (
    COMPARE_MODELS, COMPARE_PROMPTS, COMPARE_SEEDS, HIRES_FIELDS, REUSED, ControlForm, Settings, control_parameters,
    fit_to_sizes, lora_parameters, nearest_size, read_upload,
)
from .grid import GridPlan
from .models import Model, named, union
from .queue import DeviceQueue, Runner
from .results import size_label

TABS = ("generate", "image_to_image", "compare", "grid")  # what each tab's button submits (`DemoService.submission`)
CHECKED_KEPT = 64  # checked submissions waiting for their handler (`DemoService.check`), at most
# A pasted parameters text's settings line (webui's, and ours): "Steps: 20, Sampler: ..." on a line of its own.
PARAMETERS_LINE = re.compile(r"^Steps: \d+, ", re.MULTILINE)
UPSCALE_RANGE = (1.0, 4.0)  # the Upscale tab's factors
MAX_UPSCALED_SIDE = 8192  # the Upscale tab's largest picture: a 2048 one, 4x


@dataclasses.dataclass
class Submission:
    """What one click submits: its device calls (one, or a grid's), a note for the status, and for a
    grid where its cells lie in the calls."""

    calls: list[PreparedRequest]
    note: str | None = None
    grid: GridPlan | None = None
    # What the settings name that is not loaded and was left out, as webui says it ("Failed to find networks:
    # ..."): on the page beside the result, and in each picture's parameters.
    left_out: str | None = None
    sheet: bool = True  # whether a grid's answer has its labelled sheet (the Compare tab's models: a gallery only)


def _prompts(value) -> str:
    """The Compare tab's prompts text ("" for none). Raises ValueError where it is no text."""
    if not isinstance(value, (str, type(None))):
        raise ValueError(f"prompts must be text (one per line), got {type(value).__name__} {value!r:.80}")
    return value or ""


class DemoService:
    """A pipeline served to the demo's visitors: their settings as prepared requests, and the device queue."""

    def __init__(
        self, models: Sequence[Model], *, max_images_per_core: int = 4, max_queued: int = 32, max_per_owner: int = 4,
        emphasis: str = "original", runner: Runner | None = None, failed: Mapping[str, str] | None = None,
    ):
        """`models`: the models served, on the same devices, the first the default (a request's `model`
        names one). `emphasis`: the form's default for how prompts' weights apply. `runner`: what has the
        devices render (default: this process's pipelines; several hosts' runner sends each call to all).
        `failed`: the models asked for that did not load, and why, for the page to say."""
        self.models = list(models)
        self.emphasis = emphasis
        self.launch_notes: list[str] = [f"Model {name} did not load: {why}" for name, why in (failed or {}).items()]
        # The LoRAs and ControlNets of every model, in the order the page lists them; each applies to the models
        # it was loaded with.
        self.loras = union(self.models, lambda model: model.loras)
        self.lora_parameters = lora_parameters(list(self.loras))
        self.controlnets = list(union(self.models, lambda model: {c.name: c for c in model.pipe.controlnets}).values())
        self.control_parameters = control_parameters(len(self.controlnets))
        self.max_images_per_core = max_images_per_core
        self.queue = DeviceQueue(self.pipe, max_batch_images=self.max_images, max_queued=max_queued,
                                 max_per_owner=max_per_owner, runner=runner)
        self.choices = choices_of(self)
        self._checked: collections.OrderedDict = collections.OrderedDict()  # (owner, tab) -> (form, submission)
        self._lock = threading.Lock()
        # One upscale at a time: a model upscaler's tiles run on the devices beside the queue's calls.
        self._upscaling = threading.Lock()

    # The default model's, and the devices': what the page starts with.
    pipe = property(lambda self: self.models[0].pipe)
    model_label = property(lambda self: self.models[0].label)
    notice = property(lambda self: self.models[0].notice)
    recommended = property(lambda self: self.models[0].settings)
    sizes = property(lambda self: self.models[0].sizes)

    def model(self, name=None) -> Model:
        """The served model `name` names (`models.named`; None: the default). Raises ValueError."""
        return named(self.models, name)

    @property
    def max_images(self) -> int:
        return self.pipe.num_devices * self.max_images_per_core

    def serve_images_per_core(self, n: int) -> None:
        """At most `n` images per core from now on (fewer than asked at construction: the most that fit)."""
        self.max_images_per_core = n
        self.queue.max_batch_images = self.max_images

    def limits(self, model: Model) -> Limits:
        """A model's limits, at the demo's sizes for it."""
        return dataclasses.replace(model.pipe.limits, sizes=tuple(model.sizes))

    def settings(self, form: Mapping) -> Settings:
        """The settings of a form's fields by name, LoRA scales by their `lora_parameters`."""
        fields = {f.name for f in dataclasses.fields(Settings)}
        scales = tuple(form[name] for name in self.lora_parameters if name in form)
        controls = tuple(ControlForm(**{field: form[name] for field, name in names.items() if name in form})
                         for names in self.control_parameters)
        return Settings(**{k: v for k, v in form.items() if k in fields}, lora_scales=scales or None,
                        controls=controls)

    def check(self, tab: str, owner: str | None, form: Mapping) -> None:
        """Builds what a tab's button submits (`submission`) and keeps it for `checked`, which the page
        calls next: a bad value is refused before anything is shown, and the request is built once.

        Raises:
          ValueError: a bad value, in one sentence.
        """
        submission = self.submission(tab, form)
        with self._lock:
            self._checked[owner, tab] = (dict(form), submission)
            while len(self._checked) > CHECKED_KEPT:
                self._checked.popitem(last=False)

    def checked(self, tab: str, owner: str | None, form: Mapping) -> Submission:
        """The submission `check` built of the same form, else (a raw API call runs no check, or another
        click's check came between) built now. Raises ValueError."""
        with self._lock:
            kept, submission = self._checked.pop((owner, tab), (None, None))
        return submission if kept == dict(form) else self.submission(tab, form)

    def submission(self, tab: str, form: Mapping) -> Submission:
        """What a tab's button submits (`TABS`), from the form's fields by name, its uploads read.

        Raises:
          ValueError: a bad value, in one sentence.
        """
        pictures = {"image": "image", "mask": "image", "ip_adapter_image": "image prompt"} | {
            names["picture"]: "control image" for names in self.control_parameters}
        form = {k: read_upload(v, pictures[k]) if k in pictures and v is not None else v for k, v in form.items()}
        settings = self.settings(form)
        texts = (form.get("prompts") if tab == "compare" else settings.prompt, settings.negative_prompt)
        left_out = self.left_out(settings, texts)
        if tab == "generate":
            return Submission([self.images(settings)], left_out=left_out)
        if tab == "image_to_image":
            prepared, note = self.image_edit(settings, form.get("image"), form.get("mask"), form.get("strength"))
            return Submission([prepared], note, left_out=left_out)
        if tab == "compare" and form.get("mode") == COMPARE_MODELS:
            plan = self.model_comparison(dataclasses.replace(settings, prompt=_prompts(form.get("prompts")).strip()))
            return Submission(plan.requests, grid=plan, left_out=left_out, sheet=False)
        if tab == "compare":
            return Submission([self.comparison(settings, form.get("mode"), form.get("prompts"), form.get("num_seeds"))],
                              left_out=left_out)
        if tab == "grid":
            plan = self.grid(settings, form.get("x_axis") or None, form.get("x_values"), form.get("y_axis") or None,
                             form.get("y_values"))
            return Submission(plan.requests, grid=plan, left_out=left_out)
        raise ValueError(f"no tab {tab!r}; the tabs are {', '.join(TABS)}")

    def left_out(self, settings: Settings, texts) -> str | None:
        """What a request of these settings draws without, as a sentence: the LoRAs its prompts (`texts`) name
        that are not loaded with its model (`_request` leaves their tags out); None for nothing."""
        names = self._lora_names(self.model(settings.model))
        missing = [name for text in texts if isinstance(text, str) for name in prompt_syntax.without_loras(
            text, names)[1]]
        return f"Failed to find networks: {', '.join(dict.fromkeys(missing))}" if missing else None

    def images(self, settings: Settings) -> PreparedRequest:
        """One prompt, `images_per_core` images on every core: images (seed, 0), (seed, 1), ..."""
        model = self.model(settings.model)
        return self.prepare(self._images(settings, model), model)

    def image_edit(self, settings: Settings, image: Image.Image | None, mask: Image.Image | None,
                   strength) -> tuple[PreparedRequest, str | None]:
        """Image-to-image of `image`, inpainting where `mask` (None for none) is white: both fitted to
        the demo's size of the nearest aspect ratio (`fit_to_sizes`). Returns the request and a note
        when the image was resized."""
        if image is None:
            raise ValueError("upload an image to start from")
        original, model = image.size, self.model(settings.model)
        picture, (width, height) = fit_to_sizes(image, model.sizes)
        masks = None
        if mask is not None:
            if mask.size != original:
                raise ValueError(f"the mask is {mask.size[0]}x{mask.size[1]}, the image {original[0]}x{original[1]}")
            masks = images.mask(fit_to_sizes(mask.convert("L"), [(width, height)])[0])[None]
        request = self._images(dataclasses.replace(settings, width=width, height=height), model)
        n = len(request)
        request = dataclasses.replace(
            request, images=np.repeat(images.pixels(picture)[None], n, axis=0),
            masks=None if masks is None else masks.repeat(n, 0), strength=number(strength, "strength", 0.0, 1.0),
        )
        note = None if original == (width, height) else (
            f"the image was {original[0]}x{original[1]}; cropped and resized to {width}x{height}, this model's "
            "nearest size"
        )
        return self.prepare(request, model), note

    def comparison(self, settings: Settings, mode, prompts, num_seeds) -> PreparedRequest:
        """The Compare tab: several prompts (one per line) from the same seed, or one prompt over
        `num_seeds` consecutive seeds (`COMPARE_PROMPTS`, `COMPARE_SEEDS`; `model_comparison` for
        `COMPARE_MODELS`)."""
        prompts = _prompts(prompts)
        if mode not in (COMPARE_PROMPTS, COMPARE_SEEDS):
            modes = ", ".join(repr(m) for m in self.compare_modes)
            raise ValueError(f"compare mode must be one of {modes}, got {mode!r}")
        if mode == COMPARE_PROMPTS:
            return self.prompt_comparison(settings, prompts.splitlines())
        return self.seed_comparison(dataclasses.replace(settings, prompt=prompts.strip()), num_seeds)

    def prompt_comparison(self, settings: Settings, prompts: Sequence[str]) -> PreparedRequest:
        """Several prompts from the same starting noise (seed, image 0), side by side."""
        prompts = [p for p in prompts if p.strip()]
        if not 1 <= len(prompts) <= self.max_images:
            raise ValueError(f"enter from 1 to {self.max_images} prompts, one per line (got {len(prompts)})")
        styled = [self._styled(dataclasses.replace(settings, prompt=p)) for p in prompts]
        n, model = len(styled), self.model(settings.model)
        request = self._request(settings, model, styled[0], (settings.seed,) * n, (0,) * n)
        return self.prepare(dataclasses.replace(
            request, prompts=tuple(p for p, _ in styled), negative_prompts=tuple(q for _, q in styled)), model)

    @property
    def compare_modes(self) -> tuple[str, ...]:
        """The Compare tab's ways: each model's where several are served."""
        return (COMPARE_PROMPTS, COMPARE_SEEDS) + ((COMPARE_MODELS,) if len(self.models) > 1 else ())

    def model_comparison(self, settings: Settings) -> GridPlan:
        """One prompt and seed through each model (image 0 of each), as a grid over the model axis: each model's
        picture in a call of its own, at the form's size where the model has it, else at its own first.

        Raises:
          ValueError: one model is served.
        """
        if len(self.models) == 1:
            raise ValueError(f"one model is loaded ({self.models[0].name}): compare models with several --model")
        return self.grid(settings, grid.MODEL_AXIS, ", ".join(model.name for model in self.models), None, "")

    def seed_comparison(self, settings: Settings, num_seeds) -> PreparedRequest:
        """One prompt from `num_seeds` consecutive seeds, side by side."""
        first = integer(settings.seed, "seed", 0, MAX_SEED)
        n = integer(num_seeds, "number of seeds", 1, self.max_images)
        if first + n - 1 > MAX_SEED:
            raise ValueError(f"seeds {first}..{first + n - 1} go past {MAX_SEED}")
        model = self.model(settings.model)
        return self.prepare(self._request(settings, model, self._styled(settings), tuple(range(first, first + n)),
                                          (0,) * n), model)

    def grid(self, settings: Settings, x_axis: str | None, x_values: str, y_axis: str | None,
             y_values: str) -> GridPlan:
        """A prompt x seed x ... grid (`sdxl.serving.grid`): each cell image 0 of its own settings, the
        cells that can share a device call in as few calls as fit."""
        names = [lora.display_name(source) for source in self.loras]
        axes = [
            None if not name else grid.parse_axis(
                name, values, prompt=settings.prompt if isinstance(settings.prompt, str) else "",
                max_steps=self.pipe.max_steps, loras=names, models=[model.name for model in self.models],
            )
            for name, values in ((x_axis, x_values), (y_axis, y_values))
        ]
        x, y = axes
        if x is not None and y is not None and x.name == y.name:
            raise ValueError(f"the x and y axes are both {x.name}: choose two different settings")
        model = self.model(settings.model)
        controls = self._controls(settings, model, *self._size(settings, model))  # made once: the cells share them
        for axis in axes:
            if axis is not None and axis.name in grid.CONTROL_AXES and controls is None:
                raise ValueError(f"the {axis.name.replace('_', ' ')} axis needs a control image (ControlNet panel)"
                                 if self.controlnets else "no ControlNet is loaded (start with --controlnet)")
            if axis is not None and axis.name == grid.IP_ADAPTER_AXIS and settings.ip_adapter_image is None:
                raise ValueError("the image prompt scale axis needs a picture (Image prompt panel)"
                                 if self.choices.ip_adapters else "no IP-Adapter is loaded (start with --ip-adapter)")

        def with_value(cell: tuple[Settings, tuple | None], name: str, value) -> tuple[Settings, tuple | None]:
            settings, controls = cell
            if name.startswith(grid.LORA_AXIS):
                scales = list(self._lora_scales(settings))
                scales[names.index(name[len(grid.LORA_AXIS):])] = value
                return dataclasses.replace(settings, lora_scales=tuple(scales)), controls
            if name in grid.CONTROL_AXES:  # every ControlNet's
                field = name.removeprefix("control_")
                return settings, tuple(dataclasses.replace(c, **{field: value}) for c in controls)
            if name in HIRES_FIELDS:  # an axis of the hires fix's settings turns it on
                return dataclasses.replace(settings, hires=True, **{name: value}), controls
            if name == grid.MODEL_AXIS:  # at the form's size where the model offers it, else at its own first
                other = self.model(value)
                size = (settings.width, settings.height) if (settings.width, settings.height) in other.sizes else (
                    None, None)  # `_size`: its first
                changed = dataclasses.replace(settings, model=value, width=size[0], height=size[1])
                return changed, self._controls(changed, other, *self._size(changed, other))
            return dataclasses.replace(settings, **{name: value}), controls

        cells = []
        for cell, cell_controls in grid.cells((settings, controls), x, y, with_value):
            model = self.model(cell.model)
            cells.append(self.prepare(self._request(dataclasses.replace(cell, images_per_core=1, refine=False), model,
                                                    self._styled(cell), (cell.seed,), (0,), cell_controls), model))
        return grid.plan(x, y, cells, self.max_images, self.pipe.padded_batch)

    def upscale(self, picture, upscaler, factor) -> tuple[Image.Image, str]:
        """The Upscale tab (A1111's Extras): an uploaded picture `factor` times larger, by an image
        upscaler or a launched model upscaler, as a hires fix's image upscalers resize
        (`hires.upscaled_pictures`). Returns the picture and a sentence saying what was done.

        Raises:
          ValueError: no picture, or a bad upscaler or factor, in one sentence.
        """
        if picture is None:
            raise ValueError("upload an image to upscale, or send one from the gallery")
        picture = read_upload(picture).convert("RGB")
        upscaler = choice(upscaler, "upscaler", [name for _, name in self.choices.upscalers])
        factor = number(factor, "upscale factor", *UPSCALE_RANGE)
        width, height = (int(side * factor) for side in picture.size)
        if max(width, height) > MAX_UPSCALED_SIDE:
            raise ValueError(f"{picture.width}x{picture.height} upscaled {factor:g}x is {width}x{height}; the most "
                             f"this demo makes is {MAX_UPSCALED_SIDE} a side: choose a smaller factor")
        start = time.perf_counter()
        with self._upscaling:
            upscaled = hires_fix.upscaled_pictures(images.pixels(picture)[None], height, width, upscaler,
                                                   self.pipe.upscalers)[0]
        said = (f"{picture.width}x{picture.height} to {width}x{height} with {upscaler} in "
                f"{time.perf_counter() - start:.1f} s")
        return Image.fromarray(upscaled), said

    def prepare(self, request: Request, model: Model | None = None) -> PreparedRequest:
        """A request checked against the demo's limits for `model` (default: the first) and made what the
        devices take (`Pipeline.prepare`), its prompts' tags of LoRAs not loaded with the model left out (as
        webui draws them; `left_out` says so)."""
        model = model or self.models[0]
        names = self._lora_names(model)
        drawable = dataclasses.replace(request, **{field: tuple(prompt_syntax.without_loras(text, names)[0]
                                                                for text in getattr(request, field))
                                                   for field in ("prompts", "negative_prompts")})
        return model.pipe.prepare(drawable, limits=self.limits(model))

    def prompt_length(self, text, emphasis: str = "original", *, negative: bool = False, model=None) -> str:
        """A prompt box's length as the page shows it under the box, "84 tokens, 2 chunks", as `model`
        (a name; None: the default) reads it; or why it cannot be read."""
        if not isinstance(text, str) or emphasis not in EMPHASIS_MODES:
            return ""
        if not negative and PARAMETERS_LINE.search(text):
            return "This holds a picture's settings (a parameters text): ↙ Read them fills the form in"
        try:
            return self.model(model).pipe.prompts.length_text(text, emphasis, negative=negative)
        except ValueError as e:
            return str(e)

    def png_parameters(self, prepared: PreparedRequest, i: int, left_out: str | None = None) -> str:
        """Image `i`'s parameters text, with what its settings named that was `left_out` (`Submission.left_out`)."""
        return infotext.png_parameters(prepared.model, prepared.request, i, self.label_of(prepared), left_out)

    def label_of(self, prepared: PreparedRequest) -> str:
        """How results name the model a request was prepared for."""
        return next(model.label for model in self.models if model.name == prepared.model.name)

    def control_map(self, picture, preprocessor, canny_low, canny_high, width, height, model=None) -> np.ndarray:
        """The map a ControlNet panel's picture (an upload) makes at the chosen size (None: `model`'s first), as
        the request will make it (and then takes from the maps kept). Raises ValueError."""
        form = ControlForm(read_upload(picture, "control image"), preprocessor, canny_low, canny_high)
        served = self.model(model)
        return form.control(*self._size(Settings(width=width, height=height), served)).map

    def reused(self, text: str) -> tuple[dict, str]:
        """The form's fields, by name, that a PNG's "parameters" text (this demo's, A1111's or Forge's)
        fills in: the prompts, and of seed, guidance, steps, sampler, schedule type, emphasis, size (one
        of this model's), noise source, ENSD, variation seed, clip skip, hires fix (by a scale, with an
        upscaler the page has) and CFG rescale those it names; and a sentence that says what was filled in,
        and what was not. Raises ValueError."""
        model, unused_model = self._model_of_text(infotext.settings_of(text))
        found, unused = infotext.read_infotext(text, model.pipe)
        if len(self.models) > 1:  # the page's Model choice follows the text
            found["model"] = model.name
        unused = tuple(unused_model if entry.startswith("Model ") and unused_model else entry for entry in unused)
        hires, replaced = found.pop("hires", None), []
        if hires is not None:
            found |= {"hires": True, **self._reused_hires(hires, found.get("width"), found.get("height"), replaced)}
        if "width" in found and (found["width"], found["height"]) not in model.sizes:
            width, height = nearest_size(found["width"], found["height"], model.sizes)
            replaced.append(f"size {found['width']}x{found['height']} is not this model's: its nearest, "
                            f"{width}x{height}, in its place")
            found["width"], found["height"] = width, height
        missing = prompt_syntax.without_loras(found["prompt"], self._lora_names(model))[1]
        replaced += [f"the LoRA {name} is not loaded: the picture is drawn without it" for name in missing]
        label = size_label(found.get("width"), found.get("height"))
        fields = {"prompt": found["prompt"], "negative_prompt": found["negative_prompt"],
                  **{name: found[name] for name in (*REUSED, *HIRES_FIELDS) if name in found},
                  **({"size": label} if label in [size_label(*size) for size in model.sizes] else {}),
                  **self._reused_image_prompt(found.get("ip_adapter_scale"))}
        labels = {name: dict(map(reversed, getattr(self.choices, f"{name}s")))
                  for name in ("sampler", "schedule_type", "noise_source")} | {"sdxl_clip_l_skip": {True: "on"}}
        filled = "".join(f", {word} {labels.get(name, {}).get(fields[name], fields[name])}"
                         for name, word in REUSED.items() if name in fields and name != "hires")
        if fields.get("hires"):
            filled += f", the hires fix ({fields['hires_upscaler']}, {fields['hires_scale']:g}x)"
        filled += "".join(f"; {sentence}" for sentence in replaced)
        if "ip_adapter" in fields:
            filled += f", the image prompt's {fields['ip_adapter']} at {fields['ip_adapter_scale']:g} (not its picture)"
        said = f"Filled in: the prompts{filled}" + (f". Not used: {', '.join(unused)}" if unused else "")
        # A1111's settings a text leaves out are off in it: one reused before must not stay.
        left_out = {"ensd": 0, "variation_seed": 0, "variation_strength": 0.0, "clip_skip": 1,
                    "sdxl_clip_l_skip": False, "hires": False, "guidance_rescale": 0.0}
        return left_out | fields, said

    def _reused_hires(self, hires: Hires, width, height, replaced: list[str]) -> dict:
        """The hires fix's form fields a text's `hires` fills in: a resize to a size as its scale (of the first
        pass's `width` and `height`), and an upscaler that is not loaded as the nearest that is, said in
        `replaced`."""
        upscalers = [value for _, value in self.choices.hires_upscalers]
        upscaler = hires.upscaler
        if upscaler not in upscalers:
            models = [name for name in upscalers if name not in (*LATENT_UPSCALERS, *IMAGE_UPSCALERS)]
            upscaler = "Latent" if upscaler.startswith("Latent") else models[0] if models else "Lanczos"
            replaced.append(f"the hires upscaler {hires.upscaler} is not loaded: {upscaler} in its place")
        scale = hires.scale
        if not hires.by_scale and width:
            scale = round(max(hires.resize_width / width, hires.resize_height / (height or 1)) * 20) / 20
            replaced.append(f"the hires fix's resize to {hires.resize_width}x{hires.resize_height} as a scale "
                            f"of {scale:g}")
        return {name: getattr(hires, field) for name, field in HIRES_FIELDS.items()} | {
            "hires_upscaler": upscaler, "hires_scale": min(max(scale, 1.0), 4.0)}

    @staticmethod
    def _lora_names(model: Model) -> set[str]:
        """The names prompts' LoRA tags may give the model's LoRAs (their files' stems)."""
        return {lora.display_name(source) for source in model.pipe.lora_files}

    def _model_of_text(self, settings: Mapping[str, str]) -> tuple[Model, str | None]:
        """The served model a text's settings name by "Model hash" (its file's), else by "Model" (its name),
        and where they name none of several, the default and a sentence saying what is loaded instead."""
        text_hash, text_name = settings.get("Model hash"), infotext.file_stem(settings.get("Model"))
        for model in self.models:
            if text_hash and text_hash == model.hash:
                return model, None
        for model in self.models:
            if text_name in (infotext.file_stem(model.name), model.label):
                return model, None
        if text_name is None or len(self.models) == 1:
            return self.models[0], None  # `read_infotext` says what the text names, and what is loaded
        return self.models[0], (f"Model {settings['Model']} (loaded: {', '.join(m.name for m in self.models)}; "
                                f"{self.models[0].name} is chosen)")

    def _reused_image_prompt(self, scales) -> dict:
        """The image prompt's fields that a text's IP-Adapter scales (`infotext.read_infotext`'s, one per
        adapter) fill in: the first adapter that steers, its scale and its layers. The picture is not in
        a text."""
        for label, scale in zip(self.choices.ip_adapters, scales or ()):
            named = preset_named(scale)
            if named is not None and named[1]:
                return {"ip_adapter": label, "ip_adapter_scale": named[1], "ip_adapter_layers": named[0]}
        return {}

    def _images(self, settings: Settings, model: Model) -> Request:
        n = self.pipe.num_devices * integer(settings.images_per_core, "images per core", 1, self.max_images_per_core)
        return self._request(settings, model, self._styled(settings), (settings.seed,) * n, tuple(range(n)))

    def _request(self, settings: Settings, model: Model, styled: tuple[str, str], seeds: tuple, image_index: tuple,
                 controls: tuple[Control, ...] | None = None) -> Request:
        """The request of `model` for images of `seeds` and `image_index`, with the settings' size, sampler,
        guidance, LoRAs (those loaded with it), refiner and ControlNets (`controls` where made already)."""
        n = len(seeds)
        width, height = self._size(settings, model)
        if controls is None:
            controls = self._controls(settings, model, width, height)
        return Request(
            (styled[0],) * n, (styled[1],) * n, seeds, image_index, (settings.guidance_scale,) * n, settings.steps,
            height, width, settings.sampler, schedule_type=settings.schedule_type or None,
            loras=tuple((source, scale) for source, scale in zip(self.loras, self._lora_scales(settings))
                        if source in model.loras),
            refine_from=float(settings.refine_from) if settings.refine else None, emphasis=settings.emphasis,
            clip_skip=settings.clip_skip, sdxl_clip_l_skip=settings.sdxl_clip_l_skip,
            controls=None if controls is None else conditionings.per_image(CONTROLS, controls, n, "controls"),
            noise_source=settings.noise_source,
            ensd=settings.ensd, variation_seed=settings.variation_seed, variation_strength=settings.variation_strength,
            hires=Hires(**{field: getattr(settings, name) for name, field in HIRES_FIELDS.items()})
            if settings.hires else None, image_prompts=self._image_prompts(settings, model, n),
            guidance_rescales=(settings.guidance_rescale,) * n,
        )

    def _image_prompts(self, settings: Settings, model: Model, n: int) -> tuple | None:
        """The request's image prompts: the chosen IP-Adapter takes the picture at the scale, on the
        layers chosen; the model's others sit out at 0 with it (a request gives every adapter one, or
        none). None without a picture."""
        if settings.ip_adapter_image is None:
            return None
        labels, everyone = ip_adapter_labels(model.pipe), self.choices.ip_adapters
        if not everyone:
            raise ValueError("no IP-Adapter is loaded to take the image prompt (start with --ip-adapter)")
        chosen = choice(everyone[0] if settings.ip_adapter is None else settings.ip_adapter, "IP-Adapter", everyone)
        if chosen not in labels:
            raise ValueError(f"the IP-Adapter {chosen} is not loaded with {model.name} (it does not fit it)")
        prompt = ImagePrompt.of(settings.ip_adapter_image, preset_scale(
            model.pipe.spec.unet, settings.ip_adapter_layers, settings.ip_adapter_scale))
        off = ImagePrompt(prompt.picture, 0.0)
        per_adapter = [prompt if label == chosen else off for label in labels]
        return conditionings.per_image(IMAGE_PROMPTS, per_adapter, n, "the image prompt")

    def _controls(self, settings: Settings, model: Model, width, height) -> tuple[Control, ...] | None:
        """The request's controls, one per ControlNet loaded with `model`, from the form's panels (one per
        ControlNet of any model): none without pictures."""
        given = [form.picture is not None for form in settings.controls]
        if not any(given):
            return None
        forms, mine = dict(zip((c.name for c in self.controlnets), settings.controls)), [
            c.name for c in model.pipe.controlnets]
        others = [name for name, form in forms.items() if form.picture is not None and name not in mine]
        if others:
            raise ValueError(f"the ControlNet {others[0]} is not loaded with {model.name} (it does not fit it): clear "
                             "its control image")
        if len(given) != len(self.controlnets) or not all(forms[name].picture is not None for name in mine):
            raise ValueError(f"{len(mine)} ControlNets are loaded ({', '.join(mine)}): give a control image for each, "
                             f"or none (got {sum(given)})")
        return tuple(forms[name].control(width, height) for name in mine)

    @staticmethod
    def _size(settings: Settings, model: Model) -> tuple:
        """The settings' (width, height) as sent (`Request.validated` checks them), the model's first size's in
        place of what is not sent."""
        first = model.sizes[0]
        return (first[0] if settings.width is None else settings.width,
                first[1] if settings.height is None else settings.height)

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
