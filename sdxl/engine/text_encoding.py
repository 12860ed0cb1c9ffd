"""Text conditioning inside the compiled program: each text encoder's chosen hidden state of every chunk
of a prompt, weighed as webui weighs it (`sdxl.prompts.syntax` reads the weights on the host)."""

import jax
import jax.numpy as jnp

from ..checkpoints import ModelSpec
from ..models import clip


def encode_text(
    spec: ModelSpec, params: dict, ids: jax.Array, weights: jax.Array, rescale: jax.Array, clip_layer: jax.Array,
    clip_norm: jax.Array, dtype,
) -> tuple[jax.Array, jax.Array | None]:
    """Text conditioning as webui computes it chunk by chunk; for an unweighted prompt of one chunk,
    as the diffusers pipelines do.

    Args:
      params: with "embeddings", one [R, C_e] table per encoder of the textual-inversion vectors that ids
        past its vocabulary select (`sdxl.models.clip.CLIPTextEmbeddings`).
      ids, weights: [B, E, K * 77] token ids and their weights, one row per text encoder, K chunks.
      rescale: [B] bool, whether weighted chunks keep their mean (`emphasized`).
      clip_layer, clip_norm: [B, E] which hidden state of each encoder is read, and whether normed
        (`chosen_state`; `Inputs.clip_layer`).

    Returns:
      context: [B, K * 77, D] cross-attention states, the chunks' side by side, of every encoder,
        concatenated. By default SDXL's encoders give their penultimate hidden states; SD 1.x/2.x's
        its last (final-normed) one.
      pooled: [B, P] the last encoder's projected pooled output of the first chunk, unweighted (SDXL), else None.
    """
    batch, _, length = ids.shape
    chunks = length // spec.max_tokens
    per_chunk = jnp.repeat(rescale, chunks)
    states, pooled = [], None
    extra_tokens = params.get("embeddings", (None,) * len(spec.text_encoders))
    for e, (name, config) in enumerate(zip(spec.text_encoder_names, spec.text_encoders)):
        encoder = clip.CLIPTextModel(config, dtype=dtype)
        out = encoder.apply({"params": params[name]}, ids[:, e].reshape(batch * chunks, -1), extra_tokens[e])
        hidden = chosen_state(config, params[name], out.hidden_states, jnp.repeat(clip_layer[:, e], chunks),
                              jnp.repeat(clip_norm[:, e], chunks), dtype)  # [B * K, 77, D_e]
        weighted = emphasized(hidden, weights[:, e].reshape(batch * chunks, -1), per_chunk)
        states.append(weighted.reshape(batch, length, -1))
        if out.text_embeds is not None:
            pooled = out.text_embeds.reshape(batch, chunks, -1)[:, 0]
    return jnp.concatenate(states, axis=-1), (pooled if spec.is_sdxl else None)


def chosen_state(
    config: clip.CLIPTextConfig, params: dict, hidden_states: tuple[jax.Array, ...], layer: jax.Array,
    norm: jax.Array, dtype,
) -> jax.Array:
    """Each row's hidden state `layer` back from the last layer's output (1), through the encoder's
    final layer norm where `norm`: with (1, True) its last hidden state, and webui's clip skip N
    (N, True) on SD 1.x. A layer beyond the encoder's depth reads its embeddings (webui's deepest
    skip, 12, is within every real encoder; the tiny random ones are shallower).

    Args: hidden_states: the encoder's embeddings and layer outputs, [C, 77, D] each; layer [C] int32;
      norm [C] bool.
    """
    layer, state = jnp.minimum(layer, len(hidden_states)), hidden_states[-1]
    for back in range(2, len(hidden_states) + 1):
        state = jnp.where((layer == back)[:, None, None], hidden_states[-back], state)
    return jnp.where(norm[:, None, None], clip.final_layer_norm(config, params, state, dtype), state)


def emphasized(hidden: jax.Array, weights: jax.Array, rescale: jax.Array) -> jax.Array:
    """webui's emphasis: each token's states times its weight, then, where `rescale` ("original"; not
    "no-norm"), the chunk scaled so that its mean over every token and feature, BOS and padding
    included, is what it was. "none" is all weights 1 (`sdxl.prompts.syntax.prompt_pieces`).

    Args: hidden [C, 77, D] one chunk per row; weights [C, 77]; rescale [C] bool.
    """
    weighted = hidden * weights[..., None].astype(hidden.dtype)
    mean, weighted_mean = (x.astype(jnp.float32).mean(axis=(1, 2)) for x in (hidden, weighted))
    factor = jnp.where(rescale, mean / weighted_mean, 1.0)
    return weighted * factor[:, None, None].astype(hidden.dtype)
