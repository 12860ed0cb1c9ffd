"""Checkpoints: where a model name leads, what its configs say, and loading its weights.

- `spec.py`: `ModelSpec`, everything static about a checkpoint (its configs), and its parameter shapes.
- `folder.py`: the diffusers pipeline folder: its index, the weight files to read, and loading them
  with every key and shape checked.
- `single_file.py`: one safetensors file in the original (SGM / A1111) layout, mapped key by key.
- `hub.py`: the Hugging Face Hub: downloading what a pipeline reads, or finding it in the cache.
- `random_models.py`: the built-in random models ("tiny", "tiny-sd1", "medium", published configs).
- `weights.py`: safetensors files read and written, every key and shape checked.
- `tokenizer.py`: a checkpoint's CLIP tokenizers.
- `lora.py`: LoRA files in every shared format, read and applied to the weights.
- `vaes.py`: a separate VAE in place of the checkpoint's own.
- `shapes.py`: the built-in `shapes` model's world: its captions, pictures and configs.
- `upscalers.py`: ESRGAN and Real-ESRGAN upscaler files (safetensors, or PyTorch's read without it).

`resolve` turns whatever a user names (a folder, a single file, a built-in name, a Hub repo id or
file) into a `Checkpoint`: its spec, the folder of its configs and tokenizers, and its weights.
"""

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from ..models import previews
from . import hub, random_models, single_file, vaes
from .folder import load_weights
from .hub import HubUnavailableError
from .random_models import BUILTIN_CONFIGS
from .spec import ModelSpec
from .weights import CheckpointError, SafetensorsFile, load_params

# Models trained in this project and shipped with it (their model cards say how): their folders, and
# the projections of their latents to RGB that their live previews use (`sdxl.models.previews`).
TRAINED_MODELS = {"shapes": Path(__file__).parents[2] / "assets" / "shapes"}
TRAINED_PREVIEW_FACTORS = {TRAINED_MODELS["shapes"]: previews.SHAPES_FACTORS}

__all__ = [
    "BUILTIN_CONFIGS",
    "Checkpoint",
    "CheckpointError",
    "HubUnavailableError",
    "ModelSpec",
    "load_weights",
    "locate",
    "locate_file",
    "resolve",
]


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A model ready to load: what it is, where its configs and tokenizers are, where its weights are."""

    spec: ModelSpec
    folder: Path  # the diffusers folder of its configs and `tokenizer*/` files
    single_file: Path | None = None  # the weights, when not in `folder`
    family: str | None = None  # the single file's ("sdxl", "sd1", "sd2")
    unet_file: Path | None = None  # a UNet's weights (diffusers keys) replacing the folder's
    vae: vaes.VAECheckpoint | None = None  # a VAE replacing its own; `spec.vae` is then this VAE's config

    @property
    def preview_factors(self) -> tuple:
        """How its live previews project latents to RGB (`sdxl.models.previews`): a trained model's own,
        else its family's."""
        return TRAINED_PREVIEW_FACTORS.get(self.folder) or previews.factors_for(self.spec)

    def load(self, dtype, put: Callable) -> dict:
        """The parameter tree, every key and shape checked; `put` places each array."""
        replaced = {"unet": self.unet_file, "vae": self.vae}
        without = tuple(component for component, replacement in replaced.items() if replacement is not None)
        if self.single_file is not None:
            params = single_file.load(self.single_file, self.family, self.spec, dtype, put, without)
        else:
            abstract = self.spec.abstract_params()
            params = load_weights(self.folder, {k: v for k, v in abstract.items() if k not in without}, dtype, put)
        if self.unet_file is not None:
            params["unet"] = load_params([self.unet_file], self.spec.abstract_params()["unet"], dtype=dtype, put=put)
        if self.vae is not None:
            params["vae"] = self.vae.load(dtype, put)
        return params


def resolve(
    name: str | os.PathLike,
    *,
    dtype="bfloat16",
    config: str | os.PathLike | None = None,
    scheduler: dict | None = None,
    unet: str | os.PathLike | None = None,
    vae: str | os.PathLike | None = None,
) -> Checkpoint:
    """The checkpoint a user names: a diffusers folder, a built-in name, a Hub repo id
    ("owner/name"), a single `.safetensors` file in the original layout, or a Hub file
    ("owner/name/file.safetensors").

    Args:
      dtype: the parameters' dtype, which picks the weight variant to fetch from the Hub.
      config: for a single file: a built-in config name ("sdxl-base-1.0", "sd-1.5", "sd-2.1",
        "sd-2.1-base") or a diffusers folder whose configs and tokenizers to use; by default the
        family's published one (`single_file.DEFAULT_CONFIGS`), as diffusers' `from_single_file`.
      scheduler: fields replacing those of the scheduler config (`ModelSpec.from_folder`).
      unet: a UNet's weights in diffusers' keys (SDXL-Lightning's `sdxl_lightning_4step_unet.safetensors`,
        say) that replace the checkpoint's, as a local file or a Hub file "owner/name/file.safetensors";
        the checkpoint's own UNet weights are then not fetched. Only for diffusers folders and repos.
      vae: a VAE that replaces the checkpoint's (`sdxl.checkpoints.vaes`): a diffusers folder, a Hub
        repo id, or a .safetensors file, local or "owner/name/file.safetensors"; the checkpoint's own
        VAE weights are then not fetched or read.

    Raises:
      CheckpointError: with the reason, before any weights are fetched where it can tell.
    """
    without = () if vae is None else ("vae",)
    checkpoint = _checkpoint(str(name), dtype, config, scheduler, unet, without)
    if vae is None:
        return checkpoint
    replacement = vaes.resolve(str(vae), checkpoint.spec, dtype=dtype)
    spec = dataclasses.replace(checkpoint.spec, vae=replacement.config)
    return dataclasses.replace(checkpoint, spec=spec, vae=replacement)


def _checkpoint(text: str, dtype, config, scheduler: dict | None, unet, without: tuple[str, ...]) -> Checkpoint:
    """`resolve` but for the VAE; the weights of the components in `without` are not fetched."""
    if unet is not None:
        if text.endswith(".safetensors"):
            raise CheckpointError(f"{text}: unet= replaces a diffusers folder's or repo's UNet, not a single file's")
        unet_file = locate_file(str(unet))
        folder = locate(text, dtype=dtype, scheduler=scheduler, without=("unet", *without))
        return Checkpoint(ModelSpec.from_folder(folder, scheduler), folder, unet_file=unet_file)
    if text.endswith(".safetensors"):
        path = Path(text).expanduser()
        if not path.is_file() and not text.startswith((".", "/", "~")) and text.count("/") >= 2:
            owner, repo, filename = text.split("/", 2)
            # The family from the file's header alone (a ranged request), so that a file this
            # package cannot run is refused before gigabytes are fetched.
            header = hub.file_header(f"{owner}/{repo}", filename)
            if header is not None:
                single_file.detect_family(header, text)
            path = hub.download_file(f"{owner}/{repo}", filename)
        return _single_file(path, config, scheduler)
    if config is not None:
        raise CheckpointError(f"{text}: config= is for single-file checkpoints; a folder has its own configs")
    folder = locate(text, dtype=dtype, scheduler=scheduler, without=without)
    return Checkpoint(ModelSpec.from_folder(folder, scheduler), folder)


def _single_file(path: Path, config, scheduler: dict | None) -> Checkpoint:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    file = SafetensorsFile(path)
    family = single_file.detect_family({key: file.shape(key) for key in file.keys()}, str(path))
    config = config or single_file.DEFAULT_CONFIGS[family]
    folder = BUILTIN_CONFIGS / str(config) if (BUILTIN_CONFIGS / str(config)).is_dir() else Path(config).expanduser()
    if not folder.is_dir():
        known = ", ".join(sorted(p.parent.name for p in BUILTIN_CONFIGS.glob("*/model_index.json")))
        raise CheckpointError(f"config {config}: neither a built-in config ({known}) nor a diffusers folder")
    # What the file says of its sampling, unless the caller's fields say otherwise.
    detected = single_file.sampling_fields(file.keys(), file.metadata, str(path))
    spec = ModelSpec.from_folder(folder, detected | (scheduler or {}))
    if single_file.family_of(spec) != family:
        raise CheckpointError(f"{path} is an {family.upper()} checkpoint, but config {config} describes another family")
    return Checkpoint(spec, folder, path, family)


def locate_file(source: str, default_filename: str | None = None) -> Path:
    """A weights file: a local file, a Hub file "owner/name/path/in/repo", or, with
    `default_filename`, the file of that name in a Hub repo "owner/name".

    Raises:
      CheckpointError: no such file, or the Hub file cannot be had.
    """
    path = Path(source).expanduser()
    if path.is_file():
        return path
    parts = source.split("/")
    hub_name = len(parts) >= 2 and all(parts) and not source.startswith((".", "/", "~"))
    if hub_name and len(parts) >= 3:
        return hub.download_file("/".join(parts[:2]), "/".join(parts[2:]))
    if hub_name and default_filename:
        return hub.download_file(source, default_filename)
    raise CheckpointError(f"{source}: no such file")


def locate(
    name_or_path: str | os.PathLike, *, dtype="bfloat16", scheduler: dict | None = None, without: tuple[str, ...] = ()
) -> Path:
    """The local folder of a checkpoint given as a folder, a built-in name, or a Hub repo id.

    Built-in names are the trained `shapes` model (`assets/shapes`), the random models that
    `random_models.ensure_checkpoint` writes on first use ("tiny", "tiny-sd1", "medium") and the
    configs-only folders in `BUILTIN_CONFIGS`. From a Hub
    repo, the weights to load in `dtype` are fetched (`hub.download`), but those of the components
    in `without`.

    Raises:
      CheckpointError: the name is none of these, or the Hub repo cannot be had
        (`HubUnavailableError` when it is not cached and the Hub is out of reach).
    """
    name = str(name_or_path)
    if name in TRAINED_MODELS:
        return TRAINED_MODELS[name]
    if name in random_models.ON_DEMAND:
        return random_models.ensure_checkpoint(name)
    if (BUILTIN_CONFIGS / name).is_dir():
        return BUILTIN_CONFIGS / name
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise CheckpointError(f"{name}: not a checkpoint folder, a built-in model, or a Hub repo id (owner/name)")
    return hub.download(name, dtype, scheduler, without)
