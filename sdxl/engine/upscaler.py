"""Model upscalers (ESRGAN, Real-ESRGAN) run on pictures of any size, tile by tile.

A picture larger than a tile is cut into tiles of one shape, as A1111's `split_grid` places them
(as few as overlap by at least `overlap` pixels, spread evenly, the last ending at the edge), so the
network compiles once per picture size; ComfyUI's `tiled_scale` instead cuts the last tile short,
a second shape to compile. Each tile's output is weighted by a ramp across the overlap with its
neighbours, as ComfyUI feathers, and the weighted sum divided by the summed weights.
"""

import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from ..checkpoints import CheckpointError, upscalers
from . import images


def tile_starts(size: int, tile: int, overlap: int) -> list[int]:
    """Where the tiles along one axis of `size` pixels start: as few tiles of `tile` pixels as overlap
    by at least `overlap`, spread evenly, the first at 0 and the last ending at the edge."""
    if size <= tile:
        return [0]
    count = math.ceil((size - overlap) / (tile - overlap))
    return [i * (size - tile) // (count - 1) for i in range(count)]


def feather(length: int, ramp: int, rising: bool, falling: bool) -> np.ndarray:
    """[length] weights of a tile's output along one axis: ramps of `ramp` pixels from 1/ramp up to 1
    at the edges it shares with a neighbour (`rising` at its start, `falling` at its end), 1 elsewhere."""
    weights = np.ones(length, np.float32)
    steps = np.arange(1, ramp + 1, dtype=np.float32) / ramp
    if rising:
        weights[:ramp] *= steps
    if falling:
        weights[length - ramp :] *= steps[::-1]
    return weights


class Upscaler:
    """A model upscaler: its network, its parameters (on the host until first used) and its tiling.

    Args:
      name: what the user calls it (`from_file`: the file's stem).
      network: the Flax network (`sdxl.models.esrgan.RRDBNet`, `sdxl.models.srvgg.SRVGGNetCompact`).
      params: its parameters, as `sdxl.checkpoints.upscalers.load` gives them.
      tile: the side of the square tiles (in input pixels) that larger pictures are cut into.
      overlap: the least overlap of neighbouring tiles, in input pixels.
    """

    def __init__(self, name: str, network, params: dict, *, tile: int, overlap: int):
        if not 0 <= overlap < tile:
            raise ValueError(f"overlap {overlap} must be at least 0 and less than the tile size {tile}")
        self.name = name
        self.network = network
        self.scale: int = network.config.scale
        self.tile, self.overlap = tile, overlap
        self.params = params  # numpy arrays until `upscale` first needs them on a device
        self._device_params = None
        # Params are an argument, not a constant: jit compiles once per input shape, not per weights.
        self._apply = jax.jit(lambda params, x: network.apply({"params": params}, x).astype(jnp.float32))

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, dtype=None, tile: int = 512, overlap: int = 32) -> "Upscaler":
        """An upscaler from a `.safetensors`, `.pth` or `.pt` file (ESRGAN, Real-ESRGAN).

        Args:
          dtype: the parameters' and computation's dtype; None: float32.
          tile: the side of the square tiles (in input pixels) that larger pictures are cut into.
          overlap: the least overlap of neighbouring tiles, in input pixels.

        Raises:
          CheckpointError: the file is unreadable, of an unknown architecture, or not for RGB pictures.
        """
        network, params = upscalers.load(Path(path), jnp.dtype(dtype or "float32"))
        if network.config.image_channels != 3:
            raise CheckpointError(f"{path}: makes {network.config.image_channels}-channel pictures, not RGB")
        return cls(Path(path).stem, network, params, tile=tile, overlap=overlap)

    def _run(self, pixels: np.ndarray) -> np.ndarray:  # [h, w, 3] float32 -> [s*h, s*w, 3]
        if self._device_params is None:
            self._device_params = jax.device_put(self.params)
        return np.asarray(self._apply(self._device_params, pixels[None]))[0]

    def upscale(self, image, output_type: str = "np"):
        """The picture `scale` times larger each way.

        Args:
          image: uint8 [H, W, 3] pixels (or a PIL image, or floats in [0, 1]).
          output_type: "np" for float32 [scale*H, scale*W, 3] in [0, 1], "pil" for a PIL image.

        Returns:
          The upscaled picture, clipped to [0, 1] (rounded to uint8 for "pil").
        """
        if output_type not in ("np", "pil"):
            raise ValueError(f"output_type must be 'np' or 'pil', got {output_type!r}")
        pixels = images.pixels(image)
        if pixels.dtype == np.uint8:
            pixels = pixels.astype(np.float32) / 255
        height, width = pixels.shape[:2]
        if height <= self.tile and width <= self.tile:
            out = self._run(pixels)
        else:
            out = self._tiled(pixels)
        out = np.clip(out, 0, 1)
        return Image.fromarray(np.round(out * 255).astype(np.uint8)) if output_type == "pil" else out

    def _tiled(self, pixels: np.ndarray) -> np.ndarray:  # [H, W, 3] -> [s*H, s*W, 3]
        s = self.scale
        height, width = pixels.shape[:2]
        tile_h, tile_w = min(self.tile, height), min(self.tile, width)
        total = np.zeros((s * height, s * width, 3), np.float32)
        weights = np.zeros((s * height, s * width, 1), np.float32)
        for top in tile_starts(height, tile_h, self.overlap):
            for left in tile_starts(width, tile_w, self.overlap):
                out = self._run(pixels[top : top + tile_h, left : left + tile_w])
                rows = feather(s * tile_h, s * self.overlap, top > 0, top + tile_h < height)
                columns = feather(s * tile_w, s * self.overlap, left > 0, left + tile_w < width)
                mask = (rows[:, None] * columns[None, :])[..., None]
                total[s * top : s * (top + tile_h), s * left : s * (left + tile_w)] += out * mask
                weights[s * top : s * (top + tile_h), s * left : s * (left + tile_w)] += mask
        return total / weights
