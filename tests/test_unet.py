"""Parity of sdxl.models.unet with diffusers' UNet2DConditionModel, on tiny random models saved to disk."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from diffusers import UNet2DConditionModel as TorchUNet

from sdxl.checkpoints import BUILTIN_CONFIGS
from sdxl.checkpoints.weights import flatten, load_params
from sdxl.config import KERNEL_VARIABLES, config_from_dict, config_from_file, read_json
from sdxl.models.unet import UNet2DConditionModel, UNetConfig, abstract_params

POOLED_DIM = 16
TIME_EMBED_DIM = 8
NUM_TIME_IDS = 6

SDXL_STYLE = dict(
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(32, 64, 64),
    layers_per_block=2,
    norm_num_groups=8,
    # Different per level, so that reading them in the wrong order breaks the checkpoint's shapes.
    transformer_layers_per_block=(1, 1, 2),
    attention_head_dim=(2, 4, 2),  # heads per level: 16-, 16- and 32-wide heads
    use_linear_projection=True,
    cross_attention_dim=32,
    addition_embed_type="text_time",
    addition_time_embed_dim=TIME_EMBED_DIM,
    projection_class_embeddings_input_dim=POOLED_DIM + NUM_TIME_IDS * TIME_EMBED_DIM,
    sample_size=16,
)

SD1_STYLE = dict(
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(32, 48, 64),
    layers_per_block=1,
    norm_num_groups=8,
    attention_head_dim=4,
    use_linear_projection=False,
    cross_attention_dim=24,
    sample_size=16,
    # Not SD's values: they take the other branch of each option.
    flip_sin_to_cos=False,
    freq_shift=1,
    downsample_padding=0,
    mid_block_scale_factor=1.5,
)

SDXL_BASE_CONFIG = read_json(BUILTIN_CONFIGS / "sdxl-base-1.0" / "unet" / "config.json")


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-initialises every weight so that activations and outputs are O(1).

    diffusers' default init leaves outputs too small for an absolute tolerance to mean much.
    """
    generator = torch.Generator().manual_seed(seed)

    def normal(shape):
        return torch.randn(shape, generator=generator)

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.GroupNorm, torch.nn.LayerNorm)):
                module.weight.copy_(1 + 0.1 * normal(module.weight.shape))
                module.bias.copy_(0.1 * normal(module.bias.shape))
            elif isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                fan_in = module.weight[0].numel()
                module.weight.copy_(normal(module.weight.shape) / fan_in**0.5)
                if module.bias is not None:
                    module.bias.copy_(0.1 * normal(module.bias.shape))


def save_reference(config: dict, path, seed: int) -> TorchUNet:
    torch.manual_seed(seed)
    model = TorchUNet(**config).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    return model


def inputs(rng, config: dict, height: int, width: int, with_text_time: bool) -> dict:
    batch = 2
    values = dict(
        sample=rng.standard_normal((batch, height, width, config.get("in_channels", 4)), dtype=np.float32),
        timesteps=np.array([999.0, 37.5], np.float32),
        encoder_hidden_states=rng.standard_normal((batch, 7, config["cross_attention_dim"]), dtype=np.float32),
    )
    if with_text_time:
        values["text_embeds"] = rng.standard_normal((batch, POOLED_DIM), dtype=np.float32)
        # original size, crop top-left, target size (in pixels)
        values["time_ids"] = np.array([[1024, 1024, 0, 0, 1024, 1024], [768, 1344, 16, 32, 832, 1216]], np.float32)
    return values


def torch_forward(model: TorchUNet, values: dict) -> np.ndarray:
    added = {k: torch.from_numpy(values[k]) for k in ("text_embeds", "time_ids") if k in values}
    with torch.no_grad():
        out = model(
            torch.from_numpy(values["sample"]).permute(0, 3, 1, 2),
            torch.from_numpy(values["timesteps"]),
            torch.from_numpy(values["encoder_hidden_states"]),
            added_cond_kwargs=added or None,
        ).sample
    return out.permute(0, 2, 3, 1).numpy()


def load_jax(path, dtype):
    config = config_from_file(UNetConfig, path / "config.json")
    params = load_params([path / "diffusion_pytorch_model.safetensors"], abstract_params(config), dtype=dtype)
    return config, params


def jax_forward(config: UNetConfig, params: dict, values: dict, dtype=jnp.float32) -> np.ndarray:
    kernels = tuple(os.environ.get(variable, "") for variable in KERNEL_VARIABLES)
    return np.asarray(_jitted_forward(config, dtype, kernels)(params, values).astype(jnp.float32))


@functools.cache
def _jitted_forward(config: UNetConfig, dtype, kernels: tuple[str, ...]):
    """The UNet's forward jitted, with the timesteps as an argument (they must work traced): one function per
    model and choice of kernels (read where it is traced), so that tests that run the same computation
    compile it once."""
    return jax.jit(lambda p, v: UNet2DConditionModel(config, dtype).apply({"params": p}, **v))


@pytest.fixture(scope="module")
def sdxl_style(tmp_path_factory):
    path = tmp_path_factory.mktemp("sdxl_style_unet")
    model = save_reference(SDXL_STYLE, path, seed=0)
    values = inputs(np.random.default_rng(0), SDXL_STYLE, 16, 24, with_text_time=True)
    return path, values, torch_forward(model, values)


@pytest.mark.oracle
def test_sdxl_style_matches_diffusers(sdxl_style):
    path, values, expected = sdxl_style
    config, params = load_jax(path, np.float32)
    assert config.num_heads == (2, 4, 2) and config.transformer_layers == (1, 1, 2)
    out = jax_forward(config, params, values)
    diff = np.abs(out - expected).max()
    print(f"SDXL-style UNet: max abs diff {diff:.2e}, output std {expected.std():.3f}")
    assert out.shape == (2, 16, 24, 4)
    assert expected.std() > 0.1
    assert diff <= 1e-4


@pytest.mark.oracle
@pytest.mark.parametrize("attention", ["xla", "splash"])
def test_text_lengths_match_diffusers_encoder_attention_mask(sdxl_style, monkeypatch, attention):
    """Each image attends to its own number of text tokens, as diffusers' `encoder_attention_mask`
    (keep the first 3 of 7 for one image, all for the other); the padding's values do not matter."""
    path, values, _ = sdxl_style
    monkeypatch.setenv("SDXL_ATTENTION", attention)
    mask = np.array([[1, 1, 1, 0, 0, 0, 0], [1] * 7], np.float32)
    model = TorchUNet.from_pretrained(path).eval()
    with torch.no_grad():
        expected = model(
            torch.from_numpy(values["sample"]).permute(0, 3, 1, 2), torch.from_numpy(values["timesteps"]),
            torch.from_numpy(values["encoder_hidden_states"]), encoder_attention_mask=torch.from_numpy(mask),
            added_cond_kwargs={k: torch.from_numpy(values[k]) for k in ("text_embeds", "time_ids")},
        ).sample.permute(0, 2, 3, 1).numpy()
    config, params = load_jax(path, np.float32)
    padded = values["encoder_hidden_states"].copy()
    padded[0, 3:] = 1e3  # ignored
    lengths = mask.sum(axis=1).astype(np.int32)
    out = jax_forward(config, params, values | dict(encoder_hidden_states=padded, encoder_lengths=lengths))
    assert np.abs(out - expected).max() <= 1e-4
    unmasked = jax_forward(config, params, values)
    assert np.abs(out[0] - unmasked[0]).max() > 1e-2 and np.abs(out[1] - unmasked[1]).max() <= 1e-5


@pytest.mark.oracle
@pytest.mark.parametrize(
    "variable, kernel",
    [
        ("SDXL_ATTENTION", "splash"),  # the TPU kernel, in Pallas' interpreter here, in every attention layer
        ("SDXL_CONV", "winograd"),  # the CPU's Winograd convolutions in every 3x3 layer, not only the wide ones
        ("SDXL_GROUP_NORM", "shifted"),  # every GroupNorm's statistics from one read of its input
    ],
)
def test_other_kernels_match_diffusers(sdxl_style, monkeypatch, variable, kernel):
    path, values, expected = sdxl_style
    monkeypatch.setenv(variable, kernel)
    config, params = load_jax(path, np.float32)
    out = jax_forward(config, params, values)
    assert np.abs(out - expected).max() <= 1e-4


@pytest.mark.oracle
def test_sd1_style_odd_latent_matches_diffusers(tmp_path, rng):
    model = save_reference(SD1_STYLE, tmp_path, seed=1)
    # 18x22 -> 9x11 -> 4x5 on the way down, so the up blocks resize to the skips' sizes, not 2x.
    values = inputs(rng, SD1_STYLE, 18, 22, with_text_time=False)
    expected = torch_forward(model, values)
    config, params = load_jax(tmp_path, np.float32)
    out = jax_forward(config, params, values)
    diff = np.abs(out - expected).max()
    print(f"SD1-style UNet, odd latent: max abs diff {diff:.2e}, output std {expected.std():.3f}")
    assert out.shape == (2, 18, 22, 4)
    assert expected.std() > 0.1
    assert diff <= 1e-4


@pytest.mark.compiles
def test_bfloat16_close_to_float32(sdxl_style):
    path, values, expected = sdxl_style
    config, params = load_jax(path, ml_dtypes.bfloat16)
    assert all(p.dtype == ml_dtypes.bfloat16 for p in flatten(params).values())
    out = jax_forward(config, params, values, dtype=jnp.bfloat16)
    # bf16 keeps 8 significant bits (relative rounding 2**-9 ~ 2e-3 per op), and the errors of the
    # ~50 layers between input and output add up: diffusers' own bf16 run of this model is off its
    # fp32 output by about 1.5% RMS and 6% at worst (relative to the output std); so is ours.
    # 5% RMS / 25% worst leave headroom while still catching a layer that computes wrongly in bf16.
    rms = np.sqrt(np.mean((out - expected) ** 2)) / expected.std()
    worst = np.abs(out - expected).max() / expected.std()
    print(f"bf16 UNet: RMS error {rms:.2e}, max abs error {worst:.2e} (relative to the output std)")
    assert np.isfinite(out).all()
    assert rms < 5e-2
    assert worst < 0.25


@pytest.mark.compiles
def test_sdxl_base_parameter_count():
    config = config_from_dict(UNetConfig, SDXL_BASE_CONFIG)
    assert config.num_heads == (5, 10, 20)
    shapes = abstract_params(config)
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))
    assert count == 2_567_463_684
    assert shapes["down_blocks.2"]["attentions.1"]["transformer_blocks.9"]["attn2"]["to_k"]["weight"].shape == (
        1280,
        2048,
    )


@pytest.mark.parametrize(
    "change",
    [
        dict(num_attention_heads=8),
        dict(only_cross_attention=True),
        dict(addition_embed_type="text"),
        dict(class_embed_type="timestep"),
        dict(down_block_types=("DownBlock2D", "AttnDownBlock2D", "CrossAttnDownBlock2D")),
        dict(transformer_layers_per_block=(1, 2)),
        dict(attention_head_dim=(5, 10, 7)),
    ],
)
def test_unsupported_config_raises(change):
    config = config_from_dict(UNetConfig, SDXL_BASE_CONFIG)
    with pytest.raises(ValueError):
        dataclasses.replace(config, **change)


def _attn2_paths(params: dict) -> dict[str, tuple[str, ...]]:
    """Each cross-attention layer's parameter path, by diffusers' module name."""
    return {".".join(path[:-2]): path[:-2] for path in flatten(params) if path[-3:] == ("attn2", "to_k", "weight")}


@pytest.mark.oracle
def test_image_prompts_attend_as_diffusers_ip_adapter_processors(sdxl_style, rng):
    """Two IP-Adapters' tokens through diffusers' IPAdapterAttnProcessor2_0, with scales that differ per
    layer and per image: each image as diffusers renders it with that image's scales."""
    from diffusers.models.attention_processor import AttnProcessor2_0, IPAdapterAttnProcessor2_0

    from sdxl.checkpoints.weights import unflatten
    from sdxl.models.layers import ImagePromptTokens
    from sdxl.models.unet import attention_layers

    path, values, _ = sdxl_style
    model = TorchUNet.from_pretrained(path).eval()
    config, params = load_jax(path, np.float32)
    layers = attention_layers(config)
    assert layers == ("down_blocks.1.attentions.0", "down_blocks.1.attentions.1", "down_blocks.2.attentions.0",
                      "down_blocks.2.attentions.1", "mid_block.attentions.0", "up_blocks.0.attentions.0",
                      "up_blocks.0.attentions.1", "up_blocks.0.attentions.2", "up_blocks.1.attentions.0",
                      "up_blocks.1.attentions.1", "up_blocks.1.attentions.2")
    tokens = (4, 2)
    cross = SDXL_STYLE["cross_attention_dim"]
    states = [rng.standard_normal((2, n, cross), dtype=np.float32) for n in tokens]
    # Per image, per adapter, per layer: some layers off, the two images' scales unlike.
    scales = rng.uniform(0.2, 1.5, (2, len(tokens), len(layers))).astype(np.float32)
    scales[:, 1, ::3] = 0.0
    flat = flatten(params)
    processors = {}
    for name in model.attn_processors:
        if not name.endswith("attn2.processor"):
            processors[name] = AttnProcessor2_0()
            continue
        hidden = model.get_submodule(name.removesuffix(".processor")).to_q.out_features
        ip = IPAdapterAttnProcessor2_0(hidden, cross, tokens)
        for a in range(len(tokens)):
            for kind in ("to_k_ip", "to_v_ip"):
                weight = torch.randn(hidden, cross) / cross**0.5
                getattr(ip, kind)[a].weight.data.copy_(weight)
                flat[(*_attn2_paths(params)[name.removesuffix(".processor")], f"{kind}.{a}", "weight")] = weight.numpy()
        processors[name] = ip
    model.set_attn_processor(processors)

    expected = []
    for b in range(2):
        for name, processor in model.attn_processors.items():
            if name.endswith("attn2.processor"):
                layer = layers.index(name.split(".transformer_blocks")[0])
                processor.scale = [float(s) for s in scales[b, :, layer]]
        added = {k: torch.from_numpy(values[k]) for k in ("text_embeds", "time_ids")}
        with torch.no_grad():
            out = model(
                torch.from_numpy(values["sample"]).permute(0, 3, 1, 2), torch.from_numpy(values["timesteps"]),
                (torch.from_numpy(values["encoder_hidden_states"]), [torch.from_numpy(s) for s in states]),
                added_cond_kwargs=added,
            ).sample
        expected.append(out.permute(0, 2, 3, 1).numpy()[b])
    prompts = tuple(ImagePromptTokens(s, scales[:, a]) for a, s in enumerate(states))
    out = jax_forward(config, unflatten(flat), {**values, "image_prompts": prompts})
    without = jax_forward(config, params, values)
    diff = np.abs(out - np.stack(expected)).max()
    print(f"IP-Adapter attention: max abs diff {diff:.2e}, effect {np.abs(out - without).max():.2f}")
    assert np.abs(out - without).max() > 0.1
    assert diff <= 1e-4
