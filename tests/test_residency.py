"""Models that do not all fit the devices at once (`sdxl.engine.residency`): the ones not in use wait in host
memory and move in when a request needs them, drawing what they draw on the devices."""

import shutil

import jax
import numpy as np
import pytest

from sdxl.checkpoints.random_models import configs_of, ensure_checkpoint, write_checkpoint
from sdxl.engine.compilation import CompileCounter
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.request import Request
from sdxl.engine.residency import DEVICES, HOST, Residency

pytestmark = pytest.mark.compiles


def _request(seed: int = 1) -> Request:
    return Request.from_prompt("a red circle", num_images=4, steps=2, height=64, width=64, seed=seed,
                               guidance_scale=3.0)


@pytest.fixture(scope="module")
def fine_tunes(tmp_path_factory) -> dict[str, str]:
    """Three models of one architecture (one set of programs): tiny and two fine-tunes, "shared-vae" with
    tiny's VAE."""
    folder = tmp_path_factory.mktemp("fine-tunes")
    shared = write_checkpoint(folder / "shared-vae", configs_of("tiny"), seed=2)
    shutil.rmtree(shared / "vae")
    shutil.copytree(ensure_checkpoint("tiny") / "vae", shared / "vae")
    return {"tiny": "tiny", "tuned": str(write_checkpoint(folder / "tuned", configs_of("tiny"), seed=1)),
            "shared-vae": str(shared)}


@pytest.fixture(scope="module")
def executables():
    """One cache of compiled programs for the module: its models share their programs."""
    return Pipeline.from_pretrained("tiny", dtype="float32").executables


@pytest.fixture
def load(fine_tunes, executables):
    """`load(name)`: one of `fine_tunes`, on the module's programs."""
    return lambda name: Pipeline.from_pretrained(fine_tunes[name], dtype="float32", executables=executables)


@pytest.fixture(scope="module")
def alone(fine_tunes, executables) -> dict[str, np.ndarray]:
    """Each model's picture, drawn by a pipeline of its own."""
    return {name: Pipeline.from_pretrained(path, dtype="float32", executables=executables)
            .render(_request(), output_type="np").images for name, path in fine_tunes.items()}


def _device_bytes() -> int:
    return sum(array.nbytes for array in jax.live_arrays())


def _leaves(pipe: Pipeline) -> list:
    return jax.tree.leaves(pipe.params)


def test_a_model_in_host_memory_moves_in_for_its_request_and_draws_as_it_does_alone(load, alone):
    residency = Residency(1)
    first = load("tiny")
    residency.add(first)
    before = _device_bytes()
    waiting = first.prepare(_request(), output_type="np")  # prepared on the devices, rendered after moving out
    second = load("tuned")
    residency.add(second, "tuned")
    assert residency.on_devices == ["tuned"] and first.model.placement.where == HOST
    assert all(isinstance(leaf, np.ndarray) for leaf in _leaves(first)), "every snapshot's arrays, moved out"
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(waiting.model.params))
    moved_out = sum(leaf.nbytes for leaf in _leaves(first))
    assert _device_bytes() - before <= sum(leaf.nbytes for leaf in _leaves(second)) - moved_out + 2**20, (
        "the devices let the moved-out weights go")

    with CompileCounter() as compiles:
        drawn = first.render(waiting)
    np.testing.assert_array_equal(drawn.images, alone["tiny"])
    assert drawn.moving_seconds > 0 and compiles.count == 0, "moving compiles nothing"
    assert residency.on_devices == ["tiny"] and second.model.placement.where == HOST
    np.testing.assert_array_equal(second.render(_request(), output_type="np").images, alone["tuned"])
    again = first.render(_request(), output_type="np")
    np.testing.assert_array_equal(again.images, alone["tiny"])
    assert first.render(_request(), output_type="np").moving_seconds == 0.0, "already there: nothing moves"


def test_the_model_used_longest_ago_moves_out(load):
    residency = Residency(2)
    pipes = {}
    for name in ("tiny", "tuned", "shared-vae"):
        pipes[name] = load(name)
        residency.add(pipes[name], name)
    assert residency.on_devices == ["tuned", "shared-vae"]
    pipes["tuned"].render(_request(), output_type="np")
    pipes["tiny"].render(_request(), output_type="np")
    assert residency.on_devices == ["tuned", "tiny"], "shared-vae was used longest ago"
    assert {name: pipe.model.placement.where for name, pipe in pipes.items()} == {
        "tiny": DEVICES, "tuned": DEVICES, "shared-vae": HOST}


def test_components_held_once_stay_held_once_through_moves(load):
    """Two models sharing a VAE, and a third: the VAE stays on the devices while either uses it, and the
    one moving in takes the copy the other holds rather than a second one."""
    residency = Residency(2)
    first = load("tiny")
    residency.add(first)
    second = load("shared-vae")
    assert second.hold_once([first]) == ["vae"]
    residency.add(second, "shared-vae")
    third = load("tuned")
    residency.add(third, "tuned")
    # tiny moved out; its VAE stays, as shared-vae holds it on the devices

    def vae_held_once() -> bool:
        return all(a is b for a, b in zip(jax.tree.leaves(first.params["vae"]), jax.tree.leaves(second.params["vae"])))

    assert vae_held_once() and isinstance(jax.tree.leaves(first.params["vae"])[0], jax.Array)
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(first.params["unet"]))
    for pipe, on_devices in ((second, ["tuned", "shared-vae"]), (first, ["shared-vae", "tiny"]),
                             (third, ["tiny", "tuned"]), (second, ["tuned", "shared-vae"])):
        pipe.render(_request(), output_type="np")
        assert residency.on_devices == on_devices
        assert vae_held_once(), "one copy, wherever it is"
    assert isinstance(jax.tree.leaves(second.params["vae"])[0], jax.Array)
