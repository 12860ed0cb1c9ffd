"""The persistent compilation cache (`sdxl/engine/compilation.py`), across restarts: an entry cut short
is replaced by the fresh compile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import cached_run

RUN = Path(cached_run.__file__)
ENV = {**os.environ, "PYTHONPATH": str(RUN.parents[1])}


def _start(cache_dir: Path) -> dict:
    """One process's start of `cached_run`: its JSON line."""
    done = subprocess.run([sys.executable, str(RUN), str(cache_dir)], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


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

