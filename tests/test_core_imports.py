"""The core imports only torch, numpy and the stdlib: never flwr, monai, grpc
(docs/architecture.md)."""

import ast
import subprocess
import sys
from pathlib import Path

import fedasync

CORE = Path(fedasync.__file__).resolve().parent
FORBIDDEN = ("flwr", "monai", "grpc")
ALLOWED = {"torch", "numpy", "fedasync"} | set(sys.stdlib_module_names)


def _imported_top_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_sources_import_only_torch_numpy_stdlib():
    # Prepare
    files = sorted(CORE.rglob("*.py"))
    assert files, "no sources found"

    # Execute
    offending = {
        str(f.relative_to(CORE)): sorted(_imported_top_modules(f) - ALLOWED) for f in files
    }

    # Assert
    assert {f: mods for f, mods in offending.items() if mods} == {}
    for f in files:
        assert not (_imported_top_modules(f) & set(FORBIDDEN)), f


def test_importing_core_loads_no_flwr_monai_grpc():
    # Prepare
    code = (
        "import sys, fedasync\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )

    # Execute
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )

    # Assert
    assert out.stdout.strip() == ""


def test_every_core_module_names_its_paper_or_says_none():
    for f in sorted(CORE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(f.read_text()))
        assert doc, f"{f.name} has no module docstring"
