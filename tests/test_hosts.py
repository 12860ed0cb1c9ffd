"""One demo over two hosts (`sdxl/serving/hosts.py`): two app processes of 2 CPU devices each, joined by
jax.distributed with gloo collectives, render the images one process renders on 4 devices; a
follower started differently is refused, and a follower that dies ends the demo with a sentence."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from gradio_client import Client
from PIL import Image

from sdxl.bench.soak import APP, free_port, running_app
from sdxl.serving import hosts

STARTUP_TIMEOUT = 300
CALL_TIMEOUT = 180
REQUEST = dict(prompt="a lighthouse at dusk", seed=7, steps=3, images_per_core=1)


def _env(tmp: Path, devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SDXL_", "GRADIO_SERVER_"))}
    return env | dict(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(tmp / "hf-cache"), GRADIO_TEMP_DIR=str(tmp / "gradio"), PYTHONUNBUFFERED="1",
    )


def _hosts_args(coordinator: str, process_id: int, *extra: str) -> list[str]:
    return ["--coordinator", coordinator, "--num-processes", "2", "--process-id", str(process_id), *extra]


@contextlib.contextmanager
def _follower(tmp: Path, coordinator: str, *args: str):
    """`python app.py ... --process-id 1`, its output in tmp/follower.log, until the block ends."""
    log = tmp / "follower.log"
    command = [sys.executable, str(APP), *args, *_hosts_args(coordinator, 1), "--port", str(free_port())]
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, cwd=APP.parent, env=_env(tmp, 2), stdout=sink, stderr=subprocess.STDOUT)
    try:
        yield process, log
    finally:
        process.kill()
        process.wait()


def _images(url: str, downloads: Path, **kwargs) -> tuple[np.ndarray, str]:
    client = Client(url, verbose=False, download_files=str(downloads))
    gallery, status = client.submit(**(REQUEST | kwargs), api_name="/generate").result(timeout=CALL_TIMEOUT)
    return np.stack([np.asarray(Image.open(item["image"]).convert("RGB")) for item in gallery]), status


@pytest.fixture(scope="module")
def cache_dir(xla_cache) -> Path:
    return xla_cache  # the session's (conftest)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, cache_dir) -> np.ndarray:
    """REQUEST's images from one process with 4 devices: one request, so one batch size to compile."""
    tmp = tmp_path_factory.mktemp("one")
    args = ["--model", "tiny", "--cache-dir", str(cache_dir), "--max-images-per-core", "1"]
    with running_app(args, tmp / "server.log", _env(tmp, 4), STARTUP_TIMEOUT) as (_, url):
        images, status = _images(url, tmp / "downloads")
    assert "4 images" in status and "4× cpu" in status, status
    return images


@pytest.mark.server
@pytest.mark.hosts
def test_two_hosts_serve_one_demo_and_stop_when_a_follower_dies(tmp_path, cache_dir, one_process):
    coordinator = f"localhost:{free_port()}"
    args = ["--model", "tiny", "--cache-dir", str(cache_dir), "--max-images-per-core", "2"]
    with _follower(tmp_path, coordinator, *args) as (follower, follower_log):
        leader_log = tmp_path / "server.log"
        with running_app([*args, *_hosts_args(coordinator, 0)], leader_log, _env(tmp_path, 2),
                         STARTUP_TIMEOUT) as (leader, url):
            try:
                images, status = _images(url, tmp_path / "downloads")
                assert "4 images" in status and "4× cpu" in status, status  # one image per core of both hosts
                # Within one uint8 level: the float32 images agree to about 1e-5 (test_pipeline's two hosts).
                np.testing.assert_allclose(images.astype(int), one_process.astype(int), atol=1)

                # Two users at once: both answered, each with its own seed's images (merged or not).
                with ThreadPoolExecutor(2) as pool:
                    calls = [pool.submit(_images, url, tmp_path / f"user-{seed}", seed=seed) for seed in (7, 8)]
                    (again, _), (other, _) = [call.result() for call in calls]
                np.testing.assert_allclose(again.astype(int), one_process.astype(int), atol=1)
                assert not np.array_equal(other, again)

                follower.send_signal(signal.SIGKILL)
                follower.wait()
                killed = time.monotonic()
                with contextlib.suppress(Exception):  # fails, or is never answered: the server ends
                    _images(url, tmp_path / "after")
                leader.wait(timeout=max(1.0, 120 - (time.monotonic() - killed)))
            except BaseException:
                print(f"----- process 0 -----\n{leader_log.read_text()[-6000:]}")
                print(f"----- process 1 -----\n{follower_log.read_text()[-6000:]}")
                raise
            assert time.monotonic() - killed < 120
            assert leader.returncode not in (0, None)
            log = leader_log.read_text()
            assert "error: lost process 1" in log or "another task died" in log, log[-3000:]


@pytest.mark.server
@pytest.mark.hosts
def test_a_follower_started_differently_is_refused(tmp_path):
    coordinator = f"localhost:{free_port()}"
    with _follower(tmp_path, coordinator, "--model", "shapes") as (follower, follower_log):
        leader = subprocess.run(
            [sys.executable, str(APP), "--model", "tiny", *_hosts_args(coordinator, 0), "--port", str(free_port())],
            cwd=APP.parent, env=_env(tmp_path, 2), capture_output=True, text=True, timeout=STARTUP_TIMEOUT,
        )
        follower.wait(timeout=60)
    assert leader.returncode == 2, leader.stderr[-3000:]
    assert "error: process 1 on host" in leader.stderr
    assert "model ['shapes'] where process 0 has ['tiny']" in leader.stderr, leader.stderr[-3000:]
    assert follower.returncode == 2
    assert "model ['shapes'] where process 0 has ['tiny']" in follower_log.read_text()


class _Store:
    """The coordination service's key-value store as `hosts.Channel` uses it; a deleted key takes the
    keys under it along, as the service's does."""

    def __init__(self):
        self.values = {}

    def key_value_set_bytes(self, key, value):
        assert key not in self.values, f"{key} written twice"
        self.values[key] = bytes(value)

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        return self.values[key]

    def key_value_increment(self, key, amount):
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]

    def key_value_delete(self, key):
        for name in [k for k in self.values if k == key or k.startswith(key + "/")]:
            del self.values[name]


def test_a_message_of_many_chunks_reaches_every_follower_whole_and_is_then_deleted():
    """A batch's pictures (image-to-image, ControlNets) are megabytes: more than one value of the store."""
    store = _Store()
    leader, followers = hosts.Channel(store, "render", 2), [hosts.Channel(store, "render", 2) for _ in range(2)]
    pictures = np.random.default_rng(0).integers(0, 256, (4, 1024, 1024, 3), np.uint8)  # 12 MiB
    leader.send({"pictures": pictures})
    leader.send("the next message")
    assert sum(key.startswith("sdxl/render/0") for key in store.values) > pictures.nbytes // hosts.CHUNK
    np.testing.assert_array_equal(followers[0].receive()["pictures"], pictures)
    assert "sdxl/render/0" in store.values  # until the other follower has read it too
    np.testing.assert_array_equal(followers[1].receive()["pictures"], pictures)
    assert not any(key.startswith("sdxl/render/0") for key in store.values)
    assert [follower.receive() for follower in followers] == ["the next message"] * 2


def test_plain_app_py_joins_the_hosts_of_a_tpu_pod_slice_and_runs_alone_elsewhere(monkeypatch):
    """On a Cloud TPU VM, JAX's own cluster detection says how many hosts the slice has."""
    from jax._src import cloud_tpu_init
    from jax._src.clusters import cloud_tpu_cluster

    assert hosts.detected() == hosts.Where()  # this machine: no TPU VM
    monkeypatch.setattr(cloud_tpu_init, "running_in_cloud_tpu_vm", True)
    for cluster, present in ((cloud_tpu_cluster.GkeTpuCluster, False), (cloud_tpu_cluster.GceTpuCluster, True)):
        monkeypatch.setattr(cluster, "is_env_present", classmethod(lambda cls, present=present: present))
    for count, where in ((4, hosts.Where("auto")), (1, hosts.Where())):  # a v5e-16's 4 hosts; a v5e-8
        monkeypatch.setattr(cloud_tpu_cluster.GceTpuCluster, "get_process_count", classmethod(lambda cls, n=count: n))
        assert hosts.detected() == where and where.problem() is None


@pytest.mark.server
@pytest.mark.hosts
def test_hosts_that_do_not_all_join_in_time_stop_with_a_sentence(tmp_path):
    """Process 0 alone, its follower never started: it stops within --join-timeout, status 3, saying so."""
    coordinator = f"localhost:{free_port()}"
    started = time.monotonic()
    alone = subprocess.run(
        [sys.executable, str(APP), "--model", "tiny", *_hosts_args(coordinator, 0), "--join-timeout", "3",
         "--port", str(free_port())],
        cwd=APP.parent, env=_env(tmp_path, 2), capture_output=True, text=True, timeout=STARTUP_TIMEOUT,
    )
    assert alone.returncode == hosts.LOST_STATUS, alone.stderr[-3000:]
    assert f"error: not all 2 processes joined process 0 at {coordinator} within 3 s" in alone.stderr
    assert time.monotonic() - started < 60
