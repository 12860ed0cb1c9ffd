"""One request: the images a caller wants, with their prompts, seeds and settings; defaults and limits.

The library (`Pipeline.generate`), the CLI, the benchmark and the demo all build a `Request`, and
`Pipeline.render` runs it. Per-image values (prompt, negative prompt, seed, image index, guidance
scale, and the image and mask to edit) are lists, so that one compiled call can render a batch that
mixes them; the size, the step count, the sampler and the strength are one per request. Requests
with equal `batch_key`s can merge into one call.

`Request.validated` is the one check of every value, with the one set of limits below, wherever the
values come from: Python callers, the command line, or a browser's JSON.
"""

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from ..models.controlnet_union import control_mode
from ..prompts.syntax import EMPHASIS_MODES
from ..sampling.samplers import SAMPLER_NAMES, SAMPLERS, WHOLE_SCHEDULE_ONLY

DEFAULT_MODEL = "stabilityai/stable-diffusion-xl-base-1.0"
DEFAULT_STEPS = 25
DEFAULT_GUIDANCE_SCALE = 5.0
MAX_SEED = 2**32 - 1
GUIDANCE_SCALE_RANGE = (0.0, 20.0)
MAX_SIZE = 4096
# About what the 8 chunks of 75 tokens a prompt may have hold, and little enough that tokenizing it
# costs milliseconds: a megabyte of prompt held a shared device queue for seconds.
MAX_PROMPT_CHARACTERS = 2000

# LoRA scales people use run from about -2 (slider LoRAs, reversed) to 2; beyond 4 images break up.
LORA_SCALE_RANGE = (-4.0, 4.0)
# The SDXL refiner's aesthetic-score conditioning: its training scores ran from 0 to 10; diffusers'
# defaults ask for a 6 and steer away from a 2.5.
AESTHETIC_SCORE_RANGE = (0.0, 10.0)
DEFAULT_AESTHETIC_SCORES = (6.0, 2.5)
DEFAULT_REFINE_FROM = 0.8  # the base's share of the noise before a refiner takes over, as diffusers' docs use
# A ControlNet's conditioning scale: A1111's ControlNet extension offers 0 to 2; beyond 4 images break up.
CONTROL_SCALE_RANGE = (0.0, 4.0)


def default_strength(spec, *, inpainting: bool) -> float:
    """The strength diffusers' pipelines default to: image-to-image 0.3 for SDXL and 0.8 for SD
    1.x/2.x, inpainting 0.9999 for SDXL and 1 for SD 1.x/2.x."""
    if inpainting:
        return 0.9999 if spec.is_sdxl else 1.0
    return 0.3 if spec.is_sdxl else 0.8


def default_control_scale(spec, *, image: bool, inpainting: bool) -> float:
    """The ControlNet scale diffusers' ControlNet pipelines default to: 1 from text, 0.8 for
    image-to-image, for inpainting 1 with SDXL and 0.5 with SD 1.x/2.x."""
    if inpainting:
        return 1.0 if spec.is_sdxl else 0.5
    return 0.8 if image else 1.0


def integer(value, label: str, low: int, high: int) -> int:
    """`value` as an int in [low, high]; integral floats and numeric text (as JSON clients send) pass.

    Raises:
      ValueError: naming `label` and the range.
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not number.is_integer() or not low <= number <= high:
        raise ValueError(f"{label} must be an integer from {low} to {high}, got {value!r}")
    return int(number)


def number(value, label: str, low: float, high: float) -> float:
    """`value` as a finite float in [low, high]; numeric text passes. Raises ValueError naming `label`."""
    try:
        result = float(value)
    except (TypeError, ValueError):
        result = float("nan")
    if isinstance(value, bool) or not (math.isfinite(result) and low <= result <= high):
        raise ValueError(f"{label} must be a number from {low:g} to {high:g}, got {value!r}")
    return result


def guidance_scale(value) -> float:
    """A guidance scale as a float in `GUIDANCE_SCALE_RANGE`. Raises ValueError."""
    return number(value, "guidance scale", *GUIDANCE_SCALE_RANGE)


def _text(value, label: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{label} must be text, got {type(value).__name__} {value!r:.80}")
    if len(value) > MAX_PROMPT_CHARACTERS:
        raise ValueError(
            f"{label} is {len(value)} characters long; at most {MAX_PROMPT_CHARACTERS} are taken "
            "(a prompt may have 8 chunks of 75 tokens)"
        )
    return value


def required_prompt(prompt: str) -> str:
    """`prompt`, which must have words: the demo and the CLI refuse an empty one
    (the library renders it: diffusers does).

    Raises:
      ValueError: it is empty or blank, in one sentence.
    """
    if not prompt.strip():
        raise ValueError("please enter a prompt (an empty prompt would give unguided, random images)")
    return prompt


@dataclasses.dataclass(frozen=True)
class Request:
    """Images to render: one entry per image in each per-image tuple.

    Image i's starting noise depends only on (seeds[i], image_index[i]), so the same pair gives the
    same image in any batch and on any number of devices.
    """

    prompts: tuple[str, ...]
    negative_prompts: tuple[str, ...]
    seeds: tuple[int, ...]
    image_index: tuple[int, ...]
    guidance_scales: tuple[float, ...]
    steps: int
    height: int
    width: int
    sampler: str | None = None  # a name in `sampling.SAMPLERS`; None: the model's (`ModelSpec.default_sampler`)
    # [N, h, w, C] float32 latents (NHWC) that replace the seeded starting noise.
    noise: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    # ((LoRA source, scale), ...): exactly these LoRAs (() for none; validated: sorted, scale 0 left
    # out); None: whichever the pipeline has set (`Pipeline.set_loras`).
    loras: tuple[tuple[str, float], ...] | None = None
    # Image-to-image and inpainting: [N, height, width, 3] images (uint8, or float in [0, 1]) that
    # the images start from, noised to `strength` (1: pure noise's level, all steps run; 0.3: the
    # last 30% of the steps run), as diffusers' img2img and inpainting pipelines.
    images: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    # Inpainting: [N, height, width], where > 0.5 is repainted and the rest kept.
    masks: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    strength: float = 1.0
    # A base model's and a refiner's share of one schedule (diffusers' "ensemble of expert
    # denoisers"): the base stops at the fraction `denoising_end` of its noise and returns latents
    # (`Pipeline.render(output="latents")`), which the refiner continues, given as
    # `start_latents`, from `denoising_start`.
    denoising_end: float | None = None
    denoising_start: float | None = None
    start_latents: object = dataclasses.field(default=None, compare=False, repr=False)  # [N, h, w, C] jax.Array
    # Finish with the pipeline's refiner (`Pipeline.set_refiner`) from this fraction of the noise: the
    # two runs above, one request.
    refine_from: float | None = None
    # The refiner's conditioning (`ModelSpec.requires_aesthetics_score`); other models ignore them.
    aesthetic_scores: tuple[float, float] = DEFAULT_AESTHETIC_SCORES  # (positive, negative)
    emphasis: str = "original"  # one of `EMPHASIS_MODES`
    # The prompts as the encoders read them (`sdxl.prompts.tokens.Tokens`, made by `Pipeline.tokenized`);
    # None: made at render time.
    tokens: object = dataclasses.field(default=None, compare=False, repr=False)
    # ControlNets (`Pipeline.controlnets`: all of them, or none): one [N, height, width, C] control
    # image per ControlNet (uint8, or float in [0, 1]); and per image, one value per ControlNet: its
    # conditioning scale, and the fractions of the steps between which it steers (diffusers'
    # `controlnet_conditioning_scale`, `control_guidance_start` and `control_guidance_end`; by default
    # 1, 0 and 1).
    control_images: tuple[np.ndarray, ...] | None = dataclasses.field(default=None, compare=False, repr=False)
    control_scales: tuple[tuple[float, ...], ...] | None = None
    control_starts: tuple[tuple[float, ...], ...] | None = None
    control_ends: tuple[tuple[float, ...], ...] | None = None
    # A ControlNet Union's control mode: per image, one per ControlNet, the kind of its control image
    # (an index of `sdxl.models.controlnet_union.CONTROL_MODES` or one of its names; validated: the index),
    # None for a plain ControlNet, which has none. None throughout where no ControlNet is a Union.
    control_modes: tuple[tuple[int | str | None, ...], ...] | None = None
    # How each control image was made from a picture (`control_maps.Preprocessor`), for the PNG
    # parameters; None: given as it is.
    control_preprocessors: tuple | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def from_prompt(
        cls,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str] = "",
        *,
        num_images: int,
        seed: int = 0,
        guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
        steps: int = DEFAULT_STEPS,
        height: int,
        width: int,
        sampler: str | None = None,
        noise: np.ndarray | None = None,
    ) -> "Request":
        """Images (seed, 0), (seed, 1), ... of one prompt, or of one prompt per image when given lists.

        Raises:
          ValueError: a list's length is not `num_images`.
        """
        prompts = [prompt] * num_images if isinstance(prompt, str) else list(prompt)
        negatives = [negative_prompt] * num_images if isinstance(negative_prompt, str) else list(negative_prompt)
        if not len(prompts) == len(negatives) == num_images:
            raise ValueError(
                f"got {len(prompts)} prompts and {len(negatives)} negative prompts for {num_images} images"
            )
        return cls(
            tuple(prompts), tuple(negatives), (seed,) * num_images, tuple(range(num_images)),
            (guidance_scale,) * num_images, steps, height, width, sampler, noise,
        )

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def guided(self) -> bool:
        """Whether any image needs classifier-free guidance (a scale above 1, as diffusers decides);
        otherwise the program that skips the negative prompts' UNet pass renders the request."""
        return any(float(g) > 1 for g in self.guidance_scales)

    @property
    def start_from(self) -> str:
        """Where the sampling loop starts (`sdxl.engine.program.START_FROM`): a `denoising_start` continues latents."""
        if self.denoising_start is not None:
            return "latents"
        return "noise" if self.images is None else "image"

    @property
    def call_settings(self) -> tuple:
        """What every image of one compiled call shares: requests with equal settings can render
        together (guidance aside: `batch_key`)."""
        return (
            self.height, self.width, self.steps, self.sampler, self.loras, self.start_from, self.masks is not None,
            self.strength, self.denoising_start, self.denoising_end, self.aesthetic_scores, self.refine_from,
            self.emphasis, self.controls,
        )

    @property
    def controls(self) -> int:
        """How many ControlNets steer the images (0 or all of the pipeline's)."""
        return 0 if self.control_images is None else len(self.control_images)

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys share a call in the device queue: equal `call_settings`, all needing
        guidance or none (a request without would otherwise pay for the other's second UNet pass), and
        prompts of as many chunks (a short one would pay for the other's long context)."""
        return self.call_settings, self.guided, None if self.tokens is None else self.tokens.num_chunks

    @classmethod
    def merged(cls, requests: Sequence["Request"]) -> "Request":
        """One request for the images of several with the same `batch_key`, in order (no noise, no
        start latents)."""
        first = requests[0]
        arrays = {
            name: None if getattr(first, name) is None else np.concatenate([getattr(r, name) for r in requests])
            for name in ("images", "masks")
        }
        tokens = [r.tokens for r in requests]
        arrays["tokens"] = None if any(t is None for t in tokens) else type(tokens[0]).merged(tokens)
        if first.controls:
            stacks = zip(*(r.control_images for r in requests))  # per ControlNet, every request's images
            arrays["control_images"] = tuple(np.concatenate(images) for images in stacks)
        per_image = [f for f in (*_PER_IMAGE, *_PER_IMAGE_CONTROL) if getattr(first, f) is not None]
        return dataclasses.replace(
            first,
            **{f: tuple(v for r in requests for v in getattr(r, f)) for f in per_image},
            **arrays,
            noise=None,
            start_latents=None,
        )

    def validated(self, spec, *, max_steps: int) -> "Request":
        """This request with every value checked and converted to the type the program takes.

        Args:
          spec: the model's `ModelSpec`: sizes must be multiples of its `latent_factor`, and noise
            must have its latents' shape.
          max_steps: the most steps the pipeline's padded schedules hold.

        Raises:
          ValueError: one sentence naming the first bad value and what is allowed.
        """
        n = len(self)
        if n == 0 or any(len(getattr(self, f)) != n for f in _PER_IMAGE):
            raise ValueError("every per-image value needs the same, non-zero, number of entries")
        sampler = spec.default_sampler if self.sampler is None else sampler_name(self.sampler)
        f = spec.latent_factor
        sizes = {}
        for label in ("height", "width"):
            value = getattr(self, label)
            try:
                size = integer(value, label, f, MAX_SIZE)
            except ValueError:
                size = None
            if size is None or size % f:
                raise ValueError(f"{label} must be a multiple of {f} from {f} to {MAX_SIZE}, got {value!r}")
            sizes[label] = size
        latent_shape = (n, *spec.latent_shape(sizes["height"], sizes["width"]))
        if self.noise is not None and tuple(np.shape(self.noise)) != latent_shape:
            raise ValueError(f"noise must have shape {latent_shape} (NHWC), got {tuple(np.shape(self.noise))}")
        steps = integer(self.steps, "steps", 1, max_steps)
        strength = number(self.strength, "strength", 0.0, 1.0)
        self._check_start(spec, sampler, steps, strength, sizes["height"], sizes["width"], latent_shape)
        return dataclasses.replace(
            self,
            **self._checked_controls(sizes["height"], sizes["width"]),
            prompts=tuple(_text(p, "prompt") for p in self.prompts),
            negative_prompts=tuple(_text(p, "negative prompt") for p in self.negative_prompts),
            seeds=tuple(integer(s, "seed", 0, MAX_SEED) for s in self.seeds),
            image_index=tuple(integer(i, "image index", 0, MAX_SEED) for i in self.image_index),
            guidance_scales=tuple(guidance_scale(g) for g in self.guidance_scales),
            steps=steps,
            sampler=sampler,
            emphasis=_choice(self.emphasis, "emphasis", EMPHASIS_MODES),
            loras=None if self.loras is None else _active(self.loras),
            images=None if self.images is None else _pixels(self.images),
            masks=None if self.masks is None else np.asarray(self.masks, np.float32) > 0.5,
            strength=strength,
            aesthetic_scores=tuple(number(a, label, *AESTHETIC_SCORE_RANGE) for a, label in zip(
                self.aesthetic_scores, ("aesthetic score", "negative aesthetic score"))),
            **sizes,
        )

    def _check_start(
        self, spec, sampler: str, steps: int, strength: float, height: int, width: int, latent_shape: tuple
    ) -> None:
        """Checks the image, mask, strength and handoff settings against each other and the model."""
        n, start = len(self), self.start_from
        if start == "image":
            shape = np.shape(self.images)
            if len(shape) != 4 or shape[0] != n or shape[3] != 3:
                raise ValueError(f"images must be {n} RGB image(s), [N, height, width, 3], got shape {shape}")
            if shape[1:3] != (height, width):
                raise ValueError(
                    f"the image is {shape[2]}x{shape[1]} (width x height), but the request is for {width}x{height}: "
                    f"sizes must be multiples of {spec.latent_factor} (resize or crop the image)"
                )
        if (self.denoising_start is not None) != (self.start_latents is not None):
            raise ValueError("denoising_start continues a base model's latents: give both, or neither")
        if start == "latents" and tuple(np.shape(self.start_latents)) != latent_shape:
            raise ValueError(f"start latents must have shape {latent_shape}, got {tuple(np.shape(self.start_latents))}")
        if self.masks is not None:
            if start != "image":
                raise ValueError("a mask needs an image to inpaint")
            if np.shape(self.masks) != (n, height, width):
                raise ValueError(f"masks must be [N, height, width] = {(n, height, width)}, got {np.shape(self.masks)}")
            if not (np.asarray(self.masks, np.float32) > 0.5).any(axis=(1, 2)).all():
                raise ValueError("the mask is empty: paint the region to repaint")
        elif spec.is_inpainting:
            raise ValueError("this is an inpainting model: give it an image and a mask")
        if start == "image" and int(steps * strength) < 1:
            raise ValueError(
                f"strength {strength:g} of {steps} steps leaves no step to run: raise the strength or the steps"
            )
        for label in ("denoising_start", "denoising_end", "refine_from"):
            value = getattr(self, label)
            if value is not None and not (isinstance(value, float | int) and 0 < value < 1):
                raise ValueError(f"{label} must be a fraction above 0 and below 1, got {value!r}")
        if self.refine_from is not None and (self.masks is not None or start == "latents" or self.denoising_end):
            raise ValueError("refine_from refines a whole generation: not an inpainting, nor a handoff of its own")
        if None not in (self.denoising_start, self.denoising_end) and self.denoising_start >= self.denoising_end:
            raise ValueError(f"denoising_start {self.denoising_start} must be below denoising_end {self.denoising_end}")
        partial = start != "noise" or self.denoising_end is not None or self.refine_from is not None
        if sampler in WHOLE_SCHEDULE_ONLY and partial and not (start == "image" and strength == 1):
            raise ValueError(
                f"the {sampler} sampler runs whole schedules only; choose another for image-to-image, "
                "inpainting below strength 1, or a refiner handoff"
            )


    def _checked_controls(self, height: int, width: int) -> dict:
        """The control images and their per-image settings, checked, with their defaults filled in."""
        n, k = len(self), self.controls
        if not k:
            given = [f for f in _PER_IMAGE_CONTROL if getattr(self, f) is not None]
            if given:
                raise ValueError(f"{given[0].replace('_', ' ')} were given without control images")
            return {}
        for image in self.control_images:
            shape = np.shape(image)
            if len(shape) != 4 or shape[:3] != (n, height, width):
                raise ValueError(
                    f"each ControlNet needs {n} control image(s) of the request's size, [N, height, width, C] = "
                    f"{[n, height, width, 'C']}, got shape {shape}"
                )
        settings, defaults = {}, control_defaults(n, k)
        for field, (label, _, (low, high)) in _CONTROL_SETTINGS.items():
            values = getattr(self, field) or defaults[field]
            if len(values) != n or any(len(v) != k for v in values):
                raise ValueError(f"{label}s: need {k} per image (one per ControlNet) for {n} image(s)")
            settings[field] = tuple(tuple(number(x, label, low, high) for x in v) for v in values)
        for starts, ends in zip(settings["control_starts"], settings["control_ends"]):
            for start, end in zip(starts, ends):
                if start >= end:
                    raise ValueError(f"a ControlNet's start ({start:g}) must be below its end ({end:g})")
        modes = self.control_modes or defaults["control_modes"]
        if len(modes) != n or any(len(m) != k for m in modes):
            raise ValueError(
                f"control modes: need {k} per image (one per ControlNet, None for a plain one) for {n} image(s)"
            )
        settings["control_modes"] = tuple(tuple(None if m is None else control_mode(m) for m in v) for v in modes)
        return {"control_images": tuple(_pixels(image) for image in self.control_images), **settings}


def sampler_name(value) -> str:
    """A sampler's name in `SAMPLERS`, from it or its label as the UIs show it ("DPM++ 2M Karras"),
    in any case.

    Raises:
      ValueError: naming each sampler by name and label.
    """
    by_label = {label.lower(): name for name, label in SAMPLER_NAMES.items()}
    name = by_label.get(value.lower(), value.lower()) if isinstance(value, str) else value
    if name not in SAMPLERS:
        choices = ", ".join(f"{name} ({SAMPLER_NAMES[name]})" for name in SAMPLERS)
        raise ValueError(f"unknown sampler {value!r}; choose one of: {choices}")
    return name


def _choice(value, label: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{label} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _pixels(images) -> np.ndarray:
    """Images as uint8, or float32 in [0, 1] (as diffusers takes arrays)."""
    images = np.asarray(images)
    if images.dtype == np.uint8:
        return images
    images = images.astype(np.float32)
    if not np.isfinite(images).all() or images.min() < 0 or images.max() > 1:
        raise ValueError("images given as floats must lie in [0, 1]")
    return images


def _active(loras) -> tuple[tuple[str, float], ...]:
    """LoRA settings checked and in one form: sorted, and without those at scale 0 (which do nothing),
    so that equal settings give equal batch keys."""
    checked = ((source, number(scale, f"LoRA scale of {source}", *LORA_SCALE_RANGE)) for source, scale in loras)
    return tuple(sorted((source, scale) for source, scale in checked if scale))


_PER_IMAGE = ("prompts", "negative_prompts", "seeds", "image_index", "guidance_scales")
# The per-image ControlNet settings (None without control images): their labels, defaults and ranges.
_CONTROL_SETTINGS = {
    "control_scales": ("ControlNet scale", 1.0, CONTROL_SCALE_RANGE),
    "control_starts": ("ControlNet start", 0.0, (0.0, 1.0)),
    "control_ends": ("ControlNet end", 1.0, (0.0, 1.0)),
}
_PER_IMAGE_CONTROL = (*_CONTROL_SETTINGS, "control_modes")  # every per-image ControlNet field


def control_defaults(n: int, k: int) -> dict:
    """`Request`'s per-image ControlNet settings for n images and k ControlNets, each at its default
    (and no control mode)."""
    defaults = {field: ((default,) * k,) * n for field, (_, default, _) in _CONTROL_SETTINGS.items()}
    return {**defaults, "control_modes": ((None,) * k,) * n}
