import jax
import numpy as np
import pytest

from sdxl.checkpoints import BUILTIN_CONFIGS, CheckpointError, HubUnavailableError, ModelSpec, hub, locate
from sdxl.checkpoints import random_models

# Every file of stabilityai/stable-diffusion-xl-base-1.0 that could match our patterns.
SDXL_REPO_FILES = [
    "model_index.json", "sd_xl_base_1.0.safetensors", "sd_xl_offset_example-lora_1.0.safetensors",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json", "text_encoder/model.fp16.safetensors", "text_encoder/model.safetensors",
    "text_encoder/model.onnx", "text_encoder/openvino_model.bin",
    "text_encoder_2/config.json", "text_encoder_2/model.fp16.safetensors", "text_encoder_2/model.safetensors",
    "tokenizer/merges.txt", "tokenizer/special_tokens_map.json", "tokenizer/tokenizer_config.json",
    "tokenizer/vocab.json",
    "unet/config.json", "unet/diffusion_pytorch_model.fp16.safetensors", "unet/diffusion_pytorch_model.safetensors",
    "unet/diffusion_flax_model.msgpack", "unet/model.onnx",
    "vae/config.json", "vae/diffusion_pytorch_model.fp16.safetensors", "vae/diffusion_pytorch_model.safetensors",
    "vae_1_0/diffusion_pytorch_model.fp16.safetensors", "safety_checker/model.safetensors",
]


def test_published_sdxl_base_configs_give_the_published_parameter_counts():
    spec = ModelSpec.from_folder(BUILTIN_CONFIGS / "sdxl-base-1.0")
    counts = {name: sum(leaf.size for leaf in jax.tree.leaves(tree)) for name, tree in spec.abstract_params().items()}
    assert counts == {
        "unet": 2_567_463_684,
        "text_encoder": 123_060_480,
        "text_encoder_2": 694_659_840,
        "vae": 83_653_863,
    }
    assert spec.is_sdxl and spec.native_size == 1024 and spec.latent_factor == 32


def test_hub_download_picks_one_variant_per_component_and_never_pickles():
    fp16 = hub._hub_weight_patterns(SDXL_REPO_FILES, "fp16")
    assert fp16 == [
        "text_encoder/*.fp16*.safetensors", "text_encoder_2/*.fp16*.safetensors", "unet/*.fp16*.safetensors",
        "vae/*.fp16*.safetensors",
    ]
    full = hub._hub_weight_patterns(SDXL_REPO_FILES, None)
    assert "unet/diffusion_pytorch_model.safetensors" in full
    assert not any("fp16" in p or p.endswith((".bin", ".msgpack", ".onnx")) for p in full)
    # Neither single-file checkpoints nor components the pipeline never loads are downloaded.
    assert not any(p.startswith(("sd_xl", "vae_1_0", "safety_checker")) for p in fp16 + full)


def test_offline_hub_model_missing_from_the_cache_is_reported(monkeypatch, tmp_path):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    expected = r"nobody/no-model: not in the local Hugging Face cache.*HF_HUB_OFFLINE"
    with pytest.raises(HubUnavailableError, match=expected):
        locate("nobody/no-model")


@pytest.mark.parametrize("name", ["./nowhere", "/nowhere/at/all", "a/b/c", "just-a-word"])
def test_names_that_are_neither_folders_nor_repo_ids_are_refused(name):
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        locate(name)


def test_builtin_names_resolve_without_a_download():
    assert (locate("tiny") / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert locate("sdxl-base-1.0") == BUILTIN_CONFIGS / "sdxl-base-1.0"


def test_tiny_checkpoint_is_deterministic(tmp_path):
    from safetensors.numpy import load_file

    a = load_file(random_models.write_checkpoint(tmp_path / "a") / "unet" / "diffusion_pytorch_model.safetensors")
    b = load_file(random_models.write_checkpoint(tmp_path / "b") / "unet" / "diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
