"""The documentation is runnable: README and docs examples run as written, the site builds strictly.

Every ```python block of a Markdown file runs, in order, in one fresh interpreter per file (so a page's
later blocks may use what its earlier blocks defined, as a reader following the page would). Blocks that
are not meant to run use another fence (```text, ```bash).
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 250
BLOCK_TIMEOUT_S = 300

# A fence opening at the start of a line (possibly indented inside a list), its info string, its body.
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
                   re.M | re.S)


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block of a Markdown file, in order."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        info = match.group("info").strip().split()
        if not info or info[0].lower() not in ("python", "py"):
            continue
        line = text.count("\n", 0, match.start()) + 2  # the block's first code line
        body = textwrap.dedent(match.group("body"))
        blocks.append((line, body))
    return blocks


def markdown_files() -> list[pathlib.Path]:
    files = [ROOT / "README.md"]
    if DOCS.is_dir():
        files += sorted(DOCS.rglob("*.md"))
    return files


def _runner_source(path: pathlib.Path, blocks: list[tuple[int, str]]) -> str:
    # Each block is compiled under its own name (file:line), so a traceback points at the page.
    rel = path.relative_to(ROOT).as_posix()
    parts = ["import sys", "namespace = {'__name__': '__main__'}"]
    for line, code in blocks:
        parts.append(f"print('--- {rel}:{line}', flush=True)")
        parts.append(f"exec(compile({code!r}, {f'{rel}:{line}'!r}, 'exec'), namespace)")
    return "\n".join(parts) + "\n"


FILES_WITH_CODE = [p for p in markdown_files() if python_blocks(p)]


@pytest.mark.parametrize("path", FILES_WITH_CODE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run_as_written(path, tmp_path):
    blocks = python_blocks(path)
    env = dict(os.environ)
    env.setdefault("MPLBACKEND", "Agg")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    script = tmp_path / "blocks.py"
    script.write_text(_runner_source(path, blocks), encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, (
        f"{path.relative_to(ROOT)}: a python block failed\n--- stdout\n{result.stdout[-3000:]}"
        f"\n--- stderr\n{result.stderr[-6000:]}")


def test_block_extraction_finds_fences_and_skips_other_languages(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\nx = 1\n```\n\n```bash\nexit 1\n```\n\n- item\n\n    ```python\n"
                    "    y = x + 1\n    ```\n```text\nnot code\n```\n", encoding="utf-8")
    assert python_blocks(page) == [(3, "x = 1\n"), (13, "y = x + 1\n")]


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    assert python_blocks(ROOT / "README.md"), "README.md should hold one complete runnable example"


@pytest.mark.parametrize("name", ["LICENSE", "CHANGELOG.md", "pml_hyperbolic/py.typed"])
def test_release_files_exist(name):
    assert (ROOT / name).is_file(), f"{name} is missing"


def test_license_is_mit_as_setup_cfg_says():
    assert "MIT License" in (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert re.search(r"^license\s*=\s*MIT\s*$", (ROOT / "setup.cfg").read_text(encoding="utf-8"), re.M)


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    # no -q: mkdocs then drops the warnings that --strict counts
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    warnings = "\n".join(line for line in result.stderr.splitlines() if line.startswith(("WARNING", "ERROR")))
    assert result.returncode == 0, f"mkdocs build --strict failed\n{warnings or result.stderr[-8000:]}"
    assert (tmp_path / "site" / "index.html").is_file()
