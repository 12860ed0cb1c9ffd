"""A diffusers pipeline folder: its index, the weight files to read, and loading them into parameters.

    model_index.json                      which components the pipeline has
    unet/config.json, unet/*.safetensors  one folder per component, its config beside its weights
    tokenizer/vocab.json, ...             the CLIP tokenizers' files
    scheduler/scheduler_config.json

Loading checks every key and shape of every component (`sdxl.weights.load_params`).
"""

from pathlib import Path

import numpy as np

from .. import clip, vae
from ..config import read_json
from ..weights import CheckpointError, load_params

# The components whose weights a pipeline loads (a safety checker, say, is never run).
WEIGHT_COMPONENTS = ("text_encoder", "text_encoder_2", "unet", "vae")

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


def is_variant(path: Path, variant: str) -> bool:
    """Whether a weight file belongs to a variant (`diffusion_pytorch_model.fp16.safetensors`)."""
    return f".{variant}." in path.name or f".{variant}-" in path.name


def preferred_variant(dtype) -> str | None:
    """The weight variant to read for a parameter dtype: none for float32, else the fp16 files."""
    return None if np.dtype(dtype) == np.float32 else "fp16"


def weight_files(folder: Path, *, prefer_variant: str | None = "fp16") -> list[Path]:
    """The safetensors files of one component folder, choosing the `prefer_variant` files if present.

    Raises:
      CheckpointError: if the folder has no safetensors files (with a specific message when it only
        has pickled `.bin`/`.ckpt` weights, which are never loaded: unpickling runs arbitrary code).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: component folder is missing")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".ckpt", ".pt", ".pth"))
        if pickled:
            raise CheckpointError(
                f"{folder}: only pickled weights ({', '.join(pickled)}); they are never loaded because "
                "unpickling can run arbitrary code. Use a checkpoint with .safetensors files."
            )
        raise CheckpointError(f"{folder}: no .safetensors weights")
    variant_files = [f for f in files if prefer_variant and is_variant(f, prefer_variant)]
    plain_files = [f for f in files if not any(is_variant(f, v) for v in ("fp16", "bf16", "fp32"))]
    return variant_files or plain_files or files


def load_weights(folder: Path, abstract_params: dict, dtype, put) -> dict:
    """Loads every component's safetensors into a parameter tree shaped like `abstract_params`
    ({component: shapes}), checking every key and shape; `put` places each array."""
    params = {}
    for name, tree in abstract_params.items():
        rename, ignore = _KEY_RULES[name]
        files = weight_files(folder / name, prefer_variant=preferred_variant(dtype))
        params[name] = load_params(files, tree, dtype=dtype, rename=rename, ignore=ignore, put=put)
    return params
