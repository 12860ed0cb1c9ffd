"""A1111's "Latent" hires-fix upscalers, in JAX.

AUTOMATIC1111 webui 1.10 (modules/shared.py `latent_upscale_modes`, applied in modules/processing.py)
resizes the first pass's [B, C, h, w] latents with
`torch.nn.functional.interpolate(samples, size=(height // 8, width // 8), mode=..., antialias=...)`:
a target size, align_corners False. This module reproduces torch's CPU kernels for those calls
(aten/src/ATen/native/UpSample.h and cpu/UpSampleKernel.cpp): the per-axis source indices and
weights are computed on the host in float32 as torch computes them, and applied to NHWC latents as
one [out, in] matrix per axis (or a gather for the nearest modes), so the resize is jit-able.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..sampling.noise import fused_multiply_add

# A1111's latent_upscale_modes: upscaler name -> (torch interpolate mode, antialias).
_MODES = {
    "Latent": ("bilinear", False),
    "Latent (antialiased)": ("bilinear", True),
    "Latent (bicubic)": ("bicubic", False),
    "Latent (bicubic antialiased)": ("bicubic", True),
    "Latent (nearest)": ("nearest", False),
    "Latent (nearest-exact)": ("nearest-exact", False),
}
LATENT_UPSCALERS = tuple(_MODES)

_f32 = np.float32


def _cubic1(x: np.ndarray, a: float) -> np.ndarray:
    """Cubic convolution kernel for |x| <= 1 (UpSample.h `cubic_convolution1`)."""
    a = _f32(a)
    return fused_multiply_add(fused_multiply_add(a + _f32(2), x, -(a + _f32(3))) * x, x, _f32(1))


def _cubic2(x: np.ndarray, a: float) -> np.ndarray:
    """Cubic convolution kernel for 1 < |x| < 2 (UpSample.h `cubic_convolution2`)."""
    a = _f32(a)
    inner = fused_multiply_add(fused_multiply_add(a, x, -_f32(5) * a), x, _f32(8) * a)
    return fused_multiply_add(inner, x, -_f32(4) * a)


def _scale(in_size: int, out_size: int) -> np.float32:
    """`area_pixel_compute_scale` without align_corners or a given scale factor: float in / out."""
    return _f32(in_size) / _f32(out_size)


def _source(in_size: int, out_size: int) -> np.ndarray:
    """`area_pixel_compute_source_index` before clamping: scale * (dst + 0.5) - 0.5, one float32 rounding."""
    return fused_multiply_add(_scale(in_size, out_size), np.arange(out_size) + 0.5, -0.5)


def _guard(real: np.ndarray, in_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`guard_index_and_lambda`: floor index capped at the last pixel, and the fraction past it in [0, 1]."""
    index = np.minimum(np.floor(real).astype(np.int64), in_size - 1)
    return index, np.clip(real - index.astype(_f32), _f32(0), _f32(1))


def _scatter(out_size: int, in_size: int, indices: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """[out, in] float32 matrix from per-output taps; taps clamped onto the same pixel add up."""
    matrix = np.zeros((out_size, in_size), _f32)
    np.add.at(matrix, (np.arange(out_size)[:, None], indices), weights)
    return matrix


def _linear_weights(in_size: int, out_size: int) -> np.ndarray:
    """Bilinear (`compute_source_index_and_lambda`): source (dst + 0.5) * scale - 0.5, clamped at 0."""
    real = np.maximum(_source(in_size, out_size), _f32(0))
    index0, lambda1 = _guard(real, in_size)
    index1 = index0 + (index0 < in_size - 1)
    return _scatter(out_size, in_size, np.stack([index0, index1], 1), np.stack([_f32(1) - lambda1, lambda1], 1))


def _cubic_weights(in_size: int, out_size: int) -> np.ndarray:
    """Bicubic, A = -0.75, four taps at floor(source) - 1 .. + 2 clamped into the image; no clamp of the source."""
    index, t = _guard(_source(in_size, out_size), in_size)
    weights = np.stack([_cubic2(t + _f32(1), -0.75), _cubic1(t, -0.75), _cubic1(_f32(1) - t, -0.75),
                        _cubic2(_f32(2) - t, -0.75)], 1)
    indices = np.clip(index[:, None] + np.arange(-1, 3), 0, in_size - 1)
    return _scatter(out_size, in_size, indices, weights)


def _linear_filter(x: np.float32) -> np.float32:
    """Triangle filter of the antialiased bilinear kernel (`HelperInterpLinear::aa_filter`)."""
    x = abs(x)
    return _f32(1) - x if x < 1 else _f32(0)


def _cubic_filter(x: np.float32) -> np.float32:
    """Cubic filter of the antialiased bicubic kernel (`HelperInterpCubic::aa_filter`): A = -0.5, as in PIL."""
    x = abs(x)
    if x < 1:
        return _cubic1(x, -0.5)
    return _cubic2(x, -0.5) if x < 2 else _f32(0)


def _aa_weights(in_size: int, out_size: int, taps: int, kernel: Callable[[np.float32], np.float32]) -> np.ndarray:
    """Antialiased (PIL-style) weights, `_compute_indices_min_size_weights_aa`: when downscaling the filter's
    support widens by the scale; each row is cut at the borders and normalised to sum to one. The scalar loop
    keeps torch's mix of float and double arithmetic, which decides the last bit of the weights."""
    scale = _scale(in_size, out_size)
    support = _f32(taps * 0.5 * scale) if scale >= 1 else _f32(taps * 0.5)
    invscale = _f32(1 / scale) if scale >= 1 else _f32(1)
    matrix = np.zeros((out_size, in_size), _f32)
    for i in range(out_size):
        center = _f32(float(scale) * (i + 0.5))
        xmin = max(int(float(center - support) + 0.5), 0)
        xmax = min(int(float(center + support) + 0.5), in_size)
        weights = [kernel(_f32((float(_f32(j) - center) + 0.5) * float(invscale))) for j in range(xmin, xmax)]
        total = _f32(0)
        for weight in weights:
            total += weight
        if total != 0:
            matrix[i, xmin:xmax] = np.array(weights, _f32) / total
    return matrix


def _weights(mode: str, antialias: bool, in_size: int, out_size: int) -> np.ndarray:
    if antialias:
        return _aa_weights(in_size, out_size, *((2, _linear_filter) if mode == "bilinear" else (4, _cubic_filter)))
    return _linear_weights(in_size, out_size) if mode == "bilinear" else _cubic_weights(in_size, out_size)


def _nearest_indices(mode: str, in_size: int, out_size: int) -> np.ndarray:
    """`nearest_idx` and `nearest_neighbor_exact_compute_source_index`, with their float rounding."""
    dst = np.arange(out_size)
    scale = _scale(in_size, out_size)
    if mode == "nearest-exact":
        # (dst + 0.5) * scale is a double that floorf rounds to float first.
        source = np.floor(((dst + 0.5) * np.float64(scale)).astype(_f32)).astype(np.int64)
    elif out_size == in_size:
        source = dst
    elif out_size == 2 * in_size:
        source = dst >> 1
    else:
        source = np.floor(dst.astype(_f32) * scale).astype(np.int64)
    return np.minimum(source, in_size - 1)


def upscale_latents(latents: jax.Array, height: int, width: int, upscaler: str) -> jax.Array:
    """[B, h, w, C] -> [B, height, width, C] float32, as torch's interpolate to that size.

    `height` and `width` are latent sizes (A1111's target size // 8); `upscaler` is one of LATENT_UPSCALERS.
    """
    if upscaler not in _MODES:
        raise ValueError(f"unknown latent upscaler {upscaler!r}: expected one of {', '.join(LATENT_UPSCALERS)}")
    mode, antialias = _MODES[upscaler]
    latents = jnp.asarray(latents, jnp.float32)
    in_height, in_width = latents.shape[1], latents.shape[2]
    if mode.startswith("nearest"):
        rows = _nearest_indices(mode, in_height, height)
        columns = _nearest_indices(mode, in_width, width)
        return jnp.take(jnp.take(latents, rows, axis=1), columns, axis=2)
    # Width first, then height, as torch's separable antialiased kernel does; HIGHEST keeps accelerators
    # from multiplying in bf16 / tf32.
    highest = jax.lax.Precision.HIGHEST
    latents = jnp.einsum("xw,bhwc->bhxc", _weights(mode, antialias, in_width, width), latents, precision=highest)
    return jnp.einsum("yh,bhxc->byxc", _weights(mode, antialias, in_height, height), latents, precision=highest)
