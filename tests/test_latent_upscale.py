"""sdxl.engine.latent_upscale against the real thing: torch.nn.functional.interpolate to a target size, with
the mode and antialias A1111 1.10's `latent_upscale_modes` gives each "Latent" upscaler."""

import re

import jax
import numpy as np
import pytest
import torch

from sdxl.engine.latent_upscale import LATENT_UPSCALERS, upscale_latents

# A1111 1.10 modules/shared.py `latent_upscale_modes`, copied here so the module's table is checked too.
A1111_MODES = {
    "Latent": ("bilinear", False),
    "Latent (antialiased)": ("bilinear", True),
    "Latent (bicubic)": ("bicubic", False),
    "Latent (bicubic antialiased)": ("bicubic", True),
    "Latent (nearest)": ("nearest", False),
    "Latent (nearest-exact)": ("nearest-exact", False),
}
# (h, w) -> (height, width): 2x and 1.5x hires, ratios that are no simple fraction, a downscale, SDXL's
# 1024 -> 1536 hires (128 -> 192 latents).
SIZES = [((8, 12), (16, 24)), ((8, 12), (12, 18)), ((7, 9), (13, 20)), ((16, 24), (10, 15)), ((128, 128), (192, 192))]
# The weights match torch's bit for bit but for ulps of the non-antialiased bicubic ones; what is left is the
# order of the sums (one matmul per axis against torch's per-pixel loops). Measured at most 9.6e-7 on N(0, 1)
# against torch's AVX2 and AVX-512 kernels (which agree to the bit), XLA built for AVX-512 or SSE4.2 alike.
# torch's default kernels (x86 without AVX2, ATEN_CPU_CAPABILITY=default) are up to 9.2e-6 from those (128x128
# to 192x192, bicubic), and ours as far.
ATOL = 2e-6 if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else 2e-5


def torch_upscale(latents: np.ndarray, size: tuple[int, int], upscaler: str) -> np.ndarray:
    """A1111's call, on NCHW latents."""
    mode, antialias = A1111_MODES[upscaler]
    return torch.nn.functional.interpolate(torch.from_numpy(latents), size=size, mode=mode, antialias=antialias).numpy()


def test_upscalers_are_a1111s():
    assert LATENT_UPSCALERS == tuple(A1111_MODES)


@pytest.mark.parametrize("upscaler", LATENT_UPSCALERS)
@pytest.mark.parametrize(("source", "target"), SIZES, ids=lambda s: "x".join(map(str, s)))
def test_matches_torch(upscaler: str, source: tuple[int, int], target: tuple[int, int]):
    latents = np.random.default_rng(0).standard_normal((2, 4, *source), dtype=np.float32)
    expected = torch_upscale(latents, target, upscaler)
    ours = np.asarray(upscale_latents(latents.transpose(0, 2, 3, 1), *target, upscaler)).transpose(0, 3, 1, 2)
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    # Nearest modes copy pixels: their indices must be torch's exactly.
    np.testing.assert_allclose(ours, expected, rtol=0, atol=0 if "nearest" in upscaler else ATOL)


def test_jit():
    latents = np.random.default_rng(1).standard_normal((1, 4, 7, 9), dtype=np.float32)
    upscale = jax.jit(upscale_latents, static_argnums=(1, 2, 3))
    ours = np.asarray(upscale(latents.transpose(0, 2, 3, 1), 13, 20, "Latent (bicubic antialiased)"))
    expected = torch_upscale(latents, (13, 20), "Latent (bicubic antialiased)").transpose(0, 2, 3, 1)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)


def test_unknown_upscaler():
    with pytest.raises(ValueError, match=re.escape("unknown latent upscaler 'Latent (area)'")):
        upscale_latents(np.zeros((1, 8, 8, 4), np.float32), 16, 16, "Latent (area)")
