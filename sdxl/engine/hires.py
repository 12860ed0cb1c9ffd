"""Hires fix: a text-to-image pass, upscaled, then a second, image-to-image pass at the bigger size,
as AUTOMATIC1111's webui (1.10) runs it (modules/processing.py: `StableDiffusionProcessingTxt2Img`'s
`calculate_target_resolution`, `sample` and `sample_hr_pass`).

- The target size: the first pass's times `scale`, or a `resize` to a width and/or height (the
  other side kept in proportion; both: the picture covers them and the overflow is cropped).
- The upscale: a latent upscaler ("Latent", "Latent (bicubic)", ...: `latent_upscale`) resizes the
  first pass's latents on the devices; an image upscaler ("None" and "Lanczos" as PIL's Lanczos,
  "Nearest", or a model upscaler the pipeline has loaded) resizes its decoded pictures on the host
  (`upscaled_pictures`, as webui's `images.resize_image`), which the second pass encodes again.
- The second pass: A1111's image-to-image step setup with the hires steps given
  (`sd_samplers_common.setup_img2img_steps`): a schedule of int(steps / strength) steps whose last
  `steps` run (`second_pass_steps`), from the upscaled latents noised to the first of them with a
  fresh draw of each image's noise at the new size; SDXL's size conditioning at the new size. Its
  sampler, schedule type, guidance scale and prompts are the first pass's unless given.

Where the second pass differs from webui: webui encodes an image upscaler's pictures by sampling the
VAE's posterior with torch's global generator (a draw no infotext records); here the posterior's
mean is taken, as everywhere in this package. A target whose latents are not a multiple of the UNet's
downsampling (SDXL's: 32 pixels) is rounded down to one, as this UNet needs (webui runs them), and
an image upscaler resizes to the latents' size (webui: to the pixel size, encoded to its eighth).
"""

import dataclasses
from collections.abc import Mapping

import numpy as np
from PIL import Image

from ..sampling import samplers
from ..sampling.methods import DIFFUSERS, ON_A1111_SCHEDULES, ON_DIFFUSERS_SCHEDULE, sampler_name, schedule_type_for
from .checks import integer, number
from .latent_upscale import LATENT_UPSCALERS

# webui's image upscalers that need no model: "None" resizes with Lanczos as well.
IMAGE_UPSCALERS = ("None", "Lanczos", "Nearest")
DEFAULT_UPSCALER = "Latent"  # webui's default ("latent_upscale_default_mode")
DEFAULT_STRENGTH = 0.7  # webui's "Denoising strength" default for the hires pass
SCALE_RANGE = (1.0, 4.0)
# webui's image upscalers apply a model up to this many times to reach the target (`Upscaler.upscale`).
_MODEL_PASSES = 3
# webui's image-to-image never starts at pure noise's level: a strength above this counts as this.
_MAX_STRENGTH = 0.999


@dataclasses.dataclass(frozen=True)
class Hires:
    """A request's hires fix: how to upscale its first pass, and how the second pass runs.

    A field left None is the first pass's (webui's "Use same sampler", ...).
    """

    scale: float = 2.0  # the upscale factor ("Hires upscale"), unless `resize_width` or `resize_height` is given
    resize_width: int = 0  # "Hires resize": a target width and/or height; 0: from the other side
    resize_height: int = 0
    upscaler: str = DEFAULT_UPSCALER  # a latent or image upscaler, or a loaded model upscaler's name
    steps: int = 0  # the second pass's steps ("Hires steps"); 0: the first pass's
    strength: float = DEFAULT_STRENGTH  # its denoising strength ("Denoising strength")
    sampler: str | None = None
    schedule_type: str | None = None
    guidance_scale: float | None = None
    prompt: str | None = None
    negative_prompt: str | None = None

    @property
    def by_scale(self) -> bool:
        """Whether the target is the scale's ("Hires upscale"), not a size's ("Hires resize")."""
        return not (self.resize_width or self.resize_height)

    @property
    def in_latents(self) -> bool:
        """Whether the upscaler resizes latents (on the devices), not decoded pictures (on the host)."""
        return self.upscaler in LATENT_UPSCALERS

    def upscaled_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the first pass's picture is upscaled to, before any crop (webui's
        `hr_upscale_to_y`, `hr_upscale_to_x`)."""
        if self.by_scale:
            return int(height * self.scale), int(width * self.scale)
        if not self.resize_height:
            return self.resize_width * height // width, self.resize_width
        if not self.resize_width:
            return self.resize_height, self.resize_height * width // height
        if width / height < self.resize_width / self.resize_height:  # wider target: fit the width, crop the height
            return self.resize_width * height // width, self.resize_width
        return self.resize_height, self.resize_height * width // height

    def crop(self, height: int, width: int, spec) -> tuple[int, int]:
        """The latent rows and columns a "Hires resize" to both sides crops from the upscaled latents
        (webui's `truncate_y`, `truncate_x`): half at the top (left), the rest at the bottom (right)."""
        if not (self.resize_width and self.resize_height):
            return 0, 0
        f = spec.vae.downscale_factor
        up_height, up_width = self.upscaled_size(height, width)
        return (up_height - self.resize_height) // f, (up_width - self.resize_width) // f

    def upscaled_latent_size(self, height: int, width: int, spec) -> tuple[int, int]:
        """(h, w) the first pass's latents are upscaled to: the upscaled size's (webui's `size // 8`),
        less what would leave the cropped size off a multiple of the UNet's downsampling (webui runs
        such sizes; this UNet does not)."""
        f = spec.vae.downscale_factor
        multiple = spec.latent_factor // f
        up_height, up_width = self.upscaled_size(height, width)
        rows, columns = self.crop(height, width, spec)
        return (up_height // f - (up_height // f - rows) % multiple,
                up_width // f - (up_width // f - columns) % multiple)

    def size(self, height: int, width: int, spec) -> tuple[int, int]:
        """(height, width) of the second pass: the upscaled latents', less the crop."""
        f = spec.vae.downscale_factor
        latent_height, latent_width = self.upscaled_latent_size(height, width, spec)
        rows, columns = self.crop(height, width, spec)
        return (latent_height - rows) * f, (latent_width - columns) * f

    def second_pass_steps(self, first_pass_steps: int) -> tuple[int, int]:
        """(schedule steps, first step that runs) of the second pass, as webui's `setup_img2img_steps`
        with the steps given: the `steps` (else the first pass's) last of int(steps / strength)."""
        steps = self.steps or first_pass_steps
        total = int(steps / min(self.strength, _MAX_STRENGTH))
        return total, total - steps

    def validated(self, first_pass: dict, spec, max_steps: int, upscalers: tuple[str, ...]) -> "Hires":
        """This hires fix with its sizes, upscaler, steps, strength, sampler and schedule type checked
        (`Request.validated` checks its prompts and guidance scale), its sampler and schedule type
        resolved from `first_pass` (the validated request's height, width, steps, sampler,
        schedule_type) where None, against the model's latent `factor`, the most steps a schedule
        holds, and the loaded model upscalers' names.

        Raises:
          ValueError: one sentence naming the first bad value and what is allowed.
        """
        known = (*LATENT_UPSCALERS, *IMAGE_UPSCALERS, *upscalers)
        if self.upscaler not in known:
            raise ValueError(f"hires upscaler must be one of {', '.join(known)}, got {self.upscaler!r}")
        scale = number(self.scale, "hires scale", *SCALE_RANGE)
        resize_width, resize_height = (integer(getattr(self, f"resize_{side}"), f"hires resize {side}", 0, 4096)
                                       for side in ("width", "height"))
        strength = number(self.strength, "hires denoising strength", 0.0, 1.0)
        if strength == 0:
            raise ValueError("a hires denoising strength of 0 runs no step: give one above 0 (0.3 to 0.7 is usual)")
        sampler = first_pass["sampler"] if self.sampler is None else sampler_name(self.sampler)
        schedule_type = self.schedule_type
        if schedule_type is None and self.sampler is not None:  # the first pass's type where it runs on it
            fits = ON_DIFFUSERS_SCHEDULE if first_pass["schedule_type"] == DIFFUSERS else ON_A1111_SCHEDULES
            schedule_type = first_pass["schedule_type"] if sampler in fits else None
        elif schedule_type is None:
            schedule_type = first_pass["schedule_type"]
        checked = dataclasses.replace(
            self, scale=scale, resize_width=resize_width, resize_height=resize_height, strength=strength,
            steps=integer(self.steps, "hires steps", 0, max_steps), sampler=sampler,
            schedule_type=schedule_type_for(sampler, schedule_type),
        )
        height, width = first_pass["height"], first_pass["width"]
        target_height, target_width = checked.size(height, width, spec)
        if min(target_height, target_width) < spec.latent_factor or max(target_height, target_width) > 4096:
            raise ValueError(f"the hires target {target_width}x{target_height} (width x height) is out of range: "
                             f"from {spec.latent_factor} to 4096 a side")
        if (target_height, target_width) == (height, width):
            raise ValueError("the hires target is the first pass's size: give a scale above 1 or a bigger size")
        total, first = checked.second_pass_steps(first_pass["steps"])
        if total > max_steps:
            raise ValueError(f"hires steps {total - first} at denoising strength {strength:g} make a schedule of "
                             f"{total} steps, more than the {max_steps} allowed: give fewer steps or more strength")
        if first and sampler in samplers.WHOLE_SCHEDULE_ONLY:
            raise ValueError(f"the {sampler} sampler runs whole schedules only; choose another hires sampler")
        return checked


def upscaled_pictures(pictures: np.ndarray, height: int, width: int, upscaler: str, models: Mapping) -> np.ndarray:
    """[N, h, w, 3] uint8 pictures resized to [N, height, width, 3] by an image upscaler, as webui's
    `images.resize_image` (mode "Just resize") with that upscaler: "None" is one Lanczos resize; the
    others upscale by their factor (a model's own, applied up to 3 times) until the picture covers
    the target, which Lanczos resizes reach then.

    Args:
      models: the loaded model upscalers by name: objects with `scale` and `upscale(uint8 [h, w, 3],
        output_type="np") -> float32 [sh, sw, 3]` (`sdxl.engine.upscaler.Upscaler`).
    """
    return np.stack([np.asarray(_resized(Image.fromarray(p), width, height, upscaler, models)) for p in pictures])


def _resized(image: Image.Image, width: int, height: int, upscaler: str, models: Mapping) -> Image.Image:
    if upscaler == "None":
        return image.resize((width, height), resample=Image.LANCZOS)
    scale = max(width / image.width, height / image.height)
    if scale > 1:
        image = _upscaled(image, scale, upscaler, models)
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.LANCZOS)
    return image


def _upscaled(image: Image.Image, scale: float, upscaler: str, models: Mapping) -> Image.Image:
    """webui's `Upscaler.upscale`: passes of the upscaler until the picture covers scale times its
    size rounded down to 8 (or stops growing), then a Lanczos resize to exactly that."""
    target = (int(image.width * scale // 8 * 8), int(image.height * scale // 8 * 8))
    for _ in range(_MODEL_PASSES):
        if image.width >= target[0] and image.height >= target[1]:
            break
        size = image.size
        image = _one_pass(image, scale, upscaler, models)
        if image.size == size:
            break
    if image.size != target:
        image = image.resize(target, resample=Image.LANCZOS)
    return image


def _one_pass(image: Image.Image, scale: float, upscaler: str, models: Mapping) -> Image.Image:
    if upscaler in ("Lanczos", "Nearest"):
        resample = Image.LANCZOS if upscaler == "Lanczos" else Image.NEAREST
        return image.resize((int(image.width * scale), int(image.height * scale)), resample=resample)
    upscaled = models[upscaler].upscale(np.asarray(image), output_type="np")
    return Image.fromarray(np.round(np.clip(upscaled, 0, 1) * 255).astype(np.uint8))
