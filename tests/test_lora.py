"""LoRAs against diffusers' `load_lora_weights` + `set_adapters`, in every format we read.

Each test writes a random LoRA over the reference pipeline's own layers (named from its PyTorch
modules, in the format under test), loads the same file into diffusers, which converts the names
with its own code, and compares images: a name we map to the wrong layer changes the picture.
"""

import hashlib
import json
import math

import numpy as np
import pytest
import safetensors.numpy
import torch
from reference import diffusers_images, random_latents, sd_pipeline, sdxl_pipeline

from sdxl.checkpoints import CheckpointError, lora, random_models
from sdxl.checkpoints.single_file import unet_original
from sdxl.checkpoints.weights import flatten
from sdxl.engine.compilation import CompileCounter
from sdxl.engine.pipeline import Pipeline

HEIGHT, WIDTH = 64, 64
PROMPTS = ["a red cube on a table", "a blue sphere floating over grass"]
NEGATIVES = ["blurry", "low quality, watermark"]
COMPONENTS = ("unet", "text_encoder", "text_encoder_2")


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdxl")
    ref = sdxl_pipeline(folder)
    return ref, Pipeline.from_pretrained(folder, dtype="float32", max_steps=8)


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd1")
    configs = {**random_models.SD1_CONFIGS, "scheduler/scheduler_config.json": {
        **random_models.SD1_CONFIGS["scheduler/scheduler_config.json"], "_class_name": "EulerDiscreteScheduler"}}
    ref = sd_pipeline(folder, configs)
    return ref, Pipeline.from_pretrained(folder, dtype="float32", max_steps=8)


def layers(ref) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """{component: [(module name, weight shape)]} of every linear and convolution layer.

    transformers 5 names a CLIPTextModel's layers without the `text_model.` of its checkpoints
    (`encoder.layers.0.mlp.fc1`), and so does a PEFT LoRA saved from it.
    """
    result = {}
    for component in COMPONENTS:
        model = getattr(ref, component, None)
        if model is not None:
            result[component] = [(name, tuple(m.weight.shape)) for name, m in model.named_modules()
                                 if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    return result


def factors(rng, shape, rank):
    """Random (down, up) for a weight of `shape`, scaled so that the update is about 0.3 of the weight."""
    down_shape = (rank, *shape[1:])
    up_shape = (shape[0], rank) + (1, 1) * (len(shape) == 4)
    down = rng.standard_normal(down_shape) / math.prod(shape[1:]) ** 0.5
    up = 0.3 * rng.standard_normal(up_shape) / rank**0.5
    return down.astype(np.float32), up.astype(np.float32)


def kohya_file(path, ref, *, sgm: bool, seed: int, te1_prefix="lora_te1_", text_model: bool = False):
    """A kohya / A1111 LoRA: every layer, ranks 2 and 4, alpha 3 (so alpha / rank is not 1).

    sd-scripts names text encoder layers `lora_te1_text_model_encoder_...`; diffusers 0.42 with
    transformers 5 cannot load those (it looks for `text_model.text_model.`), so the files compared
    with diffusers leave out `text_model_` (`text_model=False`), as transformers 5 names the layers.
    """
    rng, tensors = np.random.default_rng(seed), {}
    prefixes = {"unet": "lora_unet_", "text_encoder": te1_prefix, "text_encoder_2": "lora_te2_"}
    for component, modules in layers(ref).items():
        for i, (module, shape) in enumerate(modules):
            if component.startswith("text") and "projection" in module:
                continue  # sd-scripts trains no text projection
            if not sgm and module.startswith("add_embedding"):
                continue  # diffusers' converter strips `add_embedding_linear_1`'s index (its SDXL "emb" rule)
            name = module
            if text_model and component != "unet" and not module.startswith("text_model."):
                name = f"text_model.{module}"
            if sgm and component == "unet":
                name = unet_original(module + ".weight", _unet_config(ref)).key.removesuffix(".weight")
            key = prefixes[component] + name.replace(".", "_")
            down, up = factors(rng, shape, 2 + 2 * (i % 2))
            tensors |= {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
                        f"{key}.alpha": np.array(3.0, np.float32)}
    safetensors.numpy.save_file(tensors, path)
    return path


def _unet_config(ref):
    from sdxl.config import config_from_dict
    from sdxl.models.unet import UNetConfig

    return config_from_dict(UNetConfig, dict(ref.unet.config))


def peft_file(path, ref, *, seed: int, alpha: float | None = None, old_names: bool = False):
    """A diffusers / PEFT LoRA (`unet.<module>.lora_A.weight`); with `alpha`, PEFT's config in the
    metadata as diffusers' `save_lora_weights` stores it. `old_names`: the attention-processor names
    of older diffusers (`attn1.processor.to_q_lora.down.weight`), for attention projections only."""
    rng, tensors, metadata = np.random.default_rng(seed), {}, {}
    rank = 4
    for component, modules in layers(ref).items():
        for module, shape in modules:
            down, up = factors(rng, shape, rank)
            if old_names:
                parent, _, projection = module.removesuffix(".0").rpartition(".")
                old = {"to_q": "to_q", "to_k": "to_k", "to_v": "to_v", "to_out": "to_out",
                       "q_proj": "to_q", "k_proj": "to_k", "v_proj": "to_v", "out_proj": "to_out"}
                if projection not in old or module.endswith(".0") != (projection == "to_out"):
                    continue
                processor = ".processor" if component == "unet" else ""
                key = f"{component}.{parent}{processor}.{old[projection]}_lora"
                tensors |= {f"{key}.down.weight": down, f"{key}.up.weight": up}
            else:
                key = f"{component}.{module}"
                tensors |= {f"{key}.lora_A.weight": down, f"{key}.lora_B.weight": up}
        if alpha is not None:
            metadata |= {f"{component}.r": rank, f"{component}.lora_alpha": alpha,
                         f"{component}.target_modules": sorted({m for m, _ in modules})}
    extra = {"lora_adapter_metadata": json.dumps(metadata)} if metadata else None
    safetensors.numpy.save_file(tensors, path, metadata=extra)
    return path


def images(pipe_or_ref, latents, loras: dict):
    if isinstance(pipe_or_ref, Pipeline):
        pipe_or_ref.set_loras({str(k): v for k, v in loras.items()})
        return pipe_or_ref.generate(PROMPTS, NEGATIVES, steps=3, guidance_scale=5.0, height=HEIGHT, width=WIDTH,
                                    latents=latents, sampler="euler", output_type="np")
    ref = pipe_or_ref
    names = []
    for i, path in enumerate(loras):
        ref.load_lora_weights(str(path), adapter_name=f"lora{i}")
        names.append(f"lora{i}")
    try:
        if names:
            ref.set_adapters(names, adapter_weights=list(loras.values()))
        return diffusers_images(ref, None, prompt=PROMPTS, negative_prompt=NEGATIVES, num_inference_steps=3,
                                guidance_scale=5.0, height=HEIGHT, width=WIDTH, latents=torch.from_numpy(latents))
    finally:
        if names:
            ref.unload_lora_weights()


def assert_matches_diffusers(model, loras: dict):
    ref, pipe = model
    latents = random_latents(2, HEIGHT, WIDTH, seed=1)
    expected, base = images(ref, latents, loras), images(ref, latents, {})
    got = images(pipe, latents, loras)
    diff = np.abs(got - expected).max()
    print(f"LoRA {[p.name for p in loras]}: max abs diff vs diffusers {diff:.2e}")
    assert np.abs(expected - base).mean() > 0.01, "the LoRA should change the picture"
    assert diff <= 1e-4


@pytest.mark.oracle
@pytest.mark.parametrize("sgm", [True, False], ids=["sgm-names", "diffusers-names"])
def test_kohya_sdxl_lora_matches_diffusers(sdxl, sgm, tmp_path):
    path = kohya_file(tmp_path / "kohya.safetensors", sdxl[0], sgm=sgm, seed=1)
    assert_matches_diffusers(sdxl, {path: 0.8})


def test_sd_scripts_text_encoder_names_load_as_transformers_5_names(sdxl, tmp_path):
    _, pipe = sdxl
    full = kohya_file(tmp_path / "full.safetensors", sdxl[0], sgm=True, seed=1, text_model=True)
    short = kohya_file(tmp_path / "short.safetensors", sdxl[0], sgm=True, seed=1)
    assert any(k.startswith("lora_te2_text_model_encoder_") for k in safetensors.numpy.load_file(full))
    read = [lora.read(path, pipe.spec) for path in (full, short)]
    assert [(x.component, x.module) for x in read[0].layers] == [(x.component, x.module) for x in read[1].layers]
    assert {layer.component for layer in read[0].layers} == set(COMPONENTS)


@pytest.mark.oracle
def test_kohya_sd1_lora_matches_diffusers(sd1, tmp_path):
    path = kohya_file(tmp_path / "kohya.safetensors", sd1[0], sgm=False, seed=2, te1_prefix="lora_te_")
    assert_matches_diffusers(sd1, {path: 0.8})


@pytest.mark.oracle
@pytest.mark.parametrize("alpha", [None, 8.0], ids=["no-alpha", "alpha-in-metadata"])
def test_peft_lora_matches_diffusers(sdxl, alpha, tmp_path):
    path = peft_file(tmp_path / "peft.safetensors", sdxl[0], seed=3, alpha=alpha)
    assert_matches_diffusers(sdxl, {path: 0.6})


@pytest.mark.oracle
def test_old_attention_processor_lora_matches_diffusers(sdxl, tmp_path):
    path = peft_file(tmp_path / "old.safetensors", sdxl[0], seed=4, old_names=True)
    assert_matches_diffusers(sdxl, {path: 1.0})


@pytest.mark.oracle
def test_two_loras_with_their_own_scales_match_diffusers(sdxl, tmp_path):
    kohya = kohya_file(tmp_path / "kohya.safetensors", sdxl[0], sgm=True, seed=5)
    peft = peft_file(tmp_path / "peft.safetensors", sdxl[0], seed=6)
    assert_matches_diffusers(sdxl, {kohya: 0.5, peft: -0.7})


def test_switching_loras_never_recompiles_and_clearing_restores_the_weights(sdxl, tmp_path):
    _, pipe = sdxl
    pipe.set_loras({})
    first = kohya_file(tmp_path / "a.safetensors", sdxl[0], sgm=True, seed=7)
    second = peft_file(tmp_path / "b.safetensors", sdxl[0], seed=8)
    latents = random_latents(2, HEIGHT, WIDTH, seed=1)
    base = images(pipe, latents, {})
    with_first = images(pipe, latents, {first: 1.0})
    compiles = CompileCounter()
    for loras in ({first: 0.3, second: 1.0}, {first: 1.0}, {second: -0.5}):
        pipe.set_loras({str(k): v for k, v in loras.items()})
        with compiles:
            images(pipe, latents, loras)
    assert pipe.set_loras({str(second): -0.5}) == 0.0  # already active
    cleared = images(pipe, latents, {})
    assert compiles.count == 0
    assert np.abs(with_first - base).mean() > 0.01
    np.testing.assert_array_equal(cleared, base)
    for a, b in zip(flatten(pipe.params_with(())).values(), flatten(pipe.params).values(), strict=True):
        assert a is b


def test_unknown_keys_are_named_and_nothing_changes(sdxl, tmp_path):
    _, pipe = sdxl
    pipe.set_loras({})
    good = kohya_file(tmp_path / "good.safetensors", sdxl[0], sgm=True, seed=9)
    tensors = safetensors.numpy.load_file(good)
    tensors["lora_unet_input_blocks_99_1_proj_in.lora_down.weight"] = np.zeros((2, 8), np.float32)
    tensors["lora_unet_some_layer.hada_w1_a"] = np.zeros((2, 8), np.float32)
    safetensors.numpy.save_file(tensors, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError, match="2 key.*input_blocks_99.*hada_w1_a"):
        pipe.set_loras({str(tmp_path / "bad.safetensors"): 1.0})
    assert pipe.loras == {} and pipe.params_with(()) is pipe.params

    down = "lora_unet_input_blocks_3_1_proj_in.lora_down.weight"
    tensors = safetensors.numpy.load_file(good)
    tensors[down] = np.zeros((2, 7), np.float32)
    safetensors.numpy.save_file(tensors, tmp_path / "misshaped.safetensors")
    with pytest.raises(CheckpointError, match="do not fit the layer"):
        pipe.set_loras({str(tmp_path / "misshaped.safetensors"): 1.0})
    with pytest.raises(CheckpointError, match="no such file"):
        pipe.set_loras({str(tmp_path / "missing.safetensors"): 1.0})


def test_a_layer_of_a_component_the_model_lacks_is_named(sd1, tmp_path):
    _, pipe = sd1  # SD 1.x: no text_encoder_2
    key = "text_encoder_2.text_model.encoder.layers.0.mlp.fc1"
    tensors = {f"{key}.lora_A.weight": np.zeros((2, 32), np.float32),
               f"{key}.lora_B.weight": np.zeros((37, 2), np.float32)}
    safetensors.numpy.save_file(tensors, tmp_path / "sdxl-only.safetensors")
    with pytest.raises(CheckpointError, match=f"2 key.*match no layer of the model: {key}.lora_A"):
        lora.read(tmp_path / "sdxl-only.safetensors", pipe.spec)


def test_kohya_names_cover_every_layer_in_both_layouts(sdxl):
    _, pipe = sdxl
    table = lora.kohya_names(pipe.spec)
    modules = {(c, m) for c, ms in lora.targets(pipe.spec).items() for m in ms}
    assert set(table.values()) == modules
    # The tiny UNet has one resnet per block: input blocks 1 and 2 are level 0's resnet and downsampler.
    assert table["lora_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q"] == (
        "unet", "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q")
    assert table["lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"] == (
        "unet", "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q")
    assert table["lora_te2_text_model_encoder_layers_0_mlp_fc1"] == (
        "text_encoder_2", "text_model.encoder.layers.0.mlp.fc1")


def test_loras_as_users_hold_them_a_hub_repo_and_a_half_precision_kohya_file(sdxl, tmp_path, monkeypatch):
    """A diffusers LoRA repo (its pytorch_lora_weights.safetensors) through huggingface_hub, online
    then offline from the cache; and a kohya file as sd-scripts saves it, float16 with float16 alphas."""
    from fake_hub import FakeHub, hub_at

    _, pipe = sdxl
    pipe.set_loras({})
    peft = peft_file(tmp_path / "peft.safetensors", sdxl[0], seed=10)
    with FakeHub({"someone/style-lora": {"pytorch_lora_weights.safetensors": peft.read_bytes()}}) as fake:
        with hub_at(fake, tmp_path / "hf", monkeypatch):
            online = lora.read(lora.locate("someone/style-lora"), pipe.spec)
        assert fake.downloaded("someone/style-lora") == ["pytorch_lora_weights.safetensors"]
        with hub_at(fake, tmp_path / "hf", monkeypatch, offline=True):
            offline = lora.read(lora.locate("someone/style-lora"), pipe.spec)
    local = lora.read(peft, pipe.spec)
    for got in (online, offline):
        assert [(x.module, x.factor) for x in got.layers] == [(x.module, x.factor) for x in local.layers]
        assert all(np.array_equal(a.up, b.up) for a, b in zip(got.layers, local.layers))

    kohya = kohya_file(tmp_path / "kohya.safetensors", sdxl[0], sgm=True, seed=11)
    half = {k: v.astype(np.float16) for k, v in safetensors.numpy.load_file(kohya).items()}
    safetensors.numpy.save_file(half, tmp_path / "kohya-fp16.safetensors")
    read_half = lora.read(tmp_path / "kohya-fp16.safetensors", pipe.spec)
    assert {x.factor for x in read_half.layers} == {3.0 / 2, 3.0 / 4}  # alpha 3 over ranks 2 and 4
    assert all(x.down.dtype == np.float32 for x in read_half.layers)


def test_lora_short_hash_is_sha256_of_the_data_after_the_header(tmp_path):
    path = tmp_path / "foxy.safetensors"
    safetensors.numpy.save_file({"a.lora_down.weight": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(path),
                                metadata={"ss_output_name": "foxy"})
    data = path.read_bytes()
    header_length = int.from_bytes(data[:8], "little")
    expected = hashlib.sha256(data[8 + header_length:]).hexdigest()[:12]
    assert lora.short_hash(path) == expected
    assert expected != hashlib.sha256(data).hexdigest()[:12]
    # Metadata does not change it: only the tensors' bytes count.
    other = tmp_path / "renamed.safetensors"
    safetensors.numpy.save_file({"a.lora_down.weight": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(other),
                                metadata={"ss_output_name": "something else", "note": "x" * 100})
    assert lora.short_hash(other) == expected


def test_lora_short_hash_prefers_the_recorded_one_and_hashes_other_files_whole(tmp_path):
    path = tmp_path / "recorded.safetensors"
    safetensors.numpy.save_file({"w": np.ones(3, np.float32)}, str(path),
                                metadata={"sshs_model_hash": "0123456789abcdef0123"})
    assert lora.short_hash(path) == "0123456789ab"
    pt = tmp_path / "old.pt"
    pt.write_bytes(b"not a safetensors file")
    assert lora.short_hash(pt) == hashlib.sha256(b"not a safetensors file").hexdigest()[:12]
