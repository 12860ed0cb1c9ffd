"""The demo's image prompt panel as requests (`Settings.ip_adapter_*`), without a server: the chosen IP-Adapter
takes the picture and the others sit out, grids over the scale in one call, PNG parameters as A1111's ControlNet
extension writes an IP-Adapter unit and read back by reuse, and bad input refused with a sentence."""

import numpy as np
import pytest
from PIL import Image

from sdxl.serving.models import Model
from sdxl.checkpoints.random_models import write_ip_adapter
from sdxl.engine import infotext
from sdxl.engine.pipeline import Pipeline
from sdxl.serving import grid
from sdxl.serving.demo import DemoService
from sdxl.serving.forms import Settings


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ip")
    pipe = Pipeline.from_pretrained("tiny", dtype="float32")
    write_ip_adapter(folder, pipe.spec.unet, kinds=("plain", "plus"))
    pipe.load_ip_adapter(str(folder), "sdxl_models", ["ip-adapter.safetensors", "ip-adapter-plus.safetensors"])
    return DemoService([Model("tiny", pipe)], max_images_per_core=2)


def _picture() -> Image.Image:
    return Image.fromarray(np.full((60, 90, 3), (200, 40, 40), np.uint8))


def test_the_chosen_adapter_takes_the_picture_and_the_others_sit_out(service):
    assert service.choices.ip_adapters == ["ip-adapter", "ip-adapter-plus"]
    assert service.choices.ip_adapter_layers == [("All layers", "all")], "the tiny UNet has no InstantStyle blocks"
    settings = service.settings({"prompt": "a fox", "ip_adapter_image": _picture(), "ip_adapter": "ip-adapter-plus",
                                 "ip_adapter_scale": 0.7})
    request = service.images(settings).request
    assert len(request.image_prompts) == len(request)
    plain, plus = request.image_prompts[0]
    assert (plain.scale, plus.scale) == (0.0, 0.7) and plain.picture is plus.picture
    assert not plain.scales.any() and np.allclose(plus.scales, 0.7)
    assert service.images(Settings(prompt="a fox")).request.image_prompts is None, "no picture: no image prompt"


@pytest.mark.parametrize("fields, message", [
    ({"ip_adapter": "ip-adapter-faceid"}, "IP-Adapter must be one of"),
    ({"ip_adapter_layers": "style"}, "the style preset scales SDXL's blocks (InstantStyle's), which this model's "
                                     "UNet lacks"),
    ({"ip_adapter_scale": 3}, "IP-Adapter scale must be"),
])
def test_bad_image_prompt_settings_are_one_sentence(service, fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        service.submission("generate", {"prompt": "a fox", "ip_adapter_image": _picture(), **fields})


def test_a_grid_over_the_image_prompt_scale_is_one_call_and_needs_a_picture(service):
    form = {"prompt": "a fox", "x_axis": grid.IP_ADAPTER_AXIS, "x_values": "0, 0.5, 1", "y_axis": "",
            "y_values": ""}
    with pytest.raises(ValueError, match=r"the image prompt scale axis needs a picture \(Image prompt panel\)"):
        service.submission("grid", form)
    plan = service.submission("grid", {**form, "ip_adapter_image": _picture()}).grid
    assert len(plan.requests) == 1, "the scale is an input of one program"
    (call,) = plan.requests
    assert [prompts[0].scale for prompts in call.request.image_prompts[:3]] == [0.0, 0.5, 1.0]


def test_png_parameters_record_an_ip_adapter_unit_and_reuse_reads_it_back(service):
    settings = Settings(prompt="a fox", ip_adapter_image=_picture(), ip_adapter="ip-adapter-plus",
                        ip_adapter_scale=0.8)
    text = service.png_parameters(service.images(settings), 0)
    assert ('ControlNet 0: "Module: ip-adapter_clip_h, Model: ip-adapter-plus, Weight: 0.8, Guidance Start: 0, '
            'Guidance End: 1"') in text, "the adapter sitting out is left out"
    assert "ControlNet 1" not in text and "IP-Adapter layers" not in text
    fields, said = service.reused(text)
    assert (fields["ip_adapter"], fields["ip_adapter_scale"], fields["ip_adapter_layers"]) == (
        "ip-adapter-plus", 0.8, "all")
    assert "ip_adapter_image" not in fields and "the image prompt's ip-adapter-plus at 0.8 (not its picture)" in said
    assert "Not used" not in said
    # A1111's unit for an adapter not loaded (with the extension's hash) is named, as a model not loaded is.
    a1111 = text.replace("Model: ip-adapter-plus", "Model: ip-adapter_sdxl [7d943a46]")
    fields, said = service.reused(a1111)
    assert "ip_adapter" not in fields
    assert "Not used: IP-Adapter ip-adapter_sdxl (loaded: ip-adapter, ip-adapter-plus)" in said
    found = infotext.read_parameters(text, service.pipe)
    assert found["ip_adapter_scale"] == [0.0, 0.8], "generate's argument: one scale per adapter"
