"""`python -m sdxl bench --soak-clients`: the demo under a small load, with a client killed mid-request."""

from sdxl.bench.soak import SOAK_MARKDOWN_HEADER


def test_a_small_soak_serves_every_surviving_request_and_reports_it(bench):
    """About 30 s on one core; 70 s the first time, when the demo fills its compilation cache."""
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
