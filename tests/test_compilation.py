"""The persistent compilation cache (`sdxl/engine/compilation.py`), across restarts: an entry cut short
is replaced by the fresh compile, and every process of a multi-host run finds its own entries; and turned off
again."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import cached_run

RUN = Path(cached_run.__file__)
ENV = {**os.environ, "PYTHONPATH": str(RUN.parents[1])}


def _start(cache_dir: Path) -> dict:
    """One process's start of `cached_run`: its JSON line."""
    done = subprocess.run([sys.executable, str(RUN), str(cache_dir)], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _start_hosts(cache_dirs: list[Path]) -> list[dict]:
    """One start of `cached_run` as a process per cache dir, joined: each process's JSON line."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    processes = [subprocess.Popen([sys.executable, str(RUN), str(cache_dir), str(i), str(len(cache_dirs)), str(port)],
                                  env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i, cache_dir in enumerate(cache_dirs)]
    try:
        outputs = [process.communicate(timeout=300) for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr[-3000:]
    return [json.loads(stdout.splitlines()[-1]) for stdout, _ in outputs]


def test_the_cache_turned_off_again_neither_reads_nor_writes(tmp_path):
    """`disable_compilation_cache` undoes `enable_compilation_cache`: a program compiled after it is a compile
    of its own, and leaves no entry (conftest turns the cache off so after each test that launches a demo here)."""
    import jax

    from sdxl.engine.compilation import CompileCounter, disable_compilation_cache, enable_compilation_cache

    enable_compilation_cache(tmp_path / "on")
    jax.jit(lambda x: x * 5 + 1)(1.0)
    assert list((tmp_path / "on").iterdir()), "on: an entry per compile"
    disable_compilation_cache()
    entries = sorted((tmp_path / "on").iterdir())
    with CompileCounter() as compiles:
        jax.jit(lambda x: x * 7 + 3)(1.0)
    assert (compiles.count, compiles.cached) == (1, 0) and jax.config.jax_compilation_cache_dir is None
    assert sorted((tmp_path / "on").iterdir()) == entries
    disable_compilation_cache()  # already off: nothing to do


@pytest.mark.cli
def test_an_entry_cut_short_is_replaced_by_the_fresh_compile(tmp_path):
    """As a crash or a full disk leaves it: the start after warns once per entry and compiles; the
    next one reads the cache, silently."""
    cold = _start(tmp_path)
    entries = {path: path.stat().st_size for path in tmp_path.glob("*-cache")}
    assert cold["requests"] == len(entries) > 0 and cold["hits"] == 0
    for path, size in entries.items():
        os.truncate(path, size // 2)

    after_the_crash = _start(tmp_path)
    assert after_the_crash["hits"] == 0
    assert len(after_the_crash["warnings"]) == len(entries)
    assert all("Error reading persistent compilation cache entry" in w for w in after_the_crash["warnings"])

    warm = _start(tmp_path)
    assert warm["hits"] == warm["requests"] == len(entries) and warm["warnings"] == []
    assert warm["total"] == cold["total"]


@pytest.mark.slow
def test_every_host_reads_its_own_disk_on_a_restart(tmp_path):
    """Two processes, each with a cache dir of its own (hosts have a disk each): the restart compiles
    nothing on either; and with one host's entries gone, that host compiles while the other reads its
    cache, without waiting on each other."""
    disks = [tmp_path / "host-0", tmp_path / "host-1"]
    cold = _start_hosts(disks)
    assert [start["hits"] for start in cold] == [0, 0] and all(start["requests"] for start in cold)

    warm = _start_hosts(disks)
    assert [start["hits"] for start in warm] == [start["requests"] for start in cold], warm
    assert warm[0]["total"] == warm[1]["total"] == cold[0]["total"]

    for path in disks[1].glob("*-cache"):
        path.unlink()
    one_cold = _start_hosts(disks)
    assert one_cold[0]["hits"] == one_cold[0]["requests"] and one_cold[1]["hits"] == 0
    assert one_cold[1]["total"] == cold[0]["total"]
