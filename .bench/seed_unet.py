"""One guided SDXL UNet evaluation compiled for a TPU v5e-4 (`v5e:2x2`) on a CPU host, not run
(BENCHMARKS.md, "The seed's UNet, compiled the same way").

Either the seed's UNet (diffusers-Flax 0.39 `FlaxUNet2DConditionModel`, bf16, split_head_dim=True,
NCHW latents) or ours (`sdxl.models.unet.UNet2DConditionModel`, bf16, NHWC latents, attention as traced for
the TPU mesh), from SDXL base 1.0's UNet config, with abstract bfloat16 parameters replicated over
the 4 chips and the batch (2 latents per guided image) split over them, as
`sdxl/bench/topology.py` and `sdxl/engine/compiled.py` build the mesh and shardings.

The seed's needs diffusers with Flax, which diffusers dropped after 0.39, in a virtual environment of
its own; ours runs in the project's (from the repository root):

    python -m venv /tmp/seed-venv && /tmp/seed-venv/bin/pip install diffusers==0.39.0 flax==0.12.8 \
        "jax[tpu]==0.10.2"
    /tmp/seed-venv/bin/python .bench/seed_unet.py --model seed --images-per-chip 4 --out /tmp/unet
    python .bench/seed_unet.py --model ours --images-per-chip 4 --out /tmp/unet
    SDXL_ATTENTION=xla python .bench/seed_unet.py --model ours --images-per-chip 4 --out /tmp/unet

Each writes OUT/<model>-b<images per chip>[-<SDXL_ATTENTION>].json and the compiled HLO, gzipped.
About six minutes each on a 2-core VM.
"""

import argparse
import collections
import gzip
import json
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "sdxl/configs/sdxl-base-1.0/unet/config.json")
TOPOLOGY = "v5e:2x2"
HEIGHT = WIDTH = 1024
TEXT_TOKENS = 77
DTYPE = jnp.bfloat16


def log(*args):
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def seed_unet(config: dict):
    """The seed's UNet: (apply, abstract params, layout)."""
    from diffusers import FlaxUNet2DConditionModel

    model = FlaxUNet2DConditionModel.from_config(config, dtype=DTYPE, split_head_dim=True)
    assert model.split_head_dim and model.dtype == DTYPE, (model.split_head_dim, model.dtype)
    params = jax.eval_shape(model.init_weights, jax.random.PRNGKey(0))

    def apply(params, sample, timesteps, encoder_hidden_states, text_embeds, time_ids):
        added = {"text_embeds": text_embeds, "time_ids": time_ids}
        return model.apply(
            {"params": params}, sample, timesteps, encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added
        ).sample

    return apply, params, "NCHW"


def our_unet(config: dict):
    """Our UNet: (apply, abstract params, layout)."""
    sys.path.insert(0, ROOT)
    from sdxl.config import config_from_dict
    from sdxl.models.unet import UNet2DConditionModel, UNetConfig, abstract_params

    cfg = config_from_dict(UNetConfig, config)
    model = UNet2DConditionModel(cfg, dtype=DTYPE)

    def apply(params, sample, timesteps, encoder_hidden_states, text_embeds, time_ids):
        return model.apply(
            {"params": params}, sample, timesteps, encoder_hidden_states, text_embeds=text_embeds, time_ids=time_ids
        )

    return apply, abstract_params(cfg), "NHWC"


def custom_calls(hlo: str) -> dict:
    return dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("seed", "ours"), required=True)
    parser.add_argument("--images-per-chip", type=int, required=True, help="guided images; 2 latents each")
    parser.add_argument("--out", default=".", help="where the JSON and HLO go (default: here)")
    parser.add_argument("--lower-only", action="store_true", help="check: trace and lower, do not compile")
    args = parser.parse_args()
    # SDXL_ATTENTION=xla compiles ours with XLA's attention instead of splash: its own output files.
    override = os.environ.get("SDXL_ATTENTION")
    name = f"{args.model}-b{args.images_per_chip}" + (f"-{override}" if override else "")

    config = json.load(open(CONFIG))
    devices = topologies.get_topology_desc(TOPOLOGY, "tpu").devices
    chips = len(devices)
    mesh = Mesh(np.array(list(devices)), ("batch",))  # sdxl.engine.mesh.batch_mesh
    replicated = NamedSharding(mesh, PartitionSpec())  # sdxl.engine.mesh.replicated
    by_image = NamedSharding(mesh, PartitionSpec("batch"))  # sdxl.engine.mesh.by_image
    batch = 2 * args.images_per_chip * chips  # unconditional + conditional latents of each image
    log(f"{args.model} UNet, {args.images_per_chip} images per chip = batch {batch} over {chips}x "
        f"{devices[0].device_kind} ({TOPOLOGY}); jax {jax.__version__}")

    start = time.perf_counter()
    apply, params, layout = (seed_unet if args.model == "seed" else our_unet)(config)
    # As loaded: every leaf in bfloat16 on every chip.
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, DTYPE, sharding=replicated), params)
    param_bytes = sum(leaf.size * 2 for leaf in jax.tree.leaves(params))
    log(f"abstract params: {len(jax.tree.leaves(params))} leaves, {param_bytes / 2**30:.3f} GiB "
        f"({time.perf_counter() - start:.1f} s)")

    h, w = HEIGHT // 8, WIDTH // 8
    shape = (batch, 4, h, w) if layout == "NCHW" else (batch, h, w, 4)
    pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=by_image)

    # As each pipeline calls its UNet: float32 latents; the seed's int32 timesteps (its pipeline casts
    # them), ours float32 (it takes fractional ones); text tensors in bfloat16 from bf16 encoders.
    inputs = (
        arg(shape, jnp.float32),
        arg((batch,), jnp.int32 if args.model == "seed" else jnp.float32),
        arg((batch, TEXT_TOKENS, config["cross_attention_dim"]), DTYPE),
        arg((batch, pooled), DTYPE),
        arg((batch, 6), DTYPE),
    )
    log("inputs:", [(s.shape, str(s.dtype)) for s in inputs])

    fn = jax.jit(apply, out_shardings=by_image)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):  # as sdxl/engine/compiled.py: kernels see the TPU mesh (splash for ours)
        traced = fn.trace(params, *inputs)
        t1 = time.perf_counter()
        lowered = traced.lower()
    t2 = time.perf_counter()
    log(f"traced {t1 - t0:.1f} s, lowered {t2 - t1:.1f} s")
    if args.lower_only:
        text = lowered.as_text()
        log("lowered: attention scopes", sorted(set(re.findall(r"(xla|splash|cudnn)_attention", text))),
            "custom calls", custom_calls(text), "mosaic" if "tpu_custom_call" in text else "")
        return 0
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:
        t3 = time.perf_counter()
        log(f"not compiled after {t3 - t2:.1f} s: {str(error).splitlines()[0]}")
        result = {"compiled": False, "error": str(error), "compile_s": t3 - t0}
        json.dump(result, open(f"{args.out}/{name}.json", "w"), indent=1)
        return 1
    t3 = time.perf_counter()

    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    sizes = {k: getattr(memory, f"{k}_size_in_bytes") for k in ("argument", "output", "temp", "alias")}
    hlo = compiled.as_text()
    with gzip.open(f"{args.out}/{name}.hlo.txt.gz", "wt") as f:
        f.write(hlo)
    attention = sorted(set(re.findall(r"/(xla|splash|cudnn)_attention/", hlo)))  # sdxl.models.attention.kernels_in
    result = {
        "compiled": True,
        "model": args.model,
        "layout": layout,
        "topology": TOPOLOGY,
        "device": devices[0].device_kind,
        "chips": chips,
        "images_per_chip": args.images_per_chip,
        "batch": batch,
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "param_bytes": param_bytes,
        **{f"{k}_bytes": v for k, v in sizes.items()},
        "bytes": sizes["argument"] + sizes["output"] + sizes["temp"] - sizes["alias"],
        "flops": cost.get("flops"),
        "bytes_accessed": cost.get("bytes accessed"),
        "optimal_seconds": cost.get("optimal_seconds"),
        "trace_s": t1 - t0,
        "lower_s": t2 - t1,
        "xla_compile_s": t3 - t2,
        "compile_s": t3 - t0,
        "attention_scopes": attention,
        "custom_calls": custom_calls(hlo),
    }
    if args.model == "seed":
        import diffusers
        import flax

        result.update(diffusers=diffusers.__version__, flax=flax.__version__)
    else:
        import flax

        result.update(flax=flax.__version__)
    json.dump(result, open(f"{args.out}/{name}.json", "w"), indent=1)
    gib = 2**30
    log(f"compiled in {t3 - t2:.1f} s (trace+lower+compile {t3 - t0:.1f} s): {result['bytes'] / gib:.2f} GiB per chip "
        f"(arguments {sizes['argument'] / gib:.2f}, outputs {sizes['output'] / gib:.3f}, temporaries "
        f"{sizes['temp'] / gib:.2f}, aliased {sizes['alias'] / gib:.2f}); "
        f"{(result['flops'] or 0) / 1e12:.2f} TFLOP per chip; attention scopes {attention}; "
        f"custom calls {result['custom_calls']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
