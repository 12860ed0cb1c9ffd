"""Per-image conditionings through one door (`sdxl.engine.conditionings`): each kind's names line up
with `Request`, `Limits` and `GenerateProgram`, and the front ends' per-image tuples are made and
checked the same way for every kind."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from sdxl.checkpoints import BUILTIN_CONFIGS, ModelSpec
from sdxl.engine import conditionings
from sdxl.engine.conditionings import KINDS, per_image, per_unit, program_fields
from sdxl.engine.controls import CONTROLS, Control
from sdxl.engine.image_prompts import IMAGE_PROMPTS
from sdxl.engine.program import GenerateProgram
from sdxl.engine.request import Limits, Request

SPEC = ModelSpec.from_folder(BUILTIN_CONFIGS / "sdxl-base-1.0")


def _controlnet(name="cn"):
    return SimpleNamespace(name=name, config=SimpleNamespace(conditioning_channels=3))


def _request(n=2, **changes) -> Request:
    return dataclasses.replace(Request.from_prompt("a fox", num_images=n, height=64, width=64), **changes)


def test_each_kind_names_a_request_field_a_limits_field_and_a_program_field():
    for kind in KINDS:
        assert kind.field in {f.name for f in dataclasses.fields(Request)}
        assert kind.units in {f.name for f in dataclasses.fields(Limits)}
        assert kind.units in {f.name for f in dataclasses.fields(GenerateProgram)}
    assert conditionings.FIELDS == ("controls", "image_prompts")


def test_one_value_for_every_image_is_one_object_and_lists_go_per_image():
    a, b, c = (Control(np.zeros((64, 64, 3), np.uint8)) for _ in range(3))
    shared = per_image(CONTROLS, [a, [b, c]], 2, "control_image")
    assert shared == ((a, b), (a, c)) and shared[0][0] is shared[1][0]
    with pytest.raises(ValueError, match=r"control_image: give one control image for every image, or one per image "
                                         r"\(3\), got 2"):
        per_image(CONTROLS, [[b, c]], 3, "control_image")
    assert per_unit(IMAGE_PROMPTS, ["p", "q"], 1, "ip_adapter_image") == [["p", "q"]], "one unit: a list per image"
    assert per_unit(IMAGE_PROMPTS, ["p", "q"], 2, "ip_adapter_image") == ["p", "q"]
    with pytest.raises(ValueError, match=r"ip_adapter_image: give a list with one entry per IP-Adapter \(2\)"):
        per_unit(IMAGE_PROMPTS, "p", 2, "ip_adapter_image")


def test_values_are_checked_once_against_their_units_in_one_sentence():
    limits = Limits(SPEC, controlnets=(_controlnet("a"), _controlnet("b")))
    control = Control.of(np.zeros((64, 64, 3), np.uint8), 64, 64, scale=0.5)
    checked = conditionings.validated(_request(controls=((control, control),) * 2), limits, 64, 64)
    assert checked["image_prompts"] is None
    (first, second), again = checked["controls"]
    assert first is second and again == (first, second), "each value is checked once, whatever shares it"
    with pytest.raises(ValueError, match=r"2 ControlNet\(s\) are loaded \(a, b\): give one control image for each, "
                                         "not 1"):
        conditionings.validated(_request(controls=((control,),) * 2), limits, 64, 64)
    with pytest.raises(ValueError, match=r"controls: need one per image \(2\), one per ControlNet each; got 1"):
        conditionings.validated(_request(controls=((control, control),)), limits, 64, 64)
    with pytest.raises(ValueError, match="no IP-Adapter is loaded to take an image prompt"):
        conditionings.validated(_request(image_prompts=((object(),),) * 2), limits, 64, 64)


def test_a_program_has_the_units_of_the_kinds_a_request_gives():
    limits = Limits(SPEC, controlnets=(_controlnet(),), ip_adapters=(SimpleNamespace(name="ip", config="ip config"),))
    control = Control(np.zeros((64, 64, 3), np.uint8))
    steered = _request(controls=((control,),) * 2)
    assert program_fields(steered, limits) == {"controlnets": (limits.controlnets[0].config,), "ip_adapters": ()}
    assert program_fields(_request(), limits) == {"controlnets": (), "ip_adapters": ()}
    assert conditionings.counts(steered) == (1, 0) and conditionings.counts(_request()) == (0, 0)
