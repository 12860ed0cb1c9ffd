"""Several models in one demo (`sdxl.serving.models`, the launch's `load_models`, `DemoService`'s `model`):
each request draws with the model it names, as a demo of that model alone draws it."""

import argparse

import numpy as np
import pytest

from sdxl.checkpoints import CheckpointError, lora
from sdxl.checkpoints.hashes import sha256
from sdxl.checkpoints.random_models import configs_of, ensure_checkpoint, write_checkpoint, write_single_file
from sdxl.engine import infotext
from sdxl.engine.compilation import CompileCounter
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.residency import DEVICES, HOST
from sdxl.serving import launch, results
from sdxl.serving.demo import DemoService, Submission
from sdxl.serving.forms import COMPARE_MODELS, Settings
from sdxl.serving.models import Model
from sdxl.serving.options import add_shared_options, demo_parser

pytestmark = pytest.mark.compiles


@pytest.fixture(scope="module")
def service() -> DemoService:
    first = Pipeline.from_pretrained("tiny", dtype="float32")
    second = Pipeline.from_pretrained("tiny-sd1", dtype="float32", executables=first.executables)
    return DemoService([Model("tiny", first), Model("tiny-sd1", second)], max_images_per_core=1)


@pytest.fixture(scope="module")
def alone(service) -> dict[str, DemoService]:
    """A demo of each model alone: its own pipeline (its own weights), running the service's compiled programs,
    so that each program compiles once in this module (a program is the same whichever pipeline runs it)."""
    executables = service.pipe.executables
    return {name: DemoService([Model(name, Pipeline.from_pretrained(name, dtype="float32", executables=executables))],
                              max_images_per_core=1)
            for name in ("tiny", "tiny-sd1")}


def _drawn(service: DemoService, prepared) -> np.ndarray:
    return service.queue.wait(service.queue.submit(prepared)).images


def test_each_request_draws_with_the_model_it_names_as_that_model_alone_draws(service, alone):
    settings = Settings(prompt="a red circle", seed=3, steps=3, guidance_scale=3.0)
    for name in ("tiny-sd1", "tiny", "tiny-sd1"):  # and back again
        prepared = service.images(Settings(**{**settings.__dict__, "model": name}))
        assert prepared.model.name == name
        np.testing.assert_array_equal(_drawn(service, prepared), _drawn(alone[name], alone[name].images(settings)))
    default = service.images(settings)
    assert default.model.name == "tiny", "no model named: the first"
    different = [_drawn(service, service.images(Settings(**{**settings.__dict__, "model": name})))
                 for name in ("tiny", "tiny-sd1")]
    assert np.abs(different[0].astype(int) - different[1].astype(int)).mean() > 1, "two models, two pictures"


def test_an_unknown_model_is_refused_with_the_loaded_ones_named(service):
    with pytest.raises(ValueError, match=r"no model 'sdxl' is loaded; the loaded ones are tiny, tiny-sd1"):
        service.images(Settings(prompt="a fox", model="sdxl"))
    with pytest.raises(ValueError, match=r"model axis: no model 'other' is loaded"):
        service.grid(Settings(prompt="a fox"), "model", "tiny, other", "seed", "1")
    assert service.images(Settings(prompt="a fox")).model.name == "tiny", "and the next request is served"


def test_a_model_by_seed_grid_draws_each_cell_as_its_model_alone(service, alone):
    plan = service.grid(Settings(prompt="a blue square", steps=2), "model", "tiny, tiny-sd1", "seed", "1, 2")
    assert len(plan.requests) == 2, "each model's cells in a call of their own"
    assert {call.model.name for call in plan.requests} == {"tiny", "tiny-sd1"}
    drawn = [_drawn(service, call) for call in plan.requests]
    for i, (call, index) in enumerate(plan.where):
        name, seed = ("tiny", "tiny-sd1")[i % 2], (1, 2)[i // 2]
        single = alone[name].images(Settings(prompt="a blue square", steps=2, seed=seed))
        assert plan.requests[call].model.name == name
        np.testing.assert_array_equal(drawn[call][index], _drawn(alone[name], single)[0])


def test_the_compare_tab_draws_one_prompt_and_seed_through_each_model(service, alone):
    form = dict(mode=COMPARE_MODELS, prompts="a blue square", seed=2, steps=2, guidance_scale=3.0)
    submission = service.submission("compare", form)
    assert [call.model.name for call in submission.calls] == ["tiny", "tiny-sd1"]
    gallery, status = list(results.rendered(service, submission, None))[-1].answer  # a gallery: no sheet
    assert "2 images" in status and "2 device calls" in status, status
    for (picture, caption), name in zip(gallery, ("tiny", "tiny-sd1")):
        single = alone[name].images(Settings(prompt="a blue square", seed=2, steps=2, guidance_scale=3.0))
        np.testing.assert_array_equal(np.asarray(picture), _drawn(alone[name], single)[0])
        assert caption == f"model {name}"
    with pytest.raises(ValueError, match=r"prompts must be text \(one per line\), got list"):
        service.submission("compare", {**form, "prompts": ["a fox", "a cat"]})
    assert COMPARE_MODELS not in alone["tiny"].compare_modes
    with pytest.raises(ValueError, match=r"one model is loaded \(tiny\): compare models with several --model"):
        alone["tiny"].submission("compare", form)


def test_requests_of_two_models_never_share_a_device_call(service):
    one, other = (service.images(Settings(prompt="a fox", model=name)) for name in ("tiny", "tiny-sd1"))
    assert one.batch_key != other.batch_key


def test_results_name_their_model(service):
    prepared = service.images(Settings(prompt="a fox", model="tiny-sd1"))
    assert "Model: tiny-sd1" in service.png_parameters(prepared, 0)
    assert results.caption(prepared, 0, "CPU 0", service.label_of(prepared)).startswith("tiny-sd1 · ")


def test_a_pictures_settings_select_the_model_they_name(service):
    prepared = service.images(Settings(prompt="a fox", seed=5, model="tiny-sd1"))
    fields, said = service.reused(service.png_parameters(prepared, 0))
    assert fields["model"] == "tiny-sd1" and "model tiny-sd1" in said
    text = "a fox\nSteps: 4, Sampler: Euler, CFG scale: 5, Seed: 1, Size: 128x128, Model: juggernautXL_v9"
    fields, said = service.reused(text)
    assert fields["model"] == "tiny"
    assert "Model juggernautXL_v9 (loaded: tiny, tiny-sd1; tiny is chosen)" in said


def test_models_of_one_architecture_share_their_programs(tmp_path, service):
    """A fine-tune is the same program with other weights: switching between them compiles nothing."""
    first = Pipeline.from_pretrained("tiny", dtype="float32", executables=service.pipe.executables)  # compiled once
    tuned = Pipeline.from_pretrained(str(write_checkpoint(tmp_path / "tuned", configs_of("tiny"), seed=1)),
                                     dtype="float32", executables=first.executables)
    service = DemoService([Model("tiny", first), Model("tuned", tuned)], max_images_per_core=1)
    settings = Settings(prompt="a fox", steps=2)
    drawn = {"tiny": _drawn(service, service.images(settings))}
    with CompileCounter() as compiles:
        for name in ("tuned", "tiny", "tuned"):
            drawn[name] = _drawn(service, service.images(Settings(**{**settings.__dict__, "model": name})))
    assert compiles.count == 0
    assert not np.array_equal(drawn["tiny"], drawn["tuned"])


def test_equal_components_of_two_models_are_held_once(tmp_path):
    first = Pipeline.from_pretrained("tiny", dtype="float32")
    same = Pipeline.from_pretrained(str(write_checkpoint(tmp_path / "same", configs_of("tiny"))), dtype="float32",
                                    executables=first.executables)
    other = Pipeline.from_pretrained(str(write_checkpoint(tmp_path / "other", configs_of("tiny"), seed=1)),
                                     dtype="float32", executables=first.executables)
    assert other.hold_once([first]) == []
    assert sorted(same.hold_once([first])) == ["text_encoder", "text_encoder_2", "unet", "vae"]
    assert same.params["vae"] is first.params["vae"]


def test_a_single_files_model_hash_is_webuis(tmp_path):
    path = write_single_file(tmp_path / "tiny.safetensors", configs_of("tiny"))
    pipe = Pipeline.from_pretrained(str(path), dtype="float32", config=str(ensure_checkpoint("tiny")))
    prepared = DemoService([Model("tiny-file", pipe)], max_images_per_core=1).images(Settings(prompt="a fox"))
    fields = infotext.settings_of(infotext.png_parameters(prepared.model, prepared.request, 0, "tiny-file"))
    assert fields["Model hash"] == sha256(path)[:10] and fields["Model"] == "tiny-file"


def _options(tmp_path, *models: str, lora_files=(), models_on_devices: int | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_shared_options(parser, {}, several_models=True)
    args = [arg for model in models for arg in ("--model", model)]
    args += [arg for path in lora_files for arg in ("--lora", str(path))]
    options = parser.parse_args([*args, "--dtype", "float32", "--cache-dir", str(tmp_path / "xla")])
    options.models_on_devices = models_on_devices  # the demo's option
    return options


def test_a_launchs_options_load_with_the_models_they_fit(tmp_path):
    sdxl_lora = lora.write_random(tmp_path / "sdxl.safetensors", Pipeline.from_pretrained("tiny").spec)
    models, failed = launch.load_models(_options(tmp_path, "tiny", "tiny-sd1", str(tmp_path / "missing"),
                                                 lora_files=[sdxl_lora]))
    assert [model.name for model in models] == ["tiny", "tiny-sd1"]
    assert list(failed) == [str(tmp_path / "missing")], "a model that fails to load leaves the others serving"
    assert models[0].loras == {str(sdxl_lora): 1.0} and models[1].loras == {}
    assert models[1].pipe.executables is models[0].pipe.executables


def test_models_beyond_those_the_devices_hold_wait_in_host_memory_and_move_in_when_asked_for(tmp_path, alone,
                                                                                             caplog):
    """`--models-on-devices 1`: the launch leaves the last model loaded on the devices; a request for another
    draws what that model draws alone, and its status says what the move took."""
    sdxl_lora = lora.write_random(tmp_path / "sdxl.safetensors", Pipeline.from_pretrained("tiny").spec)
    models, _ = launch.load_models(_options(tmp_path, "tiny", "tiny-sd1", lora_files=[sdxl_lora], models_on_devices=1))
    assert [model.placement.where for model in models] == [HOST, DEVICES]
    service = DemoService(models, max_images_per_core=1)
    settings = Settings(prompt="a red circle <lora:sdxl:0>", seed=3, steps=3, guidance_scale=3.0)
    with caplog.at_level("INFO", logger="sdxl"):
        shown = list(results.rendered(service, Submission([service.images(settings)]), None))
    gallery, status = shown[-1].answer
    assert "s of it moving the model onto the devices from host memory" in status
    assert "moved tiny onto the devices in" in caplog.text and "tiny-sd1 to host memory" in caplog.text
    assert models[0].residency.on_devices == ["tiny"]
    np.testing.assert_array_equal(np.stack([np.asarray(picture) for picture, _ in gallery]),
                                  _drawn(alone["tiny"], alone["tiny"].images(settings)))


def test_a_launch_refuses_an_option_that_fits_no_model_and_a_model_given_twice(tmp_path):
    sd1_lora = lora.write_random(tmp_path / "sd1.safetensors", Pipeline.from_pretrained("tiny-sd1").spec)
    with pytest.raises(CheckpointError, match=r"--lora .*sd1.safetensors fits none of the models: tiny: "):
        launch.load_models(_options(tmp_path, "tiny", "tiny-refiner", lora_files=[sd1_lora]))
    with pytest.raises(CheckpointError, match="--model tiny is given twice"):
        launch.load_models(_options(tmp_path, "tiny", "tiny-sd1", "tiny"))


def test_the_demos_model_option_repeats_and_its_variable_lists(monkeypatch):
    assert demo_parser("").parse_args(["--model", "tiny", "--model", "tiny-sd1"]).model == ["tiny", "tiny-sd1"]
    monkeypatch.setenv("SDXL_MODEL", "tiny, tiny-sd1")
    assert demo_parser("").parse_args([]).model == ["tiny", "tiny-sd1"]
    assert demo_parser("").parse_args(["--model", "shapes"]).model == ["shapes"], "given, it replaces the variable's"
