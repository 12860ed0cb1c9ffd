"""`Pipeline.generate`: one prompt's images in diffusers' terms, for people who come from its pipelines.

It builds a `Request` from diffusers' arguments (text-to-image, image-to-image, inpainting, the
SDXL refiner's two uses) and renders it; everything else about a request is `Pipeline.render`'s.
"""

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from . import conditionings, images
from .controls import CONTROLS, Control, default_control_scale
from .hires import Hires
from .image_prompts import IMAGE_PROMPTS, ImagePrompt
from .loading import ip_adapter_scales
from .preparing import prepare
from .request import DEFAULT_AESTHETIC_SCORES, DEFAULT_GUIDANCE_SCALE, DEFAULT_STEPS, Request, default_strength


def generate(
    pipe,
    prompt: str | Sequence[str],
    negative_prompt: str | Sequence[str] = "",
    *,
    seed: int = 0,
    steps: int = DEFAULT_STEPS,
    guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
    guidance_rescale: float = 0.0,
    height: int | None = None,
    width: int | None = None,
    num_images: int | None = None,
    sampler: str | None = None,
    schedule_type: str | None = None,
    noise_source: str = "jax",
    batch_noise: bool = False,
    variation_seed: int = 0,
    variation_strength: float = 0.0,
    ensd: int = 0,
    latents: np.ndarray | None = None,
    image=None,
    mask_image=None,
    strength: float | None = None,
    denoising_start: float | None = None,
    denoising_end: float | None = None,
    aesthetic_score: float = DEFAULT_AESTHETIC_SCORES[0],
    negative_aesthetic_score: float = DEFAULT_AESTHETIC_SCORES[1],
    refine_from: float | None = None,
    emphasis: str = "original",
    clip_skip: int = 1,
    sdxl_clip_l_skip: bool = False,
    padding_mask_crop: int | None = None,
    control_image=None,
    controlnet_conditioning_scale: float | Sequence[float] | None = None,
    control_guidance_start: float | Sequence[float] = 0.0,
    control_guidance_end: float | Sequence[float] = 1.0,
    control_mode: int | str | Sequence | None = None,
    hires: Hires | None = None,
    ip_adapter_image=None,
    ip_adapter_scale=None,
    output_type: str = "pil",
):
    """Images (seed, 0), (seed, 1), ...: image i depends only on (seed, i), whatever the device count.

    As diffusers' StableDiffusion[XL]Pipeline, with `image` its Img2ImgPipeline, with `image` and
    `mask_image` its InpaintPipeline (an inpainting UNet, or any other, which keeps the unmasked
    region after every step). Where the arguments differ from diffusers':

    Args:
      prompt, negative_prompt: a string for every image, or a list with one per image, read as webui
        reads them (`sdxl.prompts.syntax`): (weights:1.2), BREAK, up to 8 chunks of 75 tokens, prompt
        editing [from:to:when] and alternation [a|b] (`sdxl.prompts.editing`), and in the prompt
        `<lora:NAME:SCALE>` tags naming LoRAs given to `set_loras`. An empty negative prompt
        is none: SDXL's conditioning is then zeros (force_zeros_for_empty_prompt).
      guidance_rescale: as diffusers', Lin et al.'s CFG rescale: the guided prediction's standard
        deviation pulled this fraction of the way to the conditional one's (0.7 with zero-terminal-SNR
        models, as their authors suggest; 0: none).
      num_images: default the prompt or image list's length, else one image per device.
      sampler: a sampler by its name or label (`sampling.methods.SAMPLER_NAMES`: "euler", "DPM++ 2M
        SDE"); default the one that reproduces the checkpoint's scheduler.
      schedule_type: "diffusers" (the checkpoint scheduler's timesteps, as diffusers' pipelines
        step), or one of A1111's ("Automatic", "Karras", "Exponential", ...: `sampling.methods.SCHEDULE_TYPES`),
        on which the sampler runs as A1111's k-diffusion samplers do, from text only; default
        "diffusers" for the samplers diffusers has, "Automatic" for the others.
      noise_source: "jax" (JAX's PRNG, made on the devices), or torch's noise as the tools people
        compare with draw it (`sdxl.sampling.noise`): "nv", A1111's NV source, which is torch.randn on
        CUDA, or "cpu", torch.randn on the CPU. With either, image i is A1111's image of seed + i,
        from its own generator.
      batch_noise: with "nv" or "cpu", one generator draws the whole batch's noise, as diffusers
        called with `generator=torch.Generator(...).manual_seed(seed)` and ComfyUI draw it.
      variation_seed, variation_strength, ensd: A1111's variation seed and strength, and its eta
        noise seed delta, with "nv" or "cpu".
      latents: [N, C, h, w] noise in diffusers' layout, replacing the seeded noise.
      image: a PIL image or [H, W, 3] array (uint8, or floats in [0, 1]), or one per image, at a size
        the model renders; or the latents a base model returned (`output_type="latent"`), which
        `denoising_start` continues.
      strength: default as diffusers': image-to-image 0.3 for SDXL and 0.8 for SD 1.x/2.x,
        inpainting 0.9999 and 1.
      refine_from: finish with the refiner (`Pipeline.set_refiner`) from this fraction of the noise:
        diffusers' two handoff calls as one.
      emphasis: how weights apply: "original" (webui's default, each chunk keeps its mean), "no-norm",
        or "none" (brackets read as text).
      clip_skip: webui's "Clip skip", 1 to 12: SD 1.x's text encoder gives the hidden state this many
        layers back from its last, through the final layer norm. SD 2.x and SDXL ignore it, as webui
        does, unless `sdxl_clip_l_skip` (webui's setting): SDXL's CLIP-L then gives that state, unnormed.
      control_image: with ControlNets loaded (`Pipeline.from_pretrained(controlnet=...)`), the image that
        steers them (as the `control_image` of diffusers' ControlNet img2img and inpainting pipelines,
        the `image` of its text-to-image one): for one ControlNet an image or one per image, for
        several a list with one such entry per ControlNet. Resized to the output with Lanczos, as
        diffusers resizes; by default the output has its size (rounded down to a size the model renders).
      controlnet_conditioning_scale, control_guidance_start, control_guidance_end: as diffusers', a
        number for every ControlNet or a list with one per ControlNet. The scale defaults as diffusers'
        pipelines do: 1 from text, 0.8 for image-to-image, for inpainting 1 (SDXL) or 0.5 (SD 1.x/2.x).
      control_mode: what a ControlNet Union's control image is (required for one; plain ControlNets
        ignore it): a mode of `sdxl.models.controlnet_union.CONTROL_MODES`, its number or a name (3 or
        "canny"), for every ControlNet, or a list with one per ControlNet (diffusers' `[3]` for one
        Union). One mode per Union: several conditions to one Union at once are not supported.
      hires: a hires fix (`sdxl.engine.hires.Hires`): the images upscaled and rendered again at the
        bigger size, as A1111's txt2img does; the output is at that size.
      ip_adapter_image: with IP-Adapters loaded (`Pipeline.load_ip_adapter`), the picture each takes
        as a prompt (a PIL image or an [H, W, 3] array, any size): for one adapter a picture for every
        image or a list of one per image (diffusers gives every image all of a list's pictures), for
        several a list with one such entry per adapter. None: the adapters sit this call out.
      ip_adapter_scale: the adapters' scales for this call, in `Pipeline.set_ip_adapter_scale`'s forms;
        default the ones set there.
      output_type: "pil", "np" (float32 [N, H, W, 3] in [0, 1]) or "latent" ([N, h, w, C] left on the devices).

    Raises:
      ValueError: an argument is out of range, in one sentence.
      NonFiniteImageError: the output holds NaN/inf.
    """
    if padding_mask_crop is not None:
        raise ValueError(
            "padding_mask_crop is not implemented: crop the image and the mask around the masked region "
            "(plus a margin) to a size the model renders, inpaint that, and paste the result back"
        )
    model = pipe.model  # one snapshot throughout, whatever another thread loads meanwhile
    start_latents = None
    if isinstance(image, jax.Array) and image.ndim == 4 and image.shape[-1] == model.spec.vae.latent_channels:
        start_latents, image = image, None
    image, mask_image = _per_image(image, images.pixels), _per_image(mask_image, images.mask)
    pictures = [_per_image(entry, images.pixels) for entry in _per_controlnet(control_image, len(model.controlnets))]
    if num_images is None:
        lists = [p for p in (prompt, negative_prompt) if not isinstance(p, str)]
        given = [len(a) for a in (latents, start_latents, image, *pictures) if a is not None and len(a) > 1]
        num_images = len(lists[0]) if lists else (given[0] if given else model.num_devices)
    image, mask_image = (_repeated(a, num_images) for a in (image, mask_image))
    size = _size_of(model.spec, image, start_latents) or _fitting(model.spec, pictures) or (model.spec.native_size,) * 2
    height, width = size[0] if height is None else height, size[1] if width is None else width
    if control_mode is not None and not pictures:
        raise ValueError("control_mode says what a ControlNet Union's control image is: give control_image too")
    if controlnet_conditioning_scale is None:
        controlnet_conditioning_scale = default_control_scale(
            model.spec, image=image is not None, inpainting=mask_image is not None)
    if strength is None:
        strength = default_strength(model.spec, inpainting=mask_image is not None)
    request = Request.from_prompt(
        prompt, negative_prompt, num_images=num_images, seed=seed, guidance_scale=guidance_scale, steps=steps,
        height=height, width=width, sampler=sampler,
        noise=None if latents is None else np.asarray(latents, np.float32).transpose(0, 2, 3, 1),
    )
    request = dataclasses.replace(
        request, schedule_type=schedule_type, noise_source=noise_source, batch_noise=batch_noise,
        variation_seed=variation_seed, variation_strength=variation_strength, ensd=ensd, images=image,
        masks=mask_image, strength=strength, denoising_start=denoising_start, denoising_end=denoising_end,
        start_latents=start_latents, aesthetic_scores=(aesthetic_score, negative_aesthetic_score),
        refine_from=refine_from, emphasis=emphasis, clip_skip=clip_skip, sdxl_clip_l_skip=sdxl_clip_l_skip,
        hires=hires, guidance_rescales=(guidance_rescale,) * num_images,
        controls=_controls(pictures, num_images, width, height, controlnet_conditioning_scale, control_guidance_start,
                           control_guidance_end, control_mode),
        image_prompts=_image_prompts(ip_adapter_image, num_images, ip_adapter_scales(model, ip_adapter_scale)),
    )
    result = pipe.render(prepare(model, request, output_type=output_type))
    result.raise_if_not_finite()
    return images.to_pil(result.images) if output_type == "pil" else result.images


def _controls(pictures: list[np.ndarray], n: int, width, height, scale, start, end, mode):
    """Each image's `Control`s (one per ControlNet) from diffusers' arguments: per ControlNet one
    picture for every image or one per image, resized to the output as diffusers resizes them."""
    if not pictures:
        return None
    k = len(pictures)
    settings = zip(_numbers(scale, k, "controlnet_conditioning_scale"), _numbers(start, k, "control_guidance_start"),
                   _numbers(end, k, "control_guidance_end"), (None,) * k if mode is None else _modes(mode, k))
    columns = [[Control.of(picture, width, height, fit="resize", scale=scale, start=start, end=end, mode=mode)
                for picture in stack] for stack, (scale, start, end, mode) in zip(pictures, settings)]
    return conditionings.per_image(CONTROLS, columns, n, "control_image")


def _image_prompts(pictures, n: int, scales: tuple) -> tuple | None:
    """Each image's `ImagePrompt`s (one per IP-Adapter, `scales` theirs) from the argument's `pictures`.

    Raises:
      ValueError: a picture without adapters, or another count of pictures.
    """
    if pictures is None:
        return None
    if not scales:
        raise ValueError("ip_adapter_image needs an IP-Adapter: load one with pipe.load_ip_adapter(...)")
    entries = conditionings.per_unit(IMAGE_PROMPTS, pictures, len(scales), "ip_adapter_image")
    columns = [[ImagePrompt.of(picture, scale) for picture in (entry if isinstance(entry, list | tuple) else [entry])]
               for entry, scale in zip(entries, scales)]
    return conditionings.per_image(IMAGE_PROMPTS, columns, n, "ip_adapter_image")


def _size_of(spec, image: np.ndarray | None, start_latents) -> tuple[int, int] | None:
    """(height, width) of the images to start from, if any. Raises ValueError for a size the model cannot render."""
    if start_latents is not None:
        return tuple(d * spec.vae.downscale_factor for d in start_latents.shape[1:3])
    if image is None:
        return None
    size, f = image.shape[1:3], spec.latent_factor
    if size[0] % f or size[1] % f:
        fitting = f"{max(f, size[1] // f * f)}x{max(f, size[0] // f * f)}"
        raise ValueError(
            f"the image is {size[1]}x{size[0]} (width x height); this model renders sizes in multiples of {f}: "
            f"crop or resize it, to {fitting} for example"
        )
    return size


def _per_controlnet(control_image, k: int) -> list:
    """One entry (an image, or a list of them) per ControlNet, from diffusers' `control_image`.

    Raises:
      ValueError: a control image without ControlNets, ControlNets without one, or another count.
    """
    if control_image is None:
        if k:
            raise ValueError(f"this pipeline has {k} ControlNet(s): give a control image (control_image=)")
        return []
    if not k:
        raise ValueError("control_image needs a ControlNet: load one with Pipeline.from_pretrained(controlnet=...)")
    return conditionings.per_unit(CONTROLS, control_image, k, "control_image")


def _numbers(value, k: int, label: str) -> tuple[float, ...]:
    """A number for each of `k` ControlNets, from one number or a list of `k`."""
    values = list(value) if isinstance(value, list | tuple) else [value] * k
    if len(values) != k:
        raise ValueError(f"{label}: give one number, or a list of one per ControlNet ({k}), got {len(values)}")
    return tuple(values)


def _modes(value, k: int) -> tuple:
    """A control mode for each of `k` ControlNets, from one mode or a list of `k` (each may be diffusers'
    one-element list). Raises ValueError for several modes to one ControlNet."""
    values = list(value) if isinstance(value, list | tuple) else [value] * k
    if k == 1 and len(values) > 1 or any(isinstance(v, list | tuple) and len(v) != 1 for v in values):
        raise ValueError(
            "control_mode: one mode per ControlNet; several conditions to one ControlNet Union at once (a multi-hot "
            "control type) are not supported, but the same Union loaded twice takes one condition each"
        )
    if len(values) != k:
        raise ValueError(f"control_mode: give one mode, or a list of one per ControlNet ({k}), got {len(values)}")
    return tuple(v[0] if isinstance(v, list | tuple) else v for v in values)


def _fitting(spec, pictures: list[np.ndarray]) -> tuple[int, int] | None:
    """The first control image's size, rounded down to a size the model renders."""
    if not pictures:
        return None
    f = spec.latent_factor
    return tuple(max(f, d // f * f) for d in pictures[0].shape[1:3])


def _repeated(stack: np.ndarray | None, n: int) -> np.ndarray | None:
    """One image or mask for all `n` images: [1, ...] repeated to [n, ...]."""
    return stack if stack is None or len(stack) != 1 else np.repeat(stack, n, axis=0)


def _per_image(given, read) -> np.ndarray | None:
    """An image or mask for every image ([1, ...]) or a list or stack of them ([N, ...]), each read by `read`."""
    if given is None:
        return None
    if isinstance(given, list | tuple) or (isinstance(given, np.ndarray) and given.ndim == 4):
        return np.stack([read(item) for item in given])
    return read(given)[None]
