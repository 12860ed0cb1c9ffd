"""`Upscaler`: files in, pictures out, against spandrel; tiling, what it costs at the seams, and its compiles."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from PIL import Image
from test_esrgan import LAYOUTS, save, spandrel_output

from sdxl import Upscaler
from sdxl.checkpoints import CheckpointError
from sdxl.engine.compilation import CompileCounter
from sdxl.engine.upscaler import feather, tile_starts


@pytest.fixture
def picture(rng) -> np.ndarray:
    return rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)


def upscaler_file(tmp_path, layout: str) -> str:
    make, _, _ = LAYOUTS[layout]
    return save(make(), tmp_path / f"4x-{layout}.safetensors")


def test_from_file_and_upscale_match_spandrel_clipped(tmp_path, picture):
    path = upscaler_file(tmp_path, "original-4x")
    upscaler = Upscaler.from_file(path)
    assert (upscaler.name, upscaler.scale) == ("4x-original-4x", 4)
    assert all(isinstance(leaf, np.ndarray) for leaf in _leaves(upscaler.params))  # on the host until used
    out = upscaler.upscale(picture)
    want, _ = spandrel_output(path, picture.astype(np.float32) / 255)
    assert out.dtype == np.float32 and out.shape == (96, 128, 3)
    assert 0 <= out.min() and out.max() <= 1
    assert np.abs(out - np.clip(want, 0, 1)).max() < 1e-4


def test_pil_output_rounds_the_array(tmp_path, picture):
    upscaler = Upscaler.from_file(upscaler_file(tmp_path, "srvgg-x4"))
    out = upscaler.upscale(Image.fromarray(picture), output_type="pil")
    assert isinstance(out, Image.Image) and out.size == (128, 96)
    np.testing.assert_array_equal(np.asarray(out), np.round(upscaler.upscale(picture) * 255).astype(np.uint8))
    with pytest.raises(ValueError, match="output_type"):
        upscaler.upscale(picture, output_type="pt")


@pytest.mark.parametrize(
    ("size", "tile", "overlap"), [(24, 32, 4), (32, 32, 4), (100, 32, 8), (33, 32, 0), (61, 16, 4)]
)
def test_tiles_cover_the_axis_with_one_size_and_the_overlap(size, tile, overlap):
    starts = tile_starts(size, tile, overlap)
    length = min(tile, size)
    assert starts[0] == 0 and starts[-1] + length == size
    assert all(0 < later - earlier <= length - overlap for earlier, later in zip(starts, starts[1:]))
    fewer = len(starts) - 1  # would leave pixels out or overlap less
    assert size <= tile or fewer * tile - (fewer - 1) * overlap < size


def test_feather_ramps_only_at_shared_edges():
    np.testing.assert_allclose(feather(6, 2, True, False), [0.5, 1, 1, 1, 1, 1])
    np.testing.assert_allclose(feather(6, 2, True, True), [0.5, 1, 1, 1, 1, 0.5])
    np.testing.assert_allclose(feather(6, 0, True, True), np.ones(6))


# Tiles of 24 pixels overlapping by 8 against the whole picture, as measured (max, mean):
# SRVGGNetCompact (2 convs) 2.5e-2, 1.0e-3; RRDBNet x2plus (1 block) 1.2e-1, 4.7e-3. The RRDB sees
# about 34 input pixels each way, far past the overlap, and random weights make no smooth pictures.
SEAM_BOUNDS = {"srvgg-x4": (0.05, 2e-3), "x2plus": (0.25, 1e-2)}


@pytest.mark.parametrize("layout", SEAM_BOUNDS)
def test_tiled_upscale_compiles_once_and_costs_little_at_the_seams(layout, tmp_path, rng):
    path = upscaler_file(tmp_path, layout)
    picture = rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)
    whole = Upscaler.from_file(path, tile=64).upscale(picture)
    tiled_upscaler = Upscaler.from_file(path, tile=24, overlap=8)
    with CompileCounter() as compiles:
        tiled = tiled_upscaler.upscale(picture)
    assert compiles.count == 1  # 2 x 3 tiles of one shape
    assert tiled.shape == whole.shape
    difference = np.abs(tiled - whole)
    print(f"{layout}: tiled (24 px, overlap 8) vs whole: max {difference.max():.2e}, mean {difference.mean():.2e}")
    largest, mean = SEAM_BOUNDS[layout]
    assert difference.max() < largest and difference.mean() < mean


def test_a_picture_narrower_than_a_tile_is_tiled_along_its_length_only(tmp_path, rng):
    path = upscaler_file(tmp_path, "srvgg-x4")
    picture = rng.integers(0, 256, (16, 56, 3), dtype=np.uint8)
    whole = Upscaler.from_file(path).upscale(picture)
    tiled = Upscaler.from_file(path, tile=24, overlap=8).upscale(picture)
    assert tiled.shape == whole.shape == (64, 224, 3)
    assert np.abs(tiled - whole).max() < SEAM_BOUNDS["srvgg-x4"][0]


def test_bfloat16_stays_close_to_float32(tmp_path, picture):
    path = upscaler_file(tmp_path, "x4plus")
    bf16 = Upscaler.from_file(path, dtype="bfloat16")
    assert bf16.params["conv_first"]["kernel"].dtype == jnp.bfloat16
    difference = np.abs(bf16.upscale(picture) - Upscaler.from_file(path).upscale(picture))
    assert difference.max() < 0.01 and difference.mean() < 1e-3  # measured 3.0e-3, 1.5e-4


def test_non_rgb_and_bad_overlap_are_refused(tmp_path):
    make, _, _ = LAYOUTS["original-4x"]
    state = make()
    state["model.0.weight"] = state["model.0.weight"][:, :1].clone()
    state["model.10.weight"], state["model.10.bias"] = state["model.10.weight"][:1].clone(), torch.zeros(1)
    with pytest.raises(CheckpointError, match="1-channel pictures, not RGB"):
        Upscaler.from_file(save(state, tmp_path / "grey.safetensors"))
    with pytest.raises(ValueError, match="overlap 32"):
        Upscaler.from_file(upscaler_file(tmp_path, "srvgg-x4"), tile=32, overlap=32)


def _leaves(tree: dict):
    for value in tree.values():
        yield from _leaves(value) if isinstance(value, dict) else [value]
