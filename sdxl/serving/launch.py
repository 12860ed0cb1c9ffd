"""Starting the demo or the CLI: the model options both take, loading the model they name (with its
LoRAs and refiner, and offline the built-in `shapes` model in its place), and the demo's service,
warmed up before it serves and compiling the rest in the background while it does.
"""

import argparse
import dataclasses
import functools
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import numpy as np

from ..checkpoints import CheckpointError, HubUnavailableError, hub, shapes
from ..checkpoints.weights import refuse_pickled
from ..engine import conditionings, memory
from ..engine.compilation import CompileCounter, enable_compilation_cache
from ..engine.image_prompts import IMAGE_PROMPTS, ImagePrompt
from ..engine.images import model_label
from ..engine.pipeline import Pipeline
from ..engine.prepared import PreparedRequest
from ..engine.request import DEFAULT_MODEL, DEFAULT_REFINE_FROM
from ..prompts.syntax import EMPHASIS_MODES
from . import hosts as multihost
from .demo import DemoService, Settings
from .known import Recommended, recommended

log = logging.getLogger(__name__)

FALLBACK_MODEL = "shapes"  # trained here, shipped in assets/: it draws what it is told, offline
IMAGES_PER_CORE = 4  # the default most images per core: fewer where they do not fit a device
# Where a Hugging Face Space mounts its persistent storage, when it has some (`SYSTEM=spaces` there).
SPACES_STORAGE = "/data"


def add_shared_options(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """The options the demo and the CLI share: the model and what loads with it, and how prompts'
    weights apply. With `env` (the demo's environment), each defaults to its SDXL_* variable there
    and its help names it; without (the CLI), no variable is read."""
    variable = _Variables(env)
    parser.add_argument(
        "--model", default=variable.get("SDXL_MODEL", DEFAULT_MODEL),
        help="a Hub repo id, a diffusers folder, a single .safetensors file (local, or owner/name/file on the Hub), "
        f"'{FALLBACK_MODEL}' (built in: coloured shapes at 64x64, no download), or 'tiny' / 'tiny-sd1' (random "
        "weights, for tests) (default: %(default)s)" + variable.named("SDXL_MODEL"),
    )
    parser.add_argument(
        "--config", default=variable.get("SDXL_CONFIG"),
        help="for a single file: sdxl-base-1.0, sd-1.5, sd-2.1, sd-2.1-base or a diffusers folder "
        "(default: the published one of the family its keys show)" + variable.named("SDXL_CONFIG"),
    )
    parser.add_argument(
        "--unet", default=variable.get("SDXL_UNET"), help="a UNet weights file (diffusers keys) replacing the "
        "model's, e.g. ByteDance/SDXL-Lightning/sdxl_lightning_4step_unet.safetensors (local, or owner/name/file on "
        "the Hub)" + variable.named("SDXL_UNET"),
    )
    parser.add_argument("--upscaler", action="append", default=[], metavar="FILE",
                        help="a model upscaler (ESRGAN, Real-ESRGAN: 4x-UltraSharp, RealESRGAN_x4plus, ...) for the "
                        "hires fix and the Upscale tab, by its file's name; repeatable. A .safetensors or .pth file "
                        "(local, or owner/name/file on the Hub)")
    parser.add_argument(
        "--vae", default=variable.get("SDXL_VAE"), help="a VAE replacing the model's: a diffusers folder, a Hub repo "
        "id (madebyollin/sdxl-vae-fp16-fix), or a .safetensors file in diffusers' or the original keys (local, or "
        "owner/name/file on the Hub)" + variable.named("SDXL_VAE"),
    )
    parser.add_argument(
        "--no-vae-tiling", action="store_true", default=variable.get("SDXL_VAE_TILING") == "0",
        help="decode and encode pictures of more pixels than the VAE's tile (SDXL: 1024x1024) whole; by default "
        "they go in overlapping tiles as diffusers' enable_vae_tiling(), in the memory of one tile (a hires fix's "
        "2048x2048 in a 1024x1024's)" + variable.named("SDXL_VAE_TILING=0"),
    )
    parser.add_argument("--lora", action="append", type=source_and_scale, default=[], metavar="FILE[:SCALE]",
                        help="a LoRA, with its scale (default 1); repeatable. A .safetensors file (kohya/A1111 or "
                        "diffusers/PEFT), a Hub repo id, or owner/name/file.safetensors")
    parser.add_argument("--embedding", action="append", default=[], metavar="PATH",
                        help="a textual-inversion embedding that prompts name by its file's stem, as in A1111: a "
                        ".safetensors file (SDXL's clip_l and clip_g, or SD 1.x's one tensor), or a folder of them; "
                        "repeatable")
    controlnet = variable.get("SDXL_CONTROLNET")
    parser.add_argument(
        "--controlnet", action="append", default=[controlnet] if controlnet else [],
        metavar="SOURCE", help="a ControlNet that control images steer the model through; repeatable. A diffusers "
        "folder, a Hub repo id (diffusers/controlnet-canny-sdxl-1.0, lllyasviel/control_v11p_sd15_canny), or a "
        ".safetensors file (local, or owner/name/file on the Hub)" + variable.named("SDXL_CONTROLNET", "for one"),
    )
    ip_adapter = variable.get("SDXL_IP_ADAPTER")
    parser.add_argument(
        "--ip-adapter", action="append", default=[ip_adapter] if ip_adapter else [], metavar="FILE",
        help="an IP-Adapter that image prompts steer the model through; repeatable. Its .safetensors file, local "
        "(FOLDER/file.safetensors, the image encoder in FOLDER/image_encoder) or on the Hub as owner/name/FOLDER/"
        "file (h94/IP-Adapter/sdxl_models/ip-adapter_sdxl.safetensors); h94's *vit-h* files read models/"
        "image_encoder, and several share the first one's encoder" + variable.named("SDXL_IP_ADAPTER", "for one"),
    )
    parser.add_argument(
        "--refiner", default=variable.get("SDXL_REFINER"), help="an SDXL refiner (e.g. stabilityai/stable-diffusion-"
        "xl-refiner-1.0) that finishes images from a fraction of the noise; it is held on every device beside the "
        "model" + variable.named("SDXL_REFINER"),
    )
    # String defaults go through `type` (choices do not check them), so a bad environment variable gets
    # argparse's message.
    dtypes = ("float32", "bfloat16")
    parser.add_argument("--dtype", default=variable.get("SDXL_DTYPE"), type=_one_of(dtypes), choices=dtypes,
                        help="default: bfloat16 on accelerators, float32 on CPU" + variable.named("SDXL_DTYPE"))
    parser.add_argument("--emphasis", default=variable.get("SDXL_EMPHASIS", "original"), type=_one_of(EMPHASIS_MODES),
                        choices=EMPHASIS_MODES,
                        help="how (word:1.2) weights apply, as webui's Emphasis setting: original (its default, each "
                        "chunk keeps its mean), no-norm, or none (brackets read as text) (default: %(default)s)"
                        + variable.named("SDXL_EMPHASIS"))
    parser.add_argument("--cache-dir", default=variable.get("SDXL_CACHE_DIR"),
                        help="the persistent compilation cache (default: ~/.cache/sdxl-jax/xla)"
                        + variable.named("SDXL_CACHE_DIR"))


def split_scale(text: str) -> tuple[str, float | None]:
    """A command line's "SOURCE[:SCALE]" as (source, scale), the scale None where not given (a colon
    not followed by a number belongs to the source)."""
    source, sep, scale = text.rpartition(":")
    if sep and re.fullmatch(r"[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?", scale):
        return source, float(scale)
    return text, None


def source_and_scale(text: str) -> tuple[str, float]:
    """A `--lora SOURCE[:SCALE]` value as (source, scale); the scale defaults to 1."""
    source, scale = split_scale(text)
    return source, 1.0 if scale is None else scale


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


class _Variables:
    """Options' defaults from environment variables: with no `env` (the CLI's case), none is read or named."""

    def __init__(self, env: Mapping[str, str] | None):
        self.env = env

    def get(self, name: str, default: str | None = None) -> str | None:
        return default if self.env is None else self.env.get(name, default)

    def named(self, name: str, note: str = "") -> str:
        """The help's mention of an option's variable, e.g. " [env: SDXL_MODEL]"."""
        return "" if self.env is None else f" [env: {name}{' ' + note if note else ''}]"


@dataclasses.dataclass
class Model:
    """A loaded model, as the demo and the CLI present it."""

    pipe: Pipeline
    label: str  # how results name it
    settings: Recommended  # its steps, guidance, sizes and examples
    loras: dict[str, float]  # the LoRAs loaded with it, {source: scale}
    notice: str | None = None  # why the built-in model stands in for the one asked for


def load(options: argparse.Namespace, *, fallback: bool = False, max_steps: int = 100) -> Model:
    """The model `add_shared_options` named, with the compilation cache on, its LoRAs applied (each file
    read and checked now, not at a first request), its IP-Adapters loaded and its refiner set. With
    `fallback`, a Hub model that cannot be fetched is replaced by the built-in `shapes` model, with a
    notice that says why.

    Raises:
      CheckpointError: a file is missing or corrupt, or the model cannot run; in one line.
    """
    ip_adapters = [ip_adapter_file(text) for text in options.ip_adapter]  # refused before any download
    enable_compilation_cache(options.cache_dir)
    loras = dict(options.lora)
    load = functools.partial(Pipeline.from_pretrained, dtype=options.dtype, max_steps=max_steps,
                             vae_tiling=not options.no_vae_tiling)
    try:
        scheduler = recommended(options.model, options.unet, loras=tuple(loras)).scheduler
        pipe = load(options.model, config=options.config, scheduler=scheduler, unet=options.unet,
                    vae=options.vae, controlnet=options.controlnet)
        name, notice = options.model, None
    except HubUnavailableError as e:
        if not fallback:  # the CLI: a script gets the model it asked for, or a reason and what to do
            raise HubUnavailableError(
                f"{e}; to draw without the Hub, run the built-in model instead: --model {FALLBACK_MODEL}"
            ) from e
        notice = (
            f"{e}. Showing the built-in {FALLBACK_MODEL} model instead: it draws coloured circles, squares and "
            f"triangles on coloured backgrounds (try the examples). It knows only the English words of its "
            f"captions ({shapes.vocabulary()}): other words, and other languages, give blobs unrelated to the prompt. "
            f"For real images, start once where the Hub is "
            f"reachable and without HF_HUB_OFFLINE=1: the files the pipeline loads (configs, tokenizers, "
            f"safetensors weights) are then downloaded into your Hugging Face cache, and later starts read them "
            f"from there, offline too."
        ) + (" The ControlNets are not loaded: they steer the model asked for." if options.controlnet else "") + (
            " The IP-Adapters are not loaded: they steer the model asked for." if ip_adapters else "") + (
            " The VAE asked for is not loaded: it belongs with the model asked for." if options.vae else "") + (
            " The embeddings are not loaded: they belong with the model asked for." if options.embedding else ""
        )
        log.warning(notice)
        pipe, name, ip_adapters = load(FALLBACK_MODEL), FALLBACK_MODEL, []
    load_ip_adapters(pipe, ip_adapters)
    if options.embedding and not notice:
        pipe.load_textual_inversion(embedding_files(options.embedding))
    pipe.set_loras(loras)
    for source in options.upscaler:
        pipe.add_upscaler(source)
    if options.refiner:
        pipe.set_refiner(load(options.refiner, devices=list(pipe.mesh.devices.flat)))
    unet = None if notice else options.unet
    label = model_label(name, unet)
    return Model(pipe, label, recommended(name, unet, pipe.spec.default_sampler, tuple(loras)), loras, notice)


def add_demo_options(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """The demo's own options: where it listens and how much it takes, each defaulting to its SDXL_*
    variable in `env`."""
    variable = _Variables(env)
    parser.add_argument("--host", default=variable.get("SDXL_HOST"),
                        help="the address to listen on (default: 127.0.0.1, Gradio's own; 0.0.0.0 for every "
                        "interface)" + variable.named("SDXL_HOST"))
    # String defaults go through `type` too, so a bad environment variable gets argparse's message.
    parser.add_argument("--port", type=_integer_from(1, 65535), default=variable.get("SDXL_PORT", "7860"),
                        help="the port to listen on (default: %(default)s)" + variable.named("SDXL_PORT"))
    parser.add_argument("--share", action="store_true", default=variable.get("SDXL_SHARE") == "1",
                        help="also serve the demo at a temporary public gradio.live address"
                        + variable.named("SDXL_SHARE=1"))
    parser.add_argument("--mcp", action="store_true", default=variable.get("SDXL_MCP") == "1",
                        help="also serve the endpoints (generate, image_to_image, compare, grid, upscale) as MCP "
                        "tools, at /gradio_api/mcp/ (Gradio's streamable HTTP transport; needs gradio[mcp])"
                        + variable.named("SDXL_MCP=1"))
    parser.add_argument("--max-images-per-core", type=_integer_from(1),
                        default=variable.get("SDXL_MAX_IMAGES_PER_CORE"),
                        help="the most images a request may ask of each accelerator core, which is also the "
                        f"largest batch the queue merges requests into (default: {IMAGES_PER_CORE}, or the most that "
                        "fit a device's memory where fewer do; a count given here that does not fit stops the "
                        "launch)" + variable.named("SDXL_MAX_IMAGES_PER_CORE"))
    parser.add_argument("--max-queue", type=_integer_from(1), default=variable.get("SDXL_MAX_QUEUE", "32"),
                        help="the most requests waiting, from all users together; more are refused with \"the queue "
                        "is full\" (default: %(default)s)" + variable.named("SDXL_MAX_QUEUE"))
    parser.add_argument("--max-per-user", type=_integer_from(1), default=variable.get("SDXL_MAX_PER_USER", "4"),
                        help="requests one browser session or API client may have waiting (default: %(default)s)"
                        + variable.named("SDXL_MAX_PER_USER"))
    hosts = parser.add_argument_group(
        "several hosts", "run the same command on every host, each with its --process-id: process 0 serves the page "
        "and the API, the others follow its requests, and every host's devices render one batch. With none of the "
        "three, one process; on a TPU pod slice's hosts, the slice's processes, as JAX detects them")
    hosts.add_argument("--coordinator", default=variable.get("SDXL_COORDINATOR"), metavar="HOST:PORT",
                       help="where process 0 runs JAX's coordination service, reachable from every host; auto: "
                       "detect it and the other two (SLURM, Kubernetes, a TPU pod slice)"
                       + variable.named("SDXL_COORDINATOR"))
    hosts.add_argument("--num-processes", type=_integer_from(1), default=variable.get("SDXL_NUM_PROCESSES"),
                       help="how many processes (hosts)" + variable.named("SDXL_NUM_PROCESSES"))
    hosts.add_argument("--process-id", type=_integer_from(0), default=variable.get("SDXL_PROCESS_ID"),
                       help="this process's number, 0 (serves) to N-1" + variable.named("SDXL_PROCESS_ID"))
    hosts.add_argument("--join-timeout", type=_integer_from(1),
                       default=variable.get("SDXL_JOIN_TIMEOUT", str(multihost.JOIN_SECONDS)), metavar="SECONDS",
                       help="how long the hosts wait for one another at start before they stop with a sentence "
                       "(default: %(default)s)" + variable.named("SDXL_JOIN_TIMEOUT"))


def demo_parser(description: str) -> argparse.ArgumentParser:
    """`python app.py`'s options; each also reads an environment variable (SDXL_MODEL, ...), for Spaces."""
    parser = argparse.ArgumentParser(
        description=description,
        epilog="An option's [env: SDXL_...] variable, where set, is its default (for Spaces, which take no "
        f"options). Without the Hub (offline, or HF_HUB_OFFLINE=1) and no cached copy of the model, the built-in "
        f"{FALLBACK_MODEL} model stands in, and the page says so.",
    )
    add_shared_options(parser, os.environ)
    add_demo_options(parser, os.environ)
    return parser


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
        model = load(options, fallback=True)
    except CheckpointError as e:
        if hosts is not None:  # every process stops, with the reason, rather than wait for this one
            hosts.agree("model", {"load error": str(e)})
        raise
    loaded = time.perf_counter()
    pipe = model.pipe
    if hosts is not None:
        hosts.agree("model", multihost.model_facts(model))
        if not hosts.leader:
            hosts.follow(pipe)
            return None
    per_core = options.max_images_per_core or IMAGES_PER_CORE
    service = DemoService(
        pipe, model_label=model.label, max_images_per_core=per_core, max_queued=options.max_queue,
        max_per_owner=options.max_per_user, notice=model.notice, loras=model.loras, recommended=model.settings,
        emphasis=options.emphasis, runner=None if hosts is None else hosts.runner(pipe),  # calls to every process
    )
    warm_up_settings = Settings(prompt="warm-up", guidance_scale=model.settings.guidance_scale, steps=2,
                                emphasis=options.emphasis)
    warm_up = service.images(warm_up_settings)
    # On an accelerator, the largest batch of each kind the demo renders must fit a device's memory.
    served = [warm_up, *_edits(pipe, warm_up).values()]
    batch = lambda n: pipe.padded_batch(n * pipe.num_devices)  # noqa: E731
    try:
        memory.check_fits(pipe, lambda n: [p for r in served for p in r.programs_at(batch(n))], per_core,
                          "--max-images-per-core {}".format)
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
    with CompileCounter() as compiles:
        compile_seconds = service.queue.runner.compile(warm_up.programs)
    warm_start = time.perf_counter()
    service.queue.wait(service.queue.submit(warm_up))
    ready = time.perf_counter()
    print(f"model {model.label} ({pipe.dtype.name}) on {pipe.device_description}; compilation cache "
          f"{jax.config.jax_compilation_cache_dir}")
    print(f"startup: load {loaded - start:.1f} s, compile {compile_seconds:.1f} s ({compiles.cached} of "
          f"{compiles.count} programs from the cache), warm-up {ready - warm_start:.1f} s, total {ready - start:.1f} s",
          flush=True)
    for label, programs in _compiled_in_background(pipe, warm_up, per_core).items():
        compiling = service.queue.compile_in_background(programs)
        if compiling is not None:
            compiling.add_done_callback(functools.partial(_report_background_compile, label))
    return service


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


def _one_of(choices):
    """An argparse type: one of `choices` (which `choices=` does not check of a string default)."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


def _integer_from(low: int, high: int | None = None):
    """An argparse type: an integer of at least `low` (and at most `high`)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f"of at least {low}"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {text!r}")
        return value

    return parse
