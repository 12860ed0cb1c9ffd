"""`python -m sdxl bench --soak-clients N`: the demo under a bounded load, as its users load it.

The demo starts as users start it (`python app.py --model M --port P`). Once its page answers and it
has settled (its background compiles done), N clients, each its own gradio_client session, send M
`/generate` requests each, one after another, all clients at once. K more clients, spread over the
run, are killed mid-request: each is a process that submits one long request and is SIGKILLed once
the demo is serving it, so its connection drops as a crashed browser's does.

Reported: the latency percentiles of the completed requests (submit to images downloaded), errors,
lost requests (no answer within `REQUEST_TIMEOUT`), wrong images (not a decodable image of the size
its client's first image has: a request naming none gets its model's first), how many of the killed
clients' requests the demo gave up, and the server's resident memory before and after.

The demo may also run on forced CPU devices, as one process or as several joined by
jax.distributed (`running_demo(..., devices=D, processes=P)`: P processes of D/P devices each, as
`sdxl.serving.hosts` serves one demo from many hosts); `sdxl.bench.hosts` compares the two under the same load.
"""

import contextlib
import dataclasses
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from ..serving.hosts import STATS_VARIABLE
from .loading import scratch_dir
from .report import _aligned

if TYPE_CHECKING:
    from gradio_client import Client

APP = Path(__file__).resolve().parents[2] / "app.py"
STARTUP_TIMEOUT = 600  # seconds: load, compile and warm-up of a large model on a slow machine
REQUEST_TIMEOUT = 300  # seconds without an answer after which a request counts as lost
PROMPT = "a lighthouse on a cliff at dusk"
# The killed clients ask for the most steps the demo takes: their requests are surely still waiting
# or rendering when they are killed, and the demo has work to give up.
DOOMED_STEPS = 100

# A browser closed mid-request, run with `python -c`: a process that starts in a fraction of a
# second (this package's JAX imports would take seconds of the CPU the demo is measured on). It
# says which state its request reached once the demo is serving it, then waits to be killed.
DOOMED_CLIENT = """
import json, sys, time
from gradio_client import Client
from gradio_client.utils import Status
job = Client(sys.argv[1], verbose=False, download_files=sys.argv[2]).submit(**json.loads(sys.argv[3]),
                                                                            api_name="/generate")
waiting = (Status.STARTING, Status.JOINING_QUEUE, Status.IN_QUEUE, Status.SENDING_DATA)
deadline = time.monotonic() + 120
while job.status().code in waiting and time.monotonic() < deadline:
    time.sleep(0.05)
print(job.status().code.name, flush=True)
job.result()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory(pids: Sequence[int]) -> dict[str, int]:
    """Processes' current (VmRSS) and peak (VmHWM) resident memory in bytes, summed."""
    fields = dict(VmRSS=0, VmHWM=0)
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in fields:
                fields[key] += int(value.split()[0]) * 1024
    return fields


def _cpu_seconds(pids: Sequence[int]) -> float:
    """The CPU seconds processes have used, summed."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14, 15
    return ticks / os.sysconf("SC_CLK_TCK")


def _wait_until_idle(pids: Sequence[int], timeout: float = STARTUP_TIMEOUT) -> None:
    """Until the processes use under 5% of a core each for a second: the demo compiles batch sizes and
    image-to-image in the background after it starts serving, which would count against the first
    requests' latencies and in the memory before the load."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = _cpu_seconds(pids)
        time.sleep(1)
        if _cpu_seconds(pids) - before < 0.05 * len(pids):
            return
    raise RuntimeError(f"the demo was still busy {timeout} s after it started serving")


@contextlib.contextmanager
def running_app(args: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
                startup_timeout: float = STARTUP_TIMEOUT) -> Iterator[tuple[subprocess.Popen, str]]:
    """`python app.py ARGS` on a free port of 127.0.0.1, its output written to `log`, until the block
    ends: yields (the process, its URL) once its page answers. Raises RuntimeError, with the end of
    the log, if it exits first or does not answer within `startup_timeout` seconds."""
    port = free_port()
    command = [sys.executable, str(APP), *args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, cwd=APP.parent, env=env, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_until_serving(process, url, log, startup_timeout)
        yield process, url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclasses.dataclass
class RunningDemo:
    """A demo the soak started: its processes (process 0, which serves the page, first), its URL, the
    file each process writes its output to, and the one each rewrites its `sdxl.serving.hosts` counters to
    (with several processes)."""

    processes: list[subprocess.Popen]
    url: str
    logs: list[Path]
    stats: list[Path]

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def output(self) -> str:
        return "".join(log.read_text(errors="replace") for log in self.logs)

    def counters(self) -> list[dict]:
        """Each process's counters (`sdxl.serving.hosts`) as it last wrote them; none before its first batch."""
        return [json.loads(path.read_text()) if path.exists() else {} for path in self.stats]


@contextlib.contextmanager
def running_demo(model: str, scratch: Path, devices: int | None = None,
                 processes: int = 1) -> Iterator[RunningDemo]:
    """`python app.py --model MODEL`, as users start it, once its page answers. With `devices`, on that
    many forced CPU devices; with `processes` too, as that many processes of `devices / processes`
    devices each, joined by jax.distributed (`app.py --coordinator ...`) as several hosts run it."""
    if processes > 1 and (devices is None or devices % processes):
        raise ValueError(f"{processes} processes need a number of devices they divide, got {devices}")
    env = os.environ | dict(GRADIO_TEMP_DIR=str(scratch / "gradio"), PYTHONUNBUFFERED="1")
    if devices is not None:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")).strip()
        env |= dict(JAX_PLATFORMS="cpu",
                    XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices // processes}".strip())
    logs = [scratch / ("server.log" if i == 0 else f"follower-{i}.log") for i in range(processes)]
    stats = [scratch / f"hosts-{i}.json" for i in range(processes)] if processes > 1 else []
    coordinator = f"127.0.0.1:{free_port()}"

    def options(i: int) -> list[str]:
        hosts = ["--coordinator", coordinator, "--num-processes", str(processes), "--process-id", str(i)]
        return ["--model", model, *(hosts if processes > 1 else [])]

    def env_of(i: int) -> dict[str, str]:
        return env | ({STATS_VARIABLE: str(stats[i])} if stats else {})

    followers = []
    try:
        for i in range(1, processes):  # they serve nothing over HTTP, and wait for process 0 to start
            with open(logs[i], "wb") as sink:
                followers.append(subprocess.Popen([sys.executable, str(APP), *options(i)], cwd=APP.parent,
                                                  env=env_of(i), stdout=sink, stderr=subprocess.STDOUT))
        with running_app(options(0), logs[0], env_of(0)) as (process, url):
            yield RunningDemo([process, *followers], url, logs, stats)
    finally:
        for follower in followers:
            follower.kill()
            follower.wait()


def _wait_until_serving(process: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"app.py exited with status {process.returncode}:\n{log.read_text()[-5000:]}")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"app.py did not answer on {url} within {timeout} s:\n{log.read_text()[-5000:]}")


def _sizes(gallery: list[dict]) -> list[tuple[int, int] | None]:
    """The (width, height) of each of a result's images, None for one that does not decode."""
    sizes = []
    for item in gallery:
        try:
            with Image.open(item["image"]) as picture:
                picture.load()
                sizes.append(picture.size)
        except (OSError, ValueError):
            sizes.append(None)
    return sizes


def _request(client: "Client", seed: int, steps: int, size: tuple[int, int] | None) -> dict:
    """One `/generate` call, timed from submit to its images on disk: its outcome, with the size of its images
    (`size`: the one every image must have; None: its first image's)."""
    start = time.perf_counter()
    job = client.submit(prompt=PROMPT, seed=seed, steps=steps, api_name="/generate")
    try:
        gallery, _ = job.result(timeout=REQUEST_TIMEOUT)
    except TimeoutError:
        return dict(lost=True)
    except Exception as e:  # the demo's refusal (gradio_client's AppError) or a dropped connection
        return dict(error=f"{type(e).__name__}: {e}")
    sizes = _sizes(gallery)
    size = size or next((found for found in sizes if found), None)
    return dict(latency_s=time.perf_counter() - start, images=len(gallery),
                wrong=sum(found is None or found != size for found in sizes), size=size)


def _session(url: str, downloads: Path, seeds: range, steps: int, finished: list[dict]) -> None:
    """One client: its requests one after another, each outcome appended to `finished` as it comes; every
    image of the size its first one has (a request naming none gets its model's first size)."""
    from gradio_client import Client  # a dev dependency, needed by the soak alone

    client = Client(url, verbose=False, download_files=str(downloads))
    size = None
    for seed in seeds:
        outcome = _request(client, seed, steps, size)
        size = size or outcome.get("size")
        finished.append(outcome)


def _doomed_session(url: str, downloads: Path, seed: int, after: Callable[[], bool]) -> str:
    """Once `after()`, a client process that is SIGKILLed as soon as the demo serves its request: the
    state its request was in (gradio_client's Status), or why it never got there."""
    while not after():
        time.sleep(0.1)
    request = json.dumps(dict(prompt=PROMPT, seed=seed, steps=DOOMED_STEPS))
    process = subprocess.Popen([sys.executable, "-c", DOOMED_CLIENT, url, str(downloads), request],
                               stdout=subprocess.PIPE, text=True)
    state = process.stdout.readline().strip()
    process.kill()
    process.wait()
    return state or f"exited with status {process.returncode} before its request was served"


def _load(url: str, downloads: Path, clients: int, requests: int, killed: int, steps: int) -> tuple[list, list]:
    """Every client at once; the killed ones spread over the run (the k-th of K once k/(K+1) of the
    other requests have finished): (the outcomes of the others' requests, the killed ones' states)."""
    finished: list[dict] = []
    total = clients * requests
    with ThreadPoolExecutor(clients + killed) as pool:
        sessions = [pool.submit(_session, url, downloads, range(c * requests, (c + 1) * requests), steps, finished)
                    for c in range(clients)]
        # (or once every other client is done: one that failed stops short of its requests)
        doomed = [pool.submit(_doomed_session, url, downloads, total + k,
                              lambda k=k: len(finished) >= (k + 1) * total // (killed + 1)
                              or all(s.done() for s in sessions))
                  for k in range(killed)]
        for session in sessions:
            session.result()  # a client that could not even connect stops the run with its reason
        return finished, [d.result() for d in doomed]


def run_soak(model: str, clients: int, requests: int, killed: int, steps: int,
             log: Callable[[str], None] = print, *, devices: int | None = None, processes: int = 1) -> dict:
    """Starts the demo (`running_demo(model, devices=, processes=)`), loads it, and measures it: the
    result's fields are described in BENCHMARKS.md. With several processes, `hosts_counters` has
    each one's `sdxl.serving.hosts` counters over the load (from before it to once the demo is idle again)."""
    if clients < 1 or requests < 1 or killed < 0:
        raise ValueError(f"a soak needs at least 1 client and 1 request each, and killed >= 0; got {clients}, "
                         f"{requests}, {killed}")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no telemetry call per simulated client
    with scratch_dir() as scratch, running_demo(model, scratch, devices, processes) as demo:
        log(f"{demo.url} serves; waiting until its background compiles are done")
        _wait_until_idle(demo.pids)
        before, cpu, counters = _memory(demo.pids)["VmRSS"], _cpu_seconds(demo.pids), demo.counters()
        log(f"{clients} clients x {requests} requests, + {killed} killed mid-request")
        start, clients_cpu = time.perf_counter(), time.process_time()
        outcomes, killed_states = _load(demo.url, scratch / "downloads", clients, requests, killed, steps)
        wall, cpu = time.perf_counter() - start, _cpu_seconds(demo.pids) - cpu
        # On a machine with fewer cores than clients, the clients' CPU slows the demo they measure.
        clients_cpu = time.process_time() - clients_cpu
        _wait_until_idle(demo.pids)  # until the demo has given up the killed clients' requests
        after = _memory(demo.pids)
        counters = [_growth(b, a) for b, a in zip(counters, demo.counters())]
        output = demo.output()
    return dict(
        date=datetime.date.today().isoformat(),
        machine=_cpu_description(),
        demo=re.search(r"^model (.+)$", output, re.M).group(1),  # the first model's startup line
        steps=steps, clients=clients, requests_per_client=requests, killed_clients=killed,
        killed_states=killed_states,
        killed_given_up=len(re.findall(r"^gave up a (?:waiting request|batch) of", output, re.M)),
        **_summary(outcomes, wall), server_cpu_s=cpu, clients_cpu_s=clients_cpu,
        rss_before_bytes=before, rss_after_bytes=after["VmRSS"], rss_growth_bytes=after["VmRSS"] - before,
        rss_peak_bytes=after["VmHWM"],
        server_tracebacks=output.count("Traceback (most recent call last)"),
        processes=processes, **(dict(hosts_counters=counters) if processes > 1 else {}),
    )


def _growth(before: dict, after: dict) -> dict:
    """How much each count of `after` grew since `before` (nested as they are)."""
    return {key: _growth(before.get(key, {}), value) if isinstance(value, dict) else value - before.get(key, 0)
            for key, value in after.items() if key not in ("process", "processes")}


def _cpu_description() -> str:
    """The CPU model and its cores (`loading.machine_description` would start JAX here, and on an
    accelerator take the device memory the demo needs)."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    return f"{cpu} ({os.cpu_count()} cores)"


def _summary(outcomes: list[dict], wall: float) -> dict:
    latencies = [o["latency_s"] for o in outcomes if "latency_s" in o]
    errors = [o["error"] for o in outcomes if "error" in o]
    images = sum(o.get("images", 0) for o in outcomes)
    percentiles = np.percentile(latencies, [50, 90, 99, 100]) if latencies else [None] * 4
    return dict(
        requests=len(outcomes), completed=len(latencies), errors=len(errors), error_messages=sorted(set(errors)),
        lost=sum(o.get("lost", False) for o in outcomes), images=images,
        wrong_images=sum(o.get("wrong", 0) for o in outcomes), wall_s=wall, images_per_s=images / wall,
        **{f"latency_{name}_s": None if p is None else float(p)
           for name, p in zip(("p50", "p90", "p99", "max"), percentiles)},
    )


def _seconds(value) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def _latencies(r: dict) -> str:
    return " / ".join(_seconds(r[f"latency_{name}_s"]) for name in ("p50", "p90", "p99", "max"))


def _rss(r: dict) -> str:
    mib = {key: r[key] / 2**20 for key in ("rss_before_bytes", "rss_after_bytes", "rss_growth_bytes")}
    return f"{mib['rss_before_bytes']:.0f} -> {mib['rss_after_bytes']:.0f} MiB ({mib['rss_growth_bytes']:+.0f} MiB)"


def _killed(r: dict) -> str:
    """The states the killed clients' requests were in, and how many of those the demo gave up."""
    return f"{', '.join(r['killed_states']) or 'none'}; {r['killed_given_up']} given up"


def format_soak_table(r: dict) -> str:
    return _aligned([
        ("demo", f"{r['demo']}, {r['steps']} steps ({r['machine']})"),
        ("load", f"{r['clients']} clients x {r['requests_per_client']} requests, + {r['killed_clients']} killed "
                 f"mid-request ({_killed(r)})"),
        ("completed", f"{r['completed']} of {r['requests']}: {r['images']} images in {r['wall_s']:.1f} s "
                      f"({r['images_per_s']:.2f} images/s)"),
        ("CPU during the load", f"server {r['server_cpu_s']:.1f} s, surviving clients {r['clients_cpu_s']:.1f} s"),
        ("latency p50 / p90 / p99 / max", _latencies(r)),
        ("errors", f"{r['errors']} {r['error_messages'] or ''}".strip()),
        ("lost", str(r["lost"])),
        ("wrong images", str(r["wrong_images"])),
        ("server RSS before -> after", f"{_rss(r)}, peak {r['rss_peak_bytes'] / 2**20:.0f} MiB"),
        ("server log tracebacks", str(r["server_tracebacks"])),
    ])


SOAK_MARKDOWN_HEADER = (
    "| Date | Machine | Demo, steps | Clients x requests, killed | Latency p50 / p90 / p99 / max | Errors | Lost "
    "| Wrong images | Images, wall time (CPU) | Server RSS before -> after (growth) | Server tracebacks |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def soak_markdown_row(r: dict) -> str:
    cells = [
        r["date"], r["machine"], f"{r['demo']}, {r['steps']}",
        f"{r['clients']} x {r['requests_per_client']}, {r['killed_clients']} ({_killed(r)})",
        _latencies(r), str(r["errors"]), str(r["lost"]), str(r["wrong_images"]),
        f"{r['images']} in {r['wall_s']:.1f} s (server {r['server_cpu_s']:.1f}, clients {r['clients_cpu_s']:.1f} s)",
        _rss(r), str(r["server_tracebacks"]),
    ]
    return "| " + " | ".join(cells) + " |\n"
