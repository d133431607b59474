"""Certificates and keys for a deployment over TLS with SuperNode authentication.

``fedasync certs DIR --silos N [--host NAME ...]`` writes::

    DIR/ca.pem, ca.key          a certificate authority; SuperNodes and ``flwr`` trust ca.pem
    DIR/server.pem, server.key  the SuperLink's certificate, signed by the CA, for 127.0.0.1,
                                localhost and every ``--host`` (DNS names or IP addresses)
    DIR/silo-<i>/auth.key       silo i's SuperNode authentication key (EC P-384, OpenSSH
                                private key format: ``flower-supernode
                                --auth-supernode-private-key``)
    DIR/silo-<i>/auth.pub       its public key (OpenSSH format: ``flwr supernode register``)

Flower 1.42 uses TLS for encryption and server identity only (SuperNodes present no
certificate); a SuperNode proves who it is by signing each request with its authentication
key, and the SuperLink (``--enable-supernode-auth``) accepts only keys registered through its
Control API. Private keys are written 0600 and folders 0700; an existing DIR is refused
unless ``force``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("127.0.0.1", "localhost")
CURVE = ec.SECP384R1  # a NIST curve, as Flower's node authentication requires


@dataclass(frozen=True)
class CertPaths:
    """Where ``write_certs`` put each file of a certificate folder."""

    root: Path
    silos: int

    @property
    def ca_cert(self) -> Path:
        """``ca.pem``: the CA's certificate, which SuperNodes and ``flwr`` trust."""
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        """``ca.key``: the CA's private key (0600)."""
        return self.root / "ca.key"

    @property
    def server_cert(self) -> Path:
        """``server.pem``: the SuperLink's certificate, signed by the CA."""
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        """``server.key``: the SuperLink's private key (0600)."""
        return self.root / "server.key"

    def silo_dir(self, silo: int) -> Path:
        """``silo-<i>``: the folder of silo ``silo``'s keys (0700)."""
        return self.root / f"silo-{silo}"

    def node_key(self, silo: int) -> Path:
        """``silo-<i>/auth.key``: its SuperNode authentication key (OpenSSH private key, 0600)."""
        return self.silo_dir(silo) / "auth.key"

    def node_public_key(self, silo: int) -> Path:
        """``silo-<i>/auth.pub``: its public key, for ``flwr supernode register``."""
        return self.silo_dir(silo) / "auth.pub"

    def complete(self) -> bool:
        """Every file of the CA, the server and ``silos`` silos is present."""
        files = [self.ca_cert, self.ca_key, self.server_cert, self.server_key]
        for s in range(self.silos):
            files += [self.node_key(s), self.node_public_key(s)]
        return all(f.is_file() for f in files)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedasync"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def make_ca(days: int = 365) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA that may sign server certificates only (path length 0)."""
    key = ec.generate_private_key(CURVE())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("fedasync deployment CA"))
        .issuer_name(_name("fedasync deployment CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA384())
    )
    return key, cert


def parse_hosts(hosts: list[str]) -> list[x509.GeneralName]:
    """Subject alternative names: IP addresses as such, anything else as a DNS name."""
    names: list[x509.GeneralName] = []
    for h in dict.fromkeys([*DEFAULT_HOSTS, *hosts]):  # keep order, drop repeats
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


def names_hosts(cert_path: Path, hosts: list[str]) -> bool:
    """Whether the certificate at ``cert_path`` names every one of ``hosts`` (its subject
    alternative names); False when it cannot be read."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    return all(name in list(san) for name in parse_hosts(hosts))


def make_server_cert(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    hosts: list[str] | None = None,
    days: int = 365,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The SuperLink's TLS certificate for 127.0.0.1, localhost and ``hosts``."""
    key = ec.generate_private_key(CURVE())
    now = dt.datetime.now(dt.UTC)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("fedasync superlink"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(parse_hosts(list(hosts or []))), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA384())
    )
    return key, cert


def make_node_key() -> ec.EllipticCurvePrivateKey:
    """A SuperNode authentication key (EC P-384)."""
    return ec.generate_private_key(CURVE())


def pem_private(key: ec.EllipticCurvePrivateKey) -> bytes:
    """``key`` as unencrypted PKCS#8 PEM (the CA's and the server's key files)."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def openssh_private(key: ec.EllipticCurvePrivateKey) -> bytes:
    """``key`` as an unencrypted OpenSSH private key (a SuperNode's ``auth.key``)."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )


def openssh_public(key: ec.EllipticCurvePrivateKey, comment: str = "") -> bytes:
    """The public half of ``key`` as one OpenSSH line (``auth.pub``), ``comment`` appended."""
    line = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return line + (f" {comment}".encode() if comment else b"") + b"\n"


def write_file(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with ``mode`` from the first byte on (no window in which a
    private key is readable by others), atomically (temp file + rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # the umask may have removed bits
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def private_dir(path: Path) -> None:
    """Make ``path`` (and its parents) a folder only its owner may enter: 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def write_certs(
    root: Path, silos: int, hosts: list[str] | None = None, *, force: bool = False, days: int = 365
) -> CertPaths:
    """Create the CA, the SuperLink's certificate and ``silos`` node key pairs under ``root``.

    Refuses (FileExistsError) when ``root`` exists and is not empty, unless ``force``: then
    the files this function writes are replaced and other silos' folders removed.
    """
    if silos < 1:
        raise ValueError(f"--silos must be at least 1, not {silos}")
    root = Path(root)
    if root.exists() and any(root.iterdir()) and not force:
        raise FileExistsError(f"{root} exists and is not empty (use --force to overwrite it)")
    paths = CertPaths(root, silos)
    private_dir(root)
    if force:
        for old in root.glob("silo-*"):
            if old.is_dir():
                shutil.rmtree(old)
    ca_key, ca_cert = make_ca(days)
    srv_key, srv_cert = make_server_cert(ca_key, ca_cert, hosts, days)
    write_file(paths.ca_key, pem_private(ca_key), 0o600)
    write_file(paths.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    write_file(paths.server_key, pem_private(srv_key), 0o600)
    write_file(paths.server_cert, srv_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    for s in range(silos):
        private_dir(paths.silo_dir(s))
        key = make_node_key()
        write_file(paths.node_key(s), openssh_private(key), 0o600)
        write_file(paths.node_public_key(s), openssh_public(key, f"fedasync-silo-{s}"), 0o644)
    return paths


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``fedasync certs`` on the CLI's sub-command parser."""
    p = sub.add_parser(
        "certs", help="make a CA, the SuperLink's TLS certificate and SuperNode auth keys"
    )
    p.add_argument("dir", type=Path, help="folder to create (mode 0700)")
    p.add_argument("--silos", type=int, required=True, help="number of SuperNode key pairs")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="extra DNS name or IP address of the SuperLink (repeatable); "
        "127.0.0.1 and localhost are always included",
    )
    p.add_argument("--days", type=int, default=365, help="validity of the certificates")
    p.add_argument("--force", action="store_true", help="overwrite an existing folder")


def run(args: argparse.Namespace) -> int:
    """``fedasync certs``: write the folder and say what goes where."""
    try:
        paths = write_certs(args.dir, args.silos, args.host, force=args.force, days=args.days)
    except (FileExistsError, ValueError) as e:
        print(f"fedasync certs: {e}", file=sys.stderr)
        return 2
    print(f"wrote {paths.root}/:")
    print(f"  SuperLink:  --ssl-certfile {paths.server_cert} --ssl-keyfile {paths.server_key}")
    print(f"              --ssl-ca-certfile {paths.ca_cert} --enable-supernode-auth")
    print(f"  every silo: --root-certificates {paths.ca_cert}")
    print(f"  silo i:     --auth-supernode-private-key {paths.root}/silo-<i>/auth.key")
    print(f"  register:   flwr supernode register {paths.root}/silo-<i>/auth.pub <superlink>")
    print(f"  keep {paths.ca_key.name} and every *.key private (mode 0600)")
    return 0
