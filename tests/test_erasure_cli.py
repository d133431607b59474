"""``fedasync erase`` end to end against a running erasure service (plain and TLS)."""

from __future__ import annotations

import datetime as dt
import json
import stat
import threading
import time

import grpc
import pytest

from server.erasure.auth import Authorizer
from server.erasure.catalog import StaticCatalog
from server.erasure.service import ErasureService, serve
from server.erasure.states import State
from server.erasure.store import ErasureStore
from simulations.erase_cli import main


@pytest.fixture
def running(tmp_path, monkeypatch):
    """Credentials made by the CLI, and a server using them on a free port."""
    assert main(["credentials", str(tmp_path / "creds"), "--silos", "3"]) == 0
    tokens = json.loads((tmp_path / "creds" / "tokens.json").read_text())
    store = ErasureStore(tmp_path / "erasure.sqlite")
    catalog = StaticCatalog(samples={i: {f"s{i}-{j}" for j in range(5)} for i in range(3)})
    auth = Authorizer.from_file(tmp_path / "creds" / "credentials.json")
    server, port = serve(ErasureService(store, auth, catalog, poll_s=0.05), "127.0.0.1:0")
    monkeypatch.setenv("FEDASYNC_ERASURE_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.delenv("FEDASYNC_TOKEN", raising=False)
    try:
        yield store, tokens, port
    finally:
        server.stop(0).wait()
        store.close()


def test_credentials_files(tmp_path, capsys):
    assert main(["credentials", str(tmp_path / "c"), "--silos", "2"]) == 0
    out = capsys.readouterr().out
    assert "credentials.json" in out and "tokens.json" in out
    for name in ("credentials.json", "tokens.json"):
        assert stat.S_IMODE((tmp_path / "c" / name).stat().st_mode) == 0o600
    tokens = json.loads((tmp_path / "c" / "tokens.json").read_text())
    assert set(tokens) == {"admin", "silo-0", "silo-1"}


def test_submit_status_list_watch(running, capsys, tmp_path, monkeypatch):
    store, tokens, _ = running
    monkeypatch.setenv("FEDASYNC_TOKEN", tokens["silo-1"])
    # submit with --json, and a retried submit with the same --key gives the same id
    argv = ["submit", "--silo", "1", "--samples", "s1-0,s1-2", "--key", "k7", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert first["id"] == again["id"] and first["state"] == "QUEUED"
    assert first["sampleIds"] == ["s1-0", "s1-2"] and first["requester"] == "silo-1"
    assert len(store.list()) == 1
    rid = first["id"]

    # a whole-silo submit from a samples file of the admin (token from a file)
    (tmp_path / "ids.txt").write_text("s2-1\n\ns2-3\n")
    (tmp_path / "admin.tok").write_text(tokens["admin"] + "\n")
    admin = ["--token-file", str(tmp_path / "admin.tok")]
    assert main(["submit", "--silo", "2", "--samples-file", str(tmp_path / "ids.txt"), *admin]) == 0
    line = capsys.readouterr().out.strip()
    assert "silo 2  2 sample(s)  queued  by admin at v0" in line

    # status: one human line
    assert main(["status", rid]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(rid) and "queued" in out[0]

    # list: silo-1 sees its own only; the admin both, filtered by state
    assert main(["list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert main(["list", *admin]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert main(["list", "--state", "queued", "--silo", "2", *admin]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1

    # watch: follows the lifecycle driven by the "training server" and ends at verified
    def drive():
        for s in (State.ERASING, State.CALIBRATING, State.VERIFIED):
            time.sleep(0.05)
            store.transition(rid, s, actor="server", model_version=3, boundary_version=2)

    t = threading.Thread(target=drive)
    t.start()
    try:
        assert main(["watch", rid]) == 0
    finally:
        t.join()
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("-> ")[1].split()[0] for ln in lines] == [
        "queued",
        "erasing",
        "calibrating",
        "verified",
    ]
    assert main(["status", rid]) == 0
    assert "verified" in capsys.readouterr().out
    assert main(["watch", rid, "--json"]) == 0
    events = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [e["state"] for e in events][-1] == "VERIFIED"


def test_errors_and_exit_codes(running, capsys):
    _, tokens, _ = running
    whole = ["submit", "--whole-silo", "--silo"]
    assert main([*whole, "0"]) == 2  # no token
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main([*whole, "0", "--token", tokens["silo-1"]]) == 2
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    assert main([*whole, "9", "--token", tokens["admin"]]) == 1
    assert "NOT_FOUND: unknown silo 9" in capsys.readouterr().err
    assert main(["submit", "--silo", "0", "--samples", "nope", "--token", tokens["admin"]]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert main(["status", "0" * 32, "--token", tokens["admin"]]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert main([*whole, "0", "--token", tokens["admin"]]) == 0
    capsys.readouterr()
    assert main([*whole, "0", "--token", tokens["admin"]]) == 1
    assert "ALREADY_EXISTS" in capsys.readouterr().err


def test_unreachable_server(capsys):
    argv = ["status", "x", "--address", "127.0.0.1:1", "--token", "t", "--timeout", "2"]
    assert main(argv) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def _self_signed(tmp_path):
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "ca.pem").write_bytes(cert_pem)
    return key_pem, cert_pem


def test_tls(tmp_path, capsys):
    key_pem, cert_pem = _self_signed(tmp_path)
    tokens = {"admin": "secret-admin"}
    from server.erasure.auth import Principal

    auth = Authorizer.from_tokens([(tokens["admin"], Principal("admin", "admin"))])
    store = ErasureStore(tmp_path / "e.sqlite")
    service = ErasureService(store, auth, StaticCatalog(samples={0: {"a"}}))
    creds = grpc.ssl_server_credentials([(key_pem, cert_pem)])
    server, port = serve(service, "localhost:0", server_credentials=creds)
    try:
        common = ["--address", f"localhost:{port}", "--token", tokens["admin"]]
        tls = ["--tls-ca", str(tmp_path / "ca.pem")]
        assert main(["submit", "--whole-silo", "--silo", "0", *common, *tls]) == 0
        assert "queued" in capsys.readouterr().out
        # a plain-text client cannot talk to the TLS server
        assert main(["list", *common, "--timeout", "2"]) == 1
    finally:
        server.stop(0).wait()
        store.close()


def test_submit_needs_an_explicit_scope_and_refusals_are_listed(running, capsys):
    store, tokens, _ = running
    admin = ["--token", tokens["admin"]]
    # no scope: argparse refuses (exit 2) before any call; an empty --samples likewise
    with pytest.raises(SystemExit) as info:
        main(["submit", "--silo", "0", *admin])
    assert info.value.code == 2
    capsys.readouterr()
    assert main(["submit", "--silo", "0", "--samples", " , ", *admin]) == 2
    assert "--whole-silo" in capsys.readouterr().err
    assert store.list() == []
    # a refused call, then the admin's view of it (a silo may not look)
    assert main(["submit", "--whole-silo", "--silo", "0", "--token", tokens["silo-1"]]) == 2
    capsys.readouterr()
    assert main(["refusals", "--token", tokens["silo-1"]]) == 2
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    assert main(["refusals", "--json", *admin]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    counts = {
        (x["method"].rsplit("/")[-1], x["code"]): int(x["count"]) for x in lines if "count" in x
    }
    assert counts == {("Submit", "PERMISSION_DENIED"): 1, ("ListRefusals", "PERMISSION_DENIED"): 1}
    rows = [x for x in lines if "peer" in x]
    assert [(x["who"], x["method"]) for x in rows] == [
        ("silo-1", "/fedasync.erasure.v1.Erasure/ListRefusals"),
        ("silo-1", "/fedasync.erasure.v1.Erasure/Submit"),
    ]


def test_the_readmes_submit_with_a_tokens_file_and_whose_token_it_is(running, capsys, tmp_path):
    # Prepare: the tokens file as the CLI (and a run) writes it
    store, tokens, _ = running
    file = str(tmp_path / "creds" / "tokens.json")
    # Execute: the README's form (submit takes its --silo's entry), then --as admin
    as_silo = main(["submit", "--silo", "2", "--whole-silo", "--token-file", file])
    silo_line = capsys.readouterr().out
    as_admin = main(
        ["submit", "--silo", "1", "--whole-silo", "--token-file", file, "--as", "admin"]
    )
    admin_line = capsys.readouterr().out
    # Assert
    assert as_silo == 0 and "by silo-2" in silo_line
    assert as_admin == 0 and "by admin" in admin_line
    assert {r.requester for r in store.list()} == {"silo-2", "admin"}


@pytest.mark.parametrize(
    "content, argv, says",
    [
        (
            None,
            ["list"],
            "holds 4 tokens ('admin', 'silo-0', 'silo-1', 'silo-2'): say whose with --as",
        ),
        (None, ["list", "--as", "silo-9"], "has no token for 'silo-9'"),
        ("{not json", ["list"], "is not a tokens file"),
        ('{"admin": 7}', ["list"], "is not a tokens file"),
        ("two words\n", ["list"], "is not one (a token is one line of printable characters"),
        ("tok1\ntok2\n", ["list"], "is not one"),
        ("tok1\n", ["list", "--as", "admin"], "holds one token"),
        ("x" * 70000, ["list"], "holds over 65536 bytes"),
    ],
)
def test_a_wrong_token_file_is_one_line_without_the_secret(
    running, capsys, tmp_path, content, argv, says
):
    # Prepare
    _, tokens, _ = running
    path = tmp_path / "creds" / "tokens.json"
    if content is not None:
        path = tmp_path / "wrong.tok"
        path.write_text(content)
    # Execute
    rc = main([*argv, "--token-file", str(path)])
    err = capsys.readouterr().err
    # Assert: exit 2, one line naming the file, no token in it
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not any(t in err for t in tokens.values()) and "tok2" not in err
