"""The package's layers (pyproject.toml's import-linter contracts): each folder imports only those below it,
and the runtime imports neither PyTorch nor Gradio."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_each_layer_imports_only_those_below_it():
    lint = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    done = subprocess.run([sys.executable, "-c", lint, "--no-cache", "--config", "pyproject.toml"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
