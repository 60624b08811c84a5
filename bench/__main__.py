"""``python -m bench``: list the benchmarks, run one and record its JSON result, or render the docs page.

    python -m bench --list
    python -m bench distance --quick              # writes bench/results/distance-<date>-<commit>.json
    python -m bench --output out.json startup     # the record goes to out.json
    python -m bench --no-json kernel_check        # print only
    python -m bench render-docs                   # docs/benchmarks.md from bench/results/*.json
"""
from __future__ import annotations

import argparse
import ast
import importlib
import io
import os
import pkgutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
COMMANDS = {"render-docs": "Render docs/benchmarks.md from the JSON results in bench/results (--check: compare only)."}


def benchmarks() -> dict:
    """Every benchmark module of the package and the first line of its docstring (read, not imported)."""
    found = {}
    for info in sorted(pkgutil.iter_modules([HERE]), key=lambda m: m.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        with open(os.path.join(HERE, info.name + ".py"), encoding="utf-8") as fh:
            doc = ast.get_docstring(ast.parse(fh.read())) or ""
        line = " ".join(doc.strip().split("\n\n")[0].split())
        line = line.split(". ")[0].rstrip(".:")
        found[info.name] = line if line.endswith(("?", "!")) else line + "."

    return found


class _Tee(io.TextIOBase):
    """Writes to the real stream and keeps a copy (the report of a benchmark that returns no rows)."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text):
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()

    def isatty(self):
        return self.stream.isatty()

    def fileno(self):
        return self.stream.fileno()


def run(name: str, argv: list[str], output: str | None = None, record: bool = True) -> int:
    """Run benchmark ``name`` with ``argv``; unless ``record`` is false, write its JSON record."""
    from bench import _record

    listed = benchmarks()
    if name not in listed:
        raise SystemExit(f"unknown benchmark {name!r}; `python -m bench --list` names them")
    module = importlib.import_module(f"bench.{name}")
    load_before, start = _record.load_average(), time.perf_counter()
    tee, saved_argv = _Tee(sys.stdout), sys.argv
    sys.stdout, sys.argv = tee, [f"python -m bench {name}", *argv]  # argparse names the program after argv[0]
    try:
        value = module.main(argv)
    finally:
        sys.stdout, sys.argv = tee.stream, saved_argv
    wall, load_after = time.perf_counter() - start, _record.load_average()
    status = value if isinstance(value, int) and not isinstance(value, bool) else 0
    settings = summary = None
    if isinstance(value, dict) and isinstance(value.get("rows"), list) and all(isinstance(r, dict) for r in value["rows"]):
        # a report with its rows: the rows become the record's results, the rest its settings
        rows, summary = value["rows"], value.get("summary")
        settings = {key: item for key, item in value.items() if key not in ("rows", "summary", "settings")}
        settings.update(value.get("settings") if isinstance(value.get("settings"), dict) else {})
    elif isinstance(value, dict):
        rows = [value]
    elif isinstance(value, (list, tuple)) and all(isinstance(r, dict) for r in value):
        rows = list(value)
    else:
        rows = []
    if record:
        rec = _record.record(name, rows, command=argv, description=listed[name], load_before=load_before,
                             load_after=load_after, wall_s=wall, exit_status=status,
                             text=None if rows else tee.copy.getvalue(), settings=settings, summary=summary)
        print(f"result: {os.path.relpath(_record.write(rec, output))}")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Options after NAME go to the benchmark (python -m bench NAME --help).")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--output", metavar="PATH", help="write the JSON record here "
                        "(default: bench/results/<benchmark>-<date>-<commit>.json)")
    parser.add_argument("--no-json", action="store_true", help="print only; write no JSON record")
    parser.add_argument("name", nargs="?", help="benchmark (see --list) or render-docs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    a = parser.parse_args(argv)
    if a.list or a.name is None:
        listed = benchmarks()
        width = max(map(len, list(listed) + list(COMMANDS)))
        for name, doc in listed.items():
            print(f"{name:<{width}}  {doc}")
        for name, doc in COMMANDS.items():
            print(f"{name:<{width}}  {doc}")
        return 0 if a.list else 2
    if a.name == "render-docs":
        from bench import _render

        return _render.main(a.args)
    return run(a.name, a.args, output=a.output, record=not a.no_json)


if __name__ == "__main__":
    sys.exit(main())
