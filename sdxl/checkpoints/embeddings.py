"""Textual-inversion embeddings read from safetensors files, in the layouts webui (1.10) loads.

- SDXL: two tensors, `clip_l` [n, 768] for the first text encoder and `clip_g` [n, 1280] for the second.
- SD 1.x/2.x: one tensor, whatever its key: `emb_params` (kohya's sd-scripts), `string_to_param.*`
  (webui's own layout saved as safetensors) or a diffusers concept's token; [n, C], or [C] for one vector.

Pickled `.pt` and `.bin` embeddings are refused (unpickling can run arbitrary code). An embedding's name,
the word that stands for its vectors in a prompt, is its file's stem as in webui, or one given.
"""

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import hashes
from .spec import ModelSpec
from .weights import CheckpointError, SafetensorsFile, refuse_pickled

SDXL_KEYS = ("clip_l", "clip_g")  # one tensor per text encoder, in the encoders' order


@dataclasses.dataclass(frozen=True, eq=False)
class Embedding:
    """An embedding's vectors for each of a model's text encoders, [n, C_e] float32 each."""

    name: str
    vectors: tuple[np.ndarray, ...]
    short_hash: str  # as webui's "TI hashes" show it: the file's SHA-256, 12 hex digits
    path: Path

    @property
    def count(self) -> int:
        """How many token positions it takes in a prompt."""
        return self.vectors[0].shape[0]


def read(path: str | os.PathLike, spec: ModelSpec, token: str | None = None) -> Embedding:
    """The embedding in a safetensors file, its vectors checked against `spec`'s text encoders.

    Raises:
      CheckpointError: a pickled file, a missing one, a layout this model does not take (SDXL's on an SD 1.x
        model or the reverse), or vectors of another width.
    """
    path = Path(path)
    refuse_pickled(str(path), "embedding")
    if not path.is_file():
        raise CheckpointError(f"embedding {path}: no such file")
    name = path.stem if token is None else token
    if not name.strip():
        raise CheckpointError(f"embedding {path}: its token is empty")
    file = SafetensorsFile(path)
    keys = sorted(file.keys())
    widths = tuple(config.hidden_size for config in spec.text_encoders)
    if len(widths) == 2:
        if not set(SDXL_KEYS) <= set(keys):
            raise CheckpointError(
                f"embedding {path}: not an SDXL embedding (it has {', '.join(keys) or 'no tensors'}; an SDXL one "
                "has clip_l and clip_g)"
            )
        vectors = tuple(_matrix(file, key) for key in SDXL_KEYS)
    elif len(keys) != 1:
        raise CheckpointError(
            f"embedding {path}: one tensor expected for this model's one text encoder, found "
            f"{', '.join(keys) or 'none'}"
        )
    else:
        vectors = (_matrix(file, keys[0]),)
    found = tuple(v.shape[1] for v in vectors)
    if found != widths or len({v.shape[0] for v in vectors}) != 1 or not vectors[0].shape[0]:
        shapes = ", ".join(str(v.shape) for v in vectors)
        raise CheckpointError(
            f"embedding {path}: vectors of shape {shapes} do not fit this model's text encoders (width "
            f"{' and '.join(map(str, widths))})"
        )
    return Embedding(name, vectors, short_hash(path), path)


def _matrix(file: SafetensorsFile, key: str) -> np.ndarray:
    """A tensor as [n, C] float32; a single vector [C] is one row."""
    tensor = file.tensor(key).astype(np.float32)
    if tensor.ndim not in (1, 2):
        raise CheckpointError(f"embedding {file.path}: tensor {key} has shape {tensor.shape}, not [vectors, width]")
    return tensor.reshape(-1, tensor.shape[-1])


def short_hash(path: Path) -> str:
    """webui's `Embedding.shorthash`: the first 12 hex digits of the whole file's SHA-256."""
    return hashes.sha256(path)[:12]


ROW_BLOCK = 64  # the vector tables grow in blocks of this many rows, so that most loads keep their shape


def table(embeddings: Sequence[Embedding], spec: ModelSpec) -> tuple[np.ndarray, ...]:
    """One [R, C_e] float32 table per text encoder: the embeddings' vectors one after another, in order,
    then zeros to R, the next multiple of `ROW_BLOCK` (0 rows for none)."""
    count = sum(embedding.count for embedding in embeddings)
    rows = -(-count // ROW_BLOCK) * ROW_BLOCK
    tables = []
    for e, config in enumerate(spec.text_encoders):
        vectors = [embedding.vectors[e] for embedding in embeddings]
        filled = np.concatenate(vectors) if vectors else np.zeros((0, config.hidden_size), np.float32)
        tables.append(np.pad(filled, ((0, rows - count), (0, 0))))
    return tuple(tables)
