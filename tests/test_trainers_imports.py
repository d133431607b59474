"""The trainers import the core, torch, numpy, omegaconf, tqdm, matplotlib, Ray and the
process utilities of ``simulations/processes.py`` (Ray's temp folders and orphan sweep) — never
``server/`` or ``clients/`` (what they need from those goes into the core)."""

import ast
from pathlib import Path

import trainers

TRAINERS = Path(trainers.__file__).resolve().parent
FORBIDDEN = {"server", "clients", "medical_data", "flwr", "monai"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_trainers_never_import_the_server_or_the_clients():
    files = sorted(TRAINERS.rglob("*.py"))
    assert len(files) >= 5

    bad = {str(f.relative_to(TRAINERS)): sorted(_imports(f) & FORBIDDEN) for f in files}

    assert {f: m for f, m in bad.items() if m} == {}
