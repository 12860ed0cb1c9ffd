"""Finding a diffusers-format checkpoint: a local folder, a built-in name, or a Hugging Face Hub repo."""

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from .config import read_json
from .weights import CheckpointError

BUILTIN_CONFIGS = Path(__file__).parent / "configs"

# What a pipeline needs from a Hub repo: configs, tokenizers and safetensors weights. Pickled
# weights, ONNX/OpenVINO exports and single-file checkpoints are never downloaded.
_HUB_CONFIG_PATTERNS = ["model_index.json", "*/config.json", "*/scheduler_config.json", "tokenizer*/*"]


class HubUnavailableError(CheckpointError):
    """A Hub checkpoint is not in the local cache and the Hub cannot be reached (or is switched off)."""


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub endpoint accepts a TCP connection: a quick check, so that a machine without
    network fails in seconds instead of waiting out huggingface_hub's retries."""
    import huggingface_hub

    url = urlparse(huggingface_hub.constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _is_variant(path: Path, variant: str) -> bool:
    return f".{variant}." in path.name or f".{variant}-" in path.name


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
    variant_files = [f for f in files if prefer_variant and _is_variant(f, prefer_variant)]
    plain_files = [f for f in files if not any(_is_variant(f, v) for v in ("fp16", "bf16", "fp32"))]
    return variant_files or plain_files or files


# The components whose weights a pipeline loads (a safety checker, say, is never run).
WEIGHT_COMPONENTS = ("text_encoder", "text_encoder_2", "unet", "vae")


def _hub_weight_patterns(repo_files: list[str], prefer_variant: str | None) -> list[str]:
    """Per component folder: the variant's safetensors when the repo has them, else the plain ones."""
    patterns = []
    for folder in WEIGHT_COMPONENTS:
        names = [Path(f) for f in repo_files if f.startswith(folder + "/") and f.endswith(".safetensors")]
        if prefer_variant and any(_is_variant(n, prefer_variant) for n in names):
            patterns.append(f"{folder}/*.{prefer_variant}*.safetensors")
        else:
            patterns += [f"{folder}/{n.name}" for n in names if not _is_variant(n, "fp16")]
    return patterns


def download(repo_id: str, *, prefer_variant: str | None = "fp16") -> Path:
    """Fetches the files a pipeline needs from the Hub into the user's HF cache (honours HF_HUB_OFFLINE)."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    if huggingface_hub.constants.HF_HUB_OFFLINE or not hub_reachable():
        try:
            # Whatever an earlier online run cached; weight_files() then picks the variant.
            return Path(huggingface_hub.snapshot_download(repo_id, local_files_only=True))
        except LocalEntryNotFoundError as e:
            raise HubUnavailableError(
                f"{repo_id}: not in the local Hugging Face cache, and the Hub is "
                f"{'switched off (HF_HUB_OFFLINE=1)' if huggingface_hub.constants.HF_HUB_OFFLINE else 'unreachable'}"
            ) from e
    try:
        repo_files = huggingface_hub.list_repo_files(repo_id)
        patterns = _HUB_CONFIG_PATTERNS + _hub_weight_patterns(repo_files, prefer_variant)
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # a missing repo, no access, a dropped connection: all end here for the caller
        reason = f"{type(e).__name__}: {e}"
        raise CheckpointError(f"{repo_id}: could not download from the Hugging Face Hub ({reason})") from e


def resolve(name_or_path: str | os.PathLike, *, prefer_variant: str | None = "fp16") -> Path:
    """The local folder of a checkpoint given as a folder, a built-in name, or a Hub repo id.

    Built-in names are the random tiny models ("tiny", "tiny-sd1"), written on first use, and the
    configs-only folders in `BUILTIN_CONFIGS`.
    """
    from . import tiny

    name = str(name_or_path)
    if name in tiny.MODELS:
        return tiny.ensure_checkpoint(name)
    if (BUILTIN_CONFIGS / name).is_dir():
        return BUILTIN_CONFIGS / name
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise CheckpointError(f"{name}: not a checkpoint folder, a built-in model, or a Hub repo id (owner/name)")
    return download(name, prefer_variant=prefer_variant)


def read_model_index(folder: Path) -> dict:
    index = Path(folder) / "model_index.json"
    if not index.is_file():
        raise CheckpointError(f"{folder}: no model_index.json; not a diffusers pipeline folder")
    return read_json(index)
