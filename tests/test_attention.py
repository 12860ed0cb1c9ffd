"""The attention dispatch, and the splash kernel run in Pallas' interpreter against XLA's attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sdxl.models import attention


def _qkv(batch, q_length, kv_length, heads, head_dim, dtype=jnp.float32):
    q, k, v = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(q, (batch, q_length, heads, head_dim), dtype),
        jax.random.normal(k, (batch, kv_length, heads, head_dim), dtype),
        jax.random.normal(v, (batch, kv_length, heads, head_dim), dtype),
    )


@pytest.mark.compiles
@pytest.mark.parametrize(
    "q_length, kv_length, heads, head_dim",
    [
        (200, 200, 2, 64),  # self-attention, not a multiple of the 128-wide blocks
        (640, 640, 1, 128),  # more than one 512-block of queries
        (96, 77, 4, 32),  # cross-attention over CLIP's 77 tokens
    ],
)
def test_splash_matches_xla_attention(monkeypatch, q_length, kv_length, heads, head_dim):
    q, k, v = _qkv(2, q_length, kv_length, heads, head_dim)
    expected = jax.nn.dot_product_attention(q, k, v)
    monkeypatch.setenv("SDXL_ATTENTION", "splash")
    got = jax.jit(attention.dot_product_attention)(q, k, v)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=2e-6)


@pytest.mark.compiles
@pytest.mark.parametrize("kernel", ["xla", "splash"])
def test_each_image_attends_to_its_own_number_of_keys(monkeypatch, kernel):
    """A batch's shorter prompts: keys past an image's length are left out, as if they were not there,
    on a mesh as on one device."""
    monkeypatch.setenv("SDXL_ATTENTION", kernel)
    q, k, v = _qkv(4, 96, 231, 2, 32)  # three 77-token chunks
    lengths = jnp.array([77, 231, 154, 77], jnp.int32)
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    with jax.set_mesh(mesh):
        got = jax.jit(attention.dot_product_attention)(q, k, v, lengths)
    for b, length in enumerate(lengths):
        alone = jax.nn.dot_product_attention(q[b:b + 1], k[b:b + 1, :length], v[b:b + 1, :length])
        np.testing.assert_allclose(got[b:b + 1], alone, atol=2e-6)


@pytest.mark.compiles
def test_splash_in_bfloat16_is_close_to_float32(monkeypatch):
    q, k, v = _qkv(1, 256, 77, 2, 64)
    expected = jax.nn.dot_product_attention(q, k, v)
    monkeypatch.setenv("SDXL_ATTENTION", "splash")
    got = attention.dot_product_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    assert got.dtype == jnp.bfloat16
    assert float(jnp.abs(got.astype(jnp.float32) - expected).max()) < 0.05


@pytest.mark.compiles
def test_splash_splits_the_batch_over_the_mesh_without_communication(monkeypatch):
    assert len(jax.devices()) == 4
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    sharded = NamedSharding(mesh, PartitionSpec("batch"))
    q, k, v = (jax.device_put(x, sharded) for x in _qkv(8, 130, 77, 2, 64))
    expected = jax.nn.dot_product_attention(q, k, v)
    monkeypatch.setenv("SDXL_ATTENTION", "splash")
    with jax.set_mesh(mesh):
        compiled = jax.jit(attention.dot_product_attention, out_shardings=sharded).lower(q, k, v).compile()
    hlo = compiled.as_text()
    for collective in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"):
        assert collective not in hlo
    got = compiled(q, k, v)
    assert got.sharding.is_equivalent_to(sharded, got.ndim)
    np.testing.assert_allclose(got, expected, atol=2e-6)


def test_cpu_uses_xla_and_the_environment_overrides(monkeypatch):
    monkeypatch.delenv("SDXL_ATTENTION", raising=False)
    assert jax.default_backend() == "cpu"
    assert attention.implementation(jnp.bfloat16, 64) == "xla"
    monkeypatch.setenv("SDXL_ATTENTION", "splash")
    assert attention.implementation(jnp.float32, 512) == "splash"
    monkeypatch.setenv("SDXL_ATTENTION", "cudnn")
    assert attention.implementation(jnp.bfloat16, 64) == "cudnn"
    # Shapes cuDNN's kernel does not take fall back to XLA: float32, and the VAE's 512-wide head.
    assert attention.implementation(jnp.float32, 64) == "xla"
    assert attention.implementation(jnp.bfloat16, 512) == "xla"
    monkeypatch.setenv("SDXL_ATTENTION", "flash")
    with pytest.raises(ValueError, match="SDXL_ATTENTION must be one of xla, splash, cudnn"):
        attention.implementation(jnp.float32, 64)


def test_accelerators_default_to_their_flash_kernels(monkeypatch):
    monkeypatch.delenv("SDXL_ATTENTION", raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert attention.implementation(jnp.bfloat16, 64) == "splash"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert attention.implementation(jnp.bfloat16, 64) == "cudnn"
    assert attention.implementation(jnp.float32, 64) == "xla"


def test_the_mesh_in_context_names_the_platform(monkeypatch):
    """A program is traced for its mesh's devices, whatever the host's backend: a CPU host compiling for
    a TPU topology traces splash (`tests/test_topology.py`), and a CPU mesh keeps XLA's attention."""
    monkeypatch.delenv("SDXL_ATTENTION", raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with jax.set_mesh(Mesh(np.array(jax.devices()), ("batch",))):
        assert attention.target_platform() == "cpu"
        assert attention.implementation(jnp.bfloat16, 64) == "xla"
    assert attention.implementation(jnp.bfloat16, 64) == "splash"


def test_cudnn_falls_back_to_xla_where_cudnn_is_missing(monkeypatch):
    """On this CPU the cuDNN call fails as it does on a GPU without a usable cuDNN: alone, and per
    device under the pipeline's mesh."""
    q, k, v = _qkv(4, 16, 16, 2, 64, jnp.bfloat16)
    expected = jax.nn.dot_product_attention(q, k, v, implementation="xla")
    monkeypatch.setenv("SDXL_ATTENTION", "cudnn")
    np.testing.assert_array_equal(attention.dot_product_attention(q, k, v), expected)
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    with jax.set_mesh(mesh):
        sharded = NamedSharding(mesh, PartitionSpec("batch"))
        got = jax.jit(attention.dot_product_attention)(*(jax.device_put(x, sharded) for x in (q, k, v)))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    "override, dtype, kernels",
    [
        ("", jnp.float32, {"xla"}),
        ("splash", jnp.float32, {"splash"}),
        ("cudnn", jnp.bfloat16, {"xla"}),  # no cuDNN here: the fallback is what the program calls
    ],
)
def test_compiled_programs_name_the_kernel_they_call(monkeypatch, override, dtype, kernels):
    monkeypatch.setenv("SDXL_ATTENTION", override)
    q, k, v = _qkv(1, 128, 77, 2, 64, dtype)
    # A new function each time: jit's cache of traces does not know about SDXL_ATTENTION.
    compiled = jax.jit(lambda q, k, v: attention.dot_product_attention(q, k, v)).lower(q, k, v).compile()
    assert attention.kernels_in(compiled) == kernels
