"""Comparison grids (X/Y plots): one setting varied along each axis, one image per cell.

A cell is the image a single generation renders first (image index 0) for the same prompt, seed and
settings. Prompts, negative prompts, styles, seeds and guidance scales are per-image inputs of one
compiled program, so cells that differ only in those share a device call (`calls`); steps,
samplers, schedule types, LoRA scales and the hires fix's settings change the call, and each of their
values is a call of its own (steps, schedule types and LoRA scales never recompile).
"""

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from PIL import Image, ImageDraw, ImageFont

from ..engine.checks import integer, number
from ..engine.controls import CONTROL_SCALE_RANGE
from ..engine.image_prompts import IP_ADAPTER_SCALE_RANGE
from ..engine.prepared import PreparedRequest
from ..engine.request import LORA_SCALE_RANGE, MAX_SEED, guidance_rescale, guidance_scale
from ..prompts.styles import STYLES
from ..sampling.methods import SAMPLER_NAMES, sampler_name, schedule_type_named

MAX_CELLS = 64
# The axes, by the request setting each varies; a LoRA's scale is "lora:<name>".
AXES = ("prompt", "negative_prompt", "style", "seed", "guidance_scale", "guidance_rescale", "steps", "sampler",
        "schedule_type", "hires_strength", "hires_upscaler")
# With ControlNets: every ControlNet's scale, or end (the fraction of the steps after which it stops).
CONTROL_AXES = {"control_scale": CONTROL_SCALE_RANGE, "control_end": (0.0, 1.0)}
# With IP-Adapters: the image prompt's scale (an input of the program: one call, never a recompile).
IP_ADAPTER_AXIS = "ip_adapter_scale"
LORA_AXIS = "lora:"
# With several models: the model (A1111's "Checkpoint name"); each model's cells are device calls of their own.
MODEL_AXIS = "model"
_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Axis:
    """One axis: the setting it varies, its values (as the request takes them) and their labels."""

    name: str
    values: tuple
    labels: tuple[str, ...]


def split_values(text: str) -> list[str]:
    """Values one per line, or, written on one line, separated by commas; blanks dropped."""
    parts = str(text).splitlines() if "\n" in str(text) else str(text).split(",")
    return [part.strip() for part in parts if part.strip()]


def parse_axis(name: str, text: str, *, prompt: str = "", max_steps: int = 100, loras: Sequence[str] = (),
               models: Sequence[str] = ()) -> Axis:
    """The axis `name` (one of `AXES`, "lora:<name>" for a launched LoRA, or `MODEL_AXIS` over the
    served `models`' names) over the values in `text`.

    A `prompt` axis whose first value is a phrase of `prompt` is A1111's "Prompt S/R": each value
    replaces that phrase (the first gives the prompt itself); otherwise each value is a whole prompt.
    Seeds and steps take ranges, "1-4".

    Raises:
      ValueError: naming the axis and its first bad value.
    """
    raw = split_values(text)
    if not raw:
        raise ValueError(f"the {name} axis has no values")
    if name in ("seed", "steps"):
        raw = [str(v) for part in raw for v in _expanded(part, name)]
    try:
        values = [_value(name, v, max_steps, loras, models) for v in raw]
    except ValueError as e:
        raise ValueError(f"{name} axis: {e}") from None
    labels = list(raw)
    if name == "prompt" and raw[0] in prompt and raw[0]:
        values = [prompt.replace(raw[0], v) for v in raw]
    if name == "sampler":
        labels = [SAMPLER_NAMES[v] for v in values]
    if name == "schedule_type":  # its names as written, whatever the case they were typed in
        labels = list(values)
    if len(values) > MAX_CELLS:
        raise ValueError(f"the {name} axis has {len(values)} values; a grid has at most {MAX_CELLS} cells")
    return Axis(name, tuple(values), tuple(labels))


def _expanded(part: str, name: str) -> list[int | str]:
    match = _RANGE.match(part)
    if not match:
        return [part]
    first, last = int(match[1]), int(match[2])
    if last < first or last - first >= MAX_CELLS:
        raise ValueError(f"{name} axis: the range {part} must run upwards over at most {MAX_CELLS} values")
    return list(range(first, last + 1))


def _value(name: str, text: str, max_steps: int, loras: Sequence[str], models: Sequence[str]):
    if name in ("prompt", "negative_prompt"):
        return text
    if name == MODEL_AXIS:
        if text not in models:
            raise ValueError(f"no model {text!r} is loaded; the loaded ones are {', '.join(models)}")
        return text
    if name == "style":
        if text not in STYLES:
            raise ValueError(f"unknown style {text!r}; choose from: {', '.join(STYLES)}")
        return text
    if name == "seed":
        return integer(text, "seed", 0, MAX_SEED)
    if name == "guidance_scale":
        return guidance_scale(text)
    if name == "guidance_rescale":
        return guidance_rescale(text)
    if name == "steps":
        return integer(text, "steps", 1, max_steps)
    if name == "sampler":
        return sampler_name(text)
    if name == "schedule_type":
        return schedule_type_named(text)
    if name == "hires_strength":
        return number(text, "hires denoising strength", 0.0, 1.0)
    if name == "hires_upscaler":  # checked with the request, against the upscalers loaded
        return text
    if name in CONTROL_AXES:
        return number(text, name.replace("_", " "), *CONTROL_AXES[name])
    if name == IP_ADAPTER_AXIS:
        return number(text, "IP-Adapter scale", *IP_ADAPTER_SCALE_RANGE)
    if name.startswith(LORA_AXIS) and name[len(LORA_AXIS):] in loras:
        return number(text, f"scale of {name[len(LORA_AXIS):]}", *LORA_SCALE_RANGE)
    choices = ", ".join([*AXES, *(LORA_AXIS + lora for lora in loras), *([MODEL_AXIS] if len(models) > 1 else [])])
    raise ValueError(f"unknown axis {name!r}; choose from: {choices}")


def cells(settings: T, x: Axis | None, y: Axis | None, with_value: Callable[[T, str, object], T]) -> list[T]:
    """Each cell's settings, row by row (y), left to right (x): `settings` with the axes' values, each
    set by `with_value(settings, axis name, value)`."""
    found = []
    for y_value in (None,) if y is None else y.values:
        for x_value in (None,) if x is None else x.values:
            cell = settings
            for axis, value in ((y, y_value), (x, x_value)):
                if axis is not None:
                    cell = with_value(cell, axis.name, value)
            found.append(cell)
    if len(found) > MAX_CELLS:
        raise ValueError(f"the grid has {len(found)} cells; at most {MAX_CELLS} are rendered")
    return found


@dataclasses.dataclass
class GridPlan:
    """A grid's axes and the prepared requests (device calls) that render its cells; cell i is image
    `where[i]` = (request, index) of those."""

    x: Axis | None
    y: Axis | None
    requests: list[PreparedRequest]
    where: list[tuple[int, int]]


def plan(x: Axis | None, y: Axis | None, cells: Sequence[PreparedRequest], max_images: int,
         padded_batch: Callable[[int], int]) -> GridPlan:
    """The cells' one-image requests merged into as few device calls as fit (`calls`), each at the
    batch `padded_batch` gives its image count."""
    requests, where = [], [None] * len(cells)
    # Cells with guidance 1 or less share calls with guided ones: their images are the conditional
    # branch either way (within float rounding), and the grid takes fewer calls.
    for call in calls([cell.request.call_settings for cell in cells], max_images):
        for index, cell in enumerate(call):
            where[cell] = (len(requests), index)
        requests.append(PreparedRequest.merged([cells[i] for i in call], padded_batch(len(call))))
    return GridPlan(x, y, requests, where)


def calls(keys: Sequence, max_images: int) -> list[list[int]]:
    """The cells (by index) of each device call: cells with equal `keys` together, in order of first
    appearance, as few calls of at most `max_images` as fit."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return [group[i:i + max_images] for group in groups.values() for i in range(0, len(group), max_images)]


MAX_LABEL_LINES = 6  # of a column label; a longer one ends in "…"
MIN_FONT_FRACTION = 0.8  # of the grid's font size, for an axis with a word wider than a column
ELLIPSIS = "\u2026"


def labelled(
    images: Sequence[Image.Image], x: Axis | None, y: Axis | None, parameters: Sequence[str]
) -> Image.Image:
    """The cells in a table with the x values above their columns and the y values beside their rows,
    each axis named. Its PNG text (`info`, which PIL's and Gradio's PNG writers keep) has the first
    cell's `parameters` where A1111 readers look, and every cell's in "grid", a JSON list.

    Every label stays inside its own column (or row) as A1111's X/Y plot keeps it: wrapped at spaces,
    the header as tall as the longest label; an axis whose longest word is wider than a column is
    written smaller, down to `MIN_FONT_FRACTION` of the size, and a word wider still is broken with a
    hyphen. A column label longer than `MAX_LABEL_LINES` lines, or a row label longer than its row is
    tall, ends in an ellipsis.
    """
    columns = 1 if x is None else len(x.labels)
    rows = len(images) // columns
    # A sheet holds one size: cells of another (a model of another native size) are resized to the first's.
    images = [image if image.size == images[0].size else image.resize(images[0].size, Image.Resampling.LANCZOS)
              for image in images]
    width, height = images[0].size
    size = max(12, min(width, height) // 14)
    pad = max(2, size // 4)
    left = max(width // 2, 120) if y is not None else 0
    line = _line_height(_font(size))
    title_height = line + 2 * pad if x is not None or y is not None else 0
    top = title_height
    if x is not None:
        x_font = _axis_font(x.labels, width - 2 * pad, size)
        x_lines = [_wrap(label, width - 2 * pad, x_font, MAX_LABEL_LINES) for label in x.labels]
        top += max(1, *map(len, x_lines)) * _line_height(x_font) + pad
    if y is not None:
        y_font = _axis_font(y.labels, left - 2 * pad, size)
        fitting = max(1, (height - 2 * pad) // _line_height(y_font))  # as many lines as its row holds
        y_lines = [_wrap(label, left - 2 * pad, y_font, fitting) for label in y.labels]
    sheet = Image.new("RGB", (left + columns * width, top + rows * height), "white")
    for i, image in enumerate(images):
        sheet.paste(image, (left + (i % columns) * width, top + (i // columns) * height))
    draw = ImageDraw.Draw(sheet)
    if x is not None:
        _draw_title(draw, _axis_title(x.name), (left + pad, pad), columns * width - 2 * pad, size)
        for c, lines in enumerate(x_lines):
            _draw_lines(draw, lines, (left + c * width + pad, title_height), x_font)
    if y is not None:
        _draw_title(draw, _axis_title(y.name), (pad, top - line - pad), left - 2 * pad, size)
        for r, lines in enumerate(y_lines):
            _draw_lines(draw, lines, (pad, top + r * height + pad), y_font)
    sheet.info.update(parameters=parameters[0], grid=json.dumps(list(parameters)))
    return sheet


def _axis_title(name: str) -> str:
    return name.replace("_", " ").capitalize() if not name.startswith(LORA_AXIS) else f"LoRA {name[5:]} scale"


@functools.lru_cache(maxsize=64)
def _font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


def _line_height(font) -> int:
    ascent, descent = font.getmetrics()
    return ascent + descent


def _axis_font(labels: Sequence[str], width: int, size: int):
    """The font of an axis's labels: one size for all, so that they compare at a glance, the largest
    in which each of their words fits `width` (`_fitting_font`)."""
    return _fitting_font({word for label in labels for word in str(label).split()}, width, size)


def _fitting_font(texts, width: int, size: int):
    """The largest font, from `size` down to `MIN_FONT_FRACTION` of it, in which each of `texts` fits
    `width` on one line; texts too wide even at the smallest (which are broken or shortened) aside."""
    smallest = max(1, round(size * MIN_FONT_FRACTION))
    texts = [text for text in texts if _font(smallest).getlength(text) <= width]
    for candidate in range(size, smallest, -1):
        if all(_font(candidate).getlength(text) <= width for text in texts):
            return _font(candidate)
    return _font(smallest)


def _wrap(text: str, width: int, font, max_lines: int) -> list[str]:
    """`text` in lines no wider than `width`: broken at spaces, a longer word broken with a hyphen;
    at most `max_lines`, the last ending in "…" where some of the text is left out."""
    lines: list[str] = []
    for word in str(text).split():
        pieces = _broken(word, width, font)
        if lines and font.getlength(f"{lines[-1]} {pieces[0]}") <= width:
            lines[-1] = f"{lines[-1]} {pieces[0]}"
            pieces = pieces[1:]
        lines.extend(pieces)
    if len(lines) > max_lines:
        lines = [*lines[:max_lines - 1], _shortened(lines[max_lines - 1] + ELLIPSIS, width, font)]
    return lines


def _broken(word: str, width: int, font) -> list[str]:
    """A word in pieces no wider than `width`, each but the last ending in a hyphen."""
    pieces, current = [], ""
    for i, character in enumerate(word):
        if current and font.getlength(current + word[i:]) > width and font.getlength(current + character + "-") > width:
            pieces.append(current + "-")
            current = ""
        current += character
    return [*pieces, current]


def _shortened(text: str, width: int, font) -> str:
    """`text`, or as much of it as fits `width` followed by "…"."""
    if font.getlength(text) <= width:
        return text
    text = text.removesuffix(ELLIPSIS)
    while text and font.getlength(text.rstrip() + ELLIPSIS) > width:
        text = text[:-1]
    return text.rstrip() + ELLIPSIS


def _draw_title(draw: ImageDraw.ImageDraw, text: str, at: tuple[int, int], width: int, size: int) -> None:
    """An axis's name on one line within `width`: smaller if need be, then shortened."""
    font = _fitting_font([text], width, size)
    draw.text(at, _shortened(text, width, font), fill="gray", font=font)


def _draw_lines(draw: ImageDraw.ImageDraw, lines: Sequence[str], at: tuple[int, int], font) -> None:
    for i, line in enumerate(lines):
        draw.text((at[0], at[1] + i * _line_height(font)), line, fill="black", font=font)
