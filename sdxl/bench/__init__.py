"""`python -m sdxl bench`: how fast generation is, measured honestly, side by side with diffusers.

One run measures one model at one image size, step count and batch size:

- load: `Pipeline.from_pretrained` in a fresh process, against a raw read of the same weight files
  in that process (both with the files in the page cache), and the host's peak RSS against the
  parameters' bytes in bfloat16;
- compile: cold (in this process, with an empty persistent cache), and warm (in a fresh process
  that finds the persistent cache this process filled);
- time from process start to the first image, in this process (cold) and in the fresh one (warm);
- steady state: the median of `--runs` (default 5) timed `Pipeline.render` calls after warm-up. `render`
  returns the images on the host, so a timing covers the whole request: tokenization, transfers,
  the compiled program to completion, and the fetch;
- achieved TFLOP/s from XLA's cost analysis, and MFU against the device's peak;
- the cost of progress reporting (`render(..., on_step=...)`, a chain of staged programs) against the
  single program (not with `--no-progress`);
- the cost of one ControlNet (`controlnet.py`): the same batch steered by a random ControlNet of the
  model's UNet shape (as diffusers' `ControlNetModel.from_unet` makes one; SDXL's published one at
  SDXL's size), timed in turn with the batch without it; its parameters' bytes per device; and the
  FLOPs of one guided step with it over without;
- the compilations over a sweep of prompt, seed, guidance and step count (expected: none);
- peak device memory, where the backend reports it;
- with `--profile DIR`, where the device time of a few warm steps goes, op by op (`profile.py`).

With `--compare diffusers`, diffusers' pipeline loads the same saved folder and renders the same
batch (size, steps, guidance, sampler); its timed runs alternate with ours, so that a machine that
gets busier part-way slows both alike.

Models: a folder or Hub id, "tiny", "medium" (an SDXL-shaped model small enough for a CPU, built
here), or "sdxl-base" (SDXL base 1.0's published configs with random weights, about 7 GB in
float16, written to a temporary folder). `python -m sdxl write-checkpoint` writes such random
checkpoints, one tensor at a time.

With `--topology T` (a TPU slice such as v5e:2x2), it compiles the demo's programs for that slice on
this host instead, without running them (`topology.py`): bytes per chip against the chip's memory,
FLOPs per step, compile times; with `--programs hires`, a hires fix's second pass at `--hires-scale`.
It needs libtpu (`pip install "jax[tpu]"`) and no TPU.

With `--soak-clients N`, it measures the demo under load instead (`soak.py`): `python app.py --model M`
in a subprocess, N clients sending `--soak-requests` requests each at `--steps`, and
`--soak-killed` more clients killed mid-request.

With `--soak-hosts P` too, it runs that soak twice in one command and compares (`hosts.py`): against
the demo as one process of `--devices` forced CPU devices (default 2 per process), then as P
processes of `--devices`/P each (`app.py --coordinator ...`, gloo collectives), as several hosts
serve one demo: images/s and latencies for each, their ratios, and what process 0's messages to the
followers cost per request (bytes, its seconds, the followers' lag per step).
"""

import argparse
import json
import sys
from pathlib import Path

from ..checkpoints.random_models import MEDIUM_SIZE
from ..models.quantization import ALIASES, WEIGHT_DTYPES
from .hosts import HOSTS_MARKDOWN_HEADER, format_hosts_table, hosts_markdown_row, run_hosts_soak
from .loading import run_load_benchmark
from .report import (
    LOAD_MARKDOWN_HEADER, MARKDOWN_HEADER, append_markdown, format_load_table, format_table, load_markdown_row,
    markdown_row,
)
from .soak import SOAK_MARKDOWN_HEADER, format_soak_table, run_soak, soak_markdown_row
from . import weights
from .speed import run_benchmark
from .topology import (
    HIRES, IP, PROGRAMS, REFINE, STAGES, TOPOLOGY_MARKDOWN_HEADER, format_topology_table, run_topology_benchmark,
    topology_markdown_row,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="medium", help="tiny, medium, sdxl-base, a folder or a Hub id (default: %(default)s)"
    )
    parser.add_argument("--height", type=int, default=MEDIUM_SIZE)
    parser.add_argument("--width", type=int, default=MEDIUM_SIZE)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, help="images per call (default: one per device)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per median (default: %(default)s)")
    parser.add_argument(
        "--devices", type=int, help="use the first N devices (default: all; with --soak-hosts, N forced CPU devices)"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16, float32 on CPU")
    parser.add_argument(
        "--weights-dtype", choices=[*WEIGHT_DTYPES, *ALIASES], default="default",
        help="with --topology, how the UNet's and ControlNets' large weights are stored, computed in --dtype all "
        "the same (default: %(default)s, in --dtype)",
    )
    parser.add_argument(
        "--compare-weights", metavar="MODES",
        help="also time the model with its weights stored in these modes, comma-separated (fp8_e4m3fn, fp8_e5m2, "
        "int8, int8_compute, fp8_e4m3fn_compute), each loaded again and its calls timed in turn with the baseline's",
    )
    parser.add_argument(
        "--checkpoints", type=int, default=1, metavar="N",
        help="with --topology, N checkpoints of the model's architecture held on each chip (their weights N "
        "times, the programs' other buffers once) (default: %(default)s)",
    )
    parser.add_argument("--compare", choices=["diffusers"], help="also time diffusers' pipeline on the same weights")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the cold compile, images/s (and diffusers'), MFU, progress overhead and device memory: "
        "what a lease of minutes on an accelerator allows",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="neither compile nor time the progress programs (the demo's path): a cold compile less per run",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="also trace a few warm steps of the batch into DIR (jax.profiler), and summarise the ops by device "
        "time into DIR/profile.md",
    )
    parser.add_argument(
        "--load-only", action="store_true", help="measure only the loading (for checkpoints too big to run here)"
    )
    parser.add_argument(
        "--topology",
        metavar="T",
        help="instead: compile the demo's programs for this TPU slice (v5e:2x2, v6e:2x4, v5p:2x2x1, ...), not run them",
    )
    parser.add_argument(
        "--programs",
        default=",".join(PROGRAMS),
        help=f"with --topology, the programs to compile, comma-separated (default: %(default)s; also "
        f"{', '.join(HIRES)}: a hires fix's second pass, see --hires-scale; {', '.join(IP)}: text-to-image "
        "with an IP-Adapter, see --ip-adapter)",
    )
    parser.add_argument(
        "--stages",
        default=",".join(STAGES),
        help="with --topology, which stages of each program to compile, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--hires-scale",
        type=float,
        default=2.0,
        help=f"with --topology, the upscale of the {' and '.join(HIRES)} programs: a hires fix's second pass, "
        "from the first pass's latents (at --height x --width) upscaled (default: %(default)g)",
    )
    parser.add_argument(
        "--ip-adapter",
        choices=("plain", "plus"),
        default="plus",
        help=f"with --topology, the published SDXL IP-Adapter of the {' and '.join(IP)} programs: plain "
        "(ip-adapter_sdxl, ViT-bigG) or plus (ip-adapter-plus_sdxl_vit-h, ViT-H) (default: %(default)s)",
    )
    parser.add_argument(
        "--refiner",
        metavar="MODEL",
        help=f"with --topology, a refiner loaded beside the model: it shares each chip, and adds the '{REFINE}' "
        "program",
    )
    parser.add_argument(
        "--soak-clients",
        type=int,
        metavar="N",
        help="instead: start the demo (app.py --model MODEL) and send it requests from N clients at once",
    )
    parser.add_argument("--soak-requests", type=int, default=10, help="requests per soak client (default: %(default)s)")
    parser.add_argument(
        "--soak-killed", type=int, help="more soak clients, killed mid-request (default: a third of --soak-clients)"
    )
    parser.add_argument(
        "--soak-hosts",
        type=int,
        metavar="P",
        help="with --soak-clients: soak the demo as 1 process of --devices forced CPU devices (default: 2 x P), "
        "then as P processes (app.py --coordinator ...) sharing them, and compare",
    )
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--markdown", help="append the results as a row to this Markdown file (e.g. BENCHMARKS.md)")


def command(args: argparse.Namespace) -> None:
    def log(message: str) -> None:
        print(message, file=sys.stderr)

    if args.weights_dtype != "default" and not args.topology:
        raise ValueError("--weights-dtype goes with --topology; to time weights modes beside the default, "
                         "give --compare-weights")
    if args.refiner and not args.topology:
        raise ValueError("--refiner goes with --topology: the refiner's fit beside the model is compiled, not run")
    if args.topology:
        result = run_topology_benchmark(
            args.model,
            args.topology,
            height=args.height,
            width=args.width,
            steps=args.steps,
            batch=args.batch,
            dtype=args.dtype or "bfloat16",
            programs=tuple(args.programs.split(",")),
            refiner=args.refiner,
            stages=tuple(args.stages.split(",")),
            hires_scale=args.hires_scale,
            ip_adapter_kind=args.ip_adapter,
            weights_dtype=args.weights_dtype,
            checkpoints=args.checkpoints,
            log=log,
        )
        table, header, row = format_topology_table(result), TOPOLOGY_MARKDOWN_HEADER, topology_markdown_row(result)
    elif args.soak_hosts is not None and args.soak_clients is None:
        raise ValueError("--soak-hosts compares soaks: give --soak-clients too")
    elif args.soak_hosts is not None:
        killed = args.soak_clients // 3 if args.soak_killed is None else args.soak_killed
        result = run_hosts_soak(args.model, args.soak_clients, args.soak_requests, killed, args.steps,
                                processes=args.soak_hosts, devices=args.devices or 2 * args.soak_hosts, log=log)
        table, header, row = format_hosts_table(result), HOSTS_MARKDOWN_HEADER, hosts_markdown_row(result)
    elif args.soak_clients is not None:
        killed = args.soak_clients // 3 if args.soak_killed is None else args.soak_killed
        result = run_soak(args.model, args.soak_clients, args.soak_requests, killed, args.steps, log=log)
        table, header, row = format_soak_table(result), SOAK_MARKDOWN_HEADER, soak_markdown_row(result)
    elif args.load_only:
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
            quick=args.quick,
            progress=not args.no_progress,
            profile=args.profile and Path(args.profile),
            compare_weights=weights.modes_of(args.compare_weights),
            log=log,
        )
        table, header, row = format_table(result), MARKDOWN_HEADER, markdown_row(result)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        append_markdown(Path(args.markdown), header, row)
