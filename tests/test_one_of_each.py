"""One of each in the tree (docs/architecture.md): one signal handler, one seed stream, one
device picker, one config loader, and files that do one thing each (500 lines at most, unless
the file says at its top why it is one thing)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fedasync", "runkit", "protocol", "server", "clients", "medical_data", "simulations")
SOURCES = sorted(
    p
    for pkg in (*PACKAGES, "trainers")
    for p in (ROOT / pkg).rglob("*.py")
    if "/gen/" not in str(p)  # generated gRPC code
)


def _calls(path: Path, name: str):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if called == name:
                yield node


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def test_the_tree_sets_signal_handlers_in_one_place():
    allowed = {"fedasync/interrupt.py", "simulations/entry.py"}  # entry: before torch loads
    found = [
        _where(p, n)
        for p in SOURCES
        if str(p.relative_to(ROOT)) not in allowed
        for n in _calls(p, "signal")
        if isinstance(n.func, ast.Attribute) and getattr(n.func.value, "id", "") == "signal"
    ]
    assert found == []


def _has_literal_salt(node: ast.Call) -> bool:
    """A seed built at the call site from a number of its own: ``[seed, 0x3A7E]``,
    ``seed * 1009 + i``."""
    for arg in node.args:
        if isinstance(arg, ast.List | ast.Tuple) and len(arg.elts) > 1:
            if any(isinstance(e, ast.Constant) and isinstance(e.value, int) for e in arg.elts):
                return True
        if isinstance(arg, ast.BinOp):
            if any(isinstance(c, ast.Constant) and isinstance(c.value, int) for c in ast.walk(arg)):
                return True
    return False


def test_every_seed_comes_from_the_named_seed_stream():
    found = [
        _where(p, n)
        for p in SOURCES
        if p != ROOT / "fedasync" / "seeds.py"
        for fn in ("default_rng", "manual_seed", "SeedSequence")
        for n in _calls(p, fn)
        if _has_literal_salt(n)
    ]
    assert found == []


@pytest.mark.parametrize(
    ("definition", "home"),
    [("pick_device", "fedasync/devices.py"), ("load_structured", "runkit/configload.py")],
)
def test_one_device_picker_and_one_config_loader(definition, home):
    homes = [
        str(p.relative_to(ROOT))
        for p in SOURCES
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.FunctionDef) and n.name == definition
    ]
    assert homes == [home]
    merges = [_where(p, n) for p in SOURCES for n in _calls(p, "merge")]
    merges = [m for m in merges if "OmegaConf" in (ROOT / m.split(":")[0]).read_text()]
    assert all(m.startswith("runkit/configload.py") for m in merges), merges


def test_a_file_over_500_lines_says_at_its_top_why_it_is_one_thing():
    long = []
    for p in SOURCES:
        lines = p.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(p.read_text())) or ""
        if lines > 500 and "One file (" not in doc:
            long.append(f"{p.relative_to(ROOT)} ({lines} lines)")
    assert long == []
