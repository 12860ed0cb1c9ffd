"""Live previews: the sampler's prediction of the clean latents, projected to RGB by one fixed linear
map per model family, on the devices. No VAE decode: a preview costs a 4x3 matrix product per latent
pixel, and comes out at the latents' size (1/8 of the image's side).

A VAE's decoder is far from linear, but its latents keep colour nearly linearly, pixel by pixel:
the least-squares fit of a decoded image, averaged over each latent pixel's patch, against the
latents (plus a bias) recovers the picture's colours (`fit`). The SD and SDXL factors are such fits,
as ComfyUI publishes them (comfy/latent_formats.py, SD15 and SDXL; GPL-3.0 code, the numbers are
measurements of the Stability AI VAEs); `shapes` ships its own, fitted here by `fit` on its data
set (tests/test_previews.py refits and compares).
"""

import jax
import jax.numpy as jnp
import numpy as np

# (matrix [C, 3], bias [3]): RGB in [-1, 1] from the diffusion model's (scaled) latents.
SD_FACTORS = (
    ((0.3512, 0.2297, 0.3227), (0.3250, 0.4974, 0.2350), (-0.2829, 0.1762, 0.2721), (-0.2120, -0.2616, -0.7177)),
    (0.0, 0.0, 0.0),
)
SDXL_FACTORS = (
    ((0.3651, 0.4232, 0.4341), (-0.2533, -0.0042, 0.1068), (0.1076, 0.1111, -0.0362), (-0.3165, -0.2492, -0.2188)),
    (0.1084, -0.0175, -0.0011),
)
# Playground v2.5's latents are normalized per channel (`latents_mean`, `latents_std`).
PLAYGROUND_FACTORS = (
    ((0.3920, 0.4054, 0.4549), (-0.2634, -0.0196, 0.0653), (0.0568, 0.1687, -0.0755), (-0.3112, -0.2359, -0.2076)),
    (0.0, 0.0, 0.0),
)
# The `shapes` model's VAE (assets/shapes), by `fit` over 256 of its data set's images.
SHAPES_FACTORS = (
    ((0.7895, 0.3515, 0.1184), (-0.5145, -0.3614, -0.0781), (0.3454, 0.3104, 0.2147), (0.0161, -0.0159, -0.5996)),
    (0.481, 0.054, 0.077),
)


def factors_for(spec) -> tuple:
    """The projection for a model family (`Checkpoint.preview_factors` knows the trained models' own)."""
    if not spec.is_sdxl:
        return SD_FACTORS
    return SDXL_FACTORS if spec.vae.latents_mean is None else PLAYGROUND_FACTORS


def project(latents: jax.Array, factors: tuple) -> jax.Array:
    """[B, h, w, C] scaled latents -> [B, h, w, 3] uint8 preview images."""
    matrix, bias = (jnp.asarray(f, jnp.float32) for f in factors)
    rgb = latents.astype(jnp.float32) @ matrix + bias
    return jnp.round(jnp.clip(rgb / 2 + 0.5, 0, 1) * 255).astype(jnp.uint8)


def fit(latents: np.ndarray, images: np.ndarray) -> tuple:
    """The least-squares projection (matrix [C, 3], bias [3]) of `images` ([N, H, W, 3] in [-1, 1])
    from their `latents` ([N, h, w, C], scaled), each latent pixel against its patch's mean colour."""
    n, h, w, channels = latents.shape
    patches = images.reshape(n, h, images.shape[1] // h, w, images.shape[2] // w, 3).mean(axis=(2, 4))
    inputs = np.concatenate([latents.reshape(-1, channels), np.ones((n * h * w, 1))], axis=1)
    solution, *_ = np.linalg.lstsq(inputs, patches.reshape(-1, 3), rcond=None)
    matrix, bias = solution[:-1], solution[-1]
    return tuple(tuple(round(float(v), 4) for v in row) for row in matrix), tuple(round(float(v), 4) for v in bias)
