"""Independent replicas behind HAProxy (docs/deployment.md, "Replicas behind a load balancer"): its
haproxy.cfg, as written but for its addresses, in front of two single-host demos. Which replica
served each request is read from HAProxy's own log, one line per request."""

import contextlib
import dataclasses
import os
import re
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gradio_client import Client
from PIL import Image

from sdxl.bench.soak import free_port, running_app

pytestmark = pytest.mark.server

DEPLOYMENT = Path(__file__).resolve().parent.parent / "docs" / "deployment.md"
HAPROXY = Path(shutil.which("haproxy") or "/usr/sbin/haproxy")  # /usr/sbin is not on every user's PATH
STARTUP_TIMEOUT = 300
CALL_TIMEOUT = 180
REQUEST = dict(prompt="a lighthouse at dusk", steps=2)
# One line of HAProxy's httplog: `... demo replicas/replica1 0/0/0/29/80 200 2909 ... "GET /path HTTP/1.1"`.
LOG_LINE = re.compile(r' \S+ replicas/(?P<server>\S+) \S+ (?P<status>\d{3}) .*"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/')


def _documented_config() -> str:
    found = re.search(r"<!-- haproxy.cfg: tests/test_replicas.py reads the next block -->\n```haproxy\n(.*?)```",
                      DEPLOYMENT.read_text(), re.DOTALL)
    assert found, "docs/deployment.md has lost its marked haproxy.cfg block"
    return found[1]


def _filled(config: str, port: int, replicas: dict[str, int]) -> str:
    """The config listening on 127.0.0.1:PORT, each `server` line pointing at its replica's port."""
    config, binds = re.subn(r"^(\s*bind\s+)\S+", rf"\g<1>127.0.0.1:{port}", config, flags=re.MULTILINE)
    assert binds == 1, config
    return re.sub(r"^(\s*server\s+(\S+)\s+)\S+", lambda m: f"{m[1]}127.0.0.1:{replicas[m[2]]}", config,
                  flags=re.MULTILINE)


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SDXL_", "GRADIO_SERVER_"))}
    return env | dict(
        XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(tmp / "hf-cache"), GRADIO_TEMP_DIR=str(tmp / "gradio"), GRADIO_ANALYTICS_ENABLED="False",
        PYTHONUNBUFFERED="1",
    )


@contextlib.contextmanager
def _haproxy(config: Path, port: int, log: Path):
    """`haproxy -f CONFIG -db` (in the foreground), its log in `log`, once it accepts connections."""
    with open(log, "wb") as sink:
        process = subprocess.Popen([str(HAPROXY), "-f", str(config), "-db"], stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, f"haproxy exited with status {process.returncode}:\n{log.read_text()}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break  # a bare connection: no request, so no replica is picked yet
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield process
    finally:
        process.terminate()
        process.wait(timeout=10)


def _requests(log: Path) -> list[dict[str, str]]:
    return [found.groupdict() for found in map(LOG_LINE.search, log.read_text().splitlines()) if found]


def _servers_of(log: Path, client: Client, calls: int) -> set[str]:
    """The replicas that served `client`'s event streams, once HAProxy has logged `calls` of them
    (it logs a request when it ends, just after the client has its answer)."""
    deadline = time.monotonic() + 30
    while True:
        streams = [r for r in _requests(log) if r["path"].endswith(f"queue/data?session_hash={client.session_hash}")]
        if len(streams) >= calls or time.monotonic() > deadline:
            assert len(streams) >= calls, log.read_text()[-5000:]
            return {r["server"] for r in streams}
        time.sleep(0.2)


def _images(client: Client, seed: int) -> list[Image.Image]:
    gallery, status = client.submit(**REQUEST, seed=seed, api_name="/generate").result(timeout=CALL_TIMEOUT)
    assert status.startswith("1 image in"), status
    return [Image.open(item["image"]) for item in gallery]


@dataclasses.dataclass
class Balanced:
    url: str  # HAProxy's
    log: Path  # HAProxy's: one line per request, with the replica that served it
    replicas: dict[str, subprocess.Popen]  # by the config's server names


@contextlib.contextmanager
def _balanced(tmp: Path):
    """docs/deployment.md's haproxy.cfg in front of one demo per `server` line, each with its own temp folder
    (tmp/NAME/gradio) and all with one compilation cache; prints every log if the block fails."""
    config = _documented_config()
    names = re.findall(r"^\s*server\s+(\S+)", config, flags=re.MULTILINE)
    assert len(names) == 2, config
    port, log = free_port(), tmp / "haproxy.log"
    with contextlib.ExitStack() as stack:
        try:
            replicas = {}
            for name in names:  # one after the other: the second finds the first's programs in the cache
                (tmp / name).mkdir()
                args = ["--model", "tiny", "--cache-dir", str(tmp / "xla-cache"), "--max-images-per-core", "1"]
                replicas[name] = stack.enter_context(running_app(args, tmp / name / "server.log", _env(tmp / name),
                                                                 STARTUP_TIMEOUT))
            ports = {name: int(url.rstrip("/").rsplit(":", 1)[1]) for name, (_, url) in replicas.items()}
            (tmp / "haproxy.cfg").write_text(_filled(config, port, ports))
            stack.enter_context(_haproxy(tmp / "haproxy.cfg", port, log))
            yield Balanced(f"http://127.0.0.1:{port}/", log, {name: process for name, (process, _) in replicas.items()})
        except BaseException:
            for name in names:
                if (tmp / name / "server.log").exists():
                    print(f"----- {name} -----\n{(tmp / name / 'server.log').read_text()[-3000:]}")
            print(f"----- haproxy -----\n{log.read_text()[-6000:] if log.exists() else ''}")
            raise


def test_two_replicas_behind_the_documented_haproxy(tmp_path):
    if not HAPROXY.exists():
        reason = f"{HAPROXY} is missing: install Debian's haproxy (apt-get install -y haproxy) for the replicas test"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    with _balanced(tmp_path) as balanced:
        clients = [Client(balanced.url, verbose=False, download_files=str(tmp_path / f"downloads-{i}")) for i in (1, 2)]
        # Two users at once, two calls each: each gets its images, and each stays on one replica.
        with ThreadPoolExecutor(2) as pool:
            galleries = list(pool.map(lambda client: [_images(client, seed) for seed in (1, 2)], clients))
        assert all(len(images) == 1 and images[0].size == (128, 128) for calls in galleries for images in calls)
        served = [_servers_of(balanced.log, client, calls=2) for client in clients]
        assert served == [{client.cookies["sdxl_replica"]} for client in clients]
        assert served[0] | served[1] == set(balanced.replicas), "the two users were not spread over both replicas"
        # Every request reached the replica that holds its session: file downloads come from that
        # replica's own temp folder.
        requests = _requests(balanced.log)
        assert requests and all(r["status"] == "200" for r in requests), requests
        for r in requests:
            if "/file=" in r["path"]:
                assert f"/{r['server']}/gradio/" in r["path"], r

        # A replica that dies: once HAProxy's check takes it out, its user is served by the other.
        lost = clients[0].cookies["sdxl_replica"]
        balanced.replicas[lost].kill()
        deadline = time.monotonic() + 30
        while f"replicas/{lost} is DOWN" not in balanced.log.read_text():
            assert time.monotonic() < deadline, balanced.log.read_text()[-3000:]
            time.sleep(0.5)
        assert len(_images(clients[0], seed=3)) == 1
        assert _servers_of(balanced.log, clients[0], calls=3) == set(balanced.replicas)
