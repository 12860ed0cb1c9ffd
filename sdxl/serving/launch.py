"""Starting the demo or the CLI: loading the model their options name (`sdxl.serving.options`; with its
LoRAs and refiner, and offline the built-in `shapes` model in its place), and the demo's service,
warmed up before it serves and compiling the rest in the background while it does.
"""

import argparse
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np

from .. import checkpoints
from ..checkpoints import CheckpointError, HubUnavailableError, controlnets as controlnet_checkpoints, hub, shapes
from ..checkpoints.weights import refuse_pickled
from ..engine import conditionings, memory
from ..engine.compilation import CompileCounter, enable_compilation_cache
from ..engine.image_prompts import IMAGE_PROMPTS, ImagePrompt
from ..engine.images import model_label
from ..engine.pipeline import Pipeline
from ..engine.prepared import PreparedRequest
from ..engine.request import DEFAULT_REFINE_FROM
from ..engine.residency import HOST, Residency
from ..models import quantization
from . import hosts as multihost
from .demo import DemoService
from .forms import Settings
from .known import recommended
from .models import Model
from .options import FALLBACK_MODEL, IMAGES_PER_CORE

log = logging.getLogger(__name__)

# Where a Hugging Face Space mounts its persistent storage, when it has some (`SYSTEM=spaces` there).
SPACES_STORAGE = "/data"


def embedding_files(paths: Sequence[str]) -> list[Path]:
    """The files of `--embedding` values: a file as it is, a folder's .safetensors files by name; checked
    before a model loads.

    Raises:
      CheckpointError: a pickled file, a missing one, or a folder without any.
    """
    files = []
    for path in map(Path, paths):
        refuse_pickled(str(path), "embedding")
        if not path.exists():
            raise CheckpointError(f"embedding {path}: no such file or folder")
        found = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not found:
            raise CheckpointError(f"embedding folder {path}: no .safetensors files in it")
        files.extend(found)
    return files


@dataclasses.dataclass(frozen=True)
class IPAdapterFile:
    """An `--ip-adapter` file as `Pipeline.load_ip_adapter` takes it (diffusers' arguments)."""

    source: str  # a local folder or a Hub repo id
    subfolder: str  # the file's folder in it ("" for its root)
    weight_name: str
    image_encoder_folder: str  # in `subfolder` unless it has a "/" (then from `source`'s root)


def ip_adapter_file(text: str) -> IPAdapterFile:
    """An `--ip-adapter` value: a local .safetensors file (its folder's parent the source, so that
    h94/IP-Adapter's layout reads alike locally), or owner/name[/FOLDER...]/file.safetensors on the Hub.
    h94's SDXL adapters for the ViT-H encoder ("*vit-h*") read it at models/image_encoder, as diffusers'
    docs load them; the others the image_encoder beside them.

    Raises:
      CheckpointError: it names no .safetensors file, in one sentence (before anything is fetched).
    """
    path = Path(text).expanduser()
    if path.suffix != ".safetensors":
        raise CheckpointError(f"--ip-adapter names an adapter's .safetensors file (local, or owner/name/FOLDER/"
                              f"file.safetensors on the Hub), got {text!r}")
    encoder = "models/image_encoder" if "vit-h" in path.name.lower() else "image_encoder"
    if path.is_file():
        folder = path.resolve().parent
        return IPAdapterFile(str(folder.parent), folder.name, path.name, encoder)
    parts = text.split("/")
    if len(parts) < 3 or not all(parts) or text.startswith((".", "/", "~")):
        raise CheckpointError(f"--ip-adapter {text}: no such file here, and not a Hub file (owner/name/FOLDER/"
                              "file.safetensors)")
    return IPAdapterFile("/".join(parts[:2]), "/".join(parts[2:-1]), parts[-1], encoder)


def load_ip_adapters(pipe: Pipeline, files: list[IPAdapterFile]) -> None:
    """Loads `files` (`ip_adapter_file`'s) on `pipe`, all with the first one's image encoder (diffusers' rule)."""
    if files:
        pipe.load_ip_adapter([f.source for f in files], [f.subfolder for f in files],
                             [f.weight_name for f in files], image_encoder_folder=files[0].image_encoder_folder)


def load(options: argparse.Namespace, *, fallback: bool = False, max_steps: int = 100) -> Model:
    """The model `add_shared_options` named (the CLI's one `--model`; the demo's first), with the
    compilation cache on, its LoRAs applied (each file read and checked now, not at a first request), its
    IP-Adapters loaded and its refiner set. With `fallback`, a Hub model that cannot be fetched is replaced
    by the built-in `shapes` model, with a notice that says why.

    Raises:
      CheckpointError: a file is missing or corrupt, or the model cannot run; in one line.
    """
    first = options.model if isinstance(options.model, str) else options.model[0]  # the demo's options: a list
    models, _ = load_models(argparse.Namespace(**{**vars(options), "model": [first]}), fallback=fallback,
                            max_steps=max_steps)
    return models[0]


def dtypes_label(pipe: Pipeline) -> str:
    """The dtype a model computes in, and how its weights are stored where that differs: "bfloat16, int8 weights",
    "bfloat16, int8 weights multiplied in int8" (`quantization.COMPUTE_MODES`)."""
    if pipe.weights_dtype == "default":
        return pipe.dtype.name
    stored = pipe.weights_dtype.removesuffix("_compute")
    multiplied = f" multiplied in {stored}" if pipe.weights_dtype in quantization.COMPUTE_MODES else ""
    return f"{pipe.dtype.name}, {stored} weights{multiplied}"


def load_models(options: argparse.Namespace, *, fallback: bool = False,
                max_steps: int = 100) -> tuple[list[Model], dict[str, str]]:
    """The models `options.model` names (a list: the demo's `--model`, given once or more), each with the
    LoRAs, embeddings, ControlNets, IP-Adapters and refiner of the options that fit it, on the same devices,
    sharing one cache of compiled programs (models of one architecture run the same programs) and holding
    components equal to an earlier model's (a VAE, a text encoder) once. Returns the models loaded and,
    by name, why the others failed (they do not stop the launch while one loads).

    One model is as the CLI loads it: every option must fit it, and with `fallback` the built-in `shapes`
    model stands in for a Hub model that cannot be fetched. Of several, an option loads with the models
    it fits, and one that fits none is refused.

    Raises:
      CheckpointError: two models of one name; an option that fits no model; no model loads (each
        model's reason); in one line.
    """
    names = list(options.model)
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise CheckpointError(f"--model {repeated[0]} is given twice: give each model once")
    ip_adapters = [ip_adapter_file(text) for text in options.ip_adapter]  # refused before any download
    enable_compilation_cache(options.cache_dir)
    loras = dict(options.lora)
    load = functools.partial(Pipeline.from_pretrained, dtype=options.dtype, max_steps=max_steps,
                             vae_tiling=not options.no_vae_tiling, weights_dtype=options.weights_dtype)
    controlnets = _controlnets_by_model(options, names)
    # Several models share the devices; those that do not fit beside the others wait in host memory.
    residency = Residency(getattr(options, "models_on_devices", None)) if len(names) > 1 else None
    models, failed, notice = [], {}, None
    for name in names:
        shared = {} if not models else {"devices": list(models[0].pipe.mesh.devices.flat),
                                        "executables": models[0].pipe.executables}
        scheduler = recommended(name, options.unet, loras=tuple(loras)).scheduler
        start = time.perf_counter()
        try:
            pipe = _load_beside(residency, functools.partial(
                load, name, config=options.config, scheduler=scheduler, unet=options.unet, vae=options.vae,
                controlnet=controlnets.get(name, options.controlnet), prediction_type=options.prediction_type,
                rescale_betas_zero_snr=options.zero_terminal_snr or None, **shared))
        except CheckpointError as e:
            if len(names) == 1 and not (fallback and isinstance(e, HubUnavailableError)):
                if isinstance(e, HubUnavailableError):  # the CLI: the model it asked for, or what to do
                    raise HubUnavailableError(
                        f"{e}; to draw without the Hub, run the built-in model instead: --model {FALLBACK_MODEL}"
                    ) from e
                raise
            failed[name] = e
            log.warning("model %s failed to load: %s", name, e)
            continue
        except jax.errors.JaxRuntimeError as e:  # the devices' memory is full, even with the others moved out
            if not models or "RESOURCE_EXHAUSTED" not in str(e):
                raise
            failed[name] = CheckpointError(
                "it does not fit the devices' memory, even with the other models in host memory: hold weights in 8 "
                "bits (--weights-dtype int8)")
            log.warning("model %s failed to load: %s", name, failed[name])
            continue
        others = [model.pipe for model in models]
        shared_parts = pipe.hold_once(others)
        if shared_parts:
            log.info("%s holds %s of an earlier model once", name, " and ".join(shared_parts))
        if residency is not None:
            residency.add(pipe, name)
        settings = recommended(name, options.unet, pipe.spec.default_sampler, tuple(loras))
        models.append(Model(name, pipe, model_label(name, options.unet), settings))
        log.info("loaded %s in %.1f s", name, time.perf_counter() - start)
    embedding = embedding_files(options.embedding)
    if not models:
        hub_failed = [name for name in names if isinstance(failed.get(name), HubUnavailableError)]
        if not (fallback and hub_failed):
            raise CheckpointError("no model loads: " + "; ".join(f"{name}: {why}" for name, why in failed.items()))
        notice = _fallback_notice("; ".join(str(failed[name]) for name in hub_failed), options)
        log.warning(notice)
        failed = {}  # the notice says why
        pipe = load(FALLBACK_MODEL)
        models = [Model(FALLBACK_MODEL, pipe, settings=recommended(FALLBACK_MODEL, None, pipe.spec.default_sampler,
                                                                   tuple(loras)), notice=notice)]
        ip_adapters, embedding = [], []  # they steer the model asked for
    served = {model.name: model for model in models}
    _attach_each(list(served), "ip-adapter", [(", ".join(options.ip_adapter), ip_adapters)] if ip_adapters else [],
                 lambda name, files: load_ip_adapters(served[name].pipe, files))
    _attach_each(list(served), "embedding", [(str(file), file) for file in embedding],
                 lambda name, file: served[name].pipe.load_textual_inversion([file]))
    _attach_each(list(served), "lora", [(source, (source, scale)) for source, scale in loras.items()],
                 lambda name, lora: _read_lora(served[name], *lora))
    for model in models:
        model.pipe.set_loras(model.loras)
        for source in options.upscaler:
            model.pipe.add_upscaler(source)
    if options.refiner:
        refiner = load(options.refiner, devices=list(models[0].pipe.mesh.devices.flat),
                       executables=models[0].pipe.executables)
        _attach_each(list(served), "refiner", [(options.refiner, refiner)],
                     lambda name, _: served[name].pipe.set_refiner(refiner))
    return models, failed


def _load_beside(residency: Residency | None, load_one: Callable[[], Pipeline]) -> Pipeline:
    """`load_one()` beside the models loaded before it: first making room for it (`--models-on-devices`), then,
    while the devices' memory is full, moving out the model used longest ago, the most held at once
    becoming the count that fit.

    Raises:
      jax.errors.JaxRuntimeError: it does not fit alone either.
    """
    if residency is None:
        return load_one()
    residency.make_room()
    while True:
        try:
            return load_one()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e) or not residency.on_devices:
                raise
            residency.limit(len(residency.on_devices))
            residency.make_room()
            log.warning("the devices' memory holds %d model(s) at once: the others wait in host memory",
                        residency.most_on_devices)


def _fallback_notice(reason: str, options: argparse.Namespace) -> str:
    """Why the built-in model stands in for the ones asked for, what it draws, and how to get real models."""
    return (
        f"{reason}. Showing the built-in {FALLBACK_MODEL} model instead: it draws coloured circles, squares and "
        f"triangles on coloured backgrounds (try the examples). It knows only the English words of its "
        f"captions ({shapes.vocabulary()}): other words, and other languages, give blobs unrelated to the prompt. "
        f"For real images, start once where the Hub is "
        f"reachable and without HF_HUB_OFFLINE=1: the files the pipeline loads (configs, tokenizers, "
        f"safetensors weights) are then downloaded into your Hugging Face cache, and later starts read them "
        f"from there, offline too."
    ) + (" The ControlNets are not loaded: they steer the model asked for." if options.controlnet else "") + (
        " The IP-Adapters are not loaded: they steer the model asked for." if options.ip_adapter else "") + (
        " The VAE asked for is not loaded: it belongs with the model asked for." if options.vae else "") + (
        " The embeddings are not loaded: they belong with the model asked for." if options.embedding else "")


def _controlnets_by_model(options: argparse.Namespace, names: list[str]) -> dict[str, list[str]]:
    """Of several models, the `--controlnet`s each one fits, checked against its configs before any
    weights are fetched (a ControlNet's family is in its config); none for one model, which takes them
    all or fails with the reason.

    Raises:
      CheckpointError: a ControlNet fits none of the models.
    """
    if len(names) == 1 or not options.controlnet:
        return {}
    specs = {}
    for name in names:
        try:
            specs[name] = checkpoints.resolve(name, config=options.config, unet=options.unet, vae=options.vae).spec
        except CheckpointError:
            continue  # the model fails to load, and says why then
    fitting = {name: [] for name in specs}

    def check(name: str, source: str) -> None:
        controlnet_checkpoints.resolve(source, specs[name], dtype="float32")
        fitting[name].append(source)

    _attach_each(list(specs), "controlnet", [(source, source) for source in options.controlnet], check)
    return fitting


def _attach_each(names: list[str], option: str, sources: list[tuple[str, object]], attach) -> None:
    """Attaches each of `sources` ((text, value) of an `--option`) to every model it fits (`attach(name,
    value)` raises CheckpointError where it does not), saying in the log which it skips.

    Raises:
      CheckpointError: one fits none: with one model, its reason as it is; of several, each model's.
    """
    for text, value in sources:
        reasons = {}
        for name in names:
            try:
                attach(name, value)
            except CheckpointError as e:
                reasons[name] = e
        if len(reasons) == len(names):
            if len(names) == 1:
                raise next(iter(reasons.values()))
            raise CheckpointError(f"--{option} {text} fits none of the models: "
                                  + "; ".join(f"{name}: {why}" for name, why in reasons.items()))
        for name, why in reasons.items():
            log.warning("--%s %s is not loaded with %s: %s", option, text, name, why)


def _read_lora(model: Model, source: str, scale: float) -> None:
    """Reads a LoRA file, checked against the model, and lists it with the model's LoRAs."""
    model.pipe.model.reading([source])  # read once: `set_loras` finds it read
    model.loras[source] = scale


def demo_service(options: argparse.Namespace) -> DemoService | None:
    """The demo's service for `demo_parser`'s options, warmed up: the default request's programs are
    compiled and have run once; the others compile in the background while it serves.

    With several processes (`--coordinator`, `sdxl.serving.hosts`), process 0 gets the service, whose queue
    has every other process make its calls; another process follows process 0 until it ends, then
    returns None."""
    # The package's own log lines (refused requests, given-up work) go to the console, one line each.
    console = logging.StreamHandler()
    console.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("sdxl").addHandler(console)
    logging.getLogger("sdxl").setLevel(logging.INFO)
    start = time.perf_counter()
    hosts = _join_hosts(options)
    storage = persistent_storage(os.environ, options.cache_dir)
    if storage is not None:
        hub.use_cache_folder(storage.hub_cache)
        options.cache_dir = options.cache_dir or storage.compilation_cache
        print(storage.describe(), flush=True)
    try:
        models, failed = load_models(options, fallback=True)
    except CheckpointError as e:
        if hosts is not None:  # every process stops, with the reason, rather than wait for this one
            hosts.agree("model", {"load error": str(e)})
        raise
    loaded = time.perf_counter()
    model = models[0]
    pipe = model.pipe
    if hosts is not None:
        hosts.agree("model", {"models": [multihost.model_facts(model) for model in models]})
        if not hosts.leader:
            hosts.follow([model.pipe for model in models])
            return None
    per_core = options.max_images_per_core or IMAGES_PER_CORE
    service = DemoService(
        models, max_images_per_core=per_core, max_queued=options.max_queue, max_per_owner=options.max_per_user,
        emphasis=options.emphasis, runner=None if hosts is None else hosts.runner(pipe),  # calls to every process
        failed={name: str(why) for name, why in failed.items()},
    )
    warm_ups = [service.images(_warm_up_settings(each, options.emphasis)) for each in models]
    warm_up_settings = _warm_up_settings(model, options.emphasis)
    # On an accelerator, the largest batch of each kind the demo renders, of every model, must fit a device's
    # memory beside every model's weights.
    served = [request for each, warm in zip(models, warm_ups) for request in (warm, *_edits(each.pipe, warm).values())]
    batch = lambda n: pipe.padded_batch(n * pipe.num_devices)  # noqa: E731
    try:
        _moving_models_out_to_fit(models[0].residency, options.models_on_devices, lambda: memory.check_fits(
            pipe, lambda n: [p for r in served for p in r.programs_at(batch(n))], per_core,
            "--max-images-per-core {}".format))
    except memory.DoesNotFitError as e:
        if options.max_images_per_core is not None or e.fitting is None:  # asked for, or not even 1 fits
            raise
        per_core = e.fitting
        service.serve_images_per_core(per_core)
        note = f"Serving {per_core} image(s) per core, the most that fit: the default {IMAGES_PER_CORE} do not ({e})."
        log.warning(note)
        service.launch_notes.append(note)
    if storage is not None:
        service.launch_notes.append(storage.describe())
    _report_hires_fit(service, warm_up_settings)
    with CompileCounter() as compiles:  # models of one architecture share their programs
        compile_seconds = service.queue.runner.compile([p for warm in warm_ups for p in warm.programs])
    warm_start = time.perf_counter()
    for warm in reversed(warm_ups):  # the first model last: it stays on the devices where not all do
        service.queue.wait(service.queue.submit(warm))
    ready = time.perf_counter()
    for each in models:
        print(f"model {each.label} ({dtypes_label(each.pipe)}, {each.pipe.spec.sampling}) on "
              f"{each.pipe.device_description}" + (f", model hash {each.hash}" if each.pipe.weights_file else "")
              + (", in host memory until a request needs it" if each.placement and each.placement.where == HOST
                                                                  else ""))
    for name, why in failed.items():
        print(f"model {name} did not load: {why}")
    print(f"compilation cache {jax.config.jax_compilation_cache_dir}")
    print(f"startup: load {loaded - start:.1f} s, compile {compile_seconds:.1f} s ({compiles.cached} of "
          f"{compiles.count} programs from the cache), warm-up {ready - warm_start:.1f} s, total {ready - start:.1f} s",
          flush=True)
    for each, warm in zip(models, warm_ups):
        for label, programs in _compiled_in_background(each.pipe, warm, per_core).items():
            compiling = service.queue.compile_in_background(programs)
            if compiling is not None:
                label = label if len(models) == 1 else f"{each.name}: {label}"
                compiling.add_done_callback(functools.partial(_report_background_compile, label))
    return service


def _moving_models_out_to_fit(residency: Residency | None, asked: int | None, check: Callable[[], None]) -> None:
    """Runs the launch's fit check (`check`), moving models to host memory, those used longest ago first, while
    it fails with more than one on the devices (unless `--models-on-devices` asked for how many).

    Raises:
      memory.DoesNotFitError: it fails with one model on the devices (or as many as asked).
    """
    while True:
        try:
            return check()
        except memory.DoesNotFitError:
            if residency is None or asked is not None or len(residency.on_devices) < 2:
                raise
            residency.limit(len(residency.on_devices) - 1)
            log.warning("the devices' memory holds %d model(s) at once beside the programs: the others wait in "
                        "host memory", residency.most_on_devices)


def _warm_up_settings(model: Model, emphasis: str) -> Settings:
    """The request a launch renders first with a model: its default size and guidance, two steps."""
    return Settings(prompt="warm-up", model=model.name, guidance_scale=model.settings.guidance_scale, steps=2,
                    emphasis=emphasis)


@dataclasses.dataclass(frozen=True)
class PersistentStorage:
    """The caches a launch keeps on persistent storage, each None where the user placed it elsewhere."""

    root: Path
    hub_cache: Path | None  # the Hugging Face cache (the models' files)
    compilation_cache: Path | None

    def describe(self) -> str:
        """Where they are, as the page and the log say it."""
        kept = [f"{what} in {path}" for what, path in (("the models' files", self.hub_cache),
                                                        ("the compiled programs", self.compilation_cache)) if path]
        skipped = [what for what, path in (("the download", self.hub_cache),
                                           ("the compilation", self.compilation_cache)) if path]
        if not kept:
            return f"Persistent storage at {self.root}: unused, as both caches are placed elsewhere."
        return (f"Persistent storage at {self.root} keeps {' and '.join(kept)}: a restart skips "
                f"{' and '.join(skipped)}.")


def persistent_storage(env: Mapping[str, str], cache_dir: str | None) -> PersistentStorage | None:
    """Where a demo on a Hugging Face Space keeps its caches across restarts: where the Space has
    persistent storage (`/data`, mounted and writable; or the folder SDXL_PERSISTENT_STORAGE names,
    anywhere), the Hugging Face cache goes to `.huggingface/hub` there (as HF_HOME=/data/.huggingface
    would put it) unless HF_HOME or HF_HUB_CACHE is set, and the compilation cache to `sdxl-jax/xla`
    unless `cache_dir` (--cache-dir, SDXL_CACHE_DIR) is given. None without such storage."""
    root = env.get("SDXL_PERSISTENT_STORAGE") or (SPACES_STORAGE if env.get("SYSTEM") == "spaces" else "")
    if not root or not os.path.isdir(root) or not os.access(root, os.W_OK):
        return None
    root = Path(root).resolve()
    user_hub = any(env.get(name) for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"))
    return PersistentStorage(root, None if user_hub else root / ".huggingface" / "hub",
                             None if cache_dir else root / "sdxl-jax" / "xla")


def _report_hires_fit(service: DemoService, settings: Settings) -> None:
    """Says whether the second pass of a hires fix at the form's default upscale fits the largest batch,
    on a device that reports its memory (where `memory.check_fits` checks): said, not refused, as
    requests without a hires fix fit. The pass stays compiled for the first request with one."""
    pipe = service.pipe
    if memory.device_memory(pipe) is None:
        return
    hires = service.images(dataclasses.replace(settings, hires=True))
    second, most = hires.hires.request, service.max_images_per_core
    what = f"a hires fix at its default {hires.request.hires.scale:g}x ({second.width}x{second.height})"
    try:
        memory.check_fits(pipe, lambda n: hires.hires.programs_at(pipe.padded_batch(n * pipe.num_devices)), most,
                          "--max-images-per-core {}".format)
    except memory.DoesNotFitError as e:
        print(f"warning: {what}: {e}", flush=True)
    else:
        print(f"{what}: fits at --max-images-per-core {most}", flush=True)


def _join_hosts(options: argparse.Namespace) -> "multihost.Hosts | None":
    """With `--coordinator` (or on a TPU pod slice's hosts: `sdxl.serving.hosts.detected`), this process among
    the others (`sdxl.serving.hosts.join`), started alike (or it ends with the difference, status 2); None for
    one process."""
    where = multihost.Where(getattr(options, "coordinator", None), getattr(options, "num_processes", None),
                            getattr(options, "process_id", None))
    if where == multihost.Where():
        where = multihost.detected()  # a TPU pod slice's hosts, with none of the three options
    problem = where.problem()
    if problem:
        multihost.fail(problem, 2)
    hosts = multihost.join(where, join_seconds=getattr(options, "join_timeout", multihost.JOIN_SECONDS))
    if hosts is not None:
        hosts.agree("options", multihost.option_facts(options))
        print(f"{hosts.describe(hosts.process_id)} of {hosts.count}: "
              f"{'serves' if hosts.leader else 'follows process 0'}", flush=True)
    return hosts


def _compiled_in_background(pipe: Pipeline, warm_up: PreparedRequest, max_images_per_core: int) -> dict[str, tuple]:
    """The programs that compile while the demo serves, by label: the batch sizes that "images per
    core" and merged requests use, the other guidance variant (a guidance scale of 1 or less runs
    without), then image-to-image and inpainting (and the refiner's handoff), at the first size."""
    programs = {f"batch {n * pipe.num_devices}": warm_up.programs_at(pipe.padded_batch(n * pipe.num_devices))
                for n in range(2, max_images_per_core + 1)}
    request = warm_up.request
    other = "without guidance" if request.guided else "with guidance"
    flipped = dataclasses.replace(request, guidance_scales=(1.0 if request.guided else 5.0,) * len(request))
    programs[f"batch {len(request)} {other}"] = pipe.prepare(flipped).programs
    for label, edited in _edits(pipe, warm_up).items():
        programs[label] = edited.programs
    return programs


def _edits(pipe: Pipeline, warm_up: PreparedRequest) -> dict[str, PreparedRequest]:
    """The warm-up request as the demo's other kinds of request, by label: image-to-image and
    inpainting (and with a refiner, refined; with IP-Adapters, with an image prompt, whose program
    runs the image encoder and the adapters' layers besides)."""
    request = warm_up.request
    pixels = np.zeros((len(request), request.height, request.width, 3), np.uint8)
    edits = {"image-to-image": dict(images=pixels), "inpainting": dict(images=pixels, masks=pixels[..., 0] == 0)}
    if pipe.ip_adapters:
        prompt = ImagePrompt(pixels[0])  # every adapter's, every image's
        edits["image prompts"] = dict(image_prompts=conditionings.per_image(
            IMAGE_PROMPTS, [prompt] * len(pipe.ip_adapters), len(request), "warm-up"))
    if pipe.refiner is not None:
        edits["refining"] = dict(refine_from=DEFAULT_REFINE_FROM)
    return {label: pipe.prepare(dataclasses.replace(request, **edit)) for label, edit in edits.items()}


def _report_background_compile(label: str, compiling) -> None:
    error = compiling.exception()
    outcome = f"failed: {error}" if error else f"{compiling.result():.1f} s"
    print(f"background compile of {label}: {outcome}", flush=True)
