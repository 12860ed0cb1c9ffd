"""Per-image conditionings beside the prompt, through one door: a `Kind` each (the ControlNets'
`Control`s, the IP-Adapters' `ImagePrompt`s), listed in `KINDS`.

A kind's values ride in a `Request` field: per image, one value for each loaded unit of the kind (a
ControlNet, an IP-Adapter), or None where none steers. The front ends (`generate`, the CLI, the demo)
make each value with the kind's one constructor (`Control.of`, `ImagePrompt.of`) and each image's
tuple of them with `per_unit` and `per_image`; `Request.validated` checks them (`validated`), and the
rest of the way iterates `KINDS` too: a request's call settings (`counts`), its program's fields
(`program_fields`), the arrays the program takes (`host_arrays`) and the values of its shapes for
compiling (`placeholders`). The program reads each kind's arrays in its loop (`sdxl.engine.program`).
"""

from collections.abc import Sequence
from typing import Protocol

from .controls import CONTROLS
from .image_prompts import IMAGE_PROMPTS


class Kind(Protocol):
    """A kind of per-image conditioning: where its values ride, what checks them, what the program takes."""

    field: str  # the `Request` field: per image, one value per loaded unit; None where none steers
    units: str  # the loaded units (name, config), by `Limits`' (and `Pipeline`'s) field; also `GenerateProgram`'s
    unit_name: str  # a unit as sentences name it: "ControlNet"
    value_name: str  # a value as sentences name it: "control image"
    none_loaded: str  # the sentence for values given when no unit is loaded

    def checked(self, value, unit, height: int, width: int, spec):
        """`value` checked for `unit` (a loaded one) at an output of `width` x `height` of the model
        `spec`. Raises ValueError, in one sentence."""

    def host_arrays(self, values: tuple[tuple, ...], program) -> dict:
        """The `Inputs` fields of each image's checked values for `program`: [N, ...] arrays, or a tuple
        of them, one per unit."""

    def placeholder(self, program) -> tuple:
        """One image's values for compiling `program`, one per unit, of the shapes a request's would have."""


KINDS: tuple[Kind, ...] = (CONTROLS, IMAGE_PROMPTS)
FIELDS = tuple(kind.field for kind in KINDS)  # the `Request` fields of every kind


def validated(request, limits, height: int, width: int) -> dict:
    """Each kind's values of a request checked against the loaded units (`Limits`), by `Request` field:
    each image's one value per unit (each value checked once), or None.

    Raises:
      ValueError: values without units, or another count of them, or a bad value, in one sentence.
    """
    return {kind.field: _checked(kind, getattr(request, kind.field), len(request), getattr(limits, kind.units),
                                 height, width, limits.spec) for kind in KINDS}


def _checked(kind: Kind, given, n: int, units: Sequence, height: int, width: int, spec) -> tuple | None:
    if given is None:
        return None
    if not units:
        raise ValueError(kind.none_loaded)
    if len(given) != n:
        raise ValueError(f"{kind.field}: need one per image ({n}), one per {kind.unit_name} each; got {len(given)}")
    checked = {}  # each value once: a request usually gives the same to every image
    for values in given:
        if len(values) != len(units):
            names = ", ".join(unit.name for unit in units)
            raise ValueError(f"{len(units)} {kind.unit_name}(s) are loaded ({names}): give one {kind.value_name} "
                             f"for each, not {len(values)}")
        for value, unit in zip(values, units):
            if id(value) not in checked:
                checked[id(value)] = kind.checked(value, unit, height, width, spec)
    return tuple(tuple(checked[id(value)] for value in values) for values in given)


def counts(request) -> tuple[int, ...]:
    """How many units of each kind steer a request's images (0, or all those loaded)."""
    return tuple(len(getattr(request, kind.field)[0]) if getattr(request, kind.field) else 0 for kind in KINDS)


def program_fields(request, loaded) -> dict:
    """`GenerateProgram`'s field of each kind: the configs of the units loaded (`loaded`: `Limits`, a
    `Pipeline`, or what else holds them by the kinds' `units`) where the request's values steer, else ()."""
    return {kind.units: tuple(unit.config for unit in getattr(loaded, kind.units)) if getattr(request, kind.field)
            else () for kind in KINDS}


def host_arrays(request, program) -> dict:
    """The `Inputs` fields of a prepared request's values, [N, ...] per image, of the kinds its program has."""
    return {name: arrays for kind in KINDS if getattr(program, kind.units)
            for name, arrays in kind.host_arrays(getattr(request, kind.field), program).items()}


def placeholders(program) -> dict:
    """The `Request` fields of a placeholder for compiling `program`: per image the kind's placeholder
    values where the program has its units, else None."""
    return {kind.field: (kind.placeholder(program),) * program.batch if getattr(program, kind.units) else None
            for kind in KINDS}


def per_unit(kind: Kind, given, k: int, label: str) -> list:
    """A caller's entries for `k` loaded units of `kind`: for one unit what it gives, for several a list
    (or tuple) of one per unit.

    Raises:
      ValueError: another count, named by the argument's `label`.
    """
    if k == 1:
        return [given]
    if not isinstance(given, list | tuple) or len(given) != k:
        raise ValueError(f"{label}: give a list with one entry per {kind.unit_name} ({k})")
    return list(given)


def per_image(kind: Kind, columns: Sequence, n: int, label: str) -> tuple[tuple, ...]:
    """Each of `n` images' values, one per unit, from `columns` (one per unit): each one value for every
    image, or a list (or tuple) of one per image.

    Raises:
      ValueError: another count, named by the argument's `label`.
    """
    made = []
    for column in columns:
        column = list(column) if isinstance(column, list | tuple) else [column]
        if len(column) not in (1, n):
            raise ValueError(f"{label}: give one {kind.value_name} for every image, or one per image ({n}), "
                             f"got {len(column)}")
        made.append(column * n if len(column) == 1 else column)
    return tuple(zip(*made))
