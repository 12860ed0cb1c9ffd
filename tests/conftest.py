"""Test-wide setup: 4 forced CPU devices, so sharding is exercised on every machine; one persistent
compilation cache for the session; the slow kinds of test, which `-m "not slow"` leaves out."""

import json
import os
import subprocess
import sys
from pathlib import Path

# Must happen before jax is imported anywhere: the device count is fixed when the backend starts.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(os.cpu_count() or 1)

# The kinds of slow test (pyproject.toml describes each); any of them is also `slow`.
SLOW_KINDS = ("server", "browser", "hosts", "tpu", "oracle", "compiles", "cli")


def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def xla_cache(tmp_path_factory) -> Path:
    """One persistent compilation cache for the processes the tests start (demos read SDXL_CACHE_DIR; the
    CLI's tests pass it as --cache-dir), so a program compiles once whichever of them needs it first. A
    fresh folder each session, unless SDXL_TEST_CACHE_DIR names one to keep between runs. This process
    keeps JAX's default (no persistent cache): its tests count compilations, and a hit is no compile.
    Under pytest-xdist the workers share one folder (beside their own temporary ones)."""
    shared = os.environ.get("PYTEST_XDIST_WORKER") and tmp_path_factory.getbasetemp().parent / "xla-cache"
    path = Path(os.environ.get("SDXL_TEST_CACHE_DIR") or shared or tmp_path_factory.mktemp("xla-cache"))
    path.mkdir(parents=True, exist_ok=True)
    os.environ["SDXL_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(autouse=True)
def _no_persistent_cache_in_this_process():
    """A test that launches the demo in this process (`launch.load_models`) turns JAX's persistent cache on
    here; it is turned off after it, so later tests compile as the docstring of `xla_cache` says (a write per
    compile costs, and a hit would not count as a compile)."""
    yield
    from sdxl.engine.compilation import disable_compilation_cache

    disable_compilation_cache()


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def bench(tmp_path):
    """`bench(*ARGS)` runs `python -m sdxl bench ARGS` in a subprocess, its JSON and Markdown going to
    tmp_path (the Markdown file may hold earlier tables); returns (the JSON report, stdout, the
    Markdown file's path)."""
    def run(*args: str, timeout: int = 600) -> tuple[dict, str, Path]:
        out, markdown = tmp_path / "bench.json", tmp_path / "BENCHMARKS.md"
        result = subprocess.run(
            [sys.executable, "-m", "sdxl", "bench", *args, "--json", str(out), "--markdown", str(markdown)],
            capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        )
        assert result.returncode == 0, result.stderr
        return json.loads(out.read_text()), result.stdout, markdown

    return run
