"""README.md and docs/ as tested text: every relative link resolves, every `python` or `bash` block is
either run by a test named in the comment just before it or marked `<!-- not run: REASON -->`, and the
blocks marked for this module run: the library quick start (the model and sizes made tiny), the CLI
examples, and the README's gradio_client example against the offline demo (docs/tests.md, "Tested
docs")."""

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from PIL import Image

from sdxl.bench.soak import running_app

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STARTUP_TIMEOUT = 300  # seconds: load + compile + warm-up on a slow 2-core machine

# A fenced block at the start of a line, with the line before it (where its marker comment goes).
BLOCK = re.compile(r"^(?P<before>[^\n]*)\n```(?P<lang>[\w-]*)\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MARK = re.compile(r"<!--\s*(?P<text>.*?)\s*-->")
RUN_BY = re.compile(r"(?P<file>tests/test_\w+\.py)(?:::(?P<test>test_\w+))?")
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def _blocks(page: Path) -> list[dict]:
    return [dict(found.groupdict(), page=page.relative_to(ROOT)) for found in BLOCK.finditer(page.read_text())]


BLOCKS = [block for page in PAGES for block in _blocks(page)]


def _mark(block: dict) -> str:
    found = MARK.fullmatch(block["before"].strip())
    return found["text"] if found else ""


def _run_by(name: str) -> list[str]:
    """The bodies of the blocks whose marker names this module's test `name`, in reading order (the README,
    then docs/ by file name)."""
    bodies = [block["body"] for block in BLOCKS if f"tests/test_docs.py::{name}" in _mark(block)]
    assert bodies, f"no block is marked as run by {name}"
    return bodies


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but `-` and `_`), spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.MULTILINE):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_the_docs_have_pages_and_blocks():
    assert len(PAGES) >= 10 and len(BLOCKS) >= 15, (PAGES, len(BLOCKS))
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_point_to_files_and_headings_that_exist(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)  # links written as code are examples, not links
    broken = []
    for target in (found["target"] for found in LINK.finditer(text)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not this repository's
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and (file.suffix != ".md" or anchor not in _anchors(file)):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, broken


def test_every_python_and_bash_block_is_run_by_a_test_or_marked_not_run():
    unmarked, unknown = [], []
    for block in (b for b in BLOCKS if b["lang"] in ("python", "bash")):
        where = f"{block['page']}: {block['body'].splitlines()[0]}"
        mark = _mark(block)
        if re.match(r"not run: \S", mark):
            continue
        run_by = RUN_BY.search(mark)
        if not run_by:
            unmarked.append(where)
        elif not (ROOT / run_by["file"]).exists() or (
                run_by["test"] and f"def {run_by['test']}(" not in (ROOT / run_by["file"]).read_text()):
            unknown.append(f"{where}: {mark}")
    assert not unmarked, f"mark these blocks <!-- run: tests/test_X.py::test_Y --> or <!-- not run: why -->: {unmarked}"
    assert not unknown, f"these blocks name a test that does not exist: {unknown}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b["lang"] == "python"],
                         ids=lambda b: f"{b['page']}:{b['body'].splitlines()[0][:40]}")
def test_each_python_block_parses(block):
    ast.parse(block["body"])


IMPORTS = sorted({line.strip() for block in BLOCKS if block["lang"] == "python"
                  for line in block["body"].splitlines() if re.match(r"\s*from sdxl[\w.]* import ", line)})


@pytest.mark.parametrize("statement", IMPORTS)
def test_each_sdxl_import_of_the_docs_runs(statement):
    exec(statement, {})


def _subprocess_env() -> dict[str, str]:
    """This session's (4 forced CPU devices, offline, the shared compilation cache), the repository importable
    and this interpreter's folder first on PATH, so that `python` is this one."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return {**os.environ, "PYTHONPATH": str(ROOT), "PATH": path}


# The library examples load SDXL from the Hub and render at 1024x1024; here they load the random `tiny`
# model at its size, and keep the session's compilation cache. Each replacement must apply, so an example
# that changes is still run.
TINY = {
    '"stabilityai/stable-diffusion-xl-base-1.0"': '"tiny"',
    '"RunDiffusion/Juggernaut-XL-v9"': '"tiny"',
    'dtype="bfloat16"': 'dtype="float32"',
    "1024": "128",
    "steps=25": "steps=2",
    "enable_compilation_cache()": 'enable_compilation_cache(os.environ["SDXL_CACHE_DIR"])',
}


@pytest.mark.cli
def test_library_examples(tmp_path):
    """The README's library quick start, then docs/library.md's `Request`, in one process (the second uses the
    first's `pipe`)."""
    script = "import os\n" + "\n".join(_run_by("test_library_examples"))
    for written, tiny in TINY.items():
        assert written in script, f"the library examples no longer say {written}: update TINY"
        script = script.replace(written, tiny)
    script += textwrap.dedent("""
        import numpy as np
        assert len(images) == pipe.num_devices == 4 and images[0].size == (128, 128), images
        assert result.images.shape == (2, 128, 128, 3), result.images.shape
        assert len(pictures["tuned"]) == 4 and tuned.params["vae"] is pipe.params["vae"]
        assert all((a == b).all() for a, b in zip(map(np.asarray, again), map(np.asarray, pictures["base"])))
        assert residency.on_devices == [pipe.name] and tuned.model.placement.where == "host memory"
        print("ran")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_subprocess_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("ran"), done.stdout[-3000:] + done.stderr[-5000:]


@pytest.mark.cli
def test_cli_examples(tmp_path):
    """Each CLI block as written, in a fresh folder: it writes its PNGs into out/. The CLI reads no SDXL_*
    variable, so the session's compilation cache is given as --cache-dir (not the user's ~/.cache)."""
    for i, body in enumerate(_run_by("test_cli_examples")):
        assert body.startswith("python -m sdxl generate "), body
        body = body.replace("python -m sdxl generate ", 'python -m sdxl generate --cache-dir "$SDXL_CACHE_DIR" ', 1)
        folder = tmp_path / str(i)
        folder.mkdir()
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=folder, env=_subprocess_env(),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, body + done.stdout[-3000:] + done.stderr[-5000:]
        assert list((folder / "out").glob("*.png")), (body, sorted(p.name for p in folder.rglob("*")))


@pytest.fixture(scope="module")
def offline_demo(tmp_path_factory, xla_cache):
    """`python app.py` as the README's first command starts it, offline and with an empty Hugging Face cache, so
    it serves the built-in shapes model; yields its URL."""
    tmp = tmp_path_factory.mktemp("offline-demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SDXL_", "GRADIO_SERVER_"))} | dict(
        XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp / "hf-home"), HF_HUB_CACHE=str(tmp / "hf-home" / "hub"), GRADIO_TEMP_DIR=str(tmp / "gradio"),
        GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1",
    )
    log = tmp / "server.log"
    try:
        with running_app(["--cache-dir", str(xla_cache)], log, env, STARTUP_TIMEOUT) as (_, url):
            yield url
    finally:
        if log.exists():
            print(f"----- the demo's output -----\n{log.read_text(errors='replace')[-5000:]}")


@pytest.mark.server
def test_client_example(offline_demo, tmp_path, monkeypatch, capsys):
    """The README's gradio_client example as written but for the demo's address, in a folder with a photo.png."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # gradio_client reads it in this process
    (code,) = _run_by("test_client_example")
    assert code.count('"http://127.0.0.1:7860/"') == 1, code
    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (64, 64), (200, 40, 40)).save("photo.png")
    namespace = {}
    exec(code.replace('"http://127.0.0.1:7860/"', repr(offline_demo)), namespace)
    printed = capsys.readouterr().out
    assert re.search(r"^\d+ images? in [\d.]+ s", printed, re.MULTILINE), printed
    assert all(Path(path).is_file() for path in re.findall(r"'([^']+\.(?:png|webp))'", printed)), printed
    assert len(namespace["cells"]) == 8 and "device call" in namespace["status"], namespace["status"]
