"""ControlNet Union (diffusers' `ControlNetUnionModel`, xinsir's ControlNet++): one SDXL ControlNet for
many kinds of control image, told which kind each is by its control mode.

It is the plain ControlNet (`sdxl.models.controlnet`: the UNet's encoder, the control image's embedding,
the zero convolutions) with the mode in two places:

    control_type_proj,          the mode as a one-hot vector over `num_control_type`, each entry
    control_add_embedding       embedded as a timestep is, then an MLP: added to the time embedding
    task_embedding              one vector per mode, added to the control image's mean feature
    transformer_layes.N         (sic) a CLIP-like transformer block over two tokens per row: the
                                control image's mean feature and the latents' (after `conv_in`)
    spatial_ch_projs            the control image's token to a per-channel shift, added with the
                                control image's embedding to the latents

Module names follow diffusers' keys, so `diffusion_pytorch_model.safetensors` loads with three keys
renamed (`rename_key`: PyTorch's fused attention projection, and the bare `task_embedding` tensor).

One control image per model: diffusers' single-condition path (`control_image=[image],
control_mode=[m]`), where the residuals are scaled at the end as a plain ControlNet's. Several
conditions to one model at once (a multi-hot control type) are not implemented.

The transformer's attention: diffusers' `nn.MultiheadAttention` is sequence-first, so given its
[rows, tokens, C] input it attends over the rows of the batch, for each token. For one image per
call that is the image's own rows (its negative and positive prompts' with guidance); with more,
diffusers' images depend on each other. Here the rows of each image attend to one another only
(`rows_per_image`), so an image is the same in any batch, and equals diffusers' one-image call.
"""

import dataclasses
import numbers

import flax.linen as nn
import jax
import jax.numpy as jnp

from .controlnet import ControlNetConfig, embedded_condition, steering_residuals
from .layers import Context, Conv3x3, Linear, quick_gelu
from .unet import TimestepEmbedding, time_embedding, timestep_embedding

# xinsir's control modes by index, with the names of the control images each is for (the model card's
# "ControlMode"; the first name is the mode's own). The first six are every Union model's; ProMax
# (`diffusion_pytorch_model_promax.safetensors` with `config_promax.json`, 8 modes) adds tile and repaint.
CONTROL_MODES = (
    ("openpose",),
    ("depth",),
    ("hed", "pidi", "scribble", "ted", "softedge"),  # thick lines
    ("canny", "lineart", "anime_lineart", "mlsd"),  # thin lines
    ("normal",),
    ("segment",),
    ("tile",),
    ("repaint", "inpaint", "outpaint"),
)
_MODE_BY_NAME = {name: mode for mode, names in enumerate(CONTROL_MODES) for name in names}
# Stored keys that PyTorch names apart from its modules: `nn.MultiheadAttention`'s fused projection
# and `nn.Parameter`s (here `task_embedding`).
_RENAMED_SUFFIXES = {"attn.in_proj_weight": "attn.in_proj.weight", "attn.in_proj_bias": "attn.in_proj.bias"}
_RENAMED_KEYS = {"task_embedding": "task_embedding.weight"}


def describe_mode(mode: int) -> str:
    """A mode for people: "2 hed/pidi/scribble/ted/softedge"."""
    return f"{mode} {'/'.join(CONTROL_MODES[mode])}" if mode < len(CONTROL_MODES) else str(mode)


def describe_modes(count: int = len(CONTROL_MODES)) -> str:
    """The first `count` modes for people: "0 openpose, 1 depth, ..."."""
    return ", ".join(describe_mode(mode) for mode in range(count))


def control_mode(value) -> int:
    """A control mode as its index: an index of `CONTROL_MODES`, or one of its names.

    Raises:
      ValueError: naming the modes.
    """
    if isinstance(value, str):
        text = value.strip().lower()
        value = int(text) if text.isdigit() else _MODE_BY_NAME.get(text, value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= value < len(CONTROL_MODES):
        return int(value)
    raise ValueError(f"a control mode is one of {describe_modes()} (the number or a name), got {value!r}")


def rename_key(key: str) -> str:
    """A stored key as the module's key (see `_RENAMED_SUFFIXES`)."""
    for suffix, renamed in _RENAMED_SUFFIXES.items():
        if key.endswith("." + suffix):
            return key.removesuffix(suffix) + renamed
    return _RENAMED_KEYS.get(key, key)


@dataclasses.dataclass(frozen=True)
class ControlNetUnionConfig(ControlNetConfig):
    """diffusers' `ControlNetUnionModel` config: the plain ControlNet's fields (and its checks), its own
    default conditioning embedding, and the fields of the mode's transformer."""

    conditioning_embedding_out_channels: tuple[int, ...] = (48, 96, 192, 384)
    num_control_type: int = 6
    num_trans_channel: int = 320
    num_trans_head: int = 8
    num_trans_layer: int = 1
    num_proj_channel: int = 320

    def __post_init__(self):
        super().__post_init__()
        width = self.block_out_channels[0]
        problems = {
            "controlnet_conditioning_channel_order must be 'rgb' (diffusers refuses others)":
                self.controlnet_conditioning_channel_order != "rgb",
            "its control type is embedded at addition_time_embed_dim, which only an SDXL config has":
                self.addition_time_embed_dim is None,
            f"num_trans_channel and num_proj_channel must be the first block's width ({width})":
                self.num_trans_channel != width or self.num_proj_channel != width,
            f"num_trans_channel ({self.num_trans_channel}) must split into num_trans_head heads":
                self.num_trans_head < 1 or self.num_trans_channel % self.num_trans_head,
            "num_control_type must be at least 1": self.num_control_type < 1,
        }
        for problem, found in problems.items():
            if found:
                raise ValueError(f"ControlNetUnionConfig: {problem}")

    def model(self, dtype=jnp.float32) -> nn.Module:
        return ControlNetUnionModel(self, dtype)

    def abstract_inputs(self) -> dict:
        return {**super().abstract_inputs(), "control_mode": jax.ShapeDtypeStruct((1,), jnp.int32)}


class MultiheadAttention(nn.Module):
    """torch's `nn.MultiheadAttention` (one fused input projection, `in_proj`) over [rows, tokens, C]
    as diffusers calls it, sequence-first: each token attends across rows, here the
    `rows_per_image` consecutive rows of one image (see the module's docstring)."""

    num_heads: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, rows_per_image: int) -> jax.Array:  # [N, T, C] -> [N, T, C]
        rows, tokens, channels = x.shape
        images, heads = rows // rows_per_image, self.num_heads

        def by_token(y):  # [N, T, C] -> [images * T, rows_per_image, heads, C / heads]
            y = y.reshape(images, rows_per_image, tokens, heads, channels // heads)
            return y.transpose(0, 2, 1, 3, 4).reshape(images * tokens, rows_per_image, heads, -1)

        q, k, v = jnp.split(Linear(3 * channels, dtype=self.dtype, name="in_proj")(x), 3, axis=-1)
        out = jax.nn.dot_product_attention(by_token(q), by_token(k), by_token(v))
        out = out.reshape(images, tokens, rows_per_image, channels).transpose(0, 2, 1, 3).reshape(x.shape)
        return Linear(channels, dtype=self.dtype, name="out_proj")(out)


class ResidualAttentionBlock(nn.Module):
    """A pre-norm transformer block as OpenAI CLIP's: attention, then a quick-GELU MLP."""

    num_heads: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, rows_per_image: int) -> jax.Array:  # [N, T, C]
        def layer_norm(name):  # two-pass variance, as torch's
            return nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, dtype=self.dtype, name=name)

        x = x + MultiheadAttention(self.num_heads, self.dtype, name="attn")(layer_norm("ln_1")(x), rows_per_image)
        hidden = quick_gelu(Linear(4 * x.shape[-1], dtype=self.dtype, name="mlp.c_fc")(layer_norm("ln_2")(x)))
        return x + Linear(x.shape[-1], dtype=self.dtype, name="mlp.c_proj")(hidden)


class ControlNetUnionModel(nn.Module):
    """The residuals that steer a UNet toward a control image of a given mode."""

    config: ControlNetUnionConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self, sample, timesteps, encoder_hidden_states, controlnet_cond, conditioning_scale, control_mode,
        text_embeds=None, time_ids=None, encoder_lengths=None, rows_per_image: int = 1,
    ) -> tuple[list[jax.Array], jax.Array]:
        """Runs the ControlNet Union.

        Args:
          sample, ..., encoder_lengths: as `sdxl.models.controlnet.ControlNetModel`'s.
          control_mode: [B] int32, each row's mode (an index of `CONTROL_MODES`, below `num_control_type`).
          rows_per_image: consecutive rows of the batch that are one image's (2 with guidance: its
            negative and positive prompts'), which the mode's transformer attends across.

        Returns:
          As `sdxl.models.controlnet.ControlNetModel`'s.
        """
        config, dtype = self.config, self.dtype
        context = Context(encoder_hidden_states.astype(dtype), encoder_lengths)
        temb = time_embedding(config.unet_config, sample.shape[0], timesteps, text_embeds, time_ids, None, dtype)
        temb = temb + self._control_type_embedding(control_mode)
        cond = embedded_condition(self, config, controlnet_cond, dtype)
        x = Conv3x3(config.block_out_channels[0], dtype=dtype, name="conv_in")(sample.astype(dtype))
        x = x + self._fused(cond, x, control_mode, rows_per_image)
        return steering_residuals(config, x, temb, context, conditioning_scale, dtype)

    def _control_type_embedding(self, control_mode: jax.Array) -> jax.Array:
        """[B, time_embed_dim]: the one-hot control type, each entry embedded as a timestep, through an MLP."""
        config = self.config
        one_hot = jax.nn.one_hot(control_mode, config.num_control_type, dtype=jnp.float32)  # [B, M]
        waves = timestep_embedding(
            one_hot.reshape(-1), config.addition_time_embed_dim, config.flip_sin_to_cos, config.freq_shift
        ).reshape(len(control_mode), -1)  # [B, M * addition_time_embed_dim]
        embedding = TimestepEmbedding(config.unet_config.time_embed_dim, self.dtype, name="control_add_embedding")
        return embedding(waves.astype(self.dtype))

    def _fused(self, cond: jax.Array, x: jax.Array, control_mode: jax.Array, rows_per_image: int) -> jax.Array:
        """[B, h, w, C] what the control image adds to the latents: its embedding `cond`, plus a
        per-channel shift from the transformer over (its mean feature + its mode's task embedding,
        the latents' mean feature)."""
        config, dtype = self.config, self.dtype
        task = nn.Embed(config.num_control_type, config.num_trans_channel, dtype=dtype, name="task_embedding")
        tokens = jnp.stack([cond.mean(axis=(1, 2)) + task(control_mode), x.mean(axis=(1, 2))], axis=1)  # [B, 2, C]
        for i in range(config.num_trans_layer):
            block = ResidualAttentionBlock(config.num_trans_head, dtype, name=f"transformer_layes.{i}")
            tokens = block(tokens, rows_per_image)
        alpha = Linear(config.num_proj_channel, dtype=dtype, name="spatial_ch_projs")(tokens[:, 0])  # [B, C]
        return cond + alpha[:, None, None, :]
