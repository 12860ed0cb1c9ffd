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
from sdxl.models.vae import AutoencoderKL, VAEConfig, abstract_params, rename_key

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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A random torch VAE saved with save_pretrained, and its inputs in NCHW."""
    torch.manual_seed(0)
    vae = TorchAutoencoderKL(**TINY_CONFIG).eval()
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
    path = tmp_path_factory.mktemp("vae")
    vae.save_pretrained(path)
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (2, 3, 32, 48)).astype(np.float32)
    latents = rng.standard_normal((2, 4, 8, 12)).astype(np.float32)
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
    assert mean.shape == (2, 32 // config.downscale_factor, 48 // config.downscale_factor, 4)
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
