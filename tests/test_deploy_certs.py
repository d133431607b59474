"""`fedasync certs`: the chain verifies for the SuperLink's names, private keys stay private,
an existing folder is not overwritten by accident, and Flower accepts the node keys."""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from cryptography.x509.verification import PolicyBuilder, Store

from simulations.certs import CertPaths, write_certs
from simulations.cli import main as cli_main


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> CertPaths:
    root = tmp_path_factory.mktemp("c") / "certs"
    return write_certs(root, 2, ["superlink.hospital.example", "10.1.2.3"])


def test_server_certificate_verifies_for_every_name(certs):
    # Prepare
    store = Store([_cert(certs.ca_cert)])
    leaf = _cert(certs.server_cert)
    names = [
        x509.DNSName("localhost"),
        x509.DNSName("superlink.hospital.example"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("10.1.2.3")),
    ]
    # Execute / Assert: the chain and each subject alternative name verify
    for name in names:
        verifier = PolicyBuilder().store(store).build_server_verifier(name)
        chain = verifier.verify(leaf, [])
        assert chain[-1] == _cert(certs.ca_cert)
    wrong = PolicyBuilder().store(store).build_server_verifier(x509.DNSName("elsewhere.example"))
    with pytest.raises(x509.verification.VerificationError):
        wrong.verify(leaf, [])


def test_sans_are_exactly_the_defaults_and_the_extra_hosts(certs):
    san = _cert(certs.server_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.value.get_values_for_type(x509.DNSName) == [
        "localhost",
        "superlink.hospital.example",
    ]
    assert [str(ip) for ip in san.value.get_values_for_type(x509.IPAddress)] == [
        "127.0.0.1",
        "10.1.2.3",
    ]


def test_tls_handshake_on_loopback_with_the_server_key(certs):
    # Prepare: a TLS server with server.pem/server.key; a client trusting only ca.pem
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certs.server_cert, certs.server_key)
    client_ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            tls.sendall(b"ok")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    # Execute
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            got = tls.recv(2)
    t.join(5)
    listener.close()
    # Assert
    assert got == b"ok"


def test_private_keys_are_0600_and_folders_0700_whatever_the_umask(tmp_path):
    old = os.umask(0)  # the most permissive umask must not leak into the files
    try:
        paths = write_certs(tmp_path / "certs", 2)
    finally:
        os.umask(old)
    for d in (paths.root, paths.silo_dir(0), paths.silo_dir(1)):
        assert _mode(d) == 0o700, d
    for key in (paths.ca_key, paths.server_key, paths.node_key(0), paths.node_key(1)):
        assert _mode(key) == 0o600, key
    for public in (paths.ca_cert, paths.server_cert, paths.node_public_key(0)):
        assert _mode(public) == 0o644, public


def test_refuses_to_overwrite_unless_forced(tmp_path, capsys):
    # Prepare
    root = tmp_path / "certs"
    assert cli_main(["certs", str(root), "--silos", "3"]) == 0
    first_ca = (root / "ca.pem").read_bytes()
    # Execute / Assert: refused, nothing changed
    assert cli_main(["certs", str(root), "--silos", "2"]) == 2
    assert "--force" in capsys.readouterr().err
    assert (root / "ca.pem").read_bytes() == first_ca
    with pytest.raises(FileExistsError):
        write_certs(root, 2)
    # Execute / Assert: forced, a new CA and only the silos asked for
    assert cli_main(["certs", str(root), "--silos", "2", "--force"]) == 0
    assert (root / "ca.pem").read_bytes() != first_ca
    assert sorted(p.name for p in root.glob("silo-*")) == ["silo-0", "silo-1"]
    assert CertPaths(root, 2).complete()


def test_node_keys_load_the_way_flower_loads_them(certs):
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import (
        bytes_to_public_key,
        sign_message,
        uses_nist_ec_curve,
        verify_signature,
    )

    for silo in range(2):
        # flower-supernode --auth-supernode-private-key: an OpenSSH EC private key
        private = load_ssh_private_key(certs.node_key(silo).read_bytes(), None)
        assert isinstance(private, ec.EllipticCurvePrivateKey)
        # flwr supernode register: an OpenSSH public key on a NIST curve
        registered = try_load_public_key(certs.node_public_key(silo))
        public = bytes_to_public_key(registered)
        assert uses_nist_ec_curve(public)
        # the SuperLink verifies what the SuperNode signs with the registered key
        signature = sign_message(private, b"2026-11-30T00:00:00+00:00")
        assert verify_signature(public, b"2026-11-30T00:00:00+00:00", signature)
    other = load_ssh_private_key(certs.node_key(1).read_bytes(), None)
    assert not verify_signature(
        bytes_to_public_key(try_load_public_key(certs.node_public_key(0))),
        b"x",
        sign_message(other, b"x"),  # type: ignore[arg-type]
    )


def test_a_resumed_deployment_on_other_addresses_gets_certificates_that_name_them(
    small_cfg, tmp_path
):
    from simulations.certs import names_hosts
    from simulations.deploy import prepare

    cfg = small_cfg("silos.count=2", f"run.out_dir={tmp_path}")
    _, _, first, _ = prepare(cfg, None, cert_hosts=["10.101.0.1"])
    assert names_hosts(first.server_cert, ["10.101.0.1"])
    assert not names_hosts(first.server_cert, ["10.102.0.1"])
    again = first.server_cert.read_bytes()
    _, _, same, _ = prepare(cfg, None, cert_hosts=["10.101.0.1"])  # same hosts: kept
    assert same.server_cert.read_bytes() == again
    _, _, moved, _ = prepare(cfg, None, cert_hosts=["10.102.0.1"])  # another federation
    assert names_hosts(moved.server_cert, ["10.102.0.1"])
    assert names_hosts(moved.server_cert, [])  # (the loopback names, always)
