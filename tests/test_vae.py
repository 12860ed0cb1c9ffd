"""Parity of sdxl.models.vae.AutoencoderKL with diffusers' AutoencoderKL on a tiny random model."""

import math

import jax
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL as TorchAutoencoderKL
from safetensors.numpy import load_file, save_file

from sdxl.checkpoints import BUILTIN_CONFIGS
from sdxl.checkpoints.weights import CheckpointError, load_params
from sdxl.config import config_from_dict, config_from_file, read_json
from sdxl.models.vae import (
    AutoencoderKL, VAEConfig, abstract_params, rename_key, tile_sizes, tiled_decode, tiled_encode,
)

# Three levels (two down/upsamplers), channel changes on both skip paths, two resnets per block.
TINY_CONFIG = dict(
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(16, 32, 32),
    layers_per_block=2,
    norm_num_groups=8,
    latent_channels=4,
)
WEIGHTS = "diffusion_pytorch_model.safetensors"
LEGACY_ATTENTION_NAMES = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}


def randomised(config: dict) -> TorchAutoencoderKL:
    """A torch VAE with every parameter random, seeded."""
    torch.manual_seed(0)
    vae = TorchAutoencoderKL(**config).eval()
    # Default init leaves norm scales at 1 and biases at 0, which would hide mis-mapped affine
    # parameters; randomise everything at a scale that keeps activations O(1).
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if p.ndim > 1:
                p.normal_(0, 1 / math.sqrt(p[0].numel()))
            elif "norm" in name and name.endswith("weight"):
                p.normal_(1, 0.2)
            else:
                p.normal_(0, 0.2)
    return vae


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A random torch VAE saved with save_pretrained, and its inputs in NCHW. Each fills one tile, no more, so
    that `test_small_inputs_are_not_tiled` runs (eagerly) the operations the tests before it compiled."""
    vae = randomised(TINY_CONFIG)
    path = tmp_path_factory.mktemp("vae")
    vae.save_pretrained(path)
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (2, 3, 32, 24)).astype(np.float32)
    latents = rng.standard_normal((2, 4, 8, 6)).astype(np.float32)
    return vae, path, images, latents


def nhwc(x):
    return np.asarray(x).transpose(0, 2, 3, 1)


def load(path, weights=WEIGHTS, rename=lambda key: key):
    config = config_from_file(VAEConfig, path / "config.json")
    params = load_params([path / weights], abstract_params(config), dtype=np.float32, rename=rename)
    return config, params


def decode(config, params, latents):
    return AutoencoderKL(config).apply({"params": params}, latents, method=AutoencoderKL.decode)


def check_close(name, ours, theirs):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    diff = np.abs(ours - theirs).max()
    print(f"{name}: max abs diff {diff:.2e} (reference std {theirs.std():.3f})")
    assert theirs.std() > 0.1
    assert ours.shape == theirs.shape
    assert diff <= 1e-4


@pytest.mark.oracle
def test_decode_matches_diffusers(reference):
    vae, path, _, latents = reference
    config, params = load(path)
    with torch.no_grad():
        expected = vae.decode(torch.from_numpy(latents)).sample.numpy()
    check_close("decode", decode(config, params, nhwc(latents)), nhwc(expected))


@pytest.mark.oracle
def test_winograd_decode_matches_diffusers(reference, monkeypatch):
    """The CPU's Winograd convolutions in every 3x3 layer, not only the wide ones it picks by default."""
    vae, path, _, latents = reference
    monkeypatch.setenv("SDXL_CONV", "winograd")
    config, params = load(path)
    with torch.no_grad():
        expected = vae.decode(torch.from_numpy(latents)).sample.numpy()
    got = jax.jit(lambda p, z: decode(config, p, z))(params, nhwc(latents))
    check_close("decode, Winograd", got, nhwc(expected))


def test_encode_matches_diffusers(reference):
    vae, path, images, _ = reference
    config, params = load(path)
    with torch.no_grad():
        posterior = vae.encode(torch.from_numpy(images)).latent_dist
    mean, logvar = AutoencoderKL(config).apply({"params": params}, nhwc(images), method=AutoencoderKL.encode)
    assert mean.shape == (2, 32 // config.downscale_factor, 24 // config.downscale_factor, 4)
    check_close("encode mean", mean, nhwc(posterior.mean.numpy()))
    check_close("encode logvar", logvar, nhwc(posterior.logvar.numpy()))


def legacy_name(key):
    for name, legacy in LEGACY_ATTENTION_NAMES.items():
        key = key.replace(f"mid_block.attentions.0.{name}.", f"mid_block.attentions.0.{legacy}.")
    return key


def test_legacy_attention_names_load(reference):
    vae, path, _, latents = reference
    tensors = load_file(path / WEIGHTS)
    legacy = {legacy_name(key): value for key, value in tensors.items()}
    assert "decoder.mid_block.attentions.0.proj_attn.weight" in legacy
    assert "encoder.mid_block.attentions.0.query.bias" in legacy
    save_file(legacy, path / "legacy.safetensors")

    assert all(rename_key(key) == key for key in tensors)
    assert {rename_key(key) for key in legacy} == set(tensors)
    with pytest.raises(CheckpointError, match="query"):
        load(path, "legacy.safetensors")

    config, params = load(path)
    _, legacy_params = load(path, "legacy.safetensors", rename=rename_key)
    assert jax.tree.all(jax.tree.map(np.array_equal, legacy_params, params))
    with torch.no_grad():
        expected = vae.decode(torch.from_numpy(latents)).sample.numpy()
    check_close("decode (legacy names)", decode(config, legacy_params, nhwc(latents)), nhwc(expected))


def test_sdxl_parameter_count():
    sdxl_vae = read_json(BUILTIN_CONFIGS / "sdxl-base-1.0" / "vae" / "config.json")
    config = config_from_dict(VAEConfig, sdxl_vae)
    assert config.downscale_factor == 8
    count = sum(leaf.size for leaf in jax.tree.leaves(abstract_params(config)))
    assert count == 83_653_863


@pytest.mark.parametrize(
    "overrides",
    [
        {"act_fn": "relu"},
        {"down_block_types": ("AttnDownEncoderBlock2D",)},
        {"up_block_types": ("AttnUpDecoderBlock2D",)},
        {"block_out_channels": (64, 128)},
        {"block_out_channels": (48,)},
    ],
)
def test_unsupported_config_raises(overrides):
    with pytest.raises(ValueError):
        VAEConfig(**overrides)


@pytest.fixture
def tiling(reference):
    """The reference VAE with diffusers' tiling switched on for one test."""
    vae = reference[0]
    vae.enable_tiling()
    yield reference
    vae.disable_tiling()


# Latents 3 tiles tall and 4 wide (a tile is 8 latent pixels, one every 6), whose last tiles are
# narrow: 7 and 1 rows, 2 columns; images likewise (a tile is 32 pixels, one every 24).
@pytest.mark.oracle
@pytest.mark.parametrize("shape", [(13, 20)])
def test_tiled_decode_matches_diffusers(tiling, shape):
    vae, path, _, _ = tiling
    config, params = load(path)
    latents = np.random.default_rng(1).standard_normal((2, 4, *shape)).astype(np.float32)
    with torch.no_grad():
        expected = vae.decode(torch.from_numpy(latents)).sample.numpy()
        vae.disable_tiling()
        whole = vae.decode(torch.from_numpy(latents)).sample.numpy()
        vae.enable_tiling()
    model = AutoencoderKL(config)
    got = jax.jit(lambda p, z: tiled_decode(model, p, z))(params, nhwc(latents))
    check_close(f"tiled decode {shape}", got, nhwc(expected))
    # The tiles' seams are there to see: the whole decode (diffusers', which ours matches) differs.
    assert np.abs(np.asarray(got) - nhwc(whole)).max() > 1e-2


@pytest.mark.oracle
@pytest.mark.parametrize("shape", [(52, 80)])
def test_tiled_encode_matches_diffusers(tiling, shape):
    vae, path, _, _ = tiling
    config, params = load(path)
    images = np.random.default_rng(2).uniform(-1, 1, (2, 3, *shape)).astype(np.float32)
    with torch.no_grad():
        posterior = vae.encode(torch.from_numpy(images)).latent_dist
    model = AutoencoderKL(config)
    mean, logvar = jax.jit(lambda p, x: tiled_encode(model, p, x))(params, nhwc(images))
    check_close(f"tiled encode mean {shape}", mean, nhwc(posterior.mean.numpy()))
    check_close(f"tiled encode logvar {shape}", logvar, nhwc(posterior.logvar.numpy()))


def test_small_inputs_are_not_tiled(reference):
    """As diffusers, what fits one tile (the reference's inputs) is decoded or encoded whole."""
    _, path, images, latents = reference
    config, params = load(path)
    model = AutoencoderKL(config)
    sample, latent = tile_sizes(config)
    assert max(images.shape[2:]) == sample and max(latents.shape[2:]) == latent, "each fills a tile, no more"
    latents, images = nhwc(latents), nhwc(images)
    np.testing.assert_array_equal(tiled_decode(model, params, latents), decode(config, params, latents))
    whole = model.apply({"params": params}, images, method=AutoencoderKL.encode)
    jax.tree.map(np.testing.assert_array_equal, tiled_encode(model, params, images), whole)


def temp_bytes(function, *args) -> int:
    return jax.jit(function).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_tiled_decode_needs_one_tiles_memory():
    """Four times the area decodes tiled in about the temporaries of one tile, where a whole decode
    needs four times as much."""
    config = VAEConfig(**TINY_CONFIG, sample_size=64)
    model, params = AutoencoderKL(config), abstract_params(config)
    _, tile = tile_sizes(config)

    def latents(size):
        return jax.ShapeDtypeStruct((1, size, size, config.latent_channels), np.float32)

    one_tile = temp_bytes(lambda p, z: decode(config, p, z), params, latents(tile))
    whole = temp_bytes(lambda p, z: decode(config, p, z), params, latents(2 * tile))
    tiled = temp_bytes(lambda p, z: tiled_decode(model, p, z), params, latents(2 * tile))
    print(f"temporaries: one tile {one_tile / 2**20:.2f} MiB, 4x area whole {whole / 2**20:.2f} MiB, "
          f"tiled {tiled / 2**20:.2f} MiB")
    assert whole > 3 * one_tile
    assert tiled < 1.5 * one_tile
