"""Weights stored in 8 bits, computed in the model's dtype: Forge's `--unet-in-fp8-e4m3fn` and ComfyUI's
`weight_dtype`, plus int8.

A quantized weight is a `Quantized` leaf of the parameter tree in place of the array: its values in the
stored dtype and one scale per output channel (a Linear `weight`'s rows [out, in], a convolution
`kernel`'s last axis, HWIO), the float32 weight being `values * scale`. int8 rounds `weight / scale` to
the integers of [-127, 127], with `scale` the channel's largest magnitude over 127 (symmetric, per
channel); fp8 scales the channel's largest magnitude to the format's largest finite value (448 for
e4m3fn, 57344 for e5m2), then rounds to the nearest fp8 value. ComfyUI and Forge cast to fp8 without a
scale, which flushes weights below 2^-9 (e4m3fn's smallest subnormal) to zero; the per-channel scale
costs 2 bytes per output channel and keeps them.

The compiled program takes the stored leaves as its arguments and calls `dequantized` just before the
model reads them, inside the denoising loop, so that XLA fuses the convert and the scale into the
operand of the dot or convolution that reads them (a TPU compile reads the int8 or fp8 weight, with no
bfloat16 copy among its buffers) rather than holding a dequantized copy of the model.

Norms, biases, embeddings and small weights (the UNet's first and last convolutions among them: fewer
than `MIN_ELEMENTS`) stay in the compute dtype: they are a sliver of the bytes and the most sensitive.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct, traverse_util

# `--weights-dtype`'s choices, named as ComfyUI's weight_dtype names them, and int8; "default" stores
# the weights in the compute dtype.
WEIGHT_DTYPES = {
    "default": None,
    "fp8_e4m3fn": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
    "int8": jnp.int8,
}
# Shorter names that mean the same.
ALIASES = {"fp8": "fp8_e4m3fn"}
# Weights with fewer elements stay in the compute dtype.
MIN_ELEMENTS = 1 << 14
# The components of a model's parameter tree whose weights a mode stores in 8 bits ("controlnets": each
# ControlNet's tree).
COMPONENTS = ("unet", "controlnets")


def weights_dtype_name(name: str | None) -> str:
    """The canonical name of a weights mode (None: "default").

    Raises:
      ValueError: a name that is none of `WEIGHT_DTYPES` or `ALIASES`.
    """
    name = ALIASES.get(name or "default", name or "default")
    if name not in WEIGHT_DTYPES:
        choices = ", ".join([*WEIGHT_DTYPES, *ALIASES])
        raise ValueError(f"weights dtype must be one of {choices}, got {name!r}")
    return name


@struct.dataclass
class Quantized:
    """A weight stored in 8 bits: `values * scale` ([out, in] or [kh, kw, in, out]; `scale` broadcasts)."""

    values: jax.Array  # int8, float8_e4m3fn or float8_e5m2
    scale: jax.Array  # float32, [out, 1] or [1, 1, 1, out]
    axis: int = struct.field(pytree_node=False)  # the output channels' (0 or 3)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def dequantized(self, dtype) -> jax.Array:
        return self.values.astype(dtype) * self.scale.astype(dtype)

    def requantized(self, weight: jax.Array) -> "Quantized":
        """`weight` (this one's shape: say this one with a LoRA's update added) quantized as this one is."""
        return quantize(weight, self.values.dtype, self.axis)


def _output_axis(path: tuple[str, ...], shape: tuple[int, ...]) -> int | None:
    """The output-channel axis of a weight this module quantizes, else None."""
    if int(np.prod(shape)) < MIN_ELEMENTS:
        return None
    if path[-1] == "weight" and len(shape) == 2:  # `layers.Linear`: [out, in]
        return 0
    if path[-1] == "kernel" and len(shape) == 4:  # convolutions: HWIO
        return 3
    return None


def _largest(dtype) -> float:
    return 127.0 if jnp.dtype(dtype) == jnp.int8 else float(jnp.finfo(dtype).max)


def quantize(weight: jax.Array, dtype, axis: int) -> Quantized:
    """`weight` in `dtype` with one float32 scale per index of `axis` (see the module's docstring)."""
    reduced = tuple(a for a in range(weight.ndim) if a != axis)
    weight = weight.astype(jnp.float32)
    largest = jnp.max(jnp.abs(weight), axis=reduced, keepdims=True)
    scale = jnp.where(largest > 0, largest / _largest(dtype), 1.0)
    scaled = weight / scale
    if jnp.dtype(dtype) == jnp.int8:
        scaled = jnp.clip(jnp.round(scaled), -127, 127)
    return Quantized(scaled.astype(dtype), scale, axis)


_quantize = jax.jit(quantize, static_argnums=(1, 2))


def quantized(tree: dict, weights_dtype: str) -> dict:
    """A loaded parameter tree with its large weights quantized on their devices, one at a time: each
    original is dropped as soon as its quantized leaf is made, so a model's weights are never held twice.
    The tree is taken over: the caller keeps no other reference to it."""
    dtype = WEIGHT_DTYPES[weights_dtype]
    if dtype is None:
        return tree
    flat = traverse_util.flatten_dict(tree)
    for path in list(flat):
        axis = _output_axis(path, flat[path].shape)
        if axis is not None:
            flat[path] = _quantize(flat.pop(path), dtype, axis)
    return traverse_util.unflatten_dict(flat)


def abstract(tree: dict, weights_dtype: str) -> dict:
    """The shapes (`jax.ShapeDtypeStruct`s) of `quantized(tree)` for the shapes of a loaded tree, with
    their shardings (a quantized leaf's scale takes its weight's)."""
    dtype = WEIGHT_DTYPES[weights_dtype]
    if dtype is None:
        return tree

    def leaf(path, value):
        axis = _output_axis(path, value.shape)
        if axis is None:
            return value
        scale_shape = tuple(n if a == axis else 1 for a, n in enumerate(value.shape))
        sharding = getattr(value, "sharding", None)
        return Quantized(jax.ShapeDtypeStruct(value.shape, dtype, sharding=sharding),
                         jax.ShapeDtypeStruct(scale_shape, jnp.float32, sharding=sharding), axis)

    flat = traverse_util.flatten_dict(tree)
    return traverse_util.unflatten_dict({path: leaf(path, value) for path, value in flat.items()})


def in_components(params: dict, quantize) -> dict:
    """`params` ({component: tree, or a tuple of trees}) with `quantize(tree)` for each tree of `COMPONENTS`
    (`quantized` or `abstract` with a mode)."""
    return {name: (tuple(map(quantize, tree)) if isinstance(tree, tuple) else quantize(tree))
            if name in COMPONENTS else tree for name, tree in params.items()}


def dequantized(tree, dtype):
    """`tree` with every `Quantized` leaf as an array of `dtype`: to call inside the compiled program, where
    the model reads the weights (see the module's docstring)."""
    return jax.tree.map(lambda leaf: leaf.dequantized(dtype) if isinstance(leaf, Quantized) else leaf, tree,
                        is_leaf=lambda leaf: isinstance(leaf, Quantized))
