"""Measuring the load: `Pipeline.from_pretrained` against a raw read of the same files, and the RSS.

Each measurement runs in a fresh process (`python -m sdxl.bench FUNCTION OPTIONS_JSON`), as a
restarted server would: memory freed within a process is reused, and the page cache state is the
measurement's to set.
"""

import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np

from ..checkpoints import locate, random_models, resolve
from ..checkpoints.folder import weight_files
from ..checkpoints.weights import flatten
from ..engine.pipeline import Pipeline


def resolve_model(name: str, scratch: Path, dtype: str) -> Path:
    """The checkpoint folder `bench --model name` measures.

    "sdxl-base" (SDXL base 1.0's published configs with random weights, about 7 GB) is written into
    `scratch`, which the caller deletes; anything else is located as `Pipeline.from_pretrained` does
    ("medium" and "tiny" are written once into the project cache).
    """
    if name == "sdxl-base":
        configs = random_models.configs_of("sdxl-base-1.0")
        return random_models.write_checkpoint(scratch / "sdxl-base", configs, dtype="float16")
    return Path(name) if name.endswith(".safetensors") else locate(name, dtype=dtype)


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sdxl-bench-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def machine_description() -> str:
    """CPU model and cores, plus the accelerator kind and count."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
    device = jax.devices()[0]
    accelerator = "" if device.platform == "cpu" else f", {jax.device_count()}x {device.device_kind}"
    return f"{cpu} ({os.cpu_count()} cores){accelerator}"


def read_files(files: list[Path], buffer_bytes: int = 16 << 20) -> tuple[float, int]:
    """Reads every byte of `files` into one reused buffer: (seconds, bytes), the floor for a loader."""
    buffer = memoryview(bytearray(buffer_bytes))
    total, start = 0, time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return time.perf_counter() - start, total


def _loaded_files(model: Path, dtype: str) -> list[Path]:
    """The weight files `Pipeline.from_pretrained(model)` reads for `dtype`: a folder's, or a single file."""
    checkpoint = resolve(model, dtype=dtype)
    if checkpoint.single_file is not None:
        return [checkpoint.single_file]
    components = ("unet", "vae", *checkpoint.spec.text_encoder_names)
    return [f for name in components for f in weight_files(checkpoint.folder / name, dtype)]


def memory_status() -> dict[str, int]:
    """This process's current (VmRSS) and peak (VmHWM) resident memory in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def process_start_time() -> float:
    """When this process started, in `time.time()` seconds (Linux; to 10 ms)."""
    start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def default_dtype() -> str:
    return "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"


def load_on_devices(folder: Path, dtype: str, max_steps: int, num_devices: int | None, weights_dtype: str = "default"):
    return Pipeline.from_pretrained(str(folder), dtype=dtype, max_steps=max_steps, devices=jax.devices()[:num_devices],
                                    weights_dtype=weights_dtype)


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
    folder = Path(folder)
    jax.devices()  # start the backend before taking the baseline memory
    files = _loaded_files(folder, dtype)
    if cold:
        evict_from_page_cache(files)
    else:
        read_files(files)
    raw_read_s, weight_bytes = read_files(files)
    if cold:
        evict_from_page_cache(files)
    before = memory_status()["VmRSS"]
    start = time.perf_counter()
    pipe = load_on_devices(folder, dtype, max_steps, num_devices)
    load_s = time.perf_counter() - start
    suffix = "_cold" if cold else ""
    return pipe, {
        f"load{suffix}_s": load_s,
        f"raw_read{suffix}_s": raw_read_s,
        "weight_bytes": weight_bytes,
        "rss_before_load_bytes": before,
        "load_peak_rss_bytes": memory_status()["VmHWM"],
    }


def read_into_fresh_memory(folder: str, dtype: str) -> dict:
    """Reads every weight file into newly allocated memory (`python -m sdxl.bench read_into_fresh_memory
    OPTIONS_JSON`): the floor for a loader whose parameters live in host memory (a CPU backend).

    Fresh memory costs more than the bytes read on some virtual machines, where the host backs a
    guest's memory only when it is first touched: on this project's CI machine, 6.5 GiB took 29 s
    this way against 1.2 s into a reused buffer. It is measured in its own process because memory
    freed within a process is reused, and fast, from then on.
    """
    files = _loaded_files(Path(folder), dtype)
    read_files(files)  # into the page cache
    start = time.perf_counter()
    arrays = [np.fromfile(path, np.uint8) for path in files]
    seconds = time.perf_counter() - start
    del arrays
    return {"raw_read_fresh_s": seconds}


def bf16_bytes(spec) -> int:
    return 2 * sum(int(np.prod(leaf.shape)) for leaf in flatten(spec.abstract_params()).values())


def load(folder: str, dtype: str, max_steps: int, num_devices: int | None, cold: bool) -> dict:
    """`measure_load`'s numbers alone (`python -m sdxl.bench load OPTIONS_JSON`)."""
    return measure_load(folder, dtype, max_steps, num_devices, cold)[1]


def in_fresh_process(function: str, **options) -> dict:
    package_root = str(Path(__file__).resolve().parents[2])
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
    cold = in_fresh_process(
        "load", folder=folder, dtype=dtype, max_steps=max_steps, num_devices=num_devices, cold=True
    )
    return {k: v for k, v in cold.items() if k.endswith("_cold_s")} | in_fresh_process(
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


def run_load_benchmark(
    model: str, *, dtype: str | None = None, num_devices: int | None = None, log: Callable[[str], None] = print
) -> dict:
    """Only the loading numbers, warm and from the disk, each in a fresh process; for full-size
    checkpoints on a machine too slow to run them."""
    dtype = dtype or default_dtype()
    with scratch_dir() as scratch:
        folder = resolve_model(model, scratch, dtype)
        log(f"loading {folder} with the page cache warm, then from the disk")
        options = dict(folder=str(folder), dtype=dtype, max_steps=100, num_devices=num_devices)
        result = in_fresh_process("load", **options, cold=False) | disk_and_fresh_memory_loads(**options)
        result |= dict(
            date=datetime.date.today().isoformat(),
            machine=machine_description(),
            model=model,
            dtype=dtype,
            param_bytes_bf16=bf16_bytes(resolve(folder, dtype=dtype).spec),
        )
    return result | load_ratios(result)


