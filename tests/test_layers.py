"""The package's layers (pyproject.toml's import-linter contracts): each folder imports only those below it,
and the runtime imports neither PyTorch nor Gradio."""

from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_each_layer_imports_only_those_below_it(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    status = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert status == 0, capsys.readouterr().out
