"""The generated gRPC code in server/erasure/gen matches proto/ (regenerate: ``make proto``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GEN = ROOT / "server" / "erasure" / "gen"


def test_generated_code_matches_the_proto(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "server.erasure.gen_proto", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    fresh = sorted(p.name for p in tmp_path.iterdir())
    assert fresh == ["__init__.py", "erasure_pb2.py", "erasure_pb2.pyi", "erasure_pb2_grpc.py"]
    stale = [n for n in fresh if (tmp_path / n).read_bytes() != (GEN / n).read_bytes()]
    assert not stale, f"{stale} differ from proto/: run `make proto` and commit the result"


def test_generated_code_imports_from_this_package():
    from server.erasure.gen import erasure_pb2, erasure_pb2_grpc

    assert erasure_pb2.DESCRIPTOR.package == "fedasync.erasure.v1"
    assert erasure_pb2_grpc.ErasureStub.__module__ == "server.erasure.gen.erasure_pb2_grpc"
