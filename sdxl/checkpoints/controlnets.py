"""ControlNets: where a ControlNet source leads, whether it can steer the model, and its weights.

A source is what diffusers' `ControlNetModel.from_pretrained` and `from_single_file` take:
- a diffusers folder: `config.json` beside `diffusion_pytorch_model[.fp16].safetensors`;
- a Hub repo id of one ("diffusers/controlnet-canny-sdxl-1.0", "lllyasviel/control_v11p_sd15_canny");
- one `.safetensors` file, local or on the Hub ("owner/name/file.safetensors"): SD 1.5's ControlNets
  in the original layout (`control_v11p_sd15_canny.safetensors`: `input_hint_block`, `zero_convs`,
  with or without a `control_model.` prefix), or a diffusers-layout file, with the `config.json`
  beside it or, without one, SDXL's published ControlNet config (as A1111 users hold
  `diffusers_xl_canny_full.safetensors`).

Both of diffusers' kinds load: `ControlNetModel` and `ControlNetUnionModel` (`sdxl.models.controlnet_union`,
SDXL only). xinsir's Union repo holds two: `diffusion_pytorch_model.safetensors` with `config.json`
(6 modes), which its folder or repo id loads, and `diffusion_pytorch_model_promax.safetensors` with
`config_promax.json` (8 modes), which loads when the file is named: a file `<name>_<suffix>.safetensors`
takes `config_<suffix>.json` beside it where there is one.

Its config is read, and checked against the model it is to steer, before any weights are fetched.
Pickled files (`.pth`, `.bin`, `.ckpt`) are refused: unpickling can run arbitrary code.
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path

from ..models.controlnet import ControlNetConfig, abstract_params
from ..models.controlnet_union import ControlNetUnionConfig, rename_key
from . import hub, single_file
from .folder import model_config, weight_files
from .random_models import BUILTIN_CONFIGS
from .spec import ModelSpec, cached_shapes
from .weights import CheckpointError, SafetensorsFile, load_params, refuse_pickled

# The configs of ControlNet files that come without one, by family (see `sdxl/configs/README.md`).
DEFAULT_CONFIGS = {"sd1": "controlnet-sd-1.5", "sdxl": "controlnet-sdxl-1.0"}
# A key each layout has: the original's conditioning embedding, diffusers'.
_ORIGINAL_KEY = "input_hint_block.0.weight"
_DIFFUSERS_KEY = "controlnet_cond_embedding.conv_in.weight"
_ORIGINAL_PREFIX = "control_model."
# diffusers' ControlNet kinds, by the `_class_name` of their config.json.
CONFIG_CLASSES = {"ControlNetModel": ControlNetConfig, "ControlNetUnionModel": ControlNetUnionConfig}
_UNION_KEY = "task_embedding"  # a ControlNet Union's [modes, C] tensor
_WEIGHTS_STEM = "diffusion_pytorch_model"


@dataclasses.dataclass(frozen=True)
class ControlNetCheckpoint:
    """A ControlNet ready to load: its config and where its weights are."""

    name: str  # the source as given
    config: ControlNetConfig
    files: tuple[Path, ...]
    original_prefix: str | None = None  # the original layout's key prefix; None: diffusers' keys

    def load(self, dtype, put: Callable) -> dict:
        """The parameter tree, every key and shape checked; `put` places each array."""
        abstract = cached_shapes(abstract_params, self.config)
        if self.original_prefix is None:
            rename = rename_key if isinstance(self.config, ControlNetUnionConfig) else lambda key: key
            return load_params(list(self.files), abstract, dtype=dtype, rename=rename, put=put)
        return single_file.load_original(
            self.files[0], self.original_prefix, single_file.controlnet_original, self.config, abstract, dtype, put
        )


def resolve(source: str, spec: ModelSpec, *, dtype) -> ControlNetCheckpoint:
    """The ControlNet `source` names (see the module's docstring), checked against `spec`'s model.

    Raises:
      CheckpointError: with the reason (not found, pickled, another family, a kind this package
        cannot run), before its weights are fetched where it can tell.
    """
    text = str(source)
    path = Path(text).expanduser()
    refuse_pickled(text, "ControlNet")
    if path.is_dir():
        config = _config(path / "config.json", spec, text)
        return ControlNetCheckpoint(text, config, tuple(weight_files(path, dtype)))
    hub_name = not text.startswith((".", "/", "~")) and all(text.split("/"))
    if text.endswith(".safetensors"):
        if path.is_file():
            return _single_file(text, path, _header(path), spec, path.parent)
        if hub_name and text.count("/") >= 2:
            owner, repo, filename = text.split("/", 2)
            header, configs = hub.file_header(f"{owner}/{repo}", filename), None
            if header is not None:  # refuse before the download where the Hub answers
                configs = _hub_config_folder(f"{owner}/{repo}", filename) if _UNION_KEY in header else None
                _single_file(text, None, header, spec, configs)
            path = hub.download_file(f"{owner}/{repo}", filename)
            header = _header(path)
            if _UNION_KEY in header and configs is None:  # a Union's config beside it (`_config_names`)
                _hub_config_folder(f"{owner}/{repo}", filename)
            return _single_file(text, path, header, spec, path.parent)
        raise CheckpointError(f"{text}: no such file")
    if hub_name and text.count("/") == 1 and not path.exists():
        folder, config = hub.download_model(text, dtype, lambda folder: _config(folder / "config.json", spec, text))
        return ControlNetCheckpoint(text, config, tuple(weight_files(folder, dtype)))
    raise CheckpointError(f"{text}: not a ControlNet folder, a .safetensors file, or a Hub repo id (owner/name)")


def family_name(config: ControlNetConfig) -> str:
    """Which models a ControlNet steers, for people: SDXL, or by its text width SD 1.x or 2.x."""
    if config.addition_embed_type == "text_time":
        return "SDXL"
    return {768: "SD 1.x", 1024: "SD 2.x"}.get(config.cross_attention_dim, "SD 1.x/2.x")


def check_fits(config: ControlNetConfig, spec: ModelSpec, where: str) -> None:
    """Raises CheckpointError unless the ControlNet's residuals fit the model's UNet, named by family
    where they differ (an SD 1.5 ControlNet for an SDXL model, say)."""
    if (config.addition_embed_type == "text_time") != spec.is_sdxl:
        model = "SDXL" if spec.is_sdxl else "SD 1.x/2.x"
        raise CheckpointError(f"{where} is an {family_name(config)} ControlNet; it cannot steer this {model} model")
    unet = spec.unet
    checks = {
        "text width": (config.cross_attention_dim, unet.cross_attention_dim),
        "UNet widths": (config.block_out_channels, unet.block_out_channels),
        "layers per block": (config.layers_per_block, unet.layers_per_block),
        "latent channels": (config.in_channels, spec.vae.latent_channels),
        "added conditioning": (
            config.projection_class_embeddings_input_dim, unet.projection_class_embeddings_input_dim
        ),
        "image downscaling": (config.downscale_factor, spec.vae.downscale_factor),
    }
    for what, (theirs, ours) in checks.items():
        if theirs != ours:
            raise CheckpointError(
                f"{where} ({family_name(config)}) does not fit this model: its {what} is {theirs}, the model's {ours}"
            )


def _config(path: Path, spec: ModelSpec, where: str) -> ControlNetConfig:
    config = model_config(path, CONFIG_CLASSES, where, "ControlNet")
    check_fits(config, spec, where)
    return config


def _header(path: Path) -> dict[str, tuple[int, ...]]:
    file = SafetensorsFile(path)
    return {key: file.shape(key) for key in file.keys()}


def _single_file(
    where: str, path: Path | None, header: dict[str, tuple[int, ...]], spec: ModelSpec, folder: Path | None
) -> ControlNetCheckpoint:
    """A one-file ControlNet, its layout and config told from its keys ({key: shape}); `path` None
    checks the header alone."""
    original = next((k.removesuffix(_ORIGINAL_KEY) for k in header if k.endswith(_ORIGINAL_KEY)), None)
    if original not in (None, "", _ORIGINAL_PREFIX) or (original is None and _DIFFUSERS_KEY not in header):
        raise CheckpointError(f"{where}: no ControlNet in this file (neither {_ORIGINAL_KEY} nor {_DIFFUSERS_KEY})")
    if original is not None and any("label_emb." in k for k in header):
        raise CheckpointError(
            f"{where}: an SDXL ControlNet in the original layout is not supported; use its diffusers folder or repo"
        )
    beside = _config_beside(folder, where)
    if beside is not None:
        config = _config(beside, spec, where)
    elif _UNION_KEY in header:
        raise CheckpointError(
            f"{where}: a ControlNet Union with no config beside it to say its modes; put its config.json "
            "beside it (xinsir's diffusion_pytorch_model_promax.safetensors takes config_promax.json)"
        )
    else:
        family = "sdxl" if any(k.startswith("add_embedding.") for k in header) else _context_family(header)
        if family not in DEFAULT_CONFIGS:
            what = "an SD 2.x ControlNet" if family == "sd2" else "a ControlNet of no known family"
            raise CheckpointError(f"{where}: {what}, with no config.json beside it to say its architecture")
        config = _config(BUILTIN_CONFIGS / DEFAULT_CONFIGS[family] / "config.json", spec, where)
    modes = header[_UNION_KEY][0] if _UNION_KEY in header else None
    if modes is not None and modes != getattr(config, "num_control_type", None):
        raise CheckpointError(
            f"{where}: a ControlNet Union of {modes} modes, but its config ({beside.name}) is not one of "
            f"{modes}; put the config that came with this file beside it"
        )
    return ControlNetCheckpoint(where, config, () if path is None else (path,), original)


def _config_names(where: str) -> list[str]:
    """The configs a weight file takes, first found first: `config_<suffix>.json` for
    `diffusion_pytorch_model_<suffix>.safetensors` (xinsir's ProMax), then `config.json`."""
    stem = where.rpartition("/")[2].removesuffix(".safetensors")
    suffix = stem.removeprefix(_WEIGHTS_STEM).lstrip("._-") if stem.startswith(_WEIGHTS_STEM) else ""
    return [f"config_{suffix}.json", "config.json"] if suffix else ["config.json"]


def _config_beside(folder: Path | None, where: str) -> Path | None:
    if folder is None:
        return None
    return next((folder / name for name in _config_names(where) if (folder / name).is_file()), None)


def _hub_config_folder(repo_id: str, filename: str) -> Path | None:
    """The local folder of the config the Hub holds beside `filename` (`_config_names`), fetched; None
    when there is none."""
    directory = filename.rpartition("/")[0]
    for name in _config_names(filename):
        try:
            return hub.download_file(repo_id, f"{directory}/{name}" if directory else name).parent
        except CheckpointError:
            continue
    return None


def _context_family(header: dict[str, tuple[int, ...]]) -> str | None:
    """"sd1" or "sd2" from the width of the text a cross-attention layer reads."""
    widths = {shape[1] for key, shape in header.items() if key.endswith("attn2.to_k.weight")}
    return {768: "sd1", 1024: "sd2"}.get(widths.pop()) if len(widths) == 1 else None
