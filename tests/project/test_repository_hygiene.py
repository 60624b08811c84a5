"""The repository reads as a library: no work-log names, and docstrings that state contracts.

Measurements and their history belong in ``docs/design/`` and in the benchmark suite's JSON results;
``pml_hyperbolic/`` states what each component promises.
"""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Built from pieces so that this file does not match its own patterns.
WORK_STEP = re.compile(r"\b" + "st" + r"op(?:[ _-]?|[ \t]*\n[ \t#*>]*)\d+", re.I)  # also across a line break
ISSUE_NUMBER = re.compile(r"\b" + "iss" + r"ues? #?\d+\b", re.I)
# Narrow: never acceptable in the package (a date, a results file, a commit, "measured").
HISTORY_STRICT = re.compile(
    r"\b(19|20)\d\d-\d\d-\d\d\b|bench/" + "results" + r"|\bmeasured\b|\bcommit [0-9a-f]{7}", re.I)
# Wide: what measurement history usually looks like (also matches a few legitimate contract words).
HISTORY_WIDE = re.compile(
    HISTORY_STRICT.pattern + r"|±|\+/-|\b\d+(\.\d+)? ?(ms|µs)\b|\bR@1\b|AUROC [0-9]", re.I)


def _repository_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [line for line in out.splitlines() if (ROOT / line).is_file()]


def _text(path: pathlib.Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def test_no_work_step_names_in_file_names():
    offenders = [f for f in _repository_files() if WORK_STEP.search(f)]
    assert offenders == []


def test_no_work_step_names_or_internal_issue_numbers_in_files():
    offenders = []
    for name in _repository_files():
        text = _text(ROOT / name)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if WORK_STEP.search(line) or ISSUE_NUMBER.search(line):
                offenders.append(f"{name}:{number}: {line.strip()[:100]}")
        for match in WORK_STEP.finditer(text):  # the name wrapped onto the next line
            if "\n" in match.group(0):
                number = text.count("\n", 0, match.start()) + 1
                offenders.append(f"{name}:{number}: {match.group(0)!r}")
    assert offenders == [], "\n".join(offenders[:40])


def _package_docstrings():
    for path in sorted((ROOT / "pml_hyperbolic").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield path.relative_to(ROOT), getattr(node, "name", "<module>"), doc


def test_package_docstrings_carry_no_dates_results_files_or_commits():
    offenders = [f"{path}::{name}: {HISTORY_STRICT.search(doc).group(0)!r}"
                 for path, name, doc in _package_docstrings() if HISTORY_STRICT.search(doc)]
    assert offenders == [], "\n".join(offenders)


def test_package_comments_carry_no_dates_results_files_or_commits():
    offenders = []
    for path in sorted((ROOT / "pml_hyperbolic").rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            comment = line.split("#", 1)[1] if "#" in line else ""
            if comment and HISTORY_STRICT.search(comment):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert offenders == [], "\n".join(offenders)


def test_history_looking_docstring_lines_stay_rare():
    """Docstrings that look like measurement reports (±, timings, R@1 figures), counted in lines."""
    lines = sum(len(doc.splitlines()) for _, _, doc in _package_docstrings() if HISTORY_WIDE.search(doc))
    assert lines < 100, lines
