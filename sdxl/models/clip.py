"""The CLIP text encoder of Stable Diffusion (transformers' CLIPTextModel / CLIPTextModelWithProjection).

SD 1.x/2.x condition on one encoder; SDXL on two: OpenAI CLIP ViT-L/14 (`text_encoder`, no
projection) and OpenCLIP ViT-bigG/14 (`text_encoder_2`, with a projection of the pooled output).
Module names mirror the checkpoint keys, e.g. `text_model.encoder.layers.3.self_attn.q_proj.weight`.
"""

import dataclasses
from typing import ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from .layers import Linear, quick_gelu

ARCHITECTURES = ("CLIPTextModel", "CLIPTextModelWithProjection")

# A buffer (always arange(max_position_embeddings)) that checkpoints from older transformers versions store.
IGNORED_KEYS = ("text_model.embeddings.position_ids",)


ACTIVATIONS = {
    "quick_gelu": quick_gelu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    """A transformers CLIPTextConfig (only the fields we use), with transformers' defaults.

    Whether the model projects its pooled output (`text_projection`) is not a config value in
    transformers but a choice of class, which config.json records in `architectures`. We keep that
    field as stored and derive `with_projection` from it, so the config is still built from the JSON
    dict alone.
    """

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    bos_token_id: int = 49406
    eos_token_id: int = 49407
    architectures: tuple[str, ...] = ("CLIPTextModel",)
    causal: ClassVar[bool] = True  # each token attends to those before it (the vision tower's: to all)

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (supported: {sorted(ACTIVATIONS)})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if not isinstance(self.eos_token_id, int):
            raise ValueError(f"eos_token_id must be a single token id, got {self.eos_token_id!r}")
        if len(self.architectures) != 1 or self.architectures[0] not in ARCHITECTURES:
            raise ValueError(f"architectures {self.architectures!r} is not one of {ARCHITECTURES}")

    @property
    def openai(self) -> bool:
        """OpenAI's CLIP (quick_gelu: SD 1.x's encoder, SDXL's first) rather than OpenCLIP (gelu: SD 2.x's
        encoder, SDXL's second), which webui reads through another class that ignores its "Clip skip"."""
        return self.hidden_act == "quick_gelu"

    @property
    def with_projection(self) -> bool:
        """Whether the checkpoint has a `text_projection` (SDXL's `text_encoder_2`)."""
        return self.architectures[0] == "CLIPTextModelWithProjection"


class CLIPTextOutput(NamedTuple):
    """The encoder's outputs, named as transformers names them.

    Attributes:
      hidden_states: the embeddings, then every layer's output (before `final_layer_norm`),
        num_hidden_layers + 1 arrays of shape [B, T, hidden_size].
      last_hidden_state: the last layer's output after `final_layer_norm`, [B, T, hidden_size].
      pooler_output: `last_hidden_state` at the end-of-text token, [B, hidden_size].
      text_embeds: `pooler_output` through `text_projection`, [B, projection_dim]; None without
        a projection.
    """

    hidden_states: tuple[jax.Array, ...]
    last_hidden_state: jax.Array
    pooler_output: jax.Array
    text_embeds: jax.Array | None


def rename_key(key: str) -> str:
    """Maps a stored key to the module's key.

    transformers 5 saves a CLIPTextModel without the `text_model.` prefix that older checkpoints
    (and the published SD/SDXL ones) have; CLIPTextModelWithProjection keeps it.
    """
    if key.startswith(("embeddings.", "encoder.", "final_layer_norm.")):
        return "text_model." + key
    return key


def layer_norm(config: CLIPTextConfig, dtype, name: str) -> nn.LayerNorm:
    # Two-pass variance, as torch computes it: CLIP's residual stream can have large-magnitude channels.
    return nn.LayerNorm(epsilon=config.layer_norm_eps, use_fast_variance=False, dtype=dtype, name=name)


class CLIPTextEmbeddings(nn.Module):
    config: CLIPTextConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array, extra_tokens: jax.Array | None = None) -> jax.Array:
        """`extra_tokens` [R, C]: the token table's rows past the vocabulary (textual-inversion vectors),
        which ids from `vocab_size` on select. They replace the token embedding before the positions are
        added, as webui's `EmbeddingsWithFixes` does."""
        cfg = self.config
        token = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, name="token_embedding")
        position = nn.Embed(cfg.max_position_embeddings, cfg.hidden_size, dtype=self.dtype, name="position_embedding")
        positions = jnp.arange(input_ids.shape[-1])
        if extra_tokens is None:
            tokens = token(input_ids)
        else:
            extra = input_ids >= cfg.vocab_size
            tokens = jnp.where(
                extra[..., None],
                jnp.take(extra_tokens, jnp.where(extra, input_ids - cfg.vocab_size, 0), axis=0).astype(self.dtype),
                token(jnp.where(extra, 0, input_ids)),
            )
        return tokens + position(positions)[None]  # [B, T, C]


class CLIPAttention(nn.Module):
    """Self-attention of the text tower, or of the vision tower (`sdxl.models.clip_vision`), whose
    config names the same fields."""

    config: CLIPTextConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        heads = cfg.num_attention_heads
        head_shape = (*x.shape[:-1], heads, cfg.hidden_size // heads)  # [B, T, heads, head_dim]
        q = Linear(cfg.hidden_size, dtype=self.dtype, name="q_proj")(x).reshape(head_shape)
        k = Linear(cfg.hidden_size, dtype=self.dtype, name="k_proj")(x).reshape(head_shape)
        v = Linear(cfg.hidden_size, dtype=self.dtype, name="v_proj")(x).reshape(head_shape)
        # No mask beside the causal one: SD pipelines pass none, so padding tokens are attended to.
        out = jax.nn.dot_product_attention(q, k, v, is_causal=cfg.causal)
        out = out.reshape(x.shape)  # [B, T, C]
        return Linear(cfg.hidden_size, dtype=self.dtype, name="out_proj")(out)


class CLIPMLP(nn.Module):
    config: CLIPTextConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        x = Linear(cfg.intermediate_size, dtype=self.dtype, name="fc1")(x)
        x = ACTIVATIONS[cfg.hidden_act](x)
        return Linear(cfg.hidden_size, dtype=self.dtype, name="fc2")(x)


class CLIPEncoderLayer(nn.Module):
    config: CLIPTextConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = layer_norm(self.config, self.dtype, "layer_norm1")(x)
        x = x + CLIPAttention(self.config, self.dtype, name="self_attn")(h)
        h = layer_norm(self.config, self.dtype, "layer_norm2")(x)
        return x + CLIPMLP(self.config, self.dtype, name="mlp")(h)


class CLIPTextTransformer(nn.Module):
    """The `text_model` part of the checkpoint: embeddings, encoder layers, final norm, pooling."""

    config: CLIPTextConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self, input_ids: jax.Array, extra_tokens: jax.Array | None = None
    ) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array]:
        cfg = self.config
        x = CLIPTextEmbeddings(cfg, self.dtype, name="embeddings")(input_ids, extra_tokens)
        hidden_states = [x]
        for i in range(cfg.num_hidden_layers):
            x = CLIPEncoderLayer(cfg, self.dtype, name=f"encoder.layers.{i}")(x)
            hidden_states.append(x)
        last_hidden_state = layer_norm(cfg, self.dtype, "final_layer_norm")(x)

        if cfg.eos_token_id == 2:
            # Configs written before transformers PR #24773 carry a wrong eos_token_id 2 (the
            # published SDXL configs among them). For them transformers keeps pooling at the largest
            # token id, which is the end-of-text token unless the vocabulary was extended. Ids past the
            # vocabulary (textual-inversion vectors) count as 0, the placeholder id webui gives them.
            pool_at = jnp.argmax(jnp.where(input_ids >= cfg.vocab_size, 0, input_ids), axis=-1)
        else:
            # The first end-of-text token: padding may reuse the same id.
            pool_at = jnp.argmax(input_ids == cfg.eos_token_id, axis=-1)
        # A per-row gather (batched by vmap, not indexed with an arange) so that a batch-sharded
        # input stays on its devices: XLA's partitioner cannot tell an arange index is row-local.
        pooled = jax.vmap(lambda states, i: states[i])(last_hidden_state, pool_at)  # [B, C]
        return tuple(hidden_states), last_hidden_state, pooled


class CLIPTextModel(nn.Module):
    """CLIPTextModel, or CLIPTextModelWithProjection when `config.with_projection`."""

    config: CLIPTextConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array, extra_tokens: jax.Array | None = None) -> CLIPTextOutput:
        """Encodes token ids, as transformers does when called with `input_ids` only.

        Args:
          input_ids: [B, T] integer token ids, T <= max_position_embeddings. Every sequence must
            contain the end-of-text token (tokenizers add it), which is where the output is pooled.
          extra_tokens: [R, hidden_size] token embeddings for the ids vocab_size .. vocab_size + R - 1
            (`CLIPTextEmbeddings`), or None.

        Returns:
          A CLIPTextOutput.
        """
        cfg = self.config
        if input_ids.ndim != 2 or input_ids.shape[1] > cfg.max_position_embeddings:
            raise ValueError(
                f"input_ids must be [batch, length <= {cfg.max_position_embeddings}], got shape {input_ids.shape}"
            )
        hidden_states, last_hidden_state, pooled = CLIPTextTransformer(cfg, self.dtype, name="text_model")(
            input_ids, extra_tokens
        )
        text_embeds = None
        if cfg.with_projection:
            text_embeds = Linear(cfg.projection_dim, use_bias=False, dtype=self.dtype, name="text_projection")(pooled)
        return CLIPTextOutput(hidden_states, last_hidden_state, pooled, text_embeds)


def final_layer_norm(config: CLIPTextConfig, params: dict, hidden: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The encoder's `final_layer_norm` (of its `params`) applied to one of its hidden states, [..., hidden_size]."""
    norm = layer_norm(config, dtype, "final_layer_norm")
    return norm.apply({"params": params["text_model"]["final_layer_norm"]}, hidden)


def abstract_params(config: CLIPTextConfig) -> dict:
    """The model's parameter shapes (ShapeDtypeStructs, float32), computed without allocating them."""
    input_ids = jnp.zeros((1, config.max_position_embeddings), jnp.int32)
    return jax.eval_shape(CLIPTextModel(config).init, jax.random.key(0), input_ids)["params"]
