"""The demo's ControlNet panel as requests (`sdxl.serving.forms.ControlForm`), without a server: maps made at the
output's size, settings per image, grids over the scale in one call, PNG parameters as A1111's
ControlNet extension writes them, and bad input refused with a sentence."""

import dataclasses

import numpy as np
import pytest
from PIL import Image

from sdxl.serving.models import Model
from sdxl.checkpoints import resolve
from sdxl.checkpoints.random_models import write_controlnet
from sdxl.engine import images, infotext
from sdxl.engine.control_maps import canny
from sdxl.engine.pipeline import Pipeline
from sdxl.serving import grid
from sdxl.serving.demo import DemoService
from sdxl.serving.forms import ControlForm, Settings, control_parameters


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("controlnets")
    spec = Pipeline.from_pretrained("tiny", dtype="float32").spec
    sources = [str(write_controlnet(folder / name, spec, seed=i)) for i, name in enumerate(("canny-cn", "depth-cn"))]
    return Pipeline.from_pretrained("tiny", dtype="float32", controlnet=sources)


@pytest.fixture(scope="module")
def service(pipe):
    return DemoService([Model("tiny", pipe)], max_images_per_core=2)


def _picture(width=200, height=100) -> Image.Image:
    """A white square on black, off centre, wider than tall."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[20:70, 120:170] = 255
    return Image.fromarray(pixels)


def test_panel_fields_arrive_by_their_parameter_names(service):
    assert control_parameters(2)[1]["scale"] == "control_scale_2" and control_parameters(1)[0]["picture"] == \
        "control_image"
    picture = _picture()
    settings = service.settings({"prompt": "a fox", "control_image": picture, "control_preprocessor": "canny",
                                 "control_scale": 0.5, "control_end_2": 0.8, "canny_low_2": 30})
    first, second = settings.controls
    assert (first.picture, first.preprocessor, first.scale) == (picture, "canny", 0.5)
    assert (second.picture, second.end, second.canny_low, second.scale) == (None, 0.8, 30, 1.0)


def test_control_maps_are_cropped_to_the_output_and_made_there(service):
    width, height = service.sizes[0]
    pictures = (_picture(), _picture())
    settings = Settings(prompt="a fox", controls=(ControlForm(pictures[0], "canny", scale=0.6, end=0.7),
                                                   ControlForm(pictures[1], "none", start=0.2)))
    request = service.images(settings).request
    n = len(request)
    assert len(request.controls) == n
    assert all(c is first for per in request.controls for c, first in zip(per, request.controls[0])), "one each"
    edges, given = request.controls[0]
    assert edges.map.shape == given.map.shape == (height, width, 3)
    cropped = images.pixels(pictures[0].resize((width, height), Image.Resampling.LANCZOS,
                                                box=(50, 0, 150, 100)))  # the centre square of 200x100
    np.testing.assert_array_equal(given.map, cropped)
    np.testing.assert_array_equal(edges.map, canny(cropped, 100, 200))
    assert edges.map.any() and set(np.unique(edges.map)) <= {0, 255}
    assert [(c.scale, c.start, c.end) for c in request.controls[0]] == [(0.6, 0.0, 0.7), (1.0, 0.2, 1.0)]
    assert [c.made_by.name for c in request.controls[0]] == ["canny", "none"]
    assert service.images(Settings(prompt="a fox")).request.controls is None, "no pictures: no ControlNet"


def test_png_parameters_record_each_controlnet_as_the_a1111_extension(service):
    settings = Settings(prompt="a fox", controls=(ControlForm(_picture(), "canny", canny_low=50, scale=0.7, end=0.8),
                                                   ControlForm(_picture(), "none")))
    request = service.images(settings)
    text = service.png_parameters(request, 0)
    assert ('ControlNet 0: "Module: canny, Model: canny-cn, Weight: 0.7, Threshold A: 50, Threshold B: 200, '
            'Guidance Start: 0, Guidance End: 0.8"') in text
    assert 'ControlNet 1: "Module: none, Model: depth-cn, Weight: 1, Guidance Start: 0, Guidance End: 1"' in text
    found, unused = infotext.read_infotext(text)
    assert found["prompt"] == "a fox", "the quoted entries leave the rest readable"
    assert unused == ("Model", "ControlNet 0", "ControlNet 1"), "generate applies no ControlNet from a text"


def test_a_grid_over_the_controlnet_scale_is_one_device_call(service, monkeypatch):
    settings = Settings(prompt="a fox", seed=3, controls=(ControlForm(_picture(), "canny"), ControlForm(_picture())))
    resizes, resize = [], Image.Image.resize
    monkeypatch.setattr(Image.Image, "resize", lambda *a, **k: resizes.append(a[1]) or resize(*a, **k))
    plan = service.grid(settings, "control_scale", "0, 0.5, 1", "seed", "1-2")
    assert len(resizes) <= 2, "each picture is resized at most once for the grid (its map may be kept), not once a cell"
    assert len(plan.requests) == 1, "scales are per-image inputs: the cells share a call"
    (call,) = plan.requests
    scales = [[control.scale for control in per] for per in call.request.controls]
    assert [first for first, _ in scales] == [0.0, 0.5, 1.0] * 2
    assert all(first == second for first, second in scales), "the axis sets every ControlNet's scale"
    maps = {id(control.map) for per in call.request.controls for control in per}
    assert len(maps) == 2, "every cell shares the two maps"


@pytest.mark.parametrize("settings, message", [
    (Settings(prompt="a fox", controls=(ControlForm(_picture()), ControlForm())),
     "2 ControlNets are loaded (.*): give a control image for each, or none"),
    (Settings(prompt="a fox", controls=(ControlForm(_picture(), "sobel"), ControlForm(_picture()))),
     "preprocessor must be one of canny, none"),
    (Settings(prompt="a fox", controls=(ControlForm(_picture(), "canny", canny_low=0), ControlForm(_picture()))),
     "Canny's low threshold must be an integer from 1 to 255"),
    (Settings(prompt="a fox", controls=(ControlForm(_picture(), scale=9), ControlForm(_picture()))),
     "ControlNet scale must be a number from 0 to 4, got 9"),
    (Settings(prompt="a fox", controls=(ControlForm(_picture(), start=0.5, end=0.5), ControlForm(_picture()))),
     r"a ControlNet's start \(0.5\) must be below its end \(0.5\)"),
])
def test_bad_panel_input_is_refused_with_a_sentence(service, settings, message):
    with pytest.raises(ValueError, match=message):
        service.images(settings)


def test_a_controlnet_axis_needs_a_control_image(service):
    with pytest.raises(ValueError, match="the control scale axis needs a control image"):
        service.grid(Settings(prompt="a fox"), "control_scale", "0, 1", None, "")
    assert "control_end" in grid.CONTROL_AXES


@pytest.mark.compiles
def test_one_pipeline_renders_with_and_without_its_controlnets(service):
    plain = service.images(Settings(prompt="a fox", steps=2))
    steered = service.images(Settings(prompt="a fox", steps=2, controls=(ControlForm(_picture(), "canny"),
                                                                          ControlForm(_picture()))))
    without, with_control = (service.pipe.render(r).images for r in (plain, steered))
    assert np.abs(without.astype(float) - with_control).mean() > 1, "the control images steer"


@pytest.fixture(scope="module")
def union_service(tmp_path_factory):
    """The demo with a random 6-mode ControlNet Union for the tiny model, written by diffusers."""
    from diffusers import ControlNetUnionModel, UNet2DConditionModel

    from reference import randomize_

    folder = tmp_path_factory.mktemp("union") / "controlnet-union-tiny"
    unet = UNet2DConditionModel.from_pretrained(resolve("tiny").folder / "unet")
    width = unet.config.block_out_channels[0]
    layout = ControlNetUnionModel.from_unet(unet, conditioning_embedding_out_channels=(4, 8, 8, 16),
                                            load_weights_from_unet=False)
    union = ControlNetUnionModel.from_config(layout.config, num_control_type=6, num_trans_channel=width,
                                             num_proj_channel=width, num_trans_head=4)
    randomize_(union, 7)
    union.save_pretrained(folder, safe_serialization=True)
    pipe = Pipeline.from_pretrained("tiny", dtype="float32", controlnet=str(folder))
    return DemoService([Model("tiny", pipe)], max_images_per_core=1)


@pytest.mark.compiles
def test_a_controlnet_union_takes_its_mode_from_the_panel(union_service):
    service = union_service
    assert service.control_parameters[0]["mode"] == "control_mode"
    settings = service.settings({"prompt": "a fox", "steps": 2, "control_image": _picture(),
                                 "control_preprocessor": "canny", "control_mode": "canny"})
    request = service.images(settings)
    assert [per[0].mode for per in request.request.controls] == [3] * len(request)
    assert "Union Control Type: canny" in service.png_parameters(request, 0)
    depth = service.images(dataclasses.replace(settings, controls=(dataclasses.replace(settings.controls[0],
                                                                                        mode="depth"),)))
    canny_images, depth_images = (service.pipe.render(r).images for r in (request, depth))
    assert np.abs(canny_images.astype(float) - depth_images).mean() > 1, "the mode steers"
    with pytest.raises(ValueError, match="is a ControlNet Union: say what its control image is"):
        service.images(dataclasses.replace(settings, controls=(dataclasses.replace(settings.controls[0],
                                                                                    mode=None),)))
    with pytest.raises(ValueError, match="a control mode is one of 0 openpose"):
        service.images(dataclasses.replace(settings, controls=(dataclasses.replace(settings.controls[0],
                                                                                    mode="sobel"),)))
