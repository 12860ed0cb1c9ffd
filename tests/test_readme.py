"""The README's Python examples name what the package has: each of their imports runs."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
IMPORTS = [line.strip() for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
           for line in block.splitlines() if re.match(r"\s*from sdxl[\w.]* import ", line)]


def test_the_readme_has_library_examples():
    assert len(IMPORTS) >= 3, IMPORTS


@pytest.mark.parametrize("statement", IMPORTS)
def test_each_import_of_the_readme_runs(statement):
    exec(statement, {})
