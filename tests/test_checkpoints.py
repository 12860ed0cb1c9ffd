import json
import time

import jax
import numpy as np
import pytest
from fake_hub import SD15_FILES, SDXL_BASE_FILES, FakeHub, fake_repo, hub_at

from sdxl.checkpoints import BUILTIN_CONFIGS, CheckpointError, HubUnavailableError, ModelSpec, locate, random_models
from sdxl.checkpoints.folder import choose_weight_files, weight_variant
from sdxl.checkpoints.weights import flatten
from sdxl.engine.pipeline import Pipeline
from sdxl.serving import known

SDXL_REPO = "stabilityai/stable-diffusion-xl-base-1.0"
SD15_REPO = "stable-diffusion-v1-5/stable-diffusion-v1-5"
REFINER_FILES = (
    "model_index.json", "scheduler/scheduler_config.json", "sd_xl_refiner_1.0.safetensors",
    "text_encoder_2/config.json", "text_encoder_2/model.safetensors", "text_encoder_2/model.fp16.safetensors",
    "tokenizer_2/merges.txt", "tokenizer_2/special_tokens_map.json", "tokenizer_2/tokenizer_config.json",
    "tokenizer_2/vocab.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
    "unet/diffusion_pytorch_model.fp16.safetensors", "vae/config.json", "vae/diffusion_pytorch_model.safetensors",
    "vae/diffusion_pytorch_model.fp16.safetensors",
)

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


@pytest.mark.parametrize(
    "filename, variant",
    [
        ("diffusion_pytorch_model.safetensors", None),
        ("model.fp16.safetensors", "fp16"),
        ("diffusion_pytorch_model.non_ema.safetensors", "non_ema"),
        ("diffusion_pytorch_model-00001-of-00002.safetensors", None),
        ("diffusion_pytorch_model.fp16-00002-of-00002.safetensors", "fp16"),
    ],
)
def test_weight_variants_are_read_from_file_names(filename, variant):
    assert weight_variant(filename) == variant


def test_one_weight_set_is_chosen_per_component():
    sd15_unet = [f.removeprefix("unet/") for f in SD15_FILES if f.startswith("unet/")]
    assert choose_weight_files(sd15_unet, "float32", "unet") == ["diffusion_pytorch_model.safetensors"]
    assert choose_weight_files(sd15_unet, "bfloat16", "unet") == ["diffusion_pytorch_model.fp16.safetensors"]
    sharded = ["a-00001-of-00002.safetensors", "a-00002-of-00002.safetensors", "a.safetensors.index.json"]
    assert choose_weight_files(sharded, "bfloat16", "unet") == sharded[:2]
    assert choose_weight_files(["model.fp16.safetensors"], "float32", "x") == ["model.fp16.safetensors"]
    with pytest.raises(CheckpointError, match="no plain or fp16 safetensors weights, only model.ema.safetensors"):
        choose_weight_files(["model.ema.safetensors", "config.json"], "float32", "x")
    with pytest.raises(CheckpointError, match="only pickled weights"):
        choose_weight_files(["pytorch_model.bin"], "float32", "x")


# ---------------------------------------------------------------------------------------------
# The Hub, through huggingface_hub itself, against a local stand-in with the real repos' file lists


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    """Tiny random SDXL, SDXL refiner and SD 1.x checkpoints, each in float32 and float16 (the fp16 variant)."""
    root = tmp_path_factory.mktemp("tiny-weights")
    write = random_models.write_checkpoint
    families = (
        ("sdxl", random_models.SDXL_CONFIGS), ("refiner", random_models.REFINER_CONFIGS),
        ("sd1", random_models.SD1_CONFIGS),
    )
    return {
        (family, dtype): write(root / f"{family}-{dtype}", configs, dtype=dtype)
        for family, configs in families
        for dtype in ("float32", "float16")
    }


def _repo(tiny_weights, family: str, file_list, configs: dict | None = None) -> dict[str, bytes]:
    """The real repo's files: the tiny checkpoint's configs, tokenizers and weights under their real
    names (float16 ones as the fp16 variant), `configs` {path: JSON} over them, placeholders elsewhere."""
    contents = {}
    for dtype, suffix in (("float32", ".safetensors"), ("float16", ".fp16.safetensors")):
        folder = tiny_weights[family, dtype]
        for path in folder.rglob("*"):
            name = str(path.relative_to(folder))
            if path.is_file() and name in file_list or name.replace(".safetensors", suffix) in file_list:
                contents[name.replace(".safetensors", suffix)] = path.read_bytes()
    contents |= {name: b"{}" for name in file_list if name.endswith("special_tokens_map.json")}
    contents |= {name: json.dumps(config).encode() for name, config in (configs or {}).items()}
    return fake_repo(file_list, contents)


def _weights(fetched: list[str]) -> list[str]:
    return sorted(f for f in fetched if f.endswith((".safetensors", ".bin", ".ckpt", ".onnx", ".msgpack")))


def _params(pipe) -> dict:
    return {k: np.asarray(v) for k, v in flatten(pipe.params).items()}


def _load(name, dtype="float32"):
    return Pipeline.from_pretrained(name, dtype=dtype, devices=jax.devices()[:1])


def test_a_hub_download_fetches_configs_then_one_weight_set_and_serves_offline(tiny_weights, tmp_path, monkeypatch):
    cache = tmp_path / "hf"
    with FakeHub({SDXL_REPO: _repo(tiny_weights, "sdxl", SDXL_BASE_FILES)}) as fake:
        with hub_at(fake, cache, monkeypatch):
            online = _load(SDXL_REPO)
        fetched = fake.downloaded(SDXL_REPO)
        assert _weights(fetched) == [
            "text_encoder/model.safetensors", "text_encoder_2/model.safetensors",
            "unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
        ]
        assert all(f.endswith(".json") or f.startswith("tokenizer") or f in _weights(fetched) for f in fetched)
        assert fetched.index("unet/config.json") < fetched.index("unet/diffusion_pytorch_model.safetensors")

        # The same cache later, with HF_HUB_OFFLINE=1 and with no network: nothing is asked of the Hub.
        fake.reset_log()
        with hub_at(fake, cache, monkeypatch, offline=True):
            offline = _load(SDXL_REPO)
        assert fake.requests == []
    with hub_at(None, cache, monkeypatch):
        start = time.perf_counter()
        unreachable = _load(SDXL_REPO)
        assert time.perf_counter() - start < 60
    expected = _params(_load(str(tiny_weights["sdxl", "float32"])))
    for pipe in (online, offline, unreachable):
        got = _params(pipe)
        assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in expected)


def test_a_16_bit_load_fetches_only_the_fp16_variant(tiny_weights, tmp_path, monkeypatch):
    with FakeHub({SDXL_REPO: _repo(tiny_weights, "sdxl", SDXL_BASE_FILES)}) as fake:
        with hub_at(fake, tmp_path / "hf", monkeypatch):
            pipe = _load(SDXL_REPO, dtype="bfloat16")
        assert _weights(fake.downloaded(SDXL_REPO)) == [
            "text_encoder/model.fp16.safetensors", "text_encoder_2/model.fp16.safetensors",
            "unet/diffusion_pytorch_model.fp16.safetensors", "vae/diffusion_pytorch_model.fp16.safetensors",
        ]
    assert pipe.dtype == "bfloat16"


def test_sd15_never_fetches_its_non_ema_or_pickled_weights(tiny_weights, tmp_path, monkeypatch):
    """The repo's non_ema UNet beside the plain one once cost 3.4 GB and then 'stored twice'."""
    repo = _repo(tiny_weights, "sd1", SD15_FILES)
    repo["unet/diffusion_pytorch_model.non_ema.safetensors"] = repo["unet/diffusion_pytorch_model.safetensors"]
    with FakeHub({SD15_REPO: repo}) as fake:
        with hub_at(fake, tmp_path / "hf", monkeypatch):
            pipe = _load(SD15_REPO)
        assert _weights(fake.downloaded(SD15_REPO)) == [
            "text_encoder/model.safetensors", "unet/diffusion_pytorch_model.safetensors",
            "vae/diffusion_pytorch_model.safetensors",
        ]
    assert pipe.spec.default_sampler == "pndm"  # SD 1.5's PNDMScheduler, as PLMS


def test_a_diffusers_filled_cache_serves_offline(tiny_weights, tmp_path, monkeypatch):
    """What an earlier `StableDiffusionXLPipeline.from_pretrained(repo)` left in the cache is enough."""
    import diffusers

    cache = tmp_path / "hf"
    with FakeHub({SDXL_REPO: _repo(tiny_weights, "sdxl", SDXL_BASE_FILES)}) as fake:
        with hub_at(fake, cache, monkeypatch):
            diffusers.StableDiffusionXLPipeline.from_pretrained(SDXL_REPO)
        assert "sd_xl_base_1.0.safetensors" not in fake.downloaded(SDXL_REPO)
        fake.reset_log()
        with hub_at(fake, cache, monkeypatch, offline=True):
            pipe = _load(SDXL_REPO)
        assert fake.requests == []
    assert pipe.spec.is_sdxl


def _sdxl_configs(**changes) -> dict:
    """The tiny SDXL configs with some fields changed: {path: {field: value}} merged over them."""
    return {path: {**random_models.SDXL_CONFIGS[path], **fields} for path, fields in changes.items()}


REFINER_INDEX = {
    "_class_name": "StableDiffusionXLImg2ImgPipeline", "requires_aesthetics_score": True,
    "force_zeros_for_empty_prompt": False, "text_encoder": [None, None], "tokenizer": [None, None],
}


@pytest.mark.parametrize(
    "file_list, configs, reason",
    [
        (REFINER_FILES, _sdxl_configs(**{"model_index.json": REFINER_INDEX}),
         "5 time ids .* does model_index.json's requires_aesthetics_score fit this UNet"),
        (
            SDXL_BASE_FILES,
            _sdxl_configs(**{"model_index.json": {"_class_name": "StableDiffusionInstructPix2PixPipeline"},
                             "unet/config.json": {"in_channels": 8}}),
            "an instruct-pix2pix model",
        ),
        (SDXL_BASE_FILES, _sdxl_configs(**{"unet/config.json": {"in_channels": 8}}), "8 input channels"),
        (SDXL_BASE_FILES,
         _sdxl_configs(**{"scheduler/scheduler_config.json": {"_class_name": "HeunDiscreteScheduler"}}),
         "scheduler HeunDiscreteScheduler is not implemented"),
        (SDXL_BASE_FILES, _sdxl_configs(**{"scheduler/scheduler_config.json": {
            "_class_name": "EDMDPMSolverMultistepScheduler", "algorithm_type": "sde-dpmsolver++"}}),
         "EDMDPMSolverMultistepScheduler with algorithm_type='sde-dpmsolver\\+\\+' is not implemented"),
        (SDXL_BASE_FILES, _sdxl_configs(**{"unet/config.json": {"transformer_layers_per_block": [[1], [1, 2]]}}),
         "transformer_layers_per_block must be an int or one int per level"),
        (SDXL_BASE_FILES, _sdxl_configs(**{"vae/config.json": {"shift_factor": 0.1159}}), "shift_factor"),
    ],
    ids=[
        "refiner-index-over-a-base-unet", "instruct-pix2pix", "8-channel-unet", "heun", "edm-sde",
        "ssd-1b-style-unet", "vae-shift",
    ],
)
def test_an_unsupported_model_is_refused_before_its_weights_are_fetched(
    tiny_weights, tmp_path, monkeypatch, file_list, configs, reason
):
    repo = "someone/some-model"
    with FakeHub({repo: _repo(tiny_weights, "sdxl", file_list, configs)}) as fake:
        with hub_at(fake, tmp_path / "hf", monkeypatch), pytest.raises(CheckpointError, match=reason):
            _load(repo)
        assert fake.downloaded(repo) and _weights(fake.downloaded(repo)) == []


def test_the_refiner_repo_fetches_its_one_text_encoder_and_loads(tiny_weights, tmp_path, monkeypatch):
    """stabilityai/stable-diffusion-xl-refiner-1.0's layout: text_encoder_2 alone, the aesthetic score."""
    repo = "stabilityai/stable-diffusion-xl-refiner-1.0"
    with FakeHub({repo: _repo(tiny_weights, "refiner", REFINER_FILES)}) as fake:
        with hub_at(fake, tmp_path / "hf", monkeypatch):
            pipe = _load(repo)
        assert _weights(fake.downloaded(repo)) == [
            "text_encoder_2/model.safetensors", "unet/diffusion_pytorch_model.safetensors",
            "vae/diffusion_pytorch_model.safetensors",
        ]
    assert pipe.spec.text_encoder_names == ("text_encoder_2",) and pipe.spec.requires_aesthetics_score
    assert sorted(pipe.params) == ["text_encoder_2", "unet", "vae"]


def test_a_model_missing_from_the_cache_without_network_is_hub_unavailable(tmp_path, monkeypatch):
    with hub_at(None, tmp_path / "hf", monkeypatch), pytest.raises(HubUnavailableError, match="unreachable"):
        locate("nobody/no-model")


def test_sdxl_turbo_loads_with_its_own_sampler(tiny_weights, tmp_path, monkeypatch):
    """stabilityai/sdxl-turbo: SDXL base's layout, its single files beside, EulerAncestral with trailing spacing."""
    files = [f for f in SDXL_BASE_FILES if not f.startswith("sd_xl_base")] + [
        "sd_xl_turbo_1.0.safetensors", "sd_xl_turbo_1.0_fp16.safetensors",
    ]
    scheduler = {"_class_name": "EulerAncestralDiscreteScheduler", "timestep_spacing": "trailing"}
    repo = _repo(tiny_weights, "sdxl", files, _sdxl_configs(**{"scheduler/scheduler_config.json": scheduler}))
    with FakeHub({"stabilityai/sdxl-turbo": repo}) as fake:
        with hub_at(fake, tmp_path / "hf", monkeypatch):
            pipe = _load("stabilityai/sdxl-turbo")
        assert not any(f.startswith("sd_xl_turbo") for f in fake.downloaded("stabilityai/sdxl-turbo"))
    assert pipe.spec.default_sampler == "euler_ancestral" and pipe.spec.scheduler.timestep_spacing == "trailing"


def test_a_hub_single_file_is_fetched_alone(tiny_weights, tmp_path, monkeypatch):
    single = random_models.write_single_file(tmp_path / "fine-tune.safetensors", random_models.SDXL_CONFIGS)
    repo = {"fine-tune.safetensors": single.read_bytes(), "README.md": b"a fine-tune"}
    with FakeHub({"someone/fine-tune": repo}) as fake:
        with hub_at(fake, tmp_path / "hf", monkeypatch):
            pipe = Pipeline.from_pretrained(
                "someone/fine-tune/fine-tune.safetensors", config=str(tiny_weights["sdxl", "float32"]),
                dtype="float32", devices=jax.devices()[:1],
            )
        assert set(fake.downloaded("someone/fine-tune")) == {"fine-tune.safetensors"}  # its header, then itself
    assert pipe.spec.is_sdxl


def test_a_hub_single_file_that_cannot_run_is_refused_from_its_header(tmp_path, monkeypatch):
    import safetensors.numpy

    single = random_models.write_single_file(tmp_path / "model.safetensors", random_models.SDXL_CONFIGS)
    tensors = safetensors.numpy.load_file(single)
    tensors["model.diffusion_model.input_blocks.0.0.weight"] = np.zeros((32, 9, 3, 3), np.float16)
    safetensors.numpy.save_file(tensors, tmp_path / "inpainting.safetensors")
    repo = {"inpainting.safetensors": (tmp_path / "inpainting.safetensors").read_bytes()}
    with FakeHub({"someone/inpainting": repo}) as fake:
        with hub_at(fake, tmp_path / "hf", monkeypatch), pytest.raises(CheckpointError, match="9 input channels"):
            _load("someone/inpainting/inpainting.safetensors")
    assert not list((tmp_path / "hf").rglob("inpainting.safetensors"))  # never downloaded


def test_a_lightning_unet_file_replaces_the_base_unet_which_is_never_fetched(tiny_weights, tmp_path, monkeypatch):
    """SDXL-Lightning as its card uses it: SDXL base's repo, with a UNet file from another repo."""
    lightning = random_models.write_checkpoint(tmp_path / "distilled", random_models.SDXL_CONFIGS, seed=7)
    unet_file = "sdxl_lightning_4step_unet.safetensors"
    distilled_unet = (lightning / "unet/diffusion_pytorch_model.safetensors").read_bytes()
    repos = {SDXL_REPO: _repo(tiny_weights, "sdxl", SDXL_BASE_FILES),
             "ByteDance/SDXL-Lightning": {unet_file: distilled_unet}}
    settings = known.recommended(SDXL_REPO, f"ByteDance/SDXL-Lightning/{unet_file}")
    assert (settings.steps, settings.guidance_scale, settings.scheduler) == (4, 0.0, {"timestep_spacing": "trailing"})
    with FakeHub(repos) as fake:
        with hub_at(fake, tmp_path / "hf", monkeypatch):
            pipe = Pipeline.from_pretrained(SDXL_REPO, unet=f"ByteDance/SDXL-Lightning/{unet_file}",
                                            scheduler=settings.scheduler, dtype="float32", devices=jax.devices()[:1])
        assert "unet/diffusion_pytorch_model.safetensors" not in fake.downloaded(SDXL_REPO)
    assert pipe.spec.scheduler.timestep_spacing == "trailing"
    base, distilled = _params(_load(str(tiny_weights["sdxl", "float32"]))), _params(_load(lightning))
    got = _params(pipe)
    for key, value in got.items():
        np.testing.assert_array_equal(value, (distilled if key[0] == "unet" else base)[key])

    with pytest.raises(CheckpointError, match="no such file"):
        Pipeline.from_pretrained(str(tiny_weights["sdxl", "float32"]), unet=str(tmp_path / "missing.safetensors"))
    with pytest.raises(CheckpointError, match="not a single file"):
        Pipeline.from_pretrained(str(tmp_path / "model.safetensors"), unet=str(lightning / "unet/config.json"))
    sd1_unet = tiny_weights["sd1", "float32"] / "unet/diffusion_pytorch_model.safetensors"
    with pytest.raises(CheckpointError, match="does not match the model"):  # every key and shape is checked
        Pipeline.from_pretrained(str(tiny_weights["sdxl", "float32"]), unet=str(sd1_unet))


@pytest.mark.parametrize("model, unet, sampler, expected", [
    ("stabilityai/sdxl-turbo", None, None, (1, 0.0, None)),
    ("/models/sdxl-turbo", None, None, (1, 0.0, None)),
    (SDXL_REPO, "sdxl_lightning_1step_unet_x0.safetensors", None,
     (1, 0.0, {"timestep_spacing": "trailing", "prediction_type": "sample"})),
    (SDXL_REPO, "sdxl_lightning_8step_unet.safetensors", None, (8, 0.0, {"timestep_spacing": "trailing"})),
    ("someone/lcm-model", None, "lcm", (4, 1.0, None)),
    (SDXL_REPO, None, "euler", (25, 5.0, None)),
])
def test_recommended_settings_of_known_few_step_models(model, unet, sampler, expected):
    settings = known.recommended(model, unet, sampler)
    assert (settings.steps, settings.guidance_scale, settings.scheduler) == expected


def test_a_hyper_sd_lora_asks_for_ddim_with_trailing_steps():
    settings = known.recommended(SDXL_REPO, loras=("ByteDance/Hyper-SD/Hyper-SDXL-8steps-lora.safetensors",))
    assert (settings.steps, settings.guidance_scale) == (8, 0.0)
    assert settings.scheduler == {"_class_name": "DDIMScheduler", "timestep_spacing": "trailing"}
    assert known.recommended(SDXL_REPO, loras=("style.safetensors",)).steps == 25


def test_a_separate_vae_replaces_the_base_vae_which_is_never_fetched(tiny_weights, tmp_path, monkeypatch):
    vae = tiny_weights["sdxl", "float32"] / "vae"
    with FakeHub({SDXL_REPO: _repo(tiny_weights, "sdxl", SDXL_BASE_FILES)}) as fake:
        with hub_at(fake, tmp_path / "hf", monkeypatch):
            pipe = Pipeline.from_pretrained(SDXL_REPO, vae=str(vae), dtype="float32", devices=jax.devices()[:1])
            assert [f for f in fake.downloaded(SDXL_REPO) if f.startswith("vae/")] == ["vae/config.json"]
            assert pipe.vae_name == "vae" and _load(SDXL_REPO).vae_name is None
