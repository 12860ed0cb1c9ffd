"""Image prompts: IP-Adapter scales per layer as diffusers' `set_ip_adapter_scale` expands them, and
whole generations steered by tiny random IP-Adapters (plain and Plus, in h94's layout) against
diffusers' `load_ip_adapter` pipelines."""

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionXLPipeline
from diffusers import UNet2DConditionModel as TorchUNet
from diffusers.loaders.unet_loader_utils import _maybe_expand_lora_scales

from reference import diffusers_images, picture, sdxl_pipeline
from test_unet import SD1_STYLE, SDXL_STYLE
from sdxl.checkpoints.random_models import IP_ADAPTER_FILES, write_ip_adapter
from sdxl.config import config_from_dict
from sdxl.engine.compilation import CompileCounter
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.image_prompts import (
    STYLE_AND_LAYOUT, STYLE_ONLY, layer_scales, preset_named, preset_scale, presets_of,
)
from sdxl.models.unet import UNetConfig, attention_layers

SCALES = [
    0.7,
    {"down": 0.5},
    {"mid": [0.3]},
    {"up": {"block_1": 2.0}},
    {"down": {"block_1": 0.2}, "up": 1.0, "mid": 0.1},
]


@pytest.mark.parametrize("style", [SDXL_STYLE, SD1_STYLE], ids=["sdxl", "sd1"])
@pytest.mark.parametrize("scale", [*SCALES, STYLE_ONLY, STYLE_AND_LAYOUT, {"down": {"block_2": [0.4, 0.9]}}],
                         ids=lambda s: str(s))
def test_scales_expand_to_layers_as_diffusers_expands_them(style, scale):
    """A block without transformers, which diffusers passes over (and so scales nothing), we refuse."""
    config = config_from_dict(UNetConfig, style)
    layers = attention_layers(config)
    torch_unet = TorchUNet(**style)
    named = [(side, int(block.removeprefix("block_"))) for side, blocks in dict(scale if isinstance(scale, dict)
             else {}).items() if isinstance(blocks, dict) for block in blocks]
    if any(not hasattr(getattr(torch_unet, f"{side}_blocks")[i], "attentions") for side, i in named):
        with pytest.raises(ValueError, match="blocks with transformers are"):
            layer_scales(config, scale)
        return
    expected = _maybe_expand_lora_scales(torch_unet, [scale], default_scale=0.0)[0]
    if isinstance(expected, dict):
        assert set(expected) <= set(layers)
        expected = [expected.get(name, 0.0) for name in layers]
    np.testing.assert_allclose(layer_scales(config, scale), np.broadcast_to(expected, len(layers)))


@pytest.mark.parametrize("scale, message", [
    ({"up": {"block_2": 1.0}}, "up blocks with transformers are block_0, block_1, not block_2"),
    ({"down": {"block_1": [1.0, 0.5, 0.2]}}, "down.block_1 has 2 transformers"),
    ({"middle": 1.0}, "keyed by down, mid and up, not middle"),
    ({"mid": [1.0, 1.0]}, "the mid block has one transformer"),
    (2.5, "IP-Adapter scale must be"),
])
def test_a_scale_that_does_not_fit_is_refused_in_one_sentence(scale, message):
    with pytest.raises(ValueError, match=message):
        layer_scales(config_from_dict(UNetConfig, SDXL_STYLE), scale)


HEIGHT, WIDTH, STEPS = 64, 96, 4
PROMPTS = ["a red cube on a table", "a blue sphere floating over grass"]
NEGATIVES = ["blurry", "low quality, watermark"]


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """diffusers' tiny SDXL and ours from the same folder, and both adapters' files beside it."""
    folder = tmp_path_factory.mktemp("sdxl")
    ref = StableDiffusionXLPipeline(**sdxl_pipeline(folder).components)
    pipe = Pipeline.from_pretrained(folder, dtype="float32", max_steps=STEPS)
    write_ip_adapter(folder / "ip", pipe.spec.unet, kinds=("plain", "plus"))
    return folder / "ip", ref, pipe


def _noise(n: int, seed: int = 3) -> np.ndarray:
    return torch.randn((n, 4, HEIGHT // 8, WIDTH // 8), generator=torch.Generator().manual_seed(seed)).numpy()


def _pictures() -> list:
    return [picture(40, 52, seed=7), picture(90, 70, seed=8)]  # other sizes than the images: the encoder's own


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["plain", "plus"])
def test_generations_with_an_ip_adapter_match_diffusers(sdxl, kind):
    """One picture for every image, then no guidance, at a scale set per block; and one picture per
    prompt, where diffusers renders each prompt alone (its pipeline gives every prompt all pictures)."""
    folder, ref, pipe = sdxl
    weight_name = IP_ADAPTER_FILES[kind]
    ref.load_ip_adapter(str(folder), subfolder="sdxl_models", weight_name=weight_name)
    pipe.load_ip_adapter(str(folder), subfolder="sdxl_models", weight_name=weight_name)
    try:
        pictures, noise = _pictures(), _noise(2)

        def both(label, scale, guidance_scale=5.0, **kwargs):
            ref.set_ip_adapter_scale(scale)
            pipe.set_ip_adapter_scale(scale)
            expected = diffusers_images(ref, prompt=PROMPTS, negative_prompt=NEGATIVES, num_inference_steps=STEPS,
                                        guidance_scale=guidance_scale, height=HEIGHT, width=WIDTH,
                                        latents=torch.from_numpy(noise), **kwargs)
            got = pipe.generate(PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=guidance_scale, height=HEIGHT,
                                width=WIDTH, latents=noise, output_type="np", **kwargs)
            _compare(f"{kind}: {label}", got, expected)
            return got

        steered = both("one picture for all", 0.8, ip_adapter_image=pictures[0])
        with CompileCounter() as compiles:  # the scales are inputs: a sweep never recompiles
            swept = pipe.generate(PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=5.0, height=HEIGHT, width=WIDTH,
                                  latents=noise, output_type="np", ip_adapter_image=pictures[0],
                                  ip_adapter_scale=0.3)
        assert compiles.count == 0 and np.abs(swept - steered).mean() > 1e-3
        both("no guidance, scales per block", {"mid": 0.5, "up": {"block_0": [1.2, 0.0]}}, guidance_scale=1.0,
             ip_adapter_image=pictures[0])
        unsteered = pipe.generate(PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=5.0, height=HEIGHT, width=WIDTH,
                                  latents=noise, output_type="np")
        assert np.abs(steered - unsteered).mean() > 1e-2  # it steers

        ref.set_ip_adapter_scale(0.8)
        expected = np.concatenate([
            diffusers_images(ref, prompt=prompt, negative_prompt=negative, num_inference_steps=STEPS,
                             guidance_scale=5.0, height=HEIGHT, width=WIDTH, latents=torch.from_numpy(noise[i:i + 1]),
                             ip_adapter_image=pictures[i])
            for i, (prompt, negative) in enumerate(zip(PROMPTS, NEGATIVES))
        ])
        got = pipe.generate(PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=5.0, height=HEIGHT, width=WIDTH,
                            latents=noise, output_type="np", ip_adapter_image=pictures, ip_adapter_scale=0.8)
        _compare(f"{kind}: one picture per prompt", got, expected)
    finally:
        ref.unload_ip_adapter()
        pipe.unload_ip_adapter()


def _compare(label: str, got: np.ndarray, expected: np.ndarray, tolerance: float = 1e-4) -> None:
    diff = np.abs(got - expected).max()
    print(f"IP-Adapter {label}: max abs diff vs diffusers {diff:.2e}")
    assert got.shape == expected.shape and diff <= tolerance


def test_layer_presets_scale_instantstyles_blocks_and_are_named_back():
    sdxl, sd1 = (config_from_dict(UNetConfig, style) for style in (SDXL_STYLE, SD1_STYLE))
    assert preset_scale(sdxl, "all", 0.5) == 0.5
    style = preset_scale(sdxl, "style", 0.5)
    assert style == {"up": {"block_0": [0.0, 0.5, 0.0]}}
    np.testing.assert_array_equal(layer_scales(sdxl, style), layer_scales(sdxl, STYLE_ONLY) * 0.5)
    assert preset_named(style) == ("style", 0.5) and preset_named(0.7) == ("all", 0.7)
    assert preset_named(preset_scale(sdxl, "style-and-layout", 1.5)) == ("style-and-layout", 1.5)
    assert preset_named({"up": {"block_0": [0.0, 1.0, 0.5]}}) is None, "blocks of no preset"
    assert presets_of(sdxl) == ["all", "style", "style-and-layout"] and presets_of(sd1) == ["all"]
    with pytest.raises(ValueError, match="the style preset scales SDXL's blocks"):
        preset_scale(sd1, "style", 1.0)
    with pytest.raises(ValueError, match="the IP-Adapter layers are one of all, style, style-and-layout"):
        preset_scale(sdxl, "faces", 1.0)
