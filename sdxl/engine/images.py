"""Images in and out: the images and masks users give (PIL images, arrays) as the arrays a `Request`
carries, and PNGs that carry their generation parameters, and contact sheets.

diffusers' image processor reads a PIL image's pixels as they are and a mask as its greyscale
("L") version, binarized at one half; `pixels` and `mask` do the same, and refuse what they cannot
read with a sentence that says why.
"""

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image, PngImagePlugin

from ..checkpoints import lora
from ..models.controlnet_union import CONTROL_MODES
from ..prompts import syntax as prompt_syntax
from ..prompts.syntax import A1111_EMPHASIS_NAMES
from ..sampling.samplers import SAMPLER_NAMES


# Modes PIL converts to RGB without losing what the picture shows; 16- and 32-bit modes would be
# clipped, not scaled, so they are refused.
_CONVERTIBLE_MODES = ("RGB", "RGBA", "RGBX", "RGBa", "L", "LA", "La", "P", "PA", "1", "CMYK", "YCbCr", "LAB", "HSV")


def pixels(image) -> np.ndarray:
    """[H, W, 3] pixels of a PIL image or an array: uint8, or float32 in [0, 1] for a float array.

    Raises:
      ValueError: a mode or shape that is not an RGB or greyscale picture.
    """
    if isinstance(image, Image.Image):
        if image.mode not in _CONVERTIBLE_MODES:
            raise ValueError(f"images in mode {image.mode} (16-bit or float) are not supported: save 8-bit RGB")
        # diffusers' load_image does the same: an alpha channel is dropped, not composited.
        return np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=-1)
    if array.ndim != 3 or array.shape[-1] not in (3, 4):
        raise ValueError(f"an image array must be [height, width, 3] (RGB), got shape {array.shape}")
    array = array[..., :3]
    if array.dtype == np.uint8:
        return array
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"an image array must hold uint8 or floats in [0, 1], got {array.dtype}")
    return array.astype(np.float32)


def resized(image: np.ndarray, height: int, width: int, *, crop: bool = False) -> np.ndarray:
    """[H, W, C] pixels (uint8, or float32 in [0, 1]) at height x width, resized with Lanczos as
    diffusers' image processors resize the PIL images they are given; unchanged at that size. With
    `crop`, first centre-cropped to that aspect ratio (A1111's "Crop and Resize")."""
    if image.shape[:2] == (height, width):
        return image
    box = crop_box(image.shape[1], image.shape[0], width, height) if crop else None
    if image.dtype == np.uint8:
        return np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.LANCZOS, box=box))
    channels = [Image.fromarray(image[..., c], "F").resize((width, height), Image.Resampling.LANCZOS, box=box)
                for c in range(image.shape[-1])]
    return np.clip(np.stack([np.asarray(c) for c in channels], axis=-1), 0, 1)


def crop_box(width: int, height: int, to_width: int, to_height: int) -> tuple[float, float, float, float]:
    """The centred box of a width x height picture with to_width x to_height's aspect ratio, as PIL's
    `resize(box=...)` takes it: the largest such box."""
    scale = min(width / to_width, height / to_height)
    crop_w, crop_h = to_width * scale, to_height * scale
    return (width - crop_w) / 2, (height - crop_h) / 2, (width + crop_w) / 2, (height + crop_h) / 2


def checked_pixels(images) -> np.ndarray:
    """Images (any shape) as uint8, or float32 in [0, 1] (as diffusers takes arrays).

    Raises:
      ValueError: floats outside [0, 1], or not finite.
    """
    images = np.asarray(images)
    if images.dtype == np.uint8:
        return images
    images = images.astype(np.float32)
    if not np.isfinite(images).all() or images.min() < 0 or images.max() > 1:
        raise ValueError("images given as floats must lie in [0, 1]")
    return images


# A bound on what one uploaded or opened image may decode to: SDXL's largest bucket is 1.6
# megapixels, the largest size here (MAX_SIZE squared) 16.8; PIL's own bound is 89.
MAX_IMAGE_PIXELS = 4096 * 4096


def read_image(source) -> Image.Image:
    """Opens an image file (a path or a binary file), refusing before it decodes one whose header
    claims more than `MAX_IMAGE_PIXELS` (a decompression bomb: a small file that decodes to
    gigabytes) or that PIL cannot read.

    Raises:
      ValueError: one sentence naming the problem.
    """
    limit = f"{MAX_IMAGE_PIXELS / 1e6:.1f} megapixels at most are read"
    try:
        image = Image.open(source)
    except Image.DecompressionBombError as e:  # PIL's own bound (the demo lowers it to twice ours)
        raise ValueError(f"the image is far too large: {limit}") from e
    except OSError as e:
        raise ValueError(f"cannot read the image: {e}") from e
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"the image is {width}x{height}, {width * height / 1e6:.0f} megapixels: {limit}")
    try:
        image.load()
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot read the image: {e}") from e
    return image


def mask(image) -> np.ndarray:
    """[H, W] bool, True where the image is repainted: a PIL image's greyscale (as diffusers' mask
    processor, "L") or an array's values, above one half.

    Raises:
      ValueError: a mask that is not one greyscale or RGB picture.
    """
    if isinstance(image, Image.Image):
        if image.mode not in _CONVERTIBLE_MODES:
            raise ValueError(f"masks in mode {image.mode} are not supported: save an 8-bit greyscale image")
        return np.asarray(image.convert("L")) >= 128  # diffusers: x / 255 >= 0.5
    array = np.asarray(image)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim == 3 and array.shape[-1] in (3, 4):  # as PIL's "L": ITU-R 601-2 luma
        array = array[..., :3].astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
    if array.ndim != 2:
        raise ValueError(f"a mask array must be [height, width], got shape {np.shape(image)}")
    if np.asarray(image).dtype == np.uint8:
        return array >= 127.5
    return np.asarray(array, np.float32) >= 0.5


def image_count(n: int) -> str:
    """"1 image", "4 images": how the CLI and the demo report a result."""
    return f"{n} image{'' if n == 1 else 's'}"


def model_label(model: str, unet: str | None) -> str:
    """How a result names its model: the checkpoint, and the UNet file that replaced its UNet."""
    return f"{model} + {Path(unet).name}" if unet else model


def parameters_text(prompt: str, negative_prompt: str, settings: dict[str, object]) -> str:
    """Generation parameters in the widely read "parameters" PNG-chunk format, as webui writes it: the
    prompt, the negative prompt, then the settings as "Key: value" pairs (quoted where a value holds a
    comma, colon or newline), in order; None values left out."""
    lines = [prompt]
    if negative_prompt:
        lines.append(f"Negative prompt: {negative_prompt}")
    values = (f"{key}: {_infotext_value(value)}" for key, value in settings.items() if value is not None)
    lines.append(", ".join(values))
    return "\n".join(lines)


def _infotext_value(value) -> str:
    return infotext_quote(_number(value))


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def png_parameters(pipe, request, i: int, model: str) -> str:
    """The parameters of image `i` of a rendered request (on `pipe`, with its refiner), as the CLI and
    the demo save them: the prompts as written, weights and LoRA tags included; webui's fields where it
    has them ("Schedule type", "Emphasis", "Lora hashes"), then ours."""
    sampler, schedule = A1111_SAMPLERS[request.sampler]
    loras = request.loras or ()
    readable = [prompt_syntax.lora_tags(request.prompts[i])[0], request.negative_prompts[i]]
    return parameters_text(request.prompts[i], request.negative_prompts[i], {
        "Steps": request.steps, "Sampler": sampler, "Schedule type": schedule,
        "CFG scale": float(request.guidance_scales[i]), "Seed": request.seeds[i],
        "Image index": request.image_index[i], "Size": f"{request.width}x{request.height}", "Model": model,
        "Denoising strength": None if request.images is None else float(request.strength),
        "Refiner": None if request.refine_from is None else pipe.refiner.name,
        "Refiner switch at": None if request.refine_from is None else float(request.refine_from),
        "Emphasis": emphasis_infotext(request.emphasis, readable),
        "LoRAs": " ".join(f"{lora.display_name(source)}:{scale:g}" for source, scale in loras) or None,
        "Lora hashes": lora_hashes_text(
            (lora.display_name(source), pipe.lora_files[source].short_hash) for source, _ in loras
        ) or None,
        **controlnet_infotext(pipe, request, i),
    })


def controlnet_infotext(pipe, request, i: int) -> dict[str, str]:
    """Image `i`'s ControlNets as A1111's ControlNet extension records them: "ControlNet 0" (and 1,
    2, ...) with "Module: canny, Model: ..., Weight: 0.7, Threshold A: 100, Threshold B: 200, Guidance
    Start: 0, Guidance End: 0.8" as its value. The module is how the control map was made from a
    picture ("none": given as the map)."""
    entries = {}
    for k, (controlnet, control) in enumerate(zip(pipe.controlnets, request.controls[i] if request.controls else ())):
        fields = {**control.made_by.infotext(), "Model": controlnet_label(controlnet.name), "Weight": control.scale,
                  "Guidance Start": control.start, "Guidance End": control.end,
                  **({} if control.mode is None else {"Union Control Type": CONTROL_MODES[control.mode][0]})}
        order = ("Module", "Model", "Weight", "Threshold A", "Threshold B", "Guidance Start", "Guidance End",
                 "Union Control Type")
        entries[f"ControlNet {k}"] = ", ".join(f"{key}: {_number(fields[key])}" for key in order if key in fields)
    return entries


def controlnet_label(source: str) -> str:
    """How results and the demo name a ControlNet: a Hub repo id as it is, a file or folder by its name."""
    path = Path(source)
    if source.endswith(".safetensors"):
        return path.stem
    return path.name if path.is_dir() else source


def lora_hashes_text(loras: Iterable[tuple[str, str]]) -> str:
    """The value of webui's "Lora hashes" field from (name as written in the tag, short hash) pairs:
    "name: hash, name: hash", names without ":" and ",", one entry per name (a repeated name keeps its
    first place and its last hash). In the infotext it is written quoted (`infotext_quote`)."""
    entries: dict[str, str] = {}
    for name, short_hash in loras:
        entries[name.translate(str.maketrans("", "", ":,"))] = short_hash
    return ", ".join(f"{name}: {short_hash}" for name, short_hash in entries.items())


def infotext_quote(value: str) -> str:
    """A value as webui writes it in the infotext: JSON-quoted when it holds a comma, colon or newline."""
    value = str(value)
    if "," not in value and ":" not in value and "\n" not in value:
        return value
    return json.dumps(value, ensure_ascii=False)


def emphasis_infotext(emphasis: str, texts: Iterable[str]) -> str | None:
    """webui's "Emphasis" infotext value: written only when the mode is not "original" and some prompt
    (positive or negative, tags removed) holds "(" or "["."""
    if emphasis == "original" or not any("(" in text or "[" in text for text in texts):
        return None
    return A1111_EMPHASIS_NAMES[emphasis]


def read_parameters(text: str) -> dict:
    """The settings in a "parameters" text (`png_parameters`', or webui's and Forge's): prompt,
    negative_prompt, and those of steps, sampler (our name for it), guidance_scale, seed, width, height
    and emphasis that it names. Raises ValueError if it has no settings line."""
    lines = text.strip().split("\n")
    settings_line = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("Steps: ")), None)
    if settings_line is None:
        raise ValueError("no generation parameters in this image (no 'Steps:' line)")
    prompt_lines, negative = lines[:settings_line], ""
    for i, line in enumerate(prompt_lines):
        if line.startswith("Negative prompt: "):
            negative = "\n".join([line[len("Negative prompt: "):], *prompt_lines[i + 1:]])
            prompt_lines = prompt_lines[:i]
            break
    fields = {key: json.loads(value) if value.startswith('"') else value
              for key, value in _SETTING.findall(lines[settings_line])}
    found = {"prompt": "\n".join(prompt_lines), "negative_prompt": negative}
    for key, (name, parse) in _SETTINGS.items():
        if key in fields:
            try:
                found[name] = parse(fields[key])
            except ValueError:
                pass  # a value this demo cannot use is left as it is
    if "Size" in fields and "x" in fields["Size"]:
        found["width"], found["height"] = (int(v) for v in fields["Size"].split("x"))
    sampler = _sampler_named(fields.get("Sampler"), fields.get("Schedule type"))
    if sampler is not None:
        found["sampler"] = sampler
    emphasis = {label: mode for mode, label in A1111_EMPHASIS_NAMES.items()}.get(fields.get("Emphasis", "Original"))
    if emphasis is not None:
        found["emphasis"] = emphasis
    return found


# "Key: value" pairs of a settings line; a value runs to the next comma (webui quotes values with commas).
_SETTING = re.compile(r'\s*([\w ]+): ("(?:[^"\\]|\\.)*"|[^,]*)(?:,|$)')
_SETTINGS = {"Steps": ("steps", int), "CFG scale": ("guidance_scale", float), "Seed": ("seed", int)}
# Our samplers as webui (1.9 and later) names them: (Sampler, Schedule type); None: the model's own schedule.
A1111_SAMPLERS = {name: (label.removesuffix(" Karras"), "Karras" if name.endswith("_karras") else None)
                  for name, label in SAMPLER_NAMES.items()}
# webui's "Automatic" schedule type is each sampler's default: Karras for DPM++ 2M, the model's own for ours.
_AUTOMATIC_KARRAS = ("DPM++ 2M",)


def _sampler_named(sampler: str | None, schedule: str | None) -> str | None:
    """Our sampler for webui's sampler and schedule type (one field before 1.9: "DPM++ 2M Karras");
    None when we have none like it."""
    if sampler is None:
        return None
    if schedule == "Automatic" and sampler in _AUTOMATIC_KARRAS:
        schedule = "Karras"
    for name, (label, karras) in A1111_SAMPLERS.items():
        if sampler == label and (karras == schedule or (karras is None and schedule != "Karras")):
            return name
        if karras and sampler == f"{label} {karras}":
            return name
    return next((name for name, (label, _) in A1111_SAMPLERS.items() if label == sampler), None)


def save_png(image: Image.Image, path: Path, parameters: str) -> Path:
    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", parameters)
    image.save(path, pnginfo=info)
    return Path(path)


def contact_sheet(images: list[Image.Image]) -> Image.Image:
    """Lays images out in a near-square sheet (all images must share one size)."""
    columns = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    width, height = images[0].size
    sheet = Image.new("RGB", (columns * width, rows * height))
    for i, image in enumerate(images):
        sheet.paste(image, ((i % columns) * width, (i // columns) * height))
    return sheet


def to_pil(images: np.ndarray) -> list[Image.Image]:
    return [Image.fromarray(image) for image in images]
