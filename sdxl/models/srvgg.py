"""Real-ESRGAN's SRVGGNetCompact (realesr-general-x4v3, realesr-animevideov3): a plain stack of 3x3
convs and PReLUs at the input's resolution, a pixel shuffle to the output's, and the nearest-upsampled
input added, so the network only learns the residual.

Module names follow the published keys (`body.0` the first conv, `body.1` its PReLU, ..., the last
conv `body.{2 * num_conv + 2}`). Images are NHWC in [0, 1].
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from .layers import Conv3x3


@dataclasses.dataclass(frozen=True)
class SRVGGConfig:
    image_channels: int = 3
    num_feat: int = 64
    num_conv: int = 16
    scale: int = 4


def pixel_shuffle(x: jax.Array, factor: int) -> jax.Array:
    """torch.nn.functional.pixel_shuffle on NHWC: [B, H, W, C*f*f] -> [B, H*f, W*f, C], channel
    c*f*f + i*f + j becoming pixel (i, j) of each f x f block."""
    batch, height, width, channels = x.shape
    channels //= factor * factor
    x = x.reshape(batch, height, width, channels, factor, factor)
    x = x.transpose(0, 1, 4, 2, 5, 3)  # [B, H, f, W, f, C]
    return x.reshape(batch, height * factor, width * factor, channels)


class PReLU(nn.Module):
    """torch.nn.PReLU(num_parameters=C): a learned slope per channel for the negative part."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, H, W, C]
        weight = self.param("weight", nn.initializers.constant(0.25), (x.shape[-1],), jnp.float32)
        return jnp.where(x >= 0, x, weight.astype(self.dtype) * x)


class SRVGGNetCompact(nn.Module):
    config: SRVGGConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, H, W, C] in [0, 1] -> [B, scale*H, scale*W, C]
        c = self.config
        h = x
        for i in range(c.num_conv + 1):
            h = Conv3x3(c.num_feat, dtype=self.dtype, name=f"body.{2 * i}")(h)
            h = PReLU(self.dtype, name=f"body.{2 * i + 1}")(h)
        h = Conv3x3(c.image_channels * c.scale**2, dtype=self.dtype, name=f"body.{2 * c.num_conv + 2}")(h)
        base = jnp.repeat(jnp.repeat(x.astype(h.dtype), c.scale, axis=1), c.scale, axis=2)
        return pixel_shuffle(h, c.scale) + base
