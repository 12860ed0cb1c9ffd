"""The published config folders shipped in sdxl/configs: readable, supported, and tokenizing as the
published checkpoints do, all offline."""

import jax
import numpy as np
import pytest

from sdxl.checkpoints import BUILTIN_CONFIGS, ModelSpec
from sdxl.checkpoints.tokenizer import load_tokenizer, tokenize
from sdxl.config import read_json

FOLDERS = ["sdxl-base-1.0", "sdxl-refiner-1.0", "sd-1.5", "sd-2.1", "sd-2.1-base"]

CLIP_L_TEXT = 123_060_480  # CLIP ViT-L/14's text tower
OPENCLIP_H_TEXT = 340_387_840  # OpenCLIP ViT-H/14's text tower less its last layer, as diffusers has it
SD_VAE = 83_653_863
# Parameter counts of the published checkpoints (diffusers' models built from these configs agree).
PARAMETERS = {
    "sdxl-base-1.0": {"unet": 2_567_463_684, "vae": SD_VAE, "text_encoder": CLIP_L_TEXT, "text_encoder_2": 694_659_840},
    # The refiner's UNet config is derived (sdxl/configs/README.md): 4.52 GB in float16, as published.
    "sdxl-refiner-1.0": {"unet": 2_259_526_660, "vae": SD_VAE, "text_encoder_2": 694_659_840},
    "sd-1.5": {"unet": 859_520_964, "vae": SD_VAE, "text_encoder": CLIP_L_TEXT},
    "sd-2.1": {"unet": 865_910_724, "vae": SD_VAE, "text_encoder": OPENCLIP_H_TEXT},
    "sd-2.1-base": {"unet": 865_910_724, "vae": SD_VAE, "text_encoder": OPENCLIP_H_TEXT},
}
# What each model's pipeline runs: (default sampler, prediction type, native size, VAE scaling factor).
FAMILY = {
    "sdxl-base-1.0": ("euler", "epsilon", 1024, 0.13025),
    "sdxl-refiner-1.0": ("euler", "epsilon", 1024, 0.13025),
    "sd-1.5": ("pndm", "epsilon", 512, 0.18215),
    "sd-2.1": ("ddim", "v_prediction", 768, 0.18215),
    "sd-2.1-base": ("pndm", "epsilon", 512, 0.18215),
}
# Pad token id of each tokenizer folder: CLIP's end token, or "!" (id 0) for the OpenCLIP encoders'.
PAD_IDS = {
    ("sdxl-base-1.0", "tokenizer"): 49407,
    ("sdxl-base-1.0", "tokenizer_2"): 0,
    ("sdxl-refiner-1.0", "tokenizer_2"): 0,
    ("sd-1.5", "tokenizer"): 49407,
    ("sd-2.1", "tokenizer"): 0,
    ("sd-2.1-base", "tokenizer"): 0,
}
A_PHOTO_OF_A_CAT = [49406, 320, 1125, 539, 320, 2368, 49407]


@pytest.mark.parametrize("name", FOLDERS)
def test_configs_load_and_give_the_published_parameter_counts(name):
    spec = ModelSpec.from_folder(BUILTIN_CONFIGS / name)
    counts = {part: sum(leaf.size for leaf in jax.tree.leaves(tree)) for part, tree in spec.abstract_params().items()}
    assert counts == PARAMETERS[name]
    sampler, prediction_type, native_size, scaling_factor = FAMILY[name]
    assert spec.default_sampler == sampler
    assert spec.scheduler.prediction_type == prediction_type
    assert spec.native_size == native_size
    assert spec.vae.scaling_factor == scaling_factor
    assert spec.is_sdxl == name.startswith("sdxl")
    assert spec.max_tokens == 77


def test_sd15_runs_without_a_safety_checker():
    index = read_json(BUILTIN_CONFIGS / "sd-1.5" / "model_index.json")
    assert index["safety_checker"] == [None, None] and index["feature_extractor"] == [None, None]
    assert index["requires_safety_checker"] is False


def test_every_tokenizer_folder_is_listed():
    found = {(p.parent.parent.name, p.parent.name) for p in BUILTIN_CONFIGS.glob("*/tokenizer*/vocab.json")}
    assert found == set(PAD_IDS)
    for name in FOLDERS:
        spec = ModelSpec.from_folder(BUILTIN_CONFIGS / name)
        assert {t for n, t in PAD_IDS if n == name} == set(spec.tokenizer_names)


@pytest.mark.parametrize(("name", "tokenizer_name"), sorted(PAD_IDS))
def test_tokenizers_give_clip_ids_and_pad_as_published(name, tokenizer_name):
    tokenizer = load_tokenizer(BUILTIN_CONFIGS / name / tokenizer_name)
    assert len(tokenizer) == 49408
    assert tokenizer("a photo of a cat").input_ids == A_PHOTO_OF_A_CAT
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (49406, 49407)
    pad = PAD_IDS[name, tokenizer_name]
    assert tokenizer.pad_token_id == pad
    ids, truncated = tokenize(tokenizer, ["a photo of a cat", "cat " * 100], 77)
    np.testing.assert_array_equal(ids[0], A_PHOTO_OF_A_CAT + [pad] * (77 - len(A_PHOTO_OF_A_CAT)))
    assert truncated == [False, True] and ids[1, 0] == 49406 and ids[1, -1] == 49407
    # Words from the learned merges, capitals, digits (one token each), punctuation and an accent: the
    # ids of OpenAI CLIP's own tokenizer (open_clip's SimpleTokenizer gives the same).
    assert tokenizer("Astronaut riding a horse, 1984; café").input_ids == [
        49406, 18376, 6765, 320, 4558, 267, 272, 280, 279, 275, 282, 15304, 49407
    ]
