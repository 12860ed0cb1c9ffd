"""One request: the images a caller wants, with their prompts, seeds and settings; defaults and limits.

The library (`Pipeline.generate`), the CLI, the benchmark and the demo all build a `Request`, and
`Pipeline.render` runs it. Per-image values (prompt, negative prompt, seed, image index, guidance
scale) are lists, so that one compiled call can render a batch that mixes them; the size, the step
count and the sampler are one per request. Requests with equal `batch_key`s can merge into one call.

`Request.validated` is the one check of every value, with the one set of limits below, wherever the
values come from: Python callers, the command line, or a browser's JSON.
"""

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from .sampling import SAMPLERS

DEFAULT_MODEL = "stabilityai/stable-diffusion-xl-base-1.0"
DEFAULT_STEPS = 25
DEFAULT_GUIDANCE_SCALE = 5.0
MAX_SEED = 2**32 - 1
GUIDANCE_SCALE_RANGE = (0.0, 20.0)
MAX_SIZE = 4096
# Far more than the text encoders' 77 tokens read, and little enough that tokenizing it costs
# milliseconds: a megabyte of prompt held a shared device queue for seconds.
MAX_PROMPT_CHARACTERS = 2000
# LoRA scales people use run from about -2 (slider LoRAs, reversed) to 2; beyond 4 images break up.
LORA_SCALE_RANGE = (-4.0, 4.0)


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
            "(the text encoders read 77 tokens, a few hundred characters)"
        )
    return value


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
    def batch_key(self) -> tuple:
        """Requests with equal keys can share a compiled call."""
        return (self.height, self.width, self.steps, self.sampler, self.guided, self.loras)

    @classmethod
    def merged(cls, requests: Sequence["Request"]) -> "Request":
        """One request for the images of several with the same `batch_key`, in order (no noise)."""
        first = requests[0]
        return dataclasses.replace(
            first,
            **{f: tuple(v for r in requests for v in getattr(r, f)) for f in _PER_IMAGE},
            noise=None,
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
        sampler = spec.default_sampler if self.sampler is None else self.sampler
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; choose one of: {', '.join(SAMPLERS)}")
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
        if self.noise is not None:
            expected = (n, *spec.latent_shape(sizes["height"], sizes["width"]))
            if tuple(np.shape(self.noise)) != expected:
                raise ValueError(f"noise must have shape {expected} (NHWC), got {tuple(np.shape(self.noise))}")
        return dataclasses.replace(
            self,
            prompts=tuple(_text(p, "prompt") for p in self.prompts),
            negative_prompts=tuple(_text(p, "negative prompt") for p in self.negative_prompts),
            seeds=tuple(integer(s, "seed", 0, MAX_SEED) for s in self.seeds),
            image_index=tuple(integer(i, "image index", 0, MAX_SEED) for i in self.image_index),
            guidance_scales=tuple(guidance_scale(g) for g in self.guidance_scales),
            steps=integer(self.steps, "steps", 1, max_steps),
            sampler=sampler,
            loras=None if self.loras is None else _active(self.loras),
            **sizes,
        )


def _active(loras) -> tuple[tuple[str, float], ...]:
    """LoRA settings checked and in one form: sorted, and without those at scale 0 (which do nothing),
    so that equal settings give equal batch keys."""
    checked = ((source, number(scale, f"LoRA scale of {source}", *LORA_SCALE_RANGE)) for source, scale in loras)
    return tuple(sorted((source, scale) for source, scale in checked if scale))


_PER_IMAGE = ("prompts", "negative_prompts", "seeds", "image_index", "guidance_scales")
