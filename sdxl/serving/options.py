"""The command-line options of the demo (`python app.py`) and the CLI (`python -m sdxl generate`): the
model and what loads with it, which both take, and the demo's own. Each demo option also reads an
environment variable (SDXL_MODEL, ...), for Spaces, which take no options.
"""

import argparse
import os
import re
from collections.abc import Mapping

from ..engine.request import DEFAULT_MODEL
from ..models.quantization import ALIASES, WEIGHT_DTYPES
from ..prompts.syntax import EMPHASIS_MODES
from ..sampling.schedulers import PREDICTION_TYPES
from . import hosts as multihost

FALLBACK_MODEL = "shapes"  # trained here, shipped in assets/: it draws what it is told, offline
IMAGES_PER_CORE = 4  # the default most images per core: fewer where they do not fit a device


def add_shared_options(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None, *,
                       several_models: bool = False) -> None:
    """The options the demo and the CLI share: the model and what loads with it, and how prompts'
    weights apply. With `env` (the demo's environment), each defaults to its SDXL_* variable there
    and its help names it; without (the CLI), no variable is read. With `several_models` (the demo),
    `--model` may be given several times (SDXL_MODEL a comma-separated list), and is a list."""
    variable = _Variables(env)
    what = ("a Hub repo id, a diffusers folder, a single .safetensors file (local, or owner/name/file on the Hub), "
            f"'{FALLBACK_MODEL}' (built in: coloured shapes at 64x64, no download), or 'tiny' / 'tiny-sd1' (random "
            "weights, for tests)")
    if several_models:
        models = [name.strip() for name in variable.get("SDXL_MODEL", DEFAULT_MODEL).split(",") if name.strip()]
        parser.add_argument("--model", action=_Several, default=models, metavar="MODEL",
                            help=f"{what}; repeatable: the page offers each, the first by default, and compares "
                            f"them in a grid (default: {','.join(models)})" + variable.named("SDXL_MODEL",
                                                                                             "comma-separated"))
    else:
        parser.add_argument("--model", default=DEFAULT_MODEL, help=f"{what} (default: %(default)s)")
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
    parser.add_argument(
        "--prediction-type", default=variable.get("SDXL_PREDICTION_TYPE"), type=_one_of(PREDICTION_TYPES),
        choices=PREDICTION_TYPES, help="what the model predicts, for a checkpoint that does not say, as ComfyUI's "
        "ModelSamplingDiscrete node (default: what its scheduler config, its v_pred key or its model spec says, else "
        "epsilon)" + variable.named("SDXL_PREDICTION_TYPE"),
    )
    parser.add_argument(
        "--zero-terminal-snr", action="store_true", default=variable.get("SDXL_ZERO_TERMINAL_SNR") == "1",
        help="the model was trained with zero terminal SNR but its checkpoint does not say (a single file's ztsnr "
        "key does), as A1111's Noise schedule setting: the rescaled noise schedule, its steps trailing"
        + variable.named("SDXL_ZERO_TERMINAL_SNR=1"),
    )
    dtypes = ("float32", "bfloat16")
    parser.add_argument("--dtype", default=variable.get("SDXL_DTYPE"), type=_one_of(dtypes), choices=dtypes,
                        help="default: bfloat16 on accelerators, float32 on CPU" + variable.named("SDXL_DTYPE"))
    weights_dtypes = (*WEIGHT_DTYPES, *ALIASES)
    parser.add_argument("--weights-dtype", default=variable.get("SDXL_WEIGHTS_DTYPE", "default"),
                        type=_one_of(weights_dtypes), choices=weights_dtypes,
                        help="how the UNet's and ControlNets' large weights are stored, computed in --dtype all the "
                        "same: default (in --dtype), fp8_e4m3fn (fp8) or fp8_e5m2 as ComfyUI's weight_dtype and "
                        "Forge's --unet-in-fp8-e4m3fn, or int8; each with a scale per output channel, half "
                        "bfloat16's bytes; int8_compute or fp8_e4m3fn_compute (fp8_e4m3fn_fast, ComfyUI's) also "
                        "multiply in 8 bits in the Linear layers and 3x3 convolutions (default: %(default)s)"
                        + variable.named("SDXL_WEIGHTS_DTYPE"))
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


class _Several(argparse.Action):
    """A repeatable option whose values replace its default list (argparse's "append" adds to it)."""

    def __call__(self, parser, namespace, value, option_string=None):
        given = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [value] if given is self.default else [*given, value])


class _Variables:
    """Options' defaults from environment variables: with no `env` (the CLI's case), none is read or named."""

    def __init__(self, env: Mapping[str, str] | None):
        self.env = env

    def get(self, name: str, default: str | None = None) -> str | None:
        return default if self.env is None else self.env.get(name, default)

    def named(self, name: str, note: str = "") -> str:
        """The help's mention of an option's variable, e.g. " [env: SDXL_MODEL]"."""
        return "" if self.env is None else f" [env: {name}{' ' + note if note else ''}]"


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
    parser.add_argument("--models-on-devices", type=_integer_from(1), default=variable.get("SDXL_MODELS_ON_DEVICES"),
                        help="with several --model: the most whose weights the devices hold at once; the others wait "
                        "in host memory and move in when a request needs one, the one used longest ago moving out "
                        "(default: all that fit, as the launch finds on devices that report their memory)"
                        + variable.named("SDXL_MODELS_ON_DEVICES"))
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
    add_shared_options(parser, os.environ, several_models=True)
    add_demo_options(parser, os.environ)
    return parser


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
