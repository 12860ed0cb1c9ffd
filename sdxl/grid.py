"""Comparison grids (X/Y plots): one setting varied along each axis, one image per cell.

A cell is the image a single generation renders first (image index 0) for the same prompt, seed and
settings. Prompts, negative prompts, styles, seeds and guidance scales are per-image inputs of one
compiled program, so cells that differ only in those share a device call (`calls`); steps,
samplers and LoRA scales change the call, and each of their values is a call of its own (steps and
LoRA scales never recompile).
"""

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from PIL import Image, ImageDraw, ImageFont

from .request import LORA_SCALE_RANGE, MAX_SEED, Request, guidance_scale, integer, number
from .sampling import SAMPLER_NAMES, SAMPLERS
from .styles import STYLES

MAX_CELLS = 64
# The axes, by the request setting each varies; a LoRA's scale is "lora:<name>".
AXES = ("prompt", "negative_prompt", "style", "seed", "guidance_scale", "steps", "sampler")
LORA_AXIS = "lora:"
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


def parse_axis(name: str, text: str, *, prompt: str = "", max_steps: int = 100, loras: Sequence[str] = ()) -> Axis:
    """The axis `name` (one of `AXES`, or "lora:<name>" for a launched LoRA) over the values in `text`.

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
        values = [_value(name, v, max_steps, loras) for v in raw]
    except ValueError as e:
        raise ValueError(f"{name} axis: {e}") from None
    labels = list(raw)
    if name == "prompt" and raw[0] in prompt and raw[0]:
        values = [prompt.replace(raw[0], v) for v in raw]
    if name == "sampler":
        labels = [SAMPLER_NAMES[v] for v in values]
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


def _value(name: str, text: str, max_steps: int, loras: Sequence[str]):
    if name in ("prompt", "negative_prompt"):
        return text
    if name == "style":
        if text not in STYLES:
            raise ValueError(f"unknown style {text!r}; choose from: {', '.join(STYLES)}")
        return text
    if name == "seed":
        return integer(text, "seed", 0, MAX_SEED)
    if name == "guidance_scale":
        return guidance_scale(text)
    if name == "steps":
        return integer(text, "steps", 1, max_steps)
    if name == "sampler":
        by_label = {label.lower(): key for key, label in SAMPLER_NAMES.items()}
        sampler = by_label.get(text.lower(), text)
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {text!r}; choose from: {', '.join(SAMPLERS)}")
        return sampler
    if name.startswith(LORA_AXIS) and name[len(LORA_AXIS):] in loras:
        return number(text, f"scale of {name[len(LORA_AXIS):]}", *LORA_SCALE_RANGE)
    choices = ", ".join([*AXES, *(LORA_AXIS + lora for lora in loras)])
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
    """A grid's axes and the requests (device calls) that render its cells; cell i is image
    `where[i]` = (request, index) of those."""

    x: Axis | None
    y: Axis | None
    requests: list[Request]
    where: list[tuple[int, int]]


def plan(x: Axis | None, y: Axis | None, cells: Sequence[Request], max_images: int) -> GridPlan:
    """The cells' one-image requests merged into as few device calls as fit (`calls`)."""
    requests, where = [], [None] * len(cells)
    # Cells with guidance 1 or less share calls with guided ones: their images are the conditional
    # branch either way (within float rounding), and the grid takes fewer calls.
    for call in calls([cell.call_settings for cell in cells], max_images):
        for index, cell in enumerate(call):
            where[cell] = (len(requests), index)
        requests.append(Request.merged([cells[i] for i in call]))
    return GridPlan(x, y, requests, where)


def calls(keys: Sequence, max_images: int) -> list[list[int]]:
    """The cells (by index) of each device call: cells with equal `keys` together, in order of first
    appearance, as few calls of at most `max_images` as fit."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return [group[i:i + max_images] for group in groups.values() for i in range(0, len(group), max_images)]


def labelled(
    images: Sequence[Image.Image], x: Axis | None, y: Axis | None, parameters: Sequence[str]
) -> Image.Image:
    """The cells in a table with the x values above their columns and the y values beside their rows,
    each axis named. Its PNG text (`info`, which PIL's and Gradio's PNG writers keep) has the first
    cell's `parameters` where A1111 readers look, and every cell's in "grid", a JSON list."""
    columns = 1 if x is None else len(x.labels)
    rows = len(images) // columns
    width, height = images[0].size
    font = ImageFont.load_default(size=max(12, min(width, height) // 14))
    line = font.size + 6
    top = line * (1 + _lines(x, font, width)) if x is not None else 0
    left = max(width // 2, 120) if y is not None else 0
    sheet = Image.new("RGB", (left + columns * width, top + rows * height), "white")
    draw = ImageDraw.Draw(sheet)
    if x is not None:
        draw.text((left + 4, 2), _axis_title(x.name), fill="gray", font=font)
        for c, label in enumerate(x.labels):
            _wrapped(draw, label, (left + c * width + 4, line), width - 8, font)
    if y is not None:
        draw.text((4, max(top - line, 0) + 2), _axis_title(y.name), fill="gray", font=font)
        for r, label in enumerate(y.labels):
            _wrapped(draw, label, (4, top + r * height + 4), left - 8, font)
    for i, image in enumerate(images):
        sheet.paste(image, (left + (i % columns) * width, top + (i // columns) * height))
    sheet.info.update(parameters=parameters[0], grid=json.dumps(list(parameters)))
    return sheet


def _axis_title(name: str) -> str:
    return name.replace("_", " ").capitalize() if not name.startswith(LORA_AXIS) else f"LoRA {name[5:]} scale"


def _lines(axis: Axis, font, width: int) -> int:
    return max(len(_wrap(label, width - 8, font)) for label in axis.labels)


def _wrap(text: str, width: int, font) -> list[str]:
    lines, current = [], ""
    for word in str(text).split():
        trial = f"{current} {word}".strip()
        if current and font.getlength(trial) > width:
            lines.append(current)
            current = word
        else:
            current = trial
    return [*lines, current][:4] or [""]  # at most four lines a label


def _wrapped(draw: ImageDraw.ImageDraw, text: str, at: tuple[int, int], width: int, font) -> None:
    for i, line in enumerate(_wrap(text, width, font)):
        draw.text((at[0], at[1] + i * (font.size + 2)), line, fill="black", font=font)
