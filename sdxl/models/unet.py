"""The denoising UNet (diffusers' `UNet2DConditionModel`) as configured by SD 1.x/2.x and SDXL.

Module names follow the diffusers state-dict keys (`down_blocks.1.attentions.0.transformer_blocks.0
.attn2.to_k`), so `sdxl.checkpoints.weights.load_params` loads `unet/diffusion_pytorch_model.safetensors`
directly.

Latents are NHWC. Every level of the UNet is a down block (resnets, each optionally followed by a
spatial transformer, then a stride-2 conv) whose intermediate outputs are kept as skips; an up block
consumes them in reverse, concatenating one skip onto its input before each resnet.

The resnet, attention and resampling blocks are the shared ones of `sdxl.models.layers`.
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .layers import (
    Attention, Context, Conv3x3, Downsample2D, ImagePromptTokens, Linear, ResnetBlock2D, Upsample2D, group_norm,
)

DOWN_BLOCK_TYPES = ("DownBlock2D", "CrossAttnDownBlock2D")
UP_BLOCK_TYPES = ("UpBlock2D", "CrossAttnUpBlock2D")
# The GroupNorm in front of every spatial transformer has this epsilon, whatever norm_eps says.
TRANSFORMER_GROUP_NORM_EPS = 1e-6
# The LayerNorms inside every transformer block (diffusers' BasicTransformerBlock default).
TRANSFORMER_LAYER_NORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """diffusers' `UNet2DConditionModel` config (the fields of `unet/config.json`), with its defaults.

    Fields that only switch on features this module does not implement are kept so that a config
    using them is rejected instead of silently misread. `sample_size` does not change the network.
    `upcast_attention` is accepted and ignored: attention logits are always computed in float32.

    `attention_head_dim` is, for historical reasons, the number of attention heads per level, not
    their width (diffusers reads it so whenever `num_attention_heads` is unset, and refuses
    `num_attention_heads` altogether); each head is `channels // heads` wide.
    """

    sample_size: int | tuple[int, int] | None = None
    in_channels: int = 4
    out_channels: int = 4
    center_input_sample: bool = False
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    down_block_types: tuple[str, ...] = (
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    )
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    up_block_types: tuple[str, ...] = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")
    only_cross_attention: bool | tuple[bool, ...] = False
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int = 2
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1.0
    act_fn: str = "silu"
    norm_num_groups: int | None = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int = 1280
    transformer_layers_per_block: int | tuple[int, ...] = 1
    reverse_transformer_layers_per_block: tuple[tuple[int, ...], ...] | None = None
    encoder_hid_dim: int | None = None
    encoder_hid_dim_type: str | None = None
    attention_head_dim: int | tuple[int, ...] = 8
    num_attention_heads: int | tuple[int, ...] | None = None
    dual_cross_attention: bool = False
    use_linear_projection: bool = False
    class_embed_type: str | None = None
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    num_class_embeds: int | None = None
    upcast_attention: bool | None = False
    resnet_time_scale_shift: str = "default"
    time_embedding_type: str = "positional"
    time_embedding_dim: int | None = None
    time_embedding_act_fn: str | None = None
    timestep_post_act: str | None = None
    time_cond_proj_dim: int | None = None
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3
    projection_class_embeddings_input_dim: int | None = None
    attention_type: str = "default"

    def __post_init__(self):
        required = {
            "center_input_sample": False,
            "mid_block_type": "UNetMidBlock2DCrossAttn",
            "act_fn": "silu",
            "dual_cross_attention": False,
            "resnet_time_scale_shift": "default",
            "time_embedding_type": "positional",
            "attention_type": "default",
            "conv_in_kernel": 3,
            "conv_out_kernel": 3,
            "reverse_transformer_layers_per_block": None,
            "encoder_hid_dim": None,
            "encoder_hid_dim_type": None,
            "class_embed_type": None,
            "num_class_embeds": None,
            "time_embedding_dim": None,
            "time_embedding_act_fn": None,
            "timestep_post_act": None,
        }
        for name, supported in required.items():
            if getattr(self, name) != supported:
                raise ValueError(f"UNetConfig: {name}={getattr(self, name)!r} is not supported (only {supported!r})")
        if self.num_attention_heads is not None:
            raise ValueError(
                "UNetConfig: num_attention_heads must be unset (diffusers refuses it too); "
                "attention_head_dim gives the number of heads per level"
            )
        if any(np.atleast_1d(self.only_cross_attention)):
            raise ValueError(f"UNetConfig: only_cross_attention={self.only_cross_attention!r} is not supported")
        if self.addition_embed_type not in (None, "text_time"):
            raise ValueError(
                f"UNetConfig: addition_embed_type={self.addition_embed_type!r} is not supported "
                "(only None or 'text_time')"
            )
        if self.addition_embed_type == "text_time" and (
            self.addition_time_embed_dim is None or self.projection_class_embeddings_input_dim is None
        ):
            raise ValueError(
                "UNetConfig: addition_embed_type 'text_time' needs addition_time_embed_dim and "
                "projection_class_embeddings_input_dim"
            )
        if not isinstance(self.layers_per_block, int):
            raise ValueError(f"UNetConfig: layers_per_block must be an int, got {self.layers_per_block!r}")
        if not isinstance(self.cross_attention_dim, int):
            raise ValueError(f"UNetConfig: cross_attention_dim must be an int, got {self.cross_attention_dim!r}")
        if self.norm_num_groups is None:
            raise ValueError("UNetConfig: norm_num_groups=None (no output norm) is not supported")
        if self.downsample_padding not in (0, 1):
            raise ValueError(f"UNetConfig: downsample_padding={self.downsample_padding!r} is not supported (0 or 1)")

        levels = len(self.block_out_channels)
        if len(self.down_block_types) != levels or len(self.up_block_types) != levels:
            raise ValueError(
                f"UNetConfig: need one down and one up block per entry of block_out_channels "
                f"{self.block_out_channels}, got {self.down_block_types} and {self.up_block_types}"
            )
        for types, supported in ((self.down_block_types, DOWN_BLOCK_TYPES), (self.up_block_types, UP_BLOCK_TYPES)):
            for block_type in types:
                if block_type not in supported:
                    raise ValueError(f"UNetConfig: block type {block_type!r} is not supported (only {supported})")
        for name in ("attention_head_dim", "transformer_layers_per_block"):
            value = getattr(self, name)
            if not isinstance(value, int) and (len(value) != levels or not all(isinstance(v, int) for v in value)):
                raise ValueError(f"UNetConfig: {name} must be an int or one int per level, got {value!r}")
        for channels, heads in zip(self.block_out_channels, self.num_heads):
            if channels % self.norm_num_groups or channels % heads:
                raise ValueError(
                    f"UNetConfig: {channels} channels do not split into {self.norm_num_groups} norm groups "
                    f"and {heads} attention heads"
                )

    @property
    def num_heads(self) -> tuple[int, ...]:
        """Attention heads per level, from the misnamed `attention_head_dim`."""
        return _per_level(self.attention_head_dim, len(self.block_out_channels))

    @property
    def transformer_layers(self) -> tuple[int, ...]:
        """Transformer blocks in each spatial transformer, per level."""
        return _per_level(self.transformer_layers_per_block, len(self.block_out_channels))

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.block_out_channels[0]


def _per_level(value: int | tuple[int, ...], levels: int) -> tuple[int, ...]:
    return (value,) * levels if isinstance(value, int) else tuple(value)


@dataclasses.dataclass(frozen=True)
class TransformerSpec:
    """How the spatial transformers of one level are built."""

    num_heads: int
    num_layers: int
    use_linear_projection: bool


def timestep_embedding(timesteps: jax.Array, dim: int, flip_sin_to_cos: bool, freq_shift: float) -> jax.Array:
    """Sinusoidal embedding of (possibly fractional) timesteps, as diffusers' `get_timestep_embedding`.

    Args:
      timesteps: [N] values to embed.
      dim: embedding width; half sines, half cosines (zero-padded when odd).
      flip_sin_to_cos: put the cosines first.
      freq_shift: frequencies are 10000 ** (-i / (dim // 2 - freq_shift)).

    Returns:
      [N, dim] float32 embeddings.
    """
    half = dim // 2
    exponent = -math.log(10000) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift)
    angles = timesteps.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]  # [N, half]
    waves = [jnp.cos(angles), jnp.sin(angles)] if flip_sin_to_cos else [jnp.sin(angles), jnp.cos(angles)]
    return jnp.pad(jnp.concatenate(waves, axis=-1), ((0, 0), (0, dim % 2)))


def guidance_scale_embedding(w: jax.Array, dim: int) -> jax.Array:
    """[N, dim] float32: diffusers' `get_guidance_scale_embedding(w, dim)`, the sinusoidal embedding
    of w * 1000 with frequencies 10000 ** (-i / (dim // 2 - 1)), sines first. LCM UNets take the
    guidance scale this way (w = scale - 1) instead of a second, unconditional pass."""
    return timestep_embedding(jnp.asarray(w, jnp.float32) * 1000.0, dim, flip_sin_to_cos=False, freq_shift=1)


class TimestepEmbedding(nn.Module):
    """Linear -> SiLU -> linear MLP that lifts a sinusoidal (or any) vector to the time-embedding width;
    with a `condition` (an LCM UNet's guidance embedding), its projection `cond_proj` is added first."""

    features: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, condition=None):  # [B, D] (, [B, D_cond]) -> [B, features]
        if condition is not None:
            x = x + Linear(x.shape[-1], use_bias=False, dtype=self.dtype, name="cond_proj")(condition)
        x = nn.silu(Linear(self.features, dtype=self.dtype, name="linear_1")(x))
        return Linear(self.features, dtype=self.dtype, name="linear_2")(x)


class GEGLU(nn.Module):
    """Linear projection to twice the width; one half gates the other through an exact GELU."""

    features: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, T, C] -> [B, T, features]
        hidden, gate = jnp.split(Linear(2 * self.features, dtype=self.dtype, name="proj")(x), 2, axis=-1)
        return hidden * nn.gelu(gate, approximate=False)


class FeedForward(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, T, C]
        channels = x.shape[-1]
        # `net.1` is a dropout layer, which holds no weights.
        x = GEGLU(4 * channels, self.dtype, name="net.0")(x)
        return Linear(channels, dtype=self.dtype, name="net.2")(x)


class BasicTransformerBlock(nn.Module):
    """Pre-norm self-attention, cross-attention over the text, and GEGLU feed-forward, each residual."""

    num_heads: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, context):  # [B, T, C], [B, S, D]
        def layer_norm(name):
            return nn.LayerNorm(
                epsilon=TRANSFORMER_LAYER_NORM_EPS, use_fast_variance=False, dtype=self.dtype, name=name
            )

        x = x + Attention(self.num_heads, dtype=self.dtype, name="attn1")(layer_norm("norm1")(x))
        x = x + Attention(self.num_heads, dtype=self.dtype, name="attn2")(layer_norm("norm2")(x), context)
        return x + FeedForward(self.dtype, name="ff")(layer_norm("norm3")(x))


class Transformer2DModel(nn.Module):
    """Spatial transformer: the pixels of a feature map, as tokens, attend to each other and to the text."""

    spec: TransformerSpec
    norm_num_groups: int
    dtype: jnp.dtype = jnp.float32
    layer: int = 0  # its place in `attention_layers`, where the image prompts' scales are

    @nn.compact
    def __call__(self, x, context):  # [B, H, W, C], [B, S, D] -> [B, H, W, C]
        batch, height, width, channels = x.shape
        context = context.at_layer(self.layer)
        h = group_norm(self.norm_num_groups, TRANSFORMER_GROUP_NORM_EPS, self.dtype, "norm")(x)
        # A 1x1 conv and a linear layer compute the same map on NHWC data; the checkpoint stores
        # one or the other depending on use_linear_projection.
        if self.spec.use_linear_projection:
            projection = lambda name: Linear(channels, dtype=self.dtype, name=name)  # noqa: E731
        else:
            projection = lambda name: nn.Conv(channels, (1, 1), dtype=self.dtype, name=name)  # noqa: E731
        h = projection("proj_in")(h).reshape(batch, height * width, channels)  # [B, T, C]
        for i in range(self.spec.num_layers):
            h = BasicTransformerBlock(self.spec.num_heads, self.dtype, name=f"transformer_blocks.{i}")(h, context)
        h = projection("proj_out")(h.reshape(batch, height, width, channels))
        return x + h


def _resnet_and_transformer(block: nn.Module, index: int, x, temb, context):
    """Layer `index` of a down or up block: a resnet, then a spatial transformer if the block has one.

    Called from inside `block`'s `__call__`, so the layers it creates are `block`'s children.
    """
    x = ResnetBlock2D(
        block.out_channels, block.norm_num_groups, block.norm_eps, dtype=block.dtype, name=f"resnets.{index}"
    )(x, temb)
    if block.transformer is not None:
        x = Transformer2DModel(
            block.transformer, block.norm_num_groups, block.dtype, block.first_layer + index, name=f"attentions.{index}"
        )(x, context)
    return x


class DownBlock(nn.Module):
    """One UNet level on the way down: `DownBlock2D`, or `CrossAttnDownBlock2D` when `transformer` is set.

    Returns the block's output and its skips: the output of every layer, then that of the downsampler.
    """

    out_channels: int
    num_layers: int
    transformer: TransformerSpec | None
    add_downsample: bool
    downsample_padding: int
    norm_num_groups: int
    norm_eps: float
    dtype: jnp.dtype = jnp.float32
    first_layer: int = 0  # the place of its first spatial transformer in `attention_layers`

    @nn.compact
    def __call__(self, x, temb, context):  # [B, H, W, C_in] -> [B, H/2, W/2, out_channels], skips
        skips = []
        for i in range(self.num_layers):
            x = _resnet_and_transformer(self, i, x, temb, context)
            skips.append(x)
        if self.add_downsample:
            x = Downsample2D(self.downsample_padding, self.dtype, name="downsamplers.0")(x)
            skips.append(x)
        return x, skips


class UpBlock(nn.Module):
    """One UNet level on the way up: `UpBlock2D`, or `CrossAttnUpBlock2D` when `transformer` is set.

    There is one layer per skip; each takes the running features concatenated (channels last) with
    one skip, the most recent skip first.
    """

    out_channels: int
    transformer: TransformerSpec | None
    add_upsample: bool
    norm_num_groups: int
    norm_eps: float
    dtype: jnp.dtype = jnp.float32
    first_layer: int = 0  # the place of its first spatial transformer in `attention_layers`

    @nn.compact
    def __call__(self, x, skips, temb, context, upsample_size=None):  # [B, h, w, C_in] -> [B, *upsample_size, out]
        for i, skip in enumerate(reversed(skips)):
            x = _resnet_and_transformer(self, i, jnp.concatenate([x, skip], axis=-1), temb, context)
        if self.add_upsample:
            x = Upsample2D(self.dtype, name="upsamplers.0")(x, upsample_size)
        return x


class UNetMidBlock2DCrossAttn(nn.Module):
    """resnet -> spatial transformer -> resnet at the lowest resolution."""

    transformer: TransformerSpec
    norm_num_groups: int
    norm_eps: float
    output_scale_factor: float
    dtype: jnp.dtype = jnp.float32
    layer: int = 0  # the place of its spatial transformer in `attention_layers`

    @nn.compact
    def __call__(self, x, temb, context):  # [B, h, w, C]
        def resnet(name):
            return ResnetBlock2D(
                x.shape[-1], self.norm_num_groups, self.norm_eps, self.output_scale_factor, self.dtype, name=name
            )

        x = resnet("resnets.0")(x, temb)
        x = Transformer2DModel(
            self.transformer, self.norm_num_groups, self.dtype, self.layer, name="attentions.0"
        )(x, context)
        return resnet("resnets.1")(x, temb)


def time_embedding(
    config: UNetConfig, batch: int, timesteps, text_embeds, time_ids, timestep_cond, dtype
) -> jax.Array:
    """[B, time_embed_dim]: the timestep's embedding, plus SDXL's pooled text and size ids
    (`add_embedding`) where the config has them. Called inside a module's `__call__`, whose children
    `time_embedding` and `add_embedding` it makes: the UNet's, or a ControlNet's copy of them."""
    timesteps = jnp.broadcast_to(jnp.asarray(timesteps, jnp.float32), (batch,))
    t_emb = timestep_embedding(timesteps, config.block_out_channels[0], config.flip_sin_to_cos, config.freq_shift)
    if (timestep_cond is None) != (config.time_cond_proj_dim is None):
        raise ValueError(f"time_cond_proj_dim={config.time_cond_proj_dim}: timestep_cond is needed exactly then")
    condition = None if timestep_cond is None else timestep_cond.astype(dtype)
    temb = TimestepEmbedding(config.time_embed_dim, dtype, name="time_embedding")(t_emb.astype(dtype), condition)
    if config.addition_embed_type != "text_time":
        return temb
    if text_embeds is None or time_ids is None:
        raise ValueError("addition_embed_type 'text_time' needs text_embeds and time_ids")
    width = text_embeds.shape[-1] + time_ids.shape[-1] * config.addition_time_embed_dim
    if width != config.projection_class_embeddings_input_dim:
        raise ValueError(
            f"text_embeds {text_embeds.shape} and time_ids {time_ids.shape} give {width} features; "
            f"projection_class_embeddings_input_dim is {config.projection_class_embeddings_input_dim}"
        )
    time_embeds = timestep_embedding(
        time_ids.reshape(-1), config.addition_time_embed_dim, config.flip_sin_to_cos, config.freq_shift
    ).reshape(batch, -1)  # [B, N * addition_time_embed_dim]
    add_embeds = jnp.concatenate([text_embeds.astype(jnp.float32), time_embeds], axis=-1).astype(dtype)
    return temb + TimestepEmbedding(config.time_embed_dim, dtype, name="add_embedding")(add_embeds)


def _transformer_specs(config: UNetConfig) -> list[TransformerSpec]:
    return [
        TransformerSpec(heads, layers, config.use_linear_projection)
        for heads, layers in zip(config.num_heads, config.transformer_layers)
    ]


def _norm(config: UNetConfig, dtype) -> dict:
    return dict(norm_num_groups=config.norm_num_groups, norm_eps=config.norm_eps, dtype=dtype)


def attention_layers(config: UNetConfig) -> tuple[str, ...]:
    """The spatial transformers (diffusers' `attentions.*` of each block), in the order the UNet runs
    them: the down blocks', the mid block's, the up blocks'. An image prompt's scales are per layer in
    this order (`ImagePromptTokens`)."""
    names = []
    for level, block_type in enumerate(config.down_block_types):
        if block_type.startswith("CrossAttn"):
            names += [f"down_blocks.{level}.attentions.{i}" for i in range(config.layers_per_block)]
    names.append("mid_block.attentions.0")
    for i, block_type in enumerate(config.up_block_types):
        if block_type.startswith("CrossAttn"):
            names += [f"up_blocks.{i}.attentions.{j}" for j in range(config.layers_per_block + 1)]
    return tuple(names)


def _first_layer(config: UNetConfig, block: str) -> int:
    """Where `block`'s first spatial transformer is in `attention_layers` (0 for a block without)."""
    layers = attention_layers(config)
    name = f"{block}.attentions.0"
    return layers.index(name) if name in layers else 0


def down_and_mid_blocks(config: UNetConfig, x, temb, context, dtype) -> tuple[list, jax.Array]:
    """The encoder half, after `conv_in`: every down block, then the mid block.

    Called inside a module's `__call__`, whose children `down_blocks.*` and `mid_block` it makes: the
    UNet's, or a ControlNet's copy of them.

    Returns:
      The skips (`x` first, then every down block's) and the mid block's output.
    """
    specs, levels = _transformer_specs(config), len(config.block_out_channels)
    skips = [x]
    for level, block_type in enumerate(config.down_block_types):
        x, block_skips = DownBlock(
            config.block_out_channels[level],
            config.layers_per_block,
            specs[level] if block_type.startswith("CrossAttn") else None,
            add_downsample=level < levels - 1,
            downsample_padding=config.downsample_padding,
            first_layer=_first_layer(config, f"down_blocks.{level}"),
            name=f"down_blocks.{level}",
            **_norm(config, dtype),
        )(x, temb, context)
        skips += block_skips
    mid = UNetMidBlock2DCrossAttn(
        specs[-1], output_scale_factor=config.mid_block_scale_factor, layer=_first_layer(config, "mid_block"),
        name="mid_block", **_norm(config, dtype),
    )(x, temb, context)
    return skips, mid


class UNet2DConditionModel(nn.Module):
    """Predicts the noise (or v) in a latent, given the timestep, the text tokens and, for SDXL, the
    pooled text embedding and the size/crop conditioning ("time ids")."""

    config: UNetConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self, sample, timesteps, encoder_hidden_states, text_embeds=None, time_ids=None, timestep_cond=None,
        encoder_lengths=None, down_block_additional_residuals=None, mid_block_additional_residual=None,
        image_prompts: tuple[ImagePromptTokens, ...] = (),
    ):
        """Runs the UNet.

        Args:
          sample: [B, H, W, in_channels] noisy latents.
          timesteps: [B] (or scalar) timesteps; may be fractional and traced.
          encoder_hidden_states: [B, S, cross_attention_dim] text encoder tokens.
          text_embeds: [B, D_pooled] pooled text embedding; required for addition_embed_type 'text_time'.
          time_ids: [B, N] size and crop conditioning (N = 6 for SDXL base: original size, crop
            top-left, target size); required for addition_embed_type 'text_time'.
          timestep_cond: [B, time_cond_proj_dim] the guidance embedding (`guidance_scale_embedding`);
            required when the config has a time_cond_proj_dim (LCM UNets).
          encoder_lengths: [B] int32, how many of the text tokens each image attends to (diffusers'
            `encoder_attention_mask` as lengths): the rest is padding of a shorter prompt. None: all.
          down_block_additional_residuals, mid_block_additional_residual: a ControlNet's output
            (`sdxl.models.controlnet`), added to every skip and to the mid block's output, as diffusers adds them.
          image_prompts: each IP-Adapter's image tokens and scales (`ImagePromptTokens`, [B, N, D] and
            [B, len(attention_layers)]); the UNet's parameters then hold each adapter's `to_k_ip.{a}` and
            `to_v_ip.{a}` in every `attn2` (`sdxl.checkpoints.ip_adapters`).

        Returns:
          [B, H, W, out_channels] in `dtype`.
        """
        cfg = self.config
        dtype = self.dtype
        image_prompts = tuple(p._replace(states=p.states.astype(dtype)) for p in image_prompts)
        context = Context(encoder_hidden_states.astype(dtype), encoder_lengths, image_prompts)
        temb = time_embedding(cfg, sample.shape[0], timesteps, text_embeds, time_ids, timestep_cond, dtype)
        x = Conv3x3(cfg.block_out_channels[0], dtype=dtype, name="conv_in")(sample.astype(dtype))
        skips, x = down_and_mid_blocks(cfg, x, temb, context, dtype)
        if down_block_additional_residuals is not None:
            skips = [skip + residual.astype(dtype) for skip, residual in zip(skips, down_block_additional_residuals)]
            x = x + mid_block_additional_residual.astype(dtype)

        specs, levels = _transformer_specs(cfg), len(cfg.block_out_channels)
        for i, block_type in enumerate(cfg.up_block_types):
            level = levels - 1 - i
            num_layers = cfg.layers_per_block + 1
            block_skips, skips = skips[-num_layers:], skips[:-num_layers]
            # Upsample to the size of the next level's skips: twice this size, except where an odd
            # size was rounded up on the way down.
            x = UpBlock(
                cfg.block_out_channels[level],
                specs[level] if block_type.startswith("CrossAttn") else None,
                add_upsample=level > 0,
                first_layer=_first_layer(cfg, f"up_blocks.{i}"),
                name=f"up_blocks.{i}",
                **_norm(cfg, dtype),
            )(x, block_skips, temb, context, skips[-1].shape[1:3] if skips else None)

        x = nn.silu(group_norm(cfg.norm_num_groups, cfg.norm_eps, dtype, "conv_norm_out")(x))
        return Conv3x3(cfg.out_channels, dtype=dtype, name="conv_out")(x)


def abstract_inputs(config: UNetConfig) -> dict:
    """The smallest inputs a UNet of `config` (or a ControlNet, its encoder) runs on, as shapes."""
    size = 2 ** (len(config.block_out_channels) - 1)

    def dummy(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    inputs = dict(
        sample=dummy(1, size, size, config.in_channels),
        timesteps=dummy(1),
        encoder_hidden_states=dummy(1, 1, config.cross_attention_dim),
    )
    if config.addition_embed_type == "text_time":
        # Only the concatenated width reaches a parameter, so one time id will do.
        pooled_dim = config.projection_class_embeddings_input_dim - config.addition_time_embed_dim
        inputs.update(text_embeds=dummy(1, pooled_dim), time_ids=dummy(1, 1))
    if config.time_cond_proj_dim is not None:
        inputs.update(timestep_cond=dummy(1, config.time_cond_proj_dim))
    return inputs


def abstract_params(config: UNetConfig) -> dict:
    """The UNet's parameter shapes and dtypes, without allocating them."""
    return jax.eval_shape(UNet2DConditionModel(config).init, jax.random.key(0), **abstract_inputs(config))["params"]
