"""Measuring generation: speed against diffusers, FLOPs and MFU, compile times, recompilations."""

import dataclasses
import datetime
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from ..config import KERNEL_VARIABLES
from ..engine.compilation import enable_compilation_cache
from ..engine.compiled import Executables
from ..engine.request import Request
from ..models import attention, convolution, unet
from . import controlnet as control, counting, ip_adapter, weights
from .costs import HIRES, hires_memory, time_lora_switches, time_noise_draws, time_upscaler
from .workload import (
    LONG_PROMPT_CHUNKS, SAMPLER, batch_request, count_compilations, prompt_of_chunks, sweep_requests, timed,
)
from .loading import (
    bf16_bytes, default_dtype, disk_and_fresh_memory_loads, in_fresh_process, load_on_devices, load_ratios,
    machine_description, measure_load, memory_status, process_start_time, resolve_model, scratch_dir,
)

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
OVERRIDES = (*KERNEL_VARIABLES, "XLA_FLAGS")


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
    compare_weights: tuple[str, ...] = (),
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
      compare_weights: weights modes (`quantization.WEIGHT_DTYPES`) whose pipelines render the same batch,
        timed in turn with the baseline's (`weights.py`).
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
        weights_calls, weight_bytes = weights.first_runs(folder, dtype, max_steps, num_devices, request,
                                                         compare_weights, log)
        calls |= weights_calls
        weight_bytes = {"default": weights.param_bytes_per_device(pipe), **weight_bytes} if compare_weights else {}
        fresh, variants = {}, {}
        if not quick:
            log("measuring load, warm compile and first image in a fresh process")
            options = dict(folder=str(folder), dtype=dtype, max_steps=max_steps, num_devices=num_devices)
            probe_options = dict(cache_dir=str(cache_dir), height=height, width=width, batch=len(request), steps=steps)
            fresh = in_fresh_process("probe", **options, **probe_options)
            log("measuring the load from the disk and a read into fresh memory, in fresh processes")
            fresh |= disk_and_fresh_memory_loads(**options)
            variant_calls, variants, hires, long_prompt = _variants(pipe, scratch, request, dtype, log)
            calls |= variant_calls
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
            rest |= _host_costs(pipe, scratch, request, hires, long_prompt, runs, _median_s(timings["ours"]), log)

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
        **variants,  # what a ControlNet and an IP-Adapter add
        **rest,  # recompilations over the sweep, LoRA switches, noise draws, hires memory, an upscaler
        param_bytes_bf16=bf16_bytes(pipe.spec),
        **weights.speed(request, timings, _median_s, weight_bytes),
    )
    if not quick:
        result |= load_ratios(result) | _variant_speed(request, timings)
    if compare:
        result |= reference | _reference_speed(request, timings, flops)
    return result


def _variants(pipe, scratch: Path, request: Request, dtype: str, log: Callable[[str], None]) -> tuple:
    """The calls of the benchmark's batch as other programs render it (no guidance, a long prompt, steered
    by a random ControlNet, with an image prompt through a random IP-Adapter, with a hires fix), each
    compiled; what the ControlNet and the IP-Adapter add; and the hires request and the long prompt."""
    height, width, steps = request.height, request.width, request.steps
    unguided = pipe.prepare(dataclasses.replace(request, guidance_scales=(0.0,) * len(request)))
    long_prompt = prompt_of_chunks(pipe.prompts, LONG_PROMPT_CHUNKS)
    long = pipe.prepare(batch_request(len(request), height, width, steps, prompt=long_prompt))
    log("writing a random ControlNet of the model's UNet shape, and compiling the model steered by it")
    steered, controlled, controlnet_first = control.first_run(pipe, scratch, request, dtype)
    log("writing a random Plus IP-Adapter of the model's UNet shape, and compiling it with an image prompt")
    prompted, ip_adapter_first = ip_adapter.first_run(pipe, scratch, request)
    # A hires fix as SDXL's shared infotexts have it: 2x by "Latent", half the steps again.
    hires = pipe.prepare(dataclasses.replace(request, hires=HIRES))
    log(f"compiling the hires pass at {hires.hires.request.width}x{hires.hires.request.height}")
    pipe.compile(hires.programs)
    calls = {
        "unguided": lambda: pipe.render(unguided),  # the program without the negative prompts' pass
        "long_prompt": lambda: pipe.render(long),  # the program of 4 chunks
        "controlnet": lambda: steered.render(controlled),  # the same batch steered by one ControlNet
        "ip_adapter": lambda: pipe.render(prompted),  # the same batch with an image prompt
        "hires": lambda: pipe.render(hires),
    }
    return calls, {**controlnet_first, **ip_adapter_first}, hires, long_prompt


def _host_costs(pipe, scratch: Path, request: Request, hires, long_prompt: str, runs: int, call_s: float,
                log: Callable[[str], None]) -> dict:
    """The recompilations over the sweep, and what the other features cost beside the batch (`costs`)."""
    log("counting compilations over a sweep of prompts, weights, seeds, guidance and steps")
    sweep = sweep_requests(len(request), request.height, request.width, request.steps, long_prompt)
    costs = dict(recompiles=count_compilations(pipe, sweep), sweep_runs=len(sweep))
    log("timing LoRA switches")
    costs |= time_lora_switches(pipe, scratch, request)
    log("timing A1111's noise, drawn on the host")
    costs |= time_noise_draws(pipe, request, runs, call_s)
    costs |= hires_memory(pipe, hires)
    log(f"timing a model upscaler of realesr-general-x4v3's shape on {request.width}x{request.height} pictures")
    return costs | time_upscaler(scratch, request.height, request.width, runs)


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


# Untimed calls before the timed ones: ours ran once already (the first image), and so did the
# ControlNet's and the IP-Adapter's; torch's CPU kernels take a few calls to settle.
WARMUP_CALLS = {"ours": 0, "progress": 1, "unguided": 1, "long_prompt": 1, "controlnet": 1, "ip_adapter": 0,
                "hires": 1, "reference": 2}


def _interleaved_timings(calls: dict[str, Callable[[], object]], runs: int) -> dict[str, list[tuple[float, float]]]:
    """`runs` (wall, CPU) timings of each call, taking turns so that drifting machine load hits all alike."""
    for name, call in calls.items():
        for _ in range(WARMUP_CALLS.get(name, 0)):  # a weights mode's pipeline ran once already
            call()
    timings = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            timings[name].append(timed(call))
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
