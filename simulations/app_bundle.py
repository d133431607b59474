"""The Flower App Bundle of a deployment: the project files ``flwr run`` ships to the
SuperLink (pyproject.toml and the packages the ServerApp and the ClientApp import), staged in
a folder of their own.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from simulations.flower_commands import DeployError


def project_root() -> Path:
    """The folder whose pyproject.toml declares the Flower app (``flwr run`` builds it)."""
    root = Path(__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or "[tool.flwr.app" not in pyproject.read_text():
        raise DeployError(f"{root} has no pyproject.toml with [tool.flwr.app]: install with -e")
    return root


APP_PACKAGES = ("fedasync", "protocol", "clients", "server", "medical_data")
"""What the ServerApp and the ClientApp import: the Flower App Bundle carries these."""


def stage_app(dest: Path, serverapp: str | None = None) -> Path:
    """Copy the Flower app (pyproject.toml and the Python files of ``APP_PACKAGES``) to ``dest``
    for ``flwr run`` to bundle: from the project folder it walks .venv too (about 9 s).
    ``serverapp`` (``module:attribute``) replaces the ServerApp component in the copy."""
    root = project_root()
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    pyproject = (root / "pyproject.toml").read_text()
    if serverapp is not None:
        pyproject, n = re.subn(
            r'(?m)^serverapp = ".*"$', f"serverapp = {json.dumps(serverapp)}", pyproject
        )
        if n != 1:
            raise DeployError("pyproject.toml names no [tool.flwr.app.components] serverapp")
    (dest / "pyproject.toml").write_text(pyproject)
    for pkg in APP_PACKAGES:
        for src in (root / pkg).rglob("*.py"):
            if "__pycache__" not in src.parts:
                out = dest / src.relative_to(root)
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, out)
    return dest
