"""Weights stored in 8 bits (`sdxl.models.quantization`): each mode's rounding, its loading (the tree the
compiled program is built for), a LoRA on it, and the UNet's output and the pictures against the
unquantized model's; the compute modes' 8-bit products, and that the compiled program multiplies in 8 bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from sdxl.checkpoints import lora, random_models
from sdxl.engine.compiled import abstract_params
from sdxl.engine.mesh import replicated
from sdxl.engine.pipeline import Pipeline
from sdxl.models import layers, quantization, unet
from sdxl.models.quantization import Quantized

MODES = ("fp8_e4m3fn", "fp8_e5m2", "int8", "int8_compute", "fp8_e4m3fn_compute")
# fp8's significand bits (e4m3fn 3, e5m2 2): a scaled weight rounds to within 2^-(m+1) of itself.
SIGNIFICAND_BITS = {jnp.float8_e4m3fn: 3, jnp.float8_e5m2: 2}


def test_int8_rounds_each_weight_to_its_channels_step(rng):
    weight = rng.standard_normal((64, 48)).astype(np.float32) * rng.uniform(1e-3, 1, (64, 1)).astype(np.float32)
    q = quantization.quantize(weight, jnp.int8, 0)
    step = np.abs(weight).max(axis=1, keepdims=True) / 127
    assert q.values.dtype == jnp.int8 and q.scale.shape == (64, 1)
    np.testing.assert_allclose(q.scale, step, rtol=1e-6)
    assert (np.abs(np.asarray(q.dequantized(jnp.float32)) - weight) <= step * (0.5 + 1e-5)).all()
    assert (np.abs(np.asarray(q.values, np.int32)).max(axis=1) == 127).all()  # every channel spans the range


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_keeps_its_relative_precision_at_any_weights_scale(dtype, rng):
    """Scaled per output channel (a kernel's last axis), weights of 1e-4 keep fp8's precision, where a plain
    cast (ComfyUI's) flushes those below e4m3fn's smallest subnormal, 2^-9, to zero."""
    kernel = rng.standard_normal((3, 3, 16, 32)).astype(np.float32) * 1e-4
    q = quantization.quantize(kernel, dtype, 3)
    assert q.values.dtype == dtype and q.scale.shape == (1, 1, 1, 32)
    info = jnp.finfo(dtype)
    # Round to nearest: half a unit in the last place of the scaled value, or of the smallest normal's below it.
    scaled_error = np.maximum(np.abs(kernel / np.asarray(q.scale)), float(info.smallest_normal)) * 2.0 ** -(
        SIGNIFICAND_BITS[dtype] + 1)
    error = np.abs(np.asarray(q.dequantized(jnp.float32)) - kernel)
    assert (error <= scaled_error * np.asarray(q.scale) * (1 + 1e-5)).all()
    assert np.count_nonzero(np.asarray(kernel.astype(jnp.float8_e4m3fn), np.float32)) < kernel.size / 10


def test_a_channel_of_zeros_stays_zero():
    weight = np.zeros((4, 8), np.float32)
    weight[1] = 0.5
    q = quantization.quantize(weight, jnp.int8, 0)
    assert np.array_equal(np.asarray(q.dequantized(jnp.float32)), weight)


def test_the_mode_names_are_comfyuis_and_a_wrong_one_is_one_sentence():
    assert quantization.weights_dtype_name(None) == "default"
    assert quantization.weights_dtype_name("fp8") == "fp8_e4m3fn"
    assert quantization.weights_dtype_name("fp8_e4m3fn_fast") == "fp8_e4m3fn_compute"
    with pytest.raises(ValueError, match="weights dtype must be one of default, fp8_e4m3fn, fp8_e5m2, int8, "
                       "int8_compute, fp8_e4m3fn_compute, fp8, fp8_e4m3fn_fast, got 'fp4'"):
        quantization.weights_dtype_name("fp4")


def _rounded(x: np.ndarray, dtype, reduced: tuple[int, ...]) -> np.ndarray:
    """`x` as 8-bit compute rounds it: each slice over `reduced` scaled to `dtype`'s largest value, rounded
    to `dtype`, and scaled back, in float64."""
    largest = 127 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)
    scale = np.abs(x).max(axis=reduced, keepdims=True) / largest
    values = np.round(x / scale) if dtype == jnp.int8 else np.asarray(jnp.asarray(x / scale, dtype), np.float64)
    return values * scale


COMPUTE_DTYPES = [jnp.int8, jnp.float8_e4m3fn]


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_a_linear_layer_multiplies_an_8_bit_weight_by_each_rows_own_rounding(dtype, rng):
    """The product of the rounded operands, to float32's precision: each row (token) of the input has its
    own scale, so rows a million times apart in size keep their precision."""
    x = rng.standard_normal((2, 3, 64)) * np.array([1e-3, 1, 1e3])[:, None]  # [B, T, in]
    q, bias = quantization.quantize(rng.standard_normal((32, 64)), dtype, 0), rng.standard_normal(32)
    y = np.asarray(layers.Linear(32).apply({"params": {"weight": q, "bias": bias.astype(np.float32)}},
                                           x.astype(np.float32)))
    weight = np.asarray(q.dequantized(jnp.float32), np.float64)
    expected = _rounded(x, dtype, (2,)) @ weight.T + bias
    row_size = np.abs(expected - bias).max(axis=-1, keepdims=True)
    assert (np.abs(y - expected) <= 1e-5 * row_size + 1e-6 * np.abs(bias)).all()
    # The rounding is there: the unrounded input's product is further off than float32's precision.
    assert (np.abs(y - (x @ weight.T + bias)) > 1e-4 * row_size).any()


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize(("strides", "padding"), [(1, 1), (2, ((0, 1), (0, 1)))])
def test_a_3x3_convolution_multiplies_an_8_bit_kernel_by_each_images_own_rounding(dtype, strides, padding, rng):
    x = rng.standard_normal((2, 12, 10, 16)) * np.array([1e-2, 1e2])[:, None, None, None]
    q = quantization.quantize(rng.standard_normal((3, 3, 16, 24)), dtype, 3)
    params = {"kernel": q, "bias": np.zeros(24, np.float32)}
    y = np.asarray(layers.Conv3x3(24, strides=strides, padding=padding).apply({"params": params},
                                                                             x.astype(np.float32)))
    reference = layers.Conv3x3(24, strides=strides, padding=padding)
    kernel = np.asarray(q.dequantized(jnp.float32))
    with jax.default_matmul_precision("highest"):
        expected = np.asarray(reference.apply({"params": {**params, "kernel": kernel}},
                                              _rounded(x, dtype, (1, 2, 3)).astype(np.float32)))
    image_size = np.abs(expected).max(axis=(1, 2, 3), keepdims=True)
    assert (np.abs(y - expected) <= 1e-5 * image_size).all()


@pytest.fixture(scope="module")
def loaded() -> dict[str, Pipeline]:
    return {mode: Pipeline.from_pretrained("tiny", dtype="float32", weights_dtype=mode)
            for mode in ("default", *MODES)}


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_loads_its_large_weights_in_8_bits_and_the_rest_as_they_were(loaded, mode):
    pipe, default = loaded[mode], loaded["default"]
    assert pipe.weights_dtype == mode and pipe.model.key != default.model.key
    flat = traverse_util.flatten_dict(pipe.params["unet"])
    stored = jnp.dtype(quantization.WEIGHT_DTYPES[mode])
    quantized = {path: leaf for path, leaf in flat.items() if isinstance(leaf, Quantized)}
    assert {leaf.values.dtype for leaf in quantized.values()} == {stored}
    # Every Linear weight and convolution kernel of at least MIN_ELEMENTS, and nothing else: norms, biases,
    # and the first and last convolutions (fewer elements) stay in float32.
    unquantized = traverse_util.flatten_dict(default.params["unet"])
    assert set(quantized) == {path for path, leaf in unquantized.items() if path[-1] in ("weight", "kernel")
                              and leaf.size >= quantization.MIN_ELEMENTS}
    assert ("conv_in", "kernel") not in quantized and ("conv_out", "kernel") not in quantized
    assert all(leaf.dtype == jnp.float32 for path, leaf in flat.items() if path not in quantized)
    # The text encoders and the VAE are as the default mode loads them.
    for name in ("text_encoder", "text_encoder_2", "vae"):
        assert jax.tree.all(jax.tree.map(np.array_equal, pipe.params[name], default.params[name]))


@pytest.mark.parametrize("mode", MODES)
def test_the_compiled_program_is_built_for_the_loaded_tree(loaded, mode):
    """`abstract_params` (what a program compiles for, on any host) describes the stored leaves exactly."""
    pipe = loaded[mode]
    abstract = abstract_params(pipe.spec, (), (), 0, pipe.dtype, replicated(pipe.mesh), mode)
    assert jax.tree.structure(abstract) == jax.tree.structure(pipe.params)
    described = jax.tree.map(lambda leaf: (leaf.shape, jnp.dtype(leaf.dtype)), abstract)
    assert described == jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), pipe.params)


# The largest |difference| of the tiny UNet's output from the float32 model's (whose largest |output| is
# 2.36), measured on the CPU in float32: fp8_e4m3fn 0.173, fp8_e5m2 0.200, int8 0.0394; with the activations
# in 8 bits too, int8_compute 0.0707, fp8_e4m3fn_compute 0.167.
UNET_BOUNDS = {"fp8_e4m3fn": 0.19, "fp8_e5m2": 0.22, "int8": 0.044, "int8_compute": 0.078,
               "fp8_e4m3fn_compute": 0.185}


@pytest.fixture(scope="module")
def unet_programs(loaded) -> dict:
    """Each mode's UNet on the same random inputs, in float32, compiled for the mode's loaded parameters as
    its program reads them (`quantization.dequantized`): {mode: a compiled function of the parameters}."""
    return {mode: _unet_output(pipe.spec, mode).lower(pipe.params["unet"]).compile() for mode, pipe in loaded.items()}


@pytest.mark.compiles
@pytest.mark.parametrize("mode", MODES)
def test_the_unet_computes_within_its_modes_rounding_of_the_unquantized_one(loaded, unet_programs, mode):
    reference = np.asarray(unet_programs["default"](loaded["default"].params["unet"]))
    difference = np.abs(np.asarray(unet_programs[mode](loaded[mode].params["unet"])) - reference).max()
    assert 0 < difference < UNET_BOUNDS[mode], difference


@pytest.mark.compiles
def test_int8_compute_multiplies_every_weight_it_keeps_in_8_bits(loaded, unet_programs):
    """In the program compiled for this CPU, each Linear weight and 3x3 kernel that int8_compute keeps
    quantized is read by one dot or convolution of two int8 operands, and every such product reads one
    (`tests/test_topology.py` checks the programs compiled for a TPU)."""
    params = loaded["int8_compute"].params["unet"]
    kept = [path[:-1] for path, leaf in traverse_util.flatten_dict(
        quantization.dequantized(params, jnp.float32, "int8_compute")).items() if isinstance(leaf, Quantized)]
    products = quantization.products_in(unet_programs["int8_compute"].as_text())
    layers = [tuple(name.split("/")[2:-1]) for types, name in products if types == ("s8", "s8")]
    assert len(kept) > 20 and sorted(layers) == sorted(kept)
    assert any(layer[-2:] == ("upsamplers.0", "conv") for layer in layers)  # a 3x3 convolution
    weights_only = quantization.products_in(unet_programs["int8"].as_text())
    assert weights_only and all(types == ("f32", "f32") for types, _ in weights_only)  # int8 dequantizes first


def _unet_output(spec, mode: str):
    """A jitted function of the UNet's parameters: its output, in float32, for random inputs, with the
    parameters as a program of `mode` reads them."""
    rng = np.random.default_rng(0)
    model = unet.UNet2DConditionModel(spec.unet, dtype=jnp.float32)
    x = rng.standard_normal((2, 8, 8, spec.unet.in_channels)).astype(np.float32)
    context = rng.standard_normal((2, 77, spec.unet.cross_attention_dim)).astype(np.float32)
    pooled = spec.unet.projection_class_embeddings_input_dim - 6 * spec.unet.addition_time_embed_dim
    extra = {"text_embeds": rng.standard_normal((2, pooled)).astype(np.float32),
             "time_ids": np.full((2, 6), 64, np.float32)}

    @jax.jit
    def output(params):
        return model.apply({"params": quantization.dequantized(params, jnp.float32, mode)}, x,
                           jnp.array([500, 20]), context, **extra)

    return output


def test_a_lora_on_8_bit_weights_is_applied_in_float32_and_stored_alike_again(loaded, tmp_path):
    default, pipe = loaded["default"], loaded["int8"]
    style = lora.read(lora.write_random(tmp_path / "style.safetensors", pipe.spec), pipe.spec)
    put = lambda array: jax.device_put(array, replicated(pipe.mesh))  # noqa: E731
    applied, reference = (traverse_util.flatten_dict(lora.apply(p.params, [(style, 0.8)], put)["unet"])
                          for p in (pipe, default))
    loaded_leaves = traverse_util.flatten_dict(pipe.params["unet"])
    changed = [path for path, leaf in applied.items()
               if isinstance(leaf, Quantized) and leaf is not loaded_leaves[path]]
    assert changed
    for path in changed:
        new, old = applied[path], loaded_leaves[path]
        assert new.values.dtype == jnp.int8
        # The loaded weight is within half its step of the float32 one, the update within half its own step.
        bound = (np.asarray(new.scale) + np.asarray(old.scale)) / 2 * (1 + 1e-5)
        assert (np.abs(np.asarray(new.dequantized(jnp.float32)) - reference[path]) <= bound).all()


# The largest |difference| of a picture's pixels (in [0, 1]) from the float32 model's, 4 steps at 64x64,
# measured: fp8_e4m3fn 0.0866, fp8_e5m2 0.285, int8 0.0322, int8_compute 0.0602, fp8_e4m3fn_compute 0.175 (the
# tiny model's random weights amplify them: the trained shapes model's are in BENCHMARKS.md). Each mode's UNet
# has its bound above; whole pictures are drawn for one mode that dequantizes and one that multiplies in 8 bits
# (a program each, the rest of the pipeline shared by every mode).
PICTURE_BOUNDS = {"fp8_e4m3fn": 0.1, "int8_compute": 0.068}


@pytest.mark.compiles
def test_pictures_are_within_a_bound_of_the_unquantized_models(loaded):
    def picture(pipe):
        return pipe.generate("a red circle", seed=3, steps=4, height=64, width=64, output_type="np")

    reference = picture(loaded["default"])
    for mode, bound in PICTURE_BOUNDS.items():
        difference = np.abs(picture(loaded[mode]) - reference).max()
        assert 0 < difference < bound, (mode, difference)


@pytest.mark.compiles
def test_a_controlnets_weights_are_stored_alike_and_steer_within_a_bound(tmp_path):
    """A ControlNet's large weights are quantized as the UNet's; its program is built for them, runs and
    computes in int8 (the weights-only modes read the same stored weights, and dequantize them as the UNet's
    do, which the tests above bound)."""
    spec = Pipeline.from_pretrained("tiny").spec
    folder = random_models.write_controlnet(tmp_path / "cn", spec)
    control = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    pictures = {}
    for mode in ("default", "int8_compute"):
        pipe = Pipeline.from_pretrained("tiny", dtype="float32", controlnet=str(folder), weights_dtype=mode)
        configs = tuple(controlnet.config for controlnet in pipe.controlnets)
        abstract = abstract_params(pipe.spec, configs, (), 0, pipe.dtype, replicated(pipe.mesh), mode)
        assert jax.tree.map(lambda leaf: (leaf.shape, jnp.dtype(leaf.dtype)), abstract) == jax.tree.map(
            lambda leaf: (leaf.shape, leaf.dtype), pipe.params)
        pictures[mode] = pipe.generate("a fox", seed=1, steps=2, height=64, width=64, control_image=control,
                                       output_type="np")
    leaves = jax.tree.leaves(pipe.params["controlnets"], is_leaf=lambda leaf: isinstance(leaf, Quantized))
    quantized = [leaf for leaf in leaves if isinstance(leaf, Quantized)]
    assert quantized and all(leaf.values.dtype == jnp.int8 for leaf in quantized)
    # The UNet and the ControlNet computing in int8 (the ControlNet's stride-2 convolutions among them), 2 steps
    # at 64x64 in float32: measured 0.0721 (int8 weights alone: 0.0230).
    assert 0 < np.abs(pictures["int8_compute"] - pictures["default"]).max() < 0.08
