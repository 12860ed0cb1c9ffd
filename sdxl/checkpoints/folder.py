"""A diffusers pipeline folder: its index, the weight files to read, and loading them into parameters.

    model_index.json                      which components the pipeline has
    unet/config.json, unet/*.safetensors  one folder per component, its config beside its weights
    tokenizer/vocab.json, ...             the CLIP tokenizers' files
    scheduler/scheduler_config.json

Loading checks every key and shape of every component (`sdxl.checkpoints.weights.load_params`).
"""

import re
from pathlib import Path

import numpy as np

from ..config import config_from_dict, read_json
from ..models import clip, vae
from .weights import PICKLED_SUFFIXES, CheckpointError, StoredTensor, load_params, stored_tensors

# The components whose weights a pipeline loads (a safety checker, say, is never run).
WEIGHT_COMPONENTS = ("text_encoder", "text_encoder_2", "unet", "vae")

# The weight files diffusers and transformers read, by name (sharded or not, of any variant); another
# set beside them (xinsir's `diffusion_pytorch_model_promax.safetensors`) is read only when named.
STANDARD_WEIGHT_NAMES = ("diffusion_pytorch_model", "model")

# Per component: how a stored key maps to the module's name, and the stored buffers to skip.
_KEY_RULES = {
    "unet": (lambda key: key, ()),
    "vae": (vae.rename_key, ()),
    "text_encoder": (clip.rename_key, clip.IGNORED_KEYS),
    "text_encoder_2": (clip.rename_key, clip.IGNORED_KEYS),
}


def read_model_index(folder: Path) -> dict:
    index = Path(folder) / "model_index.json"
    if not index.is_file():
        raise CheckpointError(f"{folder}: no model_index.json; not a diffusers pipeline folder")
    return read_json(index)


def weight_variant(filename: str) -> str | None:
    """The variant a safetensors file belongs to: "fp16" for `diffusion_pytorch_model.fp16.safetensors`,
    "non_ema" for `diffusion_pytorch_model.non_ema.safetensors`, None for the plain files (also when
    sharded: `model-00001-of-00002.safetensors`, `model.fp16-00001-of-00002.safetensors` is "fp16")."""
    return _weight_set(filename)[1]


def _weight_set(filename: str) -> tuple[str, str | None]:
    """(name, variant) of the weight set a safetensors file is (one of the shards of)."""
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", filename.removesuffix(".safetensors"))
    name, _, variant = stem.partition(".")
    return name, variant or None


def preferred_variant(dtype) -> str | None:
    """The weight variant to read for a parameter dtype: none for float32, else the fp16 files."""
    return None if np.dtype(dtype) == np.float32 else "fp16"


def choose_weight_files(filenames: list[str], dtype, where: str) -> list[str]:
    """Exactly one set of weights of one component: the fp16 variant for a 16-bit `dtype` where the
    component has one, else the plain files; the fp16 files for float32 only when there are no plain
    ones. Other variants (`ema`, `non_ema`, `bf16`, ...) are never read. Where a variant has several
    sets under different names, the one named as diffusers names its weights (`STANDARD_WEIGHT_NAMES`).

    Raises:
      CheckpointError: `where` (the component) has neither plain nor fp16 safetensors weights, or
        several sets of which none is named as diffusers names them.
    """
    weights = sorted(f for f in filenames if f.endswith(".safetensors"))
    by_variant = {}
    for name in weights:
        by_variant.setdefault(weight_variant(name), []).append(name)
    preferred = preferred_variant(dtype)
    for variant in (preferred, None, "fp16"):
        if variant in by_variant:
            return _one_set(by_variant[variant], where)
    pickled = sorted(f for f in filenames if Path(f).suffix in PICKLED_SUFFIXES)
    if pickled:
        raise CheckpointError(
            f"{where}: only pickled weights ({', '.join(pickled)}); they are never loaded because "
            "unpickling can run arbitrary code. Use a checkpoint with .safetensors files."
        )
    if weights:
        raise CheckpointError(f"{where}: no plain or fp16 safetensors weights, only {', '.join(weights)}")
    raise CheckpointError(f"{where}: no .safetensors weights")


def _one_set(filenames: list[str], where: str) -> list[str]:
    """The files of one weight set (a file, or its shards) among `filenames`, all of one variant."""
    names = {_weight_set(f)[0] for f in filenames}
    if len(names) == 1:
        return filenames
    standard = [name for name in STANDARD_WEIGHT_NAMES if name in names]
    if not standard:
        raise CheckpointError(f"{where}: several sets of weights ({', '.join(filenames)}); name the file to load")
    return [f for f in filenames if _weight_set(f)[0] == standard[0]]


def model_config(path: Path, classes: dict[str, type], where: str, what: str):
    """A one-model folder's config (a ControlNet's, a VAE's `config.json`) as the class its
    `_class_name` names among `classes`, the first where it names none.

    Raises:
      CheckpointError: the config is missing or unreadable, of another class, or holds values the
        class refuses; `where` and `what` (the kind of model) say which.
    """
    try:
        values = read_json(path)
    except FileNotFoundError as e:
        raise CheckpointError(f"{where}: no config.json; not a diffusers {what} folder") from e
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    kind = values.get("_class_name", next(iter(classes)))
    if kind not in classes:
        raise CheckpointError(f"{where}: a {kind}; only {' and '.join(classes)} {what}s are supported")
    try:
        return config_from_dict(classes[kind], values)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from e


def weight_files(folder: Path, dtype) -> list[Path]:
    """The safetensors files of one component folder to load for `dtype` (`choose_weight_files`).

    Raises:
      CheckpointError: the folder is missing or has no weights to load.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: component folder is missing")
    names = [p.name for p in folder.iterdir() if p.is_file()]
    return [folder / name for name in choose_weight_files(names, dtype, str(folder))]


def stored_weights(folder: Path, component: str, dtype) -> dict[str, StoredTensor]:
    """{module key: StoredTensor} of one component's weight files (`weight_files`) in `folder`."""
    rename, ignore = _KEY_RULES[component]
    return stored_tensors(weight_files(folder / component, dtype), rename, ignore)


def load_weights(folder: Path, abstract_params: dict, dtype, put) -> dict:
    """Loads every component's safetensors into a parameter tree shaped like `abstract_params`
    ({component: shapes}), checking every key and shape; `put` places each array."""
    params = {}
    for name, tree in abstract_params.items():
        rename, ignore = _KEY_RULES[name]
        files = weight_files(folder / name, dtype)
        params[name] = load_params(files, tree, dtype=dtype, rename=rename, ignore=ignore, put=put)
    return params
