"""One request: the images a caller wants, with their prompts, seeds and settings; defaults and limits.

The library (`Pipeline.generate`), the CLI, the benchmark and the demo all build a `Request`, and
`Pipeline.prepare` makes it what the devices take (`sdxl.engine.prepared`). Per-image values
(prompt, negative prompt, seed, image index, guidance scale, the ControlNets' `Control`s, and the
image and mask to edit) are lists, so that one compiled call can render a batch that mixes them;
the size, the step count, the sampler and the strength are one per request.

`Request.validated(limits)` is the one check of every value, against what the loaded pipeline
allows (`Limits`), wherever the values come from: Python callers, the command line, or a browser's
JSON.
"""

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from ..prompts.syntax import EMPHASIS_MODES, lora_tags
from ..sampling.noise import NOISE_SOURCES
from ..sampling import samplers
from ..sampling.methods import DIFFUSERS, sampler_name, schedule_type_for, steps_run
from . import conditionings
from .checks import choice, flag, fraction, integer, number, text
from .controls import Control
from .hires import Hires
from .image_prompts import ImagePrompt
from .images import checked_pixels

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
CLIP_SKIP_RANGE = (1, 12)  # webui's slider: every layer of CLIP ViT-L's 12 (the embeddings never)
DEFAULT_REFINE_FROM = 0.8  # the base's share of the noise before a refiner takes over, as diffusers' docs use


def default_strength(spec, *, inpainting: bool) -> float:
    """The strength diffusers' pipelines default to: image-to-image 0.3 for SDXL and 0.8 for SD
    1.x/2.x, inpainting 0.9999 for SDXL and 1 for SD 1.x/2.x."""
    if inpainting:
        return 0.9999 if spec.is_sdxl else 1.0
    return 0.3 if spec.is_sdxl else 0.8


def guidance_scale(value) -> float:
    """A guidance scale as a float in `GUIDANCE_SCALE_RANGE`. Raises ValueError."""
    return number(value, "guidance scale", *GUIDANCE_SCALE_RANGE)


def guidance_rescale(value) -> float:
    """A CFG rescale factor as a float from 0 (none) to 1. Raises ValueError."""
    return number(value, "guidance rescale", 0.0, 1.0)


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
class Limits:
    """What a loaded pipeline allows a request (`Pipeline.limits`), for `Request.validated`; the demo
    narrows it to its own sizes."""

    spec: object  # the model's `ModelSpec`: sizes must be multiples of its `latent_factor`
    max_steps: int = 100  # the most steps the pipeline's padded schedules hold
    controlnets: tuple = ()  # the loaded ControlNets (`ControlNetCheckpoint`s: name, config), in order
    # The LoRA files read, by the name a prompt's `<lora:NAME:SCALE>` tag gives them: {name: source}.
    loras: Mapping[str, str] = dataclasses.field(default_factory=dict)
    active_loras: tuple[tuple[str, float], ...] = ()  # what a request that names no LoRAs gets
    refiner: str | None = None  # the refiner's name, where one continues requests with `refine_from`
    sizes: tuple[tuple[int, int], ...] | None = None  # the (width, height) allowed; None: any the model renders
    upscalers: tuple[str, ...] = ()  # the model upscalers loaded, by name, for a hires fix (`Pipeline.upscalers`)
    ip_adapters: tuple = ()  # the loaded IP-Adapters (`IPAdapter`s: name, image size), in order


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
    # A name in `sampling.methods.SAMPLER_NAMES`; None: the model's (`ModelSpec.default_sampler`).
    sampler: str | None = None
    # One of `sampling.methods.SCHEDULE_TYPES`: "diffusers" (the checkpoint scheduler's timesteps, as
    # diffusers), or one of A1111's, on which the sampler runs as A1111's k-diffusion samplers do;
    # None: the sampler's own (`schedule_type_for`).
    schedule_type: str | None = None
    # [N, h, w, C] float32 latents (NHWC) that replace the seeded starting noise.
    noise: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    # Where the noise comes from (`sdxl.sampling.noise`): "jax", JAX's PRNG at (seed, image index),
    # made on the devices; or torch's, made on the host as the tools people compare with draw it:
    # "nv" (A1111's NV source, which is CUDA's torch.randn) or "cpu" (torch.randn on the CPU).
    noise_source: str = "jax"
    # With "nv" or "cpu": one generator draws all the images of a seed, as diffusers and ComfyUI draw
    # a batch (True); or, as A1111 and Forge, each image has its own, at seed + image index (False).
    batch_noise: bool = False
    # A1111's variation seed ("subseed"; image i's is variation_seed + its index) and strength, and its
    # eta noise seed delta (ENSD), which re-seeds the draws after the starting noise.
    variation_seed: int = 0
    variation_strength: float = 0.0
    ensd: int = 0
    # [N, steps, h, w, C] float32 the noise a stochastic sampler adds at each step (those before the
    # first step that runs unread); drawn on the host (`Pipeline.prepare`) with a noise source.
    step_noise: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    # ((LoRA source, scale), ...): exactly these LoRAs (() for none; validated: sorted, scale 0 left
    # out, the prompts' tags added); None: the pipeline's active ones (`Pipeline.set_loras`).
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
    # (`Pipeline.render(output_type="latent")`), which the refiner continues, given as
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
    # webui's "Clip skip" (its setting `CLIP_stop_at_last_layers`, `CLIP_SKIP_RANGE`): SD 1.x's text
    # encoder gives the hidden state this many layers back from its last layer's output (1: the last),
    # through the final layer norm. SD 2.x ignores it, as webui does; so does SDXL, unless
    # `sdxl_clip_l_skip` (webui's setting of that name), when its CLIP-L gives that state, unnormed
    # (`sdxl.engine.inputs.clip_layers`).
    clip_skip: int = 1
    sdxl_clip_l_skip: bool = False
    # Per image, one `Control` for each of the pipeline's ControlNets (`Pipeline.controlnets`: all of
    # them, or none); None: no ControlNet steers.
    controls: tuple[tuple[Control, ...], ...] | None = dataclasses.field(default=None, compare=False)
    # Per image, one `ImagePrompt` for each of the pipeline's IP-Adapters (`Pipeline.ip_adapters`: all
    # of them, or none); None: no picture prompts.
    image_prompts: tuple[tuple[ImagePrompt, ...], ...] | None = dataclasses.field(default=None, compare=False)
    # A second pass at a bigger size, from this one's upscaled result (`sdxl.engine.hires`); None: none.
    hires: Hires | None = None
    # Per image, Lin et al.'s CFG rescale factor, 0 to 1: the guided prediction's standard deviation pulled
    # this far towards the conditional one's, as diffusers' `guidance_rescale` (`rescale_noise_cfg`);
    # None: 0 for every image.
    guidance_rescales: tuple[float, ...] | None = None

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
            (guidance_scale,) * num_images, steps, height, width, sampler, noise=noise,
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
        together (guidance, prompt lengths and embeddings aside: `PreparedRequest.batch_key`)."""
        return (
            self.height, self.width, self.steps, self.sampler, self.schedule_type, self.loras, self.start_from,
            self.masks is not None, self.strength, self.denoising_start, self.denoising_end, self.aesthetic_scores,
            self.refine_from, self.emphasis, self.clip_skip, self.sdxl_clip_l_skip, self.noise_source,
            self.noise is not None, self.hires, *conditionings.counts(self),
        )

    @classmethod
    def merged(cls, requests: Sequence["Request"]) -> "Request":
        """One request for the images of several with the same `call_settings`, in order (no start latents).

        Raises:
          ValueError: some give noise and others do not.
        """
        first = requests[0]
        arrays = {}
        for name in ("images", "masks", "noise", "step_noise"):
            given = [getattr(r, name) is not None for r in requests]
            if any(given) and not all(given):
                raise ValueError(f"cannot merge requests with {name} and requests without")
            arrays[name] = np.concatenate([getattr(r, name) for r in requests]) if all(given) else None
        per_image = [f for f in (*_PER_IMAGE, *conditionings.FIELDS) if getattr(first, f) is not None]
        return dataclasses.replace(
            first, **{f: tuple(v for r in requests for v in getattr(r, f)) for f in per_image}, **arrays,
            start_latents=None,
        )

    def validated(self, limits: Limits) -> "Request":
        """This request with every value checked against `limits` and converted to the type the
        program takes: its LoRAs those it names (or the active ones), with the ones its prompts' tags
        name at their scales; each per-image conditioning (`conditionings.KINDS`: each `Control`, each
        `ImagePrompt`) checked against the unit it steers through.

        Raises:
          ValueError: one sentence naming the first bad value and what is allowed.
        """
        n, spec = len(self), limits.spec
        if n == 0 or any(len(getattr(self, f)) != n for f in _PER_IMAGE if getattr(self, f) is not None):
            raise ValueError("every per-image value needs the same, non-zero, number of entries")
        sampler = spec.default_sampler if self.sampler is None else sampler_name(self.sampler)
        schedule_type = schedule_type_for(sampler, self.schedule_type)
        height, width = (_size(getattr(self, label), label, spec.latent_factor) for label in ("height", "width"))
        if limits.sizes is not None and (width, height) not in limits.sizes:
            presets = ", ".join(f"{w}x{h}" for w, h in limits.sizes)
            raise ValueError(f"size {width}x{height} is not one of this model's sizes: {presets}")
        latent_shape = (n, *spec.latent_shape(height, width))
        if self.noise is not None and tuple(np.shape(self.noise)) != latent_shape:
            raise ValueError(f"noise must have shape {latent_shape} (NHWC), got {tuple(np.shape(self.noise))}")
        steps = integer(self.steps, "steps", 1, limits.max_steps)
        run = steps_run(spec.scheduler, sampler, schedule_type, steps, is_sdxl=spec.is_sdxl)
        if run > limits.max_steps:
            raise ValueError(f"the {schedule_type} schedule type runs {run} steps for {steps}, more than the "
                             f"{limits.max_steps} allowed: ask for fewer")
        strength = number(self.strength, "strength", 0.0, 1.0)
        noise_settings = self.checked_noise()
        if self.refine_from is not None and limits.refiner is None:
            raise ValueError("no refiner is loaded to refine with (start the demo or the CLI with --refiner)")
        self._check_start(spec, sampler, schedule_type, steps, strength, height, width, latent_shape)
        hires = None
        if self.hires is not None:
            if self.start_from != "noise" or self.refine_from is not None or self.denoising_end is not None:
                raise ValueError("a hires fix follows a whole text-to-image pass: not image-to-image, inpainting "
                                 "or a refiner's handoff")
            if self.controls:
                raise ValueError("a hires fix with ControlNets is not supported yet: leave out the control image "
                                 "or the hires fix")
            first_pass = dict(height=height, width=width, steps=steps, sampler=sampler, schedule_type=schedule_type)
            hires = self.hires.validated(first_pass, spec, limits.max_steps, limits.upscalers)
            hires = dataclasses.replace(
                hires, guidance_scale=None if hires.guidance_scale is None else guidance_scale(hires.guidance_scale),
                **{label: None if getattr(hires, label) is None else
                   text(getattr(hires, label), f"hires {label.replace('_', ' ')}", MAX_PROMPT_CHARACTERS)
                   for label in ("prompt", "negative_prompt")},
            )
        prompts = tuple(text(p, "prompt", MAX_PROMPT_CHARACTERS) for p in self.prompts)
        return dataclasses.replace(
            self,
            prompts=prompts,
            negative_prompts=tuple(text(p, "negative prompt", MAX_PROMPT_CHARACTERS) for p in self.negative_prompts),
            seeds=tuple(integer(s, "seed", 0, MAX_SEED) for s in self.seeds),
            image_index=tuple(integer(i, "image index", 0, MAX_SEED) for i in self.image_index),
            guidance_scales=tuple(guidance_scale(g) for g in self.guidance_scales),
            guidance_rescales=tuple(guidance_rescale(r) for r in self.guidance_rescales or (0.0,) * n),
            steps=steps,
            height=height,
            width=width,
            sampler=sampler,
            schedule_type=schedule_type,
            emphasis=choice(self.emphasis, "emphasis", EMPHASIS_MODES),
            clip_skip=integer(self.clip_skip, "clip skip", *CLIP_SKIP_RANGE),
            sdxl_clip_l_skip=flag(self.sdxl_clip_l_skip, "sdxl_clip_l_skip"),
            loras=_loras(self.loras, prompts, limits),
            images=None if self.images is None else checked_pixels(self.images),
            masks=None if self.masks is None else np.asarray(self.masks, np.float32) > 0.5,
            strength=strength,
            aesthetic_scores=tuple(number(a, label, *AESTHETIC_SCORE_RANGE) for a, label in zip(
                self.aesthetic_scores, ("aesthetic score", "negative aesthetic score"))),
            **conditionings.validated(self, limits, height, width),
            hires=hires,
            **noise_settings,
        )

    def checked_noise(self) -> dict:
        """The noise source and A1111's seed settings, checked against each other, by field name.

        Raises:
          ValueError: one sentence.
        """
        source = choice(self.noise_source, "noise source", NOISE_SOURCES)
        settings = dict(
            noise_source=source, batch_noise=bool(self.batch_noise),
            variation_seed=integer(self.variation_seed, "variation seed", 0, MAX_SEED),
            variation_strength=number(self.variation_strength, "variation strength", 0.0, 1.0),
            ensd=integer(self.ensd, "ENSD (eta noise seed delta)", 0, MAX_SEED),
        )
        a1111 = [label for label, used in (("a variation strength", settings["variation_strength"]),
                                           ("an ENSD", settings["ensd"])) if used]
        if source == "jax" and (a1111 or settings["batch_noise"]):
            asked = " and ".join(a1111) or "batch noise"
            raise ValueError(f"{asked} needs torch's noise: choose the noise source nv or cpu, not jax")
        if settings["batch_noise"] and a1111:
            raise ValueError(f"A1111 draws noise per image, so {' and '.join(a1111)} cannot go with batch noise")
        if source != "jax" and self.noise is not None:
            raise ValueError(f"give starting noise, or a noise source to draw it ({source}), not both")
        return settings

    def _check_start(
        self, spec, sampler: str, schedule_type: str, steps: int, strength: float, height: int, width: int,
        latent_shape: tuple,
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
            if getattr(self, label) is not None:
                fraction(getattr(self, label), label)
        if self.refine_from is not None and (self.masks is not None or start == "latents" or self.denoising_end):
            raise ValueError("refine_from refines a whole generation: not an inpainting, nor a handoff of its own")
        if None not in (self.denoising_start, self.denoising_end) and self.denoising_start >= self.denoising_end:
            raise ValueError(f"denoising_start {self.denoising_start} must be below denoising_end {self.denoising_end}")
        partial = start != "noise" or self.denoising_end is not None or self.refine_from is not None
        if partial and schedule_type != DIFFUSERS:
            # A1111's image-to-image has its own step setup, not built here yet.
            raise ValueError(
                f"A1111's schedule types ({schedule_type}) render from text, whole; for image-to-image, inpainting "
                f"or a refiner handoff choose the schedule type {DIFFUSERS}"
            )
        if sampler in samplers.WHOLE_SCHEDULE_ONLY and partial and not (start == "image" and strength == 1):
            raise ValueError(
                f"the {sampler} sampler runs whole schedules only; choose another for image-to-image, "
                "inpainting below strength 1, or a refiner handoff"
            )


_PER_IMAGE = ("prompts", "negative_prompts", "seeds", "image_index", "guidance_scales", "guidance_rescales")


def _size(value, label: str, factor: int) -> int:
    """A height or width: a multiple of the model's latent factor up to `MAX_SIZE`. Raises ValueError."""
    try:
        size = integer(value, label, factor, MAX_SIZE)
    except ValueError:
        size = None
    if size is None or size % factor:
        raise ValueError(f"{label} must be a multiple of {factor} from {factor} to {MAX_SIZE}, got {value!r}")
    return size


def _loras(loras, prompts: Sequence[str], limits: Limits) -> tuple[tuple[str, float], ...]:
    """The LoRAs a request runs with: those it names (None: the active ones), with those its prompts'
    `<lora:NAME:SCALE>` tags name at their scales (a LoRA tagged twice applies twice, as in webui:
    the scales add); checked, sorted, and without those at scale 0 (which do nothing), so that equal
    settings give equal batch keys."""
    tags = {tuple(lora_tags(prompt)[1]) for prompt in prompts}
    if len(tags) > 1:
        raise ValueError("the prompts of one request name different LoRA tags; give each its own request")
    chosen = dict(limits.active_loras if loras is None else loras)
    tagged: dict[str, float] = {}
    for name, scale in tags.pop():
        tagged[name] = tagged.get(name, 0.0) + scale
    for name, scale in tagged.items():
        if name not in limits.loras:
            known = f"the loaded ones: {', '.join(sorted(limits.loras))}" if limits.loras else "no LoRA is loaded"
            raise ValueError(f"the prompt names the LoRA {name!r}, which is not loaded; {known}")
        chosen[limits.loras[name]] = scale
    checked = {source: number(scale, f"LoRA scale of {source}", *LORA_SCALE_RANGE) for source, scale in chosen.items()}
    return tuple(sorted((source, scale) for source, scale in checked.items() if scale))
