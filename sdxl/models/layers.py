"""The building blocks every model file shares, with PyTorch's numerics and diffusers' parameter names.

The linear, convolution and norm layers; the resnet, attention and resampling blocks that both the
UNet and the VAE are made of (diffusers keeps them in its shared `resnet.py`, `attention_processor.py`
and `upsampling.py`/`downsampling.py`); and the step-invariant cache the denoising loop uses.

Flax's `nn.Dense` keeps its kernel as [in, out]; PyTorch's `Linear.weight` is [out, in]. Keeping
the stored layout means a checkpoint's linear weights (88% of SDXL's parameters) load without a
transpose, which on a CPU host cost more than reading the file. XLA contracts either layout
at the same speed: `x @ weight.T` is a GEMM with a transposed operand, which is also what PyTorch runs.
Conv kernels (12%) keep `nn.Conv`'s HWIO layout, which the loader transposes to.

`SDXL_GROUP_NORM=two-pass|shifted` picks how every GroupNorm computes its statistics (`GroupNorm`),
when a model is traced; two-pass by default.
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..config import kernel_override
from . import convolution
from .attention import dot_product_attention
from .quantization import Quantized, product_in_8_bits

# The Flax collection of values that every denoising step would compute alike: `Conv3x3`'s
# Winograd-domain kernels and cross-attention's keys and values of the text. A caller that runs the
# model many times on the same weights and text (the pipeline's denoising steps) makes it mutable
# once, then passes it to every call.
STEP_INVARIANTS = "step_invariants"

GROUP_NORM_STATISTICS = ("two-pass", "shifted")  # SDXL_GROUP_NORM's choices (`GroupNorm`)


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


def quick_gelu(x: jax.Array) -> jax.Array:
    """The sigmoid approximation of gelu that OpenAI CLIP was trained with (and the blocks built like CLIP's)."""
    return x * jax.nn.sigmoid(1.702 * x)


class Linear(nn.Module):
    """torch.nn.Linear: y = x @ weight.T + bias, with `weight` [out, in] as the checkpoint stores it; a
    `Quantized` weight computes in 8 bits, the input quantized per row (`quantization.product_in_8_bits`)."""

    features: int
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.lecun_normal(in_axis=1, out_axis=0)
        weight = self.param("weight", init, (self.features, x.shape[-1]), jnp.float32)
        contract = functools.partial(jax.lax.dot_general, dimension_numbers=(((x.ndim - 1,), (1,)), ((), ())))
        if isinstance(weight, Quantized):
            y = product_in_8_bits(contract, x, weight, (x.ndim - 1,), self.dtype)
        else:
            y = contract(x.astype(self.dtype), weight.astype(self.dtype))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32).astype(self.dtype)
        return y


class Conv3x3(nn.Module):
    """torch.nn.Conv2d(kernel_size=3, stride=strides, padding=padding) over NHWC maps, with `nn.Conv`'s
    parameters (`kernel` [3, 3, in, out]); at stride 1 and padding 1, by the algorithm that `sdxl.models.convolution`
    picks for the shape. A `Quantized` kernel computes in 8 bits, directly, the input quantized per image
    (`quantization.product_in_8_bits`)."""

    features: int
    dtype: jnp.dtype = jnp.float32
    strides: int = 1
    padding: convolution.Padding = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (3, 3, x.shape[-1], self.features), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
        conv = functools.partial(convolution.direct_conv3x3, strides=self.strides, padding=self.padding)
        implementation = convolution.implementation(*x.shape[1:], self.dtype)
        if isinstance(kernel, Quantized):
            y = product_in_8_bits(conv, x, kernel, (1, 2, 3), self.dtype)
        elif (self.strides, self.padding) == (1, 1) and implementation == "winograd":
            transformed = step_invariant(self, "kernel", lambda: convolution.winograd_kernel(kernel.astype(self.dtype)))
            y = convolution.winograd_conv3x3(x.astype(self.dtype), transformed)
        else:
            y = conv(x.astype(self.dtype), kernel.astype(self.dtype))
        return y + bias.astype(self.dtype)


class GroupNorm(nn.Module):
    """torch's GroupNorm over NHWC maps, statistics in float32 with the two-pass variance.

    Two-pass, as torch computes it: the residual stream (and the VAE decoder's activations) reach
    the hundreds, where E[x^2] - E[x]^2 loses precision. Each channel is summed over (H, W) first
    and the channels of a group after: XLA:CPU reduces [B, H, W, C] over (H, W) about 9x faster than
    Flax's [B, H, W, G, C/G] over (H, W, C/G), which made GroupNorm a tenth of a CPU generation.

    `SDXL_GROUP_NORM=shifted` reads the map once for both statistics instead of twice, for
    memory-bound accelerators: the sums of x - s and of its square, with s each group's mean over a
    subsample of the positions (every `stride`-th row and column, about 16 a side). With s that close
    to the mean, E[(x - s)^2] - E[x - s]^2 cancels no more digits than the two-pass variance; in
    float32 the two differ by about 1e-6 of the result.
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

        def per_channel_group_mean(values):  # [B, ..., C] -> [B, 1, ..., 1, C]
            count = math.prod(values.shape[a] for a in spatial) * (channels // self.num_groups)
            sums = values.sum(spatial).reshape(x.shape[0], self.num_groups, -1).sum(-1) / count
            per_channel = jnp.repeat(sums, channels // self.num_groups, axis=-1)
            return per_channel.reshape(x.shape[:1] + (1,) * len(spatial) + (channels,))

        x = x.astype(jnp.float32)
        if kernel_override("SDXL_GROUP_NORM", GROUP_NORM_STATISTICS) == "shifted":
            stride = max(1, min(x.shape[a] for a in spatial) // 16)
            shift = per_channel_group_mean(x[(slice(None),) + (slice(None, None, stride),) * len(spatial)])
            shifted_mean = per_channel_group_mean(x - shift)
            variance = jnp.maximum(per_channel_group_mean(jnp.square(x - shift)) - jnp.square(shifted_mean), 0)
            centered = x - (shift + shifted_mean)
        else:
            centered = x - per_channel_group_mean(x)
            variance = per_channel_group_mean(jnp.square(centered))
        inv_std = jax.lax.rsqrt(variance + self.epsilon)
        return (centered * (inv_std * scale.astype(jnp.float32)) + bias.astype(jnp.float32)).astype(self.dtype)


def group_norm(num_groups: int, epsilon: float, dtype, name: str) -> GroupNorm:
    return GroupNorm(num_groups=num_groups, epsilon=epsilon, dtype=dtype, name=name)


def resize_nearest(x: jax.Array, size: tuple[int, int]) -> jax.Array:
    """Nearest-neighbour resize of [B, H, W, C] to [B, *size, C] with torch's index rule floor(i * in / out)."""
    for axis, out in zip((1, 2), size):
        n = x.shape[axis]
        if out == 2 * n:
            x = jnp.repeat(x, 2, axis=axis)
        else:
            x = jnp.take(x, (np.arange(out) * n) // out, axis=axis)
    return x


class ResnetBlock2D(nn.Module):
    """Pre-norm residual block; the time embedding, if any, is added between its two convs.

    Without a time embedding (the VAE's resnets) the block has no `time_emb_proj` layer, as
    diffusers' `ResnetBlock2D` with `temb_channels=None`.
    """

    out_channels: int
    norm_num_groups: int
    norm_eps: float
    output_scale_factor: float = 1.0
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, temb=None):  # [B, H, W, C_in], [B, D_t] or None -> [B, H, W, out_channels]
        h = nn.silu(group_norm(self.norm_num_groups, self.norm_eps, self.dtype, "norm1")(x))
        h = Conv3x3(self.out_channels, dtype=self.dtype, name="conv1")(h)
        if temb is not None:
            temb = Linear(self.out_channels, dtype=self.dtype, name="time_emb_proj")(nn.silu(temb))
            h = h + temb[:, None, None, :]
        h = nn.silu(group_norm(self.norm_num_groups, self.norm_eps, self.dtype, "norm2")(h))
        h = Conv3x3(self.out_channels, dtype=self.dtype, name="conv2")(h)
        if x.shape[-1] != self.out_channels:
            x = nn.Conv(self.out_channels, (1, 1), dtype=self.dtype, name="conv_shortcut")(x)
        return (x + h) / self.output_scale_factor


class ImagePromptTokens(NamedTuple):
    """An IP-Adapter's image prompt as cross-attention takes it: its tokens, which every layer that
    attends to the text also attends to with weights of the adapter's own, and each image's scale of
    that attention at every such layer (`unet.attention_layers`' order), or at this one."""

    states: jax.Array  # [B, N, D]
    scales: jax.Array  # [B, L], or [B] at one layer


class Context(NamedTuple):
    """What cross-attention attends to: the text's token states, and how many of them each image's
    prompt has (a prompt of fewer chunks than the batch's longest); None: all of them. And an image
    prompt per IP-Adapter, if any."""

    states: jax.Array  # [B, S, D]
    lengths: jax.Array | None = None  # [B] int32
    image_prompts: tuple[ImagePromptTokens, ...] = ()

    def at_layer(self, layer: int) -> "Context":
        """This context at the cross-attention layer `layer`: each image prompt's scales there."""
        return self._replace(image_prompts=tuple(p._replace(scales=p.scales[:, layer]) for p in self.image_prompts))


class Attention(nn.Module):
    """Multi-head attention of `x` over `context` (over itself when `context` is None).

    The UNet's query/key/value projections have no bias; the VAE's do (`qkv_bias`).
    """

    num_heads: int
    qkv_bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, context: Context | None = None):  # [B, T, C], [B, S, D] -> [B, T, C]
        batch, length, channels = x.shape
        head_dim = channels // self.num_heads

        def project(name, inputs):  # -> [B, T or S, heads, head_dim]
            y = Linear(channels, use_bias=self.qkv_bias, dtype=self.dtype, name=name)(inputs)
            return y.reshape(batch, -1, self.num_heads, head_dim)

        lengths = None
        if context is None:
            key, value = project("to_k", x), project("to_v", x)
        else:  # the text's keys and values: the same in every denoising step
            key = step_invariant(self, "key", lambda: project("to_k", context.states))
            value = step_invariant(self, "value", lambda: project("to_v", context.states))
            lengths = context.lengths
        query = project("to_q", x)
        out = dot_product_attention(query, key, value, lengths)
        # IP-Adapter (diffusers' IPAdapterAttnProcessor2_0): the queries also attend to each image
        # prompt's tokens, through the adapter's own key and value weights, added at its scale.
        for a, prompt in enumerate(() if context is None else context.image_prompts):
            key = step_invariant(self, f"ip_key.{a}", lambda a=a, p=prompt: project(f"to_k_ip.{a}", p.states))
            value = step_invariant(self, f"ip_value.{a}", lambda a=a, p=prompt: project(f"to_v_ip.{a}", p.states))
            out = out + prompt.scales[:, None, None, None].astype(out.dtype) * dot_product_attention(query, key, value)
        return Linear(channels, dtype=self.dtype, name="to_out.0")(out.reshape(batch, length, channels))


class Downsample2D(nn.Module):
    """Stride-2 3x3 conv; padding 0 means padding only the bottom and right edges."""

    padding: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, H, W, C] -> [B, ceil(H/2), ceil(W/2), C]
        padding = ((0, 1), (0, 1)) if self.padding == 0 else self.padding
        return Conv3x3(x.shape[-1], self.dtype, strides=2, padding=padding, name="conv")(x)


class Upsample2D(nn.Module):
    """Nearest-neighbour upsampling to a given size (twice the input for even latents), then a 3x3 conv."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, size):  # [B, H, W, C] -> [B, *size, C]
        return Conv3x3(x.shape[-1], dtype=self.dtype, name="conv")(resize_nearest(x, size))


class Parameter(nn.Module):
    """A bare tensor (a torch `nn.Parameter` such as CLIP's `class_embedding`) as a module of its own
    name, whose one parameter loads from the stored key plus ".weight" (`weights.checkpoint_key`);
    the model's `rename_key` adds it."""

    shape: tuple[int, ...]

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("value", nn.initializers.normal(1.0), self.shape, jnp.float32)
