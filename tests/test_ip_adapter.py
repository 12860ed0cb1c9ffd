"""Parity of sdxl.models.ip_adapter's image projections with diffusers', after diffusers' own conversion
of h94's files (random ones written by `random_models.write_ip_adapter`)."""

import numpy as np
import pytest
import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import load_file

from sdxl.checkpoints import ip_adapters, random_models
from sdxl.checkpoints.weights import SafetensorsFile
from sdxl.config import config_from_dict
from sdxl.models import ip_adapter
from sdxl.models.unet import UNetConfig

UNET = config_from_dict(UNetConfig, random_models.SDXL_CONFIGS["unet/config.json"])
ENCODER = random_models.IP_ADAPTER_ENCODER
POSITIONS = (ENCODER["image_size"] // ENCODER["patch_size"]) ** 2 + 1


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return random_models.write_ip_adapter(tmp_path_factory.mktemp("ip"), UNET, kinds=("plain", "plus", "full"))


def _diffusers_projection(file) -> torch.nn.Module:
    """The projection as diffusers' load_ip_adapter builds it from the file."""
    state_dict = {k.removeprefix("image_proj."): v for k, v in load_file(file).items() if k.startswith("image_proj.")}
    # The conversion reads nothing of the UNet it is a method of (without low_cpu_mem_usage).
    return UNet2DConditionModel._convert_ip_adapter_image_proj_to_diffusers(None, state_dict, False).eval()


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["plain", "plus", "full"])
def test_projection_matches_diffusers(adapters, rng, kind):
    file = adapters / "sdxl_models" / random_models.IP_ADAPTER_FILES[kind]
    loaded = ip_adapters.resolve(adapters, "sdxl_models", file.name, UNET, image_encoder_folder=None).adapters[0]
    assert loaded.projection == random_models.ip_adapter_projection(kind, UNET.cross_attention_dim)
    weights = loaded.load(UNET, np.float32)
    shape = (2, POSITIONS, ENCODER["hidden_size"]) if kind != "plain" else (2, ENCODER["projection_dim"])
    inputs = rng.standard_normal(shape).astype(np.float32)

    ours = ip_adapter.image_projection(weights.projection).apply({"params": weights.image_proj}, inputs)
    with torch.no_grad():
        theirs = _diffusers_projection(file)(torch.from_numpy(inputs)).numpy()
    tokens = POSITIONS if kind == "full" else weights.num_tokens
    assert ours.shape == theirs.shape == (2, tokens, UNET.cross_attention_dim)
    diff = np.abs(np.asarray(ours) - theirs).max()
    print(f"{kind}: max abs diff {diff:.2e} (reference std {theirs.std():.2f})")
    assert theirs.std() > 0.3
    assert diff <= 1e-5


@pytest.mark.parametrize("kind", ["plain", "plus", "full"])
def test_the_kind_and_sizes_follow_from_the_stored_shapes(adapters, kind):
    file = SafetensorsFile(adapters / "sdxl_models" / random_models.IP_ADAPTER_FILES[kind])
    shapes = {key.removeprefix("image_proj."): file.shape(key) for key in file.keys() if key.startswith("image_proj.")}
    expected = random_models.ip_adapter_projection(kind, UNET.cross_attention_dim)
    assert ip_adapter.projection_config(shapes) == expected


@pytest.mark.parametrize(
    "shapes",
    [
        # IP-Adapter FaceID: insightface's 512-wide embedding through an MLP into 4 tokens
        {"proj.0.weight": (1024, 512), "proj.2.weight": (3072, 1024), "norm.weight": (768,)},
        # FaceID Plus: the same, and a Resampler over the CLIP encoder's states
        {"proj.0.weight": (1024, 512), "perceiver_resampler.proj_in.weight": (768, 1280)},
    ],
    ids=["faceid", "faceid-plus"],
)
def test_faceid_adapters_are_refused(shapes):
    with pytest.raises(ValueError, match="insightface"):
        ip_adapter.projection_config(shapes)
