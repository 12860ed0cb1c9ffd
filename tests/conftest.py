"""Test-wide setup: 4 forced CPU devices, so sharding is exercised on every machine."""

import os

# Must happen before jax is imported anywhere: the device count is fixed when the backend starts.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(os.cpu_count() or 1)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
