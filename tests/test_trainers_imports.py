"""The trainers import the core (with its process utilities, ``fedasync/processes.py``: Ray's
temp folders and orphan sweep), torch, numpy, omegaconf, tqdm, matplotlib and Ray — never
``server/``, ``clients/`` or ``simulations/`` (what they need from those goes into the core)."""

from pathlib import Path

from test_core_imports import _imported_top_modules

import trainers

TRAINERS = Path(trainers.__file__).resolve().parent
FORBIDDEN = {"server", "clients", "simulations", "protocol", "medical_data", "flwr", "monai"}


def test_trainers_never_import_the_server_or_the_clients():
    files = sorted(TRAINERS.rglob("*.py"))
    assert len(files) >= 5

    bad = {
        str(f.relative_to(TRAINERS)): sorted(_imported_top_modules(f) & FORBIDDEN) for f in files
    }

    assert {f: m for f, m in bad.items() if m} == {}
