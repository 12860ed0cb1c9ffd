"""Measuring generation: speed against diffusers, FLOPs and MFU, compile times, recompilations."""

import dataclasses
import datetime
import functools
import itertools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import jax.numpy as jnp

from ..checkpoints import lora, random_models
from ..engine.compilation import CompileCounter, enable_compilation_cache
from ..engine.compiled import Executables
from ..engine.hires import Hires
from ..engine.image_prompts import ImagePrompt
from ..engine.memory import bytes_beside_weights
from ..engine.upscaler import Upscaler
from ..engine.request import DEFAULT_GUIDANCE_SCALE, Request
from ..models import attention, convolution, unet
from ..prompts.tokens import TOKENS_PER_CHUNK
from . import controlnet as control, counting
from .loading import (
    bf16_bytes, default_dtype, disk_and_fresh_memory_loads, in_fresh_process, load_on_devices, load_ratios,
    machine_description, measure_load, memory_status, process_start_time, resolve_model, scratch_dir,
)

PROMPT = "a photograph of an astronaut riding a horse on the moon, detailed, sharp focus"
# Weighted, as prompts pasted from model pages are; repeated to fill a given number of chunks.
WEIGHTED_PHRASE = "(an astronaut:1.2) riding a horse on the moon, [blurry], ((sharp focus)), "
LONG_PROMPT_CHUNKS = 3  # compiled as 4, one masked: the cost of a long prompt as users write them
NEGATIVE_PROMPT = "blurry, low quality"
GUIDANCE_SCALE = DEFAULT_GUIDANCE_SCALE
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

# The environment variables that change how a program compiles, not what it computes (`sdxl.bench.variants`).
OVERRIDES = ("SDXL_ATTENTION", "SDXL_CONV", "SDXL_GROUP_NORM", "XLA_FLAGS")


def overrides() -> str:
    """This process's settings of `OVERRIDES`, as VAR=value words ("" for none)."""
    return " ".join(f"{name}={os.environ[name].strip()}" for name in OVERRIDES if os.environ.get(name, "").strip())


def peak_tflops(device_kind: str) -> float | None:
    """The device's dense bf16 peak in TFLOP/s, or None when it is not in `PEAK_BF16_TFLOPS`."""
    return next((peak for name, peak in PEAK_BF16_TFLOPS if name in device_kind), None)


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
    the pipeline's `dtype`, which picks the convolution algorithm (`sdxl.models.convolution`).
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
    def apply(params, *xs):
        return model.apply({"params": params}, *xs)

    return counting.flops(counting.lowered(apply, unet.abstract_params(config), *inputs))


def generation_flops(pipe, request: Request) -> float:
    """FLOPs of one guided generation of a batch over all devices (padding images included).

    Counted on the whole program lowered for the host (`counting`), whose cost analysis counts the
    denoising loop's body once; the other `steps - 1` guided UNet evaluations are added from
    `unet_flops`.
    """
    program = pipe.prepare(request).program
    with counting.xla_attention():  # lowered over the host's mesh, which it sets itself
        whole = counting.flops(Executables(counting.host_mesh()).lowered(program, "whole"))
    spec = pipe.spec
    latent_h, latent_w, _ = spec.latent_shape(request.height, request.width)
    step = unet_flops(spec.unet, 2 * program.batch, latent_h, latent_w, spec.max_tokens, pipe.dtype)  # x2: guidance
    return whole + (request.steps - 1) * step


def whole_program(pipe, request: Request) -> "jax.stages.Compiled":
    """The one compiled program that renders `request` without progress reports."""
    return pipe.compiled(pipe.prepare(request).program, "whole")


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
) -> Request:
    """One batch of images (seed, 0), (seed, 1), ... of one prompt."""
    return Request.from_prompt(
        prompt, negative_prompt, num_images=batch, seed=seed, guidance_scale=guidance_scale, steps=steps,
        height=height, width=width, sampler=SAMPLER,
    )


def prompt_of_chunks(prompts, chunks: int) -> str:
    """`WEIGHTED_PHRASE` repeated until the model's tokenizers read it as `chunks` chunks."""
    for repeats in itertools.count(1):
        text = WEIGHTED_PHRASE * repeats
        ids, _ = prompts.read(text)
        if ids.shape[-1] // TOKENS_PER_CHUNK >= chunks:
            return text


def sweep_requests(batch: int, height: int, width: int, steps: int, long_prompt: str) -> list[Request]:
    """Requests that change everything a user changes between calls except what selects another
    program (the image size, the batch, the sampler, guidance or none, the chunk count): prompts
    (including an empty negative prompt), their weights and emphasis, seed, guidance scale and step
    count. `long_prompt` is one of a chunk count already compiled, whose weights the sweep changes."""
    reweighted = long_prompt.replace(":1.2)", ":0.7)").replace("((", "(((")
    return [
        batch_request(batch, height, width, 1, prompt="a red cube", negative_prompt=""),
        batch_request(batch, height, width, 2, seed=123, prompt="a (red:1.4) [cube]", negative_prompt="(blurry:1.3)"),
        dataclasses.replace(batch_request(batch, height, width, 1, prompt=reweighted), emphasis="no-norm"),
        batch_request(batch, height, width, 1, guidance_scale=1.5),
        batch_request(batch, height, width, steps + 1, guidance_scale=9.0, seed=7),
    ]


def count_compilations(pipe, requests: list[Request]) -> int:
    """How many XLA compilations `pipe.render` needs over `requests`."""
    with CompileCounter() as compiles:
        for request in requests:
            pipe.render(request)
    return compiles.count


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


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
    pipe.render(batch_request(batch, height, width, steps))
    return dict(
        **load,
        warm_compile_s=warm_compile_s,
        first_image_warm_s=time.time() - process_start_time(),
        peak_rss_bytes=memory_status()["VmHWM"],
    )


def _require_diffusers() -> None:
    """torch and diffusers are development dependencies (requirements-dev.txt), needed only here."""
    try:
        import diffusers  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"error: --compare diffusers needs torch and diffusers ({e}); see requirements-dev.txt") from e


def diffusers_reference(folder: Path, spec, dtype: str, request: Request) -> tuple[Callable[[], object], str]:
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
                prompt=list(request.prompts),
                negative_prompt=list(request.negative_prompts),
                height=request.height,
                width=request.width,
                num_inference_steps=request.steps,
                guidance_scale=request.guidance_scales[0],
                generator=torch.Generator(device).manual_seed(0),
                output_type="np",
            )

    name = torch.cuda.get_device_name() if device == "cuda" else f"{os.cpu_count()} CPU threads"
    return render, f"torch {torch.__version__} {name} {dtype}"


def _peak_device_memory(pipe) -> int | None:
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in pipe.mesh.devices.flat]
    return max(peaks) if all(p is not None for p in peaks) else None


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
    quick: bool = False,
    progress: bool = True,
    profile: Path | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> dict:
    """Measures generation as the package docstring (`sdxl.bench`) describes; returns a flat dict.

    Args:
      model: "tiny", "medium", "sdxl-base", a checkpoint folder or a Hub repo id.
      batch: images per call (default: one per device).
      runs: timed runs for each median.
      num_devices: use the first this many devices (default: all).
      dtype: "float32" or "bfloat16" (default: float32 on CPU, else bfloat16).
      compare: "diffusers" to time diffusers' pipeline on the same weights.
      quick: measure only what fits a lease of minutes on an accelerator: the cold compile, the first
        image, images/s (and diffusers'), FLOPs, the progress overhead and the peak device memory;
        not the fresh processes, the other programs, the sweep or LoRAs.
      progress: also compile and time the progress programs (the demo's path), against the single program.
      profile: trace `profile.PROFILE_STEPS` warm steps of the batch into this folder, and summarise them
        into its profile.md (`sdxl.bench.profile`).
      log: receives progress messages.
    """
    process_start = process_start_time()
    if compare not in (None, "diffusers"):
        raise ValueError(f"--compare: only 'diffusers' is supported, got {compare!r}")
    if compare:
        _require_diffusers()  # before minutes of measuring
    # On a GPU, JAX would otherwise take most of its memory up front, and leave none to the fresh
    # process or to torch. It is read when the backend starts, which nothing has done yet.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    dtype = dtype or default_dtype()
    max_steps = max(100, steps + 1)
    load_before = os.getloadavg()[0]
    with scratch_dir() as scratch:
        write_start = time.perf_counter()
        folder = resolve_model(model, scratch, dtype)
        write_s = time.perf_counter() - write_start
        cache_dir = scratch / "xla-cache"
        enable_compilation_cache(cache_dir)  # empty: the first compile is cold

        log(f"loading {folder}")
        pipe = load_on_devices(folder, dtype, max_steps, num_devices)
        prepared = pipe.prepare(batch_request(batch or pipe.num_devices, height, width, steps))
        request = prepared.request
        first = _first_run(pipe, request, log, started=process_start + write_s, progress=progress)
        flops = first.pop("flops")
        log(f"compiled in {first['compile_s']:.1f} s, first image after {first['first_image_s']:.1f} s")
        calls = {"ours": lambda: pipe.render(prepared)}
        if progress:  # as the demo shows it: a report and the images' previews after every step
            calls["progress"] = lambda: pipe.render(prepared, on_step=lambda done: None,
                                                    on_preview=lambda done, images: None)
        fresh = controlnet_first = ip_adapter_first = {}
        if not quick:
            log("measuring load, warm compile and first image in a fresh process")
            options = dict(folder=str(folder), dtype=dtype, max_steps=max_steps, num_devices=num_devices)
            probe_options = dict(cache_dir=str(cache_dir), height=height, width=width, batch=len(request), steps=steps)
            fresh = in_fresh_process("probe", **options, **probe_options)
            log("measuring the load from the disk and a read into fresh memory, in fresh processes")
            fresh |= disk_and_fresh_memory_loads(**options)

            unguided = pipe.prepare(dataclasses.replace(request, guidance_scales=(0.0,) * len(request)))
            long_prompt = prompt_of_chunks(pipe.prompts, LONG_PROMPT_CHUNKS)
            long = pipe.prepare(batch_request(len(request), height, width, steps, prompt=long_prompt))
            log("writing a random ControlNet of the model's UNet shape, and compiling the model steered by it")
            steered, controlled, controlnet_first = _controlnet_first_run(pipe, scratch, request, dtype)
            log("writing a random Plus IP-Adapter of the model's UNet shape, and compiling it with an image prompt")
            prompted, ip_adapter_first = _ip_adapter_first_run(pipe, scratch, request)
            # A hires fix as SDXL's shared infotexts have it: 2x by "Latent", half the steps again.
            hires = pipe.prepare(dataclasses.replace(request, hires=HIRES))
            log(f"compiling the hires pass at {hires.hires.request.width}x{hires.hires.request.height}")
            pipe.compile(hires.programs)
            calls |= {
                "unguided": lambda: pipe.render(unguided),  # the program without the negative prompts' pass
                "long_prompt": lambda: pipe.render(long),  # the program of 4 chunks
                "controlnet": lambda: steered.render(controlled),  # the same batch steered by one ControlNet
                "ip_adapter": lambda: pipe.render(prompted),  # the same batch with an image prompt
                "hires": lambda: pipe.render(hires),
            }
        reference = {}
        if compare:
            log("loading diffusers' pipeline")
            start = time.perf_counter()
            calls["reference"], reference["reference"] = diffusers_reference(folder, pipe.spec, dtype, request)
            reference["ref_load_s"] = time.perf_counter() - start
        log(f"timing {runs} runs each of: {', '.join(calls)}")
        timings = _interleaved_timings(calls, runs)
        # Before the sweep and the LoRAs, whose programs are not the benchmark's.
        peak_device_memory = _peak_device_memory(pipe)
        if not quick:
            pipe.unload_ip_adapter()  # the rest measures the model alone
        rest = {}
        if profile:
            log(f"tracing a few steps into {profile}")
            try:
                rest["profile"] = profile_steps(pipe, request, Path(profile))
            except Exception as error:  # noqa: BLE001  the timings above are a lease's to keep; the trace stays
                log(f"profile failed: {error!r}")
                rest["profile_error"] = repr(error)
        if not quick:
            log("counting compilations over a sweep of prompts, weights, seeds, guidance and steps")
            sweep = sweep_requests(len(request), height, width, steps, long_prompt)
            rest = dict(recompiles=count_compilations(pipe, sweep), sweep_runs=len(sweep))
            log("timing LoRA switches")
            rest |= time_lora_switches(pipe, scratch, request)
            log("timing A1111's noise, drawn on the host")
            rest |= time_noise_draws(pipe, request, runs, _median_s(timings["ours"]))
            rest |= hires_memory(pipe, hires)
            log(f"timing a model upscaler of realesr-general-x4v3's shape on {width}x{height} pictures")
            rest |= time_upscaler(scratch, height, width, runs)

    result = dict(
        date=datetime.date.today().isoformat(),
        machine=machine_description(),
        model=model,
        load_average=[load_before, os.getloadavg()[0]],
        runs=runs,
        quick=quick,
        peak_device_memory_bytes=peak_device_memory,
        **first,
        **fresh,  # load warm and cold, raw reads, RSS, warm compile, first image warm
        **_speed(pipe, request, timings, flops),
        **controlnet_first,
        **ip_adapter_first,
        **rest,  # recompilations over the sweep, LoRA switches
        param_bytes_bf16=bf16_bytes(pipe.spec),
    )
    if not quick:
        result |= load_ratios(result) | _variant_speed(request, timings)
    if compare:
        result |= reference | _reference_speed(request, timings, flops)
    return result


LORA_RANK = 32  # a common rank for SDXL LoRAs
HIRES = Hires(scale=2, upscaler="Latent", strength=0.5)  # a hires fix of the benchmark's steps (0.5: as many again)


def hires_memory(pipe, prepared) -> dict:
    """The hires pass's compiled program against the first pass's: the bytes each holds beside the
    weights, as the launch's fit check counts them (`memory.bytes_beside_weights`)."""
    first, second = (bytes_beside_weights(pipe.compiled(program)) for program in prepared.programs)
    return {"hires_bytes": second, "base_bytes": first, "hires_bytes_ratio": second / first}


def time_upscaler(scratch: Path, height: int, width: int, runs: int) -> dict:
    """Images/s of a random 4x SRVGGNetCompact of realesr-general-x4v3's shape (64 features, 32 convs)
    on height x width pictures (to 4x that), whole or in its tiles, compile excluded."""
    upscaler = Upscaler.from_file(random_models.write_upscaler(scratch / "realesr-general-x4v3.safetensors", scale=4,
                                                               num_feat=64, num_conv=32))
    picture = np.random.default_rng(0).integers(0, 256, (height, width, 3), np.uint8)
    upscaler.upscale(picture)  # compiles
    seconds = statistics.median(_timed(lambda: upscaler.upscale(picture))[0] for _ in range(runs))
    return {"upscaler_images_per_s": 1 / seconds, "upscaler_from": f"{width}x{height}",
            "upscaler_to": f"{4 * width}x{4 * height}"}


def time_noise_draws(pipe, request: Request, runs: int, call_s: float) -> dict:
    """Host seconds to prepare a request whose noise A1111's NV and CPU sources draw (`with_drawn_noise`)
    for an ancestral sampler (the starting noise and one draw per step, each image from its own
    generator, ENSD on), and with NV for DPM++ 2M SDE from A1111's Brownian trees (the most drawn); and
    each against one of the benchmark's calls. It is drawn when a request is prepared, before it waits
    for the devices."""
    result = {}
    for key, settings in (("nv", dict(sampler="euler_ancestral", noise_source="nv", ensd=31337)),
                          ("cpu", dict(sampler="euler_ancestral", noise_source="cpu", ensd=31337)),
                          ("sde_nv", dict(sampler="dpmpp_2m_sde", schedule_type="Karras", noise_source="nv"))):
        draw = functools.partial(pipe.prepare, dataclasses.replace(request, **settings))
        seconds = statistics.median(_timed(draw)[0] for _ in range(runs))
        result |= {f"noise_{key}_s": seconds, f"noise_{key}_cost": seconds / call_s}
    return result


def time_lora_switches(pipe, scratch: Path, request: Request) -> dict:
    """Seconds to switch to a random rank-32 LoRA over every UNet and text encoder layer (reading its
    file first), to change its scale, and to clear it; and the compilations renders with it needed
    (the first switch also compiles the update for each distinct layer shape, which it includes)."""
    path = str(lora.write_random(scratch / "lora.safetensors", pipe.spec, rank=LORA_RANK, dtype="float16"))
    request = dataclasses.replace(request, loras=None)  # with the active LoRAs
    first = pipe.set_loras({path: 1.0})
    with CompileCounter() as compiles:
        pipe.render(request)
    rescale = pipe.set_loras({path: 0.5})
    with compiles:
        pipe.render(request)
    clear = pipe.set_loras({})
    return dict(lora_first_s=first, lora_scale_s=rescale, lora_clear_s=clear, lora_recompiles=compiles.count,
                lora_layers=sum(len(layers) for layers in lora.targets(pipe.spec).values()))


def profile_steps(pipe, request: Request, directory: Path) -> dict:
    """`profile.write_summary` of a trace of `request`'s batch with `profile.PROFILE_STEPS` steps, the
    compiled program's HLO text saved beside it (to summarise it again elsewhere)."""
    from . import profile as profiling  # not at the top: `python -m sdxl.bench.profile` runs it as __main__

    directory.mkdir(parents=True, exist_ok=True)
    (directory / profiling.HLO_TEXT).write_text(whole_program(pipe, request).as_text())
    prepared = pipe.prepare(dataclasses.replace(request, steps=profiling.PROFILE_STEPS))
    pipe.render(prepared)  # the first call of a request reads its inputs' host side in
    profiling.trace(lambda: pipe.render(prepared), directory)
    title = f"{pipe.device_description}: {request.width}x{request.height}, batch {len(request)}, {pipe.dtype}"
    return profiling.write_summary(directory, f"{title}, {overrides()}" if overrides() else title)


def _first_run(pipe, request: Request, log: Callable[[str], None], started: float, progress: bool) -> dict:
    """Compiles (cold) and renders the first batch, timed from `started` (a `time.time()`); then the
    kernels and FLOPs of the compiled program, and (with `progress`) the progress programs' compile time."""
    height, width, batch = request.height, request.width, len(request)
    log(f"compiling for {width}x{height}, batch {batch}, on {pipe.device_description}")
    compile_s = pipe.warmup(height, width, batch, SAMPLER)
    pipe.render(request)
    first_image_s = time.time() - started
    latent_h, latent_w, _ = pipe.spec.latent_shape(height, width)
    unet_convolution = {
        convolution.implementation(latent_h >> level, latent_w >> level, channels, pipe.dtype)
        for level, channels in enumerate(pipe.spec.unet.block_out_channels)
    }
    first = dict(
        compile_s=compile_s,
        first_image_s=first_image_s,
        flops=generation_flops(pipe, request),
        # read off the compiled program (sdxl.models.attention)
        attention="+".join(sorted(attention.kernels_in(whole_program(pipe, request)))),
        convolution="+".join(sorted(unet_convolution)),  # its resnets' (sdxl.models.convolution)
        overrides=overrides(),
    )
    if progress:
        first["progress_compile_s"] = pipe.warmup(height, width, batch, SAMPLER, progress=True)
    return first


def _controlnet_first_run(pipe, scratch: Path, request: Request, dtype: str) -> tuple:
    """The model steered by a random ControlNet of its UNet's shape (`random_models.write_controlnet`), the
    benchmark's batch with a control image per image, and what the ControlNet adds: its compile
    time, its parameters' bytes per device, and the FLOPs of one guided step with it over without
    (from the lowered programs). Returns (pipeline, request, that)."""
    folder = random_models.write_controlnet(scratch / "controlnet", pipe.spec, dtype=dtype)
    steered = control.with_controlnet(pipe, folder)
    controlled = steered.prepare(control.steered_request(
        batch_request(len(request), request.height, request.width, request.steps)))
    compile_s = steered.compile(controlled.programs)
    steered.render(controlled)
    rows = pipe.padded_batch(len(request)) * 2  # with guidance, each image is two rows of the model's batch
    config = steered.controlnets[0].config
    step = [control.step_flops(pipe.spec, c, rows, request.height, request.width, pipe.dtype) for c in (None, config)]
    return steered, controlled, dict(
        controlnet_compile_s=compile_s,
        controlnet_param_bytes_per_device=control.param_bytes_per_device(steered),
        controlnet_step_flops=step[1],
        controlnet_step_flops_ratio=step[1] / step[0],
    )


def _ip_adapter_first_run(pipe, scratch: Path, request: Request) -> tuple:
    """The benchmark's batch with an image prompt per image, through a random Plus IP-Adapter of the
    model's UNet shape (`random_models.write_ip_adapter`: its image encoder is a tiny one, so what is
    timed is the adapter's work at every step), loaded into `pipe`; and what the adapter adds: its
    compile time and its parameters' bytes per device. Returns (prepared request, that)."""
    folder = random_models.write_ip_adapter(scratch / "ip-adapter", pipe.spec.unet, kinds=("plus",))
    pipe.load_ip_adapter(str(folder), subfolder="sdxl_models", weight_name=random_models.IP_ADAPTER_FILES["plus"])
    picture = ImagePrompt.of(np.full((request.height, request.width, 3), 128, np.uint8))
    prompted = pipe.prepare(dataclasses.replace(
        batch_request(len(request), request.height, request.width, request.steps),
        image_prompts=((picture,),) * len(request)))
    compile_s = pipe.compile(prompted.programs)
    pipe.render(prompted)
    return prompted, dict(
        ip_adapter_compile_s=compile_s,
        ip_adapter_param_bytes_per_device=sum(a.addressable_shards[0].data.nbytes
                                              for a in jax.tree.leaves(pipe.params["ip_adapters"])),
    )


# Untimed calls before the timed ones: ours ran once already (the first image), and so did the
# ControlNet's and the IP-Adapter's; torch's CPU kernels take a few calls to settle.
WARMUP_CALLS = {"ours": 0, "progress": 1, "unguided": 1, "long_prompt": 1, "controlnet": 1, "ip_adapter": 0,
                "hires": 1, "reference": 2}


def _interleaved_timings(calls: dict[str, Callable[[], object]], runs: int) -> dict[str, list[tuple[float, float]]]:
    """`runs` (wall, CPU) timings of each call, taking turns so that drifting machine load hits all alike."""
    for name, call in calls.items():
        for _ in range(WARMUP_CALLS[name]):
            call()
    timings = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            timings[name].append(_timed(call))
    return timings


def _median_s(timings: list[tuple[float, float]], index: int = 0) -> float:
    return statistics.median(t[index] for t in timings)


def _speed(pipe, request: Request, timings: dict, flops: float) -> dict:
    """Our images/s, TFLOP/s and MFU, and the progress overhead where it was timed, from the timed runs."""
    batch, ours = len(request), timings["ours"]
    device = pipe.mesh.devices.flat[0]
    kind = getattr(device, "device_kind", device.platform)
    peak = None if device.platform == "cpu" else peak_tflops(kind)
    tflops = flops / _median_s(ours) / 1e12
    speed = dict(
        height=request.height,
        width=request.width,
        steps=request.steps,
        batch=batch,
        dtype=str(pipe.dtype),
        device=kind,
        platform=device.platform,
        n_devices=pipe.num_devices,
        jax_version=jax.__version__,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        images_per_s=batch / _median_s(ours),
        s_per_image=_median_s(ours) / batch,
        cpu_s_per_image=_median_s(ours, 1) / batch,
        run_s=[t[0] for t in ours],
        flops_per_image=flops / batch,
        tflops=tflops,
        peak_tflops=peak,
        mfu=None if peak is None else tflops / (peak * pipe.num_devices),
    )
    if "progress" in timings:
        speed["progress_s_per_image"] = _median_s(timings["progress"]) / batch
        speed["progress_overhead"] = _median_s(timings["progress"]) / _median_s(ours) - 1
    return speed


def _variant_speed(request: Request, timings: dict) -> dict:
    """The other programs' images/s, each against the benchmark's: without guidance, with a long
    prompt, steered by a ControlNet, with an IP-Adapter's image prompt, with a hires fix (both passes)."""
    batch, ours = len(request), timings["ours"]
    return dict(
        unguided_images_per_s=batch / _median_s(timings["unguided"]),
        unguided_speedup=_median_s(ours) / _median_s(timings["unguided"]),
        long_prompt_chunks=LONG_PROMPT_CHUNKS,
        long_prompt_images_per_s=batch / _median_s(timings["long_prompt"]),
        long_prompt_cost=_median_s(timings["long_prompt"]) / _median_s(ours),
        controlnet_images_per_s=batch / _median_s(timings["controlnet"]),
        controlnet_cost=_median_s(timings["controlnet"]) / _median_s(ours),
        controlnet_run_s=[t[0] for t in timings["controlnet"]],
        ip_adapter_images_per_s=batch / _median_s(timings["ip_adapter"]),
        ip_adapter_cost=_median_s(timings["ip_adapter"]) / _median_s(ours),
        hires_images_per_s=batch / _median_s(timings["hires"]),
        hires_cost=_median_s(timings["hires"]) / _median_s(ours),
    )


def _reference_speed(request: Request, timings: dict, flops: float) -> dict:
    """diffusers' images/s and TFLOP/s, and the ratio of its time to ours."""
    batch, theirs = len(request), timings["reference"]
    return dict(
        ref_images_per_s=batch / _median_s(theirs),
        ref_s_per_image=_median_s(theirs) / batch,
        ref_cpu_s_per_image=_median_s(theirs, 1) / batch,
        ref_run_s=[t[0] for t in theirs],
        ref_tflops=flops / _median_s(theirs) / 1e12,
        ratio=_median_s(theirs) / _median_s(timings["ours"]),
    )
