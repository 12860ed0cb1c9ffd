"""sdxl.checkpoints.ip_adapters: h94's files found, checked and loaded as diffusers' load_ip_adapter
loads them (random ones written by `random_models.write_ip_adapter`)."""

import shutil

import numpy as np
import pytest
import torch
import transformers
from diffusers import UNet2DConditionModel
from safetensors.numpy import load_file

from fake_hub import FakeHub, hub_at
from reference import sdxl_pipeline
from sdxl.checkpoints import CheckpointError, ip_adapters, random_models
from sdxl.config import config_from_dict
from sdxl.models import clip_vision
from sdxl.models.unet import UNetConfig

SDXL_UNET = random_models.SDXL_CONFIGS["unet/config.json"]
SD1_UNET = random_models.SD1_CONFIGS["unet/config.json"]
UNET = config_from_dict(UNetConfig, SDXL_UNET)
FILES = random_models.IP_ADAPTER_FILES


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return random_models.write_ip_adapter(tmp_path_factory.mktemp("ip"), UNET, kinds=("plain", "plus", "full"))


@pytest.mark.parametrize("config", [SDXL_UNET, SD1_UNET, random_models.MEDIUM_CONFIGS["unet/config.json"]],
                         ids=["sdxl", "sd1", "medium"])
def test_cross_attention_layers_are_diffusers_attn_processors_in_order(config):
    unet = UNet2DConditionModel(**{k: v for k, v in config.items() if not k.startswith("_")})
    theirs = [name.removesuffix(".processor") for name in unet.attn_processors if name.endswith("attn2.processor")]
    ours = ip_adapters.cross_attention_layers(config_from_dict(UNetConfig, config))
    assert ours == theirs
    assert ours[-1].startswith("mid_block")  # registered after the up blocks


def test_loads_every_layer_under_its_key_id(folder):
    checkpoint = ip_adapters.resolve(folder, "sdxl_models", FILES["plain"], UNET).adapters[0]
    weights = checkpoint.load(UNET, np.float32)
    stored = load_file(checkpoint.file)
    layers = ip_adapters.cross_attention_layers(UNET)
    assert list(weights.layers) == layers and weights.num_tokens == 4
    for i, path in enumerate(layers):
        for name in ("to_k_ip", "to_v_ip"):
            np.testing.assert_array_equal(weights.layers[path][name], stored[f"ip_adapter.{2 * i + 1}.{name}.weight"])
    assert {tuple(w["to_k_ip"].shape) for w in weights.layers.values()} == {(64, 64)}  # the second level's width


def test_an_adapter_for_another_unet_is_refused_in_one_sentence(tmp_path):
    sd1 = config_from_dict(UNetConfig, SD1_UNET)
    random_models.write_ip_adapter(tmp_path, sd1, subfolder="models")
    with pytest.raises(CheckpointError, match="does not fit this model's UNet") as refused:
        ip_adapters.resolve(tmp_path, "models", FILES["plain"], UNET)
    assert "\n" not in str(refused.value)


def test_pickled_and_missing_files_are_refused(folder):
    with pytest.raises(CheckpointError, match="pickled"):
        ip_adapters.resolve(folder, "sdxl_models", "ip-adapter_sdxl.bin", UNET)
    with pytest.raises(CheckpointError, match="no such file"):
        ip_adapters.resolve(folder, "sdxl_models", "ip-adapter_sdxl.safetensors", UNET)


def test_the_image_encoder_folder_as_diffusers_finds_it(folder):
    def encoder(**kwargs):
        return ip_adapters.resolve(folder, "sdxl_models", FILES["plus"], UNET, **kwargs).image_encoder

    assert encoder().files == (folder / "sdxl_models/image_encoder/model.safetensors",)
    shutil.copytree(folder / "sdxl_models/image_encoder", folder / "encoders/vit")
    # A name with a "/" is from the source's root, one without inside the subfolder.
    assert encoder(image_encoder_folder="encoders/vit").files == (folder / "encoders/vit/model.safetensors",)
    with pytest.raises(CheckpointError, match="no image encoder"):
        encoder(image_encoder_folder="vit")
    assert encoder(image_encoder_folder=None) is None


def test_several_adapters_share_the_first_sources_encoder(folder):
    found = ip_adapters.resolve([folder], "sdxl_models", [FILES["plain"], FILES["full"]], UNET)
    assert [a.projection.kind for a in found.adapters] == ["plain", "full"]
    assert found.image_encoder.config.image_size == random_models.IP_ADAPTER_ENCODER["image_size"]
    with pytest.raises(CheckpointError, match="2 subfolders for 3"):
        ip_adapters.resolve(folder, ["sdxl_models"] * 2, [FILES["plain"]] * 3, UNET)


def test_an_encoder_the_projection_cannot_read_is_refused(folder):
    projection = random_models.ip_adapter_projection("plain", UNET.cross_attention_dim)
    encoder = config_from_dict(clip_vision.CLIPVisionConfig, {**random_models.IP_ADAPTER_ENCODER, "projection_dim": 16})
    with pytest.raises(CheckpointError, match="reads 24-wide image embeds, the image encoder gives 16-wide"):
        ip_adapters.check_encoder(projection, encoder, "here")


@pytest.mark.oracle
def test_the_image_encoder_loads_as_transformers_loads_it(folder, rng):
    encoder = ip_adapters.resolve(folder, "sdxl_models", FILES["plus"], UNET).image_encoder
    params = encoder.load(np.float32)
    reference = transformers.CLIPVisionModelWithProjection.from_pretrained(folder / "sdxl_models/image_encoder").eval()
    size = encoder.config.image_size
    pixels = rng.standard_normal((2, size, size, 3)).astype(np.float32)
    ours = clip_vision.CLIPVisionModelWithProjection(encoder.config).apply({"params": params}, pixels)
    with torch.no_grad():
        theirs = reference(torch.from_numpy(pixels).permute(0, 3, 1, 2), output_hidden_states=True)
    for name, a, b in [("image_embeds", ours.image_embeds, theirs.image_embeds),
                       ("hidden_states[-2]", ours.hidden_states[-2], theirs.hidden_states[-2])]:
        diff = np.abs(np.asarray(a) - b.numpy()).max()
        print(f"{name}: max abs diff {diff:.2e}")
        assert diff <= 1e-5


@pytest.mark.oracle
def test_diffusers_load_ip_adapter_reads_the_written_files_as_we_do(folder, tmp_path):
    pipe = sdxl_pipeline(tmp_path / "sdxl")
    names = [FILES["plain"], FILES["plus"]]
    pipe.load_ip_adapter(str(folder), subfolder="sdxl_models", weight_name=names)
    assert pipe.image_encoder is not None and pipe.feature_extractor.crop_size["height"] == 28
    ours = [a.load(UNET, np.float32) for a in ip_adapters.resolve(folder, "sdxl_models", names, UNET).adapters]
    processors = {name.removesuffix(".processor"): p for name, p in pipe.unet.attn_processors.items()}
    for path in ip_adapters.cross_attention_layers(UNET):
        for i, weights in enumerate(ours):
            for name in ("to_k_ip", "to_v_ip"):
                theirs = getattr(processors[path], name)[i].weight.detach().numpy()
                np.testing.assert_array_equal(weights.layers[path][name], theirs)
    assert processors[path].num_tokens == [4, 8]


def test_a_hub_repo_in_h94s_layout(folder, tmp_path, monkeypatch):
    sd1 = config_from_dict(UNetConfig, SD1_UNET)
    random_models.write_ip_adapter(tmp_path / "sd1", sd1, subfolder="models")
    files = {
        f"sdxl_models/{name}": (folder / "sdxl_models" / name).read_bytes()
        for name in [FILES["plain"], "image_encoder/config.json", "image_encoder/model.safetensors"]
    }
    files["models/ip-adapter.safetensors"] = (tmp_path / "sd1/models" / FILES["plain"]).read_bytes()
    with FakeHub({"h94/IP-Adapter": files}) as fake, hub_at(fake, tmp_path / "hf", monkeypatch):
        found = ip_adapters.resolve("h94/IP-Adapter", "sdxl_models", FILES["plain"], UNET)
        assert found.adapters[0].load(UNET, np.float32).num_tokens == 4
        assert found.image_encoder.config.image_size == 28
        with pytest.raises(CheckpointError, match="does not fit"):
            ip_adapters.resolve("h94/IP-Adapter", "models", "ip-adapter.safetensors", UNET)
        downloads = fake.downloaded("h94/IP-Adapter")
    # Its header, then the file; the other refused from its header alone.
    assert downloads.count(f"sdxl_models/{FILES['plain']}") == 2
    assert downloads.count("models/ip-adapter.safetensors") == 1
