"""Model configs are frozen dataclasses whose fields are named as in the checkpoint's JSON."""

import dataclasses
import json
import os
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def config_from_dict(cls: type[T], values: dict) -> T:
    """Builds `cls` from a diffusers/transformers config dict.

    Keys the dataclass does not name are ignored (configs carry many fields for features we do not
    implement); lists become tuples so configs stay hashable and usable as static jit arguments.
    """
    names = {field.name for field in dataclasses.fields(cls)}
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in names}
    return cls(**kwargs)


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON config ({e})") from e


def config_from_file(cls: type[T], path: Path) -> T:
    return config_from_dict(cls, read_json(path))


def cache_root() -> Path:
    """Where the project keeps its caches (compiled programs, the tiny checkpoint)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sdxl-jax"


# The environment variables that pick a kernel where a model is traced (`kernel_override`).
KERNEL_VARIABLES = ("SDXL_ATTENTION", "SDXL_CONV", "SDXL_GROUP_NORM")


def kernel_override(variable: str, choices: tuple[str, ...]) -> str:
    """The kernel that environment `variable` (one of `KERNEL_VARIABLES`) names, or "" when it is unset."""
    chosen = os.environ.get(variable, "").strip().lower()
    if chosen not in choices + ("",):
        raise ValueError(f"{variable} must be one of {', '.join(choices)}, got {chosen!r}")
    return chosen
