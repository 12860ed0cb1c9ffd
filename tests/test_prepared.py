"""A request prepared once (`Pipeline.prepare`, `sdxl.engine.prepared`): checked, tokenized, its
programs named; merged prepared requests are what a merged batch runs. Nothing here compiles."""

import dataclasses

import jax
import numpy as np
import pytest

from sdxl.engine.pipeline import Pipeline
from sdxl.engine.prepared import PreparedRequest
from sdxl.engine.request import Request


@pytest.fixture(scope="module")
def pipe():
    return Pipeline.from_pretrained("tiny", dtype="float32", max_steps=8)


def _request(prompt="a fox", n=4, **changes) -> Request:
    request = Request.from_prompt(prompt, num_images=n, steps=4, height=64, width=64)
    return dataclasses.replace(request, **changes)


def test_a_request_is_prepared_once_with_what_the_devices_take(pipe):
    prepared = pipe.prepare(_request(sampler="DPM++ 2M", guidance_scales=(1.0, 2.0, 3.0, 4.0)), output_type="np")
    request, program = prepared.request, prepared.program
    assert request.sampler == "dpmpp_2m" and request.loras == (), "checked and converted"
    assert (program.batch, program.sampler, program.output_type, program.guided) == (4, "dpmpp_2m", "np", True)
    assert prepared.tokens.ids.shape[0] == 4 and prepared.programs == (program,)
    assert prepared.steps == (0, 4) and prepared.steps_run == 4
    edit = pipe.prepare(_request(images=np.zeros((4, 64, 64, 3), np.uint8), strength=0.5))
    assert edit.steps == (2, 4) and edit.program.start_from == "image", "a strength skips the first steps"
    with pytest.raises(ValueError, match="steps must be an integer from 1 to 8"):
        pipe.prepare(_request(steps=9))


def test_merged_requests_run_one_program_at_the_merged_batch(pipe):
    short, long = pipe.prepare(_request(n=3)), pipe.prepare(_request("a fox, " * 40, n=2, guidance_scales=(1.0,) * 2))
    assert short.batch_key != long.batch_key, "other guidance and prompt lengths: the queue keeps them apart"
    assert long.programs_at(8) == (dataclasses.replace(long.program, batch=8),)
    merged = PreparedRequest.merged([short, long], batch=8)
    assert merged.program == dataclasses.replace(short.program, batch=8, chunks=long.program.chunks, guided=True)
    assert merged.request.prompts == (*short.request.prompts, *long.request.prompts)
    assert merged.tokens.num_chunks == long.tokens.num_chunks > 1 and len(merged.tokens.ids) == 5
    assert merged.steps == short.steps


def test_a_handoff_is_prepared_as_the_base_models_part_and_the_refiners(pipe):
    base = Pipeline.from_pretrained("tiny", dtype="float32", max_steps=8)
    refiner = Pipeline.from_pretrained("tiny-refiner", dtype="float32", max_steps=8, devices=jax.devices())
    base.set_refiner(refiner)
    prepared = base.prepare(_request(refine_from=0.5))
    first, second = prepared.programs
    assert (first.spec, first.output_type, second.spec, second.start_from) == (
        base.spec, "latent", refiner.spec, "latents")
    assert prepared.steps_run == prepared.steps[1] - prepared.steps[0] + prepared.refined.steps_run == 4
    assert prepared.refined.tokens.ids.shape[2] == 1, "the refiner reads the prompts with its one text encoder"
    with pytest.raises(ValueError, match="no refiner is loaded"):
        pipe.prepare(_request(refine_from=0.5))
