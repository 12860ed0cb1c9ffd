"""The Hugging Face Hub: a repo's configs first, then exactly the weight files a pipeline reads.

Configs and tokenizers come first (kilobytes): the model's spec is built from them, so a model this
package cannot run is refused before gigabytes of weights are fetched. Then, per component the
pipeline loads, the one weight set `folder.choose_weight_files` picks for the dtype; single-file
checkpoints, pickled weights, ONNX/OpenVINO/Flax exports and unused components are never fetched.

Without the Hub (unreachable, or `HF_HUB_OFFLINE=1`) the same files come from the local cache, as
an earlier online run, ours or diffusers', left them; huggingface_hub's own HTTP client decides
whether the Hub answers, so proxies and `HF_ENDPOINT` are honoured.
"""

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .folder import WEIGHT_COMPONENTS, choose_weight_files
from .spec import ModelSpec
from .weights import CheckpointError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Everything a pipeline reads besides its weights, and nothing else: not the configs of exports
# (`vae_decoder/`, ...) that an earlier download, diffusers' say, had no reason to fetch.
CONFIG_PATTERNS = [
    "model_index.json",
    "scheduler/scheduler_config.json",
    *(f"{component}/config.json" for component in WEIGHT_COMPONENTS),
    "tokenizer/*",
    "tokenizer_2/*",
]
# How long to wait for the Hub to say which commit a repo is at, before using the cache instead.
HUB_TIMEOUT_S = 10.0
# The Hugging Face cache folder downloads go to and are read from; None: huggingface_hub's own
# (HF_HOME, HF_HUB_CACHE). `use_cache_folder` sets it, for a demo on a Space's persistent storage.
_cache_folder: Path | None = None


def use_cache_folder(path: Path | None) -> None:
    """Downloads go to the Hugging Face cache folder `path`, and are looked for there (None: the default)."""
    global _cache_folder
    _cache_folder = path


class HubUnavailableError(CheckpointError):
    """A Hub checkpoint is not in the local cache and the Hub cannot be reached (or is switched off)."""


def download(repo_id: str, dtype, scheduler: dict | None = None, without: tuple[str, ...] = ()) -> Path:
    """The snapshot folder of `repo_id` with its configs, tokenizers and the weights to load in
    `dtype`, downloaded into the user's Hugging Face cache where they are not there yet; the weights
    of the components in `without` are not fetched (another file replaces them).

    Raises:
      CheckpointError: the repo is unknown or not accessible, or its model is not supported (before
        any weights are fetched); `HubUnavailableError` when files it needs are neither cached nor
        downloadable.
    """
    online = _hub_answers(repo_id)
    folder = _snapshot(repo_id, CONFIG_PATTERNS, online, "configs are missing")
    spec = ModelSpec.from_folder(folder, scheduler)
    files = _repo_files(repo_id, online, folder)
    weights = []
    for component in ("unet", "vae", *spec.text_encoder_names):
        if component in without:
            continue
        names = [f.removeprefix(component + "/") for f in files if f.rpartition("/")[0] == component]
        weights += [f"{component}/{name}" for name in choose_weight_files(names, dtype, f"{repo_id}/{component}")]
    _snapshot(repo_id, weights, online, "weights are missing")
    return folder


def download_model(repo_id: str, dtype, read_config: Callable[[Path], T]) -> tuple[Path, T]:
    """A one-model repo (a ControlNet's: `config.json` beside its weights): its snapshot folder, and
    what `read_config(folder)` makes of the config, which comes first, so that `read_config` can
    refuse the model before any weights are fetched; then the one weight set to load in `dtype`
    (`folder.choose_weight_files`).

    Raises:
      CheckpointError: as `download`, and whatever `read_config` raises.
    """
    online = _hub_answers(repo_id)
    folder = _snapshot(repo_id, ["config.json"], online, "config is missing")
    config = read_config(folder)
    names = [f for f in _repo_files(repo_id, online, folder) if "/" not in f]
    _snapshot(repo_id, choose_weight_files(names, dtype, repo_id), online, "weights are missing")
    return folder, config


def download_file(repo_id: str, filename: str) -> Path:
    """One file of a repo (a single-file checkpoint), from the Hub or the cache.

    Raises:
      CheckpointError: as `download`.
    """
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    online = _hub_answers(repo_id)
    try:
        return Path(huggingface_hub.hf_hub_download(repo_id, filename, local_files_only=not online,
                                                   cache_dir=_cache_folder))
    except LocalEntryNotFoundError as e:
        raise _not_cached(f"{repo_id}/{filename}", "file is missing") from e
    except Exception as e:
        raise CheckpointError(f"{repo_id}/{filename}: could not download ({type(e).__name__}: {e})") from e


def file_header(repo_id: str, filename: str) -> dict[str, tuple[int, ...]] | None:
    """{tensor key: shape} of a Hub safetensors file, read from its header alone (ranged requests),
    or None when the Hub does not answer (the file may still be in the cache)."""
    import huggingface_hub

    if not _hub_answers(repo_id):
        return None
    try:
        metadata = huggingface_hub.parse_safetensors_file_metadata(repo_id, filename)
    except Exception as e:  # a missing file, no access: the download says it
        log.warning("could not read the header of %s/%s (%s)", repo_id, filename, e)
        return None
    return {key: tuple(info.shape) for key, info in metadata.tensors.items()}


def _hub_answers(repo_id: str) -> bool:
    """Whether the Hub answers for the repo: False when it is switched off or out of reach.

    A quick question with a short time-out, so that a machine without network falls back to the
    cache in seconds instead of waiting out huggingface_hub's retries.
    """
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return False
    try:
        huggingface_hub.HfApi().repo_info(repo_id, timeout=HUB_TIMEOUT_S)
        return True
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
        raise CheckpointError(f"{repo_id}: not available on the Hugging Face Hub ({type(e).__name__})") from e
    except Exception as e:  # no network, a proxy or DNS failure, a time-out, the Hub down: try the cache
        reason = f"{type(e).__name__}: {e}"
        log.warning("the Hugging Face Hub did not answer for %s (%s); using the local cache", repo_id, reason)
        return False


def _snapshot(repo_id: str, patterns: list[str], online: bool, what: str) -> Path:
    """`snapshot_download` of the files matching `patterns`, from the Hub or from the cache alone."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns, local_files_only=not online,
                                                    cache_dir=_cache_folder))
    except LocalEntryNotFoundError as e:  # also IncompleteSnapshotError: some of the files are missing
        raise _not_cached(repo_id, what) from e
    except Exception as e:  # no access, a dropped connection, a full disk: all end here for the caller
        reason = f"{type(e).__name__}: {e}"
        raise CheckpointError(f"{repo_id}: could not download from the Hugging Face Hub ({reason})") from e


def _not_cached(name: str, what: str) -> HubUnavailableError:
    import huggingface_hub

    hub = "switched off (HF_HUB_OFFLINE=1)" if huggingface_hub.constants.HF_HUB_OFFLINE else "unreachable"
    return HubUnavailableError(f"{name}: not in the local Hugging Face cache (its {what}), and the Hub is {hub}")


def _repo_files(repo_id: str, online: bool, folder: Path) -> list[str]:
    """The repo's files: online, the whole listing (which the config download cached); from the
    cache alone, the files that are there, so that whatever weight set an earlier run fetched serves."""
    import huggingface_hub

    if online:
        return [f.path for f in huggingface_hub.get_cached_repo_tree(repo_id, cache_dir=_cache_folder)]
    return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
