"""The Hugging Face Hub: downloading exactly the files a pipeline reads, or finding them in the cache."""

import socket
from pathlib import Path
from urllib.parse import urlparse

from ..weights import CheckpointError
from .folder import WEIGHT_COMPONENTS, is_variant

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


def _hub_weight_patterns(repo_files: list[str], prefer_variant: str | None) -> list[str]:
    """Per component folder: the variant's safetensors when the repo has them, else the plain ones."""
    patterns = []
    for folder in WEIGHT_COMPONENTS:
        names = [Path(f) for f in repo_files if f.startswith(folder + "/") and f.endswith(".safetensors")]
        if prefer_variant and any(is_variant(n, prefer_variant) for n in names):
            patterns.append(f"{folder}/*.{prefer_variant}*.safetensors")
        else:
            patterns += [f"{folder}/{n.name}" for n in names if not is_variant(n, "fp16")]
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
