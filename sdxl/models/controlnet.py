"""ControlNet (diffusers' `ControlNetModel`): a trainable copy of the UNet's encoder that steers it with
an image (edges, depth, a pose).

Module names follow diffusers' state-dict keys, so `diffusion_pytorch_model.safetensors` loads
directly. The copy is the UNet's own encoder half (`sdxl.models.unet.time_embedding`, `conv_in`,
`sdxl.models.unet.down_and_mid_blocks`), plus:

    controlnet_cond_embedding   a small conv net: the control image down to the latents' size,
                                added to the latents after `conv_in`
    controlnet_down_blocks.N    one 1x1 conv per skip of the encoder ("zero convolutions")
    controlnet_mid_block        a 1x1 conv on the mid block's output

Its output, scaled, is what the UNet adds to its skips and mid block (`down_block_additional_residuals`,
`mid_block_additional_residual`). The ControlNet Union (`sdxl.models.controlnet_union`) is built of the same
parts (`embedded_condition`, `steering_residuals`); a config makes its own module (`model`).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from .layers import Context, Conv3x3, step_invariant
from .unet import UNetConfig, abstract_inputs, down_and_mid_blocks, time_embedding

# The conditioning channel orders diffusers reads; "bgr" images are flipped to RGB first.
CHANNEL_ORDERS = ("rgb", "bgr")


@dataclasses.dataclass(frozen=True)
class ControlNetConfig:
    """diffusers' `ControlNetModel` config (the fields of its `config.json`), with its defaults.

    The encoder's fields mean what they mean in `UNetConfig`, which checks them (`unet_config`).
    """

    in_channels: int = 4
    conditioning_channels: int = 3
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    down_block_types: tuple[str, ...] = (
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    )
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
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
    encoder_hid_dim: int | None = None
    encoder_hid_dim_type: str | None = None
    attention_head_dim: int | tuple[int, ...] = 8
    num_attention_heads: int | tuple[int, ...] | None = None
    use_linear_projection: bool = False
    class_embed_type: str | None = None
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    num_class_embeds: int | None = None
    upcast_attention: bool | None = False
    resnet_time_scale_shift: str = "default"
    projection_class_embeddings_input_dim: int | None = None
    controlnet_conditioning_channel_order: str = "rgb"
    conditioning_embedding_out_channels: tuple[int, ...] = (16, 32, 96, 256)
    global_pool_conditions: bool = False

    def __post_init__(self):
        if self.controlnet_conditioning_channel_order not in CHANNEL_ORDERS:
            raise ValueError(
                f"ControlNetConfig: controlnet_conditioning_channel_order="
                f"{self.controlnet_conditioning_channel_order!r} is not supported (only {CHANNEL_ORDERS})"
            )
        if self.global_pool_conditions:
            raise ValueError(
                "ControlNetConfig: global_pool_conditions (a guess-mode ControlNet, such as the shuffle model) "
                "is not supported"
            )
        _ = self.unet_config  # UNetConfig checks the encoder's fields

    @property
    def unet_config(self) -> UNetConfig:
        """The config of a UNet whose encoder this is (its up blocks mirror the down blocks)."""
        up_types = tuple(t.replace("Down", "Up") for t in reversed(self.down_block_types))
        # diffusers' ControlNet takes the heads from num_attention_heads when set, else (as the UNet)
        # from the misnamed attention_head_dim.
        return UNetConfig(
            in_channels=self.in_channels, flip_sin_to_cos=self.flip_sin_to_cos, freq_shift=self.freq_shift,
            down_block_types=self.down_block_types, mid_block_type=self.mid_block_type, up_block_types=up_types,
            only_cross_attention=self.only_cross_attention, block_out_channels=self.block_out_channels,
            layers_per_block=self.layers_per_block, downsample_padding=self.downsample_padding,
            mid_block_scale_factor=self.mid_block_scale_factor, act_fn=self.act_fn,
            norm_num_groups=self.norm_num_groups, norm_eps=self.norm_eps, cross_attention_dim=self.cross_attention_dim,
            transformer_layers_per_block=self.transformer_layers_per_block, encoder_hid_dim=self.encoder_hid_dim,
            encoder_hid_dim_type=self.encoder_hid_dim_type,
            attention_head_dim=self.num_attention_heads or self.attention_head_dim,
            use_linear_projection=self.use_linear_projection, class_embed_type=self.class_embed_type,
            addition_embed_type=self.addition_embed_type, addition_time_embed_dim=self.addition_time_embed_dim,
            num_class_embeds=self.num_class_embeds, upcast_attention=self.upcast_attention,
            resnet_time_scale_shift=self.resnet_time_scale_shift,
            projection_class_embeddings_input_dim=self.projection_class_embeddings_input_dim,
        )

    @property
    def downscale_factor(self) -> int:
        """Control image pixels per latent pixel: the conditioning embedding's stride-2 convolutions."""
        return 2 ** (len(self.conditioning_embedding_out_channels) - 1)

    def model(self, dtype=jnp.float32) -> nn.Module:
        """The Flax module of this config (`ControlNetUnionConfig` makes a `ControlNetUnionModel`)."""
        return ControlNetModel(self, dtype)

    def abstract_inputs(self) -> dict:
        """The smallest inputs the model runs on, as shapes: what initialising it needs."""
        inputs = abstract_inputs(self.unet_config)
        _, height, width, _ = inputs["sample"].shape
        f = self.downscale_factor
        image = jax.ShapeDtypeStruct((1, height * f, width * f, self.conditioning_channels), jnp.float32)
        return {**inputs, "controlnet_cond": image, "conditioning_scale": jax.ShapeDtypeStruct((1,), jnp.float32)}


class ControlNetConditioningEmbedding(nn.Module):
    """The control image to the latents' size: conv, then per level a conv and a stride-2 conv, SiLU
    after each, then a conv (zero-initialised in training) to the UNet's first width."""

    out_channels: int
    block_out_channels: tuple[int, ...]
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, image):  # [B, H, W, C] -> [B, H / f, W / f, out_channels]
        channels = self.block_out_channels
        x = nn.silu(Conv3x3(channels[0], dtype=self.dtype, name="conv_in")(image))
        for i, (width, next_width) in enumerate(zip(channels, channels[1:])):
            x = nn.silu(Conv3x3(width, dtype=self.dtype, name=f"blocks.{2 * i}")(x))
            x = Conv3x3(next_width, self.dtype, strides=2, name=f"blocks.{2 * i + 1}")(x)
            x = nn.silu(x)
        return Conv3x3(self.out_channels, dtype=self.dtype, name="conv_out")(x)


class ControlNetModel(nn.Module):
    """The residuals that steer a UNet toward a control image, given what the UNet itself is given."""

    config: ControlNetConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self, sample, timesteps, encoder_hidden_states, controlnet_cond, conditioning_scale, text_embeds=None,
        time_ids=None, encoder_lengths=None,
    ) -> tuple[list[jax.Array], jax.Array]:
        """Runs the ControlNet.

        Args:
          sample, timesteps, encoder_hidden_states, text_embeds, time_ids, encoder_lengths: as the
            UNet's (`sdxl.models.unet.UNet2DConditionModel`).
          controlnet_cond: [B, H, W, conditioning_channels] the control image in [0, 1], at the
            latents' size times `downscale_factor`.
          conditioning_scale: [B] how strongly each image is steered (0: not at all).

        Returns:
          down_block_additional_residuals: one [B, h_i, w_i, C_i] per skip of the UNet's encoder;
          mid_block_additional_residual: [B, h, w, C] for the mid block's output.
        """
        config, dtype = self.config, self.dtype
        context = Context(encoder_hidden_states.astype(dtype), encoder_lengths)
        temb = time_embedding(config.unet_config, sample.shape[0], timesteps, text_embeds, time_ids, None, dtype)
        cond = embedded_condition(self, config, controlnet_cond, dtype)
        x = Conv3x3(config.block_out_channels[0], dtype=dtype, name="conv_in")(sample.astype(dtype)) + cond
        return steering_residuals(config, x, temb, context, conditioning_scale, dtype)


def embedded_condition(module: nn.Module, config: ControlNetConfig, image: jax.Array, dtype) -> jax.Array:
    """[B, h, w, C] the control image through `controlnet_cond_embedding`, a child of `module` (a
    ControlNet's `__call__` calls this). The control image is the same at every step, so its embedding
    is a step invariant."""
    if config.controlnet_conditioning_channel_order == "bgr":
        image = image[..., ::-1]
    embedding = ControlNetConditioningEmbedding(
        config.block_out_channels[0], config.conditioning_embedding_out_channels, dtype,
        name="controlnet_cond_embedding",
    )
    return step_invariant(module, "controlnet_cond", lambda: embedding(image.astype(dtype)))


def steering_residuals(
    config: ControlNetConfig, x: jax.Array, temb: jax.Array, context: Context, conditioning_scale: jax.Array, dtype
) -> tuple[list[jax.Array], jax.Array]:
    """The encoder from `conv_in`'s output (the control image's embedding added): its down and mid
    blocks, then the zero convolutions, each output times its image's `conditioning_scale` ([B]).
    Called inside a ControlNet's `__call__`, whose children these layers are."""
    skips, mid = down_and_mid_blocks(config.unet_config, x, temb, context, dtype)
    scale = conditioning_scale.astype(dtype)[:, None, None, None]
    residuals = [
        nn.Conv(skip.shape[-1], (1, 1), dtype=dtype, name=f"controlnet_down_blocks.{i}")(skip) * scale
        for i, skip in enumerate(skips)
    ]
    mid = nn.Conv(mid.shape[-1], (1, 1), dtype=dtype, name="controlnet_mid_block")(mid) * scale
    return residuals, mid


def abstract_params(config: ControlNetConfig) -> dict:
    """The ControlNet's parameter shapes and dtypes (a ControlNet Union's too), without allocating them."""
    return jax.eval_shape(config.model().init, jax.random.key(0), **config.abstract_inputs())["params"]
