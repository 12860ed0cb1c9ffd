"""3x3 convolutions (stride 1, padding 1) with the fastest algorithm each backend has.

- CPU in float32, on maps 16 to 128 pixels a side with at least 64 input channels: Winograd's
  F(4x4, 3x3) (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2015). Each
  6x6 input tile and the 3x3 kernel are taken to a 6x6 transform domain where the convolution is an
  element-wise product, summed over the input channels: 36 matmuls give a 4x4 output tile, 2.25
  multiply-adds per output pixel and channel pair instead of 9. XLA:CPU's own convolution on these
  shapes runs at 60-75% of its GEMM rate, so this is 1.3-2.5x faster per layer and 1.2-1.3x for a
  whole `medium` generation (BENCHMARKS.md). Outside that window it loses: on 8x8 maps the
  matmuls are too small, on 256x256 maps the tiles, 2.25x the input, no longer fit in cache.
- Everything else, bfloat16 and float16 included: XLA's convolution. The transforms' coefficients
  (up to 8 in the output transform) cost accuracy that 16-bit types do not have; GPUs and TPUs run
  their own convolution algorithms (cuDNN picks Winograd itself where it pays).

The kernels are transformed when a program runs (4x their size; keeping both forms would cost that
memory for good): once per generation, before the denoising loop, whose steps all reuse them
(`sdxl.models.layers.Conv3x3` and `GenerateProgram.prepare`).

`SDXL_CONV=xla|winograd` overrides the choice when a model is traced, for every such convolution.
In float32 the Winograd result differs from the direct one by about 1e-5 of its largest value.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ..config import kernel_override
from .attention import target_platform

IMPLEMENTATIONS = ("xla", "winograd")
# A convolution's zero padding: one count for every edge, or ((top, bottom), (left, right)).
Padding = int | tuple[tuple[int, int], tuple[int, int]]

# F(4x4, 3x3) over the interpolation points 0, 1, -1, 2, -2 and infinity: Y = A^T [(G g G^T) * (B^T d B)] A
# for a 6x6 input tile d and a 3x3 kernel g.
_INPUT_TRANSFORM = np.array(  # B^T
    [
        [4, 0, -5, 0, 1, 0],
        [0, -4, -4, 1, 1, 0],
        [0, 4, -4, -1, 1, 0],
        [0, -2, -1, 2, 1, 0],
        [0, 2, -1, -2, 1, 0],
        [0, 4, 0, -5, 0, 1],
    ]
)
_KERNEL_TRANSFORM = np.array(  # G
    [
        [1 / 4, 0, 0],
        [-1 / 6, -1 / 6, -1 / 6],
        [-1 / 6, 1 / 6, -1 / 6],
        [1 / 24, 1 / 12, 1 / 6],
        [1 / 24, -1 / 12, 1 / 6],
        [0, 0, 1],
    ]
)
_OUTPUT_TRANSFORM = np.array(  # A^T
    [
        [1, 1, 1, 1, 1, 0],
        [0, 1, -1, 2, -2, 0],
        [0, 1, 1, 4, 4, 0],
        [0, 1, -1, 8, -8, 1],
    ]
)
_TILE, _OUT = _INPUT_TRANSFORM.shape[0], _OUTPUT_TRANSFORM.shape[0]


def implementation(height: int, width: int, channels: int, dtype) -> str:
    """The algorithm for a 3x3 convolution of a [B, height, width, channels] map on the target platform,
    or the one SDXL_CONV names."""
    chosen = kernel_override("SDXL_CONV", IMPLEMENTATIONS)
    if chosen:
        return chosen
    # The platform traced for, not the host's: a CPU host compiling for a TPU slice must not pick Winograd.
    suits = target_platform() == "cpu" and jnp.dtype(dtype) == jnp.float32
    pays = 16 <= min(height, width) and max(height, width) <= 128 and channels >= 64
    return "winograd" if suits and pays else "xla"


def direct_conv3x3(x: jax.Array, kernel: jax.Array, strides: int = 1, padding: Padding = 1,
                   preferred_element_type=None) -> jax.Array:
    """torch's conv2d(stride=strides, padding=padding), without bias: [B, H, W, C] by [3, 3, C, O] (HWIO)
    -> [B, H', W', O]; `padding` is one count for every edge or ((top, bottom), (left, right))."""
    pairs = ((padding, padding),) * 2 if isinstance(padding, int) else padding
    layout = ("NHWC", "HWIO", "NHWC")
    return jax.lax.conv_general_dilated(x, kernel, (strides, strides), pairs, dimension_numbers=layout,
                                        preferred_element_type=preferred_element_type)


def _combine(coefficients: np.ndarray, parts: list[jax.Array]) -> jax.Array:
    """sum(c * part) over the non-zero coefficients, written out so that XLA fuses it into one pass."""
    total = None
    for c, part in zip(coefficients.tolist(), parts):
        if c:
            term = part if c == 1 else -part if c == -1 else part * c
            total = term if total is None else total + term
    return total


def winograd_kernel(kernel: jax.Array) -> jax.Array:
    """A [3, 3, C, O] (HWIO) kernel in F(4x4, 3x3)'s transform domain: [36, C, O], G g G^T per channel pair."""
    transform = jnp.asarray(np.kron(_KERNEL_TRANSFORM, _KERNEL_TRANSFORM), kernel.dtype)  # [36, 9]
    return (transform @ kernel.reshape(9, -1)).reshape(_TILE * _TILE, *kernel.shape[2:])


def winograd_conv3x3(x: jax.Array, transformed_kernel: jax.Array) -> jax.Array:
    """`direct_conv3x3` by Winograd's F(4x4, 3x3), with the kernel from `winograd_kernel`; any H and W
    (the last tiles are zero-padded)."""
    batch, height, width, channels = x.shape
    tiles_h, tiles_w = -(-height // _OUT), -(-width // _OUT)
    # Tile (i, j) reads rows 4i .. 4i+5 and columns 4j .. 4j+5 of the padded map.
    x = jnp.pad(x, ((0, 0), (1, _OUT * tiles_h + 1 - height), (1, _OUT * tiles_w + 1 - width), (0, 0)))
    rows = [x[:, r : r + _OUT * (tiles_h - 1) + 1 : _OUT] for r in range(_TILE)]
    x = jnp.stack([_combine(c, rows) for c in _INPUT_TRANSFORM])  # [6, B, tiles_h, W + 2, C]
    columns = [x[:, :, :, s : s + _OUT * (tiles_w - 1) + 1 : _OUT] for s in range(_TILE)]
    x = jnp.stack([_combine(c, columns) for c in _INPUT_TRANSFORM], axis=1)  # [6, 6, B, tiles_h, tiles_w, C]

    products = jax.lax.dot_general(
        x.reshape(_TILE * _TILE, -1, channels), transformed_kernel, (((2,), (1,)), ((0,), (0,)))
    ).reshape(_TILE, _TILE, batch, tiles_h, tiles_w, -1)

    y = jnp.stack([_combine(c, list(products)) for c in _OUTPUT_TRANSFORM])  # [4, 6, B, tiles_h, tiles_w, O]
    y = jnp.stack([_combine(c, list(y.swapaxes(0, 1))) for c in _OUTPUT_TRANSFORM], axis=1)  # [4, 4, ...]
    y = y.transpose(2, 3, 0, 4, 1, 5).reshape(batch, _OUT * tiles_h, _OUT * tiles_w, -1)
    return y[:, :height, :width]
