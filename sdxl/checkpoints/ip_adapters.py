"""IP-Adapters: where their files are, whether they fit the model, and their weights.

Sources are what diffusers' `load_ip_adapter(source, subfolder, weight_name, image_encoder_folder)`
takes, in h94/IP-Adapter's layout: a local folder or a Hub repo id ("h94/IP-Adapter"), the
`subfolder` in it ("sdxl_models") and the file's name ("ip-adapter_sdxl.safetensors"). One file holds
an adapter: its image projection (`image_proj.*`, `sdxl.models.ip_adapter`) and, per cross-attention
layer of the UNet, the keys and values of the image tokens (`ip_adapter.{id}.to_k_ip.weight`,
`to_v_ip.weight`; `adapter_key_ids` maps the ids to the layers). Lists load several adapters, each
value standing for all when it is alone, as diffusers broadcasts them.

The CLIP image encoder (`sdxl.models.clip_vision`), which all the adapters share, is read from the
first source's `image_encoder_folder`: within `subfolder` when the name has no "/", else from the
source's root; None: the caller brings none. Configs and headers are checked against the model and
one another before any weights are fetched where the Hub answers. Pickled files are refused:
unpickling can run arbitrary code.
"""

import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from ..config import config_from_dict, read_json
from ..models import clip_vision, ip_adapter
from ..models.clip_vision import CLIPVisionConfig
from ..models.ip_adapter import ImageProjectionConfig
from ..models.unet import UNetConfig
from . import hub
from .folder import weight_files
from .spec import cached_shapes
from .weights import CheckpointError, SafetensorsFile, flatten, load_params, refuse_pickled, unflatten

# The file's two parts: the image projection's tensors, and the layers' (`ip_adapter.1.to_k_ip.weight`).
PROJECTION, LAYERS = "image_proj", "ip_adapter"
PROJECTION_PREFIX = PROJECTION + "."
ENCODER_CONFIG = "config.json"
ENCODER_WEIGHTS = "model.safetensors"  # what transformers reads from the Hub
# Which models an adapter was trained for, by the width of the text its cross-attention reads.
_FAMILIES = {768: "SD 1.x", 1024: "SD 2.x", 2048: "SDXL"}
_LAYER_KEY = re.compile(r"ip_adapter\.(\d+)\.to_[kv]_ip\.weight")


@dataclasses.dataclass(frozen=True)
class IPAdapterWeights:
    """An adapter's parameters, ready for the UNet.

    Attributes:
      name: the source, subfolder and file, for messages.
      projection: the image projection's kind and sizes.
      image_proj: the projection's parameters (`sdxl.models.ip_adapter.image_projection`).
      layers: {cross-attention layer (`cross_attention_layers`): {"to_k_ip": w, "to_v_ip": w}}, each
        w [layer width, cross_attention_dim] as torch's Linear keeps it (`sdxl.models.layers.Linear`).
    """

    name: str
    projection: ImageProjectionConfig
    image_proj: dict
    layers: dict[str, dict[str, jax.Array]]

    @property
    def num_tokens(self) -> int | None:
        """The image tokens per image (None for "full": one per encoder hidden state)."""
        return self.projection.num_tokens


@dataclasses.dataclass(frozen=True)
class IPAdapterCheckpoint:
    """An adapter ready to load: its file and its projection, checked against a UNet."""

    name: str
    file: Path
    projection: ImageProjectionConfig

    def load(self, unet: UNetConfig, dtype, put: Callable = lambda array: array) -> IPAdapterWeights:
        """The adapter's parameters, every key and shape checked; `put` places each array.

        Raises:
          CheckpointError: the file does not fit `unet`, or its keys or shapes are not an adapter's.
        """
        check_fits(_header(self.file), unet, self.name)
        layer_params = {
            key_id: {name: {"weight": jax.ShapeDtypeStruct(shape, np.float32)} for name in ("to_k_ip", "to_v_ip")}
            for key_id, shape in _expected_layer_shapes(unet).items()
        }
        abstract = {PROJECTION: ip_adapter.abstract_params(self.projection), LAYERS: layer_params}
        tree = load_params([self.file], abstract, dtype=dtype, rename=_rename_key, put=put)
        layers = {
            path: {name: weight["weight"] for name, weight in tree[LAYERS][key_id].items()}
            for key_id, path in adapter_key_ids(unet).items()
        }
        return IPAdapterWeights(self.name, self.projection, tree[PROJECTION], layers)


@dataclasses.dataclass(frozen=True)
class ImageEncoderCheckpoint:
    """The CLIP image encoder the adapters read: its config and weight files."""

    name: str
    config: CLIPVisionConfig
    files: tuple[Path, ...]

    def load(self, dtype, put: Callable = lambda array: array) -> dict:
        """The encoder's parameter tree, every key and shape checked; `put` places each array."""
        return load_params(
            list(self.files),
            clip_vision.abstract_params(self.config),
            dtype=dtype,
            rename=clip_vision.rename_key,
            ignore=clip_vision.IGNORED_KEYS,
            put=put,
        )


@dataclasses.dataclass(frozen=True)
class IPAdapters:
    """What `resolve` found: the adapters, in the order given, and the encoder they share (None when
    `image_encoder_folder` was None)."""

    adapters: tuple[IPAdapterCheckpoint, ...]
    image_encoder: ImageEncoderCheckpoint | None


@dataclasses.dataclass(frozen=True)
class IPAdapterConfig:
    """What a compiled program knows of a loaded adapter: its image encoder's config and its projection's."""

    encoder: CLIPVisionConfig
    projection: ImageProjectionConfig


def module_path(layer: str) -> tuple[str, ...]:
    """A cross-attention layer's path in the UNet's parameter tree, whose module names keep their index
    ("down_blocks.1.attentions.0.transformer_blocks.0.attn2" -> ("down_blocks.1", "attentions.0",
    "transformer_blocks.0", "attn2"))."""
    names: list[str] = []
    for part in layer.split("."):
        if part.isdigit():
            names[-1] += f".{part}"
        else:
            names.append(part)
    return tuple(names)


def unet_tree(layers: dict[str, dict]) -> dict:
    """An adapter's key and value weights ({layer: {"to_k_ip": w, "to_v_ip": w}}) as a tree beside the
    UNet's, each layer's under its `attn2` path (`sdxl.engine.program` puts them in the UNet's)."""
    return unflatten({(*module_path(layer), name, "weight"): weight
                      for layer, pair in layers.items() for name, weight in pair.items()})


def abstract_params(config: IPAdapterConfig, unet: dict) -> dict:
    """A loaded adapter's parameters as a program takes them, {"image_encoder", "image_proj", "unet"},
    as shapes; `unet` is the UNet's tree (of shapes), whose every `attn2` gets a `to_k_ip` and a
    `to_v_ip` of its `to_k`'s shape."""
    flat = flatten(unet)
    layers = {(*path[:-2], name, "weight"): leaf for path, leaf in flat.items()
              if path[-3:] == ("attn2", "to_k", "weight") for name in ("to_k_ip", "to_v_ip")}
    return {
        "image_encoder": cached_shapes(clip_vision.abstract_params, config.encoder),
        "image_proj": ip_adapter.abstract_params(config.projection),
        "unet": unflatten(layers),
    }


def cross_attention_layers(unet: UNetConfig) -> list[str]:
    """The module paths of the UNet's cross-attention layers (`attn2`), in the order of diffusers'
    `unet.attn_processors`: the down blocks, the up blocks, then the mid block, as
    UNet2DConditionModel registers its children."""
    levels = len(unet.block_out_channels)
    blocks = [
        (f"down_blocks.{level}", block_type, unet.layers_per_block, unet.transformer_layers[level])
        for level, block_type in enumerate(unet.down_block_types)
    ]
    blocks += [
        (f"up_blocks.{i}", block_type, unet.layers_per_block + 1, unet.transformer_layers[levels - 1 - i])
        for i, block_type in enumerate(unet.up_block_types)
    ]
    layers = [
        f"{block}.attentions.{j}.transformer_blocks.{k}.attn2"
        for block, block_type, attentions, depth in blocks
        if block_type.startswith("CrossAttn")
        for j in range(attentions)
        for k in range(depth)
    ]
    mid = [f"mid_block.attentions.0.transformer_blocks.{k}.attn2" for k in range(unet.transformer_layers[-1])]
    return layers + mid


def adapter_key_ids(unet: UNetConfig) -> dict[str, str]:
    """{h94's key id: cross-attention layer}: diffusers numbers the layers of `cross_attention_layers`
    1, 3, 5, ... (h94 counted every attention processor, the self-attention ones between them)."""
    return {str(2 * i + 1): path for i, path in enumerate(cross_attention_layers(unet))}


def layer_width(unet: UNetConfig, path: str) -> int:
    """The channels of a cross-attention layer (`cross_attention_layers`), as diffusers tells them
    from its block's name."""
    block, index = path.split(".")[:2]
    if block == "mid_block":
        return unet.block_out_channels[-1]
    if block == "up_blocks":
        return unet.block_out_channels[::-1][int(index)]
    return unet.block_out_channels[int(index)]


def check_fits(header: dict[str, tuple[int, ...]], unet: UNetConfig, where: str) -> None:
    """Raises CheckpointError, in one sentence, unless the adapter's layers ({key: shape}) are those
    of `unet`'s cross-attention, key ids and widths (an SD 1.5 adapter for an SDXL model, say)."""
    stored = {key: shape for key, shape in header.items() if _LAYER_KEY.fullmatch(key)}
    expected = {
        f"{LAYERS}.{key_id}.{name}.weight": shape
        for key_id, shape in _expected_layer_shapes(unet).items()
        for name in ("to_k_ip", "to_v_ip")
    }
    if stored == expected:
        return
    if not stored:
        raise CheckpointError(f"{where}: no IP-Adapter layers in this file (no {LAYERS}.<id>.to_k_ip.weight)")
    text_widths = sorted({shape[1] for shape in stored.values()})
    theirs = _FAMILIES.get(text_widths[0], "another model") if len(text_widths) == 1 else "another model"
    raise CheckpointError(
        f"{where}: an IP-Adapter for {theirs} ({len(stored) // 2} cross-attention layers reading "
        f"{'/'.join(map(str, text_widths))}-wide text); it does not fit this model's UNet "
        f"({len(expected) // 2} layers reading {unet.cross_attention_dim}-wide text)"
    )


def resolve(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    subfolder: str | Sequence[str],
    weight_name: str | Sequence[str],
    unet: UNetConfig,
    *,
    image_encoder_folder: str | None = "image_encoder",
) -> IPAdapters:
    """The adapters the arguments name (see the module's docstring), checked against `unet` and the
    image encoder.

    Raises:
      CheckpointError: with the reason (not found, pickled, FaceID, another family, an encoder the
        projection cannot read), before weights are fetched where it can tell.
    """
    weight_names = [weight_name] if isinstance(weight_name, str) else list(weight_name)
    sources = _broadcast(source, len(weight_names), "sources")
    subfolders = _broadcast(subfolder or "", len(weight_names), "subfolders")
    adapters = tuple(_adapter(*args, unet) for args in zip(sources, subfolders, weight_names))
    encoder = None
    if image_encoder_folder is not None:
        # diffusers' rule: a bare folder name is inside the subfolder, a path is from the source's root.
        inside = "/" not in image_encoder_folder
        folder = Path(subfolders[0], image_encoder_folder) if inside else Path(image_encoder_folder)
        encoder = _encoder(sources[0], folder.as_posix())
        for adapter in adapters:
            check_encoder(adapter.projection, encoder.config, f"{adapter.name} with {encoder.name}")
    return IPAdapters(adapters, encoder)


def check_encoder(projection: ImageProjectionConfig, encoder: CLIPVisionConfig, where: str) -> None:
    """Raises CheckpointError unless the projection reads what the encoder gives."""
    if projection.reads_hidden_states:
        what, width = "hidden states", encoder.hidden_size
    else:
        what, width = "image embeds", encoder.projection_dim
    if projection.image_embed_dim != width:
        raise CheckpointError(
            f"{where}: the adapter reads {projection.image_embed_dim}-wide {what}, the image encoder gives "
            f"{width}-wide ones; use the image encoder the adapter was trained with"
        )


def _broadcast(value: str | os.PathLike | Sequence, n: int, what: str) -> list[str]:
    values = [value] if isinstance(value, (str, os.PathLike)) else list(value)
    values = [str(v) for v in values]
    if len(values) == 1:
        values *= n
    if len(values) != n:
        raise CheckpointError(f"{len(values)} {what} for {n} weight names; give one, or one per weight name")
    return values


def _is_hub_name(source: str) -> bool:
    return source.count("/") == 1 and all(source.split("/")) and not source.startswith((".", "/", "~"))


def _adapter(source: str, subfolder: str, weight_name: str, unet: UNetConfig) -> IPAdapterCheckpoint:
    relative = Path(subfolder, weight_name).as_posix()
    name = f"{source}/{relative}"
    refuse_pickled(weight_name, "IP-Adapter")
    if not weight_name.endswith(".safetensors"):
        raise CheckpointError(f"{name}: not a .safetensors file")
    local = Path(source).expanduser()
    if local.is_dir():
        path = local / relative
        if not path.is_file():
            raise CheckpointError(f"{name}: no such file")
    elif _is_hub_name(source):
        header = hub.file_header(source, relative)
        if header is not None:  # refuse before the download where the Hub answers
            _projection(header, unet, name)
        path = hub.download_file(source, relative)
    else:
        raise CheckpointError(f"{source}: not a folder or a Hub repo id (owner/name)")
    return IPAdapterCheckpoint(name, path, _projection(_header(path), unet, name))


def _projection(header: dict[str, tuple[int, ...]], unet: UNetConfig, where: str) -> ImageProjectionConfig:
    shapes = {k.removeprefix(PROJECTION_PREFIX): v for k, v in header.items() if k.startswith(PROJECTION_PREFIX)}
    try:
        projection = ip_adapter.projection_config(shapes)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e
    check_fits(header, unet, where)
    if projection.cross_attention_dim != unet.cross_attention_dim:
        raise CheckpointError(
            f"{where}: its image tokens are {projection.cross_attention_dim} wide, the UNet's text "
            f"{unet.cross_attention_dim}"
        )
    return projection


def _encoder(source: str, folder: str) -> ImageEncoderCheckpoint:
    name = f"{source}/{folder}"
    local = Path(source).expanduser()
    if local.is_dir():
        config_path = local / folder / ENCODER_CONFIG
        if not config_path.is_file():
            raise CheckpointError(f"{name}: no image encoder here (no {ENCODER_CONFIG})")
        config = _encoder_config(config_path, name)
        # The plain weights where there are some, as transformers reads them whatever the dtype.
        return ImageEncoderCheckpoint(name, config, tuple(weight_files(local / folder, np.float32)))
    config = _encoder_config(hub.download_file(source, f"{folder}/{ENCODER_CONFIG}"), name)
    return ImageEncoderCheckpoint(name, config, (hub.download_file(source, f"{folder}/{ENCODER_WEIGHTS}"),))


def _encoder_config(path: Path, where: str) -> CLIPVisionConfig:
    try:
        return config_from_dict(CLIPVisionConfig, read_json(path))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: not an image encoder this package runs ({e})") from e


def _expected_layer_shapes(unet: UNetConfig) -> dict[str, tuple[int, int]]:
    return {
        key_id: (layer_width(unet, path), unet.cross_attention_dim) for key_id, path in adapter_key_ids(unet).items()
    }


def _rename_key(key: str) -> str:
    if key.startswith(PROJECTION_PREFIX):
        return PROJECTION_PREFIX + ip_adapter.rename_key(key.removeprefix(PROJECTION_PREFIX))
    return key


def _header(path: Path) -> dict[str, tuple[int, ...]]:
    file = SafetensorsFile(path)
    return {key: file.shape(key) for key in file.keys()}
