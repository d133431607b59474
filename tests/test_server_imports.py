"""How server/ is wired: no part imports the loop (only ``server.app``, which builds it), and no
import circle is left inside server/, counting imports under ``TYPE_CHECKING``.

Read from the source (every import statement, wherever it is), so a circle that only a type
checker follows counts too.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _graph() -> dict[str, set[str]]:
    """server module -> the server modules its import statements name."""
    mods = {}
    for p in (ROOT / "server").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                named = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                continue
            graph[m] |= {n for n in named if n in mods and n != m}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_only_the_builder_imports_the_loop():
    graph = _graph()
    assert "server.loop" in graph
    assert sorted(m for m, named in graph.items() if "server.loop" in named) == ["server.app"]


def test_no_import_circle_is_left_inside_server():
    assert _circles(_graph()) == []
