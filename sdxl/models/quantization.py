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

The `COMPUTE_MODES` (opt-in) also multiply in 8 bits, at twice the bfloat16 rate of a TPU v5e's MXU (int8)
or of an H100/H200's tensor cores (fp8): `dequantized` leaves the Linear weights and the 3x3 convolutions'
kernels quantized, and those layers (`sdxl.models.layers`) call `product_in_8_bits`, which quantizes their
activations on the fly, symmetrically: one scale per row of a Linear's input (per token), one per image
of a convolution's (a per-pixel scale would not factor out of a 3x3 window's sum). The dot or convolution
takes the two 8-bit operands and accumulates in int32 (int8) or float32 (fp8); the result times the
activations' scale times the weight's is in the model's dtype. Nothing is calibrated: the scales are each
call's own largest magnitudes, so no prompt set is needed and none can be unrepresentative. The 1x1
convolutions and the small weights keep the dequantized path.
"""

import re

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
    "int8_compute": jnp.int8,
    "fp8_e4m3fn_compute": jnp.float8_e4m3fn,
}
# The modes that also compute in 8 bits (see the module's docstring).
COMPUTE_MODES = ("int8_compute", "fp8_e4m3fn_compute")
# Other names that mean the same: ComfyUI's fp8_e4m3fn_fast multiplies in fp8 too.
ALIASES = {"fp8": "fp8_e4m3fn", "fp8_e4m3fn_fast": "fp8_e4m3fn_compute"}
# What a product of 8-bit operands accumulates in.
ACCUMULATORS = {jnp.dtype(jnp.int8): jnp.int32, jnp.dtype(jnp.float8_e4m3fn): jnp.float32}
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


def _scaled(x: jax.Array, dtype, reduced: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """`x` in `dtype`, and its float32 scale: one per slice over the `reduced` axes, that slice's largest
    magnitude over `dtype`'s largest (1 for a slice of zeros)."""
    x = x.astype(jnp.float32)
    largest = jnp.max(jnp.abs(x), axis=reduced, keepdims=True)
    scale = jnp.where(largest > 0, largest / _largest(dtype), 1.0)
    scaled = x / scale
    if jnp.dtype(dtype) == jnp.int8:
        scaled = jnp.clip(jnp.round(scaled), -127, 127)
    return scaled.astype(dtype), scale


def quantize(weight: jax.Array, dtype, axis: int) -> Quantized:
    """`weight` in `dtype` with one float32 scale per index of `axis` (see the module's docstring)."""
    return Quantized(*_scaled(weight, dtype, tuple(a for a in range(weight.ndim) if a != axis)), axis)


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


def _computed_in_8_bits(leaf: Quantized) -> bool:
    """Whether a layer computes with `leaf` as it is stored: a Linear weight or a 3x3 kernel (in the
    `COMPONENTS`, `layers.Linear` and `layers.Conv3x3` read those, and take a `Quantized` leaf; the 1x1
    convolutions are Flax's `nn.Conv`, which does not)."""
    return leaf.values.ndim == 2 or leaf.shape[:2] == (3, 3)


def dequantized(tree, dtype, weights_dtype: str = "default"):
    """`tree` with every `Quantized` leaf as an array of `dtype`, but in the `COMPUTE_MODES` those that
    the layers compute with in 8 bits: to call inside the compiled program, where the model reads the
    weights (see the module's docstring)."""
    computes = weights_dtype in COMPUTE_MODES

    def leaf_for_layer(leaf):
        if not isinstance(leaf, Quantized) or computes and _computed_in_8_bits(leaf):
            return leaf
        return leaf.dequantized(dtype)

    return jax.tree.map(leaf_for_layer, tree, is_leaf=lambda leaf: isinstance(leaf, Quantized))


def product_in_8_bits(product, x: jax.Array, weight: Quantized, reduced: tuple[int, ...], dtype) -> jax.Array:
    """`product(x, weight)`, a dot or convolution whose output channels are its last axis, on 8-bit operands:
    `x` quantized to `weight`'s dtype with one scale per slice over the `reduced` axes, and the result
    rescaled in `dtype` (see the module's docstring). `product` takes `preferred_element_type`."""
    stored = weight.values.dtype
    x, x_scale = _scaled(x, stored, reduced)
    y = product(x, weight.values, preferred_element_type=ACCUMULATORS[jnp.dtype(stored)])
    return y.astype(dtype) * x_scale.astype(dtype) * weight.scale.reshape(-1).astype(dtype)


# The 8-bit types as optimized HLO names them.
HLO_8_BIT_TYPES = ("s8", "f8e4m3fn", "f8e5m2")


def products_in(hlo: str) -> list[tuple[tuple[str, str], str]]:
    """The dots and convolutions of a compiled program's optimized HLO (`compiled.as_text()`; a TPU runs
    its dots as convolutions): each one's operand types, as HLO names them (("s8", "s8")), and its op name."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    return [((types[a], types[b]), name) for a, b, name in
            re.findall(r" (?:convolution|dot)\(%([\w.\-]+), %([\w.\-]+)\).*?op_name=\"([^\"]*)\"", hlo)]
