"""Layers with PyTorch's numerics, which the model files build on.

Flax's `nn.Dense` keeps its kernel as [in, out]; PyTorch's `Linear.weight` is [out, in]. Keeping
the stored layout means a checkpoint's linear weights (88% of SDXL's parameters) load without a
transpose, which on a CPU host cost more than reading the file. XLA contracts either layout
at the same speed: `x @ weight.T` is a GEMM with a transposed operand, which is also what PyTorch runs.
Conv kernels (12%) keep `nn.Conv`'s HWIO layout, which the loader transposes to.
"""

import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import convolution

# The Flax collection of values that every denoising step would compute alike: `Conv3x3`'s
# Winograd-domain kernels and cross-attention's keys and values of the text. A caller that runs the
# model many times on the same weights and text (the pipeline's denoising steps) makes it mutable
# once, then passes it to every call.
STEP_INVARIANTS = "step_invariants"


def step_invariant(module: nn.Module, name: str, compute: Callable[[], jax.Array]) -> jax.Array:
    """The value `module` keeps as `name` in `STEP_INVARIANTS` if the caller gave it, else `compute()`
    (stored there when the caller made the collection mutable)."""
    value = module.get_variable(STEP_INVARIANTS, name)
    if value is None:
        with jax.named_scope(STEP_INVARIANTS):  # in op names, for profiles and the tests
            value = compute()
        if module.is_mutable_collection(STEP_INVARIANTS):
            module.put_variable(STEP_INVARIANTS, name, value)
    return value


class Linear(nn.Module):
    """torch.nn.Linear: y = x @ weight.T + bias, with `weight` [out, in] as the checkpoint stores it."""

    features: int
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.lecun_normal(in_axis=1, out_axis=0)
        weight = self.param("weight", init, (self.features, x.shape[-1]), jnp.float32)
        y = jax.lax.dot_general(x.astype(self.dtype), weight.astype(self.dtype), (((x.ndim - 1,), (1,)), ((), ())))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32).astype(self.dtype)
        return y


class Conv3x3(nn.Module):
    """torch.nn.Conv2d(kernel_size=3, padding=1) over NHWC maps, with `nn.Conv`'s parameters
    (`kernel` [3, 3, in, out]), by the algorithm that `sdxl.convolution` picks for the shape."""

    features: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (3, 3, x.shape[-1], self.features), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
        x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
        if convolution.implementation(*x.shape[1:], self.dtype) == "winograd":
            transformed = step_invariant(self, "kernel", lambda: convolution.winograd_kernel(kernel))
            y = convolution.winograd_conv3x3(x, transformed)
        else:
            y = convolution.direct_conv3x3(x, kernel)
        return y + bias.astype(self.dtype)


class GroupNorm(nn.Module):
    """torch's GroupNorm over NHWC maps, statistics in float32 with the two-pass variance.

    Two-pass, as torch computes it: the residual stream (and the VAE decoder's activations) reach
    the hundreds, where E[x^2] - E[x]^2 loses precision. Each channel is summed over (H, W) first
    and the channels of a group after: XLA:CPU reduces [B, H, W, C] over (H, W) about 9x faster than
    Flax's [B, H, W, G, C/G] over (H, W, C/G), which made GroupNorm a tenth of a CPU generation.
    """

    num_groups: int
    epsilon: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        channels = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (channels,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (channels,), jnp.float32)
        spatial = tuple(range(1, x.ndim - 1))
        count = math.prod(x.shape[a] for a in spatial) * (channels // self.num_groups)

        def per_channel_group_mean(values):  # [B, ..., C] -> [B, 1, ..., 1, C]
            sums = values.sum(spatial).reshape(x.shape[0], self.num_groups, -1).sum(-1) / count
            per_channel = jnp.repeat(sums, channels // self.num_groups, axis=-1)
            return per_channel.reshape(x.shape[:1] + (1,) * len(spatial) + (channels,))

        x = x.astype(jnp.float32)
        centered = x - per_channel_group_mean(x)
        inv_std = jax.lax.rsqrt(per_channel_group_mean(jnp.square(centered)) + self.epsilon)
        return (centered * (inv_std * scale.astype(jnp.float32)) + bias.astype(jnp.float32)).astype(self.dtype)
