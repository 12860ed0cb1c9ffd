"""3x3 convolutions: Winograd's F(4x4, 3x3) against torch's conv2d, and the dispatch rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sdxl.models import convolution
from sdxl.models.layers import STEP_INVARIANTS, Conv3x3


def torch_conv3x3(x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """The oracle: NHWC x and HWIO kernel through torch's NCHW/OIHW conv2d."""
    out = torch.nn.functional.conv2d(
        torch.from_numpy(x).permute(0, 3, 1, 2), torch.from_numpy(kernel).permute(3, 2, 0, 1), padding=1
    )
    return out.permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize(
    "shape, out_channels",
    [
        ((2, 32, 32, 64), 64),  # whole tiles, as in a UNet level
        ((2, 16, 24, 48), 96),  # more outputs than inputs, wider than high
        ((1, 13, 7, 5), 3),  # partial last tiles in both directions
        ((3, 1, 2, 4), 2),  # smaller than one tile
    ],
)
def test_winograd_matches_torch(shape, out_channels):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    kernel = (rng.standard_normal((3, 3, shape[-1], out_channels)) / np.sqrt(9 * shape[-1])).astype(np.float32)
    expected = torch_conv3x3(x, kernel)
    got = np.asarray(jax.jit(lambda x, k: convolution.winograd_conv3x3(x, convolution.winograd_kernel(k)))(x, kernel))
    assert got.shape == expected.shape
    # The transforms' coefficients (up to 8, and 1/24) cost float32 digits: about 1e-5 of the
    # largest output, against about 1e-6 for XLA's direct convolution.
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * np.abs(expected).max())


def test_cpu_picks_winograd_where_it_pays(monkeypatch):
    monkeypatch.delenv("SDXL_CONV", raising=False)
    assert jax.default_backend() == "cpu"
    assert convolution.implementation(32, 32, 64, jnp.float32) == "winograd"
    assert convolution.implementation(128, 64, 512, jnp.float32) == "winograd"
    assert convolution.implementation(8, 8, 256, jnp.float32) == "xla"  # too few tiles
    assert convolution.implementation(256, 256, 128, jnp.float32) == "xla"  # tiles out of cache
    assert convolution.implementation(32, 32, 32, jnp.float32) == "xla"  # too few channels
    assert convolution.implementation(32, 32, 64, jnp.bfloat16) == "xla"  # too few digits
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert convolution.implementation(32, 32, 64, jnp.float32) == "xla"
    with jax.set_mesh(jax.sharding.Mesh(np.array(jax.devices()), ("batch",))):  # traced for the mesh's CPUs
        assert convolution.implementation(32, 32, 64, jnp.float32) == "winograd"


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv("SDXL_CONV", "winograd")
    assert convolution.implementation(8, 8, 4, jnp.bfloat16) == "winograd"
    monkeypatch.setenv("SDXL_CONV", "xla")
    assert convolution.implementation(32, 32, 64, jnp.float32) == "xla"
    monkeypatch.setenv("SDXL_CONV", "fft")
    with pytest.raises(ValueError, match="SDXL_CONV must be one of xla, winograd"):
        convolution.implementation(32, 32, 64, jnp.float32)


def _conv3x3_layer(x, kernel, **variables):
    layer = Conv3x3(kernel.shape[-1])
    params = {"kernel": kernel, "bias": np.zeros(kernel.shape[-1], np.float32)}
    return layer.apply({"params": params, **variables}, x, mutable=[STEP_INVARIANTS])


@pytest.mark.compiles
def test_conv3x3_layer_runs_the_chosen_algorithm(monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 16, 16, 64), dtype=np.float32)
    kernel = (rng.standard_normal((3, 3, 64, 8)) / 24).astype(np.float32)
    expected = torch_conv3x3(x, kernel)
    results = {}
    for name in convolution.IMPLEMENTATIONS:
        monkeypatch.setenv("SDXL_CONV", name)
        y, kernels = _conv3x3_layer(x, kernel)
        results[name] = np.asarray(y)
        np.testing.assert_allclose(results[name], expected, rtol=0, atol=2e-5 * np.abs(expected).max())
        assert bool(kernels) == (name == "winograd")  # only Winograd has a transformed kernel to keep
    assert not np.array_equal(results["xla"], results["winograd"])


@pytest.mark.compiles
def test_conv3x3_layer_reuses_a_given_winograd_kernel(monkeypatch):
    monkeypatch.setenv("SDXL_CONV", "winograd")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 16, 16, 64), dtype=np.float32)
    kernel = (rng.standard_normal((3, 3, 64, 4)) / 24).astype(np.float32)
    y, kernels = _conv3x3_layer(x, kernel)
    np.testing.assert_allclose(kernels[STEP_INVARIANTS]["kernel"], convolution.winograd_kernel(kernel), atol=1e-6)
    doubled = jax.tree.map(lambda k: 2 * k, kernels)
    y_given, _ = _conv3x3_layer(x, kernel, **doubled)  # used as given, not recomputed from `kernel`
    np.testing.assert_allclose(y_given, 2 * y, rtol=1e-6, atol=1e-6)
