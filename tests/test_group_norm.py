"""GroupNorm's two ways to its statistics (SDXL_GROUP_NORM) against torch's group_norm."""

import jax
import numpy as np
import pytest
import torch

from sdxl.models.layers import GroupNorm


def _activations(rng, shape=(2, 32, 48, 64)) -> np.ndarray:
    """A residual stream's values: channel means in the hundreds with a spread of a few units, and a few
    pixels far out, one of them the first (a shift taken from it alone would cancel 4 more digits)."""
    x = 300 + 20 * rng.standard_normal(shape[-1]) + rng.standard_normal(shape)
    x[:, 0, 0] += 200
    x[:, 17, 5] -= 150
    return x.astype(np.float32)


@pytest.mark.parametrize("statistics", ["two-pass", "shifted"])
def test_group_norm_matches_torch_far_from_zero(monkeypatch, statistics):
    monkeypatch.setenv("SDXL_GROUP_NORM", statistics)
    rng = np.random.default_rng(0)
    x = _activations(rng)
    scale, bias = rng.standard_normal(64).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    layer = GroupNorm(num_groups=32, epsilon=1e-5)
    out = jax.jit(layer.apply)({"params": {"scale": scale, "bias": bias}}, x)
    expected = torch.nn.functional.group_norm(torch.from_numpy(x).double().permute(0, 3, 1, 2), 32,
                                              torch.from_numpy(scale).double(), torch.from_numpy(bias).double(), 1e-5)
    np.testing.assert_allclose(out, expected.permute(0, 2, 3, 1).numpy(), rtol=0, atol=2e-4)


def test_shifted_statistics_are_the_two_pass_ones_to_float_precision(monkeypatch):
    x = _activations(np.random.default_rng(1), (4, 128, 128, 32))
    params = {"params": {"scale": np.ones(32, np.float32), "bias": np.zeros(32, np.float32)}}
    outs = {}
    for statistics in ("two-pass", "shifted"):
        monkeypatch.setenv("SDXL_GROUP_NORM", statistics)
        outs[statistics] = np.asarray(jax.jit(GroupNorm(num_groups=8, epsilon=1e-6).apply)(params, x))
    assert np.abs(outs["shifted"] - outs["two-pass"]).max() < 1e-4  # of outputs up to about 10
    monkeypatch.setenv("SDXL_GROUP_NORM", "one-pass")
    with pytest.raises(ValueError, match="SDXL_GROUP_NORM must be one of two-pass, shifted"):
        GroupNorm(num_groups=8, epsilon=1e-6).apply(params, x)
