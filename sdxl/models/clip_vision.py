"""The CLIP image encoder of IP-Adapters (transformers' CLIPVisionModelWithProjection).

h94/IP-Adapter ships two, in the folders `load_ip_adapter` reads by default: OpenCLIP ViT-H/14
(`models/image_encoder`, for the SD 1.5 adapters and the SDXL "vit-h" ones) and ViT-bigG/14
(`sdxl_models/image_encoder`). Module names mirror the checkpoint keys, e.g.
`vision_model.encoder.layers.3.self_attn.q_proj.weight`; the encoder layers are the text tower's
(`sdxl.models.clip`), read from the same-named config fields.
"""

import dataclasses
from typing import ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from .clip import ACTIVATIONS, CLIPEncoderLayer, layer_norm
from .layers import Linear, Parameter

ARCHITECTURE = "CLIPVisionModelWithProjection"

# A buffer (always arange(num_positions)) that checkpoints from older transformers versions store.
IGNORED_KEYS = ("vision_model.embeddings.position_ids",)
# Bare tensors, stored without the ".weight" their modules' keys have (`layers.Parameter`).
BARE_TENSORS = ("vision_model.embeddings.class_embedding",)


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    """A transformers CLIPVisionConfig (only the fields we use), with transformers' defaults.

    `architectures` is kept as stored and must name the class with the projection, the one diffusers'
    `load_ip_adapter` loads.
    """

    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    architectures: tuple[str, ...] = (ARCHITECTURE,)
    causal: ClassVar[bool] = False  # every patch attends to every other (`clip.CLIPAttention`)

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (supported: {sorted(ACTIVATIONS)})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if not isinstance(self.image_size, int) or not isinstance(self.patch_size, int):
            raise ValueError(f"image_size and patch_size must be ints, got {self.image_size!r}, {self.patch_size!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.architectures != (ARCHITECTURE,):
            raise ValueError(f"architectures {self.architectures!r} is not ({ARCHITECTURE!r},)")

    @property
    def num_positions(self) -> int:
        """The class token and one per patch."""
        return (self.image_size // self.patch_size) ** 2 + 1


class CLIPVisionOutput(NamedTuple):
    """The encoder's outputs, named as transformers names them.

    Attributes:
      hidden_states: the embeddings after `pre_layrnorm`, then every layer's output,
        num_hidden_layers + 1 arrays of shape [B, num_positions, hidden_size]. The Plus and
        full-face IP-Adapters read `hidden_states[-2]`.
      last_hidden_state: the last layer's output, [B, num_positions, hidden_size].
      image_embeds: the class token after `post_layernorm` and `visual_projection`, [B, projection_dim];
        what the plain IP-Adapters read.
    """

    hidden_states: tuple[jax.Array, ...]
    last_hidden_state: jax.Array
    image_embeds: jax.Array


def rename_key(key: str) -> str:
    """Maps a stored key to the module's key (see `BARE_TENSORS`)."""
    return key + ".weight" if key in BARE_TENSORS else key


class CLIPVisionEmbeddings(nn.Module):
    config: CLIPVisionConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pixel_values: jax.Array) -> jax.Array:  # [B, H, W, 3] -> [B, num_positions, C]
        cfg = self.config
        patch = (cfg.patch_size, cfg.patch_size)
        conv = nn.Conv(cfg.hidden_size, patch, strides=patch, padding="VALID", use_bias=False, dtype=self.dtype,
                       name="patch_embedding")
        patches = conv(pixel_values.astype(self.dtype))
        patches = patches.reshape(patches.shape[0], -1, cfg.hidden_size)  # row by row, as torch's flatten
        class_token = Parameter((cfg.hidden_size,), name="class_embedding")().astype(self.dtype)
        class_tokens = jnp.broadcast_to(class_token, (patches.shape[0], 1, cfg.hidden_size))
        position = nn.Embed(cfg.num_positions, cfg.hidden_size, dtype=self.dtype, name="position_embedding")
        return jnp.concatenate([class_tokens, patches], axis=1) + position(jnp.arange(cfg.num_positions))[None]


class CLIPVisionTransformer(nn.Module):
    """The `vision_model` part of the checkpoint: embeddings, encoder layers, the pooled class token."""

    config: CLIPVisionConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pixel_values: jax.Array) -> tuple[tuple[jax.Array, ...], jax.Array]:
        cfg = self.config
        x = CLIPVisionEmbeddings(cfg, self.dtype, name="embeddings")(pixel_values)
        x = layer_norm(cfg, self.dtype, "pre_layrnorm")(x)  # sic: transformers' spelling
        hidden_states = [x]
        for i in range(cfg.num_hidden_layers):
            x = CLIPEncoderLayer(cfg, self.dtype, name=f"encoder.layers.{i}")(x)
            hidden_states.append(x)
        pooled = layer_norm(cfg, self.dtype, "post_layernorm")(x[:, 0])  # [B, C]
        return tuple(hidden_states), pooled


class CLIPVisionModelWithProjection(nn.Module):
    config: CLIPVisionConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pixel_values: jax.Array) -> CLIPVisionOutput:
        """Encodes images, as transformers does when called with `pixel_values` only.

        Args:
          pixel_values: [B, image_size, image_size, num_channels], normalised as the CLIP image
            processor does (`sdxl.engine.clip_inputs`).

        Returns:
          A CLIPVisionOutput.
        """
        cfg = self.config
        expected = (cfg.image_size, cfg.image_size, cfg.num_channels)
        if pixel_values.ndim != 4 or pixel_values.shape[1:] != expected:
            raise ValueError(f"pixel_values must be [batch, {', '.join(map(str, expected))}], got {pixel_values.shape}")
        hidden_states, pooled = CLIPVisionTransformer(cfg, self.dtype, name="vision_model")(pixel_values)
        image_embeds = Linear(cfg.projection_dim, use_bias=False, dtype=self.dtype, name="visual_projection")(pooled)
        return CLIPVisionOutput(hidden_states, hidden_states[-1], image_embeds)


def abstract_params(config: CLIPVisionConfig) -> dict:
    """The model's parameter shapes (ShapeDtypeStructs, float32), computed without allocating them."""
    pixels = jnp.zeros((1, config.image_size, config.image_size, config.num_channels), jnp.float32)
    return jax.eval_shape(CLIPVisionModelWithProjection(config).init, jax.random.key(0), pixels)["params"]
