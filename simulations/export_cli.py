"""``fedasync export RUN_DIR --version N [--out DIR]``: a MONAI bundle of a version the run kept.

The run writes its final and best models as bundles itself (``<run>/bundle/final``,
``<run>/bundle/best``); this makes one of any other version it keeps (server/export.py:
the newest ``server.keep_models`` snapshots, the checkpoint's, the best evaluated one). A
version not kept is one line naming those that are, exit 2. docs/export.md says what a
bundle holds and how a hospital loads it with MONAI.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def _version(text: str) -> int:
    """A model version: a whole number >= 0 (argparse's error otherwise)."""
    if not text.isdigit() or len(text) > 18:
        raise argparse.ArgumentTypeError("a model version is a whole number >= 0")
    return int(text)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``fedasync export`` on the CLI's sub-command parser."""
    p = sub.add_parser("export", help="write a MONAI bundle of a version a run kept")
    p.add_argument("run_dir", type=Path, help="the run folder (<run.out_dir>/<run.name>)")
    p.add_argument("--version", type=_version, required=True, help="the global model version")
    p.add_argument(
        "--out", type=Path, default=None, help="bundle folder (default RUN_DIR/bundle/version-N)"
    )


def run(args: argparse.Namespace) -> int:
    """Write the bundle; say where, and which erasures it honours and does not."""
    from server.export import export

    folder, erasures = export(args.run_dir, args.version, args.out)  # UserError: exit 2
    print(f"wrote the MONAI bundle of version {args.version} to {folder}")
    honoured = [e["request"] for e in erasures["honoured"]]
    if honoured:
        print(f"it honours the erasure requests {', '.join(honoured)}")
    later = [e["request"] for e in erasures["applied_later"]]
    if later:
        print(
            f"warning: it predates the erasure requests {', '.join(later)} (applied at later "
            "versions): it still carries the data they erased"
        )
    return 0
