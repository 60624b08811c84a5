"""The package's import graph has no circles, and no module below ``training`` imports it.

Every import counts, the ones inside functions too (a "lazy" import still ties the two modules
together). Floors, lowest first: ``poincare_ball`` / ``geometry`` / ``manifold_tensors``, the
components (``distances``, ``heads``, ``losses``, ``miners``, ``evaluation``, ``data``), then
``training`` (``command_line`` < ``runner`` < ``cli``).
"""
import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "pml_hyperbolic"


def _modules():
    mods = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _targets(mods, name, is_pkg, node):
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    if node.level:
        base = (name if is_pkg else name.rsplit(".", 1)[0]).split(".")
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = []
    for alias in node.names:
        if f"{target}.{alias.name}" in mods:
            found.append(f"{target}.{alias.name}")
        elif target in mods:
            found.append(target)
    return found


@functools.lru_cache(maxsize=1)
def import_graph():
    """{module: modules it imports} for every module of the package (parents excluded: Python
    imports a module's parent packages first anyway)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(t for t in _targets(mods, name, is_pkg, node)
                                   if t != name and not name.startswith(t + "."))
    return graph


def circles(graph):
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_checker_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_no_lower_module_imports_training():
    graph = import_graph()
    upward = {m: sorted(t for t in targets if t.startswith(f"{PACKAGE}.training"))
              for m, targets in graph.items() if not m.startswith(f"{PACKAGE}.training") and m != PACKAGE}
    assert {m: t for m, t in upward.items() if t} == {}


def test_runner_never_imports_cli():
    assert f"{PACKAGE}.training.cli" not in import_graph()[f"{PACKAGE}.training.runner"]
