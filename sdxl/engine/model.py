"""A loaded model as a value: `LoadedModel`, an immutable snapshot of everything a request renders with.

Its config, its parameters on the devices, its tokenizers (with the textual-inversion embeddings they
read), and what is loaded with it: ControlNets, IP-Adapters and their default scales, the LoRA files
read and the active LoRAs, a refiner's own snapshot, model upscalers. Loading something makes a new
snapshot that shares every array it does not change, so nothing is copied twice on the devices.

A prepared request holds the snapshot it was prepared against (`sdxl.engine.prepared`), and rendering
reads only that one: whatever a `Pipeline` loads meanwhile, a prepared request draws the picture it
was prepared for. Several snapshots, of one model or of several, can exist side by side. Where a
snapshot's arrays are (the devices, or host memory while another model uses the devices) may change;
its values never do.
"""

import dataclasses
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ..checkpoints import ModelSpec, lora
from ..models.vae import tile_sizes
from ..prompts.tokens import Prompts
from . import mesh as meshes
from .request import Limits

if TYPE_CHECKING:
    from .residency import Placement


class LoraCache:
    """What the snapshots of one loaded model share and only ever add to: each LoRA file read once, by
    source, and the parameters of the LoRA set applied last, so that the requests of one set apply it
    once. Reading it never changes what a snapshot renders: the applied parameters are kept with the
    parameters they were applied to, and used only for those."""

    def __init__(self):
        self._lock = threading.Lock()
        self._files: dict[str, lora.Lora] = {}
        self._applied: tuple = ((), None, None)  # (loras, the parameters they were applied to, the result)

    def read(self, source: str, spec: ModelSpec) -> lora.Lora:
        """The LoRA file `source` names (`lora.locate`), read and checked against `spec` once.

        Raises:
          CheckpointError: it is missing or does not fit the model.
        """
        with self._lock:
            if source not in self._files:
                self._files[source] = lora.read(lora.locate(source), spec, name=source)
            return self._files[source]

    def forget(self) -> None:
        """Lets the applied parameters go (their base has moved), keeping the files read."""
        with self._lock:
            self._applied = ((), None, None)

    def applied(self, params: dict, loras: tuple, layers: list, mesh: Mesh) -> dict:
        """`params` with `layers` ((Lora, scale) of `loras`) applied, on the devices; the last set's kept."""
        with self._lock:
            kept, base, result = self._applied
            if kept != loras or base is not params:
                result = jax.block_until_ready(lora.apply(params, layers, meshes.placing_replicated(mesh)))
                self._applied = (loras, params, result)
            return result


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """A checkpoint on a device mesh with what is loaded with it: what one request renders with.

    `params` is {"unet", "vae", "text_encoder"[, "text_encoder_2"]} as loaded, with "controlnets" (one
    tree per entry of `controlnets`), "ip_adapters" (one per entry of `ip_adapters`) and "embeddings"
    (the textual-inversion tables of `prompts.embeddings`) where those are loaded.
    """

    spec: ModelSpec
    params: dict
    prompts: Prompts  # its tokenizers, reading the loaded embeddings
    mesh: Mesh
    dtype: jnp.dtype
    max_steps: int = 100  # the most steps a request may ask for (the schedules' padded length)
    name: str = ""
    weights_file: Path | None = None  # the single file its weights came from (A1111's "Model hash" is its hash)
    vae_name: str | None = None  # the separate VAE loaded in place of the checkpoint's; None for its own
    vae_tiling: bool = False  # see `Pipeline.from_pretrained`
    preview_factors: tuple | None = None  # `previews.project`'s (matrix, bias) for the previews
    controlnets: tuple = ()  # `ControlNetCheckpoint`s: the ControlNets a request's controls steer through, in order
    ip_adapters: tuple = ()  # `IPAdapter`s: the IP-Adapters a request's image prompts steer through, in order
    ip_adapter_scales: tuple = ()  # one per IP-Adapter: the scale requests that give none take
    loras: Mapping[str, float] = dataclasses.field(default_factory=dict)  # the active ones: {source: scale}
    lora_files: Mapping[str, lora.Lora] = dataclasses.field(default_factory=dict)  # those read, by source
    refiner: "LoadedModel | None" = None  # continues requests with `refine_from`
    upscalers: Mapping = dataclasses.field(default_factory=dict)  # model upscalers a hires fix may name, by name
    lora_cache: LoraCache = dataclasses.field(default_factory=LoraCache, repr=False)
    # How the UNet's and ControlNets' large weights are stored (`sdxl.models.quantization.WEIGHT_DTYPES`).
    weights_dtype: str = "default"
    # Where its arrays are, for a model that shares devices it does not always fit on (`sdxl.engine.residency`).
    placement: "Placement | None" = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if self.placement is not None:
            self.placement.track(self)

    def placed(self, params: dict) -> None:
        """Takes `params`, the same values placed elsewhere (`sdxl.engine.residency`): the one change a
        snapshot sees, which leaves what it renders as it was. LoRAs applied to the old ones are let go."""
        object.__setattr__(self, "params", params)
        self.lora_cache.forget()

    def replace(self, **changes) -> "LoadedModel":
        return dataclasses.replace(self, **changes)

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    def device_description(self) -> str:
        device = self.mesh.devices.flat[0]
        return f"{self.num_devices}× {getattr(device, 'device_kind', device.platform)}"

    def devices_of(self, num_images: int) -> list[str]:
        """Which device renders each image of an `num_images` batch (the batch is split in order), by its
        place in the mesh: "CPU 0" to "CPU 3" (JAX's ids number a second host's from 2048, say)."""
        per_device = self.padded_batch(num_images) // self.num_devices
        platform = self.mesh.devices.flat[0].platform.upper()
        return [f"{platform} {i // per_device}" for i in range(num_images)]

    def padded_batch(self, num_images: int) -> int:
        """The batch that `num_images` images compile and run as: a multiple of the device count."""
        return -(-num_images // self.num_devices) * self.num_devices

    @property
    def limits(self) -> Limits:
        """What it allows a request: its model, schedules, ControlNets, LoRAs, refiner and adapters."""
        names = {lora.display_name(source): source for source in self.lora_files}
        return Limits(self.spec, self.max_steps, self.controlnets, names, tuple(self.loras.items()),
                      None if self.refiner is None else self.refiner.name, upscalers=tuple(self.upscalers),
                      ip_adapters=self.ip_adapters)

    def reading(self, sources) -> "LoadedModel":
        """This snapshot with the LoRA files `sources` names read too (each file once, whichever snapshot asks).

        Raises:
          CheckpointError: a source is missing or does not fit the model.
        """
        missing = [source for source in sources if source not in self.lora_files]
        if not missing:
            return self
        read = {source: self.lora_cache.read(source, self.spec) for source in missing}
        return self.replace(lora_files={**self.lora_files, **read})

    def params_with(self, loras: tuple[tuple[str, float], ...]) -> dict:
        """The parameters with `loras` ((source, scale), sorted, none at 0: a validated request's)
        applied, on the devices; the loaded ones for none. The files must have been read (`reading`)."""
        if not loras:
            return self.params
        layers = [(self.lora_files[source], scale) for source, scale in loras]
        return self.lora_cache.applied(self.params, loras, layers, self.mesh)

    def tiles_vae(self, height: int, width: int) -> bool:
        """Whether the VAE tiles a picture of this size (`vae_tiling`): it has more pixels than a tile."""
        tile, _ = tile_sizes(self.spec.vae)
        return self.vae_tiling and height * width > tile * tile

    def embedding_rows(self, tokens) -> int:
        """The vector rows a prompt's program reads: the loaded tables' when one of its ids is past the
        vocabulary, else none (and the program is the one without embeddings)."""
        if "embeddings" not in self.params or not (tokens.ids >= self.spec.text_encoders[0].vocab_size).any():
            return 0
        return self.params["embeddings"][0].shape[0]

    @property
    def key(self) -> tuple:
        """What tells this snapshot's loaded things apart, by name, for a process that must render with
        one loaded alike (`sdxl.serving.hosts`)."""
        return (self.name, self.vae_name, str(self.dtype), self.weights_dtype, tuple(c.name for c in self.controlnets),
                tuple(a.name for a in self.ip_adapters), tuple(e.name for e in self.prompts.embeddings),
                None if self.refiner is None else self.refiner.key)
