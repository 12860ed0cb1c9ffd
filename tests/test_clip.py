"""Parity of sdxl.models.clip with transformers' CLIPTextModel / CLIPTextModelWithProjection."""

import math

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from sdxl.checkpoints import BUILTIN_CONFIGS
from sdxl.checkpoints.weights import load_params
from sdxl.config import config_from_dict, config_from_file, read_json
from sdxl.models import clip

VOCAB = 1000
LENGTH = 77

SDXL_BASE = BUILTIN_CONFIGS / "sdxl-base-1.0"
SDXL_TEXT_ENCODER = read_json(SDXL_BASE / "text_encoder" / "config.json")
SDXL_TEXT_ENCODER_2 = read_json(SDXL_BASE / "text_encoder_2" / "config.json")


def save_reference(path, *, hidden_act, eos_token_id, with_projection):
    """Saves a small random transformers CLIP text model to `path` and returns it."""
    config = transformers.CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        projection_dim=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=LENGTH,
        hidden_act=hidden_act,
        bos_token_id=1,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    cls = transformers.CLIPTextModelWithProjection if with_projection else transformers.CLIPTextModel
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                # Norm scales/biases and biases start at 1/0, which would hide a swapped mapping.
                param.add_(0.3 * torch.randn_like(param))
            elif "embedding" in name:
                # CLIP's 0.02 init would leave the residual stream near zero.
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, param.shape[1] ** -0.5)
    model.save_pretrained(path)
    return model


def token_ids(rng, eos_token_id):
    """Two sequences where pooling at argmax(ids) and at the first eos give different positions.

    Row 0 is padded with eos (as SDXL's first tokenizer does), row 1 with 0 (as the second does).
    """
    ids = rng.integers(3, VOCAB - 1, size=(2, LENGTH))
    ids[ids == eos_token_id] = 3
    for row, (end, pad) in enumerate([(20, eos_token_id), (50, 0)]):
        ids[row, 0] = 1
        ids[row, end] = eos_token_id
        ids[row, end + 1 :] = pad
        if eos_token_id == 2:
            ids[row, end] = VOCAB - 1  # the legacy pooling position: the largest id ...
            ids[row, 5] = eos_token_id  # ... while the configured eos appears earlier
    argmax = ids.argmax(-1)
    first_eos = (ids == eos_token_id).argmax(-1)
    assert (argmax != first_eos).all()
    return ids


def load(path, config, **kwargs):
    return load_params(
        sorted(path.glob("*.safetensors")),
        clip.abstract_params(config),
        dtype=np.float32,
        rename=clip.rename_key,
        ignore=clip.IGNORED_KEYS,
        **kwargs,
    )


def assert_close(name, ours, theirs, tolerance=1e-4):
    """Ours within `tolerance` of transformers' output, which must not be near zero everywhere."""
    ours, theirs = np.asarray(ours), theirs.detach().numpy()
    assert ours.shape == theirs.shape, name
    diff = np.abs(ours - theirs).max()
    print(f"{name}: max abs diff {diff:.2e} (reference std {theirs.std():.2f})")
    assert theirs.std() > 0.1, name
    assert diff <= tolerance, name


def check_parity(path, reference, config, ids):
    params = load(path, config)
    ours = clip.CLIPTextModel(config).apply({"params": params}, ids)
    with torch.no_grad():
        theirs = reference(torch.from_numpy(ids), output_hidden_states=True)

    assert len(ours.hidden_states) == len(theirs.hidden_states) == config.num_hidden_layers + 1
    for i, (a, b) in enumerate(zip(ours.hidden_states, theirs.hidden_states)):
        assert_close(f"hidden_states[{i}]", a, b)
    assert_close("last_hidden_state", ours.last_hidden_state, theirs.last_hidden_state)
    if config.with_projection:
        # CLIPTextModelWithProjection returns no pooler_output: compare with its text_model's.
        with torch.no_grad():
            pooled = reference.text_model(torch.from_numpy(ids)).pooler_output
        assert_close("pooler_output", ours.pooler_output, pooled)
        assert_close("text_embeds", ours.text_embeds, theirs.text_embeds)
    else:
        assert_close("pooler_output", ours.pooler_output, theirs.pooler_output)
        assert ours.text_embeds is None


@pytest.mark.compiles
@pytest.mark.parametrize(
    "hidden_act, eos_token_id, with_projection",
    [
        ("quick_gelu", 2, False),  # SDXL text_encoder-like
        ("gelu", 2, True),  # SDXL text_encoder_2-like
        ("quick_gelu", 500, True),
        ("gelu", 500, False),
    ],
)
def test_parity(tmp_path, rng, hidden_act, eos_token_id, with_projection):
    reference = save_reference(
        tmp_path, hidden_act=hidden_act, eos_token_id=eos_token_id, with_projection=with_projection
    )
    config = config_from_file(clip.CLIPTextConfig, tmp_path / "config.json")
    assert config.with_projection == with_projection
    assert (config.hidden_act, config.eos_token_id) == (hidden_act, eos_token_id)
    check_parity(tmp_path, reference, config, token_ids(rng, eos_token_id))


def test_saved_key_prefixes(tmp_path):
    """transformers 5 writes CLIPTextModel without the `text_model.` prefix, the projection model with it."""
    for name, with_projection in [("plain", False), ("projection", True)]:
        save_reference(tmp_path / name, hidden_act="gelu", eos_token_id=2, with_projection=with_projection)
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    projection = load_file(tmp_path / "projection" / "model.safetensors")
    assert not any(key.startswith("text_model.") for key in plain)
    assert all(key.startswith("text_model.") for key in projection if key != "text_projection.weight")
    assert {clip.rename_key(key) for key in plain} == {key for key in projection if key != "text_projection.weight"}


def test_legacy_checkpoint_layout(tmp_path, rng):
    """The published SD/SDXL layout: `text_model.` prefixes and the stored position_ids buffer."""
    reference = save_reference(tmp_path, hidden_act="quick_gelu", eos_token_id=2, with_projection=False)
    file = tmp_path / "model.safetensors"
    tensors = {f"text_model.{key}": value for key, value in load_file(file).items()}
    tensors["text_model.embeddings.position_ids"] = np.arange(LENGTH, dtype=np.int64)[None]
    save_file(tensors, file)
    config = config_from_file(clip.CLIPTextConfig, tmp_path / "config.json")
    check_parity(tmp_path, reference, config, token_ids(rng, 2))


@pytest.mark.parametrize(
    "values, expected",
    [(SDXL_TEXT_ENCODER, 123_060_480), (SDXL_TEXT_ENCODER_2, 694_659_840)],
    ids=["text_encoder", "text_encoder_2"],
)
def test_sdxl_parameter_counts(values, expected):
    config = config_from_dict(clip.CLIPTextConfig, values)
    params = clip.abstract_params(config)
    assert sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params)) == expected
    assert ("text_projection" in params) == config.with_projection


@pytest.mark.parametrize(
    "values",
    [
        {"hidden_act": "gelu_new"},
        {"architectures": ["CLIPModel"]},
        {"eos_token_id": [2, 3]},
        {"hidden_size": 30, "num_attention_heads": 4},
    ],
)
def test_unsupported_config(values):
    with pytest.raises(ValueError):
        config_from_dict(clip.CLIPTextConfig, values)


def test_too_long_input():
    config = config_from_dict(clip.CLIPTextConfig, SDXL_TEXT_ENCODER)
    with pytest.raises(ValueError, match="input_ids"):
        jax.eval_shape(clip.CLIPTextModel(config).init, jax.random.key(0), np.zeros((1, 78), np.int32))


@pytest.mark.parametrize("eos_token_id, with_projection", [(2, True), (500, False)])
def test_ids_past_the_vocabulary_read_extra_rows_as_webuis_embedding_fixes(tmp_path, rng, eos_token_id,
                                                                           with_projection):
    """Textual-inversion vectors as rows past the vocabulary give what webui's `EmbeddingsWithFixes` gives
    (its placeholder id 0 at their positions, the vectors put in place of the token embeddings), the
    pooled output too: for the legacy eos id 2 at the largest id, which the extra ids are not."""
    import jax.numpy as jnp

    from a1111_reference import EmbeddingsWithFixes

    reference = save_reference(tmp_path, hidden_act="gelu", eos_token_id=eos_token_id, with_projection=with_projection)
    config = config_from_file(clip.CLIPTextConfig, tmp_path / "config.json")
    ids = token_ids(rng, eos_token_id)
    extra = rng.normal(size=(4, config.hidden_size)).astype(np.float32)
    ours_ids, placeholder = ids.copy(), ids.copy()
    ours_ids[:, 2:5], placeholder[:, 2:5] = VOCAB + np.array([3, 0, 1]), 0
    ours = clip.CLIPTextModel(config).apply({"params": load(tmp_path, config)}, ours_ids, jnp.asarray(extra))
    reference.set_input_embeddings(EmbeddingsWithFixes(reference.get_input_embeddings(),
                                                       [(1, torch.from_numpy(extra[[3, 0, 1]]))]))
    with torch.no_grad():
        theirs = reference(torch.from_numpy(placeholder), output_hidden_states=True)
    assert_close("last_hidden_state", ours.last_hidden_state, theirs.last_hidden_state)
    if with_projection:
        assert_close("text_embeds", ours.text_embeds, theirs.text_embeds)
    else:
        assert_close("pooler_output", ours.pooler_output, theirs.pooler_output)
