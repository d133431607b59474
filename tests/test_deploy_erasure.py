"""The erasure service as a deployment serves it: TLS with the SuperLink's certificate, one
credential per silo (fast: no Flower processes; the loopback run is tests/test_deploy_faults.py).
"""

from __future__ import annotations

import stat

from server.erasure.auth import Authorizer
from server.erasure.catalog import StaticCatalog
from server.erasure.service import ErasureService, serve
from server.erasure.store import ErasureStore
from server.erasure_setup import service_tls
from simulations.certs import write_certs
from simulations.deploy import prepare_erasure
from simulations.erase_cli import main


def test_prepare_erasure_uses_the_superlink_certificate_and_per_silo_tokens(small_cfg, tmp_path):
    # Prepare
    paths = write_certs(tmp_path / "certs", 2)
    cfg = small_cfg("silos.count=2", "unlearning.service=true")
    folder = tmp_path / "erasure"
    # Execute
    cfg = prepare_erasure(cfg, folder, paths)
    first = {p.name: p.read_text() for p in folder.iterdir()}
    again = small_cfg("silos.count=2", "unlearning.service=true")
    again = prepare_erasure(again, folder, paths)  # a resumed run keeps the credentials
    # Assert
    u = cfg.unlearning
    assert (u.tls_certfile, u.tls_keyfile) == (str(paths.server_cert), str(paths.server_key))
    assert u.credentials == str(folder / "credentials.json") == again.unlearning.credentials
    assert sorted(first) == ["admin.token", "credentials.json", "silo-0.token", "silo-1.token"]
    assert {p.name: p.read_text() for p in folder.iterdir()} == first
    for p in folder.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_erasure_over_tls_with_another_silos_token_is_refused(small_cfg, tmp_path, capsys):
    # Prepare: the service as the ServerApp starts it in a deployment
    paths = write_certs(tmp_path / "certs", 2)
    cfg = small_cfg("silos.count=2", "unlearning.service=true")
    cfg = prepare_erasure(cfg, tmp_path / "erasure", paths)
    store = ErasureStore(tmp_path / "e.sqlite")
    catalog = StaticCatalog(samples={0: {"a", "b"}, 1: {"c"}})
    service = ErasureService(store, Authorizer.from_file(cfg.unlearning.credentials), catalog)
    server, port = serve(service, "127.0.0.1:0", server_credentials=service_tls(cfg))
    tls = ["--address", f"127.0.0.1:{port}", "--ca-cert", str(paths.ca_cert), "--timeout", "5"]
    token = {s: ["--token-file", str(tmp_path / "erasure" / f"silo-{s}.token")] for s in (0, 1)}
    try:
        # Execute / Assert: silo 1's credential may not erase silo 0's data
        assert main(["submit", "--silo", "0", "--samples", "a", *tls, *token[1]]) == 2
        assert "PERMISSION_DENIED" in capsys.readouterr().err
        assert store.list() == []
        # ...silo 0's may
        assert main(["submit", "--silo", "0", "--samples", "a", *tls, *token[0]]) == 0
        assert "queued" in capsys.readouterr().out
        # ...and nobody gets through without TLS
        plain = ["--address", f"127.0.0.1:{port}", "--timeout", "2", *token[0]]
        assert main(["list", *plain]) == 1
        assert [r.requester for r in store.list()] == ["silo-0"]
    finally:
        server.stop(0).wait()
        store.close()
