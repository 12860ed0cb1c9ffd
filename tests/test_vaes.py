"""A separate VAE (`sdxl.checkpoints.vaes`) loads as diffusers loads it, from a folder, a Hub repo and
single files in either key layout, and one that cannot serve the model is refused with its reason."""

import json

import jax
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL as TorchAutoencoderKL
from fake_hub import FakeHub, hub_at
from safetensors.torch import save_file
from test_vae import randomised

from sdxl.__main__ import main
from sdxl.checkpoints import CheckpointError, locate, random_models, resolve
from sdxl.checkpoints.single_file import vae_original
from sdxl.checkpoints.weights import checkpoint_key, flatten
from sdxl.config import read_json
from sdxl.engine.pipeline import Pipeline
from sdxl.models.vae import AutoencoderKL, abstract_params

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def vae_folder(tmp_path_factory):
    """A random VAE of the tiny model's architecture, as a diffusers folder whose config says
    `force_upcast` false (as fp16-fix's does)."""
    config = read_json(locate("tiny") / "vae" / "config.json")
    config = {k: v for k, v in config.items() if not k.startswith("_")} | {"force_upcast": False}
    folder = tmp_path_factory.mktemp("vae") / "my-vae"
    randomised(config).save_pretrained(folder)
    return folder


def original_file(folder, path, prefix: str):
    """The folder's VAE as one file in the original LDM layout (our mapping inverted), keys under `prefix`."""
    spec = resolve("tiny", dtype="float32", vae=str(folder)).spec
    state = TorchAutoencoderKL.from_pretrained(folder).state_dict()
    tensors = {}
    for flax_path in flatten(abstract_params(spec.vae)):
        key = checkpoint_key(flax_path)
        original = vae_original(key, spec.vae)
        tensor = state[key]
        tensors[prefix + original.key] = tensor[..., None, None] if original.squeeze else tensor
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


def our_decode(pipe, latents):
    model = AutoencoderKL(pipe.spec.vae)
    return np.asarray(model.apply({"params": pipe.params["vae"]}, latents, method=model.decode))


def check_decodes_alike(pipe, reference):
    latents = np.random.default_rng(0).standard_normal((1, 4, 6, 10)).astype(np.float32)
    with torch.no_grad():
        expected = reference.decode(torch.from_numpy(latents)).sample.numpy().transpose(0, 2, 3, 1)
    got = our_decode(pipe, latents.transpose(0, 2, 3, 1))
    diff = np.abs(got - expected).max()
    print(f"decode with {pipe.vae_name}: max abs diff {diff:.2e} (reference std {expected.std():.3f})")
    assert expected.std() > 0.1 and diff <= 1e-4


def load(vae, model="tiny"):
    return Pipeline.from_pretrained(model, dtype="float32", devices=jax.devices()[:1], vae=vae)


def load_own():
    return resolve("tiny", dtype="float32")


def test_a_vae_folder_replaces_the_models_vae_and_its_config(vae_folder):
    pipe = load(str(vae_folder))
    assert pipe.vae_name == "my-vae"
    assert not pipe.spec.vae.force_upcast and load_own().spec.vae.force_upcast
    check_decodes_alike(pipe, TorchAutoencoderKL.from_pretrained(vae_folder))


@pytest.mark.parametrize("prefix", ["", "first_stage_model."])
def test_an_original_layout_vae_file_loads_as_diffusers_from_single_file(vae_folder, tmp_path, prefix):
    """As stabilityai's sdxl_vae.safetensors (no prefix) and A1111's VAE files; the checkpoint's
    VAE config serves."""
    path = original_file(vae_folder, tmp_path / "sdxl_vae.safetensors", prefix)
    pipe = load(str(path))
    assert pipe.vae_name == "sdxl_vae" and pipe.spec.vae == load_own().spec.vae
    check_decodes_alike(pipe, TorchAutoencoderKL.from_single_file(str(path), config=str(vae_folder)))


def test_a_diffusers_layout_vae_file_loads(vae_folder, tmp_path):
    path = tmp_path / "vae.safetensors"
    path.write_bytes((vae_folder / WEIGHTS).read_bytes())
    pipe = load(str(path))
    assert pipe.vae_name == "vae"
    check_decodes_alike(pipe, TorchAutoencoderKL.from_pretrained(vae_folder))


def test_a_single_file_checkpoint_takes_a_vae_in_place_of_its_own(vae_folder, tmp_path):
    model = random_models.write_single_file(tmp_path / "model.safetensors", random_models.configs_of("tiny"))
    checkpoint = resolve(str(model), dtype="float32", config=str(locate("tiny")), vae=str(vae_folder))
    params = checkpoint.load(np.float32, lambda array: array)
    expected = load(str(vae_folder)).params["vae"]
    assert jax.tree.all(jax.tree.map(np.array_equal, params["vae"], expected))


def test_a_hub_vae_repo_fetches_its_config_and_one_weight_set(vae_folder, tmp_path, monkeypatch):
    repo = {name: (vae_folder / name).read_bytes() for name in ("config.json", WEIGHTS)}
    repo["sdxl_vae.safetensors"] = repo[WEIGHTS]  # as fp16-fix's repo: the same weights under other names
    with FakeHub({"someone/sdxl-vae-fix": repo}) as fake:
        with hub_at(fake, tmp_path / "hf", monkeypatch):
            pipe = load("someone/sdxl-vae-fix")
        assert sorted(fake.downloaded("someone/sdxl-vae-fix")) == ["config.json", WEIGHTS]
    assert pipe.vae_name == "sdxl-vae-fix" and not pipe.spec.vae.force_upcast
    check_decodes_alike(pipe, TorchAutoencoderKL.from_pretrained(vae_folder))


def test_a_vae_of_other_latents_is_refused_before_its_weights_are_fetched(vae_folder, tmp_path, monkeypatch):
    config = json.loads((vae_folder / "config.json").read_text()) | {"latent_channels": 16}
    repo = {"config.json": json.dumps(config).encode(), WEIGHTS: b"not read"}
    refusal = "16-channel latents at 1/8 scale cannot serve this model, whose latents have 4 channels at 1/8 scale"
    with FakeHub({"someone/flux-vae": repo}) as fake:
        with hub_at(fake, tmp_path / "hf", monkeypatch), pytest.raises(CheckpointError, match=refusal):
            resolve("tiny", vae="someone/flux-vae")
        assert fake.downloaded("someone/flux-vae") == ["config.json"]
    folder = tmp_path / "flux-vae"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))  # no weights at all: the config alone refuses it
    with pytest.raises(CheckpointError, match=refusal):
        resolve("tiny", vae=str(folder))


@pytest.mark.parametrize("source, reason", [
    ("vae-ft-mse-840000-ema-pruned.ckpt", "a pickled file"),
    ("/nowhere/sdxl_vae.safetensors", "no such file"),
    ("/nowhere/vae", "not a VAE folder, a .safetensors file, or a Hub repo id"),
])
def test_sources_that_are_no_vae_are_refused(source, reason):
    with pytest.raises(CheckpointError, match=reason):
        resolve("tiny", vae=source)


def test_a_file_without_a_vae_is_refused(tmp_path):
    unet = locate("tiny") / "unet" / WEIGHTS
    with pytest.raises(CheckpointError, match="no VAE in this file"):
        resolve("tiny", vae=str(unet))


def test_the_cli_refuses_a_bad_vae_in_one_line(capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "a lighthouse", "--vae", "/nowhere/vae.safetensors"]) == 2
    error = capsys.readouterr().err
    assert error == "error: /nowhere/vae.safetensors: no such file\n"
