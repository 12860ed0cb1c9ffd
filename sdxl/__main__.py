"""Command line: `python -m sdxl generate ...`, `python -m sdxl bench ...`, `python -m sdxl write-checkpoint ...`."""

import argparse
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "stabilityai/stable-diffusion-xl-base-1.0"


def _generate(args: argparse.Namespace) -> None:
    from .compilation import enable_compilation_cache
    from .images import grid, image_count, parameters_text, save_png, to_pil
    from .pipeline import Pipeline
    from .sampling import SAMPLER_NAMES

    enable_compilation_cache(args.cache_dir)
    start = time.perf_counter()
    pipe = Pipeline.from_pretrained(args.model, dtype=args.dtype, max_steps=max(100, args.steps))
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f} s ({pipe.dtype.name}, {pipe.device_description})")

    height = args.height or pipe.spec.native_size
    width = args.width or pipe.spec.native_size
    num_images = pipe.num_devices if args.num_images is None else args.num_images
    if num_images < 1:
        raise ValueError(f"--num-images must be at least 1, got {num_images}")
    pipe.validate(
        height=height, width=width, num_steps=args.steps, seed=args.seed, guidance_scale=args.guidance,
        sampler=args.sampler,
    )
    compile_seconds = pipe.warmup(height, width, num_images, args.sampler)
    print(f"compiled for {width}x{height}, batch {num_images}, in {compile_seconds:.1f} s")
    result = pipe.run(
        [args.prompt] * num_images,
        [args.negative_prompt] * num_images,
        [args.seed] * num_images,
        list(range(num_images)),
        [args.guidance] * num_images,
        steps=args.steps,
        height=height,
        width=width,
        sampler=args.sampler,
    )
    result.raise_if_not_finite()
    for prompt in result.truncated_prompts:
        print(f"warning: prompt truncated to {pipe.spec.max_tokens} tokens: {prompt!r}", file=sys.stderr)
    print(f"generated {image_count(num_images)} in {result.seconds:.2f} s")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    images = to_pil(result.images)
    for i, image in enumerate(images):
        text = parameters_text(
            prompt=args.prompt, negative_prompt=args.negative_prompt, steps=args.steps,
            sampler=SAMPLER_NAMES[args.sampler], guidance_scale=args.guidance, seed=args.seed, index=i,
            width=width, height=height, model=args.model,
        )
        print(save_png(image, out / f"{args.seed}-{i}.png", text))
    grid(images).save(out / f"{args.seed}-grid.png")
    print(out / f"{args.seed}-grid.png")


def main(argv: list[str] | None = None) -> int:
    from .sampling import SAMPLERS

    parser = argparse.ArgumentParser(prog="python -m sdxl", description="Stable Diffusion XL in JAX.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="render images for a prompt and save them as PNGs")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="folder, Hub repo id, or 'tiny' (default: %(default)s)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--negative-prompt", default="")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--steps", type=int, default=25)
    gen.add_argument("--guidance", type=float, default=5.0)
    gen.add_argument("--sampler", default="euler", choices=list(SAMPLERS))
    gen.add_argument("--height", type=int, help="default: the model's native size")
    gen.add_argument("--width", type=int, help="default: the model's native size")
    gen.add_argument("--num-images", type=int, help="default: one per device")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16, float32 on CPU")
    gen.add_argument("--out", default="out", help="output folder (default: %(default)s)")
    gen.add_argument("--cache-dir", help="persistent compilation cache folder")
    gen.set_defaults(run=_generate)

    from . import bench

    bench_parser = commands.add_parser("bench", help="measure generation speed, optionally beside diffusers")
    bench.add_bench_arguments(bench_parser)
    bench_parser.set_defaults(run=bench.bench_command)
    write = commands.add_parser("write-checkpoint", help="write a random checkpoint (e.g. full-size SDXL) to benchmark")
    bench.add_write_checkpoint_arguments(write)
    write.set_defaults(run=bench.write_checkpoint_command)

    args = parser.parse_args(argv)
    from .pipeline import NonFiniteImageError
    from .weights import CheckpointError

    try:
        args.run(args)
    except (ValueError, CheckpointError, NonFiniteImageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
