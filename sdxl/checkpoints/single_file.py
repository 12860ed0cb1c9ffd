"""Single-file checkpoints in the original (SGM / A1111) layout, as most fine-tunes are shared.

One safetensors file holds every component under the original training code's names:

    model.diffusion_model.*                   the UNet, in LDM's `openaimodel` names
    first_stage_model.*                       the VAE, in LDM's autoencoder names
    cond_stage_model.transformer.*            SD 1.x: CLIP ViT-L/14, in transformers' names
    cond_stage_model.model.*                  SD 2.x: OpenCLIP ViT-H/14, in open_clip's names
    conditioner.embedders.0.transformer.*     SDXL: CLIP ViT-L/14, in transformers' names
    conditioner.embedders.1.model.*           SDXL: OpenCLIP ViT-bigG/14, in open_clip's names

The configs and tokenizers are not in the file: they come from a diffusers folder (`config=`) or
from the package's published ones (`sdxl/configs/`), chosen by the family the keys show, as
diffusers' `from_single_file` chooses them.

The mapping is data: for each component, `KEY_MAPS[component](config)` lists every module key of
our models with the original key it is stored under (and how: OpenCLIP fuses q/k/v into one
`in_proj` tensor and stores its text projection transposed; the VAE's attention projections are
1x1 convolutions). Loading then checks every key and shape both ways, like a diffusers folder's,
and `write_single_file` inverts the same table for the tests.
"""

import dataclasses
import functools
import json
import re
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..models.clip import CLIPTextConfig
from ..models.controlnet import ControlNetConfig
from ..models.unet import UNetConfig
from ..models.vae import VAEConfig
from ..sampling.schedulers import ZERO_TERMINAL_SNR
from .spec import ModelSpec
from .weights import (
    SAFETENSORS_DTYPES, CheckpointError, SafetensorsFile, StoredTensor, checkpoint_key, flatten, load_stored, nbytes,
    torch_axes,
)


@dataclasses.dataclass(frozen=True)
class Original:
    """Where the original layout stores one of our parameters (see `weights.StoredTensor`)."""

    key: str
    rows: tuple[int, int] | None = None
    transpose: bool = False
    squeeze: bool = False


# Each component's prefix in the file, per family.
PREFIXES = {
    "sdxl": {
        "unet": "model.diffusion_model.",
        "vae": "first_stage_model.",
        "text_encoder": "conditioner.embedders.0.transformer.",
        "text_encoder_2": "conditioner.embedders.1.model.",
    },
    "sd1": {
        "unet": "model.diffusion_model.", "vae": "first_stage_model.", "text_encoder": "cond_stage_model.transformer."
    },
    "sd2": {"unet": "model.diffusion_model.", "vae": "first_stage_model.", "text_encoder": "cond_stage_model.model."},
}
# The published configs (`sdxl/configs/`) each family defaults to, as diffusers' defaults.
DEFAULT_CONFIGS = {"sdxl": "sdxl-base-1.0", "sd1": "sd-1.5", "sd2": "sd-2.1"}
# Stored tensors that are no parameters: the training schedule's buffers (top-level keys such as
# `alphas_cumprod`), EMA copies, position ids, OpenCLIP's logit scale and causal mask.
_NOT_PARAMETERS = re.compile(r"^[^.]+$|^model_ema\.|position_ids$|logit_scale$|attn_mask$")

_UNET_INPUT = "model.diffusion_model.input_blocks.0.0.weight"


def detect_family(shapes: dict[str, tuple[int, ...]], where: str) -> str:
    """"sdxl", "sd1" or "sd2" from a file's keys ({key: shape}), as diffusers'
    `infer_diffusers_model_type` tells them apart (by the text encoders' prefixes, which also holds
    for small test models); or a CheckpointError naming what the file is instead."""

    def has(prefix: str) -> bool:
        return any(k.startswith(prefix) for k in shapes)

    if _UNET_INPUT not in shapes:
        raise CheckpointError(f"{where}: no UNet under model.diffusion_model: not an SD/SDXL single file")
    channels = shapes[_UNET_INPUT][1]
    if channels != 4:
        raise CheckpointError(f"{where}: a UNet with {channels} input channels (inpainting) is not supported")
    if "edm_mean" in shapes:
        raise CheckpointError(f"{where}: Playground v2.5 (EDM) checkpoints are not supported")
    if "edm_vpred.sigma_max" in shapes:
        raise CheckpointError(f"{where}: CosXL (EDM v-prediction) checkpoints are not supported")
    if has("conditioner.embedders.1.model."):
        return "sdxl"
    if has("conditioner.embedders.0.model."):
        raise CheckpointError(f"{where}: the SDXL refiner is not supported")
    if has("cond_stage_model.model."):
        return "sd2"
    if has("cond_stage_model.transformer."):
        return "sd1"
    raise CheckpointError(f"{where}: no text encoder under cond_stage_model or conditioner.embedders")


# The SAI model spec's `modelspec.prediction_type` values (kohya's sd-scripts write "epsilon" or "v").
_MODELSPEC_PREDICTION_TYPES = {"epsilon": "epsilon", "v": "v_prediction", "v_prediction": "v_prediction"}


def sampling_fields(keys, metadata: dict[str, str], where: str) -> dict:
    """The scheduler config fields a single file says it samples with, as the tools it comes from read
    them: an (empty) `v_pred` tensor means v-prediction, and `ztsnr` zero terminal SNR (ComfyUI's
    `supported_models.SDXL.model_type`, A1111's and Forge's loaders); without `v_pred`, the SAI model
    spec's `modelspec.prediction_type` in the metadata says it. {} for a plain epsilon model.

    Raises:
      CheckpointError: a model spec prediction type this package does not run.
    """
    fields = {}
    declared = metadata.get("modelspec.prediction_type")
    if "v_pred" in keys:
        fields["prediction_type"] = "v_prediction"
    elif declared is not None:
        prediction_type = _MODELSPEC_PREDICTION_TYPES.get(declared.strip().lower())
        if prediction_type is None:
            raise CheckpointError(f"{where}: its model spec's prediction type {declared!r} is not supported "
                                  f"(only {', '.join(_MODELSPEC_PREDICTION_TYPES)})")
        fields["prediction_type"] = prediction_type
    if "ztsnr" in keys:
        fields.update(ZERO_TERMINAL_SNR)
    return fields


def family_of(spec: ModelSpec) -> str:
    """The family a model's configs describe: SD 2.x's OpenCLIP text tower uses gelu where OpenAI
    CLIP's, SD 1.x's, uses quick_gelu."""
    if spec.is_sdxl:
        return "sdxl"
    return "sd2" if spec.text_encoders[0].hidden_act == "gelu" else "sd1"


# ---------------------------------------------------------------------------------------------
# The tables: our module key -> where the original layout stores it


_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
           "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


@functools.cache  # one table per config, not one per key
def unet_prefixes(config: UNetConfig) -> dict[str, str]:
    """{our module prefix: LDM's} for a UNet: its blocks are numbered in one sequence per side."""
    layers, levels = config.layers_per_block, len(config.block_out_channels)
    table = {
        "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
        "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
        "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
        "mid_block.resnets.0": "middle_block.0", "mid_block.attentions.0": "middle_block.1",
        "mid_block.resnets.1": "middle_block.2",
    }
    for level in range(levels):
        for layer in range(layers):
            block = 1 + level * (layers + 1) + layer
            table[f"down_blocks.{level}.resnets.{layer}"] = f"input_blocks.{block}.0"
            table[f"down_blocks.{level}.attentions.{layer}"] = f"input_blocks.{block}.1"
        table[f"down_blocks.{level}.downsamplers.0.conv"] = f"input_blocks.{1 + level * (layers + 1) + layers}.0.op"
        attention = config.up_block_types[level].startswith("CrossAttn")
        for layer in range(layers + 1):
            block = level * (layers + 1) + layer
            table[f"up_blocks.{level}.resnets.{layer}"] = f"output_blocks.{block}.0"
            table[f"up_blocks.{level}.attentions.{layer}"] = f"output_blocks.{block}.1"
        last = level * (layers + 1) + layers
        table[f"up_blocks.{level}.upsamplers.0.conv"] = f"output_blocks.{last}.{1 + attention}.conv"
    return table


@functools.cache
def vae_prefixes(config: VAEConfig) -> dict[str, str]:
    """{our module prefix: LDM's} for a VAE: the decoder's levels are numbered from the bottom."""
    levels = len(config.block_out_channels)
    table = {"encoder.conv_norm_out": "encoder.norm_out", "decoder.conv_norm_out": "decoder.norm_out"}
    for side in ("encoder", "decoder"):
        table[f"{side}.mid_block.resnets.0"] = f"{side}.mid.block_1"
        table[f"{side}.mid_block.resnets.1"] = f"{side}.mid.block_2"
        table[f"{side}.mid_block.attentions.0"] = f"{side}.mid.attn_1"
    for level in range(levels):
        for layer in range(config.layers_per_block + 1):
            table[f"encoder.down_blocks.{level}.resnets.{layer}"] = f"encoder.down.{level}.block.{layer}"
            table[f"decoder.up_blocks.{level}.resnets.{layer}"] = f"decoder.up.{levels - 1 - level}.block.{layer}"
        table[f"encoder.down_blocks.{level}.downsamplers.0.conv"] = f"encoder.down.{level}.downsample.conv"
        table[f"decoder.up_blocks.{level}.upsamplers.0.conv"] = f"decoder.up.{levels - 1 - level}.upsample.conv"
    return table


_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _renamed(key: str, prefixes: dict[str, str]) -> tuple[str, str, str] | None:
    """(our prefix, its original, the rest of `key`) for the longest prefix of `key` in the table."""
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in prefixes:
            return prefix, prefixes[prefix], ".".join(parts[end:])
    return None


def unet_original(key: str, config: UNetConfig) -> Original:
    found = _renamed(key, unet_prefixes(config))
    if found is None:
        return Original(key)
    prefix, original, rest = found
    if ".resnets." in prefix or prefix.startswith("mid_block.resnets"):
        layer, _, leaf = rest.partition(".")
        rest = f"{_RESNET.get(layer, layer)}.{leaf}"
    return Original(f"{original}.{rest}")


def vae_original(key: str, config: VAEConfig) -> Original:
    found = _renamed(key, vae_prefixes(config))
    if found is None:
        return Original(key)
    prefix, original, rest = found
    if prefix.endswith("attentions.0"):
        for ours, theirs in _VAE_ATTENTION.items():
            if rest.startswith(ours + "."):
                # LDM's attention projections are 1x1 convolutions: [C, C, 1, 1] for our [C, C].
                leaf = rest[len(ours) + 1:]
                return Original(f"{original}.{theirs}.{leaf}", squeeze=theirs != "norm" and leaf == "weight")
    if ".resnets." in prefix:
        rest = rest.replace("conv_shortcut.", "nin_shortcut.")
    return Original(f"{original}.{rest}")


def clip_original(key: str, config: CLIPTextConfig) -> Original:
    """CLIP ViT-L is stored in transformers' own names."""
    return Original(key)


_OPEN_CLIP_LAYER = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "self_attn.out_proj": "attn.out_proj",
                    "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}


def open_clip_original(key: str, config: CLIPTextConfig) -> Original:
    """OpenCLIP's names; its attention's query, key and value are the rows of one `in_proj`."""
    fixed = {
        "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
        "text_model.embeddings.position_embedding.weight": "positional_embedding",
        "text_model.final_layer_norm.weight": "ln_final.weight",
        "text_model.final_layer_norm.bias": "ln_final.bias",
    }
    if key in fixed:
        return Original(fixed[key])
    if key == "text_projection.weight":
        return Original("text_projection", transpose=True)  # open_clip multiplies x @ projection
    match = re.fullmatch(r"text_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
    if match is None:
        return Original(key)
    layer, name, leaf = match.groups()
    block = f"transformer.resblocks.{layer}"
    projection = re.fullmatch(r"self_attn\.([qkv])_proj", name)
    if projection:
        return Original(f"{block}.attn.in_proj_{leaf}", rows=("qkv".index(projection.group(1)), 3))
    return Original(f"{block}.{_OPEN_CLIP_LAYER.get(name, name)}.{leaf}")


def controlnet_original(key: str, config: ControlNetConfig) -> Original:
    """A ControlNet in the original layout (the ControlNet project's `cldm`): its UNet encoder under
    the UNet's names; the conditioning embedding is `input_hint_block` (every other entry a SiLU),
    the zero convolutions `zero_convs.N.0`, the mid block's `middle_block_out.0`."""
    module, _, leaf = key.rpartition(".")
    if module.startswith("controlnet_cond_embedding."):
        name = module.removeprefix("controlnet_cond_embedding.")
        last = 4 * (len(config.conditioning_embedding_out_channels) - 1) + 2
        index = {"conv_in": 0, "conv_out": last}.get(name)
        index = 2 * int(name.removeprefix("blocks.")) + 2 if index is None else index
        return Original(f"input_hint_block.{index}.{leaf}")
    if module.startswith("controlnet_down_blocks."):
        return Original(f"zero_convs.{module.removeprefix('controlnet_down_blocks.')}.0.{leaf}")
    if module == "controlnet_mid_block":
        return Original(f"middle_block_out.0.{leaf}")
    return unet_original(key, config.unet_config)


def key_map(family: str, spec: ModelSpec) -> dict[str, dict[str, Original]]:
    """{component: {our module key: Original}} for every parameter of `spec`'s model."""
    originals = {"unet": (unet_original, spec.unet), "vae": (vae_original, spec.vae)}
    encoders = (clip_original, open_clip_original) if family == "sdxl" else (
        (clip_original,) if family == "sd1" else (open_clip_original,)
    )
    for name, original, config in zip(spec.text_encoder_names, encoders, spec.text_encoders):
        originals[name] = (original, config)
    table = {}
    for component, tree in spec.abstract_params().items():
        original, config = originals[component]
        prefix = PREFIXES[family][component]
        table[component] = {}
        for path in flatten(tree):
            key = checkpoint_key(path)
            where = original(key, config)
            table[component][key] = dataclasses.replace(where, key=prefix + where.key)
    return table


# ---------------------------------------------------------------------------------------------
# Loading and writing


def load(path: Path, family: str, spec: ModelSpec, dtype, put: Callable, without: tuple[str, ...] = ()) -> dict:
    """The parameter tree of `spec`'s model from a single file, every key and shape checked; the
    components in `without` (another file replaces them) are neither read nor checked.

    Raises:
      CheckpointError: a parameter is missing or mis-shaped, or the file holds tensors that are
        neither parameters of the model nor known non-parameters (`_NOT_PARAMETERS`).
    """
    file = SafetensorsFile(path)
    table = key_map(family, spec)
    used = {original.key for component in table.values() for original in component.values()}
    skipped = tuple(PREFIXES[family][component] for component in without)
    # Fused q/k/v tensors are used three times; OpenCLIP-H's last layer is unused by SD 2.x's encoder.
    extra = sorted(
        k for k in file.keys() if k not in used and not _NOT_PARAMETERS.search(k) and not k.startswith(skipped)
    )
    unused_layers = [k for k in extra if _beyond_the_encoder(k, family, spec)]
    extra = [k for k in extra if k not in unused_layers and not k.endswith("text_projection")]
    if extra:
        raise CheckpointError(f"{path}: keys that belong to no component of the model: {_listed(extra)}")
    abstract, params = spec.abstract_params(), {}
    for component, originals in table.items():
        if component in without:
            continue
        present = {k: o for k, o in originals.items() if o.key in file.keys()}
        stored = {k: StoredTensor(file, o.key, o.rows, o.transpose, o.squeeze) for k, o in present.items()}
        missing = sorted(set(originals) - set(present))
        if missing:
            shown = ", ".join(originals[k].key for k in missing[:10])
            raise CheckpointError(f"{path}: {component}: {len(missing)} tensors missing ({shown})")
        params[component] = load_stored(
            stored, abstract[component], dtype=dtype, put=put, where=f"{path} ({component})"
        )
    return params


def load_original(
    path: Path, prefix: str, original: Callable[[str, object], Original], config, abstract: dict, dtype, put: Callable
) -> dict:
    """One model's parameters from a file that holds it alone in the original layout: a ControlNet
    (`controlnet_original`, its keys under "control_model." or none) or a VAE (`vae_original`, under
    "first_stage_model." or none); every key and shape checked both ways.

    Args:
      prefix: the stored keys' prefix.
      original: where the layout stores each of our keys, given the model's `config`.
      abstract: the model's parameter shapes.

    Raises:
      CheckpointError: a parameter is missing or mis-shaped, or the file holds other tensors.
    """
    file = SafetensorsFile(path)
    originals = {checkpoint_key(p): original(checkpoint_key(p), config) for p in flatten(abstract)}
    stored_keys = {prefix + o.key for o in originals.values()}
    missing = sorted(k for k in stored_keys if k not in file.keys())
    extra = sorted(k for k in file.keys() if k not in stored_keys)
    for what, keys in (("missing", missing), ("that belong to no part of the model", extra)):
        if keys:
            raise CheckpointError(f"{path}: {len(keys)} tensors {what} ({_listed(keys)})")
    stored = {k: StoredTensor(file, prefix + o.key, o.rows, o.transpose, o.squeeze) for k, o in originals.items()}
    return load_stored(stored, abstract, dtype=dtype, put=put, where=str(path))


def _listed(keys: list[str]) -> str:
    """The first ten keys, and how many more, for a message."""
    return ", ".join(keys[:10]) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")


def _beyond_the_encoder(key: str, family: str, spec: ModelSpec) -> bool:
    """An OpenCLIP layer past those the text encoder's config keeps (SD 2.x's uses 23 of 24)."""
    match = re.match(r"cond_stage_model\.model\.transformer\.resblocks\.(\d+)\.", key)
    return family == "sd2" and match is not None and int(match.group(1)) >= spec.text_encoders[0].num_hidden_layers


def write_single_file(
    path: Path, family: str, spec: ModelSpec, tensor: Callable[[str, str], np.ndarray], dtype
) -> Path:
    """Writes a model as one file in the original layout: `key_map` inverted, for the tests and the
    benchmark. `tensor(component, our module key)` gives one parameter in PyTorch's layout; it is
    called while writing, so the host holds one tensor (three of a fused q/k/v) at a time."""
    entries: dict[str, list] = {}  # original key -> [its shape, [(component, our key, Original)]]
    abstract = spec.abstract_params()
    for component, originals in key_map(family, spec).items():
        shapes = {
            checkpoint_key(p): tuple(leaf.shape[a] for a in torch_axes(p, len(leaf.shape)))
            for p, leaf in flatten(abstract[component]).items()
        }
        for key, original in originals.items():
            shape = shapes[key][::-1] if original.transpose else shapes[key]
            shape = (*shape, 1, 1) if original.squeeze else shape
            if original.rows is not None:
                shape = (shape[0] * original.rows[1], *shape[1:])
            entries.setdefault(original.key, [shape, []])[1].append((component, key, original))

    def stored(original_key: str) -> np.ndarray:
        parts = []
        for component, key, original in sorted(entries[original_key][1], key=lambda e: (e[2].rows or (0, 1))[0]):
            value = np.asarray(tensor(component, key))
            value = value.T if original.transpose else value
            parts.append(value.reshape(*value.shape, 1, 1) if original.squeeze else value)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    _write_safetensors(path, {key: shape for key, (shape, _) in entries.items()}, stored, np.dtype(dtype))
    return Path(path)


def _write_safetensors(
    path: Path, shapes: dict[str, tuple[int, ...]], tensor: Callable[[str], np.ndarray], dtype: np.dtype
) -> None:
    stored_dtype = {v: k for k, v in SAFETENSORS_DTYPES.items()}[dtype]
    header, offset = {}, 0
    for key in sorted(shapes):
        size = nbytes(shapes[key], dtype)
        header[key] = {"dtype": stored_dtype, "shape": list(shapes[key]), "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        for key in sorted(shapes):
            f.write(np.ascontiguousarray(tensor(key), dtype).tobytes())
