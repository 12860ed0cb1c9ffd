"""A loaded model as a value (`sdxl.engine.model`): a prepared request renders with the snapshot it was
prepared against, whatever the pipeline loads, sets or unloads between its prepare and its render."""

import dataclasses

import numpy as np
import pytest

from test_embeddings import write_sdxl_embedding
from sdxl.checkpoints import lora
from sdxl.checkpoints.random_models import IP_ADAPTER_FILES, write_ip_adapter
from sdxl.engine.image_prompts import ImagePrompt
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.request import Request

pytestmark = pytest.mark.compiles

SIZE, STEPS = 64, 2
PICTURE = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loaded")
    pipe = Pipeline.from_pretrained("tiny", dtype="float32", max_steps=STEPS)
    write_ip_adapter(folder / "ip", pipe.spec.unet, kinds=("plain",))
    lora.write_random(folder / "style.safetensors", pipe.spec, seed=1)
    write_sdxl_embedding(folder / "shiny.safetensors", vectors=2, seed=3, widths=(32, 32))
    return folder


@pytest.fixture
def pipe(files):
    """A fresh pipeline with an IP-Adapter, a LoRA and an embedding loaded."""
    pipe = Pipeline.from_pretrained("tiny", dtype="float32", max_steps=STEPS)
    pipe.load_ip_adapter(str(files / "ip"), subfolder="sdxl_models", weight_name=IP_ADAPTER_FILES["plain"])
    pipe.set_ip_adapter_scale(0.8)
    pipe.set_loras({str(files / "style.safetensors"): 0.7})
    pipe.load_textual_inversion(files / "shiny.safetensors")
    return pipe


def _request(pipe: Pipeline, image_prompt: bool = True) -> Request:
    """Two images of a prompt naming the embedding, with an image prompt at the pipeline's scale (as `generate`
    makes one)."""
    request = Request.from_prompt("a shiny red cube", num_images=2, seed=5, steps=STEPS, height=SIZE, width=SIZE)
    prompts = ((ImagePrompt.of(PICTURE, pipe.ip_adapter_scales()[0]),),) * 2 if image_prompt else None
    return dataclasses.replace(request, image_prompts=prompts)


CHANGES = {
    "a LoRA's scale": lambda pipe, files: pipe.set_loras({str(files / "style.safetensors"): -1.5}),
    "no LoRA": lambda pipe, files: pipe.set_loras({}),
    "the IP-Adapter's scale": lambda pipe, files: pipe.set_ip_adapter_scale(0.1),
    "the IP-Adapter unloaded": lambda pipe, files: pipe.unload_ip_adapter(),
    "an embedding named in the prompt": lambda pipe, files: pipe.load_textual_inversion(
        files / "shiny.safetensors", token="cube"),
}


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_what_loads_between_prepare_and_render_never_changes_a_prepared_picture(pipe, files, change):
    prepared = pipe.prepare(_request(pipe))
    expected = pipe.render(pipe.prepare(_request(pipe))).images
    CHANGES[change](pipe, files)
    np.testing.assert_array_equal(pipe.render(prepared).images, expected)
    changed = pipe.render(pipe.prepare(_request(pipe, image_prompt=change != "the IP-Adapter unloaded"))).images
    assert np.abs(changed.astype(int) - expected).max() > 0, "the change applies to requests prepared after it"


def test_a_snapshot_is_a_value_that_setters_replace_and_never_change(pipe, files):
    before = pipe.model
    params, prompts, scales = before.params, before.prompts, before.ip_adapter_scales
    pipe.set_ip_adapter_scale(0.3)
    pipe.unload_ip_adapter()
    pipe.load_textual_inversion(files / "shiny.safetensors", token="other")
    pipe.set_loras({})
    assert pipe.model is not before
    assert (before.params, before.prompts, before.ip_adapter_scales) == (params, prompts, scales)
    assert "ip_adapters" in before.params and "ip_adapters" not in pipe.params
    assert [e.name for e in before.prompts.embeddings] == ["shiny"]
    assert [e.name for e in pipe.prompts.embeddings] == ["shiny", "other"]
    assert pipe.model.params["unet"] is before.params["unet"], "what a change keeps is shared, not copied"


def test_requests_of_two_snapshots_never_share_a_device_call(pipe, files):
    first = pipe.prepare(_request(pipe, image_prompt=False))
    pipe.load_textual_inversion(files / "shiny.safetensors", token="cube")
    second = pipe.prepare(_request(pipe, image_prompt=False))
    assert first.model is not second.model
    assert first.batch_key != second.batch_key
    assert pipe.prepare(_request(pipe, image_prompt=False)).batch_key == second.batch_key
