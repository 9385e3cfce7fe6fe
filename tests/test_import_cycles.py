"""No module of ``tandem`` imports one that imports it back, directly or around a longer
loop, counting imports inside functions too (a lazy import still ties the two modules
together); imports under ``if TYPE_CHECKING:`` do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import tandem

PACKAGE = Path(tandem.__file__).parent


def _module_names() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _imports(tree: ast.Module):
    type_only = {id(n) for node in ast.walk(tree)
                 if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in type_only]


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``tandem`` modules it imports (``from pkg import name`` counts as the
    submodule ``pkg.name`` when there is one, else as ``pkg``)."""
    mods = _module_names()
    graph = {}
    for name, (path, is_pkg) in mods.items():
        deps = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
                continue
            base = node.module or ""
            if node.level:
                parent = name.split(".") if is_pkg else name.split(".")[:-1]
                base = ".".join(parent[:len(parent) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                deps |= {f"{base}.{a.name}"} if f"{base}.{a.name}" in mods else ({base} if base in mods else set())
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
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


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert "tandem.engine.arg_utils" in graph["tandem.entrypoints.cli"]  # the graph sees imports
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
