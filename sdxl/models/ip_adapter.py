"""IP-Adapters' image projections: a CLIP image encoder's output as tokens for the UNet's cross-attention.

Three kinds, under h94/IP-Adapter's module names (its files store them under `image_proj.`), each as
diffusers runs it after converting the file (`UNet2DConditionModel._convert_ip_adapter_image_proj_to_diffusers`):

- "plain" (h94's `ImageProjModel`, diffusers' `ImageProjection`): the projected image embedding
  through `proj` into `num_tokens` tokens, then `norm`.
- "plus" (h94's `Resampler`, diffusers' `IPAdapterPlusImageProjection`): learnt `latents` that
  attend, layer by layer, to the encoder's penultimate hidden states (`proj_in`), then `proj_out`
  and `norm_out`.
- "full" (h94's `MLPProjModel`, diffusers' `IPAdapterFullImageProjection`, the "full face"
  adapter): every penultimate hidden state through an MLP (`proj.0`, GELU, `proj.2`) and `proj.3`.

The kind and its sizes follow from the stored weights alone (`projection_config`), as diffusers
tells them. The FaceID adapters project insightface's face embedding instead, so they are refused.
"""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from .layers import Linear, Parameter

KINDS = ("plain", "plus", "full")
# The Resampler's heads are 64 wide in every published adapter; diffusers counts them so.
RESAMPLER_HEAD_DIM = 64
# Bare tensors, stored without the ".weight" their modules' keys have (`layers.Parameter`).
_LATENTS = "latents"
BARE_TENSORS = (_LATENTS,)
_FACEID = (
    "a FaceID IP-Adapter: it projects an insightface face embedding, and this project does not run "
    "insightface; use a plain, Plus or full-face IP-Adapter"
)


@dataclasses.dataclass(frozen=True)
class ImageProjectionConfig:
    """An image projection's kind and sizes, read from its weights' shapes (`projection_config`).

    `num_tokens` is the number of tokens it gives: the plain kind's `proj` rows per token, the
    Resampler's latents; None for "full", which gives one per encoder hidden state (257 for ViT-H/14).
    The Resampler's fields (`hidden_dim` onwards) are 0 for the other kinds.
    """

    kind: str
    image_embed_dim: int  # the width of what it reads: image_embeds (plain), a hidden state (plus, full)
    cross_attention_dim: int
    num_tokens: int | None = None
    hidden_dim: int = 0
    depth: int = 0
    heads: int = 0
    ff_dim: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is not one of {KINDS}")
        if (self.kind == "full") != (self.num_tokens is None):
            raise ValueError(f"num_tokens {self.num_tokens!r} does not fit the kind {self.kind!r}")
        if self.kind == "plus" and not (self.depth and self.heads and self.ff_dim and self.hidden_dim):
            raise ValueError(f"a Resampler needs hidden_dim, depth, heads and ff_dim, got {self}")

    @property
    def reads_hidden_states(self) -> bool:
        """Whether it reads the encoder's penultimate hidden states (`hidden_states[-2]`) rather
        than its `image_embeds`."""
        return self.kind != "plain"


def rename_key(key: str) -> str:
    """Maps a stored key (without `image_proj.`) to the module's key (see `BARE_TENSORS`)."""
    return key + ".weight" if key in BARE_TENSORS else key


def projection_config(shapes: dict[str, tuple[int, ...]]) -> ImageProjectionConfig:
    """The projection that weights of these shapes ({key without `image_proj.`: shape}) are, told apart
    by their keys in the order diffusers tells them.

    Raises:
      ValueError: a FaceID adapter, or weights of no known projection.
    """
    if "proj.weight" in shapes:
        rows, image_embed_dim = shapes["proj.weight"]
        # diffusers takes 4 tokens for granted; the norm's width gives the same for h94's adapters.
        cross_attention_dim = shapes["norm.weight"][0] if "norm.weight" in shapes else rows
        return ImageProjectionConfig("plain", image_embed_dim, cross_attention_dim, rows // cross_attention_dim)
    if "proj.3.weight" in shapes:
        return ImageProjectionConfig("full", shapes["proj.0.weight"][1], shapes["proj.3.weight"][0])
    if "perceiver_resampler.proj_in.weight" in shapes or "norm.weight" in shapes:
        raise ValueError(_FACEID)
    if _LATENTS not in shapes or "proj_in.weight" not in shapes:
        raise ValueError("no IP-Adapter image projection (neither proj, proj.3, nor latents and proj_in)")
    _, num_tokens, hidden_dim = shapes[_LATENTS]
    depth = len({m.group(1) for key in shapes if (m := re.fullmatch(r"layers\.(\d+)\.0\.to_q\.weight", key))})
    return ImageProjectionConfig(
        "plus",
        image_embed_dim=shapes["proj_in.weight"][1],
        cross_attention_dim=shapes["proj_out.weight"][0],
        num_tokens=num_tokens,
        hidden_dim=hidden_dim,
        depth=depth,
        heads=shapes["layers.0.0.to_q.weight"][0] // RESAMPLER_HEAD_DIM,
        ff_dim=shapes["layers.0.1.1.weight"][0],
    )


def _layer_norm(dtype, name: str) -> nn.LayerNorm:
    # torch's LayerNorm: eps 1e-5, the two-pass variance.
    return nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, dtype=dtype, name=name)


def _gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)


class ImageProjModel(nn.Module):
    config: ImageProjectionConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, image_embeds: jax.Array) -> jax.Array:  # [B, D_image] -> [B, T, D_cross]
        cfg = self.config
        x = Linear(cfg.num_tokens * cfg.cross_attention_dim, dtype=self.dtype, name="proj")(image_embeds)
        x = x.reshape(x.shape[0], cfg.num_tokens, cfg.cross_attention_dim)
        return _layer_norm(self.dtype, "norm")(x)


class PerceiverAttention(nn.Module):
    """The latents attend to the image's states and to themselves (h94's `PerceiverAttention`)."""

    config: ImageProjectionConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, latents: jax.Array) -> jax.Array:  # [B, S, C], [B, T, C] -> [B, T, C]
        cfg = self.config
        inner = cfg.heads * RESAMPLER_HEAD_DIM
        x = _layer_norm(self.dtype, "norm1")(x)
        latents = _layer_norm(self.dtype, "norm2")(latents)
        context = jnp.concatenate([x, latents], axis=1)  # [B, S + T, C]

        def heads(y):  # [B, L, inner] -> [B, L, heads, head_dim]
            return y.reshape(*y.shape[:2], cfg.heads, RESAMPLER_HEAD_DIM)

        q = Linear(inner, use_bias=False, dtype=self.dtype, name="to_q")(latents)
        k, v = jnp.split(Linear(2 * inner, use_bias=False, dtype=self.dtype, name="to_kv")(context), 2, axis=-1)
        out = jax.nn.dot_product_attention(heads(q), heads(k), heads(v))  # scaled by head_dim ** -0.5
        out = out.reshape(*latents.shape[:2], inner)
        return Linear(cfg.hidden_dim, use_bias=False, dtype=self.dtype, name="to_out")(out)


class FeedForward(nn.Module):
    """h94's `FeedForward`: an `nn.Sequential` of LayerNorm, Linear, GELU, Linear (`0`, `1`, `3`)."""

    config: ImageProjectionConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        x = _layer_norm(self.dtype, "0")(x)
        x = _gelu(Linear(cfg.ff_dim, use_bias=False, dtype=self.dtype, name="1")(x))
        return Linear(cfg.hidden_dim, use_bias=False, dtype=self.dtype, name="3")(x)


class Resampler(nn.Module):
    config: ImageProjectionConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, hidden_states: jax.Array) -> jax.Array:  # [B, S, D_image] -> [B, T, D_cross]
        cfg = self.config
        latents = Parameter((1, cfg.num_tokens, cfg.hidden_dim), name=_LATENTS)().astype(self.dtype)
        latents = jnp.broadcast_to(latents, (hidden_states.shape[0], *latents.shape[1:]))  # [B, T, C]
        x = Linear(cfg.hidden_dim, dtype=self.dtype, name="proj_in")(hidden_states)
        for i in range(cfg.depth):
            latents = latents + PerceiverAttention(cfg, self.dtype, name=f"layers.{i}.0")(x, latents)
            latents = latents + FeedForward(cfg, self.dtype, name=f"layers.{i}.1")(latents)
        latents = Linear(cfg.cross_attention_dim, dtype=self.dtype, name="proj_out")(latents)
        return _layer_norm(self.dtype, "norm_out")(latents)


class MLPProjModel(nn.Module):
    config: ImageProjectionConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, hidden_states: jax.Array) -> jax.Array:  # [B, S, D_image] -> [B, S, D_cross]
        cfg = self.config
        x = _gelu(Linear(cfg.image_embed_dim, dtype=self.dtype, name="proj.0")(hidden_states))
        x = Linear(cfg.cross_attention_dim, dtype=self.dtype, name="proj.2")(x)
        return _layer_norm(self.dtype, "proj.3")(x)


MODELS = {"plain": ImageProjModel, "plus": Resampler, "full": MLPProjModel}


def image_projection(config: ImageProjectionConfig, dtype=jnp.float32) -> nn.Module:
    """The projection module of `config.kind`; it takes the encoder's `image_embeds` [B, D] or, where
    `config.reads_hidden_states`, its `hidden_states[-2]` [B, S, D], and gives [B, T, cross_attention_dim]."""
    return MODELS[config.kind](config, dtype)


def abstract_params(config: ImageProjectionConfig) -> dict:
    """The projection's parameter shapes (ShapeDtypeStructs, float32), computed without allocating them."""
    shape = (1, 2, config.image_embed_dim) if config.reads_hidden_states else (1, config.image_embed_dim)
    return jax.eval_shape(image_projection(config).init, jax.random.key(0), jnp.zeros(shape))["params"]
