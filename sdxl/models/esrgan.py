"""ESRGAN's RRDBNet (Wang et al., "ESRGAN: Enhanced Super-Resolution Generative Adversarial Networks",
2018), the network of most model upscalers: ESRGAN_4x, 4x-UltraSharp, NMKD Siax, Real-ESRGAN's x4plus.

Module names follow BasicSR's keys as Real-ESRGAN publishes them (`conv_first`, `body.0.rdb1.conv1`,
`conv_body`, `conv_up1`, `conv_hr`, `conv_last`), so `sdxl.checkpoints.weights.load_stored` loads
those files directly; `sdxl.checkpoints.upscalers` maps the original ESRGAN layout
(`model.1.sub.0.RDB1.conv1.0`) to these names.

Images are NHWC in [0, 1]. BasicSR's RRDBNet always upsamples 4x after its body and reaches scale 2
or 1 by pixel-unshuffling the input first (Real-ESRGAN x2plus); the original layout has one nearest
2x stage per factor of 2 (one for 2x models, three for 8x).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from .layers import Conv3x3, resize_nearest

# The original's LeakyReLU slope and the scale of each dense block's and RRDB's residual branch.
NEGATIVE_SLOPE = 0.2
RESIDUAL_SCALE = 0.2


@dataclasses.dataclass(frozen=True)
class ESRGANConfig:
    """What differs between RRDBNet checkpoints (all of it readable from their shapes).

    `image_channels` is the picture's; the first convolution sees `image_channels * unshuffle**2`.
    """

    image_channels: int = 3
    num_feat: int = 64
    num_block: int = 23
    num_grow_ch: int = 32
    num_upsample: int = 2  # nearest 2x stages (conv_up1, conv_up2, ...)
    unshuffle: int = 1  # the input's pixel-unshuffle factor: 2 for scale 2, 4 for scale 1 (BasicSR)

    def __post_init__(self):
        if (2**self.num_upsample) % self.unshuffle:
            raise ValueError(f"unshuffle {self.unshuffle} does not divide 2**num_upsample ({2**self.num_upsample})")

    @property
    def scale(self) -> int:
        """How many output pixels one input pixel becomes along each axis."""
        return 2**self.num_upsample // self.unshuffle


def leaky_relu(x: jax.Array) -> jax.Array:
    return nn.leaky_relu(x, NEGATIVE_SLOPE)


def pixel_unshuffle(x: jax.Array, factor: int) -> jax.Array:
    """torch.nn.functional.pixel_unshuffle on NHWC: [B, H, W, C] -> [B, H/f, W/f, C*f*f], channel
    c*f*f + i*f + j holding pixel (i, j) of each f x f block."""
    batch, height, width, channels = x.shape
    x = x.reshape(batch, height // factor, factor, width // factor, factor, channels)
    x = x.transpose(0, 1, 3, 5, 2, 4)  # [B, H/f, W/f, C, f, f]
    return x.reshape(batch, height // factor, width // factor, channels * factor * factor)


class ResidualDenseBlock(nn.Module):
    """Five 3x3 convs, each seeing the block's input and every earlier conv's output."""

    num_grow_ch: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, H, W, F] -> [B, H, W, F]
        features = x
        for i in range(1, 5):
            grown = leaky_relu(Conv3x3(self.num_grow_ch, dtype=self.dtype, name=f"conv{i}")(features))
            features = jnp.concatenate([features, grown], axis=-1)  # [B, H, W, F + i * G]
        return x + RESIDUAL_SCALE * Conv3x3(x.shape[-1], dtype=self.dtype, name="conv5")(features)


class RRDB(nn.Module):
    """Residual in residual dense block: three dense blocks under one scaled residual."""

    num_grow_ch: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, H, W, F] -> [B, H, W, F]
        h = x
        for i in range(1, 4):
            h = ResidualDenseBlock(self.num_grow_ch, self.dtype, name=f"rdb{i}")(h)
        return x + RESIDUAL_SCALE * h


class RRDBNet(nn.Module):
    config: ESRGANConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, H, W, C] in [0, 1] -> [B, scale*H, scale*W, C]
        c = self.config
        height, width = x.shape[1:3]
        if c.unshuffle > 1:
            # Reflect-pad to a multiple of the factor and crop the output after, as spandrel does.
            pad = [(0, 0), (0, -height % c.unshuffle), (0, -width % c.unshuffle), (0, 0)]
            x = pixel_unshuffle(jnp.pad(x, pad, mode="reflect"), c.unshuffle)
        feat = Conv3x3(c.num_feat, dtype=self.dtype, name="conv_first")(x)
        body = feat
        for i in range(c.num_block):
            body = RRDB(c.num_grow_ch, self.dtype, name=f"body.{i}")(body)
        feat = feat + Conv3x3(c.num_feat, dtype=self.dtype, name="conv_body")(body)
        for i in range(1, c.num_upsample + 1):
            feat = resize_nearest(feat, (2 * feat.shape[1], 2 * feat.shape[2]))
            feat = leaky_relu(Conv3x3(c.num_feat, dtype=self.dtype, name=f"conv_up{i}")(feat))
        feat = leaky_relu(Conv3x3(c.num_feat, dtype=self.dtype, name="conv_hr")(feat))
        out = Conv3x3(c.image_channels, dtype=self.dtype, name="conv_last")(feat)
        return out[:, : c.scale * height, : c.scale * width]
