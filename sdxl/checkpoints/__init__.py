"""Checkpoints: where a model name leads, what its configs say, and loading its weights.

- `spec.py`: `ModelSpec`, everything static about a checkpoint (its configs), and its parameter shapes.
- `folder.py`: the diffusers pipeline folder: its index, the weight files to read, and loading them
  with every key and shape checked.
- `hub.py`: the Hugging Face Hub: downloading what a pipeline reads, or finding it in the cache.
- `random_models.py`: the built-in random models ("tiny", "tiny-sd1", "medium", published configs).

`locate` turns whatever a user names (a folder, a built-in name, a Hub repo id) into a folder.
"""

import os
from pathlib import Path

from ..weights import CheckpointError
from . import hub, random_models
from .folder import load_weights
from .hub import HubUnavailableError
from .random_models import BUILTIN_CONFIGS
from .spec import ModelSpec

__all__ = [
    "BUILTIN_CONFIGS",
    "CheckpointError",
    "HubUnavailableError",
    "ModelSpec",
    "load_weights",
    "locate",
]


def locate(name_or_path: str | os.PathLike, *, dtype="bfloat16") -> Path:
    """The local folder of a checkpoint given as a folder, a built-in name, or a Hub repo id.

    Built-in names are the random models that `random_models.ensure_checkpoint` writes on first use
    ("tiny", "tiny-sd1", "medium") and the configs-only folders in `BUILTIN_CONFIGS`. From a Hub
    repo, the weights to load in `dtype` are fetched (`hub.download`).

    Raises:
      CheckpointError: the name is none of these, or the Hub repo cannot be had
        (`HubUnavailableError` when it is not cached and the Hub is out of reach).
    """
    name = str(name_or_path)
    if name in random_models.ON_DEMAND:
        return random_models.ensure_checkpoint(name)
    if (BUILTIN_CONFIGS / name).is_dir():
        return BUILTIN_CONFIGS / name
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise CheckpointError(f"{name}: not a checkpoint folder, a built-in model, or a Hub repo id (owner/name)")
    return hub.download(name, dtype)
