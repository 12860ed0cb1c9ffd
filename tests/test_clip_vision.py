"""Parity of sdxl.models.clip_vision with transformers' CLIPVisionModelWithProjection."""

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from test_clip import assert_close
from sdxl.checkpoints.weights import load_params
from sdxl.config import config_from_dict, config_from_file
from sdxl.models import clip_vision

IMAGE_SIZE = 28
VISION_TOLERANCE = 1e-5  # the vision tower matches transformers tighter than the text tower's 1e-4


def save_reference(path, *, hidden_act):
    """Saves a small random transformers CLIP vision model to `path` and returns it."""
    config = transformers.CLIPVisionConfig(
        hidden_size=48,
        intermediate_size=96,
        projection_dim=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=7,
        hidden_act=hidden_act,
    )
    torch.manual_seed(0)
    model = transformers.CLIPVisionModelWithProjection(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 and "class_embedding" not in name:
                # Norm scales/biases start at 1/0, which would hide a swapped mapping.
                param.add_(0.3 * torch.randn_like(param))
            elif param.ndim == 1 or "position_embedding" in name:
                param.normal_(0.0, 1.0)  # CLIP's init would leave the residual stream near zero
            else:
                param.normal_(0.0, param[0].numel() ** -0.5)
    model.save_pretrained(path)
    return model


def load(path, config):
    return load_params(
        sorted(path.glob("*.safetensors")),
        clip_vision.abstract_params(config),
        dtype=np.float32,
        rename=clip_vision.rename_key,
        ignore=clip_vision.IGNORED_KEYS,
    )


def check_parity(path, reference, rng):
    config = config_from_file(clip_vision.CLIPVisionConfig, path / "config.json")
    pixels = rng.standard_normal((2, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    ours = clip_vision.CLIPVisionModelWithProjection(config).apply({"params": load(path, config)}, pixels)
    with torch.no_grad():
        theirs = reference(torch.from_numpy(pixels).permute(0, 3, 1, 2), output_hidden_states=True)
    assert len(ours.hidden_states) == len(theirs.hidden_states) == config.num_hidden_layers + 1
    for i, (a, b) in enumerate(zip(ours.hidden_states, theirs.hidden_states)):
        assert_close(f"hidden_states[{i}]", a, b, VISION_TOLERANCE)
    assert_close("last_hidden_state", ours.last_hidden_state, theirs.last_hidden_state, VISION_TOLERANCE)
    assert_close("image_embeds", ours.image_embeds, theirs.image_embeds, VISION_TOLERANCE)


@pytest.mark.oracle
@pytest.mark.parametrize("hidden_act", ["gelu", "quick_gelu"])  # h94's encoders use gelu; OpenAI's quick_gelu
def test_parity(tmp_path, rng, hidden_act):
    check_parity(tmp_path, save_reference(tmp_path, hidden_act=hidden_act), rng)


@pytest.mark.oracle
def test_legacy_checkpoint_layout(tmp_path, rng):
    """Checkpoints of older transformers versions store the position_ids buffer."""
    reference = save_reference(tmp_path, hidden_act="gelu")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    assert set(clip_vision.BARE_TENSORS) <= set(tensors)
    tensors["vision_model.embeddings.position_ids"] = np.arange(17, dtype=np.int64)[None]
    save_file(tensors, file)
    check_parity(tmp_path, reference, rng)


@pytest.mark.parametrize(
    "values",
    [
        {"hidden_act": "gelu_new"},
        {"architectures": ["CLIPVisionModel"]},
        {"image_size": 30, "patch_size": 7},
        {"hidden_size": 30, "num_attention_heads": 4},
    ],
)
def test_unsupported_config(values):
    with pytest.raises(ValueError):
        config_from_dict(clip_vision.CLIPVisionConfig, values)
