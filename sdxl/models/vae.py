"""The KL autoencoder (diffusers' `AutoencoderKL`) that maps images to and from SD/SDXL latents.

Module names follow the diffusers state-dict keys (`encoder.down_blocks.0.resnets.1.conv1`), so
`sdxl.checkpoints.weights.load_params` loads `vae/diffusion_pytorch_model.safetensors` directly; pass
`rename=rename_key` for older checkpoints that use the legacy attention names.

Images are NHWC in [-1, 1]. Latents are NHWC and unscaled: the diffusion model's latents are
`(z - shift_factor) * scaling_factor`, and that conversion is the pipeline's business, not this module's.

`tiled_decode` and `tiled_encode` are `decode` and `encode` as diffusers runs them after
`enable_tiling()`: in overlapping tiles, one at a time, so that a 2048x2048 SDXL image needs about
the memory of a 1024x1024 one. XLA's temporaries, compiled for CPU with XLA's convolutions (as
accelerators run them): 2.57 GiB to decode 2048x2048 tiled, 2.50 GiB for 1024x1024, 32 GiB for
2048x2048 whole; with the CPU's Winograd convolutions, whose transformed kernels each tile shape
keeps, 3.17 GiB tiled.
"""

import dataclasses
import functools
import re
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .layers import Attention, Conv3x3, Downsample2D, ResnetBlock2D, Upsample2D, group_norm

# Every norm in the VAE (resnets, mid-block attention, conv_norm_out) uses this epsilon.
NORM_EPS = 1e-6
# diffusers' DiagonalGaussianDistribution clamps the log-variance to this range.
LOGVAR_RANGE = (-30.0, 20.0)
# diffusers' `tile_overlap_factor`: tiled encoding and decoding overlap tiles by a quarter.
TILE_OVERLAP = 0.25


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """diffusers' `AutoencoderKL` config (the fields of `vae/config.json`), with diffusers' defaults.

    `sample_size`, `scaling_factor`, `shift_factor`, `latents_mean`, `latents_std` and
    `force_upcast` do not change the network; they are carried for the pipeline.
    """

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int | tuple[int, ...] = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    def __post_init__(self):
        if self.act_fn != "silu":
            raise ValueError(f"act_fn {self.act_fn!r} is not supported (only 'silu')")
        if any(t != "DownEncoderBlock2D" for t in self.down_block_types):
            raise ValueError(f"down_block_types {self.down_block_types} not supported (only DownEncoderBlock2D)")
        if any(t != "UpDecoderBlock2D" for t in self.up_block_types):
            raise ValueError(f"up_block_types {self.up_block_types} not supported (only UpDecoderBlock2D)")
        levels = len(self.block_out_channels)
        if not levels or len(self.down_block_types) != levels or len(self.up_block_types) != levels:
            raise ValueError(
                f"need one down and one up block per entry of block_out_channels {self.block_out_channels}, "
                f"got {len(self.down_block_types)} down and {len(self.up_block_types)} up blocks"
            )
        if any(c % self.norm_num_groups for c in self.block_out_channels):
            raise ValueError(
                f"norm_num_groups {self.norm_num_groups} does not divide block_out_channels {self.block_out_channels}"
            )

    @property
    def downscale_factor(self) -> int:
        """How many image pixels one latent pixel spans along each axis (8 for SD and SDXL)."""
        return 2 ** (len(self.block_out_channels) - 1)


def resnet(out_channels: int, norm_num_groups: int, dtype, name: str) -> ResnetBlock2D:
    """A resnet without time embedding, with the VAE's norm epsilon."""
    return ResnetBlock2D(out_channels, norm_num_groups, NORM_EPS, dtype=dtype, name=name)


class SpatialSelfAttention(nn.Module):
    """Residual self-attention over all pixels, with a single head as wide as the channels.

    The checkpoint keeps the norm beside the projections (`attentions.0.group_norm`,
    `attentions.0.to_q`), so the attention layer shares this module's scope.
    """

    norm_num_groups: int
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.attention = Attention(num_heads=1, qkv_bias=True, dtype=self.dtype)
        nn.share_scope(self, self.attention)

    @nn.compact
    def __call__(self, x):  # [B, H, W, C]
        batch, height, width, channels = x.shape
        h = group_norm(self.norm_num_groups, NORM_EPS, self.dtype, "group_norm")(x)
        h = self.attention(h.reshape(batch, height * width, channels))  # [B, T, C]
        return x + h.reshape(batch, height, width, channels)


class UNetMidBlock2D(nn.Module):
    """resnet -> (attention) -> resnet at the lowest resolution, keeping the channel count."""

    norm_num_groups: int
    add_attention: bool
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, h, w, C]
        channels = x.shape[-1]
        x = resnet(channels, self.norm_num_groups, self.dtype, "resnets.0")(x)
        if self.add_attention:
            x = SpatialSelfAttention(self.norm_num_groups, self.dtype, name="attentions.0")(x)
        return resnet(channels, self.norm_num_groups, self.dtype, "resnets.1")(x)


class DownEncoderBlock2D(nn.Module):
    out_channels: int
    num_layers: int
    add_downsample: bool
    norm_num_groups: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, H, W, C_in] -> [B, H/2, W/2, out_channels] (H, W if not add_downsample)
        for i in range(self.num_layers):
            x = resnet(self.out_channels, self.norm_num_groups, self.dtype, f"resnets.{i}")(x)
        if self.add_downsample:
            # Padding 0: pad only the bottom and right edges, as the original LDM encoder does.
            x = Downsample2D(padding=0, dtype=self.dtype, name="downsamplers.0")(x)
        return x


class UpDecoderBlock2D(nn.Module):
    out_channels: int
    num_layers: int
    add_upsample: bool
    norm_num_groups: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, H, W, C_in] -> [B, 2H, 2W, out_channels] (H, W if not add_upsample)
        for i in range(self.num_layers):
            x = resnet(self.out_channels, self.norm_num_groups, self.dtype, f"resnets.{i}")(x)
        if self.add_upsample:
            x = Upsample2D(self.dtype, name="upsamplers.0")(x, (2 * x.shape[1], 2 * x.shape[2]))
        return x


class Encoder(nn.Module):
    config: VAEConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, images):  # [B, H, W, in_channels] -> [B, h, w, 2 * latent_channels]
        cfg = self.config
        channels = cfg.block_out_channels
        x = Conv3x3(channels[0], dtype=self.dtype, name="conv_in")(images)
        for i, out_channels in enumerate(channels):
            x = DownEncoderBlock2D(
                out_channels,
                num_layers=cfg.layers_per_block,
                add_downsample=i < len(channels) - 1,
                norm_num_groups=cfg.norm_num_groups,
                dtype=self.dtype,
                name=f"down_blocks.{i}",
            )(x)
        x = UNetMidBlock2D(cfg.norm_num_groups, cfg.mid_block_add_attention, self.dtype, name="mid_block")(x)
        x = nn.silu(group_norm(cfg.norm_num_groups, NORM_EPS, self.dtype, "conv_norm_out")(x))
        return Conv3x3(2 * cfg.latent_channels, dtype=self.dtype, name="conv_out")(x)


class Decoder(nn.Module):
    config: VAEConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, latents):  # [B, h, w, latent_channels] -> [B, H, W, out_channels]
        cfg = self.config
        channels = cfg.block_out_channels[::-1]
        x = Conv3x3(channels[0], dtype=self.dtype, name="conv_in")(latents)
        x = UNetMidBlock2D(cfg.norm_num_groups, cfg.mid_block_add_attention, self.dtype, name="mid_block")(x)
        for i, out_channels in enumerate(channels):
            x = UpDecoderBlock2D(
                out_channels,
                # One resnet more than the encoder's blocks have: diffusers' Decoder passes layers_per_block + 1.
                num_layers=cfg.layers_per_block + 1,
                add_upsample=i < len(channels) - 1,
                norm_num_groups=cfg.norm_num_groups,
                dtype=self.dtype,
                name=f"up_blocks.{i}",
            )(x)
        x = nn.silu(group_norm(cfg.norm_num_groups, NORM_EPS, self.dtype, "conv_norm_out")(x))
        return Conv3x3(cfg.out_channels, dtype=self.dtype, name="conv_out")(x)


class AutoencoderKL(nn.Module):
    """The VAE. `encode` and `decode` share one parameter tree; call them through `apply(..., method=)`."""

    config: VAEConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg = self.config
        self.encoder = Encoder(cfg, self.dtype)
        self.decoder = Decoder(cfg, self.dtype)
        self.quant_conv = nn.Conv(2 * cfg.latent_channels, (1, 1), dtype=self.dtype) if cfg.use_quant_conv else None
        self.post_quant_conv = (
            nn.Conv(cfg.latent_channels, (1, 1), dtype=self.dtype) if cfg.use_post_quant_conv else None
        )

    def encode(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The diagonal Gaussian posterior over latents.

        Args:
          images: [B, H, W, in_channels] in [-1, 1]; H and W divisible by `config.downscale_factor`.

        Returns:
          (mean, logvar), each [B, H / f, W / f, latent_channels] with f = `config.downscale_factor`;
          logvar is clamped to [-30, 20] as in diffusers.
        """
        return posterior(self.moments(images))

    def moments(self, images: jax.Array) -> jax.Array:
        """[B, H, W, in_channels] -> [B, H / f, W / f, 2 * latent_channels]: the posterior's mean and
        log-variance side by side, before the clamp (what diffusers' tiled encoding blends)."""
        moments = self.encoder(images)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        return moments

    def decode(self, latents: jax.Array) -> jax.Array:
        """Images from unscaled latents.

        Args:
          latents: [B, h, w, latent_channels], already divided by `scaling_factor`.

        Returns:
          [B, h * f, w * f, out_channels] images, nominally in [-1, 1] (not clipped).
        """
        if self.post_quant_conv is not None:
            latents = self.post_quant_conv(latents)
        return self.decoder(latents)

    def __call__(self, images: jax.Array) -> jax.Array:
        """Reconstructs images through the posterior mean (diffusers' forward without sampling)."""
        mean, _ = self.encode(images)
        return self.decode(mean)


def posterior(moments: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mean, logvar) from `AutoencoderKL.moments`, the log-variance clamped as diffusers' does."""
    mean, logvar = jnp.split(moments, 2, axis=-1)
    return mean, jnp.clip(logvar, *LOGVAR_RANGE)


def tile_sizes(config: VAEConfig) -> tuple[int, int]:
    """(image pixels, latent pixels) across one tile: diffusers' `tile_sample_min_size`, which is the
    config's `sample_size` (1024 for SDXL's VAE, 512 for SD 1.x's), and `tile_latent_min_size`."""
    size = config.sample_size[0] if isinstance(config.sample_size, tuple | list) else config.sample_size
    return size, int(size / config.downscale_factor)


def tiled_decode(vae: AutoencoderKL, params: dict, latents: jax.Array) -> jax.Array:
    """`vae.decode` as diffusers' AutoencoderKL decodes after `enable_tiling()`: latents wider or
    taller than a tile are decoded in overlapping tiles, each blended into its upper and left
    neighbours; smaller ones in one piece.

    The tiles run one at a time (`jax.lax.map`), each for the whole batch, so a decode needs the
    temporaries of one tile per image whatever the image's size (`GenerateProgram` decodes one image
    per device at a time).

    Args:
      vae: the module whose `decode` to run (its config gives the tile size).
      params: its parameters.
      latents: [B, h, w, latent_channels], as `AutoencoderKL.decode` takes them.

    Returns:
      [B, h * f, w * f, out_channels] images, as `AutoencoderKL.decode` returns them.
    """
    sample, latent = tile_sizes(vae.config)
    decode = functools.partial(vae.apply, {"params": params}, method=vae.decode)
    if max(latents.shape[1:3]) <= latent:
        return decode(latents)
    return _tiled(decode, latents, latent, sample)


def tiled_encode(vae: AutoencoderKL, params: dict, images: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`vae.encode` as diffusers' AutoencoderKL encodes after `enable_tiling()` (see `tiled_decode`):
    the moments of overlapping tiles are blended before the log-variance is clamped.

    Args:
      vae: the module whose encoder to run (its config gives the tile size).
      params: its parameters.
      images: [B, H, W, in_channels] in [-1, 1], as `AutoencoderKL.encode` takes them.

    Returns:
      (mean, logvar), as `AutoencoderKL.encode` returns them.
    """
    sample, latent = tile_sizes(vae.config)
    moments = functools.partial(vae.apply, {"params": params}, method=vae.moments)
    if max(images.shape[1:3]) <= sample:
        return posterior(moments(images))
    return posterior(_tiled(moments, images, sample, latent))


def _tiled(run: Callable, x: jax.Array, tile: int, out_tile: int) -> jax.Array:
    """diffusers' tiling of `run` ([B, t, t', C] -> [B, t * s, t' * s, C']) over x [B, H, W, C]: tiles
    `tile` wide start every 3/4 tile, edge tiles are what is left; each output tile is blended into
    its upper, then its left neighbour over a quarter `out_tile`, and cropped to 3/4 `out_tile`."""
    stride = int(tile * (1 - TILE_OVERLAP))
    extent = int(out_tile * TILE_OVERLAP)
    keep = out_tile - extent
    height, width = x.shape[1:3]
    rows, columns = range(0, height, stride), range(0, width, stride)
    # Tiles of one shape run through one loop, one tile (of every image) at a time: one compiled
    # decoder per shape (at most four: inner, right edge, bottom edge, corner), never one per tile.
    # The batch stays whole in each step, so that a batch split over devices stays where it is.
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i in rows:
        for j in columns:
            groups.setdefault((min(tile, height - i), min(tile, width - j)), []).append((i, j))
    done = {}
    for (h, w), starts in groups.items():
        tiles = jnp.stack([x[:, i : i + h, j : j + w] for i, j in starts])  # [n, B, h, w, C]
        out = jax.lax.map(run, tiles)  # [n, B, h * s, w * s, C']
        done.update((start, out[n]) for n, start in enumerate(starts))
    # diffusers blends in place, so each tile meets its neighbours already blended.
    for i in rows:
        for j in columns:
            if i:
                done[i, j] = _blend(done[i - stride, j], done[i, j], extent, axis=1)
            if j:
                done[i, j] = _blend(done[i, j - stride], done[i, j], extent, axis=2)
    return jnp.concatenate(
        [jnp.concatenate([done[i, j][:, :keep, :keep] for j in columns], axis=2) for i in rows], axis=1
    )


def _blend(a: jax.Array, b: jax.Array, extent: int, axis: int) -> jax.Array:
    """`b` with its first `extent` rows (axis 1) or columns (axis 2) faded in from `a`'s last ones,
    linearly from all `a` to all `b`: diffusers' `blend_v` and `blend_h`."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    shape = [1] * b.ndim
    shape[axis] = extent
    # The weights in float64 and then the activations' dtype, as torch's Python-float scalars.
    weight = np.arange(extent) / extent
    tail = jax.lax.slice_in_dim(a, a.shape[axis] - extent, a.shape[axis], axis=axis)
    head = jax.lax.slice_in_dim(b, 0, extent, axis=axis)
    mixed = tail * (1 - weight).astype(b.dtype).reshape(shape) + head * weight.astype(b.dtype).reshape(shape)
    return jnp.concatenate([mixed, jax.lax.slice_in_dim(b, extent, b.shape[axis], axis=axis)], axis=axis)


_LEGACY_ATTENTION_NAMES = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}
_LEGACY_ATTENTION_KEY = re.compile(r"^((?:en|de)coder\.mid_block\.attentions\.\d+)\.(query|key|value|proj_attn)\.")


def rename_key(key: str) -> str:
    """Maps a legacy mid-block attention key (`query`, `key`, `value`, `proj_attn`) to the current name.

    Older SD 1.x VAE checkpoints store the attention under these names; diffusers renames them the
    same way on load. Other keys are returned unchanged.
    """
    match = _LEGACY_ATTENTION_KEY.match(key)
    if match is None:
        return key
    prefix, legacy_name = match.groups()
    return f"{prefix}.{_LEGACY_ATTENTION_NAMES[legacy_name]}.{key[match.end():]}"


def abstract_params(config: VAEConfig) -> dict:
    """The shapes of the encoder and decoder parameters, without allocating them."""
    f = config.downscale_factor
    images = jax.ShapeDtypeStruct((1, f, f, config.in_channels), jnp.float32)
    return jax.eval_shape(AutoencoderKL(config).init, jax.random.key(0), images)["params"]
