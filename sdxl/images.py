"""Saving generated images: PNGs that carry their generation parameters, and contact-sheet grids."""

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, PngImagePlugin


def image_count(n: int) -> str:
    """"1 image", "4 images": how the CLI and the demo report a result."""
    return f"{n} image{'' if n == 1 else 's'}"


def model_label(model: str, unet: str | None) -> str:
    """How a result names its model: the checkpoint, and the UNet file that replaced its UNet."""
    return f"{model} + {Path(unet).name}" if unet else model


def parameters_text(
    *, prompt: str, negative_prompt: str, steps: int, sampler: str, guidance_scale: float, seed: int,
    index: int, width: int, height: int, model: str, loras: Sequence[tuple[str, float]] = (),
) -> str:
    """The generation parameters in the widely read "parameters" PNG-chunk format (as A1111 writes it);
    `loras` as (source, scale) pairs."""
    lines = [prompt]
    if negative_prompt:
        lines.append(f"Negative prompt: {negative_prompt}")
    lines.append(
        f"Steps: {steps}, Sampler: {sampler}, CFG scale: {guidance_scale:g}, Seed: {seed}, Image index: {index}, "
        f"Size: {width}x{height}, Model: {model}"
    )
    if loras:
        lines[-1] += ", LoRAs: " + " ".join(f"{Path(source).stem}:{scale:g}" for source, scale in loras)
    return "\n".join(lines)


def save_png(image: Image.Image, path: Path, parameters: str) -> Path:
    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", parameters)
    image.save(path, pnginfo=info)
    return Path(path)


def grid(images: list[Image.Image]) -> Image.Image:
    """Lays images out in a near-square grid (all images must share one size)."""
    columns = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    width, height = images[0].size
    sheet = Image.new("RGB", (columns * width, rows * height))
    for i, image in enumerate(images):
        sheet.paste(image, ((i % columns) * width, (i // columns) * height))
    return sheet


def to_pil(images: np.ndarray) -> list[Image.Image]:
    return [Image.fromarray(image) for image in images]
