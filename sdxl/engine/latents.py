"""Latents inside the compiled program: the VAE's scaling of them, and applying the VAE to a batch one
image per device at a time."""

import jax
import jax.numpy as jnp

from ..checkpoints import ModelSpec
from .mesh import BATCH_AXIS


def one_image_per_device_at_a_time(fn, images: jax.Array):
    """`fn` of a batch, applied to one image per device at a time, in turn.

    The VAE's activations at full resolution are the largest a program holds: 4 images of 1024x1024
    decoded at once need 14 GiB of temporaries per chip, more than a v5e's 16 GiB leaves beside SDXL's
    weights. Taking one image per device each turn keeps every device busy, and no image moves: the
    batch axis is split over the mesh in blocks, and each turn takes one image of each block.
    """
    mesh = jax.sharding.get_abstract_mesh()
    devices = 1 if mesh.empty else mesh.shape[BATCH_AXIS]
    per_device = images.shape[0] // devices
    if per_device <= 1:
        return fn(images)
    turns = images.reshape(devices, per_device, *images.shape[1:]).swapaxes(0, 1)  # [per_device, devices, ...]
    out = jax.lax.map(fn, turns)
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(images.shape[0], *x.shape[2:]), out)


def unscaled_latents(spec: ModelSpec, latents: jax.Array) -> jax.Array:
    """The VAE's latents from the diffusion model's, [B, h, w, C], as the diffusers pipelines undo the
    scaling: SDXL with the VAE's per-channel `latents_mean` and `latents_std` where it has them
    (Playground v2.5), else (and SD 1.x/2.x always) dividing by `scaling_factor`."""
    mean, std = _latent_statistics(spec)
    return latents * std / spec.vae.scaling_factor + mean


def scaled_latents(spec: ModelSpec, latents: jax.Array) -> jax.Array:
    """The diffusion model's latents from the VAE's: `unscaled_latents` undone."""
    mean, std = _latent_statistics(spec)
    return (latents - mean) * spec.vae.scaling_factor / std


def _latent_statistics(spec: ModelSpec) -> tuple:
    config = spec.vae
    if spec.is_sdxl and config.latents_mean is not None and config.latents_std is not None:
        return jnp.asarray(config.latents_mean), jnp.asarray(config.latents_std)
    return 0.0, 1.0
