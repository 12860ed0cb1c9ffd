"""`python -m sdxl bench --topology T`: the demo's programs compiled for a TPU slice on this host, not run.

libtpu (`jax[tpu]`) compiles for a TPU slice that is not there: `get_topology_desc("v5e:2x2", "tpu")`
gives the slice's devices, and a program lowered over a mesh of them goes through the real TPU
compiler, Mosaic for the splash kernels included. What comes back is XLA's plan for one chip: its
buffers (`memory_analysis`) and its operations (`cost_analysis`), which tell whether a size and batch
fit a chip before one is rented. Nothing runs and no weights are read: the programs are those the
demo compiles (`sdxl.engine.compiled.Executables`, from `GenerateProgram` fields alone), over the mesh it
would use (`sdxl.engine.mesh.batch_mesh` over every chip of the slice, several hosts' included), with the
attention kernels of the slice's platform (`sdxl.models.attention.target_platform`).

XLA's cost model estimates seconds for some programs (`optimal_seconds`) and gives a negative number
for others (the whole program, whose loop it cannot bound); only positive estimates are kept. They
come from a model, not a measurement.

Run it with JAX_PLATFORMS=cpu, so that jax does not look for a TPU on this host first.
"""

import dataclasses
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from ..checkpoints import ModelSpec, random_models
from ..engine.compiled import IN_STAGES, WHOLE, Executables
from ..engine.hires import Hires
from ..engine.memory import bytes_beside_weights
from ..engine.mesh import batch_mesh
from ..engine.program import GenerateProgram
from . import ip_adapter
from ..models import quantization
from ..models.attention import kernels_in
from ..models.vae import tile_sizes
from .loading import machine_description

# Per-chip HBM in GiB from Google Cloud's TPU system architecture pages (v4, v5e, v5p, v6e), matched
# in order against `device_kind`: libtpu's topology devices do not report their memory.
HBM_GIB = (("TPU v4", 32), ("TPU v5 lite", 16), ("TPU v5", 95), ("TPU v6 lite", 32))
HBM_SOURCE = "Google Cloud TPU docs, system architecture (per-chip HBM)"
# The demo's padded schedule length (`sdxl.serving.launch.load`), a field of every program it compiles.
MAX_STEPS = 100
# The programs the demo runs at one size: where the loop starts (text-to-image, image-to-image,
# inpainting), each with and without classifier-free guidance.
PROGRAMS = ("text", "text-unguided", "image", "image-unguided", "inpaint", "inpaint-unguided")
# A hires fix's second pass (`sdxl.engine.hires`), at the size upscaled by `--hires-scale`: compiled when
# named, not by default, as its size is not the others'.
HIRES = ("hires", "hires-unguided")
# Text-to-image with an IP-Adapter's image prompt (`--ip-adapter`'s published SDXL adapter): compiled
# when named; its encoder and weights then share each chip with every program.
IP = ("ip", "ip-unguided")
# With a refiner, the refiner's program too: it finishes the base's latents (`Pipeline._handoff`).
REFINE = "refine"
# Each program compiled whole, and as the prepare/denoise/finish chain that progress reports run.
STAGES = WHOLE + IN_STAGES


def model_spec(model: str) -> ModelSpec:
    """The configs of a bench model: a checkpoint folder, a random model ("tiny", "medium", ...), a
    config folder of `sdxl/configs`, or "sdxl-base" (SDXL base 1.0's). No weights are read or written."""
    if Path(model).is_dir():
        return ModelSpec.from_folder(Path(model))
    configs = random_models.configs_of("sdxl-base-1.0" if model == "sdxl-base" else model)
    with tempfile.TemporaryDirectory() as scratch:
        for name, config in configs.items():
            (Path(scratch) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(scratch) / name).write_text(json.dumps(config))
        return ModelSpec.from_folder(Path(scratch))


def program_named(name: str, spec: ModelSpec, height: int, width: int, batch: int, dtype,
                  weights_dtype: str = "default") -> GenerateProgram:
    """One of `PROGRAMS` as the demo compiles it: the model's sampler, uint8 images, one prompt chunk."""
    kind, _, unguided = name.partition("-")
    start_from = "noise" if kind == "text" else "image"
    return GenerateProgram(
        spec,
        spec.default_sampler,
        height,
        width,
        batch,
        jnp.dtype(dtype),
        MAX_STEPS,
        guided=not unguided,
        start_from=start_from,
        inpaint=kind == "inpaint",
        weights_dtype=weights_dtype,
    )


def hires_program(name: str, spec: ModelSpec, height: int, width: int, batch: int, dtype,
                  scale: float, weights_dtype: str = "default") -> GenerateProgram:
    """One of `HIRES` as the demo compiles it for a first pass at `height` x `width`: text-to-image's
    program at the size a latent upscaler's hires fix of `scale` renders (`Hires.size`), from the
    upscaled latents, its VAE tiling where the demo's pipeline tiles (`Pipeline._tiles_vae`)."""
    first_pass = program_named(name.replace("hires", "text"), spec, height, width, batch, dtype, weights_dtype)
    height, width = Hires(scale=scale).size(height, width, spec)
    tile, _ = tile_sizes(spec.vae)
    return dataclasses.replace(first_pass, height=height, width=width, start_from="clean_latents",
                               vae_tiling=height * width > tile * tile)


def refine_program(refiner: ModelSpec, height: int, width: int, batch: int, dtype,
                   weights_dtype: str = "default") -> GenerateProgram:
    """The refiner's program as the demo compiles it: from the base's latents, guided, to uint8 images."""
    return GenerateProgram(refiner, refiner.default_sampler, height, width, batch, jnp.dtype(dtype), MAX_STEPS,
                           start_from="latents", weights_dtype=weights_dtype)


def shared_components(spec: ModelSpec, beside: ModelSpec) -> list[str]:
    """The components of `spec` that `beside` has too, of the same shapes. The demo holds such a
    component once where the weights are equal too (`Pipeline.set_refiner`), as the published SDXL
    refiner's VAE and second text encoder are the base's; the bench reads no weights, and counts it once."""
    mine, theirs = spec.abstract_params(), beside.abstract_params()
    return sorted(name for name in mine if name in theirs and _shapes(mine[name]) == _shapes(theirs[name]))


def _shapes(tree):
    return jax.tree.map(lambda leaf: leaf.shape, tree)


def param_bytes(spec: ModelSpec, dtype, beside: ModelSpec | None = None, weights_dtype: str = "default") -> int:
    """A model's parameters on each chip (they are replicated), in `dtype` but for the large weights
    `weights_dtype` stores in 8 bits (with their scales); with `beside`, less the components the two
    share (`shared_components`)."""
    shared = shared_components(spec, beside) if beside else []
    tree = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, dtype), spec.abstract_params())
    stored = quantization.in_components(tree, lambda component: quantization.abstract(component, weights_dtype))
    held = [tree for name, tree in stored.items() if name not in shared]
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(held))


def hbm_bytes(device_kind: str) -> int | None:
    return next((gib * 2**30 for name, gib in HBM_GIB if name in device_kind), None)


def run_topology_benchmark(
    model: str,
    topology: str,
    *,
    height: int,
    width: int,
    steps: int,
    batch: int | None = None,
    dtype: str = "bfloat16",
    programs: tuple[str, ...] = PROGRAMS,
    refiner: str | None = None,
    stages: tuple[str, ...] = STAGES,
    hires_scale: float = 2.0,
    ip_adapter_kind: str = "plus",
    weights_dtype: str = "default",
    checkpoints: int = 1,
    log=print,
) -> dict:
    """Compiles `programs` whole and in stages for the TPU slice `topology` ("v5e:2x2"); returns the report.

    Args:
      batch: images per call, a multiple of the slice's chips (default: one per chip).
      steps: the steps a generation takes, for the estimate of its seconds; programs take any count.
      refiner: a refiner loaded beside the model (as `model_spec` reads it): its parameters share each
        chip with every program of the model, and the model's with its own `REFINE` program, which
        `programs` may then name (it is added to the default ones).
      stages: which of each program's stages to compile and report (at SDXL's size each takes minutes
        to tens of minutes here): the whole program, and the staged ones that progress reports run.
      hires_scale: the upscale of the `HIRES` programs' hires fix, whose first pass is at `height` x `width`.
      ip_adapter_kind: the published SDXL IP-Adapter ("plain", "plus": `bench.ip_adapter`) of the `IP` programs.
      weights_dtype: how the UNet's and ControlNets' large weights are stored (`quantization.WEIGHT_DTYPES`).
      checkpoints: how many checkpoints of the model's architecture each chip holds (the demo's choice of
        checkpoints): their weights side by side, and the programs' other buffers once, as one program
        runs at a time and they compile alike.
    """
    # libtpu locks a file so that one process drives a host's chips; compiling drives none, so a test
    # may compile while a bench does.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    devices = topologies.get_topology_desc(topology, "tpu").devices
    chips = len(devices)
    batch = batch or chips
    if batch % chips:
        raise ValueError(f"--batch must be a multiple of the {chips} chips of {topology}, got {batch}")
    if checkpoints < 1:
        raise ValueError(f"--checkpoints must be at least 1, got {checkpoints}")
    weights_dtype = quantization.weights_dtype_name(weights_dtype)
    known = PROGRAMS + HIRES + IP + ((REFINE,) if refiner else ())
    if refiner and programs == PROGRAMS:
        programs = PROGRAMS + (REFINE,)
    if unknown := set(programs) - set(known):
        hint = f" ({REFINE} needs --refiner)" if REFINE in unknown else ""
        raise ValueError(f"unknown programs {sorted(unknown)}; choose from {', '.join(known)}{hint}")
    if unknown := set(stages) - set(STAGES):
        raise ValueError(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}")
    spec, mesh = model_spec(model), batch_mesh(devices)
    refiner_spec = refiner and model_spec(refiner)
    # The hires pass's size, where it is compiled: the report's height and width are its first pass's.
    hires = None
    if set(programs) & set(HIRES):
        hires_height, hires_width = Hires(scale=hires_scale).size(height, width, spec)
        hires = {"scale": hires_scale, "height": hires_height, "width": hires_width}
    adapter = ip_adapter.adapter_config(ip_adapter_kind, spec) if set(programs) & set(IP) else None
    log(f"compiling {model} at {_size(width, height, hires)}, {batch // chips} images per chip, for {topology} "
        f"({chips} chips)")
    compiled = []
    for name in programs:
        if name == REFINE:
            program = refine_program(refiner_spec, height, width, batch, dtype, weights_dtype)
        elif name in HIRES:
            program = hires_program(name, spec, height, width, batch, dtype, hires_scale, weights_dtype)
        elif name in IP:
            text = program_named(name.replace("ip", "text"), spec, height, width, batch, dtype, weights_dtype)
            program = dataclasses.replace(text, ip_adapters=(adapter,))
        else:
            program = program_named(name, spec, height, width, batch, dtype, weights_dtype)
        executables = Executables(mesh)  # one program's at a time: SDXL's executables are large
        # `denoise` and `finish` take what `prepare` returns: after it (compiled for them if not asked for).
        for stage in (s for s in STAGES if s in stages):
            compiled.append({"program": name, "stage": stage, **_compile(executables, program, stage)})
            log(_program_line(compiled[-1]))
    return _report(
        compiled,
        model=model,
        refiner=refiner,
        # Every model's weights stay on each chip whichever program runs, a component they share once.
        weight_bytes=checkpoints * param_bytes(spec, dtype, weights_dtype=weights_dtype)
        + (param_bytes(refiner_spec, dtype, spec, weights_dtype) if refiner else 0)
        + (sum(ip_adapter.param_bytes(adapter, spec, dtype).values()) if adapter else 0),
        checkpoints=checkpoints,
        weights_dtype=weights_dtype,
        shared=shared_components(spec, refiner_spec) if refiner else [],
        hires=hires,
        topology=topology,
        devices=devices,
        height=height,
        width=width,
        steps=steps,
        batch=batch,
        dtype=dtype,
    )


def _compile(executables: Executables, program: GenerateProgram, stage: str) -> dict:
    """One stage compiled as the demo compiles it (trace, lower, compile: the seconds cover all three),
    with its bytes and FLOPs on one chip; or why the TPU compiler refused it."""
    start = time.perf_counter()
    try:
        compiled = executables.compiled(program, stage)
    except jax.errors.JaxRuntimeError as error:  # RESOURCE_EXHAUSTED: the program does not fit HBM
        return {"compiled": False, "compile_s": time.perf_counter() - start, "error": str(error)}
    seconds = time.perf_counter() - start
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    sizes = {kind: getattr(memory, f"{kind}_size_in_bytes") for kind in ("argument", "output", "temp", "alias")}
    result = {
        "compiled": True,
        "compile_s": seconds,
        # What the chip holds while the program runs: inputs, outputs and scratch, less the outputs
        # that reuse donated inputs' buffers.
        "bytes": sizes["argument"] + sizes["output"] + sizes["temp"] - sizes["alias"],
        **{f"{kind}_bytes": size for kind, size in sizes.items()},
        # What the chip holds for the program beside the loaded weights, as the launch's fit check counts it.
        "beside_weights_bytes": bytes_beside_weights(compiled),
        "flops": cost.get("flops"),
        "attention": sorted(kernels_in(compiled)),
        **_products(compiled.as_text()),
    }
    if cost.get("optimal_seconds", 0) > 0:
        result["estimated_s"] = cost["optimal_seconds"]
    return result


def _products(hlo: str) -> dict:
    """How many of a compiled program's dots and convolutions there are, and how many take two 8-bit
    operands (the `quantization.COMPUTE_MODES`' evidence that the chip multiplies in 8 bits)."""
    products = quantization.products_in(hlo)
    eight_bit = [types for types, _ in products if set(types) <= set(quantization.HLO_8_BIT_TYPES)]
    return {"products": len(products), "products_8_bit": len(eight_bit)}


def _report(
    compiled: list[dict], *, model, refiner, weight_bytes, checkpoints, weights_dtype, shared, hires, topology, devices,
    height, width, steps, batch, dtype,
) -> dict:
    kind = devices[0].device_kind
    ok = [c for c in compiled if c["compiled"]]
    largest = max(ok, key=lambda c: c["beside_weights_bytes"], default=None)

    guided = next((c["program"] for c in compiled if not c["program"].endswith("-unguided")), None)

    def guided_stage(stage: str) -> dict | None:  # of the first guided program ("text": the demo's default)
        return next((c for c in ok if (c["program"], c["stage"]) == (guided, stage)), None)

    denoise = guided_stage("denoise")
    estimates = [guided_stage(stage) for stage in IN_STAGES]
    report = {
        "compiled": len(ok) == len(compiled),
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(),
        "jax": jax.__version__,
        "topology": topology,
        "device": kind,
        "chips": len(devices),
        "hosts": len({d.process_index for d in devices}),
        "model": model,
        "checkpoints": checkpoints,
        "refiner": refiner,
        "shared_components": shared,
        "dtype": dtype,
        "weights_dtype": weights_dtype,
        "height": height,
        "width": width,
        # Only with a hires program: its upscale and size ({"scale", "height", "width"}).
        **({"hires": hires} if hires else {}),
        "steps": steps,
        "batch": batch,
        "images_per_chip": batch // len(devices),
        "attention": sorted({k for c in ok for k in c["attention"]}),
        # The loaded weights (the model's and a refiner's) and the largest program's own buffers.
        "weight_bytes_per_chip": weight_bytes,
        "bytes_per_chip": largest and weight_bytes + largest["beside_weights_bytes"],
        "largest_program": largest and f"{largest['program']} {largest['stage']}",
        "hbm_bytes_per_chip": hbm_bytes(kind),
        "hbm_source": HBM_SOURCE,
        # XLA's cost analysis counts a loop's body once: `denoise` is one step, the guided UNet on
        # this chip's share of the latents (2 per image) plus the sampler's few elementwise ops.
        "unet_flops_per_step": denoise and denoise["flops"],
        "compile_s": sum(c["compile_s"] for c in compiled),
        "programs": compiled,
    }
    capacity = report["hbm_bytes_per_chip"]
    report["fits"] = None if capacity is None else report["compiled"] and report["bytes_per_chip"] <= capacity
    if all(e is not None and "estimated_s" in e for e in estimates):
        prepare, step, finish = (e["estimated_s"] for e in estimates)
        report["estimated_generation_s"] = prepare + steps * step + finish
    return report


def _size(width: int, height: int, hires: dict | None) -> str:
    """A report's size, and its hires pass's where it has one."""
    if hires is None:
        return f"{width}x{height}"
    return f"{width}x{height} (hires pass x{hires['scale']:g}: {hires['width']}x{hires['height']})"


def _gib(value) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f} GiB"


def _program_line(c: dict) -> str:
    what = f"{c['program']} {c['stage']}: {c['compile_s']:.1f} s, "
    if not c["compiled"]:
        return what + f"not compiled: {c['error'].splitlines()[0]}"
    flops = "n/a" if c["flops"] is None else f"{c['flops'] / 1e12:.3g} TFLOP"
    products = ""
    if c["products_8_bit"]:
        products = f", {c['products_8_bit']} of {c['products']} dots and convolutions in 8 bits"
    return what + (f"{_gib(c['bytes'])} per chip (temporaries {_gib(c['temp_bytes'])}; "
                   f"{_gib(c['beside_weights_bytes'])} beside the weights), {flops}{products}")


def _models(r: dict) -> str:
    model = r["model"] if r["checkpoints"] == 1 else f"{r['checkpoints']} checkpoints of {r['model']}"
    if r["refiner"] is not None:
        model += f" + refiner {r['refiner']} (sharing {', '.join(r['shared_components']) or 'nothing'})"
    return model


def _dtypes(r: dict) -> str:
    """The compute dtype, and how the weights are stored where that differs ("bfloat16, int8 weights")."""
    return r["dtype"] if r["weights_dtype"] == "default" else f"{r['dtype']}, {r['weights_dtype']} weights"


def format_topology_table(r: dict) -> str:
    flops = r["unet_flops_per_step"]
    lines = [
        f"compiled for {r['topology']} ({r['chips']}x {r['device']}, {r['hosts']} host(s)) on this CPU, not run",
        f"{_models(r)} {_dtypes(r)} at {_size(r['width'], r['height'], r.get('hires'))}, "
        f"{r['images_per_chip']} images per chip, "
        f"{', '.join(r['attention']) or 'no'} attention",
        f"weights {_gib(r['weight_bytes_per_chip'])} per chip, and the largest program beside them, "
        f"{r['largest_program']}: {_gib(r['bytes_per_chip'])} per chip of "
        f"{_gib(r['hbm_bytes_per_chip'])} ({'fits' if r['fits'] else 'does NOT fit'})",
        "guided UNet per step: " + ("n/a" if flops is None else f"{flops / 1e12:.3g} TFLOP per chip"),
        f"compile: {r['compile_s']:.0f} s for {len(r['programs'])} programs",
        *(_program_line(c) for c in r["programs"]),
    ]
    if "estimated_generation_s" in r:
        estimate = r["estimated_generation_s"]
        lines.append(f"XLA's cost model (not a measurement): {estimate:.2f} s per call of {r['steps']} steps")
    return "\n".join(lines)


TOPOLOGY_MARKDOWN_HEADER = (
    "| Date | Machine | Topology | Model | Size, images per chip | Bytes per chip / HBM | Largest program "
    "| Guided UNet TFLOP per step per chip | Compile | Note |\n"
    "|---|---|---|---|---|---|---|---|---|---|\n"
)


def topology_markdown_row(r: dict) -> str:
    flops = r["unet_flops_per_step"]
    failed = [f"{c['program']} {c['stage']}: {c['error'].splitlines()[0]}" for c in r["programs"] if not c["compiled"]]
    cells = [
        r["date"],
        r["machine"],
        f"{r['topology']} ({r['chips']}x {r['device']})",
        f"{_models(r)} {_dtypes(r)}, {', '.join(r['attention'])} attention",
        f"{_size(r['width'], r['height'], r.get('hires'))}, {r['images_per_chip']}",
        f"{_gib(r['bytes_per_chip'])} / {_gib(r['hbm_bytes_per_chip'])}" + ("" if r["fits"] else " (does not fit)"),
        r["largest_program"] or "",
        "n/a" if flops is None else f"{flops / 1e12:.3g}",
        f"{r['compile_s']:.0f} s, {len(r['programs'])} programs",
        "; ".join([f"compiled for {r['topology']} on this CPU, not run", *failed]),
    ]
    return "| " + " | ".join(cells) + " |\n"
