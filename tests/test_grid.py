import json

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from sdxl import grid


def test_values_are_comma_separated_or_one_per_line_with_ranges_for_seeds_and_steps():
    assert grid.parse_axis("seed", "1-3, 7").values == (1, 2, 3, 7)
    assert grid.parse_axis("steps", "10\n20-22").values == (10, 20, 21, 22)
    assert grid.parse_axis("guidance_scale", "1, 4.5 ,7").values == (1.0, 4.5, 7.0)
    axis = grid.parse_axis("sampler", "euler, Euler a, DPM++ 2M Karras")
    assert axis.values == ("euler", "euler_ancestral", "dpmpp_2m_karras")
    assert axis.labels == ("Euler", "Euler a", "DPM++ 2M Karras")
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
        ("sampler", "heun", "unknown sampler 'heun'"),
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
