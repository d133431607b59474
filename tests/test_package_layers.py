"""Which package may import which: the wire protocol is shared, the server never imports the client.

- ``protocol/`` imports neither ``server/`` nor ``clients/`` (both import it).
- ``server/`` never imports ``clients/``: what the two sides share is the protocol; the task
  arithmetic both need (evaluation, subsets) is ``medical_data``'s.
- ``clients/`` never imports ``server/``.
- ``runkit/`` (the run kit) imports only the core: every run command stands on it.
- ``trainers/`` import the core and the run kit, never the federated packages.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):  # lazy imports inside functions count too
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("protocol", {"server", "clients", "simulations", "trainers"}),
        ("server", {"clients", "simulations", "trainers"}),
        ("clients", {"server", "simulations", "trainers"}),
        ("medical_data", {"server", "clients", "simulations", "trainers"}),
        ("runkit", {"protocol", "server", "clients", "medical_data", "simulations", "trainers"}),
        ("trainers", {"protocol", "server", "clients", "medical_data", "simulations"}),
    ],
)
def test_a_package_imports_only_the_layers_below_it(package, forbidden):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources in {package}/"

    offending = {
        str(f.relative_to(ROOT)): sorted(_imports(f) & forbidden)
        for f in files
        if _imports(f) & forbidden
    }

    assert offending == {}
