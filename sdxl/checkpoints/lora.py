"""LoRAs: low-rank updates of a model's layers, read from the files people share and applied to the
parameters, so that the compiled program never changes.

A LoRA file holds, for some linear and convolution layers of the UNet and the text encoders, two
factors, `down` [rank, in(, kh, kw)] and `up` [out, rank(, 1, 1)], and sometimes an `alpha`. With
the scale a user picks, the layer's weight W becomes

    W + scale * (alpha / rank) * up @ down

which is what diffusers' PEFT layers compute for `load_lora_weights` + `set_adapters(names,
adapter_weights)` (unfused: W x + scale * alpha / rank * up(down(x))). Without an alpha it is the
rank (a factor 1), as diffusers assumes; diffusers' own files may instead carry PEFT's config in their
metadata (`lora_alpha`, `alpha_pattern`, `use_rslora`).

The formats, told apart by their key names:

- kohya / A1111 (sd-scripts, most LoRAs shared on model sites): one name per layer, its module path
  with "_" for ".", prefixed `lora_unet_`, `lora_te1_` / `lora_te2_` (SDXL's two text encoders) or
  `lora_te_` (SD 1.x/2.x); factors `.lora_down.weight`, `.lora_up.weight` and an `.alpha`. SDXL's UNet
  layers go by the original SGM names (`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`)
  or by diffusers' (`lora_unet_down_blocks_1_attentions_0_...`); convolutions too (LoCon).
- diffusers / PEFT: `unet.<module>.lora_A.weight` and `.lora_B.weight`, `text_encoder.<module>...`,
  `text_encoder_2.<module>...`; and the older diffusers names, `...attn1.processor.to_q_lora.down.weight`
  (attention processors), `<module>.lora.down.weight` and `<module>.lora_linear_layer.down.weight`.

Underscored names are ambiguous ("down_blocks" or "down.blocks"?), so they are not parsed: they
are looked up in a table built from the model's own layers (`kohya_names`), with SGM names from the
single-file key map. A key that no rule or table entry explains is an error that names it.
"""

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..models.quantization import Quantized
from . import ModelSpec, locate_file
from .single_file import unet_original
from .weights import CheckpointError, SafetensorsFile, flatten, torch_axes, unflatten

# sd-scripts' prefix of each component's layer names (`lora_te_` is SD 1.x/2.x's one text encoder).
KOHYA_PREFIXES = {"lora_unet_": "unet", "lora_te1_": "text_encoder", "lora_te_": "text_encoder",
                  "lora_te2_": "text_encoder_2"}
DIFFUSERS_PREFIXES = {"unet.": "unet", "text_encoder.": "text_encoder", "text_encoder_2.": "text_encoder_2"}

# Each stored key: (pattern, which factor). `module` is the layer in the file's naming.
_FACTORS = [
    (re.compile(r"(?P<module>.+)\.lora_down\.weight"), "down"),  # kohya
    (re.compile(r"(?P<module>.+)\.lora_up\.weight"), "up"),
    (re.compile(r"(?P<module>.+)\.alpha"), "alpha"),
    (re.compile(r"(?P<module>.+)\.lora_A\.weight"), "down"),  # PEFT
    (re.compile(r"(?P<module>.+)\.lora_B\.weight"), "up"),
    (re.compile(r"(?P<module>.+)\.(?:lora|lora_linear_layer)\.down\.weight"), "down"),  # older diffusers
    (re.compile(r"(?P<module>.+)\.(?:lora|lora_linear_layer)\.up\.weight"), "up"),
    (re.compile(r"(?P<module>.+?)(?:\.processor)?\.(?P<projection>to_[qkv]|to_out)_lora\.down\.weight"), "down"),
    (re.compile(r"(?P<module>.+?)(?:\.processor)?\.(?P<projection>to_[qkv]|to_out)_lora\.up\.weight"), "up"),
]
# The older attention processors' projections, by the layer they update.
_PROCESSOR_PROJECTIONS = {
    "unet": {"to_q": "to_q", "to_k": "to_k", "to_v": "to_v", "to_out": "to_out.0"},
    "text_encoder": {"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "out_proj"},
}
_PROCESSOR_PROJECTIONS["text_encoder_2"] = _PROCESSOR_PROJECTIONS["text_encoder"]


@dataclasses.dataclass(frozen=True)
class LoraLayer:
    """One layer's update: `factor * up @ down`, in the layer's PyTorch layout."""

    component: str  # "unet", "text_encoder", "text_encoder_2"
    module: str  # the layer's module key, as our parameter tree names it
    down: np.ndarray  # [rank, in(, kh, kw)] float32
    up: np.ndarray  # [out, rank(, 1, 1)] float32
    factor: float  # alpha / rank (or / sqrt(rank) for rsLoRA)


@dataclasses.dataclass(frozen=True)
class Lora:
    """A LoRA file's updates, checked against one model."""

    name: str
    layers: tuple[LoraLayer, ...]
    short_hash: str  # as webui's "Lora hashes" show it (`short_hash`)


def targets(spec: ModelSpec) -> dict[str, dict[str, tuple[str, ...]]]:
    """{component: {module key: its weight's parameter path}} for every layer a LoRA may update:
    the linear layers and convolutions of the UNet and the text encoders (not embeddings or norms)."""
    result = {}
    for component, tree in spec.abstract_params().items():
        if component == "vae":
            continue
        result[component] = {
            ".".join(path[:-1]): path
            for path, leaf in flatten(tree).items()
            if path[-1] == "kernel" or (path[-1] == "weight" and len(leaf.shape) == 2 and "embedding" not in path[-2])
        }
    return result


@functools.cache
def kohya_names(spec: ModelSpec) -> dict[str, tuple[str, str]]:
    """{kohya layer name: (component, module key)}: every name sd-scripts gives a layer of `spec`'s model.

    The UNet's layers by diffusers' module names and, for SDXL, whose kohya LoRAs are trained on the
    original UNet, by the SGM names of the single-file layout too; the text encoders' by
    transformers' names, with and without `text_model_`.
    """
    table = {}
    for component, modules in targets(spec).items():
        for module in modules:
            if component == "unet":
                names = [module, unet_original(module + ".weight", spec.unet).key.removesuffix(".weight")]
            else:  # transformers 5 names CLIPTextModel's layers without `text_model.`, as LoRAs saved from it do
                names = [module, module.removeprefix("text_model.")]
            for prefix in (p for p, c in KOHYA_PREFIXES.items() if c == component):
                for name in names:
                    table[prefix + name.replace(".", "_")] = (component, module)
    return table


def read(path: str | os.PathLike, spec: ModelSpec, name: str | None = None) -> Lora:
    """The LoRA in a safetensors file, mapped onto `spec`'s model, every key and shape checked.

    Raises:
      CheckpointError: the file is not a LoRA this model can take: keys no rule explains (named),
        a layer the model does not have, factors whose shapes do not fit the layer.
    """
    path = Path(path)
    file = SafetensorsFile(path)
    where = name or path.name
    layer_paths = targets(spec)
    kohya = kohya_names(spec)
    factors: dict[tuple[str, str], dict[str, str]] = {}  # (component, module) -> {"down": key, ...}
    unknown = []
    for key in file.keys():
        found = _layer_of(key, kohya)
        if found is None:
            unknown.append(key)
            continue
        component, module, factor = found
        modules = layer_paths.get(component, {})  # an SD 1.x model has no text_encoder_2
        if component != "unet" and module not in modules:
            module = f"text_model.{module}"  # transformers 5 names CLIPTextModel's layers without it
        if module not in modules:
            unknown.append(key)
            continue
        factors.setdefault((component, module), {})[factor] = key
    if unknown:
        shown = ", ".join(sorted(unknown)[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise CheckpointError(f"LoRA {where}: {len(unknown)} key(s) match no layer of the model: {shown}")
    if not factors:
        raise CheckpointError(f"LoRA {where}: no LoRA weights in the file")

    configs = _peft_configs(file)
    abstract = spec.abstract_params()
    layers, problems = [], []
    for (component, module), keys in sorted(factors.items()):
        if "down" not in keys or "up" not in keys:
            problems.append(f"{component} {module}: only {', '.join(sorted(keys))}")
            continue
        down, up = (file.tensor(keys[f]).astype(np.float32) for f in ("down", "up"))
        shape = _torch_shape(abstract[component], layer_paths[component][module])
        rank = down.shape[0]
        if up.shape[:2] != (shape[0], rank) or math.prod(down.shape[1:]) != math.prod(shape[1:]):
            problems.append(f"{keys['down']}: factors {down.shape} and {up.shape} do not fit the layer's {shape}")
            continue
        peft = configs.get(component, _PeftConfig())
        alpha = float(file.tensor(keys["alpha"])) if "alpha" in keys else peft.alpha(module)
        factor = 1.0 if alpha is None else alpha / (math.sqrt(rank) if peft.use_rslora else rank)
        layers.append(LoraLayer(component, module, down, up, factor))
    if problems:
        raise CheckpointError(f"LoRA {where} does not fit the model:\n" + "\n".join(f"  {p}" for p in problems))
    return Lora(where, tuple(layers), short_hash(path))


def _layer_of(key: str, kohya: dict) -> tuple[str, str, str] | None:
    """(component, module key, "down" | "up" | "alpha") of a stored key, or None."""
    for pattern, factor in _FACTORS:
        match = pattern.fullmatch(key)
        if match is None:
            continue
        name = match["module"]
        if name in kohya:
            return (*kohya[name], factor)
        # diffusers' `save_attn_procs` wrote the UNet's layers unprefixed.
        prefix, component = next(((p, c) for p, c in DIFFUSERS_PREFIXES.items() if name.startswith(p)), ("", "unet"))
        module = name.removeprefix(prefix)
        if match.groupdict().get("projection"):
            module += "." + _PROCESSOR_PROJECTIONS[component][match["projection"]]
        return component, module, factor
    return None


@dataclasses.dataclass(frozen=True)
class _PeftConfig:
    """The part of a component's PEFT `LoraConfig` that scales its updates."""

    lora_alpha: float | None = None
    alpha_pattern: dict = dataclasses.field(default_factory=dict)  # module-name tail -> alpha
    use_rslora: bool = False

    def alpha(self, module: str) -> float | None:
        for pattern, alpha in self.alpha_pattern.items():
            if re.match(rf"(.*\.)?({pattern})$", module):  # as PEFT matches alpha_pattern keys
                return alpha
        return self.lora_alpha


def _peft_configs(file: SafetensorsFile) -> dict[str, _PeftConfig]:
    """{component: its PEFT config} from the configs diffusers stores in the file's metadata
    (`lora_adapter_metadata`, {"unet.lora_alpha": ..., ...}); {} without them."""
    metadata = file.metadata.get("lora_adapter_metadata")
    if not metadata:
        return {}
    fields: dict[str, dict] = {}
    for packed_key, value in json.loads(metadata).items():
        component, _, field = packed_key.partition(".")
        fields.setdefault(component, {})[field] = value
    return {
        component: _PeftConfig(config.get("lora_alpha"), config.get("alpha_pattern") or {},
                               bool(config.get("use_rslora", False)))
        for component, config in fields.items()
    }


def _torch_shape(tree: dict, path: tuple[str, ...]) -> tuple[int, ...]:
    """The PyTorch-layout shape of the parameter at `path` of a component's parameter tree."""
    for name in path:
        tree = tree[name]
    return tuple(tree.shape[a] for a in torch_axes(path, len(tree.shape)))


# ---------------------------------------------------------------------------------------------
# Applying LoRAs to parameters


def apply(base: dict, loras: list[tuple[Lora, float]], put: Callable[[np.ndarray], jax.Array]) -> dict:
    """`base` with every layer a LoRA updates replaced by W + sum(scale * factor * up @ down).

    Layers no LoRA touches are `base`'s own arrays, so `apply(base, [], put)` is `base` exactly.
    The updates run on the devices, in float32, and are cast to the parameters' dtype once (a weight
    stored in 8 bits is quantized again, with scales of its own: `quantization.Quantized.requantized`).
    """
    updates: dict[tuple[str, str], list] = {}
    for lora, scale in loras:
        if scale == 0:
            continue
        for layer in lora.layers:
            updates.setdefault((layer.component, layer.module), []).append((layer, scale))
    if not updates:
        return base
    flat = flatten(base)
    by_module = {(path[0], ".".join(path[1:-1])): path for path in flat}
    for (component, module), layer_updates in updates.items():
        path = by_module[(component, module)]
        weight = flat[path]
        downs = [put(np.ascontiguousarray(layer.down.reshape(layer.down.shape[0], -1))) for layer, _ in layer_updates]
        ups = [put(np.ascontiguousarray(layer.up.reshape(layer.up.shape[0], -1))) for layer, _ in layer_updates]
        scales = put(np.array([scale * layer.factor for layer, scale in layer_updates], np.float32))
        flat[path] = _updated(weight, downs, ups, scales, torch_axes(path, len(weight.shape)))
    return unflatten(flat)


@functools.partial(jax.jit, static_argnums=4)
def _updated(weight, downs, ups, scales, axes):
    torch_shape = tuple(weight.shape[a] for a in axes)
    delta = sum(s * (u @ d) for s, u, d in zip(scales, ups, downs, strict=True))
    flax_layout = jnp.transpose(delta.reshape(torch_shape), np.argsort(axes))
    if isinstance(weight, Quantized):  # weights stored in 8 bits: updated in float32, then stored alike again
        return weight.requantized(weight.dequantized(jnp.float32) + flax_layout)
    return (weight.astype(jnp.float32) + flax_layout).astype(weight.dtype)


def write_random(path: str | os.PathLike, spec: ModelSpec, *, rank: int = 4, seed: int = 0, dtype="float32") -> Path:
    """A random LoRA in the diffusers/PEFT format over every layer `targets` lists, whose update at
    scale 1 is about as large as the layer's weight (the tests' and the benchmark's LoRA)."""
    import safetensors.numpy

    rng, tensors = np.random.default_rng(seed), {}
    abstract = spec.abstract_params()
    for component, modules in targets(spec).items():
        for module, param_path in modules.items():
            shape = _torch_shape(abstract[component], param_path)
            down = rng.standard_normal((rank, *shape[1:])) / math.prod(shape[1:]) ** 0.5
            up = rng.standard_normal((shape[0], rank, *(1,) * (len(shape) - 2))) / rank**0.5
            tensors[f"{component}.{module}.lora_A.weight"] = down.astype(dtype)
            tensors[f"{component}.{module}.lora_B.weight"] = up.astype(dtype)
    safetensors.numpy.save_file(tensors, path)
    return Path(path)


def short_hash(path: str | os.PathLike) -> str:
    """A LoRA file's hash as webui shows it in "Lora hashes": 12 hex digits.

    For a .safetensors file: the `sshs_model_hash` that sd-scripts wrote into its metadata when there is
    one, else the SHA-256 of the bytes after the header (sd-scripts' "addnet" hash, Civitai's AutoV3).
    For another file, the SHA-256 of the whole file.
    """
    path = Path(path)
    digest = hashlib.sha256()
    with path.open("rb") as file:
        if path.suffix.lower() == ".safetensors":
            (header_length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(header_length))
            recorded = (header.get("__metadata__") or {}).get("sshs_model_hash")
            if recorded:
                return recorded[:12]
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:12]


def locate(source: str) -> Path:
    """The file of a LoRA source: a local `.safetensors` file, a Hub file "owner/name/file.safetensors",
    or a Hub repo "owner/name" (its `pytorch_lora_weights.safetensors`, diffusers' name for it)."""
    try:
        return locate_file(source, "pytorch_lora_weights.safetensors")
    except CheckpointError as e:
        raise CheckpointError(f"LoRA {e}") from e


def display_name(source: str) -> str:
    """How results, the demo and its API name a LoRA: its file's stem."""
    return Path(source).stem
