"""Files' hashes as webui shows them: "Model hash" (10 hex digits) and "TI hashes" (12) are the first
digits of the whole file's SHA-256."""

import functools
import hashlib
import re
from pathlib import Path

# A file in the Hugging Face cache is a link to blobs/<its SHA-256> (a Git LFS file's object id).
_HUB_BLOB = re.compile(r"[0-9a-f]{64}")


def sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, in hex: read from the name of its Hugging Face cache blob where it
    is one (a checkpoint of 7 GB is not read again), else computed."""
    resolved = Path(path).resolve()
    if resolved.parent.name == "blobs" and _HUB_BLOB.fullmatch(resolved.name):
        return resolved.name
    digest = hashlib.sha256()
    with resolved.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@functools.cache  # a loaded checkpoint's file is hashed once
def model_hash(path: str | Path) -> str:
    """A checkpoint file's "Model hash" as webui writes it (`sd_models.CheckpointInfo.shorthash`)."""
    return sha256(path)[:10]
