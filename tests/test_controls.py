"""`Control`, a ControlNet's per-image input (`sdxl.engine.controls`): made from a picture once per
picture, size and preprocessor, and checked against the ControlNet it steers in one place."""

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from sdxl.engine import controls
from sdxl.engine.control_maps import canny
from sdxl.engine.controls import Control


def _picture(width=200, height=100) -> np.ndarray:
    """A white square on black, right of centre, wider than tall."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[20:70, 120:170] = 255
    return pixels


def _controlnet(channels=3, modes=None):
    config = SimpleNamespace(conditioning_channels=channels)
    if modes is not None:
        config.num_control_type = modes
    return SimpleNamespace(name="cn", config=config)


def test_a_picture_is_cropped_or_resized_to_the_output_then_made_a_map_there():
    picture = _picture()
    cropped = Control.of(picture, 64, 64, preprocessor="canny", canny_thresholds=(50, 150), scale=0.5)
    centre = np.asarray(Image.fromarray(picture).resize((64, 64), Image.Resampling.LANCZOS, box=(50, 0, 150, 100)))
    np.testing.assert_array_equal(cropped.map, canny(centre, 50, 150))
    assert (cropped.made_by.name, cropped.made_by.canny_thresholds, cropped.scale) == ("canny", (50, 150), 0.5)
    squashed = Control.of(picture, 64, 64, fit="resize")
    np.testing.assert_array_equal(squashed.map, np.asarray(Image.fromarray(picture).resize((64, 64),
                                                                                          Image.Resampling.LANCZOS)))
    floats = Control.of(picture / np.float32(255), 64, 64, fit="resize")
    assert floats.map.dtype == np.float32 and 0 <= floats.map.min() and floats.map.max() <= 1, "read as diffusers reads"
    with pytest.raises(ValueError, match="fit must be one of crop, resize"):
        Control.of(picture, 64, 64, fit="pad")
    with pytest.raises(ValueError, match="preprocessor must be one of canny, none"):
        Control.of(picture, 64, 64, preprocessor="depth")


def test_a_map_is_made_once_per_picture_size_and_preprocessor(monkeypatch):
    made = []
    resized = controls.images.resized
    monkeypatch.setattr(controls.images, "resized", lambda *a, **k: made.append(a[1:3]) or resized(*a, **k))
    picture = _picture(201, 99)  # a content no other test uses: nothing kept from before
    first = Control.of(picture, 64, 32, preprocessor="canny")
    again = Control.of(picture.copy(), 64, 32, preprocessor="canny", scale=0.3)  # the same content, another array
    assert again.map is first.map and len(made) == 1 and again.scale == 0.3
    assert not first.map.flags.writeable, "shared by every request that asks for it"
    Control.of(picture, 32, 32, preprocessor="canny")
    Control.of(picture, 64, 32)
    assert len(made) == 3, "another size, another preprocessor: another map"


def test_a_control_is_checked_against_the_controlnet_it_steers():
    control = Control.of(_picture(), 64, 64, mode="depth")
    assert control.checked(_controlnet(), 64, 64).mode is None, "a plain ControlNet has no mode"
    assert control.checked(_controlnet(modes=6), 64, 64).mode == 1
    refusals = [
        (dict(), _controlnet(channels=1), "cn takes 1-channel control images"),
        (dict(), _controlnet(), "a control map must be \\[height, width, C\\] = \\[32, 64, 'C'\\]"),
        (dict(scale=5), _controlnet(), "ControlNet scale must be a number from 0 to 4, got 5"),
        (dict(start=0.6, end=0.6), _controlnet(), "a ControlNet's start \\(0.6\\) must be below its end"),
        (dict(end="late"), _controlnet(), "ControlNet end must be a number from 0 to 1"),
        (dict(mode=None), _controlnet(modes=6), "cn is a ControlNet Union: say what its control image is"),
        (dict(mode="tile"), _controlnet(modes=6), "cn knows 6 control modes .* not mode 6 tile"),
    ]
    for changes, controlnet, message in refusals:
        height = 32 if "\\[32" in message else 64
        with pytest.raises(ValueError, match=message):
            Control.of(_picture(), 64, 64, **changes).checked(controlnet, height, 64)
