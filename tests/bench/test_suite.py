"""The benchmark suite's contract: one entry point, no sys.path edits, JSON results that follow
bench/results/schema.json, and a docs page that is a fresh rendering of them."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench", "results")
SCHEMA = os.path.join(RESULTS, "schema.json")
_TYPES = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float),
          "boolean": bool, "null": type(None)}


def _is(value, kind):
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[kind])


def validate(value, schema, where="$"):
    """The errors of ``value`` against the subset of JSON Schema that schema.json uses."""
    errors = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, k) for k in kinds):
            return [f"{where}: {type(value).__name__} is not {kinds}"]
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: {value!r} != {schema['const']!r}")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        errors.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if "minimum" in schema and _is(value, "number") and value < schema["minimum"]:
        errors.append(f"{where}: {value} < {schema['minimum']}")
    if isinstance(value, dict):
        errors += [f"{where}: missing {key!r}" for key in schema.get("required", []) if key not in value]
        props, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                errors += validate(item, props[key], f"{where}.{key}")
            elif extra is False:
                errors.append(f"{where}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                errors += validate(item, extra, f"{where}.{key}")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{where}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{where}: more than {schema['maxItems']} items")
        for i, item in enumerate(value):
            errors += validate(item, schema.get("items", {}), f"{where}[{i}]")
    return errors


def _schema():
    with open(SCHEMA, encoding="utf-8") as fh:
        return json.load(fh)


def _result_files():
    return sorted(p for p in glob.glob(os.path.join(RESULTS, "*.json")) if p != SCHEMA)


def test_the_validator_catches_what_the_schema_forbids():
    schema = _schema()
    with open(_result_files()[0], encoding="utf-8") as fh:
        good = json.load(fh)
    assert validate(good, schema) == []
    assert any("missing 'commit'" in e for e in validate({k: v for k, v in good.items() if k != "commit"}, schema))
    assert any("unexpected key" in e for e in validate(dict(good, stray=1), schema))
    assert validate(dict(good, threads="two"), schema)
    assert validate(dict(good, results=[1, 2]), schema)
    assert validate(dict(good, benchmark="Not A Name"), schema)


@pytest.mark.parametrize("path", _result_files(), ids=os.path.basename)
def test_every_result_follows_the_schema_and_is_named_by_benchmark_date_commit(path):
    with open(path, encoding="utf-8") as fh:
        rec = json.load(fh)
    assert validate(rec, _schema()) == []
    assert os.path.basename(path) == f"{rec['benchmark']}-{rec['date'][:10]}-{rec['commit']}.json"
    assert rec["results"] or rec.get("text"), "a result file without figures"


def test_results_hold_only_json_records_and_the_schema():
    names = os.listdir(RESULTS)
    assert names and all(n.endswith(".json") for n in names), [n for n in names if not n.endswith(".json")]


def test_the_record_of_a_run_follows_the_schema(tmp_path):
    from bench import _record

    rec = _record.record("distance", [{"method": "x", "ratio": 1.5, "t": float("nan"), (1, 2): (3, 4)}],
                         command=["--quick"], load_before=_record.load_average(), wall_s=1.0)
    assert validate(rec, _schema()) == []
    assert rec["command"] == ["python", "-m", "bench", "distance", "--quick"]
    assert rec["results"][0]["t"] is None and rec["results"][0]["(1, 2)"] == [3, 4]
    path = _record.write(rec, str(tmp_path / "out.json"))
    with open(path, encoding="utf-8") as fh:
        assert json.load(fh) == rec
    assert _record.default_path(rec).endswith(f"distance-{rec['date'][:10]}-{rec['commit']}.json")


def test_the_docs_page_is_a_fresh_rendering_of_the_results():
    from bench import _render

    with open(_render.PAGE, encoding="utf-8") as fh:
        page = fh.read()
    assert page == _render.render(), "docs/benchmarks.md is stale: run `python -m bench render-docs`"
    for path in _result_files():
        with open(path, encoding="utf-8") as fh:
            assert f"## {json.load(fh)['benchmark']}" in page


def test_list_names_every_benchmark_module_and_no_private_one():
    out = subprocess.run([sys.executable, "-m", "bench", "--list"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    modules = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "bench", "*.py"))}
    public = {m for m in modules if not m.startswith("_")}
    assert public and public | {"render-docs"} == listed
    assert all(line.split(None, 1)[1:] for line in out.stdout.splitlines() if line.strip())  # a description each


def test_a_run_through_the_entry_point_writes_its_record(tmp_path):
    out_path = tmp_path / "bad_inputs.json"
    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "bench", "--output", str(out_path), "bad_inputs"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with open(out_path, encoding="utf-8") as fh:
        rec = json.load(fh)
    assert validate(rec, _schema()) == []
    assert rec["benchmark"] == "bad_inputs" and rec["results"]
    assert all(row["verdict"] == "clear" for row in rec["results"])
    unknown = subprocess.run([sys.executable, "-m", "bench", "no_such_bench"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    assert unknown.returncode != 0 and "--list" in unknown.stderr


def test_no_sys_path_edits_in_bench_or_in_tests_that_use_it():
    offenders = []
    for path in glob.glob(os.path.join(ROOT, "bench", "*.py")):
        with open(path, encoding="utf-8") as fh:
            if "sys.path" in fh.read():
                offenders.append(os.path.relpath(path, ROOT))
    for path in glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True):
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        if re.search(r"sys\.path\.(insert|append)", text) and re.search(r"""["']bench["']""", text):
            offenders.append(os.path.relpath(path, ROOT))
    assert offenders == []
