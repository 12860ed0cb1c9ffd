"""The models a demo or the CLI serves (`Model`): each loaded checkpoint with how results name it, its
recommended settings and the LoRAs loaded with it. A demo serves one or several, by name; the first
is the default."""

import dataclasses
from collections.abc import Sequence

from ..checkpoints import hashes
from ..engine.pipeline import Pipeline
from ..engine.residency import Placement, Residency
from .forms import size_presets
from .known import Recommended


@dataclasses.dataclass
class Model:
    """A loaded model, as the demo and the CLI present it."""

    name: str  # as given at launch (`--model`): what requests choose it by
    pipe: Pipeline
    label: str = ""  # how results name it ("" : its name)
    settings: Recommended = Recommended()  # its steps, guidance, sizes and examples
    loras: dict[str, float] = dataclasses.field(default_factory=dict)  # loaded with it: {source: scale}
    notice: str | None = None  # why the built-in model stands in for the one asked for

    def __post_init__(self):
        self.label = self.label or self.name

    @property
    def sizes(self) -> list[tuple[int, int]]:
        """The (width, height) sizes the demo offers for it, the first the default."""
        return list(self.settings.sizes) if self.settings.sizes else size_presets(self.pipe.spec)

    @property
    def placement(self) -> Placement | None:
        """Where its weights are, where several models share the devices (`sdxl.engine.residency`)."""
        return self.pipe.model.placement

    @property
    def residency(self) -> Residency | None:
        """The models it shares the devices with, and which of them are there."""
        return None if self.placement is None else self.placement.residency

    @property
    def hash(self) -> str | None:
        """Its file's "Model hash", as webui writes it; None for a diffusers folder (not one file)."""
        weights = self.pipe.weights_file
        return None if weights is None else hashes.model_hash(weights)


def named(models: Sequence[Model], name) -> Model:
    """The model of `models` that `name` names (None or "": the first).

    Raises:
      ValueError: no model of that name is loaded, naming the loaded ones.
    """
    if name is None or name == "":
        return models[0]
    for model in models:
        if name == model.name:
            return model
    raise ValueError(f"no model {name!r} is loaded; the loaded ones are {', '.join(m.name for m in models)}")


def union(models: Sequence[Model], of) -> dict:
    """The things `of(model)` gives ({name: value}) of every model, by name, in the order first given."""
    found: dict = {}
    for model in models:
        for name, value in of(model).items():
            found.setdefault(name, value)
    return found
