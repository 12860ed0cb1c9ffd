"""Loading onto the devices: a checkpoint as a `LoadedModel`, and what loads with one (a refiner,
IP-Adapters, textual-inversion embeddings), each as a new snapshot that shares the arrays it keeps.

Each function returns a value and changes none: `Pipeline`'s setters make the snapshot they return
the current one.
"""

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .. import checkpoints
from ..checkpoints import controlnets as controlnet_checkpoints, embeddings, ip_adapters as ip_adapter_checkpoints
from ..checkpoints.ip_adapters import IPAdapterConfig
from ..checkpoints.tokenizer import load_tokenizer
from ..models import quantization
from ..models.previews import factors_for
from ..prompts.tokens import Prompts
from ..sampling.schedulers import PREDICTION_TYPES, ZERO_TERMINAL_SNR
from . import mesh as meshes
from .checks import choice
from .image_prompts import IPAdapter, layer_scales
from .model import LoadedModel


def load(
    path_or_repo_id: str, *, dtype=None, max_steps: int = 100, devices: Sequence[jax.Device] | None = None,
    config: str | None = None, scheduler: dict | None = None, unet: str | None = None, vae: str | None = None,
    controlnet: str | Sequence[str] | None = None, vae_tiling: bool = False, weights_dtype: str | None = None,
) -> LoadedModel:
    """A checkpoint and its ControlNets on `devices` (default: all), replicated over their mesh
    (`Pipeline.from_pretrained` says what each argument takes).

    Raises:
      CheckpointError: a file is missing or corrupt, or the model cannot run; ControlNets are checked
        against the model before their weights are fetched.
    """
    weights_dtype = quantization.weights_dtype_name(weights_dtype)
    devices = list(devices or jax.devices())
    dtype = jnp.dtype(dtype or ("float32" if devices[0].platform == "cpu" else "bfloat16"))
    checkpoint = checkpoints.resolve(path_or_repo_id, dtype=dtype, config=config, scheduler=scheduler, unet=unet,
                                     vae=vae)
    sources = [] if controlnet is None else [controlnet] if isinstance(controlnet, str) else list(controlnet)
    controlnets = [controlnet_checkpoints.resolve(source, checkpoint.spec, dtype=dtype) for source in sources]
    tokenizers = [load_tokenizer(checkpoint.folder / name) for name in checkpoint.spec.tokenizer_names]
    mesh = meshes.batch_mesh(devices)
    put = meshes.placing_replicated(mesh)
    params = checkpoint.load(dtype, put)
    if controlnets:
        params["controlnets"] = tuple(c.load(dtype, put) for c in controlnets)
    params = quantization.in_components(params, lambda tree: quantization.quantized(tree, weights_dtype))
    return LoadedModel(
        checkpoint.spec, params, Prompts(checkpoint.spec, tokenizers), mesh, dtype, max_steps=max_steps,
        name=str(path_or_repo_id), weights_file=checkpoint.single_file,
        vae_name=None if checkpoint.vae is None else checkpoint.vae.name,
        vae_tiling=vae_tiling, preview_factors=checkpoint.preview_factors or factors_for(checkpoint.spec),
        controlnets=tuple(controlnets), weights_dtype=weights_dtype,
    )


def scheduler_overrides(
    scheduler: dict | None, prediction_type: str | None, rescale_betas_zero_snr: bool | None
) -> dict | None:
    """The scheduler fields a caller replaces (`Pipeline.from_pretrained`'s `scheduler`), with its
    prediction type and zero-terminal-SNR switch among them; None where it replaces none.

    Raises:
      ValueError: an unknown prediction type.
    """
    fields = dict(scheduler or {})
    if prediction_type is not None:
        fields["prediction_type"] = choice(prediction_type, "prediction type", PREDICTION_TYPES)
    if rescale_betas_zero_snr:
        fields = ZERO_TERMINAL_SNR | fields  # a timestep_spacing the caller gives wins
    if rescale_betas_zero_snr is not None:
        fields["rescale_betas_zero_snr"] = bool(rescale_betas_zero_snr)
    return fields or None


def with_refiner(base: LoadedModel, refiner: LoadedModel) -> tuple[LoadedModel, LoadedModel]:
    """(`base` finishing requests with `refine_from` by `refiner`, `refiner` holding `base`'s arrays in
    place of its equal ones): the devices hold each component the two share once. The published SDXL
    refiner's VAE and second text encoder are the base's, 1.45 GiB per device in bfloat16 (on a 16 GiB
    TPU v5e, the difference between fitting and not). Compared on the devices, value for value.

    Raises:
      CheckpointError: the refiner cannot continue the base's latents.
    """
    _check_refiner(base, refiner)
    holding = held_once(refiner, [base])
    return base.replace(refiner=holding), holding


def held_once(model: LoadedModel, others: Sequence[LoadedModel]) -> LoadedModel:
    """`model` holding the arrays of `others` in place of its components equal to theirs (a text encoder,
    a VAE, a UNet, compared on the devices, value for value), so that the devices hold each once: two
    fine-tunes of one base often share their text encoders and VAE, 1.6 GiB per device in bfloat16."""
    equal = {}
    for name, theirs in model.params.items():
        if name in ("controlnets", "ip_adapters", "embeddings"):
            continue
        for other in others:
            mine = other.params.get(name)
            if mine is None or mine is theirs or list(other.mesh.devices.flat) != list(model.mesh.devices.flat):
                continue
            # Either may wait in host memory (`sdxl.engine.residency`): on the same devices, they place alike.
            shapes = [jax.tree.map(lambda a: (a.shape, a.dtype), tree) for tree in (mine, theirs)]
            if jax.tree.structure(mine) == jax.tree.structure(theirs) and shapes[0] == shapes[1] and bool(
                    _all_equal(mine, theirs)):
                equal[name] = mine
                break
    return model.replace(params={**model.params, **equal}) if equal else model


def _check_refiner(base: LoadedModel, refiner: LoadedModel) -> None:
    mine, theirs = base.spec, refiner.spec
    checks = {
        "latent channels": (mine.vae.latent_channels, theirs.vae.latent_channels),
        "VAE downscaling": (mine.vae.downscale_factor, theirs.vae.downscale_factor),
        "latent scaling": (
            (mine.vae.scaling_factor, mine.vae.latents_mean, mine.vae.latents_std),
            (theirs.vae.scaling_factor, theirs.vae.latents_mean, theirs.vae.latents_std),
        ),
        "training timesteps": (mine.scheduler.num_train_timesteps, theirs.scheduler.num_train_timesteps),
        "devices": (list(base.mesh.devices.flat), list(refiner.mesh.devices.flat)),
    }
    for what, (base_value, refiner_value) in checks.items():
        if base_value != refiner_value:
            raise checkpoints.CheckpointError(
                f"the refiner {refiner.name} cannot continue {base.name}'s latents: its {what} differ "
                f"({refiner_value} vs {base_value})"
            )
    if theirs.is_inpainting:
        raise checkpoints.CheckpointError(f"the refiner {refiner.name} is an inpainting model")


@jax.jit
def _all_equal(a, b) -> jax.Array:
    """Whether two parameter trees of the same shapes hold the same values (one program for all leaves)."""
    return jnp.all(jnp.stack([jnp.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]))


def with_ip_adapters(
    model: LoadedModel, source: str | Sequence[str], subfolder: str | Sequence[str] | None,
    weight_name: str | Sequence[str], image_encoder_folder: str | None = "image_encoder",
) -> LoadedModel:
    """`model` with these IP-Adapters in place of any it has, each at scale 1 (`Pipeline.load_ip_adapter`
    says what the arguments take).

    Raises:
      CheckpointError: an adapter or encoder that is missing, pickled, a FaceID one, or not this
        model's family, before its weights are fetched where that can be told.
    """
    found = ip_adapter_checkpoints.resolve(source, subfolder, weight_name, model.spec.unet,
                                           image_encoder_folder=image_encoder_folder)
    put = meshes.placing_replicated(model.mesh)
    if found.image_encoder is not None:
        encoder_config, encoder_params = found.image_encoder.config, found.image_encoder.load(model.dtype, put)
    elif model.ip_adapters:  # the loaded one's
        encoder_config, encoder_params = model.ip_adapters[0].config.encoder, model.params["ip_adapters"][0][
            "image_encoder"]
        for adapter in found.adapters:
            ip_adapter_checkpoints.check_encoder(adapter.projection, encoder_config, adapter.name)
    else:
        raise checkpoints.CheckpointError("no image encoder is loaded: give image_encoder_folder")
    adapters, params = [], []
    for checkpoint in found.adapters:
        weights = checkpoint.load(model.spec.unet, model.dtype, put)
        adapters.append(IPAdapter(weights.name, IPAdapterConfig(encoder_config, weights.projection)))
        params.append({"image_encoder": encoder_params, "image_proj": weights.image_proj,
                       "unet": ip_adapter_checkpoints.unet_tree(weights.layers)})
    return model.replace(params={**model.params, "ip_adapters": tuple(params)}, ip_adapters=tuple(adapters),
                         ip_adapter_scales=(1.0,) * len(adapters))


def without_ip_adapters(model: LoadedModel) -> LoadedModel:
    return model.replace(params={k: v for k, v in model.params.items() if k != "ip_adapters"}, ip_adapters=(),
                         ip_adapter_scales=())


def ip_adapter_scales(model: LoadedModel, scale=None) -> tuple:
    """One scale per IP-Adapter of `model`, from `Pipeline.set_ip_adapter_scale`'s forms, checked; None:
    the model's.

    Raises:
      ValueError: a scale out of range or a block the UNet lacks, or another count.
    """
    if scale is None:
        return model.ip_adapter_scales
    k = len(model.ip_adapters)
    scales = list(scale) if isinstance(scale, list | tuple) else [scale] * k
    if len(scales) != k:
        raise ValueError(f"{k} IP-Adapter(s) are loaded: give one scale, or a list of {k}, not {len(scales)}")
    for one in scales:
        layer_scales(model.spec.unet, one)
    return tuple(scales)


def with_embeddings(model: LoadedModel, paths: Sequence[str | os.PathLike],
                    tokens: Sequence[str | None]) -> LoadedModel:
    """`model` with the textual-inversion embeddings of `paths` besides its own, each named by its token
    (None: its file's stem); a name it has already takes the new vectors.

    Raises:
      CheckpointError: a file that is missing, pickled, or not an embedding of this model's encoders.
      ValueError: a name that is no word of a prompt.
    """
    loaded = {embedding.name: embedding for embedding in model.prompts.embeddings}
    for path, name in zip(paths, tokens, strict=True):
        embedding = embeddings.read(path, model.spec, name)
        loaded.pop(embedding.name, None)
        loaded[embedding.name] = embedding
    put = meshes.placing_replicated(model.mesh)
    tables = tuple(put(table.astype(model.dtype)) for table in embeddings.table(list(loaded.values()), model.spec))
    return model.replace(prompts=model.prompts.with_embeddings(list(loaded.values())),
                         params={**model.params, "embeddings": tables})
