"""A separate VAE in place of a checkpoint's own, as users pick one (diffusers' `vae=`, A1111's "SD VAE").

A source is:
- a diffusers folder: `config.json` beside `diffusion_pytorch_model[.fp16].safetensors`;
- a Hub repo id of one ("madebyollin/sdxl-vae-fp16-fix"): its config, then the one weight set
  to load (`hub.download_model`);
- one `.safetensors` file, local or on the Hub ("owner/name/file.safetensors"), in diffusers' keys or
  in the original LDM autoencoder's (`encoder.down.0.block.0...`, `sdxl_vae.safetensors` and A1111's
  VAE files), with or without the `first_stage_model.` prefix of a whole checkpoint's VAE.

A folder's or repo's config replaces the checkpoint's VAE config (fp16-fix's says `force_upcast`
false); a single file runs under the checkpoint's. Either way the VAE must make the latents the
model denoises: it is checked before its weights are fetched where that can be told.
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path

from ..models.vae import VAEConfig, abstract_params, rename_key
from . import hub, single_file
from .folder import model_config, weight_files
from .spec import ModelSpec, cached_shapes
from .weights import CheckpointError, SafetensorsFile, load_params, refuse_pickled

# The prefix of the VAE in a whole checkpoint in the original layout (`single_file.PREFIXES`).
ORIGINAL_PREFIX = single_file.PREFIXES["sdxl"]["vae"]
# A key each layout has: the original autoencoder's first down block, diffusers'.
_ORIGINAL_KEY = "encoder.down.0.block.0.conv1.weight"
_DIFFUSERS_KEY = "encoder.down_blocks.0.resnets.0.conv1.weight"


@dataclasses.dataclass(frozen=True)
class VAECheckpoint:
    """A VAE ready to load: its name for people, its config, and where its weights are."""

    name: str  # the file's stem, or the folder's or repo's name
    config: VAEConfig
    files: tuple[Path, ...]
    original_prefix: str | None = None  # the original layout's key prefix ("", "first_stage_model."); None: diffusers'

    def load(self, dtype, put: Callable) -> dict:
        """The parameter tree, every key and shape checked; `put` places each array."""
        abstract = cached_shapes(abstract_params, self.config)
        if self.original_prefix is None:
            return load_params(list(self.files), abstract, dtype=dtype, rename=rename_key, put=put)
        return single_file.load_original(
            self.files[0], self.original_prefix, single_file.vae_original, self.config, abstract, dtype, put
        )


def resolve(source: str, spec: ModelSpec, *, dtype) -> VAECheckpoint:
    """The VAE `source` names (see the module's docstring), checked against `spec`'s model.

    Raises:
      CheckpointError: with the reason (not found, pickled, not a VAE, latents the model cannot
        denoise), before its weights are fetched where it can tell.
    """
    text = str(source)
    path = Path(text).expanduser()
    name = path.stem if text.endswith(".safetensors") else path.name
    refuse_pickled(text, "VAE")
    if path.is_dir():
        config = _config(path / "config.json", spec, text)
        return VAECheckpoint(name, config, tuple(weight_files(path, dtype)))
    hub_name = not text.startswith((".", "/", "~")) and all(text.split("/"))
    if text.endswith(".safetensors"):
        if path.is_file():
            file = SafetensorsFile(path)
            return VAECheckpoint(name, spec.vae, (path,), _original_prefix(file.keys(), text))
        if hub_name and text.count("/") >= 2:
            owner, repo, filename = text.split("/", 2)
            header = hub.file_header(f"{owner}/{repo}", filename)
            if header is not None:  # refuse what is no VAE before the download, where the Hub answers
                _original_prefix(header, text)
            path = hub.download_file(f"{owner}/{repo}", filename)
            return VAECheckpoint(name, spec.vae, (path,), _original_prefix(SafetensorsFile(path).keys(), text))
        raise CheckpointError(f"{text}: no such file")
    if hub_name and text.count("/") == 1 and not path.exists():
        folder, config = hub.download_model(text, dtype, lambda folder: _config(folder / "config.json", spec, text))
        return VAECheckpoint(name, config, tuple(weight_files(folder, dtype)))
    raise CheckpointError(f"{text}: not a VAE folder, a .safetensors file, or a Hub repo id (owner/name)")


def check_fits(config: VAEConfig, spec: ModelSpec, where: str) -> None:
    """Raises CheckpointError unless the VAE makes the latents the model denoises (as many channels,
    at the same scale) and this package can run the model with it."""
    theirs = (config.latent_channels, config.downscale_factor)
    ours = (spec.vae.latent_channels, spec.vae.downscale_factor)
    if theirs != ours:
        raise CheckpointError(
            f"{where}: a VAE of {theirs[0]}-channel latents at 1/{theirs[1]} scale cannot serve this model, "
            f"whose latents have {ours[0]} channels at 1/{ours[1]} scale"
        )
    dataclasses.replace(spec, vae=config).check_supported(where)


def _config(path: Path, spec: ModelSpec, where: str) -> VAEConfig:
    config = model_config(path, {"AutoencoderKL": VAEConfig}, where, "VAE")
    check_fits(config, spec, where)
    return config


def _original_prefix(keys, where: str) -> str | None:
    """The original layout's key prefix of a VAE file ("" or "first_stage_model."), or None for
    diffusers' keys, told from its keys."""
    keys = set(keys)
    if _DIFFUSERS_KEY in keys:
        return None
    prefix = next((p for p in ("", ORIGINAL_PREFIX) if p + _ORIGINAL_KEY in keys), None)
    if prefix is None:
        raise CheckpointError(f"{where}: no VAE in this file (neither {_ORIGINAL_KEY} nor {_DIFFUSERS_KEY})")
    return prefix
