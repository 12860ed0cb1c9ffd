"""Command line: `python -m sdxl generate|bench|write-checkpoint|train-shapes ...`."""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from . import bench, training
from .checkpoints import CheckpointError, random_models
from .engine import conditionings, control_maps, images, infotext, memory
from .engine.checks import integer, number
from .engine.control_maps import DEFAULT_CANNY_THRESHOLDS
from .engine.controls import CONTROLS, Control, default_control_scale
from .engine.hires import DEFAULT_STRENGTH, DEFAULT_UPSCALER, IMAGE_UPSCALERS, Hires
from .engine.image_prompts import (
    IMAGE_PROMPTS, IP_ADAPTER_SCALE, IP_ADAPTER_SCALE_RANGE, SCALE_PRESETS, ImagePrompt, preset_scale,
)
from .engine.images import contact_sheet, image_count, save_png, to_pil
from .engine.latent_upscale import LATENT_UPSCALERS
from .engine.pipeline import NonFiniteImageError
from .engine.request import (
    CLIP_SKIP_RANGE, DEFAULT_GUIDANCE_SCALE, DEFAULT_REFINE_FROM, DEFAULT_STEPS, MAX_SEED, MAX_SIZE, Request,
    default_strength, guidance_rescale, guidance_scale, required_prompt,
)
from .models.controlnet_union import control_mode, describe_modes
from .sampling.noise import NOISE_SOURCES
from .sampling.methods import SAMPLER_NAMES, SCHEDULE_TYPES, schedule_type_for
from .serving import launch
from .serving.options import add_shared_options, split_scale


def generate_command(args: argparse.Namespace) -> None:
    _check_before_loading(args)
    picture = None if args.image is None else images.pixels(images.read_image(args.image))
    mask = None if args.mask is None else images.mask(images.read_image(args.mask))
    start = time.perf_counter()
    model = launch.load(args, max_steps=_max_steps(args))
    pipe = model.pipe
    print(f"loaded {model.label} in {time.perf_counter() - start:.1f} s ({launch.dtypes_label(pipe)}, "
          f"{pipe.device_description}; {pipe.spec.sampling})")
    settings = model.settings
    steps = settings.steps if args.steps is None else args.steps
    guidance = settings.guidance_scale if args.guidance_scale is None else args.guidance_scale
    if settings.note:
        print(f"{settings.note}: {steps} step(s), guidance {guidance:g} unless given")
    if pipe.refiner is not None:
        print(f"loaded the refiner {args.refiner}; it takes over at {args.refine_from:g} of the noise")
    if model.loras:
        print(f"applied {len(model.loras)} LoRA(s)")
    if pipe.prompts.embeddings:
        print(f"loaded the embedding(s) {', '.join(e.name for e in pipe.prompts.embeddings)}")

    num_images = pipe.num_devices if args.num_images is None else args.num_images
    size = (pipe.spec.native_size,) * 2 if picture is None else picture.shape[:2]
    request = Request.from_prompt(
        args.prompt, args.negative_prompt, num_images=num_images, seed=args.seed, guidance_scale=guidance,
        steps=steps, height=args.height or size[0], width=args.width or size[1], sampler=args.sampler,
    )
    request = dataclasses.replace(
        request, loras=tuple(model.loras.items()), refine_from=args.refine_from if pipe.refiner else None,
        emphasis=args.emphasis, schedule_type=args.schedule_type, clip_skip=args.clip_skip,
        sdxl_clip_l_skip=args.sdxl_clip_l_skip, guidance_rescales=(args.guidance_rescale,) * num_images,
        **_noise_arguments(args),
    )
    if picture is not None:
        strength = default_strength(pipe.spec, inpainting=mask is not None) if args.strength is None else args.strength
        request = dataclasses.replace(
            request, images=np.repeat(picture[None], num_images, axis=0),
            masks=None if mask is None else np.repeat(mask[None], num_images, axis=0), strength=strength,
        )
    if args.control_image:
        request = dataclasses.replace(request, controls=_controls(args, pipe, request))
    if args.ip_adapter_image:
        request = dataclasses.replace(request, image_prompts=_image_prompts(args, pipe, request))
    request = dataclasses.replace(request, hires=_hires(args))
    prepared = pipe.prepare(request)
    request, devices = prepared.request, pipe.num_devices
    memory.check_fits(pipe, lambda n: prepared.programs_at(pipe.padded_batch(n * devices)),
                      pipe.padded_batch(num_images) // devices,
                      lambda n: f"--num-images {n * devices} ({n} per device on {devices})", progress=False)
    compile_seconds = pipe.compile(prepared.programs)
    size = f"{request.width}x{request.height}"
    if prepared.hires is not None:
        size += f" and {prepared.hires.request.width}x{prepared.hires.request.height} (hires fix)"
    print(f"compiled for {size}, batch {num_images}, in {compile_seconds:.1f} s")
    result = pipe.render(prepared)
    result.raise_if_not_finite()
    print(f"generated {image_count(num_images)} in {result.seconds:.2f} s")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pictures = to_pil(result.images)
    for i, image in enumerate(pictures):
        parameters = infotext.png_parameters(prepared.model, request, i, model.label)
        print(save_png(image, out / f"{args.seed}-{i}.png", parameters))
    contact_sheet(pictures).save(out / f"{args.seed}-grid.png")
    print(out / f"{args.seed}-grid.png")


def _max_steps(args: argparse.Namespace) -> int:
    """The longest schedule the pipeline pads to: 100 steps, or more where --steps asks for more."""
    return max(100, args.steps or 0)


def _check_before_loading(args: argparse.Namespace) -> None:
    """Refuses the values that can be checked without the model before it loads (seconds, not
    minutes), with `Request.validated`'s sentences; the rest (sizes against the model's latent
    factor, images against the request) are checked once it has.

    Raises:
      ValueError: the first bad value, in one sentence.
    """
    required_prompt(args.prompt)
    launch.embedding_files(args.embedding)
    if args.steps is not None:
        integer(args.steps, "steps", 1, _max_steps(args))
    integer(args.seed, "seed", 0, MAX_SEED)
    integer(args.clip_skip, "clip skip", *CLIP_SKIP_RANGE)
    if args.guidance_scale is not None:
        guidance_scale(args.guidance_scale)
    guidance_rescale(args.guidance_rescale)
    for label in ("height", "width"):
        if getattr(args, label) is not None:
            integer(getattr(args, label), label, 1, MAX_SIZE)
    if args.num_images is not None and args.num_images < 1:
        raise ValueError(f"--num-images must be at least 1, got {args.num_images}")
    if args.strength is not None:
        number(args.strength, "strength", 0.0, 1.0)
    if args.refiner and not 0 < args.refine_from < 1:
        raise ValueError(f"--refine-from must be a fraction above 0 and below 1, got {args.refine_from:g}")
    number(args.control_start, "--control-start", 0.0, 1.0)
    number(args.control_end, "--control-end", 0.0, 1.0)
    if args.canny is not None:
        control_maps.parse_thresholds(args.canny)
    for mode in args.control_mode:
        control_mode(mode)
    for option in args.ip_adapter_image:
        scale = split_scale(option)[1]
        if scale is not None:
            number(scale, "--ip-adapter-image's scale", *IP_ADAPTER_SCALE_RANGE)
    if args.mask is not None and args.image is None:
        raise ValueError("--mask needs --image, the image to inpaint")
    unsized = Request.from_prompt("", num_images=1, height=1, width=1)
    dataclasses.replace(unsized, **_noise_arguments(args)).checked_noise()
    if args.sampler is not None:
        schedule_type_for(args.sampler, args.schedule_type)
    if _hires(args) is not None and args.image is not None:
        raise ValueError("a hires fix follows a text-to-image pass: leave out --image or the --hires options")


def _hires(args: argparse.Namespace) -> Hires | None:
    """The hires fix that --hires-scale or --hires-resize asks for, with the other --hires-* options."""
    if args.hires_scale is None and args.hires_resize is None:
        return None
    width, height = (0, 0) if args.hires_resize is None else _resize(args.hires_resize)
    return Hires(
        scale=args.hires_scale or 1.0, resize_width=width, resize_height=height, upscaler=args.hires_upscaler,
        steps=args.hires_steps, strength=args.hires_strength, sampler=args.hires_sampler,
        schedule_type=args.hires_schedule_type, guidance_scale=args.hires_guidance_scale, prompt=args.hires_prompt,
        negative_prompt=args.hires_negative_prompt,
    )


def _resize(text: str) -> tuple[int, int]:
    """--hires-resize WIDTHxHEIGHT (0 for a side kept in proportion) as (width, height). Raises ValueError."""
    try:
        width, height = (int(side) for side in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--hires-resize must be WIDTHxHEIGHT, 0 for a side kept in proportion (1920x0), "
                         f"got {text!r}") from None
    return width, height


def _noise_arguments(args: argparse.Namespace) -> dict:
    """The request's noise settings, from --noise-source and A1111's seed options."""
    return dict(noise_source=args.noise_source, batch_noise=args.batch_noise, variation_seed=args.variation_seed,
                variation_strength=args.variation_strength, ensd=args.ensd)


def _controls(args: argparse.Namespace, pipe, request: Request) -> tuple:
    """Each image's controls from --control-image FILE[:SCALE] (one per ControlNet), --canny,
    --control-start, --control-end and --control-mode: each picture fitted to the request's size as
    the demo fits it, then made a map there."""
    if args.control_mode and len(args.control_mode) != len(args.control_image):
        raise ValueError(f"give one --control-mode per --control-image ({len(args.control_image)}), "
                         f"got {len(args.control_mode)}")
    preprocessor, thresholds = ("none", DEFAULT_CANNY_THRESHOLDS) if args.canny is None else (
        "canny", control_maps.parse_thresholds(args.canny))
    default_scale = default_control_scale(pipe.spec, image=request.images is not None,
                                          inpainting=request.masks is not None)
    modes = args.control_mode or [None] * len(args.control_image)
    controls = []
    for option, mode in zip(args.control_image, modes):
        path, scale = split_scale(option)
        controls.append(Control.of(
            images.read_image(path), request.width, request.height, preprocessor=preprocessor,
            canny_thresholds=thresholds, scale=default_scale if scale is None else scale, start=args.control_start,
            end=args.control_end, mode=mode,
        ))
    return conditionings.per_image(CONTROLS, controls, len(request), "--control-image")


def _image_prompts(args: argparse.Namespace, pipe, request: Request) -> tuple:
    """Each image's image prompts from --ip-adapter-image FILE[:SCALE] (one per IP-Adapter, or one for
    all) on the layers --ip-adapter-layers names."""
    given, k = args.ip_adapter_image, len(pipe.ip_adapters)
    if k and len(given) not in (1, k):
        raise ValueError(f"give one --ip-adapter-image per --ip-adapter ({k}), or one for all; got {len(given)}")
    prompts = []
    for option in given * (k if len(given) == 1 else 1):
        path, scale = split_scale(option)
        scale = preset_scale(pipe.spec.unet, args.ip_adapter_layers, IP_ADAPTER_SCALE if scale is None else scale)
        prompts.append(ImagePrompt.of(images.read_image(path), scale))
    return conditionings.per_image(IMAGE_PROMPTS, prompts, len(request), "--ip-adapter-image")


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_shared_options(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--negative-prompt", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--steps", type=int, help="default: the model's recommended count (e.g. 4 for an SDXL-Lightning 4-step "
        f"UNet, 1 for SDXL-Turbo), else {DEFAULT_STEPS}",
    )
    parser.add_argument(
        "--guidance-scale", "--guidance", type=float,
        help="default: the model's recommended value (2.5 for shapes, 0 for SDXL-Turbo and SDXL-Lightning), else "
        f"{DEFAULT_GUIDANCE_SCALE:g} (SDXL's)",
    )
    parser.add_argument("--guidance-rescale", type=float, default=0.0,
                        help="Lin et al.'s CFG rescale, 0 to 1, as diffusers' guidance_rescale (0.7 for zero-terminal-"
                        "SNR models, as their authors suggest) (default: %(default)s)")
    parser.add_argument("--sampler", choices=list(SAMPLER_NAMES), help="default: the one of the checkpoint's scheduler")
    parser.add_argument(
        "--schedule-type", choices=SCHEDULE_TYPES, metavar="TYPE",
        help="diffusers (the checkpoint's scheduler, as diffusers steps), or one of A1111's, on which the sampler "
        "runs as A1111 and Forge run it (from text): " + ", ".join(SCHEDULE_TYPES[1:]) + "; default: diffusers for "
        "the samplers diffusers has, Automatic for the others",
    )
    parser.add_argument(
        "--noise-source", choices=NOISE_SOURCES, default="jax",
        help="where the noise comes from: jax (JAX's generator, on the devices; the default), or torch's as "
        "A1111, Forge, diffusers and ComfyUI draw it: nv (A1111's NV source, torch.randn on CUDA) or cpu "
        "(torch.randn on the CPU); image i is then A1111's image of seed + i",
    )
    parser.add_argument("--batch-noise", action="store_true",
                        help="with nv or cpu: one generator for all the images, as diffusers' generator= and ComfyUI")
    parser.add_argument("--variation-seed", type=int, default=0, help="A1111's variation seed (with nv or cpu)")
    parser.add_argument("--variation-strength", type=float, default=0.0,
                        help="A1111's variation seed strength, 0 to 1 (default: %(default)s)")
    parser.add_argument("--ensd", type=int, default=0,
                        help="A1111's eta noise seed delta: re-seeds the noise after the starting noise (e.g. 31337)")
    parser.add_argument("--clip-skip", type=int, default=1,
                        help="A1111's clip skip, 1 to 12: SD 1.x reads its text encoder this many layers from the "
                        "last; SD 2.x and SDXL ignore it, as A1111 (default: %(default)s)")
    parser.add_argument("--sdxl-clip-l-skip", action="store_true",
                        help="as A1111's setting 'Clip skip SDXL': SDXL's CLIP-L encoder skips as --clip-skip says")
    parser.add_argument(
        "--image", help="an image to start from (image-to-image; a PNG or JPEG whose size the model renders)"
    )
    parser.add_argument("--mask", help="with --image: inpaint where this image is white, keep where it is black")
    parser.add_argument(
        "--strength", type=float,
        help="with --image: how far it is noised, above 0 to 1 (default as diffusers: 0.3 SDXL, 0.8 SD 1.x; "
        "inpainting 0.9999, 1)",
    )
    parser.add_argument(
        "--refine-from", type=float, default=DEFAULT_REFINE_FROM,
        help="with --refiner: the fraction of the noise the base removes before the refiner takes over "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--control-image", action="append", default=[], metavar="FILE[:SCALE]",
        help="with --controlnet: the image that steers it, with its conditioning scale (default 1, 0.8 with --image); "
        "one per --controlnet, in the same order",
    )
    parser.add_argument("--control-start", type=float, default=0.0,
                        help="the fraction of the steps after which the ControlNets steer (default: %(default)s)")
    parser.add_argument("--control-end", type=float, default=1.0,
                        help="the fraction of the steps after which they stop (default: %(default)s)")
    parser.add_argument(
        "--control-mode", action="append", default=[], metavar="MODE",
        help="with a ControlNet Union (xinsir/controlnet-union-sdxl-1.0): what the control images are, one per "
        f"--controlnet in order (a plain ControlNet ignores its own): {describe_modes()} (a name or the number)",
    )
    parser.add_argument(
        "--canny", metavar="LOW,HIGH",
        help="make each control image Canny's edges of it, with these thresholds (e.g. 100,200); "
        "without it control images are used as given (edges, a depth map, a pose)",
    )
    parser.add_argument(
        "--ip-adapter-image", action="append", default=[], metavar="FILE[:SCALE]",
        help=f"with --ip-adapter: a picture the images take after (an image prompt), with its scale (default "
        f"{IP_ADAPTER_SCALE:g}); one per --ip-adapter in the same order, or one for all",
    )
    parser.add_argument(
        "--ip-adapter-layers", choices=list(SCALE_PRESETS), default="all",
        help="the layers the pictures steer: all, or InstantStyle's SDXL blocks that take the picture's style "
        "(style) and its layout too (style-and-layout) (default: %(default)s)",
    )
    parser.add_argument("--height", type=int, help="default: the image's size, else the model's native size")
    parser.add_argument("--width", type=int, help="default: the image's size, else the model's native size")
    parser.add_argument("--num-images", type=int, help="default: one per device")
    parser.add_argument("--out", default="out", help="output folder (default: %(default)s)")
    hires = parser.add_argument_group("hires fix", "render, upscale, and render again at the bigger size, as A1111")
    hires.add_argument("--hires-scale", type=float,
                       help="upscale by this factor (e.g. 1.5 or 2): turns the hires fix on")
    hires.add_argument("--hires-resize", metavar="WIDTHxHEIGHT",
                       help="or upscale to this size (0 for a side kept in proportion): turns it on too")
    hires.add_argument("--hires-upscaler", default=DEFAULT_UPSCALER,
                       help=f"{', '.join(LATENT_UPSCALERS + IMAGE_UPSCALERS)}, or a model loaded with --upscaler "
                       "(default: %(default)s)")
    hires.add_argument("--hires-steps", type=int, default=0, help="the second pass's steps (default: --steps)")
    hires.add_argument("--hires-strength", type=float, default=DEFAULT_STRENGTH,
                       help="its denoising strength, above 0 to 1 (default: %(default)s)")
    hires.add_argument("--hires-sampler", choices=list(SAMPLER_NAMES), help="default: --sampler")
    hires.add_argument("--hires-schedule-type", choices=list(SCHEDULE_TYPES), help="default: --schedule-type")
    hires.add_argument("--hires-guidance-scale", type=float, help="default: --guidance-scale")
    hires.add_argument("--hires-prompt", help="default: --prompt")
    hires.add_argument("--hires-negative-prompt", help="default: --negative-prompt")


def write_checkpoint_command(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if out.exists():
        raise ValueError(f"{out} already exists")
    start = time.perf_counter()
    configs = random_models.configs_of(args.config)
    if args.single_file:
        random_models.write_single_file(out, configs, dtype=args.dtype, seed=args.seed)
    else:
        random_models.write_checkpoint(out, configs, dtype=args.dtype, seed=args.seed)
    size = sum(f.stat().st_size for f in [out, *out.rglob("*.safetensors")] if f.suffix == ".safetensors")
    print(f"wrote {out} ({size / 2**30:.2f} GiB of {args.dtype} weights) in {time.perf_counter() - start:.0f} s")


def add_write_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default="sdxl-base-1.0", help="sdxl-base-1.0, medium, tiny or tiny-sd1 (default: %(default)s)"
    )
    parser.add_argument("--out", required=True, help="folder to write (must not exist yet)")
    parser.add_argument(
        "--single-file", action="store_true", help="write one .safetensors file in the original (SGM) layout instead"
    )
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)


COMMANDS = {  # name: (help, add its arguments, run it)
    "generate": ("render images for a prompt and save them as PNGs", add_generate_arguments, generate_command),
    "bench": ("measure generation speed, optionally beside diffusers", bench.add_arguments, bench.command),
    "write-checkpoint": (
        "write a random checkpoint (e.g. full-size SDXL) to benchmark",
        add_write_checkpoint_arguments,
        write_checkpoint_command,
    ),
    "train-shapes": ("train the built-in `shapes` model (sdxl/training.py)", training.add_arguments, training.command),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdxl", description="Stable Diffusion XL in JAX.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        command = commands.add_parser(name, help=help_text)
        add_arguments(command)
        command.set_defaults(run=run)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, CheckpointError, NonFiniteImageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
