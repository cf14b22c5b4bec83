"""docs/architecture.md's import rules hold: every module's imports, read with ``ast``
(module level, inside functions, under ``TYPE_CHECKING``), go only down the layers the doc's
"Import rules" table names, and no modules import each other in a circle."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
RUNTIME = ("errors.py", "serve_app.py", "policies", "kernels", "store", "models", "placement")
RUNTIME += ("sim", "actors")
WHOLE_REPO = (*RUNTIME, "bench", "tests")
SCRIPT_DIRS = ("tests.",)  # run with their own folder on sys.path

# -- reading the rules ---------------------------------------------------------------------


def _tables(text: str) -> list[list[list[str]]]:
    """The markdown tables of the "Import rules" section: rows of cells, header and
    separator rows dropped."""
    section = text.split("## Import rules", 1)[1].split("\n## ", 1)[0]
    tables: list[list[list[str]]] = []
    current: list[list[str]] | None = None
    for line in section.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if current is None:  # the header row
            current = []
            tables.append(current)
        elif not set("".join(cells)) <= set("-: "):
            current.append(cells)
    return tables


def _names(cell: str) -> list[str]:
    return re.findall(r"`([A-Za-z_][\w.]*)`", cell)


def read_rules(text: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(layer -> the layers it may import, transitively closed; module -> what it may also
    import), from the doc's two tables."""
    layers_table, exceptions_table = _tables(text)[:2]
    direct = {_names(row[0])[0]: set(_names(row[1])) for row in layers_table}
    for layer, below in direct.items():
        unknown = below - set(direct)
        assert not unknown, f"{layer} may import unknown layers {unknown}"
    closed: dict[str, set[str]] = {}
    for layer in direct:
        seen, todo = set(), list(direct[layer])
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(direct[n])
        closed[layer] = seen
        assert layer not in seen, f"layer {layer} may import itself through {seen}"
    extra = {_names(row[0])[0]: set(_names(row[1])) for row in exceptions_table}
    return closed, extra


# -- reading the imports -------------------------------------------------------------------


def module_files(roots: Iterable[str], base: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> its file, for every ``.py`` under ``roots``."""
    out: dict[str, Path] = {}
    for root in roots:
        path = base / root
        files = [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
        for f in files:
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` starts with (``a.b.C`` -> ``a.b``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported module of ``modules``: first line}."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                # a test imports its neighbours by bare name (its folder is on sys.path):
                # ``from conftest import x`` in tests/unit is tests.unit.conftest
                r = _resolve(t, modules)
                neighbour = f"{package}.{t.split('.')[0]}"
                if r is None and module.startswith(SCRIPT_DIRS) and neighbour in modules:
                    r = _resolve(f"{package}.{t}", modules)
                if r is not None and r != module:
                    found.setdefault(r, node.lineno)
        graph[module] = found
    return graph


# -- the checks ----------------------------------------------------------------------------


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _layer(module: str, layers: Iterable[str]) -> str | None:
    """The row ``module`` belongs to: the longest layer name it is under."""
    best = None
    for layer in layers:
        if _under(module, layer) and len(layer) > len(best or ""):
            best = layer
    return best


def upward_imports(
    graph: dict[str, dict[str, int]], rules: dict[str, set[str]], extra: dict[str, set[str]]
) -> dict[tuple[str, str], str]:
    """(importer, imported) -> why it breaks the rules, for every import that does."""
    out: dict[tuple[str, str], str] = {}
    for module, targets in graph.items():
        own = _layer(module, rules)
        if own is None:
            continue
        allowed = rules[own] | {own}
        for n in extra.get(module, ()):
            allowed |= {n} | rules.get(n, set())
        for target, line in targets.items():
            theirs = _layer(target, rules)
            if theirs is not None and theirs not in allowed:
                out[(module, target)] = (
                    f"{module} (line {line}, layer {own}) imports {target} (layer {theirs})"
                )
    return out


def cycles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """Every set of two or more modules that import each other (strongly connected)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(component: frozenset[str], graph: dict[str, dict[str, int]]) -> str:
    edges = [
        f"{a} -> {b} (line {graph[a][b]})"
        for a in sorted(component)
        for b in sorted(graph[a])
        if b in component
    ]
    return "; ".join(edges)


RULES, EXTRA = read_rules(DOC.read_text())
GRAPH = imports(module_files(WHOLE_REPO))


def test_every_runtime_module_has_a_layer():
    missing = [m for m in module_files(RUNTIME) if _layer(m, RULES) is None]
    assert not missing, f"modules no row of docs/architecture.md's import rules covers: {missing}"


def test_no_import_goes_up_a_layer():
    broken = upward_imports(GRAPH, RULES, EXTRA)
    assert not broken, "imports against docs/architecture.md's import rules:\n" + "\n".join(
        why for _, why in sorted(broken.items())
    )


def test_no_import_cycles():
    found = cycles(GRAPH)
    assert not found, "modules that import each other:\n" + "\n".join(
        _describe(c, GRAPH) for c in found
    )


def bare_neighbour_imports(package: str, modules: dict[str, Path]) -> list[str]:
    """Imports in ``package`` of a sibling module by its bare name (``from serve_http import
    x`` in bench/), which work only while the script's folder is on sys.path."""
    siblings = {m.rpartition(".")[2] for m in modules if m.startswith(package + ".")}
    out = []
    for module, path in modules.items():
        if not module.startswith(package + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] in siblings:
                    out.append(f"{module} (line {node.lineno}) imports {name}")
    return out


def test_benches_import_each_other_as_the_bench_package():
    """Every bench runs as ``python bench/NAME.py`` and is importable as ``bench.NAME``: it
    names what it shares with other benches ``bench.<module>``, never by bare name."""
    found = bare_neighbour_imports("bench", module_files(["bench"]))
    assert not found, "use `from bench.<module> import ...`:\n" + "\n".join(found)


def test_the_checks_catch_an_upward_import_and_a_cycle(tmp_path):
    (tmp_path / "low").mkdir()
    (tmp_path / "high").mkdir()
    (tmp_path / "low" / "__init__.py").write_text("")
    (tmp_path / "high" / "__init__.py").write_text("")
    (tmp_path / "low" / "a.py").write_text("def f():\n    from high.b import g\n")
    (tmp_path / "high" / "b.py").write_text("import low.a\n")
    (tmp_path / "high" / "c.py").write_text("from . import b\n")
    doc = "## Import rules\n\n| layer | may import |\n|---|---|\n| `low` | nothing |\n"
    doc += "| `high` | `low` |\n\n| module | may also import |\n|---|---|\n"
    rules, extra = read_rules(doc)
    assert rules == {"low": set(), "high": {"low"}}
    graph = imports(module_files(["low", "high"], tmp_path))
    assert graph["high.c"] == {"high.b": 1}
    assert set(upward_imports(graph, rules, extra)) == {("low.a", "high.b")}
    assert cycles(graph) == [frozenset({"low.a", "high.b"})]
    (tmp_path / "high" / "d.py").write_text("def f():\n    from c import x\n")
    found = bare_neighbour_imports("high", module_files(["high"], tmp_path))
    assert found == ["high.d (line 2) imports c"]
