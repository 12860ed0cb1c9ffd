import json

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from sdxl.serving import grid


def test_values_are_comma_separated_or_one_per_line_with_ranges_for_seeds_and_steps():
    assert grid.parse_axis("seed", "1-3, 7").values == (1, 2, 3, 7)
    assert grid.parse_axis("steps", "10\n20-22").values == (10, 20, 21, 22)
    assert grid.parse_axis("guidance_scale", "1, 4.5 ,7").values == (1.0, 4.5, 7.0)
    assert grid.parse_axis("guidance_rescale", "0, 0.7").values == (0.0, 0.7)
    axis = grid.parse_axis("sampler", "euler, Euler a, DPM++ 2M Karras")
    assert axis.values == ("euler", "euler_ancestral", "dpmpp_2m_karras")
    assert axis.labels == ("Euler", "Euler a", "DPM++ 2M Karras")
    axis = grid.parse_axis("schedule_type", "diffusers, karras, SGM uniform")
    assert axis.values == axis.labels == ("diffusers", "Karras", "SGM Uniform")
    assert grid.parse_axis("lora:ink", "0, 0.5, 1", loras=["ink"]).values == (0.0, 0.5, 1.0)


def test_a_prompt_axis_is_search_and_replace_when_its_first_value_is_in_the_prompt():
    sr = grid.parse_axis("prompt", "red, blue, green", prompt="a red circle on a red background")
    assert sr.values == (
        "a red circle on a red background", "a blue circle on a blue background",
        "a green circle on a green background",
    )
    assert sr.labels == ("red", "blue", "green")
    whole = grid.parse_axis("prompt", "a cat, in the rain\na dog", prompt="a red circle")
    assert whole.values == ("a cat, in the rain", "a dog")


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("seed", "1, x", "seed axis: seed must be an integer from 0 to"),
        ("steps", "0", "steps axis: steps must be an integer from 1 to 100"),
        ("steps", "9-2", "the range 9-2 must run upwards"),
        ("guidance_scale", "99", "guidance scale must be a number from 0 to 20"),
        ("guidance_rescale", "1.5", "guidance rescale must be a number from 0 to 1"),
        ("sampler", "unipc", "unknown sampler 'unipc'"),
        ("schedule_type", "Karras, Turbo", "schedule_type axis: unknown schedule type 'Turbo'"),
        ("style", "Baroque", "unknown style 'Baroque'"),
        ("lora:missing", "1", "unknown axis 'lora:missing'"),
        ("width", "64", "unknown axis 'width'"),
        ("seed", " , ", "the seed axis has no values"),
        ("seed", "0-64", "at most 64 values"),
    ],
)
def test_bad_values_are_named(name, text, message):
    with pytest.raises(ValueError, match=message):
        grid.parse_axis(name, text)


def test_cells_run_row_by_row_and_at_most_64():
    x, y = grid.parse_axis("seed", "1, 2, 3"), grid.parse_axis("guidance_scale", "3, 5")
    def with_value(settings, name, value):
        return settings | {name: value}

    cells = grid.cells({"seed": 0, "guidance_scale": 1.0, "prompt": "p"}, x, y, with_value)
    assert [(c["seed"], c["guidance_scale"]) for c in cells] == [(1, 3), (2, 3), (3, 3), (1, 5), (2, 5), (3, 5)]
    assert all(c["prompt"] == "p" for c in cells)
    with pytest.raises(ValueError, match="65 cells; at most 64"):
        grid.cells({}, grid.parse_axis("seed", "1-13"), grid.parse_axis("seed", "1-5"), with_value)


def test_cells_with_the_same_key_share_calls_of_at_most_the_batch_limit():
    assert grid.calls(["a"] * 6, max_images=8) == [[0, 1, 2, 3, 4, 5]]
    assert grid.calls(["a", "b", "a", "b", "a"], max_images=2) == [[0, 2], [4], [1, 3]]


def test_the_grid_image_has_its_cells_in_order_under_their_labels(tmp_path):
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255)]
    cells = [Image.new("RGB", (64, 48), c) for c in colours]
    x, y = grid.parse_axis("seed", "1-3"), grid.parse_axis("guidance_scale", "3, 5")
    sheet = grid.labelled(cells, x, y, [f"cell {i}" for i in range(6)])
    left, top = sheet.width - 3 * 64, sheet.height - 2 * 48
    assert left > 0 and top > 0
    pixels = np.asarray(sheet)
    for i, colour in enumerate(colours):
        row, column = divmod(i, 3)
        assert tuple(pixels[top + row * 48 + 24, left + column * 64 + 32]) == colour
    assert (pixels[:top, left:] < 128).any(), "the x labels are written above the cells"
    info = PngImagePlugin.PngInfo()
    for key, value in sheet.info.items():
        info.add_text(key, value)
    sheet.save(tmp_path / "grid.png", pnginfo=info)
    saved = Image.open(tmp_path / "grid.png")
    assert saved.text["parameters"] == "cell 0" and json.loads(saved.text["grid"])[5] == "cell 5"


LONG_LABELS = (
    "a red circle on a white background",
    "a large yellow triangle at the top on a purple background",
    "supercalifragilisticexpialidocious " * 4,
)


@pytest.mark.parametrize("size", [64, 1024])
def test_every_label_stays_inside_its_own_column_or_row(size):
    """Long labels (the `shapes` model's prompts at 64x64, a word wider than a column) are drawn each
    inside its own column's header or its own row's label box, never over a neighbour or a cell;
    drawn one at a time, the others empty, so that each label's pixels are its own."""
    colour = (40, 90, 200)
    columns, rows = len(LONG_LABELS), 2
    cells = [Image.new("RGB", (size, size), colour)] * (columns * rows)

    def sheet(x_labels, y_labels):
        # Unnamed axes: no titles, only the labels draw.
        x, y = grid.Axis("", tuple(range(columns)), x_labels), grid.Axis("", tuple(range(rows)), y_labels)
        pixels = np.asarray(grid.labelled(cells, x, y, ["p"] * len(cells)))
        left, top = pixels.shape[1] - columns * size, pixels.shape[0] - rows * size
        assert (pixels[top:, left:] == colour).all(), "no label is drawn over the cells"
        ink = (pixels < 200).any(axis=2)
        ink[top:, left:] = False
        return ink, left, top

    for c in range(columns):
        ink, left, top = sheet(tuple(label if i == c else "" for i, label in enumerate(LONG_LABELS)), ("", ""))
        inside = np.zeros_like(ink)
        inside[:top, left + c * size:left + (c + 1) * size] = True
        assert ink[inside].any() and not ink[~inside].any(), f"column {c}'s label leaves its column"
    for r in range(rows):
        ink, left, top = sheet(("",) * columns, tuple(LONG_LABELS[2 * r] if i == r else "" for i in range(rows)))
        inside = np.zeros_like(ink)
        inside[top + r * size:top + (r + 1) * size, :left] = True
        assert ink[inside].any() and not ink[~inside].any(), f"row {r}'s label leaves its row"


def test_long_words_are_broken_and_long_labels_end_in_an_ellipsis():
    """At 64x64 (58 pixels inside a column) "background" needs a smaller font than the grid's 12 px:
    the axis takes one, down to 10 px; a word too long even then is broken with hyphens."""
    label = "a red circle on a white background"
    font = grid._axis_font([label, "supercalifragilisticexpialidocious"], 58, 12)
    assert font.size == 10 and grid._wrap(label, 58, font, 6)[-1] == "background"
    broken = grid._wrap("supercalifragilisticexpialidocious", 58, font, 6)
    assert len(broken) > 1 and all(line.endswith("-") for line in broken[:-1])
    assert "".join(line.removesuffix("-") for line in broken) == "supercalifragilisticexpialidocious"
    cut = grid._wrap("word " * 40, 58, font, 3)
    assert len(cut) == 3 and cut[-1].endswith("\u2026") and all(font.getlength(line) <= 58 for line in cut)
