"""`python -m sdxl bench --soak-clients`: the demo under a small load, with a client killed mid-request;
with `--soak-hosts`, as one process and as two."""

import numpy as np
import pytest

from sdxl.bench.hosts import HOSTS_MARKDOWN_HEADER
from sdxl.bench.soak import SOAK_MARKDOWN_HEADER

pytestmark = [pytest.mark.server, pytest.mark.cli]  # `python -m sdxl bench` starts the demos


def test_a_small_soak_serves_every_surviving_request_and_reports_it(bench, monkeypatch):
    """About 30 s on one core; 70 s the first time, when the demo fills its compilation cache. One batch
    size, as the two-host soak below (SDXL_MAX_IMAGES_PER_CORE=1): each request is one image per device, so
    the demo's background compiles of larger batches were never run."""
    monkeypatch.setenv("SDXL_MAX_IMAGES_PER_CORE", "1")
    args = "--model tiny --steps 3 --soak-clients 3 --soak-requests 2 --soak-killed 1".split()
    r, stdout, markdown = bench(*args, timeout=300)
    assert (r["clients"], r["requests_per_client"], r["killed_clients"], r["requests"]) == (3, 2, 1, 6)
    assert (r["completed"], r["errors"], r["lost"], r["wrong_images"]) == (6, 0, 0, 0), r["error_messages"]
    assert r["images"] == 6 * 4  # one image per device, 4 forced devices (conftest's XLA_FLAGS, inherited)
    assert r["killed_states"][0] in ("PROCESSING", "ITERATING", "PROGRESS")  # killed while the demo served it
    assert r["killed_given_up"] == 1  # its 100 steps were not all rendered for nobody
    latencies = [r[f"latency_{name}_s"] for name in ("p50", "p90", "p99", "max")]
    assert 0 < latencies[0] <= latencies[1] <= latencies[2] <= latencies[3] < r["wall_s"]
    assert r["rss_before_bytes"] > 0 and r["rss_peak_bytes"] >= r["rss_after_bytes"] > 0
    assert r["server_cpu_s"] > 0 and r["clients_cpu_s"] > 0
    assert r["server_tracebacks"] == 0 and "on 4× cpu" in r["demo"]
    assert "latency p50 / p90 / p99 / max" in stdout
    header, _, row = markdown.read_text().splitlines()[-3:]
    assert markdown.read_text().startswith(SOAK_MARKDOWN_HEADER) and row.count("|") == header.count("|")


@pytest.mark.hosts
def test_a_soak_over_two_hosts_compares_them_with_one_and_reports_the_broadcasts(bench, monkeypatch):
    """The same load against 1 process x 4 CPU devices, then 2 processes x 2 (`sdxl.bench.hosts`).
    110 to 130 s on the 2-core VM at load average 4 to 5, most of it the two demos' starts and background
    compiles (one batch size each: SDXL_MAX_IMAGES_PER_CORE=1); the follower finds none of its
    programs in the persistent compilation cache."""
    monkeypatch.setenv("SDXL_MAX_IMAGES_PER_CORE", "1")
    args = "--model tiny --steps 2 --soak-clients 2 --soak-requests 1 --soak-killed 0 --soak-hosts 2".split()
    r, stdout, markdown = bench(*args, timeout=400)
    required = """images_per_s_ratio latency_p50_s_ratio latency_p90_s_ratio latency_p99_s_ratio latency_max_s_ratio
        broadcast_batches broadcast_steps broadcast_compiles broadcast_bytes broadcast_s broadcast_bytes_per_request
        broadcast_s_per_request broadcast_share_of_wall broadcast_render_bytes broadcast_render_seconds
        broadcast_step_bytes broadcast_step_seconds follower_steps follower_lag_per_step_s follower_wait_per_step_s
        load_average""".split()
    assert not [key for key in required if key not in r]
    assert (r["processes"], r["devices"], r["one"]["processes"], r["hosts"]["processes"]) == (2, 4, 1, 2)
    for run in (r["one"], r["hosts"]):
        assert (run["completed"], run["errors"], run["lost"], run["wrong_images"]) == (2, 0, 0, 0), run
        assert run["images"] == 2 * 4 and run["server_tracebacks"] == 0  # one image per device of either
    assert "on 4× cpu" in r["hosts"]["demo"] and r["demo"] == r["hosts"]["demo"]
    for key in ("images_per_s", "latency_p50_s", "latency_p90_s", "latency_p99_s", "latency_max_s"):
        assert np.isclose(r[f"{key}_ratio"], r["hosts"][key] / r["one"][key])
    # Each of the load's batches sent its request, then one decision per step; the follower read them all.
    batches, steps = r["broadcast_batches"], r["broadcast_steps"]
    assert 1 <= batches <= 2 and steps == 2 * batches and r["follower_steps"] == steps
    assert r["broadcast_render_bytes"] > r["broadcast_step_bytes"] > 0  # a request, against a step, a flag, a time
    assert r["broadcast_render_seconds"] > 0 and r["broadcast_step_seconds"] > 0 and r["broadcast_compiles"] == 0
    assert np.isclose(r["broadcast_bytes"], batches * r["broadcast_render_bytes"] + steps * r["broadcast_step_bytes"])
    assert np.isclose(r["broadcast_bytes_per_request"], r["broadcast_bytes"] / 2)
    assert 0 < r["broadcast_s_per_request"] and 0 < r["broadcast_share_of_wall"] < 1
    assert 0 < r["follower_lag_per_step_s"] < r["hosts"]["latency_max_s"] and r["follower_wait_per_step_s"] >= 0
    assert "2 processes x 2 devices" in stdout and "follower lag per step" in stdout
    header, _, row = markdown.read_text().splitlines()[-3:]
    assert markdown.read_text().startswith(HOSTS_MARKDOWN_HEADER) and row.count("|") == header.count("|")
