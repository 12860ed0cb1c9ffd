"""The GPU lease's variants (`sdxl.bench.variants`), each in a process of its own as the lease runs them."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdxl.bench.variants import VARIANTS

ROOT = Path(__file__).parents[1]


def _render(out: Path, env: dict[str, str]) -> np.ndarray:
    """The tiny model's first image of a 2-step generation, by `python -m sdxl generate` in `env`."""
    result = subprocess.run(
        [sys.executable, "-m", "sdxl", "generate", "--cache-dir", os.environ["SDXL_CACHE_DIR"], "--model", "tiny",
         "--prompt", "a lighthouse", "--steps", "2", "--num-images", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )
    assert result.returncode == 0, result.stderr
    return np.asarray(Image.open(out / "0-0.png"), np.int16)


@pytest.mark.cli
def test_each_variant_renders_the_default_images(tmp_path):
    """Each variant's setting is one this jaxlib knows (an unknown XLA flag stops the process) and keeps the
    images: exactly, but for GroupNorm's shifted statistics, to a uint8 level. A CPU ignores the XLA GPU
    flags and runs XLA's attention anyway, so those variants only start JAX; the others render."""
    default = _render(tmp_path / "default", {})
    for variant in VARIANTS:
        value = variant.value
        if variant.variable == "XLA_FLAGS":  # beside the test session's own (conftest's forced devices)
            value = f"{os.environ.get('XLA_FLAGS', '')} {value}"
            started = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.ones(1).block_until_ready()"],
                                     capture_output=True, text=True, timeout=120,
                                     env={**os.environ, "XLA_FLAGS": value})
            assert started.returncode == 0, (variant.name, started.stderr)
            continue
        if (variant.variable, value) == ("SDXL_ATTENTION", "xla"):
            continue  # the CPU's own kernel: the default images are its images
        images = _render(tmp_path / variant.name, {variant.variable: value})
        levels = 1 if variant.variable == "SDXL_GROUP_NORM" else 0
        assert np.abs(images - default).max() <= levels, variant.name
