"""`python -m sdxl bench`: how fast generation is, measured honestly, side by side with diffusers.

One run measures one model at one image size, step count and batch size:

- load: `Pipeline.from_pretrained` in a fresh process, against a raw read of the same weight files
  in that process (both with the files in the page cache), and the host's peak RSS against the
  parameters' bytes in bfloat16;
- compile: cold (in this process, with an empty persistent cache), and warm (in a fresh process
  that finds the persistent cache this process filled);
- time from process start to the first image, in this process (cold) and in the fresh one (warm);
- steady state: the median of `--runs` (default 5) timed `Pipeline.run` calls after warm-up. `run`
  returns the images on the host, so a timing covers the whole request: tokenization, transfers,
  the compiled program to completion, and the fetch;
- achieved TFLOP/s from XLA's cost analysis, and MFU against the device's peak;
- the cost of progress reporting (`run(..., on_step=...)`, a chain of staged programs) against the
  single program;
- the compilations over a sweep of prompt, seed, guidance and step count (expected: none);
- peak device memory, where the backend reports it.

With `--compare diffusers`, diffusers' pipeline loads the same saved folder and renders the same
batch (size, steps, guidance, sampler); its timed runs alternate with ours, so that a machine that
gets busier part-way slows both alike.

Models: a folder or Hub id, "tiny", "medium" (an SDXL-shaped model small enough for a CPU, built
here), or "sdxl-base" (SDXL base 1.0's published configs with random weights, about 7 GB in
float16, written to a temporary folder). `python -m sdxl write-checkpoint` writes such random
checkpoints, one tensor at a time.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from . import attention, checkpoint, convolution, tiny, unet
from .compilation import CompileCounter, enable_compilation_cache
from .config import read_json
from .weights import flatten

PROMPT = "a photograph of an astronaut riding a horse on the moon, detailed, sharp focus"
NEGATIVE_PROMPT = "blurry, low quality"
GUIDANCE_SCALE = 5.0
SAMPLER = "euler"  # diffusers' EulerDiscreteScheduler is the reference's counterpart

# Dense (no sparsity) bfloat16 peak TFLOP/s per chip, from the vendors' spec pages: Google Cloud
# TPU docs (v4, v5e, v5p, v6e system architecture) and NVIDIA's H100/H200/A100 datasheets, whose
# "with sparsity" figures are twice these. Matched in order against `device_kind`.
PEAK_BF16_TFLOPS = (
    ("TPU v4", 275.0),
    ("TPU v5 lite", 197.0),  # v5e
    ("TPU v5e", 197.0),
    ("TPU v5p", 459.0),
    ("TPU v5", 459.0),  # v5p reports itself as "TPU v5"
    ("TPU v6 lite", 918.0),  # v6e (Trillium)
    ("TPU v6e", 918.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM
    ("H200", 989.0),
    ("A100", 312.0),
)

# Bump when MEDIUM_CONFIGS or tiny.random_tensor change, so a stale cached checkpoint is not reused.
MEDIUM_VERSION = 2
MEDIUM_SIZE = 256
_MEDIUM_TEXT_ENCODER = {  # CLIP ViT-L's text encoder scaled down; 64-wide heads as in SDXL
    "architectures": ["CLIPTextModel"],
    "vocab_size": 514,  # the byte-level tokenizer's
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-05,
    "projection_dim": 128,
    "bos_token_id": 512,
    "eos_token_id": 513,
    "pad_token_id": 513,
}
_MEDIUM_TEXT_ENCODER_2 = {  # ... and OpenCLIP bigG's, with its projection and plain gelu
    **_MEDIUM_TEXT_ENCODER,
    "architectures": ["CLIPTextModelWithProjection"],
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_attention_heads": 4,
    "projection_dim": 256,
    "hidden_act": "gelu",
}
# SDXL's layout at a fifth of its width: three levels, no attention at the top one, the deepest
# transformers at the bottom, 64-wide attention heads, two text encoders whose states concatenate
# into the context, and a 4-level VAE. The UNet has 34M parameters and a 256x256 image costs 0.18
# TFLOP at 10 steps: a batch of 4 takes seconds on 2 CPU cores.
MEDIUM_CONFIGS = {
    **tiny.SDXL_CONFIGS,
    "unet/config.json": {
        "_class_name": "UNet2DConditionModel",
        "sample_size": MEDIUM_SIZE // 8,
        "in_channels": 4,
        "out_channels": 4,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "block_out_channels": [64, 128, 256],
        "layers_per_block": 2,
        "norm_num_groups": 32,
        "cross_attention_dim": _MEDIUM_TEXT_ENCODER["hidden_size"] + _MEDIUM_TEXT_ENCODER_2["hidden_size"],
        "attention_head_dim": [1, 2, 4],
        "transformer_layers_per_block": [1, 1, 2],
        "use_linear_projection": True,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 64,
        "projection_class_embeddings_input_dim": _MEDIUM_TEXT_ENCODER_2["projection_dim"] + 6 * 64,
    },
    "vae/config.json": {
        "_class_name": "AutoencoderKL",
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
        "block_out_channels": [32, 64, 128, 128],
        "layers_per_block": 1,
        "latent_channels": 4,
        "norm_num_groups": 32,
        "sample_size": MEDIUM_SIZE,
        "scaling_factor": 0.13025,
    },
    "text_encoder/config.json": _MEDIUM_TEXT_ENCODER,
    "text_encoder_2/config.json": _MEDIUM_TEXT_ENCODER_2,
}

# What `python -m sdxl write-checkpoint --config NAME` writes; "sdxl-base-1.0" is a folder of
# published configs in `checkpoint.BUILTIN_CONFIGS`.
RANDOM_MODELS = {"medium": MEDIUM_CONFIGS, **tiny.MODELS}


def peak_tflops(device_kind: str) -> float | None:
    """The device's dense bf16 peak in TFLOP/s, or None when it is not in `PEAK_BF16_TFLOPS`."""
    return next((peak for name, peak in PEAK_BF16_TFLOPS if name in device_kind), None)


# ---------------------------------------------------------------------------------------------
# Random checkpoints


def builtin_configs(name: str) -> dict:
    """{relative path: JSON} of a random model: a key of `RANDOM_MODELS`, or a published config folder.

    A published folder's text encoders name CLIP's real special tokens; they are set to those of the
    byte-level tokenizer a random checkpoint gets, so that the pooled text is taken at the end token.
    """
    if name in RANDOM_MODELS:
        return RANDOM_MODELS[name]
    folder = checkpoint.BUILTIN_CONFIGS / name
    if not folder.is_dir():
        known = sorted([*RANDOM_MODELS, *(p.name for p in checkpoint.BUILTIN_CONFIGS.iterdir())])
        raise ValueError(f"unknown config {name!r}; choose one of: {', '.join(known)}")
    configs = {str(p.relative_to(folder)): read_json(p) for p in sorted(folder.rglob("*.json"))}
    special_tokens = {
        k: tiny.SDXL_CONFIGS["text_encoder/config.json"][k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    for path, config in configs.items():
        if path.startswith("text_encoder"):
            configs[path] = {**config, **special_tokens}
    return configs


def resolve_model(name: str, scratch: Path) -> Path:
    """The checkpoint folder `bench --model name` measures.

    "medium" is written once into the project cache; "sdxl-base" (about 7 GB) into `scratch`, which
    the caller deletes; anything else is resolved as `Pipeline.from_pretrained` resolves it.
    """
    if name == "medium":
        return tiny.ensure_cached(f"medium-v{MEDIUM_VERSION}", MEDIUM_CONFIGS)
    if name == "sdxl-base":
        return tiny.write_checkpoint(scratch / "sdxl-base", builtin_configs("sdxl-base-1.0"), dtype="float16")
    return checkpoint.resolve(name)


# ---------------------------------------------------------------------------------------------
# FLOPs


def unet_flops(
    config: unet.UNetConfig,
    batch: int,
    latent_height: int,
    latent_width: int,
    context_length: int,
    dtype=jnp.float32,
) -> float:
    """XLA's FLOP count of one UNet evaluation on a batch (from the lowered program's cost analysis).

    The pipeline's denoising loop is a `while` loop with a traced trip count, whose body XLA's cost
    analysis counts once; this is the body's main cost, to count the other steps. It is traced in
    the pipeline's `dtype`, which picks the convolution algorithm (`sdxl.convolution`).
    """
    model = unet.UNet2DConditionModel(config, dtype)

    def arg(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    inputs = [
        arg(batch, latent_height, latent_width, config.in_channels),
        arg(batch),
        arg(batch, context_length, config.cross_attention_dim),
    ]
    if config.addition_embed_type == "text_time":
        time_ids = 6  # original size, crop top-left, target size
        pooled = config.projection_class_embeddings_input_dim - time_ids * config.addition_time_embed_dim
        inputs += [arg(batch, pooled), arg(batch, time_ids)]
    lowered = jax.jit(lambda params, *xs: model.apply({"params": params}, *xs)).lower(
        unet.abstract_params(config), *inputs
    )
    return float(_cost(lowered)["flops"])


def generation_flops(pipe, height: int, width: int, batch: int, steps: int) -> float:
    """FLOPs of one `steps`-step generation of a batch over all devices (padding images included).

    The compiled program's cost analysis is per device and counts the denoising loop's body once;
    the other `steps - 1` guided UNet evaluations are added from `unet_flops`.
    """
    per_device = float(_cost(pipe.compiled(height, width, batch, SAMPLER))["flops"])
    padded = pipe.padded_batch(batch)
    spec = pipe.spec
    latent_h, latent_w, _ = spec.latent_shape(height, width)
    step = unet_flops(spec.unet, 2 * padded, latent_h, latent_w, spec.max_tokens, pipe.dtype)  # x2: guidance
    return per_device * pipe.num_devices + (steps - 1) * step


def _cost(stage) -> dict:
    analysis = stage.cost_analysis()
    return analysis[0] if isinstance(analysis, list) else analysis  # older JAX: one dict per module


# ---------------------------------------------------------------------------------------------
# Measuring


def batch_request(
    batch: int,
    height: int,
    width: int,
    steps: int,
    *,
    prompt=PROMPT,
    negative_prompt=NEGATIVE_PROMPT,
    seed=0,
    guidance_scale=GUIDANCE_SCALE,
) -> dict:
    """`Pipeline.run` keyword arguments for one batch."""
    return dict(
        prompts=[prompt] * batch,
        negative_prompts=[negative_prompt] * batch,
        seeds=[seed] * batch,
        image_index=list(range(batch)),
        guidance_scales=[guidance_scale] * batch,
        steps=steps,
        height=height,
        width=width,
        sampler=SAMPLER,
    )


def sweep_requests(batch: int, height: int, width: int, steps: int) -> list[dict]:
    """Requests that change everything a user changes between calls except the image size and
    batch: prompts (including an empty negative prompt and one past the token limit), seed,
    guidance (including <= 1, which skips guidance) and the step count."""
    return [
        batch_request(batch, height, width, 1, prompt="a red cube", negative_prompt=""),
        batch_request(batch, height, width, 2, seed=123, prompt=" ".join(["a very long prompt"] * 40)),
        batch_request(batch, height, width, 1, guidance_scale=1.0),
        batch_request(batch, height, width, steps + 1, guidance_scale=9.0, seed=7),
    ]


def count_compilations(pipe, requests: list[dict]) -> int:
    """How many XLA compilations `pipe.run` needs over `requests`."""
    with CompileCounter() as compiles:
        for request in requests:
            pipe.run(**request)
    return compiles.count


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def read_files(files: list[Path], buffer_bytes: int = 16 << 20) -> tuple[float, int]:
    """Reads every byte of `files` into one reused buffer: (seconds, bytes), the floor for a loader."""
    buffer = memoryview(bytearray(buffer_bytes))
    total, start = 0, time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return time.perf_counter() - start, total


def _loaded_files(folder: Path, spec, dtype: str) -> list[Path]:
    """The weight files `Pipeline.from_pretrained` reads for `dtype`."""
    prefer_variant = None if dtype == "float32" else "fp16"
    components = ("unet", "vae", *spec.text_encoder_names)
    return [f for name in components for f in checkpoint.weight_files(folder / name, prefer_variant=prefer_variant)]


def _memory_status() -> dict[str, int]:
    """This process's current (VmRSS) and peak (VmHWM) resident memory in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def _process_start() -> float:
    """When this process started, in `time.time()` seconds (Linux; to 10 ms)."""
    start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def _default_dtype() -> str:
    return "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"


def _load(folder: Path, dtype: str, max_steps: int, num_devices: int | None):
    from .pipeline import Pipeline

    return Pipeline.from_pretrained(str(folder), dtype=dtype, max_steps=max_steps, devices=jax.devices()[:num_devices])


def evict_from_page_cache(files: list[Path]) -> None:
    """Drops the files' pages from the kernel's page cache, so the next read comes from the disk."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_load(folder: str, dtype: str, max_steps: int, num_devices: int | None, cold: bool = False):
    """Loads the pipeline, timed against a raw read of the same files; in a fresh process.

    Warm: the files are read twice first, so that the timed read and the load both find them in the
    page cache. Cold: the files are evicted from the page cache before the read and again before
    the load, so both come from the disk, as on a server's first start.

    Returns:
      (pipeline, {load_s, raw_read_s, weight_bytes, rss_before_load_bytes, load_peak_rss_bytes}),
      with `_cold` on the time keys when cold.
    """
    from .pipeline import ModelSpec

    folder = Path(folder)
    jax.devices()  # start the backend before taking the baseline memory
    files = _loaded_files(folder, ModelSpec.from_folder(folder), dtype)
    if cold:
        evict_from_page_cache(files)
    else:
        read_files(files)
    raw_read_s, weight_bytes = read_files(files)
    if cold:
        evict_from_page_cache(files)
    before = _memory_status()["VmRSS"]
    start = time.perf_counter()
    pipe = _load(folder, dtype, max_steps, num_devices)
    load_s = time.perf_counter() - start
    suffix = "_cold" if cold else ""
    return pipe, {
        f"load{suffix}_s": load_s,
        f"raw_read{suffix}_s": raw_read_s,
        "weight_bytes": weight_bytes,
        "rss_before_load_bytes": before,
        "load_peak_rss_bytes": _memory_status()["VmHWM"],
    }


def probe(
    folder: str,
    cache_dir: str,
    dtype: str,
    max_steps: int,
    num_devices: int | None,
    height: int,
    width: int,
    batch: int,
    steps: int,
) -> dict:
    """What a restarted server sees; run in a fresh process (`python -m sdxl.bench probe OPTIONS_JSON`).

    Loads the pipeline (`measure_load`, warm), compiles it with the persistent cache that the
    benchmark process filled, and renders the first image.
    """
    enable_compilation_cache(cache_dir)
    pipe, load = measure_load(folder, dtype, max_steps, num_devices)
    warm_compile_s = pipe.warmup(height, width, batch, SAMPLER)
    pipe.run(**batch_request(batch, height, width, steps))
    return dict(
        **load,
        warm_compile_s=warm_compile_s,
        first_image_warm_s=time.time() - _process_start(),
        peak_rss_bytes=_memory_status()["VmHWM"],
    )


def read_into_fresh_memory(folder: str, dtype: str) -> dict:
    """Reads every weight file into newly allocated memory (`python -m sdxl.bench read_into_fresh_memory
    OPTIONS_JSON`): the floor for a loader whose parameters live in host memory (a CPU backend).

    Fresh memory costs more than the bytes read on some virtual machines, where the host backs a
    guest's memory only when it is first touched: on this project's CI machine, 6.5 GiB took 29 s
    this way against 1.2 s into a reused buffer. It is measured in its own process because memory
    freed within a process is reused, and fast, from then on.
    """
    from .pipeline import ModelSpec

    files = _loaded_files(Path(folder), ModelSpec.from_folder(Path(folder)), dtype)
    read_files(files)  # into the page cache
    start = time.perf_counter()
    arrays = [np.fromfile(path, np.uint8) for path in files]
    seconds = time.perf_counter() - start
    del arrays
    return {"raw_read_fresh_s": seconds}


def _bf16_bytes(spec) -> int:
    return 2 * sum(int(np.prod(leaf.shape)) for leaf in flatten(spec.abstract_params()).values())


def load(folder: str, dtype: str, max_steps: int, num_devices: int | None, cold: bool) -> dict:
    """`measure_load`'s numbers alone (`python -m sdxl.bench load OPTIONS_JSON`)."""
    return measure_load(folder, dtype, max_steps, num_devices, cold)[1]


def _in_fresh_process(function: str, **options) -> dict:
    package_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run(
        [sys.executable, "-m", "sdxl.bench", function, json.dumps(options)], capture_output=True, text=True, env=env
    )
    if result.returncode:
        raise RuntimeError(f"the fresh-process measurement ({function}) failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def disk_and_fresh_memory_loads(folder: str, dtype: str, max_steps: int, num_devices: int | None) -> dict:
    """The load from the disk and the read into fresh memory, each in a fresh process.

    Only their times are kept: the memory numbers come from the process that loads with the page
    cache warm, as a restarted server does.
    """
    cold = _in_fresh_process(
        "load", folder=folder, dtype=dtype, max_steps=max_steps, num_devices=num_devices, cold=True
    )
    return {k: v for k, v in cold.items() if k.endswith("_cold_s")} | _in_fresh_process(
        "read_into_fresh_memory", folder=folder, dtype=dtype
    )


def load_ratios(r: dict) -> dict:
    """The loading goals' ratios: load time over raw read time (page cache warm, and cold), and peak RSS
    over the parameters' bytes in bfloat16 (of the whole process, and of its increase while loading)."""
    return dict(
        load_over_raw_read=r["load_s"] / r["raw_read_s"],
        load_over_raw_read_cold=r["load_cold_s"] / r["raw_read_cold_s"],
        load_over_raw_read_fresh=r["load_s"] / r["raw_read_fresh_s"],
        load_rss_over_bf16=r["load_peak_rss_bytes"] / r["param_bytes_bf16"],
        load_rss_increase_over_bf16=(r["load_peak_rss_bytes"] - r["rss_before_load_bytes"]) / r["param_bytes_bf16"],
    )


def _require_diffusers() -> None:
    """torch and diffusers are development dependencies (requirements-dev.txt), needed only here."""
    try:
        import diffusers  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"error: --compare diffusers needs torch and diffusers ({e}); see requirements-dev.txt") from e


def diffusers_reference(folder: Path, spec, dtype: str, request: dict) -> tuple[Callable[[], object], str]:
    """diffusers' pipeline for `folder`, set up like ours; returns (render one batch, device name).

    torch runs on CUDA in `dtype` when it can (diffusers' default attention is SDPA), else on all
    CPU cores. On CPU, denormal floats are flushed to zero: random weights produce many, and
    without flushing a torch UNet step is up to 10x slower (XLA flushes them already).
    """
    _require_diffusers()
    import torch
    from diffusers import DiffusionPipeline, EulerDiscreteScheduler
    from diffusers.utils import logging as diffusers_logging

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
        torch.set_flush_denormal(True)
    diffusers_logging.disable_progress_bar()
    extra = {"add_watermarker": False} if spec.is_sdxl else {"safety_checker": None, "requires_safety_checker": False}
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=getattr(torch, dtype), **extra).to(device)
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)

    def render():
        with torch.inference_mode():
            # output_type="np" copies the images to the host, which waits for the GPU.
            return pipe(
                prompt=request["prompts"],
                negative_prompt=request["negative_prompts"],
                height=request["height"],
                width=request["width"],
                num_inference_steps=request["steps"],
                guidance_scale=request["guidance_scales"][0],
                generator=torch.Generator(device).manual_seed(0),
                output_type="np",
            )

    name = torch.cuda.get_device_name() if device == "cuda" else f"{os.cpu_count()} CPU threads"
    return render, f"torch {torch.__version__} {name} {dtype}"


def _peak_device_memory(pipe) -> int | None:
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in pipe.mesh.devices.flat]
    return max(peaks) if all(p is not None for p in peaks) else None


def machine_description() -> str:
    """CPU model and cores, plus the accelerator kind and count."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
    device = jax.devices()[0]
    accelerator = "" if device.platform == "cpu" else f", {jax.device_count()}x {device.device_kind}"
    return f"{cpu} ({os.cpu_count()} cores){accelerator}"


@contextlib.contextmanager
def _scratch_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sdxl-bench-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_benchmark(
    model: str,
    *,
    height: int,
    width: int,
    steps: int,
    batch: int | None = None,
    runs: int = 5,
    num_devices: int | None = None,
    dtype: str | None = None,
    compare: str | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> dict:
    """Measures generation as the module docstring describes; returns the results as a flat dict.

    Args:
      model: "tiny", "medium", "sdxl-base", a checkpoint folder or a Hub repo id.
      batch: images per call (default: one per device).
      runs: timed runs for each median.
      num_devices: use the first this many devices (default: all).
      dtype: "float32" or "bfloat16" (default: float32 on CPU, else bfloat16).
      compare: "diffusers" to time diffusers' pipeline on the same weights.
      log: receives progress messages.
    """
    process_start = _process_start()
    if compare not in (None, "diffusers"):
        raise ValueError(f"--compare: only 'diffusers' is supported, got {compare!r}")
    if compare:
        _require_diffusers()  # before minutes of measuring
    # On a GPU, JAX would otherwise take most of its memory up front, and leave none to the fresh
    # process or to torch. It is read when the backend starts, which nothing has done yet.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    dtype = dtype or _default_dtype()
    max_steps = max(100, steps + 1)
    load_before = os.getloadavg()[0]
    with _scratch_dir() as scratch:
        write_start = time.perf_counter()
        folder = resolve_model(model, scratch)
        write_s = time.perf_counter() - write_start
        cache_dir = scratch / "xla-cache"
        enable_compilation_cache(cache_dir)  # empty: the first compile is cold

        log(f"loading {folder}")
        pipe = _load(folder, dtype, max_steps, num_devices)
        batch = batch or pipe.num_devices
        request = batch_request(batch, height, width, steps)
        pipe.validate(
            height=height, width=width, num_steps=steps, seed=0, guidance_scale=GUIDANCE_SCALE, sampler=SAMPLER
        )
        log(f"compiling for {width}x{height}, batch {batch}, on {pipe.device_description}")
        compile_s = pipe.warmup(height, width, batch, SAMPLER)
        pipe.run(**request)
        first_image_s = time.time() - process_start - write_s
        flops = generation_flops(pipe, height, width, batch, steps)
        attention_kernels = attention.kernels_in(pipe.compiled(height, width, batch, SAMPLER))
        progress_compile_s = pipe.warmup(height, width, batch, SAMPLER, progress=True)

        log("measuring load, warm compile and first image in a fresh process")
        fresh = _in_fresh_process(
            "probe",
            folder=str(folder),
            cache_dir=str(cache_dir),
            dtype=dtype,
            max_steps=max_steps,
            num_devices=num_devices,
            height=height,
            width=width,
            batch=batch,
            steps=steps,
        )
        log("measuring the load from the disk and a read into fresh memory, in fresh processes")
        fresh |= disk_and_fresh_memory_loads(str(folder), dtype, max_steps, num_devices)

        calls = {
            "ours": lambda: pipe.run(**request),
            "progress": lambda: pipe.run(**request, on_step=lambda done: None),
        }
        reference_device, reference_load_s = None, None
        if compare:
            log("loading diffusers' pipeline")
            start = time.perf_counter()
            calls["reference"], reference_device = diffusers_reference(folder, pipe.spec, dtype, request)
            reference_load_s = time.perf_counter() - start
        log(f"timing {runs} runs each of: {', '.join(calls)}")
        # Warm-up: ours ran once already (the first image); torch's CPU kernels take a few calls to settle.
        for name, call in calls.items():
            for _ in range({"ours": 0, "progress": 1, "reference": 2}[name]):
                call()
        timings = {name: [] for name in calls}
        for _ in range(runs):
            for name, call in calls.items():  # interleaved, so drifting machine load hits all alike
                timings[name].append(_timed(call))

        log("counting compilations over a sweep of prompts, seeds, guidance and steps")
        sweep = sweep_requests(batch, height, width, steps)
        recompiles = count_compilations(pipe, sweep)
        peak_device_memory = _peak_device_memory(pipe)

    def median_s(name, index=0):
        return statistics.median(t[index] for t in timings[name])

    device = pipe.mesh.devices.flat[0]
    kind = getattr(device, "device_kind", device.platform)
    config = pipe.spec.unet
    latent_h, latent_w, _ = pipe.spec.latent_shape(height, width)
    unet_convolution = {
        convolution.implementation(latent_h >> level, latent_w >> level, channels, pipe.dtype)
        for level, channels in enumerate(config.block_out_channels)
    }
    bf16_bytes = _bf16_bytes(pipe.spec)
    peak = None if device.platform == "cpu" else peak_tflops(kind)
    tflops = flops / median_s("ours") / 1e12
    result = dict(
        date=datetime.date.today().isoformat(),
        machine=machine_description(),
        model=model,
        height=height,
        width=width,
        steps=steps,
        batch=batch,
        dtype=str(pipe.dtype),
        device=kind,
        platform=device.platform,
        n_devices=pipe.num_devices,
        attention="+".join(sorted(attention_kernels)),  # read off the compiled program (sdxl.attention)
        convolution="+".join(sorted(unet_convolution)),  # its resnets' (sdxl.convolution)
        jax_version=jax.__version__,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        load_average=[load_before, os.getloadavg()[0]],
        runs=runs,
        images_per_s=batch / median_s("ours"),
        s_per_image=median_s("ours") / batch,
        cpu_s_per_image=median_s("ours", 1) / batch,
        run_s=[t[0] for t in timings["ours"]],
        compile_s=compile_s,
        progress_compile_s=progress_compile_s,
        first_image_s=first_image_s,
        flops_per_image=flops / batch,
        tflops=tflops,
        peak_tflops=peak,
        mfu=None if peak is None else tflops / (peak * pipe.num_devices),
        progress_s_per_image=median_s("progress") / batch,
        progress_overhead=median_s("progress") / median_s("ours") - 1,
        recompiles=recompiles,
        sweep_runs=len(sweep),
        peak_device_memory_bytes=peak_device_memory,
        **fresh,  # load warm and cold, raw reads, RSS, warm compile, first image warm
        param_bytes_bf16=bf16_bytes,
    )
    result |= load_ratios(result)
    if compare:
        result.update(
            reference=reference_device,
            ref_load_s=reference_load_s,
            ref_images_per_s=batch / median_s("reference"),
            ref_s_per_image=median_s("reference") / batch,
            ref_cpu_s_per_image=median_s("reference", 1) / batch,
            ref_run_s=[t[0] for t in timings["reference"]],
            ref_tflops=flops / median_s("reference") / 1e12,
            ratio=median_s("reference") / median_s("ours"),
        )
    return result


# ---------------------------------------------------------------------------------------------
# Reporting


def _number(value, unit="") -> str:
    return "n/a" if value is None else f"{value:.3g}{unit}"


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f} MiB"


def _load_rows(r: dict) -> list[tuple[str, str]]:
    def against(raw: str, load: str = "load_s") -> str:
        return f"{r[load]:.2f} s / {r[raw]:.2f} s = {r[load] / r[raw]:.2f}x"

    rss = f"{_mib(r['load_peak_rss_bytes'])} / {_mib(r['param_bytes_bf16'])} = {r['load_rss_over_bf16']:.2f}x"
    return [
        (f"load / raw read of {_mib(r['weight_bytes'])}, page cache", against("raw_read_s")),
        ("load / raw read, from the disk", against("raw_read_cold_s", "load_cold_s")),
        ("load / raw read into fresh memory", against("raw_read_fresh_s")),
        ("peak RSS loading / bf16 params", f"{rss} (+{r['load_rss_increase_over_bf16']:.2f}x)"),
    ]


def _aligned(rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def format_load_table(r: dict) -> str:
    return _aligned([("model", f"{r['model']} into {r['dtype']}"), ("device", r["machine"]), *_load_rows(r)])


def format_table(r: dict) -> str:
    """The results as an aligned two-column table."""
    mfu = "n/a (no known peak)" if r["mfu"] is None else f"{r['mfu']:.1%} of {r['peak_tflops']:g} TFLOP/s per device"
    rows = [
        (
            "model",
            f"{r['model']} {r['width']}x{r['height']}, {r['steps']} steps, batch {r['batch']}, {r['dtype']}, "
            f"{r['attention']} attention, {r['convolution']} convolutions",
        ),
        ("device", f"{r['n_devices']}x {r['device']} ({r['machine']})"),
        ("images/s", _number(r["images_per_s"])),
        ("s/image", f"{_number(r['s_per_image'])} (median of {r['runs']}; {_number(r['cpu_s_per_image'])} CPU s)"),
    ]
    if "ratio" in r:
        rows += [
            ("diffusers images/s", f"{_number(r['ref_images_per_s'])} ({r['reference']})"),
            ("ratio (ours / diffusers)", _number(r["ratio"])),
        ]
    rows += [
        ("achieved TFLOP/s", f"{_number(r['tflops'])} ({_number(r['flops_per_image'] / 1e12)} TFLOP/image)"),
        ("MFU", mfu),
        ("compile cold / warm cache", f"{_number(r['compile_s'], ' s')} / {_number(r['warm_compile_s'], ' s')}"),
        (
            "start to first image cold / warm",
            f"{_number(r['first_image_s'], ' s')} / {_number(r['first_image_warm_s'], ' s')}",
        ),
        *_load_rows(r),
        ("peak host RSS (fresh process)", _mib(r["peak_rss_bytes"])),
        ("peak device memory", _mib(r["peak_device_memory_bytes"])),
        ("progress overhead", f"{r['progress_overhead']:+.1%} ({_number(r['progress_s_per_image'])} s/image)"),
        ("recompilations over the sweep", f"{r['recompiles']} in {r['sweep_runs']} calls"),
        ("load average before / after", " / ".join(f"{x:.1f}" for x in r["load_average"])),
    ]
    return _aligned(rows)


MARKDOWN_HEADER = (
    "| Date | Machine | Devices | Model | Size, steps, batch | img/s | diffusers img/s | Ratio "
    "| TFLOP/s (MFU) | Compile cold / warm | Load / raw read | Load RSS / bf16 | Progress overhead | Recompiles |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def markdown_row(r: dict) -> str:
    """One BENCHMARKS.md table row for a result."""
    mfu = "" if r["mfu"] is None else f" ({r['mfu']:.0%})"
    cells = [
        r["date"],
        f"{r['machine']}; load {r['load_average'][0]:.1f} to {r['load_average'][1]:.1f}",
        f"{r['n_devices']}x {r['device']}",
        f"{r['model']} {r['dtype']}, {r['attention']} attention, {r['convolution']} convolutions",
        f"{r['width']}x{r['height']}, {r['steps']}, {r['batch']}",
        f"{r['images_per_s']:.3g}",
        f"{r['ref_images_per_s']:.3g}" if "ratio" in r else "",
        f"{r['ratio']:.2f}x" if "ratio" in r else "",
        f"{r['tflops']:.3g}{mfu}",
        f"{r['compile_s']:.1f} / {r['warm_compile_s']:.1f} s",
        _load_cell(r),
        f"{r['load_rss_over_bf16']:.2f}x",
        f"{r['progress_overhead']:+.1%}",
        str(r["recompiles"]),
    ]
    return "| " + " | ".join(cells) + " |\n"


def _load_cell(r: dict) -> str:
    return (
        f"{r['load_s']:.2f} / {r['raw_read_s']:.2f} s ({r['load_over_raw_read']:.1f}x); "
        f"disk {r['load_cold_s']:.2f} / {r['raw_read_cold_s']:.2f} s ({r['load_over_raw_read_cold']:.1f}x); "
        f"into fresh memory {r['raw_read_fresh_s']:.2f} s ({r['load_over_raw_read_fresh']:.1f}x)"
    )


LOAD_MARKDOWN_HEADER = (
    "| Date | Machine | Model | Weights | Load / raw read: page cache; disk; into fresh memory "
    "| Load RSS / bf16 (increase) |\n"
    "|---|---|---|---|---|---|\n"
)


def load_markdown_row(r: dict) -> str:
    cells = [
        r["date"],
        r["machine"],
        f"{r['model']} into {r['dtype']}",
        _mib(r["weight_bytes"]),
        _load_cell(r),
        f"{r['load_rss_over_bf16']:.2f}x ({r['load_rss_increase_over_bf16']:+.2f}x)",
    ]
    return "| " + " | ".join(cells) + " |\n"


def append_markdown(path: Path, header: str, row: str) -> None:
    """Appends a row to the table with `header` (starting one at the end of `path` if there is none)."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    end = text.find(header)
    if end < 0:
        text += ("\n" if text and not text.endswith("\n\n") else "") + header + row
    else:
        end += len(header)
        while end < len(text) and text.startswith("|", end):  # past the table's rows
            end = text.index("\n", end) + 1
        text = text[:end] + row + text[end:]
    path.write_text(text)


# ---------------------------------------------------------------------------------------------
# Command line


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="medium", help="tiny, medium, sdxl-base, a folder or a Hub id (default: %(default)s)"
    )
    parser.add_argument("--height", type=int, default=MEDIUM_SIZE)
    parser.add_argument("--width", type=int, default=MEDIUM_SIZE)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, help="images per call (default: one per device)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per median (default: %(default)s)")
    parser.add_argument("--devices", type=int, help="use the first N devices (default: all)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16, float32 on CPU")
    parser.add_argument("--compare", choices=["diffusers"], help="also time diffusers' pipeline on the same weights")
    parser.add_argument(
        "--load-only", action="store_true", help="measure only the loading (for checkpoints too big to run here)"
    )
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--markdown", help="append the results as a row to this Markdown file (e.g. BENCHMARKS.md)")


def run_load_benchmark(
    model: str, *, dtype: str | None = None, num_devices: int | None = None, log: Callable[[str], None] = print
) -> dict:
    """Only the loading numbers, warm and from the disk, each in a fresh process; for full-size
    checkpoints on a machine too slow to run them."""
    from .pipeline import ModelSpec

    dtype = dtype or _default_dtype()
    with _scratch_dir() as scratch:
        folder = resolve_model(model, scratch)
        log(f"loading {folder} with the page cache warm, then from the disk")
        options = dict(folder=str(folder), dtype=dtype, max_steps=100, num_devices=num_devices)
        result = _in_fresh_process("load", **options, cold=False) | disk_and_fresh_memory_loads(**options)
        result |= dict(
            date=datetime.date.today().isoformat(),
            machine=machine_description(),
            model=model,
            dtype=dtype,
            param_bytes_bf16=_bf16_bytes(ModelSpec.from_folder(folder)),
        )
    return result | load_ratios(result)


def bench_command(args: argparse.Namespace) -> None:
    def log(message: str) -> None:
        print(message, file=sys.stderr)

    if args.load_only:
        result = run_load_benchmark(args.model, dtype=args.dtype, num_devices=args.devices, log=log)
        table, header, row = format_load_table(result), LOAD_MARKDOWN_HEADER, load_markdown_row(result)
    else:
        if args.runs < 1:
            raise ValueError(f"--runs must be at least 1, got {args.runs}")
        result = run_benchmark(
            args.model,
            height=args.height,
            width=args.width,
            steps=args.steps,
            batch=args.batch,
            runs=args.runs,
            num_devices=args.devices,
            dtype=args.dtype,
            compare=args.compare,
            log=log,
        )
        table, header, row = format_table(result), MARKDOWN_HEADER, markdown_row(result)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        append_markdown(Path(args.markdown), header, row)


def add_write_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default="sdxl-base-1.0", help="sdxl-base-1.0, medium, tiny or tiny-sd1 (default: %(default)s)"
    )
    parser.add_argument("--out", required=True, help="folder to write (must not exist yet)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)


def write_checkpoint_command(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if out.exists():
        raise ValueError(f"{out} already exists")
    start = time.perf_counter()
    tiny.write_checkpoint(out, builtin_configs(args.config), dtype=args.dtype, seed=args.seed)
    size = sum(f.stat().st_size for f in out.rglob("*.safetensors"))
    print(f"wrote {out} ({size / 2**30:.2f} GiB of {args.dtype} weights) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":  # the fresh processes of `_in_fresh_process`
    functions = {"probe": probe, "load": load, "read_into_fresh_memory": read_into_fresh_memory}
    print(json.dumps(functions[sys.argv[1]](**json.loads(sys.argv[2]))))
